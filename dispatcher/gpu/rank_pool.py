"""One OS process per EP rank, started once and fed worlds by pipe (multi-GPU tier).

Rank ``r`` runs on GPU ``r % n_gpus``. The process group is NCCL when every rank has its own
GPU and gloo when ranks outnumber GPUs (NCCL refuses two ranks on one GPU); a gloo group is
always there for the CPU side of ``MoeAlltoAll``'s bootstrap and SGLang's code. For each
world every rank computes its own runtime with the policy under test from its own
``RankView`` (as production does), then every rank gets every rank's (runtime, world)
through the parent, and all validate together before any kernel is launched; a rank that
would launch alone would leave its peers spinning ~300 s and then trap.

Every wait has a timeout. A remote failure comes back as its own exception type and fails
that example. The pool is rebuilt only when it is broken (a rank crashed, timed out or has a
dead CUDA context); a failure every rank answered leaves it in step, and a rank that fails
before the agreement has its waiting peers' agreement called off (``AgreementAborted``). A
pool that cannot start raises ``PoolStartFailed`` once, with the rank's own words. Without a
GPU (``emulated=True``) the ranks run over gloo on the exact CPU model of the A2A. Each rank's stderr goes to a log whose tail is quoted when the rank dies, so a
CUDA fault's text is never lost; the parent waits on the ranks' pipes and process sentinels
together, so a death is seen when it happens; ranks exit by themselves when their parent is
gone.

Ranks are forked from a ``forkserver`` that has imported torch once (CUDA is never initialised
in it): a spawned rank paid the interpreter and torch imports on every start, a rebuild too.
The ready line says where a start's seconds went (the slowest rank's phases).
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List

from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

from ..model.generations import active, using
from . import env

__all__ = ["RankPool", "RankPoolError", "PoolStartFailed", "RankCrashed", "RankTimeout",
           "RemoteMismatch", "RemoteSizingError", "RemoteEngineError", "RemoteRefused",
           "RemoteKernelFault", "RemoteError"]

GRACE_S = 5.0  # once one rank has failed, how long the others get to answer
AGREE_TIMEOUT_S = 300.0  # a rank's wait for the others' values (the parent gives up sooner)
PROFILE_ENV = "A2A_GATE_PROFILE_RANKS"  # a directory: each rank writes its cProfile there


class RankPoolError(AssertionError):
    """Base for failures reported by the pool."""


class PoolStartFailed(RankPoolError):
    """The ranks could not start (bad environment, NCCL, FlashInfer); not retried."""


class RankCrashed(RankPoolError):
    pass


class AgreementAborted(RuntimeError):
    """On a rank: the parent called off the agreement because a peer failed first."""


class RankTimeout(RankPoolError):
    pass


class RemoteMismatch(RankPoolError):
    """The real kernels returned something other than the reference."""


class RemoteSizingError(RankPoolError):
    """The ranks' agreed validation refused the runtime (no kernel was launched)."""


class RemoteRefused(RankPoolError):
    """FlashInfer 0.7.4's dispatch op refused a rank's call (its own rows exceed its runtime);
    the ranks it accepted would wait on it until ``timeout_sec`` and trap. The pool reports it
    with the world and keeps every rank in step (none is left spinning)."""


class RemoteKernelFault(RankPoolError):
    """A CUDA error on a rank: its context is dead; the pool is rebuilt."""


class RemoteEngineError(RankPoolError):
    """The engine's own code (SGLang's dispatch()) raised on every rank before any kernel
    launched: the ranks are still in step, the pool is kept."""


class RemoteError(RankPoolError):
    """A Python exception on a rank (e.g. a FlashInfer argument check). The pool is kept when
    every rank answered (each rank waits for its own kernels first, so none is left in one);
    rebuilt when a rank did not answer: it may wait in a collective the failed rank never
    reached."""


def _is_cuda_fault(exc: BaseException, text: str) -> bool:
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "illegal" in text


