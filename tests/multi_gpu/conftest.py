"""The rank pools, one per ep_size, started once per session in each xdist worker (on a
machine without a GPU or FlashInfer, with the exact CPU model of the A2A in the ranks). Tests that
drive a pool carry its group (``on_pool``), so under ``--dist=loadgroup`` every test of one pool
runs in the one worker that started it, and the pools of different groups run side by side
on the GPUs (each pool its own processes, port and workspaces)."""
import pytest

from dispatcher.gpu.env import gpu_count


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
    """``get(ep_size)``: that pool, started in the background by this worker after collection
    where the scheduler pinned the pool's group to it (``dispatcher.gpu.warm``)."""
    from dispatcher.gpu import warm
    from dispatcher.policies import load_policy  # how the ranks load the --policy spec

    made = {}

    def get(ep_size):
        if ep_size not in made:
            made[ep_size] = warm.take(f"rank-pool-{ep_size}-shared", resolve=load_policy)
        return made[ep_size]
    yield get
    for pool in made.values():
        pool.close()


def search(strategy, check_on_cpu, run_on_pool, where: str, max_examples=None) -> None:
    """A pool tier's search, shrinking where it is cheap. Each example runs ``check_on_cpu``
    (the exact CPU model: the policy's values and the properties) and then ``run_on_pool``.
    A failure the CPU model shows fails before the pool, so Hypothesis shrinks it on the CPU
    alone; the final replay of the shrunk example also runs it once on the pool and reports
    both. A failure only the pool shows is not shrunk (every try would be a pool round trip):
    once one is in hand, later tries skip the pool, and the example is reported as found.
    Either way the message says which happened. ``max_examples``: at most this many (the
    profile's count if smaller), for examples that are each several pool round trips."""
    from hypothesis import given, settings
    from hypothesis.control import current_build_context

    pool_failure = {}
    limit = settings(max_examples=min(max_examples, settings().max_examples)) \
        if max_examples else (lambda f: f)

    @limit
    @given(world=strategy)
    def find(world):
        try:
            check_on_cpu(world)
        except AssertionError as exc:
            if current_build_context().is_final:
                try:
                    run_on_pool(world)
                    verdict = "passed (the CPU model's verdict stands)"
                except Exception as pool_exc:  # noqa: BLE001 - reported beside the CPU's
                    verdict = f"{type(pool_exc).__name__}: {str(pool_exc).splitlines()[0][:300]}"
                _note(exc, f"[shrunk on the exact CPU model; the shrunk example on {where}: "
                           f"{verdict}]")
            raise
        if pool_failure and world != pool_failure["world"]:
            return  # a pool-only failure is in hand: no pool round trips while shrinking
        try:
            run_on_pool(world)
        except AssertionError as exc:
            pool_failure["world"] = world
            _note(exc, f"[found on {where}, not shrunk: the exact CPU model does not "
                       f"reproduce it]")
            raise
    find()


def _note(exc: BaseException, line: str) -> None:
    if not (exc.args and str(exc.args[0]).endswith(line)):
        exc.args = (f"{exc.args[0] if exc.args else exc}\n{line}",) + exc.args[1:]
