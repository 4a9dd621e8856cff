"""The gate as a pytest plugin: suite-wide options, Hypothesis profiles, fixtures, markers and
hardware skips (loaded by the checkout's ``conftest.py``, or with ``-p dispatcher.plugin``).

--policy=SPEC              the sizing rule under test (default: the shipped rule); see
                           dispatcher/policies.py for the spec forms (sglang:VERSION|PATH too)
--require-gpus             on a GPU runner: a skipped gpu/multi_gpu test is a failure
--rule-budget-ms=MS        mean milliseconds a rule call may take (default 20)
--flashinfer=0.7.2|0.7.4   the FlashInfer A2A generation the CPU tiers model and the engines'
                           FlashInfer API (default: the installed FlashInfer, else 0.7.2); the
                           GPU tiers run the installed one, so a different value there is an error
HYPOTHESIS_PROFILE         dev (default) | ci | thorough | gpu | repro
"""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path


def _one_thread_each() -> None:
    """Each xdist worker is one process of many: one thread each for numpy's BLAS, OpenMP and
    torch, or N workers x N threads fight over the cores (set before numpy/torch load). The
    controller of workers sets them too, so the run's zygote (started there) imports torch as
    the workers' children would."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")


if os.environ.get("PYTEST_XDIST_WORKER"):
    _one_thread_each()

import pytest  # noqa: E402

from dispatcher.plugin.profiles import PROFILES, _database, _saved_examples  # noqa: E402,F401
from hypothesis import settings  # noqa: E402

from dispatcher.gpu.env import flashinfer_missing  # noqa: E402
from dispatcher.model import properties  # noqa: E402
from dispatcher.model.guard import CALL_TIMEOUT  # noqa: E402
from dispatcher.plugin.exit_status import (_OPEN_CONFIGS, _OUTER_PROFILE, _ZYGOTE,  # noqa: E402,F401
                                    pytest_sessionfinish, pytest_unconfigure)
from dispatcher.plugin.generation import choose_generation, flashinfer_version  # noqa: E402
from dispatcher.plugin.workers import (_join_xdist_group, pytest_xdist_auto_num_workers,  # noqa: E402,F401
                                       pytest_xdist_make_scheduler)
from dispatcher.plugin.fixtures import (_engine_generation, engine_under_test,  # noqa: E402,F401
                                        load_release, pinned_releases, policy, policy_spec)
from dispatcher.policies import (DEFAULT_POLICY, PolicyError, describe_policy,  # noqa: E402
                                 engine_spec, load_timeout_s, probe_policy)


def pytest_addoption(parser, pluginmanager):
    import importlib.util

    if pluginmanager.is_blocked("xdist") or importlib.util.find_spec("xdist") is None:
        # -p no:xdist (or no xdist at all): the suite's own --dist=loadgroup means nothing
        parser.addoption("--dist", default="no", help="(pytest-xdist is not active: ignored)")
    group = parser.getgroup("a2a-sizing-gate")
    group.addoption("--policy", default=DEFAULT_POLICY, metavar="SPEC",
                    help="sizing rule under test: NAME, module:callable, sglang[:VERSION|PATH] "
                         "(default: %(default)s)")
    group.addoption("--require-gpus", action="store_true",
                    help="fail, rather than skip, gpu/multi_gpu tests that cannot run here")
    group.addoption("--allow-missing-releases", action="store_true",
                    help="skip, rather than fail, the tests of a pinned SGLang/vLLM release "
                         "that cannot be had here (offline, no cache)")
    from dispatcher.model.generations import DEFAULT, GENERATIONS

    group.addoption("--flashinfer", default=None, metavar="VERSION",
                    help=f"FlashInfer A2A generation: {' or '.join(GENERATIONS)} (default: the "
                         f"installed FlashInfer, else {DEFAULT})")
    group.addoption("--self-check", action="store_true",
                    help="also run the gate's own self-checks (its machinery, the pinned "
                         "releases' verdicts, bad input): a run with a --policy of yours "
                         "deselects them, since they do not depend on it")
    group.addoption("--newest-companions", action="store_true",
                    help="for an engine checkout that lacks a function of the engine's own "
                         "code the gate runs beside the dispatcher file (moved, renamed): let "
                         "the newest pinned release's stand in, rather than refuse the tree")
    group.addoption("--rule-timeout-s", type=float, default=CALL_TIMEOUT.seconds, metavar="S",
                    help="seconds one call into the policy may take before it is stopped as "
                         "[slow rule] (default: %(default)s)")
    group.addoption("--rule-budget-ms", type=float, default=properties.RULE_BUDGET.seconds * 1e3,
                    metavar="MS", help="mean milliseconds one rule call may take "
                                       "(default: %(default)s)")


MARKERS = {
    "engine_releases": "engine_releases(engine, under_test=False): the test runs an engine's "
                       "pinned releases, on the FlashInfer generation they call (0.7.2); with "
                       "under_test=True, a --policy of that engine runs on the session's",
    "gpu": "every EP rank in one process on one GPU through FlashInfer's real A2A kernels; "
           "without a GPU, through the exact CPU model (not with --require-gpus)",
    "multi_gpu": "one OS process per EP rank, NCCL (or gloo when ranks share a GPU); without "
                 "a GPU, gloo and the emulated A2A (not with --require-gpus)",
    "real_kernels": "a gpu/multi_gpu test that needs the hardware itself (FlashInfer's own "
                    "byte numbers, CUDA faults, SMs): skipped without it",
    "self_check": "checks the gate itself, not the policy under test (given at collection to "
                  "every test that uses neither the policy nor its engine's tier); a run with "
                  "a --policy of the user's deselects these unless --self-check",
}


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's own plugin loads --hypothesis-profile
def pytest_configure(config):
    _OPEN_CONFIGS.append(config)
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if not config.pluginmanager.has_plugin("xdist"):  # -p no:xdist: its marks mean nothing
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's (not active)")
    asked = config.getoption("hypothesis_profile", None)
    env = os.environ.get("HYPOTHESIS_PROFILE", "dev")
    where = f"--hypothesis-profile={asked}" if asked else f"HYPOTHESIS_PROFILE={env}"
    profile = asked or env
    if profile not in PROFILES:
        raise pytest.UsageError(f"{where} is not a profile of this suite: use one of "
                                f"{', '.join(PROFILES)}")
    database = _database(config)  # never the folder the gate is run from (an engine's)
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(str(Path(database.path).parent.parent))  # its other caches beside it
    for name, chosen in PROFILES.items():
        if chosen.database is not None:
            settings.register_profile(name, settings(chosen, database=database))
    config.stash[_OUTER_PROFILE] = settings.get_current_profile_name()  # a nested run's
    settings.load_profile(profile)                                      # own, put back after
    if profile == "repro" and not _saved_examples():
        settings.load_profile(config.stash[_OUTER_PROFILE])
        raise pytest.UsageError(
            f"{where}: nothing to replay for --policy {config.getoption('--policy')}: its "
            f"example database ({database.path}) holds no saved failure. The repro profile "
            f"only replays what a failing run of this policy saved; run the gate once first "
            f"(HYPOTHESIS_PROFILE=dev or thorough), or HYPOTHESIS_PROFILE=ci to search")
    config.stash[_PROFILE_KEY] = profile
    specs = [a for a in config.invocation_params.args
             if str(a) == "--policy" or str(a).startswith("--policy=")]
    if len(specs) > 1:
        raise pytest.UsageError(f"--policy is given {len(specs)} times: one policy per run "
                                f"(gate each in its own run)")
    try:
        load_timeout_s()
    except PolicyError as exc:
        raise pytest.UsageError(str(exc)) from None
    _raise_on_sigterm()
    budget = config.getoption("--rule-budget-ms")
    if not math.isfinite(budget) or budget <= 0:
        raise pytest.UsageError(f"--rule-budget-ms must be a positive number of milliseconds, "
                                f"got {budget}")
    properties.RULE_BUDGET.seconds = config.getoption("--rule-budget-ms") / 1e3
    try:
        CALL_TIMEOUT.set(config.getoption("--rule-timeout-s"))
    except ValueError as exc:
        raise pytest.UsageError(f"--rule-timeout-s: {exc}") from None
    choose_generation(config.getoption("--flashinfer"), config.getoption("--policy"))
    if config.getoption("--newest-companions"):
        from dispatcher.releases.companions import NEWEST_ENV
        os.environ[NEWEST_ENV] = "1"  # workers and rank processes inherit it
    if not hasattr(config, "workerinput"):  # once per run, in the controller
        spec = config.getoption("--policy")
        from dispatcher.sandbox.procs import keep_cwd_off_children_paths

        keep_cwd_off_children_paths(spec)  # xdist's workers start as ``python -c``
        if _has_workers(config):
            _one_thread_each()
        if threading.current_thread() is threading.main_thread():
            from dispatcher.sandbox import zygote
            from dispatcher.sandbox.procs import child_env

            # the run's policy processes, its probe and its pools' ranks are forked from one
            # process that imports torch once (for this run's workers too: they inherit it)
            config.stash[_ZYGOTE] = zygote.start_root(child_env(spec))
        try:
            config.stash[_DESCRIBED] = describe_policy(spec)  # finds it, runs none of it
        except PolicyError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[_PROBE] = _Probe(spec, runs_tests=not _has_workers(config))
    elif _OPEN_CONFIGS[:1] == [config]:  # an xdist worker: its policy process loads meanwhile
        from dispatcher.supervised import prestart

        try:
            prestart(config.getoption("--policy"))
        except OSError:
            pass  # started again (and its error shown) at the first test that needs it


def _has_workers(config) -> bool:
    """Whether this run hands its tests to xdist workers (``-n N``, N > 0)."""
    return bool(getattr(config.option, "numprocesses", None))


def _preload_for_engine(config) -> None:
    """The tests of an engine policy that drive torch in the test process need it (seconds to
    import, more on a GPU host): a process that will run them imports it in the background
    once it has collected, rather than at its first test. Those are a rank pool's group
    (``dispatcher.gpu.warm.POOLS``: SGLang's recorder runs beside the pool); the single-GPU
    tier's driver imports torch as it starts (where it is real: its CPU model needs none),
    and every other test runs the engine's code in its policy process and imports no torch
    here (none of a vLLM policy's on a CPU machine). So only the process that runs a pool's
    group preloads it (elsewhere the import cost ~3.4 s of CPU on a 2-core machine, holding
    the interpreter's lock while the tests ran). Not during collection: a slower collection
    starts the pools later (gating an SGLang file on a 1 x H100 host: collected in 6.2-7.1 s,
    then 3.4-4.0)."""
    from dispatcher.engines import engine_of_spec

    if engine_of_spec(config.getoption("--policy")) is None or _OPEN_CONFIGS[:1] != [config]:
        return
    if not hasattr(config, "workerinput") and _has_workers(config):
        return  # the controller of workers runs no test
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return

    def preload():
        from dispatcher.sandbox.standins import MODULE_TABLE

        with MODULE_TABLE:  # no engine sandbox swaps sys.modules meanwhile
            import torch  # noqa: F401
    threading.Thread(target=preload, name="a2a-gate-preload-torch", daemon=True).start()


_DESCRIBED = pytest.StashKey[str]()
_PROFILE_KEY = pytest.StashKey[str]()


def _raise_on_sigterm() -> None:
    """SIGTERM (a CI job cancelled) unwinds this process like Ctrl-C: fixtures tear down, so
    rank pools and their temporary folders go with it (where nobody set a handler first)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def stop(signum, frame):
            raise KeyboardInterrupt("SIGTERM")
        signal.signal(signal.SIGTERM, stop)
_PROBE = pytest.StashKey["_Probe"]()


class _Probe:
    """The policy loaded once in a child process (a module that exits the process or never
    finishes loading is a usage error), in the background while pytest collects; ``verdict()``
    waits for it. Where this process runs the tests (no xdist workers), that child is the
    supervised process the tests then call (``supervised.prestart``); else a probe of its own
    (``policies.probe_policy``). No process of this run runs the policy before."""

    def __init__(self, spec: str, runs_tests: bool):
        self.error = None
        self._policy = None
        if runs_tests:
            from dispatcher.supervised import prestart

            try:
                self._policy = prestart(spec)
            except OSError as exc:
                self.error = f"--policy {spec}: its process could not start: {exc}"
            self._thread = None
            return
        import threading

        self._thread = threading.Thread(target=self._run, args=(spec,), daemon=True,
                                        name="a2a-gate-policy-probe")
        self._thread.start()

    def _run(self, spec: str) -> None:
        try:
            probe_policy(spec)
        except PolicyError as exc:
            self.error = str(exc)

    def verdict(self) -> None:
        if self._thread is not None:
            self._thread.join()
        elif self._policy is not None and not self.error:
            try:
                self._policy.wait_loaded()
            except PolicyError as exc:
                self.error = str(exc)
        if self.error:
            raise pytest.UsageError(self.error)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Before any test runs (xdist workers run none before the controller's loop hands them
    out): the probe of the policy has to have passed."""
    probe = session.config.stash.get(_PROBE, None)
    if probe is not None:
        probe.verdict()


def pytest_report_header(config):
    line = f"a2a-sizing-gate: policy {config.getoption('--policy')}"
    line += config.stash.get(_DESCRIBED, "")
    if config.getoption("--policy") != DEFAULT_POLICY and not config.getoption("--self-check"):
        line += ("\n  the gate's own self-checks (tests that do not depend on the policy) are "
                 "deselected: --self-check runs them too")
    from dispatcher.model.generations import active

    profile = config.stash.get(_PROFILE_KEY, "dev")
    if profile == "repro":
        line += (f"\n  the repro profile replays the failures of this policy saved in "
                 f"{getattr(settings().database, 'path', 'none')} (nothing is searched)")
    return [line, f"hypothesis profile: {profile}; FlashInfer: {flashinfer_version()} "
                  f"(modelled: {active().version}); "
                  f"GPU tiers: {flashinfer_missing() or 'available'}"]


# --- hardware: count GPUs without initialising CUDA in the parent --------------------------
_UNAVAILABLE = pytest.StashKey[str]()


def checks_policy(item, spec: str) -> bool:
    """Whether ``item`` checks the policy under test ``spec``: it uses the ``policy`` fixture,
    or it is the tier of the engine ``spec`` names (``engine_releases(E, under_test=True)``)."""
    names = getattr(item, "fixturenames", ())
    if "policy" in names:
        return True
    mark = item.get_closest_marker("engine_releases")
    if mark is None or not mark.kwargs.get("under_test"):
        if "engine_under_test" in names:
            raise pytest.UsageError(f"{item.nodeid} uses engine_under_test without "
                                    f"engine_releases(ENGINE, under_test=True)")
        return False
    return engine_spec(spec, mark.args[0]) == spec


_SELF_CHECKS = pytest.StashKey[int]()


def _mark_self_checks(config, items) -> None:
    """Give ``self_check`` to every test that does not check the policy under test; when the
    policy is the user's (``--policy`` not the default) deselect them unless ``--self-check``:
    the user waits only for the checks of their code, all of them, unchanged."""
    spec = config.getoption("--policy")
    mine = [item for item in items if not checks_policy(item, spec)]
    for item in mine:
        item.add_marker(pytest.mark.self_check)
    if spec == DEFAULT_POLICY or config.getoption("--self-check") or not mine:
        return
    gone = set(map(id, mine))
    items[:] = [item for item in items if id(item) not in gone]
    config.hook.pytest_deselected(items=mine)
    config.stash[_SELF_CHECKS] = len(mine)
    if hasattr(config, "workeroutput"):
        config.workeroutput["a2a_self_checks"] = len(mine)


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which reads the marks too early
def pytest_collection_modifyitems(config, items):
    _mark_self_checks(config, items)
    """GPU work is scheduled by resource (``--dist=loadgroup``): the single-GPU tier's tests
    share one xdist worker (one CUDA context, its workspaces); the tests of each rank pool
    carry that pool's group (tests/multi_gpu/conftest.py), so each pool is started by one
    worker and the pools run side by side with the single-GPU tier and the CPU tests. Tests
    that share a recorded search carry their own ``xdist_group`` mark, so one worker
    records it once."""
    emulate = not config.getoption("--require-gpus")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.xdist_group("gpu-single"))
        elif not item.get_closest_marker("multi_gpu"):
            continue
        missing = flashinfer_missing()
        if missing and emulate and not item.get_closest_marker("real_kernels"):
            missing = ""  # the exact CPU model behind the tier's driver (gpu/single_cpu.py, the
            # rank pool's emulated ranks): the tier's logic runs here; --require-gpus fails it
        item.stash[_UNAVAILABLE] = missing
    if getattr(config.option, "loadgroup", False):  # set in xdist workers under loadgroup
        for item in items:
            _join_xdist_group(item)


def pytest_collection_finish(session):
    """Start, in the background, the costly resources (``dispatcher.gpu.warm``) of the groups
    that have a test to run here: in an xdist worker, those pinned to it; in a process that
    runs its tests itself (``-n 0``, a watch's test process), every one."""
    if session.config.option.collectonly:
        return  # nothing will run: a pool started now would only be torn down (torch imported)
    # this session's own worker id: a nested ``pytest -p no:xdist`` inherits its parent
    # worker's PYTEST_XDIST_WORKER, yet runs every test it collects itself
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    alone = not worker and not _has_workers(session.config) and _OPEN_CONFIGS[:1] == [session.config]
    if not alone and not (worker and getattr(session.config.option, "loadgroup", False)):
        _preload_for_engine(session.config)  # which tests run here is not known: any may need it
        return
    from dispatcher.gpu import warm

    groups = {}
    for item in session.items:
        for mark in item.iter_markers("xdist_group"):
            name = str(mark.args[0] if mark.args else mark.kwargs.get("name", ""))
            uses = warm.FIXTURES.get(name) in getattr(item, "fixturenames", ())
            groups[name] = groups.get(name, False) or (uses and not item.stash.get(_UNAVAILABLE, ""))
    workers = int(getattr(session.config, "workerinput", {}).get("workercount", 1))
    if any(groups.get(g) and (alone or warm.pinned_worker(g, workers) == worker)
           for g in warm.POOLS):
        _preload_for_engine(session.config)
    from dispatcher.policies import load_policy  # how the pools' ranks load the --policy spec

    if alone:
        for group in (g for g in warm.PINNED if groups.get(g)):
            warm.start(group, resolve=load_policy)
        return
    warm.start_for(worker, workers, groups, lambda group: groups[group], resolve=load_policy)


def pytest_runtest_setup(item):
    reason = item.stash.get(_UNAVAILABLE, "")
    if reason:
        if item.config.getoption("--require-gpus"):
            pytest.fail(f"--require-gpus: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist: each worker deselected the same self-checks (they collect the same suite)."""
    count = getattr(node, "workeroutput", {}).get("a2a_self_checks")
    if count is not None:
        node.config.stash[_SELF_CHECKS] = count


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.stash.get(_SELF_CHECKS, 0)
    if count:
        terminalreporter.write_line(
            f"a2a-sizing-gate: {count} self-checks of the gate deselected (they do not depend "
            f"on --policy {config.getoption('--policy')}); --self-check runs them too")


pytest_plugins = ["pytester"]  # the meta tests run the suite itself against bad rules
