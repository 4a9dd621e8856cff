"""SGLang's own ``FlashinferDispatcher`` end to end on the real kernels, in the rank pool:
every rank process loads the SGLang file under test (``--policy=sglang:...``, else the newest
pinned release) with FlashInfer's real ``MoeAlltoAll``; SGLang's ``__init__`` builds its
workspace over the pool's process group, its ``dispatch()`` launches the real dispatch kernel
with the runtime it computes (all ranks agree on it on the CPU first), the stand-in experts
run on what arrived, its ``combine()`` returns the result. Checked on every rank: the
properties of the runtimes SGLang passed, the output equals the reference, received counts
equal the model's, and the workspace SGLang built equals the byte model for its cap.
"""
import pytest
from hypothesis import given

from dispatcher.gpu.env import gpu_count
from dispatcher.model import properties
from dispatcher.model.world import MoeConfig, World
from strategies import GPU_SHAPES, sglang_pool_worlds

from .conftest import ep_sizes, on_pool

pytestmark = pytest.mark.multi_gpu


@pytest.fixture(scope="session")
def engine_spec(engine_under_test):
    return engine_under_test("sglang")[0]


@pytest.mark.parametrize("ep_size", ep_sizes())
def test_sglang_dispatch_and_combine_on_the_real_kernels(ep_size, pools, engine_spec):
    pool = pools(ep_size)

    @given(world=sglang_pool_worlds(ep_size))
    def run(world):
        from dispatcher.gpu.rank_pool import RemoteEngineError

        try:
            results = pool.run_sglang(world, engine_spec)
        except RemoteEngineError as exc:  # SGLang's dispatch() raised on every rank
            raise properties.RuleCrashed(f"[rule crashed] {engine_spec} dispatch() raised on "
                                         f"every EP rank: {exc}\n"
                                         + properties.explain(world, [], engine_spec)) from None
        values = properties.RuleValues(results[0]["values"])
        properties.check_all(world, values, engine_spec)
        built = {(r["max_num_tokens"], r["workspace_size_per_rank"]) for r in results}
        assert built == {(world.max_num_tokens, world.workspace_size)}, (
            f"SGLang built MoeAlltoAll(max_num_tokens, workspace_size_per_rank) = {built}, the "
            f"byte model for the cap {world.max_num_tokens} is {world.workspace_size}\n"
            + properties.explain(world, values, engine_spec))
    run()


def test_an_undersized_release_is_caught_through_the_real_kernels():
    """SGLang 0.5.14 in an SP world whose rows exceed the cap passes its static cap (8 < 9
    rows); with the CPU agreement bypassed, in a throwaway pool, the real kernels' damage is
    what fails the example (wrong combine output, or a CUDA fault)."""
    from dispatcher.gpu.rank_pool import RankPool, RemoteKernelFault, RemoteMismatch

    world = World(ep_size=2, dp_size=1, group_tokens=(18,), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=128, top_k=8, num_experts=64, routing="hot_rank"))
    pool = RankPool(2, max(1, gpu_count()), GPU_SHAPES.largest.dispatch_bytes,
                    GPU_SHAPES.largest.combine_bytes)
    try:
        with pytest.raises((RemoteMismatch, RemoteKernelFault)) as info:
            pool.run_sglang(world, "sglang:0.5.14", bypass=True)
        assert "differs from the reference" in str(info.value) or "CUDA" in str(info.value)
    finally:
        pool.close()


@on_pool(2)
def test_the_agreement_refuses_an_undersized_sglang_runtime_before_any_kernel(pools):
    from dispatcher.gpu.rank_pool import RemoteSizingError

    world = World(ep_size=2, dp_size=1, group_tokens=(18,), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=128, top_k=8, num_experts=64))
    with pytest.raises(RemoteSizingError, match="PayloadExceedsRuntime"):
        pools(2).run_sglang(world, "sglang:0.5.14")
