"""Run vLLM's own FlashInfer NVLink ``prepare()``, unmodified, as a sizing policy.

``load_release(path)`` executes one ``flashinfer_nvlink_one_sided.py`` (or its two-sided
sibling) of any release 0.18-0.34 or a checkout, with ``sys.modules`` patched to the
stand-ins of ``standins.py`` and, where the tree has them, vLLM's own modules beside the file
(``release_modules.py``: the all-to-all managers among them). The class is built by its own
``__init__`` (which initialises the EP group's all-to-all manager with the cap) and
``prepare()`` runs as shipped on CPU tensors, until the recorder stops it at FlashInfer's
launch.

How a world becomes vLLM's inputs (docs/vllm.md has the source lines):

- EP rank ``r`` is DP rank ``r // tp``, TP rank ``r % tp`` (vLLM's EP group is DP x TP);
- ``num_tokens_across_dp`` is each DP group's count, every one raised to the largest when
  the world pads DP ranks to one size (vLLM's cross-DP padding for CUDA graphs);
- with DP > 1 and TP > 1 the one-sided backend runs sequence-parallel MoE
  (``ParallelConfig.use_sequence_parallel_moe``): each TP rank holds ``ceil(n / tp)`` rows,
  and ``dp_metadata.local_sizes`` are made by the release's own ``_compute_sp_num_tokens``;
- DP = 1 with several EP ranks is prefill context parallelism (``PCP with DP=1``): no DP
  metadata, every rank holds an equal chunk;
- the cap is ``max_num_batched_tokens``, which no DP rank's batch exceeds, and an idle DP
  rank runs a dummy batch of one token, so worlds outside that are not vLLM's
  (``NotApplicable``).
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..model.vllm_world import as_vllm_world, not_producible
from ..model.generations import active
from ..model.engine import EnginePolicy, EngineStep
from ..model.guard import GateInterrupt
from ..model.world import World
from ..sizing import NotApplicable, RankView
from ..releases.companions import Companions
from ..releases.tree import Tree
from ..sandbox.engine_tensors import stand_in_rows
from ..sandbox.standins import StandIn, exec_engine_file
from ..releases.wheels import ReleaseError
from . import fetch
from .release_modules import MANAGER_CLASSES, CpuGroup
from .sides import SIDES, _side_of
from .sandbox import ALL2ALL, _sandbox, header_note  # noqa: F401 - header_note: the report's
from .standins import Launch, Launched, OneSidedManager, QuantConfig, State, current

__all__ = ["SIDES", "Outcome", "VLLMRelease", "BoundVLLMStep", "VLLMError", "load_release",
           "load_tree", "tree_of", "tree_of_spec", "release_from_spec"]


class VLLMError(AssertionError):
    """vLLM's own prepare() raised where it had to size the all-to-all."""


@dataclass(frozen=True)
class Outcome:
    """What one EP rank's prepare() did: launched (``launch``) or raised ``error``;
    ``seen_local_sizes`` is what ``get_chunk_sizes_across_dp_rank()`` handed it."""

    launch: Optional[Launch] = None
    error: Optional[str] = None
    seen_local_sizes: object = "not read"

    @property
    def runtime(self):
        return None if self.launch is None else self.launch.runtime


def num_tokens_across_dp(world: World) -> List[int]:
    """What vLLM's DP coordination records for the step (``DPMetadata.num_tokens_across_dp_cpu``)."""
    counts = list(world.group_tokens)
    return [max(counts)] * len(counts) if world.max_len_padding else counts


