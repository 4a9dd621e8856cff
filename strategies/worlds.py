"""World strategies (the serving world of docs/model.md).

Valid worlds are built directly, never filtered: the topology first (ep_size, dp_size dividing
it), then what the scheduler records for each DP group (skewed, zeros, all-zero, equal, MAX_LEN
padding), then the cap *relative to the payload it must hold* (at it, one above, one below, at
the pre-scatter count the pre-fix rule uses, realistic caps). Boundaries (0 and 1 token, counts
at and around multiples of attn_tp) are drawn on purpose. Every choice lists its simplest
option first, so failures shrink to one group, one rank, few tokens, the default MoE.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from hypothesis import strategies as st

from dispatcher.model.generations import active, generation_of
from dispatcher.model.payloads import HIDDEN_MULTIPLE, PayloadFormat
from dispatcher.model.world import DP_GLOBAL_KINDS, ROUTINGS, MoeConfig, World
from dispatcher.sizing import ceil_align

__all__ = ["topologies", "group_token_counts", "caps", "moe_configs", "worlds", "a2a_worlds",
           "gpu_worlds", "pool_worlds", "sglang_pool_worlds", "regimes", "SHAPES",
           "CAP_PLACEMENTS", "GpuShapes", "GPU_SHAPES"]

POW2 = (1, 2, 4, 8, 16, 32, 64)
SHAPES = ("equal", "independent", "one_hot", "with_zeros", "all_zero")
CAP_PLACEMENTS = ("at_payload", "payload_plus_1", "payload_minus_1", "pre_scatter",
                  "pre_scatter_minus_1", "realistic", "roomy")
REALISTIC_CAPS = (256, 1024, 4096, 8192, 16384)


@dataclass(frozen=True)
class GpuShapes:
    """What the GPU tiers draw: MoE shapes small enough for every rank's dispatch blocks to
    be co-resident, and the caps the rank pool keeps one workspace each for (sized for the
    largest shape, ``largest``)."""

    hidden_sizes: Tuple[int, ...] = (64, 128, 256)
    top_ks: Tuple[int, ...] = (1, 2, 4, 8)
    caps: Tuple[int, ...] = (64, 128)
    single_gpu_blocks: int = 128  # rows * ep_size on one GPU (H200: 132 SMs)
    pool_blocks: int = 8 * 64  # rows * ep_size across the pool's GPUs

    @property
    def largest(self) -> MoeConfig:
        """The shape needing the most bytes per token (bf16 carries the most per element)."""
        return MoeConfig(hidden_size=max(self.hidden_sizes), top_k=max(self.top_ks))


GPU_SHAPES = GpuShapes()


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


# Strategy objects are built once per argument tuple, not once per example: a strategy built
# inside a draw is validated by Hypothesis every time, which cost more than the draw itself.
@functools.lru_cache(maxsize=None)
def _choice(values: tuple):
    return st.sampled_from(values)


@functools.lru_cache(maxsize=None)
def _ep_size(max_ep: int):
    return st.sampled_from([p for p in POW2 if p <= max_ep]) | st.integers(1, max_ep)


@functools.lru_cache(maxsize=4096)
def _token_count(attn_tp: int, max_tokens: int):
    """0, 1, counts around a multiple of attn_tp, or anything up to ``max_tokens``."""
    special = sorted({0, 1, attn_tp - 1, attn_tp, attn_tp + 1, 2 * attn_tp + 1})
    return st.sampled_from([x for x in special if 0 <= x <= max_tokens]) | st.integers(0, max_tokens)


@functools.lru_cache(maxsize=4096)
def _fixed_lists(elements, size: int):
    return st.lists(elements, min_size=size, max_size=size)


def _draw_topology(draw, max_ep, ep_sizes, dp_attention):
    ep = draw(_choice(tuple(sorted(ep_sizes))) if ep_sizes else _ep_size(max_ep))
    if dp_attention:
        ep = max(ep, 2)
    divisors = {None: _divisors(ep), True: _divisors(ep)[1:], False: [1],
                "full": [ep]}[dp_attention]
    return ep, draw(_choice(tuple(divisors)))


@st.composite
def topologies(draw, max_ep: int = 64, ep_sizes: Optional[Sequence[int]] = None,
               dp_attention: Optional[bool] = None):
    """``(ep_size, dp_size)``: powers of two mostly, any size up to ``max_ep`` sometimes;
    ``dp_size`` any divisor (1 = DP attention off); ``dp_attention`` forces it on or off, or
    ``"full"``: one DP group per rank (attn_tp 1, what SGLang 0.5.13+ require for FlashInfer)."""
    return _draw_topology(draw, max_ep, ep_sizes, dp_attention)


def _draw_group_tokens(draw, dp_size, attn_tp, max_tokens, shape):
    shape = shape or draw(_choice(SHAPES if dp_size > 1 else SHAPES[:1] + ("all_zero",)))
    one = _token_count(attn_tp, max_tokens)
    if shape == "all_zero":
        return (0,) * dp_size
    if shape == "equal":
        return (draw(one),) * dp_size
    if shape == "one_hot":  # one busy group, the rest idle or nearly (skew)
        hot = draw(st.integers(0, dp_size - 1))
        big = draw(one)
        rest = draw(_fixed_lists(st.integers(0, 2), dp_size))
        return tuple(big if g == hot else rest[g] for g in range(dp_size))
    # one structured draw per group (cheap: dp_size reaches 64); boundaries come from ``one``
    first = draw(one)
    rest = draw(_fixed_lists(st.integers(0, max_tokens), dp_size - 1))
    counts = [first] + rest
    if shape == "with_zeros":
        zero = draw(_fixed_lists(st.booleans(), dp_size))
        counts = [0 if z else c for c, z in zip(counts, zero)]
    return tuple(counts)


@st.composite
def group_token_counts(draw, dp_size: int, attn_tp: int, max_tokens: int, shape: Optional[str] = None):
    """Scheduler token counts, one per DP group, in one of ``SHAPES``."""
    return _draw_group_tokens(draw, dp_size, attn_tp, max_tokens, shape)


def _draw_cap(draw, payload_rows, pre_scatter, placement, fitting_only):
    m = max(1, payload_rows)
    options = {
        "at_payload": m,
        "payload_plus_1": m + 1,
        "payload_minus_1": max(1, m - 1),
        "pre_scatter": max(1, pre_scatter),
        "pre_scatter_minus_1": max(1, pre_scatter - 1),
    }
    placement = placement or draw(_choice(CAP_PLACEMENTS))
    if placement == "realistic":
        cap = draw(_choice(REALISTIC_CAPS))
    elif placement == "roomy":
        cap = draw(st.integers(m, 4 * m + 8))
    else:
        cap = options[placement]
    return max(cap, m) if fitting_only else cap


@st.composite
def caps(draw, payload_rows: int, pre_scatter: int, placement: Optional[str] = None,
         fitting_only: bool = False):
    """A workspace cap placed relative to the largest payload (``payload_rows``) and the
    pre-scatter count (``pre_scatter``); ``fitting_only`` keeps the payload within it."""
    return _draw_cap(draw, payload_rows, pre_scatter, placement, fitting_only)


@st.composite
def moe_configs(draw, ep_size: int, hidden_sizes: Sequence[int] = (128, 1024, 2048, 4096, 7168),
                top_ks: Optional[Sequence[int]] = None, max_experts_per_rank: int = 8,
                payloads: Sequence[str] = ("bf16", "nvfp4", "mxfp8"),
                num_experts: Optional[int] = None, flashinfer: Optional[str] = None):
    """MoE shapes: a top_k FlashInfer ``flashinfer`` supports (default: the session's
    generation), num_experts >= max(ep_size, top_k) and not always a multiple of ep_size
    (unless ``num_experts`` fixes it), every dispatch payload format, uniform or one-hot-rank
    routing."""
    payload = draw(_choice(tuple(payloads)))
    multiple = HIDDEN_MULTIPLE[PayloadFormat(payload)]
    hidden = draw(_choice(tuple(h for h in hidden_sizes if h % multiple == 0)))
    generation = generation_of(flashinfer) if flashinfer else active()  # default: the session's
    top_k = draw(_choice(tuple(top_ks or generation.supported_top_k)))
    if num_experts is None:
        per_rank = draw(st.integers(1, max_experts_per_rank))
        extra = draw(st.integers(0, ep_size - 1)) if ep_size > 1 else 0
        num_experts = max(ep_size * per_rank + extra, top_k, ep_size)
    return MoeConfig(hidden_size=hidden, top_k=top_k,
                     num_experts=num_experts, payload=payload,
                     routing=draw(_choice(ROUTINGS)),
                     seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def worlds(draw, max_ep: int = 64, ep_sizes: Optional[Sequence[int]] = None,
           max_tokens: int = 16384, fitting_only: bool = False,
           moe: Optional[Callable[[int], st.SearchStrategy]] = None,
           cap_values: Optional[Sequence[int]] = None, dp_attention: Optional[bool] = None,
           shape: Optional[str] = None, cap_placement: Optional[str] = None,
           flashinfer: Optional[str] = None):
    """Whole worlds. ``moe(ep_size)`` gives the MoE strategy (default: the default MoE,
    which the sizing properties do not depend on). ``cap_values`` restricts the cap to a few
    values at least the payload (the multi-GPU tier reuses one workspace per cap);
    ``dp_attention``, ``shape`` (one of SHAPES) and ``cap_placement`` (one of
    CAP_PLACEMENTS) pin those choices for a regime. ``flashinfer``: the worlds' generation
    (default: the session's); ``moe`` draws for it too where it is this module's."""
    ep, dp = _draw_topology(draw, max_ep, ep_sizes, dp_attention)
    attn_tp = ep // dp
    # an unrecorded dp_global (None / []) is for groups that all run the same batch
    kind = draw(_choice(DP_GLOBAL_KINDS)) if shape in (None, "equal", "all_zero") else "recorded"
    scale = draw(_choice(tuple(m for m in (8, 64, 1024, max_tokens) if m <= max_tokens)))
    if shape is None and kind != "recorded":
        shape = "equal"
    tokens = _draw_group_tokens(draw, dp, attn_tp, scale, shape)
    max_len = dp > 1 and draw(st.booleans())
    padded = [ceil_align(n, attn_tp) for n in tokens]
    rows = max(padded) // attn_tp
    if cap_values:
        fits = [c for c in sorted(cap_values) if c >= max(1, rows)]
        if not fits:
            raise ValueError(f"cap_values {cap_values} cannot hold {rows} rows: lower max_tokens")
        cap = draw(_choice(tuple(fits)))
    else:
        cap = _draw_cap(draw, rows, max(padded), cap_placement, fitting_only)
    moe_cfg = draw(moe(ep)) if moe is not None else MoeConfig()
    return World(ep_size=ep, dp_size=dp, group_tokens=tokens, max_num_tokens=cap,
                 dp_global_kind=kind, max_len_padding=max_len, moe=moe_cfg,
                 **({"flashinfer": flashinfer} if flashinfer else {}))


def a2a_worlds(max_ep: int = 8, max_tokens: int = 48, ep_sizes: Optional[Sequence[int]] = None,
               hidden_sizes: Sequence[int] = (32, 64, 128), top_ks: Sequence[int] = (1, 2, 4, 6, 8),
               cap_values: Optional[Sequence[int]] = None, emulated: bool = True,
               flashinfer: Optional[str] = None):
    """Worlds small enough to run through the emulated (or real) A2A every example: the
    payload always fits the cap, every MoE shape and payload format occurs. ``emulated``:
    only worlds the exact CPU model materialises within its limit on every generation (a
    large cap on 0.7.4 puts the combine region far out). ``flashinfer``: their generation
    (default: the session's; the top-k it does not support are not drawn)."""
    if flashinfer:
        supported = generation_of(flashinfer).supported_top_k
        top_ks = tuple(k for k in top_ks if k in supported)
    drawn = worlds(max_ep=max_ep, ep_sizes=ep_sizes, max_tokens=max_tokens, fitting_only=True,
                   moe=lambda ep: moe_configs(ep, hidden_sizes=hidden_sizes, top_ks=top_ks,
                                              max_experts_per_rank=4, flashinfer=flashinfer),
                   cap_values=cap_values, flashinfer=flashinfer)
    return drawn.filter(emulable) if emulated else drawn


def emulable(world) -> bool:
    from dispatcher.emulator.rounds import MAX_EMULATED_BYTES, emulated_bytes
    from dispatcher.model.generations import GENERATIONS

    return all(emulated_bytes(world, generation=g) <= MAX_EMULATED_BYTES
               for g in GENERATIONS.values())


def gpu_worlds(max_ep: int = 8, ep_sizes: Optional[Sequence[int]] = None,
               max_blocks: int = GPU_SHAPES.single_gpu_blocks,
               cap_values: Optional[Sequence[int]] = None, emulated: bool = False):
    """Worlds for the real kernels: every rank's dispatch CTAs (one per row) must be resident
    at once on one GPU, so rows * ep_size stays <= ``max_blocks``. ``emulated``: the tier runs
    on the exact CPU model (no GPU here), so only worlds it materialises within its limit
    (a rare large cap on 0.7.4 is left out)."""
    biggest = max(ep_sizes) if ep_sizes else max_ep
    max_tokens = max(1, max_blocks // biggest)
    if cap_values:  # a group's rows never exceed its token count: keep them within the caps
        max_tokens = min(max_tokens, max(cap_values))
    return a2a_worlds(max_ep=max_ep, ep_sizes=ep_sizes, max_tokens=max_tokens,
                      hidden_sizes=GPU_SHAPES.hidden_sizes, top_ks=GPU_SHAPES.top_ks,
                      cap_values=cap_values, emulated=emulated)


def pool_worlds(ep_size: int):
    """Worlds for the rank pool of ``ep_size`` ranks: its caps, its shapes."""
    return gpu_worlds(ep_sizes=[ep_size], max_blocks=GPU_SHAPES.pool_blocks,
                      cap_values=GPU_SHAPES.caps)


def sglang_pool_worlds(ep_size: int):
    """Pool worlds for SGLang's own dispatcher on the real kernels: bf16 payloads (FlashInfer's
    quantizers need SM100) and 64 experts, so SGLang builds one ``MoeAlltoAll`` per (hidden,
    top_k, cap), as it builds one per layer shape at start-up; no all-idle steps (SGLang's
    scheduler runs no forward then, docs/sglang.md)."""
    max_tokens = min(GPU_SHAPES.pool_blocks // ep_size, max(GPU_SHAPES.caps))
    return worlds(ep_sizes=[ep_size], max_tokens=max_tokens, fitting_only=True,
                  cap_values=GPU_SHAPES.caps,
                  moe=lambda ep: moe_configs(ep, hidden_sizes=GPU_SHAPES.hidden_sizes,
                                             top_ks=GPU_SHAPES.top_ks, payloads=("bf16",),
                                             num_experts=max(64, ep))
                  ).filter(lambda w: max(w.group_tokens) > 0)  # SGLang runs no all-idle step


def regimes(world: World) -> set:
    """The labels of the regimes a world exercises (for ``event()`` and the coverage test)."""
    r = {f"dp_global={world.dp_global_kind}", f"ep={world.ep_size}"}
    r.add("dp_attention" if world.dp_attention else "no_dp_attention")
    if world.attn_tp_size > 1:
        r.add("sp_scatter")
    if world.dp_attention and world.attn_tp_size > 1:
        r.add("dp_attention_with_attn_tp")
    if world.max_len_padding:
        r.add("max_len_padding")
    if max(world.group_tokens) == 0:
        r.add("all_zero")
    elif 0 in world.group_tokens:
        r.add("some_zero_groups")
    if world.dp_size > 1 and len(set(world.rows_per_rank)) > 1:
        r.add("skewed_rows")
    if any(n % world.attn_tp_size for n in world.group_tokens):
        r.add("scatter_padding")
    if world.max_rows == 1:
        r.add("one_row")
    if world.max_rows == world.max_num_tokens:
        r.add("payload_at_cap")
    elif world.max_rows == world.max_num_tokens + 1:
        r.add("payload_cap_plus_1")
    elif world.max_rows > world.max_num_tokens:
        r.add("payload_over_cap")
    if world.payload_fits_cap and max(world.padded_group_tokens) > world.max_num_tokens:
        r.add("pre_scatter_over_cap")
    if world.moe.num_experts % world.ep_size:
        r.add("experts_not_divisible")
    r.add(f"payload={world.moe.payload}")
    r.add(f"routing={world.moe.routing}")
    return r
