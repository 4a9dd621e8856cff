"""Suite-wide options, Hypothesis profiles and hardware markers.

--policy=SPEC              the sizing rule under test (default: the shipped rule); see
                           dispatcher/policies.py for the spec forms (sglang:VERSION|PATH too)
--require-gpus             on a GPU runner: a skipped gpu/multi_gpu test is a failure
--rule-budget-ms=MS        mean milliseconds a rule call may take (default 20)
HYPOTHESIS_PROFILE         dev (default) | ci | thorough | gpu | repro
"""
from __future__ import annotations

import os

# Each xdist worker is one process of many: one thread each for numpy's BLAS, OpenMP and
# torch, or N workers x N threads fight over the cores (set before numpy/torch load).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, settings  # noqa: E402

from dispatcher.gpu.env import flashinfer_missing  # noqa: E402
from dispatcher.model import properties  # noqa: E402
from dispatcher.policies import DEFAULT_POLICY, PolicyError, load_policy  # noqa: E402

# --- Hypothesis profiles: registered once, chosen by HYPOTHESIS_PROFILE -------------------
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILES = {
    "dev": settings(max_examples=200, **_common),
    "ci": settings(max_examples=300, derandomize=True, print_blob=True, database=None, **_common),
    "thorough": settings(max_examples=5000, **_common),
    "gpu": settings(max_examples=60, derandomize=True, print_blob=True, database=None, **_common),
    "repro": settings(max_examples=1, verbosity=Verbosity.verbose,
                      phases=[Phase.explicit, Phase.reuse], **_common),
}
for _name, _profile in PROFILES.items():
    settings.register_profile(_name, _profile)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")


def pytest_addoption(parser):
    group = parser.getgroup("a2a-sizing-gate")
    group.addoption("--policy", default=DEFAULT_POLICY, metavar="SPEC",
                    help="sizing rule under test: NAME, module:callable, sglang[:VERSION|PATH] "
                         "(default: %(default)s)")
    group.addoption("--require-gpus", action="store_true",
                    help="fail, rather than skip, gpu/multi_gpu tests that cannot run here")
    group.addoption("--rule-budget-ms", type=float, default=properties.RULE_BUDGET.seconds * 1e3,
                    metavar="MS", help="mean milliseconds one rule call may take "
                                       "(default: %(default)s)")


@pytest.fixture(scope="session")
def policy_spec(request):
    return request.config.getoption("--policy")


@pytest.fixture(scope="session")
def policy(policy_spec):
    """The policy under test: a rule ``(RankView) -> int`` or an SGLang release."""
    return load_policy(policy_spec)[1]


def pytest_configure(config):
    if _PROFILE not in PROFILES:
        raise pytest.UsageError(f"HYPOTHESIS_PROFILE={_PROFILE!r} is not a profile of this "
                                f"suite: use one of {', '.join(PROFILES)}")
    settings.load_profile(_PROFILE)
    if config.getoption("--rule-budget-ms") <= 0:
        raise pytest.UsageError("--rule-budget-ms must be positive")
    properties.RULE_BUDGET.seconds = config.getoption("--rule-budget-ms") / 1e3
    try:
        config.stash[_POLICY] = load_policy(config.getoption("--policy"))[1]
    except PolicyError as exc:
        raise pytest.UsageError(str(exc)) from None


_POLICY = pytest.StashKey[object]()


def pytest_report_header(config):
    policy = config.stash.get(_POLICY, None)
    line = f"a2a-sizing-gate: policy {config.getoption('--policy')}"
    digest = getattr(policy, "sha256", None)
    if digest:
        line += f" ({policy.path}, sha256 {digest[:16]})"
    return [line, f"hypothesis profile: {_PROFILE}; GPU tiers: "
                  f"{flashinfer_missing() or 'available'}"]


# --- hardware: count GPUs without initialising CUDA in the parent --------------------------
_UNAVAILABLE = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    """GPU work is scheduled by resource (``--dist=loadgroup``): the single-GPU tier's tests
    share one xdist worker (one CUDA context, its workspaces), the rank pools' tests another
    (one set of rank processes, never driven by two workers at once); the two groups run
    side by side with the CPU tests."""
    for item in items:
        if "multi_gpu" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("gpu-rank-pools"))
        elif "gpu" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("gpu-single"))
        else:
            continue
        item.stash[_UNAVAILABLE] = flashinfer_missing()


def pytest_runtest_setup(item):
    reason = item.stash.get(_UNAVAILABLE, "")
    if reason:
        if item.config.getoption("--require-gpus"):
            pytest.fail(f"--require-gpus: {reason}", pytrace=False)
        pytest.skip(reason)


pytest_plugins = ["pytester"]  # the meta tests run the suite itself against bad rules
