"""Worlds vLLM's FlashInfer NVLink prepare() can be asked to size (``vllm_worlds(regime)``).

Built from the same worlds as every other tier, then made vLLM's (dispatcher/vllm/loader.py
says why each holds): every DP rank's count is recorded, an idle DP rank runs a one-token
dummy batch, no DP rank batches more than the cap (``max_num_batched_tokens``), and there is
more than one EP rank. What only SGLang produces (an unrecorded or collapsed dp_global, an
all-idle step, CUDA-graph buckets per rank) is not generated here.
"""
from __future__ import annotations

import functools
from dataclasses import replace

from hypothesis import assume, strategies as st

from dispatcher.model.vllm_world import as_vllm_world

from .worlds import worlds

__all__ = ["VLLM_REGIMES", "vllm_worlds"]

# any: all of them; sequence-parallel: DP > 1 and TP > 1 (use_sequence_parallel_moe);
# dp-only: TP = 1; dp-padding: every DP rank padded to the largest (CUDA graphs across DP);
# pcp: DP = 1, prefill context parallelism (no DP metadata).
VLLM_REGIMES = ("any", "sequence-parallel", "dp-only", "dp-padding", "pcp")
EP_SIZES = (2, 3, 4, 6, 8)  # every rank runs vLLM's prepare() per example: keep worlds cheap


@functools.lru_cache(maxsize=None)
def _worlds(dp_attention, flashinfer):
    return worlds(ep_sizes=EP_SIZES, dp_attention=dp_attention,
                  flashinfer=flashinfer).map(as_vllm_world)


@st.composite
def vllm_worlds(draw, regime: str = "any", flashinfer=None):
    """A world vLLM produces, in ``regime`` (one of VLLM_REGIMES), of FlashInfer generation
    ``flashinfer`` (default: the session's)."""
    if regime == "any":
        return draw(_worlds(None, flashinfer))
    if regime == "pcp":
        return draw(_worlds(False, flashinfer))
    world = draw(_worlds(True, flashinfer))
    if regime == "sequence-parallel":
        assume(world.attn_tp_size > 1)
    elif regime == "dp-only":
        assume(world.attn_tp_size == 1)
    elif regime == "dp-padding":
        world = replace(world, max_len_padding=True)
    else:
        raise ValueError(f"unknown regime {regime!r}: one of {VLLM_REGIMES}")
    return world
