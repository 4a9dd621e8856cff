"""``a2a-gate watch --policy=SPEC [PYTEST ARGS...]``: a verdict on every save.

Warm test processes stay up between runs (``watch_workers``: one per CPU, or ``--workers N``;
torch, Hypothesis, the suite's modules and the plugin imported once). Each time a file the
policy reads changes, the checks of that policy run again across them, side by side (``-x``:
the first counterexample ends the run and is printed at once). A verdict is never stale:

- the files are found again (after any change of one of them) and re-read and re-hashed
  before every run: an engine file or
  tree's dispatcher file and every file its own code comes from (``Tree.companions``, and
  vLLM's modules run beside it), a rule module's file (a package's: every file in it);
- the policy's processes are started afresh for every run (``supervised.forget_all``), and a
  rank pool a run takes was started after the last run, no policy code loaded in it: no code
  loaded from an earlier state answers;
- a save is judged once it is over (the hashes equal on two polls in a row), never half-written;
- a file that changes while a run reads it makes the verdict "of the files as they were" and
  the run starts again;
- each run's header says what was re-read (files, their hashes) and what was re-used.

It ends on Ctrl-C (exit 130) or after ``--idle-timeout-s`` without a change (exit status of
the last verdict), leaving no process behind: the test processes are asked to end (their
pools and policy processes closed) and killed where they do not.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "watched_files", "fingerprint", "watch", "WatchError"]

USAGE = ("usage: a2a-gate watch --policy=SPEC [--workers N|auto] [--runs N] [--poll-s S] "
         "[--idle-timeout-s S] [PYTEST ARGS...]")
INTERRUPTED = 130


class WatchError(ValueError):
    """The spec names nothing whose files can be watched."""


def _module_files(module: str) -> List[Path]:
    """The file of module ``module`` (a package: every ``.py`` under it), found on
    ``sys.path`` as Python would find it, without importing anything."""
    parts = module.split(".")
    spec = PathFinder.find_spec(parts[0], [str(Path.cwd()), *sys.path])
    for part in parts[1:]:
        if spec is None or not spec.submodule_search_locations:
            spec = None
            break
        spec = PathFinder.find_spec(f"{spec.name}.{part}", list(spec.submodule_search_locations))
    if spec is None:
        raise WatchError(f"--policy: no module {module!r} on the path (PYTHONPATH) to watch")
    if spec.submodule_search_locations:
        return sorted(p for d in spec.submodule_search_locations for p in Path(d).rglob("*.py"))
    if not spec.origin or not Path(spec.origin).is_file():
        raise WatchError(f"--policy: module {module!r} has no source file to watch")
    return [Path(spec.origin)]


def watched_files(spec: str) -> Tuple[Path, ...]:
    """Every file the policy ``spec`` reads, found (nothing of it run) as the gate finds it."""
    from ..engines import engine_of_spec
    from ..policies import NAMED

    engine = engine_of_spec(spec)
    if engine is None:
        if ":" not in spec:
            raise WatchError(f"--policy={spec}: " + (
                "the gate's own rule does not change: watch a rule module (MOD:callable) or an "
                "engine's file or tree" if spec in NAMED else "use module:callable or an "
                "engine's spec (sglang:PATH, vllm:PATH)"))
        return tuple(_module_files(spec.partition(":")[0]))
    try:
        tree = engine.module("loader").tree_of_spec(spec.partition(":")[2])
    except (ValueError, OSError) as exc:
        raise WatchError(f"--policy={spec}: {exc}") from None
    files = [tree.main, *(p for _, p in tree.companions.sources if p is not None)]
    beside = getattr(engine.module("fetch"), "RELEASE_MODULES", {})  # vLLM's modules run beside it
    if tree.root is not None:
        files += [tree.root / rel for rel in beside.values() if (tree.root / rel).is_file()]
    return tuple(sorted({Path(f).resolve() for f in files}))


def fingerprint(files: Sequence[Path]) -> Dict[Path, Optional[str]]:
    """Each file's sha256 as it reads now (``None``: gone or unreadable)."""
    out = {}
    for f in files:
        try:
            out[f] = hashlib.sha256(f.read_bytes()).hexdigest()
        except OSError:
            out[f] = None
    return out


@dataclass
class Options:
    runs: Optional[int] = None  # stop after this many verdicts (None: until Ctrl-C or idle)
    poll_s: float = 0.2
    idle_timeout_s: float = 3600.0
    workers: int = 0  # warm test processes (0: as ``-n auto`` would start for the policy)

    def processes(self, spec: str) -> int:
        from .runner import processes_for

        return self.workers or processes_for(spec, False, len(os.sched_getaffinity(0)) if hasattr(
            os, "sched_getaffinity") else (os.cpu_count() or 1))


