"""Every EP rank of a world in this process, on one GPU, through FlashInfer's real kernels.

Rank ``r`` runs on CUDA stream ``r``; all ranks' dispatches are launched before any is waited
for (the kernel spins until every peer has signalled, so their blocks must be co-resident:
keep ``rows * ep_size`` well under the SM count). The workspace is ours:
``[W, size_per_rank + GUARD]`` with guard bytes after each rank's region, and every payload
plane poisoned before each example, so stale rows and stray writes are visible. Workspaces,
metainfo and streams are reused across examples, keyed by (W, cap, size).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..emulator.a2a import POISON
from ..emulator.inputs import make_inputs
from ..model.workspace import aux_offsets, aux_size
from ..model.world import World
from . import torch_ops
from .checks import (GUARD, GUARD_BYTE, CudaContextDead, GpuRoundTrip, poisoned_rows,  # noqa: F401
                     verdict)
from .flashinfer import comm, metainfo_index, module, pdl_default

__all__ = ["SingleGpuA2A", "GpuRoundTrip", "CudaContextDead", "GUARD", "verdict", "for_installed"]

@dataclass
class _Workspace:
    """One (W, cap, size) workspace: ``full`` with the guard bytes, ``ws`` the view FlashInfer
    is handed, each rank's metainfo, FlashInfer's receive views (``recv_view_cache``, as its
    ``MoeAlltoAll`` keeps them) and the offsets FlashInfer put in the metainfo."""

    full: torch.Tensor
    ws: torch.Tensor
    metainfo: List[torch.Tensor]
    views: dict
    payload_data_offset: int
    recv_counters_offset: int


class SingleGpuA2A:
    """Every rank of a world on one GPU. A CUDA fault kills the process's context for good:
    the first fault is re-raised as it came, every later ``run`` fails at once with
    ``CudaContextDead`` naming the world that faulted (never a cascade of odd errors)."""

    MAX_WORKSPACES = 16  # LRU: realistic caps make a workspace up to ~1 GB

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._workspaces: "OrderedDict[Tuple[int, int, int], _Workspace]" = OrderedDict()
        self._streams: List[torch.cuda.Stream] = []
        self._index = metainfo_index()
        self._pdl = pdl_default(self.device)
        self.dead: Optional[str] = None

    def run(self, world: World, runtimes: Sequence[int]) -> "GpuRoundTrip":
        """Dispatch -> stand-in MoE -> combine with ``runtimes[r]`` on rank ``r`` (no
        validation here: the caller decides; FlashInfer's own checks still apply)."""
        if self.dead:
            raise CudaContextDead(f"this process's CUDA context died earlier ({self.dead}); "
                                  f"restart the process to run GPU kernels again")
        try:
            return self._run(world, runtimes)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if type(exc).__name__ == "AcceleratorError" or "CUDA error" in text:
                self.dead = f"{text.splitlines()[0][:200]} while running {world!r}"
            raise

    def _streams_for(self, n: int) -> List[torch.cuda.Stream]:
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device=self.device))
        return self._streams[:n]

    def _workspace(self, ep_size: int, cap: int, size: int) -> _Workspace:
        key = (ep_size, cap, size)
        if key in self._workspaces:
            self._workspaces.move_to_end(key)
        else:
            while len(self._workspaces) >= self.MAX_WORKSPACES:
                self._workspaces.popitem(last=False)
            _, ops = comm()
            full = torch.empty((ep_size, size + GUARD), dtype=torch.uint8, device=self.device)
            full[:, size:] = GUARD_BYTE
            ws = full[:, :size]
            metainfo = [ops.moe_a2a_initialize(ws, r, ep_size, cap) for r in range(ep_size)]
            idx = self._index
            self._workspaces[key] = _Workspace(
                full, ws, metainfo, {}, int(metainfo[0][idx["PAYLOAD_DATA_OFFSET_INDEX"]]),
                int(metainfo[0][idx["RECV_COUNTERS_OFFSET_INDEX"]]))
        return self._workspaces[key]

    def byte_model(self, world: World) -> Dict[str, Tuple[int, int]]:
        """Our byte model next to FlashInfer's own numbers for this config."""
        moe = world.moe
        return dict(_byte_model(world.ep_size, world.max_num_tokens, moe.dispatch_bytes,
                                moe.combine_bytes, world.workspace_size))

    # --- the per-generation steps (``gpu/sequence.py`` runs rounds back to back on them) ----
    def space(self, world: World) -> _Workspace:
        """The workspace ``world`` runs on (kept per (W, cap, size))."""
        return self._workspace(world.ep_size, world.max_num_tokens, world.workspace_size)

    def _launch_dispatch(self, world: World, runtimes: Sequence[int], space: _Workspace, dev,
                         streams) -> Tuple[list, list]:
        """Every rank's dispatch on its own stream, launched before any is waited for: each
        rank's receive planes and combine offset."""
        _, ops = comm()
        moe, W = world.moe, world.ep_size

        def dispatch(r):
            ids, payloads = torch_ops.rank_inputs(dev, r, moe.payloads)
            out, comb_off, _ = ops.moe_a2a_dispatch(
                ids.view(torch.int32), payloads, space.ws, space.metainfo[r], runtimes[r], r, W,
                moe.top_k, moe.num_experts, enable_pdl=self._pdl, recv_view_cache=space.views)
            return out, comb_off
        done = torch_ops.per_rank_on_streams(streams[:W], self.device, dispatch)
        return [out for out, _ in done], [off for _, off in done]

    def _launch_combine(self, world: World, runtimes: Sequence[int], space: _Workspace, outs,
                        combine_offsets, streams) -> List[torch.Tensor]:
        """Every rank's combine on its own stream: each rank's combined rows."""
        _, ops = comm()
        moe, W = world.moe, world.ep_size
        def combine(r):
            return ops.moe_a2a_combine(
                outs[r], world.rows_per_rank[r], space.ws, space.metainfo[r], runtimes[r], r, W,
                moe.top_k, combine_offsets[r], enable_pdl=self._pdl)
        return torch_ops.per_rank_on_streams(streams[:W], self.device, combine)

    def _run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        size = world.workspace_size
        space = self.space(world)
        ws = space.ws
        aux = aux_offsets(W, cap)
        model = self.byte_model(world)
        model["payload_data_offset"] = (aux.payload_data, space.payload_data_offset)
        model["recv_counters_offset"] = (aux.recv_counters, space.recv_counters_offset)

        inputs = make_inputs(world)
        dev = torch_ops.device_inputs(inputs, self.device)
        ws[:, aux.payload_data:].fill_(POISON)
        streams = self._streams_for(W)
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        recv, combine_offsets = self._launch_dispatch(world, runtimes, space, dev, streams)
        for s in streams:
            main.wait_stream(s)
        model["combine_payload_offset"] = (world.layout(runtimes[0]).combine_offset,
                                           int(combine_offsets[0]))
        counts = ws[:, aux.recv_counters:aux.recv_counters + 4 * W]  # int32 [W, W] as bytes
        same = len(set(runtimes)) == 1  # a sound rule: every rank's op batched into one
        if same:
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
        guard = (space.full[:, size:] == GUARD_BYTE).all()
        return verdict(world, inputs, runtimes, guard, counts, poisoned, results, model,
                       "FlashInfer")


@lru_cache(maxsize=4096)
def _byte_model(ep_size: int, cap: int, dispatch_bytes: int, combine_bytes: int,
                workspace_size: int) -> Tuple[Tuple[str, Tuple[int, int]], ...]:
    """(name, (ours, FlashInfer's)) for one config: FlashInfer's answers are pure functions
    of these numbers, asked once per config."""
    _, ops = comm()
    theirs = ops.moe_a2a_get_workspace_size_per_rank(ep_size, cap, dispatch_bytes,
                                                     combine_bytes)
    return (("workspace_size_per_rank", (workspace_size, int(theirs))),
            ("aux_size", (aux_size(ep_size, cap),
                          int(module().moe_a2a_get_aux_data_size(ep_size, cap, 0)))))


def for_installed(device: Optional[torch.device] = None):
    """The single-GPU driver of the installed FlashInfer: ``SingleGpuA2A`` (0.7.2) or
    ``single_074.SingleGpuA2A074`` (0.7.4), the same interface."""
    from ..model.generations import DEFAULT, generation_of, installed_version

    if generation_of(installed_version() or DEFAULT).kernel == "one_sided":
        from .single_074 import SingleGpuA2A074

        return SingleGpuA2A074(device)
    return SingleGpuA2A(device)
