"""The stand-in MoE and payload decoding in torch, for the GPU tiers: the same maths as
``dispatcher/emulator/inputs.py`` (a CPU test keeps the two equal)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..model.payloads import PayloadFormat
from ..model.world import MoeConfig, owners_of

__all__ = ["decode_hidden", "stand_in_moe", "expert_outputs", "to_torch_rows", "read_back",
           "typed", "device_inputs", "rank_inputs", "per_rank_on_streams", "pdl_default"]


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
    shapes = [(a.shape[0], a.nbytes // a.shape[0] if a.shape[0] else
               a.itemsize * math.prod(a.shape[1:])) for a in arrays]
    flat = (np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
            if arrays else np.zeros(0, np.uint8))
    dev = torch.from_numpy(flat).to(device)  # a few KiB: pinning a fresh buffer costs more
    out, at = [], 0
    for n, row in shapes:
        out.append(dev[at:at + n * row].view(n, row))
        at += n * row
    return out


_HOST = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int32: np.int32,
         torch.int64: np.int64, torch.float32: np.float32, torch.bfloat16: np.uint16}


def read_back(tensors) -> list:
    """Device tensors -> numpy arrays of the same shapes, in one copy (one sync): the bytes
    of all of them concatenated on the device, split on the host. bf16 comes back as float32
    (exactly)."""
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    host = torch.cat(flat).cpu().numpy() if flat else np.zeros(0, np.uint8)
    out, at = [], 0
    for t, f in zip(tensors, flat):
        a = host[at:at + f.numel()].view(_HOST[t.dtype]).reshape(tuple(t.shape))
        at += f.numel()
        out.append((a.astype(np.uint32) << 16).view(np.float32) if t.dtype == torch.bfloat16
                   else a)
    return out


def device_inputs(inputs, device) -> list:
    """Every rank's expert ids and payload rows on the device, rank after rank."""
    return to_torch_rows([a for inp in inputs for a in (inp.expert_ids, *inp.payload_rows)],
                         device)


def rank_inputs(dev: list, rank: int, payloads) -> tuple:
    """Rank ``rank``'s expert ids and typed payload rows out of ``device_inputs``."""
    per = len(payloads) + 1
    ids, *rows = dev[rank * per:(rank + 1) * per]
    return ids, [typed(t, spec.name) for t, spec in zip(rows, payloads)]


def per_rank_on_streams(streams, device, fn) -> list:
    """``fn(r)`` for every rank ``r`` with its own stream current (every call launched before
    any is waited for); the caller's stream is current again afterwards, even on an error."""
    main = torch.cuda.current_stream(device)
    out = []
    try:
        for r, stream in enumerate(streams):
            torch.cuda.set_stream(stream)
            out.append(fn(r))
    finally:
        torch.cuda.set_stream(main)
    return out


def pdl_default(device) -> bool:
    """What FlashInfer's ``enable_pdl=None`` resolves to on ``device`` (programmatic dependent
    launch from sm_90 on), asked once instead of on every launch."""
    from flashinfer.utils import device_support_pdl

    return bool(device_support_pdl(device))
