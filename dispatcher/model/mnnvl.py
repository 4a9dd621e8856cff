"""The byte model of FlashInfer 0.7.2's MoE A2A (``MoeAlltoAll``, the MNNVL kernels; 0.7.2.post1
has the same files), exact to the byte.

Mirrors ``calculateOffsets`` / ``moeA2ADispatchOp`` / ``moeA2ACombineIntoOp`` in
``flashinfer/data/csrc/trtllm_moe_alltoall.cu`` and ``moe_a2a_get_workspace_size_per_rank`` in
``flashinfer/comm/trtllm_moe_alltoall.py``. Every offset the emulator and the GPU tiers use
comes from here; the GPU tier checks ``workspace_size_per_rank`` against FlashInfer's own.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

from .payloads import ALIGN, INT32, Layout, PayloadSpec, pad

__all__ = ["ALIGN", "MAX_TOP_K", "MAX_PAYLOADS", "MAX_RANKS", "SUPPORTED_TOP_K", "AuxOffsets",
           "aux_offsets", "aux_size", "workspace_size_per_rank", "layout"]

MAX_TOP_K = 22  # kMaxTopK
MAX_PAYLOADS = 6  # kMaxPayloads
MAX_RANKS = 64  # kMaxRanks
SUPPORTED_TOP_K = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)  # the kernel's TOP_K switch


@dataclass(frozen=True)
class AuxOffsets:
    flag_val: int
    local_token_counter: int
    send_counters: int
    recv_counters: int
    dispatch_completion_flags: int
    combine_completion_flags: int
    topk_target_ranks: int
    topk_send_indices: int
    eplb_gathered_stats: int
    payload_data: int  # == aux size


@functools.lru_cache(maxsize=4096)  # pure; asked once per rank a dispatcher is constructed for
def aux_offsets(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> AuxOffsets:
    """``calculateOffsets`` from trtllm_moe_alltoall.cu."""
    o = 0
    flag_val = o
    o += INT32
    local_token_counter = o
    o += INT32
    send_counters = o
    o += ep_size * INT32
    recv_counters = o
    o += ep_size * INT32
    o = pad(o)
    dispatch_flags = o
    o += ep_size * INT32
    o = pad(o)
    combine_flags = o
    o += ep_size * INT32
    o = pad(o)
    target_ranks = o
    o += max_num_tokens * MAX_TOP_K * INT32
    o = pad(o)
    send_indices = o
    o += max_num_tokens * MAX_TOP_K * INT32
    o = pad(o)
    eplb = o
    o += ep_size * eplb_stats_num_experts * INT32
    o = pad(o)
    return AuxOffsets(flag_val, local_token_counter, send_counters, recv_counters,
                      dispatch_flags, combine_flags, target_ranks, send_indices, eplb, o)


def aux_size(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> int:
    """``moe_a2a_get_aux_data_size``."""
    return aux_offsets(ep_size, max_num_tokens, eplb_stats_num_experts).payload_data


def workspace_size_per_rank(ep_size: int, max_num_tokens: int, dispatch_bytes_per_token: int,
                            combine_bytes: int, eplb_stats_num_experts: int = 0) -> int:
    """``moe_a2a_get_workspace_size_per_rank``: what the dispatcher allocates once, for the cap."""
    return (pad(aux_size(ep_size, max_num_tokens, eplb_stats_num_experts))
            + pad(ep_size * max_num_tokens * dispatch_bytes_per_token)
            + pad(ep_size * max_num_tokens * combine_bytes))


def layout(ep_size: int, max_num_tokens: int, runtime: int, payloads: Tuple[PayloadSpec, ...],
           combine_bytes: int, eplb_stats_num_experts: int = 0) -> Layout:
    """``moeA2ADispatchOp``'s receive planes and combine offset for ``runtime`` rows.

    Raises ``ValueError`` exactly where the C++ op's checks would (runtime <= 0, payload
    count, misaligned planes); it does *not* check the workspace size: compare
    ``bytes_needed`` with ``workspace_size_per_rank`` for that.
    """
    if runtime <= 0:
        raise ValueError(f"runtime_max_tokens_per_rank must be > 0, got {runtime}")
    if not 0 < len(payloads) <= MAX_PAYLOADS:
        raise ValueError(f"between 1 and {MAX_PAYLOADS} payloads, got {len(payloads)}")
    offset = aux_size(ep_size, max_num_tokens, eplb_stats_num_experts)
    total = 0
    recv = []
    for i, p in enumerate(payloads):
        recv.append(offset + total)
        total += ep_size * runtime * p.bytes_per_token
        if total % p.element_size:
            raise ValueError(f"misaligned payload buffer {i} ({p.name}) with element size "
                             f"{p.element_size}")
    dispatch_end = offset + total
    combine_offset = pad(dispatch_end)
    return Layout(ep_size, runtime, tuple(payloads), combine_bytes, tuple(recv), dispatch_end,
                  combine_offset, combine_offset + ep_size * runtime * combine_bytes)
