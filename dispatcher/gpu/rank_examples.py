"""What one EP rank does in the rank pool (``rank_pool.py`` is the pool: its processes, protocol
and lifecycle): agree with its peers through the parent on every rank's value, then run one
world with the kernels of its kind (``one_world``: the installed generation's kernels through
the pool's one driver, ``kernel_world``, over that generation's ``PoolOps``; or the exact CPU
model over gloo), and report its own problems. A step through an engine's own dispatcher is
that engine's rank body (``Engine.rank_body``: SGLang's is ``sglang/rank_body.py``), which
uses ``agree`` the same way.
"""
from __future__ import annotations

import os
import pickle
from typing import List

from ..sandbox.procs import alive


__all__ = ["AgreementAborted", "KernelRefused", "AGREE_TIMEOUT_S", "agree", "rank_value",
           "one_world", "kernel_world", "kernel_round"]

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
    the installed FlashInfer (``kernel_world`` over its ``PoolOps``)."""
    if state["emulated"]:
        return _run_emulated_example(state, rank, ep_size, world, spec, bypass)
    return kernel_world(state["ops"], state, rank, ep_size, max_dispatch_bytes,
                        max_combine_bytes, world, spec, bypass)


def kernel_world(ops, state, rank, ep_size, max_dispatch_bytes, max_combine_bytes, world, spec,
                 bypass) -> List[str]:
    """One world on this rank on a generation's kernels (``ops``: its ``gpu/ops.py: PoolOps``):
    the agreed and validated runtime, the A2A object of the world's key built collectively on
    first use, payload regions poisoned before every example, then dispatch, stand-in experts
    and combine; the receive counts, stale rows and output checked. A call the op refuses is
    made by the refused ranks alone, after the agreement (no peer launches)."""
    import zlib

    import numpy as np

    from ..emulator.rounds import expected_recv_counts
    from ..emulator.inputs import make_inputs, reference_outputs
    from ..model.validation import require_int, validate
    from . import torch_ops
    from .checks import poisoned_rows, rank_problems, stale_rows_ok

    a2as = state["a2as"]
    mine = rank_value(state, rank, world, spec, bypass)
    moe, key = world.moe, ops.key(world)
    known = key in a2as
    if known:  # poisoned before the agreement, which is then also the barrier: the parent sends
        ops.poison(a2as[key], rank, state)  # an example only when every rank has finished the
    values = agree(state, mine, zlib.crc32(repr(world).encode()) << 1 | known)  # last
    if bypass is False:
        validate(values, world.views, world.generation)  # the same verdict on every rank
    runtime = require_int(values[rank])
    if not known:  # collective: every rank reaches here for the same key
        a2as[key] = ops.build(state, rank, ep_size, world, max_dispatch_bytes, max_combine_bytes)
        ops.poison(a2as[key], rank, state)
        agree(state, None)  # a barrier: nobody writes into a peer before it is poisoned
    a2a = a2as[key]
    inputs = make_inputs(world)
    inp = inputs[rank]
    ids, payloads = torch_ops.rank_inputs(torch_ops.device_inputs([inp], "cuda"), 0, moe.payloads)
    refused = ops.refuses(world, values)
    if refused:  # only the refused ranks call: FlashInfer refuses them before any launch
        if rank in refused:
            try:
                ops.dispatch(a2a, world, rank, ep_size, runtime, ids, payloads)
            except Exception as exc:  # noqa: BLE001 - TVM-FFI raises its own error types
                raise KernelRefused(rank, world.rows_per_rank[rank], runtime, exc) from None
            raise AssertionError(f"FlashInfer {world.flashinfer} launched rank {rank} with "
                                 f"{world.rows_per_rank[rank]} rows and runtime {runtime}")
        raise KernelRefused(refused[0], world.rows_per_rank[refused[0]], values[refused[0]],
                            "refused on its own rank; this rank launched nothing")
    recv, kept_poison = ops.dispatch(a2a, world, rank, ep_size, runtime, ids, payloads)
    counts = ops.counts(a2a, rank, ep_size, state)
    out = ops.combine(a2a, world, torch_ops.expert_outputs(recv, runtime, moe, rank, ep_size),
                      runtime)
    poisoned = poisoned_rows(kept_poison)
    # the host's half while the GPU works; then the answers in one copy
    expected = expected_recv_counts(world, inputs)[rank]
    reference = reference_outputs(world, [inp])[0]
    host_counts, host_poisoned, host_out = torch_ops.read_back([counts, poisoned, out])
    return rank_problems(rank, bool(stale_rows_ok(host_poisoned, expected, runtime)), runtime,
                         host_counts.view(np.int32), expected, host_out, reference)


def kernel_round(ops, state, rank, ep_size, world, runtime, ids, payloads):
    """One more round on this rank's A2A object (rounds back to back, no agreement or host
    sync between them): its combined rows, on the device."""
    from . import torch_ops

    a2a = state["a2as"][ops.key(world)]
    recv, _ = ops.dispatch(a2a, world, rank, ep_size, runtime, ids, payloads)
    return ops.combine(a2a, world, torch_ops.expert_outputs(recv, runtime, world.moe, rank,
                                                            ep_size), runtime)


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
    process by the pool's ``resolve``, the loader its maker handed it), or ``bypass[rank]``
    when the caller hands each rank its value."""
    if isinstance(bypass, list):
        return bypass[rank]
    from ..model.properties import for_world

    policies = state["policies"]
    if spec not in policies:
        if state.get("resolve") is None:
            raise ValueError(f"this rank pool was made without a policy loader (resolve=): it "
                             f"cannot load {spec!r}; hand each rank its value instead")
        policies[spec] = state["resolve"](spec)[1]
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
        validate(values, world.views, world.generation)
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
