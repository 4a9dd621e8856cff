#!/usr/bin/env bash
# Build FlashInfer's A2A module for sm_90a (H100/H200) on a machine without a GPU, to ship as
# FlashInfer's AOT module (../shared-style slim packs: docs/gpu.md, "FlashInfer's module").
#
#   .ci/build-a2a-module.sh 0.7.4 OUT_DIR     # nvlink_one_sided_alltoall.so (0.7.4)
#   .ci/build-a2a-module.sh 0.7.2 OUT_DIR     # mnnvl_moe_alltoall.so (0.7.2)
#
# The module is the one the generation's row in dispatcher/model/generations.py names
# (module_name): a new generation needs no edit here.
#
# Needs nvcc (CUDA 13), g++, ninja, Python 3 and the package index. What the CPU machine lacks
# is provided here: cuBLAS and cuRAND headers (the nvidia-cublas and nvidia-curand wheels; the
# module includes them, links neither) and a libcuda stub: 0.7.4 links -lcuda, and a machine
# without the driver has no libcuda.so. The stub is an empty shared object named libcuda.so.1,
# which only satisfies the link: the driver's symbols are resolved on the GPU host at load
# (the built module does not even keep it as NEEDED). Measured on a 2-core machine: 0.7.4 in
# 98 s, 0.7.2 in 184 s.
set -euo pipefail
version=${1:?usage: build-a2a-module.sh VERSION OUT_DIR}; out=${2:?usage: build-a2a-module.sh VERSION OUT_DIR}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"; . "$work/venv/bin/activate"
pip install -q torch==2.13.0                       # flashinfer imports torch; the CPU build will do
pip install -q --no-deps "flashinfer-python==$version"
pip install -q "apache-tvm-ffi>=0.1.11,<0.2" einops tabulate numpy packaging requests ninja tqdm nvidia-ml-py click
pip download -q --no-deps --only-binary=:all: -d "$work/whl" nvidia-cublas nvidia-curand
for w in "$work"/whl/*.whl; do (cd "$work" && python3 -m zipfile -e "$w" headers); done
inc=$(dirname "$(find "$work/headers" -name cublasLt.h | head -1)")
mkdir -p "$work/stub" && echo > "$work/stub/empty.c"
gcc -shared -o "$work/stub/libcuda.so" -Wl,-soname,libcuda.so.1 "$work/stub/empty.c"
# the module is the one the generation's row names (Generation.module_name): no version here
module=$(PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" python3 -c \
  'import sys; from dispatcher.model.generations import generation_of; print(generation_of(sys.argv[1]).module_name)' "$version")
cuda=${CUDA_HOME:-/usr/local/cuda}   # the toolkit (its include/ has cuda_runtime_api.h)
[ -f "$cuda/include/cuda_runtime_api.h" ] || { echo "set CUDA_HOME to the CUDA 13 toolkit" >&2; exit 2; }
FLASHINFER_CUDA_ARCH_LIST="9.0a" CUDA_HOME=$cuda \
FLASHINFER_EXTRA_LDFLAGS="-L$work/stub" FLASHINFER_EXTRA_CUDAFLAGS="-I$inc" FLASHINFER_EXTRA_CFLAGS="-I$inc" \
FLASHINFER_WORKSPACE_BASE="$work/ws" MAX_JOBS=${MAX_JOBS:-2} python3 - "$out" "$module" <<'PY'
import inspect, shutil, sys, pathlib
import flashinfer.jit.comm as c
# the JIT spec of that module: the argument-free gen_* function of flashinfer.jit.comm whose
# spec carries its name (FlashInfer's own names for the functions differ by release)
specs = []
for fname, fn in sorted(vars(c).items()):
    if not (fname.startswith("gen_") and callable(fn)):
        continue
    try:
        if any(p.default is p.empty for p in inspect.signature(fn).parameters.values()):
            continue
        spec = fn()
    except Exception:  # noqa: BLE001 - a spec this release cannot make is not the one
        continue
    if getattr(spec, "name", None) == sys.argv[2]:
        specs.append(spec)
if len(specs) != 1:
    sys.exit(f"flashinfer.jit.comm has {len(specs)} gen_* functions for module {sys.argv[2]!r}")
spec = specs[0]
spec.build()
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dest = out / f"{spec.name}.so"
shutil.copy(spec.get_library_path(), dest)
print(dest)
PY
