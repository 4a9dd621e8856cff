"""The FlashInfer A2A generations the gate models, behind one interface.

``0.7.2`` (also 0.7.2.post1: the same A2A files) is ``MoeAlltoAll`` / ``moe_a2a_*`` over
``trtllm_moe_alltoall.cu`` (byte model: ``mnnvl.py``; GPU ops: ``gpu/mnnvl.py``); ``0.7.4`` is
the NVLink one-sided rewrite behind ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``
(``one_sided.py``; ``gpu/one_sided.py``). ``GENERATIONS`` is the one table of what differs
between them: no code outside this module names a version or compares kernels.

A session's default is one generation: ``--flashinfer=0.7.2|0.7.4``, else the installed
FlashInfer, else 0.7.2 (``active()``, read only where a default is chosen: the plugin's
option, ``World``'s default, the strategies' top-k, a load probe). A ``World`` carries its
generation (``World.flashinfer``, bound when it is made), and everything that runs a world
takes that one: the emulator, the checks' words, the engines, which enter the world's
generation for each step (``modelling``) so that their FlashInfer stand-ins answer with its
API (``in_force``). ``$A2A_GATE_FLASHINFER`` only carries the session's default to xdist
workers and rank processes.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from . import mnnvl, one_sided
from .payloads import Layout, PayloadSpec

__all__ = ["Generation", "GENERATIONS", "ENV", "DEFAULT", "PINNED_RELEASES_GENERATION", "active",
           "generation_of", "installed_version", "UnknownGeneration", "replay_flag", "using",
           "modelling", "in_force"]

ENV = "A2A_GATE_FLASHINFER"
DEFAULT = "0.7.2"
# The generation whose API every pinned SGLang and vLLM release calls (none runs on 0.7.4:
# docs/flashinfer.md's engine x FlashInfer table); their verdicts are measured on it
PINNED_RELEASES_GENERATION = "0.7.2"


class UnknownGeneration(ValueError):
    """A FlashInfer version the gate has no model for."""


@dataclass(frozen=True)
class Generation:
    """What the gate needs to know of one FlashInfer A2A generation."""

    version: str
    kernel: str  # the A2A it drives, as FlashInfer names it: "mnnvl" (MoeAlltoAll), "one_sided"
    supported_top_k: Tuple[int, ...]
    max_payloads: int
    max_ranks: int
    counter_banks: int  # receive-counter banks (0.7.4 alternates two by round parity)
    checks_local_rows: bool  # the op refuses a rank whose own rows exceed its runtime
    fixed_combine_region: bool  # the combine input no longer follows the runtime
    module_name: str  # the JIT module behind it
    gpu_ops: str  # the module of its GPU driver ops (``dispatcher.gpu.ops.ops_of`` opens it)
    _size: Callable[[int, int, Tuple[PayloadSpec, ...], int], int]
    _layout: Callable[..., Layout]
    _recv_counters: Callable[[int, int, Tuple[PayloadSpec, ...], int], int]

    def workspace_size(self, ep_size: int, max_num_tokens: int,
                       payloads: Tuple[PayloadSpec, ...], combine_bytes: int) -> int:
        """Bytes per rank the workspace has when sized for ``max_num_tokens``."""
        return self._size(ep_size, max_num_tokens, tuple(payloads), combine_bytes)

    def layout(self, ep_size: int, max_num_tokens: int, runtime: int,
               payloads: Tuple[PayloadSpec, ...], combine_bytes: int,
               sized_for: Optional[Tuple[PayloadSpec, ...]] = None) -> Layout:
        """Where one dispatch + combine with ``runtime`` rows puts things in a rank's workspace
        (``ValueError`` where the C++ op refuses the call). ``sized_for``: the payloads the
        workspace was allocated for, where they are not this call's (one workspace carrying
        layers of different formats is sized for the largest row; 0.7.4's regions follow it)."""
        return self._layout(ep_size, max_num_tokens, runtime, tuple(payloads), combine_bytes,
                            tuple(sized_for or payloads))

    def aux_end(self, ep_size: int, max_num_tokens: int,
                payloads: Tuple[PayloadSpec, ...], combine_bytes: int) -> int:
        """Where the first receive plane starts (counters, flags and routing tables before)."""
        return self.layout(ep_size, max_num_tokens, 1, payloads, combine_bytes).recv_offsets[0]

    def recv_counters_offset(self, ep_size: int, max_num_tokens: int,
                             payloads: Tuple[PayloadSpec, ...], combine_bytes: int) -> int:
        """Where the (first bank of) receive counters is."""
        return self._recv_counters(ep_size, max_num_tokens, tuple(payloads), combine_bytes)

    def __str__(self) -> str:
        return f"FlashInfer {self.version}"