# What the forkserver imports once, before any rank is forked from it (nothing here touches
# CUDA: a forked child of a process with a CUDA context could not use CUDA).
PRELOAD = ["torch", "torch.distributed", __name__]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker(rank: int, ep_size: int, port: int, n_gpus: int, max_dispatch_bytes: int,
            max_combine_bytes: int, log: str, parent: int, conn, sent_at: float,
            emulated: bool = False):
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
    state.update(conn=conn, rank=rank, parent=parent, server=server)
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
                if os.getppid() != server or not _alive(parent):  # the pytest worker is gone
                    return  # free the GPU
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind, generation, *example = msg
        try:
            with using(generation):  # the FlashInfer generation the parent's test models
                if kind == "sglang":
                    result = _run_sglang_example(state, rank, ep_size, *example)
                elif state["emulated"]:
                    result = _run_emulated_example(state, rank, ep_size, *example)
                elif state["kernel"] == "one_sided":
                    result = _run_example_074(state, rank, ep_size, *example)
                else:
                    result = _run_example(state, rank, ep_size, max_dispatch_bytes,
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

            if isinstance(exc, (RankRefused, RankRefused074)):  # 0.7.4: nothing launched
                conn.send(("refused", rank, text))
                continue
            if kind == "sglang" and not state["example"].get("launched"):
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
    from ..model.generations import generation_of, installed_version

    installed = generation_of(installed_version() or "0.7.2")
    torch.cuda.set_device(rank % n_gpus)
    torch.cuda.init()
    t = phase("cuda", t)
    backend = "nccl" if ep_size <= n_gpus else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep_size, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank % n_gpus) if backend == "nccl" else None)
    cpu = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    t = phase("process group", t)
    if installed.kernel == "one_sided":
        from .single_074 import layout_index as metainfo_index
    else:
        from .flashinfer import metainfo_index
    index = metainfo_index()
    phase("flashinfer", t)
    return {"backend": backend, "cpu": cpu, "index": index, "a2as": {},
            "policies": {}, "engines": {}, "example": {}, "emulated": False,
            "generation": installed.version, "kernel": installed.kernel}


def _agree(state, value, key: int = 0) -> list:
    """Every rank's ``value`` (each rank passes its own), with ``key`` checked equal on every
    rank, carried by the parent, which talks to every rank already: each rank sends its own
    and the parent answers every rank with all of them once all have come (a pipe round trip
    each way, where a rank waited ~1.3 ms an example in gloo all-gathers). Also a barrier: no
    rank leaves before every rank has arrived. Values travel pickled, as ``all_gather_object``
    sends them: the parent relays bytes and never builds a rank's object (a tensor a rule
    returns stays the ranks')."""
    conn = state["conn"]
    conn.send(("agree", state["rank"], pickle.dumps((value, key))))
    waited = 0.0
    while not conn.poll(1.0):
        waited += 1.0
        if (waited > AGREE_TIMEOUT_S or os.getppid() != state["server"]
                or not _alive(state["parent"])):
            raise TimeoutError(f"no agreement from the parent within {waited:.0f} s")
    msg = conn.recv()
    if msg == ("abort",):
        raise AgreementAborted("a peer failed before the agreement: this rank launched nothing")
    if not (isinstance(msg, tuple) and msg[0] == "agreed"):
        raise RuntimeError(f"expected the ranks' agreement, the parent sent {msg!r}")
    pairs = [pickle.loads(b) for b in msg[1]]
    if len({k for _, k in pairs}) != 1:
        raise RuntimeError("ranks received different worlds or hold different workspaces")
    return [v for v, _ in pairs]


def _rank_value(state, rank: int, world, spec: str, bypass):
    """This rank's runtime: the policy's value for its view (the policy loaded once per rank
    process), or ``bypass[rank]`` when the caller hands each rank its value."""
    if isinstance(bypass, list):
        return bypass[rank]
    from ..model.properties import for_world
    from ..policies import load_policy

    policies = state["policies"]
    if spec not in policies:
        policies[spec] = load_policy(spec)[1]
    return for_world(policies[spec], world)(world.rank_view(rank))


