"""SGLang's own ``FlashinferDispatcher`` end to end on the real kernels, in the rank pool (on a
machine without a GPU, on the exact CPU model of the kernels, exchanged over gloo):
every rank process loads the SGLang file under test (``--policy=sglang:...``, else the newest
pinned release) with FlashInfer's real ``MoeAlltoAll``; SGLang's ``__init__`` builds its
workspace over the pool's process group, its ``dispatch()`` launches the real dispatch kernel
with the runtime it computes (all ranks agree on it on the CPU first), the stand-in experts
run on what arrived, its ``combine()`` returns the result. Checked on every rank: the
properties of the runtimes SGLang passed, the output equals the reference, received counts
equal the model's, and the workspace SGLang built equals the byte model for its cap.
"""
import pytest

from dispatcher.model import properties
from dispatcher.model.sglang_context import SGLangContext
from dispatcher.policies import load_policy
from dispatcher.engines import ENGINES
from dispatcher.model.world import MoeConfig, World
from dispatcher.sglang.rank_body import run_example as sglang_rank
from strategies import sglang_pool_worlds

from .conftest import ep_sizes, on_pool, search

pytestmark = [pytest.mark.multi_gpu, pytest.mark.engine_releases("sglang", under_test=True)]


@pytest.fixture(scope="session")
def engine_spec(engine_under_test):
    return engine_under_test("sglang")[0]


def real_074(pool) -> bool:
    """FlashInfer 0.7.4's real kernels: no SGLang release can build its dispatcher there."""
    from dispatcher.model.generations import generation_of, installed_version

    return not pool.emulated and generation_of(installed_version() or "0.7.2").checks_local_rows


def assert_sglang_cannot_run_on_074(pool, spec):
    """What SGLang does on FlashInfer 0.7.4 (docs/flashinfer.md): its ``from flashinfer.comm
    import MoeAlltoAll`` fails inside its try/except and ``FlashinferDispatcher.__init__``
    raises ImportError on every rank, before any collective or kernel; the pool stays."""
    from dispatcher.gpu.rank_pool import RemoteEngineError

    before = pool.restarts
    with pytest.raises(RemoteEngineError, match="ImportError"):
        pool.run_engine(sglang_rank, World(ep_size=pool.ep_size, dp_size=pool.ep_size,
                                           group_tokens=(2,) * pool.ep_size, max_num_tokens=8),
                        spec)
    assert pool.restarts == before


@pytest.mark.parametrize("ep_size", ep_sizes())
def test_sglang_dispatch_and_combine_on_the_real_kernels(ep_size, pools, engine_spec):
    pool = pools(ep_size)
    if real_074(pool):
        return assert_sglang_cannot_run_on_074(pool, engine_spec)
    release = load_policy(engine_spec)[1]  # the recorder: which configs the release accepts
    where = "the emulated pool" if pool.emulated else "the real kernels"

    def on_cpu(world):  # SGLang's own dispatch() on the recorder: the runtimes ranks will pass
        world = properties.world_for(release, world, keep_cap=True)  # a config it accepts
        properties.check_all(world, properties.values_or_reject(release, world, engine_spec),
                             engine_spec)

    def on_the_pool(world):
        from dispatcher.gpu.rank_pool import RemoteEngineError

        world = properties.world_for(release, world, keep_cap=True)
        try:
            results = pool.run_engine(sglang_rank, world, engine_spec)
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

    search(sglang_pool_worlds(ep_size), on_cpu, on_the_pool, where)


# SGLang 0.5.13 in the collapsed-dp_global context (SGLang #27945): each rank is handed only
# its own group's count, so the ranks pass different runtimes (1 and 2), each covering its own
# rows: SGLang's own checks pass, and only the agreement or the kernels can tell.
COLLAPSED = SGLangContext(moe_dense_tp_size=1, enable_dp_lm_head=True)
# SGLang 0.5.13's step, on the generation that release is judged on (the world carries it: the
# pool runs the world's generation, whatever the session's --flashinfer)
COLLAPSED_WORLD = World(ep_size=2, dp_size=2, group_tokens=(1, 2), max_num_tokens=8,
                        flashinfer=ENGINES["sglang"].judged_on("0.5.13"),
                        moe=MoeConfig(hidden_size=128, top_k=8, num_experts=64, routing="hot_rank"))


@on_pool(2)
def test_a_rank_variant_release_is_caught_through_the_kernels(pools):
    """With the CPU agreement bypassed, the kernels' (or the exact model's) damage is what
    fails the example: wrong combine output, or a CUDA fault (then the pool rebuilds itself
    before its next example, as after any faulted rank)."""
    from dispatcher.gpu.rank_pool import RemoteKernelFault, RemoteMismatch

    pool = pools(2)
    if real_074(pool):
        return assert_sglang_cannot_run_on_074(pool, "sglang:0.5.13")
    with pytest.raises((RemoteMismatch, RemoteKernelFault)) as info:
        pool.run_engine(sglang_rank, COLLAPSED_WORLD, "sglang:0.5.13", bypass=True,
                        ctx=COLLAPSED)
    assert "differs from the reference" in str(info.value) or "CUDA" in str(info.value) \
        or "recv counts" in str(info.value)
    pool.run_engine(sglang_rank, COLLAPSED_WORLD, "sglang:0.5.13",
                    ctx=SGLangContext())  # and it goes on


@on_pool(2)
def test_the_agreement_refuses_a_rank_variant_sglang_runtime_before_any_kernel(pools):
    from dispatcher.gpu.rank_pool import RemoteSizingError

    if real_074(pools(2)):
        return assert_sglang_cannot_run_on_074(pools(2), "sglang:0.5.13")
    with pytest.raises(RemoteSizingError, match="RuntimeDisagreement"):
        pools(2).run_engine(sglang_rank, COLLAPSED_WORLD, "sglang:0.5.13", ctx=COLLAPSED)


@on_pool(2)
def test_a_rank_failing_before_the_agreement_leaves_the_pool_in_step(pools, tmp_path):
    """SGLang 0.5.23's file sizing one row short on EP rank 0 (an injected fault: on two
    ranks SGLang pads every decode step MAX_LEN, so a wrong max over the list is invisible):
    its own assert stops that rank before any launch while its peer waits in the agreement; the parent
    calls the agreement off, every rank answers, and the pool is kept (a rebuild per failing
    example made a wrong file take minutes to fail while Hypothesis shrank)."""
    import time

    from dispatcher.gpu.rank_pool import RemoteEngineError
    from dispatcher.sglang import fetch
    from dispatcher.sglang.verdicts import RELEASES

    text = fetch.fetch_release(RELEASES[-1]).read_text()
    mutant = tmp_path / "flashinfer.py"
    fault = ("                dp_global, attn_tp_size\n            )\n",
             "                dp_global, attn_tp_size\n            ) - (self.ep_rank == 0)\n")
    assert text.count(fault[0]) == 1
    mutant.write_text(text.replace(*fault))
    pool, world = pools(2), World(ep_size=2, dp_size=2, group_tokens=(9, 3), max_num_tokens=64)
    if real_074(pool):
        return assert_sglang_cannot_run_on_074(pool, f"sglang:{mutant}")
    before, t0 = pool.restarts, time.monotonic()
    with pytest.raises(RemoteEngineError, match="x.shape"):
        pool.run_engine(sglang_rank, world, f"sglang:{mutant}")
    assert pool.restarts == before and time.monotonic() - t0 < 20
    pool.run_engine(sglang_rank, world, f"sglang:{RELEASES[-1]}")  # and the next example runs
