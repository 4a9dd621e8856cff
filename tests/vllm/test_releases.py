"""vLLM's own FlashInfer NVLink prepare() from the pinned releases 0.18.0-0.34.0 (files fetched
from PyPI with ``pip download --no-deps``, verified and cached in ``.vllm/``), each on the
FlashInfer generation whose API it calls (``fetch.JUDGED_ON``: 0.34.0 on 0.7.4).

EXPECTED is the vLLM verdict table of docs/vllm.md, measured with
``python -m dispatcher.commands.verdicts --engine vllm``; every cell is re-measured here on
every run, and the one failure vLLM's history has in this gate (prepare() raising under
prefill context parallelism with DP = 1, until 0.32.0) is pinned with its shrunk world.
"""
import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="vLLM's prepare() needs torch: pip install torch==2.13.0 "
                    "(the CPU build) or pip install -e '.[sglang]'")
from dispatcher import cross_round_verdicts as cross_round  # noqa: E402
from dispatcher.engines import ENGINES  # noqa: E402
from dispatcher.model.generations import using  # noqa: E402
from dispatcher.model.world import World  # noqa: E402
from dispatcher.vllm.verdicts import (RELEASES, TWO_SIDED_REGIMES, TWO_SIDED_SPECS,  # noqa: E402
                                      broken_columns)
from strategies import vllm_worlds  # noqa: E402
from strategies.search import first_in, visited  # noqa: E402
from strategies.vllm import VLLM_REGIMES  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("vllm")]

# release -> the regimes where its one-sided prepare() breaks a property (docs/vllm.md)
EXPECTED = {
    "0.18.0": {"any", "pcp"}, "0.20.0": {"any", "pcp"}, "0.24.0": {"any", "pcp"},
    "0.28.0": {"any", "pcp"}, "0.32.0": set(), "0.33.0": set(), "0.34.0": set(),
}
# release -> its cross-round cell (docs/vllm.md): every release sizes the runtime per forward
# from the DP chunk sizes, so FlashInfer 0.7.2's layout grows with the batch
# (0.34.0 on 0.7.4, whose layout closes it)
EXPECTED_CROSS_ROUND = {v: "closed" if v == "0.34.0" else "exposed" for v in EXPECTED}
TWO_SIDED = TWO_SIDED_SPECS  # the two-sided files measured (docs/vllm.md)
EXAMPLES = 150
# The cells that read one regime's recorded search run on one xdist worker (--dist=loadgroup),
# which records it once.
ONE_SEARCH_PER_REGIME = [pytest.param(r, marks=pytest.mark.xdist_group(f"vllm-worlds-{r}"))
                         for r in VLLM_REGIMES]
PCP_WORLD = World(ep_size=2, dp_size=1, group_tokens=(1,), max_num_tokens=2)


@pytest.fixture(scope="session")
def releases(pinned_releases):
    """Each pinned release, loaded when a test first reads it (a missing one fails its tests)."""
    return pinned_releases("vllm:{}"), pinned_releases("vllm:{}@two-sided")


def its_generation(version: str) -> str:
    """The FlashInfer generation release ``version`` is judged on (the one whose API it calls)."""
    return ENGINES["vllm"].judged_on(version)


def test_the_table_covers_every_release():
    assert set(EXPECTED) == set(RELEASES) == set(EXPECTED_CROSS_ROUND)


@pytest.mark.xdist_group("vllm-cross-round")  # one recorded search of sequences
@pytest.mark.parametrize("version", RELEASES)
def test_release_cross_round_hazard(releases, version):
    """Every one-sided cell of the cross-round column (the two-sided backend's kernels are
    not this A2A: "n/a")."""
    hit = cross_round.first_exposed(releases[0][version], visited(
        cross_round.one_format(ENGINES["vllm"].judged_on(version)), EXAMPLES))
    assert (hit is not None) == (EXPECTED_CROSS_ROUND[version] == "exposed"), hit


