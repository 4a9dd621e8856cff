"""A pytest plugin for ``suite_wall.py``: where the time of a run goes. Into
``$A2A_GATE_TIMELINE_DIR/timeline.jsonl`` the process that reports the run (the xdist
controller, or the single process) writes one JSON line per test phase (its worker, node id,
phase, start, stop and duration), and one line each for the session's start and end; each
xdist worker adds one line when it has collected. So the benchmark can name the critical
path: the longest test, the busiest worker, and the time before the first test and after the
last."""
from __future__ import annotations

import json
import os
import time


def _write(record: dict) -> None:
    folder = os.environ.get("A2A_GATE_TIMELINE_DIR")
    if folder:
        with open(os.path.join(folder, "timeline.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def _controller() -> bool:
    return not os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config):
    if _controller():
        _write({"event": "configure", "time": time.time()})


def pytest_collection_finish(session):
    _write({"event": "collected", "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "time": time.time()})


def pytest_runtest_logreport(report):
    if not _controller():  # the controller writes for every worker
        return
    node = getattr(report, "node", None)  # xdist: the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
    _write({"worker": worker, "test": report.nodeid, "when": report.when,
            "start": getattr(report, "start", None), "stop": getattr(report, "stop", None),
            "duration": report.duration})


def pytest_unconfigure(config):
    if _controller():
        _write({"event": "unconfigure", "time": time.time()})


def pytest_sessionfinish(session):
    _write({"event": "sessionfinish", "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "time": time.time()})
