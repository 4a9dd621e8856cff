"""Measure vLLM releases' FlashInfer NVLink prepare() against every property, per regime.

    python -m dispatcher.commands.verdicts --engine vllm            # the pinned releases
    python -m dispatcher.commands.verdicts --engine vllm 0.33.0 0.33.0@two-sided /path/to/vllm

For each release (one-sided, and two-sided where it ships the file) and each regime of
``strategies.vllm_worlds``, Hypothesis searches for a world where the release's own prepare()
breaks a property (or raises) and shrinks it. "n/a": the backend never runs in that regime.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from strategies.search import minimal
from strategies.vllm import VLLM_REGIMES, vllm_worlds

from ..cross_round_verdicts import COLUMN as CROSS_ROUND, LEGEND as CROSS_ROUND_LEGEND
from ..cross_round_verdicts import search as cross_round_search
from ..model.generations import PINNED_RELEASES_GENERATION as PINNED, active, using
from ..model.properties import broken_columns
from ..model.world import World
from .fetch import JUDGED_ON, RELEASES
from .loader import VLLMRelease, release_from_spec

__all__ = ["TITLE", "default_specs", "compat_specs", "RELEASES", "REGIME_EXAMPLES", "Verdict",
           "broken_columns", "regime_verdicts",
           "tables", "TWO_SIDED_REGIMES"]

TITLE = "vLLM FlashInfer NVLink prepare/finalize"
REGIME_EXAMPLES = 300
TWO_SIDED_REGIMES = ("any", "dp-only", "dp-padding")  # no SP split, needs DP metadata
TWO_SIDED_SPECS = (RELEASES[0], "0.33.0", RELEASES[-1])  # whose two-sided file is measured


@dataclass(frozen=True)
class Verdict:
    regime: str
    example: Optional[World]  # shrunk counterexample; None: holds (or n/a)
    columns: tuple = ()  # what it breaks
    applicable: bool = True


def regime_verdicts(release: VLLMRelease, max_examples: int = REGIME_EXAMPLES) -> Dict[str, Verdict]:
    out = {}
    for regime in VLLM_REGIMES:
        if release.side == "two-sided" and regime not in TWO_SIDED_REGIMES:
            out[regime] = Verdict(regime, None, applicable=False)
            continue
        found = minimal(vllm_worlds(regime), lambda w: bool(broken_columns(release, w)),
                        max_examples)
        out[regime] = Verdict(regime, found, broken_columns(release, found) if found else ())
    return out


def judged_on(release: VLLMRelease) -> str:
    """The generation ``release`` is judged on: a pinned release's own (``fetch.JUDGED_ON``:
    the FlashInfer whose API it calls), else the session's."""
    return JUDGED_ON.get(release.label, PINNED) if release.label in RELEASES else active().version


def _cross_round_cell(release: VLLMRelease, notes: List[str]) -> str:
    if not release.runs_modelled_a2a:
        return "n/a"
    with using(judged_on(release)):  # the one it runs on (docs/flashinfer.md)
        hazard = cross_round_search(release, REGIME_EXAMPLES)
    if not hazard.exposed:
        return "closed"
    notes.append(f"[{len(notes) + 1}] {release.spec} {CROSS_ROUND}: {hazard.detail}; "
                 f"`{hazard.example!r}`")
    return f"exposed [{len(notes)}]"


def default_specs() -> List[str]:
    """Every pinned release, and the two-sided backend of the oldest, of the newest on
    ``flashinfer.comm``'s MnnvlMoe (0.33.0) and of the newest (on moe_ep's two-sided class)."""
    return ([f"vllm:{v}" for v in RELEASES]
            + [f"vllm:{v}@two-sided" for v in TWO_SIDED_SPECS])


def compat_specs() -> List[str]:
    """The rows of the engine x FlashInfer table (docs/flashinfer.md): every release with
    each backend."""
    return [f"vllm:{v}" for v in RELEASES] + [f"vllm:{v}@two-sided" for v in RELEASES]


def tables(specs, load=release_from_spec) -> str:
    releases = [load(s.partition("vllm:")[2] if s.startswith("vllm") else s)
                for s in specs]
    t0 = time.perf_counter()
    notes: List[str] = []
    lines = ["| vLLM release | " + " | ".join(VLLM_REGIMES) + f" | {CROSS_ROUND} |",
             "|---" * (len(VLLM_REGIMES) + 2) + "|"]
    for release in releases:
        cells = []
        with using(judged_on(release)):
            verdicts = regime_verdicts(release)
        for regime, v in verdicts.items():
            if not v.applicable:
                cells.append("n/a")
            elif v.example is None:
                cells.append("pass")
            else:
                notes.append(f"[{len(notes) + 1}] {release.spec} {regime}: breaks "
                             f"{', '.join(v.columns)}; `{v.example!r}`")
                cells.append(f"**FAIL** [{len(notes)}]")
        cells.append(_cross_round_cell(release, notes))
        on = judged_on(release)
        lines.append(f"| {release.spec.partition(':')[2]}"
                     + (f" (on FlashInfer {on})" if on != PINNED else "") + " | "
                     + " | ".join(cells) + " |")
    return ("\n".join(lines) + "\n\n" + CROSS_ROUND_LEGEND + "; `n/a`: the two-sided "
            "backend's kernels (`flashinfer.comm.trtllm_alltoall`) are not this A2A\n\n"
            + "\n".join(f"- {n}" for n in notes)
            + f"\n\n(searched in {time.perf_counter() - t0:.0f} s: {REGIME_EXAMPLES} worlds per "
              f"cell, derandomized)")
