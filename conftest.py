"""Suite-wide options, Hypothesis profiles and hardware markers.

--policy=module:callable   the sizing rule under test (default: the shipped rule)
--require-gpus             on a GPU runner: a skipped gpu/multi_gpu test is a failure
HYPOTHESIS_PROFILE         dev (default) | ci | thorough | gpu | repro
"""
from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings

from dispatcher.policies import DEFAULT_POLICY, load_policy

# --- Hypothesis profiles: registered once, chosen by HYPOTHESIS_PROFILE -------------------
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, **_common)
settings.register_profile("ci", max_examples=300, derandomize=True, print_blob=True,
                          database=None, **_common)
settings.register_profile("thorough", max_examples=5000, **_common)
settings.register_profile("gpu", max_examples=60, derandomize=True, print_blob=True,
                          database=None, **_common)
settings.register_profile("repro", max_examples=1, verbosity=Verbosity.verbose,
                          phases=[Phase.explicit, Phase.reuse], **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    group = parser.getgroup("a2a-sizing-gate")
    group.addoption("--policy", default=DEFAULT_POLICY, metavar="MODULE:CALLABLE",
                    help="sizing rule under test, (RankView) -> int (default: %(default)s)")
    group.addoption("--require-gpus", action="store_true",
                    help="fail, rather than skip, gpu/multi_gpu tests that cannot run here")


@pytest.fixture(scope="session")
def policy_spec(request):
    return request.config.getoption("--policy")


@pytest.fixture(scope="session")
def policy(policy_spec):
    """The sizing policy under test, as a callable ``(RankView) -> int``."""
    return load_policy(policy_spec)[1]


def pytest_configure(config):
    try:
        load_policy(config.getoption("--policy"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc


# --- hardware: count GPUs without initialising CUDA in the parent --------------------------
@lru_cache(maxsize=None)
def gpu_count() -> int:
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except Exception:
            return 0
    return 0


@lru_cache(maxsize=None)
def flashinfer_missing() -> str:
    import importlib.util

    return "" if importlib.util.find_spec("flashinfer") else (
        "flashinfer is not installed (pip install -e '.[gpu]')")


_UNAVAILABLE = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" not in item.keywords and "multi_gpu" not in item.keywords:
            continue
        item.add_marker(pytest.mark.xdist_group("gpu"))  # one xdist worker owns the GPUs
        have = gpu_count()
        item.stash[_UNAVAILABLE] = ("needs a GPU, found none (NVML / nvidia-smi)" if have == 0
                                    else flashinfer_missing())


def pytest_runtest_setup(item):
    reason = item.stash.get(_UNAVAILABLE, "")
    if reason:
        if item.config.getoption("--require-gpus"):
            pytest.fail(f"--require-gpus: {reason}", pytrace=False)
        pytest.skip(reason)
