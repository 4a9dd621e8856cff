"""SGLang's dispatcher file from a release on PyPI, a local wheel or a checkout, verified
(the cache and its checks: ``dispatcher/wheels.py``).

    python -m dispatcher.sglang fetch 0.5.10 0.5.23     # pre-fill the cache (CI does this)
    A2A_GATE_SGLANG_CACHE=/path                          # where the cache lives (default .sglang/)
"""
from __future__ import annotations

from ..wheels import Package, ReleaseError, sha256

__all__ = ["ReleaseError", "PACKAGE", "RELEASE_FILE", "COMPANIONS", "CACHE_ENV", "cache_dir",
           "canonical_version", "companion_file", "fetch_release", "wheel_file", "checkout_file",
           "installed_file", "sha256"]

RELEASE_FILE = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
# Files beside the dispatcher whose functions decide what it sees: require_mlp_tp_gather()
# (whether the scheduler records every DP group's count) and, in newer releases, the
# derivation of the A2A cap. Kept with the dispatcher file when a release has them.
COMPANIONS = ("sglang/srt/utils/common.py", "sglang/srt/arg_groups/overrides.py")
CACHE_ENV = "A2A_GATE_SGLANG_CACHE"
PACKAGE = Package("sglang", (RELEASE_FILE,), COMPANIONS, CACHE_ENV, "SGLang's flashinfer.py")

cache_dir = PACKAGE.cache_dir
canonical_version = PACKAGE.canonical_version
companion_file = PACKAGE.companion_file
fetch_release = PACKAGE.fetch_release
wheel_file = PACKAGE.wheel_file
checkout_file = PACKAGE.checkout_file
installed_file = PACKAGE.installed_file
_verified = PACKAGE.verified
