"""FlashInfer 0.7.2's ``MoeAlltoAll`` for a rank pool without a GPU: the constructor and calls
SGLang makes (``dispatch``, ``combine``), each all-gathering every rank's arguments over the
pool's process group (gloo) and running the exact CPU model of the kernels
(``emulator.a2a.A2AModel``) on them. What it returns has the real object's shapes and dtypes
(``[ep_size, runtime, ...]`` receive tensors, ``[tokens, hidden]`` combined rows), and it checks
what FlashInfer checks where FlashInfer checks it: a runtime above the cap is the class's
Python assert, a runtime below 1 the C++ op's error.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from .a2a import A2AModel
from .inputs import RankInputs
from ..model.generations import in_force
from ..model.payloads import PayloadSpec
from ..model.world import owners_of

__all__ = ["EmulatedMoeAlltoAll"]


def _byte_rows(p) -> np.ndarray:
    """``[n, ...]`` tensor -> ``[n, bytes]`` uint8 rows (zero rows too, whatever the strides)."""
    import torch

    width = p.element_size() * (int(np.prod(p.shape[1:])) if p.dim() > 1 else 1)
    if p.numel() == 0:
        return np.zeros((p.shape[0], width), np.uint8)
    return p.detach().cpu().contiguous().view(torch.uint8).reshape(p.shape[0], width).numpy()


class EmulatedMoeAlltoAll:
    """One rank's end of the emulated all-to-all (the process group is torch.distributed's
    default one, as the pool's ranks set it up)."""

    def __init__(self, mapping=None, max_num_tokens=None, top_k=None, num_experts=None,
                 workspace_size_per_rank=None, mnnvl_config=None, **_k):
        import torch.distributed as dist

        self.max_num_tokens = max_num_tokens
        self.top_k, self.num_experts = top_k, num_experts
        self.workspace_size_per_rank = workspace_size_per_rank
        self.rank, self.ep_size = dist.get_rank(), dist.get_world_size()
        self.last_recv_counts: Optional[np.ndarray] = None  # [source] for this rank
        self._model: Optional[A2AModel] = None
        self._runtimes: List[int] = []
        self._local: List[int] = []

    def _gather(self, mine):
        import torch.distributed as dist

        every = [None] * self.ep_size
        dist.all_gather_object(every, mine)
        return every

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None, **_k):
        import torch

        runtime = runtime_max_tokens_per_rank
        if runtime <= 0:
            raise RuntimeError(f"runtime_max_tokens_per_rank must be positive, got {runtime}")
        assert runtime <= self.max_num_tokens, (
            f"runtime_max_tokens_per_rank={runtime} > max_num_tokens={self.max_num_tokens}")
        ids = token_selected_experts.detach().to("cpu", torch.int32).numpy()
        rows = [_byte_rows(p) for p in input_payloads]
        every = self._gather((ids, rows, runtime))
        self._runtimes = [r for _, _, r in every]
        self._local = [i.shape[0] for i, _, _ in every]  # each rank's tokens, for combine
        specs = [PayloadSpec(f"payload{q}", r.shape[1], p.element_size())
                 for q, (r, p) in enumerate(zip(rows, input_payloads))]
        combine_bytes = 2 * input_payloads[0].shape[-1]  # bf16 out, as many as the bf16 rows in
        self._model = A2AModel(self.ep_size, self.max_num_tokens, specs, combine_bytes,
                               in_force())  # the generation of the world this step runs
        inputs = [RankInputs(None, i, None, tuple(r), owners_of(i, self.num_experts, self.ep_size))
                  for i, r, _ in every]
        views, counts = self._model.dispatch(self._runtimes, inputs)
        self.last_recv_counts = counts[self.rank].copy()
        out = []
        for q, (plane, p) in enumerate(zip(views[self.rank], input_payloads)):
            t = torch.from_numpy(np.ascontiguousarray(plane)).view(p.dtype)
            t = t.reshape(self.ep_size, runtime, *p.shape[1:]).clone()
            if q == expert_id_payload_index and invalid_token_expert_id is not None:
                for s in range(self.ep_size):  # the sanitize step: padding slots get the mark
                    t[s, int(counts[self.rank, s]):] = invalid_token_expert_id
            out.append(t)
        return out

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, **_k):
        import torch

        if self._model is None:
            raise RuntimeError("combine without a dispatch")
        R = runtime_max_tokens_per_rank
        mine = payload.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16)
        outputs = self._gather(mine.numpy().reshape(self.ep_size, R, -1))
        results = self._model.combine(self._runtimes, outputs, self._local)
        self._model = None
        return torch.from_numpy(results[self.rank]).to(torch.bfloat16)
