"""Time the gate the way users run it, side by side in one sitting, and write the figures.

    python benchmarks/suite_wall.py --runs 3 --out benchmarks/suite_wall_cpu.json
    python benchmarks/suite_wall.py --runs 3 --profile gpu --out F -- --require-gpus   # a GPU runner

Scenarios, each ``HYPOTHESIS_PROFILE=<profile> pytest -n auto -q -rf -p no:cacheprovider`` from
the repository root in a fresh process (plus the pytest arguments after ``--``):

- ``whole``: the whole suite (the gate's own self-checks included), as CI and a plain
  ``pytest -n auto`` in this repository run it;
- ``gate-sglang-file``: ``--policy=sglang:FILE``, a user's edit of the newest pinned SGLang
  dispatcher file that changes nothing (a comment): what gating a change costs (the gate's
  self-checks are deselected there, every check of the file runs);
- ``verdict-wrong-rule``, ``verdict-wrong-sglang-file``: ``-x --policy=prefix_rule`` and ``-x
  --policy=sglang:FILE`` with ``min`` for ``max`` in the sizing: time until the gate says no
  (every run must fail).

- ``watch-sglang-file``: ``a2a-gate watch --policy=sglang:FILE`` on a copy of that file, one
  process for all runs: each run saves the wrong edit and times the verdict (every one must
  fail: the first failing example, as found) and the shrunk counterexample that follows, then
  saves the harmless file back and times the verdict (every one must pass); from the save to
  the line, the watch's poll included. Its first, cold verdict is kept too.

For ``whole`` and ``gate-sglang-file`` the critical path is kept from each run (a timeline
plugin, ``suite_timeline.py``): the longest test and the busiest xdist worker (its tests' wall
time summed). Figures: the median wall time with min and max; every run's pytest summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FAILS = (1, 2)  # a failed test: 1, or 2 where -x stopped the run at it (xdist: "Interrupted")
MIN_FOR_MAX = ("max_dp_tokens = max(dp_global_num_tokens)", "max_dp_tokens = min(dp_global_num_tokens)")


def sglang_files(folder: Path) -> dict:
    """A harmless edit (a comment) and a wrong one (min for max) of the newest release's file."""
    from dispatcher.sglang import fetch
    from dispatcher.sglang.sources import RELEASES

    text = fetch.fetch_release(RELEASES[-1]).read_text()
    assert text.count(MIN_FOR_MAX[0]) == 1
    out = {}
    for name, edited in (("harmless", text + "\n# a comment: changes nothing\n"),
                         ("wrong", text.replace(*MIN_FOR_MAX))):
        path = folder / name / "flashinfer.py"
        path.parent.mkdir(parents=True)
        path.write_text(edited)
        out[name] = path
    return out


def critical_path(timeline: Path) -> dict:
    """The longest test, the busiest worker, and how long before the first test started and
    after the last one ended (from the session's configure to its unconfigure)."""
    lines = [json.loads(line) for f in timeline.glob("*.jsonl") for line in f.read_text().splitlines()]
    rows = [r for r in lines if "test" in r]
    if not rows:
        return {}
    tests, busy = {}, {}
    for r in rows:
        tests[r["test"]] = tests.get(r["test"], 0.0) + r["duration"]
        busy[r["worker"]] = busy.get(r["worker"], 0.0) + r["duration"]
    longest, worker = max(tests, key=tests.get), max(busy, key=busy.get)
    out = {"longest_test": longest, "longest_test_s": round(tests[longest], 2),
           "busiest_worker": worker, "busiest_worker_s": round(busy[worker], 1),
           "workers": len(busy), "tests_s_summed": round(sum(busy.values()), 1)}
    events = {r["event"]: r["time"] for r in lines if "event" in r and r["event"] != "collected"}
    collected = [r["time"] for r in lines if r.get("event") == "collected"]
    starts = [r["start"] for r in rows if r.get("start")]
    stops = [r["stop"] for r in rows if r.get("stop")]
    if "configure" in events and starts:
        out["before_first_test_s"] = round(min(starts) - events["configure"], 1)
        if collected:
            out["last_worker_collected_s"] = round(max(collected) - events["configure"], 1)
    if "unconfigure" in events and stops:
        out["after_last_test_s"] = round(events["unconfigure"] - max(stops), 1)
    return out


def one_run(profile: str, args: list, timeout: float, log: Path = None) -> dict:
    with tempfile.TemporaryDirectory() as timeline:
        env = {**os.environ, "HYPOTHESIS_PROFILE": profile, "A2A_GATE_TIMELINE_DIR": timeline,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),
                                                          os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "pytest", "-n", "auto", "-q", "-rf", "-p", "no:cacheprovider",
               "-p", "suite_timeline", *args]
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        wall = time.perf_counter() - t
        path = critical_path(Path(timeline))
        if log is not None and (Path(timeline) / "timeline.jsonl").is_file():
            (log.parent / (log.stem + ".timeline.jsonl")).write_text(
                (Path(timeline) / "timeline.jsonl").read_text())
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith("FAILED ")]
    return {"wall_s": round(wall, 1), "exit": done.returncode, "summary": lines[-1] if lines else "",
            **({"critical_path": path} if path else {}), **({"failed": failed[:5]} if failed else {})}


