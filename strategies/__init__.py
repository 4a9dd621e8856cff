"""Hypothesis strategies that build whole serving worlds the way SGLang's scheduler does."""
from .worlds import (a2a_worlds, caps, gpu_worlds, group_token_counts, moe_configs,  # noqa: F401
                     regimes, sglang_contexts, topologies, worlds)
