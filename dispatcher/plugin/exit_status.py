"""How a run of the gate ends (hooks registered by ``dispatcher.plugin``, which imports them):
the exit status is the session's verdict, whatever the policy under test left running or
registered to run at exit; an xdist worker ends as soon as its session is over."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

__all__ = ["pytest_sessionfinish", "pytest_unconfigure"]

_OUTER_PROFILE = pytest.StashKey[str]()  # the Hypothesis profile a nested (pytester) run replaced
_EXIT = pytest.StashKey[int]()
_ZYGOTE = pytest.StashKey[object]()  # the run's zygote root, where this session started it
_REAL_EXIT = os._exit  # taken before any policy could replace it
_OPEN_CONFIGS = []  # sessions of this process, outermost first (pytester runs nest inside)


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT] = int(exitstatus)
    if "dispatcher.gpu.warm" in sys.modules:
        sys.modules["dispatcher.gpu.warm"].close_unused()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The run's status is this session's verdict, whatever the policy runs afterwards: a
    non-daemon thread it left would keep the process alive (Python waits for such threads at
    exit), and an ``atexit`` handler it registered could exit with another status
    (``atexit.register(os._exit, 0)``). So, in the outermost session of a process that ran
    foreign code: say what was left running and end now, or end first thing at exit (this
    handler is registered last, and ``atexit`` runs handlers last-in, first-out)."""
    import atexit
    import threading

    if config in _OPEN_CONFIGS:
        _OPEN_CONFIGS.remove(config)
    root = config.stash.get(_ZYGOTE, None)
    if root is not None:  # what was forked from it goes with it
        if "dispatcher.supervised" in sys.modules:
            sys.modules["dispatcher.supervised"].forget_forked_by(root.folder)
        root.stop()
    if _OPEN_CONFIGS and _OUTER_PROFILE in config.stash:  # a nested (pytester) session ended
        settings.load_profile(config.stash[_OUTER_PROFILE])
    if hasattr(config, "workerinput") and not _OPEN_CONFIGS:
        _end_worker()
    if hasattr(config, "workerinput") or _EXIT not in config.stash or _OPEN_CONFIGS:
        return
    status = config.stash[_EXIT]
    stray = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if stray:
        sys.stdout.flush()
        sys.stderr.write(f"a2a-sizing-gate: non-daemon threads still running after the run "
                         f"({', '.join(stray[:5])}): the policy under test started them; "
                         f"exiting with the run's status ({status}) without waiting for them\n")
        sys.stderr.flush()
        _REAL_EXIT(status)
    from dispatcher.policies import foreign_code_loaded

    if foreign_code_loaded():
        atexit.register(_end_with, status)


def _end_worker() -> None:
    """An xdist worker whose session is over (its results already sent to the controller,
    which decides the run's status) ends now: tearing down a worker's heap at interpreter exit
    (every loaded release, recorded search and tensor) took seconds the run waited for."""
    _end_with(0)


def _end_with(status: int) -> None:
    """End this process with ``status`` now: flush, stop daemonic child processes as
    multiprocessing would at exit (a rank pool's forkserver), and exit before any ``atexit``
    handler a policy registered can run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if "dispatcher.supervised" in sys.modules:  # the policy's processes go first
        sys.modules["dispatcher.supervised"].stop_all()
    if "dispatcher.sandbox.zygote" in sys.modules:  # then the zygote they were forked from
        sys.modules["dispatcher.sandbox.zygote"].stop_roots()
    if "multiprocessing" in sys.modules:
        try:
            from multiprocessing import util

            util._exit_function()
        except Exception:  # noqa: BLE001 - best effort; the status below is what matters
            pass
    _REAL_EXIT(status)
