"""FlashInfer 0.7.4's MoE A2A (``NVLinkOneSidedAlltoAll``, the NVLink one-sided kernels) on the
GPU: its raw module, the rank ops a process on a shared workspace runs (``RawA2A``, for the
rank pool) and ``Ops``, the raw per-rank ops the single-GPU driver (``single.py``) runs.

0.7.4 has no public functional API; ``NVLinkOneSidedAlltoAll`` allocates its own workspace. The
raw module behind it (``get_nvlink_one_sided_alltoall_module()``) lays out a workspace
(``moe_a2a_get_workspace_layout``), initialises, dispatches and combines touching only local
state, on a caller-owned ``uint8 [W, bytes]`` CUDA tensor whose rank slices are 128-aligned, so
one process still runs every rank, as for 0.7.2: the workspace is ours, with guard bytes after
each rank's slice and the dispatch and combine regions poisoned before each example; the same
checks (output, counts, guards, stale rows, byte model). The fence path runs (no CFT, no
Lamport: an H200 has neither), with a short ``timeout_sec`` so a peer that is never launched
traps in seconds, not 300. Before any rank launches, every rank whose call 0.7.4 would refuse
(its rows over its runtime, a runtime <= 0 or over the cap) is called first: FlashInfer refuses
it without launching anything, the refusal is reported with the world, and no peer is left
spinning.
"""
from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

import torch

from ..emulator.a2a import POISON
from ..model import one_sided as w074
from ..model.world import World
from . import torch_ops
from .checks import ranks_refused, refusal

__all__ = ["Ops", "PoolOps", "RawA2A", "TIMEOUT_S", "module", "metainfo_index",
           "flashinfer_layout", "byte_model", "aligned16"]

TIMEOUT_S = 20  # timeout_sec of every wait on a peer (FlashInfer's default: 300)
INVALID_EXPERT_ID = -1


@lru_cache(maxsize=None)
def module():
    from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels import (
        get_nvlink_one_sided_alltoall_module)

    return get_nvlink_one_sided_alltoall_module()


@lru_cache(maxsize=None)
def metainfo_index() -> Dict[str, int]:
    names, values = module().moe_a2a_get_metainfo_index_pairs()
    return {str(n).replace("MOE_A2A_", ""): int(v) for n, v in zip(names, values)}


def flashinfer_layout(ep_size: int, cap: int, top_k: int, dispatch_bytes: int,
                      combine_bytes: int) -> torch.Tensor:
    """FlashInfer's metainfo for the fence path, as ``NVLinkOneSidedAlltoAll`` asks for it."""
    idx = metainfo_index()
    meta = torch.empty(idx["NUM_METAINFO_FIELDS"], dtype=torch.int64)
    module().moe_a2a_get_workspace_layout(
        ep_size, cap, top_k, w074.dispatch_capacity(ep_size, cap, dispatch_bytes),
        w074.combine_capacity(ep_size, cap, combine_bytes), 0, 0, False, meta)
    return meta


def byte_model(ep_size: int, cap: int, top_k: int, dispatch_bytes: int,
                   combine_bytes: int) -> Dict[str, Tuple[int, int]]:
    """Our offsets next to FlashInfer's metainfo (a host function: no kernel launched)."""
    meta, idx = flashinfer_layout(ep_size, cap, top_k, dispatch_bytes, combine_bytes), metainfo_index()
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


class RawA2A:
    """One rank's end of 0.7.4's raw module ops on a workspace shared by every rank (a CUDA IPC
    mapping of one allocation): the calls ``NVLinkOneSidedAlltoAll`` makes on the fence path,
    with its results' shapes, for a host where the class itself refuses to start (no P2P
    NVLink: one GPU shared by every rank)."""

    def __init__(self, full: torch.Tensor, metainfo: torch.Tensor, rank: int, ep_size: int,
                 top_k: int, num_experts: int, hidden_size: int, pdl: bool):
        self.full, self.metainfo, self.rank, self.ep_size = full, metainfo, rank, ep_size
        self.top_k, self.num_experts, self.hidden_size, self.pdl = top_k, num_experts, hidden_size, pdl
        self.workspace = full[:, :int(metainfo[metainfo_index()["WORKSPACE_SIZE_INDEX"]])]
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
class Space:
    full: torch.Tensor  # [W, size + GUARD]
    ws: torch.Tensor  # [W, size]: what FlashInfer is handed
    metainfo: torch.Tensor


