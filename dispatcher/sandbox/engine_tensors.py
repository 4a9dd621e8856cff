"""The tensors an engine's dispatcher is handed for ``n`` rows (bf16 hidden states, fp32
top-k weights, int32 top-k expert ids): their values are never read to size the A2A, only
their shapes and types. Past ``MAX_BYTES`` the rows are one row broadcast (a stride-0 view),
so a replay of a world with millions of tokens per rank costs no memory for them."""
from __future__ import annotations

__all__ = ["MAX_BYTES", "stand_in_rows"]

MAX_BYTES = 32 << 20


def stand_in_rows(n: int, hidden_size: int, top_k: int, num_experts: int):
    """``(hidden [n, H] bf16, weights [n, K] fp32, ids [n, K] int32)``."""
    import torch

    if n * (2 * hidden_size + 8 * top_k) <= MAX_BYTES:
        ids = torch.arange(n * top_k, dtype=torch.int32) % num_experts
        return (torch.zeros(n, hidden_size, dtype=torch.bfloat16),
                torch.ones(n, top_k, dtype=torch.float32), ids.view(n, top_k))
    ids = (torch.arange(top_k, dtype=torch.int32) % num_experts).expand(n, top_k)
    return (torch.zeros(1, hidden_size, dtype=torch.bfloat16).expand(n, hidden_size),
            torch.ones(1, top_k, dtype=torch.float32).expand(n, top_k), ids)
