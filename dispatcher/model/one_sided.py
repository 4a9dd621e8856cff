"""FlashInfer 0.7.4's MoE A2A workspace byte model (the NVLink one-sided rewrite), exact to the byte.

Mirrors ``calculateWorkspaceLayout`` and ``moeA2ADispatchOp`` in
``flashinfer/data/csrc/nvlink_one_sided_alltoall.cu`` and the payload capacities
``NVLinkOneSidedAlltoAll.__init__`` computes in
``flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py`` (fence path: no CFT
region, no Lamport regions, no EPLB statistics, as on an H200 and as our GPU tiers run it).
What changed from 0.7.2 (``mnnvl.py``): routing tables sized by top_k (was a fixed 22),
two banks of receive counters picked by round parity, a 256-aligned dispatch region whose
receive planes start on 128-byte boundaries, and a combine input region at a fixed offset (it
no longer follows the runtime). ``tests/cpu/test_workspace_bytes.py`` checks this module
against FlashInfer's own host C++ compiled from the release.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .payloads import INT32, Layout, PayloadSpec, pad

__all__ = ["ALIGN", "WORKSPACE_ALIGNMENT", "MAX_TOP_K", "MAX_PAYLOADS", "MAX_RANKS",
           "SUPPORTED_TOP_K", "Offsets", "offsets", "dispatch_capacity", "combine_capacity",
           "workspace_size_per_rank", "layout", "round_parity", "offsets_for"]

ALIGN = 128  # kCachelineAlignment
WORKSPACE_ALIGNMENT = 256  # meta::kWorkspaceAlignment
MAX_TOP_K = 22  # kMaxTopK
MAX_PAYLOADS = 4  # kMaxPayloads (0.7.2: 6)
MAX_RANKS = 256  # kMaxRanks (0.7.2: 64)
# NVLinkOneSidedAlltoAll's _SUPPORTED_TOP_K (3 is new in 0.7.4)
SUPPORTED_TOP_K = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22)


def round_parity(flag_val: int) -> int:
    """The receive-counter bank a round uses: ``((flag_val - 1) >> 1) & 1`` (dispatch raises
    ``flag_val`` to 2n+1, combine to 2n+2, so round n uses bank n % 2)."""
    return ((flag_val - 1) >> 1) & 1


def dispatch_capacity(ep_size: int, max_num_tokens: int, dispatch_bytes_per_token: int,
                      extra_payload_bytes_per_token: int = 0) -> int:
    """``dispatch_bytes`` as ``NVLinkOneSidedAlltoAll`` asks for it: every rank's rows at the
    cap, plus one alignment per payload; ``dispatch_bytes_per_token`` is the whole row
    (activations, scales, 4-byte top-k ids and weights)."""
    return (ep_size * max_num_tokens * (dispatch_bytes_per_token + extra_payload_bytes_per_token)
            + MAX_PAYLOADS * WORKSPACE_ALIGNMENT)


def combine_capacity(ep_size: int, max_num_tokens: int, combine_bytes: int) -> int:
    """``combine_input_bytes``: every rank's rows at the cap, 16-bit at least."""
    return ep_size * max_num_tokens * combine_bytes


@dataclass(frozen=True)
class Offsets:
    """``MoeA2AWorkspaceLayout`` of the fence path, per rank."""

    flag_val: int
    local_token_counter: int
    send_counters: int
    recv_counters: int  # int32 [2][ep_size]: bank = round_parity(flag_val)
    dispatch_completion_flags: int
    topk_target_ranks: int
    topk_target_indices: int
    eplb_gathered_stats: int
    dispatch_payload: int
    dispatch_payload_size: int
    combine_completion_flags: int
    combine_input: int
    combine_input_size: int
    workspace_size: int


