"""The strategies are tested too: every regime of docs/model.md is actually generated,
worlds are frozen, picklable and replayable from their repr, and failures shrink small."""
import dataclasses
import pickle

import pytest
from hypothesis import given, settings

from dispatcher.model.parse import parse_context, parse_world
from dispatcher.model.world import MoeConfig
from strategies import a2a_worlds, moe_configs, regimes, sglang_steps, worlds
from strategies.search import assert_all_examples, find_any, minimal
from dispatcher.sglang.bug_classes import BUG_CLASSES

BUG_CLASS_KEYS = list(BUG_CLASSES)

REGIMES = ["dp_global=recorded", "dp_global=none", "dp_global=empty", "dp_attention",
           "no_dp_attention", "sp_scatter", "dp_attention_with_attn_tp", "max_len_padding",
           "all_zero", "some_zero_groups", "skewed_rows", "scatter_padding", "one_row",
           "payload_at_cap", "payload_cap_plus_1", "payload_over_cap", "pre_scatter_over_cap",
           "ep=1", "ep=64"]
MOE_REGIMES = ["experts_not_divisible", "payload=bf16", "payload=nvfp4", "payload=mxfp8",
               "routing=uniform", "routing=hot_rank"]


@pytest.mark.parametrize("label", REGIMES)
def test_worlds_reach(label):
    find_any(worlds(), lambda w: label in regimes(w))


@pytest.mark.parametrize("label", MOE_REGIMES)
def test_a2a_worlds_reach(label):
    find_any(a2a_worlds(), lambda w: label in regimes(w))


@pytest.mark.parametrize("what, condition", [
    ("odd ep_size", lambda w: w.ep_size % 2 == 1 and w.ep_size > 1),
    ("dp_size >= 16", lambda w: w.dp_size >= 16),
    ("4096+ rows on a rank", lambda w: w.max_rows >= 4096),
])
def test_large_and_odd_topologies_reached(what, condition):
    find_any(worlds(), condition)


def test_shrinks_to_a_small_simple_world():
    """The smallest SP world where the pre-scatter count overflows a cap the payload fits."""
    w = minimal(worlds(), lambda w: "pre_scatter_over_cap" in regimes(w), max_examples=3000)
    assert (w.ep_size, w.dp_size, w.group_tokens, w.max_num_tokens) == (2, 1, (1,), 1)
    assert w.moe == MoeConfig() and not w.max_len_padding


@settings(max_examples=50)
@given(world=worlds(moe=moe_configs))
def test_worlds_are_frozen_picklable_and_replayable(world):
    assert pickle.loads(pickle.dumps(world)) == world
    assert parse_world(repr(world)) == world
    with pytest.raises(dataclasses.FrozenInstanceError):
        world.ep_size = 3  # type: ignore[misc]
    assert len(world.views) == world.ep_size


@settings(max_examples=200)
@given(world=worlds())
def test_worlds_follow_the_scheduler_model(world):
    """Each DP group's rows are its padded count split evenly over attn_tp; dp_global holds
    the padded counts; unrecorded dp_global only when all groups run the same batch."""
    tp = world.attn_tp_size
    for r, rows in enumerate(world.rows_per_rank):
        assert rows * tp == world.padded_group_tokens[r // tp]
    if world.dp_global is not None and len(world.dp_global):
        assert len(world.dp_global) == world.dp_size
        assert all(d % tp == 0 for d in world.dp_global)
    else:
        assert len(set(world.rows_per_rank)) == 1


@pytest.mark.parametrize("regime", BUG_CLASS_KEYS)
def test_every_step_of_a_regime_is_in_its_class(regime):
    """A bug class's strategy draws only steps its class applies to (nothing wasted)."""
    bug = BUG_CLASSES[regime]
    assert_all_examples(bug.steps(), lambda step: bug.applies(*step), 150)


@pytest.mark.parametrize("label, condition", [
    ("every forward mode", None),
    ("all-idle under a skipped all-gather", lambda w, c: max(w.group_tokens) == 0),
    ("a draft forward", lambda w, c: c.draft_forward),
    ("a derived cap", lambda w, c: not c.cap_from_env and w.max_num_tokens >= 4096),
    ("a collapsing config under DP attention",
     lambda w, c: w.dp_attention and c.moe_dense_tp_size == 1 and c.enable_dp_lm_head),
    ("SP prefill over its own A2A", lambda w, c: c.sp_prefill_a2a and c.forward_mode == "extend"
     and not w.dp_attention and w.attn_tp_size > 1),
])
def test_any_sglang_step_reaches(label, condition):
    from dispatcher.model.sglang_context import FORWARD_MODES

    if condition is None:
        for mode in FORWARD_MODES:
            find_any(sglang_steps(), lambda step, mode=mode: step[1].forward_mode == mode)
        return
    find_any(sglang_steps(), lambda step: condition(*step))


@settings(max_examples=200)
@given(step=sglang_steps())
def test_sglang_steps_are_producible(step):
    """Capture runs one batch size; skipping the all-gather needs equal batches; a derived
    cap is max(chunked_prefill_size, 4096); nothing idle runs without the skip."""
    world, ctx = step
    if ctx.forward_mode == "capture" or ctx.skip_all_gather:
        assert len(set(world.group_tokens)) == 1
    if not ctx.cap_from_env:
        assert world.max_num_tokens == ctx.expected_cap_when_derived
    if max(world.group_tokens) == 0:
        assert ctx.skip_all_gather and world.dp_attention
    assert parse_context(repr(ctx)) == ctx


def test_a_recorded_search_is_the_search_each_cell_would_run():
    """The verdict tests check every release on one recorded search (``visited``): it must
    visit what ``find_any`` / ``assert_no_examples`` visit, so a cell's answer is unchanged."""
    from hypothesis import find, settings
    from hypothesis.errors import NoSuchExample

    from strategies.search import SEARCH, _NO_SHRINK, first_in, visited

    def search(cond):  # find_any's search, answering None where it would fail
        try:
            return find(worlds(), cond, settings=settings(SEARCH, max_examples=200, phases=_NO_SHRINK))
        except NoSuchExample:
            return None

    recorded = visited(worlds(), 200)
    assert len(recorded) == 200 and visited(worlds(), 200) is recorded
    conditions = (lambda w: w.ep_size == 3 and w.dp_attention, lambda w: w.max_len_padding,
                  lambda w: not w.payload_fits_cap, lambda w: w.ep_size > 64)
    answers = [search(cond) for cond in conditions]
    assert [first_in(recorded, c) for c in conditions] == answers
    assert answers[1] is not None and answers[-1] is None  # both kinds of cell are compared
    again = []

    def other_condition(w):  # never true, and reads the example differently
        again.append(w)
        return w.ep_size < 0
    assert search(other_condition) is None and tuple(again) == recorded
