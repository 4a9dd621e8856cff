"""The properties every sizing policy must have, as plain checks shared by every tier.

Each check takes a world and the value the policy returned on each of its EP ranks, and raises
``PropertyViolation`` (an ``AssertionError``) whose message shows the world in words, the
rule's values, the ideal value and a command that replays it. ``rule_values`` is the one
place a policy is called: it also fails a rule that returns something other than an int,
answers differently for the same view, or is too slow to gate (``RULE_BUDGET``).
"""
from __future__ import annotations

import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

from ..sizing import NotApplicable, Policy
from .validation import A2ASizingError, NotAnInteger, require_int
from .engine import EnginePolicy, EngineStep, RemotePolicy, is_engine
from .generations import replay_flag
from .guard import CallTimedOut, PolicyExited, PolicyForked, guarded
from .show import shown, text
from .world import World

__all__ = ["RuleHung", "PropertyViolation", "RuleCrashed", "RefusedCorrectly", "SlowRule", "RuleBudget",
           "RULE_BUDGET", "RuleValues", "policy_name", "for_world", "world_for", "rule_values", "values_or_reject", "explain",
           "check_positive", "check_fits", "check_rank_invariant", "check_within_cap",
           "check_tight", "PROPERTIES", "COLUMNS", "check_all", "breaks", "broken_columns"]


class PropertyViolation(AssertionError):
    pass


class RuleCrashed(PropertyViolation):
    """The rule raised, or returned something other than an int (a crash in production)."""


class SlowRule(PropertyViolation):
    """The rule is too slow for the gate to check it in reasonable time."""


class RuleHung(SlowRule):
    """A call into the policy did not return within ``--rule-timeout-s`` and was stopped."""


class RefusedCorrectly(NotApplicable):
    """The policy refused to size a world where no valid runtime exists (payload over the
    cap): its clear error is the right answer, so there is no value to check."""


@dataclass
class RuleBudget:
    """Mean seconds per rule call allowed, judged after ``warmup`` calls in this process (so
    a slow first call, e.g. SGLang constructing its dispatcher, is not held against it), on
    the mean of at least ``sample`` calls. A rule's costs are heavy-tailed: SGLang 0.5.23's
    file takes 0.35 ms a call on average and 0.02 ms at the median, and 2% of its calls (a
    dispatcher built for a new shape) hold 79% of its time (benchmarks/README.md). The mean of
    a few dozen calls on a loaded host (a watch's first run on a 16-core GPU host, its pools
    starting beside it) reached the 20 ms budget: a slow-rule verdict on an unmodified file."""

    seconds: float = 0.02
    warmup: int = 20
    sample: int = 200
    calls: int = 0
    spent: float = 0.0

    def charge(self, seconds: float, name: str) -> None:
        self.calls += 1
        if self.calls <= self.warmup:  # warm-up calls are not counted at all
            return
        self.spent += seconds
        counted = self.calls - self.warmup
        if counted >= self.sample and self.spent / counted > self.seconds:
            mean = self.spent / counted
            raise SlowRule(
                f"[slow rule] {name} takes {mean * 1e3:.0f} ms per call on average over "
                f"{counted} calls after {self.warmup} warm-up calls (budget "
                f"{self.seconds * 1e3:.0f} ms): the ci profile makes "
                f"about 45,000 calls, i.e. {45_000 * mean / 3600:.1f} h. Make the rule cheaper "
                f"or raise the budget with --rule-budget-ms.")


RULE_BUDGET = RuleBudget()


def policy_name(policy: Policy) -> str:
    """A ``--policy`` spec that loads ``policy`` again (for replay lines)."""
    spec = getattr(policy, "spec", None)
    if spec:
        return spec
    module, qual = getattr(policy, "__module__", None), getattr(policy, "__qualname__", None)
    return f"{module}:{qual}" if module and qual and "<" not in qual else repr(policy)


class RuleValues(list):
    """The policy's value per EP rank, with ``notes``: what an engine policy's own code saw
    on each rank (e.g. the ``dp_global`` SGLang was handed), shown in every failure (and
    rendered only then: ``notes_from`` is the engine's own renderer)."""

    def __init__(self, values, notes: str = "", replay_args: str = "", notes_from=None):
        super().__init__(values)
        self._notes = notes
        self.notes_from = notes_from
        self.replay_args = replay_args  # e.g. an engine's --context, for the replay line

    @property
    def notes(self) -> str:
        return self.notes_from() if self.notes_from else self._notes


def for_world(policy, world: World) -> Policy:
    """The per-rank callable for ``world``: a rule itself, or an engine policy (SGLang's own
    dispatcher) bound to the whole world it runs in (``policy.bind(world)``)."""
    return policy.bind(world) if isinstance(policy, EnginePolicy) else policy


