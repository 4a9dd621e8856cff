"""The gate's model and harness for how a dispatcher sizes FlashInfer's MoE all-to-all.

The code under test is whatever ``--policy`` names (a rule, or SGLang's own dispatcher
file); this package is everything around it, in layers whose imports only run downward:

    sizing.py, mutants.py   the rules: RankView -> runtime (shipped, historical, wrong on purpose)
    model/                  the world, FlashInfer's byte layout, validation, the properties
    emulator/               the exact CPU model of dispatch/combine and its reference
    gpu/                    FlashInfer's real kernels: one process on one GPU, or a rank pool
    sglang/                 SGLang's dispatcher file run as the policy, releases, verdicts
    policies.py             a --policy spec -> the policy; __main__.py: the replay command

``strategies/`` (beside this package) builds worlds from ``model/``; the tiers in ``tests/``
use both.
"""
from .model.world import MoeConfig, World  # noqa: F401
from .sizing import Policy, RankView, ideal_rule, prefix_rule, seed_era_rule  # noqa: F401
