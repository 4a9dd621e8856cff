"""Stand-ins for everything SGLang's ``flashinfer.py`` imports, reading the world under test.

``get_dp_global_num_tokens``, ``is_dp_attention_enabled``, ``get_is_extend_in_batch``,
``get_parallel().attn_tp_size``, the server args and env vars, the forward mode and
speculative decoding answer from the current (world, rank, context); FlashInfer's
``MoeAlltoAll`` is a recorder that captures the ``runtime_max_tokens_per_rank`` SGLang passes
to ``dispatch`` (and stops there). ``stand_in_modules()`` is the module table the loader
installs; a name missing from it fails the load by name (never a silent stub).
"""
from __future__ import annotations

import contextvars
import enum
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

from ..model.sglang_context import DERIVED_CAP_FLOOR, SGLangContext
from ..model.validation import CAP_ENV
from ..model.world import World
from ..sandbox.standins import (FlashInferStandIn, Launched, StandIn, build_modules, flashinfer_api,  # noqa: F401
                        fp4_quantize, identity, mxfp8_quantize)
from .flashinfer_side import (LaunchRecord, MoeAlltoAll, moe_a2a_get_workspace_size_per_rank,  # noqa: F401
                              torch_distributed_comm_backend)

__all__ = ["Launched", "LaunchRecord", "RoutedAround", "Hooks", "StandIn", "stand_in_modules",
           "stand_in_globals", "current"]


class RoutedAround(Exception):
    """dispatch() sent the batch around the A2A (prefill all-gather, standard dispatcher)."""


@dataclass(frozen=True)
class Hooks:
    """Functions of the release under test that live beside its dispatcher file (loaded
    from its own ``utils/common.py`` / ``arg_groups/overrides.py``; ``None`` where the tree
    under test has no such file, and then the stand-in's documented default answers)."""

    require_mlp_tp_gather: Optional[Callable] = None
    a2a_cap: Optional[Callable] = None
    scheduler: object = None  # scheduler.Scheduler: the release's scheduler-side functions


@dataclass
class _State:
    world: World
    rank: int
    ctx: SGLangContext
    hooks: Hooks
    seen_dp_global: object = "not read"
    args: object = None  # the server args / parallel state, built once per (rank, step)
    parallel: object = None


current: contextvars.ContextVar[_State] = contextvars.ContextVar("sglang_world")


def _state() -> _State:
    return current.get()


# --- stand-ins for what SGLang reads -------------------------------------------------------
def mlp_tp_gather() -> bool:
    """The release's own ``require_mlp_tp_gather()`` for this world's server args. Without
    the release's ``utils/common.py``: True under DP attention (what every release since the
    fix of SGLang #30242 returns for FlashInfer A2A)."""
    s = _state()
    fn = s.hooks.require_mlp_tp_gather
    if fn is None:
        return s.world.dp_attention
    return _mlp_tp_gather(fn, s.world, s.ctx)


@functools.lru_cache(maxsize=1024)
def _mlp_tp_gather(fn, world: World, ctx: SGLangContext) -> bool:
    """The release's answer for one step's server args (a function of the world and context
    alone, the same on every rank), asked by the first rank that needs it."""
    return bool(fn(_server_args()) if _takes_server_args(fn) else fn())


@functools.lru_cache(maxsize=None)
def _takes_server_args(fn) -> bool:
    """Older releases take ``server_args``; newer ones read the runtime context."""
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in inspect.signature(fn).parameters.values())


def get_dp_global_num_tokens():
    """The release's own scheduler-side functions decide it (``scheduler.Scheduler.dp_global``;
    the stale list of the hardening column when the context asks for one)."""
    s = _state()
    gather = mlp_tp_gather() if s.world.dp_attention else False
    sched = s.hooks.scheduler
    value = (sched.stale_dp_global if s.ctx.stale_by else sched.dp_global)(s.world, s.ctx, s.rank, gather)
    s.seen_dp_global = value
    return value


def is_dp_attention_enabled():
    return _state().world.dp_attention


def get_is_extend_in_batch():
    return _state().ctx.forward_mode in ("extend", "mixed")


def get_is_capture_mode():
    return _state().ctx.forward_mode == "capture"