def _offsets(world: World):
    return w074.offsets_for(world.ep_size, world.max_num_tokens, world.moe.payloads,
                            world.moe.combine_bytes)


class Ops:
    """0.7.4's raw module ops on a caller-owned ``[W, size + guard]`` workspace, one rank at a
    time (the calls ``NVLinkOneSidedAlltoAll`` makes on the fence path)."""

    def __init__(self, device):
        from .torch_ops import pdl_default

        self.device = device
        self._pdl = pdl_default(device)
        self._index = metainfo_index()  # loads (or JIT-builds once) the module

    def key(self, world: World) -> tuple:
        moe = world.moe
        return (world.ep_size, world.max_num_tokens, moe.top_k, moe.dispatch_bytes,
                moe.combine_bytes)

    def _meta(self, world: World) -> torch.Tensor:
        moe = world.moe
        return flashinfer_layout(world.ep_size, world.max_num_tokens, moe.top_k,
                                 moe.dispatch_bytes, moe.combine_bytes)

    def size(self, world: World) -> int:
        return int(self._meta(world)[self._index["WORKSPACE_SIZE_INDEX"]])

    def initialize(self, world: World, full: torch.Tensor, ws: torch.Tensor) -> Space:
        meta = self._meta(world)
        for r in range(world.ep_size):
            module().moe_a2a_initialize(ws, meta, r, world.ep_size)
        return Space(full, ws, meta)

    def byte_model(self, world: World, space: Space = None) -> Dict[str, Tuple[int, int]]:
        moe = world.moe
        return byte_model(world.ep_size, world.max_num_tokens, moe.top_k, moe.dispatch_bytes,
                          moe.combine_bytes)

    def refused(self, world: World, runtimes, space: Space, dev) -> List[str]:
        """Call FlashInfer first on every rank it would refuse (it raises before launching);
        returns the refusals, or [] when every rank's call is acceptable."""
        moe = world.moe
        found = []
        for r in ranks_refused(world, runtimes):
            ids, payloads = torch_ops.rank_inputs(dev, r, moe.payloads)
            try:
                self._dispatch(r, world, runtimes[r], space, ids, payloads)
            except Exception as exc:  # noqa: BLE001 - TVM-FFI raises its own error types
                found.append(refusal(world, r, runtimes[r], str(exc).splitlines()[-1][:200]))
                continue
            raise AssertionError(f"{world.generation} launched rank {r} with "
                                 f"{world.rows_per_rank[r]} rows and runtime {runtimes[r]}: the "
                                 f"gate expected a refusal")
        return found

    def poison(self, world: World, space: Space) -> None:
        off = _offsets(world)
        space.ws[:, off.dispatch_payload:off.dispatch_payload + off.dispatch_payload_size]\
            .fill_(POISON)
        space.ws[:, off.combine_input:off.combine_input + off.combine_input_size].fill_(POISON)

    def _dispatch(self, r, world, runtime, space, ids, payloads):
        moe = world.moe
        payloads = [aligned16(p) for p in payloads]
        return module().moe_a2a_dispatch(
            ids.view(torch.int32), payloads, space.ws, space.metainfo, runtime, r, world.ep_size,
            moe.top_k, moe.num_experts, None, False, -1, INVALID_EXPERT_ID, False, False, None,
            TIMEOUT_S, self._pdl)

    def dispatch(self, r: int, world: World, runtime: int, space: Space, ids, payloads):
        """Rank ``r``'s dispatch: its receive planes ``[W, R, n]`` and its combine offset
        (rank 0's plane offsets are kept for the byte model)."""
        W, ws = world.ep_size, space.ws
        offsets, comb_off, _ = self._dispatch(r, world, runtime, space, ids, payloads)
        if r == 0:
            self._rank0_offsets = [int(o) for o in offsets]
        return ([ws[r].narrow(0, int(o), W * runtime * p.shape[1] * p.element_size())
                 .view(p.dtype).view(W, runtime, p.shape[1]) for o, p in zip(offsets, payloads)],
                int(comb_off))

    def round_model(self, world: World, runtimes, combine_offsets) -> Dict[str, Tuple]:
        lay = world.layout(runtimes[0])
        return {"recv_offsets": (list(lay.recv_offsets), self._rank0_offsets),
                "combine_offset": (lay.combine_offset, int(combine_offsets[0]))}

    def counts(self, world: World, space: Space) -> torch.Tensor:
        """This round's bank, picked by flag_val as the kernel picks it: int32 ``[W, W]`` as
        bytes."""
        off, W, ws = _offsets(world), world.ep_size, space.ws
        flags = ws[:, off.flag_val:off.flag_val + 4].contiguous().view(torch.int32).long()
        bank = ((flags - 1) >> 1) & 1  # [W, 1]
        banks = ws[:, off.recv_counters:off.recv_counters + 8 * W].contiguous().view(
            torch.int32).view(W, 2, W)
        return banks.gather(1, bank.view(W, 1, 1).expand(W, 1, W)).view(W, W).contiguous()\
            .view(torch.uint8)

    def combine(self, r: int, world: World, runtime: int, space: Space, out,
                combine_offset) -> torch.Tensor:
        moe, W = world.moe, world.ep_size
        result = torch.empty(world.rows_per_rank[r], moe.hidden_size, dtype=torch.bfloat16,
                             device=self.device)
        payload = out.reshape(W, runtime, moe.hidden_size).contiguous()
        module().moe_a2a_combine(
            payload, world.rows_per_rank[r], space.ws, space.metainfo, runtime, r, W, moe.top_k,
            combine_offset, False, False, False, False, None, result, TIMEOUT_S, self._pdl, False)
        return result


