"""Sequences of steps on one workspace: what an engine runs between two allocations.

One EP topology, one cap and one MoE layer shape for the whole sequence (the workspace is sized
once); from step to step the scheduler's counts change (any shape ``worlds`` draws: equal,
skewed, idle groups, all idle), the padding mode and what ``get_dp_global_num_tokens()``
records, and the dispatch format (a model mixing BF16 and quantized layers changes the bytes
per token between rounds at any count). Hypothesis shrinks a failing sequence to its shortest
history, then each step to its smallest counts.
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from dispatcher.model.payloads import HIDDEN_MULTIPLE, PayloadFormat
from dispatcher.model.world import DP_GLOBAL_KINDS

from .worlds import GPU_SHAPES, emulable, group_token_counts, moe_configs, pool_worlds, worlds

__all__ = ["step_sequences", "gpu_sequences", "pool_sequences", "MAX_STEPS"]

MAX_STEPS = 6


@st.composite
def step_sequences(draw, max_ep: int = 8, max_steps: int = MAX_STEPS, max_tokens: int = 1024,
                   hidden_sizes=(128, 1024, 7168), formats_change: bool = True, ep_sizes=None,
                   within_cap: bool = False, growing: bool = False, top_ks=None,
                   flashinfer=None):
    """A tuple of 2..``max_steps`` worlds sharing ``ep_size``, ``dp_size``, ``max_num_tokens``
    and the MoE layer's shape (hidden size, top_k, experts); the first is any world.
    ``formats_change=False``: every step dispatches the first step's format (what a model of
    one format runs: only the sizing changes the layout). ``within_cap``: every step's rows fit
    the cap (the steps a server runs without crashing: the hazard search's). ``growing``: each
    later step adds its drawn counts to the first step's (a search for layouts that grow).
    ``flashinfer``: the steps' generation (default: the session's)."""
    first = draw(worlds(max_ep=max_ep, ep_sizes=ep_sizes, max_tokens=max_tokens,
                        moe=lambda ep: moe_configs(ep, hidden_sizes=hidden_sizes, top_ks=top_ks,
                                                   max_experts_per_rank=2, flashinfer=flashinfer),
                        flashinfer=flashinfer))
    moe = first.moe
    formats = tuple(f.value for f in PayloadFormat if moe.hidden_size % HIDDEN_MULTIPLE[f] == 0)
    if not formats_change:
        formats = (moe.payload,)

    # a list, so that shrinking can drop any step, not only the last
    if within_cap:  # rows per rank are ceil(tokens / attn_tp)
        max_tokens = min(max_tokens, first.max_num_tokens * first.attn_tp_size)
        first = first if first.payload_fits_cap else replace(
            first, group_tokens=tuple(min(n, max_tokens) for n in first.group_tokens))
    return (first, *draw(st.lists(_next_step(first, formats, max_tokens, growing), min_size=1,
                                  max_size=max_steps - 1)))


@st.composite
def _next_step(draw, first, formats, max_tokens, growing=False):
    """A later step of ``first``'s workspace: fresh counts, padding, what is recorded, and a
    format of ``formats``."""
    tokens = tuple(min(n, max_tokens) for n in draw(
        group_token_counts(first.dp_size, first.attn_tp_size, max_tokens)))
    if growing:
        tokens = tuple(min(n + m, max_tokens) for n, m in zip(tokens, first.group_tokens))
    equal = len(set(tokens)) == 1
    return replace(
        first, group_tokens=tokens,
        dp_global_kind=draw(st.sampled_from(DP_GLOBAL_KINDS)) if equal else "recorded",
        max_len_padding=first.dp_size > 1 and draw(st.booleans()),
        moe=replace(first.moe, payload=draw(st.sampled_from(formats))))


def gpu_sequences(max_ep: int = 8, max_steps: int = 4, emulated: bool = False):
    """Sequences for the real kernels on one GPU: one dispatch format (one workspace), every
    step within the cap, and every rank's dispatch blocks co-resident (rows * ep_size within
    ``GPU_SHAPES.single_gpu_blocks``). ``emulated``: on the exact CPU model instead, so every
    step within what it materialises."""
    drawn = step_sequences(max_ep=max_ep, max_steps=max_steps,
                          max_tokens=max(1, GPU_SHAPES.single_gpu_blocks // max_ep),
                          hidden_sizes=GPU_SHAPES.hidden_sizes, top_ks=GPU_SHAPES.top_ks,
                          formats_change=False, within_cap=True)
    return drawn.filter(lambda seq: all(map(emulable, seq))) if emulated else drawn


@st.composite
def pool_sequences(draw, ep_size: int, max_steps: int = 4):
    """Sequences for the rank pool of ``ep_size`` ranks: the first step a pool world (its caps
    and shapes), the later ones fresh counts within its cap and the pool's co-residency."""
    first = draw(pool_worlds(ep_size))
    max_tokens = min(first.max_num_tokens * first.attn_tp_size,
                     max(1, GPU_SHAPES.pool_blocks // ep_size))
    return (first, *draw(st.lists(_next_step(first, (first.moe.payload,), max_tokens),
                                  min_size=1, max_size=max_steps - 1)))
