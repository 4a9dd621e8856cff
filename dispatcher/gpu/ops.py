"""Each FlashInfer generation's GPU ops module (``mnnvl`` for 0.7.2's kernels, ``one_sided``
for 0.7.4's), opened by the module name its generation's row records (``Generation.gpu_ops``):
the model names it, the GPU folder imports it, so no import runs up from the model."""
from __future__ import annotations

import importlib
from types import ModuleType

from ..model.generations import Generation

__all__ = ["ops_of"]


def ops_of(generation: Generation) -> ModuleType:
    """``generation``'s GPU ops module (imports torch and FlashInfer)."""
    return importlib.import_module(generation.gpu_ops)
