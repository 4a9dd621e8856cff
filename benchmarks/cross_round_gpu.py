"""Try to show FlashInfer 0.7.2's cross-round race on real kernels on one GPU.

Every EP rank runs in this process on one GPU, each on its own stream, rounds back to back with
no host synchronisation (as ``dispatcher/gpu/sequence.py``). Even rounds: rank 0 (the victim)
has ``--tokens`` tokens, the runtime is that; odd rounds: rank W-1 (the aggressor) has R2 tokens,
the runtime R2, the largest whose aggressor slot of the next hidden plane starts at or before the
victim's previous combine input (0.7.2's byte model). Every other rank has 1 token. Every token
goes to every rank (top_k = W, one expert per rank) and the experts are the identity, so every
output row must be exactly W * its input.

The window: on one GPU a victim whose combine blocks are all resident reads its rows before the
aggressor's next dispatch writes (combine signals at its start; the aggressor waits for that
signal, then its one-token combine and its dispatch take microseconds). Here the victim's combine
runs in a CUDA green context of ``--victim-sms`` SMs: fully able to run (its blocks need only the
peers' combine signals), but slow, so its later rows are read after the aggressor, with the rest
of the GPU, has finished its combine and pushed the next round's rows. The victim's dispatches
stay on the whole GPU (every dispatch grid must be co-resident: they wait for each other).

    PYTHONPATH=<flashinfer site>:. python benchmarks/cross_round_gpu.py [--mode growing|flat|sync]

Controls that must come back clean: ``--mode flat`` (the runtime fixed at R2: the layout never
grows), ``--mode sync`` (a host sync between rounds), and FlashInfer 0.7.4 (a fixed combine
region). Exit status: 0 clean, 1 corrupted, 2 could not run (no green contexts, no GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dispatcher.gpu import env  # noqa: E402

env.apply()  # CUDA_DEVICE_MAX_CONNECTIONS etc., before CUDA starts

import torch  # noqa: E402

from dispatcher.model import mnnvl as w072  # noqa: E402
from dispatcher.model.cross_round import rows_at_risk  # noqa: E402
from dispatcher.model.generations import generation_of, installed_version  # noqa: E402
from dispatcher.model.payloads import (  # noqa: E402
    PayloadFormat,
    combine_bytes_per_token,
    dispatch_payloads,
)


class Fi072:
    """0.7.2's functional API on our own ``[W, size]`` workspace (``gpu/single.py``)."""

    def __init__(self, W, cap, H, dev):
        from dispatcher.gpu.mnnvl import comm
        from dispatcher.gpu.torch_ops import pdl_default

        self.ops, self.W, self.pdl = comm()[1], W, pdl_default(dev)
        size = self.ops.moe_a2a_get_workspace_size_per_rank(W, cap, 2 * H + 8 * W, 2 * H)
        self.ws = torch.zeros((W, size), dtype=torch.uint8, device=dev)
        self.meta = [self.ops.moe_a2a_initialize(self.ws, r, W, cap) for r in range(W)]
        self.off = [None] * W

    def dispatch(self, r, x, ids, w, R):
        out, self.off[r], _ = self.ops.moe_a2a_dispatch(
            ids, [x, ids, w], self.ws, self.meta[r], R, r, self.W, self.W, self.W,
            enable_pdl=self.pdl)
        return out[0]  # [W, R, H] bf16: rank r's hidden-state plane

    def combine(self, r, y, n, R):
        return self.ops.moe_a2a_combine(y, n, self.ws, self.meta[r], R, r, self.W, self.W,
                                        self.off[r], enable_pdl=self.pdl)


class Fi074:
    """0.7.4's raw module, fence path (``gpu/one_sided.py``'s ``RawA2A``)."""

    def __init__(self, W, cap, H, dev):
        from dispatcher.gpu.torch_ops import pdl_default
        from dispatcher.gpu.one_sided import RawA2A, flashinfer_layout, metainfo_index, module

        meta = flashinfer_layout(W, cap, W, 2 * H + 8 * W, 2 * H)
        size = int(meta[metainfo_index()["WORKSPACE_SIZE_INDEX"]])
        self.ws = torch.zeros((W, size), dtype=torch.uint8, device=dev)
        for r in range(W):
            module().moe_a2a_initialize(self.ws, meta, r, W)
        self.ranks = [RawA2A(self.ws, meta, r, W, W, W, H, pdl_default(dev)) for r in range(W)]

    def dispatch(self, r, x, ids, w, R):
        out = self.ranks[r].dispatch(x, ids, w, runtime_max_tokens_per_rank=R).hidden_states
        return out.view(self.ranks[r].ep_size, R, -1)

    def combine(self, r, y, n, R):
        return self.ranks[r].combine(y)


