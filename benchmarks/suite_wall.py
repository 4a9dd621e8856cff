"""Time the whole gate the way users run it, and write the figures.

    python benchmarks/suite_wall.py --runs 3 --out benchmarks/suite_wall_cpu.json
    python benchmarks/suite_wall.py --runs 3 -- --policy=sglang:0.5.23
    python benchmarks/suite_wall.py --runs 3 --profile gpu -- --require-gpus     # a GPU runner

Each run is ``HYPOTHESIS_PROFILE=<profile> pytest -n auto -q -rf -p no:cacheprovider [ARGS]`` in
a fresh process from the repository root, nothing else set; the figure is the median wall
time with the min and max, and every run's pytest summary line (and failed tests) is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(profile: str, args: list, timeout: float, log: Path = None) -> dict:
    env = {**os.environ, "HYPOTHESIS_PROFILE": profile}
    cmd = [sys.executable, "-m", "pytest", "-n", "auto", "-q", "-rf", "-p", "no:cacheprovider", *args]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith("FAILED ")]
    return {"wall_s": round(wall, 1), "exit": done.returncode, "summary": lines[-1] if lines else "",
            **({"failed": failed} if failed else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--log-dir", help="keep each run's whole pytest output here (run-N.log)")
    ap.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    a = ap.parse_args()
    runs = []
    logs = Path(a.log_dir) if a.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    for i in range(a.runs):
        runs.append(one_run(a.profile, a.pytest_args, a.timeout,
                            logs / f"run-{i + 1}.log" if logs else None))
        print(f"run {i + 1}: {runs[-1]['wall_s']} s  {runs[-1]['summary']}", flush=True)
    walls = [r["wall_s"] for r in runs]
    figures = {
        "command": f"HYPOTHESIS_PROFILE={a.profile} pytest -n auto {' '.join(a.pytest_args)}".strip(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, python {platform.python_version()}",
        "median_wall_s": statistics.median(walls), "min_wall_s": min(walls),
        "max_wall_s": max(walls), "runs": runs,
    }
    print(json.dumps(figures, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
