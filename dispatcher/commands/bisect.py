"""``a2a-gate bisect --good REV --bad REV [--repo PATH] [--engine sglang|vllm] [-- PYTEST ARGS]``:
the first commit of an engine's git history at which the gate fails.

Everything happens in a worktree of its own (``git worktree add --detach`` in a temporary
folder, removed at the end, also on Ctrl-C, SIGTERM or an error): the user's checkout, its
uncommitted and ignored files and any ``git bisect`` the user has in progress are never
touched. Bad input (not a git checkout, an unknown revision, ``--good`` not an ancestor of
``--bad``) is refused before any gate run.

1. The gate runs at ``--bad`` (it must fail there); the shrunk counterexample its failure
   printed is kept. With ``--replay LINE`` (a failing run's replay line) that counterexample
   judges ``--bad`` instead, in seconds.
2. ``--good`` is checked by replaying that counterexample: if it fails there too, ``--good`` is
   not good and nothing is bisected.
3. ``git bisect`` (in the worktree) picks commits; each is judged by the counterexample first
   (one short process: a commit that fails it is bad) and, only if it passes, by the gate
   (exit 0 good, 1 bad). A commit where the engine's file is missing or does not load, or
   whose judge ends without a verdict or runs over its time, is skipped.

The result names the first bad commit, the failing test, the shrunk world and its replay line.
The gate run at each commit is, unless PYTEST ARGS say otherwise, the engine's own tier and the
property tests (``DEFAULT_PARTS``) under ``HYPOTHESIS_PROFILE=ci`` (derandomized, so every
commit is judged on the same examples).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from ..engines import ENGINES
from ..sandbox.procs import OutputFlood, alive, child_env, python_child, run_bounded
from .runner import suite_args

__all__ = ["main", "bisect", "BisectError", "GateJudge", "Verdict", "PROPERTIES", "GOOD",
           "BAD", "SKIP", "repointed", "remove_stale_worktrees"]

GOOD, BAD, SKIP = "good", "bad", "skip"  # what ``git bisect`` is told about a commit
PROPERTIES = ("cpu/test_sizing_properties.py",)
STEP_TIMEOUT_S = 1800  # one commit's gate run
REPLAY_TIMEOUT_S = 300  # one commit's replay of the counterexample
_REPLAY = re.compile(r"^\s*(?:E\s+)?replay: (python -m dispatcher .*)$", re.M)
_FAILED = re.compile(r"^FAILED (\S+)", re.M)


class BisectError(Exception):
    """Bad input or nothing to bisect: said in one line, exit 2."""


@dataclass(frozen=True)
class Verdict:
    """A commit's verdict, what decided it and where its log is."""

    word: str  # GOOD, BAD or SKIP
    why: str
    log: Optional[Path] = None


# (worktree at the commit, replay line, replay only): ``--good`` is judged by the replay alone
Judge = Callable[[Path, Optional[str], bool], Verdict]


def _git(repo: Path, *args: str, check: bool = True, timeout: float = 600) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode:
        raise BisectError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def _engine_of(tree: Path) -> str:
    for engine in ENGINES.values():
        try:
            engine.package().checkout_file(tree)
            return engine.name
        except ValueError:
            continue
    raise BisectError(f"{tree}: no SGLang or vLLM dispatcher file at --bad; name the engine "
                      f"with --engine")