def _parse(args: List[str]) -> Tuple[str, Options, List[str]]:
    opts, rest, spec = Options(), [], None
    it = iter(args)
    for a in it:
        name, eq, value = a.partition("=")
        if name in ("--policy", "--runs", "--poll-s", "--idle-timeout-s", "--workers"):
            if not eq:
                value = next(it, None)
                if value is None:
                    raise WatchError(f"{name} needs a value\n{USAGE}")
            try:
                if name == "--policy":
                    spec = value
                elif name == "--runs":
                    opts.runs = int(value)
                    if opts.runs < 1:
                        raise ValueError
                elif name == "--workers":
                    opts.workers = 0 if value == "auto" else int(value)
                    if not 0 <= opts.workers <= 256:
                        raise ValueError
                elif name == "--poll-s":
                    opts.poll_s = float(value)
                    if not 0.01 <= opts.poll_s <= 60:
                        raise ValueError
                else:
                    opts.idle_timeout_s = float(value)
                    if not 0 < opts.idle_timeout_s <= 7 * 86400:
                        raise ValueError
            except ValueError:
                raise WatchError(f"{name}={value}: out of range\n{USAGE}") from None
        elif name in ("-n", "--numprocesses") or a.startswith("-n"):
            raise WatchError("watch keeps its own warm test processes (xdist workers would "
                             f"start again on every run): leave -n out, use --workers\n{USAGE}")
        else:
            rest.append(a)
    if not spec:
        raise WatchError(f"--policy=SPEC names what to watch\n{USAGE}")
    return spec, opts, rest


SETTLE_POLLS = 25  # a save still being written after this many polls is run as it reads


def _settled(files, prints, opts: Options, sleep) -> Dict[Path, Optional[str]]:
    """The files' hashes once a save is over: equal on two polls in a row (an editor that
    truncates then writes shows an empty file first; that state is never judged)."""
    for _ in range(SETTLE_POLLS):
        sleep(opts.poll_s)
        now = fingerprint(files)
        if now == prints:
            return now
        prints = now
    return prints


def _short(prints: Dict[Path, Optional[str]]) -> str:
    return ", ".join(f"{p.name} {h[:12] if h else '(missing)'}" for p, h in prints.items())


REUSED = ("re-used: {n} warm test processes (torch, Hypothesis, the suite's modules; the "
          "pools, GPU driver and policy processes they started after the last run, no policy "
          "code read or run in them); loaded fresh: the policy, in each of its processes")


def watch(spec: str, args: Sequence[str], opts: Options,
          run: Optional[Callable[[str, Sequence[str]], int]] = None,
          say: Callable[[str], None] = print, clock=time.monotonic, sleep=time.sleep) -> int:
    """Run the checks of ``spec`` now and on every change of a file it reads; the exit status
    of the last verdict (``INTERRUPTED`` on Ctrl-C). ``run``: one run's verdict (by default
    across ``opts.processes(spec)`` warm test processes, ``watch_workers``)."""
    workers = None
    if run is None:
        from .watch_workers import Workers

        workers = Workers(opts.processes(spec), say)
        run = workers.run
    try:
        code = _watch(spec, args, opts, run, say, clock, sleep,
                      REUSED.format(n=workers.count) if workers else "re-used: this process",
                      idle=workers.late if workers else lambda: None)
        if workers is not None and code != INTERRUPTED:
            workers.finish()  # the last verdict's counterexample, shrunk
        return code
    finally:
        if workers is not None:
            workers.close()


def _watch(spec, args, opts, run, say, clock, sleep, reused: str, idle) -> int:
    last, verdicts, code, idle_since, refused, files = None, 0, 0, None, None, ()
    try:
        while True:
            # Idle while the files found last read as they did (hashing them is cheap). Where
            # one changed they are found again (following the tree's imports costs ~50 ms): only
            # an edit of one of them can lead the imports elsewhere.
            prints = fingerprint(files) if last is not None else None
            if prints is None or prints != last:
                try:
                    files = watched_files(spec)
                except WatchError as exc:  # mid-save, or an edit that names nothing: wait
                    if str(exc) != refused:
                        say(f"watch: {exc}: waiting for the next change")
                    refused, last = str(exc), None
                    sleep(opts.poll_s)
                    continue
                refused = None
                prints = fingerprint(files)
            if prints == last:
                idle_since = clock() if idle_since is None else idle_since
                if clock() - idle_since > opts.idle_timeout_s:
                    say(f"watch: no change in {opts.idle_timeout_s:g} s: stopping")
                    return code
                idle()  # a shrunk counterexample, once ready
                sleep(opts.poll_s)
                continue
            idle_since = None
            prints = _settled(files, prints, opts, sleep)
            say(f"watch: run {verdicts + 1} of {spec}: re-read {len(files)} files "
                f"({_short(prints)}); {reused}")
            t0 = clock()
            code = run(spec, args)
            took = clock() - t0
            after = fingerprint(files)
            verdicts += 1
            word = "pass" if code == 0 else "FAIL" if code == 1 else f"exit {code}"
            if after != prints:
                say(f"watch: verdict {word} of the files as they were at the run's start; "
                    f"{_short({p: h for p, h in after.items() if prints.get(p) != h})} changed "
                    f"during the run: running again")
                last = None
            else:
                say(f"watch: verdict {word} in {took:.1f} s (exit {code})")
                last = prints
            if opts.runs is not None and verdicts >= opts.runs:
                return code
    except KeyboardInterrupt as exc:
        say(f"watch: stopped ({str(exc) or 'Ctrl-C'})")
        return INTERRUPTED


def main(args: List[str]) -> int:
    try:
        spec, opts, rest = _parse(list(args))
        watched_files(spec)  # a spec that names nothing is refused before any run
    except WatchError as exc:
        print(f"a2a-gate watch: {exc}", file=sys.stderr)
        return 2
    _stop_on_sigterm()
    return watch(spec, rest, opts, say=lambda line: print(line, flush=True))


def _stop_on_sigterm() -> None:
    """SIGTERM (a terminal closed, a job cancelled) stops the watch as Ctrl-C does: its test
    processes, the zygote and its folders go with it (the default action left them behind)."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, stop)
