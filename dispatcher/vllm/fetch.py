"""vLLM's FlashInfer prepare/finalize files from a release on PyPI, a local wheel or a
checkout, verified (the cache and its checks: ``dispatcher/releases/wheels.py``).

    python -m dispatcher.vllm fetch 0.18.0 0.33.0      # pre-fill the cache (CI does this)
    A2A_GATE_VLLM_CACHE=/path                          # where the cache lives (default .vllm/)
"""
from __future__ import annotations

from pathlib import Path

from ..releases.companions import Needed
from ..releases.tree import EngineCode
from ..releases.wheels import Package, ReleaseError

__all__ = ["ReleaseError", "RELEASES", "NEEDED", "VERSION_FILES", "PACKAGE", "ONE_SIDED",
           "TWO_SIDED", "FORWARD_CONTEXT", "RELEASE_MODULES", "JUDGED_ON", "CACHE_ENV", "CODE"]

_FUSED_MOE = "vllm/model_executor/layers/fused_moe"
# The one-sided (MoeAlltoAll) prepare/finalize: in prepare_finalize/ since 0.19, beside the
# other fused_moe files in 0.18 (where it first shipped).
ONE_SIDED = (f"{_FUSED_MOE}/prepare_finalize/flashinfer_nvlink_one_sided.py",
             f"{_FUSED_MOE}/flashinfer_nvlink_one_sided_prepare_finalize.py")
TWO_SIDED = (f"{_FUSED_MOE}/prepare_finalize/flashinfer_nvlink_two_sided.py",
             f"{_FUSED_MOE}/flashinfer_nvlink_two_sided_prepare_finalize.py")
# Where the per-rank token counts prepare() reads are computed: DPMetadata and the SP split
# (``_compute_sp_num_tokens``), run from the release itself.
FORWARD_CONTEXT = "vllm/forward_context.py"
# Releases whose one-sided file differs from the one before (0.19 = 0.18 moved into
# prepare_finalize/; 0.20 adds asserts; 0.24 the payload-index API; 0.28 combine_into;
# 0.32 the DP=1 branch; 0.33 the moe_ep wrapper; 0.34 FlashInfer 0.7.4's runtime keyword, the
# two-sided file on moe_ep's NVLinkTwoSidedAlltoAll). 0.18.0 keeps the old layout.
RELEASES = ("0.18.0", "0.20.0", "0.24.0", "0.28.0", "0.32.0", "0.33.0", "0.34.0")
# The FlashInfer generation each pinned release is judged on: the one whose API it calls (the
# others are its row of the engine x FlashInfer table, docs/flashinfer.md). 0.34.0's metadata pins
# flashinfer-python==0.7.3, which the package index does not serve; it passes
# ``dispatch(runtime_max_tokens_per_rank=)``, 0.7.4's keyword (0.7.2's moe_ep wrapper calls it
# ``max_tokens_per_rank``) and builds moe_ep's NVLinkTwoSidedAlltoAll, so it is judged on
# 0.7.4. The older releases call 0.7.2's API (``generations.PINNED_RELEASES_GENERATION``).
JUDGED_ON = {"0.34.0": "0.7.4"}
VERSION_FILES = ("vllm/_version.py",)  # what release a tree says it is (written at build)
# vLLM's own code the gate runs beside the prepare/finalize file (dispatcher.releases.companions)
NEEDED = (Needed("_compute_sp_num_tokens", (FORWARD_CONTEXT,), "0.18.0",
                 decides="each rank's share of its DP rank's tokens under SP"),)
# vLLM's own modules the file under test reaches, run from the release (``release_modules.py``):
# the EP group's all-to-all managers (``all2all.py``: the workspace sizing every layer shares)
# and what they import of vLLM. Kept where the release has them.
_COMM = "vllm/distributed/device_communicators"
RELEASE_MODULES = {
    "vllm.envs": "vllm/envs.py",
    "vllm.utils.math_utils": "vllm/utils/math_utils.py",
    f"{_COMM.replace('/', '.')}.base_device_communicator": f"{_COMM}/base_device_communicator.py",
    f"{_COMM.replace('/', '.')}.mnnvl_compat": f"{_COMM}/mnnvl_compat.py",
    f"{_COMM.replace('/', '.')}.all2all": f"{_COMM}/all2all.py",
    "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce":
        f"{_FUSED_MOE}/topk_weight_and_reduce.py",
}
CACHE_ENV = "A2A_GATE_VLLM_CACHE"
PACKAGE = Package("vllm", ONE_SIDED, (FORWARD_CONTEXT,) + TWO_SIDED + tuple(RELEASE_MODULES.values()), CACHE_ENV,
                  "vLLM's flashinfer_nvlink_one_sided.py", Path(__file__).with_name("pins.json"))
# the tree under test: the prepare/finalize file and vLLM's own code beside it (dispatcher/releases/tree.py)
CODE = EngineCode(PACKAGE, NEEDED, RELEASES, "vLLM", VERSION_FILES)
