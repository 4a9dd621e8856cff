"""Whatever a policy raises or does is a verdict, never a skip or an exit: a rule that calls
``pytest.skip()`` or raises ``SystemExit`` crashes its test with the world; a module that
exits the process or never finishes importing is a usage error saying so (exit 4 in pytest,
2 in the replay command)."""
import importlib.util
import os
import subprocess
import sys
import time
import textwrap

import pytest

from .. import CONFTEST, SOURCE, hostile_folder

from dispatcher.model import properties
from dispatcher.model.world import World
from dispatcher.sandbox.procs import DROP_CWD

WORLD = World(ep_size=2, dp_size=1, group_tokens=(2,), max_num_tokens=4)


@pytest.mark.parametrize("raise_it", [
    lambda: pytest.skip("no GPU here"), lambda: pytest.xfail("later"),
    lambda: pytest.importorskip("a_module_that_is_not_there"), lambda: sys.exit(0),
    lambda: (_ for _ in ()).throw(GeneratorExit()), lambda: (_ for _ in ()).throw(SystemExit(3))])
def test_anything_a_rule_raises_is_a_crash(raise_it):
    def rule(view):
        raise_it()
    with pytest.raises(properties.RuleCrashed, match=r"\[rule crashed\]"):
        properties.rule_values(rule, WORLD)


def test_a_plain_rule_cannot_declare_a_world_impossible():
    from dispatcher.sizing import NotApplicable

    def rule(view):
        raise NotApplicable("not my world")
    with pytest.raises(properties.RuleCrashed, match="only an engine policy"):
        properties.rule_values(rule, WORLD)


def test_keyboard_interrupt_stops_the_run():
    def rule(view):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        properties.rule_values(rule, WORLD)


MODULES = {
    "exits": "import os\nos._exit(0)\n",
    "sysexit": "import sys\nsys.exit(0)\n",
    "loops": "while True:\n    pass\n",
}
WORDS = {"exits": "ended the process", "sysexit": "raised SystemExit", "loops": "did not finish within 1 s"}


def _path(monkeypatch, folder):
    """``folder`` importable in child processes, the gate still importable beside it."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(SOURCE), *rest]))


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    for name, body in MODULES.items():
        (tmp_path / f"hostile_{name}.py").write_text(body + "def rule(view):\n    return 1\n")
    _path(monkeypatch, tmp_path)
    monkeypatch.setenv("A2A_GATE_POLICY_LOAD_TIMEOUT_S", "1")
    return tmp_path


def _assert_usage_error(pytester, policy: str, words: str) -> None:
    """``pytest --policy=POLICY`` on a trivial suite is a usage error saying ``words``."""
    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_nothing="def test_x():\n    pass\n")
    # in-process: the policy is never loaded here (the probe's child process loads it first)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                          f"--policy={policy}")
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text[-2000:]
    assert words in text and "INTERNALERROR" not in text, text[-2000:]


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_that_exits_or_hangs_is_a_usage_error(pytester, hostile, name):
    _assert_usage_error(pytester, f"hostile_{name}:rule", WORDS[name])


def test_a_users_module_named_like_the_gate_is_still_probed(pytester, hostile):
    """The gate's own modules are known by where they are, not by a name prefix: a user's
    ``dispatcher_local`` that exits at import gets the probe like any module of theirs (it
    was taken for the gate's own: no probe, exit 0 with no output)."""
    (hostile / "dispatcher_local.py").write_text(MODULES["exits"] + "def rule(view):\n    return 1\n")
    _assert_usage_error(pytester, "dispatcher_local:rule", WORDS["exits"])


@pytest.mark.parametrize("name", list(MODULES))
def test_the_replay_command_reports_it_as_bad_input(hostile, name):
    done = subprocess.run([sys.executable, "-m", "dispatcher", "--policy", f"hostile_{name}:rule",
                           repr(WORLD)], capture_output=True, text=True, timeout=60, cwd=SOURCE)
    assert done.returncode == 2, done.stdout + done.stderr
    assert WORDS[name] in done.stderr


def test_a_rule_exiting_in_the_replay_command_is_a_violation(tmp_path, monkeypatch):
    (tmp_path / "exits_late.py").write_text(textwrap.dedent("""
        import sys
        def rule(view):
            sys.exit(0)
    """))
    _path(monkeypatch, tmp_path)
    done = subprocess.run([sys.executable, "-m", "dispatcher", "--policy", "exits_late:rule",
                           repr(WORLD)], capture_output=True, text=True, timeout=60, cwd=SOURCE)
    assert done.returncode == 1 and "[rule crashed]" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="SGLang's file needs torch")
