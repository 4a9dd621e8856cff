"""FlashInfer's A2A source files from a release on PyPI, a local wheel or a checkout, verified
(the cache and its checks: ``dispatcher/releases/wheels.py``). The gate reads them, never imports them:
the API each generation offers engines (``api.py``) and the host C++ that lays out its
workspace (``host_layout.py``) come from these files.

    python -m dispatcher.flashinfer fetch            # the pinned releases (CI does this)
    A2A_GATE_FLASHINFER_CACHE=/path                  # where the cache lives (default .flashinfer-python/)
"""
from __future__ import annotations

from pathlib import Path

from ..model.generations import GENERATIONS
from ..releases.wheels import Package, ReleaseError

__all__ = ["ReleaseError", "PACKAGE", "ONE_SIDED", "COMM_INIT", "MOE_A2A_072", "TWO_SIDED",
           "TWO_SIDED_EP",
           "MOE_EP_INIT", "COMM_BASE", "LAYOUT_CU", "LAYOUT_CU_072", "META_H", "KERNELS_H",
           "CACHE_ENV", "PINNED", "source_file"]

# moe_ep's NVLinkOneSidedAlltoAll (0.7.2: a wrapper over MoeAlltoAll; 0.7.4: the only API)
ONE_SIDED = "flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py"
# moe_ep's NVLinkTwoSidedAlltoAll (vLLM 0.34's two-sided path)
TWO_SIDED_EP = "flashinfer/moe_ep/backends/split/comm/nvlink_two_sided/communication.py"
COMM_INIT = "flashinfer/comm/__init__.py"  # what ``from flashinfer.comm import ...`` finds
MOE_A2A_072 = "flashinfer/comm/trtllm_moe_alltoall.py"  # MoeAlltoAll, moe_a2a_* (gone in 0.7.4)
TWO_SIDED = "flashinfer/comm/trtllm_alltoall.py"  # MnnvlMoe (vLLM's two-sided path; gone in 0.7.4)
MOE_EP_INIT = "flashinfer/moe_ep/__init__.py"
COMM_BASE = "flashinfer/moe_ep/core/comm/communication.py"  # MoEEpCommParams, the base dispatch
LAYOUT_CU = "flashinfer/data/csrc/nvlink_one_sided_alltoall.cu"  # calculateWorkspaceLayout (0.7.4)
LAYOUT_CU_072 = "flashinfer/data/csrc/trtllm_moe_alltoall.cu"  # calculateOffsets (0.7.2)
_TRT = "flashinfer/data/csrc/nv_internal/tensorrt_llm"
META_H = f"{_TRT}/thop/moe/communication/moeAlltoAllMeta.h"
KERNELS_H = f"{_TRT}/kernels/moe/communication/moeAlltoAllKernels.h"
CACHE_ENV = "A2A_GATE_FLASHINFER_CACHE"
PINNED = tuple(GENERATIONS)  # the generations the gate models (0.7.2.post1's A2A files are 0.7.2's)
PACKAGE = Package("flashinfer-python", (ONE_SIDED,),
                  (COMM_INIT, MOE_A2A_072, TWO_SIDED, TWO_SIDED_EP, MOE_EP_INIT, COMM_BASE, LAYOUT_CU,
                   LAYOUT_CU_072, META_H, KERNELS_H),
                  CACHE_ENV, "FlashInfer's A2A sources", Path(__file__).with_name("pins.json"),
                  module="flashinfer")


def source_file(version: str, name: str) -> Path:
    """File ``name`` of FlashInfer ``version`` (fetched and verified once), or ReleaseError."""
    main = PACKAGE.fetch_release(version)
    found = main if name == ONE_SIDED else PACKAGE.companion_file(main, name)
    if found is None:
        raise ReleaseError(f"FlashInfer {version} has no {name}")
    return found
