"""``a2a-gate``: the gate's one command line.

    a2a-gate [PYTEST ARGS...]             run the whole suite (as ``pytest`` in a checkout of it)
    a2a-gate replay [--policy SPEC] [--context CTX] "World(...)"     one world, every check
    a2a-gate fetch [sglang|vllm|flashinfer] [VERSION ...]   pre-fill the verified release cache
    a2a-gate verdicts [--engine sglang|vllm|both] [SPEC ...]          the verdict tables
    a2a-gate bisect --good REV --bad REV [--repo PATH] [--engine sglang|vllm] [-- PYTEST ARGS]

The suite runs from any directory, with the options, profiles, markers, xdist groups, exit
codes and messages of ``pytest -n auto`` in a checkout: e.g. inside an SGLang checkout,
``a2a-gate -n auto --policy=sglang:.``. Inside an engine's own pytest session the same suite is
``pytest -p dispatcher.plugin --pyargs dispatcher.suite``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

__all__ = ["main", "suite_args", "COMMANDS", "INI_ARGS"]

_REPO = Path(__file__).resolve().parents[1]
# The pytest settings the suite runs with: pyproject.toml's [tool.pytest.ini_options] in a
# checkout, these arguments from ``a2a-gate`` anywhere else (tests/meta holds them equal). Kept
# here, not in the plugin: importing the plugin before pytest starts would leave it (and
# Hypothesis) out of pytest's assert rewriting.
INI_ARGS = ("--strict-markers", "--strict-config", "-ra", "--dist=loadgroup",
            "-o", "xfail_strict=true")


def suite_args(parts: Tuple[str, ...] = ()) -> List[str]:
    """The pytest arguments that select the suite (or ``parts`` of it, paths inside it such as
    ``sglang/test_engine_steps.py``) and its settings: a checkout's own ``pyproject.toml`` and
    ``tests/``, or the installed ``dispatcher.suite`` with the plugin and the settings of
    ``INI_ARGS`` (never the settings of the directory it is run from, e.g.
    an engine's own pytest configuration)."""
    if (_REPO / "pyproject.toml").is_file() and (_REPO / "tests" / "__init__.py").is_file():
        suite = _REPO / "tests"
        settings = ["-c", str(_REPO / "pyproject.toml"), "--rootdir", str(_REPO)]
    else:
        spec = importlib.util.find_spec("dispatcher.suite")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("a2a-gate: the suite (dispatcher.suite) is not installed with "
                             "the gate")
        suite = Path(list(spec.submodule_search_locations)[0])
        settings = ["-c", os.devnull, "--rootdir", str(suite), "-p", "dispatcher.plugin",
                    *INI_ARGS]
    return settings + [str(suite / p) for p in parts or (".",)]


def run_suite(args: List[str]) -> int:
    import pytest

    return int(pytest.main(suite_args() + list(args)))


def _replay(args: List[str]) -> int:
    from .__main__ import main as replay

    return replay(args)


def _fetch(args: List[str]) -> int:
    engines = ("sglang", "vllm", "flashinfer")
    chosen = [args[0]] if args and args[0] in engines else list(engines)
    versions = args[1:] if args and args[0] in engines else args
    if versions and len(chosen) > 1:
        print("usage: a2a-gate fetch [sglang|vllm|flashinfer] [VERSION ...] (name the package of the "
              "versions)", file=sys.stderr)
        return 2
    from .wheels import fetch_main

    for engine in chosen:
        package = importlib.import_module(f"dispatcher.{engine}.fetch").PACKAGE
        pinned = (importlib.import_module("dispatcher.flashinfer.fetch").PINNED
                  if engine == "flashinfer"
                  else importlib.import_module(f"dispatcher.{engine}.verdicts").RELEASES)
        code = fetch_main(package, pinned, ["fetch", *versions])
        if code:
            return code
    return 0


def _verdicts(args: List[str]) -> int:
    from .sglang_verdicts import main as verdicts

    return verdicts(args)


def _bisect(args: List[str]) -> int:
    from .bisect import main as bisect

    return bisect(args)


COMMANDS = {"replay": _replay, "fetch": _fetch, "verdicts": _verdicts, "bisect": _bisect}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv[:1] == ["help"]:
        print(__doc__)
        return 0
    return run_suite(argv)


if __name__ == "__main__":
    sys.exit(main())
