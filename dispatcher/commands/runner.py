"""Where the suite is and the pytest settings it runs with, for ``a2a-gate`` and bisect."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import List, Sequence, Tuple

__all__ = ["suite_args", "INI_ARGS", "hypothesis_home", "keep_hypothesis_home", "processes_for",
           "POLICY_PROCESSES"]

# Test processes worth starting for a user's policy gated alone (its 13-26 checks, the gate's
# self-checks deselected): two run the pinned GPU tiers' chains, the rest share the others,
# each past that only adds its own start (an interpreter, the suite's collection, torch for an
# engine) to the run's. Gating an SGLang file on a 1 x H100 host: 8 processes 15.2 s, 16 (one
# per CPU) 17.1-19.4 s (benchmarks/README.md).
POLICY_PROCESSES = 8


def processes_for(spec: str, self_check: bool, cpus: int) -> int:
    """How many test processes ``-n auto`` and ``a2a-gate watch`` start (``cpus``: one per CPU):
    that many for the whole suite (the shipped rule, or ``--self-check``), at most
    ``POLICY_PROCESSES`` for a user's policy."""
    from ..policies import DEFAULT_POLICY

    if spec == DEFAULT_POLICY or self_check:
        return max(1, cpus)
    return max(1, min(cpus, POLICY_PROCESSES))


_REPO = Path(__file__).resolve().parents[2]
# The pytest settings the suite runs with: pyproject.toml's [tool.pytest.ini_options] in a
# checkout, these arguments from ``a2a-gate`` anywhere else (tests/meta holds them equal). Kept
# here, not in the plugin: importing the plugin before pytest starts would leave it (and
# Hypothesis) out of pytest's assert rewriting.
INI_ARGS = ("--strict-markers", "--strict-config", "-ra", "--dist=loadgroup",
            "-o", "xfail_strict=true")


def _suite() -> Tuple[Path, List[str], List[str]]:
    """(the suite's folder, the settings it runs with, where pytest's cache goes)."""
    if (_REPO / "pyproject.toml").is_file() and (_REPO / "tests" / "__init__.py").is_file():
        return _REPO / "tests", ["-c", str(_REPO / "pyproject.toml"), "--rootdir", str(_REPO)], []
    spec = importlib.util.find_spec("dispatcher.suite")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("a2a-gate: the suite (dispatcher.suite) is not installed with the gate")
    suite = Path(list(spec.submodule_search_locations)[0])
    from ..releases.wheels import user_cache  # pytest's cache beside the releases, not in site-packages

    return (suite, ["-c", os.devnull, "--rootdir", str(suite), "-p", "dispatcher.plugin",
                    *INI_ARGS], ["-o", f"cache_dir={user_cache() / 'pytest-cache'}"])


def _no_cache(args: Sequence[str]) -> bool:
    """Whether ``args`` turn pytest's cache plugin off (``-p no:cacheprovider``)."""
    args = list(args)
    return any(a in ("-pno:cacheprovider", "-p=no:cacheprovider")
               or (a == "-p" and i + 1 < len(args) and args[i + 1] == "no:cacheprovider")
               for i, a in enumerate(args))


def suite_args(parts: Tuple[str, ...] = (), args: Sequence[str] = ()) -> List[str]:
    """The pytest arguments that select the suite (or ``parts`` of it, paths inside it such as
    ``sglang/test_engine_steps.py``) and its settings: a checkout's own ``pyproject.toml`` and
    ``tests/``, or the installed ``dispatcher.suite`` with the plugin and the settings of
    ``INI_ARGS`` (never the settings of the directory it is run from, e.g.
    an engine's own pytest configuration). ``args``: more pytest arguments; those that name a
    path inside the suite (``sglang/test_engine_steps.py::test_x``) select it instead of the
    whole suite."""
    suite, settings, cache = _suite()
    if not _no_cache(args):  # with pytest's cache plugin off, cache_dir is no option at all
        settings += cache
    named = [a for a in args if not a.startswith("-") and (suite / a.split("::")[0]).exists()]
    rest = [a for a in args if a not in named]
    return settings + [str(suite / p) for p in (*parts, *named) or (".",)] + rest


def hypothesis_home() -> Path:
    """Where Hypothesis keeps its files for the gate's own commands (the verdict, compat and
    canary tables, the replay, bisect): a checkout's ``.hypothesis/``, else beside the release
    caches; never the folder a command is run from (an engine's checkout)."""
    if (_REPO / "pyproject.toml").is_file():
        return _REPO / ".hypothesis"
    from ..releases.wheels import user_cache

    return user_cache() / "hypothesis-home"


def keep_hypothesis_home() -> None:
    """Point Hypothesis's home at ``hypothesis_home()`` (before a command's first search)."""
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(str(hypothesis_home()))
