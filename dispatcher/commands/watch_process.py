"""A warm test process of ``a2a-gate watch`` (``watch_workers``): started once, it runs one
``Job`` after another, each a pytest session of its share of the policy's checks (``Shard``),
and between runs starts afresh the costly resources its share took (``gpu.warm``: a rank pool,
the single-GPU driver), no policy code run in them. Its messages to the watch: ``up``; per run
``found`` (a Hypothesis test's first failing example, as found, before shrinking), ``failed``
(each failure, as pytest prints it, at once), ``tick`` (a test finished) and ``done`` (exit
status, durations, counts); it stops after its current test on ``stop``, and
ends on ``None``, a closed pipe or SIGTERM (a run then unwinds as on Ctrl-C)."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Dict, FrozenSet, Tuple

import pytest

__all__ = ["Job", "Shard", "unit_of", "owner", "serve"]


@dataclass(frozen=True)
class Job:
    """One run of one process's share of the checks."""
    run: int
    spec: str
    args: Tuple[str, ...]
    index: int
    count: int
    plan: Dict[str, int]  # unit -> the process that runs it (a unit not here: by its hash)
    first: FrozenSet[str]  # tests that failed in an earlier run: they go first
    log: str  # where this run's pytest output goes


def unit_of(item) -> str:
    """What goes to one process as a whole: an xdist group (``@name``), else the test."""
    from ..gpu.warm import group_name

    group = group_name(item)
    return "@" + group if group else item.nodeid


def owner(unit: str, planned: Dict[str, int], count: int) -> int:
    where = planned.get(unit)
    return where if where is not None and 0 <= where < count else zlib.crc32(unit.encode()) % count


def _text(report) -> str:
    """A failure as pytest's terminal prints it: its header, the traceback and its sections."""
    head = getattr(report, "head_line", None) or report.nodeid
    parts = [f"{'_' * 20} {head} {'_' * 20}", report.longreprtext]
    parts += [f"{'-' * 20} {title} {'-' * 20}\n{content}" for title, content in report.sections]
    return "\n".join(parts)


class Shard:
    """The plugin of one process's run: keep its share, report as it goes, stop when told."""

    def __init__(self, job: Job, rx: Connection, tx: Connection):
        self.job, self.rx, self.tx = job, rx, tx
        self.units: Dict[str, str] = {}
        self.durations: Dict[str, float] = {}
        self.counts: Counter = Counter()
        self.stopped = False
        self.session = None
        self.looping = False  # in pytest_runtestloop: Ctrl-C there ends the session cleanly
        self.item = None  # the test under way
        self.found_in: set = set()  # tests whose first failing example was sent

    def pytest_sessionstart(self, session):
        self.session = session

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session):
        self.looping = True
        try:
            return (yield)
        finally:
            self.looping = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.stopped:  # told before its loop began: run nothing, the session stops
            return True
        self.item = item
        return None

    def found(self, exc: BaseException, args, kwargs) -> None:
        """The first failing example of the test under way, as Hypothesis found it: sent at once
        (``found``), before Hypothesis shrinks it; the shrunk one follows as ``failed``. Not for
        a test expected to fail (xfail), where a failing example is no verdict."""
        item = self.item
        if item is None or item.nodeid in self.found_in or item.get_closest_marker("xfail"):
            return
        self.found_in.add(item.nodeid)
        self.tx.send(("found", self.job.run, item.nodeid, _found_text(item, exc, args, kwargs)))

    def stop(self) -> None:
        """End this run: within the test loop at once, as Ctrl-C would (the test under way
        tears down, the session ends INTERRUPTED); elsewhere (pytest configuring, collecting,
        or ending its session, where a KeyboardInterrupt would escape ``pytest.main`` and end
        the process) no further test runs."""
        if self.looping:
            self.stopped = True
            raise KeyboardInterrupt("stopped by the watch: another test process has the verdict")
        self._stop_after_this_test()

    def _stop_after_this_test(self) -> None:
        self.stopped = True
        if self.session is not None:
            self.session.shouldstop = "another test process found a counterexample"

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, config, items):
        result = yield  # after the suite's own selection (the policy's checks, -k, ...)
        job, mine, others = self.job, [], []
        for item in items:
            (mine if owner(unit_of(item), job.plan, job.count) == job.index else others
             ).append(item)
        if others:
            config.hook.pytest_deselected(items=others)
        mine.sort(key=lambda it: it.nodeid not in job.first)  # stable: the order kept otherwise
        items[:] = mine
        for item in mine:
            _send_first_failure(item)
        self.units = {item.nodeid: unit_of(item) for item in mine}
        return result

    def pytest_runtest_logreport(self, report):
        unit = self.units.get(report.nodeid, report.nodeid)
        self.durations[unit] = self.durations.get(unit, 0.0) + report.duration
        if report.when == "call":
            self.counts[report.outcome] += 1
        elif report.skipped:
            self.counts["skipped"] += 1
        elif report.failed:
            self.counts["error"] += 1
        if report.failed:
            self.tx.send(("failed", self.job.run, report.nodeid, _text(report)))

    def pytest_runtest_logfinish(self, nodeid, location):
        self.tx.send(("tick", self.job.run))  # alive and moving (``STALL_S``)
        while self.rx.poll(0):  # the watch: another process has the verdict
            if self.rx.recv() == "stop":
                self._stop_after_this_test()


