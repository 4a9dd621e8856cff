"""Replay one world: ``python -m dispatcher --policy SPEC [--context "SGLangContext(...)"] "World(...)"``.

Prints the world in words, the policy's value on every rank, which properties hold, what the
dispatcher's validation says and, for worlds small enough, the emulated A2A round trip. For
an SGLang policy it also prints what SGLang's own dispatch() saw and did on every rank and
checks every bug class, in the context given (default: eager decode). The world and the
context are read by ``dispatcher.model.parse`` (literals only, never evaluated as code).

Exit codes: 0 every property holds; 1 a property is violated (or the rule crashed, or the
round trip is wrong); 2 bad input (the world text, the policy spec, the arguments);
3 an internal error of the gate (please report it).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from .emulator.a2a import round_trip
from .model import properties
from .model.parse import BadWorld, parse_context, parse_world
from .model.sglang_context import SGLangContext
from .model.validation import A2ASizingError, validate
from .policies import DEFAULT_POLICY, PolicyError, load_policy, probe_policy
from .sizing import NotApplicable

OK, VIOLATED, BAD_INPUT, INTERNAL = 0, 1, 2, 3


def replay(world_text: str, spec: str, context_text: str = "") -> int:
    try:
        world = parse_world(world_text)
        ctx = parse_context(context_text) if context_text else SGLangContext()
        probe_policy(spec)
        name, policy = load_policy(spec)
        sglang = getattr(policy, "engine", None) == "sglang"
        if context_text and not sglang:
            raise BadWorld(f"--context is for sglang: policies; {spec} is not one")
    except (BadWorld, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    try:
        failed = _engine_classes(policy, world, ctx) if sglang else 0
    except NotApplicable as exc:
        print(f"world:\n{world.describe()}\n{name}: not a step of this release ({exc}); "
              f"nothing to check")
        return OK
    try:
        if sglang:
            policy = policy.bind(world, ctx)
        values = properties.rule_values(policy, world, name)
    except properties.PropertyViolation as exc:  # crashed, not an int, nondeterministic
        print(exc)
        return VIOLATED
    except NotApplicable as exc:
        print(f"world:\n{world.describe()}\n{name} declares this world impossible for its "
              f"system ({exc}); nothing to check")
        return OK
    print(properties.explain(world, values, name))
    for prop, check in properties.PROPERTIES.items():
        try:
            check(world, values, name)
            print(f"  {prop:15s} ok")
        except properties.PropertyViolation as exc:
            failed += 1
            print(f"  {prop:15s} VIOLATED: {str(exc).splitlines()[0]}")
    try:
        runtime = validate(values, world.views)
    except A2ASizingError as exc:
        print(f"dispatcher refuses: {type(exc).__name__}: {exc}")
        return VIOLATED if failed or world.payload_fits_cap else OK
    print(f"dispatcher: launches with runtime {runtime}")
    try:
        exact = round_trip(world, [runtime] * world.ep_size).exact
        print(f"emulated A2A round trip: {'exact' if exact else 'WRONG'}")
        failed += not exact
    except MemoryError as exc:
        print(f"emulated A2A round trip: skipped ({exc})")
    return VIOLATED if failed else OK


def _engine_classes(release, world, ctx) -> int:
    """Every bug class on this step of an SGLang release; the number violated."""
    from .sglang.classes import BUG_CLASSES, check_step, describe_step

    print(describe_step(release, world, ctx, release.step(world, ctx)))
    failed = 0
    for key, bug in BUG_CLASSES.items():
        if not bug.applies(world, ctx):
            continue
        problem = check_step(release, key, world, ctx)
        if bug.hazard:  # a context SGLang does not produce: reported, never a failure
            print(f"  {key:20s} {'hazard, exposed: ' + problem.splitlines()[0] if problem else 'hazard, hardened'}")
            continue
        failed += problem is not None
        print(f"  {key:20s} {'VIOLATED: ' + problem.splitlines()[0] if problem else 'ok'}")
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("world", help="a World repr, as printed by a failing test")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help="the rule or SGLang file to replay (default: %(default)s)")
    ap.add_argument("--flashinfer", default=None, metavar="0.7.2|0.7.4",
                    help="the FlashInfer A2A generation (default: the installed one, else 0.7.2)")
    ap.add_argument("--context", default="", metavar="'SGLangContext(...)'",
                    help="for sglang: policies, the step's context (default: eager decode)")
    ap.add_argument("--newest-companions", action="store_true",
                    help="let the newest pinned release's code stand in for an engine "
                         "checkout's missing companion functions (as in the gate run)")
    args = ap.parse_args(argv)  # exits 2 on bad arguments
    if args.newest_companions:
        from .companions import NEWEST_ENV

        os.environ[NEWEST_ENV] = "1"
    if args.flashinfer:
        from .model import generations

        try:
            os.environ[generations.ENV] = generations.generation_of(args.flashinfer).version
        except generations.UnknownGeneration as exc:
            print(f"error: {exc}", file=sys.stderr)
            return BAD_INPUT
    try:
        return replay(args.world, args.policy, args.context)
    except Exception:  # noqa: BLE001 - a bug in the gate, not in the input
        traceback.print_exc()
        print("internal error of the gate (exit 3): please report it with the command above",
              file=sys.stderr)
        return INTERNAL


if __name__ == "__main__":
    sys.exit(main())
