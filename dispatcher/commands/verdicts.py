"""``python -m dispatcher.commands.verdicts [--engine NAME|all] [SPEC ...]`` (``a2a-gate verdicts``): the
verdict tables of every engine in ``dispatcher.engines.ENGINES`` (each engine's
``verdicts.py``). With SPECs, only those (``0.5.23``, ``sglang:PATH``, ``vllm:0.33.0``,
``vllm:0.33.0@two-sided``); a SPEC without an engine prefix is the first engine's (SGLang).

The tables are computed in a child process (which runs the engines' code) and printed by this
one, which decides the exit status: a child that ends without its tables (an engine file that
exits, crashes or runs past ``--timeout``) is an error saying so, never a silent exit 0."""
import argparse
import sys

DONE = "A2A-GATE-VERDICTS-DONE"  # the child's last line, once every table is printed
DEFAULT_TIMEOUT_S = 4 * 3600.0

from ..engines import ENGINES, engine_of_spec
from ..model.properties import PropertyViolation
from ..sandbox.procs import seconds_arg as _seconds
from ..supervised import PolicyProcessLost, load_supervised
from ..releases.wheels import ReleaseError

DEFAULT_ENGINE = next(iter(ENGINES))  # a bare version or path: SGLang's


def _engine(spec: str):
    return engine_of_spec(spec) or ENGINES[DEFAULT_ENGINE]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher.commands.verdicts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=(*ENGINES, "all", "both"), default="all",
                        help="one engine's tables, or all (both: the same as all)")
    parser.add_argument("specs", nargs="*", metavar="SPEC")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds the tables may take (default {DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("--rule-timeout-s", type=_seconds, default=None, metavar="S",
                        help="seconds one call into a file's code may take (default: 10, as "
                             "in the gate run); a call past it stops the tables, named")
    parser.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.timeout <= 7 * 86_400:
        parser.error(f"--timeout must be a positive number of seconds up to a week, got "
                     f"{args.timeout}")
    from ..model.guard import CALL_TIMEOUT

    if args.rule_timeout_s is not None and args.rule_timeout_s > CALL_TIMEOUT.MAX_SECONDS:
        parser.error(f"--rule-timeout-s must be at most {CALL_TIMEOUT.MAX_SECONDS:,.0f} s (a "
                     f"day), got {args.rule_timeout_s}")
    from .runner import keep_hypothesis_home

    keep_hypothesis_home()  # never a .hypothesis/ in the folder it is run from
    chosen = list(ENGINES.values()) if args.engine in ("all", "both") else [ENGINES[args.engine]]
    left_out = [s for s in args.specs if _engine(s) not in chosen]
    if left_out:
        parser.error(f"--engine {args.engine} does not gate {', '.join(left_out)} "
                     f"(use --engine all, or leave them out)")
    from ..policies import PolicyError, probe_policy

    try:  # each named file loaded once in a child process first (exits, endless loads)
        for spec in [] if args.in_child else args.specs:
            probe_policy(spec if engine_of_spec(spec) else _engine(spec).spec(spec))
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.in_child:
        return _in_child(list(argv if argv is not None else sys.argv[1:]), args)
    if args.rule_timeout_s:
        CALL_TIMEOUT.set(args.rule_timeout_s)
    try:
        for engine in chosen:
            mine = [s for s in args.specs if _engine(s) is engine]
            if args.specs and not mine:
                continue
            verdicts = engine.verdicts()
            table = verdicts.tables(mine or verdicts.default_specs(), load=_loader(engine))
            print(f"## {verdicts.TITLE}\n\n{table}\n")
    except (ReleaseError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (PolicyProcessLost, PropertyViolation) as exc:  # a file's code hung, exited or
        print(f"error: {exc}", file=sys.stderr)            # crashed in a call: named
        return 1
    print(DONE, flush=True)
    return 0


def _loader(engine):
    """How the tables load a target: a pinned release in this process (verified code, the
    tables of the docs); any other file or tree in a supervised process of its own, so a call
    that hangs, exits or crashes is stopped at its deadline and named."""
    def load(target: str):
        if target.partition("@")[0] in engine.releases:
            return engine.module("loader").release_from_spec(target)
        return load_supervised(f"{engine.name}:{target}")
    return load


def _in_child(argv, args) -> int:
    """Run the tables in a child process; print what it printed; 0 only where it finished."""
    from ..sandbox.procs import OutputFlood, child_env, python_child, run_bounded

    specs = " ".join(args.specs)
    try:
        code, text = run_bounded(python_child("dispatcher.commands.verdicts", "--in-child", *argv),
                                 child_env(specs.split()[0] if args.specs else ""),
                                 args.timeout, limit=16 << 20)
    except OutputFlood as exc:
        print(f"error: the verdict run flooded its output: {exc}", file=sys.stderr)
        return 1
    lines = text.splitlines()
    done = code == 0 and DONE in lines
    print("\n".join(line for line in lines if line != DONE))
    if done:
        return 0
    if code == 2:
        return 2  # its own error, printed above
    why = (f"did not finish within {args.timeout:.0f} s (--timeout)" if code is None else
           "stopped before its tables were printed: a call into its code hung, exited or "
           "crashed (above)" if code == 1 else
           f"ended (exit code {code}) before its tables were printed: an engine file that "
           f"exits or crashes (os._exit, a signal)")
    print(f"error: the verdict run of {specs or 'the pinned releases'} {why}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
