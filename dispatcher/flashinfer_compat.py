"""``python -m dispatcher.flashinfer_compat``: every pinned SGLang and vLLM release on each
FlashInfer generation the gate models (the table in docs/flashinfer.md).

Each cell runs the release's own file on one step (eager decode, 4 EP ranks, 8 tokens; DP
attention for vLLM, whose older releases refuse a sequence-parallel step) with
FlashInfer's API as that generation's source defines it (``dispatcher/flashinfer/api.py``):
``runs`` when the release reaches the launch, else the error the release raises there, as it
would in production; where it runs the one-sided A2A, whether its runtimes along a sequence of
steps expose the generation's cross-round race (``cross_round_verdicts``). tests/meta/test_flashinfer_compat.py checks the docs table is this one.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

from .model.generations import GENERATIONS, using
from .model.world import World
from .wheels import ReleaseError

__all__ = ["cell", "table", "markdown", "STEP"]

STEP = World(ep_size=4, dp_size=1, group_tokens=(8,), max_num_tokens=64)
DP_STEP = World(ep_size=4, dp_size=4, group_tokens=(2, 2, 2, 2), max_num_tokens=64)  # vLLM


def cell(spec: str, version: str) -> str:
    """What release ``spec`` does on one step with FlashInfer ``version``'s API."""
    from .model import properties
    from .policies import load_policy

    with using(version):
        policy = load_policy(spec)[1]
        world = properties.world_for(policy, DP_STEP if spec.startswith("vllm") else STEP)
        try:
            properties.rule_values(policy, world, spec)
        except properties.RuleCrashed as exc:
            return _first_error(str(exc))
        if getattr(policy, "side", None) == "two-sided":  # other kernels: no such layout
            return "runs"
        from strategies.search import visited

        from .cross_round_verdicts import EXAMPLES, ONE_FORMAT, first_exposed

        exposed = first_exposed(policy, visited(ONE_FORMAT, EXAMPLES)) is not None
    return f"runs; cross-round {'exposed' if exposed else 'closed'}"


def _first_error(text: str) -> str:
    """The engine's own error, from a crash report: the last ``raised X: ...`` it names."""
    at = text.rfind("raised ")
    if at < 0:
        return text.splitlines()[0]
    line = text[at + len("raised "):].splitlines()[0].split(" on EP rank")[0].strip()
    return line.split(". ")[0].rstrip(".") + "."  # its first sentence


def specs() -> List[str]:
    from .sglang.verdicts import RELEASES as SGLANG
    from .vllm.verdicts import RELEASES as VLLM

    return ([f"sglang:{v}" for v in SGLANG] + [f"vllm:{v}" for v in VLLM]
            + [f"vllm:{v}@two-sided" for v in VLLM])


def table() -> Dict[str, Tuple[str, ...]]:
    return {spec: tuple(cell(spec, v) for v in GENERATIONS) for spec in specs()}


def markdown(rows: Dict[str, Tuple[str, ...]]) -> str:
    head = "| release | " + " | ".join(f"FlashInfer {v}" for v in GENERATIONS) + " |"
    rule = "|---|" + "---|" * len(GENERATIONS)
    body = [f"| `{spec}` | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
            for spec, cells in rows.items()]
    return "\n".join([head, rule, *body])


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m dispatcher.flashinfer_compat",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    try:
        print(markdown(table()))
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
