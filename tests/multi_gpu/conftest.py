"""The rank pools, one per ep_size, started once per session (per xdist worker: all
multi_gpu tests share one worker, so no two processes drive the same pool)."""
import pytest

from dispatcher.gpu.env import gpu_count


def ep_sizes():
    """2 ranks, and 4 where there are at least 2 GPUs (ranks share GPUs over gloo)."""
    n = max(1, gpu_count())
    return [w for w in (2, 4) if w <= 2 * n]


@pytest.fixture(scope="session")
def pools():
    from dispatcher.gpu.rank_pool import RankPool
    from strategies import GPU_SHAPES

    made = {}

    def get(ep_size):
        if ep_size not in made:
            made[ep_size] = RankPool(ep_size, max(1, gpu_count()),
                                     GPU_SHAPES.largest.dispatch_bytes,
                                     GPU_SHAPES.largest.combine_bytes)
        return made[ep_size]
    yield get
    for pool in made.values():
        pool.close()
