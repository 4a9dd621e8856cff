"""The rank pool's failure to start is bounded and says why (no GPU needed to provoke it):
the ranks' own error comes back, once, within seconds; nothing is retried in a loop."""
import time

import pytest

pytest.importorskip("torch", reason="the rank pool needs torch (CPU is enough to start it)")


def test_a_pool_that_cannot_start_fails_once_with_the_ranks_words():
    from dispatcher.gpu.rank_pool import PoolStartFailed, RankPool

    t = time.monotonic()
    with pytest.raises(PoolStartFailed, match="could not start") as info:
        RankPool(2, n_gpus=0, max_dispatch_bytes=640, max_combine_bytes=512, start_timeout=60)
    assert "ZeroDivisionError" in str(info.value)  # rank % n_gpus, the rank's own traceback
    assert time.monotonic() - t < 60
