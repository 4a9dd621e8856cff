"""The engines whose own dispatcher code the gate runs as the policy under test: one record
each. Policies (``--policy=<name>:...``), the CLI's fetch and verdict commands, bisect and the
engine x FlashInfer table loop over ``ENGINES``; an engine's modules are named here and
imported only when that engine is used (so torch is needed only for an engine policy).

An engine package ``dispatcher/<name>/`` provides: ``fetch.py`` with ``PACKAGE`` (its files on
the package index, cached and verified), ``RELEASES`` (the pinned releases, oldest first) and
``NEEDED`` (its code the gate runs beside the dispatcher file, ``dispatcher.companions``);
``loader.py`` with ``release_from_spec(target)``; ``verdicts.py`` with ``tables``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["Engine", "ENGINES", "engine_of_spec"]


@dataclass(frozen=True)
class Engine:
    name: str  # the --policy prefix and the package folder: "sglang"
    title: str  # for messages: "SGLang"
    example: str  # a release for messages: "0.5.23"
    bisect_parts: Tuple[str, ...]  # the suite's files a bisect step runs (with the properties)

    def module(self, part: str):
        """``dispatcher.<name>.<part>`` (imported on first use)."""
        return importlib.import_module(f"dispatcher.{self.name}.{part}")

    def package(self):
        return self.module("fetch").PACKAGE

    @property
    def releases(self) -> Tuple[str, ...]:
        return tuple(self.module("fetch").RELEASES)


ENGINES: Dict[str, Engine] = {e.name: e for e in (
    Engine("sglang", "SGLang", "0.5.23", ("sglang/test_engine_steps.py",)),
    Engine("vllm", "vLLM", "0.33.0", ("vllm/test_engine.py",)),
)}


def engine_of_spec(spec: str):
    """The ``Engine`` a ``--policy`` spec names (``sglang:...``), or None for a rule."""
    return ENGINES.get(spec.partition(":")[0])
