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


def search(strategy, check_on_cpu, run_on_pool, where: str) -> None:
    """A pool tier's search, shrinking where it is cheap. Each example runs ``check_on_cpu``
    (the exact CPU model: the policy's values and the properties) and then ``run_on_pool``.
    The search itself does not shrink: every try would cost a pool round trip. A failure the
    CPU model reproduces is shrunk on the CPU model alone, and the shrunk example is replayed
    once on the pool; a failure only the pool shows is reported as found. Either way the
    message says which happened."""
    from hypothesis import Phase, given, settings
    from hypothesis.errors import UnsatisfiedAssumption

    from strategies.search import minimal

    seen = {}

    @settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(world=strategy)
    def find(world):
        seen["world"] = world
        check_on_cpu(world)
        run_on_pool(world)

    def cpu_fails(world) -> bool:
        try:
            check_on_cpu(world)
        except AssertionError:
            return True
        except UnsatisfiedAssumption:
            return False
        return False

    try:
        find()
    except AssertionError as exc:
        world = seen.get("world")
        if world is None or not cpu_fails(world):
            exc.args = (f"{exc.args[0] if exc.args else exc}\n[found on {where}, not shrunk: "
                        f"the exact CPU model does not reproduce it]",) + exc.args[1:]
            raise
        small = minimal(strategy, cpu_fails, 500) or world
        try:
            check_on_cpu(small)
        except AssertionError as small_exc:
            try:
                run_on_pool(small)
                verdict = "passed (the CPU model's verdict stands)"
            except Exception as pool_exc:  # noqa: BLE001 - reported beside the CPU's
                verdict = f"{type(pool_exc).__name__}: {str(pool_exc).splitlines()[0][:300]}"
            raise type(small_exc)(
                f"{small_exc}\n[shrunk on the exact CPU model from {world!r}; the shrunk example "
                f"on {where}: {verdict}]") from exc
        raise
