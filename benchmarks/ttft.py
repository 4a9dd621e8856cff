"""What a sizing rule costs: one MoE layer's A2A path (dispatch -> stand-in experts ->
combine) timed with the runtime each rule picks, plus a CPU-only padding/bytes model.

  python benchmarks/ttft.py --cpu-only --out benchmarks/ttft          # any machine
  python benchmarks/ttft.py --out benchmarks/ttft                     # 2+ GPUs, FlashInfer
  python benchmarks/ttft.py --policy mypkg.sizing:rule --out /tmp/x   # cost a proposed rule

GPU: one process per rank (NCCL), FlashInfer's ``MoeAlltoAll`` sized for ``--cap``; each
point: warm-up, then ``--iters`` iterations timed with CUDA events on every rank (max over
ranks per iteration), median and p10/p90. The stand-in expert is one bf16 GEMM
``[ep_size * runtime, H] x [H, H]`` per rank: its cost grows with the received rows, padding
included, as a grouped GEMM over padded receive buffers does. A rule whose value exceeds the
cap is recorded as a crash (FlashInfer's assert), not timed.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dispatcher.model.world import MoeConfig, World  # noqa: E402
from dispatcher.policies import load_policy  # noqa: E402
from dispatcher.sizing import ideal_rule, prefix_rule, seed_era_rule  # noqa: E402

TOKENS = (16, 64, 256, 1024, 4096, 16384)  # scheduler tokens per DP group
SHAPES = ((4096, 8, 64), (7168, 8, 256))  # (hidden, top_k, experts)
BUILTIN = {"prefix_rule": prefix_rule, "seed_era_rule": seed_era_rule, "ideal_rule": ideal_rule}


@dataclass
class Point:
    regime: str  # sp | dp_attention
    ep_size: int
    dp_size: int
    hidden: int
    top_k: int
    tokens_per_group: int
    rule: str
    runtime: int
    rows: int  # real payload rows per rank (max)
    padding_rows: int  # ep_size * runtime - ep_size * rows, received per rank
    dispatch_bytes: int  # bytes each rank's receive planes span (W * runtime * per-token)
    crashed: bool
    median_us: float = float("nan")
    p10_us: float = float("nan")
    p90_us: float = float("nan")


def worlds_for(regime: str, ep_size: int, tokens: int, cap: int, moe: MoeConfig) -> World:
    if regime == "sp":
        return World(ep_size=ep_size, dp_size=1, group_tokens=(tokens,), max_num_tokens=cap, moe=moe)
    dp = 2 if ep_size >= 4 else ep_size
    return World(ep_size=ep_size, dp_size=dp, group_tokens=(tokens,) + (tokens // 4,) * (dp - 1),
                 max_num_tokens=cap, moe=moe)


def plan_points(rules, ep_size, cap, regimes, shapes=SHAPES, tokens=TOKENS):
    pts = []
    for regime in regimes:
        for h, k, e in shapes:
            moe = MoeConfig(hidden_size=h, top_k=k, num_experts=max(e, ep_size))
            d = moe.dispatch_bytes
            for n in tokens:
                world = worlds_for(regime, ep_size, n, cap, moe)
                for name, rule in rules.items():
                    runtime = rule(world.views[0])
                    pts.append(Point(regime, ep_size, world.dp_size, h, k, n, name, runtime,
                                     world.max_rows, ep_size * (runtime - world.max_rows),
                                     ep_size * runtime * d, runtime > cap or runtime < 1))
    return pts


def cpu_plot(points, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({p.regime for p in points})
    fig, axes = plt.subplots(1, 2 * len(regimes), figsize=(7 * len(regimes), 4.2), squeeze=False)
    for i, regime in enumerate(regimes):
        sel = [p for p in points if p.regime == regime and p.hidden == points[0].hidden]
        for rule in dict.fromkeys(p.rule for p in sel):
            rs = [p for p in sel if p.rule == rule]
            x = [p.tokens_per_group for p in rs]
            axes[0][2 * i].plot(x, [max(p.padding_rows, 0) for p in rs], "o-", label=rule)
            axes[0][2 * i + 1].plot(x, [p.dispatch_bytes / 2**20 for p in rs], "o-", label=rule)
            for ax, ys in ((axes[0][2 * i], [p.padding_rows for p in rs]),
                           (axes[0][2 * i + 1], [p.dispatch_bytes / 2**20 for p in rs])):
                crash = [(xx, yy) for xx, yy, p in zip(x, ys, rs) if p.crashed]
                if crash:
                    ax.plot(*zip(*crash), "rx", markersize=12, mew=2)
        ep, dp = sel[0].ep_size, sel[0].dp_size
        axes[0][2 * i].set_title(f"{regime}: padding rows received per rank\n(ep={ep}, dp={dp}, H={sel[0].hidden})")
        axes[0][2 * i + 1].set_title(f"{regime}: dispatch receive bytes per rank (MiB)")
        for ax in axes[0][2 * i:2 * i + 2]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("scheduler tokens per DP group (red x: over the cap, would crash)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "padding_bytes_cpu.png", dpi=110)


def gpu_plot(points, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(p.hidden, p.top_k) for p in points})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 8), squeeze=False)
    for j, (h, k) in enumerate(shapes):
        sel = [p for p in points if (p.hidden, p.top_k) == (h, k)]
        base = {p.tokens_per_group: p.median_us for p in sel if p.rule == "ideal_rule"}
        for rule in dict.fromkeys(p.rule for p in sel):
            rs = [p for p in sel if p.rule == rule]
            ok = [p for p in rs if not p.crashed]
            axes[0][j].errorbar([p.tokens_per_group for p in ok], [p.median_us for p in ok],
                                yerr=[[p.median_us - p.p10_us for p in ok], [p.p90_us - p.median_us for p in ok]],
                                fmt="o-", capsize=3, label=rule)
            axes[1][j].plot([p.tokens_per_group for p in ok],
                            [p.median_us / base[p.tokens_per_group] for p in ok], "o-", label=rule)
            for p in rs:
                if p.crashed:
                    axes[0][j].annotate("crash\n(> cap)", (p.tokens_per_group, max(base.values())),
                                        color="red", ha="center", fontsize=8)
        axes[0][j].set_title(f"SP, ep={sel[0].ep_size}: dispatch+experts+combine, H={h} K={k}")
        axes[0][j].set_ylabel("median latency (us), p10-p90 bars")
        axes[1][j].set_ylabel("latency / shipped rule")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("scheduler tokens per DP group")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_gpu.png", dpi=110)


def _rank(rank, ep_size, port, cap, points, iters, warmup, q):
    from dispatcher.gpu import env

    env.apply()
    import datetime

    import torch
    import torch.distributed as dist

    from dispatcher.gpu.mnnvl import new_moe_alltoall
    from dispatcher.model.mnnvl import workspace_size_per_rank

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep_size, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    results = []
    for h, k in sorted({(p.hidden, p.top_k) for p in points}):
        e = max(SHAPE_E[h], ep_size)
        moe = MoeConfig(hidden_size=h, top_k=k, num_experts=e)
        a2a = new_moe_alltoall(ep_size, rank, cap, k, e, workspace_size_per_rank(
            ep_size, cap, moe.dispatch_bytes, moe.combine_bytes))
        weight = torch.randn(h, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
        gen = torch.Generator(device="cuda").manual_seed(rank)

        def layer(x, ids, w, R):
            recv = a2a.dispatch(ids, [x, ids, w], R)
            y = (recv[0].reshape(ep_size * R, h) @ weight).view(ep_size, R, h)
            return a2a.combine(y, R)

        groups = {}  # tokens -> [(point index, runtime)]: the rules of one world, interleaved
        for i, p in enumerate(points):
            if p.hidden == h and not p.crashed:
                groups.setdefault(p.tokens_per_group, []).append((i, p.runtime))
        for n_tokens, members in sorted(groups.items()):
            n = points[members[0][0]].rows
            x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
            ids = torch.randint(0, e, (n, k), device="cuda", dtype=torch.int32, generator=gen)
            w = torch.rand(n, k, device="cuda", dtype=torch.float32, generator=gen)
            times = {i: [] for i, _ in members}
            for it in range(warmup + iters):  # round-robin over rules: drift hits all alike
                for i, R in members:
                    dist.barrier()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer(x, ids, w, R)
                    end.record()
                    end.synchronize()
                    if it >= warmup:
                        times[i].append(start.elapsed_time(end) * 1000.0)
            for i, _ in members:
                t = torch.tensor(times[i], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a layer waits for its slowest rank
                if rank == 0:
                    results.append((i, t.cpu().tolist()))
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


SHAPE_E = {h: e for h, _, e in SHAPES}


def gpu_run(points, ep_size, cap, iters, warmup):
    import statistics

    import torch.multiprocessing as mp

    from dispatcher.gpu.env import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ep_size, port, cap, points, iters, warmup, q))
             for r in range(ep_size)]
    for p in procs:
        p.start()
    results = q.get(timeout=540)
    for p in procs:
        p.join(timeout=60)
    for i, times in results:
        qs = statistics.quantiles(times, n=10)
        points[i].median_us = statistics.median(times)
        points[i].p10_us, points[i].p90_us = qs[0], qs[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/ttft")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--policy", action="append", default=[],
                    help="extra rule(s) to cost, module:callable (default: the three built-ins)")
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--ep-size", type=int, default=None, help="GPU run: ranks (default: GPUs)")
    ap.add_argument("--cpu-ep-size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rules = dict(BUILTIN)
    for spec in a.policy:
        rules[spec] = load_policy(spec)[1]

    cpu_points = plan_points(rules, a.cpu_ep_size, a.cap, ("sp", "dp_attention"), shapes=SHAPES[:1])
    _write(cpu_points, out / "padding_bytes_cpu")
    cpu_plot(cpu_points, out)
    if a.cpu_only:
        return
    import torch

    ep = a.ep_size or torch.cuda.device_count()
    points = plan_points(rules, ep, a.cap, ("sp",))
    gpu_run(points, ep, a.cap, a.iters, a.warmup)
    _write(points, out / "latency_gpu")
    gpu_plot(points, out)
    _headline(points, out)


def _write(points, stem: Path):
    rows = [asdict(p) for p in points]
    with open(f"{stem}.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def _headline(points, out: Path):
    base = {(p.hidden, p.tokens_per_group): p for p in points if p.rule == "ideal_rule"}
    lines = []
    for p in points:
        if p.rule == "ideal_rule":
            continue
        b = base[(p.hidden, p.tokens_per_group)]
        ratio = "crash (> cap)" if p.crashed else f"{p.median_us / b.median_us:.2f}x"
        lines.append({"hidden": p.hidden, "tokens": p.tokens_per_group, "rule": p.rule,
                      "runtime": p.runtime, "ideal_runtime": b.runtime,
                      "median_us": None if p.crashed else round(p.median_us, 1),
                      "ideal_median_us": round(b.median_us, 1), "ratio": ratio})
    (out / "headline.json").write_text(json.dumps(lines, indent=1) + "\n")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
