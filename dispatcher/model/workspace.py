"""FlashInfer MoE A2A workspace byte model, exact to the byte (FlashInfer 0.7.2.post1).

Mirrors ``calculateOffsets`` / ``moeA2ADispatchOp`` / ``moeA2ACombineIntoOp`` in
``flashinfer/data/csrc/trtllm_moe_alltoall.cu`` and ``moe_a2a_get_workspace_size_per_rank`` in
``flashinfer/comm/trtllm_moe_alltoall.py``. Every offset the emulator and the GPU tiers use
comes from here; the GPU tier checks ``workspace_size_per_rank`` against FlashInfer's own.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Tuple

__all__ = [
    "ALIGN",
    "MAX_TOP_K",
    "MAX_PAYLOADS",
    "SUPPORTED_TOP_K",
    "PayloadFormat",
    "HIDDEN_MULTIPLE",
    "PayloadSpec",
    "dispatch_payloads",
    "combine_bytes_per_token",
    "aux_offsets",
    "aux_size",
    "workspace_size_per_rank",
    "Layout",
    "layout",
]

ALIGN = 128  # kCachelineAlignment
MAX_TOP_K = 22  # kMaxTopK
MAX_PAYLOADS = 6  # kMaxPayloads
SUPPORTED_TOP_K = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)  # the kernel's TOP_K switch
INT32 = 4


def pad(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class PayloadFormat(enum.Enum):
    """How hidden states travel in dispatch (combine is always bf16)."""

    BF16 = "bf16"
    NVFP4 = "nvfp4"  # e2m1 packed two per byte + one fp8 scale per 16 elements
    MXFP8 = "mxfp8"  # fp8 per element + one ue8m0 scale per 32 elements


# Hidden sizes each format can dispatch: the int32 planes after the hidden payloads must stay
# 4-byte aligned for every ep_size * runtime (the C++ op's "Misaligned payload buffer" check).
HIDDEN_MULTIPLE = {PayloadFormat.BF16: 2, PayloadFormat.NVFP4: 64, PayloadFormat.MXFP8: 128}


@dataclass(frozen=True)
class PayloadSpec:
    """One dispatch payload: its bytes per token and element size (the kernel's alignment
    check works in elements)."""

    name: str
    bytes_per_token: int
    element_size: int


def dispatch_payloads(fmt: PayloadFormat, hidden_size: int, top_k: int) -> Tuple[PayloadSpec, ...]:
    """The payload list a dispatcher hands to ``moe_a2a_dispatch``, in order."""
    h = hidden_size
    if fmt is PayloadFormat.BF16:
        hidden = (PayloadSpec("hidden_states", 2 * h, 2),)
    elif fmt is PayloadFormat.NVFP4:
        if h % HIDDEN_MULTIPLE[fmt]:
            raise ValueError(f"NVFP4 dispatch needs hidden_size % 64 == 0 (4-byte aligned "
                             f"int32 plane after the scales), got {h}")
        hidden = (PayloadSpec("hidden_fp4", h // 2, 1), PayloadSpec("hidden_sf", h // 16, 1))
    elif fmt is PayloadFormat.MXFP8:
        if h % HIDDEN_MULTIPLE[fmt]:
            raise ValueError(f"MXFP8 dispatch needs hidden_size % 128 == 0 (4-byte aligned "
                             f"int32 plane after the scales), got {h}")
        hidden = (PayloadSpec("hidden_fp8", h, 1), PayloadSpec("hidden_sf", h // 32, 1))
    else:  # pragma: no cover - enum is closed
        raise ValueError(fmt)
    return hidden + (
        PayloadSpec("topk_ids", INT32 * top_k, INT32),
        PayloadSpec("topk_weights", INT32 * top_k, INT32),
    )


def combine_bytes_per_token(hidden_size: int) -> int:
    return 2 * hidden_size  # bf16 expert output


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


@dataclass(frozen=True)
class Layout:
    """Where one dispatch/combine call with a given runtime puts things inside one rank's
    workspace (offsets relative to that rank's region)."""

    ep_size: int
    runtime: int
    payloads: Tuple[PayloadSpec, ...]
    combine_bytes: int
    recv_offsets: Tuple[int, ...]  # start of each payload's [ep_size, runtime, bytes] plane
    dispatch_end: int  # PAYLOAD_DATA_OFFSET + sum of planes: the C++ ``requiredSize``
    combine_offset: int  # pad(dispatch_end)
    combine_end: int  # combine_offset + ep_size * runtime * combine_bytes

    @property
    def bytes_needed(self) -> int:
        """The bytes one dispatch + combine pair touches in each rank's workspace."""
        return max(self.dispatch_end, self.combine_end)


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
