"""python -m dispatcher.sglang fetch [VERSION ...]: pre-fill the verified cache (no version:
every release the verdict table pins)."""
import sys

from ..releases.wheels import fetch_main
from .fetch import PACKAGE
from .verdicts import RELEASES

if __name__ == "__main__":
    sys.exit(fetch_main(PACKAGE, RELEASES, sys.argv[1:]))
