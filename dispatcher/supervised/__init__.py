"""The policy under test runs in a supervised child process, never in the process that decides
the exit status (pytest's, the replay's, a verdict table's).

``load_supervised(spec)`` returns the policy itself for the gate's own rules, and for code the
user named (a rule module, an engine file, release or tree) a ``SupervisedPolicy``: a stand-in
in this process that sends each call to one persistent child, which loaded the policy with
``policies.load_policy`` and runs it under ``model.guard``. This process imports nothing of
the policy's code:

- each answer comes back over a pipe, pickled, and is read with an unpickler that makes only
  the gate's own classes, Python's builtins and torch's (an object of any other class is a
  crash of the policy, named, never imported here);
- a request has a wall-clock deadline (``deadline_s``: twice ``--rule-timeout-s`` plus 1 s, a
  request being every rank of one world), enforced from here with SIGKILL of the child's
  whole process group: blocked signals, a re-armed timer or a C loop cannot outlast it;
- a child that ends without an answer (``os._exit`` bound before the guard, a segfault, a
  kill) fails that call with its exit status and its last output, and the next call starts a
  fresh child;
- what the policy prints goes to a file of this process, bounded like the load probe's
  (``procs.MAX_OUTPUT_BYTES``); its end is shown when the child dies.

Engine policies keep their interface: attributes are read from the child and methods
(``step``, ``refusal``, ``padded_world`` ...) forwarded with their (picklable) arguments, so
the tiers that drive an engine's code run unchanged.
"""
from __future__ import annotations

import atexit
import itertools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..model import properties
from ..model.engine import RemotePolicy
from ..model.generations import active
from ..model.guard import CALL_TIMEOUT
from ..model.world import World
from ..policies import NAMED, PolicyError, runs_foreign_code, load_policy, load_timeout_s
from ..engines import engine_of_spec
from ..sandbox import zygote
from ..sandbox.procs import DROP_CWD, MAX_OUTPUT_BYTES, child_env, die_with_parent, kill_group
from ..sandbox.wire import ForeignObject, _loads, _plain
from .child import _serve

__all__ = ["load_supervised", "prestart", "prewarm", "SupervisedPolicy", "deadline_s", "PolicyProcessLost", "stop_all",
           "forget_all", "forget_forked_by"]

_TAIL = 2000  # characters of the child's last output shown when it dies


def deadline_s(who: str = "") -> float:
    """Seconds one request (every rank of one world, or one engine method) of the policy
    ``who`` may take before the child running it is killed (the child's own timer stops it at
    twice the limit)."""
    return 2 * CALL_TIMEOUT.now_for(who) + 1.0


class PolicyProcessLost(BaseException):
    """The child running the policy ended, was killed at its deadline, or had a call stopped by
    its own timer (``--rule-timeout-s``), without answering.

    A ``BaseException``, as a ``KeyboardInterrupt`` is: Hypothesis does not shrink it (each
    replay would start a fresh process and wait out the deadline again), so the test fails at
    once with the world it was on and its replay line."""


_CHILD = DROP_CWD + """
from dispatcher.supervised.child import _serve
_serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["spare"])
"""


# ---------------------------------------------------------------------------------------------
# The parent


