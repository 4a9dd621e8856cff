"""What SGLang's own scheduler-side code hands the dispatcher, run from the release under test.

The dispatcher reads ``get_dp_global_num_tokens()`` and its rows; both are made before it runs,
by the server-arg checks (which topologies may use FlashInfer's A2A at all), the scheduler's DP
gather and the speculative workers' per-forward counts. This module runs those functions from
the release's (or the checkout's) own files, each compiled alone on stand-in inputs
(``Tree.function``, ``dispatcher/releases/tree.py``), so a reader can hold it line by line against SGLang:

====================================  =========================================================
SGLang function (paths under srt/)    what it decides here
====================================  =========================================================
``arg_groups/moe_hook.py``            whether the server config may use FlashInfer's A2A
``_flashinfer_a2a_topology_is_        (0.5.23+: the function; 0.5.13-0.5.22: the ``assert``
supported`` / the ``assert`` under    under ``if ... == "flashinfer":`` in ``moe_hook.py`` or
``moe_a2a_backend == "flashinfer"``   ``server_args.py``, its expression evaluated as written;
                                      0.5.10-0.5.12 check nothing)
``managers/scheduler_components/      the list the scheduler stores on the batch: every DP
dp_attn.py: _update_gather_batch``    group's count, or only the local one when
                                      ``require_mlp_tp_gather()`` is False (SGLang #27945)
``...dp_attn.py: should_skip_         whether the all-gather runs (0.5.19+; before, the env var
scheduler_all_gather``                ``SGLANG_SCHEDULER_SKIP_ALL_GATHER`` alone)
``speculative/spec_info.py:           a speculative forward's counts: the gathered request
spec_scale_global_num_tokens``        counts times its tokens per request (0.5.16+; before,
                                      ``SpecInput.get_spec_adjusted_global_num_tokens``, the
                                      same product)
====================================  =========================================================

The forward batch's DP padding (``ForwardBatch.prepare_mlp_sync_batch``) and the decode
CUDA-graph runner's bucket choice run from the release too (``forward.py``). What still stands
in is documented in docs/sglang.md: the capture sizes, the runner's ``can_run`` check and the
list a capture publishes. Which file each function comes from (the tree, the release a
lone file is identical to, or the newest release standing in) is the tree's answer
(``dispatcher/releases/tree.py``); ``Scheduler.sources`` names it in every message.
"""
from __future__ import annotations

import ast
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from ..releases.tree import Tree
from ..model.sglang_context import SGLangContext
from ..model.world import World
from .forward import GraphRunner, Padded, Padding
from .sources import (
    BUCKET_CHOICE,
    DRAFT_BUCKET_CHOICE,
    DRAFT_METHODS,
    PADDING,
    TOPOLOGY_ASSERT,
    flashinfer_assert,
    rel_path,
)

__all__ = ["ServerConfig", "Scheduler", "load_scheduler", "MUSE_SPARK"]

MUSE_SPARK = "MuseSparkForConditionalGeneration"  # the one architecture with layernorm-SP


@dataclass(frozen=True)
class ServerConfig:
    """The server args a step implies (what ``--tp``, ``--dp``, ``--enable-dp-attention``, ...
    were). A world without DP attention and attn_tp > 1 is sequence parallelism: in 0.5.23
    only Muse Spark's layernorm-SP reaches FlashInfer's A2A that way, so such a config names it;
    a single rank runs with DP attention of size 1."""

    tp_size: int
    ep_size: int
    dp_size: int
    enable_dp_attention: bool
    enable_layernorm_sp: bool
    architecture: Optional[str]
    moe_dense_tp_size: Optional[int]
    enable_dp_lm_head: bool
    speculative_algorithm: Optional[str]
    skip_all_gather: bool

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @classmethod
    def of(cls, world: World, ctx: SGLangContext) -> "ServerConfig":
        sp = not world.dp_attention and world.ep_size > 1
        return cls(tp_size=world.ep_size, ep_size=world.ep_size, dp_size=world.dp_size,
                   enable_dp_attention=not sp, enable_layernorm_sp=sp,
                   architecture=MUSE_SPARK if sp else None,
                   moe_dense_tp_size=ctx.moe_dense_tp_size,
                   enable_dp_lm_head=ctx.enable_dp_lm_head,
                   speculative_algorithm="EAGLE" if ctx.speculative else None,
                   skip_all_gather=ctx.skip_all_gather)


