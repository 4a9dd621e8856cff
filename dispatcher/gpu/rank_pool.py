"""One OS process per EP rank, started once and fed worlds by pipe (multi-GPU tier).

Rank ``r`` runs on GPU ``r % n_gpus``. The process group is NCCL when every rank has its own
GPU and gloo when ranks outnumber GPUs (NCCL refuses two ranks on one GPU); a gloo group is
always there for the CPU side of ``MoeAlltoAll``'s bootstrap and an engine's code. For each
world every rank computes its own runtime with the policy under test from its own
``RankView`` (as production does), then every rank gets every rank's (runtime, world)
through the parent, and all validate together before any kernel is launched; a rank that
would launch alone would leave its peers spinning ~300 s and then trap.

Every wait has a timeout. A remote failure comes back as its own exception type and fails
that example. The pool is rebuilt only when it is broken (a rank crashed, timed out or has a
dead CUDA context); a failure every rank answered leaves it in step, and a rank that fails
before the agreement has its waiting peers' agreement called off (``AgreementAborted``). A
pool that cannot start raises ``PoolStartFailed`` once, with the rank's own words. Without a
GPU (``emulated=True``) the ranks run over gloo on the exact CPU model of the A2A. What a rank
does in one example is ``rank_examples.py``; a sequence of rounds, ``pool_sequence.py``. Each
rank's stderr goes to a log whose tail is quoted when the rank dies, so a
CUDA fault's text is never lost; the parent waits on the ranks' pipes and process sentinels
together, so a death is seen when it happens; ranks exit by themselves when their parent is
gone.

Ranks are forked from a process that has imported torch once (CUDA is never initialised in
it): the run's zygote (``dispatcher.sandbox.zygote``), shared by every process of the run and
started before collection, or, where none serves this process, a ``forkserver`` of its own. A
spawned rank paid the interpreter and torch imports on every start, a rebuild too. The ready
line says where a start's seconds went (the slowest rank's phases).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List

from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

from ..model.generations import DEFAULT, generation_of, installed_version, using
from . import env
from ..sandbox.procs import alive
from .pool_errors import (PoolStartFailed, RankCrashed, RankPoolError,  # noqa: F401 - re-exported
                          RankTimeout, RemoteEngineError, RemoteError, RemoteKernelFault,
                          RemoteMismatch, RemoteRefused, RemoteSizingError, _is_cuda_fault)
from .rank_examples import AgreementAborted, KernelRefused, one_world
from .rank_launch import launch

__all__ = ["RankPool", "RankPoolError", "PoolStartFailed", "RankCrashed", "RankTimeout",
           "RemoteMismatch", "RemoteSizingError", "RemoteEngineError", "RemoteRefused",
           "RemoteKernelFault", "RemoteError"]

GRACE_S = 5.0  # once one rank has failed, how long the others get to answer
PROFILE_ENV = "A2A_GATE_PROFILE_RANKS"  # a directory: each rank writes its cProfile there


def _worker(conn, rank: int, ep_size: int, port: int, n_gpus: int, max_dispatch_bytes: int,
            max_combine_bytes: int, log: str, parent: int, sent_at: float,
            emulated: bool = False, resolve=None):
    phases = {"process": time.time() - sent_at}  # from the parent's start() to here
    server = os.getppid()  # the forkserver, which exits when the parent does
    env.apply()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)  # C++/CUDA messages too
    try:
        state = _start_rank(rank, ep_size, port, n_gpus, phases, emulated)
    except Exception as exc:  # noqa: BLE001 - reported to the parent with its text
        conn.send(("startup", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", rank, (state["backend"], phases)))
    state.update(conn=conn, rank=rank, parent=parent, server=server, resolve=resolve)
    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        return _serve(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, parent,
                      server, conn)
    import cProfile  # where a rank's time goes: one file per rank process, written as it exits

    profiler = cProfile.Profile()
    try:
        profiler.runcall(_serve, state, rank, ep_size, max_dispatch_bytes, max_combine_bytes,
                         parent, server, conn)
    finally:
        profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}-{os.getpid()}.prof"))


def _serve(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, parent, server, conn):
    """Run the examples the parent sends until it sends None, a rank fails hard, or the
    parent is gone (its end of the pipe closed, or it no longer exists)."""
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != server or not alive(parent):  # the pytest worker is gone
                    return  # free the GPU
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind, *example = msg
        try:
            first = example[1] if kind == "engine" else example[0]  # an engine's: after its body
            world = first[0] if isinstance(first, tuple) else first
            with using(world.flashinfer):  # the generation the world carries, the world alone sent
                if kind == "engine":  # the engine's own rank body, as the caller handed it
                    body, *example = example
                    result = body(state, rank, ep_size, *example)
                elif kind == "sequence":
                    from .pool_sequence import run_sequence_on_rank

                    worlds, spec, _ = example
                    result = run_sequence_on_rank(state, rank, ep_size, max_dispatch_bytes,
                                                  max_combine_bytes, worlds, spec)
                else:
                    result = one_world(state, rank, ep_size, max_dispatch_bytes,
                                        max_combine_bytes, *example)
            conn.send(("ok", rank, result))
        except Exception as exc:  # noqa: BLE001 - reported to the parent with its type
            from ..model.validation import A2ASizingError

            text = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, AgreementAborted):
                conn.send(("aborted", rank, text))  # in step: nothing was launched
                continue
            if isinstance(exc, A2ASizingError):
                conn.send(("sizing", rank, text))
                continue
            from ..emulator.a2a import RankRefused

            if isinstance(exc, (RankRefused, KernelRefused)):  # nothing launched
                conn.send(("refused", rank, text))
                continue
            if kind == "engine" and not state["example"].get("launched"):
                conn.send(("engine", rank, text))  # raised before any collective or kernel
                continue
            text += "\n" + traceback.format_exc()
            if _is_cuda_fault(exc, text):
                conn.send(("cuda", rank, text))
                return  # a dead context: the parent rebuilds the pool
            if not state["emulated"]:  # a kernel this rank launched finishes first, or this
                import torch  # hangs and the parent's timeout rebuilds the pool

                torch.cuda.synchronize()
            conn.send(("error", rank, text))  # the rank stays: the parent decides


def _start_rank(rank: int, ep_size: int, port: int, n_gpus: int, phases: dict,
                emulated: bool = False) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    def phase(name, t0):
        phases[name] = time.perf_counter() - t0
        return time.perf_counter()

    t = time.perf_counter()
    if emulated:  # no GPU: gloo, and the exact CPU model of the A2A in place of the kernels
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ep_size, timeout=datetime.timedelta(seconds=120))
        phase("process group", t)
        return {"backend": "gloo, emulated A2A", "cpu": dist.group.WORLD, "index": None,
                "a2as": {}, "policies": {}, "engines": {}, "example": {}, "emulated": True}

    installed = generation_of(installed_version() or DEFAULT)
    torch.cuda.set_device(rank % n_gpus)
    torch.cuda.init()
    t = phase("cuda", t)
    backend = "nccl" if ep_size <= n_gpus else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep_size, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank % n_gpus) if backend == "nccl" else None)
    cpu = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    t = phase("process group", t)
    from .ops import ops_of

    kernels = ops_of(installed)
    index = kernels.metainfo_index()
    phase("flashinfer", t)
    return {"backend": backend, "cpu": cpu, "index": index, "a2as": {},
            "policies": {}, "engines": {}, "example": {}, "emulated": False,
            "generation": installed.version, "ops": kernels.PoolOps()}


class RankPool:
    """``ep_size`` rank processes over ``n_gpus`` GPUs, reused across examples. The workspace
    of each cap is sized for ``max_dispatch_bytes`` / ``max_combine_bytes`` per token.
    ``resolve``: how a rank loads the ``--policy`` spec it is sent (``spec -> (name,
    policy)``, a module-level function such as ``dispatcher.policies.load_policy``, handed by
    whoever makes the pool: the pool sits below the policies and imports none of them);
    without it the ranks take only the values the caller hands them, and engine steps."""

    def __init__(self, ep_size: int, n_gpus: int, max_dispatch_bytes: int,
                 max_combine_bytes: int, timeout: float = 60.0, start_timeout: float = 300.0,
                 emulated: bool = False, resolve=None):
        self.ep_size, self.n_gpus, self.emulated = ep_size, n_gpus, emulated
        self.resolve = resolve
        self.max_dispatch_bytes, self.max_combine_bytes = max_dispatch_bytes, max_combine_bytes
        self.timeout, self.start_timeout = timeout, start_timeout
        self.backend = None
        self.restarts = 0
        self._procs: list = []
        self._conns: list = []  # the parent's end of each rank's pipe
        self._logs = Path(tempfile.mkdtemp(prefix="a2a-gate-ranks-"))
        self._start()

    def _start(self):
        self._in_flight = False  # fresh ranks: no example under way
        port = env.free_port()
        t, sent_at = time.monotonic(), time.time()
        self._conns, self._procs = launch(_worker, [
            (r, self.ep_size, port, self.n_gpus, self.max_dispatch_bytes, self.max_combine_bytes,
             str(self._log(r)), os.getpid(), sent_at, self.emulated, self.resolve)
            for r in range(self.ep_size)])
        try:
            ready = self._collect(self.start_timeout, "start")
        except RankPoolError as exc:
            self.close(graceful=False)  # the others may wait in init for the failed rank
            raise PoolStartFailed(f"the {self.ep_size}-rank pool could not start: {exc}") from exc
        self.backend = ready[0][0]
        slowest = {k: max(r[1][k] for r in ready) for k in ready[0][1]}
        where = "the CPU" if self.emulated else f"{self.n_gpus} GPU(s)"
        print(f"[rank pool] {self.ep_size} ranks on {where}, {self.backend}, "
              f"ready in {time.monotonic() - t:.1f} s ("
              + ", ".join(f"{k} {v:.1f}" for k, v in slowest.items()) + ")",
              file=sys.stderr, flush=True)

    def _log(self, rank: int) -> Path:
        return self._logs / f"rank{rank}.log"

    def _tail(self, rank: int, lines: int = 15) -> str:
        try:
            text = self._log(rank).read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return ("\n  stderr of rank %d:\n    " % rank + "\n    ".join(text)) if text else ""

    def _collect(self, timeout: float, what: str) -> list:
        """Every rank's answer; the first failure decides, the others get ``GRACE_S``. Waits
        on the ranks' pipes and their process sentinels at once, so a rank that dies is seen
        as it dies; relays the ranks' agreement (``_agree``) on the way."""
        got: Dict[int, tuple] = {}
        agree: Dict[int, object] = {}  # the ranks' values on their way to the agreement
        failing = False  # a rank has failed: agreements are called off
        dead: List[int] = []
        deadline = time.monotonic() + timeout
        while len(got) + len(dead) < self.ep_size:
            left = deadline - time.monotonic()
            if left <= 0:
                if any(k not in ("ready", "ok") for k, _ in got.values()):
                    break
                missing = sorted(set(range(self.ep_size)) - set(got))
                raise RankTimeout(f"{what}: ranks {missing} did not answer within "
                                  f"{timeout:.0f} s" + "".join(self._tail(r) for r in missing))
            waiting = [r for r in range(self.ep_size) if r not in got and r not in dead]
            ready = set(wait([self._conns[r] for r in waiting]
                             + [self._procs[r].sentinel for r in waiting], timeout=left))
            for r in waiting:
                conn, sentinel = self._conns[r], self._procs[r].sentinel
                if conn not in ready and sentinel not in ready:
                    continue
                try:  # a rank may answer and then exit: read what it sent first
                    answer = conn.recv() if conn.poll() else None
                except (EOFError, OSError):
                    answer = None
                if answer is None:
                    if sentinel in ready or not self._procs[r].is_alive():
                        dead.append(r)
                    continue
                kind, rank, payload = answer
                if kind == "agree" and failing:  # a peer failed first: nothing to agree on
                    self._conns[rank].send(("abort",))
                    continue
                if kind == "agree":  # every rank's value, then all of them back to every rank
                    agree[rank] = payload
                    if len(agree) == self.ep_size:
                        message = ForkingPickler.dumps(
                            ("agreed", [agree[i] for i in range(self.ep_size)]))
                        for c in self._conns:
                            c.send_bytes(message)
                        agree.clear()
                    continue
                got[rank] = (kind, payload)
                if kind not in ("ready", "ok", "aborted"):
                    deadline = min(deadline, time.monotonic() + GRACE_S)
                    failing = True
                    for waiting_rank in agree:  # they wait for a value that will not come
                        self._conns[waiting_rank].send(("abort",))
                    agree.clear()
            if dead:
                raise RankCrashed(f"{what}: rank process(es) {sorted(dead)} died"
                                  + "".join(self._tail(r) for r in sorted(dead)))
        failed = [r for r in sorted(got) if got[r][0] not in ("ready", "ok", "aborted")]
        if not failed:
            return [got[r][1] for r in range(self.ep_size)]
        kind, text = got[failed[0]]
        kinds = {k for k, _ in got.values()} - {"aborted"}
        if len(got) == self.ep_size and kinds == {"sizing"}:  # all refused the same values
            raise RemoteSizingError(f"rank {failed[0]}: {text}")
        if len(got) == self.ep_size and kinds == {"engine"}:  # all raised before any kernel
            raise RemoteEngineError(f"rank {failed[0]}: {text}")
        if len(got) == self.ep_size and kinds <= {"refused", "ok"}:  # 0.7.4 refused, in step
            raise RemoteRefused(f"{what}: rank {failed[0]}: {text}")
        cls = {"cuda": RemoteKernelFault, "error": RemoteError}.get(kind, RankCrashed)
        exc = cls(f"{what}: rank {failed[0]} failed ({kind}): {text}" + self._tail(failed[0]))
        exc.in_step = len(got) == self.ep_size and "cuda" not in kinds  # every rank answered
        raise exc

    def run(self, world, policy_spec: str, bypass=False) -> None:
        """Run one world on every rank with our kernel driver and the policy's runtimes.
        ``bypass``: False validates on the CPU first; True launches the policy's values
        unchecked; a list gives each rank's value directly."""
        if (world.moe.dispatch_bytes > self.max_dispatch_bytes
                or world.moe.combine_bytes > self.max_combine_bytes):
            raise ValueError(f"{world.moe} needs more bytes per token than the pool's "
                             f"workspaces hold ({self.max_dispatch_bytes} dispatch)")
        problems = [p for r in self._send("rule", world, policy_spec, bypass) for p in r]
        if problems:
            raise RemoteMismatch("; ".join(problems))

    def run_engine(self, body, world, engine_spec: str, bypass=False, ctx=None) -> List[dict]:
        """Run one world through an engine's own dispatcher on every rank: ``body`` is that
        engine's rank body (a module-level function, sent by reference and imported by each
        rank: ``dispatcher.sglang.rank_body.run_example``), called on each rank as
        ``body(state, rank, ep_size, world, engine_spec, bypass, ctx)``; the pool names no
        engine. ``ctx`` is the engine's context of the step (e.g. an ``SGLangContext``;
        default eager decode). Returns each rank's record (the runtimes all ranks passed, the
        cap and workspace the engine built); raises ``RemoteMismatch`` when the output, or the
        counts, are not the reference's."""
        if not callable(body) or "<" in getattr(body, "__qualname__", "<"):
            raise TypeError(f"the rank body must be a module-level function, got {body!r}")
        results = self._send("engine", world, engine_spec, bypass, ctx, body=body)
        problems = [p for r in results for p in r["problems"]]
        if problems:
            raise RemoteMismatch("; ".join(problems))
        return results

    def run_sequence(self, worlds, policy_spec: str) -> List[List[str]]:
        """Rounds of ``worlds`` (one workspace: one cap, one MoE layer) back to back on every
        rank (``pool_sequence.py``): the policy's runtimes agreed and validated for every round
        before any kernel, then no agreement or host sync between rounds. Returns each round's
        problems on every rank (empty: exact); the caller decides which a hazard explains."""
        first = worlds[0]
        if any((w.ep_size, w.max_num_tokens, w.moe) != (first.ep_size, first.max_num_tokens,
                                                         first.moe) for w in worlds):
            raise ValueError("the rounds of a sequence share the ranks, the cap and the MoE layer")
        if (first.moe.dispatch_bytes > self.max_dispatch_bytes
                or first.moe.combine_bytes > self.max_combine_bytes):
            raise ValueError(f"{first.moe} needs more bytes per token than the pool's "
                             f"workspaces hold ({self.max_dispatch_bytes} dispatch)")
        per_rank = self._send("sequence", tuple(worlds), policy_spec, False)
        return [[p for rank in per_rank for p in rank[n]] for n in range(len(worlds))]

    def _send(self, kind, world, spec, bypass, *extra, body=None) -> list:
        first = world[0] if isinstance(world, tuple) else world  # a sequence: its first round
        if first.ep_size != self.ep_size:
            raise ValueError(f"pool has {self.ep_size} ranks, world needs {first.ep_size}")
        try:
            head = (kind, body) if body is not None else (kind,)
            message = ForkingPickler.dumps((*head, world, spec, bypass, *extra))  # once for all
            self._in_flight = True  # until every rank has answered (or the pool is rebuilt)
            for conn in self._conns:  # a few KiB into an idle pipe: never blocks
                conn.send_bytes(message)
            answers = self._collect(self.timeout, "example")
            self._in_flight = False
            return answers
        except (RemoteSizingError, RemoteEngineError, RemoteRefused):
            self._in_flight = False
            raise  # every rank refused together, before any kernel: they are still in step
        except RemoteError as exc:
            if getattr(exc, "in_step", False):
                self._in_flight = False
                raise  # every rank answered and its device is idle: the pool is still usable
            self._rebuild()
            raise
        except (RankPoolError, OSError) as exc:
            self._rebuild()
            if isinstance(exc, OSError):  # a rank's pipe broke: it died before reading
                raise RankCrashed(f"example: a rank's pipe broke ({exc})") from exc
            raise

    def _rebuild(self):
        self._stop(graceful=False)  # a rank may be stuck in a collective with a dead peer
        self.restarts += 1
        self._start()

    def close(self, graceful: bool = True):
        """Ask the ranks to exit (each gets 10 s), or kill them at once (``graceful=False``, or
        an example left unanswered: a Ctrl-C, or a watch's stop, came while the ranks ran it,
        and they may wait in the agreement or a kernel for a peer that will never come:
        asked, each would use up its 10 s); the ranks' log folder goes with the pool."""
        self._stop(graceful and not self._in_flight)
        shutil.rmtree(self._logs, ignore_errors=True)

    def _stop(self, graceful: bool):
        for conn in self._conns if graceful else ():
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            if graceful:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for conn in self._conns:
            conn.close()
