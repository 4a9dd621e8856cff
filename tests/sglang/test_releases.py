"""SGLang's own ``FlashinferDispatcher``, unmodified, from every distinct release 0.5.10-0.5.23
(files fetched from PyPI with ``pip download --no-deps``, verified and cached in ``.sglang/``).

The EXPECTED tables are the verdict tables of docs/sglang.md, measured with
``python -m dispatcher.commands.verdicts``; these tests re-measure every cell on every run, so
a change in the stand-ins or the world model that would change a verdict is caught, and each
bug class is pinned with the shrunk counterexample of the first release that shipped it.
"""
import pytest

from .. import needs_torch

NEEDS_TORCH = needs_torch(reason="SGLang's dispatcher needs torch: pip install torch==2.13.0 "
                    "(the CPU build) or pip install -e '.[sglang]'")
from dispatcher import cross_round_verdicts as cross_round  # noqa: E402
from dispatcher.model import properties  # noqa: E402
from dispatcher.model.generations import PINNED_RELEASES_GENERATION  # noqa: E402
from dispatcher.model.properties import COLUMNS, breaks  # noqa: E402
from dispatcher.model.sglang_context import SGLangContext  # noqa: E402
from dispatcher.model.world import MoeConfig, World  # noqa: E402
from dispatcher.sglang.bug_classes import BUG_CLASSES, HAZARDS, check_step  # noqa: E402
from dispatcher.sglang.loader import load_release  # noqa: E402
from dispatcher.sglang.verdicts import RELEASES  # noqa: E402
from dispatcher.sizing import NotApplicable  # noqa: E402
from dispatcher.releases.wheels import ReleaseError  # noqa: E402
from strategies import worlds  # noqa: E402
from strategies.search import first_in, minimal, visited  # noqa: E402

pytestmark = [NEEDS_TORCH, pytest.mark.engine_releases("sglang")]

# release -> the bug classes it ships (docs/sglang.md, first table)
EXPECTED_CLASSES = {
    "0.5.10": {"sp-prescatter", "constructed-cap", "collapsed-dp-global", "cuda-graph-buckets",
               "padding-slots", "extend-over-cap"},
    "0.5.12": {"sp-prescatter", "constructed-cap", "collapsed-dp-global", "cuda-graph-buckets",
               "extend-over-cap"},
    "0.5.13": {"collapsed-dp-global", "cuda-graph-buckets", "extend-over-cap"},
    "0.5.14": {"extend-over-cap"},
    "0.5.15": {"cuda-graph-buckets", "all-idle", "extend-over-cap"},
    "0.5.16": {"extend-over-cap"},
    "0.5.17": {"extend-over-cap"},
    "0.5.18": {"extend-over-cap"},
    "0.5.19": set(),
    "0.5.20": set(),
    "0.5.22": set(),
    "0.5.23": set(),
}
# release -> the classes no server config it accepts reaches (its own server-arg checks:
# FlashInfer's A2A needs DP attention with dp_size == tp_size from 0.5.13 on, and 0.5.23 lets
# SP back in only as Muse Spark's layernorm-SP at TP4/EP4 and TP8/EP8)
EXPECTED_UNREACHABLE = {v: {"sp-prescatter"} for v in ("0.5.13", "0.5.14", "0.5.15", "0.5.16",
                                                       "0.5.17", "0.5.18", "0.5.19", "0.5.20",
                                                       "0.5.22")}
# release -> the hazards it is exposed to (the hardening columns: never a failing test):
# every release sizes the runtime per forward from the DP counts, so on FlashInfer 0.7.2 the
# layout grows whenever the batch does (cross-round; no release runs on 0.7.4)
EXPECTED_HAZARDS = {v: {"stale-draft", cross_round.COLUMN} for v in EXPECTED_CLASSES}
# release -> the properties its eager-decode runtime breaks (docs/sglang.md, second table)
EXPECTED_PROPERTIES = {
    "0.5.10": {"within-cap", "tight"},  # "no crash" only on an empty dp_global: no SGLang step
    "0.5.12": {"within-cap", "tight"},
    "0.5.14": set(),
    "0.5.16": set(),
    "0.5.23": set(),
}
CLASS_EXAMPLES = 150  # per cell: a failing cell is found within a few dozen steps
# The cells that read one recorded search run on one xdist worker (--dist=loadgroup), which
# records it once; spread over the workers, each worker would generate the same search again.
ONE_SEARCH_PER_CLASS = [pytest.param(key, marks=pytest.mark.xdist_group(f"sglang-steps-{key}"))
                        for key in BUG_CLASSES]



@pytest.fixture(scope="session")
def releases(pinned_releases):
    """Each pinned release, loaded when a test first reads it (a missing one fails its tests)."""
    return pinned_releases("sglang:{}")


