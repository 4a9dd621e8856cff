"""The CPU model and the GPU tiers compute the same stand-in MoE: numpy (emulator) and torch
(GPU tiers) agree bit for bit on the same received rows, on the CPU."""
import numpy as np
import pytest
from hypothesis import given, settings

from dispatcher.emulator import inputs as np_ops
from dispatcher.model.world import owners_of
from strategies import a2a_worlds

torch = pytest.importorskip("torch", reason="the torch stand-in MoE needs torch (CPU is fine)")
from dispatcher.gpu import torch_ops  # noqa: E402


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
