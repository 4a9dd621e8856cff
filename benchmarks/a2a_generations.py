"""The A2A round trip (dispatch, then combine, every EP rank on its own stream of one GPU) of
the installed FlashInfer generation, on fixed worlds; run once per generation on the same host
and put the two side by side with ``--table``.

    PYTHONPATH=<site with FlashInfer 0.7.2> python benchmarks/a2a_generations.py --out DIR
    PYTHONPATH=<site with FlashInfer 0.7.4> python benchmarks/a2a_generations.py --out DIR
    python benchmarks/a2a_generations.py --table DIR      # the markdown table of both

Each figure: the median of 3 timed sets of ``--iters`` round trips (after a warm-up), in
microseconds per round trip, with the spread (min-max of the 3). The kernels run as the GPU
tiers drive them (``dispatcher/gpu/single.py`` for 0.7.2's functional API,
``dispatcher/gpu/one_sided.py`` for 0.7.4's raw module ops, fence path), the expert step is
a copy of what arrived (no MoE compute), so the figure is the all-to-all itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLDS = [  # (ep_size, rows per rank, hidden, top_k): DeepSeek-like rows, decode to prefill
    (2, 16, 7168, 8), (2, 64, 7168, 8), (4, 16, 7168, 8), (4, 32, 7168, 8), (8, 16, 7168, 8),
]


def _world(ep, rows, hidden, k):
    from dispatcher.model.world import MoeConfig, World

    return World(ep_size=ep, dp_size=ep, group_tokens=(rows,) * ep, max_num_tokens=rows,
                 moe=MoeConfig(hidden_size=hidden, top_k=k, num_experts=max(64, ep)))


def _setup(world):
    """(launch_dispatch(r), launch_combine(r)) closures for every rank, on the installed
    generation's driver, with the world's inputs on the GPU."""
    import torch

    from dispatcher.emulator.inputs import make_inputs
    from dispatcher.gpu import torch_ops
    from dispatcher.gpu.single import for_installed

    drv = for_installed()
    version = drv.generation.version
    moe, W, R = world.moe, world.ep_size, world.max_num_tokens
    inputs = make_inputs(world)
    dev = torch_ops.device_inputs(inputs, drv.device)
    ranks = [torch_ops.rank_inputs(dev, r, moe.payloads) for r in range(W)]
    outs = [torch.zeros(W, R, moe.hidden_size, dtype=torch.bfloat16, device=drv.device)
            for _ in range(W)]
    offsets = [None] * W
    space = drv.space(world)

    def dispatch(r):
        offsets[r] = drv.ops.dispatch(r, world, R, space, *ranks[r])[1]

    def combine(r):
        drv.ops.combine(r, world, R, space, outs[r], offsets[r])
    return drv, version, dispatch, combine


def measure(world, iters: int) -> list:
    import torch

    drv, version, dispatch, combine = _setup(world)
    streams = drv._streams_for(world.ep_size)
    main = torch.cuda.current_stream(drv.device)

    def one_round():
        for phase in (dispatch, combine):
            ready = main.record_event()
            for r, s in enumerate(streams):  # every rank launched before any is waited for
                s.wait_event(ready)
                with torch.cuda.stream(s):
                    phase(r)
            for s in streams:
                main.wait_stream(s)

    for _ in range(10):
        one_round()
    torch.cuda.synchronize()
    sets = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            one_round()
        torch.cuda.synchronize()
        sets.append((time.perf_counter() - t) / iters * 1e6)
    return sets


def run(out: Path, iters: int) -> None:
    from dispatcher.gpu import env
    from dispatcher.model.generations import installed_version

    env.apply()
    import torch

    rows = []
    for ep, r, h, k in WORLDS:
        sets = measure(_world(ep, r, h, k), iters)
        rows.append({"ep_size": ep, "rows_per_rank": r, "hidden": h, "top_k": k,
                     "us_per_round_trip": sets, "median_us": statistics.median(sets)})
        print(f"ep={ep} rows={r}: {statistics.median(sets):.1f} us "
              f"({min(sets):.1f}-{max(sets):.1f})", flush=True)
    version = installed_version()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"a2a_round_trip_{version}.json").write_text(json.dumps({
        "flashinfer": version, "gpu": torch.cuda.get_device_name(), "iters": iters,
        "command": "python benchmarks/a2a_generations.py --out DIR", "worlds": rows},
        indent=1) + "\n")


def table(folder: Path) -> str:
    runs = {json.loads(p.read_text())["flashinfer"]: json.loads(p.read_text())
            for p in sorted(folder.glob("a2a_round_trip_*.json"))}
    versions = sorted(runs)
    head = ("| EP | rows/rank | hidden | top_k | "
            + " | ".join(f"{v} us (min-max)" for v in versions) + " |")
    lines = [head, "|---|---|---|---|" + "---|" * len(versions)]
    for i, w in enumerate(runs[versions[0]]["worlds"]):
        cells = []
        for v in versions:
            s = runs[v]["worlds"][i]["us_per_round_trip"]
            cells.append(f"{statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f})")
        lines.append(f"| {w['ep_size']} | {w['rows_per_rank']} | {w['hidden']} | {w['top_k']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for a2a_round_trip_<version>.json")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--table", type=Path, help="print the table of the runs in this folder")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if not args.out:
        ap.error("--out or --table")
    run(args.out, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
