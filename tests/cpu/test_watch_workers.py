"""The watch's warm test processes: the share of the checks (every test once, the longest spread
first), the first failure ending the run, and a process that dies started again."""
import contextlib
import multiprocessing
import os
import re
import signal
import sys
import threading
import time

import pytest

from dispatcher.commands import watch_process as wp, watch_workers as ww

from .test_watch import CHECKS, GOOD, SAME_ON_EVERY_RANK, WRONG


def test_the_longest_go_first_each_to_the_least_loaded_process():
    durations = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 2.0, "e": 2.0}
    planned = ww.plan(durations, 2)
    assert planned == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}  # loads 9 and 7


def test_a_unit_never_timed_goes_by_its_name_and_a_stale_plan_is_not_trusted():
    assert wp.owner("x::t", {}, 3) == wp.owner("x::t", {}, 3) in range(3)
    assert wp.owner("x::t", {"x::t": 7}, 3) == wp.owner("x::t", {}, 3)  # once run on 8
    assert wp.owner("x::t", {"x::t": 1}, 3) == 1


@pytest.fixture
def rule_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), rest) if p))
    return tmp_path


def test_every_check_runs_once_across_the_processes(rule_folder):
    (rule_folder / "a2a_shared.py").write_text(GOOD)
    said = []
    workers = ww.Workers(2, said.append)
    try:
        assert workers.run("a2a_shared:rule", ["-q", CHECKS]) == 0
        assert said[-1].startswith("5 passed in "), said  # the 5 property tests, each once
        assert re.search(r"the longest: \S*test_sizing_properties.py::test_property\[", said[-1])
        assert "the busiest process: " in said[-1]  # where the run's time went
        assert len({u for u in workers.durations if "test_property" in u}) == 5
        assert len({i for i in workers.timed}) == 2  # both processes ran a share
    finally:
        workers.close()
    assert all(p is None for p in workers.procs)


def test_a_failure_ends_the_run_and_a_save_while_it_shrinks_keeps_the_processes(rule_folder):
    rule = rule_folder / "a2a_shared.py"
    rule.write_text(WRONG)
    said = []
    workers = ww.Workers(2, said.append)
    try:
        assert workers.run("a2a_shared:rule", ["-q", CHECKS]) == 1
        assert "Falsifying example, as found" in said[0] and "PropertyViolation" in said[0]
        assert said[1].startswith("FAILED ") and "test_sizing_properties.py::" in said[1]
        assert "as found" in said[1], said  # the verdict before shrinking
        assert workers.failed  # it goes first next time
        pids = [p.proc.pid for p in workers.procs]
        rule.write_text(GOOD)  # a save while the counterexample may be shrinking: it stops
        said.clear()
        assert workers.run("a2a_shared:rule", ["-q", CHECKS]) == 0  # the stopped ones drained
        assert said[-1].startswith("5 passed in "), said
        assert [p.proc.pid for p in workers.procs] == pids, said  # none killed, none cold
    finally:
        workers.close()
    assert all(p is None for p in workers.procs)


def test_the_counterexample_as_found_is_the_verdict_and_its_shrunk_form_follows(rule_folder):
    (rule_folder / "a2a_shrunk.py").write_text(WRONG)
    said = []
    workers = ww.Workers(1, said.append)
    try:
        assert workers.run("a2a_shrunk:rule", ["-q", SAME_ON_EVERY_RANK]) == 1
        assert "Falsifying example, as found" in said[0] and "PropertyViolation" in said[0]
        assert said[1].startswith("FAILED ") and "as found" in said[1], said
        assert workers.shrinking  # its process goes on: the shrunk form comes while the watch
        workers.finish()  # waits for a save (``late``), or here, at the watch's last run
        assert "PropertyViolation" in said[2] and "as found" not in said[2], said[2:]
        assert said[3].startswith("FAILED ") and "shrunk" in said[3], said[2:]
        assert not workers.shrinking
    finally:
        workers.close()


@pytest.mark.parametrize("when, code, passed", [
    ("pytest_runtest_call", pytest.ExitCode.INTERRUPTED, 0),  # the test under way ends
    ("pytest_collection_finish", pytest.ExitCode.INTERRUPTED, 0),  # no test starts
    ("pytest_sessionfinish", pytest.ExitCode.OK, 2),  # its share done, the session ending
])
def test_the_watchs_stop_ends_a_run_and_never_the_process(pytester, when, code, passed):
    """SIGUSR1 (another process has the verdict) at any point of a test process's session stops
    that run and returns from ``pytest.main``. Raised as Ctrl-C while the session ended, it
    escaped ``pytest.main`` and ended the process: the next run started it cold (seen as the
    test above failing now and then, process 0 replaced)."""
    pytester.makepyfile(test_two="def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    (rx, watch_tx), (watch_rx, tx) = (multiprocessing.Pipe(duplex=False) for _ in range(2))
    shard = wp.Shard(wp.Job(1, "x", (), 0, 1, {}, frozenset(), os.devnull), rx, tx)
    signaller = type("Signaller", (), {when: lambda self: os.kill(os.getpid(), signal.SIGUSR1)})()
    before = signal.signal(signal.SIGUSR1, wp._interrupt)
    wp._IN_RUN.append(shard)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", no_reraise_ctrlc=True,
                                              plugins=[shard, signaller])  # as pytest.main
    except KeyboardInterrupt:
        pytest.fail(f"the watch's stop in {when} escaped pytest.main (the process would end)")
    finally:
        wp._IN_RUN.clear()
        signal.signal(signal.SIGUSR1, before)
        for conn in (rx, watch_tx, watch_rx, tx):
            conn.close()
    assert shard.stopped and result.ret == code
    assert result.parseoutcomes().get("passed", 0) == passed


