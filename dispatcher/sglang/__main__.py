"""python -m dispatcher.sglang fetch VERSION [VERSION ...]: pre-fill the verified cache."""
import sys

from .fetch import ReleaseError, fetch_release

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "fetch":
        sys.exit(__doc__)
    try:
        for version in sys.argv[2:]:
            print(fetch_release(version))
    except ReleaseError as exc:
        sys.exit(f"error: {exc}")
