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

__all__ = ["check_sequence", "checked_rounds", "Rounds", "round_pairs", "RoundPair",
           "exposes_cross_round"]


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


@dataclass(frozen=True)
class Rounds:
    """The A2A rounds a policy ran along a sequence, in order: a step the engine never runs
    (``NotApplicable``: SGLang's scheduler runs no forward when every DP group is idle) or
    that runs no round is no round, in every tier alike. ``worlds[i]`` is the world the engine
    ran (its ``engine_worlds`` map applied), ``values[i]`` its runtime on every rank,
    ``steps[i]`` the 0-based step of the sequence, and ``pairs`` each two consecutive rounds
    with the rows the later one puts at risk."""

    worlds: Tuple[World, ...]
    values: Tuple[properties.RuleValues, ...]
    steps: Tuple[int, ...]
    pairs: Tuple[RoundPair, ...]

    def at_risk(self, i: int) -> bool:
        """Whether round ``i``'s combine rows are at risk from round ``i + 1``'s writes."""
        return i + 1 < len(self.steps) and any(
            any(p.risk) for p in self.pairs if p.before == self.steps[i])


def _rounds(policy, seq: Sequence[World], name: str, engine_worlds, hold: bool) -> Rounds:
    """Every step of ``seq`` through ``policy`` in order (held to every property unless
    ``hold`` is False), and the rounds it ran."""
    if not seq:
        return Rounds((), (), (), ())
    if len({(w.ep_size, w.max_num_tokens, w.moe.hidden_size, w.moe.top_k, w.moe.num_experts)
            for w in seq}) > 1:
        raise ValueError("the steps of a sequence run on one workspace: they share ep_size, "
                         "max_num_tokens and the MoE layer's shape")
    pairs, last = [], None  # last: (step, runtime, layout, rows) of the latest round
    ran: List[tuple] = []
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
                exc.add_note(f"replay the sequence: python -m dispatcher{replay_flag(world.flashinfer)} "
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
        ran.append((world, values, n))
    return Rounds(tuple(w for w, _, _ in ran), tuple(v for _, v, _ in ran),
                  tuple(n for _, _, n in ran), tuple(pairs))


def check_sequence(policy, seq: Sequence[World], name: str = "the rule",
                   engine_worlds=None) -> Tuple[Optional[Tuple[int, ...]], ...]:
    """Every step of ``seq`` through ``policy`` in order; ``PropertyViolation`` (with the step
    named and the sequence's replay line) on the first step that breaks a property. Returns,
    for every step after the first, the rows at risk per reader rank between the last round
    before it and its own (None where it runs no round, or none ran before it).
    ``engine_worlds``: maps a step to the world the engine runs (``properties.world_for``)."""
    hazards: List[Optional[Tuple[int, ...]]] = [None] * max(0, len(seq) - 1)
    for pair in _rounds(policy, seq, name, engine_worlds, hold=True).pairs:
        hazards[pair.after - 1] = pair.risk
    return tuple(hazards)


def checked_rounds(policy, seq: Sequence[World], name: str = "the rule",
                   engine_worlds=None) -> Rounds:
    """``check_sequence``'s checks, and the rounds the policy ran: what a tier that runs the
    rounds on kernels (one GPU, the rank pool) runs, with each round's own runtime (the
    policy is called once per step, in order, as the engine would call it)."""
    return _rounds(policy, seq, name, engine_worlds, hold=True)


def round_pairs(policy, seq: Sequence[World], engine_worlds=None) -> List[RoundPair]:
    """The consecutive rounds ``policy`` runs along ``seq`` on the session's generation and
    the rows each puts at risk, whatever else the policy gets right or wrong on those steps
    (the bug classes and properties are other checks): a step that crashes, or whose ranks
    disagree, runs no round."""
    return list(_rounds(policy, seq, "the policy", engine_worlds, hold=False).pairs)


def exposes_cross_round(policy, seq: Sequence[World], engine_worlds=None) -> bool:
    """Whether ``policy``'s runtimes along ``seq`` put some combine row at risk between two
    consecutive rounds it runs."""
    return any(any(p.risk) for p in round_pairs(policy, seq, engine_worlds))
