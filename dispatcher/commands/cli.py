"""``a2a-gate``: the gate's one command line.

    a2a-gate [PYTEST ARGS...]             run the whole suite (as ``pytest`` in a checkout of it)
    a2a-gate replay [--policy SPEC] [--context CTX] "World(...)"     one world, every check
    a2a-gate fetch [sglang|vllm|flashinfer] [--pin] [VERSION ...]   pre-fill the verified cache
                                          (--pin: write the releases' hashes into pins.json)
    a2a-gate verdicts [--engine sglang|vllm|all] [SPEC ...]           the verdict tables
    a2a-gate bisect --good REV --bad REV [--repo PATH] [--engine sglang|vllm] [-- PYTEST ARGS]
    a2a-gate canary [--release NAME:VERSION ...]   the newest releases on the index, judged
    a2a-gate watch --policy=SPEC [PYTEST ARGS...]  a verdict on every save of the policy's files

The suite runs from any directory, with the options, profiles, markers, xdist groups, exit
codes and messages of ``pytest -n auto`` in a checkout: e.g. inside an SGLang checkout,
``a2a-gate -n auto --policy=sglang:.``. Inside an engine's own pytest session the same suite is
``pytest -p dispatcher.plugin --pyargs dispatcher.suite``.
"""
from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main", "COMMANDS"]

def run_suite(args: List[str]) -> int:
    import pytest

    from .runner import suite_args

    return int(pytest.main(suite_args(args=list(args))))


def _replay(args: List[str]) -> int:
    from ..__main__ import main as replay

    return replay(args)


def _fetch(args: List[str]) -> int:
    from ..engines import ENGINES
    from ..flashinfer import fetch as flashinfer
    from ..releases.wheels import fetch_main

    packages = {name: (e.package, lambda e=e: e.releases) for name, e in ENGINES.items()}
    packages["flashinfer"] = (lambda: flashinfer.PACKAGE, lambda: flashinfer.PINNED)
    flags = [a for a in args if a == "--pin"]
    args = [a for a in args if a != "--pin"]
    chosen = [args[0]] if args and args[0] in packages else list(packages)
    versions = args[1:] if args and args[0] in packages else args
    if versions and len(chosen) > 1:
        print(f"usage: a2a-gate fetch [{'|'.join(packages)}] [--pin] [VERSION ...] (name the "
              f"package of the versions)", file=sys.stderr)
        return 2
    for name in chosen:
        package, pinned = packages[name]
        code = fetch_main(package(), pinned(), ["fetch", *flags, *versions])
        if code:
            return code
    return 0


def _verdicts(args: List[str]) -> int:
    from .verdicts import main as verdicts

    return verdicts(args)


def _bisect(args: List[str]) -> int:
    from .bisect import main as bisect

    return bisect(args)


def _canary(args: List[str]) -> int:
    from .canary import main as canary

    return canary(args)


def _watch(args: List[str]) -> int:
    from .watch import main as watch

    return watch(args)


COMMANDS = {"replay": _replay, "fetch": _fetch, "verdicts": _verdicts, "bisect": _bisect,
            "canary": _canary, "watch": _watch}


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
