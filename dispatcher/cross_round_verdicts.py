"""The ``cross-round`` hazard column of the engines' verdict tables.

FlashInfer 0.7.2 puts a round's combine input right after the round's own receive planes, so a
round whose planes grow writes over the previous round's combine input while a slower peer may
still read it (``model/cross_round.py``; docs/flashinfer.md, "Two rounds on one workspace").
Whether an engine's sizing lets the layout grow between consecutive rounds is a property of its
runtimes along a sequence of steps: Hypothesis searches sequences of one model's steps (one
format: only the sizing changes the layout, ``strategies.sequences``) through the engine's own
file for two consecutive rounds with rows at risk, shrinks the sequence, and reports those two
rounds. A hazard of the
stack, never a failing test of the engine: "exposed" (with the shrunk sequence) or "closed".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from strategies.search import minimal
from strategies.sequences import step_sequences

from .model import properties
from .model.engine import is_engine
from .model.generations import active, generation_of
from .model.sequences import exposes_cross_round, round_pairs
from .model.world import World

__all__ = ["COLUMN", "EXAMPLES", "ONE_FORMAT", "one_format", "CrossRound", "search", "first_exposed",
           "engine_worlds", "LEGEND"]

COLUMN = "cross-round"
EXAMPLES = 300
# one model's steps (one format) that a server runs (rows within the cap), none with fewer
# tokens in a DP group than the first (a shrinking layout is safe), up to 4 EP ranks (the
# condition does not depend on more) and 3 steps (two rounds, or two with a step between)
# (of the session's generation; ``one_format(version)``: of generation ``version``)


@functools.lru_cache(maxsize=None)
def one_format(flashinfer: Optional[str] = None):
    return step_sequences(max_ep=4, max_steps=3, formats_change=False, within_cap=True,
                          growing=True, flashinfer=flashinfer)


ONE_FORMAT = one_format()
LEGEND = ("`cross-round`: FlashInfer 0.7.2's cross-round race (a hazard of the stack: "
          "docs/flashinfer.md, \"Two rounds on one workspace\"), \"exposed\" where the release's "
          "runtimes let round n+1's receive planes reach round n's combine input, with the two "
          "rounds shrunk; on 0.7.4 (the generation vLLM 0.34.0 is judged on) the layout closes it")


def engine_worlds(policy):
    """The world the policy's engine runs for each drawn step, on the sequence's workspace
    (the cap stays: one allocation)."""
    if not is_engine(policy):
        return lambda world: world
    return lambda world: policy.engine_world(world, keep_cap=True)  # NotApplicable: no round


@dataclass(frozen=True)
class CrossRound:
    """What one policy's sizing does to 0.7.2's layout along sequences of steps."""

    version: str  # the generation searched
    example: Optional[Tuple[World, ...]]  # shrunk sequence with rows at risk; None: closed
    detail: str = ""

    @property
    def exposed(self) -> bool:
        return self.example is not None


def first_exposed(policy, examples) -> Optional[Tuple[World, ...]]:
    """The first of recorded ``examples`` (sequences of ``ONE_FORMAT``) that exposes the
    hazard: the same search as ``search`` without shrinking, for the tests and the compat
    table."""
    from strategies.search import first_in

    return first_in(examples, lambda seq: exposes_cross_round(policy, seq, engine_worlds(policy)))


def search(policy, max_examples: int = EXAMPLES, flashinfer: Optional[str] = None
           ) -> CrossRound:
    """The two rounds (shrunk) on which ``policy``'s runtimes let generation ``flashinfer``'s
    layout (default: the session's) grow over the previous round's combine input, or
    "closed"."""
    found = minimal(one_format(flashinfer), lambda seq: exposes_cross_round(
        policy, seq, engine_worlds(policy)), max_examples)
    if found is None:
        return CrossRound(generation_of(flashinfer).version if flashinfer else active().version,
                          None)
    worlds_of = engine_worlds(policy)
    pair = next(p for p in round_pairs(policy, found, worlds_of) if any(p.risk))
    (ra, rb), risk = pair.runtimes, pair.risk
    before, after = worlds_of(found[pair.before]), worlds_of(found[pair.after])
    return CrossRound(after.flashinfer, (before, after),
                      f"runtime {ra} -> {rb} puts {sum(risk)} of round n's combine rows at risk "
                      f"on {after.generation} (per reader rank {list(risk)})")
