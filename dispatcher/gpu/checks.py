"""The checks both GPU tiers make on one EP rank after a real dispatch -> MoE -> combine.

Received counts equal the model's, rows past each sender's count still hold the poison (a
stray write landed nowhere), and combine's output equals the reference within ``RTOL``.
``single`` runs them for every rank of a world in one process, ``rank_pool`` for its own
rank in each process: one definition, so the tiers cannot drift apart. The device computes
only which received rows are still all poison (``poisoned_rows``); the rest is judged on
the host from what was read back, so a tier reads every answer in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..emulator.a2a import POISON

from ..emulator.rounds import expected_recv_counts
from ..emulator.inputs import reference_outputs
from ..model.world import World

__all__ = ["RTOL", "ATOL", "poisoned_rows", "stale_rows_ok", "rank_problems", "world_problems",
           "GUARD", "GUARD_BYTE", "GpuRoundTrip", "CudaContextDead", "verdict", "ranks_refused",
           "refusal"]

# bf16 tolerance: both sides round each expert row to bf16 once and sum exactly in fp32, so a
# correct A2A matches the reference bit for bit; allow half a bf16 ulp of the largest value.
RTOL, ATOL = 2.0 ** -8, 0.0


def poisoned_rows(recv):
    """Which received rows hold POISON in every byte of every payload plane: planes
    ``[..., W, R, n]`` (any dtype; one target ``[W, R, n]``, or T targets stacked) give a bool
    ``[..., W, R]`` on their device. (torch is imported by the GPU paths only: the CPU driver
    of this tier, ``single_cpu.py``, uses the host-side checks of this module.)"""
    import torch

    rows = torch.cat([p.contiguous().view(torch.uint8) for p in recv], dim=-1)
    return (rows == POISON).all(-1)


def stale_rows_ok(poisoned: np.ndarray, expected_counts: np.ndarray, runtime: int):
    """Rows ``[count, runtime)`` of each source's slot are still poison, from ``poisoned_rows``
    read back: ``[W, R]`` with counts ``[W]`` gives a bool, ``[T, W, R]`` with ``[T, W]`` gives
    ``[T]``."""
    stale = np.arange(runtime) >= np.asarray(expected_counts)[..., None]  # [..., W, R]
    return (poisoned | ~stale).all(axis=(-2, -1))


def rank_problems(rank: int, stale_ok: Optional[bool], runtime: int,
                  counts: np.ndarray, expected_counts: np.ndarray,
                  output: np.ndarray, reference: np.ndarray) -> List[str]:
    """Everything wrong on EP rank ``rank`` (empty when its round trip was exact).
    ``stale_ok`` is ``stale_rows_ok``; ``None`` skips that check (a dispatcher that
    sanitizes padding rows, as SGLang's does with ``invalid_token_expert_id``, writes them on
    purpose)."""
    problems = []
    if not np.array_equal(counts, expected_counts):
        problems.append(f"rank {rank} recv counts {counts.tolist()} != model "
                        f"{expected_counts.tolist()}")
    if stale_ok is not None and not stale_ok:
        problems.append(f"rank {rank}: a stray write landed past a sender's count")
    if output.shape != reference.shape:
        problems.append(f"rank {rank}: combine returned shape {output.shape}, expected "
                        f"{reference.shape}")
    else:
        close = np.isclose(output, reference, rtol=RTOL, atol=ATOL)
        if not close.all():
            bad = int((~close).any(axis=1).sum())
            problems.append(f"rank {rank}: combine output differs from the reference on "
                            f"{bad} of {reference.shape[0]} tokens")
    return problems


def world_problems(stale_ok: Sequence[bool], runtimes: Sequence[int], counts: np.ndarray,
                   expected_counts: np.ndarray, outputs: Sequence[np.ndarray],
                   references: Sequence[np.ndarray]) -> List[str]:
    """``rank_problems`` of every rank of a world: when every rank is exact, one comparison
    for the whole world says so; otherwise rank by rank, to name what is wrong where."""
    if (all(stale_ok) and np.array_equal(counts, expected_counts)
            and all(o.shape == r.shape for o, r in zip(outputs, references))
            and np.isclose(np.concatenate([o.reshape(-1) for o in outputs]),
                           np.concatenate([r.reshape(-1) for r in references]),
                           rtol=RTOL, atol=ATOL).all()):
        return []
    return [p for r in range(len(outputs))
            for p in rank_problems(r, bool(stale_ok[r]), runtimes[r], counts[r],
                                   expected_counts[r], outputs[r], references[r])]


def ranks_refused(world: World, runtimes: Sequence[int]) -> List[int]:
    """The ranks a generation that checks a rank's own rows refuses before any launch: a
    runtime outside ``(0, cap]`` or below the rank's own rows (``world.generation``'s op)."""
    return [r for r in range(world.ep_size) if not 0 < runtimes[r] <= world.max_num_tokens
            or world.rows_per_rank[r] > runtimes[r]]


def refusal(world: World, rank: int, runtime: int, why: str) -> str:
    """One refused rank in words, as both drivers of the single-GPU tier report it."""
    return (f"{world.generation} refused rank {rank} ({world.rows_per_rank[rank]} rows, runtime "
            f"{runtime}): {why}; no peer was launched (it would wait timeout_sec and trap)")


GUARD = 4096
GUARD_BYTE = 0x5A


@dataclass(frozen=True)
class GpuRoundTrip:
    problems: Tuple[str, ...]  # empty when every rank's round trip was exact
    byte_model: Dict[str, Tuple[int, int]]  # name -> (ours, FlashInfer's)


class CudaContextDead(RuntimeError):
    """An earlier kernel fault killed this process's CUDA context: nothing more can run."""


def verdict(world: World, inputs, runtimes: Sequence[int], guard, counts, poisoned, results,
            model: Dict[str, Tuple[int, int]], flashinfer: str) -> GpuRoundTrip:
    """Every check of a single-GPU round trip, from what is still on the device: guard bytes
    intact (``guard``), received counts ([W, W] int32 as bytes), stale rows still poison
    (``poisoned``: one stacked tensor when every rank ran the same runtime, else one per
    rank), each rank's combined output against the reference, and our byte model against
    FlashInfer's numbers. The host's half runs while the GPU works; then one copy (one sync)."""
    from . import torch_ops

    W = world.ep_size
    expected = expected_recv_counts(world, inputs)
    ref = reference_outputs(world, inputs)
    guard_ok, host_counts, *rest = torch_ops.read_back([guard, counts, *poisoned, *results])
    host_counts = host_counts.view(np.int32)
    host_poisoned, host_out = rest[:len(poisoned)], rest[len(poisoned):]
    stale = (stale_rows_ok(host_poisoned[0], expected, runtimes[0]) if len(set(runtimes)) == 1 else
             [stale_rows_ok(host_poisoned[r], expected[r], runtimes[r]) for r in range(W)])
    problems = [] if guard_ok else ["guard bytes after a rank's workspace were overwritten"]
    problems += world_problems(stale, runtimes, host_counts, expected, host_out, ref)
    wrong = {k: v for k, v in model.items() if v[0] != v[1]}
    if wrong:
        problems.append(f"byte model != {flashinfer}: {wrong}")
    return GpuRoundTrip(tuple(problems), model)

