"""The byte model: FlashInfer's workspace size, exact, and what a call needs of it."""
import pytest
from hypothesis import given, strategies as st

from dispatcher.model.workspace import (PayloadFormat, aux_size, dispatch_payloads, pad,
                                        workspace_size_per_rank)
from dispatcher.model.world import World
from strategies import moe_configs, worlds


def test_design_example_to_the_byte():
    """DESIGN.md section 3: W=2, cap=256, H=4096, K=8 -> 8,466,816 bytes."""
    specs = dispatch_payloads(PayloadFormat.BF16, 4096, 8)
    d = sum(p.bytes_per_token for p in specs)
    assert workspace_size_per_rank(2, 256, d, 2 * 4096) == 8_466_816


@pytest.mark.parametrize("fmt, expect", [
    (PayloadFormat.BF16, lambda h, k: 2 * h + 8 * k),
    (PayloadFormat.NVFP4, lambda h, k: h // 2 + h // 16 + 8 * k),
    (PayloadFormat.MXFP8, lambda h, k: h + h // 32 + 8 * k),
])
@pytest.mark.parametrize("h, k", [(128, 1), (4096, 8), (7168, 8), (2048, 22)])
def test_payload_bytes_per_token(fmt, expect, h, k):
    assert sum(p.bytes_per_token for p in dispatch_payloads(fmt, h, k)) == expect(h, k)


@pytest.mark.parametrize("w, head", [(1, 384), (2, 384), (15, 384), (16, 512), (30, 512),
                                     (31, 512), (32, 640), (33, 896), (64, 1152)])
def test_aux_size(w, head):
    """aux = pad(8 + 8W) + pad(4W) + pad(4W) + 2 * pad(88 * cap): 384 only up to W = 15."""
    for cap in (1, 7, 256, 8192):
        assert aux_size(w, cap) == head + 2 * pad(88 * cap)


@given(world=worlds(moe=moe_configs), frac=st.floats(0, 1))
def test_needed_bytes_fit_for_every_runtime_up_to_the_cap(world, frac):
    size, cap = world.workspace_size, world.max_num_tokens
    for runtime in {1, max(1, round(frac * cap)), cap}:
        lay = world.layout(runtime)
        assert lay.dispatch_end <= size and lay.combine_end <= size
    assert size - world.layout(cap).combine_end < 128  # the cap uses it up to its padding


@given(world=worlds(moe=moe_configs))
def test_one_row_past_the_cap_does_not_fit(world):
    over = world.layout(world.max_num_tokens + 1)
    assert over.bytes_needed > world.workspace_size  # W * 2H >= 128 for every drawn H


def test_layout_rejects_what_the_kernel_rejects():
    world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=8)
    with pytest.raises(ValueError, match="> 0"):
        world.layout(0)
