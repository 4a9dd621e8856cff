"""The policy's runtime through the exact CPU model of FlashInfer's A2A.

The round trip (dispatch -> stand-in MoE -> combine) runs with the values the rule returns on
each rank, *without* the dispatcher's validation, so an undersized or rank-variant rule shows
the damage FlashInfer would do (the model names each row that left its slot), not only a
refused launch.
"""
import numpy as np
import pytest
from hypothesis import assume, event, given, strategies as st

from dispatcher.emulator.a2a import POISON, A2AModel, RankRefused

from dispatcher.emulator.rounds import round_trip
from dispatcher.emulator.inputs import make_inputs
from dispatcher.model import properties
from dispatcher.model.generations import GENERATIONS, generation_of
from dispatcher.model.validation import A2ASizingError, CapExceeded, NonPositiveRuntime
from dispatcher.model.world import MoeConfig, World
from strategies import a2a_worlds

BOTH = pytest.mark.parametrize("version", list(GENERATIONS))


def kernel_checks(values, world):
    """The only checks FlashInfer itself makes on the value (C++ > 0, Python <= cap)."""
    for v in values:
        if not v >= 1:
            raise NonPositiveRuntime(f"FlashInfer rejects runtime {v} (values {values})")
        if v > world.max_num_tokens:
            raise CapExceeded(f"FlashInfer's assert: runtime {v} > cap {world.max_num_tokens}")


def describe_failure(world, values, rt, name):
    events = "\n  ".join(str(e) for e in rt.events[:5]) or "(none)"
    return (f"emulated A2A round trip is wrong on ranks {rt.mismatched_ranks()}; recv counts "
            f"{'ok' if np.array_equal(rt.recv_counts, rt.expected_counts) else 'WRONG'}; "
            f"received rows {'ok' if rt.received_ok else 'CORRUPTED'}\n"
            f"rows that left their slot ({len(rt.events)}):\n  {events}\n"
            + properties.explain(world, values, name))


@given(world=a2a_worlds())
def test_round_trip_is_exact_with_the_policy_runtime(world, policy, policy_spec):
    world = properties.world_for(policy, world)  # an engine's own world (vLLM)
    values = properties.values_or_reject(policy, world, policy_spec)
    kernel_checks(values, world)
    rt = round_trip(world, values)
    event(f"ep={world.ep_size} payload={world.moe.payload}")
    assert rt.exact, describe_failure(world, values, rt, policy_spec)


@BOTH
@given(world=a2a_worlds(), short=st.integers(1, 4))
def test_model_names_every_overflow_of_an_undersized_runtime(version, world, short):
    """Runtime below the payload. 0.7.2: whenever some rank sends more rows to one target than
    the runtime, the model reports exactly those rows, and never on a correct runtime. 0.7.4:
    the op refuses every rank whose own rows exceed the runtime (its peers wait on it), and a
    runtime every rank fits is exact."""
    gen = generation_of(version)
    assume(world.moe.top_k in gen.supported_top_k)
    world = world.on(gen)
    runtime = max(1, world.ideal_runtime - short)
    inputs = make_inputs(world)
    if gen.checks_local_rows:
        over = [r for r, n in enumerate(world.rows_per_rank) if n > runtime]
        if over:
            with pytest.raises(RankRefused) as refused:
                round_trip(world, [runtime] * world.ep_size, inputs)
            assert list(refused.value.refused) == over
            assert set(refused.value.waiting) == set(range(world.ep_size)) - set(over)
            event("0.7.4 refused")
            return
    rt = round_trip(world, [runtime] * world.ep_size, inputs)
    worst = int(rt.expected_counts.max()) if rt.expected_counts.size else 0
    overflowing = int(np.clip(rt.expected_counts - runtime, 0, None).sum())
    n_payloads = len(world.moe.payloads)
    dispatch_events = [e for e in rt.events if e.phase == "dispatch"]
    assert len(dispatch_events) == overflowing * n_payloads
    assert all(e.send_index >= runtime for e in rt.events)
    if worst > runtime:
        event("overflow")
        assert not rt.exact


