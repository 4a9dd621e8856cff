"""Tier ``multi_gpu``: one OS process per EP rank (``dispatcher/gpu/rank_pool.py``), started once
per session per ep_size and fed worlds by pipe; NCCL with one rank per GPU, gloo when ranks
share GPUs. Same checks as the gpu tier, made on every rank."""
import pytest

from dispatcher.model import properties
from dispatcher.model.world import MoeConfig, World
from strategies import pool_worlds

from .conftest import ep_sizes, on_pool, search

pytestmark = pytest.mark.multi_gpu
SEQUENCES = 50  # sequences per pool search (each one several rounds)


@pytest.mark.parametrize("ep_size", ep_sizes())
def test_pool_round_trip(ep_size, pools, policy, policy_spec):
    pool = pools(ep_size)

    where = "the emulated pool" if pool.emulated else "the real kernels"

    def on_cpu(world):
        world = properties.world_for(policy, world, keep_cap=True)  # an engine's own world (vLLM)
        properties.check_all(world, properties.values_or_reject(policy, world, policy_spec),
                             policy_spec)

    def on_pool(world):
        pool.run(properties.world_for(policy, world, keep_cap=True), policy_spec)

    search(pool_worlds(ep_size), on_cpu, on_pool, where)


@pytest.mark.parametrize("ep_size", ep_sizes())
def test_pool_rounds_back_to_back(ep_size, pools, policy, policy_spec):
    """Sequences of steps through the policy under test on every rank, rounds back to back on
    the pool's workspaces with no agreement or host sync between them (``pool_sequence.py``):
    every round's output is exact on every rank, except a round whose combine rows the next
    round puts at risk (FlashInfer 0.7.2's cross-round race, a hazard of the layout: reported
    in the statistics when it shows, never a failure of the policy)."""
    from hypothesis import event

    from dispatcher.gpu.rank_pool import RemoteMismatch
    from dispatcher.model.sequences import checked_rounds
    from strategies.sequences import pool_sequences

    pool = pools(ep_size)
    where = "the emulated pool" if pool.emulated else "the real kernels"
    ran = {}

    def on_cpu(seq):  # every property at every step; a step the engine never runs is no round
        ran[seq] = checked_rounds(policy, seq, policy_spec, engine_worlds=lambda w: (
            properties.world_for(policy, w, keep_cap=True)))

    def on_pool(seq):
        rounds = ran[seq]
        if not rounds.worlds:
            return
        for n, found in enumerate(pool.run_sequence(rounds.worlds, policy_spec)):
            if rounds.at_risk(n):
                event(f"rows at risk after round {n + 1}: "
                      f"{'RACE SHOWN (output wrong)' if found else 'output exact'}")
            elif found:
                raise RemoteMismatch("; ".join(found) + f"\nsequence: {rounds.worlds!r}")

    # each example is up to 4 rounds on every rank: 50 sequences are about as many rounds as
    # the round-trip test's worlds under the gpu profile
    search(pool_sequences(ep_size), on_cpu, on_pool, where, max_examples=SEQUENCES)


@on_pool(2, "shared")
def test_undersized_caught_through_real_kernels(pools):
    """0.7.2 takes the undersized runtime and corrupts the output (caught by the compare);
    0.7.4 refuses it on the short ranks, reported in step (no rank left spinning)."""
    from dispatcher.gpu.rank_pool import RemoteMismatch, RemoteRefused

    pool = pools(2)
    world = World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=64,
                  moe=MoeConfig(hidden_size=128, top_k=8, num_experts=8, routing="hot_rank"))
    expected = RemoteRefused if world.generation.checks_local_rows else RemoteMismatch
    with pytest.raises(expected):
        pool.run(world, "dispatcher.mutants:undersized", bypass=True)
    pool.run(world, "dispatcher.sizing:ideal_rule")  # the pool is still healthy


@on_pool(2, "shared")
def test_validation_refuses_before_any_kernel(pools):
    from dispatcher.gpu.rank_pool import RemoteSizingError

    pool = pools(2)
    world = World(ep_size=2, dp_size=2, group_tokens=(9, 3), max_num_tokens=64)
    with pytest.raises(RemoteSizingError, match="RuntimeDisagreement"):
        pool.run(world, "dispatcher.mutants:rank_variant")
    pool.run(world, "dispatcher.sizing:ideal_rule")


