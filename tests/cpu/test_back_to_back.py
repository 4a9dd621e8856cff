"""Two A2A rounds back to back on one workspace in the exact emulator
(``emulator.a2a.back_to_back``), in the order FlashInfer's protocol allows that is worst for one
rank: every peer finishes round n's combine and pushes round n+1's dispatch rows before that
rank reads its round-n combine input.

The emulator moves the bytes by the kernels' own addressing (routing, send indices, each
target's planes), not by ``model/cross_round.py``: the rows the late rank reads after a peer
wrote over them are exactly the rows ``rows_at_risk`` counts for it, its round-n output is
wrong only then, round n+1 is always right, and on FlashInfer 0.7.4 nothing is ever
overwritten (docs/flashinfer.md, "Two rounds on one workspace")."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from dispatcher.emulator.rounds import back_to_back, expected_recv_counts
from dispatcher.emulator.inputs import make_inputs
from dispatcher.model.cross_round import rows_at_risk
from dispatcher.model.generations import generation_of
from dispatcher.model.world import MoeConfig, World
from strategies.sequences import step_sequences

SMALL = dict(ep_sizes=(2, 3, 4), max_steps=2, max_tokens=24, hidden_sizes=(128,))
STEP = World(ep_size=2, dp_size=2, group_tokens=(4, 4), max_num_tokens=16,
             moe=MoeConfig(hidden_size=128, top_k=2, num_experts=4))


def _runtime(world: World) -> int:
    return max(1, world.ideal_runtime)


def _counted_at_risk(first: World, second: World, run, late: int) -> int:
    """``rows_at_risk`` for ``late`` summed over every target, with the rows each rank really
    sent that target in each round."""
    sent = expected_recv_counts(first, make_inputs(first))  # [target, source]
    sent_next = expected_recv_counts(second, make_inputs(second))
    (r0, r1) = run.rounds
    return sum(rows_at_risk(r0.layouts[t], r1.layouts[t], sent[t], sent_next[t])[late]
               for t in range(first.ep_size))


@given(seq=step_sequences(**SMALL), version=st.sampled_from(["0.7.2", "0.7.4"]),
       data=st.data())
def test_the_late_rank_reads_exactly_the_rows_the_model_puts_at_risk(seq, version, data):
    first, second = seq
    assume(first.payload_fits_cap and second.payload_fits_cap)  # a round past the cap crashes
    if data.draw(st.booleans(), label="grow"):  # half the pairs: the smaller round first
        first, second = sorted(seq, key=lambda w: (w.ideal_runtime, w.moe.dispatch_bytes))
    # rank 0's combine rows lie first in every peer's combine region: the first a grown
    # plane reaches, so it is late in half the pairs
    late = data.draw(st.just(0) | st.integers(0, first.ep_size - 1), label="late")
    gen = generation_of(version)
    assume(all(w.moe.top_k in gen.supported_top_k for w in (first, second)))
    first, second = first.on(gen), second.on(gen)
    run = back_to_back(first, second, [_runtime(first)] * first.ep_size,
                       [_runtime(second)] * first.ep_size, late)
    at_risk = _counted_at_risk(first, second, run, late)
    event(f"{version}: {'rows overwritten' if run.overwritten else 'nothing overwritten'}")
    assert run.overwritten == at_risk
    assert run.second_exact, "round n+1 is wrong: the race hits only round n's combine"
    assert set(run.first_mismatched()) <= {late}, "a rank that read before any write is wrong"
    if version == "0.7.4":
        assert run.overwritten == 0 and not run.first_mismatched()
    elif not run.overwritten:
        assert not run.first_mismatched()


@pytest.mark.parametrize("version, nxt, wrong", [
    ("0.7.2", replace(STEP, group_tokens=(8, 8)), True),  # the layout grows: rank 0 is hit
    ("0.7.2", replace(STEP, moe=replace(STEP.moe, payload="bf16")), False),  # constant
    ("0.7.2", replace(STEP, group_tokens=(2, 2)), False),  # shrinking
    ("0.7.4", replace(STEP, group_tokens=(8, 8)), False),  # closed by layout
], ids=["grows-072", "constant-072", "shrinks-072", "grows-074"])
def test_a_growing_layout_corrupts_the_late_ranks_output(version, nxt, wrong):
    run = back_to_back(STEP.on(version), nxt.on(version), [4, 4], [_runtime(nxt)] * 2, late=0)
    assert (run.first_mismatched() == [0]) is wrong
    assert (run.overwritten > 0) is wrong and run.second_exact
    if wrong:  # not noise: whole rows of the combine sum differ
        bad = ~np.all(run.first[0] == run.first_reference[0], axis=1)
        assert bad.sum() >= 1


def test_a_bf16_layer_after_an_nvfp4_one_at_a_constant_runtime():
    bf16 = STEP.on("0.7.2")
    nvfp4 = replace(bf16, moe=replace(STEP.moe, payload="nvfp4"))
    assert back_to_back(nvfp4, bf16, [4, 4], [4, 4], late=1).first_mismatched() == [1]
    assert not back_to_back(bf16, nvfp4, [4, 4], [4, 4], late=1).first_mismatched()
    assert not back_to_back(nvfp4.on("0.7.4"), STEP.on("0.7.4"), [4, 4], [4, 4],
                            late=1).first_mismatched()


def test_rounds_of_different_workspaces_are_refused():
    with pytest.raises(ValueError, match="share ep_size"):
        back_to_back(STEP, replace(STEP, max_num_tokens=32), [4, 4], [4, 4])
