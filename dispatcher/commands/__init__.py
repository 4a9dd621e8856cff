"""The gate's commands, the layer users run (``a2a-gate``: ``cli.py``): the suite's settings
(``runner.py``), the replay's process (``replay.py``; ``python -m dispatcher`` is its
controller), the verdict and engine x FlashInfer tables (``verdicts.py``, ``compat.py``), what
ships next (``canary.py``) and bisect (``bisect.py``). Nothing below imports them."""