def test_crashed_rank_fails_the_example_and_the_pool_is_rebuilt():
    """The pool's own machinery (no kernel is involved: a rank process is killed), so on the
    exact CPU model, where a start costs a second rather than a CUDA context and FlashInfer's
    module per rank twice; the real kernels' start is the shared pool's."""
    from dispatcher.gpu.rank_pool import RankCrashed, RankPool
    from dispatcher.policies import load_policy
    from strategies import GPU_SHAPES

    pool = RankPool(2, 1, GPU_SHAPES.largest.dispatch_bytes, GPU_SHAPES.largest.combine_bytes,
                    emulated=True, resolve=load_policy)
    try:
        world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=64)
        before = pool.restarts
        pool._procs[1].kill()
        with pytest.raises(RankCrashed):
            pool.run(world, "dispatcher.sizing:ideal_rule")
        assert pool.restarts == before + 1
        pool.run(world, "dispatcher.sizing:ideal_rule")
    finally:
        pool.close()


def test_a_pool_made_without_a_policy_loader_names_what_it_lacks():
    """The pool sits below the policies: its maker hands the ranks their loader (resolve=).
    One made without it refuses a spec by name, keeps its ranks, and still runs the values a
    caller hands each rank (on the exact CPU model: the pool's own machinery)."""
    from dispatcher.gpu.rank_pool import RankPool, RemoteError

    pool = RankPool(2, 1, 640, 512, emulated=True)
    try:
        world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=64)
        with pytest.raises(RemoteError, match="without a policy loader"):
            pool.run(world, "dispatcher.sizing:ideal_rule")
        assert pool.restarts == 0
        pool.run(world, "unused", bypass=[2, 2])
    finally:
        pool.close()


@on_pool(2, "shared")
def test_a_python_error_on_every_rank_keeps_the_pool(pools):
    """FlashInfer's own check (runtime over the cap, validation bypassed: 0.7.2's Python
    assert, 0.7.4's ValueError or C++ check) is a Python error on every rank before any
    kernel: the example fails with it and, every rank having answered with an idle device,
    the pool is kept (a rebuild costs seconds per failing example while Hypothesis shrinks)."""
    from dispatcher.gpu.rank_pool import RemoteError

    pool = pools(2)
    world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=64)
    before = pool.restarts
    expected = ("ValueError|exceeds the allocation-time token capacity"
                if world.generation.checks_local_rows else "AssertionError")
    with pytest.raises(RemoteError, match=expected):
        pool.run(world, "ideal_rule", bypass=[65, 65])
    assert pool.restarts == before
    pool.run(world, "dispatcher.sizing:ideal_rule")


def test_rank_processes_exit_when_their_parent_is_killed():
    """A killed pytest worker must not leave rank processes holding GPU memory (the ranks'
    watch of their parent is the same with or without kernels: the exact CPU model's pool
    starts in a second)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    # what a SIGKILLed parent cannot remove goes to a folder of this test's, removed at the
    # end (a short path: multiprocessing's sockets live there, and a socket's path has 107 bytes)
    tmp = Path(tempfile.mkdtemp(prefix="a2a-t-"))
    try:
        script = tmp / "parent.py"
        script.write_text(
            "import time\n"
            "from dispatcher.gpu.env import gpu_count\n"
            "from dispatcher.gpu.rank_pool import RankPool\n"
            "from strategies import GPU_SHAPES\n"
            "if __name__ == '__main__':  # a child process must not start a pool of its own\n"
            "    pool = RankPool(2, 1, GPU_SHAPES.largest.dispatch_bytes,\n"
            "                    GPU_SHAPES.largest.combine_bytes, emulated=True)\n"
            "    print(' '.join(str(p.pid) for p in pool._procs), flush=True)\n"
            "    time.sleep(600)\n")
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "TMPDIR": str(tmp),
                                                  "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            pids = [int(p) for p in parent.stdout.readline().split()]
            assert len(pids) == 2
        finally:
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                     "zombie" not in open(f"/proc/{p}/status").read()]
        assert not alive, f"rank processes {alive} outlived their parent"
        assert len(list(tmp.iterdir())) > 1  # its logs and multiprocessing's folder went there
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
