"""The pool tiers' search (``tests/multi_gpu/conftest.py: search``), with a stand-in pool: a
failure the CPU model shows is shrunk without the pool and replayed on it once; a failure only
the pool shows costs no pool round trips while Hypothesis shrinks, and says so."""
import pytest
from hypothesis import strategies as st

from ..multi_gpu.conftest import search


def test_a_failure_the_cpu_model_shows_is_shrunk_without_the_pool():
    pool_calls = []

    def on_cpu(n):
        assert n < 10, f"too big: {n}"

    with pytest.raises(AssertionError) as info:
        search(st.integers(0, 1000), on_cpu, pool_calls.append, "the stand-in pool")
    assert "too big: 10" in str(info.value)  # shrunk to the boundary, on the CPU
    assert "[shrunk on the exact CPU model; the shrunk example on the stand-in pool: passed" \
        in str(info.value)
    assert 10 in pool_calls and all(n < 10 for n in pool_calls[:-1])


def test_a_failure_only_the_pool_shows_is_not_shrunk_on_the_pool():
    pool_calls = []

    def on_pool(n):
        pool_calls.append(n)
        assert n < 500, f"the pool fails at {n}"

    with pytest.raises(AssertionError) as info:
        search(st.integers(0, 1000), lambda n: None, on_pool, "the stand-in pool")
    first_bad = next(i for i, n in enumerate(pool_calls) if n >= 500)
    assert set(pool_calls[first_bad + 1:]) <= {pool_calls[first_bad]}  # only the final replay
    assert "[found on the stand-in pool, not shrunk" in str(info.value)
