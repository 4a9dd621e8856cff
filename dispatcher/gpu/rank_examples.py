"""What one EP rank does in the rank pool (``rank_pool.py`` is the pool: its processes, protocol
and lifecycle): agree with its peers through the parent on every rank's value, then run one
world with the kernels of its kind (``one_world``: FlashInfer 0.7.2's ``MoeAlltoAll``, 0.7.4's
``NVLinkOneSidedAlltoAll`` or the exact CPU model over gloo), or a step through an engine's own
dispatcher (``run_sglang_example``), and report its own problems.
"""
from __future__ import annotations

import os
import pickle
from typing import List

from ..sandbox.procs import alive


__all__ = ["AgreementAborted", "KernelRefused", "AGREE_TIMEOUT_S", "agree", "rank_value",
           "one_world", "run_sglang_example"]

AGREE_TIMEOUT_S = 300.0  # a rank's wait for the others' values (the parent gives up sooner)


class KernelRefused(RuntimeError):
    """FlashInfer refused this round on some rank before any launch (a generation whose op
    checks a rank's own rows: ``Generation.checks_local_rows``)."""

    def __init__(self, refused_rank, rows, runtime, why):
        super().__init__(f"FlashInfer refused rank {refused_rank} ({rows} rows, runtime "
                         f"{runtime}): {str(why).splitlines()[-1][:200]}; no peer launched "
                         f"(each would wait timeout_sec and trap)")


class AgreementAborted(RuntimeError):
    """On a rank: the parent called off the agreement because a peer failed first."""


def one_world(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, world, spec, bypass):
    """One world on this rank, by the pool's kind: the exact CPU model, or the kernels of
    the installed FlashInfer (its GPU ops module's ``pool_example``)."""
    if state["emulated"]:
        return _run_emulated_example(state, rank, ep_size, world, spec, bypass)
    return state["ops"].pool_example(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes,
                                     world, spec, bypass)


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


def _run_emulated_example(state, rank, ep_size, world, spec, bypass) -> List[str]:
    """``_run_example`` without a GPU: the same policy call, agreement and validation; each
    rank's tokens then travel to every rank over the process group (gloo), and every rank runs
    the exact CPU model of FlashInfer's dispatch and combine (``emulator.a2a``) on them and
    checks its own received counts, stray writes and combined output."""
    import zlib

    import torch.distributed as dist

    from ..emulator.rounds import round_trip
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
    if world.generation.checks_local_rows and runtimes[rank] > cap:  # 0.7.4: the class and the op
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
    in a pool without a GPU, on the emulated ``MoeAlltoAll`` of ``emulator/gloo.py``):
    its ``__init__`` builds its ``MoeAlltoAll`` (over the pool's group), its ``dispatch()``
    launches the real dispatch kernel with the runtime it computes, the stand-in experts run
    on what arrived, its ``combine()`` returns the result, checked against the reference."""
    import numpy as np
    import torch

    from ..emulator.a2a import POISON

    from ..emulator.rounds import expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..model.sglang_context import SGLangContext
    from ..model.mnnvl import aux_offsets
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
