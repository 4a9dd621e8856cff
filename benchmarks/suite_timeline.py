"""A pytest plugin for ``suite_wall.py``: the process that reports the run (the xdist
controller, or the single process) writes one JSON line per test phase (its worker, node id,
phase and duration) to ``$A2A_GATE_TIMELINE_DIR/timeline.jsonl``, so the benchmark can name the
critical path: the longest test and the busiest worker."""
from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report):
    folder = os.environ.get("A2A_GATE_TIMELINE_DIR")
    if not folder or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes for all
        return
    node = getattr(report, "node", None)  # xdist: the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
    with open(os.path.join(folder, "timeline.jsonl"), "a") as f:
        f.write(json.dumps({"worker": worker, "test": report.nodeid, "when": report.when,
                            "duration": report.duration}) + "\n")
