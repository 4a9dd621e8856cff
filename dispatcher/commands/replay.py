"""The replay itself, in the process ``python -m dispatcher`` starts for it (``__main__.py`` is
the controller that starts this process, bounds it in time and decides the exit status).

Prints the world in words, the policy's value on every rank, which properties hold, what the
dispatcher's validation says and, for worlds small enough, the emulated A2A round trip. For
an SGLang policy it also prints what SGLang's own dispatch() saw and did on every rank and
checks every bug class, in the context given (default: eager decode). The world and the
context are read by ``dispatcher.model.parse`` (literals only, never evaluated as code).

It tells the controller how far it got through the file named by ``$A2A_GATE_REPLAY_REPORT``:
``loaded`` once the policy is loaded, ``verdict N`` at the end; so an exit from inside the
policy (``os._exit(0)`` at import, in a rule call or at exit) can never pass for a verdict.
"""
from __future__ import annotations

import os
import sys
import traceback

from ..emulator.rounds import round_trip
from ..model import properties
from ..model.parse import BadWorld, parse_context, parse_sequence, parse_world
from ..model.engine import is_engine
from ..model.sglang_context import SGLangContext
from ..model.validation import A2ASizingError, validate
from ..policies import PolicyError
from ..supervised import PolicyProcessLost, load_supervised
from ..sizing import NotApplicable

OK, VIOLATED, BAD_INPUT, INTERNAL = 0, 1, 2, 3
REPORT_ENV = "A2A_GATE_REPLAY_REPORT"


def _report(line: str) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")


def replay(world_text: str, spec: str, context_text: str = "") -> int:
    if world_text.lstrip().startswith(("(", "[")):
        return replay_sequence(world_text, spec, context_text)
    try:
        world = parse_world(world_text)
        ctx = parse_context(context_text) if context_text else SGLangContext()
        name, policy = spec, load_supervised(spec)
        _report("loaded")
        sglang = is_engine(policy) and policy.takes_context
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
    except properties.PropertyViolation as exc:  # its code crashed, exited or hung in the step
        print(f"{exc}\nworld:\n{world.describe()}")
        return VIOLATED
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
        runtime = validate(values, world.views, world.generation)
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


def _world_of(step):
    """A step of a sequence: a world, or SGLang's (world, context)."""
    return step[0] if isinstance(step, tuple) else step


def replay_sequence(text: str, spec: str, context_text: str = "") -> int:
    """A sequence of steps on one workspace, in order through one policy object: what a
    failing sequence test printed. Every step is held to every property (an SGLang sequence
    of (world, context) steps: to every bug class too); the cross-round rows at risk between
    consecutive A2A rounds are shown."""
    from ..model.sequences import check_sequence

    try:
        steps = parse_sequence(text)
        if context_text:
            raise BadWorld("--context is for one step; a sequence names each step's context")
        name, policy = spec, load_supervised(spec)
        _report("loaded")
        paired = isinstance(steps[0], tuple)
        sglang = is_engine(policy) and policy.takes_context
        if paired and not sglang:
            raise BadWorld(f"(World, SGLangContext) steps are for sglang: policies; {spec} is "
                           f"not one")
    except (BadWorld, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    try:
        if paired:
            from ..sglang.bug_classes import BUGS
            from ..sglang.sequences import check_steps

            hazards = check_steps(policy, steps, BUGS)
        else:
            hazards = check_sequence(policy, steps, name, engine_worlds=lambda w: (
                policy.engine_world(w, keep_cap=True) if is_engine(policy)
                else w))
    except AssertionError as exc:  # PropertyViolation, SequenceFailure
        print(exc)
        for note in getattr(exc, "__notes__", ()):
            print(note)
        return VIOLATED
    print(f"{name}: every step of the {len(steps)} holds every property")
    for n, risk in enumerate(hazards, 1):
        if risk is not None:
            print(f"  steps {n} -> {n + 1}: cross-round rows at risk per reader rank "
                  f"{list(risk)} on FlashInfer {_world_of(steps[n]).flashinfer}")
    return OK


def _engine_classes(release, world, ctx) -> int:
    """Every bug class on this step of an SGLang release; the number violated."""
    from ..sglang.bug_classes import BUG_CLASSES, check_step, describe_step

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


def run(args) -> int:
    """The replay of parsed arguments (``__main__.parser()``); the verdict is reported too."""
    if args.rule_timeout_s:
        from ..model.guard import CALL_TIMEOUT

        CALL_TIMEOUT.set(args.rule_timeout_s)
    if args.newest_companions:
        from ..releases.companions import NEWEST_ENV

        os.environ[NEWEST_ENV] = "1"
    if args.flashinfer:
        from ..model import generations

        try:
            os.environ[generations.ENV] = generations.generation_of(args.flashinfer).version
        except generations.UnknownGeneration as exc:
            print(f"error: {exc}", file=sys.stderr)
            return BAD_INPUT
    try:
        return replay(args.world, args.policy, args.context)
    except PolicyProcessLost as exc:  # its process died or was killed at its deadline
        print(exc)
        return VIOLATED
    except Exception:  # noqa: BLE001 - a bug in the gate, not in the input
        traceback.print_exc()
        print("internal error of the gate (exit 3): please report it with the command above",
              file=sys.stderr)
        return INTERNAL


def main(argv=None) -> int:
    from ..__main__ import parser

    code = run(parser().parse_args(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    _report(f"verdict {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