@dataclass(repr=False, eq=False)
class VLLMRelease(EnginePolicy):
    """One vLLM prepare/finalize file loaded with stand-ins: ``outcome()`` runs one rank's
    prepare(), ``bind(world)`` is the per-rank policy the properties check."""

    engine = "vllm"  # an engine policy (dispatcher/__main__.py, the tiers tell them apart)

    path: Path
    label: str
    loaded: Dict[str, object]  # FlashInfer generation -> the file executed against it
    sha256: str
    side: str
    compute_sp: Callable = None  # vLLM's _compute_sp_num_tokens (dispatcher.releases.companions)
    tree: Optional[Tree] = None  # the tree under test: the vLLM code beside the file
    _instances: "OrderedDict[tuple, tuple]" = field(default_factory=OrderedDict, repr=False)
    _inputs: Dict[tuple, tuple] = field(default_factory=dict, repr=False)
    MAX_INSTANCES = 16384  # one per rank and layer shape; cheap objects

    @property
    def spec(self) -> str:
        return f"vllm:{self.label}" + ("@two-sided" if self.side == "two-sided" else "")

    @property
    def companions(self) -> Optional[Companions]:
        return self.tree.companions if self.tree else None

    @property
    def root(self) -> Optional[Path]:
        """The tree whose vLLM modules run beside the file."""
        return self.tree.root if self.tree else None

    @property
    def runs_modelled_a2a(self) -> bool:
        return self.side != "two-sided"  # MnnvlMoe's kernels: not this workspace

    def module(self, version: str):
        """The file as executed against FlashInfer generation ``version`` (a world's: its
        imports of ``flashinfer.comm`` differ by generation), executed once per generation."""
        if version not in self.loaded:
            self.loaded[version] = _exec(self.path, self.sha256, version, self.side, self.root)
        return self.loaded[version]

    def __repr__(self):
        return self.spec

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    def __call__(self, view: RankView) -> int:
        raise TypeError(f"{self.spec} runs vLLM's prepare() for a whole world: call "
                        f"bind(world)(view), as dispatcher.model.properties.rule_values does")

    def bind(self, world: World) -> "BoundVLLMStep":
        return BoundVLLMStep(self, world)

    def engine_world(self, world: World, keep_cap: bool = False) -> World:
        """The nearest world vLLM runs with this backend (``NotApplicable`` if none); with
        ``keep_cap`` only at the same cap (a rank pool's workspaces are built per cap)."""
        world = as_vllm_world(world, raise_cap=not keep_cap, side=self.side)
        reason = not_producible(world, self.side)
        if reason:
            raise NotApplicable(reason)
        return world

    # --- what the runner hands prepare() ---------------------------------------------------
    def sp_size(self, world: World) -> int:
        """``use_sequence_parallel_moe``: DP > 1 and TP > 1 on the one-sided backend."""
        sp = world.dp_size > 1 and world.attn_tp_size > 1 and self.side == "one-sided"
        return world.attn_tp_size if sp else 1

    def local_sizes(self, world: World):
        """``dp_metadata.local_sizes`` (None: no DP metadata), from the release's own split."""
        if world.dp_size == 1:
            return None
        import torch

        accepted = _params(self.compute_sp)
        extra = {k: v for k, v in (("pcp_size", 1), ("use_ep", True)) if k in accepted}
        sizes = self.compute_sp(torch.tensor(num_tokens_across_dp(world)), self.sp_size(world),
                                **extra)
        return list(sizes)

    def _layer(self, world: World, rank: int, state: State):
        """This rank's prepare/finalize object, built by its own ``__init__`` (which
        initialises the rank's all-to-all manager, kept with it and set on ``state``)."""
        moe = world.moe
        key = (world.ep_size, world.dp_size, rank, moe.hidden_size, moe.top_k, moe.num_experts,
               moe.payload, world.max_num_tokens, world.flashinfer)
        if key in self._instances:
            self._instances.move_to_end(key)
            layer, state.manager = self._instances[key]
            return layer
        state.manager = self._manager(world, rank)
        if len(self._instances) >= self.MAX_INSTANCES:
            self._instances.popitem(last=False)
        hidden, scales = moe.payloads[0].bytes_per_token, (
            moe.payloads[1].bytes_per_token if moe.payload != "bf16" else 0)
        known = dict(max_num_tokens=world.max_num_tokens, top_k=moe.top_k,
                     num_experts=moe.num_experts, hidden_size=moe.hidden_size,
                     num_dispatchers=world.ep_size, x_bytes_per_token=hidden,
                     x_sf_bytes_per_token=scales, dispatch_scale_bytes_per_token=scales,
                     dispatch_dtype_bytes_per_elem=hidden // moe.hidden_size or 1,
                     dispatch_format=None, extra_payload_bytes_per_token=0)
        cls = getattr(self.module(world.flashinfer), SIDES[self.side])
        takes, required = _init_params(cls)
        unknown = required - set(known)
        if unknown:
            raise ReleaseError(f"{self.spec}: {SIDES[self.side]}.__init__ takes "
                               f"{sorted(unknown)}, which this gate does not know how to fill")
        layer = cls(**{k: v for k, v in known.items() if k in takes})
        self._instances[key] = (layer, state.manager)
        return layer

    def _manager(self, world: World, rank: int):
        """This rank's all-to-all manager: the release's own class, constructed as vLLM's EP
        group does (``cls(cpu_group)``), where the sandbox holds it; else the stand-in."""
        own = sys.modules.get(ALL2ALL)
        cls = getattr(own, MANAGER_CLASSES[self.side], None) if isinstance(
            own, types.ModuleType) and not isinstance(own, StandIn) else None
        return cls(CpuGroup(rank, world.ep_size)) if cls else OneSidedManager(world, rank)

    def _tensors(self, n: int, moe):
        key = (n, moe.hidden_size, moe.top_k, moe.num_experts)
        if key not in self._inputs:
            if len(self._inputs) > 256:
                self._inputs.clear()
            self._inputs[key] = stand_in_rows(n, moe.hidden_size, moe.top_k, moe.num_experts)
        return self._inputs[key]

    def outcome(self, world: World, rank: int) -> Outcome:
        """Run this release's prepare() as EP rank ``rank`` of ``world``."""
        reason = not_producible(world, self.side)
        if reason:
            raise NotApplicable(reason)
        with _sandbox(world.flashinfer, self.root, self.side):
            return self._run_rank(world, rank, self.local_sizes(world))

    def step(self, world: World) -> List[Outcome]:
        """Every EP rank's outcome for one step (the stand-ins entered, the sizes made once)."""
        reason = not_producible(world, self.side)
        if reason:
            raise NotApplicable(reason)
        sizes = self.local_sizes(world)
        with _sandbox(world.flashinfer, self.root, self.side):
            return [self._run_rank(world, r, sizes) for r in range(world.ep_size)]

    def _run_rank(self, world: World, rank: int, local_sizes) -> Outcome:
        state = State(world, rank, local_sizes)
        token = current.set(state)
        try:
            layer = self._layer(world, rank, state)
            a1, weights, ids = self._tensors(world.rows_per_rank[rank], world.moe)
            args = dict(a1=a1, topk_weights=weights, topk_ids=ids,
                        num_experts=world.moe.num_experts, expert_map=None,
                        apply_router_weight_on_input=False,
                        quant_config=QuantConfig.of(world.moe.payload), defer_input_quant=False)
            layer.prepare(**{k: v for k, v in args.items() if k in _params(type(layer).prepare)})
            return Outcome(error="prepare() returned without launching the all-to-all",
                           seen_local_sizes=state.seen_local_sizes)
        except Launched as launched:
            return Outcome(launch=launched.record, seen_local_sizes=state.seen_local_sizes)
        except ReleaseError:
            raise
        except (KeyboardInterrupt, GateInterrupt):  # the gate stopped the call
            raise
        except BaseException as exc:  # noqa: BLE001 - vLLM's own verdict, whatever it raised
            return Outcome(error=f"{type(exc).__name__}: {exc}",
                           seen_local_sizes=state.seen_local_sizes)
        finally:
            current.reset(token)


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


