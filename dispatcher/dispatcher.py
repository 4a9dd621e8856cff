"""The dispatcher: size with a policy, validate on every rank, only then launch.

``plan`` is what every dispatcher in this suite (CPU model, single-GPU, multi-GPU) runs before
a kernel: all ranks' values are computed and checked together, so a bad value is a specific
exception with an actionable message, never a silent overwrite in FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from .sizing import Policy, RankView

__all__ = ["CAP_ENV", "A2ASizingError", "RuntimeDisagreement", "NonPositiveRuntime",
           "CapExceeded", "PayloadExceedsRuntime", "RuntimePlan", "plan", "validate"]

CAP_ENV = "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


class A2ASizingError(ValueError):
    """No kernel may be launched with this runtime_max_tokens_per_rank."""


class RuntimeDisagreement(A2ASizingError):
    """EP ranks would pass different runtimes (they would corrupt each other)."""


class NonPositiveRuntime(A2ASizingError):
    """runtime < 1 (FlashInfer's C++ check would fire)."""


class CapExceeded(A2ASizingError):
    """runtime > max_num_tokens, the cap the workspace was sized for."""


class PayloadExceedsRuntime(A2ASizingError):
    """A rank holds more rows than runtime: FlashInfer would write past its slots, silently."""


@dataclass(frozen=True)
class RuntimePlan:
    runtime: int
    rows_per_rank: Tuple[int, ...]
    max_num_tokens: int


def validate(values: Sequence[int], views: Sequence[RankView]) -> RuntimePlan:
    """Check every rank's value against every rank's payload, before anything is launched."""
    rows = tuple(v.local_tokens for v in views)
    cap = views[0].max_num_tokens
    distinct = sorted(set(values))
    if len(distinct) > 1:
        by_value = {x: [r for r, y in enumerate(values) if y == x] for x in distinct}
        raise RuntimeDisagreement(
            "EP ranks disagree on runtime_max_tokens_per_rank: "
            + ", ".join(f"{x} on ranks {_ranks(rs)}" for x, rs in by_value.items())
            + ". Every rank must pass the same value (derive it from data all ranks share, "
              "e.g. dp_global, never from a rank's own x.shape[0] when ranks differ).")
    runtime = values[0]
    if not isinstance(runtime, int) or isinstance(runtime, bool):
        raise A2ASizingError(f"runtime_max_tokens_per_rank must be an int, got "
                             f"{type(runtime).__name__} {runtime!r}")
    biggest = max(rows)
    if runtime < 1:
        raise NonPositiveRuntime(
            f"runtime_max_tokens_per_rank={runtime} but FlashInfer needs >= 1 even when every "
            f"rank has 0 rows; use max(1, ...).")
    if runtime > cap:
        if biggest > cap:
            raise CapExceeded(
                f"rank {rows.index(biggest)} holds {biggest} rows but the A2A workspace was "
                f"sized for max_num_tokens={cap}: no valid runtime exists. Raise {CAP_ENV} to "
                f"at least {biggest} (or lower chunked_prefill_size / max running requests).")
        raise CapExceeded(
            f"runtime_max_tokens_per_rank={runtime} exceeds the workspace cap max_num_tokens="
            f"{cap} although the largest payload is only {biggest} rows: the sizing rule is "
            f"oversized ({runtime / max(1, biggest):.1f}x); fix the rule, not the cap.")
    short = [r for r, n in enumerate(rows) if n > runtime]
    if short:
        raise PayloadExceedsRuntime(
            f"runtime_max_tokens_per_rank={runtime} is smaller than the payload rows "
            f"(x.shape[0]) of ranks {_ranks(short)} (largest {biggest}); FlashInfer would "
            f"silently write past those ranks' slots. Size from post-scatter rows: "
            f"ceil(max(dp_global) / attn_tp_size).")
    return RuntimePlan(runtime, rows, cap)


def plan(policy: Policy, views: Sequence[RankView]) -> RuntimePlan:
    """Run ``policy`` on every rank's view and validate the result."""
    return validate([policy(v) for v in views], views)


def _ranks(rs: Sequence[int]) -> str:
    return str(list(rs)) if len(rs) <= 8 else f"[{rs[0]}, {rs[1]}, ... {rs[-1]}] ({len(rs)})"
