"""The cross-round hazard of one workspace used by two A2A rounds in a row: which of round n's
combine rows round n+1's dispatch can overwrite before a slower peer has read them.

FlashInfer's combine is a pull that signals only at its start: a rank that finished combine n
starts dispatch n+1 and pushes rows into every peer's receive planes while a slower rank may
still be reading its round-n combine input in that peer's workspace (the source reading, with
file:line, is docs/flashinfer.md's "cross-round"). Only the layout keeps the two apart:

- FlashInfer 0.7.2 puts the combine input right after the *current* planes
  (``combine_offset = pad(dispatch_end)``), so a round whose planes end further out (a larger
  runtime, or more bytes per token: a BF16 layer after an NVFP4 one) writes over the previous
  round's combine input;
- FlashInfer 0.7.4 puts it in a fixed region after a dispatch region sized for the cap, so no
  dispatch write reaches it.

``rows_at_risk`` is that condition on two ``Layout`` values (either generation's, from
``Generation.layout``), to the byte: in one target's workspace, reader ``a``'s round-n combine
rows are ``[c + (a*R + i)*cb, +cb)`` for ``i < prev_rows[a]``, and writer ``u``'s round-(n+1) rows
in plane ``q`` are ``[P_q + (u*R' + j)*b_q, +b_q)`` for ``j < next_rows[u]``. A reader's row is at
risk when any byte of it lies under a row some *other* rank writes (a rank's own next dispatch
follows its own combine on its stream).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from .payloads import Layout

__all__ = ["rows_at_risk", "grows_over"]


def grows_over(prev: Layout, nxt: Layout) -> bool:
    """Whether round n+1's planes (every rank sending its full runtime) end past the start of
    round n's combine input: the byte condition, before counting rows."""
    return nxt.dispatch_end > prev.combine_offset


def _merge(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    spans.sort()
    merged: List[Tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def rows_at_risk(prev: Layout, nxt: Layout, prev_rows: Sequence[int] = (),
                 next_rows: Sequence[int] = ()) -> Tuple[int, ...]:
    """Per reader rank ``a``: how many of its round-n combine rows in a peer's workspace lie
    (in part) under bytes another rank writes there in round n+1's dispatch.

    ``prev_rows[a]``: rows ``a`` sent to that peer in round n (at most ``prev.runtime``);
    ``next_rows[u]``: rows ``u`` sends it in round n+1 (at most ``nxt.runtime``). Default: every
    rank its full runtime, the worst case a sizing rule allows."""
    ep = prev.ep_size
    if nxt.ep_size != ep or nxt.combine_bytes != prev.combine_bytes:
        raise ValueError("two rounds on one workspace share ep_size and the combine row size")
    before = tuple(prev_rows) or (prev.runtime,) * ep
    after = tuple(next_rows) or (nxt.runtime,) * ep
    if len(before) != ep or len(after) != ep:
        raise ValueError(f"one row count per rank ({ep})")
    if any(not 0 <= n <= prev.runtime for n in before) or \
            any(not 0 <= n <= nxt.runtime for n in after):
        raise ValueError("a rank sends at most the round's runtime rows to one peer")
    cb, c, r = prev.combine_bytes, prev.combine_offset, prev.runtime
    writes = [(u, [(off + u * nxt.runtime * p.bytes_per_token,
                    off + (u * nxt.runtime + after[u]) * p.bytes_per_token)
                   for off, p in zip(nxt.recv_offsets, nxt.payloads)]) for u in range(ep)]
    risk = []
    for a in range(ep):
        start = c + a * r * cb
        end = start + before[a] * cb
        hits = []
        for u, spans in writes:
            if u == a:
                continue
            for lo, hi in spans:
                lo, hi = max(lo, start), min(hi, end)
                if lo < hi:  # the rows of a's block this write touches
                    hits.append(((lo - start) // cb, (hi - start + cb - 1) // cb))
        risk.append(sum(hi - lo for lo, hi in _merge(hits)))
    return tuple(risk)
