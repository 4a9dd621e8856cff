"""What one EP rank does in the rank pool (``rank_pool.py`` is the pool: its processes, protocol
and lifecycle): agree with its peers through the parent on every rank's value, then run one
world with the kernels of its kind (``one_world``: FlashInfer 0.7.2's ``MoeAlltoAll``, 0.7.4's
``NVLinkOneSidedAlltoAll`` or the exact CPU model over gloo), or a step through an engine's own
dispatcher (``run_sglang_example``), and report its own problems.
"""
from __future__ import annotations

import os
import pickle
import sys
from typing import List

from ..model.generations import active

__all__ = ["AgreementAborted", "RankRefused074", "AGREE_TIMEOUT_S", "agree", "rank_value",
           "one_world", "run_sglang_example", "alive"]

AGREE_TIMEOUT_S = 300.0  # a rank's wait for the others' values (the parent gives up sooner)


class AgreementAborted(RuntimeError):
    """On a rank: the parent called off the agreement because a peer failed first."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def one_world(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, world, spec, bypass):
    """One world on this rank, by the pool's kind: the exact CPU model, 0.7.4 or 0.7.2."""
    if state["emulated"]:
        return _run_emulated_example(state, rank, ep_size, world, spec, bypass)
    if state["kernel"] == "one_sided":
        return _run_example_074(state, rank, ep_size, world, spec, bypass)
    return _run_example(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, world,
                        spec, bypass)


def agree(state, value, key: int = 0) -> list:
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
                or not alive(state["parent"])):
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


def rank_value(state, rank: int, world, spec: str, bypass):
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
    mine = rank_value(state, rank, world, spec, bypass)
    moe, cap = world.moe, world.max_num_tokens
    aux = aux_offsets(ep_size, cap)

    def poison():
        a2as[cap].workspace[rank][aux.payload_data:].fill_(POISON)
        torch.cuda.synchronize()
    known = cap in a2as
    if known:  # poisoned before the agreement, which is then also the barrier: the parent sends
        poison()  # an example only when every rank has finished the last, so no peer still reads it
    key = zlib.crc32(repr(world).encode()) << 1 | known
    values = agree(state, mine, key)
    if bypass is False:
        validate(values, world.views)  # the same verdict on every rank
    runtime = require_int(values[rank])
    if not known:  # collective: every rank reaches here for the same cap
        size = workspace_size_per_rank(ep_size, cap, max_dispatch_bytes, max_combine_bytes)
        a2as[cap] = new_moe_alltoall(ep_size, rank, cap, top_k=8,
                                     num_experts=max(64, ep_size), workspace_size_per_rank=size)
        poison()
        agree(state, None)  # a barrier: nobody writes into a peer before it is poisoned
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
    mine = rank_value(state, rank, world, spec, bypass)
    moe, cap = world.moe, world.max_num_tokens
    shape = (cap, moe.top_k, moe.hidden_size, moe.payload, moe.num_experts)
    known = shape in a2as
    idx = state["index"]
    if known:  # poisoned before the agreement, which is also the barrier (as in _run_example)
        _poison_074(a2as[shape]["a2a"], rank, idx)
    key = zlib.crc32(repr(world).encode()) << 1 | known
    values = agree(state, mine, key)
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
        agree(state, None)  # a barrier: nobody writes into a peer before it is poisoned
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

    mine = rank_value(state, rank, world, spec, bypass)
    values = agree(state, mine, zlib.crc32(repr(world).encode()))
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


def run_sglang_example(state, rank, ep_size, world, spec, bypass, ctx=None) -> dict:
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
        __agree_before_launch(a2a, state, ep_size)
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


def __agree_before_launch(a2a, state, ep_size):
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
        agreed = agree(state, runtime_max_tokens_per_rank)
        example["values"] = agreed
        if example["bypass"] is False:
            validate(agreed, example["world"].views)
        return launch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank, *a, **k)
    a2a.dispatch = dispatch
    a2a._a2a_gate_agreed = True
