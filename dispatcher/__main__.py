"""Replay one world: ``python -m dispatcher --policy SPEC [--context "SGLangContext(...)"] "World(...)"``.

Prints the world in words, the policy's value on every rank, which properties hold, what the
dispatcher's validation says and, for worlds small enough, the emulated A2A round trip. For
an SGLang policy it also prints what SGLang's own dispatch() saw and did on every rank and
checks every bug class, in the context given (default: eager decode). The world and the
context are read by ``dispatcher.model.parse`` (literals only, never evaluated as code).

This process is the controller: the replay runs in a child process (``dispatcher.commands.replay``),
bounded by ``--timeout``, and the exit status is decided here from what the child reported,
so nothing the policy runs (``os._exit(0)`` at import, in a rule call or at exit; a loop that
never returns) can make a failure look like a pass.

Exit codes: 0 every property holds; 1 a property is violated (or the rule crashed, ended the
process, or did not return in time, or the round trip is wrong); 2 bad input (the world text,
the policy spec, the arguments, a policy that does not finish loading); 3 an internal error of
the gate (please report it).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .sandbox.procs import Terminated, child_env, die_with_parent, python_child, seconds_arg as _seconds

OK, VIOLATED, BAD_INPUT, INTERNAL = 0, 1, 2, 3
DEFAULT_POLICY = "dispatcher.sizing:ideal_rule"
TIMEOUT_ENV = "A2A_GATE_REPLAY_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0


def parser() -> argparse.ArgumentParser:
    from .model.generations import GENERATIONS

    ap = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("world", help="a World repr, as printed by a failing test (or a sequence "
                    "of steps on one workspace: \"(World(...), World(...))\")")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help="the rule or SGLang file to replay (default: %(default)s)")
    ap.add_argument("--flashinfer", default=None, metavar="|".join(GENERATIONS),
                    help="the FlashInfer A2A generation (default: the installed one, else 0.7.2)")
    ap.add_argument("--context", default="", metavar="'SGLangContext(...)'",
                    help="for sglang: policies, the step's context (default: eager decode)")
    ap.add_argument("--newest-companions", action="store_true",
                    help="let the newest pinned release's code stand in for an engine "
                         "checkout's missing companion functions (as in the gate run)")
    ap.add_argument("--rule-timeout-s", type=_seconds, default=None, metavar="S",
                    help="seconds one call into the policy may take (default: 10, as in the "
                         "gate run)")
    ap.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                    help=f"seconds the whole replay may take (default: ${TIMEOUT_ENV}, else "
                         f"{DEFAULT_TIMEOUT_S:.0f})")
    return ap


def main(argv=None) -> int:
    from .sandbox.procs import raise_on_sigterm

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)  # exits 2 on bad arguments
    raise_on_sigterm()
    timeout = args.timeout
    if timeout is None:
        try:
            timeout = _seconds(os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S)))
        except argparse.ArgumentTypeError as exc:
            print(f"error: {TIMEOUT_ENV}: {exc}", file=sys.stderr)
            return BAD_INPUT
    from .policies import PolicyError, load_timeout_s

    try:
        load_timeout = min(load_timeout_s(), timeout)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    with tempfile.TemporaryDirectory(prefix="a2a-gate-replay-") as tmp:
        report = Path(tmp) / "report"
        report.touch()
        env = child_env(args.policy, A2A_GATE_REPLAY_REPORT=str(report))
        proc = subprocess.Popen(python_child("dispatcher.commands.replay", *argv), env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            code, timed_out, said = _watch(proc, report, load_timeout, timeout)
        except Terminated:
            _kill(proc)
            print("stopped (SIGTERM): the replay is killed", file=sys.stderr)
            return 143
        finally:
            _kill(proc)  # and whatever it started
        said = report.read_text().split() if not said else said
    return _decide(said, code, timed_out, load_timeout if "loaded" not in said else timeout, args)


def _watch(proc: subprocess.Popen, report: Path, load_timeout: float, timeout: float):
    """Wait for the replay: (exit code, timed out, what it reported); loading is bounded by
    ``load_timeout``, the whole replay by ``timeout``."""
    import time

    start = time.monotonic()
    while True:
        try:
            code = proc.wait(timeout=0.05)
            return code, False, report.read_text().split()
        except subprocess.TimeoutExpired:
            pass
        said = report.read_text().split()
        elapsed = time.monotonic() - start
        if "verdict" in said:  # said and done; what lingers (a thread it left) is killed
            try:
                return proc.wait(timeout=2), False, said
            except subprocess.TimeoutExpired:
                return None, False, said
        if elapsed > timeout or ("loaded" not in said and elapsed > load_timeout):
            return None, True, said


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _decide(said, code, timed_out: bool, timeout: float, args) -> int:
    if "verdict" in said:
        return int(said[said.index("verdict") + 1])
    where = f"--policy {args.policy}"
    if "loaded" not in said:
        if timed_out:
            print(f"error: {where}: loading it did not finish within {timeout:.0f} s (an endless "
                  f"loop at import?)", file=sys.stderr)
        else:
            print(f"error: {where}: loading it ended the process (exit code {code}) before it "
                  f"finished: the module exits at import (os._exit, sys.exit) or crashed",
                  file=sys.stderr)
        return BAD_INPUT
    what = (f"[slow rule] a call into {args.policy} did not return within {timeout:.0f} s "
            f"(--timeout)" if timed_out else
            f"[rule crashed] {args.policy} ended the process (exit code {code}) while the replay "
            f"ran it (os._exit, a signal, a crash)")
    print(f"{what}\nworld: {args.world}", flush=True)
    return VIOLATED


if __name__ == "__main__":
    sys.exit(main())