class GateJudge:
    """The real judge: the counterexample replayed, then the gate, each in its own process
    with a time limit, on the engine's file in the worktree."""

    def __init__(self, engine: str, pytest_args: List[str], logs: Path):
        self.engine, self.pytest_args, self.logs = engine, pytest_args, logs

    def _env(self) -> dict:
        env = child_env()
        env.setdefault("HYPOTHESIS_PROFILE", "ci")
        return env

    def spec(self, tree: Path) -> str:
        """What this commit is gated as: the tree (``engine:TREE``), or, where the history
        holds the engine's dispatcher file and no other Python file of the engine, that file
        alone, judged with its release's code as a lone file is (``engine:FILE``, a copy of
        this commit's file outside the tree, which would be read as a checkout's)."""
        package = ENGINES[self.engine].package()
        try:
            main = package.checkout_file(tree)
        except ValueError:
            return f"{self.engine}:{tree}"  # the loader says what is missing
        others = (p for p in tree.rglob("*.py")
                  if p != main and p.name != "__init__.py" and ".git" not in p.parts)
        if next(others, None):
            return f"{self.engine}:{tree}"
        lone = tree.parent / "lone" / main.name
        lone.parent.mkdir(exist_ok=True)
        shutil.copyfile(main, lone)
        return f"{self.engine}:{lone}"

    def replay(self, tree: Path, line: str, log: Path) -> Verdict:
        """The known counterexample on this commit's file: BAD if it fails, GOOD if it holds,
        SKIP if the file does not load or the replay ends without a verdict."""
        words = repointed(shlex.split(line)[3:], self.spec(tree))  # after "python -m dispatcher"
        return self._judged(["dispatcher", *words], REPLAY_TIMEOUT_S, log, {
            BAD: "the known counterexample fails here",
            GOOD: "the known counterexample holds here"}, "the replay gave no verdict")

    def gate(self, tree: Path, log: Path) -> Verdict:
        """The gate on the worktree as it is now."""
        quiet = ["-x", "-q", "-p", "no:cacheprovider"]  # (suite_args leaves cache_dir out)
        selection = (suite_args(args=[*self.pytest_args, *quiet]) if self.pytest_args
                     else suite_args(ENGINES[self.engine].bisect_parts + PROPERTIES, quiet))
        return self._judged(["pytest", *selection,
                             f"--policy={self.spec(tree)}"], STEP_TIMEOUT_S, log,
                            {BAD: "the gate fails", GOOD: "the gate passes"},
                            f"the gate could not judge it (the file does not load, no tests, an "
                            f"internal error or over {STEP_TIMEOUT_S} s)")

    def _judged(self, module_and_args, timeout: float, log: Path, said: dict,
                otherwise: str) -> Verdict:
        """Run ``python -m MODULE ARGS`` (exit 0 good, 1 bad, anything else skipped)."""
        cmd = python_child(*module_and_args)
        code, out = _run(cmd, self._env(), timeout)
        log.write_text(f"$ python -m {shlex.join(module_and_args)}\n{out}")
        word = {0: GOOD, 1: BAD}.get(code)
        if word is None:
            return Verdict(SKIP, f"{otherwise} (exit {code})", log)
        return Verdict(word, said[word], log)

    def __call__(self, tree: Path, replay: Optional[str], replay_only: bool = False) -> Verdict:
        sha = _git(tree, "rev-parse", "HEAD")
        if replay:
            first = self.replay(tree, replay, self.logs / f"{sha}.replay.log")
            if first.word != GOOD or replay_only:
                return first
        return self.gate(tree, self.logs / f"{sha}.log")


def repointed(words: List[str], spec: str) -> List[str]:
    """A replay's arguments with its policy, written ``--policy X`` or ``--policy=X``, set to
    ``spec`` (this commit's file, whatever the line was recorded on)."""
    out, skip = [], False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word == "--policy" and i + 1 < len(words):
            out += ["--policy", spec]
            skip = True
        elif word.startswith("--policy="):
            out.append(f"--policy={spec}")
        else:
            out.append(word)
    return out


def _run(cmd: List[str], env: dict, timeout: float):
    """(exit code or None past ``timeout``, output), the process and what it started killed
    at the end (``procs.run_bounded``)."""
    try:
        code, out = run_bounded(cmd, env, timeout)
    except OutputFlood as exc:  # no verdict at this commit, like a run past its time
        return None, f"[bisect] {exc}\n"
    return code, out if code is not None else f"{out}\n[bisect] over {timeout:.0f} s: stopped\n"


def _summary(verdict: Verdict) -> str:
    text = verdict.log.read_text() if verdict.log and verdict.log.is_file() else ""
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


class _Stopped(BaseException):
    """SIGTERM (a CI job cancelled): unwound like Ctrl-C, so the worktree is removed."""


_PREFIX = "a2a-gate-bisect-"
_OWNER = "owner.pid"  # beside the worktree: the bisect that made it


