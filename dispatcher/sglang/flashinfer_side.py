"""What SGLang's dispatcher file takes from FlashInfer, as the gate hands it over: the
recorder ``MoeAlltoAll`` (binds every call to the signature of the generation under test and
stops ``dispatch()`` at the launch), the workspace-size function, and SGLang's own
``TorchDistributedCommBackend`` for the real kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..model.mnnvl import workspace_size_per_rank
from ..sandbox.standins import Launched, flashinfer_api

__all__ = ["LaunchRecord", "MoeAlltoAll", "moe_a2a_get_workspace_size_per_rank",
           "torch_distributed_comm_backend"]


@dataclass(frozen=True)
class LaunchRecord:
    """What SGLang constructed its ``MoeAlltoAll`` with and passed to ``dispatch``."""

    runtime: object
    max_num_tokens: object
    workspace_size_per_rank: object
    invalid_token_expert_id: object
    num_experts: object
    payload_bytes_per_token: Optional[int]  # None when no row was sent


class MoeAlltoAll:
    """Records what SGLang constructs and passes, and stops dispatch() at the launch. Every call
    is bound to the signature the FlashInfer generation under test has (read from its source:
    ``dispatcher/flashinfer/api.py``), so a call that release would refuse raises its TypeError."""

    def __init__(self, *args, **kwargs):
        a = flashinfer_api().bind("MoeAlltoAll.__init__", *args, **kwargs).arguments
        self.max_num_tokens = a["max_num_tokens"]
        self.workspace_size_per_rank = a.get("workspace_size_per_rank")
        self.num_experts = a["num_experts"]

    def dispatch(self, *args, **kwargs):
        a = flashinfer_api().bind("MoeAlltoAll.dispatch", *args, **kwargs).arguments
        input_payloads = a["input_payloads"]
        rows = input_payloads[0].shape[0] if input_payloads else 0
        size = (sum(p.numel() * p.element_size() for p in input_payloads) // rows) if rows else None
        raise Launched(LaunchRecord(a["runtime_max_tokens_per_rank"], self.max_num_tokens,
                                    self.workspace_size_per_rank, a["invalid_token_expert_id"],
                                    self.num_experts, size))


def moe_a2a_get_workspace_size_per_rank(*args, **kwargs):
    a = flashinfer_api().bind("moe_a2a_get_workspace_size_per_rank", *args, **kwargs).arguments
    return workspace_size_per_rank(a["ep_size"], a["max_num_tokens"],
                                   a["total_dispatch_payload_size_per_token"],
                                   a["combine_payload_size_per_token"])


def torch_distributed_comm_backend():
    """SGLang's ``flashinfer_utils.TorchDistributedCommBackend``, as it is: FlashInfer's MNNVL
    bootstrap over a torch.distributed group (for the real kernels)."""
    import torch.distributed as dist
    from flashinfer.comm.mnnvl import CommBackend

    class TorchDistributedCommBackend(CommBackend):
        def __init__(self, group):
            self._group = group

        def Get_rank(self):
            return self._group.rank()

        def Get_size(self):
            return self._group.size()

        def allgather(self, data):
            gathered = [None] * self.Get_size()
            dist.all_gather_object(gathered, data, group=self._group)
            return gathered

        def bcast(self, data, root=0):
            obj = [data]
            dist.broadcast_object_list(obj, src=root, group=self._group)
            return obj[0]

        def Split(self, color, key):
            return self

        def barrier(self):
            dist.barrier(group=self._group)
    return TorchDistributedCommBackend
