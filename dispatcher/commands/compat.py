"""``python -m dispatcher.commands.compat``: every pinned release of every engine on each FlashInfer
generation the gate models (the table in docs/flashinfer.md).

Each cell runs the release's own file on one step (eager decode, 4 EP ranks, 8 tokens; DP
attention where the engine's record asks for it: ``Engine.compat_dp_size``) with
FlashInfer's API as that generation's source defines it (``dispatcher/flashinfer/api.py``):
``runs`` when the release reaches the launch, else the error the release raises there, as it
would in production; where it runs the one-sided A2A, whether its runtimes along a sequence of
steps expose the generation's cross-round race (``cross_round_verdicts``).
tests/meta/test_compat.py checks the docs table is this one.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

from ..engines import ENGINES, engine_of_spec
from ..model.generations import GENERATIONS, using
from ..model.world import World
from ..releases.wheels import ReleaseError

__all__ = ["cell", "table", "markdown", "step_for", "specs"]

TOKENS, EP = 8, 4


def step_for(dp_size: int, version: str) -> World:
    """The one step: 4 EP ranks, 8 tokens over ``dp_size`` DP groups, on ``version``."""
    return World(ep_size=EP, dp_size=dp_size, group_tokens=(TOKENS // dp_size,) * dp_size,
                 max_num_tokens=64, flashinfer=version)


def launch_error(spec: str, version: str):
    """``(policy, None)`` where release ``spec`` reaches FlashInfer's launch on one step with
    ``version``'s API, else ``(policy, the error it raises there)``."""
    from ..model import properties
    from ..policies import load_policy

    with using(version):
        policy = load_policy(spec)[1]
        world = properties.world_for(policy, step_for(engine_of_spec(spec).compat_dp_size, version))
        try:
            properties.rule_values(policy, world, spec)
        except properties.RuleCrashed as exc:
            return policy, _first_error(str(exc))
    return policy, None


def cell(spec: str, version: str) -> str:
    """What release ``spec`` does on one step with FlashInfer ``version``'s API."""
    policy, error = launch_error(spec, version)
    if error is not None:
        return error
    from ..model.generations import generation_of

    if policy.runs_modelled_a2a and generation_of(version).fixed_combine_region:
        # the combine input no longer follows the runtime: no round reaches the last one's
        # (tests/cpu/test_cross_round.py holds it on every drawn pair of rounds)
        return "runs; cross-round closed"
    with using(version):
        if not policy.runs_modelled_a2a:  # other kernels: no such layout
            return "runs"
        from strategies.search import visited

        from ..cross_round_verdicts import EXAMPLES, ONE_FORMAT, first_exposed

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
    """Every engine's pinned releases (vLLM's also with the two-sided backend)."""
    return [s for e in ENGINES.values() for s in e.verdicts().compat_specs()]


def table() -> Dict[str, Tuple[str, ...]]:
    return {spec: tuple(cell(spec, v) for v in GENERATIONS) for spec in specs()}


def markdown(rows: Dict[str, Tuple[str, ...]]) -> str:
    head = "| release | " + " | ".join(f"FlashInfer {v}" for v in GENERATIONS) + " |"
    rule = "|---|" + "---|" * len(GENERATIONS)
    body = [f"| `{spec}` | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
            for spec, cells in rows.items()]
    return "\n".join([head, rule, *body])


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m dispatcher.commands.compat",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    from .runner import keep_hypothesis_home

    keep_hypothesis_home()  # never a .hypothesis/ in the folder it is run from
    try:
        print(markdown(table()))
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
