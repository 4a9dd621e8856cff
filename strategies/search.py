"""Searching the strategies outside ``@given``, as Hypothesis's own suite does
(``tests/common/debug.py``): one settings base, and three verbs.

- ``find_any``: is this regime reachable at all? No shrinking (nobody reads the example).
- ``minimal``: what does a failure shrink to? Shrinks; ``None`` when there is none.
- ``assert_no_examples`` / ``assert_all_examples``: nothing / everything in the search
  satisfies the condition.
- ``visited``: the examples such a search visits, recorded once, so that many conditions (a
  verdict table's cells: one per release) are checked on exactly the examples ``find_any``
  and ``assert_no_examples`` would visit for each, without generating them again.

Every search is derandomized, uses no example database and has no deadline, so it gives the
same answer in pytest, in ``python -m dispatcher.commands.verdicts`` and in a benchmark.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, TypeVar

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

__all__ = ["SEARCH", "find_any", "minimal", "assert_no_examples", "assert_all_examples",
           "visited", "first_in"]

T = TypeVar("T")
SEARCH = settings(max_examples=2000, database=None, derandomize=True, deadline=None,
                  suppress_health_check=list(HealthCheck))
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def find_any(strategy, condition: Callable[[T], bool], max_examples: int = 3000) -> T:
    """An example satisfying ``condition`` (not shrunk); fails when none is found."""
    try:
        return find(strategy, condition,
                    settings=settings(SEARCH, max_examples=max_examples, phases=_NO_SHRINK))
    except NoSuchExample:
        raise AssertionError(f"no example in {max_examples} satisfies the condition: the "
                             f"strategy never reaches this regime") from None


def minimal(strategy, condition: Callable[[T], bool], max_examples: int = 2000) -> Optional[T]:
    """The shrunk example satisfying ``condition``, or ``None`` when the search finds none."""
    try:
        return find(strategy, condition, settings=settings(SEARCH, max_examples=max_examples))
    except NoSuchExample:
        return None


def assert_no_examples(strategy, condition: Callable[[T], bool], max_examples: int = 500) -> None:
    """No example in the search satisfies ``condition``."""
    found = minimal(strategy, condition, max_examples)
    assert found is None, f"expected no example, found (shrunk): {found!r}"


def assert_all_examples(strategy, condition: Callable[[T], bool], max_examples: int = 300) -> None:
    """Every example in the search satisfies ``condition``."""
    found = minimal(strategy, lambda x: not condition(x), max_examples)
    assert found is None, f"expected every example to satisfy it, found (shrunk): {found!r}"


def visited(strategy, max_examples: int) -> Tuple:
    """Every example a search of ``max_examples`` visits, in order, before any condition holds
    (a derandomized search whose condition never holds visits the same sequence whatever the
    condition is, and one that stops at the first hit visits a prefix of it). Recorded once
    per process for each (strategy, count, FlashInfer generation: strategies draw only what
    the session's generation supports): the strategy is named by its repr."""
    from dispatcher.model.generations import active

    key = (repr(strategy), max_examples, active().version)
    if key not in _VISITED:
        seen = []

        def record(example) -> bool:
            seen.append(example)
            return False
        try:
            find(strategy, record,
                 settings=settings(SEARCH, max_examples=max_examples, phases=_NO_SHRINK))
        except NoSuchExample:
            pass
        _VISITED[key] = tuple(seen)
    return _VISITED[key]


_VISITED: dict = {}


def first_in(examples, condition: Callable[[T], bool]) -> Optional[T]:
    """The first of ``examples`` satisfying ``condition`` (what ``find_any`` would return on
    the search they were recorded from), or None."""
    return next((x for x in examples if condition(x)), None)
