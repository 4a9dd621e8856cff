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

import numpy as np
import torch

from . import torch_ops
from .emulator import POISON, expected_recv_counts
from .flashinfer_a2a import comm, metainfo_index, module
from .inputs import make_inputs, reference_outputs
from .workspace import (aux_offsets, aux_size, combine_bytes_per_token, dispatch_payloads,
                        layout, workspace_size_per_rank)
from .world import World

GUARD = 4096
GUARD_BYTE = 0x5A
# bf16 tolerance: both sides round each expert row to bf16 once and sum exactly in fp32, so a
# correct A2A matches the reference bit for bit; allow half a bf16 ulp of the largest value.
RTOL, ATOL = 2.0 ** -8, 0.0


@dataclass(frozen=True)
class GpuRoundTrip:
    outputs: Tuple[np.ndarray, ...]
    reference: Tuple[np.ndarray, ...]
    recv_counts: np.ndarray  # [target, source] read from each rank's recv_counters
    expected_counts: np.ndarray
    guards_intact: bool
    stale_rows_poisoned: bool  # rows past every sender's count still hold the poison
    byte_model: Dict[str, Tuple[int, int]]  # name -> (ours, FlashInfer's)

    def mismatched_ranks(self) -> List[int]:
        bad = []
        for r, (o, e) in enumerate(zip(self.outputs, self.reference)):
            if o.shape != e.shape or not np.allclose(o, e, rtol=RTOL, atol=ATOL):
                bad.append(r)
        return bad

    def byte_model_mismatches(self) -> Dict[str, Tuple[int, int]]:
        return {k: v for k, v in self.byte_model.items() if v[0] != v[1]}

    def problems(self) -> List[str]:
        p = []
        if self.mismatched_ranks():
            p.append(f"combine output differs from the reference on ranks {self.mismatched_ranks()}")
        if not np.array_equal(self.recv_counts, self.expected_counts):
            p.append(f"recv counts {self.recv_counts.tolist()} != model {self.expected_counts.tolist()}")
        if not self.guards_intact:
            p.append("guard bytes after a rank's workspace were overwritten")
        if not self.stale_rows_poisoned:
            p.append("rows past a sender's count were written (a stray write landed in a slot)")
        if self.byte_model_mismatches():
            p.append(f"byte model != FlashInfer: {self.byte_model_mismatches()}")
        return p


class SingleGpuA2A:
    MAX_WORKSPACES = 16  # LRU: realistic caps make a workspace up to ~1 GB

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._workspaces: "OrderedDict[Tuple[int, int, int], tuple]" = OrderedDict()
        self._streams: List[torch.cuda.Stream] = []
        self._index = metainfo_index()

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
        moe = world.moe
        specs = dispatch_payloads(moe.payload_format, moe.hidden_size, moe.top_k)
        d, c = sum(p.bytes_per_token for p in specs), combine_bytes_per_token(moe.hidden_size)
        W, cap = world.ep_size, world.max_num_tokens
        return {
            "workspace_size_per_rank": (workspace_size_per_rank(W, cap, d, c),
                                        int(ops.moe_a2a_get_workspace_size_per_rank(W, cap, d, c))),
            "aux_size": (aux_size(W, cap), int(module().moe_a2a_get_aux_data_size(W, cap, 0))),
        }

    def run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        """Dispatch -> stand-in MoE -> combine with ``runtimes[r]`` on rank ``r`` (no
        validation here: the caller decides; FlashInfer's own checks still apply)."""
        _, ops = comm()
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        fmt = moe.payload_format
        specs = dispatch_payloads(fmt, moe.hidden_size, moe.top_k)
        c = combine_bytes_per_token(moe.hidden_size)
        size = workspace_size_per_rank(W, cap, sum(p.bytes_per_token for p in specs), c)
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
        lay = layout(W, cap, runtimes[0], specs, c)
        model["combine_payload_offset"] = (lay.combine_offset, int(combine_offsets[0]))
        counts = ws[:, aux.recv_counters:aux.recv_counters + 4 * W].contiguous().view(torch.int32)
        expected = expected_recv_counts(world, inputs)
        stale_ok = self._stale_rows_poisoned(recv, expected, runtimes)
        # stand-in MoE on every target rank at once when runtimes agree, else per rank
        n_hidden = len(specs) - 2
        outs = []
        for r in range(W):
            planes = [p.reshape(W * runtimes[r], -1) for p in recv[r]]
            x = torch_ops.decode_hidden(planes[:n_hidden], fmt, moe.hidden_size)
            e = planes[n_hidden].contiguous().view(torch.int32)
            w = planes[n_hidden + 1].contiguous().view(torch.float32)
            y = torch_ops.stand_in_moe(x[None], e[None], w[None],
                                       torch.tensor([r], device=self.device), moe.num_experts, W)
            outs.append(y.view(W, runtimes[r], moe.hidden_size))
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
        guards = bool((full[:, size:] == GUARD_BYTE).all().item())
        host = [t.float().cpu().numpy() for t in results]
        return GpuRoundTrip(tuple(host), tuple(ref), counts.cpu().numpy().astype(np.int64),
                            expected, guards, stale_ok, model)

    @staticmethod
    def _stale_rows_poisoned(recv, expected, runtimes) -> bool:
        """On each target, rows [count, R) of each source slot still hold POISON."""
        for t, planes in enumerate(recv):
            R = runtimes[t]
            row = torch.arange(R, device=planes[0].device)
            stale = row[None, :] >= torch.as_tensor(expected[t], device=row.device)[:, None]
            for p in planes:
                rows = p.contiguous().view(torch.uint8).reshape(p.shape[0], R, -1)
                if not bool(((rows == POISON).all(-1) | ~stale).all().item()):
                    return False
        return True
