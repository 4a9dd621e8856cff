"""Hypothesis strategies that build whole serving worlds the way SGLang's scheduler does
(``worlds``), and the helpers that search them outside ``@given`` (``search``)."""
from .worlds import (GPU_SHAPES, a2a_worlds, caps, gpu_worlds, group_token_counts,  # noqa: F401
                     moe_configs, pool_worlds, regimes, sglang_contexts, topologies, worlds)