class _Child:
    """One child process that loaded ``spec``, started on first use and again after it died."""

    def __init__(self, spec: str):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self.is_engine = False
        self.methods = set()  # names the policy answers as methods (asked once)
        self.constants = {}  # its labels and flags (str, int, bool, None), read once

    def launch(self, spare: bool = False) -> None:
        """Start the process; it loads the policy while this one goes on (``await_ready``).
        ``spare``: it waits, its imports done, until ``wake`` tells it to load."""
        to_child, from_parent = os.pipe()[::-1]  # (write end, read end)
        from_child, to_parent = os.pipe()
        self.out = tempfile.TemporaryFile()
        args = [str(from_parent), str(to_parent), self.spec, *(["spare"] if spare else [])]
        try:  # forked by the run's zygote where one serves (no interpreter or torch start)
            self.proc = zygote.popen(
                _serve, (zygote.PassedFd(0), zygote.PassedFd(1), self.spec, spare),
                env=child_env(self.spec), stdout=self.out.fileno(), fds=(from_parent, to_parent),
                preload=zygote.WITH_TORCH if engine_of_spec(self.spec) else (),
                argv=["-c", *args])
            if self.proc is None:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, *args],
                    stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT,
                    env=child_env(self.spec), pass_fds=(from_parent, to_parent),
                    start_new_session=True, preexec_fn=die_with_parent)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self.tx = Connection(to_child, readable=False)
        self.rx = Connection(from_child, writable=False)
        self.ready = False

    def wake(self) -> bool:
        """A spare: load the policy now; False where it is gone (a fresh one is needed)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            return False
        try:
            self.tx.send_bytes(pickle.dumps("load"))
        except OSError:
            self.stop()
            return False
        return True

    def await_ready(self) -> None:
        """Wait until the policy has loaded (``load_timeout_s()`` at most); a ``PolicyError``
        saying why where it did not."""
        if self.proc is None:
            self.launch()
        if self.ready:
            return
        seconds = load_timeout_s()
        try:
            status, payload = self._receive(seconds, "loading it")
        except _Died as exc:
            raise PolicyError(f"--policy {self.spec}: loading it ended the process (exit code "
                              f"{exc.code}) before it finished: the module exits at import "
                              f"(os._exit, sys.exit) or crashed: {exc.tail[-300:]}") from None
        except _Timeout:
            raise PolicyError(f"--policy {self.spec}: loading it did not finish within "
                              f"{seconds:.0f} s (an endless loop at import?)") from None
        except _Flood as exc:
            raise PolicyError(f"--policy {self.spec}: loading it flooded the output: {exc}"
                              ) from None
        if status == "load-error":
            self.stop()
            raise PolicyError(payload)
        self.is_engine, self.ready = payload, True

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for conn in (self.tx, self.rx):
            conn.close()
        kill_group(proc)

    def tail(self) -> str:
        size = self.out.seek(0, 2)
        self.out.seek(max(0, size - _TAIL))
        text = self.out.read().decode("utf-8", "replace").strip()
        return text or "(nothing printed)"

    def request(self, op: str, *args, what: str = "a call"):
        self.await_ready()
        message = (op, active().version, CALL_TIMEOUT.now_for(self.spec),
                   properties.RULE_BUDGET.seconds, args)
        try:
            self.tx.send_bytes(pickle.dumps(message))
        except OSError:  # the child closed its end (or died): it is reported below
            pass
        status, payload = self._receive(deadline_s(self.spec), what)
        if status == "raise":
            raise payload
        if status == "hung":  # its timer stopped a call: its later calls get the short limit
            CALL_TIMEOUT.trip(self.spec)
            raise _Hung(payload)
        return payload

    def _receive(self, seconds: float, what: str):
        deadline = time.monotonic() + seconds
        while True:
            if self.rx.poll(0.05):
                try:
                    return _loads(self.rx.recv_bytes())
                except (EOFError, OSError):
                    break
                except ForeignObject as exc:  # cannot happen: the child checks its answers
                    self.stop()
                    raise PolicyProcessLost(f"[rule crashed] {self.spec}: its process sent "
                                            f"{exc}") from None
            if self.proc.poll() is not None:
                break
            if os.fstat(self.out.fileno()).st_size > MAX_OUTPUT_BYTES:
                self.stop()
                raise _Flood(f"it printed more than {MAX_OUTPUT_BYTES >> 20} MiB during {what} "
                             f"and was stopped")
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                CALL_TIMEOUT.trip(self.spec)
                raise _Timeout(seconds, what, tail)
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = self.tail()
        self.stop()
        raise _Died(code, what, tail)


class _Flood(Exception):
    pass


class _Died(Exception):
    def __init__(self, code, what, tail):
        super().__init__(code, what, tail)
        self.code, self.what, self.tail = code, what, tail

    def words(self) -> str:
        how = ("was killed" if self.code is None else
               f"was killed by signal {signal.Signals(-self.code).name}" if self.code < 0 else
               f"exited with status {self.code}")
        return (f"the process running the policy {how} during {self.what}, without "
                f"answering; its last output:\n    " + self.tail.replace("\n", "\n    "))


class _Hung(Exception):
    """A call the child's own timer stopped (``CallTimedOut``): the child lives on."""


