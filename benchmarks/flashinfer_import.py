"""Whether importing FlashInfer's A2A package touches CUDA (if it did not, the run's zygote
could preload it for a rank pool's ranks), and what it costs, on a GPU host:

    PYTHONPATH=SITE:. python3 benchmarks/flashinfer_import.py 072|074

It imports torch, then the generation's package and the gate's driver of it, says whether CUDA
is initialised, and forks a child that initialises CUDA and loads the A2A module (which fails
where the parent initialised CUDA). Output: gpu_runs/shared_zygote_round/flashinfer_import_probe.log."""
import os, sys, time
t = time.perf_counter(); import torch; t_torch = time.perf_counter() - t
import torch.distributed
gen = sys.argv[1]
t = time.perf_counter()
if gen == "072":
    import flashinfer.comm
    from flashinfer.comm import trtllm_moe_alltoall  # noqa
    import dispatcher.gpu.mnnvl as m
else:
    import flashinfer.moe_ep
    from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided import kernels  # noqa
    import dispatcher.gpu.one_sided as m
t_imp = time.perf_counter() - t
print(f"{gen}: torch import {t_torch:.2f}s, flashinfer+driver import {t_imp:.2f}s, cuda initialized after import: {torch.cuda.is_initialized()}", flush=True)
pid = os.fork()
if pid == 0:
    t = time.perf_counter(); torch.cuda.set_device(0); torch.cuda.init(); t_cuda = time.perf_counter() - t
    t = time.perf_counter(); idx = m.metainfo_index(); t_mod = time.perf_counter() - t
    x = torch.ones(4, device="cuda").sum().item()
    print(f"{gen}: forked child after preload: cuda {t_cuda:.2f}s, module+metainfo {t_mod:.2f}s, {len(idx)} fields, tensor ok {x}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