class _Group:
    def __init__(self, world: World, rank: int):
        self._w, self._r = world, rank

    def size(self):
        return self._w.ep_size

    def rank(self):
        return self._r

    def all_gatherv(self, *a, **k):
        raise RoutedAround()

    def reduce_scatterv(self, *a, **k):
        raise RoutedAround()


def _no_stand_in(name: str, what: str, error=AttributeError):
    """A name SGLang reads that has no stand-in: fail by name (dunder lookups stay plain)."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise error(f"the SGLang adapter has no stand-in for {what}: add it in "
                f"dispatcher/sglang/standins.py")


class _Args(types.SimpleNamespace):
    """Server args / parallel state: the fields listed; any other fails by name."""

    def __getattr__(self, name):
        _no_stand_in(name, f"the server arg or parallel field {name!r}")


def get_parallel():
    s = _state()
    if s.parallel is None:
        s.parallel = _Args(**vars(_server_args()), attn_tp_size=s.world.attn_tp_size,
                           attn_dp_enabled=s.world.dp_attention, num_dp_ranks=s.world.dp_size,
                           tp_group=_Group(s.world, s.rank))
    return s.parallel


def get_exec():
    return types.SimpleNamespace(moe=types.SimpleNamespace(elastic_ep_backend=None))


def get_forward():
    s = _state()
    sp = not s.world.dp_attention and s.world.attn_tp_size > 1
    return types.SimpleNamespace(sp_active=s.ctx.sp_prefill_a2a and sp)


def _spec_name():
    return "EAGLE" if _state().ctx.speculative else None


def get_flags():
    return types.SimpleNamespace(moe=types.SimpleNamespace(speculative_context=_state().ctx.speculative))


def get_spec():
    return types.SimpleNamespace(speculative_algorithm=_spec_name())


def _server_args():
    s = _state()
    if s.args is None:
        s.args = _new_server_args(s)
    return s.args


def _new_server_args(s):
    w = s.world
    return _Args(
        speculative_algorithm=_spec_name(), enable_dp_attention=w.dp_attention, dp_size=w.dp_size,
        tp_size=w.ep_size, ep_size=w.ep_size, moe_dense_tp_size=s.ctx.moe_dense_tp_size,
        enable_dp_lm_head=s.ctx.enable_dp_lm_head, moe_a2a_backend="flashinfer",
        chunked_prefill_size=s.ctx.chunked_prefill_size, elastic_ep_backend=None,
        disable_attn_tp_gather=False, flashinfer_a2a_dispatch_type="bf16")


def get_schedule():
    return types.SimpleNamespace(chunked_prefill_size=_state().ctx.chunked_prefill_size)


def max_prefill_buffer_tokens():
    return _state().ctx.chunked_prefill_size


def flashinfer_a2a_max_dispatch_tokens_per_rank(prefill_buffer_tokens, *a, **k):
    """The release's own cap derivation (arg_groups/overrides.py, 0.5.22+); without it, the
    env var or ``max(prefill_buffer_tokens, 4096)``, as those releases do."""
    fn = _state().hooks.a2a_cap
    if fn is not None:
        return fn(prefill_buffer_tokens, *a, **k)
    configured = _Env(CAP_ENV).get()
    return configured if configured is not None else max(prefill_buffer_tokens, DERIVED_CAP_FLOOR)


def require_mlp_tp_gather(*a, **k):
    """Imported by the dispatcher of 0.5.14 / 0.5.15: the release's own function."""
    return mlp_tp_gather()


class _Env:
    """``envs.NAME`` / ``get_int_env_var``: the cap (when the context sets it) and whether
    NVFP4 dispatch is on; every other variable is unset."""

    def __init__(self, name):
        self.name = name

    def get(self, default=None):
        s = current.get(None)
        if s is None:  # read at import time, before any world: unset
            return default if default is not None else False
        if self.name == CAP_ENV:
            return s.world.max_num_tokens if s.ctx.cap_from_env else default
        if self.name == "SGLANG_MOE_NVFP4_DISPATCH":
            return s.world.moe.payload == "nvfp4"
        if self.name == "SGLANG_SCHEDULER_SKIP_ALL_GATHER":
            return s.ctx.skip_all_gather
        return default if default is not None else False


class _Envs:
    def __getattr__(self, name):
        return _Env(name)


