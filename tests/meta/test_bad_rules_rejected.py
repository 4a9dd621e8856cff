"""Known-bad rules are rejected: for each one, Hypothesis finds a world where the property it
breaks fails, and the shrunk counterexample reads well. A property that passes on everything
protects nothing; these tests prove each one can fail."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from dispatcher import properties
from dispatcher.emulator import round_trip
from dispatcher.mutants import MUTANTS
from dispatcher.sizing import KNOWN_BAD_RULES, ideal_rule
from strategies import a2a_worlds, worlds

ROOT = Path(__file__).resolve().parents[2]
FIND = settings(max_examples=2000, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
RULES = {**KNOWN_BAD_RULES, **MUTANTS}

# rule -> the properties it must be caught breaking
EXPECTED = {
    "prefix_rule": ["tight", "within-cap", "positive"],
    "seed_era_rule": ["tight", "positive"],
    "undersized": ["fits", "tight"],
    "rank_variant": ["rank-invariant", "fits"],
    "over_cap": ["within-cap", "tight"],
    "zero_when_idle": ["positive"],
    "not_tight": ["tight"],
    "one_extra": ["tight"],
}


def _breaks(rule, prop):
    check = properties.PROPERTIES[prop]

    def violated(world):
        try:
            values = properties.rule_values(rule, world)
        except properties.RuleCrashed:  # fails the suite too, but not this property
            return False
        try:
            check(world, values, rule.__name__)
        except properties.PropertyViolation:
            return True
        return False
    return violated


@pytest.mark.parametrize("name, prop", [(n, p) for n, ps in EXPECTED.items() for p in ps])
def test_bad_rule_breaks_property(name, prop):
    world = find(worlds(), _breaks(RULES[name], prop), settings=FIND)
    assert world.ep_size <= 4, f"{name}/{prop} shrank only to {world!r}"


def test_every_known_bad_rule_is_covered():
    assert set(EXPECTED) == set(RULES)


def _oversized(rule):
    def over(world):
        try:
            return min(properties.rule_values(rule, world)) > world.ideal_runtime
        except properties.RuleCrashed:
            return False
    return over


def test_prefix_rule_caught_in_sp_world_without_dp_attention():
    """The famous bug: SP scatter, no DP attention, the pre-scatter count (attn_tp x)."""
    world = find(worlds(), lambda w: not w.dp_attention and _oversized(RULES["prefix_rule"])(w),
                 settings=FIND)
    assert world.attn_tp_size == world.ep_size == 2 and world.dp_global == (2,)
    assert properties.rule_values(RULES["prefix_rule"], world) == [2, 2]  # ideal: 1


def test_seed_era_rule_oversized_only_with_dp_attention_and_attn_tp():
    world = find(worlds(), _oversized(RULES["seed_era_rule"]), settings=FIND)
    assert world.dp_attention and world.attn_tp_size > 1
    assert world.ep_size == 4 and world.dp_size == 2


def test_prefix_rule_crashes_on_an_empty_dp_global():
    world = find(worlds(), lambda w: w.dp_global == () and w.max_rows > 0, settings=FIND)
    with pytest.raises(properties.RuleCrashed, match="ValueError"):
        properties.rule_values(RULES["prefix_rule"], world)


def test_undersized_rule_corrupts_the_emulated_a2a():
    """Past the CPU checks: the exact model shows the wrong output an undersized rule causes."""
    def corrupted(world):
        values = properties.rule_values(RULES["undersized"], world)
        return world.max_rows >= 2 and not round_trip(world, values).exact
    world = find(a2a_worlds(), corrupted, settings=FIND)
    rt = round_trip(world, properties.rule_values(RULES["undersized"], world))
    assert rt.events and rt.mismatched_ranks()


@pytest.mark.parametrize("prop", list(properties.PROPERTIES))
def test_shipped_rule_has_no_counterexample(prop):
    with pytest.raises(NoSuchExample):
        find(worlds(), _breaks(ideal_rule, prop), settings=settings(FIND, max_examples=500))


@pytest.mark.parametrize("rule", ["prefix_rule", "dispatcher.mutants:undersized"])
def test_suite_fails_end_to_end_with_a_readable_counterexample(rule):
    """``pytest --policy=RULE`` on the CPU tier fails, printing a shrunk world in words and
    the command that replays it."""
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
         "-x", str(ROOT / "tests/cpu/test_sizing_properties.py"), f"--policy={rule}",
         "-k", "tight", "-o", "addopts=--strict-markers"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert re.search(r"(Falsifying|Failing) (explicit )?example", text), text[-3000:]
    assert "replay: python -m dispatcher --policy" in text
    assert "payload rows per EP rank" in text and "ideal:" in text
