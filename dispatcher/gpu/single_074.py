"""Every EP rank of a world in this process, on one GPU, through FlashInfer 0.7.4's real kernels.

0.7.4 has no public functional API; ``NVLinkOneSidedAlltoAll`` allocates its own workspace. The
raw module behind it (``get_nvlink_one_sided_alltoall_module()``) lays out a workspace
(``moe_a2a_get_workspace_layout``), initialises, dispatches and combines touching only local
state, on a caller-owned ``uint8 [W, bytes]`` CUDA tensor whose rank slices are 128-aligned, so
one process still runs every rank, as ``single.py`` does for 0.7.2: the workspace is ours, with
guard bytes after each rank's slice and the dispatch and combine regions poisoned before each
example; the same checks (output, counts, guards, stale rows, byte model). The fence path runs
(no CFT, no Lamport: an H200 has neither), with a short ``timeout_sec`` so a peer that is never
launched traps in seconds, not 300. Before any rank launches, every rank whose call 0.7.4 would
refuse (its rows over its runtime, a runtime <= 0 or over the cap) is called first: FlashInfer
refuses it without launching anything, the refusal is reported with the world, and no peer is
left spinning.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..emulator.a2a import POISON
from ..emulator.inputs import make_inputs
from ..model import workspace_074 as w074
from ..model.world import World
from . import torch_ops
from .checks import GUARD, GUARD_BYTE, CudaContextDead, GpuRoundTrip, poisoned_rows, verdict

__all__ = ["SingleGpuA2A074", "RawA2A074", "TIMEOUT_S", "module", "layout_index",
           "flashinfer_layout", "byte_model_074", "aligned16"]

TIMEOUT_S = 20  # timeout_sec of every wait on a peer (FlashInfer's default: 300)
INVALID_EXPERT_ID = -1


@lru_cache(maxsize=None)
def module():
    from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels import (
        get_nvlink_one_sided_alltoall_module)

    return get_nvlink_one_sided_alltoall_module()


@lru_cache(maxsize=None)
def layout_index() -> Dict[str, int]:
    names, values = module().moe_a2a_get_metainfo_index_pairs()
    return {str(n).replace("MOE_A2A_", ""): int(v) for n, v in zip(names, values)}


def flashinfer_layout(ep_size: int, cap: int, top_k: int, dispatch_bytes: int,
                      combine_bytes: int) -> torch.Tensor:
    """FlashInfer's metainfo for the fence path, as ``NVLinkOneSidedAlltoAll`` asks for it."""
    idx = layout_index()
    meta = torch.empty(idx["NUM_METAINFO_FIELDS"], dtype=torch.int64)
    module().moe_a2a_get_workspace_layout(
        ep_size, cap, top_k, w074.dispatch_capacity(ep_size, cap, dispatch_bytes),
        w074.combine_capacity(ep_size, cap, combine_bytes), 0, 0, False, meta)
    return meta


