"""The policy under test along sequences of steps on one workspace (``strategies.sequences``,
``dispatcher/model/sequences.py``).

An engine runs step after step between two allocations, and a policy can be wrong only after a
certain history (a runtime baked at an earlier step, a count kept from the last one): every
step of a sequence goes through the same policy object, in order, and must hold every property
the single-step tests check; a failure shrinks to the shortest such history (the whole
sequence is the falsifying example, the note names the step). Between two consecutive A2A
rounds the cross-round hazard of the session's FlashInfer generation is counted: a hazard of
FlashInfer 0.7.2's layout, shown in the statistics, never a failure of the policy
(docs/flashinfer.md).
"""
from hypothesis import event, given

from dispatcher.model import properties
from dispatcher.model.sequences import check_sequence
from strategies.sequences import step_sequences


@given(seq=step_sequences())
def test_every_step_of_a_sequence_holds_every_property(seq, policy, policy_spec):
    hazards = check_sequence(policy, seq, policy_spec,
                             engine_worlds=lambda w: properties.world_for(policy, w, keep_cap=True))
    for risk in hazards:
        if risk is not None:
            event(f"cross-round on FlashInfer {seq[0].flashinfer}: "
                  f"{'rows at risk' if any(risk) else 'no row at risk'}")
