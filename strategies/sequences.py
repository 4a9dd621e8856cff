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

from dispatcher.model.workspace import HIDDEN_MULTIPLE, PayloadFormat
from dispatcher.model.world import DP_GLOBAL_KINDS

from .worlds import group_token_counts, moe_configs, worlds

__all__ = ["step_sequences", "MAX_STEPS"]

MAX_STEPS = 6


def _moe(ep_size):
    return moe_configs(ep_size, hidden_sizes=(128, 1024, 7168), max_experts_per_rank=2)


@st.composite
def step_sequences(draw, max_ep: int = 8, max_steps: int = MAX_STEPS):
    """A tuple of 2..``max_steps`` worlds sharing ``ep_size``, ``dp_size``, ``max_num_tokens``
    and the MoE layer's shape (hidden size, top_k, experts); the first is any world."""
    first = draw(worlds(max_ep=max_ep, max_tokens=1024, moe=_moe))
    tp, moe = first.attn_tp_size, first.moe
    formats = tuple(f.value for f in PayloadFormat if moe.hidden_size % HIDDEN_MULTIPLE[f] == 0)
    steps = [first]
    for _ in range(draw(st.integers(1, max_steps - 1))):
        tokens = draw(group_token_counts(first.dp_size, tp, 1024))
        equal = len(set(tokens)) == 1
        steps.append(replace(
            first, group_tokens=tokens,
            dp_global_kind=draw(st.sampled_from(DP_GLOBAL_KINDS)) if equal else "recorded",
            max_len_padding=first.dp_size > 1 and draw(st.booleans()),
            moe=replace(moe, payload=draw(st.sampled_from(formats)))))
    return tuple(steps)
