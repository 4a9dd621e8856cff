"""The per-call timer (``dispatcher/model/guard.py``): a hang shortens the limit of the policy
that hung only, and a call the timer stopped is reported as stopped, whatever the policy's code
made of the timer's exception."""
import time

import pytest

from dispatcher.model import guard
from dispatcher.model.guard import CALL_TIMEOUT, CallTimedOut, guarded


@pytest.fixture
def limits(monkeypatch):
    monkeypatch.setattr(CALL_TIMEOUT, "seconds", 0.5)
    monkeypatch.setattr(CALL_TIMEOUT, "after_trip", 0.1)
    monkeypatch.setattr(CALL_TIMEOUT, "tripped_by", set())
    return CALL_TIMEOUT


def _busy(seconds: float, swallow: bool = False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not swallow:
            continue
        try:  # a policy that swallows everything: the timer's exception lands in here
            while time.monotonic() < end:
                sum(range(1000))
        except BaseException:  # noqa: BLE001
            pass


def test_a_hang_shortens_the_limit_of_the_policy_that_hung_only(limits):
    with pytest.raises(CallTimedOut), guarded(who="spins"):
        _busy(5)
    assert limits.now_for("spins") == 0.1 and limits.now_for("another") == 0.5
    with guarded(who="another"):  # slow on a loaded machine, within its own limit: it runs
        _busy(0.3)
    with pytest.raises(CallTimedOut), guarded(who="spins"):  # the one that hung: the short one
        _busy(0.3)


def test_a_call_that_swallowed_the_timers_exception_is_still_stopped(limits):
    t0 = time.monotonic()
    with pytest.raises(CallTimedOut), guarded(seconds=0.1, who="swallows"):
        _busy(0.4, swallow=True)
    assert time.monotonic() - t0 < 2


def test_a_timer_exception_turned_into_another_error_is_reported_as_the_stop(limits):
    """As inside ``ast``'s constructor, where an exception from a signal handler comes out as
    ``SystemError: AST constructor recursion depth mismatch``: the call was stopped by the gate,
    and is no error of the policy's."""
    def converts():
        try:
            _busy(5)
        except CallTimedOut:
            raise SystemError("AST constructor recursion depth mismatch") from None

    with pytest.raises(CallTimedOut) as stopped, guarded(seconds=0.1, who="converts"):
        converts()
    assert isinstance(stopped.value.__cause__, SystemError)


def test_a_call_within_its_limit_is_untouched(limits):
    with guarded(who="quick"):
        value = sum(range(10))
    assert value == 45 and not limits.tripped_by
    assert guard.signal.getitimer(guard.signal.ITIMER_REAL)[0] == 0  # disarmed
