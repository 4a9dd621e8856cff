"""``python -m dispatcher.verdicts [--engine NAME|all] [SPEC ...]`` (``a2a-gate verdicts``): the
verdict tables of every engine in ``dispatcher.engines.ENGINES`` (each engine's
``verdicts.py``). With SPECs, only those (``0.5.23``, ``sglang:PATH``, ``vllm:0.33.0``,
``vllm:0.33.0@two-sided``); a SPEC without an engine prefix is the first engine's (SGLang)."""
import argparse
import sys

from .engines import ENGINES, engine_of_spec
from .wheels import ReleaseError

DEFAULT_ENGINE = next(iter(ENGINES))  # a bare version or path: SGLang's


def _engine(spec: str):
    return engine_of_spec(spec) or ENGINES[DEFAULT_ENGINE]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher.verdicts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=(*ENGINES, "all", "both"), default="all",
                        help="one engine's tables, or all (both: the same as all)")
    parser.add_argument("specs", nargs="*", metavar="SPEC")
    args = parser.parse_args(argv)
    from .runner import keep_hypothesis_home

    keep_hypothesis_home()  # never a .hypothesis/ in the folder it is run from
    chosen = list(ENGINES.values()) if args.engine in ("all", "both") else [ENGINES[args.engine]]
    left_out = [s for s in args.specs if _engine(s) not in chosen]
    if left_out:
        parser.error(f"--engine {args.engine} does not gate {', '.join(left_out)} "
                     f"(use --engine all, or leave them out)")
    from .policies import PolicyError, probe_policy

    try:  # each named file loaded once in a child process first (exits, endless loads)
        for spec in args.specs:
            probe_policy(spec if engine_of_spec(spec) else _engine(spec).spec(spec))
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        for engine in chosen:
            mine = [s for s in args.specs if _engine(s) is engine]
            if args.specs and not mine:
                continue
            verdicts = engine.verdicts()
            print(f"## {verdicts.TITLE}\n\n{verdicts.tables(mine or verdicts.default_specs())}\n")
    except (ReleaseError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
