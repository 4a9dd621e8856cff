"""The run's zygote (``dispatcher.sandbox.zygote``): the gate's child processes (a policy's
process, its probe, a pool's ranks) are forked from one process that imported torch once, and
each is what ``python -c`` would have started: its environment, folder, arguments and output,
its own session, its exit status, and it never outlives the process that asked for it."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from dispatcher.sandbox import zygote
from dispatcher.sandbox.procs import child_env

from .. import needs_torch

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="the zygote needs Linux (fork, parent-death signal)"),
              needs_torch(reason="the zygote's children run torch: pip install torch==2.13.0")]


def describe(code: int) -> None:
    """A child's account of itself, then exit ``code``."""
    print(json.dumps({"torch_at_start": "torch" in sys.modules, "cwd": os.getcwd(),
                      "hypothesis_at_start": any(m.split(".")[0] == "hypothesis" for m in sys.modules),
                      "argv": sys.argv, "mark": os.environ.get("A2A_TEST_PER_WORKER"),
                      "leader": os.getpgid(0) == os.getpid() == os.getsid(0),
                      "pid": os.getpid()}), flush=True)
    sys.exit(code)


def sleep_with_a_grandchild(path: str) -> None:
    """Sleep, with a grandchild in the same process group; write both pids to ``path``."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(path, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(300)


def raise_error() -> None:
    raise RuntimeError("raised in the child")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].split()[0] == "Z":  # a zombie has ended
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _pids(path, within: float = 60.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().strip():
            return [int(p) for p in open(path).read().split()]
        time.sleep(0.05)
    raise AssertionError("the child did not start")


@pytest.fixture
def root(monkeypatch):
    """A zygote of this test's own (the run's, if any, is set aside), stopped after the test.
    Its children preload nothing (``NOTHING``) unless a test asks for torch: each sub-zygote
    that imports torch costs seconds, more on a busy GPU host."""
    monkeypatch.delenv(zygote.ENV, raising=False)
    made = zygote.start_root(child_env())
    assert made is not None and os.environ[zygote.ENV] == made.folder
    yield made
    made.stop()


NOTHING = ()  # a sub-zygote's preload where what it imported is not what the test is about


def test_a_child_is_what_python_c_would_start_and_its_status_comes_back(root, tmp_path):
    out = tempfile.TemporaryFile()
    env = dict(child_env(), PYTEST_XDIST_WORKER="gw7", A2A_TEST_PER_WORKER="x")
    env.pop("A2A_TEST_PER_WORKER")  # per-worker variables (PYTEST_*) may differ; others may not
    proc = zygote.popen(describe, (3,), env=env, cwd=str(tmp_path), stdout=out.fileno(),
                        preload=zygote.WITH_TORCH, argv=["-c", "first", "second"])
    assert isinstance(proc, zygote.Forked)
    assert proc.wait(timeout=120) == 3 and proc.returncode == 3
    out.seek(0)
    seen = json.loads(out.read().decode().strip().splitlines()[-1])
    assert seen["torch_at_start"], "the child imported torch itself: the zygote did not preload it"
    assert not seen["hypothesis_at_start"]  # so HYPOTHESIS_* may differ (read when imported)
    assert seen["cwd"] == str(tmp_path) and seen["argv"] == ["-c", "first", "second"]
    assert seen["leader"] and seen["pid"] == proc.pid and proc.pid != os.getpid()
    # a second child is a fork too, and an error in the target is its exit status and output
    out2 = tempfile.TemporaryFile()
    failing = zygote.popen(raise_error, (), env=child_env(), stdout=out2.fileno(),
                           preload=zygote.WITH_TORCH)  # the same sub-zygote: forked at once
    assert failing.wait(timeout=60) == 1
    out2.seek(0)
    assert "RuntimeError: raised in the child" in out2.read().decode()


def test_a_process_of_another_environment_is_refused(root):
    """A fork would carry what the zygote imported under its environment: a request for
    another (a thread count, a path) gets None, and the caller starts ``python -c``."""
    for change in ({"OMP_NUM_THREADS": "7"}, {"PYTHONPATH": "/elsewhere"}):
        assert zygote.popen(describe, (0,), env=dict(child_env(), **change)) is None
    served = zygote.popen(describe, (0,), env=dict(child_env(), PYTEST_CURRENT_TEST="t", COLUMNS="9",
                                                   PYTHONSAFEPATH="1", HYPOTHESIS_PROFILE="ci"))
    assert served is not None and served.wait(timeout=60) == 0


def test_a_command_run_from_the_gates_folder_is_served(root, monkeypatch):
    """A command of the gate's started from its own folder (``a2a-gate verdicts``, a replay,
    a nested ``pytest``, as the self-checks run them) asks with the environment the run's
    zygote has: the gate's folder once on ``PYTHONPATH`` though it is also the current one and
    the policy's module lies there (it was there twice: every such command was refused, and
    started ``python -c`` and torch again), ``PYTHONSAFEPATH`` set by the run or not."""
    from dispatcher.sandbox.procs import SOURCE_ROOT

    monkeypatch.chdir(SOURCE_ROOT)
    own = child_env("dispatcher.sizing:ideal_rule")["PYTHONPATH"].split(os.pathsep)
    assert own.count(SOURCE_ROOT) == 1 and own[0] == SOURCE_ROOT
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    for spec in ("dispatcher.sizing:ideal_rule", "sglang:0.5.23", ""):
        proc = zygote.popen(describe, (0,), env=child_env(spec))
        assert proc is not None, spec
        assert proc.wait(timeout=60) == 0


def test_a_kill_takes_the_childs_group(root, tmp_path):
    pids = str(tmp_path / "pids")
    proc = zygote.popen(sleep_with_a_grandchild, (pids,), env=child_env(), preload=NOTHING)
    child, grandchild = _pids(pids)
    assert child == proc.pid and proc.poll() is None and proc.is_alive()
    proc.kill_group()
    assert proc.returncode == -signal.SIGKILL
    assert _gone(child) and _gone(grandchild)


def test_a_child_goes_with_the_process_that_asked(root, tmp_path):
    """The asker holds a lease: SIGKILL it (no clean-up of its own runs), and the zygote kills
    what it asked for."""
    pids = str(tmp_path / "pids")
    asker = subprocess.Popen([sys.executable, "-c", (
        "import importlib, json, sys, time\n"
        "from dispatcher.sandbox import zygote\n"
        f"target = importlib.import_module({__name__!r}).sleep_with_a_grandchild\n"
        "proc = zygote.popen(target, (sys.argv[1],), env=json.loads(sys.argv[2]))\n"
        "assert proc is not None  # held: a dropped handle gives its lease up\n"
        "time.sleep(300)\n"), pids, json.dumps(child_env())], env=child_env())
    try:
        child, grandchild = _pids(pids)
        asker.kill()
        asker.wait()
        assert _gone(child) and _gone(grandchild)
    finally:
        asker.kill()
        asker.wait()


def test_stopping_the_root_ends_what_it_forked_and_its_folder(root, tmp_path):
    pids = str(tmp_path / "pids")
    proc = zygote.popen(sleep_with_a_grandchild, (pids,), env=child_env(), preload=NOTHING)
    child, grandchild = _pids(pids)
    root.stop()
    assert _gone(child) and _gone(grandchild) and proc.wait(timeout=10) == -signal.SIGKILL
    assert not os.path.exists(root.folder) and zygote.ENV not in os.environ
    assert zygote.popen(describe, (0,), env=child_env()) is None  # none announced: python -c


def test_a_nested_run_keeps_a_zygote_that_serves_it(root):
    """``start_root`` under a zygote that serves the same environment starts none (a nested
    pytest run inside a run shares the run's); under another environment, its own."""
    assert zygote.start_root(child_env()) is None and os.environ[zygote.ENV] == root.folder
    other = zygote.start_root(dict(child_env(), A2A_TEST_OTHER="1"))
    try:
        assert other is not None and os.environ[zygote.ENV] == other.folder
    finally:
        other.stop()
    assert os.environ[zygote.ENV] == root.folder  # what was announced before, again


def test_the_gates_processes_are_forked_where_a_zygote_serves(root, tmp_path, monkeypatch):
    """The policy's process and a pool's ranks come from the zygote (no interpreter or torch
    start each), and answer as they do from ``python -c``."""
    from dispatcher import supervised
    from dispatcher.gpu.rank_pool import RankPool
    from dispatcher.policies import load_policy
    from dispatcher.sizing import RankView

    (tmp_path / "a2a_forked_rule.py").write_text("def rule(view):\n    return 5\n")
    supervised.forget_all()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")])))  # the user's rule module, on their path
    root.stop()  # the zygote is started with the environment the run's children will have
    here = zygote.start_root(child_env("a2a_forked_rule:rule"))
    try:
        policy = supervised.load_supervised("a2a_forked_rule:rule")
        assert isinstance(policy._child.proc, zygote.Forked)
        view = RankView(ep_rank=0, ep_size=2, dp_size=1, attn_tp_size=2, dp_global=None,
                        local_tokens=3, max_num_tokens=8)
        assert policy(view) == 5
        pool = RankPool(2, 1, 640, 512, emulated=True, resolve=load_policy)
        try:
            assert all(isinstance(p, zygote.Forked) for p in pool._procs)
            from strategies import GPU_SHAPES  # noqa: F401 - the pool's usual shapes load
            from dispatcher.model.world import World

            pool.run(World(ep_size=2, dp_size=1, group_tokens=(3,), max_num_tokens=8),
                     "ideal_rule")
        finally:
            pool.close()
    finally:
        supervised.forget_all()
        here.stop()