def watch_runs(profile: str, files: dict, runs: int, timeout: float, log: Path = None,
               args: tuple = ()) -> dict:
    """One ``a2a-gate watch`` process: the cold first verdict, then per run the wrong save's and
    the revert's time to verdict."""
    import select

    target = files["harmless"].parent.parent / "watched" / "flashinfer.py"
    target.parent.mkdir(exist_ok=True)
    harmless, wrong = files["harmless"].read_text(), files["wrong"].read_text()
    target.write_text(harmless)
    env = {**os.environ, "HYPOTHESIS_PROFILE": profile, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher.commands.cli", "watch",
                             f"--policy=sglang:{target}", "-q", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
    # unbuffered: a readline never takes more than its line, so select() sees every line after it
    out = []

    def line_after(since: float, starts: str, has: str = ""):
        end = since + timeout
        while time.perf_counter() < end:
            if select.select([proc.stdout], [], [], 0.1)[0]:
                line = proc.stdout.readline().decode("utf-8", "replace")
                if not line:
                    break
                out.append(line)
                if line.startswith(starts) and has in line:
                    return round(time.perf_counter() - since, 1), line
        raise RuntimeError(f"no {starts!r} line in time:\n" + "".join(out[-40:]))

    def verdict(since: float):
        took, line = line_after(since, "watch: verdict")
        return took, line.split()[2]
    try:
        cold = verdict(time.perf_counter())
        rounds, shrunk = [], []
        for _ in range(runs):
            for text in (wrong, harmless):
                time.sleep(0.5)  # a save after the watch is back to waiting
                t = time.perf_counter()
                target.write_text(text)
                rounds.append(verdict(t))
                if text is wrong and rounds[-1][1] == "FAIL":  # its shrunk form, then the revert
                    shrunk.append(line_after(t, "FAILED ", "shrunk")[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if log is not None:
        log.write_text("".join(out))
    return {"cold_first_verdict": cold, "wrong_save": [r for r in rounds[0::2]],
            "wrong_save_shrunk_s": shrunk, "revert": [r for r in rounds[1::2]],
            # each passing run's summary: its longest unit and busiest process (where it went)
            "passes": [line.strip() for line in out if "warm test processes; the longest" in line]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--only", nargs="+", help="scenarios to run (default: all)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--log-dir", help="keep each run's whole pytest output here")
    ap.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    a = ap.parse_args()
    logs = Path(a.log_dir) if a.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = sglang_files(Path(tmp))
        scenarios = {
            "whole": ([], 0),
            "gate-sglang-file": ([f"--policy=sglang:{files['harmless']}"], 0),
            "verdict-wrong-rule": (["-x", "--policy=prefix_rule"], FAILS),
            "verdict-wrong-sglang-file": (["-x", f"--policy=sglang:{files['wrong']}"], FAILS),
        }
        figures = {"profile": a.profile, "pytest_args": a.pytest_args,
                   "machine": f"{os.cpu_count()} cores, {platform.machine()}, python "
                              f"{platform.python_version()}", "scenarios": {}}
        for name, (args, expect) in scenarios.items():
            if a.only and name not in a.only:
                continue
            runs = []
            for i in range(a.runs):
                runs.append(one_run(a.profile, args + a.pytest_args, a.timeout,
                                    logs / f"{name}-{i + 1}.log" if logs else None))
                print(f"{name} run {i + 1}: {runs[-1]['wall_s']} s exit {runs[-1]['exit']}  "
                      f"{runs[-1]['summary']}", flush=True)
            walls = [r["wall_s"] for r in runs]
            figures["scenarios"][name] = {
                "command": f"HYPOTHESIS_PROFILE={a.profile} pytest -n auto "
                           f"{' '.join(args + a.pytest_args)}".strip(),
                "expected_exit": expect, "median_wall_s": statistics.median(walls),
                "min_wall_s": min(walls), "max_wall_s": max(walls), "runs": runs}
        if not a.only or "watch-sglang-file" in a.only:
            w = watch_runs(a.profile, files, a.runs, a.timeout,
                           logs / "watch-sglang-file.log" if logs else None, tuple(a.pytest_args))
            figures["scenarios"]["watch-sglang-file"] = {
                "command": f"HYPOTHESIS_PROFILE={a.profile} a2a-gate watch --policy=sglang:FILE "
                           f"{' '.join(a.pytest_args)}".strip(),
                **w, **{f"median_{k}_s": statistics.median(t for t, _ in w[k])
                        for k in ("wrong_save", "revert")},
                **({"median_wrong_save_shrunk_s": statistics.median(w["wrong_save_shrunk_s"])}
                   if w["wrong_save_shrunk_s"] else {})}
            print(f"watch-sglang-file: cold {w['cold_first_verdict']}, wrong saves "
                  f"{w['wrong_save']} (shrunk {w['wrong_save_shrunk_s']}), reverts "
                  f"{w['revert']}", flush=True)
    print(json.dumps(figures, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1) + "\n")
    ok = all(r["exit"] in (s["expected_exit"] if s["expected_exit"] else (0,))
             and (not s["expected_exit"] or " failed" in r["summary"])
             for s in figures["scenarios"].values() for r in s.get("runs", ()))
    w = figures["scenarios"].get("watch-sglang-file")
    ok = ok and (w is None or (all(v == "FAIL" for _, v in w["wrong_save"])
                               and all(v == "pass" for _, v in w["revert"])))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
