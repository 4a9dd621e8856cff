"""(world, SGLang context) pairs: the steps SGLang's dispatcher can be asked to size.

``sglang_contexts()`` draws every switch; ``sglang_steps()`` draws any step, and one strategy
per bug class draws the steps of its regime (each class's record names it:
``dispatcher/sglang/bug_classes.py``), built
so that SGLang could produce each one: a CUDA-graph capture runs one batch size on every
rank, a replayed batch fits a graph bucket, an all-idle step exists only where the
scheduler skips its all-gather (otherwise no idle batch runs), which only deployments that
give every DP rank the same batch may do, a draft forward is
speculative with its tokens per request (the counts are multiples of it), a derived cap
is ``max(chunked_prefill_size, 4096)``. Topologies are drawn as server configs: one DP group
per rank first (the one every release since 0.5.13 accepts), else any; the release under test
refuses what its own server-arg checks refuse (``dispatcher/sglang/scheduler.py``).
"""
from __future__ import annotations

import functools
from dataclasses import replace

from hypothesis import assume, strategies as st

from dispatcher.model.sglang_context import CAPTURE_SIZES, FORWARD_MODES, SGLangContext

from .worlds import group_token_counts, worlds

__all__ = ["sglang_contexts", "sglang_steps", "sglang_sequences", "sp_prescatter_steps",
           "constructed_cap_steps", "collapsed_dp_global_steps", "cuda_graph_bucket_steps",
           "all_idle_steps", "stale_draft_steps", "padding_slot_steps", "extend_over_cap_steps"]
CHUNKED_PREFILL_SIZES = (2048, 4096, 8192, 16384)
MAX_EP = 8  # every rank runs SGLang's dispatch() per example: keep worlds cheap


@st.composite
def sglang_contexts(draw, forward_modes=FORWARD_MODES):
    """Every switch SGLang's dispatch() reads beyond the world (``SGLangContext``)."""
    speculative = draw(st.booleans())
    draft = speculative and draw(st.booleans())
    return SGLangContext(
        forward_mode=draw(st.sampled_from(forward_modes)), speculative=speculative,
        draft_forward=draft, tokens_per_req=draw(_TOKENS_PER_REQ) if draft else 1,
        moe_dense_tp_size=draw(st.sampled_from([None, 1])),
        enable_dp_lm_head=draw(st.booleans()), skip_all_gather=draw(st.booleans()),
        cap_from_env=draw(st.booleans()),
        chunked_prefill_size=draw(st.sampled_from(CHUNKED_PREFILL_SIZES)),
        sp_prefill_a2a=draw(st.booleans()))


