"""Resolve a ``--policy`` spec to a sizing policy.

``module:callable`` imports it (``dispatcher.sizing:ideal_rule``, ``mypkg.sizing:rule``);
a bare name is looked up among the shipped, historical and mutant rules.
"""
from __future__ import annotations

import importlib
import os
import subprocess
from typing import Tuple

from .mutants import MUTANTS
from .sizing import KNOWN_BAD_RULES, Policy, ideal_rule

DEFAULT_POLICY = "dispatcher.sizing:ideal_rule"
NAMED = {"ideal_rule": ideal_rule, **KNOWN_BAD_RULES, **MUTANTS}


def load_policy(spec: str) -> Tuple[str, Policy]:
    """Return ``(spec, callable)``; raise ``ValueError`` with the choices on a bad spec.

    ``sglang`` runs the installed SGLang's ``FlashinferDispatcher.dispatch()``;
    ``sglang:PATH`` the one in PATH (a ``flashinfer.py``, an SGLang checkout, a wheel) and
    ``sglang:0.5.10`` a release fetched from PyPI (``pip download --no-deps``, cached).
    """
    if spec == "sglang" or spec.startswith("sglang:"):
        from . import sglang_adapter as sa

        target = spec.partition(":")[2]
        try:
            if not target:
                return spec, sa.load_release(sa.installed_release_path(), "installed")
            if target[:1].isdigit() and not os.path.exists(target):
                return spec, sa.load_release(sa.fetch_release(target), target)
            return spec, sa.load_release(target)
        except (OSError, ImportError, subprocess.CalledProcessError) as exc:
            raise ValueError(f"--policy {spec}: {exc}") from exc
    if ":" not in spec:
        if spec in NAMED:
            return spec, NAMED[spec]
        raise ValueError(f"unknown policy {spec!r}: use module:callable or one of {sorted(NAMED)}")
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"--policy {spec}: cannot import {module!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--policy {spec}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--policy {spec}: {attr!r} is not callable")
    return spec, obj
