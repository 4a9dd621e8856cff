"""GPU-tier speed on the machine it runs on: worlds/s through the real kernels on one GPU
(every rank in one process), examples/s of the multi-process rank pool, and examples/s of
SGLang's own dispatch()/combine() end to end in the pool (the newest pinned release).

    python benchmarks/gpu_speed.py --out gpu_speed.json [--pool-sizes 2 4] [--profile DIR]

Worlds are drawn by the tiers' own strategies (Hypothesis, derandomized) and each is run with
every check the tests make; generation is included in the "with_generation" figures.
``--profile DIR`` writes a cProfile of each timed loop (this process only; the ranks' own
with ``A2A_GATE_PROFILE_RANKS=DIR``) as ``DIR/<figure>.txt``: the timed figures then include
the profiler's overhead.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import Phase, given, settings  # noqa: E402

from dispatcher.model.validation import plan  # noqa: E402
from dispatcher.sizing import ideal_rule  # noqa: E402
from strategies import GPU_SHAPES, gpu_worlds, pool_worlds, sglang_pool_worlds  # noqa: E402
from strategies.search import SEARCH  # noqa: E402

GENERATE = settings(SEARCH, phases=[Phase.generate])


def draw(strategy, n):
    out = []

    @settings(GENERATE, max_examples=n)
    @given(strategy)
    def collect(w):
        out.append(w)
    collect()
    return out


PROFILE_DIR = None


def timed(fn, items, name="loop"):
    profiler = None
    if PROFILE_DIR:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    for it in items:
        fn(it)
    rate = len(items) / (time.perf_counter() - t)
    if profiler:
        profiler.disable()
        _write_profile(profiler, name)
    return rate


def _write_profile(profiler, name):
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    Path(PROFILE_DIR, f"{name}.txt").write_text(text.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--examples", type=int, default=400)
    ap.add_argument("--pool-sizes", type=int, nargs="*", default=[2])
    ap.add_argument("--out")
    ap.add_argument("--profile", metavar="DIR", help="write each timed loop's cProfile here")
    a = ap.parse_args()
    global PROFILE_DIR
    if a.profile:
        PROFILE_DIR = a.profile
        Path(a.profile).mkdir(parents=True, exist_ok=True)
    import torch

    from dispatcher.gpu.single import SingleGpuA2A

    figures = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    t = time.perf_counter()
    gpu = SingleGpuA2A()
    figures["single_gpu_start_s"] = round(time.perf_counter() - t, 2)
    worlds = draw(gpu_worlds(), a.examples)

    def one(world):
        rt = gpu.run(world, [plan(ideal_rule, world.views, world.generation)] * world.ep_size)
        assert not rt.problems, rt.problems
    t = time.perf_counter()
    for w in worlds[:20]:  # warm-up: module load, workspaces, streams
        one(w)
    figures["single_gpu_warmup_20_s"] = round(time.perf_counter() - t, 2)
    figures["single_gpu_worlds_per_s"] = round(timed(one, worlds, "single_gpu"), 1)
    print(figures, flush=True)
    figures["single_gpu_worlds_per_s_with_generation"] = round(
        a.examples / _gen_and_run(one, a.examples), 1)
    from dispatcher.gpu.rank_pool import RankPool
    from dispatcher.policies import load_policy
    from dispatcher.sglang.rank_body import run_example as sglang_rank
    from dispatcher.sglang.verdicts import RELEASES

    engine = f"sglang:{RELEASES[-1]}"
    for ep in a.pool_sizes:
        t = time.perf_counter()
        pool = RankPool(ep, torch.cuda.device_count(), GPU_SHAPES.largest.dispatch_bytes,
                        GPU_SHAPES.largest.combine_bytes, resolve=load_policy)
        figures[f"pool_ep{ep}_start_s"] = round(time.perf_counter() - t, 1)
        ws = draw(pool_worlds(ep), a.examples)
        for w in ws[:10]:
            pool.run(w, "dispatcher.sizing:ideal_rule")
        figures[f"pool_ep{ep}_{pool.backend}_examples_per_s"] = round(
            timed(lambda w: pool.run(w, "dispatcher.sizing:ideal_rule"), ws, f"pool_ep{ep}"), 1)
        sw = draw(sglang_pool_worlds(ep), a.examples)
        t = time.perf_counter()
        for w in sw[:24]:  # SGLang builds one MoeAlltoAll per (hidden, top_k, cap)
            pool.run_engine(sglang_rank, w, engine)
        figures[f"sglang_e2e_ep{ep}_warmup_24_s"] = round(time.perf_counter() - t, 1)
        figures[f"sglang_e2e_ep{ep}_{pool.backend}_examples_per_s"] = round(
            timed(lambda w: pool.run_engine(sglang_rank, w, engine), sw, f"sglang_e2e_ep{ep}"), 1)
        print(figures, flush=True)
        pool.close()
    print(json.dumps(figures, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=2) + "\n")


def _gen_and_run(one, n):
    t = time.perf_counter()

    @settings(GENERATE, max_examples=n)
    @given(gpu_worlds())
    def run(w):
        one(w)
    run()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
