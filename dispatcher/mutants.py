"""Deliberately wrong sizing rules, one per way a rule can be wrong.

The meta tests prove the properties reject each of them; the README shows what the suite
prints for one (``pytest --policy=dispatcher.mutants:undersized``).
"""
from __future__ import annotations

from .sizing import RankView, ideal_rule


def undersized(view: RankView) -> int:
    """One row short of the ideal (FlashInfer would write past a slot)."""
    return max(1, ideal_rule(view) - 1)


def rank_variant(view: RankView) -> int:
    """Each rank its own rows: right value on some ranks, different ones on others."""
    return max(1, view.local_tokens)


def over_cap(view: RankView) -> int:
    """Always the cap plus one."""
    return view.max_num_tokens + 1


def zero_when_idle(view: RankView) -> int:
    """Forgets the max(1, ...) floor."""
    return ideal_rule(view) if max(view.dp_global or (view.local_tokens,)) else 0


def not_tight(view: RankView) -> int:
    """Valid but wasteful: always the cap."""
    return view.max_num_tokens


def one_extra(view: RankView) -> int:
    """Valid but one padding row too many whenever that still fits the cap."""
    return min(view.max_num_tokens, ideal_rule(view) + 1)


MUTANTS = {f.__name__: f for f in (undersized, rank_variant, over_cap, zero_when_idle,
                                   not_tight, one_extra)}
