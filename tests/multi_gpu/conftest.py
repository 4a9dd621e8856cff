"""The rank pools, one per ep_size, started once per session in each xdist worker (on a
machine without a GPU or FlashInfer, with the exact CPU model of the A2A in the ranks). Tests that
drive a pool carry its group (``on_pool``), so under ``--dist=loadgroup`` every test of one pool
runs in the one worker that started it, and the pools of different groups run side by side
on the GPUs (each pool its own processes, port and workspaces)."""
import pytest

from dispatcher.gpu.env import flashinfer_missing, gpu_count


def on_pool(ep_size: int, use: str = "shared"):
    """The xdist group of the tests that drive the ``ep_size`` pool: ``shared`` for the tests
    that leave it healthy, another name for tests that kill or rebuild their own copy."""
    return pytest.mark.xdist_group(f"rank-pool-{ep_size}-{use}")


def ep_sizes():
    """2 ranks, and 4 where there are at least 2 GPUs (ranks share GPUs over gloo), each
    with its pool's group."""
    n = max(1, gpu_count())
    return [pytest.param(w, marks=on_pool(w)) for w in (2, 4) if w <= 2 * n]


@pytest.fixture(scope="session")
def pools():
    from dispatcher.gpu.rank_pool import RankPool
    from strategies import GPU_SHAPES

    made = {}

    def get(ep_size):
        if ep_size not in made:
            made[ep_size] = RankPool(ep_size, max(1, gpu_count()),
                                     GPU_SHAPES.largest.dispatch_bytes,
                                     GPU_SHAPES.largest.combine_bytes,
                                     emulated=bool(flashinfer_missing()))
        return made[ep_size]
    yield get
    for pool in made.values():
        pool.close()
