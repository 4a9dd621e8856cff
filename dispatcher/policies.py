"""Resolve a ``--policy`` spec to the policy under test.

- a bare name: the shipped rule, a historical rule or a mutant (``prefix_rule``, ``undersized``)
- ``module:callable``: your rule, imported (``mypkg.sizing:rule``, ``dispatcher.sizing:ideal_rule``)
- ``sglang`` / ``sglang:VERSION`` / ``sglang:PATH``: SGLang's own dispatcher (installed, a
  release fetched from PyPI and verified, or a checkout / wheel / ``flashinfer.py``)
- ``vllm`` / ``vllm:VERSION`` / ``vllm:PATH``, optionally ``@two-sided``: vLLM's own FlashInfer
  NVLink prepare/finalize, in the same forms

A spec that cannot be resolved raises ``PolicyError`` naming what is wrong; only the module
or file the spec names is executed. ``probe_policy`` loads it first in a child process with a
timeout, so a module that exits the process (``os._exit``, ``sys.exit``) or never finishes
importing is a usage error that says so, not a silent green run or a hang.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from typing import Tuple

from .engines import ENGINES, engine_of_spec
from .mutants import MUTANTS
from .sandbox import zygote
from .sandbox.procs import DROP_CWD, OutputFlood, child_env, run_bounded
from .sizing import KNOWN_BAD_RULES, Policy, ideal_rule

__all__ = ["DEFAULT_POLICY", "NAMED", "PolicyError", "load_policy", "probe_policy", "engine_spec",
           "runs_foreign_code",
           "describe_policy", "foreign_code_loaded",
           "PROBE_TIMEOUT_S", "load_timeout_s", "LOAD_TIMEOUT_ENV"]

DEFAULT_POLICY = "dispatcher.sizing:ideal_rule"
_ENGINE_FORMS = ", ".join(f"{name}[:VERSION|PATH]" for name in ENGINES)
NAMED = {"ideal_rule": ideal_rule, **KNOWN_BAD_RULES, **MUTANTS}


class PolicyError(ValueError):
    """The ``--policy`` spec names nothing this suite can run as a policy."""


_FOREIGN_LOADED = []


def foreign_code_loaded() -> bool:
    """Whether this process has loaded code that is not the gate's own (a user's module, an
    engine file): then what it may run at exit must not decide the exit status."""
    return bool(_FOREIGN_LOADED)


def load_policy(spec: str) -> Tuple[str, Policy]:
    """Return ``(spec, policy)``; raise ``PolicyError`` with the reason on a bad spec."""
    if runs_foreign_code(spec) and not _FOREIGN_LOADED:
        _FOREIGN_LOADED.append(spec)
    engine = engine_of_spec(spec)
    if engine is not None:
        try:
            loader = engine.module("loader")
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
        raise PolicyError(f"unknown policy {spec!r}: use module:callable, {_ENGINE_FORMS} or one "
                          f"of {sorted(NAMED)}")
    module, _, attr = spec.partition(":")
    here = os.getcwd()
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise PolicyError(f"--policy {spec}: cannot import {module!r}: {exc}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's module failed (or exited) at import
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise PolicyError(f"--policy {spec}: importing {module!r} raised "
                          f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})") from None
    finally:
        if os.getcwd() != here:  # the module changed directory at import: not the gate's
            warnings.warn(f"--policy {spec}: importing {module!r} changed the current "
                          f"directory to {os.getcwd()}; the gate changed it back to {here}")
            os.chdir(here)
    for part in attr.split("."):
        if not part or not hasattr(obj, part):
            raise PolicyError(f"--policy {spec}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PolicyError(f"--policy {spec}: {attr!r} is not callable")
    return spec, obj


LOAD_TIMEOUT_ENV = "A2A_GATE_POLICY_LOAD_TIMEOUT_S"
PROBE_TIMEOUT_S = 120.0  # the default of $A2A_GATE_POLICY_LOAD_TIMEOUT_S


def load_timeout_s() -> float:
    """Seconds a policy may take to load: ``$A2A_GATE_POLICY_LOAD_TIMEOUT_S`` (a positive,
    finite number), else ``PROBE_TIMEOUT_S``; a bad value is a ``PolicyError`` naming it."""
    import math

    text = os.environ.get(LOAD_TIMEOUT_ENV, "").strip()
    if not text:
        return PROBE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise PolicyError(f"{LOAD_TIMEOUT_ENV}={text!r}: must be a positive number of seconds "
                          f"(default {PROBE_TIMEOUT_S:.0f})")
    return value
_LOADED, _FAILED = "A2A-GATE-POLICY-LOADED", "A2A-GATE-POLICY-ERROR: "
_PROBE = DROP_CWD + "from dispatcher.policies import _probe_main\n_probe_main(sys.argv[1])\n"


def _probe_main(spec: str) -> None:
    """The probe's child: load ``spec`` and say whether it loaded."""
    try:
        load_policy(spec)
    except PolicyError as exc:
        print(_FAILED + str(exc).replace(chr(10), " "), flush=True)
        sys.exit(2)
    print(_LOADED, flush=True)


