"""The CPU model and the GPU tiers compute the same stand-in MoE: numpy (emulator) and torch
(GPU tiers) agree bit for bit on the same received rows, on the CPU."""
import numpy as np
from hypothesis import given, settings, strategies as st

from dispatcher.emulator import inputs as np_ops
from dispatcher.model.world import owners_of
from strategies import a2a_worlds

from .. import lazy_module, needs_torch

pytestmark = needs_torch("the torch stand-in MoE needs torch (CPU is fine)")
torch, torch_ops = lazy_module("torch"), lazy_module("dispatcher.gpu.torch_ops")


@settings(max_examples=100)
@given(world=a2a_worlds())
def test_numpy_and_torch_stand_in_moe_agree(world):
    moe, W = world.moe, world.ep_size
    for rank, inp in enumerate(np_ops.make_inputs(world)):
        n = inp.x.shape[0]
        if n == 0:
            continue
        rows = torch_ops.to_torch_rows([*inp.payload_rows], "cpu")
        recv = [r.reshape(1, n, -1).expand(W, n, -1).contiguous() for r in rows]
        got = torch_ops.expert_outputs(recv, n, moe, rank, W)[0].view(torch.int16).numpy()
        x = np_ops.decode_hidden(list(inp.payload_rows[:len(rows) - 2]), moe.payload_format,
                                 moe.hidden_size)
        want = np_ops.stand_in_moe(x, inp.expert_ids, inp.weights, rank, moe.num_experts, W)
        assert np.array_equal(got.view(np.uint16), want)


@given(world=a2a_worlds())
def test_expert_owner_is_one_function_for_numpy_and_torch(world):
    moe, W = world.moe, world.ep_size
    ids = np.arange(-2, moe.num_experts + 2)
    mine = owners_of(ids, moe.num_experts, W)
    assert np.array_equal(mine, owners_of(torch.from_numpy(ids), moe.num_experts, W).numpy())
    inside = mine[2:-2]
    assert (mine[:2] == -1).all() and (mine[-2:] == -1).all()
    assert (np.diff(inside) >= 0).all() and set(inside) == set(range(W))  # contiguous, all ranks
    counts = np.bincount(inside, minlength=W)
    assert counts.max() - counts.min() <= 1 and (np.diff(counts) <= 0).all()  # first E % W + 1


@settings(max_examples=60)
@given(world=a2a_worlds(), runtime=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_every_rank_at_once_equals_one_rank_at_a_time(world, runtime, seed):
    """The single-GPU tier batches every rank's stand-in MoE and stale-row check into one
    launch per op when the ranks share a runtime: the same answers as rank by rank."""
    from dispatcher.emulator.a2a import POISON
    from dispatcher.gpu.checks import poisoned_rows, stale_rows_ok

    moe, W = world.moe, world.ep_size
    g = torch.Generator().manual_seed(seed)
    widths = [spec.bytes_per_token for spec in moe.payloads]
    recv = [[torch.randint(0, 256, (W, runtime, b), dtype=torch.uint8, generator=g) for b in widths]
            for _ in range(W)]
    for r in range(W):  # sensible ids and weights, poisoned stale rows on some ranks
        ids = torch.randint(0, moe.num_experts, (W, runtime, moe.top_k), dtype=torch.int32, generator=g)
        recv[r][-2] = ids.view(torch.uint8).reshape(W, runtime, -1)
        recv[r][-1] = torch.rand(W, runtime, moe.top_k, generator=g).view(torch.uint8).reshape(W, runtime, -1)
    counts = torch.randint(0, runtime + 1, (W, W), generator=g).numpy()
    for r in range(W):
        for src in range(W):
            if (r + src + seed) % 3:
                for plane in recv[r]:
                    plane[src, counts[r, src]:] = POISON
    stacked = [torch.stack(planes) for planes in zip(*recv)]
    batch = torch_ops.expert_outputs(stacked, runtime, moe, range(W), W)
    ok = stale_rows_ok(poisoned_rows(stacked).numpy(), counts, runtime)
    for r in range(W):
        one = torch_ops.expert_outputs(recv[r], runtime, moe, r, W)
        assert torch.equal(batch[r].view(torch.int16), one.view(torch.int16))
        alone = stale_rows_ok(poisoned_rows(recv[r]).numpy(), counts[r], runtime)
        assert bool(ok[r]) == bool(alone) == all(  # and equal to the definition, row by row
            (plane[src, counts[r, src]:].view(torch.uint8) == POISON).all()
            for plane in recv[r] for src in range(W))