class _Timeout(Exception):
    def __init__(self, seconds, what, tail):
        super().__init__(seconds, what, tail)
        self.seconds, self.what, self.tail = seconds, what, tail


_LIVE = []
_KEYS = itertools.count()


_SPARES: dict = {}  # _where(spec) -> a spare child (``prewarm``): imports done, nothing loaded


@atexit.register
def stop_all() -> None:
    """Kill every policy process this process started (at exit, and before a fast exit)."""
    for child in [*_LIVE, *_SPARES.values()]:
        child.stop()
    _SPARES.clear()


def prewarm(spec: str) -> None:
    """Start a spare process for ``spec`` (a watch's test process does, after each run): the
    next load of ``spec`` takes it and skips the interpreter's and torch's start. It reads
    nothing of the policy until then, so what it then loads is the files as they are."""
    if spec in NAMED or not runs_foreign_code(spec):
        return
    key = _where(spec)
    if key not in _SPARES:
        child = _Child(spec)
        child.launch(spare=True)
        _SPARES[key] = child


def forget_forked_by(folder: str) -> None:
    """Stop and forget the policy processes forked by the zygote of ``folder`` (it is being
    stopped: a nested run's own), so no later load takes one of them."""
    gone = [c for c in [*_LIVE, *_SPARES.values()] if getattr(c.proc, "folder", None) == folder]
    for child in gone:
        child.stop()
    _LIVE[:] = [c for c in _LIVE if c not in gone]
    for table in (_SPARES, _BY_SPEC):
        for key in [k for k, v in table.items() if getattr(v, "_child", v) in gone]:
            del table[key]


def forget_all() -> None:
    """Kill every policy process and forget them: the next load starts a fresh one (a watch's
    next run, after an edit of the policy's files), or takes a spare (``prewarm``), which
    has loaded nothing yet and is kept."""
    for child in _LIVE:
        child.stop()
    _LIVE.clear()
    _BY_SPEC.clear()


