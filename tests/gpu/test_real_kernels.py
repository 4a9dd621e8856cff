"""Tier ``gpu``: every EP rank of a generated world in one process on one GPU, through
FlashInfer's real dispatch and combine kernels (``dispatcher/gpu/single.py``). Without a GPU
the same test bodies run on the exact CPU model behind the same driver calls
(``dispatcher/gpu/single_cpu.py``), so the tier's logic is checked in CI under every kind of
policy; the tests that need the hardware itself carry ``real_kernels``.

Per example: the sizing properties of the policy under test, the dispatcher's validation,
then the round trip with the validated runtime: combine output equals the reference (bf16,
rtol 2^-8; a correct A2A matches bit for bit), received counts equal the model's, guard bytes
after every rank's workspace intact, stale rows still poisoned, and our byte model equal to
FlashInfer's ``moe_a2a_get_workspace_size_per_rank`` / aux size / metainfo / combine offset.
"""

import pytest
from hypothesis import event, example, given, settings

from dispatcher.gpu.env import flashinfer_missing
from dispatcher.plugin.profiles import PROFILES
from dispatcher.model import properties
from dispatcher.model.validation import validate
from dispatcher.model.world import MoeConfig, World
from dispatcher.sizing import NotApplicable
from strategies import gpu_worlds, moe_configs, worlds
from strategies.sequences import gpu_sequences

pytestmark = pytest.mark.gpu
# No GPU or FlashInfer here: the tier runs on the exact CPU model, in the worlds it materialises
# and with the example count of the gpu profile at most (the CPU tiers search the same model
# and properties with the full count: here the test bodies are what is checked)
ON_CPU = bool(flashinfer_missing())
on_cpu_sized = settings(max_examples=min(settings().max_examples, PROFILES["gpu"].max_examples)
                        ) if ON_CPU else (lambda test: test)


@pytest.fixture(scope="session")
def single_gpu():
    """The installed FlashInfer generation's driver (0.7.2 or 0.7.4), or the exact CPU model's
    where there is none, started in the background by this worker after collection where the
    scheduler pinned this tier to it."""
    from dispatcher.gpu import warm

    return warm.take("gpu-single")


def _report(world, values, rt, name):
    return "; ".join(rt.problems) + "\n" + properties.explain(world, values, name)


@example(world=World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=16,
                     moe=MoeConfig(hidden_size=128, top_k=8, num_experts=8, routing="hot_rank")))
@example(world=World(ep_size=8, dp_size=1, group_tokens=(0,), max_num_tokens=1))
@on_cpu_sized
@given(world=gpu_worlds(emulated=ON_CPU))
def test_real_round_trip(world, policy, policy_spec, single_gpu):
    world = properties.world_for(policy, world)  # an engine's own world (vLLM)
    values = properties.values_or_reject(policy, world, policy_spec)
    properties.check_all(world, values, policy_spec)
    runtime = validate(values, world.views, world.generation)
    event(f"ep={world.ep_size} payload={world.moe.payload}")
    rt = single_gpu.run(world, [runtime] * world.ep_size)
    assert not rt.problems, _report(world, values, rt, policy_spec)


# SGLang's scheduler runs no forward when every DP group is idle: two such steps are no round
# (the GPU tier once ran them and failed every unmodified SGLang release)
ALL_IDLE_STEP = World(ep_size=1, dp_size=1, group_tokens=(0,), max_num_tokens=1,
                      moe=MoeConfig(hidden_size=64, top_k=1, num_experts=1))


@on_cpu_sized
@example(seq=(ALL_IDLE_STEP, ALL_IDLE_STEP))
@given(seq=gpu_sequences(emulated=ON_CPU))
def test_real_rounds_back_to_back_on_one_workspace(seq, policy, policy_spec, single_gpu):
    """A sequence of steps through the policy under test, then through the real kernels on one
    workspace with no host sync between rounds, each rank on its own stream
    (``gpu/sequence.py``): every round's output on every rank is exact, except where the
    cross-round hazard puts round n's combine rows at risk (FlashInfer 0.7.2, a layout that
    grows): a wrong output there is the race shown on real kernels, reported in the statistics,
    never a failure of the policy (docs/flashinfer.md)."""
    from dispatcher.model.sequences import checked_rounds

    rounds = checked_rounds(policy, seq, policy_spec,  # every property at every step
                            engine_worlds=lambda w: properties.world_for(policy, w, keep_cap=True))
    if not rounds.worlds:  # every step one the engine never runs (all idle, say): no round
        event("no round ran")
        return
    runtimes = [validate(values, w.views, w.generation) for w, values in zip(rounds.worlds, rounds.values)]
    problems = single_gpu.run_sequence(rounds.worlds, runtimes)
    for n, found in enumerate(problems):
        if rounds.at_risk(n):
            event(f"rows at risk after round {n + 1}: "
                  f"{'RACE SHOWN (output wrong)' if found else 'output exact'}")
            continue
        assert not found, "; ".join(found) + f"\nsequence: {rounds.worlds!r}"


