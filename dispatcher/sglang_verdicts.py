"""``python -m dispatcher.sglang_verdicts``: the verdict table (``dispatcher/sglang/verdicts.py``)."""
import sys

from .sglang.verdicts import main

if __name__ == "__main__":
    sys.exit(main())
