"""FlashInfer 0.7.2's MoE A2A (``MoeAlltoAll``, the MNNVL kernels) on the GPU, imported in one
place (lazily: CPU machines never import it): the module, ``MoeAlltoAll`` bootstrapped as SGLang
does, and ``Ops``, the raw per-rank ops the single-GPU driver (``single.py``) runs.

The single-GPU tier drives the functional API (``moe_a2a_initialize / _dispatch / _combine``)
on a workspace it allocates itself, which is the only way to run every EP rank in one process
and to put guard bytes after each rank's region. The multi-GPU tier uses ``MoeAlltoAll``, the
class SGLang's ``FlashinferDispatcher`` constructs, so the gate runs what production runs; its
0.7.x deprecation warning (in favour of ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``, a
wrapper over the same class that needs the moe_ep bootstrap) is silenced for that one call.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

import torch

from ..emulator.a2a import POISON
from ..model.mnnvl import aux_offsets, aux_size
from ..model.world import World
from .torch_ops import pdl_default

__all__ = ["comm", "module", "metainfo_index", "new_moe_alltoall", "Ops", "PoolOps"]


@lru_cache(maxsize=None)
def comm():
    import flashinfer.comm as fc
    from flashinfer.comm import trtllm_moe_alltoall as ops

    return fc, ops


def module():
    """The compiled module (JIT-built once, or the AOT .so shipped inside the package)."""
    return comm()[1].get_moe_alltoall_module()


def metainfo_index() -> dict:
    names, values = module().moe_a2a_get_metainfo_index_pairs()
    return {str(n).replace("MOE_A2A_", ""): int(v) for n, v in zip(names, values)}


def new_moe_alltoall(ep_size: int, rank: int, max_num_tokens: int, top_k: int,
                     num_experts: int, workspace_size_per_rank: int):
    """``MoeAlltoAll`` bootstrapped as SGLang does (after ``init_process_group``; every rank
    calls this together)."""
    from flashinfer.comm import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig, TorchDistBackend

    _, ops = comm()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
        return ops.MoeAlltoAll(
            mapping=Mapping(world_size=ep_size, rank=rank, gpus_per_node=ep_size,
                            tp_size=ep_size, moe_ep_size=ep_size),
            max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
            workspace_size_per_rank=workspace_size_per_rank,
            mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend()))


@dataclass
class Space:
    """One (W, cap, size) workspace: ``full`` with the guard bytes, ``ws`` the view FlashInfer
    is handed, each rank's metainfo, FlashInfer's receive views (``recv_view_cache``, as its
    ``MoeAlltoAll`` keeps them) and the offsets FlashInfer put in the metainfo."""

    full: torch.Tensor
    ws: torch.Tensor
    metainfo: List[torch.Tensor]
    views: dict
    payload_data_offset: int
    recv_counters_offset: int


class Ops:
    """0.7.2's raw ops on a caller-owned ``[W, size + guard]`` workspace, one rank at a time
    (the functional API ``moe_a2a_initialize / _dispatch / _combine``)."""

    def __init__(self, device):
        self.device = device
        self._index = metainfo_index()
        self._pdl = pdl_default(device)

    def key(self, world: World) -> tuple:
        return (world.ep_size, world.max_num_tokens, world.workspace_size)

    def size(self, world: World) -> int:
        return world.workspace_size

    def initialize(self, world: World, full: torch.Tensor, ws: torch.Tensor) -> Space:
        _, ops = comm()
        W, cap = world.ep_size, world.max_num_tokens
        metainfo = [ops.moe_a2a_initialize(ws, r, W, cap) for r in range(W)]
        idx = self._index
        return Space(full, ws, metainfo, {}, int(metainfo[0][idx["PAYLOAD_DATA_OFFSET_INDEX"]]),
                     int(metainfo[0][idx["RECV_COUNTERS_OFFSET_INDEX"]]))

    def byte_model(self, world: World, space: Space = None) -> Dict[str, Tuple[int, int]]:
        """Our byte model next to FlashInfer's own numbers for this config."""
        moe, W, cap = world.moe, world.ep_size, world.max_num_tokens
        model = dict(_byte_model(W, cap, moe.dispatch_bytes, moe.combine_bytes,
                                 world.workspace_size))
        if space is not None:
            aux = aux_offsets(W, cap)
            model["payload_data_offset"] = (aux.payload_data, space.payload_data_offset)
            model["recv_counters_offset"] = (aux.recv_counters, space.recv_counters_offset)
        return model

    def refused(self, world: World, runtimes, space: Space, dev) -> List[str]:
        return []  # 0.7.2's op takes any positive runtime (the cap is a Python assert)

    def poison(self, world: World, space: Space) -> None:
        space.ws[:, aux_offsets(world.ep_size, world.max_num_tokens).payload_data:].fill_(POISON)

    def dispatch(self, r: int, world: World, runtime: int, space: Space, ids, payloads):
        """Rank ``r``'s dispatch: its receive planes ``[W, R, n]`` and its combine offset."""
        _, ops = comm()
        moe = world.moe
        out, comb_off, _ = ops.moe_a2a_dispatch(
            ids.view(torch.int32), payloads, space.ws, space.metainfo[r], runtime, r,
            world.ep_size, moe.top_k, moe.num_experts, enable_pdl=self._pdl,
            recv_view_cache=space.views)
        return out, comb_off

    def round_model(self, world: World, runtimes, combine_offsets) -> Dict[str, Tuple]:
        return {"combine_payload_offset": (world.layout(runtimes[0]).combine_offset,
                                           int(combine_offsets[0]))}

    def counts(self, world: World, space: Space) -> torch.Tensor:
        """The receive counters of the round just dispatched: int32 ``[W, W]`` as bytes."""
        at = aux_offsets(world.ep_size, world.max_num_tokens).recv_counters
        return space.ws[:, at:at + 4 * world.ep_size]

    def combine(self, r: int, world: World, runtime: int, space: Space, out,
                combine_offset) -> torch.Tensor:
        _, ops = comm()
        return ops.moe_a2a_combine(
            out, world.rows_per_rank[r], space.ws, space.metainfo[r], runtime, r, world.ep_size,
            world.moe.top_k, combine_offset, enable_pdl=self._pdl)