def _size_mnnvl(ep, cap, payloads, combine_bytes):
    return mnnvl.workspace_size_per_rank(ep, cap, sum(p.bytes_per_token for p in payloads),
                                         combine_bytes)


def _layout_mnnvl(ep, cap, runtime, payloads, combine_bytes, sized_for):
    return mnnvl.layout(ep, cap, runtime, payloads, combine_bytes)  # offsets follow the call


def _recv_counters_mnnvl(ep, cap, payloads, combine_bytes):
    return mnnvl.aux_offsets(ep, cap).recv_counters


def _recv_counters_one_sided(ep, cap, payloads, combine_bytes):
    return one_sided.offsets_for(ep, cap, payloads, combine_bytes).recv_counters


GENERATIONS = {g.version: g for g in (
    Generation("0.7.2", "mnnvl", mnnvl.SUPPORTED_TOP_K, mnnvl.MAX_PAYLOADS, mnnvl.MAX_RANKS,
               counter_banks=1, checks_local_rows=False, fixed_combine_region=False,
               module_name="mnnvl_moe_alltoall", gpu_ops="dispatcher.gpu.mnnvl",
               _size=_size_mnnvl, _layout=_layout_mnnvl, _recv_counters=_recv_counters_mnnvl),
    Generation("0.7.4", "one_sided", one_sided.SUPPORTED_TOP_K, one_sided.MAX_PAYLOADS,
               one_sided.MAX_RANKS, counter_banks=2, checks_local_rows=True,
               fixed_combine_region=True, module_name="nvlink_one_sided_alltoall",
               gpu_ops="dispatcher.gpu.one_sided", _size=one_sided.workspace_size_per_rank,
               _layout=one_sided.layout, _recv_counters=_recv_counters_one_sided),
)}


# The releases whose A2A the gate models, as their packages are versioned (a pre-release or a
# later patch may change the kernels: it is not taken for its neighbour)
RELEASES = {"0.7.2": "0.7.2", "0.7.2.post1": "0.7.2", "0.7.4": "0.7.4"}


def generation_of(version: str) -> Generation:
    """The generation of FlashInfer release ``version`` (``0.7.2.post1`` is 0.7.2)."""
    from packaging.version import InvalidVersion, Version

    try:
        canonical = str(Version(str(version)))
    except InvalidVersion:
        raise UnknownGeneration(f"{version!r} is not a version; the gate models FlashInfer "
                                f"{', '.join(RELEASES)}") from None
    if canonical not in RELEASES:
        raise UnknownGeneration(f"FlashInfer {version}: the gate models the A2A of "
                                f"{', '.join(RELEASES)} only (a pre-release or another patch "
                                f"release may differ)")
    return GENERATIONS[RELEASES[canonical]]


@functools.lru_cache(maxsize=None)
def installed_version() -> Optional[str]:
    """The installed flashinfer-python's version (read from its metadata, never imported)."""
    from importlib import metadata

    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None


def active() -> Generation:
    """The session's generation: ``$A2A_GATE_FLASHINFER`` (the plugin sets it from
    ``--flashinfer``), else the installed FlashInfer, else 0.7.2."""
    return _resolve(os.environ.get(ENV) or installed_version() or DEFAULT)


@functools.lru_cache(maxsize=None)
def _resolve(version: str) -> Generation:
    return generation_of(version)


_IN_FORCE: "contextvars.ContextVar[Optional[Generation]]" = contextvars.ContextVar(
    "a2a_gate_step_generation", default=None)


@contextlib.contextmanager
def modelling(version: str):
    """Run engine code for generation ``version`` inside the block: an engine's sandbox enters
    the generation of the world whose step it runs (``world.flashinfer``), or the one a file is
    executed against, so the FlashInfer stand-ins the engine calls answer with that API."""
    generation = _resolve(version)
    token = _IN_FORCE.set(generation)
    try:
        yield generation
    finally:
        _IN_FORCE.reset(token)


def in_force() -> Generation:
    """The generation of the step an engine runs now (``modelling``). Engine code runs only
    inside its sandbox, which always enters one: asked outside it, this is the gate's bug."""
    generation = _IN_FORCE.get()
    if generation is None:
        raise LookupError("no engine step is running: FlashInfer's stand-ins answer only "
                          "inside an engine's sandbox, which enters the world's generation")
    return generation


def replay_flag(version: str) -> str:
    """`` --flashinfer=X`` for a replay line of a world of generation ``version`` when that is
    not the default (so the line reproduces the failure on any machine)."""
    version = _resolve(version).version
    return "" if version == DEFAULT else f" --flashinfer={version}"


@contextlib.contextmanager
def using(version: str):
    """Model ``version`` inside the block (for tests that check both generations), then
    restore the session's choice."""
    before = os.environ.get(ENV)
    os.environ[ENV] = generation_of(version).version
    try:
        yield active()
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