@functools.lru_cache(maxsize=None)
def _init_params(cls) -> tuple:
    """(every parameter ``cls.__init__`` takes, the ones without a default)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    plain = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return frozenset(p.name for p in plain), frozenset(p.name for p in plain if p.default is p.empty)


class BoundVLLMStep(EngineStep):
    """A release bound to one world: called with a rank's view it returns the per-rank
    maximum that rank's prepare() launched with; ``notes()`` says what each rank saw."""


    replay_args = ""

    def __init__(self, release: VLLMRelease, world: World):
        reason = not_producible(world, release.side)
        if reason:
            raise NotApplicable(reason)
        self.release, self.world = release, world
        self.outcomes: Optional[List[Outcome]] = None
        self._served: set = set()
        self.spec = release.spec
        self.replay_args = release.companions.replay_flag if release.companions else ""

    def __call__(self, view: RankView) -> int:
        rank = view.ep_rank
        if self.outcomes is None:
            self.outcomes = self.release.step(self.world)
        out = self.outcomes[rank]
        if rank in self._served:
            out = self.release.outcome(self.world, rank)
        self._served.add(rank)
        if out.error:
            raise VLLMError(f"vLLM {self.release.label} prepare() raised {out.error}")
        return out.runtime

    def notes(self) -> str:
        if not self.outcomes:
            return ""
        return (f"  what vLLM {self.release.label} ({self.release.side}) saw and did:\n"
                + describe_outcomes(self.outcomes, self.world))


def describe_outcomes(outcomes: List[Outcome], world: World) -> str:
    """One line per distinct rank behaviour: the local sizes read and the launch or error."""
    lines: "OrderedDict[str, List[int]]" = OrderedDict()
    for rank, o in enumerate(outcomes):
        did = (f"launched {o.launch.api} with max tokens per rank {o.launch.runtime!r} "
               f"(cap {o.launch.max_num_tokens})" if o.launch else f"raised {o.error}")
        sizes = ("no DP metadata" if o.seen_local_sizes is None else
                 f"local sizes {o.seen_local_sizes}" if o.seen_local_sizes != "not read" else
                 "local sizes not read")
        lines.setdefault(f"{sizes}, x.shape[0]={world.rows_per_rank[rank]}: {did}", []).append(rank)
    return "\n".join(f"    ranks {_ranges(r)}: {what}" for what, r in lines.items())


