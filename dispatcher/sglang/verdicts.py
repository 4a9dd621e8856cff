"""Measure SGLang releases against every bug class and every property; print the tables.

    python -m dispatcher.commands.verdicts --engine sglang     # every distinct release 0.5.10-0.5.23
    python -m dispatcher.commands.verdicts 0.5.23 /path/to/sglang

Bug classes (``bug_classes.py``): for each release and class, Hypothesis searches that class's
regime (``BugClass.steps``) for a step where the release's own dispatch() breaks the
class's check, and shrinks it. A class none of whose steps the release's own server-arg checks
accept is "unreachable" there (with the refusing file:line); a hazard (a context SGLang's own
code never produces) has its own column, "hardening": "exposed" or "hardened", never FAIL. Properties: the same for each property of the sizing rule in
eager decode. "pass" means no counterexample in the search; every FAIL comes with its shrunk
step, readable in docs/sglang.md and replayable with ``python -m dispatcher``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from strategies import worlds
from strategies.search import minimal

from ..cross_round_verdicts import COLUMN as CROSS_ROUND, LEGEND as CROSS_ROUND_LEGEND
from ..cross_round_verdicts import search as cross_round_search
from ..model.generations import PINNED_RELEASES_GENERATION, using
from ..model.properties import COLUMNS, RuleCrashed, breaks, rule_values
from ..model.sglang_context import SGLangContext
from ..model.world import World
from .bug_classes import BUG_CLASSES, BUGS, HAZARDS, check_step
from .loader import SGLangRelease, release_from_spec
from .sources import RELEASES

__all__ = ["TITLE", "default_specs", "compat_specs", "RELEASES", "CLASS_EXAMPLES", "PROPERTY_EXAMPLES",
           "Verdict", "class_verdicts",
           "property_verdicts", "tables"]

TITLE = "SGLang FlashinferDispatcher"
CLASS_EXAMPLES = 300
PROPERTY_EXAMPLES = 1500


@dataclass(frozen=True)
class Verdict:
    column: str
    example: Optional[Tuple[World, SGLangContext]]  # shrunk counterexample, None: holds
    detail: str = ""
    unreachable: bool = False  # no step of the class's regime is a config the release accepts


def reachable(release: SGLangRelease, key: str, max_examples: int = CLASS_EXAMPLES) -> bool:
    """Whether some step of class ``key``'s regime is one the release accepts."""
    return minimal(BUG_CLASSES[key].steps(), lambda wc: BUG_CLASSES[key].applies(*wc)
                   and release.refusal(*wc) is None, max_examples) is not None


def class_verdicts(release: SGLangRelease, max_examples: int = CLASS_EXAMPLES) -> Dict[str, Verdict]:
    out = {}
    for key in BUG_CLASSES:
        if not reachable(release, key, max_examples):
            out[key] = Verdict(key, None, f"unreachable in {release.label}: "
                               f"{release.sources['topology']}", True)
            continue
        found = minimal(BUG_CLASSES[key].steps(), lambda wc, key=key: check_step(release, key, *wc) is not None,
                        max_examples)
        detail = "" if found is None else check_step(release, key, *found).splitlines()[0]
        out[key] = Verdict(key, found, detail.split("] ", 1)[-1])
    with using(PINNED_RELEASES_GENERATION):  # the only one they run on (docs/flashinfer.md)
        hazard = cross_round_search(release, max_examples)
    out[CROSS_ROUND] = Verdict(
        CROSS_ROUND, (hazard.example, SGLangContext()) if hazard.exposed else None,
        hazard.detail)
    return out


def property_verdicts(release: SGLangRelease, max_examples: int = PROPERTY_EXAMPLES) -> Dict[str, Verdict]:
    out = {}
    for column in COLUMNS:
        world = minimal(worlds(), breaks(release, column), max_examples)
        if world is None:
            out[column] = Verdict(column, None)
            continue
        try:
            values = rule_values(release, world)
            detail = f"returns {sorted(set(values))}, ideal {world.ideal_runtime}"
        except RuleCrashed as exc:
            detail = str(exc).splitlines()[0].split(" raised ", 1)[-1][:110]
        out[column] = Verdict(column, (world, SGLangContext()), detail)
    return out


def _table(title: str, columns: List[str], rows: List[Tuple[str, Dict[str, Verdict]]],
           notes: List[str]) -> str:
    lines = [f"| {title} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label, verdicts in rows:
        cells = []
        for c in columns:
            v = verdicts[c]
            if v.unreachable:
                notes.append(f"[{len(notes) + 1}] {label} {c}: {v.detail}")
                cells.append(f"unreachable [{len(notes)}]")
                continue
            hazard = c in HAZARDS or c == CROSS_ROUND
            if v.example is None:
                cells.append("closed" if c == CROSS_ROUND
                             else "hardened" if hazard else "pass")
                continue
            notes.append(f"[{len(notes) + 1}] {label} {c}: {v.detail}; `{v.example[0]!r}`"
                         + ("" if v.example[1] == SGLangContext() else f" with `{v.example[1]!r}`"))
            cells.append(f"exposed [{len(notes)}]" if hazard else f"**FAIL** [{len(notes)}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_specs() -> List[str]:
    """Every pinned release."""
    return [f"sglang:{v}" for v in RELEASES]


def compat_specs() -> List[str]:
    """The rows of the engine x FlashInfer table (docs/flashinfer.md)."""
    return default_specs()


def tables(specs, load=release_from_spec) -> str:
    """The bug-class table and the property table, with numbered counterexamples."""
    releases = [load(s.partition("sglang:")[2] if s.startswith("sglang") else s)
                for s in specs]
    t0 = time.perf_counter()
    by_class = [(r.label, class_verdicts(r)) for r in releases]
    by_property = [(r.label, property_verdicts(r)) for r in releases]
    notes: List[str] = []
    header = [f"{c.title} ({c.record})" for c in BUG_CLASSES.values()]
    first = _table("release", list(BUGS) + list(HAZARDS) + [CROSS_ROUND], by_class, notes)
    second = _table("release", list(COLUMNS), by_property, notes)
    legend = " / ".join([f"`{k}`: {h}" for k, h in zip(BUG_CLASSES, header)]
                        + [CROSS_ROUND_LEGEND])
    return (f"{first}\n\n{legend}\n\n{second}\n\n" + "\n".join(f"- {n}" for n in notes)
            + f"\n\n(searched in {time.perf_counter() - t0:.0f} s: {CLASS_EXAMPLES} steps per "
              f"class cell and sequences per cross-round cell, {PROPERTY_EXAMPLES} worlds per "
              f"property cell, derandomized)")
