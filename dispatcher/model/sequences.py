"""A sequence of steps on one workspace through one policy object, in order.

``check_sequence`` runs every step through the policy (an engine keeps its dispatcher
instances across steps, a rule object its state), holds each step to every property of the
single-step tests, and returns the cross-round hazard between consecutive A2A rounds
(``cross_round.rows_at_risk`` on the session's FlashInfer generation): a hazard of the layout,
never a violation of the policy.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ..sizing import NotApplicable
from . import properties
from .cross_round import rows_at_risk
from .world import World

__all__ = ["check_sequence"]


def _round(world: World, runtime: int, sized_for):
    """The layout and the rows each rank sends one peer (at most the runtime), or None where
    the round cannot run."""
    try:
        layout = world.layout(runtime, sized_for)
    except ValueError:
        return None
    return layout, tuple(min(rows, runtime) for rows in world.rows_per_rank)


def check_sequence(policy, seq: Sequence[World], name: str = "the rule",
                   engine_worlds=None) -> Tuple[Optional[Tuple[int, ...]], ...]:
    """Every step of ``seq`` through ``policy`` in order; ``PropertyViolation`` (with the step
    named) on the first step that breaks a property. Returns, per pair of consecutive steps,
    the rows at risk of the cross-round hazard (None where either step runs no A2A round).
    ``engine_worlds``: maps a step to the world the engine runs (``properties.world_for``)."""
    hazards, prev = [], None
    # one workspace for the whole sequence, allocated for the widest row its layers carry
    widest = max((w.moe.payloads for w in seq), key=lambda ps: sum(p.bytes_per_token for p in ps))
    for n, world in enumerate(seq, 1):
        if engine_worlds is not None:
            world = engine_worlds(world)
        try:
            values = properties.rule_values(policy, world, name)
        except NotApplicable:  # a step this engine never runs: the history goes on
            this = None
        else:
            try:
                properties.check_all(world, values, name)
            except properties.PropertyViolation as exc:
                exc.add_note(f"at step {n} of {len(seq)} on one workspace")
                raise
            this = _round(world, values[0], widest)
        if n > 1:
            hazards.append(None if prev is None or this is None
                           else rows_at_risk(prev[0], this[0], prev[1], this[1]))
        prev = this
    return tuple(hazards)
