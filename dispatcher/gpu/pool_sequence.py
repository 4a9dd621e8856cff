"""A rank's side of a sequence of rounds in the rank pool (``RankPool.run_sequence``).

Every rank computes its runtime for every round with the policy under test, the ranks agree
once on all of them (through the parent, as for one world) and validate every round before any
kernel; then the rounds run back to back on the pool's workspaces: the first as one world runs
(every check: counts, stray writes, output), and each later one with nothing between a rank's
combine of round n and its dispatch of round n+1 (no agreement, no host sync), as an engine
runs them. The host reads every round's output once, at the end, and each round's output is
checked against its reference. Without a GPU, every rank runs the exact CPU model of the
rounds in order on one model workspace, never cleared (``emulator.rounds.rounds_in_order``).
"""
from __future__ import annotations

import zlib
from typing import List, Sequence

__all__ = ["run_sequence_on_rank"]


def _output_problems(rank: int, n: int, got, ref) -> List[str]:
    import numpy as np

    from .checks import ATOL, RTOL

    if got.shape != ref.shape:
        return [f"round {n + 1}, rank {rank}: combine returned shape {got.shape}, expected "
                f"{ref.shape}"]
    close = np.isclose(got, ref, rtol=RTOL, atol=ATOL)
    if close.all():
        return []
    return [f"round {n + 1}, rank {rank}: combine output differs from the reference on "
            f"{int((~close).any(axis=1).sum())} of {ref.shape[0]} tokens"]


def run_sequence_on_rank(state, rank: int, ep_size: int, max_dispatch_bytes: int,
                         max_combine_bytes: int, worlds: Sequence, spec: str) -> List[List[str]]:
    """This rank's problems in each round (empty lists: exact)."""
    from ..model.validation import require_int, validate
    from .rank_examples import agree, one_world, rank_value

    mine = [rank_value(state, rank, world, spec, False) for world in worlds]
    agreed = agree(state, mine, zlib.crc32(repr(tuple(worlds)).encode()))
    values = [[agreed[r][n] for r in range(ep_size)] for n in range(len(worlds))]
    for world, vals in zip(worlds, values):
        validate(vals, world.views, world.generation)  # the same verdict on every rank, before any kernel
    runtimes = [require_int(vals[rank]) for vals in values]
    if state["emulated"]:
        return _emulated(state, rank, worlds, values)
    problems = [list(one_world(state, rank, ep_size, max_dispatch_bytes, max_combine_bytes,
                               worlds[0], spec, values[0]))]
    outs, refs = _later_rounds(state, rank, ep_size, worlds[1:], runtimes[1:])
    from . import torch_ops

    for n, (got, ref) in enumerate(zip(torch_ops.read_back(outs), refs), 1):
        problems.append(_output_problems(rank, n, got, ref))
    return problems


def _emulated(state, rank, worlds, values) -> List[List[str]]:
    import torch.distributed as dist

    from ..emulator.rounds import rounds_in_order
    from ..emulator.inputs import make_inputs

    mine = [make_inputs(world)[rank] for world in worlds]
    gathered = [None] * len(values[0])
    dist.all_gather_object(gathered, mine, group=state["cpu"])
    inputs = [[gathered[r][n] for r in range(len(gathered))] for n in range(len(worlds))]
    rounds = rounds_in_order(worlds, [[int(v) for v in vals] for vals in values], inputs)
    return [_output_problems(rank, n, got[rank], ref[rank])
            for n, (got, ref) in enumerate(rounds)]


def _later_rounds(state, rank, ep_size, worlds, runtimes):
    """Rounds 2.. on this rank's stream, back to back: each rank's combined rows (on the
    device) and their references (on the host)."""
    from ..emulator.inputs import make_inputs, reference_outputs
    from . import torch_ops
    from .rank_examples import kernel_round

    outs, refs = [], []
    for world, R in zip(worlds, runtimes):
        moe = world.moe
        inp = make_inputs(world)[rank]
        ids, payloads = torch_ops.rank_inputs(torch_ops.device_inputs([inp], "cuda"), 0,
                                              moe.payloads)
        out = kernel_round(state["ops"], state, rank, ep_size, world, R, ids, payloads)
        outs.append(out)
        refs.append(reference_outputs(world, [inp])[0])
    return outs, refs