@functools.lru_cache(maxsize=4096)
def offsets(ep_size: int, max_num_tokens: int, top_k: int, dispatch_bytes: int,
            combine_input_bytes: int, eplb_stats_num_experts: int = 0) -> Offsets:
    """``calculateWorkspaceLayout(..., combineRecvBytes=0, canUseCft=false)``."""
    if not 0 < ep_size <= MAX_RANKS:
        raise ValueError(f"Invalid EP size: {ep_size}")
    if not 0 < max_num_tokens <= 2**31 - 1:
        raise ValueError(f"Invalid allocation-time token capacity: {max_num_tokens}")
    if not 0 < top_k <= MAX_TOP_K:
        raise ValueError(f"Invalid top_k: {top_k}")
    dispatch_bytes = pad(dispatch_bytes, WORKSPACE_ALIGNMENT)
    combine_input_bytes = pad(combine_input_bytes, WORKSPACE_ALIGNMENT)
    at = {}
    o = 0

    def reserve(name: str, size: int, alignment: int = INT32) -> None:
        nonlocal o
        o = pad(o, alignment)
        at[name] = o
        o += size

    counts = ep_size * INT32
    reserve("flag_val", 4)
    reserve("local_token_counter", INT32)
    reserve("send_counters", counts)
    reserve("recv_counters", 2 * counts)
    reserve("dispatch_completion_flags", counts, ALIGN)
    reserve("topk_target_ranks", max_num_tokens * top_k * INT32, ALIGN)
    reserve("topk_target_indices", max_num_tokens * top_k * INT32, ALIGN)
    reserve("eplb_gathered_stats", ep_size * eplb_stats_num_experts * INT32, ALIGN)
    reserve("dispatch_payload", dispatch_bytes, WORKSPACE_ALIGNMENT)
    reserve("combine_completion_flags", counts, ALIGN)
    reserve("combine_input", combine_input_bytes, WORKSPACE_ALIGNMENT)
    return Offsets(dispatch_payload_size=dispatch_bytes, combine_input_size=combine_input_bytes,
                   workspace_size=o, **at)


def offsets_for(ep_size: int, max_num_tokens: int, payloads: Tuple[PayloadSpec, ...],
                 combine_bytes: int) -> Offsets:
    top_k = payloads[-1].bytes_per_token // INT32  # the last payload is the top-k weights
    row = sum(p.bytes_per_token for p in payloads)
    return offsets(ep_size, max_num_tokens, top_k, dispatch_capacity(ep_size, max_num_tokens, row),
                   combine_capacity(ep_size, max_num_tokens, combine_bytes))


def workspace_size_per_rank(ep_size: int, max_num_tokens: int, payloads: Tuple[PayloadSpec, ...],
                            combine_bytes: int) -> int:
    """``metainfo[WORKSPACE_SIZE_INDEX]``: the bytes per rank ``NVLinkOneSidedAlltoAll``
    allocates for the cap (fence path)."""
    return offsets_for(ep_size, max_num_tokens, tuple(payloads), combine_bytes).workspace_size


def layout(ep_size: int, max_num_tokens: int, runtime: int, payloads: Tuple[PayloadSpec, ...],
           combine_bytes: int, sized_for: Optional[Tuple[PayloadSpec, ...]] = None) -> Layout:
    """``moeA2ADispatchOp``'s receive planes for ``runtime`` rows, and the fixed combine region
    of a workspace allocated for ``sized_for`` (default: these payloads).

    Raises ``ValueError`` where the C++ op refuses the call: runtime <= 0 or over the cap, more
    than ``MAX_PAYLOADS`` payloads, planes past the dispatch region."""
    payloads = tuple(payloads)
    if runtime <= 0:
        raise ValueError(f"runtimeMaxTokensPerRank must be positive (> 0), got {runtime}")
    if runtime > max_num_tokens:
        raise ValueError(f"runtimeMaxTokensPerRank {runtime} exceeds the allocation-time token "
                         f"capacity {max_num_tokens}")
    if not 0 < len(payloads) <= MAX_PAYLOADS:
        raise ValueError(f"between 1 and {MAX_PAYLOADS} payloads, got {len(payloads)}")
    off = offsets_for(ep_size, max_num_tokens, tuple(sized_for or payloads), combine_bytes)
    current = off.dispatch_payload
    recv = []
    for p in payloads:
        recv.append(current)
        end = current + ep_size * runtime * p.bytes_per_token
        current = pad(end, ALIGN)
    if current > off.dispatch_payload + off.dispatch_payload_size:
        raise ValueError(f"Dispatch payload exceeds its workspace capacity: need "
                         f"{current - off.dispatch_payload} bytes, capacity "
                         f"{off.dispatch_payload_size}")
    return Layout(ep_size, runtime, payloads, combine_bytes, tuple(recv), end,
                  off.combine_input, off.combine_input + ep_size * runtime * combine_bytes)
