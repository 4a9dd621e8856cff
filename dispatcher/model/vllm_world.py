"""Which worlds vLLM runs (the ``vllm:`` policies' domain; dispatcher/vllm/loader.py and
docs/vllm.md map a world onto vLLM's inputs).

vLLM's DP coordination records every DP rank's count; an idle DP rank runs a dummy batch of
one token; no DP rank batches more than ``max_num_batched_tokens`` (the cap); with one EP rank
there is no all-to-all. The two-sided backend has no sequence-parallel split and needs DP
metadata. ``as_vllm_world`` is the nearest world vLLM runs (what the generic tiers check a
vLLM policy on); ``not_producible`` says why vLLM never runs a given one.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .world import World

__all__ = ["as_vllm_world", "not_producible"]


def as_vllm_world(world: World, raise_cap: bool = True, side: str = "one-sided") -> World:
    """The step as vLLM would run it: idle DP ranks at one token, every count recorded and
    (``raise_cap``) the cap at least every DP rank's batch. The GPU tiers keep the cap, which
    their workspaces were built for, and leave a world whose cap is too small to vLLM.

    The two-sided backend has no sequence-parallel split and needs DP metadata: every EP rank
    is a DP rank of its own there. A world with attention TP (or DP = 1) becomes the one whose
    DP ranks each batch the rows that EP rank holds in ``world`` (same EP ranks, same payload
    rows per rank, same cap), rather than a world vLLM never runs (which the tiers would have
    to throw away: most of what ``worlds()`` draws has attention TP)."""
    if side == "two-sided" and world.ep_size > 1 and (world.attn_tp_size > 1
                                                      or world.dp_size == 1):
        world = replace(world, dp_size=world.ep_size, group_tokens=world.rows_per_rank,
                        dp_global_kind="recorded")
    tokens = tuple(max(1, n) for n in world.group_tokens)
    cap = max(world.max_num_tokens, max(tokens)) if raise_cap else world.max_num_tokens
    return replace(world, group_tokens=tokens, dp_global_kind="recorded", max_num_tokens=cap)


def not_producible(world: World, side: str = "one-sided") -> Optional[str]:
    """Why vLLM never runs this step, or None when it can."""
    if world.ep_size == 1:
        return "EP size 1: vLLM runs no all-to-all"
    if world.dp_global_kind != "recorded":
        return "vLLM always records every DP rank's count (num_tokens_across_dp)"
    if min(world.group_tokens) == 0:
        return "an idle vLLM DP rank runs a dummy batch of one token, never zero"
    if max(world.group_tokens) > world.max_num_tokens:
        return "no vLLM DP rank batches more than max_num_batched_tokens, the cap"
    if side == "two-sided" and world.attn_tp_size > 1:
        return ("vLLM's two-sided backend has no sequence-parallel split: TP ranks hold the "
                "whole batch, which this world does not describe")
    if side == "two-sided" and world.dp_size == 1:
        return "vLLM's two-sided backend needs DP metadata (DP > 1)"
    return None
