"""Replay one world: ``python -m dispatcher --policy SPEC "World(...)"``.

Prints the world in words, the policy's value on every rank, which properties hold, what the
dispatcher's validation says and, for worlds small enough, the emulated A2A round trip.
"""
from __future__ import annotations

import argparse
import sys

from . import properties
from .dispatcher import A2ASizingError, plan
from .emulator import round_trip
from .policies import DEFAULT_POLICY, load_policy
from .world import MoeConfig, World


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    ap.add_argument("world", help='a World repr, as printed by a failing test')
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    args = ap.parse_args(argv)
    name, policy = load_policy(args.policy)
    world = eval(args.world, {"World": World, "MoeConfig": MoeConfig})  # noqa: S307 - a repr
    values = properties.rule_values(policy, world)
    print(properties.explain(world, values, name))
    failed = 0
    for prop, check in properties.PROPERTIES.items():
        try:
            check(world, values, name)
            print(f"  {prop:15s} ok")
        except properties.PropertyViolation as exc:
            failed += 1
            print(f"  {prop:15s} VIOLATED: {str(exc).splitlines()[0]}")
    try:
        p = plan(policy, world.views)
        print(f"dispatcher: launches with runtime {p.runtime}")
        if world.ep_size * world.max_num_tokens * world.moe.hidden_size <= 1 << 24:
            rt = round_trip(world, [p.runtime] * world.ep_size)
            print(f"emulated A2A round trip: {'exact' if rt.exact else 'WRONG'}")
    except A2ASizingError as exc:
        print(f"dispatcher refuses: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