def get_int_env_var(name, default=0):
    return _Env(name).get(default)


class _Backend:
    """A backend enum member: ``is_<name>()`` is True for its own name only."""

    def __init__(self, name=""):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            return lambda: attr[3:] == self.name
        raise AttributeError(attr)


def get_moe_runner_backend():
    return _Backend()  # no runner-specific path (cutlass payload-in-workspace etc.)


def get_moe_a2a_backend():
    return _Backend("flashinfer")


class MoeA2ABackend(_Backend):
    pass


class FlashinferA2ADispatchType(enum.Enum):
    BF16 = "bf16"
    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"


def get_flashinfer_a2a_dispatch_type():
    return FlashinferA2ADispatchType(_state().world.moe.payload)


class SpeculativeAlgorithm:
    def __init__(self, name):
        self.name = name

    @classmethod
    def from_string(cls, s):
        return cls(s)

    def is_eagle(self):
        return bool(self.name) and "EAGLE" in str(self.name).upper()

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda: False
        raise AttributeError(name)


class StandardTopKOutput(NamedTuple):
    topk_weights: object
    topk_ids: object
    router_logits: object


class TopKOutputChecker:
    @staticmethod
    def format_is_bypassed(_o):
        return False

    @staticmethod
    def format_is_standard(_o):
        return True


class _Format(enum.Enum):
    STANDARD = "standard"
    FLASHINFER = "flashinfer"


class BaseDispatcher:
    def __init__(self, *a, **k):
        self.quant_config = {}

    def set_quant_config(self, quant_config):
        self.quant_config = quant_config


class StandardDispatcher(BaseDispatcher):
    def dispatch(self, *a, **k):
        raise RoutedAround()


class _Record:
    def __init__(self, *a, **k):
        self.__dict__.update(k)


def _table() -> Dict[str, Dict[str, object]]:
    dp = {"get_dp_global_num_tokens": get_dp_global_num_tokens,
          "is_dp_attention_enabled": is_dp_attention_enabled,
          "get_is_extend_in_batch": get_is_extend_in_batch}
    ctx = {"get_flags": get_flags, "get_forward": get_forward, "get_parallel": get_parallel,
           "get_spec": get_spec, "get_schedule": get_schedule, "get_server_args": _server_args,
           "get_exec": get_exec, "max_prefill_buffer_tokens": max_prefill_buffer_tokens}
    logging_ = {"debug_kernel_api": identity}
    return {
        "sglang": {}, "sglang.srt": {}, "sglang.kernels": {}, "sglang.srt.layers": {},
        "sglang.srt.layers.moe": {}, "sglang.srt.utils": {"get_int_env_var": get_int_env_var},
        "sglang.kernel_api_logging": logging_, "sglang.kernels.kernel_api_logging": logging_,
        "sglang.srt.arg_groups": {},
        "sglang.srt.arg_groups.overrides": {
            "flashinfer_a2a_max_dispatch_tokens_per_rank": flashinfer_a2a_max_dispatch_tokens_per_rank},
        "sglang.srt.environ": {"envs": _Envs()},
        "sglang.srt.layers.dp_attention": dp,
        "sglang.srt.layers.moe.moe_runner": {},
        "sglang.srt.layers.moe.moe_runner.base": {"MoeRunnerConfig": _Record},
        "sglang.srt.layers.moe.token_dispatcher": {
            "BaseDispatcher": BaseDispatcher, "CombineInput": object, "DispatchOutput": object,
            "CombineInputFormat": _Format, "DispatchOutputFormat": _Format},
        "sglang.srt.layers.moe.token_dispatcher.flashinfer_utils": {"TorchDistributedCommBackend": _Record},
        "sglang.srt.layers.moe.token_dispatcher.standard": {
            "StandardCombineInput": _Record, "StandardDispatcher": StandardDispatcher,
            "StandardDispatchOutput": _Record},
        "sglang.srt.layers.moe.topk": {"StandardTopKOutput": StandardTopKOutput,
                                       "TopKOutput": object, "TopKOutputChecker": TopKOutputChecker},
        "sglang.srt.layers.moe.utils": {
            "FlashinferA2ADispatchType": FlashinferA2ADispatchType,
            "get_flashinfer_a2a_dispatch_type": get_flashinfer_a2a_dispatch_type,
            "get_moe_runner_backend": get_moe_runner_backend,
            "get_moe_a2a_backend": get_moe_a2a_backend, "MoeA2ABackend": MoeA2ABackend},
        "sglang.srt.model_executor": {}, "sglang.srt.model_executor.runner_utils": {},
        "sglang.srt.model_executor.runner_utils.capture_mode": {
            "get_is_capture_mode": get_is_capture_mode},
        "sglang.srt.layers.quantization": {},
        "sglang.srt.layers.quantization.fp4_utils": {"fp4_quantize": fp4_quantize},
        "sglang.srt.runtime_context": ctx,
        "sglang.srt.server_args": {"get_global_server_args": _server_args},
        "sglang.srt.speculative": {},
        "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": SpeculativeAlgorithm},
        "sglang.srt.utils.common": {"require_mlp_tp_gather": require_mlp_tp_gather},
        "flashinfer": {"fp4_quantize": fp4_quantize, "nvfp4_block_scale_interleave": identity,
                       "mxfp8_quantize": mxfp8_quantize},
        "flashinfer.comm": {"MoeAlltoAll": MoeAlltoAll,
                            "moe_a2a_get_workspace_size_per_rank": moe_a2a_get_workspace_size_per_rank},
        "flashinfer.comm.mapping": {"Mapping": _Record},
        "flashinfer.comm.mnnvl": {"MnnvlConfig": _Record},
    }


