"""What an SGLang forward step reads beyond the world's topology (the ``sglang:`` policies'
second input; ``strategies.sglang_contexts()`` draws it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["SGLangContext", "FORWARD_MODES"]

FORWARD_MODES = ("decode", "extend", "mixed", "capture")


@dataclass(frozen=True)
class SGLangContext:
    """The forward mode (decode, extend, mixed, or CUDA-graph capture), speculative decoding,
    and the server args that decide ``require_mlp_tp_gather`` (dense TP size, DP LM head)
    and whether SP prefill goes through its own A2A."""

    forward_mode: str = "decode"
    speculative: bool = False
    moe_dense_tp_size: Optional[int] = None
    enable_dp_lm_head: bool = False
    sp_prefill_a2a: bool = False

    def __post_init__(self):
        if self.forward_mode not in FORWARD_MODES:
            raise ValueError(f"forward_mode {self.forward_mode!r} not in {FORWARD_MODES}")
