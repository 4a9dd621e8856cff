"""Time to verdict: how long the gate takes to say "no" to a wrong sizing rule or a wrong
SGLang file, tier by tier, from the start of pytest to its exit (median of ``--runs``, with
the spread). Every run must fail (exit 1); a run that passes is reported as a miss.

    python benchmarks/time_to_verdict.py --out benchmarks/time_to_verdict_cpu.json
    python benchmarks/time_to_verdict.py --tiers pool gpu --out ...   # on a GPU host

Tiers: ``cpu`` (the rule's property tests; for a file, the SGLang tests and the property
tests), ``pool`` (the rank pool: the real kernels with a GPU and FlashInfer, else the exact
CPU model over gloo), ``gpu`` (every rank on one GPU; rules only). The wrong SGLang files are
edits of the newest pinned release's dispatcher, made here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = ["prefix_rule", "dispatcher.mutants:undersized", "dispatcher.mutants:rank_variant"]
FILE_EDITS = {  # name -> (text in the newest release's file, its replacement)
    "min-dp-global": ("max_dp_tokens = max(dp_global_num_tokens)",
                      "max_dp_tokens = min(dp_global_num_tokens)"),
    "ep-size-divisor": ("            attn_tp_size = get_parallel().attn_tp_size\n",
                        "            attn_tp_size = self.ep_size\n"),
    "cap-as-runtime": ("                runtime_max_tokens_per_rank,\n                invalid_token_expert_id",
                       "                self.max_num_tokens,\n                invalid_token_expert_id"),
}
TIERS = {  # tier -> (tests for a rule, tests for an SGLang file)
    "cpu": (["tests/cpu/test_sizing_properties.py"],
            ["tests/sglang/test_engine_steps.py", "tests/cpu/test_sizing_properties.py"]),
    "pool": (["tests/multi_gpu/test_rank_pool.py", "-k", "pool_round_trip"],
             ["tests/multi_gpu/test_sglang_end_to_end.py", "-k", "dispatch_and_combine"]),
    "gpu": (["tests/gpu", "-k", "real_round_trip"], None),
}


def wrong_files(folder: Path) -> dict:
    from dispatcher.sglang import fetch
    from dispatcher.sglang.verdicts import RELEASES

    text = fetch.fetch_release(RELEASES[-1]).read_text()
    out = {}
    for name, (old, new) in FILE_EDITS.items():
        assert text.count(old) == 1, f"{name}: {old!r} not once in {RELEASES[-1]}"
        path = folder / name / "flashinfer.py"
        path.parent.mkdir(parents=True)
        path.write_text(text.replace(old, new))
        out[f"sglang file: {name}"] = f"sglang:{path}"
    return out


def one_run(tests, spec, profile) -> tuple:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-x", "-q",
           f"--policy={spec}", *tests]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, HYPOTHESIS_PROFILE=profile))
    return time.perf_counter() - t0, done.returncode, (done.stdout + done.stderr)[-600:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", nargs="+", default=["cpu", "pool"], choices=list(TIERS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", default="ci", help="HYPOTHESIS_PROFILE (gpu on a GPU host)")
    ap.add_argument("--only", choices=("rules", "files"), help="only the wrong rules or files")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        policies = {f"rule: {r}": r for r in RULES} | wrong_files(Path(tmp))
        for tier in args.tiers:
            for label, spec in policies.items():
                tests = TIERS[tier][label.startswith("sglang")]
                kind = "files" if label.startswith("sglang") else "rules"
                if tests is None or args.only not in (None, kind):
                    continue
                walls, codes, tail = [], [], ""
                for _ in range(args.runs):
                    wall, code, tail = one_run(tests, spec, args.profile)
                    walls.append(wall)
                    codes.append(code)
                row = {"tier": tier, "policy": label, "exit_codes": codes,
                       "median_s": round(statistics.median(walls), 1),
                       "min_s": round(min(walls), 1), "max_s": round(max(walls), 1)}
                if any(c != 1 for c in codes):
                    row["tail"] = tail
                rows.append(row)
                print(f"{tier:5s} {label:32s} median {row['median_s']:6.1f} s "
                      f"({row['min_s']}-{row['max_s']}) exits {codes}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "profile": args.profile,
                                        "rows": rows}, indent=1) + "\n")
    return 0 if all(set(r["exit_codes"]) == {1} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
