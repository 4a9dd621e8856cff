"""Child processes that run foreign code (a policy's probe, a replay, a bisect step) go with
the process that started them: ``die_with_parent`` (for ``preexec_fn``) asks Linux to SIGKILL
the child when its parent dies, so a cancelled run (SIGTERM, SIGKILL, a CI job stopped) never
leaves a policy spinning in an orphan. Elsewhere it does nothing; the callers' own timeouts
and process-group kills remain."""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["seconds_arg", "DROP_CWD", "alive", "die_with_parent", "raise_on_sigterm", "python_child", "child_env", "SOURCE_ROOT",
           "run_bounded", "OutputFlood", "MAX_OUTPUT_BYTES", "kill_group", "signal_group",
           "keep_cwd_off_children_paths"]

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds dispatcher/
# ``python -c`` puts the current directory first on sys.path, as '' (not under PYTHONSAFEPATH):
# a child of the gate takes it off before anything else is imported, so a json.py or socket.py
# lying there is never run (a PYTHONPATH entry that happens to be the current folder stays)
DROP_CWD = ("import sys\n"
            "if sys.path and sys.path[0] == '':\n"
            "    del sys.path[0]\n")
_BOOT = (DROP_CWD + "sys.argv = sys.argv[1:]\nimport runpy\n"
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def python_child(module: str, *args: str) -> list:
    """The command that runs ``python -m module args`` without the current directory on its
    path (``python -P`` where every supported Python has it)."""
    return [sys.executable, "-c", _BOOT, module, *args]


def _named_in_cwd(spec: str) -> bool:
    """Whether ``spec`` (``module:callable``) names a module that lies in the current
    directory: then the user asked for code from there."""
    if not spec or ":" not in spec:
        return False
    top = spec.partition(":")[0].split(".")[0]
    here = os.getcwd()
    return bool(top) and (os.path.isfile(os.path.join(here, f"{top}.py"))
                          or os.path.isdir(os.path.join(here, top)))


def child_env(spec: str = "", **extra: str) -> dict:
    """The environment of a child process of the gate: the gate's own code importable, the
    current directory only where ``spec`` names a module in it, the user's PYTHONPATH kept
    (the same for a child's child: an entry already there, or the gate's own folder as the
    current one, is not added twice: the run's zygote serves only children of its environment)."""
    first = list(dict.fromkeys([SOURCE_ROOT] + ([os.getcwd()] if _named_in_cwd(spec) else [])))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(first + rest), **extra)

_PR_SET_PDEATHSIG = 1


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> int:
    """In the child, between fork and exec (or in a fork that goes on): SIGKILL when the
    parent goes (Linux only); the parent's pid."""
    parent = os.getppid()
    if not sys.platform.startswith("linux"):
        return parent
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return parent
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    return parent


class Terminated(BaseException):
    """SIGTERM, raised where the program runs so its ``finally`` blocks run (children are
    killed, worktrees removed) before it ends."""


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises ``Terminated`` in the main thread."""
    def handler(signum, frame):
        raise Terminated()
    signal.signal(signal.SIGTERM, handler)


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to process group ``pgid``, which may be gone already."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc) -> None:
    """SIGKILL ``proc``'s process group (it was started in a session of its own) and reap it
    (a child forked by the run's zygote says how: ``Forked.kill_group``)."""
    if hasattr(proc, "kill_group"):
        proc.kill_group()
        return
    signal_group(proc.pid)
    proc.wait()


class OutputFlood(RuntimeError):
    """A child printed more than ``run_bounded``'s byte budget: it was killed at once."""


MAX_OUTPUT_BYTES = 64 << 20  # what a child may print before it is stopped as a flood


def run_bounded(cmd, env=None, timeout: float = None, limit: int = 1 << 20, cwd=None,
                max_bytes: int = None, start=None):
    """Run ``cmd`` in a session of its own, dying with this process: ``(exit code, or None when
    it ran over ``timeout``; what it printed, stdout and stderr together, at most ``limit``
    characters from the end)``. Its output goes to a file, not a pipe, so a grandchild it
    left holding the output open cannot keep this waiting; whatever it started is killed
    when it ends. A child that prints more than ``max_bytes`` is killed at once and
    ``OutputFlood`` raised (the file would fill the disk for the whole timeout otherwise;
    default ``MAX_OUTPUT_BYTES``). ``start``: ``start(output file) -> process or None``, the
    same run started another way (forked by the run's zygote: ``sandbox.zygote``), ``cmd``
    where it gives None."""
    import subprocess
    import tempfile
    import time

    max_bytes = MAX_OUTPUT_BYTES if max_bytes is None else max_bytes
    with tempfile.TemporaryFile() as out:
        proc = start(out) if start is not None else None
        if proc is None:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if os.fstat(out.fileno()).st_size > max_bytes:
                        raise OutputFlood(f"it printed more than {max_bytes >> 20} MiB and was "
                                          f"stopped") from None
                    if deadline is not None and time.monotonic() > deadline:
                        code = None
                        break
        finally:
            kill_group(proc)
        size = out.seek(0, 2)
        out.seek(max(0, size - limit))
        return code, out.read().decode("utf-8", "replace")


def keep_cwd_off_children_paths(spec: str) -> None:
    """Python processes started from here as ``python -c`` or ``python -m`` (xdist's workers,
    pytester's runs) do not put the current directory first on their path (``PYTHONSAFEPATH``,
    Python 3.11+): a ``json.py`` lying there would run before the worker restores its path.
    Not where ``spec`` names a module in that directory (the user asked for code from there),
    nor where the user set ``PYTHONSAFEPATH`` themselves."""
    if not _named_in_cwd(spec):
        os.environ.setdefault("PYTHONSAFEPATH", "1")


def seconds_arg(text: str) -> float:
    """An argparse ``type``: a positive, finite number of seconds."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the seconds must be a positive number")
    return value
