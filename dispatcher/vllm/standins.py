"""Stand-ins for everything vLLM's FlashInfer prepare/finalize files import, reading the
world under test.

``get_forward_context().dp_metadata`` holds the per-rank token counts the release's own
``_compute_sp_num_tokens`` (its ``forward_context.py``) makes from the world's DP counts;
``get_ep_group()`` hands out the EP rank's all-to-all manager, whose communication objects
are recorders: FlashInfer's ``MoeAlltoAll.dispatch`` (0.18-0.32), the ``moe_ep`` wrapper's
``dispatch(max_tokens_per_rank=)`` (0.33) and ``MnnvlMoe`` (two-sided) capture the per-rank
maximum vLLM passes and stop prepare() there. Where the release has them, vLLM's own modules
replace these stand-ins (``release_modules.py``: its all-to-all managers among them), and a
name of vLLM's that neither provides is ``Unmodelled``: imported freely, refused by name on use
(never a silent stub).
"""
from __future__ import annotations

import contextvars
import enum
import functools
import types
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..model.payloads import PayloadFormat
from ..model.world import World
from ..sandbox.standins import Launched, build_modules, flashinfer_api, quantized_zeros

__all__ = ["Launched", "Launch", "State", "current", "stand_in_modules", "QuantConfig"]


@dataclass(frozen=True)
class Launch:
    """What vLLM passed at the launch: the per-rank maximum, the cap its manager was built
    for, and the bytes per token of the payloads (None when no row was sent)."""

    runtime: object
    max_num_tokens: object
    payload_bytes_per_token: Optional[int]
    api: str  # which FlashInfer entry point: MoeAlltoAll.dispatch | moe_ep dispatch | MnnvlMoe


@dataclass
class State:
    world: World
    rank: int
    local_sizes: object  # what dp_metadata.get_chunk_sizes_across_dp_rank() returns; None: no DP metadata
    manager: "OneSidedManager" = None  # this rank's, set when its layer is built or reused
    seen_local_sizes: object = "not read"


current: contextvars.ContextVar[State] = contextvars.ContextVar("vllm_world")


# --- vllm.forward_context ------------------------------------------------------------------
class DPMetadata:
    """vLLM's ``DPMetadata`` as prepare() reads it: ``local_sizes`` were set by the
    runner's ``sp_local_sizes`` context (the release's own ``_compute_sp_num_tokens``)."""

    def __init__(self, local_sizes):
        self.local_sizes = local_sizes

    def get_chunk_sizes_across_dp_rank(self):
        s = current.get()
        s.seen_local_sizes = self.local_sizes
        return self.local_sizes


def get_forward_context():
    s = current.get()
    return types.SimpleNamespace(
        dp_metadata=None if s.local_sizes is None else DPMetadata(s.local_sizes))


# --- vllm.distributed: the EP group and its all-to-all manager ------------------------------
def _payload_bytes(payloads) -> Optional[int]:
    rows = payloads[0].shape[0] if payloads else 0
    return sum(p.numel() * p.element_size() for p in payloads) // rows if rows else None


class _MoeAlltoAll:
    """FlashInfer's ``MoeAlltoAll`` (0.18-0.32 call it through ``manager.moe_alltoall``)."""

    def __init__(self, manager):
        self._m = manager

    def dispatch(self, *args, **kwargs):
        a = flashinfer_api().bind("MoeAlltoAll.dispatch", *args, **kwargs).arguments
        raise Launched(Launch(a["runtime_max_tokens_per_rank"], self._m.max_num_tokens,
                              _payload_bytes(a["input_payloads"]), "MoeAlltoAll.dispatch"))


