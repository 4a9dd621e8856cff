"""What takes seconds to start (a rank pool; the single-GPU driver: a CUDA context and
FlashInfer's module), started in the background by the one process that will use it, while it
collects and runs other tests.

The tests that share such a resource carry its ``xdist_group``; the gate's scheduler
(``dispatcher/plugin/__init__.py``) pins each of these groups to one xdist worker known before the run
(``pinned_worker``), so that worker starts the resource right after collection
(``start_for``), and the tests' fixtures ``take`` it (waiting for it, or starting it then
where nothing was started). One definition of each resource (``RESOURCES``) serves both.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, Optional

from ..sandbox.standins import MODULE_TABLE

__all__ = ["RESOURCES", "PINNED", "FIXTURES", "pinned_worker", "start", "start_for", "take", "close_unused", "TAKEN", "POOLS", "group_name"]


def _pool(ep_size: int) -> Callable[..., object]:
    def make(resolve=None):
        from strategies import GPU_SHAPES

        from .env import flashinfer_missing, gpu_count
        from .rank_pool import RankPool

        return RankPool(ep_size, max(1, gpu_count()), GPU_SHAPES.largest.dispatch_bytes,
                        GPU_SHAPES.largest.combine_bytes, emulated=bool(flashinfer_missing()),
                        resolve=resolve)
    return make


def _single_gpu(resolve=None):
    """The installed FlashInfer's kernels on this GPU; on a machine without them, the exact
    CPU model behind the same calls (``single_cpu.py``; the plugin runs the tier's tests that
    need no hardware there, and --require-gpus fails them first)."""
    from . import env

    if env.flashinfer_missing():
        from .single_cpu import EmulatedSingleA2A

        return EmulatedSingleA2A()
    from .single import for_installed

    env.apply()  # before this process's CUDA starts (CUDA_DEVICE_MAX_CONNECTIONS among them)
    return for_installed()  # on the installed FlashInfer's kernels


# xdist group -> how its resource is made (``resolve``: the policy loader a rank pool hands
# its ranks, from the plugin: this folder sits below the policies)
POOLS = ("rank-pool-2-shared", "rank-pool-4-shared")  # the rank pools' groups
RESOURCES: Dict[str, Callable[..., object]] = {
    "gpu-single": _single_gpu,
    POOLS[0]: _pool(2),
    POOLS[1]: _pool(4),
}
PINNED = tuple(RESOURCES)  # the groups pinned to a worker each, in this order
# group -> the fixture that takes its resource: only a test that uses it makes it worth starting
FIXTURES = {"gpu-single": "single_gpu", "rank-pool-2-shared": "pools",
            "rank-pool-4-shared": "pools"}


def group_name(item) -> str:
    """The xdist group of a pytest ``item`` as xdist names it: the sorted names of every
    ``xdist_group`` mark, joined by ``_`` ("" for none)."""
    return "_".join(sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")}))


def pinned_worker(group: str, workers: int) -> Optional[str]:
    """The xdist worker id (``gw<i>``) that runs ``group``'s tests, or None if it is not pinned."""
    if group not in PINNED or workers < 1:
        return None
    return f"gw{PINNED.index(group) % workers}"


_STARTED: Dict[str, tuple] = {}
TAKEN: set = set()  # the names taken in this process (a watch's test process starts them afresh)
_LOCK = threading.Lock()


def start(name: str, resolve=None) -> None:
    """Start ``RESOURCES[name]`` in a background thread (once)."""
    with _LOCK:
        if name in _STARTED:
            return
        box: dict = {}

        def run():
            try:
                with MODULE_TABLE:  # no engine sandbox swaps sys.modules while this imports
                    box["value"] = RESOURCES[name](resolve)
            except BaseException as exc:  # noqa: BLE001 - raised again where it is taken
                box["error"] = exc
        thread = threading.Thread(target=run, name=f"a2a-gate-warm-{name}", daemon=True)
        _STARTED[name] = (thread, box)
        thread.start()


def start_for(worker: str, workers: int, groups: Iterable[str], usable: Callable[[str], bool],
              resolve=None) -> None:
    """In xdist worker ``worker``: start each resource whose group is pinned to it and has a
    selected test that can run here (``usable``)."""
    for group in set(groups):
        if pinned_worker(group, workers) == worker and usable(group):
            start(group, resolve)


def take(name: str, resolve=None):
    """The resource, started earlier or now (with ``resolve``); its start's error is raised
    here."""
    TAKEN.add(name)
    with _LOCK:
        entry = _STARTED.pop(name, None)
    if entry is None:
        return RESOURCES[name](resolve)
    thread, box = entry
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def close_unused() -> None:
    """Close what was started and never taken (its tests were not run after all)."""
    with _LOCK:
        left = list(_STARTED.items())
        _STARTED.clear()
    for _, (thread, box) in left:
        thread.join()
        close = getattr(box.get("value"), "close", None)
        if close is not None:
            close()
