"""SGLang's dispatcher file from a release on PyPI, a local wheel or a checkout, verified
(the cache and its checks: ``dispatcher/releases/wheels.py``).

    python -m dispatcher.sglang fetch 0.5.10 0.5.23     # pre-fill the cache (CI does this)
    A2A_GATE_SGLANG_CACHE=/path                          # where the cache lives (default .sglang/)
"""
from __future__ import annotations

from pathlib import Path

from ..releases.tree import EngineCode
from ..releases.wheels import Package, ReleaseError, sha256
# The dispatcher file and the files beside it whose functions decide what it sees (kept with
# the dispatcher file when a release has them): sources.py, one record per piece
from .sources import (COMMON, COMPANIONS, DP_ATTN, MOE_HOOK, NEEDED, OVERRIDES, RELEASE_FILE,
                      RELEASES, SERVER_ARGS, SPEC_INFO, VERSION_FILES)

__all__ = ["ReleaseError", "RELEASES", "NEEDED", "PACKAGE", "CODE", "RELEASE_FILE", "COMPANIONS", "COMMON", "OVERRIDES",
           "DP_ATTN", "SPEC_INFO", "MOE_HOOK", "SERVER_ARGS", "CACHE_ENV", "cache_dir",
           "canonical_version", "companion_file", "fetch_release", "wheel_file", "checkout_file",
           "installed_file", "sha256"]

CACHE_ENV = "A2A_GATE_SGLANG_CACHE"
PACKAGE = Package("sglang", (RELEASE_FILE,), COMPANIONS, CACHE_ENV, "SGLang's flashinfer.py",
                  Path(__file__).with_name("pins.json"))
# the tree under test: the dispatcher file and SGLang's own code beside it (dispatcher/releases/tree.py)
CODE = EngineCode(PACKAGE, NEEDED, RELEASES, "SGLang", VERSION_FILES)

cache_dir = PACKAGE.cache_dir
canonical_version = PACKAGE.canonical_version
companion_file = PACKAGE.companion_file
fetch_release = PACKAGE.fetch_release
wheel_file = PACKAGE.wheel_file
checkout_file = PACKAGE.checkout_file
installed_file = PACKAGE.installed_file
_verified = PACKAGE.verified
