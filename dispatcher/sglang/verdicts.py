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

from strategies import worlds
from strategies.search import minimal

from ..model.properties import COLUMNS, RuleCrashed, breaks, rule_values
from ..model.sglang_context import SGLangContext
from ..model.world import World
from ..policies import PolicyError, load_policy
from .loader import SGLangRelease

__all__ = ["Verdict", "verdicts", "extend_behaviour", "table", "main"]

SEARCH_EXAMPLES = 1500


@dataclass(frozen=True)
class Verdict:
    column: str
    world: Optional[World]  # the shrunk counterexample, None when the property holds
    detail: str = ""


def verdicts(release: SGLangRelease, max_examples: int = SEARCH_EXAMPLES) -> Dict[str, Verdict]:
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


def main(argv=None) -> int:
    specs = (sys.argv[1:] if argv is None else argv) or ["0.5.10", "0.5.14", "0.5.16", "0.5.23"]
    try:
        print(table(specs))
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