def _broken(release):
    return lambda w: bool(broken_columns(release, w))


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("regime", ONE_SEARCH_PER_REGIME)
def test_one_sided_release_fails_exactly_its_regimes(releases, version, regime):
    hit = first_in(visited(vllm_worlds(regime, its_generation(version)), EXAMPLES),
                   _broken(releases[0][version]))
    if regime in EXPECTED[version]:
        assert hit is not None, f"{version} fails in {regime}, but no world of {EXAMPLES} shows it"
    else:
        assert hit is None, f"{version} breaks {broken_columns(releases[0][version], hit)} on {hit!r}"


@pytest.mark.parametrize("version", TWO_SIDED)
@pytest.mark.parametrize("regime", [p for p in ONE_SEARCH_PER_REGIME
                                    if p.values[0] in TWO_SIDED_REGIMES])
def test_two_sided_release_holds_every_property(releases, version, regime):
    hit = first_in(visited(vllm_worlds(regime, its_generation(version)), EXAMPLES),
                   _broken(releases[1][version]))
    assert hit is None, f"{version}@two-sided breaks something on {hit!r}"


def test_pcp_without_dp_metadata_crashes_until_0_32(releases):
    """vLLM runs the one-sided A2A under prefill context parallelism with DP = 1
    (``use_all2all_kernels``: ``pcp_size > 1``) but makes DP metadata only for DP > 1, so
    prepare()'s ``get_local_sizes()`` met ``None``: AttributeError in 0.18, an assert from
    0.20; 0.32.0 falls back to ``a1.shape[0]`` ("PCP with DP=1")."""
    for version, release in releases[0].items():
        world = PCP_WORLD.on(its_generation(version))
        outs = release.step(world)
        if version in ("0.32.0", "0.33.0", "0.34.0"):
            assert [o.runtime for o in outs] == [1, 1], outs
            assert all(o.seen_local_sizes == "not read" for o in outs)
        else:
            assert all(o.error and o.error.startswith(("AttributeError", "AssertionError"))
                       for o in outs), outs
            assert broken_columns(release, world) == ("no crash",)


def test_sequence_parallel_sizes_come_from_the_release_and_are_post_split(releases):
    """DP 2 x TP 2: each TP rank holds ceil(n / 2) rows; vLLM's own _compute_sp_num_tokens
    gives the per-rank sizes, and the runtime is their max (not max(num_tokens_across_dp),
    the analogue of SGLang #25685)."""
    world = World(ep_size=4, dp_size=2, group_tokens=(5, 9), max_num_tokens=16)
    for version, release in releases[0].items():
        outs = release.step(world.on(its_generation(version)))
        assert [o.seen_local_sizes for o in outs] == [[3, 3, 5, 5]] * 4
        assert [o.runtime for o in outs] == [5] * 4


@pytest.mark.parametrize("name, side", [("flashinfer_nvlink_one_sided.py", ""),
                                        ("flashinfer_nvlink_two_sided.py", "@two-sided")])
def test_a_lone_copy_of_either_backends_file_is_its_release(tmp_path, name, side):
    """A user's copy of the newest release's one- or two-sided file, alone in a folder: it
    loads as that release's file (identical bytes: the release's code beside it) and holds
    every property on a step. The two-sided file was refused as lacking itself "beside" it."""
    import shutil

    from dispatcher.model.properties import check_all, rule_values
    from dispatcher.policies import load_policy
    from dispatcher.vllm import fetch
    from dispatcher.vllm.loader import tree_of

    newest = RELEASES[-1]
    cached = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release(newest))
    source = next(cached.rglob(name))
    shutil.copy(source, tmp_path / name)
    spec = f"vllm:{tmp_path / name}{side}"
    generation = its_generation(newest)
    with using(generation):  # the generation the load probe executes the file against
        release = load_policy(spec)[1]
    assert tree_of(tmp_path / name).origin.startswith(f"identical to vLLM {newest}'s")
    world = World(ep_size=4, dp_size=4, group_tokens=(1, 2, 3, 4), max_num_tokens=8,
                  flashinfer=generation)
    check_all(world, rule_values(release, world, spec), spec)