def _poison(a2a, rank: int, idx) -> None:
    """POISON in this rank's dispatch and combine regions (never the counters or flags)."""

    for name in ("DISPATCH_PAYLOAD", "COMBINE_INPUT"):
        at = int(a2a.metainfo[idx[f"{name}_OFFSET_INDEX"]])
        a2a.workspace[rank][at:at + int(a2a.metainfo[idx[f"{name}_SIZE_INDEX"]])].fill_(POISON)
    torch.cuda.synchronize()


def _round_counts(rank_bytes, metainfo, idx, ep_size):
    """This round's receive counts (int32 [W] as bytes, on the device): 0.7.4 keeps two banks
    and the round's is picked by ``flag_val`` as the kernel picks it (never a count of our own,
    which a refused call would put out of step)."""
    fv = int(metainfo[idx["FLAG_VAL_OFFSET_INDEX"]])
    rc = int(metainfo[idx["RECV_COUNTERS_OFFSET_INDEX"]])
    flag = rank_bytes[fv:fv + 4].view(torch.int32).long()
    bank = ((flag - 1) >> 1) & 1
    banks = rank_bytes[rc:rc + 8 * ep_size].view(torch.int32).view(2, ep_size)
    return banks.index_select(0, bank).reshape(-1).contiguous().view(torch.uint8)