def _interrupt_at_the_exit_of_hypothesis_context():
    """What a SIGUSR1 raised as Ctrl-C at the entry of ``contextlib``'s ``__exit__`` of
    Hypothesis's build context does (seen in a watch: the next run's pool tests failed the nested
    ``@given`` health check): a trace function raises there, once. Returns what it left."""
    from hypothesis.control import currently_in_test_context

    left = []

    def tracer(frame, event, arg):
        owner = frame.f_locals.get("self") if event == "call" else None
        if (not left and frame.f_code.co_name == "__exit__" and frame.f_code.co_filename ==
                contextlib.__file__ and getattr(getattr(owner, "gen", None), "__name__", "")
                == "with_value" and currently_in_test_context()):
            left.append(owner)
            sys.settrace(None)
            raise KeyboardInterrupt("SIGUSR1 at that instant")
    sys.settrace(tracer)
    return left


def test_a_stop_mid_bookkeeping_waits_and_a_process_left_inside_a_test_is_seen(monkeypatch):
    from hypothesis import given, settings, strategies as st

    @contextlib.contextmanager
    def held():
        yield sys._getframe(1)  # contextlib's frame, as a signal could find it
    with held() as frame:
        pass
    (rx, watch_tx), (watch_rx, tx) = (multiprocessing.Pipe(duplex=False) for _ in range(2))
    shard = wp.Shard(wp.Job(1, "x", (), 0, 1, {}, frozenset(), os.devnull), rx, tx)
    shard.looping, resent = True, threading.Event()
    monkeypatch.setattr(wp, "_signal_self", resent.set)
    monkeypatch.setattr(wp, "_IN_RUN", [shard])
    wp._interrupt(signal.SIGUSR1, frame)  # mid-bookkeeping: no raise, tried again
    assert resent.wait(5) and not shard.stopped
    with pytest.raises(KeyboardInterrupt):
        wp._interrupt(signal.SIGUSR1, sys._getframe())  # in the test's own code: at once
    assert shard.stopped

    @settings(max_examples=3, database=None)
    @given(st.integers())
    def a_test(x):
        pass
    assert not wp._left_inside_a_test()
    left = _interrupt_at_the_exit_of_hypothesis_context()
    try:
        with pytest.raises(KeyboardInterrupt):
            a_test()
    finally:
        sys.settrace(None)
    assert left and wp._left_inside_a_test()  # such a process ends rather than run again
    left[0].__exit__(None, None, None)  # this one restored, as its __exit__ would have
    assert not wp._left_inside_a_test()
    for conn in (rx, watch_tx, watch_rx, tx):
        conn.close()


# a rule that, while ``armed`` exists, says so at its first call and takes a second over it:
# the test process is then surely mid-run, waiting for the policy (a timer was not: a 1 x H100
# host ran the whole run before it fired)
DYING = """import os
import time

from dispatcher.sizing import ideal_rule

_FIRST = [True]


def rule(view):
    if _FIRST and os.path.exists({armed!r}):
        _FIRST.clear()
        open({called!r}, "w").close()
        time.sleep(1)
    return ideal_rule(view)
"""


def _kill_when(path, pid):
    def wait():
        for _ in range(600):
            if path.exists():
                os.killpg(pid, signal.SIGKILL)
                return
            time.sleep(0.05)
    threading.Thread(target=wait, daemon=True).start()


def test_a_process_that_dies_fails_that_run_and_is_started_again(rule_folder):
    armed, called = rule_folder / "armed", rule_folder / "called"
    (rule_folder / "a2a_dying.py").write_text(DYING.format(armed=str(armed), called=str(called)))
    said = []
    workers = ww.Workers(1, said.append)
    args = ["-q", SAME_ON_EVERY_RANK]  # a run of ~1 s: collection, the policy's load, one test
    try:
        first = workers.run("a2a_dying:rule", args)
        assert first == 0, said
        victim = workers.procs[0].proc.pid
        armed.touch()
        _kill_when(called, victim)  # mid-run: while the policy answers its first call
        assert workers.run("a2a_dying:rule", args) == 3
        armed.unlink()
        assert any("test process 0 died during the run" in line for line in said), said
        assert workers.run("a2a_dying:rule", args) == 0
        assert workers.procs[0].proc.pid != victim
    finally:
        workers.close()


def test_a_spare_policy_process_loads_the_file_as_it_reads_when_taken(rule_folder):
    """``supervised.prewarm``: the spare a watch's test process starts after a run has read
    nothing of the policy; the next load takes it (no new process) and reads the saved edit."""
    from dispatcher import supervised
    from dispatcher.model.world import World

    rule = rule_folder / "a2a_spare.py"
    rule.write_text("def rule(view):\n    return 1\n")
    view = World(ep_size=2, dp_size=1, group_tokens=(3,), max_num_tokens=8).rank_view(0)
    try:
        supervised.prewarm("a2a_spare:rule")
        (spare,) = supervised._SPARES.values()
        rule.write_text("def rule(view):\n    return 2\n")  # the save, after the spare started
        policy = supervised.load_supervised("a2a_spare:rule")
        assert policy(view) == 2 and policy._child is spare and not supervised._SPARES
        supervised.forget_all()
        assert spare.proc is None  # the taken spare is the run's process: it goes with the run
    finally:
        supervised.stop_all()
        supervised.forget_all()