def stand_in_modules(flashinfer: str, version: str, imports: tuple = ()
                     ) -> Dict[str, types.ModuleType]:
    """Every module SGLang's dispatcher file imports, as stand-ins (for ``sys.modules``).
    ``flashinfer``: "recorder" (``MoeAlltoAll`` records and stops at the launch); "emulated"
    (the CPU rank pool: ``emulator.gloo.EmulatedMoeAlltoAll``, the exact model over gloo);
    "real" (FlashInfer's own modules answer, and SGLang's comm backend runs over
    torch.distributed).
    ``imports`` (``Companions.imports``: a piece of SGLang's code -> the modules the tree's
    files import it from) puts the stand-in that runs that piece in those modules too, so a
    tree importing a helper from a new module reaches the helper. A name of SGLang's own
    modules that the table lacks, and any module of SGLang's it does not hold, import as
    ``Unmodelled`` (``UnmodelledFinder``): using one stops the call by name, not judged.
    ``version``: the FlashInfer generation whose modules and names they offer."""
    return _stand_in_modules(flashinfer, version, imports)


@functools.lru_cache(maxsize=64)
def _stand_in_modules(flashinfer: str, version: str, imports: tuple = ()
                      ) -> Dict[str, types.ModuleType]:
    from ..flashinfer.api import api

    table = _table()
    runs = {name: value for attrs in table.values() for name, value in attrs.items()}
    for key, modules in imports:
        for module in modules:
            if key in runs:
                table[module] = dict(table.get(module, {}), **{key: runs[key]})
    names = api(version).comm_names  # what this release's flashinfer.comm binds
    table["flashinfer.comm"] = {n: a for n, a in table["flashinfer.comm"].items() if n in names}
    if flashinfer == "real":
        table = {n: a for n, a in table.items() if n != "flashinfer" and not n.startswith("flashinfer.")}
        table["sglang.srt.layers.moe.token_dispatcher.flashinfer_utils"] = {
            "TorchDistributedCommBackend": torch_distributed_comm_backend()}
    elif flashinfer == "emulated":
        from ..emulator.gloo import EmulatedMoeAlltoAll

        if "MoeAlltoAll" in table["flashinfer.comm"]:
            table["flashinfer.comm"] = dict(table["flashinfer.comm"],
                                            MoeAlltoAll=EmulatedMoeAlltoAll)
    elif flashinfer != "recorder":
        raise ValueError(f"flashinfer={flashinfer!r}: recorder, emulated or real")
    return build_modules(table, "sglang", version, lenient=True)


def stand_in_globals() -> Dict[str, object]:
    """Every stand-in name, for running a release's companion function (its module-level
    names, e.g. ``envs`` or ``get_parallel``, answered by the stand-ins)."""
    names: Dict[str, object] = {"ServerArgs": object}
    for attrs in _table().values():
        names.update(attrs)
    return names
