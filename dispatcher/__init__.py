"""Sizing rule, world model, byte model, exact A2A model and dispatchers for FlashInfer's
MoE all-to-all. See README.md for the map."""
from .sizing import RankView, Policy, ideal_rule, prefix_rule, seed_era_rule  # noqa: F401
from .world import MoeConfig, World  # noqa: F401
