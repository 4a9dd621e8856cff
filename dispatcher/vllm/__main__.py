"""python -m dispatcher.vllm fetch [VERSION ...]: pre-fill the verified cache (no version:
every release the verdict table pins)."""
import sys

from .fetch import PACKAGE, ReleaseError

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "fetch":
        sys.exit(__doc__)
    from .verdicts import RELEASES

    try:
        for version in sys.argv[2:] or RELEASES:
            print(PACKAGE.fetch_release(version))
    except ReleaseError as exc:
        sys.exit(f"error: {exc}")
