"""The cross-round hazard on the byte model (``dispatcher/model/cross_round.py``): the rows of a
round's combine input the next round's dispatch can overwrite. Known values are the source
reading's (docs/flashinfer.md); the property holds it to the byte condition on both
generations: on 0.7.2 some row is at risk exactly when the next planes end past the previous
combine offset, on 0.7.4 never (both rounds on one workspace, allocated for the wider row)."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.model.cross_round import grows_over, rows_at_risk
from dispatcher.model.generations import GENERATIONS
from dispatcher.model.payloads import (
    PayloadFormat,
    combine_bytes_per_token,
    dispatch_payloads,
)

G072, G074 = GENERATIONS["0.7.2"], GENERATIONS["0.7.4"]
W, H, K, CAP = 8, 7168, 8, 1024
BF16 = dispatch_payloads(PayloadFormat.BF16, H, K)
NVFP4 = dispatch_payloads(PayloadFormat.NVFP4, H, K)


def _rounds(gen, r0, p0, r1, p1, ep=W, hidden=H, cap=CAP):
    """Two rounds on one workspace, allocated for the wider of the two rows."""
    cb = combine_bytes_per_token(hidden)
    wide = max(p0, p1, key=lambda ps: sum(p.bytes_per_token for p in ps))
    return gen.layout(ep, cap, r0, p0, cb, wide), gen.layout(ep, cap, r1, p1, cb, wide)


@pytest.mark.parametrize("r0, p0, r1, p1, at_risk", [
    (64, BF16, 65, BF16, (9, 0, 0, 0, 0, 0, 0, 0)),  # one more row already reaches rank 0's
    (64, BF16, 128, BF16, (64, 64, 64, 64, 64, 64, 64, 3)),
    (128, NVFP4, 128, BF16, (128, 128, 128, 128, 128, 96, 0, 0)),  # a BF16 layer after NVFP4
    (128, BF16, 128, NVFP4, (0,) * 8),
    (128, BF16, 128, BF16, (0,) * 8),  # a constant layout is safe
    (128, BF16, 64, BF16, (0,) * 8),  # and so is a shrinking one
], ids=["64-65", "64-128", "nvfp4-bf16", "bf16-nvfp4", "constant", "shrinking"])
def test_the_rows_the_source_reading_found(r0, p0, r1, p1, at_risk):
    assert rows_at_risk(*_rounds(G072, r0, p0, r1, p1)) == at_risk
    assert rows_at_risk(*_rounds(G074, r0, p0, r1, p1)) == (0,) * 8  # closed by layout


def test_the_64_to_65_bytes():
    prev, nxt = _rounds(G072, 64, BF16, 65, BF16)
    assert (prev.combine_offset, prev.combine_offset + W * 64 * 2 * H) == (7553408, 14893440)
    assert nxt.recv_offsets == (180608, 7635328, 7651968) and nxt.dispatch_end == 7668608


def test_only_rows_actually_sent_and_written_count():
    prev, nxt = _rounds(G072, 64, BF16, 128, BF16)
    assert rows_at_risk(prev, nxt, prev_rows=(0,) * W) == (0,) * W  # nothing to read
    assert rows_at_risk(prev, nxt, next_rows=(0,) * W) == (0,) * W  # nothing written
    alone = (128,) + (0,) * (W - 1)  # only rank 0 writes: its own rows are never at risk
    assert rows_at_risk(prev, nxt, next_rows=alone)[0] == 0


def _only_own_rows_reach(prev, nxt) -> bool:
    """Every byte round n+1's planes put in round n's combine input (``[c, c + W*R*cb)``,
    block ``a`` reader ``a``'s) is written by that block's own reader, which reads before it
    writes."""
    W, R, cb, c = prev.ep_size, prev.runtime, prev.combine_bytes, prev.combine_offset
    top = c + W * R * cb
    for u in range(W):
        for off, p in zip(nxt.recv_offsets, nxt.payloads):
            lo = max(off + u * nxt.runtime * p.bytes_per_token, c)
            hi = min(off + (u + 1) * nxt.runtime * p.bytes_per_token, top)
            if lo < hi and {(lo - c) // (R * cb), (hi - 1 - c) // (R * cb)} != {u}:
                return False
    return True


def test_a_reader_overwritten_only_by_itself_is_not_at_risk():
    """NVFP4 at runtime 1, then BF16 at runtime 2 (EP 2, hidden 128): the BF16 plane reaches
    the combine input, but only rank 0's slot-1 row over rank 0's own block: nothing at risk."""
    p0 = dispatch_payloads(PayloadFormat.NVFP4, 128, 1)
    p1 = dispatch_payloads(PayloadFormat.BF16, 128, 1)
    prev, nxt = _rounds(G072, 1, p0, 2, p1, 2, 128, 16)
    assert grows_over(prev, nxt) and rows_at_risk(prev, nxt) == (0, 0)
    assert _only_own_rows_reach(prev, nxt)


@given(ep=st.integers(2, 16), hidden=st.sampled_from([128, 1024, 2048, 7168]),
       top_k=st.sampled_from([1, 2, 4, 8]), cap=st.sampled_from([16, 256, 1024]),
       fmts=st.tuples(*[st.sampled_from(list(PayloadFormat))] * 2), data=st.data())
def test_at_risk_exactly_when_the_next_planes_reach_the_combine_input(ep, hidden, top_k, cap,
                                                                      fmts, data):
    r0, r1 = data.draw(st.integers(1, cap)), data.draw(st.integers(1, cap))
    p0, p1 = (dispatch_payloads(f, hidden, top_k) for f in fmts)
    prev, nxt = _rounds(G072, r0, p0, r1, p1, ep, hidden, cap)
    risk = rows_at_risk(prev, nxt)
    if any(risk):
        assert grows_over(prev, nxt)
    elif grows_over(prev, nxt):  # the planes reach the combine input with the reader's own rows
        assert _only_own_rows_reach(prev, nxt)
    assert all(0 <= n <= r0 for n in risk)
    sent = tuple(data.draw(st.lists(st.integers(0, r0), min_size=ep, max_size=ep)))
    partial = rows_at_risk(prev, nxt, prev_rows=sent)
    assert all(p <= min(n, s) for p, n, s in zip(partial, risk, sent))
    assert rows_at_risk(*_rounds(G074, r0, p0, r1, p1, ep, hidden, cap)) == (0,) * ep


def test_rounds_of_different_worlds_are_refused():
    a = G072.layout(2, 64, 8, BF16, combine_bytes_per_token(H))
    b = G072.layout(4, 64, 8, BF16, combine_bytes_per_token(H))
    with pytest.raises(ValueError, match="share ep_size"):
        rows_at_risk(a, b)
    with pytest.raises(ValueError, match="at most the round's runtime"):
        rows_at_risk(a, a, prev_rows=(9, 0))
