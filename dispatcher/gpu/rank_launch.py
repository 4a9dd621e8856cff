"""How a rank pool's processes start: forked from a process that has imported torch once and
never initialised CUDA (a forked child of a process with a CUDA context could not use CUDA).

That process is the run's zygote (``dispatcher.sandbox.zygote``) where one serves this process:
it is shared by every process of the run and started before collection, so a pool's start pays
no interpreter or torch import at all. Where none does (another environment, a process outside
a run), it is a ``forkserver`` of this process, as ``torch.multiprocessing`` makes it, which
imports torch once for this process's pools.
"""
from __future__ import annotations

import socket
from multiprocessing.connection import Connection
from typing import Callable, List, Sequence, Tuple

__all__ = ["launch", "PRELOAD"]

# What the forkserver imports once, before any rank is forked from it (nothing here touches CUDA)
PRELOAD = ["torch", "torch.distributed", "dispatcher.gpu.rank_pool"]


def launch(worker: Callable, args: Sequence[tuple]) -> Tuple[List[Connection], list]:
    """Start one process per entry of ``args``, each running ``worker(conn, *its args)``
    (``worker`` a module-level function); this side's end of each pipe, and the processes
    (``multiprocessing.Process``'s ``sentinel``, ``is_alive``, ``kill``, ``join``)."""
    started = _from_zygote(worker, args)
    return started if started is not None else _from_forkserver(worker, args)


def _from_zygote(worker, args):
    from ..sandbox import zygote
    from ..sandbox.procs import child_env

    if not zygote.available():
        return None
    conns, procs = [], []
    for n, rest in enumerate(args):
        mine, theirs = socket.socketpair()
        with theirs:
            proc = zygote.popen(_with_connection, (worker, zygote.PassedFd(0), *rest),
                                env=child_env(), fds=(theirs.fileno(),),
                                preload=zygote.WITH_TORCH, argv=["-c", f"ep-rank-{n}"])
        if proc is None:  # not served here: nothing of this pool is left running
            mine.close()
            for conn, started in zip(conns, procs):
                started.close()
                conn.close()
            return None
        conns.append(Connection(mine.detach()))
        procs.append(proc)
    for proc in procs:
        proc.pid  # forked: from now on only its end makes its sentinel readable
    return conns, procs


def _with_connection(worker, fd: int, *args) -> None:
    """In a rank forked by the zygote: its end of the pipe came as ``fd``."""
    worker(Connection(fd), *args)


def _from_forkserver(worker, args):
    import torch.multiprocessing as mp  # here: the parent's protocol needs no torch

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: this process's first pool
    pipes = [ctx.Pipe() for _ in args]
    procs = [ctx.Process(target=worker, daemon=True, name=f"ep-rank-{n}", args=(theirs, *rest))
             for n, ((_, theirs), rest) in enumerate(zip(pipes, args))]
    for proc in procs:
        proc.start()
    for _, theirs in pipes:
        theirs.close()  # the rank holds its end: a dead rank then reads as EOF here
    return [mine for mine, _ in pipes], procs
