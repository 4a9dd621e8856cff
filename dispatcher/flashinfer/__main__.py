"""``python -m dispatcher.flashinfer fetch [VERSION ...]``: pre-fill the verified source cache."""
import sys

from ..releases.wheels import fetch_main
from .fetch import PACKAGE, PINNED

if __name__ == "__main__":
    sys.exit(fetch_main(PACKAGE, PINNED, sys.argv[1:]))
