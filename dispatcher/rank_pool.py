"""One OS process per EP rank, started once and fed worlds by queue (multi-GPU tier).

Rank ``r`` runs on GPU ``r % n_gpus``. The process group is NCCL when every rank has its own
GPU and gloo when ranks outnumber GPUs (NCCL refuses two ranks on one GPU); a gloo group is
always there for the CPU agreement. For each world every rank computes its own runtime with
the policy under test from its own ``RankView`` (as production does), then all ranks
all-gather (runtime, rows, world) on the CPU and validate together before any kernel is
launched; a rank that would launch alone would leave its peers spinning ~300 s and then trap.
Every wait has a timeout. A remote failure comes back as its own exception type; a crashed
rank, a timeout or a dead CUDA context fails that example and the pool is rebuilt.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.multiprocessing as mp

__all__ = ["RankPool", "RankPoolError", "RankCrashed", "RankTimeout", "RemoteMismatch",
           "RemoteSizingError", "RemoteKernelFault", "RemoteError", "RankResult"]

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# The multi-GPU workspaces are allocated once per cap and sized for the largest MoE shape the
# multi-GPU strategy draws (hidden <= MAX_HIDDEN bf16, top_k <= MAX_TOP_K); smaller shapes fit.
MAX_HIDDEN, MAX_TOP_K = 256, 8


class RankPoolError(AssertionError):
    """Base for failures reported by the pool."""


class RankCrashed(RankPoolError):
    pass


class RankTimeout(RankPoolError):
    pass


class RemoteMismatch(RankPoolError):
    """The real kernels returned something other than the reference."""


class RemoteSizingError(RankPoolError):
    """The ranks' agreed validation refused the runtime (no kernel was launched)."""


class RemoteKernelFault(RankPoolError):
    """A CUDA error on a rank: its context is dead; the pool is rebuilt."""


class RemoteError(RankPoolError):
    """A Python exception on a rank (e.g. a FlashInfer argument check); ranks stay up."""


