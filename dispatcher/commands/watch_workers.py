"""The warm test processes of ``a2a-gate watch``: ``count`` pytest processes started once, each
running its share of the policy's checks on every run (``Shard``). A run pays no interpreter,
torch, Hypothesis or suite import, and the checks run side by side as under ``pytest -n auto``.

- **The share.** Each test goes to one process; the tests of one xdist group (a rank pool's,
  the single-GPU tier's) go together. The longest go first, each to the least loaded process,
  timed by the last run each ran in. A test never timed goes by a hash of its name. Tests that
  failed in an earlier run of this watch go first in their process.
- **The first failure.** The first failure any process reports is printed at once and is the
  run's verdict: a Hypothesis test's first failing example as found, else the failure as pytest
  prints it. The other processes are interrupted in their current test (SIGUSR1: as Ctrl-C
  would, its fixtures torn down). One that has not finished within ``DRAIN_S`` is killed and
  started again. The finder goes on to shrink its example; the shrunk counterexample is printed
  when it comes, while the watch waits for the next save (``late``). A save before then stops
  the shrink: the run of the new state does not wait for it.
- **Between runs.** Each process starts afresh, in the background, the costly resources its
  share took (a rank pool, the single-GPU driver: ``gpu.warm``). No policy code has run in them
  when the next run takes them: a rank loads the policy at its first world.
- **The policy never runs here.** It runs in its supervised process, started fresh in every run
  (``supervised.forget_all``), or in the ranks of a pool started for that run.
"""
from __future__ import annotations

import heapq
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable, Dict, List, Optional

from ..sandbox.procs import (child_env, die_with_parent, keep_cwd_off_children_paths, kill_group,
                             python_child)
from .watch_process import Job

__all__ = ["Workers", "plan", "DRAIN_S", "STALL_S"]

DRAIN_S = 60.0  # a process told to stop that is still in its test after this is killed
START_S = 120.0  # a process that has not said it is up within this is killed
CLOSE_S = 10.0  # a process asked to end that has not, after this, is killed
STALL_S = 900.0  # a process in a run that finishes no test for this long is killed (each test's
# calls into the policy have their own deadlines: this bounds what nothing else does)


def plan(durations: Dict[str, float], count: int) -> Dict[str, int]:
    """Longest first, each to the least loaded process (ties: the lower index)."""
    loads = [(0.0, i) for i in range(count)]
    out = {}
    for unit, seconds in sorted(durations.items(), key=lambda kv: (-kv[1], kv[0])):
        load, i = heapq.heappop(loads)
        out[unit] = i
        heapq.heappush(loads, (load + seconds, i))
    return out


# ---------------------------------------------------------------------------------------------
# The watch's side


@dataclass
class _Proc:
    proc: subprocess.Popen
    tx: Connection
    rx: Connection
    out: str  # its own output (not a run's): shown where it dies
    up: bool = False
    busy: Optional[int] = None  # the run it is in
    told_stop: float = 0.0  # when it was told to stop (0: not told)
    heard: float = 0.0  # when it last said something

    def tail(self, chars: int = 1500) -> str:
        try:
            with open(self.out, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - chars))
                return f.read().decode("utf-8", "replace").strip() or "(nothing printed)"
        except OSError:
            return "(no output)"


