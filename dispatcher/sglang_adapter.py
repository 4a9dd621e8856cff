"""Run SGLang's own ``FlashinferDispatcher.dispatch()``, unmodified, as a sizing policy.

``load_release(path)`` executes one ``sglang/srt/layers/moe/token_dispatcher/flashinfer.py``
(any release 0.5.10 ... 0.5.23, or a checkout) with its ``sglang.*`` and ``flashinfer.*``
imports answered by stand-ins that read the world being tested: ``get_dp_global_num_tokens``,
``is_dp_attention_enabled``, ``get_is_extend_in_batch``, ``get_parallel().attn_tp_size``, the
server args and env vars, the forward mode, speculative decoding. FlashInfer's ``MoeAlltoAll``
is replaced by a recorder that captures the ``runtime_max_tokens_per_rank`` SGLang passes to
``dispatch`` (and stops there); the prefill all-gather path of newer releases is recorded as
"routed around the A2A". Nothing of SGLang is patched: the class is constructed by its own
``__init__`` and ``dispatch`` runs as shipped, on CPU tensors.

Every name a release imports must have a stand-in below; an unknown one fails the load with
its name (never a silent stub), so a new release that reads something new is noticed.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, NamedTuple, Optional, Tuple

from .dispatcher import CapExceeded
from .sizing import NotApplicable, RankView
from .workspace import workspace_size_per_rank
from .world import World

__all__ = ["SGLangContext", "Outcome", "SGLangRelease", "SGLangAssertion", "load_release",
           "installed_release_path", "fetch_release", "RELEASE_FILE", "CACHE"]

RELEASE_FILE = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
CACHE = Path(os.environ.get("A2A_GATE_SGLANG_CACHE", Path(__file__).resolve().parents[1] / ".sglang"))
FORWARD_MODES = ("decode", "extend", "mixed", "capture")


class SGLangAssertion(AssertionError):
    """SGLang's own dispatch() raised (an assert or error) where it had to size the A2A."""


@dataclass(frozen=True)
class SGLangContext:
    """What SGLang's code paths read beyond the world's topology: the forward mode (decode,
    extend, mixed, or CUDA-graph capture), speculative decoding, and the server args that
    decide ``require_mlp_tp_gather`` (dense TP size, DP LM head)."""

    forward_mode: str = "decode"
    speculative: bool = False
    moe_dense_tp_size: Optional[int] = None
    enable_dp_lm_head: bool = False
    sp_prefill_a2a: bool = False

    def __post_init__(self):
        if self.forward_mode not in FORWARD_MODES:
            raise ValueError(f"forward_mode {self.forward_mode!r} not in {FORWARD_MODES}")


@dataclass(frozen=True)
class Outcome:
    """What one EP rank's dispatch() did: launched the A2A with ``runtime``, routed the
    batch around it (all-gather prefill), or raised ``error``."""

    runtime: Optional[int] = None
    routed_around: bool = False
    error: Optional[str] = None


class _Launched(Exception):
    def __init__(self, runtime):
        super().__init__(runtime)
        self.runtime = runtime


class _RoutedAround(Exception):
    pass


@dataclass
class _State:
    world: World
    rank: int
    ctx: SGLangContext


_CURRENT: contextvars.ContextVar[_State] = contextvars.ContextVar("sglang_world")


def _state() -> _State:
    return _CURRENT.get()


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
        raise _RoutedAround()

    def reduce_scatterv(self, *a, **k):
        raise _RoutedAround()


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
        if self.name == "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK":
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
        raise _RoutedAround()


# --- stand-ins for FlashInfer: the recorder ---------------------------------------------------
class MoeAlltoAll:
    """Records the runtime SGLang passes and stops dispatch() right there."""

    def __init__(self, mapping=None, max_num_tokens=None, top_k=None, num_experts=None,
                 workspace_size_per_rank=None, mnnvl_config=None, **_k):
        self.max_num_tokens = max_num_tokens

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k):
        raise _Launched(runtime_max_tokens_per_rank)


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token, *a, **k):
    return workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                   combine_payload_size_per_token)


class _Record:
    def __init__(self, *a, **k):
        self.__dict__.update(k)


