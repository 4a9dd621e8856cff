#!/usr/bin/env bash
# The README's GPU command under every kind of policy a user gates, on a GPU host with no
# package index (docs/gpu.md, "Every kind of policy on a GPU host"), once per FlashInfer
# generation shipped beside the checkout:
#   .gpu072s/site.tgz  .gpu074s/site.tgz   FlashInfer 0.7.2 / 0.7.4 with its A2A module as the
#                      AOT module (.ci/build-a2a-module.sh, then the pack step in docs/gpu.md)
#   .sglang/ .vllm/ .flashinfer-python/   the pinned files (python -m dispatcher.<x> fetch)
#   POLICIES="default user sglang:0.5.23 lone tree vllm:0.33.0 vllm:0.33.0@two-sided"  (lone: a lone
#   copy of 0.5.23's flashinfer.py; tree: 0.5.23's files laid out as a checkout, python/sglang;
#   user: a rule module of a user's, on their PYTHONPATH), or POLICIES_072 / POLICIES_074 for one generation (the releases
#   that call its API: vLLM 0.34.0 calls 0.7.4's); RUNS=1 runs of each; PYTEST_ARGS (e.g.
#   --durations=8) added to every run
# Writes $OUT/summary.log (one line per run: generation, policy, exit code, wall, pytest's last
# line) and $OUT/logs.tgz (every run's whole log).
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}; R=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
eval "$(PYTHONPATH=$PWD python3 -m dispatcher.gpu.env)"   # NVLink multicast off
lone=$(mktemp -d)
cp .sglang/0.5.23/sglang/srt/layers/moe/token_dispatcher/flashinfer.py "$lone/flashinfer.py"
mkdir -p "$lone/tree/python" && cp -r .sglang/0.5.23/sglang "$lone/tree/python/sglang"
printf 'from dispatcher.sizing import ideal_rule\n\ndef rule(view):\n    return ideal_rule(view)\n' > "$lone/a2a_user_rule.py"
for g in ${GENERATIONS:-072 074}; do
  [ -f .gpu${g}s/site.tgz ] || { echo "no .gpu${g}s/site.tgz: FlashInfer $g skipped" | tee -a "$OUT/summary.log"; continue; }
  site=/tmp/site$g; mkdir -p $site && tar -C $site -xzf .gpu${g}s/site.tgz
  export PYTHONPATH=$site:$PWD:$lone
  python3 -c "import torch, flashinfer; print('FlashInfer', flashinfer.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/summary.log"
  python3 -c "from dispatcher.gpu.single import for_installed; for_installed()"   # the module, once
  own=POLICIES_$g
  for p in ${!own:-${POLICIES:-default user sglang:0.5.23 lone tree vllm:0.33.0 vllm:0.33.0@two-sided}}; do
    case $p in default) arg="" ;; lone) arg="--policy=sglang:$lone/flashinfer.py" ;;
      tree) arg="--policy=sglang:$lone/tree" ;;
      user) arg="--policy=a2a_user_rule:rule" ;; *) arg="--policy=$p" ;; esac
    for i in $(seq 1 "${RUNS:-1}"); do
      log=$R/$g-$(echo "$p" | tr ':@/' '---')-$i.log
      t=$SECONDS
      timeout 280 python3 -m pytest -n auto -p no:cacheprovider --require-gpus -q $arg ${PYTEST_ARGS:-} > "$log" 2>&1
      rc=$?
      echo "$g $p run $i: exit $rc, $((SECONDS - t)) s: $(grep -E '(passed|failed|error)' "$log" | tail -1)" | tee -a "$OUT/summary.log"
    done
  done
done
tar -C "$R" -czf "$OUT/logs.tgz" . && ls -la "$OUT"