def _run_example(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, world, spec,
                 bypass) -> List[str]:
    import zlib

    import numpy as np
    import torch

    from ..emulator.a2a import POISON, expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..model.validation import require_int, validate
    from ..model.workspace import aux_offsets, workspace_size_per_rank
    from . import torch_ops
    from .checks import poisoned_rows, rank_problems, stale_rows_ok
    from .flashinfer import new_moe_alltoall

    a2as = state["a2as"]
    mine = _rank_value(state, rank, world, spec, bypass)
    moe, cap = world.moe, world.max_num_tokens
    aux = aux_offsets(ep_size, cap)

    def poison():
        a2as[cap].workspace[rank][aux.payload_data:].fill_(POISON)
        torch.cuda.synchronize()
    known = cap in a2as
    if known:  # poisoned before the agreement, which is then also the barrier: the parent sends
        poison()  # an example only when every rank has finished the last, so no peer still reads it
    key = zlib.crc32(repr(world).encode()) << 1 | known
    values = _agree(state, mine, key)
    if bypass is False:
        validate(values, world.views)  # the same verdict on every rank
    runtime = require_int(values[rank])
    if not known:  # collective: every rank reaches here for the same cap
        size = workspace_size_per_rank(ep_size, cap, max_dispatch_bytes, max_combine_bytes)
        a2as[cap] = new_moe_alltoall(ep_size, rank, cap, top_k=8,
                                     num_experts=max(64, ep_size), workspace_size_per_rank=size)
        poison()
        _agree(state, None)  # a barrier: nobody writes into a peer before it is poisoned
    a2a = a2as[cap]
    a2a.top_k, a2a.num_experts = moe.top_k, moe.num_experts
    rc = int(a2a.metainfo[state["index"]["RECV_COUNTERS_OFFSET_INDEX"]])
    inputs = make_inputs(world)
    inp = inputs[rank]
    ids, *rows = torch_ops.to_torch_rows([inp.expert_ids, *inp.payload_rows], "cuda")
    payloads = [torch_ops.typed(t, sp.name) for t, sp in zip(rows, moe.payloads)]
    recv = a2a.dispatch(ids.view(torch.int32), payloads, runtime)
    counts = a2a.workspace[rank][rc:rc + 4 * ep_size].clone()  # as dispatch left them
    y = torch_ops.expert_outputs(recv, runtime, moe, rank, ep_size)
    out = a2a.combine(y, runtime)
    poisoned = poisoned_rows(recv)
    # the host's half while the GPU works; then the answers in one copy
    expected = expected_recv_counts(world, inputs)[rank]
    reference = reference_outputs(world, [inp])[0]
    host_counts, host_poisoned, host_out = torch_ops.read_back([counts, poisoned, out])
    return rank_problems(rank, bool(stale_rows_ok(host_poisoned, expected, runtime)), runtime,
                         host_counts.view(np.int32), expected, host_out, reference)


