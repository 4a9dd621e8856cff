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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..emulator.a2a import POISON, expected_recv_counts
from ..emulator.inputs import make_inputs, reference_outputs
from ..model.workspace import aux_offsets, aux_size
from ..model.world import World
from . import torch_ops
from .checks import rank_problems, stale_rows_ok
from .flashinfer import comm, metainfo_index, module

__all__ = ["SingleGpuA2A", "GpuRoundTrip", "CudaContextDead", "GUARD"]

GUARD = 4096
GUARD_BYTE = 0x5A


@dataclass(frozen=True)
class GpuRoundTrip:
    problems: Tuple[str, ...]  # empty when every rank's round trip was exact
    byte_model: Dict[str, Tuple[int, int]]  # name -> (ours, FlashInfer's)


class CudaContextDead(RuntimeError):
    """An earlier kernel fault killed this process's CUDA context: nothing more can run."""


class SingleGpuA2A:
    """Every rank of a world on one GPU. A CUDA fault kills the process's context for good:
    the first fault is re-raised as it came, every later ``run`` fails at once with
    ``CudaContextDead`` naming the world that faulted (never a cascade of odd errors)."""

    MAX_WORKSPACES = 16  # LRU: realistic caps make a workspace up to ~1 GB

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._workspaces: "OrderedDict[Tuple[int, int, int], tuple]" = OrderedDict()
        self._streams: List[torch.cuda.Stream] = []
        self._index = metainfo_index()
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

    def _workspace(self, ep_size: int, cap: int, size: int):
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
            self._workspaces[key] = (full, ws, metainfo)
        return self._workspaces[key]

    def byte_model(self, world: World) -> Dict[str, Tuple[int, int]]:
        """Our byte model next to FlashInfer's own numbers for this config."""
        _, ops = comm()
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        theirs = ops.moe_a2a_get_workspace_size_per_rank(W, cap, moe.dispatch_bytes,
                                                         moe.combine_bytes)
        return {
            "workspace_size_per_rank": (world.workspace_size, int(theirs)),
            "aux_size": (aux_size(W, cap), int(module().moe_a2a_get_aux_data_size(W, cap, 0))),
        }

    def _run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        _, ops = comm()
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        specs = moe.payloads
        size = world.workspace_size
        full, ws, metainfo = self._workspace(W, cap, size)
        aux = aux_offsets(W, cap)
        model = self.byte_model(world)
        idx = self._index
        model["payload_data_offset"] = (aux.payload_data, int(metainfo[0][idx["PAYLOAD_DATA_OFFSET_INDEX"]]))
        model["recv_counters_offset"] = (aux.recv_counters, int(metainfo[0][idx["RECV_COUNTERS_OFFSET_INDEX"]]))

        inputs = make_inputs(world)
        ref = reference_outputs(world, inputs)
        arrays = []
        for inp in inputs:
            arrays += [inp.expert_ids] + list(inp.payload_rows)
        dev = torch_ops.to_torch_rows(arrays, self.device)
        per_rank = [dev[i * (len(specs) + 1):(i + 1) * (len(specs) + 1)] for i in range(W)]
        ws[:, aux.payload_data:].fill_(POISON)
        streams = self._streams_for(W)
        main = torch.cuda.current_stream(self.device)
        for s in streams:
            s.wait_stream(main)
        combine_offsets, recv = [], []
        for r in range(W):  # launch every rank before waiting on any
            with torch.cuda.stream(streams[r]):
                ids, *rows = per_rank[r]
                payloads = [torch_ops.typed(t, spec.name) for t, spec in zip(rows, specs)]
                out, comb_off, _ = ops.moe_a2a_dispatch(
                    ids.view(torch.int32), payloads, ws, metainfo[r], runtimes[r], r, W,
                    moe.top_k, moe.num_experts)
                combine_offsets.append(comb_off)
                recv.append(out)
        for s in streams:
            main.wait_stream(s)
        model["combine_payload_offset"] = (world.layout(runtimes[0]).combine_offset,
                                           int(combine_offsets[0]))
        counts = ws[:, aux.recv_counters:aux.recv_counters + 4 * W].contiguous().view(torch.int32)
        same = len(set(runtimes)) == 1  # a sound rule: every rank's op batched into one
        if same:
            stacked = [torch.stack(planes) for planes in zip(*recv)]  # [W, W, R, bytes] each
            batch = torch_ops.expert_outputs(stacked, runtimes[0], moe, range(W), W)
            outs = list(batch.unbind(0))
        else:
            outs = [torch_ops.expert_outputs(recv[r], runtimes[r], moe, r, W) for r in range(W)]
        for s in streams:
            s.wait_stream(main)
        results = []
        for r in range(W):
            with torch.cuda.stream(streams[r]):
                results.append(ops.moe_a2a_combine(
                    outs[r], world.rows_per_rank[r], ws, metainfo[r], runtimes[r], r, W,
                    moe.top_k, combine_offsets[r]))
        for s in streams:
            main.wait_stream(s)
        # every answer read back in three copies (one sync), not a sync per rank and plane
        expected = expected_recv_counts(world, inputs)
        stale = (stale_rows_ok(stacked, expected, runtimes[0]) if same else
                 torch.stack([stale_rows_ok(recv[r], expected[r], runtimes[r]) for r in range(W)]))
        flags = torch.cat([(full[:, size:] == GUARD_BYTE).all().view(1), stale])
        outputs = torch.cat([results[r].float().reshape(-1) for r in range(W)])
        host_flags, host_counts, host_out = flags.cpu().numpy(), counts.cpu().numpy(), \
            outputs.cpu().numpy()
        problems = []
        if not host_flags[0]:
            problems.append("guard bytes after a rank's workspace were overwritten")
        at = 0
        for r in range(W):
            n = results[r].numel()
            out_r = host_out[at:at + n].reshape(results[r].shape)
            at += n
            problems += rank_problems(r, bool(host_flags[1 + r]), runtimes[r], host_counts[r],
                                      expected[r], out_r, ref[r])
        wrong = {k: v for k, v in model.items() if v[0] != v[1]}
        if wrong:
            problems.append(f"byte model != FlashInfer: {wrong}")
        return GpuRoundTrip(tuple(problems), model)
