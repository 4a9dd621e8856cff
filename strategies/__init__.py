"""Hypothesis strategies that build whole serving worlds the way SGLang's scheduler does."""
from .worlds import (a2a_worlds, caps, group_token_counts, moe_configs, regimes,  # noqa: F401
                     topologies, worlds)
