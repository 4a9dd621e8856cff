"""The GPU environment, in one place: what every GPU process sets, how GPUs are counted
without initialising CUDA, and whether FlashInfer is importable. No torch import here (the
pytest parent reads this module).

    python -m dispatcher.gpu.env      # prints the variables as `export` lines for a shell
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
from functools import lru_cache

__all__ = ["GPU_ENV", "apply", "free_port", "gpu_count", "flashinfer_missing"]

# Never enable NVLink multicast on shared hosts (NCCL NVLS, torch symmetric memory, NVSHMEM).
# CUDA_DEVICE_MAX_CONNECTIONS: the hardware queues streams map onto (default 8). The single-GPU
# tier runs each EP rank on its own stream and every rank's dispatch blocks must run at once:
# a rank whose stream shares a queue with a spinning peer never launches, and the peers wait
# for it until FlashInfer's timeout (seen at ep 64: ranks 32+ never started). 32 is CUDA's most.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def apply() -> None:
    """Set ``GPU_ENV`` in this process (before CUDA, NCCL or FlashInfer start)."""
    os.environ.update(GPU_ENV)


def free_port() -> int:
    """A free TCP port on the loopback interface for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@lru_cache(maxsize=None)
def gpu_count() -> int:
    """GPUs on this host through NVML (or ``nvidia-smi -L``), never through CUDA."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: fall back to nvidia-smi
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            return 0
    return 0


@lru_cache(maxsize=None)
def flashinfer_missing() -> str:
    """Why the GPU tiers cannot run here ("" when they can)."""
    if gpu_count() == 0:
        return "needs a GPU, found none (NVML / nvidia-smi)"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install -e '.[gpu]')"
    from ..model.generations import (DEFAULT, UnknownGeneration, active, generation_of,
                                     installed_version)

    version = installed_version() or ""
    try:
        kernels = generation_of(version or DEFAULT)
    except UnknownGeneration as exc:
        return f"{exc}: the GPU tiers drive the kernels of those only (docs/flashinfer.md)"
    if active() != kernels:
        return (f"this session models {active()} ($A2A_GATE_FLASHINFER) but FlashInfer "
                f"{version} is installed: the GPU tiers run the installed kernels")
    return ""


if __name__ == "__main__":
    for key, value in GPU_ENV.items():
        print(f"export {key}={value}")