def _producible(world, ctx):
    """The step as SGLang would run it under ``ctx`` (see the module docstring)."""
    if not ctx.cap_from_env:
        world = replace(world, max_num_tokens=ctx.expected_cap_when_derived)
    if world.dp_global_kind == "empty":  # SGLang publishes None, never [], where nothing is
        world = replace(world, dp_global_kind="none")  # gathered (dispatcher/sglang/loader.py)
    if ctx.forward_mode == "capture" or ctx.skip_all_gather:
        # capture runs one batch size everywhere; skipping the all-gather is only for
        # deployments that guarantee every DP rank the same batch (should_skip_...)
        world = replace(world, group_tokens=(max(world.group_tokens),) * world.dp_size,
                        dp_global_kind="recorded", max_len_padding=False)
    if ctx.tokens_per_req > 1:  # a draft forward holds whole requests of tokens_per_req each
        k = ctx.tokens_per_req
        world = replace(world, group_tokens=tuple(n // k * k for n in world.group_tokens))
    if ctx.forward_mode == "replay":  # a bucket is never over the cap (4096 floor)
        k = ctx.tokens_per_req  # buckets count requests; a draft's graph runs k tokens each
        assume(max(world.group_tokens) // k <= CAPTURE_SIZES[-1])
        bucket = min(b for b in CAPTURE_SIZES if b >= max(1, *world.group_tokens) // k) * k
        world = replace(world, max_num_tokens=max(world.max_num_tokens, bucket))
    if max(world.group_tokens) == 0:
        assume(ctx.skip_all_gather and world.dp_attention)
    return world


COLLAPSING = dict(moe_dense_tp_size=1, enable_dp_lm_head=True)  # require_mlp_tp_gather False


@functools.lru_cache(maxsize=None)
def _worlds(**kwargs):
    """World strategies built once per regime (not once per example)."""
    return worlds(max_ep=kwargs.pop("max_ep", MAX_EP), **kwargs)


# draft decode: topk; draft extend: speculative_num_draft_tokens; multi-layer EAGLE: steps + 1
_TOKENS_PER_REQ = st.integers(1, 8)
_ANY_CONTEXT = sglang_contexts()
_CAP_SIZES = st.sampled_from(CHUNKED_PREFILL_SIZES)
_STALE = st.integers(1, 4)
# DP attention as a server config: one group per rank first (every release's accepted one)
_DP_ATTENTION = st.sampled_from(("full", True))
_ANY_TOPOLOGY = st.sampled_from(("full", None))
# SGLang pads a decode step SUM_LEN only when its groups are skewed (sum * 2 < max * dp, its
# DpPaddingMode): one busy group among three or more. A quarter of the "any" steps are drawn
# there, so both of the release's padding modes are searched (MAX_LEN otherwise dominates).
_SKEWED_DP = dict(dp_attention="full", ep_sizes=(3, 4, 6, 8), shape="one_hot")


@st.composite
def sglang_steps(draw):
    """``(world, ctx)``: any step SGLang can produce (every bug class's regime and beyond)."""
    ctx = draw(_ANY_CONTEXT)
    skewed = draw(st.integers(0, 3)) == 0
    world = draw(_worlds(**_SKEWED_DP) if skewed else _worlds(dp_attention=draw(_ANY_TOPOLOGY)))
    return _producible(world, ctx), ctx


# --- one regime per bug class: each class's record names its strategy (``BugClass.steps``) ---
@st.composite
def sp_prescatter_steps(draw):
    return draw(_worlds(ep_sizes=(2, 3, 4, 8), dp_attention=False)), SGLangContext()


@st.composite
def constructed_cap_steps(draw):
    ctx = SGLangContext(cap_from_env=draw(st.booleans()), chunked_prefill_size=draw(_CAP_SIZES))
    world = draw(_worlds(fitting_only=True, dp_attention=draw(_ANY_TOPOLOGY)))
    return _producible(world, ctx), ctx


@st.composite
def collapsed_dp_global_steps(draw):
    world = draw(_worlds(dp_attention=draw(_DP_ATTENTION), fitting_only=True))
    return world, SGLangContext(**COLLAPSING)


@st.composite
def cuda_graph_bucket_steps(draw):
    ctx = SGLangContext(forward_mode="replay", **COLLAPSING)
    world = draw(_worlds(dp_attention=draw(_DP_ATTENTION), max_tokens=CAPTURE_SIZES[-1],
                         fitting_only=True))
    return _producible(world, ctx), ctx


@st.composite
def all_idle_steps(draw):
    ctx = SGLangContext(skip_all_gather=True)
    return draw(_worlds(dp_attention=draw(_DP_ATTENTION), shape="all_zero")), ctx


@st.composite
def stale_draft_steps(draw):  # a hazard (the hardening column), not a context SGLang makes
    ctx = SGLangContext(speculative=True, draft_forward=True, stale_by=draw(_STALE))
    world = draw(_worlds(fitting_only=True, dp_attention=draw(_ANY_TOPOLOGY)))
    return _producible(world, ctx), ctx


@st.composite
def padding_slot_steps(draw):
    world = draw(_worlds(fitting_only=True, dp_attention=draw(_ANY_TOPOLOGY)))
    return world, SGLangContext()


@st.composite
def extend_over_cap_steps(draw):
    ctx = SGLangContext(forward_mode=draw(st.sampled_from(("extend", "decode", "mixed"))),
                        sp_prefill_a2a=draw(st.booleans()))
    world = draw(_worlds(cap_placement="payload_minus_1", dp_attention=draw(_ANY_TOPOLOGY)))
    assume(not world.payload_fits_cap)
    return world, ctx


@st.composite
def sglang_sequences(draw, max_steps: int = 6):
    """One SGLang server's steps in order on one workspace: its topology (DP attention, one
    group per rank first: what every release accepts), cap, MoE layer and server switches are
    the first step's (its context drawn as ``sglang_contexts()``); CUDA-graph
    captures of some buckets come first (as at start-up), then any mix of eager decode steps,
    replays, prefill and mixed batches, idle steps and, on a speculative server, draft
    forwards, each with fresh counts and made producible as one step is. Shrinking drops
    steps anywhere in the list."""
    # a server every release accepts (one DP group per rank, the all-gather on) in 3 of 4
    # draws: a refused topology runs no step, and 0.5.22+ refuse every step that skips the
    # all-gather under DP attention
    usual = draw(st.integers(0, 3)) > 0
    ctx = draw(_ANY_CONTEXT)
    ctx = replace(ctx, skip_all_gather=False) if usual else ctx
    topology = "full" if usual else draw(_DP_ATTENTION)
    first, first_ctx = _producible(draw(_worlds(dp_attention=topology)), ctx), ctx
    server = replace(first_ctx, forward_mode="decode", draft_forward=False, tokens_per_req=1,
                     stale_by=0)
    captures = [s for s in draw(st.lists(_capture(first, server), max_size=2)) if s]
    rest = draw(st.lists(_serving_step(first, server), min_size=1,
                         max_size=max(1, max_steps - 2 - len(captures))))
    return (*captures, (first, first_ctx), *(s for s in rest if s))


def _serving_at(first, ctx, tokens, padding, kind):
    """The step SGLang runs for these counts on ``first``'s server, or None where it runs none
    (an idle batch with the all-gather on, a batch over every bucket) or needs another cap."""
    if max(tokens) == 0 and not (ctx.skip_all_gather and first.dp_attention):
        return None
    if ctx.forward_mode == "replay" and max(tokens) // ctx.tokens_per_req > CAPTURE_SIZES[-1]:
        return None
    world = _producible(replace(
        first, group_tokens=tokens, max_len_padding=padding and first.dp_size > 1,
        dp_global_kind=kind if len(set(tokens)) == 1 else "recorded"), ctx)
    return (world, ctx) if world.max_num_tokens == first.max_num_tokens else None


@st.composite
def _capture(draw, first, server):
    """A CUDA-graph capture of one bucket within the cap (every group runs it)."""
    bucket = draw(st.sampled_from([b for b in CAPTURE_SIZES if b <= first.max_num_tokens] or [1]))
    return _serving_at(first, replace(server, forward_mode="capture"),
                       (bucket,) * first.dp_size, False, "recorded")


@st.composite
def _serving_step(draw, first, server):
    """An eager or replayed decode step, a prefill or mixed batch, or (speculative) a draft
    forward, with fresh counts."""
    draft = server.speculative and draw(st.booleans())
    ctx = replace(server, forward_mode=draw(st.sampled_from(FORWARD_MODES[:3] + ("replay",))),
                  draft_forward=draft, tokens_per_req=draw(_TOKENS_PER_REQ) if draft else 1)
    tokens = draw(group_token_counts(first.dp_size, first.attn_tp_size,
                                     min(first.max_num_tokens, 1024)))
    return _serving_at(first, ctx, tokens, draw(st.booleans()), first.dp_global_kind)