class _Communication:
    """``flashinfer.moe_ep``'s ``NVLinkOneSidedAlltoAll`` (0.33): a runtime of ``None`` runs
    with the cap, as the class does. The call is bound to the generation's own signature (0.7.2:
    ``max_tokens_per_rank=``, 0.7.4: ``runtime_max_tokens_per_rank=``), so a keyword the
    release does not take raises its TypeError."""

    def __init__(self, manager):
        self._m = manager

    def dispatch(self, *args, **kwargs):
        flashinfer = flashinfer_api()
        entry = "NVLinkOneSidedAlltoAll.dispatch"
        a = flashinfer.bind(entry, *args, **kwargs).arguments
        payloads = [a[n] for n in ("hidden_states", "hidden_states_scale", "topk_ids",
                                   "topk_weights") if a.get(n) is not None]
        max_tokens_per_rank = a[flashinfer.runtime_keyword(entry)]
        runtime = self._m.max_num_tokens if max_tokens_per_rank is None else max_tokens_per_rank
        raise Launched(Launch(runtime, self._m.max_num_tokens, _payload_bytes(payloads),
                              "moe_ep NVLinkOneSidedAlltoAll.dispatch"))


class All2AllManagerBase:
    def __init__(self, world: World, rank: int):
        self.world_size, self.rank = world.ep_size, rank
        self.max_num_tokens = None

    def __getattr__(self, name):
        raise AttributeError(f"vLLM's all-to-all manager stand-in has no {name!r}: the file "
                             f"under test reads something this gate does not model")


class OneSidedManager(All2AllManagerBase):
    """``FlashInferNVLinkOneSidedManager``: ``initialize`` keeps the largest cap asked for (one
    workspace shared by every layer, vLLM #42976); its communication objects record."""

    def initialize(self, max_num_tokens, top_k=None, num_experts=None, hidden_size=None, **_k):
        self.max_num_tokens = max(max_num_tokens, self.max_num_tokens or 0)

    @property
    def moe_alltoall(self):
        # vLLM's all2all.py builds it with ``from flashinfer.comm import MoeAlltoAll``
        if "MoeAlltoAll" not in flashinfer_api().comm_names:
            raise ImportError(f"cannot import name 'MoeAlltoAll' from 'flashinfer.comm' "
                              f"(FlashInfer {flashinfer_api().version} has no such name)")
        return _MoeAlltoAll(self)

    def get_communication(self):
        return _Communication(self)

    # the two-sided path (MnnvlMoe workspaces) asks for these
    def ensure_alltoall_workspace_initialized(self):
        return True

    prepare_workspace_tensor = None
    workspace_tensor = None


def get_ep_group():
    manager = current.get().manager
    return types.SimpleNamespace(device_communicator=types.SimpleNamespace(all2all_manager=manager))


class MnnvlMoe:
    """FlashInfer's two-sided ``MnnvlMoe``: the prepare step receives the per-rank maximum."""

    @staticmethod
    def mnnvl_moe_alltoallv_prepare_without_allgather(topk_ids, topk_weights, stats, workspace,
                                                      max_num_token, *a, **k):
        s = current.get()
        raise Launched(Launch(max_num_token, s.world.max_num_tokens, None,
                              "MnnvlMoe.mnnvl_moe_alltoallv_prepare_without_allgather"))


# --- vllm.model_executor.layers.fused_moe -------------------------------------------------
class FusedMoEActivationFormat(enum.Enum):
    Standard = "standard"
    BatchedExperts = "batched_experts"


class FusedMoEPrepareAndFinalizeModular:
    def __init__(self, *a, **k):
        pass


class QuantConfig:
    """``FusedMoEQuantConfig`` for the world's payload: unquantized bf16, NVFP4 or MXFP8."""

    def __init__(self, payload: str):
        self.payload = payload
        self.quant_dtype = {"bf16": None, "nvfp4": "nvfp4", "mxfp8": "mxfp8"}[payload]
        self.a1_gscale = None
        self.per_act_token_quant = False
        self.block_shape = None
        self.mx_alignment = 0
        self.is_scale_swizzled = self.is_nvfp4_scale_swizzled = False

    def __getattr__(self, name):
        raise AttributeError(f"the quant config stand-in has no {name!r}")

    @classmethod
    @functools.lru_cache(maxsize=None)
    def of(cls, payload: str) -> "QuantConfig":
        """One per payload format (prepare() only reads it)."""
        return cls(payload)


def moe_kernel_quantize_input(a1, gscale=None, quant_dtype=None, *a, **k):
    if quant_dtype is None:
        return a1, None
    return quantized_zeros(a1, PayloadFormat(quant_dtype))


