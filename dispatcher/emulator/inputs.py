"""The tensors of one world, made from its seed, and the stand-in MoE (CPU, numpy).

Values are chosen so that every step is exact: hidden values are small integers, weights are
quarters, the stand-in expert scales by a small integer, so the bf16 expert output is rounded
once (RNE) and the fp32 sum over at most ``min(top_k, ep_size)`` such rows is exact whatever
the order. Any correct all-to-all therefore reproduces ``reference`` bit for bit; the GPU tiers
run the same maths in torch (``dispatcher/gpu/torch_ops.py``; a CPU test keeps the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ..model.payloads import PayloadFormat
from ..model.world import World, owned_experts, owners_of

__all__ = ["RankInputs", "make_inputs", "encode_hidden", "decode_hidden", "expert_scale",
           "stand_in_moe", "reference_outputs", "to_bf16_bits", "from_bf16_bits"]

X_MIN, X_MAX = -4, 3  # fits signed int4 (NVFP4 stand-in), int8 (MXFP8) and bf16 exactly
WEIGHTS = np.array([0.25, 0.5, 0.75, 1.0], dtype=np.float32)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (what ``.to(torch.bfloat16)`` does)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def expert_scale(expert_ids: np.ndarray) -> np.ndarray:
    """The stand-in expert ``e`` multiplies its input by ``1 + e % 3``."""
    return 1.0 + (expert_ids % 3).astype(np.float32)


@dataclass(frozen=True)
class RankInputs:
    """One EP rank's MoE inputs: ``x`` (values), ``expert_ids`` [n, K] int32, ``weights``
    [n, K] fp32, and the byte rows of every dispatch payload, in FlashInfer's order."""

    x: np.ndarray
    expert_ids: np.ndarray
    weights: np.ndarray
    payload_rows: Tuple[np.ndarray, ...]
    owners: np.ndarray  # [n, K] EP rank owning each expert (computed once, used everywhere)


def encode_hidden(x: np.ndarray, fmt: PayloadFormat, rng: np.random.Generator) -> List[np.ndarray]:
    """Hidden-state payload byte rows for ``fmt``. The quantized formats carry the values as
    int8 (MXFP8 stand-in) or packed signed int4 pairs (NVFP4 stand-in) plus seeded scale
    bytes, so the byte sizes are FlashInfer's and the values stay exact."""
    n, h = x.shape
    if fmt is PayloadFormat.BF16:
        return [to_bf16_bits(x).view(np.uint8).reshape(n, 2 * h)]
    q = x.astype(np.int8)
    if fmt is PayloadFormat.MXFP8:
        return [q.view(np.uint8).reshape(n, h), rng.integers(0, 256, (n, h // 32), dtype=np.uint8)]
    lo = q[:, 0::2].view(np.uint8) & 0xF
    hi = q[:, 1::2].view(np.uint8) & 0xF
    return [(lo | (hi << 4)).astype(np.uint8), rng.integers(0, 256, (n, h // 16), dtype=np.uint8)]


def decode_hidden(rows: List[np.ndarray], fmt: PayloadFormat, hidden_size: int) -> np.ndarray:
    """Inverse of ``encode_hidden`` on [m, bytes] rows (scale bytes are ignored)."""
    m = rows[0].shape[0]
    if fmt is PayloadFormat.BF16:
        return from_bf16_bits(np.ascontiguousarray(rows[0]).view(np.uint16)).reshape(m, hidden_size)
    if fmt is PayloadFormat.MXFP8:
        return np.ascontiguousarray(rows[0]).view(np.int8).astype(np.float32)
    b = rows[0].astype(np.int16)
    lo = ((b & 0xF) ^ 8) - 8
    hi = ((b >> 4) ^ 8) - 8
    out = np.empty((m, hidden_size), dtype=np.float32)
    out[:, 0::2] = lo
    out[:, 1::2] = hi
    return out


def _route(rng: np.random.Generator, n: int, world: World) -> np.ndarray:
    moe = world.moe
    if moe.routing == "hot_rank":
        hot = owned_experts(int(rng.integers(world.ep_size)), moe.num_experts, world.ep_size)
        pool = np.arange(hot.start, hot.stop)
    else:
        pool = np.arange(moe.num_experts)
    if n == 0:
        return np.zeros((0, moe.top_k), dtype=np.int32)
    if len(pool) >= moe.top_k:  # top-k experts are distinct, as a router's top-k is
        keys = rng.random((n, len(pool)))
        idx = np.argpartition(keys, moe.top_k - 1, axis=1)[:, :moe.top_k]
        return pool[idx].astype(np.int32)
    return rng.choice(pool, size=(n, moe.top_k)).astype(np.int32)


def make_inputs(world: World) -> List[RankInputs]:
    """Every EP rank's inputs, from ``world.moe.seed`` alone."""
    moe = world.moe
    fmt = moe.payload_format
    rng = np.random.default_rng(moe.seed)
    specs = moe.payloads
    out = []
    for n in world.rows_per_rank:
        x = rng.integers(X_MIN, X_MAX + 1, (n, moe.hidden_size)).astype(np.float32)
        ids = _route(rng, n, world)
        w = WEIGHTS[rng.integers(0, len(WEIGHTS), (n, moe.top_k))]
        rows = encode_hidden(x, fmt, rng) + [ids.view(np.uint8).reshape(n, 4 * moe.top_k),
                                             w.view(np.uint8).reshape(n, 4 * moe.top_k)]
        assert [r.shape[1] for r in rows] == [s.bytes_per_token for s in specs]
        out.append(RankInputs(x, ids, w, tuple(np.ascontiguousarray(r) for r in rows),
                              owners_of(ids, moe.num_experts, world.ep_size)))
    return out


def stand_in_moe(x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, ep_rank,
                 num_experts: int, ep_size: int) -> np.ndarray:
    """What EP rank ``ep_rank``'s experts return for received rows: bf16 bits of
    ``x * sum_k w_k * scale(e_k)`` over the k whose expert this rank owns (stale rows, whose
    ids are anything, go through too, as padding rows do in a real MoE). ``ep_rank`` may be an
    array giving each row's target rank, to run every target at once."""
    rank = np.asarray(ep_rank).reshape(-1, 1) if np.ndim(ep_rank) else ep_rank
    mine = owners_of(expert_ids, num_experts, ep_size) == rank
    with np.errstate(all="ignore"):
        s = np.where(mine, weights * expert_scale(expert_ids), 0.0).sum(axis=1, dtype=np.float32)
        return to_bf16_bits(x * s[:, None])


def reference_outputs(world: World, inputs: List[RankInputs]) -> List[np.ndarray]:
    """What combine must return on each rank, computed without any all-to-all: one bf16
    expert-output row per distinct target rank, summed in fp32, rounded to bf16 (every
    rank's tokens in one pass: each row's answer depends on that row alone)."""
    if not inputs:
        return []
    W = world.ep_size
    owners, ids, weights, x = (np.concatenate([getattr(i, name) for i in inputs])
                               for name in ("owners", "expert_ids", "weights", "x"))
    mine = owners[:, :, None] == np.arange(W)  # [n, K, W]
    s = (mine * (weights * expert_scale(ids))[:, :, None]).sum(axis=1, dtype=np.float32)
    y = from_bf16_bits(to_bf16_bits(x[:, None, :] * s[:, :, None]))  # [n, W, H]
    acc = (y * mine.any(axis=1)[:, :, None]).sum(axis=1, dtype=np.float32)
    out = from_bf16_bits(to_bf16_bits(acc))
    return np.split(out, np.cumsum([i.x.shape[0] for i in inputs])[:-1])