def runs_foreign_code(spec: str) -> bool:
    """Whether ``spec`` executes code that is not the gate's own (a user module, an engine
    file); the gate's named rules and modules need no probe."""
    module = spec.partition(":")[0]
    return spec not in NAMED and (module in ENGINES or not _gate_module(module))


def _gate_module(module: str) -> bool:
    """Whether ``module`` is the gate's own: its package or a module inside it, found where
    this package is (a user's ``dispatcher_local`` or ``dispatcher2`` is not, whatever its
    name starts with); nothing is imported to tell."""
    import importlib.util

    if module != __package__ and not module.startswith(__package__ + "."):
        return False
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    here = os.path.dirname(os.path.abspath(__file__))
    origin = getattr(spec, "origin", None) if spec is not None else None
    return bool(origin) and os.path.abspath(origin).startswith(here + os.sep)


def probe_policy(spec: str, timeout_s: float = None) -> None:
    """Load ``spec`` once in a child process first: a module or engine file that exits the
    process, never finishes loading or cannot be loaded is a ``PolicyError`` saying which."""
    if not runs_foreign_code(spec):
        return
    timeout_s = load_timeout_s() if timeout_s is None else timeout_s
    try:
        code, text = run_bounded(
            [sys.executable, "-c", _PROBE, spec], child_env(spec), timeout_s,
            start=lambda out: zygote.popen(_probe_main, (spec,), env=child_env(spec),
                                           stdout=out.fileno(), preload=_preload_of(spec),
                                           argv=["-c", spec]))
    except OutputFlood as exc:
        raise PolicyError(f"--policy {spec}: loading it flooded the output: {exc}") from None
    out = text.splitlines()
    if code is None and _LOADED not in out:
        raise PolicyError(f"--policy {spec}: loading it did not finish within {timeout_s:.0f} s "
                          f"(an endless loop at import?)")
    failed = [line[len(_FAILED):] for line in out if line.startswith(_FAILED)]
    if failed:
        raise PolicyError(failed[-1])
    if _LOADED not in out:
        last = (text.strip().splitlines() or ["(nothing printed)"])[-1][:300]
        raise PolicyError(f"--policy {spec}: loading it ended the process (exit code "
                          f"{code}) before it finished: the module exits at import "
                          f"(os._exit, sys.exit) or crashed: {last}")


def _preload_of(spec: str) -> tuple:
    """What the process that loads ``spec`` is forked with (``sandbox.zygote``): torch for an
    engine's code, nothing for a rule module (its process imports what the module does)."""
    return zygote.WITH_TORCH if engine_of_spec(spec) is not None else ()


def engine_spec(spec: str, engine: str) -> str:
    """What an engine's own tiers run: ``spec`` when the policy under test (``--policy``) is one
    of ``engine``'s releases or checkouts, else that engine's newest pinned release."""
    mine = engine_of_spec(spec)
    if mine is not None and mine.name == engine:
        return spec
    return f"{engine}:{ENGINES[engine].releases[-1]}"


def describe_policy(spec: str) -> str:
    """One line on what ``spec`` runs, found without running any of it (for the report
    header): an engine file's path, hash and the code beside it; a ``PolicyError`` for a spec
    that names nothing (a rule module is only found by loading it: the probe's job)."""
    engine = engine_of_spec(spec)
    if engine is None:
        if ":" not in spec and spec not in NAMED:
            raise PolicyError(f"unknown policy {spec!r}: use module:callable, {_ENGINE_FORMS} or "
                              f"one of {sorted(NAMED)}")
        return ""
    try:
        loader = engine.module("loader")
        tree = loader.tree_of_spec(spec.partition(":")[2])  # found and read, nothing run
        own = getattr(loader, "header_note", lambda _: "")(tree)  # what runs, what is stood in
        return (f" ({tree.main}, sha256 {tree.digest[:16]})\n  the engine's code beside it: "
                f"{tree.origin}{own}")
    except ImportError as exc:  # torch missing
        raise PolicyError(f"--policy {spec} needs torch (pip install torch==2.13.0, the CPU "
                          f"build): {exc}") from None
    except (ValueError, OSError) as exc:
        raise PolicyError(f"--policy {spec}: {exc}") from None
