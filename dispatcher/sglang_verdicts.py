"""``python -m dispatcher.sglang_verdicts [--engine sglang|vllm|both] [SPEC ...]``: the verdict
tables of both engines (``dispatcher/sglang/verdicts.py``, ``dispatcher/vllm/verdicts.py``).
With SPECs, only those (``0.5.23``, ``sglang:PATH``, ``vllm:0.33.0``, ``vllm:0.33.0@two-sided``)."""
import argparse
import sys

from .wheels import ReleaseError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher.sglang_verdicts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("sglang", "vllm", "both"), default="both")
    parser.add_argument("specs", nargs="*", metavar="SPEC")
    args = parser.parse_args(argv)
    vllm_specs = [s for s in args.specs if s.startswith("vllm")]
    sglang_specs = [s for s in args.specs if not s.startswith("vllm")]
    left_out = {"sglang": vllm_specs, "vllm": sglang_specs}.get(args.engine, [])
    if left_out:
        parser.error(f"--engine {args.engine} does not gate {', '.join(left_out)} "
                     f"(use --engine both, or leave them out)")
    from .policies import PolicyError, probe_policy

    try:  # each named file loaded once in a child process first (exits, endless loads)
        for spec in args.specs:
            probe_policy(spec if spec.startswith(("sglang", "vllm")) else f"sglang:{spec}")
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.engine in ("sglang", "both") and (sglang_specs or not args.specs):
            from .sglang.verdicts import RELEASES as SGLANG, tables as sglang_tables
            print("## SGLang FlashinferDispatcher\n\n" + sglang_tables(sglang_specs or list(SGLANG)))
        if args.engine in ("vllm", "both") and (vllm_specs or not args.specs):
            from .vllm.verdicts import RELEASES as VLLM, tables as vllm_tables
            default = [f"vllm:{v}" for v in VLLM] + [f"vllm:{VLLM[0]}@two-sided",
                                                     f"vllm:{VLLM[-1]}@two-sided"]
            print("\n## vLLM FlashInfer NVLink prepare/finalize\n\n"
                  + vllm_tables(vllm_specs or default))
    except (ReleaseError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
