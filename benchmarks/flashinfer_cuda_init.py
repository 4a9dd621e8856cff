"""Where importing a FlashInfer package first initialises CUDA (the call stack of torch's first
``_lazy_init``), and what the import costs, on a GPU host:

    PYTHONPATH=SITE:. python3 -X importtime benchmarks/flashinfer_cuda_init.py flashinfer.comm 2> importtime.log

Output: gpu_runs/watch_revert_round/cuda_init_probe.log (with the slowest imports appended)."""
import sys
import time
import traceback

import torch

seen = []
_lazy_init = torch.cuda._lazy_init


def traced():
    if not seen and not torch.cuda.is_initialized():
        seen.append("".join(traceback.format_stack(limit=25)))
    return _lazy_init()


torch.cuda._lazy_init = traced
t = time.perf_counter()
name = sys.argv[1]
__import__(name)
print(f"import {name}: {time.perf_counter() - t:.2f} s; CUDA initialised: {torch.cuda.is_initialized()}")
print("first CUDA init from:\n" + (seen[0] if seen else "(not through torch.cuda._lazy_init)"))
