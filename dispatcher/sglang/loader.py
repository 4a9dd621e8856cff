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

import importlib.util
import inspect
import sys
import types
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional
from unittest import mock

from ..model.sglang_context import SGLangContext
from ..model.validation import CapExceeded
from ..model.world import World
from ..sizing import NotApplicable, RankView
from . import fetch
from .standins import Launched, RoutedAround, StandardTopKOutput, _Group, _State, current, stand_in_modules

__all__ = ["Outcome", "SGLangRelease", "SGLangAssertion", "load_release", "release_from_spec"]


class SGLangAssertion(AssertionError):
    """SGLang's own dispatch() raised (an assert or error) where it had to size the A2A."""


@dataclass(frozen=True)
class Outcome:
    """What one EP rank's dispatch() did: launched the A2A with ``runtime``, routed the
    batch around it (all-gather prefill), or raised ``error``."""

    runtime: Optional[int] = None
    routed_around: bool = False
    error: Optional[str] = None


@contextmanager
def _sandbox():
    """The stand-in modules, and torch's allocators sending "cuda" tensors to the CPU (old
    releases pre-allocate dummy tensors on "cuda" in __init__; their values are never read)."""
    import torch

    def to_cpu(fn):
        def inner(*a, **k):
            if str(k.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
                k["device"] = "cpu"
            return fn(*a, **k)
        return inner

    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, stand_in_modules()))
        for name in ("empty", "full", "zeros", "ones"):
            stack.enter_context(mock.patch.object(torch, name, to_cpu(getattr(torch, name))))
        yield


@dataclass(repr=False, eq=False)
class SGLangRelease:
    """One ``flashinfer.py`` loaded with stand-ins: ``outcome()`` runs one rank's dispatch(),
    ``bind(world)`` is the per-rank policy the properties check."""

    path: Path
    label: str
    module: types.ModuleType
    sha256: str
    _instances: Dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> str:
        return f"sglang:{self.label}"

    def __repr__(self):
        return self.spec

    def _repr_pretty_(self, printer, cycle):  # Hypothesis prints dataclasses field by field
        printer.text(repr(self))

    def __call__(self, view: RankView) -> int:
        raise TypeError(f"{self.spec} runs SGLang's dispatch() for a whole world: call "
                        f"bind(world)(view), as dispatcher.model.properties.rule_values does")

    def bind(self, world: World, ctx: SGLangContext = SGLangContext()) -> Callable[[RankView], int]:
        """The policy for one world: each rank's call runs that rank's dispatch()."""
        def rank_policy(view: RankView) -> int:
            out = self.outcome(world, view.ep_rank, ctx)
            if out.error and not world.payload_fits_cap:  # its clear refusal is the right answer
                raise CapExceeded(f"SGLang {self.label} refused: {out.error}")
            if out.error:
                raise SGLangAssertion(f"SGLang {self.label} dispatch() raised {out.error}")
            if out.routed_around:
                raise SGLangAssertion(f"SGLang {self.label} did not launch the A2A in "
                                      f"{ctx.forward_mode} mode")
            return out.runtime
        return rank_policy

    def _dispatcher(self, world: World, rank: int, ctx: SGLangContext):
        moe = world.moe
        key = (world.ep_size, rank, moe.hidden_size, moe.top_k, moe.num_experts, moe.payload,
               ctx.speculative, world.max_num_tokens, world.dp_size, ctx.sp_prefill_a2a)
        if key not in self._instances:
            cls = self.module.FlashinferDispatcher
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
        token = current.set(_State(world, rank, ctx))
        try:
            with _sandbox():  # releases import sglang.* lazily inside __init__/dispatch too
                d = self._dispatcher(world, rank, ctx)
                for attr in ("runtime_max_tokens_per_rank", "active_moe_a2a", "active_a2a_namespace"):
                    d.__dict__.pop(attr, None)
                n, moe = world.rows_per_rank[rank], world.moe
                x = torch.zeros(n, moe.hidden_size, dtype=torch.bfloat16)
                ids = (torch.arange(n * moe.top_k) % moe.num_experts).view(n, moe.top_k)
                d.dispatch(x, StandardTopKOutput(torch.ones(n, moe.top_k), ids, None))
            return Outcome(routed_around=True)  # returned without launching the A2A
        except Launched as launched:
            return Outcome(runtime=launched.runtime)
        except RoutedAround:
            return Outcome(routed_around=True)
        except Exception as exc:  # noqa: BLE001 - SGLang's own verdict, reported as such
            return Outcome(error=f"{type(exc).__name__}: {exc}")
        finally:
            current.reset(token)


_LOADED: Dict[str, SGLangRelease] = {}


def load_release(path, label: Optional[str] = None) -> SGLangRelease:
    """Load one dispatcher ``flashinfer.py`` (loaded once per content hash per process)."""
    path = Path(path).resolve()
    if not path.is_file() or path.suffix != ".py":
        raise fetch.ReleaseError(f"sglang:{path}: expected SGLang's flashinfer.py, an SGLang "
                                 f"checkout, a wheel or a release version")
    digest = fetch.sha256(path)
    if digest in _LOADED:
        return _LOADED[digest]
    name = f"_a2a_gate_sglang_{digest[:16]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        with _sandbox():
            spec.loader.exec_module(module)
    except ImportError:
        raise  # a name the stand-ins lack: its message names it
    except Exception as exc:
        raise fetch.ReleaseError(f"sglang:{path}: loading it raised {type(exc).__name__}: "
                                 f"{exc}") from exc
    if not isinstance(getattr(module, "FlashinferDispatcher", None), type):
        raise fetch.ReleaseError(f"sglang:{path} defines no FlashinferDispatcher class: it is "
                                 f"not SGLang's token_dispatcher/flashinfer.py")
    release = SGLangRelease(path, label or str(path), module, digest)
    _LOADED[digest] = release
    return release


def release_from_spec(target: str) -> SGLangRelease:
    """``sglang:TARGET``: "" (installed), a version, a wheel, a checkout or a flashinfer.py."""
    if not target:
        return load_release(fetch.installed_file(), "installed")
    p = Path(target)
    if p.exists():
        if p.is_dir():
            return load_release(fetch.checkout_file(p), target)
        if p.suffix == ".whl":
            version = p.name.split("-")[1] if p.name.count("-") >= 2 else p.name
            return load_release(fetch.wheel_file(p), f"{version} (local wheel {p.name})")
        return load_release(p, target)
    if target[:1].isdigit():
        version = fetch.canonical_version(target)
        return load_release(fetch.fetch_release(version), version)
    raise fetch.ReleaseError(f"sglang:{target}: no such file or folder, and not a version")