def _identity(x, *a, **k):
    return x


def _launch(api: str, max_num_tokens, runtime, payloads) -> Launch:
    return Launch(runtime, max_num_tokens, _payload_bytes(payloads), api)


def _parallel_state() -> Dict[str, object]:
    """``vllm.distributed.parallel_state``'s groups for the rank being run (torch.distributed:
    what cannot run here), read by the release's own ``All2AllManagerBase.__init__``."""
    from .release_modules import parallel_state_standins

    def of(name):
        return lambda *a, **k: parallel_state_standins(current.get().world,
                                                       current.get().rank)[name](*a, **k)
    return {n: of(n) for n in ("get_dp_group", "get_tp_group", "in_the_same_node_as")}


def _has_moe_ep(name: str):
    """vLLM's ``has_flashinfer_nvlink_*`` (importable FlashInfer names): whether the
    generation's ``flashinfer.moe_ep`` binds ``name``."""
    return lambda: name in flashinfer_api().moe_ep_names


def _table() -> Dict[str, Dict[str, object]]:
    import logging

    from .release_modules import CommBackend, moe_ep_standins

    fm = "vllm.model_executor.layers.fused_moe"
    return {
        "vllm": {}, "vllm.model_executor": {}, "vllm.model_executor.layers": {}, fm: {},
        f"{fm}.modular_kernel": {
            "FusedMoEPrepareAndFinalizeModular": FusedMoEPrepareAndFinalizeModular,
            "FusedMoEPrepareAndFinalize": FusedMoEPrepareAndFinalizeModular,
            "FusedMoEActivationFormat": FusedMoEActivationFormat,
            "PrepareResultType": tuple, "TopKWeightAndReduce": object},
        f"{fm}.config": {"FusedMoEQuantConfig": QuantConfig},
        f"{fm}.utils": {"moe_kernel_quantize_input": moe_kernel_quantize_input},
        "vllm.distributed": {"get_ep_group": get_ep_group},
        "vllm.distributed.device_communicators": {},
        "vllm.distributed.device_communicators.all2all": {
            "FlashInferNVLinkOneSidedManager": OneSidedManager,
            "FlashInferNVLinkTwoSidedManager": OneSidedManager},
        "vllm.distributed.device_communicators.base_device_communicator": {
            "All2AllManagerBase": All2AllManagerBase},
        "vllm.forward_context": {"get_forward_context": get_forward_context},
        "vllm.distributed.parallel_state": _parallel_state(),
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils": {}, "vllm.utils.flashinfer": {
            "nvfp4_block_scale_interleave": _identity,
            "has_flashinfer_nvlink_one_sided": _has_moe_ep("NVLinkOneSidedAlltoAll"),
            "has_flashinfer_nvlink_two_sided": _has_moe_ep("NVLinkTwoSidedAlltoAll")},
        "flashinfer": {}, "flashinfer.comm": {},
        "flashinfer.comm.trtllm_alltoall": {"MnnvlMoe": MnnvlMoe},
        "flashinfer.comm.mnnvl": {"CommBackend": CommBackend},
        "flashinfer.moe_ep": moe_ep_standins(_launch),
    }


def stand_in_modules(version: str) -> Dict[str, types.ModuleType]:
    """Every module vLLM's prepare/finalize file imports, as stand-ins (for ``sys.modules``);
    FlashInfer's modules are those generation ``version`` has."""
    return _stand_in_modules(version)


@functools.lru_cache(maxsize=None)
def _stand_in_modules(version: str) -> Dict[str, types.ModuleType]:
    from ..flashinfer.api import api

    table = _table()
    for name in ("flashinfer.comm.trtllm_alltoall",):
        if name not in api(version).modules:  # gone in 0.7.4: the import fails as it would
            del table[name]
    moe_ep = table["flashinfer.moe_ep"]  # only the names this generation binds
    table["flashinfer.moe_ep"] = {k: v for k, v in moe_ep.items() if k in api(version).moe_ep_names}
    return build_modules(table, "vllm", version, flashinfer_names=False, lenient=True)


ComputeSp = Callable[..., list]