def _run_example_074(state, rank, ep_size, world, spec, bypass) -> List[str]:
    """``_run_example`` on FlashInfer 0.7.4: each rank's ``NVLinkOneSidedAlltoAll`` (one per
    cap and MoE shape: 0.7.4 bakes top_k and the payload bytes into the layout), built over the
    pool's process group as an engine builds it, fence path, a short ``timeout_sec``. A call
    0.7.4 refuses (a rank's rows over its runtime) is agreed on before any launch: the refused
    rank makes the call, FlashInfer refuses it, and no peer launches (none is left spinning)."""
    import zlib

    import numpy as np
    import torch
    from flashinfer.moe_ep import (BootstrapConfig, MoEEpCommParams, NVLinkOneSidedAlltoAll,
                                   NVLinkOneSidedConfig)

    from ..emulator.a2a import expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..model.validation import require_int, validate
    from . import torch_ops
    from .checks import poisoned_rows, rank_problems, stale_rows_ok
    from .single_074 import INVALID_EXPERT_ID, TIMEOUT_S

    a2as = state["a2as"]
    mine = _rank_value(state, rank, world, spec, bypass)
    moe, cap = world.moe, world.max_num_tokens
    shape = (cap, moe.top_k, moe.hidden_size, moe.payload, moe.num_experts)
    known = shape in a2as
    idx = state["index"]
    if known:  # poisoned before the agreement, which is also the barrier (as in _run_example)
        _poison_074(a2as[shape]["a2a"], rank, idx)
    key = zlib.crc32(repr(world).encode()) << 1 | known
    values = _agree(state, mine, key)
    if bypass is False:
        validate(values, world.views)  # the same verdict on every rank
    runtime = require_int(values[rank])
    if not known:  # collective: every rank builds the same shape's object together
        params = MoEEpCommParams(num_experts=moe.num_experts, top_k=moe.top_k,
                                 max_tokens_per_rank=cap, hidden_size=moe.hidden_size,
                                 dtype=torch.bfloat16, invalid_expert_id=INVALID_EXPERT_ID)
        if state.get("a2a_path") != "shared workspace":
            try:  # the class an engine builds (its platform check is collective: all or none)
                a2a = NVLinkOneSidedAlltoAll(
                    BootstrapConfig(world_size=ep_size, rank=rank,
                                    device=torch.cuda.current_device()),
                    params, NVLinkOneSidedConfig(timeout_sec=TIMEOUT_S, cft=False, lamport=False))
                state["a2a_path"] = "NVLinkOneSidedAlltoAll"
            except RuntimeError as exc:
                if "NVLink backends are not supported" not in str(exc):
                    raise
                state["a2a_path"] = "shared workspace"  # one GPU, no P2P NVLink: its raw ops
                print(f"[rank {rank}] NVLinkOneSidedAlltoAll refused this host ({exc}); its "
                      f"raw ops run on one CUDA-IPC-shared workspace instead", file=sys.stderr)
        if state["a2a_path"] == "shared workspace":
            a2a = _shared_workspace_074(state, rank, ep_size, moe, cap)
        a2as[shape] = {"a2a": a2a}
        _poison_074(a2a, rank, idx)
        _agree(state, None)  # a barrier: nobody writes into a peer before it is poisoned
    entry = a2as[shape]
    a2a = entry["a2a"]
    inputs = make_inputs(world)
    inp = inputs[rank]
    ids, *rows = torch_ops.to_torch_rows([inp.expert_ids, *inp.payload_rows], "cuda")
    payloads = [torch_ops.typed(t, sp.name) for t, sp in zip(rows, moe.payloads)]
    hidden, scale = payloads[0], (payloads[1] if len(payloads) == 4 else None)
    refused = [r for r in range(ep_size) if world.rows_per_rank[r] > values[r]]
    if refused:  # only the refused ranks call: FlashInfer refuses them before any launch
        if rank in refused:
            try:
                a2a.dispatch(hidden, ids.view(torch.int32), payloads[-1],
                             hidden_states_scale=scale, runtime_max_tokens_per_rank=runtime)
            except Exception as exc:  # noqa: BLE001 - TVM-FFI raises its own error types
                raise RankRefused074(rank, world.rows_per_rank[rank], runtime, exc) from None
            raise AssertionError(f"FlashInfer 0.7.4 launched rank {rank} with "
                                 f"{world.rows_per_rank[rank]} rows and runtime {runtime}")
        raise RankRefused074(refused[0], world.rows_per_rank[refused[0]], values[refused[0]],
                             "refused on its own rank; this rank launched nothing")
    res = a2a.dispatch(hidden, ids.view(torch.int32), payloads[-1], hidden_states_scale=scale,
                       runtime_max_tokens_per_rank=runtime)
    counts = _round_counts_074(a2a.workspace[rank], a2a.metainfo, idx, ep_size)
    planes = [res.hidden_states] + ([res.hidden_states_scale] if scale is not None else [])
    recv = [p.view(ep_size, runtime, -1) for p in planes + [res.topk_ids, res.topk_weights]]
    y = torch_ops.expert_outputs(recv, runtime, moe, rank, ep_size)
    out = a2a.combine(y)
    # the fence path sanitizes the expert ids of padding rows (-1): the other planes stay poison
    poisoned = poisoned_rows([p for i, p in enumerate(recv) if i != len(planes)])
    expected = expected_recv_counts(world, inputs)[rank]
    reference = reference_outputs(world, [inp])[0]
    host_counts, host_poisoned, host_out = torch_ops.read_back([counts, poisoned, out])
    return rank_problems(rank, bool(stale_rows_ok(host_poisoned, expected, runtime)), runtime,
                         host_counts.view(np.int32), expected, host_out, reference)


def _poison_074(a2a, rank: int, idx) -> None:
    """POISON in this rank's dispatch and combine regions (never the counters or flags)."""
    import torch

    from ..emulator.a2a import POISON

    for name in ("DISPATCH_PAYLOAD", "COMBINE_INPUT"):
        at = int(a2a.metainfo[idx[f"{name}_OFFSET_INDEX"]])
        a2a.workspace[rank][at:at + int(a2a.metainfo[idx[f"{name}_SIZE_INDEX"]])].fill_(POISON)
    torch.cuda.synchronize()


