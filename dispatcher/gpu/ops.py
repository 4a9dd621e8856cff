"""What a FlashInfer generation's kernels do for the GPU drivers, as two typed contracts, and
the door to each generation's module (``mnnvl`` for 0.7.2's kernels, ``one_sided`` for
0.7.4's), opened by the module name its generation's row records (``Generation.gpu_ops``):
the model names it, the GPU folder imports it, so no import runs up from the model.

- ``Ops``: every rank of a world in one process on a caller-owned workspace with guard bytes
  (the single-GPU driver, ``single.py`` and ``sequence.py``);
- ``PoolOps``: one rank of the rank pool on the object an engine builds (the pool's one
  driver, ``rank_examples.kernel_world`` and ``kernel_round``).

Each generation's module defines a class of each name; ``tests/gpu/test_ops_contract.py``
checks that both implement every method with its parameters. The drivers hold every step a
generation shares (agreement, validation, inputs, expert outputs, checks); a generation's
class holds only what its kernels do differently.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Hashable, List, Protocol, Sequence, Tuple, runtime_checkable

from ..model.generations import Generation
from ..model.world import World

__all__ = ["Ops", "PoolOps", "ops_of"]


@runtime_checkable
class Ops(Protocol):
    """A generation's raw per-rank ops on a ``[W, size + guard]`` workspace the single-GPU
    driver allocates (``space`` is the generation's own record of it)."""

    def __init__(self, device) -> None: ...

    def key(self, world: World) -> Hashable:
        """The workspaces a world can share (one allocation per key)."""

    def size(self, world: World) -> int:
        """Bytes per rank FlashInfer is handed (the guard bytes come after them)."""

    def initialize(self, world: World, full, ws):
        """Lay out and initialise every rank's slice of ``ws`` (a view of ``full``)."""

    def byte_model(self, world: World, space=None) -> Dict[str, Tuple[int, int]]:
        """name -> (our byte model's number, FlashInfer's own) for this config."""

    def refused(self, world: World, runtimes: Sequence[int], space, dev) -> List[str]:
        """The refusal of each rank whose call the op refuses, made before any launch."""

    def poison(self, world: World, space) -> None:
        """POISON in every payload plane (never counters or flags)."""

    def dispatch(self, r: int, world: World, runtime: int, space, ids, payloads):
        """Rank ``r``'s dispatch: its receive planes ``[W, R, n]`` and its combine offset."""

    def round_model(self, world: World, runtimes: Sequence[int],
                    combine_offsets) -> Dict[str, Tuple]:
        """name -> (the layout's number, FlashInfer's) of the round just dispatched."""

    def counts(self, world: World, space):
        """The receive counters of the round just dispatched: int32 ``[W, W]`` as bytes."""

    def combine(self, r: int, world: World, runtime: int, space, out, combine_offset):
        """Rank ``r``'s combine: its rows of the combined output."""


@runtime_checkable
class PoolOps(Protocol):
    """A generation's kernels on one rank of the rank pool, on the A2A object an engine
    builds over the pool's process group (``a2a``)."""

    def key(self, world: World) -> Hashable:
        """The A2A object a world runs on (one per key, built once, collectively)."""

    def build(self, state: dict, rank: int, ep_size: int, world: World,
              max_dispatch_bytes: int, max_combine_bytes: int):
        """This rank's A2A object for ``world``'s key (collective: every rank calls it)."""

    def poison(self, a2a, rank: int, state: dict) -> None:
        """POISON in this rank's payload regions, synchronised (never counters or flags)."""

    def refuses(self, world: World, runtimes: Sequence[int]) -> List[int]:
        """The ranks whose call the op refuses before any launch (their rows over their
        runtime, on a generation whose op checks them)."""

    def dispatch(self, a2a, world: World, rank: int, ep_size: int, runtime: int, ids,
                 payloads) -> Tuple[list, list]:
        """This rank's dispatch: its receive planes ``[W, R, n]`` (payloads, ids, weights) and
        those whose padding rows must still hold POISON."""

    def counts(self, a2a, rank: int, ep_size: int, state: dict):
        """This round's receive counts on this rank: int32 ``[W]`` as bytes, on the device,
        copied before the combine."""

    def combine(self, a2a, world: World, y, runtime: int):
        """This rank's combine of the expert outputs ``y``: its combined rows."""


def ops_of(generation: Generation) -> ModuleType:
    """``generation``'s GPU ops module (imports torch and FlashInfer), with its ``Ops`` and
    ``PoolOps`` classes."""
    return importlib.import_module(generation.gpu_ops)