def test_famous_undersize_gives_wrong_results_silently_on_072():
    """DESIGN.md 3: runtime 4 with 9 local rows returns wrong combine output, no error."""
    world = World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=16,
                  moe=MoeConfig(hidden_size=64, top_k=8, num_experts=8, routing="hot_rank"))
    rt = round_trip(world.on("0.7.2"), [4, 4])
    assert rt.mismatched_ranks() and rt.events and not rt.received_ok
    with pytest.raises(RankRefused, match="Local token count exceeds"):
        round_trip(world.on("0.7.4"), [4, 4])  # 0.7.4 refuses it on both ranks: loud, not silent


def test_074_refuses_the_short_rank_and_names_the_waiting_peers():
    world = World(ep_size=4, dp_size=4, group_tokens=(5, 3, 3, 3), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=32, top_k=4, num_experts=8))
    with pytest.raises(RankRefused) as refused:
        round_trip(world.on("0.7.4"), [4, 4, 4, 4])  # rank 0 has 5 rows
    assert refused.value.refused == (0,) and refused.value.waiting == (1, 2, 3)
    assert "Ranks [1, 2, 3] launched and wait" in str(refused.value)
    # 0.7.2 takes it and writes past rank 0's slots
    assert not round_trip(world.on("0.7.2"), [4, 4, 4, 4]).exact


@BOTH
def test_rank_disagreement_misplaces_rows(version):
    """Every rank fits its own value but they disagree: silent on both generations."""
    world = World(ep_size=4, dp_size=4, group_tokens=(3, 3, 3, 3), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=32, top_k=4, num_experts=8))
    rt = round_trip(world.on(version), [3, 3, 4, 4])
    assert rt.events and not rt.exact
    assert any(e.sender_runtime != e.receiver_runtime for e in rt.events)


@BOTH
@given(world=a2a_worlds())
def test_stale_rows_past_each_senders_count_hold_poison(version, world):
    gen = generation_of(version)
    assume(world.moe.top_k in gen.supported_top_k)
    moe = world.moe
    model = A2AModel(world.ep_size, world.max_num_tokens, moe.payloads, moe.combine_bytes, gen)
    views, counts = model.dispatch([world.ideal_runtime] * world.ep_size, make_inputs(world))
    for t, planes in enumerate(views):
        assert (model.recv_counters_read(t) == counts[t]).all()  # the round's bank
        for s in range(world.ep_size):
            for plane in planes:
                assert (plane[s, counts[t, s]:] == POISON).all()


@given(world=a2a_worlds(), rounds=st.integers(2, 4))
def test_074_counters_alternate_banks_by_round(world, rounds):
    """0.7.4 writes round n's receive counts to bank n % 2 and marks the other bank -1, so
    reading one fixed bank is right only every other round."""
    assume(world.moe.top_k in GENERATIONS["0.7.4"].supported_top_k)
    moe, R = world.moe, world.ideal_runtime
    model = A2AModel(world.ep_size, world.max_num_tokens, moe.payloads, moe.combine_bytes,
                     GENERATIONS["0.7.4"])
    inputs = make_inputs(world)
    for n in range(rounds):
        _, counts = model.dispatch([R] * world.ep_size, inputs)
        assert model.bank == n % 2
        for t in range(world.ep_size):
            assert (model.recv_counters_read(t, n % 2) == counts[t]).all()
            assert (model.recv_counters_read(t, 1 - n % 2) == -1).all()
        outs = [np.zeros((world.ep_size, R, moe.hidden_size), np.uint16)] * world.ep_size
        model.combine([R] * world.ep_size, outs, world.rows_per_rank)


def test_kernel_checks_match_flashinfer():
    world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=4)
    with pytest.raises(A2ASizingError):
        kernel_checks([0, 0], world)
    with pytest.raises(A2ASizingError):
        kernel_checks([5, 5], world)
