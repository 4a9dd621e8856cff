"""SGLang's dispatcher file from a release on PyPI, a local wheel or a checkout, verified
(the cache and its checks: ``dispatcher/wheels.py``).

    python -m dispatcher.sglang fetch 0.5.10 0.5.23     # pre-fill the cache (CI does this)
    A2A_GATE_SGLANG_CACHE=/path                          # where the cache lives (default .sglang/)
"""
from __future__ import annotations

from pathlib import Path

from ..wheels import Package, ReleaseError, sha256

__all__ = ["ReleaseError", "PACKAGE", "RELEASE_FILE", "COMPANIONS", "COMMON", "OVERRIDES",
           "DP_ATTN", "SPEC_INFO", "MOE_HOOK", "SERVER_ARGS", "CACHE_ENV", "cache_dir",
           "canonical_version", "companion_file", "fetch_release", "wheel_file", "checkout_file",
           "installed_file", "sha256"]

RELEASE_FILE = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
# Files beside the dispatcher whose functions decide what it sees (docs/sglang.md, "Where a
# step comes from"), kept with the dispatcher file when a release has them:
COMMON = "sglang/srt/utils/common.py"  # require_mlp_tp_gather()
OVERRIDES = "sglang/srt/arg_groups/overrides.py"  # the A2A cap derivation (0.5.22+)
DP_ATTN = ("sglang/srt/managers/scheduler_components/dp_attn.py",  # the scheduler's DP gather
           "sglang/srt/managers/scheduler_dp_attn_mixin.py")  # (its 0.5.10-0.5.12 home)
SPEC_INFO = "sglang/srt/speculative/spec_info.py"  # spec_scale_global_num_tokens (0.5.16+)
MOE_HOOK = "sglang/srt/arg_groups/moe_hook.py"  # server-arg checks of FlashInfer A2A (0.5.19+)
SERVER_ARGS = "sglang/srt/server_args.py"  # the same checks before 0.5.19
COMPANIONS = (COMMON, OVERRIDES) + DP_ATTN + (SPEC_INFO, MOE_HOOK, SERVER_ARGS)
CACHE_ENV = "A2A_GATE_SGLANG_CACHE"
PACKAGE = Package("sglang", (RELEASE_FILE,), COMPANIONS, CACHE_ENV, "SGLang's flashinfer.py",
                  Path(__file__).with_name("pins.json"))

cache_dir = PACKAGE.cache_dir
canonical_version = PACKAGE.canonical_version
companion_file = PACKAGE.companion_file
fetch_release = PACKAGE.fetch_release
wheel_file = PACKAGE.wheel_file
checkout_file = PACKAGE.checkout_file
installed_file = PACKAGE.installed_file
_verified = PACKAGE.verified
