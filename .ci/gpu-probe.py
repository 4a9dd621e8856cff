"""A few SGLang worlds through the rank pool, one by one, with timings and the ranks' logs:
the first thing to run on a new GPU host when the end-to-end tier misbehaves.

    python3 .ci/gpu-probe.py sglang:0.5.23 sglang:0.5.10
"""
import glob
import sys
import time

from dispatcher.gpu.env import gpu_count
from dispatcher.gpu.rank_pool import RankPool
from dispatcher.model.world import MoeConfig, World
from dispatcher.sglang.rank_body import run_example as sglang_rank
from strategies import GPU_SHAPES

if __name__ == "__main__":
    moe = MoeConfig(hidden_size=64, top_k=1, num_experts=64)
    steps = [World(ep_size=2, dp_size=1, group_tokens=(4,), max_num_tokens=64, moe=moe),
             World(ep_size=2, dp_size=2, group_tokens=(5, 1), max_num_tokens=64, moe=moe),
             World(ep_size=2, dp_size=2, group_tokens=(0, 3), max_num_tokens=128, moe=moe)]
    pool = RankPool(2, max(1, gpu_count()), GPU_SHAPES.largest.dispatch_bytes,
                    GPU_SHAPES.largest.combine_bytes, timeout=30)
    for spec in sys.argv[1:]:
        for world in steps:
            t = time.time()
            try:
                r = pool.run_engine(sglang_rank, world, spec)
                print(f"{spec} ok {time.time() - t:.2f}s values={r[0]['values']} "
                      f"cap={r[0]['max_num_tokens']} ws={r[0]['workspace_size_per_rank']} "
                      f"model={world.workspace_size} {world!r}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe prints everything
                print(f"{spec} ERR {time.time() - t:.2f}s {type(exc).__name__}: {str(exc)[:2500]}",
                      flush=True)
    pool.close()
    for f in sorted(glob.glob("/tmp/a2a-gate-ranks-*/*.log")):
        print("----", f, open(f).read()[-1200:])
