"""vLLM's own modules that the file under test reaches, run from the release or checkout under
test (``fetch.RELEASE_MODULES``): the EP group's all-to-all managers (``all2all.py``, which size
the workspace every layer shares and build FlashInfer's communication), their base class, the
MNNVL communicator, ``envs`` and the weight-and-reduce classes.

Only what cannot run on a CPU is stood in: ``torch.distributed`` (the EP group's CPU group, its
barrier), ``torch.accelerator``, vLLM's process groups (``parallel_state``) and FlashInfer
itself (``flashinfer.moe_ep``: recorders whose ``dispatch`` is bound to the generation's own
signature, read from its source). A module of vLLM's that the gate neither keeps nor stands in
is a ``Unmodelled`` module: importing it works (a release may import what it never calls on
this path), and any use of one of its names raises ``UnmodelledCode`` naming it, which the
gate reports as code it cannot run, never as vLLM's failure.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional
from unittest import mock

from ..sandbox.standins import (Launched, Unmodelled, UnmodelledCode,  # noqa: F401
                        UnmodelledFinder, flashinfer_api)
from ..releases.wheels import ReleaseError
from .fetch import RELEASE_MODULES

__all__ = ["UnmodelledCode", "Unmodelled", "ReleaseModules", "release_modules",
           "MANAGER_CLASSES", "moe_ep_standins", "parallel_state_standins"]

# the manager class each side's file asserts its EP group's manager is
MANAGER_CLASSES = {"one-sided": "FlashInferNVLinkOneSidedManager",
                   "two-sided": "FlashInferNVLinkTwoSidedManager"}


_FINDER = UnmodelledFinder("vllm")  # every vllm.* module nothing else provides


# --- what cannot run on a CPU: the EP group's process groups --------------------------------
class CpuGroup:
    """The EP group's CPU process group as the manager sees it (``rank()``, ``size()``)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def parallel_state_standins(world, rank: int) -> Dict[str, object]:
    """``vllm.distributed.parallel_state``'s groups for EP rank ``rank`` of ``world`` (vLLM's EP
    group is DP x TP: rank ``r`` is DP rank ``r // tp``, TP rank ``r % tp``)."""
    tp = world.ep_size // world.dp_size
    dp_group = types.SimpleNamespace(rank_in_group=rank // tp, world_size=world.dp_size)
    tp_group = types.SimpleNamespace(rank_in_group=rank % tp, world_size=tp)
    return {"get_dp_group": lambda: dp_group, "get_tp_group": lambda: tp_group,
            "in_the_same_node_as": lambda group, source_rank=0: [True] * group.size()}


class _Accelerator:
    """What the managers call of ``torch.accelerator`` on a rank's GPU (the rest of it is the
    CPU build's own)."""

    @staticmethod
    def current_device_index():
        return 0

    @staticmethod
    def synchronize(*a, **k):
        pass

    @staticmethod
    def empty_cache():
        pass


def _barrier(*a, **k):
    """``torch.distributed.barrier``: every rank of a step runs in this process, in order."""


# --- FlashInfer itself: flashinfer.moe_ep ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoEEpCommParams:
    """FlashInfer's ``MoEEpCommParams`` (``moe_ep/core/comm/communication.py``), the fields the
    managers read; ``dispatch_bytes_per_token`` is FlashInfer's: the hidden row in the token
    dtype (bf16: 2 bytes an element) plus int32 ids and fp32 weights per top-k slot."""

    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: object = None
    dispatch_format: object = None
    invalid_expert_id: Optional[int] = None

    @property
    def dispatch_bytes_per_token(self) -> int:
        return 2 * self.hidden_size + 8 * self.top_k


@dataclasses.dataclass(frozen=True)
class _Config:
    extra_payload_bytes_per_token: int = 0
    use_low_precision_combine: object = False
    comm_backend: object = None
    cft: object = None
    lamport: object = None


class NVLinkOneSidedConfig(_Config):
    pass


class NVLinkTwoSidedConfig(_Config):
    pass


def _bootstrap(**kwargs):
    return types.SimpleNamespace(**kwargs)


def moe_ep_standins(launch_record) -> Dict[str, object]:
    """``flashinfer.moe_ep``'s names the managers import, as recorders: a communication's
    ``dispatch`` is bound to the generation's own signature (``flashinfer/api.py``) and raises
    ``Launched(launch_record(entry, communication, runtime, payloads))``."""

    class _Communication:
        entry = ""

        def __init__(self, bootstrap, params, config):
            self.bootstrap, self.params, self.config = bootstrap, params, config

        def dispatch(self, *args, **kwargs):
            api = flashinfer_api()
            if not api.has(self.entry):
                raise ImportError(f"cannot import name {self.entry.split('.')[0]!r} from "
                                  f"'flashinfer.moe_ep' (FlashInfer {api.version} has no such "
                                  f"name)")
            a = api.bind(self.entry, *args, **kwargs).arguments
            runtime = a[api.runtime_keyword(self.entry)]
            payloads = [a[n] for n in ("hidden_states", "hidden_states_scale", "topk_ids",
                                       "topk_weights") if a.get(n) is not None]
            if runtime is None:  # the class runs with its capacity
                runtime = self.params.max_tokens_per_rank
            raise Launched(launch_record(f"moe_ep {self.entry}", self.params.max_tokens_per_rank,
                                         runtime, payloads))

        def combine(self, *a, **k):
            raise RuntimeError("combine before a dispatch: the gate stops every step at dispatch")

        def get_combine_input_buffer(self, dtype):
            return None  # the workspace's own region exists only on a GPU

        def destroy(self):
            pass

    class NVLinkOneSidedAlltoAll(_Communication):
        entry = "NVLinkOneSidedAlltoAll.dispatch"

    class NVLinkTwoSidedAlltoAll(_Communication):
        entry = "NVLinkTwoSidedAlltoAll.dispatch"

    def create_communication(bootstrap, params, backend=None):
        cls = NVLinkTwoSidedAlltoAll if isinstance(backend, NVLinkTwoSidedConfig) else \
            NVLinkOneSidedAlltoAll
        return cls(bootstrap, params, backend)

    return {"BootstrapConfig": _bootstrap, "MoEEpCommParams": MoEEpCommParams,
            "NVLinkOneSidedConfig": NVLinkOneSidedConfig,
            "NVLinkTwoSidedConfig": NVLinkTwoSidedConfig,
            "NVLinkOneSidedAlltoAll": NVLinkOneSidedAlltoAll,
            "NVLinkTwoSidedAlltoAll": NVLinkTwoSidedAlltoAll,
            "create_communication": create_communication}


class CommBackend:
    """``flashinfer.comm.mnnvl.CommBackend``, the base of vLLM's ``CustomCommunicator``."""


# --- the release's modules ------------------------------------------------------------------
@dataclasses.dataclass
class ReleaseModules:
    """The release's own modules (``name -> module``), executed once per FlashInfer generation
    under its stand-ins; ``missing`` the ones the release does not have."""

    modules: Dict[str, types.ModuleType]
    missing: tuple

    def manager_class(self, side: str):
        """The release's manager class for ``side`` when it builds FlashInfer's ``moe_ep``
        communication (the API the gate's FlashInfer recorders model), else None."""
        all2all = self.modules.get("vllm.distributed.device_communicators.all2all")
        cls = getattr(all2all, MANAGER_CLASSES[side], None) if all2all else None
        if cls is None or "flashinfer.moe_ep" not in _source(cls):
            return None
        return cls


def _source(cls) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


@contextmanager
def runtime_patches():
    """While a release module runs: ``torch.accelerator`` and ``torch.distributed.barrier``
    of a GPU process, and the finder of vLLM modules the gate does not run."""
    import torch
    import torch.distributed

    with mock.patch.multiple(torch.accelerator, current_device_index=_Accelerator.current_device_index,
                             synchronize=_Accelerator.synchronize,
                             empty_cache=_Accelerator.empty_cache), \
            mock.patch.object(torch.distributed, "barrier", _barrier), \
            mock.patch.object(sys, "meta_path", sys.meta_path + [_FINDER]):
        yield


def release_modules(root: Path, module_prefix: str, sandbox_modules: Dict[str, types.ModuleType]
                    ) -> ReleaseModules:
    """Execute the release's modules found under ``root`` (the folder holding ``vllm/``) in
    dependency order, each put in ``sandbox_modules`` (the sandbox's ``sys.modules`` entries,
    already in place) as it loads: a module that fails to load is a ``ReleaseError`` naming it."""
    loaded, missing = {}, []
    for name, rel in RELEASE_MODULES.items():
        path = Path(root) / rel
        if not path.is_file():
            missing.append(name)
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = name.rpartition(".")[0]
        sys.modules[name] = sandbox_modules[name] = module  # its stand-in parent finds it there
        try:
            spec.loader.exec_module(module)
        except (KeyboardInterrupt, UnmodelledCode):
            raise
        except BaseException as exc:  # noqa: BLE001 - the gate cannot run this module
            raise ReleaseError(f"{module_prefix}: vLLM's {rel} did not load under the gate's "
                               f"stand-ins: {type(exc).__name__}: {exc}") from exc
        loaded[name] = module
    return ReleaseModules(loaded, tuple(missing))