def rule_values(policy: Policy, world: World, name: str = "") -> List[int]:
    """The policy's value on every EP rank, each checked to be an int; the policy is asked
    once more for the last rank, which must give the same answer. A rule that raises, returns a
    non-int or answers differently is reported with the world and a replay line."""
    if isinstance(policy, RemotePolicy):  # every rank asked in the policy's own process
        return policy.rule_values(world, name)
    name = name or policy_name(policy)
    rank_policy = for_world(policy, world)
    engine = isinstance(rank_policy, EngineStep)
    values = RuleValues([], replay_args=rank_policy.replay_args if engine else "",
                        notes_from=rank_policy.notes if engine else None)
    for view in world.views:
        values.append(_call(rank_policy, view, world, values, name))
    last = world.ep_size - 1  # asked again right after: a counter or a coin shows here
    again = _call(rank_policy, world.views[last], world, values, name)
    if again != values[last]:
        raise RuleCrashed(
            f"[deterministic] {name} returned {shown(values[last])} for EP rank {last} and then "
            f"{shown(again)} for the same RankView: it depends on hidden state or randomness, so ranks can "
            f"disagree and the replay line below may not reproduce what the test saw.\n"
            f"{explain(world, values, name)}")
    return values


class BoundedOutput:
    """What a policy prints, passed on up to ``limit`` characters per process and dropped
    after that (once, with a warning): a rule printing megabytes per call would otherwise fill
    the disk through pytest's capture with nothing on screen."""

    limit = 64 * 1024

    def __init__(self):
        self.passed = 0
        self.dropped = 0
        self.target = sys.stdout  # where what passes goes (the stdout of the call)

    def write(self, text: str) -> int:
        room = self.limit - self.passed
        if room > 0:
            self.target.write(text[:room])
            self.passed += min(room, len(text))
        if len(text) > room:
            if not self.dropped:
                warnings.warn(f"the policy under test printed more than {self.limit:,} "
                              f"characters; the rest of what it prints is dropped")
            self.dropped += len(text) - max(room, 0)
        return len(text)

    def flush(self):
        pass


POLICY_OUTPUT = BoundedOutput()


def _call(policy, view, world, values, name):
    t0 = time.perf_counter()
    real = sys.stdout
    if real is not POLICY_OUTPUT:
        POLICY_OUTPUT.target, sys.stdout = real, POLICY_OUTPUT
    try:
        with guarded(who=name):
            value = policy(view)
    except PolicyExited as exc:
        raise RuleCrashed(f"[rule crashed] {name} called os._exit({shown(exc.code)}) on EP rank "
                          f"{view.ep_rank}: the gate kept the process (an exit from a policy "
                          f"never passes for a verdict)\n"
                          f"{explain(world, _with(values, '<exited>'), name)}") from None
    except PolicyForked as exc:
        raise RuleCrashed(f"[rule crashed] {name} forked the test process ({exc.forks} time(s)) "
                          f"on EP rank {view.ep_rank}: the copies were ended at once (a second "
                          f"copy of the run would report its tests again)\n"
                          f"{explain(world, _with(values, '<forked>'), name)}") from None
    except CallTimedOut as exc:
        raise RuleHung(f"[slow rule] {name} did not return within {exc.seconds:g} s on EP rank "
                       f"{view.ep_rank} (--rule-timeout-s): stopped\n"
                       f"{explain(world, _with(values, '<no answer>'), name)}") from None
    except NotApplicable as exc:
        if not isinstance(policy, EngineStep):  # only an engine's step may say so
            raise RuleCrashed(f"[rule crashed] {name} raised NotApplicable: {text(exc)} on EP rank "
                              f"{view.ep_rank}: only an engine policy may declare a world "
                              f"impossible\n{explain(world, _with(values, '<raised>'), name)}"
                              ) from exc
        raise
    except A2ASizingError as exc:
        if not world.payload_fits_cap:
            raise RefusedCorrectly(f"{type(exc).__name__}: {text(exc)}") from exc
        raise RuleCrashed(
            f"[rule crashed] {name} refused a world where runtime {world.ideal_runtime} is "
            f"valid: {type(exc).__name__}: {text(exc)}\n"
            f"{explain(world, _with(values, '<refused>'), name)}") from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - pytest.skip(), SystemExit, ...: a verdict
        raise RuleCrashed(
            f"[rule crashed] {name} raised {type(exc).__name__}: {text(exc)} on EP rank "
            f"{view.ep_rank}\n{explain(world, _with(values, '<raised>'), name)}") from exc
    finally:
        sys.stdout = real
    RULE_BUDGET.charge(time.perf_counter() - t0, name)
    try:
        return require_int(value)
    except NotAnInteger as exc:
        raise RuleCrashed(f"[int] {name} on EP rank {view.ep_rank}: {text(exc)}\n"
                          f"{explain(world, _with(values, value), name)}") from None


def _with(values: RuleValues, last) -> RuleValues:
    return RuleValues(list(values) + [last], values.notes, values.replay_args)


def world_for(policy, world: World, keep_cap: bool = False) -> World:
    """The world ``policy`` is checked on: an engine policy's nearest world its engine runs
    (``policy.engine_world``: vLLM never idles a DP rank at zero tokens, say), else ``world``;
    ``keep_cap`` for a tier whose workspaces are built per cap (the rank pool). Inside a
    Hypothesis test, a world the engine never runs is rejected."""
    if not is_engine(policy):
        return world
    try:
        return policy.engine_world(world, keep_cap=keep_cap)
    except NotApplicable as exc:
        from hypothesis import event, reject

        event(f"{type(exc).__name__}: {str(exc)[:60]}")
        reject()


