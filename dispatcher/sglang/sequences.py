"""One SGLang server's steps in order, on one workspace, through one release object.

An SGLang server builds its dispatchers once and runs step after step on them: CUDA-graph
captures at start-up, then decode steps (eager, or replays of a captured bucket), prefill and
mixed batches (routed around the A2A where the release does that), idle steps, and speculative
draft forwards. ``check_steps`` runs such a sequence (``strategies.sglang_sequences`` draws
them) and holds every step to everything a single step is held to: the soundness of any step
(``classes.step_problem``) and each bug class's check. A release wrong only after a certain
history (a runtime kept from an earlier step) fails at the step that shows it, and Hypothesis
shrinks the sequence to the shortest such history. Between consecutive A2A rounds it counts
FlashInfer's cross-round hazard on the session's generation (``model/cross_round.py``): a
hazard of the layout, never a failure of the release.
"""
from __future__ import annotations

import shlex
from typing import Optional, Sequence, Tuple

from ..model.cross_round import rows_at_risk
from ..model.generations import replay_flag
from ..model.sglang_context import SGLangContext
from ..model.world import World
from ..sizing import NotApplicable
from .bug_classes import class_problem, describe_step, step_problem
from .loader import SGLangRelease

__all__ = ["SequenceFailure", "check_steps", "replay_line"]

Step = Tuple[World, SGLangContext]


class SequenceFailure(AssertionError):
    """A step of a sequence the release got wrong (the step named, the sequence replayable)."""


def replay_line(release: SGLangRelease, steps: Sequence[Step]) -> str:
    companions = release.companions.replay_flag if release.companions else ""
    return (f"python -m dispatcher{replay_flag(steps[0][0].flashinfer)}{companions} --policy "
            f"{shlex.quote(release.spec)} \"{tuple(steps)!r}\"")


def _round(release: SGLangRelease, world: World, ctx: SGLangContext, outs):
    """(layout, rows each rank sends one peer) of a launched step, or None."""
    if not outs or any(o.launch is None for o in outs):
        return None
    runtime = outs[0].runtime
    if type(runtime) is not int or not 1 <= runtime <= world.max_num_tokens:
        return None
    rows = release.forward_world(world, ctx).rows_per_rank
    try:
        return world.layout(runtime), tuple(min(n, runtime) for n in rows)
    except ValueError:
        return None


def check_steps(release: SGLangRelease, steps: Sequence[Step],
                keys: Sequence[str]) -> Tuple[Optional[Tuple[int, ...]], ...]:
    """Every step in order against ``step_problem`` and the classes ``keys``;
    ``SequenceFailure`` on the first step wrong. Returns, for every step after the first, the
    cross-round rows at risk per reader rank between the last round before it and its own
    (None where it runs no A2A round, or none ran before it)."""
    hazards, prev = [], None
    for n, (world, ctx) in enumerate(steps, 1):
        try:
            outs = release.step(world, ctx)
        except NotApplicable:  # a step this server never runs: the history goes on
            this = None
        else:
            problems = [step_problem(release, world, ctx, outs)]
            problems += [f"[{k}] {p}" for k in keys
                         if (p := class_problem(release, k, world, ctx, outs)) is not None]
            problems = [p for p in problems if p]
            if problems:
                raise SequenceFailure(
                    f"at step {n} of {len(steps)} on one workspace: {problems[0]}\n"
                    f"{describe_step(release, world, ctx, outs)}\n"
                    f"the sequence: {tuple(steps)!r}\n"
                    f"replay the sequence: {replay_line(release, steps)}")
            this = _round(release, world, ctx, outs)
        if n > 1:
            hazards.append(None if prev is None or this is None
                           else rows_at_risk(prev[0], this[0], prev[1], this[1]))
        if this is not None:  # the workspace's latest round (a step with none leaves it)
            prev = this
    return tuple(hazards)
