"""Whole rounds on the exact CPU model of the A2A (``a2a.py``): one dispatch -> stand-in MoE ->
combine checked against the reference (``round_trip``), two rounds back to back on one
workspace in the order that races (``back_to_back``), and a sequence of rounds in order
(``rounds_in_order``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..model.world import World
from ..model.generations import Generation
from .a2a import A2AModel, Round, SlotEvent
from .inputs import (RankInputs, decode_hidden, make_inputs,
                     reference_outputs, stand_in_moe)

__all__ = ["RoundTrip", "round_trip", "BackToBack", "back_to_back", "rounds_in_order",
           "expected_recv_counts", "emulated_bytes", "MAX_EMULATED_BYTES"]

MAX_EMULATED_BYTES = 1 << 28  # all ranks' touched workspace bytes the model materialises


@dataclass(frozen=True)
class RoundTrip:
    """One emulated dispatch -> stand-in MoE -> combine, and what it should have been."""

    outputs: Tuple[np.ndarray, ...]
    reference: Tuple[np.ndarray, ...]
    recv_counts: np.ndarray  # [target, source] as the kernel wrote them
    expected_counts: np.ndarray  # from routing alone
    events: Tuple[SlotEvent, ...]
    received_ok: bool  # every received row equals the row its sender sent

    def mismatched_ranks(self) -> List[int]:
        return [r for r, (o, e) in enumerate(zip(self.outputs, self.reference))
                if not np.array_equal(o, e)]

    @property
    def exact(self) -> bool:
        return (not self.mismatched_ranks() and not self.events and self.received_ok
                and np.array_equal(self.recv_counts, self.expected_counts))


def expected_recv_counts(world: World, inputs: Sequence[RankInputs]) -> np.ndarray:
    """[target, source]: tokens of ``source`` with at least one expert on ``target``."""
    W = world.ep_size
    owners = np.concatenate([inp.owners for inp in inputs])
    hits = (owners[:, :, None] == np.arange(W)).any(axis=1)  # [tokens, target]
    upto = np.concatenate([np.zeros((1, W), np.int64), hits.cumsum(axis=0)])
    ends = np.cumsum([inp.owners.shape[0] for inp in inputs])
    return (upto[ends] - upto[ends - [inp.owners.shape[0] for inp in inputs]]).T.copy()


def emulated_bytes(world: World, runtimes: Optional[Sequence[int]] = None,
                   generation: Optional[Generation] = None) -> int:
    """The bytes emulating ``world`` materialises (every rank's workspace up to the furthest
    byte a round with ``runtimes`` touches, default the ideal runtime, plus the inputs)."""
    gen = generation or world.generation
    moe = world.moe
    runtimes = runtimes or [max(1, world.ideal_runtime)]
    return (world.ep_size * max(gen.layout(world.ep_size, world.max_num_tokens, max(1, r),
                                           moe.payloads, moe.combine_bytes).bytes_needed
                                for r in set(runtimes))
            + 16 * moe.hidden_size * sum(world.rows_per_rank))


def round_trip(world: World, runtimes: Sequence[int],
               inputs: Optional[Sequence[RankInputs]] = None) -> RoundTrip:
    """Run the world through the model with ``runtimes[r]`` on rank ``r``."""
    need = emulated_bytes(world, runtimes)
    if need > MAX_EMULATED_BYTES:
        raise MemoryError(f"emulating this world touches {need / 2**20:.0f} MiB of workspace "
                          f"(limit {MAX_EMULATED_BYTES >> 20} MiB): run it on a GPU tier")
    moe = world.moe
    inputs = make_inputs(world) if inputs is None else inputs
    model = A2AModel(world.ep_size, world.max_num_tokens, moe.payloads, moe.combine_bytes,
                     world.generation)
    views, recv_counts = model.dispatch(runtimes, inputs)
    received_ok = _received_rows_ok(model, views, inputs)
    outputs = _experts(world, runtimes, views)
    combined = model.combine(runtimes, outputs, world.rows_per_rank)
    return RoundTrip(tuple(combined), tuple(reference_outputs(world, inputs)), recv_counts,
                     expected_recv_counts(world, inputs), tuple(model.events), received_ok)


def _experts(world: World, runtimes: Sequence[int], views) -> List[np.ndarray]:
    """Each target rank's stand-in expert output ``[W, R, H]`` (bf16 bits) for the rows its
    receive planes hold."""
    moe, W = world.moe, world.ep_size
    specs, n_hidden = moe.payloads, len(moe.payloads) - 2
    outputs = []
    groups = [list(range(W))] if len(set(runtimes)) == 1 else [[t] for t in range(W)]
    for targets in groups:  # every target rank at once when the runtimes agree
        R = runtimes[targets[0]]
        flat = [np.concatenate([np.ascontiguousarray(views[t][q]).reshape(W * R, -1) for t in targets])
                for q in range(len(specs))]
        x = decode_hidden(flat[:n_hidden], moe.payload_format, moe.hidden_size)
        ids = np.ascontiguousarray(flat[n_hidden]).view(np.int32)
        w = np.ascontiguousarray(flat[n_hidden + 1]).view(np.float32)
        y = stand_in_moe(x, ids, w, np.repeat(targets, W * R), moe.num_experts, W)
        outputs += list(y.reshape(len(targets), W, R, moe.hidden_size))
    return outputs


@dataclass(frozen=True)
class BackToBack:
    """Two rounds on one workspace in the order worst for one rank (``late``)."""

    late: int
    first: Tuple[np.ndarray, ...]  # every rank's round-n combine output
    first_reference: Tuple[np.ndarray, ...]
    second: Tuple[np.ndarray, ...]
    second_reference: Tuple[np.ndarray, ...]
    overwritten: int  # round-n combine rows ``late`` read after a peer's round-n+1 write
    rounds: Tuple[Round, Round]

    def first_mismatched(self) -> List[int]:
        return [r for r, (o, e) in enumerate(zip(self.first, self.first_reference))
                if not np.array_equal(o, e)]

    @property
    def second_exact(self) -> bool:
        return all(np.array_equal(o, e) for o, e in zip(self.second, self.second_reference))


def back_to_back(first: World, second: World, runtimes: Sequence[int],
                 next_runtimes: Sequence[int], late: int = 0) -> BackToBack:
    """Round n on ``first`` then round n+1 on ``second`` on one workspace (allocated for the
    wider of their rows), never cleared between them, in an order FlashInfer's protocol allows:
    combine signals only at its start and the host does not synchronise, so every rank but
    ``late`` finishes round n's combine and pushes round n+1's dispatch rows into its peers'
    receive planes before ``late`` reads its round-n combine input; then ``late`` reads, pushes
    its own rows, and round n+1 completes. Where round n+1's planes reach a peer's round-n
    combine input (FlashInfer 0.7.2, a growing layout: ``model/cross_round.py``), ``late``'s
    round-n output is wrong; round n+1's is right either way."""
    W = first.ep_size
    if (second.ep_size, second.max_num_tokens, second.moe.combine_bytes) != \
            (W, first.max_num_tokens, first.moe.combine_bytes):
        raise ValueError("two rounds on one workspace share ep_size, the cap and the combine row")
    widest = max(first.moe.payloads, second.moe.payloads,
                 key=lambda ps: sum(p.bytes_per_token for p in ps))
    model = A2AModel(W, first.max_num_tokens, widest, first.moe.combine_bytes, first.generation)
    inputs, next_inputs = make_inputs(first), make_inputs(second)
    views, _ = model.dispatch(runtimes, inputs, first.moe.payloads)
    rnd = model.stage(_experts(first, runtimes, views))
    out: List[Optional[np.ndarray]] = [
        None if s == late else model.read(rnd, s, first.rows_per_rank[s]) for s in range(W)]
    model.watch_writes()
    model.begin_dispatch(next_runtimes, next_inputs, second.moe.payloads)
    for s in range(W):
        if s != late:
            model.push(s)
    out[late] = model.read(rnd, late, first.rows_per_rank[late])
    model.push(late)
    views, _ = model.finish_dispatch()
    nxt = model.stage(_experts(second, next_runtimes, views))
    second_out = [model.read(nxt, s, second.rows_per_rank[s]) for s in range(W)]
    return BackToBack(late, tuple(out), tuple(reference_outputs(first, inputs)),
                      tuple(second_out), tuple(reference_outputs(second, next_inputs)),
                      model.overwritten[late], (rnd, nxt))