@pytest.mark.parametrize("body, words", [("import os\nos._exit(0)\n", "ended the process"),
                                         ("import sys\nsys.exit(0)\n", "raised SystemExit")])
def test_an_engine_file_that_exits_at_load_is_a_usage_error(pytester, tmp_path, body, words):
    engine = tmp_path / "flashinfer.py"
    engine.write_text(body + "\n\nclass FlashinferDispatcher:\n    pass\n")  # read as SGLang's
    _assert_usage_error(pytester, f"sglang:{engine}", words)


def test_what_a_rule_prints_is_bounded(capsys):
    from dispatcher.model.properties import POLICY_OUTPUT

    def loud(view):
        print("x" * (1 << 20))
        return max(1, view.local_tokens)
    before = POLICY_OUTPUT.passed
    with pytest.warns(UserWarning, match="printed more than"):
        properties.rule_values(loud, WORLD)
    out = capsys.readouterr().out
    assert len(out) <= POLICY_OUTPUT.limit - before and POLICY_OUTPUT.dropped > 2 << 20


def test_a_rule_leaving_a_thread_running_does_not_hang_pytest(pytester, tmp_path, monkeypatch):
    (tmp_path / "threadrule.py").write_text(textwrap.dedent("""
        import threading, time
        def rule(view):
            if not getattr(rule, "started", False):
                rule.started = True
                threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()
            return max(1, max(v for v in [view.local_tokens]))
    """))
    _path(monkeypatch, tmp_path)
    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_one="""
        from dispatcher.model import properties
        from dispatcher.model.world import World
        def test_calls_the_rule(policy):
            properties.rule_values(policy, World(ep_size=1, dp_size=1, group_tokens=(1,),
                                                 max_num_tokens=1))
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                           "--policy=threadrule:rule", timeout=60)
    assert result.ret == pytest.ExitCode.OK  # the thread lives (and goes) with the rule's process
    assert result.duration < 30


# --- a policy cannot decide the exit status, end the process or run forever ---------------
LATE = {
    # registered at import: would turn the failed run's status into 0 at exit
    "exit0_at_exit": "import atexit, os\natexit.register(os._exit, 0)\ndef rule(view):\n    return 0\n",
    # inside a call: would end the run with status 0 and no output
    "exit0_in_call": "import os\ndef rule(view):\n    os._exit(0)\n",
    # never returns (a power-of-two round-up that loops on an idle world)
    "loops_in_call": ("def rule(view):\n    n = view.local_tokens\n    while n & (n - 1) or n == 0:\n"
                      "        n += n & -n\n    return n\n"),
    # the exit bound before the gate could guard it: ends the process that runs the rule
    "bound_exit": "from os import _exit\ndef rule(view):\n    _exit(0)\n",
    # a user's module named like the gate: its atexit exit runs where the rule runs, not in pytest
    "dispatcher_late": "import atexit, os\natexit.register(os._exit, 0)\ndef rule(view):\n    return 0\n",
    # stops the gate's timer inside the call, ignores SIGTERM and spins: only SIGKILL ends it
    "spins_deaf": ("import signal\ndef rule(view):\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
                   "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    while True:\n"
                   "        pass\n"),
    # a crash of the interpreter (a segfault) inside the call
    "segfaults": "import ctypes\ndef rule(view):\n    return ctypes.string_at(0)\n",
}
LATE_WORDS = {"exit0_at_exit": "[positive]", "exit0_in_call": "called os._exit(0)",
              "loops_in_call": "[slow rule]", "bound_exit": "exited with status 0",
              "dispatcher_late": "[positive]", "spins_deaf": "[slow rule]",
              "segfaults": "killed by signal SIGSEGV"}
ONE_TEST = """
from dispatcher.model import properties
from dispatcher.model.world import World
from dispatcher.sandbox.procs import DROP_CWD
def test_calls_the_rule(policy, policy_spec):
    world = World(ep_size=2, dp_size=1, group_tokens=(0,), max_num_tokens=4)
    properties.check_all(world, properties.rule_values(policy, world, policy_spec), policy_spec)
