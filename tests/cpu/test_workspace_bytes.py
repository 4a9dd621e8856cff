"""The byte model of both FlashInfer generations: the workspace size, exact, and what a call
needs of it. 0.7.4's model is checked against FlashInfer 0.7.4's own layout function, built
from the release for this CPU (dispatcher/flashinfer/host_layout.py)."""
import pytest
from hypothesis import assume, given, strategies as st

from dispatcher.model import one_sided as w074
from dispatcher.model.generations import GENERATIONS, generation_of
from dispatcher.model.payloads import PayloadFormat, dispatch_payloads, pad
from dispatcher.model.mnnvl import aux_size, workspace_size_per_rank
from dispatcher.model.world import World
from strategies import moe_configs, worlds

BOTH = pytest.mark.parametrize("version", list(GENERATIONS))


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


@BOTH
@given(world=worlds(moe=moe_configs), frac=st.floats(0, 1))
def test_needed_bytes_fit_for_every_runtime_up_to_the_cap(version, world, frac):
    gen = generation_of(version)
    assume(world.moe.top_k in gen.supported_top_k)
    world = world.on(gen)
    size, cap = world.workspace_size, world.max_num_tokens
    for runtime in {1, max(1, round(frac * cap)), cap}:
        lay = world.layout(runtime)
        assert lay.dispatch_end <= size and lay.combine_end <= size
    # the cap uses the workspace up to its padding (0.7.4 pads its regions to 256 bytes)
    assert size - world.layout(cap).combine_end < (256 if gen.fixed_combine_region else 128)


@BOTH
@given(world=worlds(moe=moe_configs))
def test_one_row_past_the_cap_does_not_fit(version, world):
    gen = generation_of(version)
    assume(world.moe.top_k in gen.supported_top_k)
    world = world.on(gen)
    if gen.checks_local_rows:  # the op itself refuses it (0.7.2 only asserted in Python)
        with pytest.raises(ValueError, match="exceeds the allocation-time token capacity"):
            world.layout(world.max_num_tokens + 1)
        return
    over = world.layout(world.max_num_tokens + 1)
    assert over.bytes_needed > world.workspace_size  # W * 2H >= 128 for every drawn H


@BOTH
def test_layout_rejects_what_the_kernel_rejects(version):
    world = World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=8, flashinfer=version)
    with pytest.raises(ValueError, match="> 0"):
        world.layout(0)


# --- 0.7.4 against FlashInfer's own layout code ----------------------------------------------
@pytest.fixture(scope="module")
def host_layout_074(tmp_path_factory):
    """FlashInfer 0.7.4's calculateWorkspaceLayout, compiled from the release for this CPU."""
    from dispatcher.flashinfer.host_layout import build

    return build("0.7.4", tmp_path_factory.mktemp("layout-0.7.4"))


layout_calls = st.tuples(
    st.one_of(st.integers(1, 64), st.sampled_from([128, 255, 256])),  # ep_size (up to 256)
    st.one_of(st.integers(1, 300), st.sampled_from([1024, 8192, 16384, 2**20])),  # cap
    st.sampled_from(w074.SUPPORTED_TOP_K),
    st.integers(1, 1 << 34),  # dispatch bytes as asked
    st.integers(1, 1 << 34),  # combine input bytes as asked
    st.integers(0, 512))  # EPLB statistics experts


ONE_BUILD = pytest.mark.xdist_group("flashinfer-host-layout-074")  # one worker compiles it once


@ONE_BUILD
@given(calls=st.lists(layout_calls, min_size=1, max_size=40))
def test_074_offsets_equal_flashinfers_layout_function(host_layout_074, calls):
    from dispatcher.flashinfer.host_layout import model_fields

    theirs = host_layout_074.layouts([(ep, cap, k, d, cmb, 0, eplb, 0)
                                      for ep, cap, k, d, cmb, eplb in calls])
    for (ep, cap, k, d, cmb, eplb), got in zip(calls, theirs):
        ours = model_fields(w074.offsets(ep, cap, k, d, cmb, eplb))
        assert isinstance(got, dict), got
        assert {n: got[n] for n in ours} == ours, (ep, cap, k, d, cmb, eplb)
        assert got["cft_enabled"] == 0 and got["lamport_max_num_tokens"] == 0


@ONE_BUILD
@given(world=worlds(moe=moe_configs))
def test_074_workspace_of_every_world_is_flashinfers(host_layout_074, world):
    """What NVLinkOneSidedAlltoAll would allocate for the world's cap and MoE shapes."""
    moe = world.moe
    assume(moe.top_k in w074.SUPPORTED_TOP_K)
    W, cap = world.ep_size, world.max_num_tokens
    d = w074.dispatch_capacity(W, cap, moe.dispatch_bytes)
    c = w074.combine_capacity(W, cap, moe.combine_bytes)
    (got,) = host_layout_074.layouts([(W, cap, moe.top_k, d, c, 0, 0, 0)])
    assert got["workspace_size"] == w074.workspace_size_per_rank(W, cap, moe.payloads,
                                                                  moe.combine_bytes)
    lay = w074.layout(W, cap, cap, moe.payloads, moe.combine_bytes)
    assert lay.recv_offsets[0] == got["dispatch_payload_offset"]
    assert lay.combine_offset == got["combine_input_offset"]


@ONE_BUILD
def test_074_refuses_what_flashinfer_refuses(host_layout_074):
    bad = [(0, 1, 8, 1, 1, 0, 0, 0), (257, 1, 8, 1, 1, 0, 0, 0), (2, 0, 8, 1, 1, 0, 0, 0),
           (2, 1, 0, 1, 1, 0, 0, 0), (2, 1, 23, 1, 1, 0, 0, 0)]
    for call, theirs in zip(bad, host_layout_074.layouts(bad)):
        assert isinstance(theirs, str), call
        with pytest.raises(ValueError) as ours:
            w074.offsets(*call[:5])
        assert str(ours.value).split(":")[0] == theirs.split(":")[0]


def test_074_sizes_differ_from_072_both_ways():
    """Smaller for top_k < 22 at a large cap, larger for a tiny cap (256-byte regions)."""
    specs = dispatch_payloads(PayloadFormat.BF16, 4096, 8)
    d = sum(p.bytes_per_token for p in specs)
    assert w074.workspace_size_per_rank(2, 256, specs, 8192) < workspace_size_per_rank(2, 256, d, 8192)
    tiny = dispatch_payloads(PayloadFormat.BF16, 2, 1)
    assert (w074.workspace_size_per_rank(1, 1, tiny, 4)
            > workspace_size_per_rank(1, 1, sum(p.bytes_per_token for p in tiny), 4))