def _ranges(ranks: List[int]) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else (
        f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks))


_LOADED: Dict[tuple, VLLMRelease] = {}
_MODULES: Dict[str, object] = {}


def _exec(path: Path, digest: str, version: str, side: str, root: Optional[Path]):
    """The file executed against the FlashInfer generation ``version`` with the modules of
    the tree ``root`` beside it."""
    name = f"_a2a_gate_vllm_{digest[:16]}_{version.replace('.', '_')}_{side.replace('-', '_')}"
    if name not in _MODULES:
        _MODULES[name] = exec_engine_file(path, name, _sandbox(version, root, side), "vllm")
    return _MODULES[name]


def tree_of(path, label: Optional[str] = None) -> Tree:
    """The tree of one prepare/finalize file (``dispatcher/releases/tree.py``): read, nothing of it run;
    its ``root`` is the tree whose vLLM modules run beside it (its own, or for a lone file the
    release its companions come from: the one it is identical to, else the newest pinned)."""
    path = Path(path).resolve()
    if not path.is_file() or path.suffix != ".py":
        raise ReleaseError(f"vllm:{path}: expected vLLM's flashinfer_nvlink_one_sided.py (or "
                           f"two_sided), a vLLM checkout, a wheel or a release version")
    if _side_of(path) is None:
        raise ReleaseError(f"vllm:{path} defines neither {' nor '.join(SIDES.values())}: it is "
                           f"not vLLM's FlashInfer NVLink prepare/finalize file")
    return fetch.CODE.at(path, label)


def load_release(path, label: Optional[str] = None) -> VLLMRelease:
    """Load one vLLM prepare/finalize file with the vLLM code beside it (once per content of
    both per process)."""
    return load_tree(tree_of(path, label))


def load_tree(tree: Tree) -> VLLMRelease:
    """The tree's prepare/finalize file executed with the tree's vLLM modules beside it, and
    vLLM's SP split compiled from the tree. It is first executed against the session's default
    generation (the load probe); each world's step runs the file as executed against that
    world's own generation (``VLLMRelease.module``)."""
    if tree.key in _LOADED:
        return _LOADED[tree.key]
    import torch

    side = _side_of(tree.main)
    split = tree.function("_compute_sp_num_tokens", {"torch": torch})
    version = active().version  # a default: the session's generation, for the load probe
    module = _exec(tree.main, tree.digest, version, side, tree.root)
    release = VLLMRelease(tree.main, tree.label, {version: module}, tree.digest, side,
                          split, tree=tree)
    _LOADED[tree.key] = release
    return release


def _split(target: str):
    """``(target, side)`` of ``TARGET[@one-sided|@two-sided]``."""
    head, at, tail = target.rpartition("@")
    if at and tail in ("one-sided", "two-sided"):
        return head, tail
    if at and not Path(target).exists():  # a path may hold "@" (a CI workspace: job@2)
        raise ReleaseError(f"vllm:{target}: the suffix @{tail} selects no backend: @one-sided "
                           f"(the default) or @two-sided")
    return target, ""


def main_path(target: str):
    """``(file, label)`` for ``vllm:TARGET[@two-sided]`` (nothing of it run)."""
    target, side = _split(target)
    path, label = fetch.CODE.main_file(target)
    if side == "two-sided" and path.name in {Path(rel).name for rel in fetch.TWO_SIDED}:
        return path, label  # the two-sided file itself, named alone
    if side == "two-sided":
        sibling = next((f for f in (fetch.PACKAGE.companion_file(path, rel)
                                    for rel in fetch.TWO_SIDED) if f is not None), None)
        if sibling is None:
            raise ReleaseError(f"vllm:{target}@two-sided: no {' or '.join(fetch.TWO_SIDED)} "
                               f"beside {path}")
        path = sibling
    return path, label


def tree_of_spec(target: str) -> Tree:
    """The tree ``vllm:TARGET[@two-sided]`` names (nothing of it run)."""
    return tree_of(*main_path(target))


def release_from_spec(target: str) -> VLLMRelease:
    """``vllm:TARGET[@two-sided]``: "" (installed), a version, a wheel, a checkout or the file."""
    side = _split(target)[1]
    release = load_tree(tree_of_spec(target))
    path = release.path
    if side and release.side != side:
        raise ReleaseError(f"vllm:{target}: {path.name} is the {release.side} file")
    return release