"""


@pytest.fixture
def late(tmp_path, monkeypatch):
    for name, body in LATE.items():
        (tmp_path / f"{name}.py").write_text(body)
    _path(monkeypatch, tmp_path)
    return tmp_path


@pytest.mark.parametrize("name, workers", [  # -n 2: xdist once lost such a run (INTERNALERROR)
    ("exit0_at_exit", "0"), ("exit0_in_call", "0"), ("exit0_in_call", "2"), ("loops_in_call", "0"),
    ("bound_exit", "0"), ("bound_exit", "2"), ("dispatcher_late", "0"), ("spins_deaf", "0"),
    ("segfaults", "0"), ("segfaults", "2")])
def test_a_failing_run_fails_whatever_the_policy_runs(pytester, late, name, workers):
    """The session's verdict is the exit status: an ``atexit`` exit, an ``os._exit`` inside
    a call or a call that never returns all end as a failed test with the world."""
    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_one=ONE_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", workers,
                                           f"--policy={name}:rule", "--rule-timeout-s=0.5",
                                           timeout=120)
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text[-3000:]
    assert LATE_WORDS[name] in text and "INTERNALERROR" not in text, text[-3000:]


@pytest.mark.parametrize("name", list(LATE))
def test_the_replay_command_decides_its_own_status(late, name):
    done = subprocess.run([sys.executable, "-m", "dispatcher", "--policy", f"{name}:rule",
                           "--timeout", "20", "--rule-timeout-s", "0.5", repr(World(ep_size=2, dp_size=1, group_tokens=(0,),
                                                          max_num_tokens=4))],
                          capture_output=True, text=True, timeout=60, cwd=SOURCE)
    assert done.returncode == 1, done.stdout + done.stderr
    assert LATE_WORDS[name] in done.stdout + done.stderr


def test_a_replay_over_its_time_is_stopped(late):
    """The replay's own bound: the controller stops a child that overruns ``--timeout`` (here
    shorter than the per-call limit) and says so."""
    done = subprocess.run([sys.executable, "-m", "dispatcher", "--policy", "loops_in_call:rule",
                           "--timeout", "1", repr(World(ep_size=2, dp_size=1, group_tokens=(0,),
                                                         max_num_tokens=4))],
                          capture_output=True, text=True, timeout=60, cwd=SOURCE)
    assert done.returncode == 1 and "did not return within 1 s" in done.stdout, \
        done.stdout + done.stderr


def test_the_replay_runs_nothing_from_the_current_directory(tmp_path, monkeypatch):
    """A ``json.py`` (or ``socket.py``) lying in the folder a user runs the replay from is never
    imported by its child (the gate's other processes: tests/meta/test_packaging.py)."""
    rules, here = hostile_folder(tmp_path)
    _path(monkeypatch, rules)
    world = repr(World(ep_size=2, dp_size=1, group_tokens=(2,), max_num_tokens=4))
    # a2a-gate as its console script runs it (``python -m`` would put the folder first itself)
    gate = [sys.executable, "-c", DROP_CWD + "from dispatcher.commands.cli import main\nsys.exit(main())"]
    done = subprocess.run(gate + ["replay", "--policy", "elsewhere_rule:rule", world],
                          capture_output=True, text=True, timeout=120, cwd=here)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not list(here.glob("ran-*")), list(here.glob("ran-*"))


def test_a_plain_rule_cannot_choose_its_worlds():
    """``bind``, ``engine_world`` and ``engine_step`` on a plain callable mean nothing: only
    the gate's engine types (dispatcher/model/engine.py) are bound to a world, mapped to their
    engine's worlds or may declare a world impossible."""
    from dispatcher.sizing import NotApplicable

    def rule(view):
        return 1

    rule.engine_world = lambda world, keep_cap=False: World(ep_size=1, dp_size=1,
                                                            group_tokens=(1,), max_num_tokens=1)
    rule.bind = lambda world, *a: (lambda view: 1)
    rule.engine_step = True
    world = World(ep_size=2, dp_size=1, group_tokens=(9,), max_num_tokens=16)
    assert properties.world_for(rule, world) is world
    with pytest.raises(properties.PropertyViolation, match=r"\[fits\]"):
        properties.check_all(world, properties.rule_values(rule, world))

    def shy(view):
        raise NotApplicable("not my world")
    shy.engine_step = True
    with pytest.raises(properties.RuleCrashed, match="only an engine policy"):
        properties.rule_values(shy, world)


@pytest.mark.parametrize("body, words", [
    ("def rule(view):\n    return 10 ** 5000\n", "an int of about 5,000 digits"),
    ("class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n"
     "def rule(view):\n    raise E()\n", "its message could not be read"),
    ("import os\ndef rule(view):\n    if os.fork() == 0:\n        import time\n"
     "        time.sleep(600)\n    return 1\n", "forked the test process"),
])
def test_what_a_rule_returns_or_raises_is_reported_with_the_world(tmp_path, monkeypatch, body,
                                                                  words):
    name = f"odd_rule_{abs(hash(body))}"  # a module of its own per case
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    from dispatcher.policies import load_policy

    rule = load_policy(f"{name}:rule")[1]
    with pytest.raises(properties.PropertyViolation) as info:
        properties.check_all(WORLD, properties.rule_values(rule, WORLD, f"{name}:rule"))
    assert words in str(info.value) and "replay: python -m dispatcher" in str(info.value)


def test_a_module_that_changes_directory_at_import_is_put_back(tmp_path, monkeypatch):
    (tmp_path / "wanders.py").write_text("import os\nos.chdir('/')\ndef rule(view):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    from dispatcher.policies import load_policy

    with pytest.warns(UserWarning, match="changed the current directory"):
        load_policy("wanders:rule")
    assert os.getcwd() == str(tmp_path)


def test_a_module_that_starts_a_child_at_import_loads_and_its_child_goes(hostile, tmp_path):
    """The probe waits for the module's process, not for the output a child it left holds
    open, and ends that child with it."""
    from dispatcher.policies import probe_policy

    marker = tmp_path / "child.pid"
    (hostile / "spawns.py").write_text(
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "def rule(view):\n    return 1\n")
    probe_policy("spawns:rule", timeout_s=60)  # loads: no "endless loop"
    pid = int(marker.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read():
            break
        import time
        time.sleep(0.1)
    else:
        pytest.fail(f"the child {pid} the module started outlived the probe")


def test_a_module_that_prints_without_end_at_import_is_stopped_at_once(hostile, monkeypatch):
    """The probe keeps what the module prints in a file: past the byte budget the module is
    killed and the load refused by name, long before its timeout (it filled 0.5-0.8 GB/s)."""
    import time

    from dispatcher.sandbox import procs
    from dispatcher.policies import PolicyError, probe_policy

    (hostile / "floods.py").write_text("while True:\n    print('x' * 65536)\n")
    monkeypatch.setattr(procs, "MAX_OUTPUT_BYTES", 4 << 20)
    t0 = time.monotonic()
    with pytest.raises(PolicyError, match="flooded the output: it printed more than 4 MiB"):
        probe_policy("floods:rule", timeout_s=60)
    assert time.monotonic() - t0 < 30


def test_the_verdicts_command_loads_a_file_in_a_child_first(tmp_path):
    engine = tmp_path / "flashinfer.py"
    engine.write_text("import os\nos._exit(0)\n\n\nclass FlashinferDispatcher:\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "dispatcher.commands.verdicts", f"sglang:{engine}"],
                          capture_output=True, text=True, timeout=120, cwd=SOURCE)
    assert done.returncode == 2 and "ended the process" in done.stderr, done.stdout + done.stderr


def test_the_gates_commands_write_nothing_into_the_folder_they_run_from(tmp_path):
    """``a2a-gate verdicts`` (and compat, canary) run from an engine's checkout keep
    Hypothesis's files beside the gate's, never a ``.hypothesis/`` in that checkout."""
    env = dict(os.environ, PYTHONPATH=str(SOURCE))
    done = subprocess.run([sys.executable, "-c", "from dispatcher.commands.runner import keep_hypothesis_home\n"
                           "keep_hypothesis_home()\n"
                           "from strategies.search import minimal\nfrom strategies import worlds\n"
                           "minimal(worlds(), lambda w: w.ep_size > 2, 50)\n"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / ".hypothesis").exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="SGLang's file needs torch")
@pytest.mark.parametrize("body, words", [
    ("        from os import _exit\n        _exit(0)\n", "[rule crashed]"),
    ("        import signal\n        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
     "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        while True:\n"
     "            pass\n", "[slow rule]"),
], ids=["exits", "spins-deaf"])
def test_the_verdicts_command_fails_where_a_files_dispatch_exits_or_hangs(tmp_path, body, words):
    """A file's code runs in a supervised process of the verdict run: a ``dispatch()`` that ends
    the process (``_exit`` imported under its own name, which no guard of ``os._exit`` sees)
    or never returns (SIGALRM blocked, SIGTERM ignored) is an error naming it at the call's
    deadline, never exit 0 and never a hang (it waited out the 4-hour --timeout before)."""
    from dispatcher.sglang import fetch, sources

    release = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release(sources.RELEASES[-1]))
    text = (release / sources.RELEASE_FILE).read_text()
    head = "        is_extend = get_is_extend_in_batch()\n"
    assert head in text
    engine = tmp_path / "flashinfer.py"
    engine.write_text(text.replace(head, body + head, 1))
    from dispatcher.model.generations import ENV, PINNED_RELEASES_GENERATION

    env = dict(os.environ, **{ENV: PINNED_RELEASES_GENERATION})  # whose API 0.5.23 calls
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dispatcher.commands.verdicts", f"sglang:{engine}",
                           "--rule-timeout-s", "0.5"],
                          capture_output=True, text=True, timeout=120, cwd=SOURCE, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert words in done.stdout + done.stderr, done.stdout + done.stderr
    assert "before its tables were printed" in done.stderr, done.stdout + done.stderr
    assert time.monotonic() - t0 < 30


def test_a_replay_stopped_by_sigterm_leaves_no_folder_and_no_process(late, tmp_path):
    """SIGTERM (a CI job cancelled) while the replay runs a rule that never returns: exit 143,
    its report folder removed, the rule's processes gone."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    name = f"spins_{os.getpid()}_{int(time.time() * 1e6)}"  # no other test's process has it
    (late / f"{name}.py").write_text(LATE["spins_deaf"])
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher", "--policy", f"{name}:rule",
                             repr(WORLD)], cwd=SOURCE, env=dict(os.environ, TMPDIR=str(tmp)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not list(tmp.glob("a2a-gate-replay-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # the rule is spinning by now
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, out + err
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert name not in ps