def _shipped(version):
    return EXPECTED_CLASSES[version] | EXPECTED_HAZARDS[version]


def test_the_tables_cover_every_release_and_class():
    assert set(EXPECTED_CLASSES) == set(RELEASES) == set(EXPECTED_HAZARDS)
    assert all(set(h) <= set(HAZARDS) | {cross_round.COLUMN} for h in EXPECTED_HAZARDS.values())
    assert not any(set(c) & set(HAZARDS) for c in EXPECTED_CLASSES.values())
    for key, version in ((k, c.first_seen[0]) for k, c in BUG_CLASSES.items()):
        assert key in _shipped(version)
        earlier = RELEASES[:RELEASES.index(version)]
        assert not any(key in _shipped(v) for v in earlier), f"{key} seen before {version}"


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("key", ONE_SEARCH_PER_CLASS)
def test_release_ships_exactly_its_bug_classes(releases, version, key):
    """Every cell of the class table. A shipped class must be found (not shrunk here: the
    pinned test below reads the shrunk example), a fixed one must not."""
    release = releases[version]
    steps = visited(BUG_CLASSES[key].steps(), CLASS_EXAMPLES)  # one search, every release's cell
    accepted = [st for st in steps if BUG_CLASSES[key].applies(*st) and release.refusal(*st) is None]
    if key in EXPECTED_UNREACHABLE.get(version, ()):
        assert not accepted, f"{version} is expected to refuse every {key} step, yet it accepts " \
                             f"{accepted[0]!r}"
        return
    assert accepted, f"no step of {len(steps)} in the {key} regime is a config {version} accepts"
    hit = first_in(steps, lambda step: check_step(release, key, *step) is not None)
    if key in _shipped(version):
        assert hit is not None, f"{version} ships {key} but no step of {len(steps)} shows it"
    else:
        assert hit is None, f"{version} is not expected to ship {key}, yet: " \
                            f"{check_step(release, key, *hit)}"


@pytest.mark.xdist_group("sglang-cross-round")  # one recorded search of sequences
@pytest.mark.parametrize("version", RELEASES)
def test_release_cross_round_hazard(releases, version):
    """Every cell of the cross-round column: the release's own runtimes along sequences of one
    model's steps on one workspace let FlashInfer 0.7.2's layout grow over the previous
    round's combine input (found among the sequences the table's search visits first)."""
    hit = cross_round.first_exposed(
        releases[version], visited(cross_round.one_format(PINNED_RELEASES_GENERATION),
                                   CLASS_EXAMPLES))
    assert (hit is not None) == (cross_round.COLUMN in EXPECTED_HAZARDS[version]), hit


@pytest.mark.parametrize("key", list(BUG_CLASSES))
def test_each_class_is_pinned_on_the_first_release_that_shipped_it(releases, key):
    """The shrunk counterexample of the first release with the class, as it reads; the
    newest release passes the same step unless it still ships the class."""
    version, world, ctx = BUG_CLASSES[key].first_seen
    problem = check_step(releases[version], key, world, ctx)
    assert problem is not None and BUG_CLASSES[key].words in problem, problem
    assert "what SGLang" in problem and "replay: python -m dispatcher --policy" in problem
    if key not in _shipped(RELEASES[-1]):
        assert check_step(releases[RELEASES[-1]], key, world, ctx) is None


def test_cuda_graph_bucket_regression_and_fix(releases):
    """SGLang #29461 (0.5.15) sized capture by x.shape[0], so ranks replaying different
    buckets pass different runtimes (#30242); 0.5.14 used the static cap there, and the
    fix (#30450, 0.5.16) makes require_mlp_tp_gather() True for FlashInfer A2A, so every
    rank picks its bucket from the cross-rank max."""
    _, world, ctx = BUG_CLASSES["cuda-graph-buckets"].first_seen
    verdicts = {v: check_step(releases[v], "cuda-graph-buckets", world, ctx)
                for v in ("0.5.14", "0.5.15", "0.5.16")}
    assert verdicts["0.5.14"] is None and verdicts["0.5.16"] is None
    assert "replaying buckets [2, 1]" in verdicts["0.5.15"]
    assert releases["0.5.15"].replay_world(world, ctx).group_tokens == (2, 1)
    assert releases["0.5.16"].replay_world(world, ctx).group_tokens == (2, 2)


@pytest.mark.xdist_group("sglang-property-table")  # one search of worlds() for every cell
@pytest.mark.parametrize("version", list(EXPECTED_PROPERTIES))
@pytest.mark.parametrize("column", COLUMNS)
def test_release_property_verdict(releases, version, column):
    """Every cell of the property table (eager decode). A broken property must be found in
    1,500 worlds (not shrunk here: the shrunk examples are the table's, and the pinned tests
    below read them), a held one must survive 300."""
    def broken(world):  # breaks(release, column)(world), each world's release run shared by columns
        key = (version, world)
        if key not in _BROKEN:
            _BROKEN[key] = properties.broken_columns(releases[version], world)
        return column in _BROKEN[key]
    if column in EXPECTED_PROPERTIES[version]:
        assert first_in(visited(worlds(), 1500), broken) is not None, \
            f"{version} breaks {column} but no world of 1500 shows it"
    else:
        hit = first_in(visited(worlds(), 300), broken)
        assert hit is None, f"{version} is not expected to break {column}, yet it does on {hit!r}"