@pytest.mark.real_kernels
@given(world=worlds(moe=moe_configs))
def test_byte_model_equals_flashinfer(world, single_gpu):
    """Every drawn config, ep_size up to 64 and realistic hidden sizes and caps."""
    model = single_gpu.byte_model(world)
    assert all(ours == theirs for ours, theirs in model.values()), (model, world)


@pytest.mark.parametrize("world", [
    World(ep_size=2, dp_size=2, group_tokens=(9, 9), max_num_tokens=16,
          moe=MoeConfig(hidden_size=128, top_k=8, num_experts=8, routing="hot_rank")),
    World(ep_size=4, dp_size=1, group_tokens=(40,), max_num_tokens=16,
          moe=MoeConfig(hidden_size=64, top_k=4, num_experts=8, routing="hot_rank", seed=3)),
])
def test_undersized_runtime_is_caught_through_the_real_kernel(world, single_gpu):
    """One row below the payload, validation bypassed: on 0.7.2 the real kernel's damage (wrong
    output, stray rows, guards) is detected, not only the CPU check; on 0.7.4 FlashInfer
    refuses the short ranks before any launch and the refusal is reported (no peer spins).
    In the tier's shared process: the overflow stays inside the workspace and its guard bytes
    (ours), and were it ever to fault, every later test fails naming this world
    (test_after_a_cuda_fault_every_later_run_fails_fast_naming_it)."""
    try:
        found = single_gpu.run(world, [world.max_rows - 1] * world.ep_size).problems
    except RuntimeError as exc:  # only a CUDA fault is the kernel's damage; anything else is a bug
        assert "CUDA error" in str(exc) or "illegal" in str(exc), exc
        return
    assert found, "FlashInfer ran an undersized runtime and nothing was detected"
    if world.generation.checks_local_rows:
        assert all("FlashInfer 0.7.4 refused rank" in f for f in found), found
    else:
        assert any("differs" in f or "stray" in f or "guard" in f for f in found), found


def test_prefix_rule_rejected_in_sp_worlds(single_gpu):
    """SP without DP attention: the pre-fix rule passes the pre-scatter count; the kernel
    runs (it fits the cap) but moves attn_tp times the rows: the gate rejects it as not tight."""
    from dispatcher.sizing import prefix_rule

    world = World(ep_size=4, dp_size=1, group_tokens=(30,), max_num_tokens=32,
                  moe=MoeConfig(hidden_size=128, top_k=8, num_experts=16))
    values = properties.rule_values(prefix_rule, world)
    assert values == [32] * 4 and world.ideal_runtime == 8
    assert not single_gpu.run(world, values).problems  # correct, just 4x the rows
    with pytest.raises(properties.PropertyViolation, match="tight"):
        properties.check_tight(world, values, "prefix_rule")


@pytest.mark.real_kernels
def test_a_world_of_another_generation_is_refused_by_name(single_gpu):
    """The world carries its generation; the driver runs the installed one's kernels and
    refuses any other world by name, before anything is allocated or launched."""
    import re

    from dispatcher.model.generations import GENERATIONS

    installed = single_gpu.generation
    other = next(v for v in GENERATIONS if v != installed.version)
    world = World(ep_size=2, dp_size=2, group_tokens=(1, 1), max_num_tokens=4, flashinfer=other)
    with pytest.raises(ValueError, match=re.escape(f"models FlashInfer {other}, but this driver "
                                                   f"runs {installed}'s kernels")):
        single_gpu.run(world, [1, 1])
    assert single_gpu.dead is None


@pytest.mark.real_kernels
def test_after_a_cuda_fault_every_later_run_fails_fast_naming_it(single_gpu):
    """One dead CUDA context must not turn every later GPU test into an odd error: once a
    run faulted, the next ones raise CudaContextDead naming the world that faulted."""
    from dispatcher.gpu.single import CudaContextDead, for_installed

    probe = for_installed()
    probe.dead = "CUDA error: an illegal memory access while running World(...)"
    with pytest.raises(CudaContextDead, match="died earlier .*illegal memory access"):
        probe.run(World(ep_size=2, dp_size=1, group_tokens=(2,), max_num_tokens=4), [1, 1])