@lru_cache(maxsize=4096)
def _byte_model(ep_size: int, cap: int, dispatch_bytes: int, combine_bytes: int,
                workspace_size: int):
    """(name, (ours, FlashInfer's)) for one config: FlashInfer's answers are pure functions
    of these numbers, asked once per config."""
    _, ops = comm()
    theirs = ops.moe_a2a_get_workspace_size_per_rank(ep_size, cap, dispatch_bytes,
                                                     combine_bytes)
    return (("workspace_size_per_rank", (workspace_size, int(theirs))),
            ("aux_size", (aux_size(ep_size, cap),
                          int(module().moe_a2a_get_aux_data_size(ep_size, cap, 0)))))


class PoolOps:
    """0.7.2's kernels on one rank of the rank pool (``gpu/ops.py: PoolOps``): ``MoeAlltoAll``,
    one per cap, as SGLang builds it."""

    def key(self, world: World):
        return world.max_num_tokens

    def build(self, state, rank, ep_size, world, max_dispatch_bytes, max_combine_bytes):
        from ..model.mnnvl import workspace_size_per_rank

        cap = world.max_num_tokens
        size = workspace_size_per_rank(ep_size, cap, max_dispatch_bytes, max_combine_bytes)
        return new_moe_alltoall(ep_size, rank, cap, top_k=8, num_experts=max(64, ep_size),
                                workspace_size_per_rank=size)

    def poison(self, a2a, rank, state) -> None:
        a2a.workspace[rank][aux_offsets(a2a.ep_size, a2a.max_num_tokens).payload_data:].fill_(
            POISON)
        torch.cuda.synchronize()

    def refuses(self, world: World, runtimes) -> List[int]:
        return []  # 0.7.2's op takes any positive runtime (the cap is a Python assert)

    def dispatch(self, a2a, world, rank, ep_size, runtime, ids, payloads):
        moe = world.moe
        a2a.top_k, a2a.num_experts = moe.top_k, moe.num_experts
        recv = a2a.dispatch(ids.view(torch.int32), payloads, runtime)
        return recv, recv

    def counts(self, a2a, rank, ep_size, state):
        rc = int(a2a.metainfo[state["index"]["RECV_COUNTERS_OFFSET_INDEX"]])
        return a2a.workspace[rank][rc:rc + 4 * ep_size].clone()  # as dispatch left them

    def combine(self, a2a, world, y, runtime):
        return a2a.combine(y, runtime)
