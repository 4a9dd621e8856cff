"""The properties every sizing policy must have, as plain checks shared by every tier.

Each check takes a world and the value the policy returned on each of its EP ranks, and raises
``PropertyViolation`` (an ``AssertionError``) whose message shows the world in words, the
rule's values, the ideal value and a command that replays it.
"""
from __future__ import annotations

import shlex
from typing import Callable, Dict, Sequence

from .dispatcher import A2ASizingError
from .sizing import NotApplicable, Policy
from .world import World

__all__ = ["PropertyViolation", "RuleCrashed", "rule_values", "values_or_reject", "explain", "check_positive", "check_fits",
           "check_rank_invariant", "check_within_cap", "check_tight", "PROPERTIES", "check_all"]


class PropertyViolation(AssertionError):
    pass


class RuleCrashed(PropertyViolation):
    """The rule raised instead of returning a value (a crash in production)."""


class RefusedCorrectly(NotApplicable):
    """The policy refused to size a world where no valid runtime exists (payload over the
    cap): its clear error is the right answer, so there is no value to check."""


def rule_values(policy: Policy, world: World, policy_name: str = "the rule") -> list:
    """The policy's value on every EP rank; a rule that raises is reported with the world."""
    values = []
    for view in world.views:
        try:
            values.append(policy(view))
        except NotApplicable:
            raise
        except A2ASizingError as exc:
            if not world.payload_fits_cap:
                raise RefusedCorrectly(f"{type(exc).__name__}: {exc}") from exc
            raise RuleCrashed(
                f"[rule crashed] {policy_name} refused a world where runtime "
                f"{world.ideal_runtime} is valid: {type(exc).__name__}: {exc}\n"
                f"{explain(world, values + ['<refused>'], policy_name)}") from exc
        except Exception as exc:
            raise RuleCrashed(
                f"[rule crashed] {policy_name} raised {type(exc).__name__}: {exc} on EP rank "
                f"{view.ep_rank}\n{explain(world, values + ['<raised>'], policy_name)}") from exc
    return values


def values_or_reject(policy: Policy, world: World, policy_name: str = "the rule") -> list:
    """``rule_values`` inside a Hypothesis test: a world the policy declares impossible for
    its system is rejected (and shown in ``--hypothesis-show-statistics``), not checked."""
    from hypothesis import event, reject

    try:
        return rule_values(policy, world, policy_name)
    except NotApplicable as exc:
        event(f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
        reject()


def explain(world: World, values: Sequence[int], policy_name: str = "the rule") -> str:
    vals = list(values)
    shown = vals if len(vals) <= 16 else f"{vals[:8]} ... {vals[-4:]}"
    return (f"world:\n{world.describe()}\n"
            f"  {policy_name} returned per EP rank: {shown}   ideal: {world.ideal_runtime}\n"
            f"replay: python -m dispatcher --policy {shlex.quote(policy_name)} \"{world!r}\"")


def _fail(name: str, what: str, world: World, values, policy_name: str):
    raise PropertyViolation(f"[{name}] {what}\n{explain(world, values, policy_name)}")


def check_positive(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    """runtime >= 1 on every rank (FlashInfer rejects 0 even when every rank is idle)."""
    bad = [r for r, v in enumerate(values) if not v >= 1]
    if bad:
        _fail("positive", f"runtime < 1 on ranks {bad[:8]}", world, values, policy_name)


def check_fits(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    """runtime >= every EP rank's payload rows (else FlashInfer overwrites slots silently)."""
    need = world.max_rows
    bad = [r for r, v in enumerate(values) if v < need]
    if bad:
        _fail("fits", f"runtime below the largest payload ({need} rows, on rank "
              f"{world.rows_per_rank.index(need)}) on ranks {bad[:8]}", world, values, policy_name)


def check_rank_invariant(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    """Every EP rank passes the same runtime (different values corrupt each other)."""
    if len(set(values)) > 1:
        _fail("rank-invariant", f"ranks disagree: {sorted(set(values))[:6]}", world, values,
              policy_name)


def check_within_cap(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    """runtime <= max_num_tokens whenever the payload itself fits the cap."""
    if world.payload_fits_cap:
        bad = [r for r, v in enumerate(values) if v > world.max_num_tokens]
        if bad:
            _fail("within-cap", f"runtime over the cap {world.max_num_tokens} although every "
                  f"payload ({world.max_rows} rows) fits it", world, values, policy_name)


def check_tight(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    """runtime == max(1, largest post-scatter rows): no padding rows moved or computed."""
    bad = [r for r, v in enumerate(values) if v != world.ideal_runtime]
    if bad:
        _fail("tight", f"runtime != ideal {world.ideal_runtime} on ranks {bad[:8]}", world,
              values, policy_name)


PROPERTIES: Dict[str, Callable] = {
    "positive": check_positive,
    "fits": check_fits,
    "rank-invariant": check_rank_invariant,
    "within-cap": check_within_cap,
    "tight": check_tight,
}


def check_all(world: World, values: Sequence[int], policy_name: str = "the rule") -> None:
    for check in PROPERTIES.values():
        check(world, values, policy_name)
