"""Run SGLang's own ``FlashinferDispatcher.dispatch()``, unmodified, as a sizing policy.

``load_release(path)`` executes one ``sglang/srt/layers/moe/token_dispatcher/flashinfer.py``
(any release 0.5.10 ... 0.5.23, or a checkout) with ``sys.modules`` patched to the stand-ins
of ``standins.py`` (``unittest.mock.patch.dict``, restored even when SGLang raises). Nothing of
SGLang is patched: the class is constructed by its own ``__init__`` and ``dispatch`` runs as
shipped, on CPU tensors; FlashInfer's ``MoeAlltoAll`` is the recorder that stops it at the
launch. A release is an *engine policy*: ``bind(world, ctx)`` gives the per-rank callable, so
every rank's dispatch() sees the whole world (MoE shapes included), never a rebuilt one.
"""
from __future__ import annotations

from collections import OrderedDict
import inspect
import sys
import types
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional
from unittest import mock

from ..model.generations import active, modelling
from ..model.engine import EnginePolicy
from ..model.guard import GateInterrupt
from ..model.sglang_context import CAPTURE_SIZES, SGLangContext
from ..model.world import World
from ..sizing import NotApplicable, RankView
from ..releases.companions import Companions, defines
from ..sandbox.engine_tensors import stand_in_rows
from ..releases.tree import Tree
from ..sandbox.standins import UnmodelledCode, UnmodelledFinder, exec_engine_file, reentrant
from . import fetch
from .forward import ReleaseCodeError
from .report import (EMPTY_LIST, Outcome, SGLangAssertion,  # noqa: F401 - re-exported
                     describe_outcomes, describe_sources)
from .scheduler import ServerConfig, load_scheduler
from .bound_step import BoundStep
from .standins import (Hooks, Launched, RoutedAround, StandardTopKOutput, _Group,
                       _State, current, mlp_tp_gather, stand_in_globals, stand_in_modules)

__all__ = ["Outcome", "SGLangRelease", "BoundStep", "SGLangAssertion", "load_release",
           "load_tree", "tree_of", "tree_of_spec", "release_from_spec"]


_FINDER = UnmodelledFinder("sglang")  # every sglang.* module the stand-ins do not hold


