"""``a2a-gate bisect --good REV --bad REV [--repo PATH] [--engine sglang|vllm] [-- PYTEST ARGS]``:
the first commit of an engine's git history at which the gate fails.

It runs the gate at ``--bad`` first (it must fail there) and keeps the shrunk counterexample
that failure printed; then ``git bisect run`` judges each commit: the counterexample is
replayed first (seconds: a commit that fails it is bad), and only a commit that passes it runs
the gate (its exit 0 good, 1 bad). A commit where the engine's dispatcher file is missing or
does not load is skipped (125). The result names the first bad commit, the failing test, the
shrunk world and its replay line. The checkout is left as it was found (``git bisect reset``,
also on Ctrl-C or an error); it must have no uncommitted changes to tracked files.

The gate run at each commit is, unless PYTEST ARGS say otherwise, the engine's own tier and the
property tests (``DEFAULT_PARTS``) under ``HYPOTHESIS_PROFILE=ci`` (derandomized, so every
commit is judged on the same examples).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

__all__ = ["main", "DEFAULT_PARTS", "GOOD", "BAD", "SKIP"]

GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's codes
DEFAULT_PARTS = {"sglang": ("sglang/test_engine_steps.py", "cpu/test_sizing_properties.py"),
                 "vllm": ("vllm/test_engine.py", "cpu/test_sizing_properties.py")}
STEP_TIMEOUT_S = 1800  # one commit's gate run
_REPLAY = re.compile(r"^\s*(?:E\s+)?replay: (python -m dispatcher .*)$", re.M)
_FAILED = re.compile(r"^FAILED (\S+)", re.M)


class BisectError(Exception):
    """Bad input: not a git checkout, unknown revisions, uncommitted changes, nothing to find."""


def _git(repo: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    if check and done.returncode:
        raise BisectError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def _engine_of(repo: Path) -> str:
    from .sglang.fetch import PACKAGE as SGLANG
    from .vllm.fetch import PACKAGE as VLLM
    from .wheels import ReleaseError

    for name, package in (("sglang", SGLANG), ("vllm", VLLM)):
        try:
            package.checkout_file(repo)
            return name
        except ReleaseError:
            continue
    raise BisectError(f"{repo}: no SGLang or vLLM dispatcher file at HEAD; name the engine "
                      f"with --engine")


def _gate(repo: Path, engine: str, pytest_args: List[str], log: Path) -> int:
    """The gate on the checkout as it is now: 0 passes, 1 fails, SKIP cannot judge."""
    from .cli import suite_args

    selection = suite_args() + pytest_args if pytest_args else suite_args(DEFAULT_PARTS[engine])
    cmd = [sys.executable, "-m", "pytest", *selection, "-x", "-q", "-p", "no:cacheprovider",
           f"--policy={engine}:{repo}"]
    env = dict(os.environ)
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    with open(log, "w") as out:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=STEP_TIMEOUT_S, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[bisect] the gate ran over {STEP_TIMEOUT_S} s: skipped\n")
            return SKIP
    if code in (GOOD, BAD):
        return code
    return SKIP  # a usage error (the file does not load), an internal error, no tests


def _replay(replay_line: str, engine: str, repo: Path) -> int:
    """The known counterexample on this commit's file: BAD if it still fails, else GOOD."""
    words = shlex.split(replay_line)[3:]  # after "python -m dispatcher"
    if "--policy" in words:  # judge this commit's file, whatever the line was recorded on
        words[words.index("--policy") + 1] = f"{engine}:{repo}"
    done = subprocess.run([sys.executable, "-m", "dispatcher", *words], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    return BAD if done.returncode == 1 else GOOD


def step(repo: Path, engine: str, pytest_args: List[str], logs: Path) -> int:
    """One commit's verdict for ``git bisect run``."""
    from .policies import PolicyError, load_policy, probe_policy

    sha = _git(repo, "rev-parse", "HEAD")
    log = logs / f"{sha}.log"
    spec = f"{engine}:{repo}"
    try:
        probe_policy(spec)
        load_policy(spec)
    except PolicyError as exc:
        log.write_text(f"[bisect] skipped: {exc}\n")
        return SKIP
    known = logs / "replay.txt"
    if known.is_file() and _replay(known.read_text().strip(), engine, repo) == BAD:
        log.write_text(f"[bisect] the known counterexample fails here:\n{known.read_text()}")
        return BAD
    return _gate(repo, engine, pytest_args, log)


def _summary(log: Path) -> str:
    text = log.read_text() if log.is_file() else ""
    failed = _FAILED.findall(text)
    replay = _REPLAY.findall(text)
    world = re.search(r"^E?\s*world:\n((?:E?\s{2,}.*\n){1,12})", text, re.M)
    lines = []
    if failed:
        lines.append(f"failing test: {failed[0]}")
    if world:
        block = [re.sub(r"^E? {0,10}", "  ", line) for line in world.group(1).rstrip().splitlines()]
        lines.append("shrunk world:\n" + "\n".join(block))
    if replay:
        lines.append(f"replay: {replay[0]}")
    return "\n".join(lines) or text[-2000:]


def bisect(repo: Path, good: str, bad: str, engine: Optional[str], pytest_args: List[str]) -> str:
    top = Path(_git(repo, "rev-parse", "--show-toplevel"))
    if _git(top, "status", "--porcelain", "--untracked-files=no"):
        raise BisectError(f"{top} has uncommitted changes to tracked files: commit or stash "
                          f"them first (bisect checks out other commits)")
    good_sha = _git(top, "rev-parse", "--verify", f"{good}^{{commit}}")
    bad_sha = _git(top, "rev-parse", "--verify", f"{bad}^{{commit}}")
    original = _git(top, "symbolic-ref", "-q", "--short", "HEAD", check=False) or \
        _git(top, "rev-parse", "HEAD")
    logs = Path(tempfile.mkdtemp(prefix="a2a-gate-bisect-"))
    try:
        _git(top, "checkout", "-q", bad_sha)
        engine = engine or _engine_of(top)
        first = step(top, engine, pytest_args, logs)
        if first != BAD:
            raise BisectError(f"the gate does not fail at --bad {bad} "
                              f"({'passes' if first == GOOD else 'cannot judge it'}; log: "
                              f"{logs / (bad_sha + '.log')}): nothing to bisect")
        replay = _REPLAY.findall((logs / f"{bad_sha}.log").read_text())
        if replay:
            (logs / "replay.txt").write_text(replay[0] + "\n")
        _git(top, "bisect", "start", bad_sha, good_sha)
        cmd = [sys.executable, "-m", "dispatcher.bisect", "--step", "--repo", str(top),
               "--engine", engine, "--logs", str(logs), "--", *pytest_args]
        done = subprocess.run(["git", "-C", str(top), "bisect", "run", *cmd], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
        found = re.search(r"^([0-9a-f]{40}) is the first bad commit", done.stdout, re.M)
        if not found:
            raise BisectError("git bisect found no single first bad commit:\n"
                              + (done.stdout + done.stderr)[-3000:])
        sha = found.group(1)
        subject = _git(top, "log", "-1", "--format=%h %s", sha)
        log = logs / f"{sha}.log"
        if "known counterexample fails here" in (log.read_text() if log.is_file() else ""):
            log = logs / f"{bad_sha}.log"  # the full failure was recorded at --bad
        return f"first bad commit: {subject} ({sha})\n{_summary(log)}\nlogs: {logs}"
    finally:
        _git(top, "bisect", "reset", check=False)
        _git(top, "checkout", "-q", original, check=False)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="a2a-gate bisect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--good", help="a commit where the gate passes")
    parser.add_argument("--bad", help="a commit where the gate fails")
    parser.add_argument("--repo", default=".", help="the engine's git checkout (default: .)")
    parser.add_argument("--engine", choices=("sglang", "vllm"), help="default: from the files")
    parser.add_argument("--step", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--logs", help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    repo = Path(args.repo).resolve()
    if args.step:
        return step(repo, args.engine, pytest_args, Path(args.logs))
    if not (args.good and args.bad):
        parser.error("--good and --bad are required")
    try:
        print(bisect(repo, args.good, args.bad, args.engine, pytest_args))
    except BisectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the checkout is back where it was", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
