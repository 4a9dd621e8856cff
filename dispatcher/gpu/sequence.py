"""Rounds back to back on one workspace through FlashInfer's real kernels, on one GPU.

An engine runs one A2A round after another on one workspace with no host synchronisation
between them. ``run_sequence`` does the same with the single-GPU driver of either generation
(``single.py`` over the generation's ops): every rank on its own stream, rank ``r``'s dispatch of round
n+1 ordered only after its own combine of round n (no host sync, no cross-rank wait between
rounds); within a round the stand-in MoE on the main stream reads every rank's received rows,
as an MoE layer would. The host synchronises once, at the end, and every round's combined
output on every rank is checked against its reference, so a round whose combine input a
peer's next dispatch overwrote (FlashInfer 0.7.2's cross-round race, docs/flashinfer.md) shows
as that round's wrong output. The received counts and stale rows of a round are workspace state
the next round overwrites: ``run`` checks those one round at a time.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from ..emulator.inputs import make_inputs, reference_outputs
from ..model.world import World
from .checks import ATOL, GUARD_BYTE, RTOL

__all__ = ["run_sequence", "check_rounds", "round_problems"]


def check_rounds(worlds: Sequence[World], runtimes: Sequence[int]) -> None:
    first = worlds[0]
    shape = (first.ep_size, first.max_num_tokens, first.moe.payloads, first.moe.combine_bytes)
    for world, runtime in zip(worlds, runtimes):
        if (world.ep_size, world.max_num_tokens, world.moe.payloads,
                world.moe.combine_bytes) != shape:
            raise ValueError("the rounds of a sequence share one workspace: ep_size, the cap and "
                             "the MoE layer (one dispatch format) are the first round's")
        if not max(1, world.max_rows) <= runtime <= world.max_num_tokens:
            raise ValueError(f"runtime {runtime} of {world!r}: a round runs with a runtime that "
                             f"covers every rank's rows and is within the cap")


def run_sequence(driver, worlds: Sequence[World], runtimes: Sequence[int]
                 ) -> Tuple[Tuple[str, ...], ...]:
    """Every round of ``worlds`` (``runtimes[n]`` on every rank in round n) back to back on one
    workspace; per round, the problems found (empty: every rank's output exact). A guard byte
    overwritten past any rank's workspace is reported on the last round."""
    if len(worlds) != len(runtimes) or not worlds:
        raise ValueError("one runtime per round")
    import torch

    from . import torch_ops

    check_rounds(worlds, runtimes)
    W = worlds[0].ep_size
    space = driver.space(worlds[0])
    streams = driver._streams_for(W)
    main = torch.cuda.current_stream(driver.device)
    inputs = [make_inputs(world) for world in worlds]
    devs = [torch_ops.device_inputs(inp, driver.device) for inp in inputs]
    ready = main.record_event()  # every round's inputs are on the device
    for s in streams:
        s.wait_event(ready)
    results: List[List[torch.Tensor]] = []
    for world, R, dev in zip(worlds, runtimes, devs):
        same = [R] * W
        recv, offsets = driver._launch_dispatch(world, same, space, dev, streams)
        for s in streams:  # the MoE reads what every rank received
            main.wait_stream(s)
        stacked = [torch.stack(planes) for planes in zip(*recv)]
        outs = list(torch_ops.expert_outputs(stacked, R, world.moe, range(W), W).unbind(0))
        ready = main.record_event()
        for s in streams:
            s.wait_event(ready)
        # no wait after the combine: each rank's next dispatch follows only its own combine
        results.append(driver._launch_combine(world, same, space, outs, offsets, streams))
    for s in streams:
        main.wait_stream(s)
    guard = (space.full[:, space.ws.shape[1]:] == GUARD_BYTE).all()
    host = torch_ops.read_back([guard] + [t for round_ in results for t in round_])
    guard_ok, outputs = bool(host[0]), host[1:]
    problems = [round_problems(n, outputs[n * W:(n + 1) * W], reference_outputs(world, inp))
                for n, (world, inp) in enumerate(zip(worlds, inputs))]
    if not guard_ok:
        problems[-1] += ("guard bytes after a rank's workspace were overwritten",)
    return tuple(problems)


def round_problems(n: int, outputs: Sequence[np.ndarray], references: Sequence[np.ndarray]
                   ) -> Tuple[str, ...]:
    """What is wrong with round ``n``'s combined output on each rank (empty: all exact)."""
    found = []
    for r, (got, ref) in enumerate(zip(outputs, references)):
        close = np.isclose(got, ref, rtol=RTOL, atol=ATOL) if got.shape == ref.shape else None
        if close is None or not close.all():
            bad = ref.shape[0] if close is None else int((~close).any(axis=1).sum())
            found.append(f"round {n + 1}, rank {r}: combine output differs from the "
                         f"reference on {bad} of {ref.shape[0]} tokens")
    return tuple(found)
