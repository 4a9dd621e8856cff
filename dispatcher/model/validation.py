"""Validation before launch: every rank's value checked against every rank's payload.

``validate`` is what every dispatcher in this suite (CPU model, single-GPU, multi-GPU) runs
before a kernel: all ranks' values are checked together, so a bad value is a specific
exception with an actionable message, never a silent overwrite in FlashInfer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..sizing import Policy, RankView
from .show import shown

if TYPE_CHECKING:
    from .generations import Generation

__all__ = ["CAP_ENV", "A2ASizingError", "NotAnInteger", "RuntimeDisagreement",
           "NonPositiveRuntime", "CapExceeded", "PayloadExceedsRuntime", "require_int",
           "plan", "validate"]

CAP_ENV = "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


class A2ASizingError(ValueError):
    """No kernel may be launched with this runtime_max_tokens_per_rank."""


class NotAnInteger(A2ASizingError):
    """The runtime is not a Python ``int`` (FlashInfer's op takes an int64 scalar)."""


class RuntimeDisagreement(A2ASizingError):
    """EP ranks would pass different runtimes (they would corrupt each other)."""


class NonPositiveRuntime(A2ASizingError):
    """runtime < 1 (FlashInfer's C++ check would fire)."""


class CapExceeded(A2ASizingError):
    """runtime > max_num_tokens, the cap the workspace was sized for."""


class PayloadExceedsRuntime(A2ASizingError):
    """A rank holds more rows than runtime: FlashInfer would write past its slots, silently."""


def require_int(value) -> int:
    """The one place the runtime's type is decided: a Python ``int`` (``bool`` excluded).

    FlashInfer's ``MoeAlltoAll.dispatch`` compares the value with the cap in Python and hands
    it to an FFI op taking an int64; SGLang computes it from Python ints. A float, a numpy
    scalar or a tensor is a different value in a different place (a 0-d tensor compares
    fine and then fails in the FFI; ``3.0 <= cap`` passes the assert), so none is accepted.
    """
    if type(value) is not int:
        raise NotAnInteger(
            f"runtime_max_tokens_per_rank must be a Python int, got {type(value).__name__} "
            f"{shown(value)}; return int(...) from the rule")
    return value


def validate(values: Sequence[int], views: Sequence[RankView], generation: "Generation") -> int:
    """Check every rank's value against every rank's payload, before anything is launched;
    return the runtime all ranks agreed on. ``generation``: the world's FlashInfer generation
    (what it does with a runtime below a rank's rows, in the error's words)."""
    rows = tuple(v.local_tokens for v in views)
    cap = views[0].max_num_tokens
    distinct = sorted(set(values), key=shown)  # foreign values: shown, never repr'd raw
    if len(distinct) > 1:
        by_value = {x: [r for r, y in enumerate(values) if y == x] for x in distinct}
        raise RuntimeDisagreement(
            "EP ranks disagree on runtime_max_tokens_per_rank: "
            + ", ".join(f"{shown(x)} on ranks {_ranks(rs)}" for x, rs in by_value.items())
            + ". Every rank must pass the same value (derive it from data all ranks share, "
              "e.g. dp_global, never from a rank's own x.shape[0] when ranks differ).")
    runtime = require_int(values[0])
    biggest = max(rows)
    if runtime < 1:
        raise NonPositiveRuntime(
            f"runtime_max_tokens_per_rank={shown(runtime)} but FlashInfer needs >= 1 even when every "
            f"rank has 0 rows; use max(1, ...).")
    if runtime > cap:
        if biggest > cap:
            raise CapExceeded(
                f"rank {rows.index(biggest)} holds {biggest} rows but the A2A workspace was "
                f"sized for max_num_tokens={cap}: no valid runtime exists. Raise {CAP_ENV} to "
                f"at least {biggest} (or lower chunked_prefill_size / max running requests).")
        raise CapExceeded(
            f"runtime_max_tokens_per_rank={shown(runtime)} exceeds the workspace cap "
            f"max_num_tokens={cap} although the largest payload is only {biggest} rows: the "
            f"sizing rule is oversized ({_ratio(runtime, max(1, biggest))}); fix the rule, not "
            f"the cap.")
    short = [r for r, n in enumerate(rows) if n > runtime]
    if short:
        raise PayloadExceedsRuntime(
            f"runtime_max_tokens_per_rank={shown(runtime)} is smaller than the payload rows "
            f"(x.shape[0]) of ranks {_ranks(short)} (largest {biggest}); {_undersized_effect(generation)} "
            f"Size from post-scatter rows: ceil(max(dp_global) / attn_tp_size).")
    return runtime


def _undersized_effect(generation: "Generation") -> str:
    """What FlashInfer ``generation`` does with a runtime below a rank's rows."""
    if generation.checks_local_rows:
        return (f"{generation} would refuse those ranks while their peers wait for them until "
                f"timeout_sec and trap.")
    return "FlashInfer would silently write past those ranks' slots."


def plan(policy: Policy, views: Sequence[RankView], generation: "Generation") -> int:
    """Run ``policy`` on every rank's view and validate the result (``validate``)."""
    return validate([policy(v) for v in views], views, generation)


def _ratio(runtime: int, rows: int) -> str:
    """``runtime / rows`` as ``12.5x``, for any int (past a float's range, in words)."""
    try:
        return f"{runtime / rows:.1f}x"
    except OverflowError:
        return f"{shown(runtime // rows)}x"


def _ranks(rs: Sequence[int]) -> str:
    return str(list(rs)) if len(rs) <= 8 else f"[{rs[0]}, {rs[1]}, ... {rs[-1]}] ({len(rs)})"
