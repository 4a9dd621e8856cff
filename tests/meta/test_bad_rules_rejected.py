"""Known-bad rules are rejected: for each one, Hypothesis finds a world where the property it
breaks fails, and the shrunk counterexample reads well. A property that passes on everything
protects nothing; these tests prove each one can fail."""
import re

import pytest

from .. import copy_suite

from dispatcher.emulator.a2a import RankRefused

from dispatcher.emulator.rounds import round_trip
from dispatcher.model import properties
from dispatcher.model.properties import breaks
from dispatcher.mutants import MUTANTS
from dispatcher.sizing import KNOWN_BAD_RULES, ideal_rule
from strategies import a2a_worlds, worlds
from strategies.search import minimal

RULES = {**KNOWN_BAD_RULES, **MUTANTS}

# rule -> the properties it must be caught breaking
EXPECTED = {
    "prefix_rule": ["tight", "within-cap", "positive", "no crash"],
    "seed_era_rule": ["tight", "positive"],
    "undersized": ["fits", "tight"],
    "rank_variant": ["rank-invariant", "fits"],
    "over_cap": ["within-cap", "tight"],
    "zero_when_idle": ["positive"],
    "not_tight": ["tight"],
    "one_extra": ["tight"],
}


@pytest.mark.parametrize("name, prop", [(n, p) for n, ps in EXPECTED.items() for p in ps])
def test_bad_rule_breaks_property(name, prop):
    world = minimal(worlds(), breaks(RULES[name], prop))
    assert world is not None, f"{name} was never caught breaking {prop}"
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
    world = minimal(worlds(), lambda w: not w.dp_attention and _oversized(RULES["prefix_rule"])(w))
    assert world.attn_tp_size == world.ep_size == 2 and world.dp_global == (2,)
    assert properties.rule_values(RULES["prefix_rule"], world) == [2, 2]  # ideal: 1


def test_seed_era_rule_oversized_only_with_dp_attention_and_attn_tp():
    world = minimal(worlds(), _oversized(RULES["seed_era_rule"]))
    assert world.dp_attention and world.attn_tp_size > 1
    assert world.ep_size == 4 and world.dp_size == 2


def test_undersized_rule_corrupts_the_emulated_a2a():
    """Past the CPU checks: the exact model shows what an undersized rule causes: wrong output
    on 0.7.2, the short ranks refused on 0.7.4 (their peers left waiting)."""
    def corrupted(world):
        values = properties.rule_values(RULES["undersized"], world)
        return world.max_rows >= 2 and not round_trip(world, values).exact
    world = minimal(a2a_worlds(flashinfer="0.7.2"), corrupted)
    rt = round_trip(world, properties.rule_values(RULES["undersized"], world))
    assert rt.events and rt.mismatched_ranks()
    world = world.on("0.7.4")
    with pytest.raises(RankRefused):
        round_trip(world, properties.rule_values(RULES["undersized"], world))


@pytest.mark.xdist_group("worlds-500")  # one worker records the search once (--dist=loadgroup)
@pytest.mark.parametrize("column", properties.COLUMNS)
def test_shipped_rule_has_no_counterexample(column):
    """The 500 worlds assert_no_examples would search, read once for every column."""
    from strategies.search import first_in, visited

    hit = first_in(visited(worlds(), 500), breaks(ideal_rule, column))
    assert hit is None, f"the shipped rule breaks {column} on {hit!r}"


@pytest.mark.parametrize("rule", ["prefix_rule", "dispatcher.mutants:undersized"])
def test_suite_fails_end_to_end_with_a_readable_counterexample(pytester, rule, monkeypatch):
    """``pytest --policy=RULE`` on the CPU tier fails, printing a shrunk world in words and
    the command that replays it (run through pytester, in a subprocess)."""
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    copy_suite(pytester.path, "cpu")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-x", "-k", "tight",
        f"--policy={rule}", "tests/cpu/test_sizing_properties.py")
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text[-3000:]
    assert re.search(r"(Falsifying|Failing) (explicit )?example", text), text[-3000:]
    assert re.search(r"replay: python -m dispatcher( --flashinfer=\S+)? --policy", text)
    assert "payload rows per EP rank" in text and "ideal:" in text