@dataclass
class Workers:
    """``count`` warm test processes and what they learned (durations, failed tests)."""
    count: int
    say: Callable[[str], None] = print
    durations: Dict[str, float] = field(default_factory=dict)
    failed: set = field(default_factory=set)
    runs: int = 0
    shrinking: Dict[int, tuple] = field(default_factory=dict)  # process -> (run, test, since)
    timed: Dict[int, Dict[str, float]] = field(default_factory=dict)  # this run: process -> unit -> s

    def __post_init__(self):
        self.folder = tempfile.mkdtemp(prefix="a2a-gate-watch-")
        self.procs: List[Optional[_Proc]] = [None] * self.count
        self._root = None  # the zygote of every run (sandbox.zygote), once started
        self.started = 0  # processes started, restarts included

    # processes

    def _launch(self, i: int) -> _Proc:
        to_child, from_parent = os.pipe()[::-1]
        from_child, to_parent = os.pipe()
        out = os.path.join(self.folder, f"process{i}-{self.started}.out")
        self.started += 1
        with open(out, "wb") as sink:
            try:
                proc = subprocess.Popen(
                    python_child("dispatcher.commands.watch_process", str(from_parent), str(to_parent)),
                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                    env=child_env(self._spec), pass_fds=(from_parent, to_parent),
                    start_new_session=True, preexec_fn=die_with_parent)
            finally:
                os.close(from_parent)
                os.close(to_parent)
        return _Proc(proc, Connection(to_child, readable=False),
                     Connection(from_child, writable=False), out)

    def start(self, spec: str) -> None:
        """Start every process not running (the first run, or after one died or was killed);
        first of all, the zygote their policy processes and pools' ranks are forked from."""
        self._spec = spec
        if self._root is None:
            from ..sandbox import zygote

            keep_cwd_off_children_paths(spec)  # as each test process's session will
            self._root = zygote.start_root(child_env(spec)) or False
        for i, p in enumerate(self.procs):
            if p is None or p.proc.poll() is not None:
                self.procs[i] = self._launch(i)

    def _kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            for conn in (p.tx, p.rx):
                conn.close()
            kill_group(p.proc)
        self.procs[i] = None

    def close(self) -> None:
        """Ask each process to end (its resources closed), kill the ones that do not."""
        for p in filter(None, self.procs):
            try:
                if p.busy is None:
                    p.tx.send(None)
                else:
                    os.killpg(p.proc.pid, signal.SIGTERM)  # its run unwinds, as on Ctrl-C
            except (OSError, ProcessLookupError):
                pass
        end = time.monotonic() + CLOSE_S
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    p.proc.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                self._kill(i)
        if self._root:
            self._root.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    # runs

    def _messages(self, timeout: float):
        """(index, message) for each process that has one within ``timeout``; (index, None)
        for a process that died."""
        live = {p.rx: i for i, p in enumerate(self.procs) if p is not None}
        for conn in wait(list(live), timeout=timeout):
            i = live[conn]
            try:
                yield i, conn.recv()
            except (EOFError, OSError):
                yield i, None
        for i, p in enumerate(self.procs):
            if p is not None and p.proc.poll() is not None and not p.rx.poll(0):
                yield i, None

    def _drain(self) -> None:
        """Wait for the processes still in a stopped run; kill one that takes too long."""
        while any(p is not None and p.busy is not None for p in self.procs):
            for i, msg in self._messages(0.1):
                self._absorb(i, msg, current=None)
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                if p is not None and p.busy is not None and now - p.told_stop > DRAIN_S:
                    self.say(f"watch: test process {i} did not stop within {DRAIN_S:g} s of "
                             f"being told: killed, started again")
                    self._kill(i)

    def _absorb(self, i: int, msg, current: Optional[int]):
        """Take one message of process ``i``; what it means for run ``current``."""
        p = self.procs[i]
        if p is not None:
            p.heard = time.monotonic()
        if msg is None:
            tail = p.tail() if p is not None else ""
            self._kill(i)
            return ("died", tail)
        kind = msg[0]
        if kind == "up":
            p.up = True
            return None
        if kind in ("found", "failed"):
            _, run, nodeid, text = msg
            self.failed.add(nodeid)
            shrunk = self.shrinking.get(i, (None, None))[:2] == (run, nodeid)
            if kind == "found" and run == current:
                self.shrinking[i] = (run, nodeid, time.monotonic())
            if shrunk and kind == "failed":
                return ("shrunk", nodeid, text, self.shrinking.pop(i)[2])
            return (kind, nodeid, text) if run == current else None
        if kind == "done":
            _, run, code, durations, counts, stopped = msg
            p.busy, p.told_stop = None, 0.0
            self.durations.update(durations)
            if run == current:
                self.timed[i] = dict(durations)
            unshrunk = self.shrinking.pop(i, None)
            if unshrunk is not None and code == 0 and not stopped:
                return ("passed after all", unshrunk[1])
            return ("done", code, counts, stopped) if run == current else None
        return None

    def _tell_stop(self, j: int) -> None:
        """Process ``j`` ends its run: after its current test (``stop``), and that test at once
        (SIGUSR1: as Ctrl-C would)."""
        q = self.procs[j]
        try:
            q.tx.send("stop")
            os.kill(q.proc.pid, signal.SIGUSR1)
        except (OSError, ProcessLookupError):
            pass
        q.told_stop = time.monotonic()

    def late(self, wait: float = 0.0) -> None:
        """While the watch waits for a save: the last run's counterexample shrunk, once its
        process has it (or what became of that process)."""
        if not self.shrinking:
            return
        for i, msg in self._messages(wait):
            event = self._absorb(i, msg, current=None)
            if event is None:
                continue
            if event[0] == "shrunk":
                _, nodeid, text, since = event
                self.say(text)
                self.say(f"FAILED {nodeid} (run {self.runs}: the counterexample above shrunk, "
                         f"in {time.monotonic() - since:.1f} s more)")
            elif event[0] == "passed after all":  # Hypothesis reports a flaky failure as one
                self.say(f"watch: {event[1]} passed when run to its end, its failing example "
                         f"above did not fail again: run {self.runs}'s verdict is of one call")
            elif event[0] == "died" and self.shrinking.pop(i, None) is not None:
                self.say(f"watch: test process {i} died while shrinking the counterexample; "
                         f"its last output:\n{event[1]}\nstarted again for the next run")

    def finish(self, timeout: float = DRAIN_S) -> None:
        """The watch ends (its last run): wait for the counterexample's shrink, printed."""
        end = time.monotonic() + timeout
        while self.shrinking and time.monotonic() < end:
            self.late(wait=0.1)

    def run(self, spec: str, args) -> int:
        """One run of the checks of ``spec`` across the processes: 1 at the first failure
        (printed at once; the others told to stop), else the runs' combined exit status."""
        for j, q in enumerate(self.procs):  # a shrink of the last run's counterexample
            if q is not None and q.busy is not None and not q.told_stop:
                self._tell_stop(j)
        self.shrinking.clear()
        self._drain()
        self.start(spec)
        self.runs += 1
        self.timed = {}
        run, planned, first = self.runs, plan(self.durations, self.count), frozenset(self.failed)
        t0 = time.monotonic()
        for i, p in enumerate(self.procs):
            p.busy, p.heard = run, t0
            p.tx.send(Job(run, spec, tuple(args), i, self.count, planned, first,
                          os.path.join(self.folder, f"run{i}.log")))
        codes: Dict[int, int] = {}
        counts: Counter = Counter()
        while len(codes) < self.count:
            deadline = [p for p in self.procs if p is not None and not p.up]
            if deadline and time.monotonic() - t0 > START_S:
                for i, p in enumerate(self.procs):
                    if p is not None and not p.up:
                        self.say(f"watch: test process {i} did not start within {START_S:g} "
                                 f"s:\n{p.tail()}")
                        self._kill(i)
                        codes[i] = 3
            for i, p in enumerate(self.procs):
                if p is not None and i not in codes and time.monotonic() - p.heard > STALL_S:
                    self.say(f"watch: test process {i} finished no test in {STALL_S:g} s: "
                             f"killed, started again for the next run")
                    self._kill(i)
                    codes[i] = 3
            for i, msg in self._messages(0.1):
                event = self._absorb(i, msg, run)
                if event is None:
                    continue
                if event[0] in ("found", "failed"):
                    self.say(event[2])
                    for j, q in enumerate(self.procs):
                        if q is not None and q.busy == run and j != i:
                            self._tell_stop(j)
                    if event[0] == "failed":  # the finder ends its run too (-x)
                        self.procs[i].told_stop = time.monotonic()
                        self.say(f"FAILED {event[1]} (the first counterexample, in "
                                 f"{time.monotonic() - t0:.1f} s; the other test processes "
                                 f"stop)")
                    else:
                        self.say(f"FAILED {event[1]} (the first failing example, as found, in "
                                 f"{time.monotonic() - t0:.1f} s; the other test processes "
                                 f"stop; this one shrinks it)")
                    return 1
                if event[0] == "died":
                    if i in codes:  # it ended after its share (``_left_inside_a_test``)
                        continue
                    self.say(f"watch: test process {i} died during the run; its last "
                             f"output:\n{event[1]}\nstarted again for the next run")
                    codes[i] = 3
                    continue
                _, code, got, _ = event
                codes[i] = code
                counts.update(got)
                if code not in (0, 1, 5):  # a usage error, a collection error: pytest's words
                    self._show_log(i, code)
        return self._verdict(codes, counts, time.monotonic() - t0)

    def _critical(self) -> str:
        """Where the run's time went: its longest unit (a test, or an xdist group's tests as
        a whole) and its busiest process (the tests it ran, summed)."""
        units = {u: t for got in self.timed.values() for u, t in got.items()}
        if not units:
            return ""
        longest = max(units, key=units.get)
        busiest = max(self.timed, key=lambda i: sum(self.timed[i].values()))
        return (f"; the longest: {longest} {units[longest]:.1f} s; the busiest process: "
                f"{sum(self.timed[busiest].values()):.1f} s of tests")

    def _show_log(self, i: int, code: int) -> None:
        try:
            with open(os.path.join(self.folder, f"run{i}.log"), encoding="utf-8",
                      errors="replace") as f:
                text = f.read()
        except OSError:
            text = "(no output)"
        self.say(f"watch: test process {i} ended its run with exit {code}:\n{text[-4000:]}")

    def _verdict(self, codes: Dict[int, int], counts: Counter, took: float) -> int:
        bad = sorted({c for c in codes.values() if c not in (0, 5)})
        words = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"
        self.say(f"{words} in {took:.1f} s ({self.count} warm test processes{self._critical()})")
        if bad:
            return 1 if 1 in bad else bad[0]
        return 5 if codes and all(c == 5 for c in codes.values()) else 0
