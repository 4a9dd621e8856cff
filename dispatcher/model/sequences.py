"""A sequence of steps on one workspace through one policy object, in order.

``check_sequence`` runs every step through the policy (an engine keeps its dispatcher
instances across steps, a rule object its state), holds each step to every property of the
single-step tests, and returns the cross-round hazard between consecutive A2A rounds
(``cross_round.rows_at_risk`` on the session's FlashInfer generation): a hazard of the layout,
never a violation of the policy.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..sizing import NotApplicable
from . import properties
from .cross_round import rows_at_risk
from .generations import replay_flag
from .world import World

__all__ = ["check_sequence", "round_pairs", "RoundPair", "exposes_cross_round"]


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


@dataclass(frozen=True)
class RoundPair:
    """Two consecutive A2A rounds on the workspace (steps between them that ran none skipped):
    the steps they ran at (0-based), their runtimes and the rows at risk per reader rank."""

    before: int
    after: int
    runtimes: Tuple[int, int]
    risk: Tuple[int, ...]


def _pairs(policy, seq: Sequence[World], name: str, engine_worlds, hold: bool) -> List[RoundPair]:
    """Every step of ``seq`` through ``policy`` in order (held to every property unless
    ``hold`` is False), and each pair of consecutive rounds it ran."""
    if not seq:
        return []
    if len({(w.ep_size, w.max_num_tokens, w.moe.hidden_size, w.moe.top_k, w.moe.num_experts)
            for w in seq}) > 1:
        raise ValueError("the steps of a sequence run on one workspace: they share ep_size, "
                         "max_num_tokens and the MoE layer's shape")
    pairs, last = [], None  # last: (step, runtime, layout, rows) of the latest round
    # one workspace for the whole sequence, allocated for the widest row its layers carry
    widest = max((w.moe.payloads for w in seq), key=lambda ps: sum(p.bytes_per_token for p in ps))
    for n, world in enumerate(seq):
        try:
            if engine_worlds is not None:
                world = engine_worlds(world)
            values = properties.rule_values(policy, world, name)
        except NotApplicable:  # a step this engine never runs: the history goes on
            continue
        except properties.PropertyViolation:
            if hold:
                raise
            continue  # a crash runs no round
        if hold:
            try:
                properties.check_all(world, values, name)
            except properties.PropertyViolation as exc:
                exc.add_note(f"at step {n + 1} of {len(seq)} on one workspace")
                exc.add_note(f"replay the sequence: python -m dispatcher{replay_flag()} "
                             f"--policy {shlex.quote(name)} \"{tuple(seq)!r}\"")
                raise
        elif not (len(set(values)) == 1 and type(values[0]) is int and values[0] >= 1):
            continue  # ranks that disagree run no round any layout describes
        this = _round(world, values[0], widest)
        if this is None:
            continue
        if last is not None:
            pairs.append(RoundPair(last[0], n, (last[1], values[0]),
                                   rows_at_risk(last[2], this[0], last[3], this[1])))
        last = (n, values[0], *this)
    return pairs


def check_sequence(policy, seq: Sequence[World], name: str = "the rule",
                   engine_worlds=None) -> Tuple[Optional[Tuple[int, ...]], ...]:
    """Every step of ``seq`` through ``policy`` in order; ``PropertyViolation`` (with the step
    named and the sequence's replay line) on the first step that breaks a property. Returns,
    for every step after the first, the rows at risk per reader rank between the last round
    before it and its own (None where it runs no round, or none ran before it).
    ``engine_worlds``: maps a step to the world the engine runs (``properties.world_for``)."""
    hazards: List[Optional[Tuple[int, ...]]] = [None] * max(0, len(seq) - 1)
    for pair in _pairs(policy, seq, name, engine_worlds, hold=True):
        hazards[pair.after - 1] = pair.risk
    return tuple(hazards)


def round_pairs(policy, seq: Sequence[World], engine_worlds=None) -> List[RoundPair]:
    """The consecutive rounds ``policy`` runs along ``seq`` on the session's generation and
    the rows each puts at risk, whatever else the policy gets right or wrong on those steps
    (the bug classes and properties are other checks): a step that crashes, or whose ranks
    disagree, runs no round."""
    return _pairs(policy, seq, "the policy", engine_worlds, hold=False)


def exposes_cross_round(policy, seq: Sequence[World], engine_worlds=None) -> bool:
    """Whether ``policy``'s runtimes along ``seq`` put some combine row at risk between two
    consecutive rounds it runs."""
    return any(any(p.risk) for p in round_pairs(policy, seq, engine_worlds))
