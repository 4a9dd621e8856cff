"""The sizing rule: what one EP rank passes as ``runtime_max_tokens_per_rank``.

A *policy* is any callable ``(RankView) -> int``. It sees only what a real EP rank sees when
it sizes the all-to-all (``RankView``), and must return the same value on every rank, at
least every rank's payload rows, at least 1 and at most the workspace cap.

``ideal_rule`` is the shipped rule. ``prefix_rule`` and ``seed_era_rule`` are the known-bad
historical rules, kept as named policies so the suite can prove it rejects them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

__all__ = [
    "RankView",
    "Policy",
    "NotApplicable",
    "ceil_div",
    "ceil_align",
    "ideal_rule",
    "prefix_rule",
    "seed_era_rule",
    "KNOWN_BAD_RULES",
]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_align(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m`` (SGLang's ``ceil_align``)."""
    return ceil_div(n, m) * m


@dataclass(frozen=True)
class RankView:
    """What one EP rank sees when it sizes the A2A for one forward step.

    ``dp_global`` is what ``get_dp_global_num_tokens()`` returns on this rank: one entry per
    DP-attention group (already padded to ``attn_tp_size``), a single pre-scatter entry when
    DP attention is off, or ``None`` / ``()`` where nothing was recorded (CUDA-graph capture).
    ``local_tokens`` is ``x.shape[0]`` on this rank after the attention-TP scatter.
    """

    ep_rank: int
    ep_size: int
    dp_size: int
    attn_tp_size: int
    dp_global: Optional[Tuple[int, ...]]
    local_tokens: int
    max_num_tokens: int


Policy = Callable[[RankView], int]


class NotApplicable(Exception):
    """Raised by a policy for a world its system can never produce (e.g. SGLang runs no
    forward when every DP group is idle). The suite rejects such worlds and counts them in
    the Hypothesis statistics; a policy that rejects everything fails as Unsatisfiable."""


def ideal_rule(view: RankView) -> int:
    """The shipped rule: the largest post-scatter row count over all EP ranks, at least 1.

    Every ``dp_global`` entry is a DP group's count padded to ``attn_tp_size`` (or, with DP
    attention off, the one pre-scatter padded count), so each rank of group ``g`` holds
    ``dp_global[g] / attn_tp_size`` rows: the max over groups is the same on every rank and is
    the smallest value that fits all of them. With nothing recorded every rank runs the same
    batch, so the local row count is that maximum.
    """
    if view.dp_global:
        rows = ceil_div(max(view.dp_global), view.attn_tp_size)
    else:
        rows = view.local_tokens
    return max(1, rows)


def prefix_rule(view: RankView) -> int:
    """Before SGLang PR #25685: ``max(dp_global)`` whenever it is not None.

    Under SP the single entry is the *pre-scatter* count, ``attn_tp_size`` times too large
    (past the cap FlashInfer's assert fires); an empty list raises; zero local rows give 0.
    """
    if view.dp_global is not None:
        return max(view.dp_global)
    return view.local_tokens


def seed_era_rule(view: RankView) -> int:
    """PR #25685 (commit 878e6b8): ``max(dp_global)`` only for a multi-entry list.

    Fixes SP without DP attention, but with DP attention and ``attn_tp_size > 1`` the entries
    are still pre-scatter: ``attn_tp_size`` times too large. Zero local rows give 0.
    """
    if view.dp_global is not None and len(view.dp_global) > 1:
        return max(view.dp_global)
    return view.local_tokens


KNOWN_BAD_RULES = {"prefix_rule": prefix_rule, "seed_era_rule": seed_era_rule}
