"""The stand-in MoE and payload decoding in torch, for the GPU tiers: the same maths as
``dispatcher/emulator/inputs.py`` (a CPU test keeps the two equal)."""
from __future__ import annotations

import numpy as np
import torch

from ..model.workspace import PayloadFormat
from ..model.world import MoeConfig, owners_of

__all__ = ["decode_hidden", "stand_in_moe", "expert_outputs", "to_torch_rows", "typed"]


def decode_hidden(planes, fmt: PayloadFormat, hidden_size: int) -> torch.Tensor:
    """[..., bytes] uint8 hidden planes -> [..., H] float32 (the stand-in quantization)."""
    p = planes[0]
    if fmt is PayloadFormat.BF16:
        return p.contiguous().view(torch.bfloat16).float()
    if fmt is PayloadFormat.MXFP8:
        return p.contiguous().view(torch.int8).float()
    b = p.to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8
    hi = ((b >> 4) ^ 8) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2).float()


def stand_in_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 ep_ranks: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """``x`` [T, M, H], ids/weights [T, M, K], ``ep_ranks`` [T]: each target rank's bf16 output
    ``x * sum_k w_k (1 + e_k % 3)`` over the k it owns (stale rows go through too)."""
    mine = owners_of(expert_ids, num_experts, ep_size) == ep_ranks.view(-1, 1, 1)
    scale = 1.0 + (expert_ids.long() % 3).float()
    s = torch.where(mine, weights * scale, torch.zeros_like(weights)).sum(-1, keepdim=True)
    return (x * s).to(torch.bfloat16)


def expert_outputs(recv, runtime: int, moe: MoeConfig, rank, ep_size: int) -> torch.Tensor:
    """What EP rank ``rank``'s experts return for the planes it received (``[W, R, bytes]``
    each, FlashInfer's order): ``[W, R, H]`` bf16, the tensor combine is handed. ``rank`` may
    be a list of ranks, with ``recv`` their planes stacked (``[T, W, R, bytes]``, the same
    runtime): ``[T, W, R, H]``, one launch per op for every rank of a world."""
    ranks = torch.as_tensor([rank] if isinstance(rank, int) else list(rank), device=recv[0].device)
    t = len(ranks)
    planes = [p.reshape(t, ep_size * runtime, -1) for p in recv]
    n_hidden = len(planes) - 2
    x = decode_hidden(planes[:n_hidden], moe.payload_format, moe.hidden_size)
    ids = planes[n_hidden].contiguous().view(torch.int32)
    w = planes[n_hidden + 1].contiguous().view(torch.float32)
    y = stand_in_moe(x, ids, w, ranks, moe.num_experts, ep_size)
    shape = (ep_size, runtime, moe.hidden_size)
    return y.view(*shape) if isinstance(rank, int) else y.view(t, *shape)


DTYPES = {"hidden_states": torch.bfloat16, "topk_ids": torch.int32, "topk_weights": torch.float32}


def typed(rows: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 byte rows -> the dtype FlashInfer is handed for payload ``name`` (bf16 hidden
    states, int32 ids, fp32 weights; quantized hidden states and scales stay uint8)."""
    return rows.view(DTYPES.get(name, torch.uint8))


def to_torch_rows(arrays, device) -> list:
    """numpy [n, ...] arrays of any dtype -> their bytes as uint8 [n, row_bytes] tensors on
    ``device``, moved in one copy."""
    rows = [np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], a.itemsize * int(np.prod(a.shape[1:])))
            for a in arrays]
    flat = np.concatenate([r.reshape(-1) for r in rows]) if rows else np.zeros(0, np.uint8)
    host = torch.from_numpy(flat)
    dev = host.to(device)  # a few KiB: pinning a fresh buffer (cudaHostAlloc) costs more
    out, at = [], 0
    for r in rows:
        out.append(dev[at:at + r.size].view(r.shape))
        at += r.size
    return out
