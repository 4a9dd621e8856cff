"""Which of vLLM's FlashInfer NVLink backends a prepare/finalize file is (read, never run)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..releases.wheels import ReleaseError

__all__ = ["SIDES"]

SIDES = {"one-sided": "FlashInferNVLinkOneSidedPrepareAndFinalize",
         "two-sided": "FlashInferNVLinkTwoSidedPrepareAndFinalize"}


def _side_of(path: Path) -> Optional[str]:
    """Which side's prepare/finalize class the file defines (read, not run)."""
    import ast

    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        raise ReleaseError(f"vllm:{path}: not a Python file vLLM could import ({exc})") from None
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return next((s for s, cls in SIDES.items() if cls in names), None)
