"""Whatever a policy raises or does is a verdict, never a skip or an exit: a rule that calls
``pytest.skip()`` or raises ``SystemExit`` crashes its test with the world; a module that
exits the process or never finishes importing is a usage error saying so (exit 4 in pytest,
2 in the replay command)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from .. import CONFTEST, SOURCE

from dispatcher.model import properties
from dispatcher.model.world import World

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
WORDS = {"exits": "ended the process", "sysexit": "raised SystemExit", "loops": "did not finish within 3 s"}


def _path(monkeypatch, folder):
    """``folder`` importable in child processes, the gate still importable beside it."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(SOURCE), *rest]))


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    for name, body in MODULES.items():
        (tmp_path / f"hostile_{name}.py").write_text(body + "def rule(view):\n    return 1\n")
    _path(monkeypatch, tmp_path)
    monkeypatch.setenv("A2A_GATE_POLICY_LOAD_TIMEOUT_S", "3")
    return tmp_path


def _assert_usage_error(pytester, policy: str, words: str) -> None:
    """``pytest --policy=POLICY`` on a trivial suite is a usage error saying ``words``."""
    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_nothing="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist",
                                           f"--policy={policy}", timeout=120)
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text[-2000:]
    assert words in text and "INTERNALERROR" not in text, text[-2000:]


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_that_exits_or_hangs_is_a_usage_error(pytester, hostile, name):
    _assert_usage_error(pytester, f"hostile_{name}:rule", WORDS[name])


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
    engine.write_text(body)
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


def test_warm_up_calls_do_not_count_against_the_budget():
    budget = properties.RuleBudget(seconds=0.01, warmup=3)
    budget.charge(5.0, "rule")  # a slow first call (an engine constructing itself)
    for _ in range(10):
        budget.charge(0.001, "rule")
    with pytest.raises(properties.SlowRule):
        for _ in range(10):
            budget.charge(0.05, "rule")


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
    assert result.ret == pytest.ExitCode.OK
    assert "left-behind" in result.stderr.str()