def _round_counts_074(rank_bytes, metainfo, idx, ep_size):
    """This round's receive counts (int32 [W] as bytes, on the device): 0.7.4 keeps two banks
    and the round's is picked by ``flag_val`` as the kernel picks it (never a count of our own,
    which a refused call would put out of step)."""
    import torch

    fv = int(metainfo[idx["FLAG_VAL_OFFSET_INDEX"]])
    rc = int(metainfo[idx["RECV_COUNTERS_OFFSET_INDEX"]])
    flag = rank_bytes[fv:fv + 4].view(torch.int32).long()
    bank = ((flag - 1) >> 1) & 1
    banks = rank_bytes[rc:rc + 8 * ep_size].view(torch.int32).view(2, ep_size)
    return banks.index_select(0, bank).reshape(-1).contiguous().view(torch.uint8)


def _shared_workspace_074(state, rank, ep_size, moe, cap):
    """0.7.4's raw ops on one workspace allocated by rank 0 and mapped into every rank by CUDA
    IPC (all ranks on one GPU), laid out and initialised as NVLinkOneSidedAlltoAll does
    (collective: every rank calls it for the same shape)."""
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from .checks import GUARD, GUARD_BYTE
    from .single_074 import RawA2A074, flashinfer_layout, layout_index, module

    meta = flashinfer_layout(ep_size, cap, moe.top_k, moe.dispatch_bytes, moe.combine_bytes)
    size = int(meta[layout_index()["WORKSPACE_SIZE_INDEX"]])
    box = [None]
    if rank == 0:
        full = torch.empty((ep_size, size + GUARD), dtype=torch.uint8, device="cuda")
        full[:, size:] = GUARD_BYTE
        torch.cuda.synchronize()
        box = [pickle.dumps(reduce_tensor(full))]
    dist.broadcast_object_list(box, src=0, group=state["cpu"])
    if rank != 0:
        rebuild, args = pickle.loads(box[0])
        full = rebuild(*args)
    module().moe_a2a_initialize(full[:, :size], meta, rank, ep_size)
    torch.cuda.synchronize()
    dist.barrier(group=state["cpu"])  # no peer publishes before every rank cleared its slice
    from flashinfer.utils import device_support_pdl

    return RawA2A074(full, meta, rank, ep_size, moe.top_k, moe.num_experts, moe.hidden_size,
                     bool(device_support_pdl(torch.device("cuda", torch.cuda.current_device()))))


class RankRefused074(RuntimeError):
    """FlashInfer 0.7.4 refused this round on some rank before any launch."""

    def __init__(self, refused_rank, rows, runtime, why):
        super().__init__(f"FlashInfer 0.7.4 refused rank {refused_rank} ({rows} rows, runtime "
                         f"{runtime}): {str(why).splitlines()[-1][:200]}; no peer launched "
                         f"(each would wait timeout_sec and trap)")


def _run_emulated_example(state, rank, ep_size, world, spec, bypass) -> List[str]:
    """``_run_example`` without a GPU: the same policy call, agreement and validation; each
    rank's tokens then travel to every rank over the process group (gloo), and every rank runs
    the exact CPU model of FlashInfer's dispatch and combine (``emulator.a2a``) on them and
    checks its own received counts, stray writes and combined output."""
    import zlib

    import torch.distributed as dist

    from ..emulator.a2a import round_trip
    from ..emulator.inputs import make_inputs
    from ..model.validation import require_int, validate
    from .checks import rank_problems

    mine = _rank_value(state, rank, world, spec, bypass)
    values = _agree(state, mine, zlib.crc32(repr(world).encode()))
    if bypass is False:
        validate(values, world.views)
    runtimes = [require_int(v) for v in values]
    cap = world.max_num_tokens  # what FlashInfer 0.7.2 itself checks, as it checks it:
    if runtimes[rank] <= 0:  # the C++ op
        raise RuntimeError(f"runtime_max_tokens_per_rank must be positive, got {runtimes[rank]}")
    if active().checks_local_rows and runtimes[rank] > cap:  # 0.7.4: the class and the op
        raise ValueError(f"runtime_max_tokens_per_rank={runtimes[rank]} must be in (0, {cap}]")
    assert runtimes[rank] <= cap, (  # 0.7.2: MoeAlltoAll.dispatch's Python assert
        f"runtime_max_tokens_per_rank={runtimes[rank]} > max_num_tokens={cap}")
    gathered = [None] * ep_size
    dist.all_gather_object(gathered, make_inputs(world)[rank], group=state["cpu"])
    trip = round_trip(world, runtimes, gathered)
    stray = not any(e.target_rank == rank for e in trip.events)
    return rank_problems(rank, stray, runtimes[rank], trip.recv_counts[rank],
                         trip.expected_counts[rank], trip.outputs[rank], trip.reference[rank])


