"""FlashInfer's MoE A2A, imported in one place (lazily: CPU machines never import it).

The single-GPU tier drives the functional API (``moe_a2a_initialize / _dispatch / _combine``)
on a workspace it allocates itself, which is the only way to run every EP rank in one process
and to put guard bytes after each rank's region. The multi-GPU tier uses ``MoeAlltoAll``, the
class SGLang's ``FlashinferDispatcher`` constructs, so the gate runs what production runs; its
0.7.x deprecation warning (in favour of ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``, a
wrapper over the same class that needs the moe_ep bootstrap) is silenced for that one call.
"""
from __future__ import annotations

import warnings
from functools import lru_cache


@lru_cache(maxsize=None)
def comm():
    import flashinfer.comm as fc
    from flashinfer.comm import trtllm_moe_alltoall as ops

    return fc, ops


def module():
    """The compiled module (JIT-built once, or the AOT .so shipped inside the package)."""
    return comm()[1].get_moe_alltoall_module()


def pdl_default(device) -> bool:
    """What FlashInfer's ``enable_pdl=None`` resolves to on ``device`` (programmatic dependent
    launch from sm_90 on), asked once instead of on every launch."""
    from flashinfer.utils import device_support_pdl

    return bool(device_support_pdl(device))


def metainfo_index() -> dict:
    names, values = module().moe_a2a_get_metainfo_index_pairs()
    return {str(n).replace("MOE_A2A_", ""): int(v) for n, v in zip(names, values)}


def new_moe_alltoall(ep_size: int, rank: int, max_num_tokens: int, top_k: int,
                     num_experts: int, workspace_size_per_rank: int):
    """``MoeAlltoAll`` bootstrapped as SGLang does (after ``init_process_group``; every rank
    calls this together)."""
    from flashinfer.comm import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig, TorchDistBackend

    _, ops = comm()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
        return ops.MoeAlltoAll(
            mapping=Mapping(world_size=ep_size, rank=rank, gpus_per_node=ep_size,
                            tp_size=ep_size, moe_ep_size=ep_size),
            max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
            workspace_size_per_rank=workspace_size_per_rank,
            mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend()))