def _fp4_quantize(x, global_scale=None, is_sf_swizzled_layout=False, **_k):
    import torch

    n, h = x.shape
    return (torch.zeros(n, h // 2, dtype=torch.uint8), torch.zeros(n, h // 16, dtype=torch.uint8))


def _mxfp8_quantize(x, *a, **k):
    import torch

    n, h = x.shape
    return (torch.zeros(n, h, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.zeros(n * h // 32, dtype=torch.uint8))


def _identity(x, *a, **k):
    return x


def _stand_in_modules() -> Dict[str, Dict[str, object]]:
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


class _StandIn(types.ModuleType):
    """A stand-in module: only the names listed; anything else fails the load by name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"the SGLang adapter has no stand-in for {self.__name__}.{name}: "
                          f"add one in dispatcher/sglang_adapter.py")


@contextlib.contextmanager
def _stand_ins():
    saved = {}
    mods = _stand_in_modules()
    for name, attrs in mods.items():
        saved[name] = sys.modules.get(name)
        m = _StandIn(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodule imports resolve through sys.modules
        sys.modules[name] = m
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


@contextlib.contextmanager
def _cuda_to_cpu():
    """Old releases pre-allocate dummy tensors on "cuda" in __init__; on a CPU machine they
    go to the CPU (values are never read for sizing)."""
    import torch

    names = ("empty", "full", "zeros", "ones")
    orig = {n: getattr(torch, n) for n in names}

    def wrap(fn):
        def inner(*a, **k):
            if str(k.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
                k["device"] = "cpu"
            return fn(*a, **k)
        return inner
    for n in names:
        setattr(torch, n, wrap(orig[n]))
    try:
        yield
    finally:
        for n, f in orig.items():
            setattr(torch, n, f)


@dataclass(repr=False)
class SGLangRelease:
    """One ``flashinfer.py`` loaded with stand-ins; call it as a policy or ``outcome()``."""

    path: Path
    label: str
    module: types.ModuleType
    _instances: Dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def __name__(self):  # noqa: A003 - reads like a policy in reports
        return f"sglang:{self.label}"

    def __repr__(self):
        return f"sglang:{self.label}"

    def _repr_pretty_(self, printer, cycle):  # Hypothesis prints dataclasses field by field
        printer.text(repr(self))

    def _dispatcher(self, world: World, rank: int, ctx: SGLangContext):
        moe = world.moe
        key = (world.ep_size, rank, moe.hidden_size, moe.top_k, moe.num_experts, moe.payload,
               ctx.speculative, world.max_num_tokens, world.dp_size, ctx.sp_prefill_a2a)
        if key not in self._instances:
            cls = self.module.FlashinferDispatcher
            with _cuda_to_cpu():
                kwargs = dict(group=_Group(world, rank), router_topk=moe.top_k,
                              num_experts=moe.num_experts,
                              num_local_experts=moe.num_experts // world.ep_size,
                              hidden_size=moe.hidden_size)
                if "enable_sp_prefill_a2a" in inspect.signature(cls.__init__).parameters:
                    kwargs["enable_sp_prefill_a2a"] = ctx.sp_prefill_a2a  # server arg, 0.5.2x
                d = cls(**kwargs)
            quant = {}
            if moe.payload == "nvfp4":
                quant["input_global_scale"] = 1.0
            elif moe.payload == "mxfp8":
                quant["use_mxfp8"] = True
            d.set_quant_config(quant)
            d.max_num_tokens = world.max_num_tokens  # the world's cap (constructed from it)
            self._instances[key] = d
        return self._instances[key]

    def outcome(self, world: World, rank: int, ctx: SGLangContext = SGLangContext()) -> Outcome:
        """Run this release's dispatch() as EP rank ``rank`` of ``world``."""
        import torch

        if max(world.group_tokens) == 0:
            raise NotApplicable("every DP group is idle: SGLang's scheduler runs no forward")
        token = _CURRENT.set(_State(world, rank, ctx))
        try:
            with _stand_ins():  # releases import sglang.* lazily inside __init__/dispatch too
                return self._outcome(world, rank, ctx, torch)
        finally:
            _CURRENT.reset(token)

    def _outcome(self, world, rank, ctx, torch) -> Outcome:
        try:
            d = self._dispatcher(world, rank, ctx)
            for attr in ("runtime_max_tokens_per_rank", "active_moe_a2a", "active_a2a_namespace"):
                if attr in d.__dict__:
                    delattr(d, attr)
            n, moe = world.rows_per_rank[rank], world.moe
            x = torch.zeros(n, moe.hidden_size, dtype=torch.bfloat16)
            ids = (torch.arange(n * moe.top_k, dtype=torch.int64) % moe.num_experts).view(n, moe.top_k)
            topk = StandardTopKOutput(torch.ones(n, moe.top_k), ids, None)
            with _cuda_to_cpu():
                d.dispatch(x, topk)
            return Outcome(routed_around=True)  # returned without launching the A2A
        except _Launched as launched:
            return Outcome(runtime=int(launched.runtime))
        except _RoutedAround:
            return Outcome(routed_around=True)
        except Exception as exc:  # noqa: BLE001 - SGLang's own verdict, reported as such
            return Outcome(error=f"{type(exc).__name__}: {exc}")

    def __call__(self, view: RankView) -> int:
        """As a policy: decode mode, the world rebuilt from what the rank sees."""
        world = _world_from_view(view)
        out = self.outcome(world, view.ep_rank)
        if out.error and not world.payload_fits_cap:  # its clear refusal is the right answer
            raise CapExceeded(f"SGLang {self.label} refused: {out.error}")
        if out.error:
            raise SGLangAssertion(f"SGLang {self.label} dispatch() raised {out.error}")
        if out.routed_around:
            raise SGLangAssertion(f"SGLang {self.label} did not launch the A2A in decode mode")
        return out.runtime


def _world_from_view(view: RankView) -> World:
    """The world a RankView comes from (rows per rank from dp_global when recorded)."""
    tp = view.attn_tp_size
    if view.dp_global:
        groups = tuple(view.dp_global) if view.dp_size > 1 else (view.dp_global[0],)
        kind = "recorded"
    else:
        groups = (view.local_tokens * tp,) * view.dp_size
        kind = "none" if view.dp_global is None else "empty"
    return World(ep_size=view.ep_size, dp_size=view.dp_size, group_tokens=groups,
                 max_num_tokens=view.max_num_tokens, dp_global_kind=kind,
                 moe=_DEFAULT_MOE(view.ep_size))


def _DEFAULT_MOE(ep_size):
    from .world import MoeConfig

    return MoeConfig(num_experts=max(64, ep_size))


_LOADED: Dict[Path, SGLangRelease] = {}


def load_release(path, label: Optional[str] = None) -> SGLangRelease:
    """Load a ``flashinfer.py`` (or a wheel / a checkout root holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / RELEASE_FILE if (path / RELEASE_FILE).exists() else path / "python" / RELEASE_FILE
    if path.suffix == ".whl":
        path = _extract(path)
    path = path.resolve()
    if path in _LOADED:
        return _LOADED[path]
    if not path.exists():
        raise FileNotFoundError(f"no SGLang dispatcher at {path}")
    name = f"_a2a_gate_sglang_{abs(hash(str(path)))}"
    with _stand_ins():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    release = SGLangRelease(path, label or _label(path), module)
    _LOADED[path] = release
    return release


def _label(path: Path) -> str:
    for part in path.parts:
        if part.startswith("sglang-") or part[:1].isdigit():
            return part.replace("sglang-", "")
    return str(path)


def installed_release_path() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sglang is not installed (pip install --no-deps sglang)")
    return Path(list(spec.submodule_search_locations)[0]).parent / RELEASE_FILE


def _extract(wheel: Path) -> Path:
    version = wheel.name.split("-")[1]
    dest = CACHE / version
    target = dest / RELEASE_FILE
    if not target.exists():
        with zipfile.ZipFile(wheel) as z:
            z.extract(RELEASE_FILE, dest)
    return target


def fetch_release(version: str) -> Path:
    """The release's ``flashinfer.py`` from PyPI (``pip download --no-deps``), cached; safe to
    call from several xdist workers at once (each downloads privately, the file is renamed
    into place atomically)."""
    target = CACHE / version / RELEASE_FILE
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", tmp, f"sglang=={version}"], check=True)
        wheel = next(Path(tmp).glob(f"sglang-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(RELEASE_FILE, tmp)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(tmp) / RELEASE_FILE, target)
    return target


if __name__ == "__main__":  # python -m dispatcher.sglang_adapter fetch 0.5.10 0.5.23
    if len(sys.argv) > 2 and sys.argv[1] == "fetch":
        for v in sys.argv[2:]:
            print(fetch_release(v))
    else:
        print(__doc__)