def _run_sglang_example(state, rank, ep_size, world, spec, bypass, ctx=None) -> dict:
    """SGLang's own ``FlashinferDispatcher`` on this rank, end to end on the real kernels (or,
    in a pool without a GPU, on the emulated ``MoeAlltoAll`` of ``emulated.py``):
    its ``__init__`` builds its ``MoeAlltoAll`` (over the pool's group), its ``dispatch()``
    launches the real dispatch kernel with the runtime it computes, the stand-in experts run
    on what arrived, its ``combine()`` returns the result, checked against the reference."""
    import numpy as np
    import torch

    from ..emulator.a2a import POISON, expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..model.sglang_context import SGLangContext
    from ..model.workspace import aux_offsets
    from ..sglang.loader import release_from_spec
    from ..sglang.standins import StandardTopKOutput
    from . import torch_ops
    from .checks import rank_problems

    engines, cpu = state["engines"], state["cpu"]
    if spec not in engines:
        release = release_from_spec(spec.partition(":")[2],
                                    flashinfer="emulated" if state["emulated"] else "real")
        release.process_group = cpu
        engines[spec] = release
    release, ctx = engines[spec], ctx or SGLangContext()
    state["example"] = {"world": world, "bypass": bypass, "values": None, "launched": False}
    emulated = state["emulated"]
    device = "cpu" if emulated else "cuda"
    inputs = make_inputs(world)
    inp = inputs[rank]
    x = torch.from_numpy(inp.x).to(device, torch.bfloat16)
    ids = torch.from_numpy(inp.expert_ids).to(device)
    weights = torch.from_numpy(inp.weights).to(device)
    with release.as_rank(world, rank, ctx):
        d = release.dispatcher(world, rank, ctx)  # collective the first time a shape is seen
        a2a = d.moe_a2a
        _agree_before_launch(a2a, state, ep_size)
        if not emulated:  # the model's planes start poisoned for every call
            a2a.workspace[rank][aux_offsets(ep_size, a2a.max_num_tokens).payload_data:].fill_(POISON)
            torch.cuda.synchronize()  # poisoned before the agreement inside dispatch(), a barrier
        out = d.dispatch(x, StandardTopKOutput(weights, ids, None))
        runtime = state["example"]["values"][rank]
        topk = out.topk_output
        y = torch_ops.stand_in_moe(out.hidden_states.float()[None], topk.topk_ids[None],
                                   topk.topk_weights[None], torch.tensor([rank], device=device),
                                   world.moe.num_experts, ep_size)[0]
        result = d.combine(release.module.FlashinferCombineInput(y))
    expected = expected_recv_counts(world, inputs)[rank].copy()
    reference = reference_outputs(world, [inp])[0]
    if emulated:
        counts, output = a2a.last_recv_counts.astype(np.int32), torch_ops.read_back([result])[0]
    else:
        rc = int(a2a.metainfo[state["index"]["RECV_COUNTERS_OFFSET_INDEX"]])
        counts, output = torch_ops.read_back([a2a.workspace[rank][rc:rc + 4 * ep_size], result])
        counts = counts.view(np.int32)
    if world.rows_per_rank[rank] == 0 and counts[rank] == 1:
        expected[rank] = 1  # releases before 0.5.15 send one dummy token to themselves
    problems = rank_problems(rank, None, runtime, counts, expected, output, reference)
    return {"problems": problems, "values": state["example"]["values"],
            "max_num_tokens": a2a.max_num_tokens,
            "workspace_size_per_rank": a2a.workspace_size_per_rank}


