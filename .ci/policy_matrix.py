"""Run the README's command once per row of .ci/policy-matrix.tsv: every kind of policy a user
gates (a rule of theirs, an SGLang release, a lone SGLang file, an SGLang tree, vLLM one- and
two-sided) on both FlashInfer generations, each row's paths expected to pass or to fail.

    python .ci/policy_matrix.py [--only KIND ...] [--pytest-args "..."]

Prints one line per row (kind, generation, spec, expected, got, wall) and exits 1 when any row
did not end as expected (its pytest output is printed then), 2 on a malformed table. A row
that fails to collect anything (pytest's exit 5) or errors (exit 2-4) is never "as expected".
"""
from __future__ import annotations

import argparse
import re
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / ".ci" / "policy-matrix.tsv"
KINDS = ("rule", "sglang-release", "sglang-file", "sglang-tree", "vllm-one-sided",
         "vllm-two-sided")
EXPECT = {"pass": (0,), "fail": (1,), "incompatible": (1,)}
# what every failure of an "incompatible" row must say: the engine's own error at FlashInfer's API
INCOMPATIBLE = re.compile(r"ImportError|ModuleNotFoundError|TypeError: .*unexpected keyword")
USER_RULE = '''"""A user's own sizing rule, as a user writes one (a module on their path)."""
from dispatcher.sizing import ideal_rule


def rule(view):
    return ideal_rule(view)
'''


def read_table(path: Path = TABLE):
    """[(kind, flashinfer, spec, paths, expect)] from the table; ValueError on a bad row."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) != 5:
            raise ValueError(f"{path.name}:{n}: 5 tab-separated columns, got {len(cols)}")
        kind, gen, spec, paths, expect = cols
        if kind not in KINDS or expect not in EXPECT:
            raise ValueError(f"{path.name}:{n}: kind {kind!r} (one of {KINDS}) or expect "
                             f"{expect!r} (one of {', '.join(EXPECT)})")
        rows.append((kind, gen, spec, tuple(paths.split()), expect))
    return rows


def _newest_sglang() -> Path:
    sys.path.insert(0, str(ROOT))
    from dispatcher.engines import ENGINES

    engine = ENGINES["sglang"]
    return engine.package().main_file(engine.releases[-1])[0]


def materialise(spec: str, scratch: Path):
    """(the --policy spec, extra environment) for a table spec with a placeholder."""
    if spec == "@user-rule":
        folder = scratch / "user-rule"
        folder.mkdir(exist_ok=True)
        (folder / "a2a_ci_user_rule.py").write_text(USER_RULE)
        path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
        return "a2a_ci_user_rule:rule", {"PYTHONPATH": path}
    if spec == "@lone-sglang":
        folder = scratch / "lone-sglang"
        folder.mkdir(exist_ok=True)
        shutil.copy(_newest_sglang(), folder / "flashinfer.py")
        return f"sglang:{folder / 'flashinfer.py'}", {}
    if spec == "@sglang-tree":  # the release's files as a checkout lays them out (python/sglang)
        main = _newest_sglang()
        package = next(p for p in main.parents if p.name == "sglang")
        tree = scratch / "sglang-tree"
        if not tree.exists():
            shutil.copytree(package, tree / "python" / "sglang")
        return f"sglang:{tree}", {}
    if spec.startswith("@"):
        raise ValueError(f"unknown placeholder {spec}")
    return spec, {}


def _only_incompatible(output: str) -> bool:
    """Every failed test of the run failed on the engine's own error at FlashInfer's API."""
    blocks = output.split("\n____")[1:]
    return bool(blocks) and all(INCOMPATIBLE.search(b) for b in blocks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=KINDS, help="run only these kinds")
    ap.add_argument("--pytest-args", default="-n auto -q -p no:cacheprovider",
                    help="what each row's pytest gets besides its policy and paths")
    args = ap.parse_args(argv)
    try:
        rows = read_table()
    except ValueError as exc:
        print(f"policy matrix: {exc}", file=sys.stderr)
        return 2
    bad = 0
    with tempfile.TemporaryDirectory(prefix="a2a-gate-matrix-") as tmp:
        for kind, gen, spec, paths, expect in rows:
            if args.only and kind not in args.only:
                continue
            policy, extra = materialise(spec, Path(tmp))
            cmd = [sys.executable, "-m", "pytest", *shlex.split(args.pytest_args),
                   f"--policy={policy}", f"--flashinfer={gen}",
                   *([] if paths == (".",) else paths)]
            t0 = time.monotonic()
            out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **extra}, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            wall = time.monotonic() - t0
            summary = next((ln for ln in reversed(out.stdout.splitlines()) if ln.strip()), "")
            ok = out.returncode in EXPECT[expect] and (
                expect != "incompatible" or _only_incompatible(out.stdout))
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {kind:15} {gen}  {spec:24} expect {expect:4} "
                  f"exit {out.returncode}  {wall:5.1f} s  {summary.strip('= ')}", flush=True)
            if not ok:
                print(f"  $ {shlex.join(cmd)}\n" + out.stdout[-6000:], flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