def values_or_reject(policy: Policy, world: World, name: str = "") -> List[int]:
    """``rule_values`` inside a Hypothesis test: a world the policy declares impossible for
    its system is rejected (and shown in ``--hypothesis-show-statistics``), not checked."""
    from hypothesis import event, reject

    try:
        return rule_values(policy, world, name)
    except NotApplicable as exc:
        event(f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
        reject()


def explain(world: World, values: Sequence, name: str = "the rule") -> str:
    vals = [v if type(v) is int and v.bit_length() < 64 else _Shown(v) for v in values]
    listed = vals if len(vals) <= 16 else f"{vals[:8]} ... {vals[-4:]}"
    notes, extra = getattr(values, "notes", ""), getattr(values, "replay_args", "")
    return (f"world:\n{world.describe()}\n"
            f"  {name} returned per EP rank: {listed}   ideal: {world.ideal_runtime}\n"
            + (f"{notes}\n" if notes else "")
            + f"replay: python -m dispatcher{replay_flag(world.flashinfer)} --policy {shlex.quote(name)}{extra} "
              f"\"{world!r}\"")


class _Shown:
    """A value printed by ``show.shown`` inside a list's repr."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return shown(self.value)


def _fail(prop: str, what: str, world: World, values, name: str):
    raise PropertyViolation(f"[{prop}] {what}\n{explain(world, values, name)}")


def check_positive(world: World, values: Sequence[int], name: str = "the rule") -> None:
    """runtime >= 1 on every rank (FlashInfer rejects 0 even when every rank is idle)."""
    bad = [r for r, v in enumerate(values) if not v >= 1]
    if bad:
        _fail("positive", f"runtime < 1 on ranks {bad[:8]}", world, values, name)


def check_fits(world: World, values: Sequence[int], name: str = "the rule") -> None:
    """runtime >= every EP rank's payload rows (else FlashInfer overwrites slots silently)."""
    need = world.max_rows
    bad = [r for r, v in enumerate(values) if v < need]
    if bad:
        _fail("fits", f"runtime below the largest payload ({need} rows, on rank "
              f"{world.rows_per_rank.index(need)}) on ranks {bad[:8]}", world, values, name)


def check_rank_invariant(world: World, values: Sequence[int], name: str = "the rule") -> None:
    """Every EP rank passes the same runtime (different values corrupt each other)."""
    if len(set(values)) > 1:
        _fail("rank-invariant", f"ranks disagree: {sorted(set(values))[:6]}", world, values, name)


def check_within_cap(world: World, values: Sequence[int], name: str = "the rule") -> None:
    """runtime <= max_num_tokens whenever the payload itself fits the cap."""
    if world.payload_fits_cap:
        bad = [r for r, v in enumerate(values) if v > world.max_num_tokens]
        if bad:
            _fail("within-cap", f"runtime over the cap {world.max_num_tokens} although every "
                  f"payload ({world.max_rows} rows) fits it", world, values, name)


def check_tight(world: World, values: Sequence[int], name: str = "the rule") -> None:
    """runtime == max(1, largest post-scatter rows): no padding rows moved or computed."""
    bad = [r for r, v in enumerate(values) if v != world.ideal_runtime]
    if bad:
        _fail("tight", f"runtime != ideal {world.ideal_runtime} on ranks {bad[:8]}", world,
              values, name)


PROPERTIES: Dict[str, Callable] = {
    "positive": check_positive,
    "fits": check_fits,
    "rank-invariant": check_rank_invariant,
    "within-cap": check_within_cap,
    "tight": check_tight,
}
COLUMNS = tuple(PROPERTIES) + ("no crash",)  # what a verdict is given on


def check_all(world: World, values: Sequence[int], name: str = "the rule") -> None:
    for check in PROPERTIES.values():
        check(world, values, name)


def breaks(policy: Policy, column: str) -> Callable[[World], bool]:
    """A predicate: does ``policy`` break ``column`` (a property, or "no crash") on a world?

    A world the policy cannot produce or correctly refuses is no counterexample; a crash
    counts against "no crash" only, so each column's counterexample is about that column."""
    if column not in COLUMNS:
        raise ValueError(f"unknown property {column!r}: one of {COLUMNS}")
    return lambda world: column in broken_columns(policy, world)


def broken_columns(policy: Policy, world: World) -> tuple:
    """Every column ``policy`` breaks on ``world``, from one call of the policy per rank:
    ``("no crash",)`` when it crashes, ``()`` on a world it cannot produce or correctly
    refuses, else the properties it breaks (``breaks(policy, c)(world)`` for each ``c``)."""
    name = policy_name(policy)
    try:
        values = rule_values(policy, world, name)
    except NotApplicable:
        return ()
    except RuleCrashed:
        return ("no crash",)
    broken = []
    for column, check in PROPERTIES.items():
        try:
            check(world, values, name)
        except PropertyViolation:
            broken.append(column)
    return tuple(broken)