def _shared_workspace(state, rank, ep_size, moe, cap):
    """0.7.4's raw ops on one workspace allocated by rank 0 and mapped into every rank by CUDA
    IPC (all ranks on one GPU), laid out and initialised as NVLinkOneSidedAlltoAll does
    (collective: every rank calls it for the same shape)."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from .checks import GUARD, GUARD_BYTE

    meta = flashinfer_layout(ep_size, cap, moe.top_k, moe.dispatch_bytes, moe.combine_bytes)
    size = int(meta[metainfo_index()["WORKSPACE_SIZE_INDEX"]])
    box = [None]
    if rank == 0:
        full = torch.empty((ep_size, size + GUARD), dtype=torch.uint8, device="cuda")
        full[:, size:] = GUARD_BYTE
        torch.cuda.synchronize()
        box = [pickle.dumps(reduce_tensor(full))]
    dist.broadcast_object_list(box, src=0, group=state["cpu"])
    if rank != 0:
        rebuild, args = pickle.loads(box[0])
        full = rebuild(*args)
    module().moe_a2a_initialize(full[:, :size], meta, rank, ep_size)
    torch.cuda.synchronize()
    dist.barrier(group=state["cpu"])  # no peer publishes before every rank cleared its slice
    from .torch_ops import pdl_default

    return RawA2A(full, meta, rank, ep_size, moe.top_k, moe.num_experts, moe.hidden_size,
                  pdl_default(torch.device("cuda", torch.cuda.current_device())))


class PoolOps:
    """0.7.4's kernels on one rank of the rank pool (``gpu/ops.py: PoolOps``): each rank's
    ``NVLinkOneSidedAlltoAll``, one per cap and MoE shape (0.7.4 bakes top_k and the payload
    bytes into the layout), built over the pool's process group as an engine builds it, fence
    path, a short ``timeout_sec``; on a host whose platform check refuses the class (one GPU,
    no P2P NVLink), its raw ops on one CUDA-IPC-shared workspace. A call 0.7.4 refuses (a
    rank's rows over its runtime) is made by the refused rank alone: FlashInfer refuses it
    before any launch and no peer is left spinning."""

    def key(self, world: World):
        moe = world.moe
        return (world.max_num_tokens, moe.top_k, moe.hidden_size, moe.payload, moe.num_experts)

    def build(self, state, rank, ep_size, world, max_dispatch_bytes, max_combine_bytes):
        from flashinfer.moe_ep import (BootstrapConfig, MoEEpCommParams, NVLinkOneSidedAlltoAll,
                                       NVLinkOneSidedConfig)

        moe, cap = world.moe, world.max_num_tokens
        if state.get("a2a_path") != "shared workspace":
            params = MoEEpCommParams(num_experts=moe.num_experts, top_k=moe.top_k,
                                     max_tokens_per_rank=cap, hidden_size=moe.hidden_size,
                                     dtype=torch.bfloat16, invalid_expert_id=INVALID_EXPERT_ID)
            try:  # the class an engine builds (its platform check is collective: all or none)
                a2a = NVLinkOneSidedAlltoAll(
                    BootstrapConfig(world_size=ep_size, rank=rank,
                                    device=torch.cuda.current_device()),
                    params, NVLinkOneSidedConfig(timeout_sec=TIMEOUT_S, cft=False, lamport=False))
                state["a2a_path"] = "NVLinkOneSidedAlltoAll"
                return a2a
            except RuntimeError as exc:
                if "NVLink backends are not supported" not in str(exc):
                    raise
                state["a2a_path"] = "shared workspace"
                print(f"[rank {rank}] NVLinkOneSidedAlltoAll refused this host ({exc}); its "
                      f"raw ops run on one CUDA-IPC-shared workspace instead", file=sys.stderr)
        return _shared_workspace(state, rank, ep_size, moe, cap)

    def poison(self, a2a, rank, state) -> None:
        _poison(a2a, rank, state["index"])

    def refuses(self, world: World, runtimes) -> List[int]:
        return [r for r in range(world.ep_size) if world.rows_per_rank[r] > runtimes[r]]

    def dispatch(self, a2a, world, rank, ep_size, runtime, ids, payloads):
        scale = payloads[1] if len(payloads) == 4 else None
        res = a2a.dispatch(payloads[0], ids.view(torch.int32), payloads[-1],
                           hidden_states_scale=scale, runtime_max_tokens_per_rank=runtime)
        planes = [res.hidden_states] + ([res.hidden_states_scale] if scale is not None else [])
        recv = [p.view(ep_size, runtime, -1) for p in planes + [res.topk_ids, res.topk_weights]]
        # the fence path sanitizes the expert ids of padding rows (-1): the other planes stay poison
        return recv, [p for i, p in enumerate(recv) if i != len(planes)]

    def counts(self, a2a, rank, ep_size, state):
        return _round_counts(a2a.workspace[rank], a2a.metainfo, state["index"], ep_size)

    def combine(self, a2a, world, y, runtime):
        return a2a.combine(y)
