"""The zygote's side of ``dispatcher.sandbox.zygote`` (the root, its sub-zygotes, and a
forked child's first steps): nothing of the user's runs in these processes, only in the
children, after ``child_main`` made each what ``python -c`` would have started."""
from __future__ import annotations

import itertools
import json
import os
import pickle
import select
import signal
import socket
import sys
from typing import Optional

from ..procs import die_with_parent, signal_group
from . import PassedFd, _comparable, _recv, _send

__all__ = ["root_main"]

_REQUEST_TIMEOUT_S = 10.0  # a request is read within this, or dropped


def _log(text: str) -> None:
    print(f"[zygote {os.getpid()}] {text}", file=sys.stderr, flush=True)


def _mismatch(request: dict) -> str:
    """Why a request's process differs from the zygote's in what it would import ("" if not)."""
    if request.get("executable") != sys.executable:
        return f"another interpreter ({request.get('executable')})"
    mine, theirs = _comparable(os.environ), _comparable(request.get("env", {}))
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return f"another environment ({', '.join(differ[:8])})" if differ else ""


def root_main(listen_fd: int, owner: int) -> None:
    """The root: fork a sub-zygote per preload set on demand and answer with its socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(fileno=listen_fd)
    folder = os.path.dirname(listener.getsockname())
    subs: dict = {}  # preload -> (pid, socket path)
    names = itertools.count()

    def stop(*_):  # the owner's Root.stop(): each sub-zygote ends what it forked, then this
        for pid, _path in subs.values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid, _path in subs.values():
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    while True:
        if os.getppid() != owner:
            os._exit(0)
        for pid, _ in _reaped():  # sub-zygotes that ended
            subs = {k: v for k, v in subs.items() if v[0] != pid}
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        conn.settimeout(_REQUEST_TIMEOUT_S)
        try:
            request = json.loads(_recv(conn, 1 << 20))
            if request.get("executable") != sys.executable:
                _log(f"refused a process of another interpreter ({request.get('executable')})")
                _send(conn, json.dumps({"path": None}).encode())
                continue
            if request.get("hello"):
                _send(conn, json.dumps({"env": _comparable(os.environ)}).encode())
                continue
            preload = tuple(request.get("preload", ()))
            if preload not in subs:
                path = os.path.join(folder, f"sub{next(names)}.sock")
                sub_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sub_listener.bind(path)
                sub_listener.listen(128)  # askers wait here while it imports
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    listener.close()
                    conn.close()
                    _sub_main(sub_listener, preload)  # never returns
                sub_listener.close()
                subs[preload] = (pid, path)
            _send(conn, json.dumps({"path": subs[preload][1],
                                    "env": _comparable(os.environ)}).encode())
        except (OSError, EOFError, ValueError) as exc:
            _log(f"a request failed: {exc!r}")
        finally:
            conn.close()


def _sub_main(listener: socket.socket, preload: tuple) -> None:
    """A sub-zygote: import ``preload`` once, then fork a child per request and hold its lease."""
    root = die_with_parent()
    try:
        for name in preload:
            try:
                __import__(name)
            except Exception as exc:  # noqa: BLE001 - each child meets it again, and says so
                _log(f"preload of {name} failed: {exc!r}")
        import gc

        gc.collect()
        gc.freeze()  # the children's collections skip what was preloaded (no copy of its pages)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        leases: dict = {}  # lease socket -> child pid

        def stop(*_):  # the root ends: so does everything forked here, groups and all
            for pid in leases.values():
                signal_group(pid)
            os._exit(0)
        signal.signal(signal.SIGTERM, stop)
        while True:
            if os.getppid() != root:
                for pid in leases.values():
                    signal_group(pid)
                os._exit(0)
            ready = select.select([listener, wake_r, *leases], [], [], 1.0)[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
            _reap(leases)
            for lease in [s for s in ready if s in leases]:
                try:
                    gone = not lease.recv(64)
                except OSError:
                    gone = True
                if gone:  # the asker went: so does its child
                    signal_group(leases.pop(lease))
                    lease.close()
            if listener in ready:
                conn, _ = listener.accept()
                pid = _fork_child(conn, listener, wake_r, wake_w, leases)
                if pid is not None:
                    leases[conn] = pid
                else:
                    conn.close()
    except BaseException as exc:  # noqa: BLE001 - logged, then this sub-zygote ends
        _log(f"sub-zygote failed: {exc!r}")
        os._exit(1)


def _reaped():
    """``(pid, wait status)`` of each child of this process that has ended, reaped."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        yield pid, status


def _reap(leases: dict) -> None:
    by_pid = {pid: lease for lease, pid in leases.items()}
    for pid, status in _reaped():
        lease = by_pid.get(pid)
        if lease is None:
            continue
        del leases[lease]
        try:
            lease.settimeout(_REQUEST_TIMEOUT_S)
            _send(lease, json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass
        lease.close()


def _fork_child(conn, listener, wake_r, wake_w, leases) -> Optional[int]:
    """Read one request from ``conn`` and fork its child; its pid, or None (bad request)."""
    conn.settimeout(_REQUEST_TIMEOUT_S)
    try:
        _, fds, _, _ = socket.recv_fds(conn, 1, 64)
        header = json.loads(_recv(conn, 1 << 20))
        payload = _recv(conn)
    except (OSError, EOFError, ValueError) as exc:
        _log(f"a request failed: {exc!r}")
        return None
    why = _mismatch(header)
    if why:  # the root refused such processes already: only a changed asker gets here
        _log(f"refused a child of {why}")
        for fd in fds:
            os.close(fd)
        return None
    led_r, led_w = os.pipe()  # the child's word that it leads its session and group
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the sub-zygote's stop
            os.setsid()
            os.close(led_r)
            os.write(led_w, b"x")
            os.close(led_w)
            closing = [listener.fileno(), wake_r, wake_w] + [s.fileno() for s in leases]
            _child_main(conn, fds, header, payload, closing)
        finally:
            os._exit(70)  # not reached
    os.close(led_w)
    select.select([led_r], [], [], _REQUEST_TIMEOUT_S)  # a kill of its group then finds it
    os.close(led_r)
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, json.dumps({"pid": pid}).encode())
    except OSError:
        signal_group(pid)  # the asker is gone already
    conn.settimeout(None)
    return pid


def _child_main(conn, fds, header, payload, closing) -> None:
    """In the forked child (already the leader of a session of its own): become what ``python
    -c`` would have started, then run the target."""
    die_with_parent()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in closing:
        try:
            os.close(fd)
        except OSError:
            pass
    conn.close()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out = fds[-1] if header.get("stdout") else null
    os.dup2(out, 1)
    os.dup2(out, 2)
    for extra in {null, out}:
        os.close(extra)
    os.chdir(header["cwd"])
    os.environ.clear()
    os.environ.update(header["env"])
    sys.argv = list(header["argv"])
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        target, args = pickle.loads(payload)
        args = tuple(fds[a] if isinstance(a, PassedFd) else a for a in args)
        target(*args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would print it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _exit_as_python_does(code)


def _exit_as_python_does(code: int) -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run ``atexit``, flush."""
    import atexit as _atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    try:
        _atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
