"""What SGLang's own code saw and did on each rank: the ``Outcome`` record, and in words (every
failure message shows it). Reads an ``Outcome``'s and a release's fields only, so the loader
and the bug classes both use it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..model.world import World
from .flashinfer_side import LaunchRecord

__all__ = ["Outcome", "SGLangAssertion", "EMPTY_LIST", "describe_outcomes", "describe_sources"]


EMPTY_LIST = ("SGLang never publishes an empty dp_global: every list set_dp_buffer_len is "
              "handed has one entry per DP group of the gather (prepare_mlp_sync_batch, a "
              "capture's [num_tokens] * dp_size), and None where nothing was gathered")


class SGLangAssertion(AssertionError):
    """SGLang's own dispatch() raised (an assert or error) where it had to size the A2A."""


@dataclass(frozen=True)
class Outcome:
    """What one EP rank's dispatch() did: launched the A2A (``launch`` holds what it
    constructed and passed), routed the batch around it (all-gather prefill), or raised
    ``error``; ``seen_dp_global`` is what ``get_dp_global_num_tokens()`` handed it."""

    launch: Optional[LaunchRecord] = None
    routed_around: bool = False
    error: Optional[str] = None
    seen_dp_global: object = "not read"

    @property
    def runtime(self):
        return None if self.launch is None else self.launch.runtime


def describe_outcomes(outs: Sequence, world: Optional[World] = None) -> str:
    """One line per EP rank: what ``get_dp_global_num_tokens()`` handed it and what it did;
    marked where that differs from the world's ``dp_global`` printed above it."""
    def one(o) -> str:
        if o.error:
            return f"raised {o.error.splitlines()[0][:240]}"
        if o.routed_around:
            return "routed the batch around the A2A"
        rec = o.launch
        return (f"launched runtime={rec.runtime!r} (cap {rec.max_num_tokens!r}, workspace "
                f"{rec.workspace_size_per_rank!r} B/rank, invalid_token_expert_id="
                f"{rec.invalid_token_expert_id!r})")
    printed = None if world is None or world.dp_global is None else list(world.dp_global)
    lines = []
    for r, o in enumerate(outs[:8]):
        differs = (world is not None and o.seen_dp_global != "not read"
                   and o.seen_dp_global != printed)
        mark = " (NOT the world's dp_global)" if differs else ""
        lines.append(f"    EP rank {r}: get_dp_global_num_tokens() -> {o.seen_dp_global!r}{mark}; "
                     f"{one(o)}")
    if len(outs) > 8:
        lines.append(f"    ... ({len(outs)} ranks)")
    return "\n".join(lines)


def describe_sources(release) -> str:
    """Which SGLang function produced what each rank saw (``scheduler.Scheduler.sources``)."""
    src = release.sources
    if len(set(src.values())) == 1:
        return f"  step made by: {next(iter(src.values()))}"
    return (f"  step made by SGLang's own code: config accepted by {src['topology']}; list by "
            f"{src['gather']}; all-gather skipped per {src['skip_all_gather']}; draft counts "
            f"by {src['spec_scale']}; padded by {src['padding']}; CUDA-graph bucket by "
            f"{src['bucket']} (a draft's by {src['draft_bucket']})")
