"""An exact CPU model of FlashInfer's MoE all-to-all (``moe_a2a_dispatch`` / ``_combine``).

Each rank's workspace is a byte array laid out by ``workspace.layout``; dispatch writes every
token's payload rows to ``recv_plane[target][payload] + (src_rank * R + send_index) * bytes``
exactly as ``vectorized_dispatch_impl`` does, with ``R`` the *sender's* runtime, one copy per
distinct target rank (duplicates collapse, as ``__match_any_sync`` does); combine reads the
target's staged expert output at ``combine_offset + (src_rank * R + send_index) * bytes``. So
an undersized or rank-variant runtime corrupts exactly the bytes the kernel would, and
``A2AModel.events`` names each write or read that left its slot. The kernel hands out send indices
with ``atomicAdd`` (any order); the model uses token order, one of the kernel's legal orders.

Both FlashInfer generations (``model/generations.py``): on 0.7.2 the combine region follows the
runtime and the receive counters are one bank; on 0.7.4 (``moeAlltoAllKernels.cu``) the combine
input sits at a fixed offset, the receive counters alternate between two banks by round parity,
the combine prepare stages only the rows each source's count covers, and a rank whose own rows
exceed its runtime is refused by the op (``RankRefused``) while its peers, already launched,
wait for it until ``timeout_sec`` and trap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..model.generations import Generation
from ..model.payloads import INT32, Layout, PayloadSpec
from ..model.one_sided import round_parity
from .inputs import (RankInputs, from_bf16_bits, to_bf16_bits)

__all__ = ["SlotEvent", "IllegalAddress", "RankRefused", "A2AModel", "Round", "POISON"]

POISON = 0xA5  # unused slots hold this, so stale rows are visible


class IllegalAddress(RuntimeError):
    """A write or read past a rank's workspace: on a GPU, an illegal-address fault."""


class RankRefused(RuntimeError):
    """The dispatch op of a generation that checks a rank's own rows refused some ranks' calls
    ("Local token count exceeds the runtime capacity"); the ranks it accepted launched and wait
    for the refused ones."""

    def __init__(self, refused: Sequence[int], runtimes: Sequence[int], rows: Sequence[int],
                 generation: str = "FlashInfer"):
        self.refused = tuple(refused)
        self.waiting = tuple(r for r in range(len(runtimes)) if r not in self.refused)
        detail = ", ".join(f"rank {r}: {rows[r]} rows > runtime {runtimes[r]}" for r in refused)
        super().__init__(
            f"{generation} refuses the dispatch on {len(self.refused)} rank(s) ({detail}): "
            f"RuntimeError 'Local token count exceeds the runtime capacity'. "
            + (f"Ranks {list(self.waiting)} launched and wait for them until timeout_sec, then "
               f"trap (the CUDA context is lost)." if self.waiting else ""))


@dataclass(frozen=True)
class SlotEvent:
    """One row that the kernel moves to or from a place other than its slot."""

    phase: str  # dispatch | combine
    source_rank: int
    target_rank: int
    token: int
    payload: str
    send_index: int
    sender_runtime: int
    receiver_runtime: int
    lands_in: str

    def __str__(self) -> str:
        verb = "wrote" if self.phase == "dispatch" else "read"
        return (f"{self.phase}: rank {self.source_rank} token {self.token} -> rank "
                f"{self.target_rank} {self.payload} send_index {self.send_index} "
                f"(sender runtime {self.sender_runtime}, receiver runtime "
                f"{self.receiver_runtime}) {verb} {self.lands_in}")