def _send_first_failure(item) -> None:
    """Wrap the Hypothesis test of ``item`` (once per function, kept across runs) so that its
    first failing example reaches the watch when found (``Shard.found``), not after shrinking.
    ``hypothesis.inner_test`` is Hypothesis's place to wrap the test it calls (as pytest-trio
    does); the wrapper re-raises all it sees, so Hypothesis decides as it would unwrapped."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    inner = getattr(handle, "inner_test", None)
    if inner is None or getattr(inner, "_a2a_watch_sends", False):
        return

    @functools.wraps(inner)
    def test(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except BaseException as exc:
            if _IN_RUN and _fails_the_test(exc):
                _IN_RUN[0].found(exc, args, kwargs)
            raise
    test._a2a_watch_sends = True
    handle.inner_test = test


def _fails_the_test(exc: BaseException) -> bool:
    """What Hypothesis counts as a failing example (``failure_exceptions_to_catch``), less its
    own control exceptions (``reject()``, ``assume()``: ``HypothesisException``); pytest's
    skips and Ctrl-C are ``BaseException``s that fail no example."""
    from hypothesis.errors import HypothesisException

    return (isinstance(exc, (Exception, SystemExit, pytest.fail.Exception))
            and not isinstance(exc, HypothesisException))


def _found_text(item, exc: BaseException, args, kwargs, width: int = 300) -> str:
    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= width else text[:width] + "..."
    call = ", ".join([*map(short, args), *(f"{k}={short(v)}" for k, v in kwargs.items())])
    where = "".join(traceback.format_exception(exc, limit=-3)).rstrip()  # where it failed
    return "\n".join([f"{'_' * 20} {item.name} {'_' * 20}",
                      f"Falsifying example, as found (before shrinking): "
                      f"{getattr(item, 'originalname', item.name)}({call})", where])


# ---------------------------------------------------------------------------------------------
# A test process


def _run_job(job: Job, rx: Connection, tx: Connection):
    from .. import supervised
    from ..gpu import warm
    from ..model.guard import CALL_TIMEOUT
    from .runner import suite_args

    shard = Shard(job, rx, tx)
    supervised.forget_all()  # no process loaded from an earlier state answers
    CALL_TIMEOUT.tripped_by.clear()  # an edit that ends a hang gets the whole limit again
    warm.TAKEN.clear()
    fd = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    saved = [os.dup(1), os.dup(2)]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)
    os.close(fd)
    try:
        # a second session in one process finds Hypothesis imported: pytest says it cannot
        # rewrite its asserts again, which the suite never needs (its own modules are rewritten)
        _IN_RUN.append(shard)
        try:
            code = int(pytest.main(suite_args(args=[
                *job.args, f"--policy={job.spec}", "-x", "-n", "0", "-p", "no:cacheprovider",
                "-W", "ignore::pytest.PytestAssertRewriteWarning"]), plugins=[shard]))
        finally:
            _IN_RUN.clear()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for f in saved:
            os.close(f)
        supervised.forget_all()
    return code, shard.durations, dict(shard.counts), shard.stopped


def _prepare_next(taken) -> None:
    """Start afresh, in the background, what this run took, for the next run to take."""
    from ..gpu import warm
    from ..policies import load_policy  # how a pool's ranks load the --policy spec

    for name in taken:
        warm.start(name, resolve=load_policy)


_IN_RUN: list = []  # the run's Shard while pytest runs it


RETRY_S = 0.005  # a stop that came mid-bookkeeping is tried again after this


def _interrupt(signum, frame) -> None:
    """SIGUSR1 from the watch (another process has the verdict): the run under way stops
    (``Shard.stop``); the process stays for the next run. Not while Hypothesis's or a context
    manager's own code runs (``_mid_bookkeeping``): the stop is tried again a moment later."""
    if not _IN_RUN:
        return
    if _IN_RUN[0].looping and _mid_bookkeeping(frame):
        threading.Timer(RETRY_S, _signal_self).start()
        return
    _IN_RUN[0].stop()


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def _mid_bookkeeping(frame) -> bool:
    """A Ctrl-C raised in this frame could skip the restore of a context: a KeyboardInterrupt
    at the entry of ``contextlib``'s ``__exit__`` of Hypothesis's build context left the
    process "inside a @given test", and its next run failed its pool tests with the nested
    ``@given`` health check (a false alarm of the unmodified SGLang file)."""
    import contextlib

    import hypothesis

    name = frame.f_code.co_filename if frame is not None else ""
    return (name == contextlib.__file__
            or name.startswith(os.path.dirname(hypothesis.__file__) + os.sep))