class _Anything(types.SimpleNamespace):
    """A stand-in object (a batch, a sync info): the fields given; any other reads as None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


@dataclass(frozen=True)
class Scheduler:
    """The scheduler-side functions of one release, each with where it came from."""

    topology: Callable[[ServerConfig], bool]
    update_gather_batch: Optional[Callable]
    should_skip_all_gather: Optional[Callable]
    spec_scale: Optional[Callable]
    sources: Dict[str, str]  # what decided each step: "file:line function" or the stand-in
    padding: Optional[Padding] = None  # the forward batch's DP padding
    runner: Optional[GraphRunner] = None  # the decode CUDA-graph runner's bucket choice
    draft_runner: Optional[GraphRunner] = None  # the EAGLE draft runner's
    _padded: Dict[tuple, Optional[Padded]] = field(default_factory=dict, repr=False, compare=False)

    # --- server args -------------------------------------------------------------------------
    def refusal(self, config: ServerConfig) -> Optional[str]:
        """None if the release accepts ``config`` for FlashInfer's A2A, else why not."""
        if self.topology(config):
            return None
        return (f"SGLang refuses --moe-a2a-backend flashinfer with tp={config.tp_size}, "
                f"dp={config.dp_size}, DP attention {'on' if config.enable_dp_attention else 'off'}"
                f"{', layernorm-SP' if config.enable_layernorm_sp else ''} "
                f"({self.sources['topology']})")

    # --- the scheduler's DP gather -------------------------------------------------------------
    def skips_all_gather(self, config: ServerConfig) -> bool:
        if self.should_skip_all_gather is None:
            return config.skip_all_gather
        return bool(self.should_skip_all_gather(config.dp_size))

    def gathered(self, world: World, ctx: SGLangContext, rank: int, require_gather: bool):
        """``batch.global_num_tokens`` after the release's ``_update_gather_batch`` on this
        rank (DP attention on), in the scheduler's units (requests on decode-family steps)."""
        config = ServerConfig.of(world, ctx)
        counts = [n // ctx.tokens_per_req for n in world.group_tokens]
        skip = self.skips_all_gather(config) and world.dp_size > 1
        info = _Anything(num_tokens=counts[rank // world.attn_tp_size],
                         num_tokens_for_logprob=counts[rank // world.attn_tp_size],
                         global_num_tokens=None if skip else counts,
                         global_num_tokens_for_logprob=None if skip else counts)
        batch = _Anything()
        if self.update_gather_batch is None:  # dispatcher.releases.companions refuses such a tree
            raise LookupError(f"no _update_gather_batch() to run ({self.sources['gather']})")
        self.update_gather_batch(batch, info, require_gather)
        return batch.global_num_tokens

    def scaled(self, world: World, ctx: SGLangContext, rank: int, require_gather: bool):
        """The gathered list in tokens: a speculative forward's request counts scaled by the
        release's own ``spec_scale_global_num_tokens`` (``forward_batch.global_num_tokens_cpu``
        before padding); None where nothing was gathered."""
        listed = self.gathered(world, ctx, rank, require_gather)
        if listed is None or ctx.tokens_per_req == 1:
            return None if listed is None else list(listed)
        if self.spec_scale is None:
            return [n * ctx.tokens_per_req for n in listed]
        spec = _Anything(num_tokens_per_req=ctx.tokens_per_req,
                         num_tokens_for_logprob_per_req=ctx.tokens_per_req)
        return list(self.spec_scale(spec, list(listed), list(listed))[0])

    def padded(self, world: World, ctx: SGLangContext, rank: int,
               require_gather: bool) -> Optional[Padded]:
        """What the release's ``prepare_mlp_sync_batch`` publishes on EP rank ``rank`` of an
        eager DP-attention step, and the rows its DP group holds; None where the scheduler
        gathered nothing (the all-gather skipped: the batch is not padded)."""
        if self.padding is None:
            return None
        group = rank // world.attn_tp_size  # every rank of a group gathers the same list
        key = (world, ctx, group, require_gather)
        if key not in self._padded:
            if len(self._padded) > 4096:
                self._padded.clear()
            listed = self.scaled(world, ctx, rank, require_gather)
            self._padded[key] = None if listed is None else self.padding.run(
                world, ctx, group, listed, world.group_tokens[group] // ctx.tokens_per_req,
                ctx.forward_mode in ("extend", "mixed"))
        return self._padded[key]

    def dp_global(self, world: World, ctx: SGLangContext, rank: int, require_gather: bool):
        """What ``get_dp_global_num_tokens()`` returns on EP rank ``rank``.

        DP attention: the release's gather (above), scaled to a speculative forward's tokens,
        then what the release's own forward-batch padding publishes (eager steps; a CUDA-graph
        capture publishes the counts it captures, unpadded). Without DP attention (SP): the one
        pre-scatter count, nothing in CUDA-graph capture or where the world records nothing
        (SGLang publishes no empty list: such a world is no SGLang step)."""
        if not world.dp_attention:
            if ctx.forward_mode == "capture" or world.dp_global is None:
                return None
            return list(world.padded_group_tokens)  # (an empty list: no step, loader.outcome)
        if ctx.forward_mode == "capture":
            return self.scaled(world, ctx, rank, require_gather)
        padded = self.padded(world, ctx, rank, require_gather)
        return None if padded is None else padded.published

    def stale_dp_global(self, world: World, ctx: SGLangContext, rank: int, require_gather: bool):
        """The hazard of the hardening column: a draft forward handed the target step's list,
        ``ctx.stale_by`` tokens fewer per busy group than it holds. SGLang rebuilds the list
        every forward under DP attention (docs/sglang.md); only its MoRI test, without DP
        attention, keeps a stale one."""
        listed = self.dp_global(world, ctx, rank, require_gather)
        if listed is None or not ctx.stale_by:
            return listed
        return [max(1, n - ctx.stale_by) if n else 0 for n in listed]


def _source(path: Optional[Path], name: str, fn, standin: str = "") -> str:
    if fn is None or path is None:
        return f"no {name}() in the tree: the release has none"
    return f"{rel_path(path)}:{fn.__code__.co_firstlineno} {name}(){standin}"




def _topology(tree: Tree, namespace: Dict[str, object], standin: str
              ) -> Tuple[Callable, str]:
    hook = tree.source("_flashinfer_a2a_topology_is_supported")
    if hook is not None:
        fn = tree.function("_flashinfer_a2a_topology_is_supported", namespace)
        return (lambda c: bool(fn(**_topology_kwargs(c)))), _source(
            hook, "_flashinfer_a2a_topology_is_supported", fn, standin)
    path = tree.source(TOPOLOGY_ASSERT)
    if path is None:  # 0.5.10-0.5.12: no check at all
        return (lambda c: True), "no FlashInfer A2A topology check in the release: every topology"
    test, line = flashinfer_assert(path)
    code = compile(ast.Expression(test), str(path), "eval")

    def check(c: ServerConfig) -> bool:
        cfg = _Anything(**{k: getattr(c, k) for k in ServerConfig.__dataclass_fields__},
                        attn_dp_size=c.attn_dp_size)
        scope = dict(namespace, self=cfg, cfg=cfg, server_args=cfg,
                     resolved_view=lambda a: a,
                     attn_dp_enabled_of=lambda a: a.enable_dp_attention)
        return bool(eval(code, scope))  # the release's own expression, its names answered
    return check, f"{rel_path(path)}:{line} assert under moe_a2a_backend == \"flashinfer\"{standin}"


def _topology_kwargs(c: ServerConfig) -> dict:
    return dict(architecture=c.architecture, tp_size=c.tp_size, ep_size=c.ep_size,
                attn_dp_size=c.attn_dp_size, attn_dp_enabled=c.enable_dp_attention,
                enable_layernorm_sp=c.enable_layernorm_sp)


def load_scheduler(tree: Tree, namespace: Dict[str, object]) -> Scheduler:
    """The scheduler-side functions the ``tree`` resolved (its own, or the files standing in
    for them), each compiled alone in ``namespace`` (the stand-ins answer their module-level
    names, e.g. ``envs``)."""
    tag = tree.companions.tag
    standin = f" ({tag})" if tag else ""
    topology, topo_source = _topology(tree, namespace, standin)

    def get(name):
        return tree.source(name), tree.function(name, namespace)

    dp_attn, update = get("_update_gather_batch")
    skip_path, skip = get("should_skip_scheduler_all_gather")
    spec, scale = get("spec_scale_global_num_tokens")
    skip_source = (_source(skip_path, "should_skip_scheduler_all_gather", skip, standin) if skip
                   else "no should_skip_scheduler_all_gather() in the release: "
                        "SGLANG_SCHEDULER_SKIP_ALL_GATHER alone")
    scale_source = (_source(spec, "spec_scale_global_num_tokens", scale, standin) if scale
                    else "no spec_scale_global_num_tokens() in the release: "
                         "SpecInput.get_spec_adjusted_global_num_tokens, requests x tokens per request")
    forward, runner_file = tree.source(PADDING), tree.source(BUCKET_CHOICE)
    draft_file = tree.source(DRAFT_BUCKET_CHOICE)
    padding = None if forward is None else Padding(forward, standin)
    runner = None if runner_file is None else GraphRunner(runner_file, standin)
    draft = None if draft_file is None else GraphRunner(draft_file, standin, DRAFT_METHODS)
    return Scheduler(topology, update, skip, scale, {
        "topology": topo_source,
        "gather": _source(dp_attn, "_update_gather_batch", update, standin),
        "skip_all_gather": skip_source,
        "spec_scale": scale_source,
        "padding": padding.source if padding else "no prepare_mlp_sync_batch() in the tree",
        "bucket": runner.source if runner else "no decode CUDA-graph runner in the tree",
        "draft_bucket": draft.source if draft else "no EAGLE draft CUDA-graph runner in the tree",
    }, padding, runner, draft)
