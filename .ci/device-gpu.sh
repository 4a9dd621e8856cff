#!/usr/bin/env bash
# The GPU run behind the GPU figures in docs/gpu.md, for a GPU host with no package index
# (Python 3.12, torch, pytest, hypothesis there; FlashInfer shipped as a tarball).
#   .gpu/site.tgz                  FlashInfer 0.7.2.post1 and its few pure-Python needs, installed
#                                  with pip --target for Python 3.12 and tarred
#   .gpu/mnnvl_moe_alltoall.so     optional prebuilt module (installed as FlashInfer's AOT .so;
#                                  if it fails to load, FlashInfer JIT-builds it, ~165 s)
#   STEPS="gpu multi2 multi4 bad speed ttft"   which parts to run; results in $OUT/results.tgz
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}; R=$OUT/r; mkdir -p "$R"
STEPS=${STEPS:-gpu multi2 multi4 bad speed ttft}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
site=/tmp/site; aot=$site/flashinfer/data/aot/mnnvl_moe_alltoall
mkdir -p $site && tar -C $site -xzf .gpu/site.tgz
[ -f .gpu/mnnvl_moe_alltoall.so ] && mkdir -p $aot && cp .gpu/mnnvl_moe_alltoall.so $aot/
export PYTHONPATH=$site:$PWD
eval "$(python3 -m dispatcher.gpu.env)"   # NVLink multicast off, as every GPU process sets it
nvidia-smi -L | tee $R/env.log
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())" | tee -a $R/env.log
load='import time; t=time.time(); from dispatcher.gpu.flashinfer import module; module(); print("a2a module ready in %.1f s" % (time.time()-t))'
if ! python3 -c "$load" 2>&1 | tee -a $R/env.log; then
  echo "prebuilt module did not load; JIT build" | tee -a $R/env.log
  rm -rf $aot; python3 -c "$load" 2>&1 | tee -a $R/env.log
  cp ~/.cache/flashinfer/*/*/cached_ops/mnnvl_moe_alltoall/mnnvl_moe_alltoall.so $OUT/ 2>/dev/null
fi
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($*)"; local t=$SECONDS
  timeout "$limit" "$@" > $R/$name.log 2>&1; local rc=$?
  echo "rc=$rc wall=$((SECONDS - t))s" | tee -a $R/$name.log; tail -n 25 $R/$name.log; }
py="python3 -m pytest -p no:cacheprovider -n 0 -q -rs --require-gpus -m"
for s in $STEPS; do case $s in
  gpu) step gpu 120 $py gpu tests/gpu --junitxml=$R/junit-gpu.xml --timeout=100 ;;
  multi2) step multi2 100 $py multi_gpu tests/multi_gpu -s -k "not pool_round_trip or pool_round_trip and 2" --junitxml=$R/junit-multi2.xml --timeout=90 ;;
  multi4) step multi4 75 $py multi_gpu tests/multi_gpu -s -k "pool_round_trip and 4" --junitxml=$R/junit-multi4.xml --timeout=70 ;;
  bad) for pol in prefix_rule dispatcher.mutants:undersized; do
         step "bad-${pol##*:}" 45 $py "gpu or multi_gpu" tests/gpu tests/multi_gpu -k "real_round_trip or pool_round_trip and 2" --policy=$pol --timeout=40
       done ;;
  speed) step speed 70 python3 benchmarks/gpu_speed.py --examples 300 --pool-sizes ${POOLS:-2} --out $R/gpu_speed.json ;;
  sglang) for rel in 0.5.23 0.5.10; do  # SGLang's own dispatch() sizing the real kernels
         step "sglang-$rel" 90 $py gpu tests/gpu -k real_round_trip --policy=sglang:$rel --timeout=80
       done ;;
  ttft) step ttft 300 python3 benchmarks/ttft.py --out $R/ttft ;;
esac; done
tar -C $R -czf $OUT/results.tgz . && ls -la $OUT