@reentrant
@contextmanager
def _sandbox(flashinfer: str, version: str, imports: tuple = ()):
    """The stand-in modules, and torch's allocators sending "cuda" tensors to the CPU (old
    releases pre-allocate dummy tensors on "cuda" in __init__; their values are never read,
    and a recorder run must not initialise CUDA in every xdist worker of a GPU host).
    ``flashinfer``: "recorder" (stops at the launch), "emulated" (the CPU pool: the exact model of
    the kernels over gloo, tensors on the CPU) or "real" (the GPU pool: FlashInfer is real,
    tensors stay on the GPU and SGLang's
    ``torch.cuda.device_count()`` (its MNNVL ``gpus_per_node``) is the world's ep_size, the
    pool's one node. ``version``: the FlashInfer generation the code runs on (the world's: its
    stand-ins and names, ``generations.modelling``). ``imports``: where the tree's files import
    SGLang's own code from (``Companions.imports``), so its stand-ins answer there too."""
    import torch

    def to_cpu(fn):
        def inner(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return inner

    with ExitStack() as stack:
        stack.enter_context(modelling(version))
        stack.enter_context(mock.patch.dict(sys.modules,
                                            stand_in_modules(flashinfer, version, imports)))
        stack.enter_context(mock.patch.object(sys, "meta_path", sys.meta_path + [_FINDER]))
        if flashinfer != "real":  # the recorder never touches a GPU, even on a GPU host
            for name in ("empty", "full", "zeros", "ones"):
                stack.enter_context(mock.patch.object(torch, name, to_cpu(getattr(torch, name))))
        else:
            devices = torch.cuda.device_count
            stack.enter_context(mock.patch.object(
                torch.cuda, "device_count",
                lambda: current.get().world.ep_size if current.get(None) else devices()))
        yield


@dataclass(repr=False, eq=False)
class SGLangRelease(EnginePolicy):
    """One ``flashinfer.py`` loaded with stand-ins: ``outcome()`` runs one rank's dispatch(),
    ``bind(world)`` is the per-rank policy the properties check."""

    engine = "sglang"  # an engine policy (dispatcher/__main__.py, the tiers tell them apart)
    takes_context = True  # each step has an SGLangContext beside its world

    path: Path
    label: str
    loaded: Dict[str, types.ModuleType]  # FlashInfer generation -> the file executed against it
    sha256: str
    hooks: Hooks = Hooks()
    flashinfer: str = "recorder"  # or "real" / "emulated" MoeAlltoAll (the rank pools)
    process_group: object = None  # with real FlashInfer: the group SGLang bootstraps over
    tree: Optional[Tree] = None  # the tree under test: where the SGLang code beside it came from
    _instances: "OrderedDict[tuple, object]" = field(default_factory=OrderedDict, repr=False)
    _input_cache: Dict[tuple, tuple] = field(default_factory=dict, repr=False)
    _refusals: Dict[ServerConfig, Optional[str]] = field(default_factory=dict, repr=False)
    _padded_worlds: Dict[tuple, object] = field(default_factory=dict, repr=False)
    _replayed: Dict[tuple, object] = field(default_factory=dict, repr=False)
    MAX_INSTANCES = 2048  # constructed dispatchers kept (LRU): one per rank and shape

    @property
    def spec(self) -> str:
        return f"sglang:{self.label}"

    def module(self, version: str) -> types.ModuleType:
        """The file as executed against FlashInfer generation ``version`` (a world's: its
        imports of ``flashinfer.comm`` differ by generation), executed once per generation."""
        if version not in self.loaded:
            self.loaded[version] = _exec(self.path, self.sha256, self.flashinfer, version,
                                         self._imports)
        return self.loaded[version]

    @property
    def companions(self) -> Optional[Companions]:
        return self.tree.companions if self.tree else None

    @property
    def _imports(self) -> tuple:
        return self.companions.imports if self.companions else ()

    @property
    def sources(self) -> Dict[str, str]:
        """Which SGLang function makes each part of a step (``Scheduler.sources``): plain
        text, read the same here or through a supervised process."""
        return dict(self.hooks.scheduler.sources)

    def __repr__(self):
        return self.spec

    def _repr_pretty_(self, printer, cycle):  # Hypothesis prints dataclasses field by field
        printer.text(repr(self))

    def __call__(self, view: RankView) -> int:
        raise TypeError(f"{self.spec} runs SGLang's dispatch() for a whole world: call "
                        f"bind(world)(view), as dispatcher.model.properties.rule_values does")

    def _takes_sp_prefill_arg(self, version: str) -> bool:
        init = self.module(version).FlashinferDispatcher.__init__
        return "enable_sp_prefill_a2a" in inspect.signature(init).parameters

    def bind(self, world: World, ctx: SGLangContext = SGLangContext()) -> "BoundStep":
        """The policy for one world: each rank's call is that rank's dispatch() runtime."""
        return BoundStep(self, world, ctx)

    def refusal(self, world: World, ctx: SGLangContext = SGLangContext()) -> Optional[str]:
        """Why the release's own server-arg checks refuse this step's config for FlashInfer's
        A2A (then it is no step of this release's dispatcher), or None."""
        config = ServerConfig.of(world, ctx)
        if config not in self._refusals:
            self._refusals[config] = self.hooks.scheduler.refusal(config)
        return self._refusals[config]

    def engine_world(self, world: World, keep_cap: bool = False) -> World:
        """The nearest world this release runs: ``world``, or, for a topology its server-arg
        checks refuse, the same rows with every EP rank its own DP group (DP attention with
        attn_dp_size == tp_size, the topology every release since 0.5.13 requires); rows,
        cap and ideal runtime are unchanged. ``NotApplicable`` if that is refused too. Either
        is then padded as the release's forward batch pads a decode step (``padded_world``)."""
        if world.dp_global_kind == "empty":  # SGLang publishes no empty list (outcome())
            world = replace(world, dp_global_kind="none")
        if self.refusal(world) is None:
            return self.padded_world(world)
        rows = world.rows_per_rank
        nearest = replace(world, dp_size=world.ep_size, group_tokens=tuple(rows),
                          dp_global_kind="recorded", max_len_padding=False)
        reason = self.refusal(nearest)
        if reason:
            raise NotApplicable(reason)
        return self.padded_world(nearest)

    def dispatcher(self, world: World, rank: int, ctx: SGLangContext):
        """This rank's ``FlashinferDispatcher``, constructed by its own ``__init__`` (kept per
        rank and shape: SGLang builds one per layer at start-up)."""
        moe = world.moe
        key = (world.ep_size, rank, moe.hidden_size, moe.top_k, moe.num_experts, moe.payload,
               ctx.speculative, world.max_num_tokens, world.dp_size, ctx.sp_prefill_a2a,
               ctx.cap_from_env, ctx.chunked_prefill_size, world.flashinfer)
        if key in self._instances:
            self._instances.move_to_end(key)
        else:
            if len(self._instances) >= self.MAX_INSTANCES:
                self._instances.popitem(last=False)
            cls = self.module(world.flashinfer).FlashinferDispatcher
            kwargs = dict(group=self.process_group or _Group(world, rank), router_topk=moe.top_k,
                          num_experts=moe.num_experts,
                          num_local_experts=moe.num_experts // world.ep_size,
                          hidden_size=moe.hidden_size)
            if self._takes_sp_prefill_arg(world.flashinfer):
                kwargs["enable_sp_prefill_a2a"] = ctx.sp_prefill_a2a  # server arg, 0.5.2x
            d = cls(**kwargs)  # SGLang constructs its MoeAlltoAll (cap, workspace) itself
            quant = {}
            if moe.payload == "nvfp4":
                quant["input_global_scale"] = 1.0
            elif moe.payload == "mxfp8":
                quant["use_mxfp8"] = True
            d.set_quant_config(quant)
            self._instances[key] = d
        return self._instances[key]

    @contextmanager
    def as_rank(self, world: World, rank: int, ctx: SGLangContext):
        state = _State(world, rank, ctx, self.hooks)
        token = current.set(state)
        try:
            with _sandbox(self.flashinfer, world.flashinfer, self._imports):  # sglang.* is imported in calls too
                yield state
        finally:
            current.reset(token)

    def require_gather(self, world: World, ctx: SGLangContext = SGLangContext()) -> bool:
        """This release's own ``require_mlp_tp_gather()`` for the step's server args."""
        with self.as_rank(world, 0, ctx):
            return mlp_tp_gather()

    def records_every_group(self, world: World, ctx: SGLangContext = SGLangContext()) -> bool:
        """Whether every DP group's count is shared for these server args: this release's
        own ``require_mlp_tp_gather()``, and an all-gather that is not skipped."""
        if not world.dp_attention or ctx.skip_all_gather:
            return not ctx.skip_all_gather
        return self.require_gather(world, ctx)

    def padded_world(self, world: World, ctx: SGLangContext = SGLangContext()) -> World:
        """The eager step as the release's forward batch pads it: ``world`` with the padding
        mode the release's ``prepare_mlp_sync_batch`` chose, or, where its padded counts are
        not that (an edited padding), each DP group's padded rows as its count. ``world``
        itself where nothing is padded (no DP attention, a CUDA graph, no gathered list)."""
        if not world.dp_attention or ctx.forward_mode in ("capture", "replay"):
            return world
        key = (world, ctx)  # the world carries its generation
        if key not in self._padded_worlds:
            if len(self._padded_worlds) > 4096:
                self._padded_worlds.clear()
            self._padded_worlds[key] = self._pad(world, ctx)
        return self._padded_worlds[key]

    def _pad(self, world: World, ctx: SGLangContext) -> World:
        sched, tp = self.hooks.scheduler, world.attn_tp_size
        require = self.require_gather(world, ctx)
        with self.as_rank(world, 0, ctx):  # the release's env reads see this step's context
            padded = [sched.padded(world, ctx, g * tp, require) for g in range(world.dp_size)]
        if any(p is None for p in padded):
            return world
        rows = tuple(p.num_tokens for p in padded)
        moded = replace(world, max_len_padding=all(p.max_len for p in padded))
        if moded.padded_group_tokens == rows:
            return moded
        bad = [g for g, n in enumerate(rows) if type(n) is not int or n < 0 or n % tp]
        if bad:
            raise ReleaseCodeError(
                f"{sched.sources['padding']} padded DP group {bad[0]} to {rows[bad[0]]!r} "
                f"rows, not a multiple of attn_tp={tp}: the attention-TP scatter cannot split "
                f"it")
        return replace(world, group_tokens=rows, max_len_padding=False)

    def replay_world(self, world: World, ctx: SGLangContext) -> Optional[World]:
        """The padded step a CUDA-graph replay runs: each DP group's batch rounded up to the
        bucket the release's own decode runner (a draft forward: its EAGLE draft runner) picks
        for it (``forward.GraphRunner``: the
        cross-rank max when it requires the MLP gather, the group's own batch otherwise,
        SGLang #30242 / #30450); a draft forward's buckets count requests of
        ``tokens_per_req`` tokens each. ``None`` when the step runs eagerly: a batch larger
        than every bucket (the runner's ``can_run``), or no gathered counts (the all-gather
        skipped: the scheduler never marks the batch ``can_run_dp_cuda_graph``)."""
        key = (world, ctx)  # the world carries its generation
        if key not in self._replayed:  # every rank's outcome and the checks ask for it
            if len(self._replayed) > 4096:
                self._replayed.clear()
            self._replayed[key] = self._replay(world, ctx)
        return self._replayed[key]

    def _replay(self, world: World, ctx: SGLangContext) -> Optional[World]:
        sched, tp, k = self.hooks.scheduler, world.attn_tp_size, ctx.tokens_per_req
        require = self.require_gather(world, ctx) if world.dp_attention else False
        requests = [n // k for n in world.group_tokens]
        with self.as_rank(world, 0, ctx):  # the release's env reads see this step's context
            gathered = [sched.gathered(world, ctx, g * tp, require) if world.dp_attention
                        else None for g in range(world.dp_size)]
        if world.dp_attention and any(x is None for x in gathered):
            return None
        need = [max(gathered[g]) if require and world.dp_attention else requests[g]
                for g in range(world.dp_size)]
        if max(need) > CAPTURE_SIZES[-1]:
            return None
        runner = sched.draft_runner if ctx.draft_forward else sched.runner
        buckets = tuple(runner.bucket(ctx, CAPTURE_SIZES, require, requests[g], gathered[g]) * k
                        for g in range(world.dp_size))
        return replace(world, group_tokens=buckets, max_len_padding=False)

    def forward_world(self, world: World, ctx: SGLangContext) -> World:
        """The step whose rows the dispatcher holds: the replayed buckets, or the padded
        eager step (``world`` where the step runs eagerly without DP padding)."""
        if ctx.forward_mode == "replay":
            return self.replay_world(world, ctx) or world
        return self.padded_world(world, ctx)

    def outcome(self, world: World, rank: int, ctx: SGLangContext = SGLangContext()) -> Outcome:
        """Run this release's dispatch() as EP rank ``rank`` of ``world``. In ``replay``
        mode, the value is the one baked when the rank captured its bucket's graph."""
        refused = self.refusal(world, ctx)
        if refused:
            raise NotApplicable(refused)
        if world.dp_global_kind == "empty":
            raise NotApplicable(EMPTY_LIST)
        if max(world.group_tokens) == 0 and not (ctx.skip_all_gather and world.dp_attention):
            raise NotApplicable("every DP group is idle: SGLang's scheduler runs no forward "
                                "(no idle batch unless the all-gather is skipped)")
        if ctx.forward_mode == "replay":
            try:
                replayed = self.replay_world(world, ctx)
            except ReleaseCodeError as exc:
                return Outcome(error=str(exc))
            if replayed is None:
                raise NotApplicable("batch larger than every CUDA-graph bucket: runs eagerly")
            tp = world.attn_tp_size
            captured = replace(replayed, group_tokens=(replayed.group_tokens[rank // tp],) * world.dp_size)
            return self.outcome(captured, rank, replace(ctx, forward_mode="capture"))
        try:
            rows = self.padded_world(world, ctx).rows_per_rank[rank]
        except ReleaseCodeError as exc:
            return Outcome(error=str(exc))
        with self.as_rank(world, rank, ctx) as state:
            try:
                d = self.dispatcher(world, rank, ctx)
                for attr in ("runtime_max_tokens_per_rank", "active_moe_a2a", "active_a2a_namespace"):
                    d.__dict__.pop(attr, None)
                d.dispatch(*self._inputs(rows, world.moe))
                return Outcome(routed_around=True, seen_dp_global=state.seen_dp_global)
            except Launched as launched:
                return Outcome(launch=launched.record, seen_dp_global=state.seen_dp_global)
            except RoutedAround:
                return Outcome(routed_around=True, seen_dp_global=state.seen_dp_global)
            except (KeyboardInterrupt, GateInterrupt):  # the gate stopped the call
                raise
            except UnmodelledCode:  # code the gate cannot run: not judged, never SGLang's verdict
                raise
            except BaseException as exc:  # noqa: BLE001 - SGLang's own verdict, whatever it raised
                return Outcome(error=f"{type(exc).__name__}: {exc}",
                               seen_dp_global=state.seen_dp_global)

    def _inputs(self, n: int, moe):
        """dispatch()'s arguments for ``n`` rows (values are never read for sizing): bf16
        hidden states, int32 top-k ids, fp32 weights; cached, SGLang does not write them."""
        key = (n, moe.hidden_size, moe.top_k, moe.num_experts)
        if key not in self._input_cache:
            if len(self._input_cache) > 256:
                self._input_cache.clear()
            hidden, weights, ids = stand_in_rows(n, moe.hidden_size, moe.top_k, moe.num_experts)
            self._input_cache[key] = (hidden, StandardTopKOutput(weights, ids, None))
        return self._input_cache[key]

    def step(self, world: World, ctx: SGLangContext = SGLangContext()) -> List[Outcome]:
        """Every EP rank's outcome for one step."""
        with _sandbox(self.flashinfer, world.flashinfer, self._imports):
            return [self.outcome(world, r, ctx) for r in range(world.ep_size)]


_LOADED: Dict[tuple, SGLangRelease] = {}


def tree_of(path, label: Optional[str] = None) -> Tree:
    """The tree of one dispatcher ``flashinfer.py`` (``dispatcher/releases/tree.py``): read, nothing of
    it run; a file that is no SGLang dispatcher file is refused before its companions are
    looked for."""
    path = Path(path).resolve()
    if not path.is_file() or path.suffix != ".py":
        raise fetch.ReleaseError(f"sglang:{path}: expected SGLang's flashinfer.py, an SGLang "
                                 f"checkout, a wheel or a release version")
    if not defines(path, "FlashinferDispatcher"):  # read, not run: before its companions
        raise _not_ours(path)
    return fetch.CODE.at(path, label)


def _not_ours(path: Path) -> fetch.ReleaseError:
    return fetch.ReleaseError(f"sglang:{path} defines no FlashinferDispatcher class: it is "
                              f"not SGLang's token_dispatcher/flashinfer.py")


def load_release(path, label: Optional[str] = None, flashinfer: str = "recorder") -> SGLangRelease:
    """Load one dispatcher ``flashinfer.py`` with the SGLang code beside it (loaded once per
    process for each content of the file and of that code: a lone copy of a release and the
    release itself share nothing but what is the same)."""
    return load_tree(tree_of(path, label), flashinfer)


def load_tree(tree: Tree, flashinfer: str = "recorder") -> SGLangRelease:
    """The tree's dispatcher file executed on the stand-ins, with the SGLang code the tree
    resolved compiled beside it. It is first executed against the session's default generation
    (the load probe: a release that cannot import there is refused at load); each world's step
    runs the file as executed against that world's own generation (``SGLangRelease.module``)."""
    version = active().version  # a default: the session's generation, for the load probe
    module = _exec(tree.main, tree.digest, flashinfer, version, tree.companions.imports)
    if not isinstance(getattr(module, "FlashinferDispatcher", None), type):
        raise _not_ours(tree.main)
    key = (tree.key, flashinfer)
    if key in _LOADED:
        return _LOADED[key]
    namespace = stand_in_globals()
    hooks = Hooks(
        scheduler=load_scheduler(tree, namespace),
        require_mlp_tp_gather=tree.function("require_mlp_tp_gather", namespace),
        a2a_cap=tree.function("flashinfer_a2a_max_dispatch_tokens_per_rank", namespace))
    release = SGLangRelease(tree.main, tree.label, {version: module}, tree.digest,
                            hooks, flashinfer, tree=tree)
    _LOADED[key] = release
    return release


_MODULES: Dict[tuple, types.ModuleType] = {}


def _exec(path: Path, digest: str, flashinfer: str, version: str, imports: tuple = ()
          ) -> types.ModuleType:
    """The file executed against one FlashInfer generation (once per content per process and
    per place the tree's imports lead)."""
    name = f"_a2a_gate_sglang_{digest[:16]}_{flashinfer}_{version.replace('.', '_')}"
    if (name, imports) not in _MODULES:
        _MODULES[name, imports] = exec_engine_file(path, name, _sandbox(flashinfer, version, imports),
                                                   "sglang")
    return _MODULES[name, imports]


def tree_of_spec(target: str) -> Tree:
    """The tree ``sglang:TARGET`` names (nothing of it run): "" (installed), a version, a
    wheel, a checkout or a flashinfer.py."""
    return tree_of(*fetch.CODE.main_file(target))


def release_from_spec(target: str, flashinfer: str = "recorder") -> SGLangRelease:
    """``sglang:TARGET``: "" (installed), a version, a wheel, a checkout or a flashinfer.py."""
    return load_tree(tree_of_spec(target), flashinfer)