_BROKEN: dict = {}


def test_pre_25685_release_fails_with_a_shrunk_sp_counterexample(releases):
    """The famous bug, through SGLang 0.5.10's own code: SP scatter without DP attention,
    the pre-scatter count passed as the runtime."""
    release = releases["0.5.10"]
    world = minimal(worlds(), lambda w: not w.dp_attention and breaks(release, "tight")(w), 300)
    assert world.attn_tp_size == world.ep_size == 2 and world.dp_global == (2,)
    assert properties.rule_values(release, world) == [2, 2] and world.ideal_runtime == 1


def test_newest_release_sizes_the_famous_world_right(releases):
    world = World(ep_size=4, dp_size=1, group_tokens=(9,), max_num_tokens=8)
    assert properties.rule_values(releases["0.5.23"], world) == [3] * 4
    assert properties.rule_values(releases["0.5.10"], world) == [12] * 4


def test_extend_batches_are_modelled_per_release(releases):
    """0.5.19+ route extend (prefill) around the A2A unless SP prefill has its own A2A;
    0.5.10 has no such path and sizes the A2A for it like decode."""
    world = World(ep_size=4, dp_size=4, group_tokens=(6, 2, 2, 2), max_num_tokens=64)
    new = releases["0.5.23"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    old = releases["0.5.10"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    assert new.routed_around and old.runtime == 6


def test_cuda_graph_capture_and_speculative(releases):
    world = World(ep_size=4, dp_size=1, group_tokens=(8,), max_num_tokens=64,
                  dp_global_kind="none", moe=MoeConfig(payload="nvfp4"))
    for ctx in (SGLangContext(forward_mode="capture"), SGLangContext(speculative=True)):
        assert releases["0.5.23"].outcome(world, 1, ctx).runtime == 2


def test_what_sglang_constructs_is_recorded_not_overwritten(releases):
    """#25907: 0.5.10 multiplies the per-rank cap by ep_size when it constructs MoeAlltoAll;
    the recorder keeps what it built, and the property sees it."""
    world = World(ep_size=4, dp_size=4, group_tokens=(1, 1, 1, 1), max_num_tokens=16)
    old = releases["0.5.10"].outcome(world, 0).launch
    new = releases["0.5.23"].outcome(world, 0).launch
    assert (old.max_num_tokens, new.max_num_tokens) == (64, 16)
    assert new.workspace_size_per_rank == world.workspace_size
    assert old.invalid_token_expert_id is None and new.invalid_token_expert_id == 64


def test_sglang_assertion_in_an_over_cap_world_is_the_right_answer(releases):
    world = World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=4)
    with pytest.raises(properties.RefusedCorrectly, match="SGLANG_FLASHINFER_NUM_MAX_DISPATCH"):
        properties.rule_values(releases["0.5.23"], world)


def test_an_unknown_name_imports_and_its_use_is_refused_by_name(tmp_path):
    """A name of SGLang's own modules that the stand-ins lack imports, as it would in SGLang (a
    next release may import what it never calls on this path); using it stops by name."""
    f = tmp_path / "flashinfer.py"
    f.write_text("from sglang.srt.layers.dp_attention import get_brand_new_thing\n"
                 "from sglang.srt.brand_new_module import other\n\n"
                 "class FlashinferDispatcher:\n    pass\n")
    assert load_release(f).path == f
    f.write_text(f.read_text() + "\nget_brand_new_thing()\n")
    with pytest.raises(ReleaseError, match=r"used sglang\.srt\.layers\.dp_attention\."
                                           r"get_brand_new_thing, which the gate neither runs"):
        load_release(f)


def test_an_empty_dp_global_is_no_sglang_step(releases):
    """No SGLang path publishes ``[]`` (every list has one entry per DP group of the gather;
    None where nothing was gathered): a world recording one is refused as no step of the
    release, and its nearest SGLang world records None. (0.5.23's prefill all-gather raised on
    ``[]`` where decode handled it; with no producer that is no bug of the release.)"""
    world = World(ep_size=1, dp_size=1, group_tokens=(1,), max_num_tokens=1, dp_global_kind="empty")
    with pytest.raises(NotApplicable, match="never publishes an empty dp_global"):
        releases["0.5.23"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    assert releases["0.5.23"].engine_world(world).dp_global is None