def plan(W, N, H, rounds, flat):
    """R2, the heavy rank, and each round's runtime and token counts (0.7.2's byte model)."""
    specs, cb = dispatch_payloads(PayloadFormat.BF16, H, W), combine_bytes_per_token(H)
    lay = w072.layout(W, N, N, specs, cb)  # plane offsets do not depend on the cap
    x = (lay.combine_offset - lay.recv_offsets[0]) // cb  # combine start, in hidden rows
    r2 = max(1, x // (W - 1))  # the aggressor's slot of the next hidden plane starts <= x
    heavy = [0 if s % 2 == 0 else W - 1 for s in range(rounds)]
    runtime = [r2 if flat or s % 2 else N for s in range(rounds)]
    counts = [[(N if s % 2 == 0 else r2) if r == heavy[s] else 1 for r in range(W)]
              for s in range(rounds)]
    return r2, heavy, runtime, counts


def inputs(s, r, n, H, W, dev):
    """Row t holds +-(1 + (t + r + s) % 8) everywhere (the sign flips each round)."""
    v = ((torch.arange(n, device=dev) + r + s) % 8 + 1).float() * (1.0 if s % 2 == 0 else -1.0)
    x = v[:, None].expand(n, H).to(torch.bfloat16).contiguous()
    ids = torch.arange(W, dtype=torch.int32, device=dev).repeat(n, 1)  # every rank's expert
    return x, ids, torch.ones((n, W), dtype=torch.float32, device=dev)


class GreenVictim:
    """Where the victim's combine runs: a stream of a green context of ``sms`` SMs."""

    def __init__(self, sms, dev):
        from torch.cuda.green_contexts import GreenContext

        self.ctx = GreenContext.create(num_sms=sms, device_id=dev.index)
        if hasattr(self.ctx, "Stream"):  # torch >= 2.12
            self.stream, self.enter, self.leave = self.ctx.Stream(), None, None
        else:  # torch 2.10-2.11: the green context's own stream, current while it is set
            self.ctx.set_context()
            self.stream = torch.cuda.current_stream()
            self.ctx.pop_context()
            self.enter, self.leave = self.ctx.set_context, self.ctx.pop_context

    def run(self, after: torch.cuda.Event, fn):
        """``fn()`` on the green stream after ``after``; an event recorded when it is done."""
        if self.enter:
            self.enter()
        try:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(after)
                out = fn()
                done = self.stream.record_event()
        finally:
            if self.leave:
                self.leave()
        return out, done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, default=2, choices=(2, 4, 8))
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=48, help="the victim's tokens (co-resident)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--mode", choices=("growing", "flat", "sync"), default="growing")
    p.add_argument("--victim-sms", type=int, default=8,
                   help="SMs of the victim's combine (0: no green context, the whole GPU)")
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 2
    W, H, N, S = a.ep, a.hidden, a.tokens, a.rounds
    version = installed_version() or "?"
    gen = generation_of(installed_version() or "0.7.2")
    dev = torch.device("cuda", torch.cuda.current_device())
    r2, heavy, runtime, counts = plan(W, N, H, S, a.mode == "flat")
    cap = max(r2, N)
    be = (Fi074 if gen.kernel == "one_sided" else Fi072)(W, cap, H, dev)
    try:
        green = GreenVictim(a.victim_sms, dev) if a.victim_sms else None
    except Exception as exc:  # noqa: BLE001 - an older driver or torch
        print(f"no green context of {a.victim_sms} SMs: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    inp = [[inputs(s, r, counts[s][r], H, W, dev) for r in range(W)] for s in range(S)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(device=dev) for _ in range(W)]
    outs = [[None] * W for _ in range(S)]
    t0 = time.perf_counter()
    for s in range(S):  # no host synchronisation unless --mode sync
        recv = [None] * W
        for r in range(W):
            with torch.cuda.stream(streams[r]):
                recv[r] = be.dispatch(r, *inp[s][r], runtime[s])
        dispatched = [streams[r].record_event() for r in range(W)]
        for r in sorted(range(W), key=lambda q: q == 0):  # the victim last
            if r == 0 and green is not None:
                outs[s][r], done = green.run(dispatched[0], lambda: be.combine(
                    0, recv[0], counts[s][0], runtime[s]))
                streams[0].wait_event(done)  # its next dispatch follows its own combine
                continue
            with torch.cuda.stream(streams[r]):
                outs[s][r] = be.combine(r, recv[r], counts[s][r], runtime[s])
        if a.mode == "sync":
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    wrong = [[int((outs[s][r].float() != W * inp[s][r][0].float()).any(-1).sum())
              for r in range(W)] for s in range(S)]
    specs, cb = dispatch_payloads(PayloadFormat.BF16, H, W), combine_bytes_per_token(H)
    risk = []
    for s in range(S):
        if s + 1 == S:
            risk.append([0] * W)
            continue
        now = gen.layout(W, cap, runtime[s], specs, cb)
        nxt = gen.layout(W, cap, runtime[s + 1], specs, cb)
        risk.append(list(rows_at_risk(now, nxt, [min(c, runtime[s]) for c in counts[s]],
                                      [min(c, runtime[s + 1]) for c in counts[s + 1]])))
    hit = sum(wrong[s][r] for s in range(S) for r in range(W) if risk[s][r])
    exposed = sum(counts[s][r] for s in range(S) for r in range(W) if risk[s][r])
    other = sum(wrong[s][r] for s in range(S) for r in range(W) if not risk[s][r])
    total = sum(map(sum, counts))
    verdict = "corrupted" if hit or other else "clean"
    result = dict(flashinfer=version, generation=gen.version, ep=W, hidden=H, tokens=N, r2=r2,
                  cap=cap, rounds=S, mode=a.mode, victim_sms=a.victim_sms,
                  green="torch.cuda.green_contexts" if green else None,
                  at_risk_tokens=exposed, wrong_at_risk=hit, other_tokens=total - exposed,
                  wrong_other=other, verdict=verdict, seconds=round(seconds, 3),
                  first_rounds=[dict(runtime=runtime[s], rows_at_risk=risk[s],
                                     wrong_tokens=wrong[s]) for s in range(min(S, 4))])
    print(json.dumps(result))
    print(f"VERDICT: {verdict}: {hit} of {exposed} tokens on ranks whose combine rows the next "
          f"dispatch overlaps came back wrong; {other} of {total - exposed} other tokens wrong "
          f"[FlashInfer {version}, ep {W}, mode {a.mode}, victim on {a.victim_sms or 'all'} SMs]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if verdict == "corrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
