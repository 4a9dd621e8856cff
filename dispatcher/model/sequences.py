"""A sequence of steps on one workspace through one policy object, in order.

``check_sequence`` runs every step through the policy (an engine keeps its dispatcher
instances across steps, a rule object its state), holds each step to every property of the
single-step tests, and returns the cross-round hazard between consecutive A2A rounds
(``cross_round.rows_at_risk`` on the session's FlashInfer generation): a hazard of the layout,
never a violation of the policy.
"""
from __future__ import annotations

import shlex
from typing import Optional, Sequence, Tuple

from ..sizing import NotApplicable
from . import properties
from .cross_round import rows_at_risk
from .generations import replay_flag
from .world import World

__all__ = ["check_sequence", "exposes_cross_round", "runtimes_along"]


def _round(world: World, runtime: int, sized_for):
    """The layout and the rows each rank sends one peer (at most the runtime), or None where
    the round cannot run (past the cap: both generations' Python wrappers assert it)."""
    if runtime > world.max_num_tokens:
        return None
    try:
        layout = world.layout(runtime, sized_for)
    except ValueError:
        return None
    return layout, tuple(min(rows, runtime) for rows in world.rows_per_rank)


def check_sequence(policy, seq: Sequence[World], name: str = "the rule",
                   engine_worlds=None, hold: bool = True) -> Tuple[Optional[Tuple[int, ...]], ...]:
    """Every step of ``seq`` through ``policy`` in order; ``PropertyViolation`` (with the step
    named) on the first step that breaks a property. Returns, per pair of consecutive steps,
    the rows at risk of the cross-round hazard (None where either step runs no A2A round).
    ``engine_worlds``: maps a step to the world the engine runs (``properties.world_for``).
    ``hold=False``: only the hazard; a step is not held to the properties, and one whose
    runtime no rank-invariant round can use (a crash, ranks that disagree) runs no round."""
    if not seq:
        return ()
    if len({(w.ep_size, w.max_num_tokens, w.moe.hidden_size, w.moe.top_k, w.moe.num_experts)
            for w in seq}) > 1:
        raise ValueError("the steps of a sequence run on one workspace: they share ep_size, "
                         "max_num_tokens and the MoE layer's shape")
    hazards, prev = [], None
    # one workspace for the whole sequence, allocated for the widest row its layers carry
    widest = max((w.moe.payloads for w in seq), key=lambda ps: sum(p.bytes_per_token for p in ps))
    for n, world in enumerate(seq, 1):
        try:
            if engine_worlds is not None:
                world = engine_worlds(world)
            values = properties.rule_values(policy, world, name)
        except NotApplicable:  # a step this engine never runs: the history goes on
            this = None
        except properties.PropertyViolation:
            if hold:
                raise
            this = None
        else:
            if not hold:
                same = len(set(values)) == 1 and type(values[0]) is int and values[0] >= 1
                this = _round(world, values[0], widest) if same else None
                if n > 1:
                    hazards.append(None if prev is None or this is None
                                   else rows_at_risk(prev[0], this[0], prev[1], this[1]))
                prev = this
                continue
            try:
                properties.check_all(world, values, name)
            except properties.PropertyViolation as exc:
                exc.add_note(f"at step {n} of {len(seq)} on one workspace")
                exc.add_note(f"replay the sequence: python -m dispatcher{replay_flag()} "
                             f"--policy {shlex.quote(name)} \"{tuple(seq)!r}\"")
                raise
            this = _round(world, values[0], widest)
        if n > 1:
            hazards.append(None if prev is None or this is None
                           else rows_at_risk(prev[0], this[0], prev[1], this[1]))
        prev = this
    return tuple(hazards)


def exposes_cross_round(policy, seq: Sequence[World], engine_worlds=None) -> bool:
    """Whether ``policy``'s runtimes along ``seq`` put some combine row at risk between two
    consecutive rounds it runs, on the session's generation (whatever else the policy gets
    right or wrong on those steps: the bug classes and properties are other columns)."""
    hazards = check_sequence(policy, seq, engine_worlds=engine_worlds, hold=False)
    return any(risk is not None and any(risk) for risk in hazards)


def runtimes_along(policy, seq: Sequence[World], engine_worlds=None) -> Tuple[Optional[int], ...]:
    """The runtime ``policy`` passes at each step (None where the step runs no round)."""
    out = []
    for world in seq:
        try:
            if engine_worlds is not None:
                world = engine_worlds(world)
            out.append(properties.rule_values(policy, world)[0])
        except NotApplicable:
            out.append(None)
    return tuple(out)