def _where(lay: Layout, offset: int, aux_end: int) -> str:
    """Name the place ``offset`` falls in, in a receiver laid out by ``lay``."""
    if offset < aux_end:
        return "the aux region (counters/flags)"
    for q, p in enumerate(lay.payloads):
        start = lay.recv_offsets[q]
        plane = lay.ep_size * lay.runtime * p.bytes_per_token
        if start <= offset < start + plane:
            src, row = divmod((offset - start) // p.bytes_per_token, lay.runtime)
            return f"{p.name} slot of source rank {src}, row {row}"
    if lay.dispatch_end <= offset < lay.combine_offset:
        return "past the dispatch planes (padding, unused dispatch capacity, combine flags)"
    if lay.combine_offset <= offset < lay.combine_end:
        src, row = divmod((offset - lay.combine_offset) // lay.combine_bytes, lay.runtime)
        return f"combine slot of source rank {src}, row {row}"
    return "the unused tail of the workspace"


@dataclass(frozen=True)
class Round:
    """One A2A round: every rank's runtime, the payloads it moves, each rank's layout of the
    workspace for it, its inputs and each source's (token, target, send index) rows."""

    runtimes: Tuple[int, ...]
    payloads: Tuple[PayloadSpec, ...]
    layouts: Tuple[Layout, ...]
    inputs: Tuple[RankInputs, ...]
    sends: Tuple[Tuple[np.ndarray, np.ndarray, np.ndarray], ...]


class A2AModel:
    """W ranks' workspaces (``[W, size_per_rank]`` bytes, sized for the cap and the payloads
    given, the widest a round may move) and the two collective calls, each taking every rank's
    arguments at once; or their steps (``begin_dispatch``, ``push``, ``finish_dispatch``,
    ``stage``, ``read``) to run rounds back to back in an order the protocol allows."""

    def __init__(self, ep_size: int, max_num_tokens: int, payloads: Sequence[PayloadSpec],
                 combine_bytes: int, generation: Generation):
        self.ep_size = ep_size
        self.max_num_tokens = max_num_tokens
        self.payloads = tuple(payloads)
        self.combine_bytes = combine_bytes
        self.generation = gen = generation
        self.size_per_rank = gen.workspace_size(ep_size, max_num_tokens, self.payloads,
                                                combine_bytes)
        self.aux_end = gen.aux_end(ep_size, max_num_tokens, self.payloads, combine_bytes)
        self.recv_counters = gen.recv_counters_offset(ep_size, max_num_tokens, self.payloads,
                                                      combine_bytes)
        self.flag_val = 0  # moe_a2a_initialize: 0; each dispatch and each combine adds 1
        # moe_a2a_initialize zeroes each rank (0.7.4: its receive counters to -1); we poison
        # the planes so stale rows show. Bytes are materialised lazily up to the furthest one
        # touched (caps reach 16384 rows).
        self.workspace = np.zeros((ep_size, self.aux_end), dtype=np.uint8)
        if gen.counter_banks == 2:
            self.workspace[:, self.recv_counters:self.recv_counters + 2 * ep_size * INT32] = 0xFF
        self.events: List[SlotEvent] = []  # every row moved to or from a place not its slot
        self.round: Optional[Round] = None  # the latest round a dispatch began
        self.written: Optional[np.ndarray] = None  # see watch_writes
        self.overwritten: List[int] = []

    def _ensure(self, end: int) -> None:
        """Materialise every rank's workspace up to byte ``end`` (poisoned, never written)."""
        have = self.workspace.shape[1]
        if end > have:
            end = min(self.size_per_rank, max(end, 2 * have))
            grown = np.full((self.ep_size, end), POISON, dtype=np.uint8)
            grown[:, :have] = self.workspace
            self.workspace = grown
            if self.written is not None:
                wider = np.full((self.ep_size, end), -1, dtype=np.int16)
                wider[:, :have] = self.written
                self.written = wider

    def _layout(self, runtime: int, payloads: Tuple[PayloadSpec, ...]) -> Layout:
        lay = self.generation.layout(self.ep_size, self.max_num_tokens, runtime, payloads,
                                     self.combine_bytes, self.payloads)
        if lay.dispatch_end > self.size_per_rank:  # the C++ op's TVM_FFI_ICHECK
            raise ValueError(f"workspace size per rank insufficient, need {lay.dispatch_end} "
                             f"bytes but has {self.size_per_rank}")
        return lay

    def _routes(self, owners: np.ndarray):
        """(token, target) for each first top-k slot per distinct target, and its send index."""
        n, k = owners.shape
        earlier = np.tril(np.ones((k, k), dtype=bool), -1)  # [k, j]: j < k
        dup = ((owners[:, :, None] == owners[:, None, :]) & earlier).any(axis=2)
        tok, kk = np.nonzero(~dup)  # row-major: token order, then k
        tgt = owners[tok, kk]
        onehot = tgt[:, None] == np.arange(self.ep_size)[None, :]
        idx = (np.cumsum(onehot, axis=0)[np.arange(len(tgt)), tgt] - 1) if len(tgt) else tgt
        return tok, tgt, idx.astype(np.int64)

    def dispatch(self, runtimes: Sequence[int], inputs: Sequence[RankInputs],
                 payloads: Optional[Sequence[PayloadSpec]] = None):
        """All ranks' ``moe_a2a_dispatch``; returns each rank's receive planes
        (``[W, R_rank, bytes]`` views per payload) and the recv-count matrix [target, source].
        ``payloads``: this round's rows, where they are not the ones the workspace was sized
        for (a layer of another format on the same workspace)."""
        self.begin_dispatch(runtimes, inputs, payloads)
        for s in range(self.ep_size):
            self.push(s)
        return self.finish_dispatch()

    def begin_dispatch(self, runtimes: Sequence[int], inputs: Sequence[RankInputs],
                       payloads: Optional[Sequence[PayloadSpec]] = None) -> Round:
        """A new round: every rank's call is checked and its layout fixed; no row moves yet
        (``push`` moves one rank's, ``finish_dispatch`` publishes the counters)."""
        W = self.ep_size
        payloads = tuple(payloads or self.payloads)
        layouts = tuple(self._layout(r, payloads) for r in runtimes)
        if self.generation.checks_local_rows:  # TVM_FFI_ICHECK(localNumTokens <= runtime...)
            rows = [inp.owners.shape[0] for inp in inputs]
            refused = [r for r in range(W) if rows[r] > runtimes[r]]
            if refused:
                raise RankRefused(refused, runtimes, rows, str(self.generation))
        self.flag_val += 1  # moeA2APrepareDispatchKernel
        self._ensure(max(lay.bytes_needed for lay in layouts))
        self.round = Round(tuple(runtimes), payloads, layouts, tuple(inputs),
                           tuple(self._routes(inp.owners) for inp in inputs))
        return self.round

    def push(self, s: int) -> None:
        """Rank ``s``'s dispatch writes: its rows into every target's receive planes."""
        rnd = self.round
        tok, tgt, idx = rnd.sends[s]
        R_s, lay_s = rnd.runtimes[s], rnd.layouts[s]
        for q, spec in enumerate(rnd.payloads):
            b = spec.bytes_per_token
            dst = lay_s.recv_offsets[q] + (s * R_s + idx) * b
            self._audit(rnd, "dispatch", s, tok, tgt, idx, dst, q,
                        lambda lay: lay.recv_offsets[q], b)
            if len(dst):
                self._ensure(int(dst.max()) + b)
            cols = dst[:, None] + np.arange(b)
            self.workspace[tgt[:, None], cols] = rnd.inputs[s].payload_rows[q][tok]
            if self.written is not None:
                self.written[tgt[:, None], cols] = s

    def finish_dispatch(self):
        """The receive counters of the round, and each rank's receive-plane views."""
        W, rnd = self.ep_size, self.round
        recv_counts = np.zeros((W, W), dtype=np.int64)
        for s, (_, tgt, _) in enumerate(rnd.sends):
            np.add.at(recv_counts, (tgt, np.full_like(tgt, s)), 1)
        bank = self.bank
        for t in range(W):  # send_counters -> recv_counters[target][bank][source]
            off = self.recv_counters + bank * W * INT32
            self.workspace[t, off:off + W * INT32] = recv_counts[t].astype(np.int32).view(np.uint8)
            if self.generation.counter_banks == 2:  # the prepare kernel marks the next bank -1
                nxt = self.recv_counters + (1 - bank) * W * INT32
                self.workspace[t, nxt:nxt + W * INT32] = 0xFF
        views = []
        for t in range(W):
            lay = rnd.layouts[t]
            views.append([self.workspace[t, o:o + W * lay.runtime * p.bytes_per_token]
                          .reshape(W, lay.runtime, p.bytes_per_token)
                          for o, p in zip(lay.recv_offsets, rnd.payloads)])
        return views, recv_counts

    @property
    def bank(self) -> int:
        """The receive-counter bank of the current round (always 0 on 0.7.2)."""
        return round_parity(self.flag_val) if self.generation.counter_banks == 2 else 0

    def recv_counters_read(self, rank: int, bank: Optional[int] = None) -> np.ndarray:
        """The int32 receive counters [source] in ``rank``'s workspace, from ``bank``."""
        off = self.recv_counters + (self.bank if bank is None else bank) * self.ep_size * INT32
        return self.workspace[rank, off:off + self.ep_size * INT32].view(np.int32).copy()

    def _audit(self, rnd: Round, phase, s, tok, tgt, idx, offsets, q, plane_start, b):
        """Record every row whose offset differs from its receiver's slot row, and fault on
        any that falls past the workspace."""
        if not len(tgt):
            return
        R = np.asarray(rnd.runtimes, dtype=np.int64)
        starts = np.array([plane_start(lay) for lay in rnd.layouts], dtype=np.int64)
        expect = starts[tgt] + (s * R[tgt] + idx) * b
        past = offsets + b > self.size_per_rank
        if past.any():
            i = int(np.argmax(past))
            raise IllegalAddress(f"{phase}: rank {s} token {int(tok[i])} -> rank {int(tgt[i])} "
                                 f"touches byte {int(offsets[i]) + b} of a "
                                 f"{self.size_per_rank}-byte workspace")
        name = rnd.payloads[q].name if q is not None else "expert output"
        verb = "into " if phase == "dispatch" else "from "
        for i in np.nonzero((offsets != expect) | (idx >= R[tgt]))[0]:
            t = int(tgt[i])
            self.events.append(SlotEvent(
                phase, s, t, int(tok[i]), name, int(idx[i]), int(R[s]), int(R[t]),
                verb + _where(rnd.layouts[t], int(offsets[i]), self.aux_end)))

    def combine(self, runtimes: Sequence[int], expert_outputs: Sequence[np.ndarray],
                local_num_tokens: Sequence[int]) -> List[np.ndarray]:
        """All ranks' ``moe_a2a_combine``: stage each rank's ``[W, R, combine_bytes]`` output
        into its workspace, then sum one row per distinct target (fp32, no routing weights)
        and round to bf16. Returns each rank's ``[n, H]`` float32 (bf16 values)."""
        rnd = self.stage(expert_outputs)
        return [self.read(rnd, s, local_num_tokens[s]) for s in range(self.ep_size)]

    def stage(self, expert_outputs: Sequence[np.ndarray]) -> Round:
        """Every rank's combine prepare: its expert output into its own combine region, then
        the combine flag (after which any peer may read it)."""
        W, c, rnd = self.ep_size, self.combine_bytes, self.round
        for t in range(W):
            lay = rnd.layouts[t]
            out = np.ascontiguousarray(expert_outputs[t]).view(np.uint8).reshape(-1)
            if self.generation.fixed_combine_region:
                # moeA2APrepareCombineKernel: only row j < recv_count[bank][source] of each
                # source's block is staged (the rest keeps what was there)
                self._ensure(lay.combine_offset + out.size)
                counts = self.recv_counters_read(t)
                rows = out.reshape(W, lay.runtime, c)
                for src in range(W):
                    n = min(max(int(counts[src]), 0), lay.runtime)
                    at = lay.combine_offset + src * lay.runtime * c
                    self.workspace[t, at:at + n * c] = rows[src, :n].reshape(-1)
            else:
                self.workspace[t, lay.combine_offset:lay.combine_offset + out.size] = out
        self.flag_val += 1  # moeA2APrepareCombineKernel
        return rnd

    def read(self, rnd: Round, s: int, local_num_tokens: int) -> np.ndarray:
        """Rank ``s``'s combine of round ``rnd``: it pulls its rows' expert outputs from every
        target's combine region, as the workspace holds them now."""
        c = self.combine_bytes
        tok, tgt, idx = rnd.sends[s]
        src = rnd.layouts[s].combine_offset + (s * rnd.runtimes[s] + idx) * c
        self._audit(rnd, "combine", s, tok, tgt, idx, src, None, lambda lay: lay.combine_offset, c)
        if len(src):
            self._ensure(int(src.max()) + c)
        cols = src[:, None] + np.arange(c)
        if self.written is not None:  # rows another rank's later dispatch wrote over
            hit = self.written[tgt[:, None], cols]
            self.overwritten[s] += int(((hit >= 0) & (hit != s)).any(axis=1).sum())
        rows = self.workspace[tgt[:, None], cols]
        vals = from_bf16_bits(np.ascontiguousarray(rows).view(np.uint16))
        acc = np.zeros((local_num_tokens, c // 2), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # overwritten rows sum to anything
            np.add.at(acc, tok, vals)
        return from_bf16_bits(to_bf16_bits(acc))

    def watch_writes(self) -> None:
        """From now on, record which rank's dispatch last wrote each byte (``read`` counts the
        rows a rank reads that another rank wrote since: ``overwritten``)."""
        self.written = np.full(self.workspace.shape, -1, dtype=np.int16)
        self.overwritten = [0] * self.ep_size