def _agree_before_launch(a2a, state, ep_size):
    """Wrap this ``MoeAlltoAll``'s ``dispatch`` (FlashInfer's object, not SGLang's code):
    every rank all-gathers the runtime SGLang passes and, unless bypassed, validates it on
    the CPU before the kernel; a rank launching alone would leave its peers spinning."""
    if getattr(a2a, "_a2a_gate_agreed", False):
        return
    from ..model.validation import validate

    launch = a2a.dispatch

    def dispatch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k):
        example = state["example"]
        example["launched"] = True  # from here on ranks wait for each other
        agreed = _agree(state, runtime_max_tokens_per_rank)
        example["values"] = agreed
        if example["bypass"] is False:
            validate(agreed, example["world"].views)
        return launch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k)
    a2a.dispatch = dispatch
    a2a._a2a_gate_agreed = True


class RankPool:
    """``ep_size`` rank processes over ``n_gpus`` GPUs, reused across examples. The workspace
    of each cap is sized for ``max_dispatch_bytes`` / ``max_combine_bytes`` per token."""

    def __init__(self, ep_size: int, n_gpus: int, max_dispatch_bytes: int,
                 max_combine_bytes: int, timeout: float = 60.0, start_timeout: float = 300.0,
                 emulated: bool = False):
        self.ep_size, self.n_gpus, self.emulated = ep_size, n_gpus, emulated
        self.max_dispatch_bytes, self.max_combine_bytes = max_dispatch_bytes, max_combine_bytes
        self.timeout, self.start_timeout = timeout, start_timeout
        self.backend = None
        self.restarts = 0
        self._procs: list = []
        self._conns: list = []  # the parent's end of each rank's pipe
        self._logs = Path(tempfile.mkdtemp(prefix="a2a-gate-ranks-"))
        self._start()

    def _start(self):
        import torch.multiprocessing as mp  # here: the parent's protocol needs no torch

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first pool
        pipes = [ctx.Pipe() for _ in range(self.ep_size)]
        self._conns = [mine for mine, _ in pipes]
        port = env.free_port()
        t, sent_at = time.monotonic(), time.time()
        self._procs = [ctx.Process(
            target=_worker, daemon=True, name=f"ep-rank-{r}",
            args=(r, self.ep_size, port, self.n_gpus, self.max_dispatch_bytes,
                  self.max_combine_bytes, str(self._log(r)), os.getpid(), pipes[r][1],
                  sent_at, self.emulated)) for r in range(self.ep_size)]
        for p in self._procs:
            p.start()
        for _, theirs in pipes:
            theirs.close()  # the rank holds its end: a dead rank then reads as EOF here
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

    def run_sglang(self, world, sglang_spec: str, bypass=False, ctx=None) -> List[dict]:
        """Run one world through SGLang's own dispatcher on every rank (``sglang:...``):
        its dispatch() and combine() on the real kernels, in context ``ctx`` (an
        ``SGLangContext``; default eager decode). Returns each rank's record (the
        runtimes all ranks passed, the cap and workspace SGLang built); raises
        ``RemoteMismatch`` when the output, or the counts, are not the reference's."""
        results = self._send("sglang", world, sglang_spec, bypass, ctx)
        problems = [p for r in results for p in r["problems"]]
        if problems:
            raise RemoteMismatch("; ".join(problems))
        return results

    def _send(self, kind, world, spec, bypass, *extra) -> list:
        if world.ep_size != self.ep_size:
            raise ValueError(f"pool has {self.ep_size} ranks, world needs {world.ep_size}")
        try:
            message = ForkingPickler.dumps((kind, active().version, world, spec, bypass,
                                            *extra))  # once for all
            for conn in self._conns:  # a few KiB into an idle pipe: never blocks
                conn.send_bytes(message)
            return self._collect(self.timeout, "example")
        except (RemoteSizingError, RemoteEngineError, RemoteRefused):
            raise  # every rank refused together, before any kernel: they are still in step
        except RemoteError as exc:
            if getattr(exc, "in_step", False):
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
        """Ask the ranks to exit (each gets 10 s), or kill them at once (``graceful=False``);
        the ranks' log folder goes with the pool."""
        self._stop(graceful)
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
