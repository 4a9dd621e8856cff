#!/usr/bin/env bash
# The GPU runs behind the GPU figures in benchmarks/README.md, for a GPU host with no package
# index (Python 3.12, torch, pytest, pytest-xdist, hypothesis there; FlashInfer shipped here),
# once per FlashInfer generation:
#   .gpu072s/site.tgz  .gpu074s/site.tgz   FlashInfer 0.7.2 / 0.7.4 with its A2A module built for
#                      sm_90a as the AOT module (.ci/build-a2a-module.sh, then the pack step in
#                      docs/gpu.md); a missing pack skips that generation, and FlashInfer
#                      JIT-builds a missing module (~3 min)
#   .sglang/ .vllm/ .flashinfer-python/   the pinned files (python -m dispatcher.sglang fetch,
#                      ... vllm fetch, ... flashinfer fetch)
#   GENERATIONS="072 074"   which generations; STEPS="gpu multi sglang vllm bad speed a2a profile wall ttft"
#   which parts; logs in $OUT/results.tgz (each step's log name ends in the generation)
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}; R=$(mktemp -d); mkdir -p "$OUT"
STEPS=${STEPS:-gpu multi sglang bad a2a}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
eval "$(PYTHONPATH=$PWD python3 -m dispatcher.gpu.env)"   # NVLink multicast off, as every GPU process sets it
step() { local name=$1-$g limit=$2; shift 2; echo "=== $name: $*" | tee $R/$name.log; local t=$SECONDS
  timeout "$limit" "$@" >> $R/$name.log 2>&1; local rc=$?
  echo "rc=$rc wall=$((SECONDS - t))s" | tee -a $R/$name.log; tail -n 6 $R/$name.log; }
py="python3 -m pytest -p no:cacheprovider -n 0 -q -rs --require-gpus"
for g in ${GENERATIONS:-072 074}; do
[ -f .gpu${g}s/site.tgz ] || { echo "no .gpu${g}s/site.tgz: FlashInfer $g skipped" | tee -a $R/env.log; continue; }
site=/tmp/site$g; mkdir -p $site && tar -C $site -xzf .gpu${g}s/site.tgz
export PYTHONPATH=$site:$PWD
{ nvidia-smi -L; python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"; } | tee -a $R/env.log
python3 -c 'import time; t=time.time(); from dispatcher.gpu.single import for_installed; for_installed(); print("a2a driver ready in %.1f s" % (time.time()-t))' 2>&1 | tee -a $R/env.log
for s in $STEPS; do case $s in
  gpu) step gpu 150 $py -m gpu tests/gpu --timeout=140 ;;
  multi) step multi 300 $py -m multi_gpu tests/multi_gpu -s --timeout=280 ;;
  sglang) for rel in 0.5.23 0.5.10; do  # SGLang's own dispatch()/combine() on the real kernels
         step "sglang-$rel" 120 $py -m multi_gpu tests/multi_gpu/test_sglang_end_to_end.py -k "real_kernels and 2" --policy=sglang:$rel --timeout=110
       done ;;
  vllm) step vllm-gpu 150 $py -m gpu tests/gpu --policy=vllm:0.33.0 --timeout=140   # vLLM's value, real kernels
        step vllm-multi 240 $py -m multi_gpu tests/multi_gpu/test_rank_pool.py -k pool_round_trip --policy=vllm:0.33.0 --timeout=230 ;;
  profile) mkdir -p $R/prof  # each timed loop's cProfile, and each rank's (text beside the .prof)
         A2A_GATE_PROFILE_RANKS=$R/prof step profile 200 python3 benchmarks/gpu_speed.py --examples 300 --pool-sizes 2 --profile $R/prof
         for f in $R/prof/*.prof; do python3 -c "import pstats,sys; s=pstats.Stats(sys.argv[1]).strip_dirs(); s.sort_stats('tottime').print_stats(40); s.sort_stats('cumulative').print_stats(40)" $f > ${f%.prof}.txt; done ;;
  bad) for pol in prefix_rule dispatcher.mutants:undersized; do
         step "bad-${pol##*:}" 90 $py -m "gpu or multi_gpu" tests/gpu tests/multi_gpu -k "real_round_trip or pool_round_trip and 2" --policy=$pol --timeout=80
       done ;;
  speed) for i in 1 2 3; do  # the host's state before each run: GPU clocks and power state, CPU MHz
         { nvidia-smi --query-gpu=index,pstate,clocks.sm,clocks.max.sm,persistence_mode --format=csv,noheader
           awk -F: '/MHz/ {s+=$2; n++} END {printf "cpu MHz mean %.0f over %d cores\n", s/n, n}' /proc/cpuinfo
         } > $R/host-before-speed-$i.log 2>&1
         step "speed-$i" 150 python3 benchmarks/gpu_speed.py --examples 300 --pool-sizes 2 4 --out $R/gpu_speed_$i.json
       done ;;
  wall) step wall ${WALL_LIMIT:-540} python3 benchmarks/suite_wall.py --runs ${RUNS:-3} ${WALL_ONLY:+--only $WALL_ONLY} --profile gpu --out $R/suite_wall_gpu_$g.json --log-dir $R/wall-runs-$g -- --require-gpus --durations=30 ;;
  ttft) step ttft 300 python3 benchmarks/ttft.py --out $R/ttft ;;
  a2a) step a2a 120 python3 benchmarks/a2a_generations.py --out $R/a2a --iters 200 ;;
esac; done; done
[ -d $R/a2a ] && PYTHONPATH=$PWD python3 benchmarks/a2a_generations.py --table $R/a2a | tee $R/a2a/table.md
tar -C $R -czf $OUT/results.tgz . && ls -la $OUT
