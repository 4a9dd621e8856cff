"""The serving world the dispatcher lives in (SGLang's model; docs/model.md).

A ``World`` is one forward step of one MoE layer across all EP ranks: the topology, what the
scheduler recorded, the cap, and the MoE shapes. Everything a rank sees (``RankView``) and
every row count is *derived* from it, so a world cannot contradict itself.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cached_property, lru_cache
from typing import Optional, Tuple

import numpy as np

from ..sizing import RankView, ceil_align
from .generations import DEFAULT, GENERATIONS, Generation, active, generation_of
from .payloads import (Layout, PayloadFormat, PayloadSpec, combine_bytes_per_token,
                       dispatch_payloads)

__all__ = ["MoeConfig", "World", "DP_GLOBAL_KINDS", "ROUTINGS", "owned_experts", "owners_of"]

DP_GLOBAL_KINDS = ("recorded", "none", "empty")
_SUPPORTED_TOP_K = tuple(sorted({k for g in GENERATIONS.values() for k in g.supported_top_k}))
ROUTINGS = ("uniform", "hot_rank")


def owned_experts(rank: int, num_experts: int, ep_size: int) -> range:
    """Contiguous ownership with remainder: ranks ``< E % W`` own one extra expert."""
    base, rem = divmod(num_experts, ep_size)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (1 if rank < rem else 0))


def owners_of(expert_ids, num_experts: int, ep_size: int):
    """The EP rank owning each expert id (``compute_target_rank_id`` in FlashInfer's dispatch
    kernel); ids outside ``[0, num_experts)`` (stale rows) map to -1. ``expert_ids`` is a
    numpy array or a torch tensor (looked up in the same table, kept on its device)."""
    if hasattr(expert_ids, "astype"):
        e = expert_ids.astype("int64", copy=False)
        table = _owner_table(num_experts, ep_size)
        return table[np.where((e >= 0) & (e < num_experts), e, num_experts)]
    e = expert_ids.long()
    table = _owner_table_on(num_experts, ep_size, e.device)
    return table[e.where((e >= 0) & (e < num_experts), num_experts)]


@lru_cache(maxsize=512)
def _owner_table(num_experts: int, ep_size: int) -> np.ndarray:
    """Owner of each expert id ``0 .. E-1``, then -1 (where every out-of-range id looks):
    FlashInfer's arithmetic, contiguous ownership with the first ``E % W`` ranks one larger."""
    base, rem = divmod(num_experts, ep_size)
    split = rem * (base + 1)
    e = np.arange(num_experts, dtype=np.int64)
    own = np.where(e < split, e // (base + 1), rem + (e - split) // max(base, 1))
    table = np.append(own, -1)
    table.flags.writeable = False
    return table


@lru_cache(maxsize=512)
def _owner_table_on(num_experts: int, ep_size: int, device):
    import torch

    return torch.from_numpy(_owner_table(num_experts, ep_size).copy()).to(device)


def _require_ints(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if type(value) is not int:
            raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def short_repr(obj) -> str:
    """``Name(field=value, ...)`` with default-valued fields left out: a one-line replay."""
    parts = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        default = f.metadata.get("shown_unless", f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING))
        if default is MISSING or value != default:
            parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


MAX_EXPERTS = 1 << 16  # real layers: 8..512; FlashInfer's expert ids are int32
MAX_HIDDEN = 1 << 17  # real layers: 2048..16384


@dataclass(frozen=True, repr=False)
class MoeConfig:
    """MoE shapes of the layer and how its tensors are made (from ``seed``, no hidden RNG)."""

    hidden_size: int = 128
    top_k: int = 8
    num_experts: int = 64
    payload: str = "bf16"  # a PayloadFormat value: bf16 | nvfp4 | mxfp8
    routing: str = "uniform"  # uniform | hot_rank (every token to one EP rank's experts)
    seed: int = 0

    def __post_init__(self):
        _require_ints(self, "hidden_size", "top_k", "num_experts", "seed")
        if self.hidden_size < 1 or self.hidden_size % 2 or self.hidden_size > MAX_HIDDEN:
            raise ValueError(f"hidden_size={self.hidden_size} must be a positive even number "
                             f"up to {MAX_HIDDEN}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be in 0..2**32-1 (a numpy seed)")
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(f"num_experts={self.num_experts} is more than {MAX_EXPERTS} (no "
                             f"MoE layer has that many; the model would allocate per expert)")
        if self.top_k not in _SUPPORTED_TOP_K:
            raise ValueError(f"top_k={self.top_k} not in any FlashInfer A2A's top_k: "
                             f"{_SUPPORTED_TOP_K}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} not in {ROUTINGS}")
        PayloadFormat(self.payload)

    @property
    def payload_format(self) -> PayloadFormat:
        return PayloadFormat(self.payload)

    @property
    def payloads(self) -> Tuple[PayloadSpec, ...]:
        """What a dispatcher hands to ``moe_a2a_dispatch``, in order (bytes per token)."""
        return dispatch_payloads(self.payload_format, self.hidden_size, self.top_k)

    @property
    def dispatch_bytes(self) -> int:
        return sum(p.bytes_per_token for p in self.payloads)

    @property
    def combine_bytes(self) -> int:
        return combine_bytes_per_token(self.hidden_size)

    __repr__ = short_repr

    def _repr_pretty_(self, printer, cycle):  # Hypothesis/IPython: print the one-line replay
        printer.text(repr(self))


@dataclass(frozen=True, repr=False)
class World:
    """One step of one MoE layer on ``ep_size`` EP ranks.

    ``group_tokens[g]`` is DP group ``g``'s scheduler token count before padding (one group
    when DP attention is off). ``dp_global_kind`` says what ``get_dp_global_num_tokens()``
    returns: the recorded list, ``None`` or ``[]`` (nothing recorded: every group runs the
    same batch, as in CUDA-graph capture).
    """

    ep_size: int
    dp_size: int
    group_tokens: Tuple[int, ...]
    max_num_tokens: int
    dp_global_kind: str = "recorded"
    max_len_padding: bool = False
    moe: MoeConfig = field(default_factory=MoeConfig)
    # The FlashInfer generation whose A2A this world runs on: bound when the world is made (the
    # session's, --flashinfer), so a world's bytes never depend on where it is read; shown in
    # its repr unless it is the default generation
    flashinfer: str = field(default_factory=lambda: active().version,
                            metadata={"shown_unless": DEFAULT})

    def __post_init__(self):
        _require_ints(self, "ep_size", "dp_size", "max_num_tokens")
        if self.flashinfer not in GENERATIONS:  # a release (0.7.2.post1) names its generation
            object.__setattr__(self, "flashinfer", generation_of(self.flashinfer).version)
        if not (isinstance(self.group_tokens, tuple)
                and all(type(n) is int for n in self.group_tokens)):
            raise ValueError(f"group_tokens must be a tuple of ints, got {self.group_tokens!r}")
        if not isinstance(self.moe, MoeConfig):
            raise ValueError(f"moe must be a MoeConfig, got {type(self.moe).__name__}")
        gen = self.generation
        if not 1 <= self.ep_size <= gen.max_ranks:
            raise ValueError(f"ep_size={self.ep_size} outside {gen}'s 1..{gen.max_ranks}")
        if self.moe.top_k not in gen.supported_top_k:
            raise ValueError(f"top_k={self.moe.top_k} not in {gen}'s {gen.supported_top_k}")
        if self.dp_size < 1 or self.ep_size % self.dp_size:
            raise ValueError(f"dp_size={self.dp_size} must divide ep_size={self.ep_size}")
        if len(self.group_tokens) != self.dp_size:
            raise ValueError(f"{len(self.group_tokens)} group counts for dp_size={self.dp_size}")
        if min(self.group_tokens) < 0:
            raise ValueError(f"negative token count in {self.group_tokens}")
        if self.dp_global_kind not in DP_GLOBAL_KINDS:
            raise ValueError(f"dp_global_kind={self.dp_global_kind!r} not in {DP_GLOBAL_KINDS}")
        if self.dp_global_kind != "recorded" and len(set(self.group_tokens)) > 1:
            raise ValueError("dp_global unrecorded (None/[]) only when every group runs the "
                             "same batch")
        if self.max_len_padding and self.dp_size == 1:
            raise ValueError("MAX_LEN padding is a DP-attention mode (dp_size > 1)")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={self.max_num_tokens} must be >= 1")
        if self.moe.num_experts < max(self.ep_size, self.moe.top_k):
            raise ValueError(f"num_experts={self.moe.num_experts} < max(ep_size, top_k)")

    __repr__ = short_repr

    def _repr_pretty_(self, printer, cycle):  # Hypothesis/IPython: print the one-line replay
        printer.text(repr(self))

    # --- topology -------------------------------------------------------------------------
    @property
    def attn_tp_size(self) -> int:
        return self.ep_size // self.dp_size

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    # --- what the scheduler and the scatter produce ----------------------------------------
    @cached_property
    def padded_group_tokens(self) -> Tuple[int, ...]:
        """Each group's count padded to attn_tp (all raised to the max in MAX_LEN mode)."""
        padded = tuple(ceil_align(n, self.attn_tp_size) for n in self.group_tokens)
        if self.max_len_padding:
            padded = (max(padded),) * self.dp_size
        return padded

    @cached_property
    def rows_per_rank(self) -> Tuple[int, ...]:
        """``x.shape[0]`` on each EP rank after the attention-TP scatter."""
        tp = self.attn_tp_size
        return tuple(self.padded_group_tokens[r // tp] // tp for r in range(self.ep_size))

    @property
    def dp_global(self) -> Optional[Tuple[int, ...]]:
        if self.dp_global_kind == "none":
            return None
        if self.dp_global_kind == "empty":
            return ()
        return self.padded_group_tokens

    @property
    def max_rows(self) -> int:
        return max(self.rows_per_rank)

    @property
    def ideal_runtime(self) -> int:
        """The value every rank should pass: the largest post-scatter row count, at least 1."""
        return max(1, self.max_rows)

    @property
    def payload_fits_cap(self) -> bool:
        """Whether a valid runtime exists at all (every rank's rows fit the workspace cap)."""
        return self.max_rows <= self.max_num_tokens

    def on(self, flashinfer) -> "World":
        """This world on another FlashInfer generation (a version or a ``Generation``)."""
        return replace(self, flashinfer=getattr(flashinfer, "version", flashinfer))

    @property
    def generation(self) -> Generation:
        """The FlashInfer A2A generation this world runs on (``flashinfer``)."""
        return GENERATIONS[self.flashinfer]

    @property
    def workspace_size(self) -> int:
        """Bytes per rank FlashInfer's workspace has for this world's cap and MoE shapes."""
        return self.generation.workspace_size(self.ep_size, self.max_num_tokens,
                                              self.moe.payloads, self.moe.combine_bytes)

    def layout(self, runtime: int, sized_for=None) -> Layout:
        """Where one dispatch + combine with ``runtime`` rows puts things in a workspace
        (allocated for the payloads ``sized_for``, default this world's)."""
        return self.generation.layout(self.ep_size, self.max_num_tokens, runtime,
                                      self.moe.payloads, self.moe.combine_bytes, sized_for)

    def rank_view(self, ep_rank: int) -> RankView:
        return RankView(ep_rank=ep_rank, ep_size=self.ep_size, dp_size=self.dp_size,
                        attn_tp_size=self.attn_tp_size, dp_global=self.dp_global,
                        local_tokens=self.rows_per_rank[ep_rank],
                        max_num_tokens=self.max_num_tokens)

    @cached_property
    def views(self) -> Tuple[RankView, ...]:
        return tuple(self.rank_view(r) for r in range(self.ep_size))

    # --- for readers ------------------------------------------------------------------------
    def describe(self) -> str:
        """The world in words, for failure messages."""
        mode = (f"DP attention on (dp={self.dp_size}, attn_tp={self.attn_tp_size}"
                f"{', MAX_LEN padding' if self.max_len_padding else ''})"
                if self.dp_attention else f"DP attention off (SP scatter over attn_tp={self.attn_tp_size})")
        dpg = self.dp_global
        return "\n".join([
            f"  ep_size={self.ep_size}  {mode}",
            f"  scheduler tokens per DP group: {list(self.group_tokens)}"
            f" -> padded {list(self.padded_group_tokens)}",
            f"  dp_global (get_dp_global_num_tokens): {None if dpg is None else list(dpg)}",
            f"  payload rows per EP rank (x.shape[0]): {_compact(self.rows_per_rank)}",
            f"  workspace cap max_num_tokens={self.max_num_tokens}; ideal runtime="
            f"{self.ideal_runtime}{'' if self.payload_fits_cap else '  (payload OVER the cap)'}",
            f"  moe: {self.moe}  (on {self.generation}'s A2A)",
        ])


def _compact(values) -> str:
    values = list(values)
    if len(values) > 16:
        return f"{values[:8]} ... {values[-4:]} ({len(values)} ranks)"
    return str(values)
