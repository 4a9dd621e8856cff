"""vLLM's sandbox: the stand-in modules of a FlashInfer generation in ``sys.modules``, with the
release's own vLLM modules (``release_modules.py``: its all-to-all managers among them) in place
of their stand-ins where the tree has them; and, read without running anything, which of
vLLM's own code runs beside the file (``header_note``)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional
from unittest import mock

from ..model.generations import modelling
from ..releases.tree import Tree
from ..releases.wheels import ReleaseError
from ..sandbox.standins import reentrant
from .fetch import RELEASE_MODULES
from .release_modules import MANAGER_CLASSES, release_modules, runtime_patches
from .sides import _side_of
from .standins import stand_in_modules

__all__ = ["ALL2ALL", "header_note"]

ALL2ALL = "vllm.distributed.device_communicators.all2all"  # the managers' module


@reentrant
@contextmanager
def _sandbox(version: str, root: Optional[Path] = None, side: str = ""):
    """The stand-in modules of FlashInfer generation ``version`` (the world's: its stand-ins
    and names, ``generations.modelling``) in ``sys.modules`` (the two-sided file imports
    FlashInfer inside prepare(), so calls run inside it too), with the release's own vLLM
    modules under ``root`` (``release_modules.py``) in place of their stand-ins."""
    import torch  # noqa: F401 - imported outside the patch, or restoring sys.modules drops it
    import torch.distributed  # noqa: F401

    with modelling(version), mock.patch.dict(sys.modules, stand_in_modules(version)), \
            runtime_patches():
        if root is not None:
            sys.modules.update(_own_modules(root, side, version))
        yield


_OWN: Dict[tuple, Dict[str, object]] = {}


def _own_modules(root: Path, side: str, version: str) -> Dict[str, object]:
    """The release's own modules to put in place of the stand-ins (loaded once per tree, side
    and generation, inside the sandbox). Its all-to-all managers replace the gate's only where
    they build FlashInfer's ``moe_ep`` communication, the API the FlashInfer recorders model;
    otherwise the gate's stand-in manager runs (the report header says which: ``header_note``)."""
    key = (str(root), side, version)
    if key not in _OWN:
        try:
            own = release_modules(root, f"vllm:{root}", {})
        except ReleaseError:  # an older tree: its modules import what is not modelled
            _OWN[key] = {}
            for name in RELEASE_MODULES:  # what the failed load left in the sandbox goes too
                sys.modules.pop(name, None)
            return _OWN[key]
        modules = dict(own.modules)
        if side and own.manager_class(side) is None:
            modules.pop(ALL2ALL, None)  # the file's isinstance check needs the manager it gets
            sys.modules[ALL2ALL] = stand_in_modules(version)[ALL2ALL]
        _OWN[key] = modules
    return _OWN[key]


def header_note(tree: Tree) -> str:
    """For the report header, read without running anything: which of vLLM's own modules run
    beside the tree's file, and which of its code the gate stands in for by hand, with the
    reason."""
    import ast

    side = _side_of(tree.main)
    root = tree.root
    have = [n.rpartition(".")[2] for n, rel in RELEASE_MODULES.items()
            if root is not None and (root / rel).is_file()]
    if not have:
        return ("\n  by hand: the gate's stand-ins for vLLM's all-to-all managers (no "
                "all2all.py beside the file)")
    all2all = root / RELEASE_MODULES[ALL2ALL]
    manager = MANAGER_CLASSES.get(side or "", "")
    try:
        tree = ast.parse(all2all.read_text()) if all2all.is_file() else None
    except (OSError, SyntaxError, ValueError):
        tree = None
    node = next((n for n in getattr(tree, "body", []) if isinstance(n, ast.ClassDef)
                 and n.name == manager), None)
    text = "" if node is None or tree is None else (ast.get_source_segment(all2all.read_text(), node) or "")
    if "flashinfer.moe_ep" in text:
        return f"\n  vLLM's own code run beside it: {', '.join(have)} (its {manager} among them)"
    return (f"\n  vLLM's own code run beside it where it loads: {', '.join(have)}; by hand: the "
            f"gate's stand-in {manager or 'manager'} (this release's builds FlashInfer's "
            f"flashinfer.comm workspaces, which the gate does not model)")