def _left_inside_a_test() -> bool:
    """Hypothesis still sees a test under way after the run ended: what no stop may leave
    (``_mid_bookkeeping``); a process so left ends rather than run the next run."""
    from hypothesis.control import currently_in_test_context

    return currently_in_test_context()


def serve(fd_in: int, fd_out: int) -> None:
    """A test process's loop: a ``Job`` in, its messages out, until the pipe closes or ``None``
    comes; SIGTERM ends a run as Ctrl-C would (its fixtures tear down), then the process."""
    rx, tx = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    closing = []

    def terminate(signum, frame):
        closing.append(signum)
        raise KeyboardInterrupt("SIGTERM")
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGUSR1, _interrupt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the watch's: it asks us to stop
    try:
        import hypothesis  # noqa: F401 - warm before the first run asks for it
        tx.send(("up", os.getpid()))
        while not closing:
            job = rx.recv()
            if job is None:
                break
            if not isinstance(job, Job):  # a "stop" that came after this run had ended
                continue
            code, durations, counts, stopped = _run_job(job, rx, tx)
            from ..gpu import warm

            taken = set(warm.TAKEN)
            tx.send(("done", job.run, code, durations, counts, stopped))
            if _left_inside_a_test():
                print("watch's test process: Hypothesis's test context was left set by the "
                      "stopped run; this process ends, the next run starts another", flush=True)
                break
            if not closing:
                _prepare_next(taken)
                from .. import supervised

                supervised.prewarm(job.spec)  # the next run's policy process, nothing loaded
    except (KeyboardInterrupt, EOFError, OSError):
        pass
    finally:
        _end()


def _end() -> None:
    """Close what was started for a next run and the policy's processes, then exit at once
    (no heap teardown, no ``atexit`` handler a policy registered)."""
    try:
        if "dispatcher.gpu.warm" in sys.modules:
            sys.modules["dispatcher.gpu.warm"].close_unused()
        if "dispatcher.supervised" in sys.modules:
            sys.modules["dispatcher.supervised"].stop_all()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)


if __name__ == "__main__":  # run as a script: the messages' classes are the module's own
    from dispatcher.commands.watch_process import serve as _serve

    _serve(int(sys.argv[1]), int(sys.argv[2]))