def byte_model_074(ep_size: int, cap: int, top_k: int, dispatch_bytes: int,
                   combine_bytes: int) -> Dict[str, Tuple[int, int]]:
    """Our offsets next to FlashInfer's metainfo (a host function: no kernel launched)."""
    meta, idx = flashinfer_layout(ep_size, cap, top_k, dispatch_bytes, combine_bytes), layout_index()
    ours = w074.offsets(ep_size, cap, top_k, w074.dispatch_capacity(ep_size, cap, dispatch_bytes),
                        w074.combine_capacity(ep_size, cap, combine_bytes))
    pairs = {"workspace_size": (ours.workspace_size, "WORKSPACE_SIZE_INDEX"),
             "recv_counters": (ours.recv_counters, "RECV_COUNTERS_OFFSET_INDEX"),
             "topk_target_indices": (ours.topk_target_indices, "TOPK_TARGET_INDICES_OFFSET_INDEX"),
             "dispatch_payload": (ours.dispatch_payload, "DISPATCH_PAYLOAD_OFFSET_INDEX"),
             "dispatch_payload_size": (ours.dispatch_payload_size, "DISPATCH_PAYLOAD_SIZE_INDEX"),
             "combine_input": (ours.combine_input, "COMBINE_INPUT_OFFSET_INDEX"),
             "combine_input_size": (ours.combine_input_size, "COMBINE_INPUT_SIZE_INDEX")}
    return {name: (v, int(meta[idx[key]])) for name, (v, key) in pairs.items()}


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """0.7.4 takes only 16-byte aligned payloads (our rows share one buffer): a copy if not."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class RawA2A074:
    """One rank's end of 0.7.4's raw module ops on a workspace shared by every rank (a CUDA IPC
    mapping of one allocation): the calls ``NVLinkOneSidedAlltoAll`` makes on the fence path,
    with its results' shapes, for a host where the class itself refuses to start (no P2P
    NVLink: one GPU shared by every rank)."""

    def __init__(self, full: torch.Tensor, metainfo: torch.Tensor, rank: int, ep_size: int,
                 top_k: int, num_experts: int, hidden_size: int, pdl: bool):
        self.full, self.metainfo, self.rank, self.ep_size = full, metainfo, rank, ep_size
        self.top_k, self.num_experts, self.hidden_size, self.pdl = top_k, num_experts, hidden_size, pdl
        self.workspace = full[:, :int(metainfo[layout_index()["WORKSPACE_SIZE_INDEX"]])]
        self._round = None

    def dispatch(self, hidden_states, topk_ids, topk_weights=None, *, hidden_states_scale=None,
                 runtime_max_tokens_per_rank=None):
        from types import SimpleNamespace

        payloads = [aligned16(p) for p in (hidden_states, hidden_states_scale, topk_ids,
                                           topk_weights) if p is not None]
        R, W = runtime_max_tokens_per_rank, self.ep_size
        offsets, comb, _ = module().moe_a2a_dispatch(
            topk_ids, payloads, self.workspace, self.metainfo, R, self.rank, W, self.top_k,
            self.num_experts, None, False, -1, INVALID_EXPERT_ID, False, False, None, TIMEOUT_S,
            self.pdl)
        mine = self.workspace[self.rank]
        recv = [mine.narrow(0, int(o), W * R * p.shape[1] * p.element_size()).view(p.dtype)
                .view(W * R, p.shape[1]) for o, p in zip(offsets, payloads)]
        self._round = (R, topk_ids.shape[0], int(comb))
        names = ["hidden_states"] + (["hidden_states_scale"] if hidden_states_scale is not None
                                     else []) + ["topk_ids", "topk_weights"]
        got = dict(hidden_states_scale=None)
        got.update(zip(names, recv))
        return SimpleNamespace(**got)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        R, n, comb = self._round
        payload = expert_output.reshape(self.ep_size, R, -1).contiguous()
        out = torch.empty(n, payload.shape[-1], dtype=payload.dtype, device=payload.device)
        module().moe_a2a_combine(payload, n, self.workspace, self.metainfo, R, self.rank,
                                 self.ep_size, self.top_k, comb, False, False, False, False, None,
                                 out, TIMEOUT_S, self.pdl, False)
        self._round = None
        return out


@dataclass
class _Workspace:
    full: torch.Tensor  # [W, size + GUARD]
    ws: torch.Tensor  # [W, size]: what FlashInfer is handed
    metainfo: torch.Tensor


class SingleGpuA2A074:
    """Every rank of a world on one GPU, FlashInfer 0.7.4 (the interface of ``SingleGpuA2A``)."""

    MAX_WORKSPACES = 16

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._workspaces: "OrderedDict[tuple, _Workspace]" = OrderedDict()
        self._streams: List[torch.cuda.Stream] = []
        from flashinfer.utils import device_support_pdl

        self._pdl = bool(device_support_pdl(self.device))
        self._index = layout_index()  # loads (or JIT-builds once) the module
        self.dead: Optional[str] = None

    def run(self, world: World, runtimes: Sequence[int]) -> GpuRoundTrip:
        if self.dead:
            raise CudaContextDead(f"this process's CUDA context died earlier ({self.dead}); "
                                  f"restart the process to run GPU kernels again")
        try:
            return self._run(world, list(runtimes))
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if type(exc).__name__ == "AcceleratorError" or "CUDA error" in text:
                self.dead = f"{text.splitlines()[0][:200]} while running {world!r}"
            raise

    def byte_model(self, world: World) -> Dict[str, Tuple[int, int]]:
        moe = world.moe
        return byte_model_074(world.ep_size, world.max_num_tokens, moe.top_k,
                              moe.dispatch_bytes, moe.combine_bytes)

    def _streams_for(self, n: int) -> List[torch.cuda.Stream]:
        while len(self._streams) < n:
            self._streams.append(torch.cuda.Stream(device=self.device))
        return self._streams[:n]

    def _workspace(self, world: World) -> _Workspace:
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        key = (W, cap, moe.top_k, moe.dispatch_bytes, moe.combine_bytes)
        if key in self._workspaces:
            self._workspaces.move_to_end(key)
            return self._workspaces[key]
        while len(self._workspaces) >= self.MAX_WORKSPACES:
            self._workspaces.popitem(last=False)
        meta = flashinfer_layout(W, cap, moe.top_k, moe.dispatch_bytes, moe.combine_bytes)
        size = int(meta[layout_index()["WORKSPACE_SIZE_INDEX"]])
        full = torch.empty((W, size + GUARD), dtype=torch.uint8, device=self.device)
        full[:, size:] = GUARD_BYTE
        ws = full[:, :size]
        for r in range(W):
            module().moe_a2a_initialize(ws, meta, r, W)
        self._workspaces[key] = _Workspace(full, ws, meta)
        return self._workspaces[key]

    def _refused(self, world: World, runtimes: List[int], space: _Workspace, dev) -> List[str]:
        """Call FlashInfer first on every rank it would refuse (it raises before launching);
        returns the refusals, or [] when every rank's call is acceptable."""
        moe, W = world.moe, world.ep_size
        suspects = [r for r in range(W) if not 0 < runtimes[r] <= world.max_num_tokens
                    or world.rows_per_rank[r] > runtimes[r]]
        found = []
        for r in suspects:
            ids, payloads = torch_ops.rank_inputs(dev, r, moe.payloads)
            try:
                self._dispatch(r, world, runtimes[r], space, ids, payloads)
            except Exception as exc:  # noqa: BLE001 - TVM-FFI raises its own error types
                found.append(f"FlashInfer 0.7.4 refused rank {r} ({world.rows_per_rank[r]} rows, "
                             f"runtime {runtimes[r]}): {str(exc).splitlines()[-1][:200]}; no "
                             f"peer was launched (it would wait timeout_sec and trap)")
                continue
            raise AssertionError(f"FlashInfer 0.7.4 launched rank {r} with {world.rows_per_rank[r]}"
                                 f" rows and runtime {runtimes[r]}: the gate expected a refusal")
        return found

    def _dispatch(self, r, world, runtime, space, ids, payloads):
        moe = world.moe
        payloads = [aligned16(p) for p in payloads]
        return module().moe_a2a_dispatch(
            ids.view(torch.int32), payloads, space.ws, space.metainfo, runtime, r, world.ep_size,
            moe.top_k, moe.num_experts, None, False, -1, INVALID_EXPERT_ID, False, False, None,
            TIMEOUT_S, self._pdl)

    # --- the per-generation steps (``gpu/sequence.py`` runs rounds back to back on them) ----
    def space(self, world: World) -> _Workspace:
        return self._workspace(world)

    def _launch_dispatch(self, world: World, runtimes: Sequence[int], space: _Workspace, dev,
                         streams) -> Tuple[list, list]:
        """Every rank's dispatch on its own stream, launched before any is waited for: each
        rank's receive planes ``[W, R, n]`` and combine offset (rank 0's offsets are kept for
        the byte model)."""
        moe, W, ws = world.moe, world.ep_size, space.ws

        def dispatch(r):
            ids, payloads = torch_ops.rank_inputs(dev, r, moe.payloads)
            offsets, comb_off, _ = self._dispatch(r, world, runtimes[r], space, ids, payloads)
            R = runtimes[r]
            if r == 0:
                self._rank0_offsets = ([int(o) for o in offsets], int(comb_off))
            return ([ws[r].narrow(0, int(o), W * R * p.shape[1] * p.element_size())
                     .view(p.dtype).view(W, R, p.shape[1]) for o, p in zip(offsets, payloads)],
                    int(comb_off))
        done = torch_ops.per_rank_on_streams(streams[:W], self.device, dispatch)
        return [planes for planes, _ in done], [off for _, off in done]

    def _launch_combine(self, world: World, runtimes: Sequence[int], space: _Workspace, outs,
                        combine_offsets, streams) -> List[torch.Tensor]:
        """Every rank's combine on its own stream: each rank's combined rows."""
        moe, W = world.moe, world.ep_size
        results = [torch.empty(world.rows_per_rank[r], moe.hidden_size, dtype=torch.bfloat16,
                               device=self.device) for r in range(W)]

        def combine(r):
            payload = outs[r].reshape(W, runtimes[r], moe.hidden_size).contiguous()
            module().moe_a2a_combine(
                payload, world.rows_per_rank[r], space.ws, space.metainfo, runtimes[r], r, W,
                moe.top_k, combine_offsets[r], False, False, False, False, None, results[r],
                TIMEOUT_S, self._pdl, False)
        torch_ops.per_rank_on_streams(streams[:W], self.device, combine)
        return results

    def _run(self, world: World, runtimes: List[int]) -> GpuRoundTrip:
        moe, W = world.moe, world.ep_size
        space = self._workspace(world)
        ws = space.ws
        model = self.byte_model(world)
        off = w074.offsets(W, world.max_num_tokens, moe.top_k,
                           w074.dispatch_capacity(W, world.max_num_tokens, moe.dispatch_bytes),
                           w074.combine_capacity(W, world.max_num_tokens, moe.combine_bytes))
        inputs = make_inputs(world)
        dev = torch_ops.device_inputs(inputs, self.device)
        refused = self._refused(world, runtimes, space, dev)
        if refused:
            return GpuRoundTrip(tuple(refused), model)
        ws[:, off.dispatch_payload:off.dispatch_payload + off.dispatch_payload_size].fill_(POISON)
        ws[:, off.combine_input:off.combine_input + off.combine_input_size].fill_(POISON)
        streams = self._streams_for(W)
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        recv, combine_offsets = self._launch_dispatch(world, runtimes, space, dev, streams)
        lay = world.layout(runtimes[0])
        offsets, comb_off = self._rank0_offsets
        model["recv_offsets"] = (list(lay.recv_offsets), offsets)
        model["combine_offset"] = (lay.combine_offset, comb_off)
        for s in streams:
            main.wait_stream(s)
        # this round's bank, picked by flag_val as the kernel picks it: [W, W] int32 as bytes
        flags = ws[:, off.flag_val:off.flag_val + 4].contiguous().view(torch.int32).long()
        bank = ((flags - 1) >> 1) & 1  # [W, 1]
        banks = ws[:, off.recv_counters:off.recv_counters + 8 * W].contiguous().view(
            torch.int32).view(W, 2, W)
        counts = banks.gather(1, bank.view(W, 1, 1).expand(W, 1, W)).view(W, W).contiguous()\
            .view(torch.uint8)
        same = len(set(runtimes)) == 1
        if same:
            stacked = [torch.stack(planes) for planes in zip(*recv)]
            outs = list(torch_ops.expert_outputs(stacked, runtimes[0], moe, range(W), W).unbind(0))
            poisoned = [poisoned_rows(stacked)]
        else:
            outs = [torch_ops.expert_outputs(recv[r], runtimes[r], moe, r, W) for r in range(W)]
            poisoned = [poisoned_rows(recv[r]) for r in range(W)]
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        results = self._launch_combine(world, runtimes, space, outs, combine_offsets, streams)
        for s in streams:
            main.wait_stream(s)
        guard = (space.full[:, ws.shape[1]:] == GUARD_BYTE).all()
        return verdict(world, inputs, runtimes, guard, counts, poisoned, results, model,
                       "FlashInfer 0.7.4")
