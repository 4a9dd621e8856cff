"""One SGLang release (``loader.SGLangRelease``) bound to one step: the per-rank policy the
properties check."""
from __future__ import annotations

from typing import List, Optional

from ..model.engine import EngineStep
from ..model.sglang_context import SGLangContext
from ..model.validation import CapExceeded
from ..model.world import World
from ..sizing import RankView
from .report import Outcome, SGLangAssertion, describe_outcomes, describe_sources

__all__ = ["BoundStep"]


class BoundStep(EngineStep):
    """A release bound to one (world, context): called with a rank's view it returns the
    runtime that rank's dispatch() launched with; ``notes()`` says what each rank saw. The
    whole step runs on the first call; asking for a rank again runs it again (so the
    determinism check of ``rule_values`` sees a fresh answer)."""


    def __init__(self, release, world: World, ctx: SGLangContext):
        self.release, self.world, self.ctx = release, world, ctx
        self.outcomes: Optional[List[Outcome]] = None
        self._served: set = set()
        self.spec = release.spec
        self.replay_args = (release.companions.replay_flag if release.companions else "") + (
            "" if ctx == SGLangContext() else f" --context \"{ctx!r}\"")

    def __call__(self, view: RankView) -> int:
        rank, label = view.ep_rank, self.release.label
        if self.outcomes is None:
            self.outcomes = self.release.step(self.world, self.ctx)
        out = self.outcomes[rank]
        if rank in self._served:
            out = self.release.outcome(self.world, rank, self.ctx)
        self._served.add(rank)
        if out.error and not self.world.payload_fits_cap:  # its clear refusal is the right answer
            raise CapExceeded(f"SGLang {label} refused: {out.error}")
        if out.error:
            raise SGLangAssertion(f"SGLang {label} dispatch() raised {out.error}")
        if out.routed_around:
            raise SGLangAssertion(f"SGLang {label} did not launch the A2A in "
                                  f"{self.ctx.forward_mode} mode")
        return out.runtime

    def notes(self) -> str:
        """Rendered only when a failure is reported."""
        if not self.outcomes:
            return ""
        return (f"  what SGLang {self.release.label} saw and did:\n"
                + describe_outcomes(self.outcomes, self.world) + "\n"
                + describe_sources(self.release))
