"""The engines whose own dispatcher code the gate runs as the policy under test: one record
each. Policies (``--policy=<name>:...``), the CLI's fetch and verdict commands, bisect and the
engine x FlashInfer table loop over ``ENGINES``; an engine's modules are named here and
imported only when that engine is used (so torch is needed only for an engine policy).

An engine package ``dispatcher/<name>/`` provides: ``fetch.py`` with ``PACKAGE`` (its files on
the package index, cached and verified), ``RELEASES`` (the pinned releases, oldest first) and
``NEEDED`` (its code the gate runs beside the dispatcher file, ``dispatcher.releases.companions``);
``loader.py`` with ``release_from_spec(target)`` (an ``EnginePolicy``, ``model/engine.py``);
``verdicts.py`` with ``TITLE``, ``default_specs()`` and ``tables(specs)``.
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
    # the DP attention size of the one step the engine x FlashInfer table runs (4 EP ranks, 8
    # tokens): 1 is sequence parallel; vLLM's older releases refuse an SP step
    compat_dp_size: int = 1

    def module(self, part: str):
        """``dispatcher.<name>.<part>`` (imported on first use)."""
        return importlib.import_module(f"dispatcher.{self.name}.{part}")

    def package(self):
        return self.module("fetch").PACKAGE

    @property
    def releases(self) -> Tuple[str, ...]:
        return tuple(self.module("fetch").RELEASES)

    def spec(self, target: str) -> str:
        """The ``--policy`` spec of ``target`` (a release, a path) of this engine."""
        return f"{self.name}:{target}"

    def owns(self, spec: str) -> bool:
        return spec.partition(":")[0] == self.name

    def judged_on(self, version: str) -> str:
        """The FlashInfer generation pinned release ``version`` is judged on: the one whose
        API it calls (``fetch.JUDGED_ON``; else the one every older release calls)."""
        from .model.generations import PINNED_RELEASES_GENERATION

        return getattr(self.module("fetch"), "JUDGED_ON", {}).get(
            version, PINNED_RELEASES_GENERATION)

    def verdicts(self):
        """Its verdict tables: ``TITLE``, ``default_specs()``, ``tables(specs)``."""
        return self.module("verdicts")


ENGINES: Dict[str, Engine] = {e.name: e for e in (
    Engine("sglang", "SGLang", "0.5.23", ("sglang/test_engine_steps.py",)),
    Engine("vllm", "vLLM", "0.33.0", ("vllm/test_engine.py",), compat_dp_size=4),
)}


def engine_of_spec(spec: str):
    """The ``Engine`` a ``--policy`` spec names (``sglang:...``), or None for a rule."""
    return ENGINES.get(spec.partition(":")[0])
