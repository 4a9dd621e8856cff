"""Hypothesis strategies that build whole serving worlds the way SGLang's scheduler does
(``worlds``), the (world, SGLang context) steps of each bug class (``sglang``), the worlds vLLM
produces (``vllm``), and the
helpers that search them outside ``@given`` (``search``)."""
from .sglang import sglang_contexts, sglang_sequences, sglang_steps  # noqa: F401
from .vllm import vllm_worlds  # noqa: F401
from .worlds import (GPU_SHAPES, a2a_worlds, caps, gpu_worlds, group_token_counts,  # noqa: F401
                     moe_configs, pool_worlds, regimes, sglang_pool_worlds, topologies,
                     worlds)
