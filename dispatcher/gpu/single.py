"""Every EP rank of a world in this process, on one GPU, through FlashInfer's real kernels.

Rank ``r`` runs on CUDA stream ``r``; all ranks' dispatches are launched before any is waited
for (the kernel spins until every peer has signalled, so their blocks must be co-resident:
keep ``rows * ep_size`` well under the SM count). The workspace is ours:
``[W, size_per_rank + GUARD]`` with guard bytes after each rank's region, and every payload
plane poisoned before each example, so stale rows and stray writes are visible. Workspaces,
metainfo and streams are reused across examples, keyed by the workspace's shape.

One driver for every FlashInfer generation: what differs (allocating and initialising a
workspace, a rank's dispatch and combine, where the receive counters are, what FlashInfer's
own byte numbers are, which calls the op refuses) is the generation's ``Ops``
(``gpu/mnnvl.py``, ``gpu/one_sided.py``; ``gpu/ops.py: ops_of`` opens it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..emulator.inputs import make_inputs
from ..model.generations import DEFAULT, Generation, generation_of, installed_version
from ..model.world import World
from . import torch_ops
from .ops import ops_of
from .checks import (GUARD, GUARD_BYTE, CudaContextDead, GpuRoundTrip, poisoned_rows,  # noqa: F401
                     verdict)

__all__ = ["SingleGpuA2A", "GpuRoundTrip", "CudaContextDead", "GUARD", "verdict", "for_installed",
           "installed_generation"]


def installed_generation() -> Generation:
    """The generation of the installed FlashInfer (the kernels a GPU host can run)."""
    return generation_of(installed_version() or DEFAULT)


class SingleGpuA2A:
    """Every rank of a world on one GPU, on ``generation``'s kernels (default: the installed
    FlashInfer's). A CUDA fault kills the process's context for good: the first fault is
    re-raised as it came, every later ``run`` fails at once with ``CudaContextDead`` naming the
    world that faulted (never a cascade of odd errors)."""

    emulated = False  # the CPU model behind the same calls: single_cpu.EmulatedSingleA2A
    MAX_WORKSPACES = 16  # LRU: realistic caps make a workspace up to ~1 GB

    def __init__(self, device: Optional[torch.device] = None,
                 generation: Optional[Generation] = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.generation = generation or installed_generation()
        self.ops = ops_of(self.generation).Ops(self.device)
        self._workspaces: "OrderedDict[tuple, object]" = OrderedDict()
        self._streams: List[torch.cuda.Stream] = []
        self.dead: Optional[str] = None

    def run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        """Dispatch -> stand-in MoE -> combine with ``runtimes[r]`` on rank ``r`` (no
        validation here: the caller decides; FlashInfer's own checks still apply)."""
        if self.dead:
            raise CudaContextDead(f"this process's CUDA context died earlier ({self.dead}); "
                                  f"restart the process to run GPU kernels again")
        if world.flashinfer != self.generation.version:
            raise ValueError(f"the world models FlashInfer {world.flashinfer}, but this driver "
                             f"runs {self.generation}'s kernels: make the world with "
                             f"flashinfer={self.generation.version!r}, or install its generation")
        try:
            return self._run(world, list(runtimes))
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if type(exc).__name__ == "AcceleratorError" or "CUDA error" in text:
                self.dead = f"{text.splitlines()[0][:200]} while running {world!r}"
            raise

    def run_sequence(self, worlds: Sequence[World], runtimes: Sequence[int]
                     ) -> Tuple[Tuple[str, ...], ...]:
        """Rounds back to back on one workspace, no host sync between them (``sequence.py``)."""
        from .sequence import run_sequence

        return run_sequence(self, worlds, runtimes)

    def _streams_for(self, n: int) -> List[torch.cuda.Stream]:
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device=self.device))
        return self._streams[:n]

    def byte_model(self, world: World) -> Dict[str, Tuple[int, int]]:
        """Our byte model next to FlashInfer's own numbers for this config."""
        return self.ops.byte_model(world)

    # --- the per-round steps (``gpu/sequence.py`` runs rounds back to back on them) --------
    def space(self, world: World):
        """The workspace ``world`` runs on (kept per shape, least recently used dropped)."""
        key = self.ops.key(world)
        if key in self._workspaces:
            self._workspaces.move_to_end(key)
            return self._workspaces[key]
        while len(self._workspaces) >= self.MAX_WORKSPACES:
            self._workspaces.popitem(last=False)
        size = self.ops.size(world)
        full = torch.empty((world.ep_size, size + GUARD), dtype=torch.uint8, device=self.device)
        full[:, size:] = GUARD_BYTE
        self._workspaces[key] = self.ops.initialize(world, full, full[:, :size])
        return self._workspaces[key]

    def _launch_dispatch(self, world: World, runtimes: Sequence[int], space, dev,
                         streams) -> Tuple[list, list]:
        """Every rank's dispatch on its own stream, launched before any is waited for: each
        rank's receive planes and combine offset."""
        moe, W = world.moe, world.ep_size

        def dispatch(r):
            ids, payloads = torch_ops.rank_inputs(dev, r, moe.payloads)
            return self.ops.dispatch(r, world, runtimes[r], space, ids, payloads)
        done = torch_ops.per_rank_on_streams(streams[:W], self.device, dispatch)
        return [out for out, _ in done], [off for _, off in done]

    def _launch_combine(self, world: World, runtimes: Sequence[int], space, outs,
                        combine_offsets, streams) -> List[torch.Tensor]:
        """Every rank's combine on its own stream: each rank's combined rows."""
        def combine(r):
            return self.ops.combine(r, world, runtimes[r], space, outs[r], combine_offsets[r])
        return torch_ops.per_rank_on_streams(streams[:world.ep_size], self.device, combine)

    def _run(self, world: World, runtimes: List[int]) -> GpuRoundTrip:
        moe, W = world.moe, world.ep_size
        space = self.space(world)
        model = self.ops.byte_model(world, space)
        inputs = make_inputs(world)
        dev = torch_ops.device_inputs(inputs, self.device)
        refused = self.ops.refused(world, runtimes, space, dev)
        if refused:
            return GpuRoundTrip(tuple(refused), model)
        self.ops.poison(world, space)
        streams = self._streams_for(W)
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        recv, combine_offsets = self._launch_dispatch(world, runtimes, space, dev, streams)
        for s in streams:
            main.wait_stream(s)
        model.update(self.ops.round_model(world, runtimes, combine_offsets))
        counts = self.ops.counts(world, space)
        if len(set(runtimes)) == 1:  # a sound rule: every rank's op batched into one
            stacked = [torch.stack(planes) for planes in zip(*recv)]  # [W, W, R, n] each
            outs = list(torch_ops.expert_outputs(stacked, runtimes[0], moe, range(W), W).unbind(0))
            poisoned = [poisoned_rows(stacked)]  # [W, W, R]
        else:
            outs = [torch_ops.expert_outputs(recv[r], runtimes[r], moe, r, W) for r in range(W)]
            poisoned = [poisoned_rows(recv[r]) for r in range(W)]  # [W, R_r] each
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        results = self._launch_combine(world, runtimes, space, outs, combine_offsets, streams)
        for s in streams:
            main.wait_stream(s)
        guard = (space.full[:, space.ws.shape[1]:] == GUARD_BYTE).all()
        return verdict(world, inputs, runtimes, guard, counts, poisoned, results, model,
                       str(self.generation))


def for_installed(device: Optional[torch.device] = None) -> SingleGpuA2A:
    """The single-GPU driver on the installed FlashInfer's kernels."""
    return SingleGpuA2A(device)
