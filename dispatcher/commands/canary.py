"""What ships next, judged the day it ships: ``a2a-gate canary`` (``python -m dispatcher.commands.canary``).

For each engine and for FlashInfer, asks the package index for the newest release. A release
the gate pins is up to date. An engine's newer release is fetched (verified as any release is)
and judged on the FlashInfer generation whose API it calls (the first generation on which its
file reaches the launch, ``compat.launch_error``): the README's command runs with it as the policy,
and the verdict is "pass" or the failing tests (each names its property or bug class). A
FlashInfer release the gate has no generation for, or an engine release that cannot be
fetched, loaded or run on any generation, is "not judged", with why. Prints one table; exits 1
only when some release could not be judged (2 on bad usage, 3 when the index cannot be asked).

    a2a-gate canary                      # the newest releases on the index
    a2a-gate canary --release vllm:0.35.0 --release flashinfer:0.7.5   # these, instead
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from ..engines import ENGINES
from ..model.generations import GENERATIONS, UnknownGeneration, generation_of
from ..releases.wheels import ReleaseError

__all__ = ["Row", "newest_on_index", "judge_engine", "judge_flashinfer", "canary", "main",
           "NOT_JUDGED"]

NOT_JUDGED = 1
FLASHINFER = "flashinfer-python"


@dataclass(frozen=True)
class Row:
    package: str  # "vllm", "sglang", "flashinfer"
    version: str
    status: str  # "up to date" | "judged" | "not judged"
    detail: str  # the verdict, or why it was not judged

    def line(self) -> str:
        return f"| {self.package} | {self.version} | {self.status} | {self.detail} |"


def newest_on_index(distribution: str, timeout_s: float = 120) -> str:
    """The newest release of ``distribution`` on the package index (``pip index versions``)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", distribution],
                         capture_output=True, text=True, timeout=timeout_s)
    found = re.search(rf"^{re.escape(distribution)} \(([^)]+)\)", out.stdout, re.M)
    if out.returncode or not found:
        raise ReleaseError(f"the package index did not list {distribution}: "
                           f"{(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return found.group(1)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def runs_on(spec: str) -> Tuple[Optional[str], str]:
    """(the first generation on which ``spec``'s file reaches the launch, else None; each
    generation's error there, for the reason)."""
    from .compat import launch_error

    errors = []
    for version in GENERATIONS:
        error = launch_error(spec, version)[1]
        if error is None:
            return version, "runs"
        errors.append(f"FlashInfer {version}: {error}")
    return None, "; ".join(errors)


def _suite(spec: str, generation: str, pytest_args: Sequence[str]) -> Tuple[int, str]:
    """The README's command with ``spec`` as the policy on ``generation``: (exit code, output)."""
    from .runner import suite_args

    code = ("import sys, pytest\n"
            f"sys.exit(int(pytest.main({suite_args(args=list(pytest_args) + [f'--policy={spec}', f'--flashinfer={generation}'])!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=1800)
    return out.returncode, out.stdout + out.stderr


def judge_engine(spec: str, pytest_args: Sequence[str] = ("-n", "auto", "-q", "-p", "no:cacheprovider"),
                 suite: Callable = _suite) -> Row:
    """An engine release (``vllm:0.35.0``, a wheel or a tree), judged or not, with why."""
    engine = ENGINES[spec.partition(":")[0]]
    target = spec.partition(":")[2]
    try:
        from ..policies import describe_policy

        describe_policy(spec)  # fetched and verified, found; nothing of it run
        generation, why = runs_on(spec)
    except Exception as exc:  # noqa: BLE001 - the release cannot be had or loaded: say why
        return Row(engine.name, target, "not judged", f"{type(exc).__name__}: {_first_line(str(exc))}")
    if generation is None:
        return Row(engine.name, target, "not judged",
                   f"runs on no FlashInfer generation the gate models ({why})")
    code, output = suite(spec, generation, pytest_args)
    if code == 0:
        return Row(engine.name, target, "judged", f"pass (on FlashInfer {generation})")
    failed = sorted({m.group(1) for m in re.finditer(r"^FAILED (\S+)", output, re.M)})
    if code == 1 and failed:
        names = ", ".join(f.split("::")[-1].split("@")[0] for f in failed[:6])
        return Row(engine.name, target, "judged",
                   f"FAIL on FlashInfer {generation}: {len(failed)} tests ({names}"
                   f"{', ...' if len(failed) > 6 else ''})")
    return Row(engine.name, target, "not judged",
               f"the gate's run on FlashInfer {generation} ended with exit {code}: "
               f"{_first_line(output.strip().splitlines()[-1] if output.strip() else '')}")


def judge_flashinfer(version: str) -> Row:
    """A FlashInfer release: judged where the gate has its generation (its A2A sources pinned
    and modelled), else not judged."""
    try:
        gen = generation_of(version)
    except UnknownGeneration as exc:
        return Row("flashinfer", version, "not judged",
                   f"{exc}: no byte model, emulator or API of its A2A (docs/extending.md, "
                   f"\"A FlashInfer generation\")")
    return Row("flashinfer", version, "judged", f"modelled as FlashInfer {gen.version}")


def canary(releases: Optional[List[str]] = None, newest: Optional[Callable[[str], str]] = None,
           judge: Optional[Callable[[str], Row]] = None) -> List[Row]:
    """One row per engine and FlashInfer: up to date, judged or not judged (``newest``: the
    index's newest release of a distribution; ``judge``: an engine release's row)."""
    from ..flashinfer.fetch import PINNED as FLASHINFER_PINNED

    newest, judge = newest or newest_on_index, judge or judge_engine

    rows = []
    wanted = releases or ([f"{name}:{newest(e.package().name)}" for name, e in ENGINES.items()]
                          + [f"flashinfer:{newest(FLASHINFER)}"])
    for spec in wanted:
        name, _, version = spec.partition(":")
        if name == "flashinfer":
            pinned = any(version == v or version.startswith(v + ".post") for v in FLASHINFER_PINNED)
            rows.append(Row(name, version, "up to date", "pinned") if pinned and not releases
                        else judge_flashinfer(version))
        elif name in ENGINES:
            if version in ENGINES[name].releases and not releases:
                rows.append(Row(name, version, "up to date", "pinned"))
            else:
                rows.append(judge(spec))
        else:
            raise ValueError(f"{spec}: name one of {', '.join([*ENGINES, 'flashinfer'])}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="a2a-gate canary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", action="append", metavar="NAME:VERSION",
                    help="judge this release instead of asking the index (repeatable)")
    args = ap.parse_args(argv)
    from .runner import keep_hypothesis_home

    keep_hypothesis_home()  # never a .hypothesis/ in the folder it is run from
    try:
        rows = canary(args.release)
    except (ReleaseError, OSError, subprocess.SubprocessError) as exc:
        print(f"a2a-gate canary: could not ask the package index: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"a2a-gate canary: {exc}", file=sys.stderr)
        return 2
    print("| package | release | status | verdict |\n|---|---|---|---|")
    for row in rows:
        print(row.line())
    return NOT_JUDGED if any(r.status == "not judged" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
