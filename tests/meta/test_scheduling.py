"""How the suite runs under ``pytest -n auto``.

Its scheduling holds in a real ``pytest -n 2`` run: every test of one ``xdist_group`` runs on
one worker. The GPU tiers rely on it (the single-GPU tier's tests share one CUDA context, each
rank pool is started and driven by one process), and the verdict tables record each search
once per group. xdist's own grouping was silently lost (marks added by conftest.py come after
xdist reads them; on pytest >= 9.2 its nodeid rewrite has no effect,
pytest-dev/pytest-xdist#1386), so this runs the scheduler, not a model of it.

And each pytest process starts without compiling Hypothesis again (conftest.py leaves it out
of assert rewriting)."""
import re
from collections import defaultdict

import pytest

from .. import CONFTEST, needs_torch

TESTS = '''
import pytest

@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xdist_group(f"search-{i % 2}"))
                               for i in range(8)])
def test_cell(i):
    pass

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(4))
def test_single_gpu(i):
    pass

@pytest.mark.multi_gpu
@pytest.mark.xdist_group("rank-pool-2-shared")
@pytest.mark.parametrize("i", range(4))
def test_pool(i):
    pass
'''


def test_each_group_runs_on_one_worker(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_groups=TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "--dist=loadgroup", "-v",
                                           "-p", "no:cacheprovider", timeout=120)
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] \w+ (\S+)", result.stdout.str(), re.M)
    assert len(ran) == 24, result.stdout.str()[-3000:]
    workers = defaultdict(set)
    for worker, nodeid in ran:
        group = nodeid.rpartition("@")[2] if "@" in nodeid else None
        workers[group].add(worker)
        if "test_single_gpu" in nodeid:
            assert group == "gpu-single", nodeid
        if "test_pool" in nodeid:
            assert group == "rank-pool-2-shared", nodeid
    assert set(workers) == {None, "search-0", "search-1", "gpu-single", "rank-pool-2-shared"}
    for group, used in workers.items():
        assert group is None or len(used) == 1, f"group {group} ran on workers {sorted(used)}"


def test_hypothesis_is_imported_plain_and_the_tests_rewritten():
    from _pytest.assertion.rewrite import AssertionRewritingHook
    import hypothesis.core

    assert isinstance(__loader__, AssertionRewritingHook)  # noqa: F821 - this module's loader
    assert not isinstance(hypothesis.core.__loader__, AssertionRewritingHook)


CRASHES = '''
import os
import time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass

@pytest.mark.xdist_group("search-0")
def test_crashes_its_worker():
    time.sleep(float(os.environ.get("A2A_TEST_CRASH_AFTER_S", "0")))
    os._exit(13)  # the worker process dies in the call (no core dump to wait for)

@pytest.mark.xdist_group("search-0")
def test_after_the_crash(i=0):
    pass
'''


HANG_DUMP = '''

import faulthandler as _faulthandler
import sys as _sys

_faulthandler.dump_traceback_later(30, exit=False, file=_sys.stderr)
'''


@pytest.mark.parametrize("crash_after_s", [0, 2], ids=["at-once", "after-the-rest"])
def test_a_crashed_worker_fails_its_test_and_the_run_goes_on(pytester, monkeypatch, crash_after_s):
    """A worker that dies in a test (a segfault in the call) fails that test with xdist's
    "worker crashed" report; the scheduler gives its other work to a worker that is up, or to
    the one started in its place, and the run ends with exit 1, never an INTERNALERROR of the
    scheduler and never a hang. ``after-the-rest``: the other worker has run everything and been
    told to stop before the crash, so the crashed unit's last test goes to the replacement,
    which must be told at once that nothing more comes (it hung, holding its last test, when the
    replacement was handed the unit and never told: once in about ten whole-suite runs on a
    loaded 2-core machine, every time here). Every process of the run dumps its threads' stacks
    after 30 s, so a hang says where it waits."""
    monkeypatch.setenv("A2A_TEST_CRASH_AFTER_S", str(crash_after_s))
    pytester.makeconftest(CONFTEST + HANG_DUMP)
    pytester.makepyfile(test_crash=CRASHES)
    result = pytester.runpytest_subprocess("-n", "2", "--dist=loadgroup", "-p", "no:cacheprovider",
                                           "--max-worker-restart=2", timeout=60)
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 1 and "INTERNALERROR" not in text, text[-3000:]
    assert re.search(r"crashed while running .*test_crashes_its_worker", text), text[-3000:]
    result.assert_outcomes(passed=7, failed=1)


@pytest.mark.parametrize("args, expected", [
    ([], 16),  # the whole suite: one process per CPU
    (["--policy=prefix_rule", "--self-check"], 16),  # the whole suite again, under that rule
    (["--policy=prefix_rule"], "policy"),  # a policy gated alone: its checks, a few dozen
    (["--policy=sglang:0.5.23"], "policy"),
], ids=["whole-suite", "self-check", "a-rule", "an-engine"])
def test_auto_starts_as_many_processes_as_the_run_has_work_for(pytester, monkeypatch, args,
                                                               expected):
    """``-n auto`` on a 16-CPU host (xdist counts them): 16 test processes for the whole suite,
    ``runner.POLICY_PROCESSES`` for a user's policy, whose 13-26 checks left each further
    process only its own start to add; a count the user set stands."""
    import os

    from dispatcher.commands.runner import POLICY_PROCESSES

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    try:  # xdist counts with psutil where it is installed
        import psutil
        monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16)
    except ImportError:
        pass
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    pytester.makeconftest(CONFTEST)
    config = pytester.parseconfig("-n", "auto", *args)
    count = config.hook.pytest_xdist_auto_num_workers(config=config)
    assert count == (POLICY_PROCESSES if expected == "policy" else expected)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert config.hook.pytest_xdist_auto_num_workers(config=config) == 5


PRELOAD_SPY = '''
import dispatcher.plugin

PRELOADED = []  # each call of the plugin's torch preload in this process
dispatcher.plugin._preload_for_engine = PRELOADED.append
'''
NO_TORCH_HERE = '''
import pytest

from conftest import PRELOADED


@pytest.fixture
def single_gpu():  # the tier's fixture: its group is pinned (its driver imports what it needs)
    return None


@pytest.mark.gpu
def test_on_the_single_gpu_tier(single_gpu, policy):
    pass


def test_checks_the_policy(policy):
    assert not PRELOADED, "torch preloaded in a process whose tests need none of it"
'''


@needs_torch()
@pytest.mark.engine_releases("sglang")
def test_under_an_engine_policy_a_process_with_no_pool_preloads_no_torch(pytester):
    """Only a process that runs a rank pool's tests (SGLang's recorder runs beside the pool)
    imports torch in the background (``plugin._preload_for_engine``); the others run the
    engine's code in its policy process and need none of it (the nested user's run of
    ``test_no_false_alarm`` paid ~3.4 s of CPU for it on a 2-core machine). The single-GPU
    tier's driver imports torch as it starts, where it is real."""
    from dispatcher.sglang.sources import RELEASES

    pytester.makeconftest(CONFTEST + PRELOAD_SPY)
    pytester.makepyfile(test_probe=NO_TORCH_HERE)
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider",
                                           f"--policy=sglang:{RELEASES[-1]}", timeout=120)
    result.assert_outcomes(passed=2)
