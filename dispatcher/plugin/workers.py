"""How a run's tests are spread over xdist workers (hooks of the gate's plugin, which imports
them): how many ``-n auto`` starts, which worker runs each ``xdist_group`` (the scheduler,
``scheduling.py``), and the node ids that carry the groups. Nothing here imports xdist until
xdist asks: the plugin runs without it too."""
from __future__ import annotations

import os

import pytest

__all__ = ["pytest_xdist_auto_num_workers", "pytest_xdist_make_scheduler", "_join_xdist_group"]


def _join_xdist_group(item) -> None:
    """Give ``item`` the ``nodeid@group`` form xdist's loadgroup scheduler reads. xdist adds it
    in its own collection hook, which runs before this file's (marks added here would be
    missed) and, on pytest >= 9.2, writes an attribute pytest no longer reads
    (pytest-dev/pytest-xdist#1386): either way the group was silently ignored. The group
    name is xdist's: the sorted names of every ``xdist_group`` mark, joined by ``_``."""
    from ..gpu.warm import group_name

    group = group_name(item)
    if not group or item.nodeid.endswith("@" + group):
        return
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9.2: nodeid is str(item._id)
        from _pytest.nodeid import NodeId
        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: xdist's count (one per CPU), capped for a user's policy gated alone
    (``runner.processes_for``); a count the user set ($PYTEST_XDIST_AUTO_NUM_WORKERS) as is."""
    from xdist.plugin import pytest_xdist_auto_num_workers as one_per_cpu

    from ..commands.runner import processes_for

    count = one_per_cpu(config)
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return count
    return processes_for(config.getoption("--policy"), config.getoption("--self-check"), count)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist=loadgroup`` with the costly groups pinned (``dispatcher/plugin/scheduling.py``)."""
    if config.getvalue("dist") == "loadgroup":
        from .scheduling import PinnedGroupScheduling

        return PinnedGroupScheduling(config, log)
    return None
