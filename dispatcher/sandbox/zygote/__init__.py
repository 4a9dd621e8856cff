"""One zygote per gate run: a process that has imported torch once and forks the run's child
processes from it (each policy process, the policy's probe, a rank pool's ranks), for every
process of the run: the pytest controller, each xdist worker, the watch's test processes.

A child started as ``python -c`` pays the interpreter's and torch's start: 2-3 s of a core on
a 2-core machine, about 5 s on a 16-core GPU host, where a run's start launched 17 of them at
once (the probe and one policy process per xdist worker) beside the pools' own. A fork from
the zygote takes milliseconds. ``multiprocessing``'s forkserver does this for one process
only; its server cannot be shared by the processes of a run, so the run's own zygote is this
small one.

- **Who owns it.** The process that decides the run (the pytest controller, the single
  process of ``-n 0``, the watch) starts the root (``start_root``) before its workers; the
  root's folder travels to them in ``ENV``. The root imports nothing heavy. On the first
  request for a preload set (``WITH_TORCH``, or none) it forks a sub-zygote that imports it
  once. The root dies with its owner, the sub-zygotes with the root, each child with its
  sub-zygote (Linux's parent-death signal), so nothing outlives the run.
- **What a child is.** A fork of a process that has loaded nothing of the user's: the
  environment, the working directory, ``sys.argv`` and the standard streams are the ones the
  asking process would have given ``python -c``, it is the leader of a session of its own (a
  kill of its group takes what it started), and it calls a function of the gate's, named by
  reference and unpickled only in the child. The environment must be the root's own, up to
  what is read only when used (``_RUNTIME_ONLY``: xdist's ``PYTEST_*``, the gate's own
  ``A2A_GATE_*``, Hypothesis's, ...), which the child is given as asked: a request with another
  environment (another ``PYTHONPATH``, thread count, interpreter) is refused and the asker
  starts ``python -c`` as before, so a fork never differs from that process in what it
  imported. Unlike a fresh interpreter, a fork shares the zygote's hash seed.
- **The lease.** The asker holds the connection it asked on; the sub-zygote sends the
  child's pid on it, then its exit status once it has reaped it. If the asker goes (it died,
  or closed the lease), the sub-zygote kills the child's process group: a child never
  outlives the process that asked for it.
- **Nothing waits for ever.** A request is read with a timeout; an asker that cannot reach the
  zygote, or is refused, falls back to ``python -c``.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from ..procs import signal_group

__all__ = ["ENV", "WITH_TORCH", "PassedFd", "Forked", "Root", "start_root", "popen", "available",
           "stop_roots"]

ENV = "A2A_GATE_ZYGOTE"  # the folder of the run's zygote (its sockets and log)
WITH_TORCH = ("torch", "torch.distributed")  # what a sub-zygote imports for the children that run torch
# What may differ between a child's environment and the zygote's: variables read only when
# used, never while a module the zygote preloads is imported (xdist's per-worker PYTEST_*,
# COLUMNS and LINES; the gate's own A2A_GATE_*, such as the generation a session chose;
# Hypothesis's HYPOTHESIS_*: no zygote imports Hypothesis, tests/cpu/test_zygote.py checks), and
# PYTHONSAFEPATH, read only as an interpreter starts: the zygote, like every ``python -c`` child
# of the gate, drops the current directory from its path either way (``procs.DROP_CWD``), so
# its path is the same with or without it (a run sets it for its workers' children, and a
# command the gate's own tests start inherits it)
_RUNTIME_ONLY = ("PYTEST_", "COLUMNS", "LINES", "A2A_GATE_", "HYPOTHESIS_", "PYTHONSAFEPATH")
_FIRST_ANSWER_S = 120.0  # the root's answer (it forks a sub-zygote at most)
_ROOT_BOOT = """
from dispatcher.sandbox.zygote.server import root_main
root_main(int(sys.argv[1]), int(sys.argv[2]))
"""


class PassedFd(int):
    """In a request's arguments: the ``i``-th file descriptor passed with it; in the child,
    the descriptor it received."""


def available() -> bool:
    """Whether this process can ask a zygote (one was started for its run)."""
    return sys.platform.startswith("linux") and bool(os.environ.get(ENV))


# ---------------------------------------------------------------------------------------------
# Wire: a 4-byte length, then the bytes (JSON for what the zygote reads, pickle for what only
# the child unpickles)


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("the other end closed")
        out += chunk
    return bytes(out)


def _recv(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    (size,) = struct.unpack("!I", _recv_exact(sock, 4))
    if size > limit:
        raise ValueError(f"a message of {size} bytes")
    return _recv_exact(sock, size)


def _comparable(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(_RUNTIME_ONLY)}


# ---------------------------------------------------------------------------------------------
# The owner's side


class Root:
    """A root this process started (``start_root``): ``stop()`` kills it, its sub-zygotes and
    their children, removes its folder and announces again what was announced before."""

    def __init__(self, proc: subprocess.Popen, folder: str, before: Optional[str]):
        self.proc, self.folder, self._before = proc, folder, before

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.terminate()  # the sub-zygotes kill their children's groups, then all end
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        signal_group(proc.pid)  # the root and its sub-zygotes: one group
        proc.wait()
        _remove(self.folder)
        if os.environ.get(ENV) == self.folder:
            if self._before is None:
                del os.environ[ENV]
            else:
                os.environ[ENV] = self._before
        for key in [k for k in _SUBS if k[0] == self.folder]:
            del _SUBS[key]
        if self in _ROOTS:
            _ROOTS.remove(self)


_ROOTS: list = []  # the roots this process started and has not stopped


def start_root(env: Optional[dict] = None) -> Optional[Root]:
    """Start a zygote for this run, whose children will have the environment ``env``, and
    announce it to this process's later children (``ENV``). None where one already announced
    serves such children (a nested run inside a run), or where none can run here. Call it from
    the main thread: the root dies with the thread that started it."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != ENV}
    before = os.environ.get(ENV)
    if not sys.platform.startswith("linux") or (before and _serves(before, env)):
        return None
    folder = tempfile.mkdtemp(prefix="a2a-gate-zygote-")
    if len(os.path.join(folder, "sub000.sock")) > 100 and os.path.isdir("/tmp"):
        os.rmdir(folder)  # a socket's path must fit 107 bytes: a deep $TMPDIR does not
        folder = tempfile.mkdtemp(prefix="a2a-gate-zygote-", dir="/tmp")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.path.join(folder, "root.sock"))
        listener.listen(64)
        from ..procs import DROP_CWD, die_with_parent

        with open(os.path.join(folder, "zygote.log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", DROP_CWD + _ROOT_BOOT, str(listener.fileno()),
                 str(os.getpid())],
                env=env, cwd=folder, pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
    except OSError:
        _remove(folder)
        return None
    finally:
        listener.close()
    root = Root(proc, folder, before)
    _ROOTS.append(root)
    os.environ[ENV] = folder
    return root


def _serves(folder: str, env: dict) -> bool:
    """Whether the zygote of ``folder`` answers and forks children of ``env``."""
    try:
        answer = _ask(folder, {"hello": True})
    except (OSError, EOFError, ValueError):
        return False
    return answer.get("env") == _comparable(env)


@atexit.register
def stop_roots() -> None:
    """Stop every root this process started (at exit)."""
    for root in list(_ROOTS):
        root.stop()


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The asker's side


class Forked:
    """A child forked by the zygote, seen as ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
    ``returncode``) and as ``multiprocessing.Process`` (``sentinel``, ``is_alive``, ``kill``,
    ``join``) see theirs. Its ``pid`` is known once the sub-zygote has forked it (it may still
    be importing torch when asked); its exit status, once reaped."""

    def __init__(self, lease: socket.socket, folder: str):
        self._lease, self.folder = lease, folder  # the folder of the root it came from
        self._pid: Optional[int] = None
        self.returncode: Optional[int] = None

    @property
    def sentinel(self) -> int:
        """Readable once the child has ended (``multiprocessing.connection.wait`` takes it)."""
        return self._lease.fileno() if self.returncode is None else self._done_fd()

    def _done_fd(self) -> int:
        if not hasattr(self, "_done"):
            r, w = os.pipe()
            os.close(w)  # a pipe whose write end is closed: always readable
            self._done = r
        return self._done

    @property
    def pid(self) -> int:
        """The child's pid, waiting for the fork (the sub-zygote may still be importing);
        -1 where it ended unforked or the zygote did not answer within ``_FIRST_ANSWER_S``."""
        deadline = time.monotonic() + _FIRST_ANSWER_S
        while self._pid is None and self.returncode is None:
            if not self._read(max(0.0, deadline - time.monotonic())):
                self.close()  # never forked in time: given up (the zygote kills it if it comes)
        return self._pid if self._pid is not None else -1

    def _read(self, timeout: Optional[float]) -> bool:
        """Read the next message (the pid, then the exit status); False where none came within
        ``timeout``."""
        if self.returncode is not None:
            return True
        if not select.select([self._lease], [], [], timeout)[0]:
            return False
        try:
            message = json.loads(_recv(self._lease))
        except (EOFError, OSError, ValueError):  # the zygote is gone: so is the child
            message = {"exit": -signal.SIGKILL}
        if "pid" in message:
            self._pid = message["pid"]
        if "exit" in message:
            self.returncode = message["exit"]
            self._lease.close()
        return True

    def poll(self) -> Optional[int]:
        while self.returncode is None and self._read(0):
            pass
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read(left) and left is not None:
                raise subprocess.TimeoutExpired("(forked by the zygote)", timeout)
        return self.returncode

    def is_alive(self) -> bool:
        return self.poll() is None

    def kill(self) -> None:
        """SIGKILL the child's process group (it leads one); not forked yet, give up the lease,
        and the zygote kills it as soon as it is."""
        self.poll()
        if self.returncode is not None:
            return
        if self._pid is None:
            self.close()
            return
        signal_group(self._pid)

    def kill_group(self) -> None:
        """Kill the child's group and reap it (``procs.kill_group``); a zygote that does not
        say within 30 s has its lease given up."""
        self.kill()
        try:
            self.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.close()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Give up the lease: the zygote kills the child if it still runs (so does dropping the
        last reference to this handle)."""
        if self.returncode is None:
            self._lease.close()
            self.returncode = -signal.SIGKILL
        if hasattr(self, "_done"):
            os.close(self._done)
            del self._done

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


_SUBS: dict = {}  # (folder, preload) -> the sub-zygote's socket path, or None where refused


def popen(target, args: Sequence = (), *, env: dict, cwd: Optional[str] = None,
          stdout: Optional[int] = None, fds: Sequence[int] = (), preload: Sequence[str] = (),
          argv: Sequence[str] = ("-c",)) -> Optional[Forked]:
    """``target(*args)`` in a child forked by the run's zygote whose preload is ``preload``:
    with ``env``, in ``cwd`` (default: here), its stdout and stderr on ``stdout`` (default:
    /dev/null), the descriptors ``fds`` passed (``PassedFd(i)`` in ``args`` stands for the
    ``i``-th), and ``sys.argv`` set to ``argv``. ``target`` must be a module-level function of
    the gate. Returns at once, without waiting for the fork; None where no zygote serves this
    process or it refused (the caller starts ``python -c`` instead)."""
    if not available():
        return None
    folder = os.environ[ENV]
    key = (folder, tuple(preload))
    try:
        if key not in _SUBS:
            _SUBS[key] = _ask_root(folder, tuple(preload))
        path, theirs = _SUBS[key]
        if path is None or _comparable(env) != theirs:
            return None  # the zygote imported under another environment: python -c
        header = {"env": dict(env), "cwd": cwd or os.getcwd(), "argv": list(argv),
                  "executable": sys.executable, "nfds": len(fds),
                  "stdout": stdout is not None}
        passed = list(fds) + ([stdout] if stdout is not None else [])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            socket.send_fds(sock, [b"Z"], passed)
            _send(sock, json.dumps(header).encode())
            _send(sock, pickle.dumps((target, tuple(args))))
        except OSError:
            sock.close()
            raise
    except (OSError, EOFError, ValueError):
        _SUBS[key] = (None, None)  # unreachable: python -c from now on
        return None
    return Forked(sock, folder)


def _ask_root(folder: str, preload: tuple) -> tuple:
    """The socket of the sub-zygote with ``preload`` (the root forks it on the first ask) and
    the environment the zygote imported under, up to what differs between workers; (None,
    None) where the zygote runs another interpreter."""
    answer = _ask(folder, {"preload": list(preload)})
    return answer.get("path"), answer.get("env")


def _ask(folder: str, request: dict) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_FIRST_ANSWER_S)
    try:
        sock.connect(os.path.join(folder, "root.sock"))
        _send(sock, json.dumps({**request, "executable": sys.executable}).encode())
        return json.loads(_recv(sock))
    finally:
        sock.close()
