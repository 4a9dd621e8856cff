"""CPU-tier speed: policy-property throughput, emulated-A2A throughput, time to catch the
pre-fix rule. Run from the repo root:  python benchmarks/cpu_speed.py [--examples N]

Each figure runs Hypothesis exactly as the suite does (ci-profile settings: derandomized,
no database) and includes generation, which dominates: Hypothesis's own per-example cost on
the 2-core CPU machine is ~0.5 ms even for a two-integer strategy (printed below as the floor).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import Phase, given, settings, strategies as st  # noqa: E402

from dispatcher.emulator.rounds import round_trip  # noqa: E402
from dispatcher.model import properties  # noqa: E402
from dispatcher.sizing import ideal_rule, prefix_rule  # noqa: E402
from strategies import a2a_worlds, worlds  # noqa: E402
from strategies.search import SEARCH  # noqa: E402


def _settings(n, phases=(Phase.generate,)):
    return settings(SEARCH, max_examples=n, phases=list(phases))


def _rate(strategy, body, n, repeats=3):
    counts = {"worlds": 0, "ranks": 0}

    @_settings(n)
    @given(strategy)
    def run(world):
        counts["worlds"] += 1
        counts["ranks"] += getattr(world, "ep_size", 1)
        body(world)

    rates = []
    for _ in range(repeats):
        counts.update(worlds=0, ranks=0)
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        rates.append((counts["worlds"] / dt, counts["ranks"] / dt))
    w = statistics.median(r[0] for r in rates)
    r = statistics.median(r[1] for r in rates)
    return w, r


def policy_properties(world):
    properties.check_all(world, properties.rule_values(ideal_rule, world))


def emulated(world):
    assert round_trip(world, [world.ideal_runtime] * world.ep_size).exact


def time_to_catch_prefix_rule(repeats=5):
    """Wall time of one failing ``@given`` run of the 'tight' property with the pre-fix rule:
    generation until the first failure plus shrinking, as pytest would spend it."""
    times, shrunk = [], None

    @settings(_settings(300, phases=(Phase.explicit, Phase.generate, Phase.shrink)))
    @given(worlds())
    def tight(world):
        values = properties.rule_values(prefix_rule, world, "prefix_rule")
        properties.check_tight(world, values, "prefix_rule")

    for _ in range(repeats):
        t = time.perf_counter()
        try:
            tight()
        except (AssertionError, ExceptionGroup) as exc:  # Hypothesis may report several
            errors = getattr(exc, "exceptions", [exc])
            shrunk = [str(e).splitlines()[0] + " | " + str(e).splitlines()[-1].split('"')[1]
                      for e in errors]
        times.append(time.perf_counter() - t)
    return statistics.median(times), shrunk


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    floor, _ = _rate(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), lambda _: None, a.examples)
    pw, pr = _rate(worlds(), policy_properties, a.examples)
    ew, er = _rate(a2a_worlds(), emulated, max(200, a.examples // 4))
    catch, shrunk = time_to_catch_prefix_rule()
    figures = {
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
        "hypothesis_floor_examples_per_s": round(floor),
        "policy_worlds_per_s": round(pw),
        "policy_rank_checks_per_s": round(pr),
        "emulated_a2a_worlds_per_s": round(ew),
        "prefix_rule_found_and_shrunk_s": round(catch, 3),
        "prefix_rule_shrunk_to": shrunk,
    }
    for k, v in figures.items():
        print(f"{k:34s} {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
