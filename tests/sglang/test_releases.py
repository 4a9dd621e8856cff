"""SGLang's own ``FlashinferDispatcher.dispatch()``, unmodified, from pinned releases (files
fetched from PyPI with ``pip download --no-deps``, verified and cached in ``.sglang/``).

EXPECTED is the verdict table of docs/sglang.md, measured with
``python -m dispatcher.sglang_verdicts``; these tests re-measure it on every run, so a change
in the adapter or in the world model that would change a verdict is caught. Run the whole
CPU tier against any checkout with ``pytest -n auto --policy=sglang:PATH``.
"""
import pytest

pytest.importorskip("torch", reason="SGLang's dispatcher needs torch: pip install torch==2.13.0 "
                    "(the CPU build) or pip install -e '.[sglang]'")
from hypothesis import event, given, reject, settings  # noqa: E402

from dispatcher.model import properties  # noqa: E402
from dispatcher.model.properties import COLUMNS, breaks  # noqa: E402
from dispatcher.model.sglang_context import SGLangContext  # noqa: E402
from dispatcher.model.world import MoeConfig, World  # noqa: E402
from dispatcher.policies import PolicyError, load_policy  # noqa: E402
from dispatcher.sglang.loader import load_release  # noqa: E402
from strategies import sglang_contexts, worlds  # noqa: E402
from strategies.search import minimal  # noqa: E402

# release -> the properties it breaks (decode mode). 0.5.10 is before SGLang PR #25685.
EXPECTED = {
    "0.5.10": {"within-cap", "tight", "no crash"},
    "0.5.14": {"fits", "within-cap", "tight"},
    "0.5.16": {"within-cap", "tight"},
    "0.5.23": set(),
}


@pytest.fixture(scope="session")
def releases():
    try:
        return {v: load_policy(f"sglang:{v}")[1] for v in EXPECTED}
    except PolicyError as exc:
        pytest.skip(f"SGLang releases unavailable: {exc}")


@pytest.mark.parametrize("version", list(EXPECTED))
@pytest.mark.parametrize("column", COLUMNS)
def test_release_verdict(releases, version, column):
    release = releases[version]
    broken = column in EXPECTED[version]
    world = minimal(worlds(), breaks(release, column), 1500 if broken else 300)
    if broken:
        assert world is not None, f"{version} no longer breaks {column}: update the table"
        assert world.ep_size <= 4, f"shrank only to {world!r}"
    else:
        assert world is None, f"{version} breaks {column}: {world!r}"


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
    """Newer releases route extend (prefill) around the A2A; 0.5.10 has no such path and
    sizes the A2A for it like decode. Neither is skipped."""
    world = World(ep_size=4, dp_size=2, group_tokens=(6, 2), max_num_tokens=64)
    new = releases["0.5.23"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    old = releases["0.5.10"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    assert new.routed_around and old.runtime == 6


def test_cuda_graph_capture_and_speculative(releases):
    world = World(ep_size=4, dp_size=1, group_tokens=(8,), max_num_tokens=64,
                  dp_global_kind="none", moe=MoeConfig(payload="nvfp4"))
    for ctx in (SGLangContext(forward_mode="capture"), SGLangContext(speculative=True)):
        assert releases["0.5.23"].outcome(world, 1, ctx).runtime == 2


def test_sglang_assertion_in_an_over_cap_world_is_the_right_answer(releases):
    world = World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=4)
    with pytest.raises(properties.RefusedCorrectly, match="SGLANG_FLASHINFER_NUM_MAX_DISPATCH"):
        properties.rule_values(releases["0.5.23"], world)


def test_unknown_import_fails_by_name(tmp_path):
    f = tmp_path / "flashinfer.py"
    f.write_text("from sglang.srt.layers.dp_attention import get_brand_new_thing\n")
    with pytest.raises(ImportError, match="get_brand_new_thing"):
        load_release(f)


@settings(max_examples=150)
@given(world=worlds(max_ep=16), ctx=sglang_contexts())
def test_newest_release_in_every_forward_mode(releases, world, ctx):
    """SGLang 0.5.23 over (world, context): every rank takes the same path (all launch the
    A2A or all route around it), and a launched runtime has every property."""
    release = releases["0.5.23"]
    if max(world.group_tokens) == 0:
        reject()  # SGLang runs no forward when every DP group is idle
    if world.dp_global == () and ctx.forward_mode in ("extend", "mixed"):
        reject()  # measured separately: test_newest_release_prefill_rejects_an_empty_dp_global
    outs = [release.outcome(world, r, ctx) for r in range(world.ep_size)]
    assert len({o.routed_around for o in outs}) == 1, (ctx, world, outs)
    event(f"{ctx.forward_mode}: {'routed around' if outs[0].routed_around else 'A2A'}")
    if outs[0].routed_around:
        return
    errors = [o.error for o in outs if o.error]
    if errors:
        assert not world.payload_fits_cap, f"SGLang raised in a valid world: {errors[0]}\n{world!r} {ctx}"
        return
    properties.check_all(world, [o.runtime for o in outs], f"sglang:0.5.23 {ctx}")


def test_newest_release_prefill_rejects_an_empty_dp_global(releases):
    """Found by the test above: 0.5.23's prefill all-gather treats ``dp_global == []`` as a
    list of no sources (an empty list must be handled like None) and raises, where decode
    handles it. Pinned as measured, so a fix upstream shows up here."""
    world = World(ep_size=1, dp_size=1, group_tokens=(1,), max_num_tokens=1, dp_global_kind="empty")
    extend = releases["0.5.23"].outcome(world, 0, SGLangContext(forward_mode="extend"))
    decode = releases["0.5.23"].outcome(world, 0, SGLangContext(forward_mode="decode"))
    assert extend.error and "len(source_sizes)=0" in extend.error
    assert decode.runtime == 1
