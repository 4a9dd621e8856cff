"""The checks both GPU tiers make on one EP rank after a real dispatch -> MoE -> combine.

Received counts equal the model's, rows past each sender's count still hold the poison (a
stray write landed nowhere), and combine's output equals the reference within ``RTOL``.
``single`` runs them for every rank of a world in one process, ``rank_pool`` for its own
rank in each process: one definition, so the tiers cannot drift apart.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from ..emulator.a2a import POISON

__all__ = ["RTOL", "ATOL", "rank_problems", "stale_rows_ok"]

# bf16 tolerance: both sides round each expert row to bf16 once and sum exactly in fp32, so a
# correct A2A matches the reference bit for bit; allow half a bf16 ulp of the largest value.
RTOL, ATOL = 2.0 ** -8, 0.0


def stale_rows_ok(recv: Sequence[torch.Tensor], expected_counts: np.ndarray,
                  runtime: int) -> torch.Tensor:
    """Rows ``[count, runtime)`` of each source's slot still hold POISON. One target: planes
    ``[W, R, ...]`` and counts ``[W]`` give a 0-dim bool; T targets at once (the same
    runtime): planes ``[T, W, R, ...]`` and counts ``[T, W]`` give ``[T]``. The answer stays
    on the GPU, so a caller reads every rank's in one copy."""
    counts = torch.as_tensor(np.asarray(expected_counts), device=recv[0].device)
    stale = torch.arange(runtime, device=counts.device) >= counts[..., None]  # [..., W, R]
    oks = [((plane.contiguous().view(torch.uint8).reshape(*stale.shape, -1) == POISON).all(-1)
            | ~stale).flatten(-2).all(-1) for plane in recv]
    return torch.stack(oks).all(0)


def rank_problems(rank: int, stale_ok: Optional[bool], runtime: int,
                  counts: np.ndarray, expected_counts: np.ndarray,
                  output: np.ndarray, reference: np.ndarray) -> List[str]:
    """Everything wrong on EP rank ``rank`` (empty when its round trip was exact).
    ``stale_ok`` is ``stale_rows_ok`` read back; ``None`` skips that check (a dispatcher that
    sanitizes padding rows, as SGLang's does with ``invalid_token_expert_id``, writes them on
    purpose)."""
    problems = []
    if not np.array_equal(counts, expected_counts):
        problems.append(f"rank {rank} recv counts {counts.tolist()} != model "
                        f"{expected_counts.tolist()}")
    if stale_ok is False:
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