class SupervisedPolicy(RemotePolicy):
    """The policy named by ``spec``, run in a supervised child (see the module's text)."""

    def __init__(self, spec: str, child: Optional[_Child] = None, key=None,
                 world: Optional[World] = None, wait: bool = True):
        if child is None:
            child = _SPARES.pop(_where(spec), None)
            if child is None or not child.wake():
                child = _Child(spec)
                child.launch()
            _LIVE.append(child)
            if wait:  # a spec that does not load fails here, as load_policy would
                child.await_ready()
        self._child, self._key, self._world = child, key, world
        self.spec_text = spec

    def wait_loaded(self) -> None:
        """Return once the policy has loaded in its process; a ``PolicyError`` saying why not."""
        self._child.await_ready()

    # the checks' entry points

    @property
    def is_engine(self) -> bool:
        return self._child.is_engine

    def rule_values(self, world: World, name: str):
        name = name or self.spec_text
        try:
            return self._child.request("rule_values", self._key, world, name,
                                       what="a call on this world")
        except _Hung as exc:  # the message already shows the world
            raise PolicyProcessLost(str(exc)) from None
        except (_Died, _Timeout, _Flood) as exc:
            raise _lost(exc, name, properties.explain(world, ["<no answer>"], name)) from None

    def bind(self, *args, **kwargs) -> "SupervisedPolicy":
        key = next(_KEYS)
        self._call_raw("bind", key, args, kwargs, what="binding it to a world")
        world = next((a for a in args if isinstance(a, World)), None)
        return SupervisedPolicy(self.spec_text, self._child, key, world)

    # everything else an engine's tiers ask of it

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self._key is not None:
            raise AttributeError(name)
        methods = self._child.methods
        if name in self._child.constants:
            return self._child.constants[name]
        if name not in methods:
            kind = self._call_raw("getattr", name, what=f"reading its {name!r}")
            if kind[0] == "value":
                if _plain(kind[1]) and type(kind[1]) is not list:  # a label, a flag: kept
                    self._child.constants[name] = kind[1]
                return kind[1]
            methods.add(name)
        return lambda *args, **kwargs: self._call_raw("call", None, name, args, kwargs,
                                                      what=f"its {name}()")

    def __call__(self, *args, **kwargs):
        return self._call_raw("call", self._key, "", args, kwargs, what="a call")

    def _call_raw(self, op, *args, what: str):
        try:
            return self._child.request(op, *args, what=what)
        except (_Died, _Timeout, _Flood, _Hung) as exc:
            raise _lost(exc, self.spec_text, _world_text(args)) from None

    def __repr__(self):
        return f"{self.spec_text} (in a supervised process)"


def _lost(exc: Exception, name: str, where: str) -> PolicyProcessLost:
    """The failure of a call whose process died, hung or flooded, in words."""
    if isinstance(exc, _Timeout):
        text = (f"[slow rule] {name} did not answer within {exc.seconds:g} s during {exc.what} "
                f"(--rule-timeout-s, enforced by killing its process); its last output:\n    "
                + exc.tail.replace("\n", "\n    "))
    elif isinstance(exc, _Hung):
        text = str(exc)
    elif isinstance(exc, _Died):
        text = f"[rule crashed] {name}: {exc.words()}"
    else:
        text = f"[rule crashed] {name}: {exc}"
    return PolicyProcessLost(f"{text}\n{where.lstrip(chr(10))}")


def _world_text(args) -> str:
    flat = [a for arg in args for a in (arg if isinstance(arg, tuple) else (arg,))]
    world = next((a for a in flat if isinstance(a, World)), None)
    return f"world:\n{world.describe()}" if world is not None else ""


def load_supervised(spec: str):
    """The policy ``spec`` names: the gate's own rules as themselves, anything else (code the
    user named) as a ``SupervisedPolicy``; a ``PolicyError`` where it does not load."""
    if spec in NAMED or not runs_foreign_code(spec):
        return load_policy(spec)[1]
    key = _where(spec)
    if key not in _BY_SPEC:  # one process per spec and test process, shared by its fixtures
        _BY_SPEC[key] = SupervisedPolicy(spec)
    policy = _BY_SPEC[key]
    policy.wait_loaded()  # started early (``prestart``): loaded by now, or why not
    return policy


def prestart(spec: str) -> Optional[SupervisedPolicy]:
    """Start loading ``spec`` in its process now, in the background (a test process does it at
    start-up, beside collection); ``None`` for the gate's own rules, which need none."""
    if spec in NAMED or not runs_foreign_code(spec):
        return None
    key = _where(spec)
    if key not in _BY_SPEC:
        _BY_SPEC[key] = SupervisedPolicy(spec, wait=False)
    return _BY_SPEC[key]


def _where(spec: str):
    """What decides which code ``spec`` loads: the spec, the path it is found on, the folder
    it is run from, and the switches the engines' loaders read."""
    from ..releases.companions import NEWEST_ENV

    return spec, child_env(spec)["PYTHONPATH"], os.getcwd(), os.environ.get(NEWEST_ENV)


_BY_SPEC: dict = {}
