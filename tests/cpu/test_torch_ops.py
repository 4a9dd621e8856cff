"""The GPU tiers read every answer back in one copy (``read_back``): on the CPU, each tensor
comes back as it was, whatever its dtype, shape or layout. (``to_torch_rows``, the other way,
is checked byte for byte by ``test_stand_in_moe.py``'s bit-exact comparison.)"""
import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import array_shapes

from .. import lazy_module, needs_torch

pytestmark = needs_torch("the GPU tiers' helpers need torch (CPU is fine)")
torch, torch_ops = lazy_module("torch"), lazy_module("dispatcher.gpu.torch_ops")
DTYPES = ["bool", "uint8", "int32", "int64", "float32", "bfloat16"]


@st.composite
def tensors(draw):
    dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
    shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    t = torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(
        draw(st.integers(0, 2 ** 16)))).to(dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous: read as it is seen, not as it is stored
    return t


@given(st.lists(tensors(), max_size=6))
def test_read_back_is_every_tensor_as_it_was(ts):
    got = torch_ops.read_back(ts)
    assert len(got) == len(ts)
    for t, a in zip(ts, got):
        want = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        assert a.shape == want.shape and a.dtype == want.dtype and np.array_equal(a, want)