def rounds_in_order(worlds: Sequence[World], runtimes: Sequence[Sequence[int]],
                    inputs: Optional[Sequence[Sequence[RankInputs]]] = None
                    ) -> Tuple[Tuple[Tuple[np.ndarray, ...], Tuple[np.ndarray, ...]], ...]:
    """Rounds one after another on one workspace, never cleared (what an engine's rounds leave
    behind is the next round's starting state), each round's reads before the next round's
    writes: per round, every rank's combined output and its reference."""
    first = worlds[0]
    widest = max((w.moe.payloads for w in worlds),
                 key=lambda ps: sum(p.bytes_per_token for p in ps))
    model = A2AModel(first.ep_size, first.max_num_tokens, widest, first.moe.combine_bytes,
                     first.generation)
    out = []
    for n, (world, R) in enumerate(zip(worlds, runtimes)):
        inp = make_inputs(world) if inputs is None else inputs[n]
        views, _ = model.dispatch(R, inp, world.moe.payloads)
        combined = model.combine(R, _experts(world, R, views), world.rows_per_rank)
        out.append((tuple(combined), tuple(reference_outputs(world, inp))))
    return tuple(out)


def _received_rows_ok(model: A2AModel, views, inputs) -> bool:
    """Every (source, send index) row a receiver holds is the row its sender sent."""
    rnd = model.round
    R = np.array([lay.runtime for lay in rnd.layouts], dtype=np.int64)
    for s, (tok, tgt, idx) in enumerate(rnd.sends):
        if (idx >= R[tgt]).any():
            return False
        for q, spec in enumerate(rnd.payloads):
            b = spec.bytes_per_token
            starts = np.array([lay.recv_offsets[q] for lay in rnd.layouts], dtype=np.int64)
            at = starts[tgt] + (s * R[tgt] + idx) * b
            got = model.workspace[tgt[:, None], at[:, None] + np.arange(b)]
            if not np.array_equal(got, inputs[s].payload_rows[q][tok]):
                return False
    return True