def remove_stale_worktrees(repo: Path) -> List[Path]:
    """Worktrees of ``repo`` that an earlier bisect made and could not remove (it was killed
    with SIGKILL): unregistered and deleted; a running bisect's are left alone."""
    listing = _git(repo, "worktree", "list", "--porcelain", check=False)
    gone = []
    for line in listing.splitlines():
        if not line.startswith("worktree "):
            continue
        tree = Path(line[len("worktree "):])
        folder = tree.parent
        if not folder.name.startswith(_PREFIX) or tree.name != "tree":
            continue
        try:
            owner = int((folder / _OWNER).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and alive(owner):
            continue
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(folder, ignore_errors=True)
        gone.append(tree)
    _git(repo, "worktree", "prune", check=False)
    return gone


@contextmanager
def _worktree(repo: Path, commit: str):
    """A detached worktree of ``repo`` at ``commit`` in a temporary folder, removed (with its
    bisect state) however the block ends; SIGTERM unwinds the block too. One that a killed
    bisect left is removed first (``remove_stale_worktrees``)."""
    remove_stale_worktrees(repo)
    folder = Path(tempfile.mkdtemp(prefix=_PREFIX))
    (folder / _OWNER).write_text(str(os.getpid()))
    tree = folder / "tree"

    def stop(signum, frame):
        raise _Stopped()
    previous = signal.signal(signal.SIGTERM, stop) if _main_thread() else None
    try:
        _git(repo, "worktree", "add", "-q", "--detach", str(tree), commit)
        yield tree, folder
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(folder, ignore_errors=True)
        _git(repo, "worktree", "prune", check=False)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _checked_input(repo: Path, good: str, bad: str):
    """(toplevel, good sha, bad sha), or a ``BisectError`` before any gate run."""
    if not repo.is_dir():
        raise BisectError(f"--repo {repo}: no such folder")
    top = Path(_git(repo, "rev-parse", "--show-toplevel"))
    shas = []
    for flag, rev in (("--good", good), ("--bad", bad)):
        done = subprocess.run(["git", "-C", str(top), "rev-parse", "--verify", "-q",
                               f"{rev}^{{commit}}"], capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise BisectError(f"{flag} {rev}: no such commit in {top}")
        shas.append(done.stdout.strip())
    good_sha, bad_sha = shas
    if good_sha == bad_sha:
        raise BisectError(f"--good and --bad are the same commit ({good_sha[:12]})")
    if subprocess.run(["git", "-C", str(top), "merge-base", "--is-ancestor", good_sha, bad_sha],
                      capture_output=True, timeout=60).returncode:
        raise BisectError(f"--good {good} is not an ancestor of --bad {bad}: nothing to bisect "
                          f"between them")
    return top, good_sha, bad_sha


def bisect(repo: Path, good: str, bad: str, engine: Optional[str], pytest_args: List[str],
           judge: Optional[Judge] = None, logs: Optional[Path] = None,
           replay: Optional[str] = None) -> str:
    """The report of the first bad commit between ``good`` and ``bad`` (``BisectError`` on bad
    input or when there is nothing to find). ``judge``: the real gate unless given.
    ``replay``: a counterexample already known (a failing run's replay line): ``--bad`` is
    judged by it instead of by a gate run."""
    if replay is not None and not _REPLAY.match(f"replay: {replay}"):
        raise BisectError(f"--replay {replay!r}: not a replay line (python -m dispatcher ...)")
    top, good_sha, bad_sha = _checked_input(repo, good, bad)
    logs = logs or Path(tempfile.mkdtemp(prefix="a2a-gate-bisect-logs-"))
    with _worktree(top, bad_sha) as (tree, _):
        engine = engine or _engine_of(tree)
        judge = judge or GateJudge(engine, pytest_args, logs)
        at_bad = judge(tree, replay, replay is not None)
        if at_bad.word != BAD:
            raise BisectError(f"the {'counterexample' if replay else 'gate'} does not fail at "
                              f"--bad {bad} ({at_bad.why}; log: {at_bad.log}): nothing to bisect")
        if replay is None:
            found = (_REPLAY.findall(at_bad.log.read_text())
                     if at_bad.log and at_bad.log.is_file() else [])
            replay = found[0] if found else None
        _git(tree, "checkout", "-q", "--detach", good_sha)
        at_good = judge(tree, replay, True)
        if at_good.word != GOOD:
            raise BisectError(f"--good {good} is not good: {at_good.why} (log: {at_good.log}); "
                              f"pick an older --good")
        out = _git(tree, "bisect", "start", bad_sha, good_sha)
        judged = {}
        try:
            for _ in range(int(_git(tree, "rev-list", "--count", f"{good_sha}..{bad_sha}")) + 2):
                first = re.search(r"^([0-9a-f]{40}) is the first bad commit", out, re.M)
                if first:
                    sha = first.group(1)
                    subject = _git(tree, "log", "-1", "--format=%h %s", sha)
                    verdict = at_bad if sha == bad_sha else judged.get(sha, at_bad)
                    if verdict.why == "the known counterexample fails here":
                        verdict = at_bad  # the full failure was recorded at --bad
                    return f"first bad commit: {subject} ({sha})\n{_summary(verdict)}\nlogs: {logs}"
                if "only 'skip'ped commits left" in out:
                    raise BisectError("git bisect cannot tell which commit is first: only "
                                      "skipped commits are left\n" + out[-3000:])
                sha = _git(tree, "rev-parse", "HEAD")
                verdict = judged[sha] = judge(tree, replay, False)
                out = _git(tree, "bisect", verdict.word)
            raise BisectError("git bisect did not end:\n" + out[-3000:])
        finally:
            _git(tree, "bisect", "reset", check=False)


def _checked_options(args) -> Optional[Path]:
    """Every option checked before any work (no worktree made, nothing fetched): the logs
    folder made (returned), the replay line a replay command whose world parses; else a
    ``BisectError`` naming the option."""
    if args.replay is not None:
        import contextlib
        import io
        import shlex

        from ..__main__ import parser as replay_parser
        from ..model.parse import BadWorld, parse_sequence, parse_world

        if not _REPLAY.match(f"replay: {args.replay}"):
            raise BisectError(f"--replay {args.replay[:200]!r}: not a replay line "
                              f"(python -m dispatcher ...)")
        try:
            words = shlex.split(args.replay)[3:]
        except ValueError as exc:
            raise BisectError(f"--replay: not a command line ({exc})") from None
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # its usage text is not ours
                parsed = replay_parser().parse_args(words)
        except SystemExit:
            raise BisectError(f"--replay {args.replay[:200]!r}: python -m dispatcher does not "
                              f"take these arguments") from None
        try:
            text = parsed.world.strip()
            (parse_sequence if text.startswith(("(", "[")) else parse_world)(text)
        except (BadWorld, ValueError) as exc:
            raise BisectError(f"--replay: its world does not parse ({exc})") from None
    if not args.logs:
        return None
    logs = Path(args.logs).resolve()
    try:
        logs.mkdir(parents=True, exist_ok=True)
        probe = logs / ".a2a-gate-bisect-probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise BisectError(f"--logs {args.logs}: not a folder the logs can be written to "
                          f"({exc.strerror or exc})") from None
    return logs


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="a2a-gate bisect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--good", required=True, help="a commit where the gate passes")
    parser.add_argument("--bad", required=True, help="a commit where the gate fails")
    parser.add_argument("--repo", default=".", help="the engine's git checkout (default: .)")
    parser.add_argument("--engine", choices=sorted(ENGINES), help="default: from the files")
    parser.add_argument("--logs", metavar="DIR", help="where each commit's log is kept "
                                                        "(default: a new folder in the temp dir)")
    parser.add_argument("--replay", metavar="LINE",
                        help="a failing run's replay line (python -m dispatcher ...): --bad is "
                             "judged by it, without a gate run")
    args = parser.parse_args(own)  # exits 2 on bad arguments
    try:
        logs = _checked_options(args)
        print(bisect(Path(args.repo).resolve(), args.good, args.bad, args.engine, pytest_args,
                     replay=args.replay, logs=logs))
    except BisectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Stopped):
        print("stopped: the worktree is removed; your checkout was never touched", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
