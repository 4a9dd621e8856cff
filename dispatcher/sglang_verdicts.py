"""Measure what an SGLang release's dispatch() does to every property, and print the table.

    python -m dispatcher.sglang_verdicts 0.5.10 0.5.14 0.5.16 0.5.23 [PATH ...]

For each property Hypothesis searches the suite's own worlds (decode mode, as the A2A runs)
for a violation and shrinks it; "no crash" is SGLang raising where a valid runtime exists.
Worlds SGLang cannot produce (every DP group idle) and over-cap worlds it refuses with its own
error are not counterexamples. The extend column says what the release does with an extend
(prefill) batch: launch the A2A or route around it (all-gather).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Dict, Optional

from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from . import properties
from .sglang_adapter import SGLangContext, SGLangRelease, load_release
from .policies import load_policy
from .sizing import NotApplicable
from .world import World
from strategies import worlds

COLUMNS = ("positive", "fits", "rank-invariant", "within-cap", "tight", "no crash")
SEARCH = settings(max_examples=1500, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))


@dataclass(frozen=True)
class Verdict:
    column: str
    world: Optional[World]  # the shrunk counterexample, None when the property holds
    detail: str = ""


def _violates(release: SGLangRelease, column: str):
    def check(world: World) -> bool:
        try:
            values = properties.rule_values(release, world, release.__name__)
        except NotApplicable:
            return False
        except properties.RuleCrashed:
            return column == "no crash"
        if column == "no crash":
            return False
        try:
            properties.PROPERTIES[column](world, values, release.__name__)
        except properties.PropertyViolation:
            return True
        return False
    return check


def verdicts(release: SGLangRelease) -> Dict[str, Verdict]:
    out = {}
    for column in COLUMNS:
        try:
            world = find(worlds(), _violates(release, column), settings=SEARCH)
        except NoSuchExample:
            out[column] = Verdict(column, None)
            continue
        try:
            values = properties.rule_values(release, world, release.__name__)
            detail = f"returns {sorted(set(values))}, ideal {world.ideal_runtime}"
        except Exception as exc:  # noqa: BLE001 - the crash itself is the detail
            detail = str(exc).splitlines()[0].split(" raised ", 1)[-1][:110]
        out[column] = Verdict(column, world, detail)
    return out


def extend_behaviour(release: SGLangRelease) -> str:
    world = World(ep_size=4, dp_size=1, group_tokens=(9,), max_num_tokens=64)
    o = release.outcome(world, 0, SGLangContext(forward_mode="extend"))
    if o.routed_around:
        return "routed around the A2A (all-gather)"
    return f"A2A with runtime {o.runtime} (ideal {world.ideal_runtime})" if o.error is None else o.error


def table(specs) -> str:
    lines = ["| release | " + " | ".join(COLUMNS) + " | extend batch |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    notes = []
    for spec in specs:
        release = load_policy(spec if spec.startswith("sglang") else f"sglang:{spec}")[1]
        v = verdicts(release)
        cells = []
        for c in COLUMNS:
            if v[c].world is None:
                cells.append("pass")
            else:
                cells.append(f"**FAIL** [{len(notes) + 1}]")
                notes.append(f"[{len(notes) + 1}] {release.label} {c}: `{v[c].world!r}` -> {v[c].detail}")
        lines.append(f"| {release.label} | " + " | ".join(cells) + f" | {extend_behaviour(release)} |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


if __name__ == "__main__":
    print(table(sys.argv[1:] or ["0.5.10", "0.5.14", "0.5.16", "0.5.23"]))
