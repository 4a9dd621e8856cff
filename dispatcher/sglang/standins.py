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
import types
from dataclasses import dataclass
from typing import Dict, NamedTuple

from ..model.sglang_context import SGLangContext
from ..model.validation import CAP_ENV
from ..model.workspace import PayloadFormat, dispatch_payloads, workspace_size_per_rank
from ..model.world import World

__all__ = ["Launched", "RoutedAround", "StandIn", "stand_in_modules", "current"]


class Launched(Exception):
    def __init__(self, runtime):
        super().__init__(runtime)
        self.runtime = runtime


class RoutedAround(Exception):
    """dispatch() sent the batch around the A2A (prefill all-gather, standard dispatcher)."""


@dataclass
class _State:
    world: World
    rank: int
    ctx: SGLangContext


current: contextvars.ContextVar[_State] = contextvars.ContextVar("sglang_world")


def _state() -> _State:
    return current.get()


# --- stand-ins for what SGLang reads -------------------------------------------------------
def get_dp_global_num_tokens():
    """The scheduler's list. DP attention always records it (FlashInfer A2A forces
    require_mlp_tp_gather; CUDA-graph capture records [bs] * dp_size); without DP attention,
    capture records nothing (None), eager decode one pre-scatter entry."""
    s = _state()
    w = s.world
    if w.dp_attention:  # recorded in every mode; unrecorded worlds run one uniform batch
        return list(w.padded_group_tokens)
    if s.ctx.forward_mode == "capture":
        return None
    dpg = w.dp_global
    return None if dpg is None else list(dpg)


def is_dp_attention_enabled():
    return _state().world.dp_attention


def get_is_extend_in_batch():
    return _state().ctx.forward_mode in ("extend", "mixed")


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


def get_parallel():
    s = _state()
    w = s.world
    return types.SimpleNamespace(
        attn_tp_size=w.attn_tp_size, attn_dp_enabled=w.dp_attention, num_dp_ranks=w.dp_size,
        tp_size=w.ep_size, moe_dense_tp_size=s.ctx.moe_dense_tp_size,
        enable_dp_lm_head=s.ctx.enable_dp_lm_head, tp_group=_Group(w, s.rank))


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
    w = s.world
    return types.SimpleNamespace(
        speculative_algorithm=_spec_name(), enable_dp_attention=w.dp_attention, dp_size=w.dp_size,
        tp_size=w.ep_size, ep_size=w.ep_size, moe_dense_tp_size=s.ctx.moe_dense_tp_size,
        enable_dp_lm_head=s.ctx.enable_dp_lm_head, moe_a2a_backend="flashinfer",
        chunked_prefill_size=w.max_num_tokens, flashinfer_a2a_dispatch_type="bf16")


def get_schedule():
    return types.SimpleNamespace(chunked_prefill_size=_state().world.max_num_tokens)


def max_prefill_buffer_tokens():
    return _state().world.max_num_tokens


def flashinfer_a2a_max_dispatch_tokens_per_rank(*_a, **_k):
    return _state().world.max_num_tokens


def require_mlp_tp_gather(server_args=None, **_k):
    """SGLang 0.5.14's helper (the only release that imports it here), on the world."""
    a = server_args or _server_args()
    if a.enable_dp_attention:
        assert a.dp_size > 1, "dp_size must be greater than 1"
        if a.moe_dense_tp_size is None or not a.enable_dp_lm_head:
            return True
        return a.moe_dense_tp_size > a.tp_size // a.dp_size
    return False


class _Env:
    def __init__(self, name):
        self.name = name

    def get(self):
        if self.name == CAP_ENV:
            return _state().world.max_num_tokens
        return False


class _Envs:
    def __getattr__(self, name):
        return _Env(name)


def get_int_env_var(name, default=0):
    return _Env(name).get() if name.startswith("SGLANG_FLASHINFER") else default


class _RunnerBackend:
    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda: False
        raise AttributeError(name)


def get_moe_runner_backend():
    return _RunnerBackend()


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


# --- stand-ins for FlashInfer: the recorder ---------------------------------------------------
class MoeAlltoAll:
    """Records the runtime SGLang passes and stops dispatch() right there."""

    def __init__(self, mapping=None, max_num_tokens=None, top_k=None, num_experts=None,
                 workspace_size_per_rank=None, mnnvl_config=None, **_k):
        self.max_num_tokens = max_num_tokens

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k):
        raise Launched(runtime_max_tokens_per_rank)


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token, *a, **k):
    return workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                   combine_payload_size_per_token)


class _Record:
    def __init__(self, *a, **k):
        self.__dict__.update(k)


def _quantized(x, fmt: PayloadFormat):
    """Zero tensors of the shapes FlashInfer's quantizer returns for ``fmt`` (values are
    never read for sizing): the hidden payload and its scales, bytes from the byte model."""
    import torch

    n, h = x.shape
    hidden, scales = dispatch_payloads(fmt, h, 1)[:2]
    return (torch.zeros(n, hidden.bytes_per_token, dtype=torch.uint8),
            torch.zeros(n, scales.bytes_per_token, dtype=torch.uint8))


def _fp4_quantize(x, *a, **k):
    return _quantized(x, PayloadFormat.NVFP4)


def _mxfp8_quantize(x, *a, **k):
    import torch

    q, sf = _quantized(x, PayloadFormat.MXFP8)
    return q.view(torch.float8_e4m3fn), sf.reshape(-1)


def _identity(x, *a, **k):
    return x


def _table() -> Dict[str, Dict[str, object]]:
    dp = {"get_dp_global_num_tokens": get_dp_global_num_tokens,
          "is_dp_attention_enabled": is_dp_attention_enabled,
          "get_is_extend_in_batch": get_is_extend_in_batch}
    ctx = {"get_flags": get_flags, "get_forward": get_forward, "get_parallel": get_parallel,
           "get_spec": get_spec, "get_schedule": get_schedule, "get_server_args": _server_args,
           "max_prefill_buffer_tokens": max_prefill_buffer_tokens}
    logging_ = {"debug_kernel_api": _identity}
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
            "get_moe_runner_backend": get_moe_runner_backend},
        "sglang.srt.layers.quantization": {},
        "sglang.srt.layers.quantization.fp4_utils": {"fp4_quantize": _fp4_quantize},
        "sglang.srt.runtime_context": ctx,
        "sglang.srt.server_args": {"get_global_server_args": _server_args},
        "sglang.srt.speculative": {},
        "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": SpeculativeAlgorithm},
        "sglang.srt.utils.common": {"require_mlp_tp_gather": require_mlp_tp_gather},
        "flashinfer": {"fp4_quantize": _fp4_quantize, "nvfp4_block_scale_interleave": _identity,
                       "mxfp8_quantize": _mxfp8_quantize},
        "flashinfer.comm": {"MoeAlltoAll": MoeAlltoAll,
                            "moe_a2a_get_workspace_size_per_rank": moe_a2a_get_workspace_size_per_rank},
        "flashinfer.comm.mapping": {"Mapping": _Record},
        "flashinfer.comm.mnnvl": {"MnnvlConfig": _Record},
    }


class StandIn(types.ModuleType):
    """A stand-in module: only the names listed; anything else fails the load by name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"the SGLang adapter has no stand-in for {self.__name__}.{name}: "
                          f"add one in dispatcher/sglang/standins.py")


def stand_in_modules() -> Dict[str, types.ModuleType]:
    """Every module SGLang's dispatcher file imports, as stand-ins (for ``sys.modules``)."""
    mods = {}
    for name, attrs in _table().items():
        m = StandIn(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodule imports resolve through sys.modules
        mods[name] = m
    return mods
