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

__all__ = ["RTOL", "ATOL", "rank_problems", "stale_rows_poisoned"]

# bf16 tolerance: both sides round each expert row to bf16 once and sum exactly in fp32, so a
# correct A2A matches the reference bit for bit; allow half a bf16 ulp of the largest value.
RTOL, ATOL = 2.0 ** -8, 0.0


def stale_rows_poisoned(recv: Sequence[torch.Tensor], expected_counts: np.ndarray,
                        runtime: int) -> bool:
    """On one target, rows ``[count, runtime)`` of each source's slot still hold POISON."""
    row = torch.arange(runtime, device=recv[0].device)
    stale = row[None, :] >= torch.as_tensor(expected_counts, device=row.device)[:, None]
    for plane in recv:
        rows = plane.contiguous().view(torch.uint8).reshape(plane.shape[0], runtime, -1)
        if not bool(((rows == POISON).all(-1) | ~stale).all().item()):
            return False
    return True


def rank_problems(rank: int, recv: Optional[Sequence[torch.Tensor]], runtime: int,
                  counts: np.ndarray, expected_counts: np.ndarray,
                  output: np.ndarray, reference: np.ndarray) -> List[str]:
    """Everything wrong on EP rank ``rank`` (empty when its round trip was exact).
    ``recv=None`` skips the stale-row check (a dispatcher that sanitizes padding rows, as
    SGLang's does with ``invalid_token_expert_id``, writes them on purpose)."""
    problems = []
    if not np.array_equal(counts, expected_counts):
        problems.append(f"rank {rank} recv counts {counts.tolist()} != model "
                        f"{expected_counts.tolist()}")
    if recv is not None and not stale_rows_poisoned(recv, expected_counts, runtime):
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
