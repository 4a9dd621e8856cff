"""The single-GPU tier's driver on a machine without a GPU or FlashInfer: every EP rank of a
world through the exact CPU model of the world's FlashInfer generation (``emulator/``), behind
the same two calls as ``single.SingleGpuA2A`` (``run``, ``run_sequence``) and with the same
answers, so the tier's test bodies (the policy under test at every step, validation, the
round trip's checks) run in CI under every kind of policy, not only on a GPU host.

What only the hardware has stays with ``SingleGpuA2A`` (its tests carry ``real_kernels``):
FlashInfer's own byte numbers from its compiled module, guard pages, streams, CUDA faults,
co-residency on the SMs. Here a write past a rank's workspace is the model's
``IllegalAddress``, a row written or read outside its slot one of the model's ``SlotEvent``s,
and 0.7.4's refusal of a rank whose rows exceed its runtime the model's ``RankRefused``.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from ..emulator.a2a import IllegalAddress
from ..emulator.rounds import round_trip, rounds_in_order
from ..model.world import World
from .checks import GpuRoundTrip, ranks_refused, refusal, world_problems
from .sequence import check_rounds, round_problems

__all__ = ["EmulatedSingleA2A"]


class EmulatedSingleA2A:
    """Every rank of a world on the exact CPU model of ``world.generation``'s kernels. Rounds
    of a sequence run in order, each read before the next writes (the model of an engine that
    synchronises): the cross-round race needs real streams and is the GPU's to show."""

    emulated = True
    dead = None  # no CUDA context to lose

    def run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        """Dispatch -> stand-in MoE -> combine with ``runtimes[r]`` on rank ``r`` (no validation
        here: the caller decides; what FlashInfer checks still applies)."""
        runtimes = list(runtimes)
        if world.generation.checks_local_rows:  # refused before any launch, rank by rank
            refused = ranks_refused(world, runtimes)
            if refused:
                return GpuRoundTrip(tuple(refusal(world, r, runtimes[r], "Local token count "
                                                  "exceeds the runtime capacity") for r in refused), {})
        try:
            rt = round_trip(world, runtimes)
        except IllegalAddress as exc:  # on a GPU: our guard bytes, or an illegal-address fault
            return GpuRoundTrip((f"guard bytes after a rank's workspace were overwritten "
                                 f"(exact model: {exc})",), {})
        W = world.ep_size
        stray = {e.target_rank for e in rt.events if e.phase == "dispatch"}
        stale_ok = [r not in stray for r in range(W)]
        problems = world_problems(stale_ok, runtimes, np.asarray(rt.recv_counts),
                                  rt.expected_counts, rt.outputs, rt.reference)
        if not rt.received_ok and not problems:
            problems.append("a received row differs from the row its sender sent")
        return GpuRoundTrip(tuple(problems), {})

    def run_sequence(self, worlds: Sequence[World], runtimes: Sequence[int]
                     ) -> Tuple[Tuple[str, ...], ...]:
        """Every round of ``worlds`` (``runtimes[n]`` on every rank in round n) on one
        workspace, never cleared between rounds; per round, the problems found."""
        if len(worlds) != len(runtimes) or not worlds:
            raise ValueError("one runtime per round")
        check_rounds(worlds, runtimes)
        W = worlds[0].ep_size
        rounds = rounds_in_order(worlds, [[R] * W for R in runtimes])
        return tuple(round_problems(n, outputs, reference)
                     for n, (outputs, reference) in enumerate(rounds))
