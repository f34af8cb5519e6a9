#!/usr/bin/env bash
# The learner's GPU measurements that need no vLLM (issue 35): one `device` call on an H200 (the 4B shape needs
# more than an H100's 80 GB), with the pure-Python wheels the host lacks carried in .carry/learner_whl
# (megatron-core, pydantic and its parts, pytest; `pip download` lines in docs/gpu.md). Results go to $OUT.
#
#   bash bench/gpu_learner.sh FUSIONS  # the fusions' GPU test, then bench/learner_step.py with --fusions none,all
#                                      # --profile: 4B and 0.6B at 8K; then 1.7B at 4K and 16K (fusions on)
set -u
PHASE=${1:?phase: FUSIONS}
OUT=${OUT:-bench/results/gpu_learner}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lsite .carry/learner_whl/*.whl \
  || { echo "wheels: install failed"; exit 1; }
export PYTHONPATH=$PWD:/tmp/lsite:${PYTHONPATH:-} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - start) )); }
run() {  # run NAME SECONDS CMD...: CMD with a deadline (at most what is left), output in $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  local cap; cap=$(left); [ "$secs" -gt "$cap" ] && secs=$cap
  if [ "$secs" -le 20 ]; then echo "[$name] skipped: no time left"; return 0; fi
  echo "[$name] up to ${secs}s: $*"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? after $(( $(date +%s) - start ))s; last lines:"; tail -n 3 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PHASE" in
  FUSIONS)
    run fusions_test 90 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/integration/learner/test_fusions_gpu.py
    LS="python3 bench/learner_step.py --no-two-step --steps 3 --fusions none,all"
    run qwen3_4b_8k 230 $LS --shape qwen3-4b --mb-tokens 8192 --tokens-per-mb 1 --profile --out "$OUT/qwen3_4b_8k.json"
    run qwen3_06b_8k 110 $LS --shape qwen3-0.6b --mb-tokens 8192 --tokens-per-mb 2 --profile --out "$OUT/qwen3_06b_8k.json"
    run qwen3_17b 150 python3 bench/learner_step.py --no-two-step --steps 3 --fusions all --shape qwen3-1.7b \
      --mb-tokens 4096,16384 --tokens-per-mb 2 --out "$OUT/qwen3_17b.json" ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
echo "done after $(( $(date +%s) - start ))s"