def test_rank_variant_runtimes_are_caught_by_the_output_compare(single_gpu):
    """Every rank fits its own value but the values differ (validation bypassed): neither
    generation checks it; rows land in other ranks' slots and the compare catches it."""
    world = World(ep_size=4, dp_size=4, group_tokens=(3, 3, 3, 3), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=128, top_k=4, num_experts=8))
    problems = single_gpu.run(world, [3, 3, 4, 4]).problems
    assert problems and not any("refused" in p for p in problems), problems


def test_074_refused_rank_is_reported_with_no_peer_spinning(single_gpu):
    """0.7.4: the rank with more rows than its runtime is refused by FlashInfer itself (called
    before any peer launches); 0.7.2 takes the call and the damage shows in the compare."""
    import time

    world = World(ep_size=4, dp_size=4, group_tokens=(5, 3, 3, 3), max_num_tokens=8,
                  moe=MoeConfig(hidden_size=128, top_k=4, num_experts=8))
    t0 = time.monotonic()
    problems = single_gpu.run(world, [4, 4, 4, 4]).problems
    assert problems
    if world.generation.checks_local_rows:
        assert len(problems) == 1 and "refused rank 0 (5 rows, runtime 4)" in problems[0]
        assert time.monotonic() - t0 < 10  # nobody waited for timeout_sec
        assert not single_gpu.run(world, [5, 5, 5, 5]).problems  # and the next round is exact


@pytest.mark.real_kernels
@pytest.mark.parametrize("ep_size", range(1, 65))  # FlashInfer 0.7.2: at most 64 ranks
def test_byte_model_equals_flashinfer_at_every_ep(ep_size, single_gpu):
    """Every ep_size FlashInfer 0.7.2 takes, at caps from 1 to 16384, DeepSeek-V3's shape
    (hidden 7168, top_k 8, 256 experts) in every payload format and a small one: FlashInfer's
    own sizes, no kernel launched."""
    for cap in (1, 7, 256, 4096, 16384):
        for moe in (MoeConfig(hidden_size=7168, top_k=8, num_experts=256, payload=p)
                    for p in ("bf16", "nvfp4", "mxfp8")):
            world = World(ep_size=ep_size, dp_size=1, group_tokens=(0,), max_num_tokens=cap,
                          moe=moe)
            model = single_gpu.byte_model(world)
            assert all(ours == theirs for ours, theirs in model.values()), (model, world)


@pytest.mark.real_kernels
def test_the_largest_worlds_co_residency_allows(single_gpu, policy, policy_spec):
    """The real kernels at the largest ep_size one GPU can run as concurrent streams and at
    every DP-attention width down to 2, each with as many rows per rank as keep every rank's
    dispatch blocks resident at once: from this GPU's SM count (one block per row, a few SMs
    spare) and its stream queues (CUDA_DEVICE_MAX_CONNECTIONS; FlashInfer itself takes 64)."""
    import os

    import torch

    sms = torch.cuda.get_device_properties(single_gpu.device).multi_processor_count
    queues = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
    largest = min(64, queues, sms - 4)
    for ep in (e for e in (64, 32, 16, 8, 4, 2) if e <= largest):
        rows = max(1, (sms - 4) // ep)
        world = World(ep_size=ep, dp_size=ep, group_tokens=(rows,) * ep, max_num_tokens=rows,
                      moe=MoeConfig(hidden_size=128, top_k=8, num_experts=max(64, ep)))
        try:  # an engine policy runs its own nearest world (vLLM, SGLang), if it has one
            world = getattr(policy, "engine_world", lambda w, **_: w)(world)
        except NotApplicable:
            continue
        values = properties.rule_values(policy, world, policy_spec)
        properties.check_all(world, values, policy_spec)
        rt = single_gpu.run(world, [validate(values, world.views, world.generation)] * ep)
        assert not rt.problems, f"ep={ep} rows={rows} on {sms} SMs: " + _report(
            world, values, rt, policy_spec)


@pytest.mark.real_kernels
@pytest.mark.parametrize("ep_size", [65, 96, 128, 200, 255, 256])
def test_074_byte_model_past_64_ranks(ep_size, single_gpu):
    """0.7.4 takes up to 256 ranks: its layout function (no kernel) against ours."""
    if not single_gpu.generation.checks_local_rows:  # the installed generation's
        with pytest.raises(ValueError):
            World(ep_size=ep_size, dp_size=1, group_tokens=(0,), max_num_tokens=1,
                  flashinfer=single_gpu.generation.version)
        return
    from dispatcher.gpu.one_sided import byte_model

    for cap in (1, 256, 8192):
        for h, k in ((7168, 8), (4096, 22), (128, 3)):
            model = byte_model(ep_size, cap, k, 2 * h + 8 * k, 2 * h)
            assert all(ours == theirs for ours, theirs in model.values()), (model, ep_size, cap)
