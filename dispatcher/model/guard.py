"""Every call into the policy under test is bounded: it cannot end the process and it cannot run
forever. ``guarded()`` is entered around each call (``properties.rule_values``):

- ``os._exit`` (and ``posix._exit``) raise ``PolicyExited`` instead of ending the process, so
  ``os._exit(0)`` inside a rule is a crash with the world, never a silent exit 0;
- a process forked inside a call (``os.fork``, a fork-started ``multiprocessing`` child) is
  ended in the child at once, and the call raises ``PolicyForked``: a second copy of the
  test process would report the tests again;
- a call that has not returned after ``CALL_TIMEOUT.seconds`` is interrupted with
  ``CallTimedOut`` (a ``SIGALRM`` timer in the main thread, as pytest-timeout's signal method
  does; a pure-Python loop stops at once, a blocking C call when it returns to Python). Where
  another timer is already armed (pytest-timeout), that one is left to do the job.

Both are ``GateInterrupt``s (``BaseException``): an engine's own ``except Exception`` does not
swallow them, and the engine loaders pass them on rather than report them as the engine's
error.
"""
from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["GateInterrupt", "PolicyExited", "PolicyForked", "CallTimedOut", "CALL_TIMEOUT",
           "guarded"]


class GateInterrupt(BaseException):
    """The gate stopped a call into the policy (never the policy's own exception)."""


class PolicyExited(GateInterrupt):
    def __init__(self, code):
        super().__init__(f"the policy called os._exit({code!r})")
        self.code = code


class PolicyForked(GateInterrupt):
    def __init__(self, forks: int):
        super().__init__(f"the policy forked the process {forks} time(s)")
        self.forks = forks


class CallTimedOut(GateInterrupt):
    def __init__(self, seconds: float):
        super().__init__(f"a call did not return within {seconds:g} s")
        self.seconds = seconds


@dataclass
class CallTimeout:
    """Seconds one call into the policy may take (``--rule-timeout-s``). Once a call of a policy
    has been stopped, later calls of that policy get at most ``after_trip`` seconds: shrinking a
    hang replays it many times, and each replay need not wait the whole limit again to show it.
    Other policies keep the whole limit (a test of another policy in the same process, whose
    first call may be slow on a loaded machine, is never stopped for the first one's hang)."""

    seconds: float = 10.0
    after_trip: float = 1.0
    tripped_by: set = field(default_factory=set)  # the policies (by name) a timer stopped

    def now_for(self, who: str = "") -> float:
        return min(self.seconds, self.after_trip) if who in self.tripped_by else self.seconds

    def trip(self, who: str = "") -> None:
        self.tripped_by.add(who)

    MAX_SECONDS = 86_400.0  # a day: more is no time limit (and past what the timer takes)

    def set(self, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)
                and 0 < seconds <= self.MAX_SECONDS):
            raise ValueError(f"a call's time limit must be a positive number of seconds up to "
                             f"{self.MAX_SECONDS:,.0f} (a day), got {seconds!r}")
        self.seconds = float(seconds)


CALL_TIMEOUT = CallTimeout()


def _refuse_exit(code=0):
    raise PolicyExited(code)


_REAL_EXIT = os._exit
_CALL = {"depth": 0, "forks": 0}


def _before_fork():
    if _CALL["depth"]:
        _CALL["forks"] += 1


def _child_of_a_call():
    if _CALL["depth"]:  # a copy of the test process made by the policy: it ends here
        _REAL_EXIT(70)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_child_of_a_call)


@contextmanager
def guarded(seconds: float = None, who: str = ""):
    """Guard the calls inside; ``seconds``: the timer's limit (default: ``CALL_TIMEOUT``'s for
    the policy ``who``). Inside another guarded block the outer timer goes on (it is not
    re-armed per call). Where the timer fired, the call is stopped: ``CallTimedOut``, also where
    its exception did not come out as raised (swallowed by the policy's own ``except``, or in a
    weakref callback, or turned into a ``SystemError`` inside a C call such as ``ast``'s)."""
    import posix

    saved = os._exit, posix._exit
    os._exit = posix._exit = _refuse_exit
    limit = CALL_TIMEOUT.now_for(who) if seconds is None else seconds
    fired = []
    armed, previous = _arm(limit, who, fired)
    _CALL["depth"] += 1
    forks = _CALL["forks"]
    try:
        yield
        if _CALL["forks"] != forks:
            raise PolicyForked(_CALL["forks"] - forks)
    except (GateInterrupt, KeyboardInterrupt):
        raise
    except BaseException as exc:
        if fired:
            raise CallTimedOut(limit) from exc
        raise
    else:
        if fired:
            raise CallTimedOut(limit)
    finally:
        _CALL["depth"] -= 1
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        os._exit, posix._exit = saved


def _arm(seconds: float, who: str = "", fired: list = None):
    """Arm the timer: (armed, the SIGALRM handler to put back)."""
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_REAL)[0]):
        return False, None

    def expired(signum, frame):
        CALL_TIMEOUT.trip(who)
        if fired is not None:
            fired.append(True)
        raise CallTimedOut(seconds)
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return True, previous
