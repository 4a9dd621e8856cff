"""What both FlashInfer A2A generations share: the payloads a dispatcher hands the A2A (formats,
bytes per token, element sizes), the combine row, and ``Layout``, where one dispatch + combine
puts things in a rank's workspace. The byte models themselves are one module per kernel:
``mnnvl.py`` (0.7.2's ``MoeAlltoAll``), ``one_sided.py`` (0.7.4's ``NVLinkOneSidedAlltoAll``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple

__all__ = ["ALIGN", "INT32", "pad", "PayloadFormat", "HIDDEN_MULTIPLE", "PayloadSpec",
           "dispatch_payloads", "combine_bytes_per_token", "Layout"]

ALIGN = 128  # kCachelineAlignment (both generations)
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