@dataclass(frozen=True)
class RankResult:
    rank: int
    runtime: int
    ok: bool
    problems: tuple
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, ep_size: int, port: int, n_gpus: int, inbox, outbox):
    os.environ.update(SAFE_ENV)
    try:
        import datetime

        import numpy as np
        import torch
        import torch.distributed as dist

        from . import torch_ops
        from .dispatcher import A2ASizingError, validate
        from .flashinfer_a2a import metainfo_index
        from .inputs import make_inputs, reference_outputs
        from .emulator import POISON, expected_recv_counts
        from .policies import load_policy
        from .workspace import aux_offsets, dispatch_payloads, workspace_size_per_rank

        torch.cuda.set_device(rank % n_gpus)
        backend = "nccl" if ep_size <= n_gpus else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ep_size, timeout=datetime.timedelta(seconds=120),
                                device_id=torch.device("cuda", rank % n_gpus) if backend == "nccl" else None)
        cpu = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
        from flashinfer.comm.mnnvl import MnnvlConfig, TorchDistBackend
        from .flashinfer_a2a import new_moe_alltoall

        index = metainfo_index()
        a2as: Dict[int, object] = {}
        policies: Dict[str, object] = {}
        outbox.put(("ready", rank, backend))
        while True:
            msg = inbox.get()
            if msg is None:
                break
            world, spec, bypass = msg
            t0 = time.perf_counter()
            try:
                if spec not in policies:
                    policies[spec] = load_policy(spec)[1]
                view = world.rank_view(rank)
                mine = policies[spec](view) if not isinstance(bypass, list) else bypass[rank]
                agreed: List[Optional[tuple]] = [None] * ep_size
                dist.all_gather_object(agreed, (mine, view.local_tokens, repr(world)), group=cpu)
                if len({a[2] for a in agreed}) != 1:
                    raise RuntimeError("ranks received different worlds")
                values = [a[0] for a in agreed]
                if bypass is False:
                    validate(values, world.views)  # same verdict on every rank
                runtime = values[rank]
                moe, cap = world.moe, world.max_num_tokens
                if cap not in a2as:  # collective: every rank reaches here for the same cap
                    size = workspace_size_per_rank(ep_size, cap, 2 * MAX_HIDDEN + 8 * MAX_TOP_K,
                                                   2 * MAX_HIDDEN)
                    from flashinfer.comm import Mapping
                    a2as[cap] = new_moe_alltoall(
                        mapping=Mapping(world_size=ep_size, rank=rank, gpus_per_node=ep_size,
                                        tp_size=ep_size, moe_ep_size=ep_size),
                        max_num_tokens=cap, top_k=MAX_TOP_K, num_experts=max(64, ep_size),
                        workspace_size_per_rank=size,
                        mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend()))
                a2a = a2as[cap]
                a2a.top_k, a2a.num_experts = moe.top_k, moe.num_experts
                aux = aux_offsets(ep_size, cap)
                own = a2a.workspace[rank]
                own[aux.payload_data:].fill_(POISON)
                torch.cuda.synchronize()
                dist.barrier(group=cpu)  # nobody writes into a peer before it is poisoned
                inputs = make_inputs(world)
                inp = inputs[rank]
                ids, *rows = torch_ops.to_torch_rows([inp.expert_ids, *inp.payload_rows], "cuda")
                specs = dispatch_payloads(moe.payload_format, moe.hidden_size, moe.top_k)
                payloads = [torch_ops.typed(t, sp.name) for t, sp in zip(rows, specs)]
                recv = a2a.dispatch(ids.view(torch.int32), payloads, runtime)
                nh = len(specs) - 2
                planes = [p.reshape(ep_size * runtime, -1) for p in recv]
                x = torch_ops.decode_hidden(planes[:nh], moe.payload_format, moe.hidden_size)
                e = planes[nh].contiguous().view(torch.int32)
                w = planes[nh + 1].contiguous().view(torch.float32)
                expected = expected_recv_counts(world, inputs)
                rc = int(a2a.metainfo[index["RECV_COUNTERS_OFFSET_INDEX"]])
                counts = own[rc:rc + 4 * ep_size].contiguous().view(torch.int32).cpu().numpy()
                problems = []
                if not np.array_equal(counts, expected[rank]):
                    problems.append(f"rank {rank} recv counts {counts.tolist()} != model "
                                    f"{expected[rank].tolist()}")
                row = torch.arange(runtime, device="cuda")
                stale = row[None, :] >= torch.as_tensor(expected[rank], device="cuda")[:, None]
                for p in recv:
                    rows = p.contiguous().view(torch.uint8).reshape(ep_size, runtime, -1)
                    if not bool(((rows == POISON).all(-1) | ~stale).all().item()):
                        problems.append(f"rank {rank}: a stray write landed past a sender's count")
                        break
                y = torch_ops.stand_in_moe(x[None], e[None], w[None],
                                           torch.tensor([rank], device="cuda"),
                                           moe.num_experts, ep_size)
                out = a2a.combine(y.view(ep_size, runtime, moe.hidden_size), runtime)
                got = out.float().cpu().numpy()
                ref = reference_outputs(world, [inp])[0]
                if got.shape != ref.shape or not np.allclose(got, ref, rtol=2.0 ** -8, atol=0):
                    bad = int((~np.isclose(got, ref, rtol=2.0 ** -8, atol=0)).any(axis=1).sum()) \
                        if got.shape == ref.shape else -1
                    problems.append(f"rank {rank}: combine output differs from the reference on "
                                    f"{bad} of {ref.shape[0]} tokens")
                outbox.put(("ok", rank, RankResult(rank, runtime, not problems, tuple(problems),
                                                   time.perf_counter() - t0)))
            except A2ASizingError as exc:
                outbox.put(("sizing", rank, f"{type(exc).__name__}: {exc}"))
            except Exception as exc:  # noqa: BLE001 - reported to the parent with its type
                text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                kind = "cuda" if ("CUDA error" in text or "illegal" in text
                                  or "AcceleratorError" in text) else "error"
                outbox.put((kind, rank, text))
                if kind == "cuda":
                    break
    except Exception as exc:  # noqa: BLE001 - start-up failure
        outbox.put(("startup", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class RankPool:
    """``ep_size`` rank processes over ``n_gpus`` GPUs, reused across examples."""

    def __init__(self, ep_size: int, n_gpus: int, timeout: float = 60.0,
                 start_timeout: float = 300.0):
        self.ep_size, self.n_gpus = ep_size, n_gpus
        self.timeout, self.start_timeout = timeout, start_timeout
        self.backend = None
        self.restarts = 0
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.ep_size)]
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, daemon=True, name=f"ep-rank-{r}",
                                   args=(r, self.ep_size, port, self.n_gpus, self._inboxes[r], self._out))
                       for r in range(self.ep_size)]
        for p in self._procs:
            p.start()
        t = time.monotonic()
        ready = self._collect(self.start_timeout, "start")
        self.backend = ready[0]
        print(f"[rank pool] {self.ep_size} ranks on {self.n_gpus} GPU(s), {self.backend}, "
              f"ready in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)

    def _collect(self, timeout: float, what: str) -> list:
        got: Dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.ep_size:
            try:
                kind, rank, payload = self._out.get(timeout=1.0)
                got[rank] = (kind, payload)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    self._rebuild()
                    raise RankCrashed(f"{what}: rank process(es) {dead} died")
                if time.monotonic() > deadline:
                    self._rebuild()
                    raise RankTimeout(f"{what}: ranks {sorted(set(range(self.ep_size)) - set(got))} "
                                      f"did not answer within {timeout:.0f} s")
        kinds = {k for k, _ in got.values()}
        if kinds <= {"ready", "ok"}:
            return [got[r][1] for r in range(self.ep_size)]
        first = next(r for r in range(self.ep_size) if got[r][0] not in ("ready", "ok"))
        kind, text = got[first]
        if kind == "sizing":
            raise RemoteSizingError(f"rank {first}: {text}")
        if kind == "error":
            raise RemoteError(f"{what}: rank {first}: {text}")
        self._rebuild()
        cls = RemoteKernelFault if kind == "cuda" else RankCrashed
        raise cls(f"{what}: rank {first} failed ({kind}): {text}")

    def run(self, world, policy_spec: str, bypass=False) -> List[RankResult]:
        """Run one world on every rank. ``bypass``: False validates on the CPU first; True
        launches the policy's values unchecked; a list gives each rank's value directly."""
        if world.ep_size != self.ep_size:
            raise ValueError(f"pool has {self.ep_size} ranks, world needs {world.ep_size}")
        for box in self._inboxes:
            box.put((world, policy_spec, bypass))
        results = self._collect(self.timeout, "example")
        problems = [p for r in results for p in r.problems]
        if problems:
            raise RemoteMismatch("; ".join(problems))
        return results

    def _rebuild(self):
        self.close()
        self.restarts += 1
        self._start()

    def close(self):
        for box in self._inboxes:
            try:
                box.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
