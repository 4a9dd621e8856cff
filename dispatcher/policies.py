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
import subprocess
import sys
import traceback
from typing import Tuple

from .mutants import MUTANTS
from .sizing import KNOWN_BAD_RULES, Policy, ideal_rule

__all__ = ["DEFAULT_POLICY", "NAMED", "PolicyError", "load_policy", "probe_policy", "engine_spec",
           "PROBE_TIMEOUT_S"]

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
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's module failed (or exited) at import
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


PROBE_TIMEOUT_S = float(os.environ.get("A2A_GATE_POLICY_LOAD_TIMEOUT_S", "120"))
_LOADED, _FAILED = "A2A-GATE-POLICY-LOADED", "A2A-GATE-POLICY-ERROR: "
_PROBE = f"""
import sys
from dispatcher.policies import PolicyError, load_policy
try:
    load_policy(sys.argv[1])
except PolicyError as exc:
    print({_FAILED!r} + str(exc).replace(chr(10), " "), flush=True)
    sys.exit(2)
print({_LOADED!r}, flush=True)
"""


def _runs_foreign_code(spec: str) -> bool:
    """Whether ``spec`` executes code that is not the gate's own (a user module, an engine
    file); the gate's named rules and modules need no probe."""
    module = spec.partition(":")[0]
    return spec not in NAMED and (module in ENGINES or not module.startswith("dispatcher"))


def probe_policy(spec: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Load ``spec`` once in a child process first: a module or engine file that exits the
    process, never finishes loading or cannot be loaded is a ``PolicyError`` saying which."""
    if not _runs_foreign_code(spec):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, spec], capture_output=True,
                              text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PolicyError(f"--policy {spec}: loading it did not finish within {timeout_s:.0f} s "
                          f"(an endless loop at import?)") from None
    out = done.stdout.splitlines()
    failed = [line[len(_FAILED):] for line in out if line.startswith(_FAILED)]
    if failed:
        raise PolicyError(failed[-1])
    if _LOADED not in out:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1][:300]
        raise PolicyError(f"--policy {spec}: loading it ended the process (exit code "
                          f"{done.returncode}) before it finished: the module exits at import "
                          f"(os._exit, sys.exit) or crashed: {last}")


def engine_spec(spec: str, policy, engine: str) -> str:
    """What an engine's own tiers run: ``spec`` when the policy under test (``--policy``) is one
    of ``engine``'s releases or checkouts, else that engine's newest pinned release."""
    if getattr(policy, "engine", None) == engine:
        return spec
    pinned = importlib.import_module(f"dispatcher.{engine}.verdicts").RELEASES
    return f"{engine}:{pinned[-1]}"
