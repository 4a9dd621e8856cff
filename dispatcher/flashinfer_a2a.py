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


def metainfo_index() -> dict:
    names, values = module().moe_a2a_get_metainfo_index_pairs()
    return {str(n).replace("MOE_A2A_", ""): int(v) for n, v in zip(names, values)}


def new_moe_alltoall(**kwargs):
    fc, ops = comm()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
        return ops.MoeAlltoAll(**kwargs)
