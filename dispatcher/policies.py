"""Resolve a ``--policy`` spec to the policy under test.

- a bare name: the shipped rule, a historical rule or a mutant (``prefix_rule``, ``undersized``)
- ``module:callable``: your rule, imported (``mypkg.sizing:rule``, ``dispatcher.sizing:ideal_rule``)
- ``sglang`` / ``sglang:VERSION`` / ``sglang:PATH``: SGLang's own dispatcher (installed, a
  release fetched from PyPI and verified, or a checkout / wheel / ``flashinfer.py``)
- ``vllm`` / ``vllm:VERSION`` / ``vllm:PATH``, optionally ``@two-sided``: vLLM's own FlashInfer
  NVLink prepare/finalize, in the same forms

A spec that cannot be resolved raises ``PolicyError`` naming what is wrong; only the module
or file the spec names is executed.
"""
from __future__ import annotations

import importlib
import traceback
from typing import Tuple

from .mutants import MUTANTS
from .sizing import KNOWN_BAD_RULES, Policy, ideal_rule

__all__ = ["DEFAULT_POLICY", "NAMED", "PolicyError", "load_policy", "engine_spec"]

DEFAULT_POLICY = "dispatcher.sizing:ideal_rule"
NAMED = {"ideal_rule": ideal_rule, **KNOWN_BAD_RULES, **MUTANTS}
ENGINES = {"sglang": "dispatcher.sglang.loader", "vllm": "dispatcher.vllm.loader"}  # spec prefix -> loader


class PolicyError(ValueError):
    """The ``--policy`` spec names nothing this suite can run as a policy."""


def load_policy(spec: str) -> Tuple[str, Policy]:
    """Return ``(spec, policy)``; raise ``PolicyError`` with the reason on a bad spec."""
    engine = spec.partition(":")[0]
    if engine in ENGINES:
        try:
            loader = importlib.import_module(ENGINES[engine])
        except ImportError as exc:  # torch missing
            raise PolicyError(f"--policy {spec} needs torch (pip install torch==2.13.0, the "
                              f"CPU build): {exc}") from None
        try:
            return spec, loader.release_from_spec(spec.partition(":")[2])
        except (ValueError, ImportError, OSError) as exc:
            raise PolicyError(f"--policy {spec}: {exc}") from None
    if ":" not in spec:
        if spec in NAMED:
            return spec, NAMED[spec]
        raise PolicyError(f"unknown policy {spec!r}: use module:callable, sglang[:VERSION|PATH], "
                          f"vllm[:VERSION|PATH] or one of {sorted(NAMED)}")
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise PolicyError(f"--policy {spec}: cannot import {module!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise PolicyError(f"--policy {spec}: importing {module!r} raised "
                          f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})") from None
    for part in attr.split("."):
        if not part or not hasattr(obj, part):
            raise PolicyError(f"--policy {spec}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PolicyError(f"--policy {spec}: {attr!r} is not callable")
    return spec, obj


def engine_spec(spec: str, policy, engine: str) -> str:
    """What an engine's own tiers run: ``spec`` when the policy under test (``--policy``) is one
    of ``engine``'s releases or checkouts, else that engine's newest pinned release."""
    if getattr(policy, "engine", None) == engine:
        return spec
    pinned = importlib.import_module(f"dispatcher.{engine}.verdicts").RELEASES
    return f"{engine}:{pinned[-1]}"
