#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, in two phases of at most 10 minutes each (one `device` call
# each, on 2 x H200, after the bundle is installed: docs/gpu.md). Results and logs go to $OUT (default
# bench/results/gpu_session).
#
#   bash bench/gpu_session.sh A   # sync vs async step breakdown with the collective (NCCL) refit, dense 0.6B;
#                                 # then a short async run of a small MoE (FlashInfer CUTLASS) through the loop
#   bash bench/gpu_session.sh B   # GPU 0: 1-GPU colocated sync run (sleep/wake), then the vLLM start matrix;
#                                 # GPU 1: MoE parity test (reload vs plain load), then rollout throughput
#   bash bench/gpu_session.sh C   # the MoE parity test (GPU 0) beside one start-matrix case (GPU 1), then the
#                                 # step breakdown of A again
#   bash bench/gpu_session.sh D   # GPU 0: rollout throughput eager, then the MoE model through a colocated sync
#                                 # loop; GPU 1: the MoE parity test, then rollout throughput with CUDA graphs
#   bash bench/gpu_session.sh E   # the refit bench over NCCL (install paths of rollout.install.direct_load), then the
#                                 # step breakdown of A (collective refit, direct load)
#   bash bench/gpu_session.sh F   # the MoE parity test (GPU 0) beside the refit bench (both GPUs); then, if plain
#                                 # load was proven for the dense model, the step breakdown of E again
#   bash bench/gpu_session.sh G   # the step breakdown of E alone (a second sample)
#   bash bench/gpu_session.sh H   # the MoE model: async on 2 GPUs with the collective refit, then colocated sync
#                                 # on 2 GPUs with expert parallelism in the learner (EP=2) and two engines
#   bash bench/gpu_session.sh I   # the refit bench with the copy plan (rollout.install.direct_load), then the step
#                                 # breakdown of E again (copy plan, pause without vLLM's fixed 20 ms sleep)
#   bash bench/gpu_session.sh J   # the dense 0.6B async loop alone, 4 steps (copy plan, pause_generation kept)
# On one H200 (`nvidia-h200`, issue 21):
#   bash bench/gpu_session.sh K   # the CUDA IPC GPU tests, gpu_smoke (pause breakdown before/after, object
#                                 # store and CUDA IPC), refit.py --gpus 1 --colocated, and the async recipe on
#                                 # one GPU (it must fail fast, naming the GPUs)
#   bash bench/gpu_session.sh L   # the colocated 1-GPU sync loop, object store then CUDA IPC, back to back
#   bash bench/gpu_session.sh M   # async on one GPU (recipes/gpu-1xh200-async.yaml: engine and learner side by
#                                 # side, CUDA IPC refit), then the colocated sync recipe, same shape, 5 steps
#                                 # each; their step times compared (bench/step_breakdown.py --metrics)
#   bash bench/gpu_session.sh W   # M's async run, then L's colocated run with CUDA IPC, STEPS (6) steps each
#   bash bench/gpu_session.sh X   # the CUDA IPC pack beside a busy GPU, eager vs CUDA graph
#                                 # (bench/ipc_export_contention.py), its GPU test, then W's async run packing eagerly
#   bash bench/gpu_session.sh MP  # M's async run alone, the learner rank's stacks recorded over warm steps (py-spy)
#   bash bench/gpu_session.sh V   # attention sdpa vs sdpa_batched: bench/learner_step.py at the loop's shape, then
#                                 # MP's run with sdpa_batched, profiled the same way
# Nemotron-H on one H200 (issue 34; models from `bench/nemotron_h_gpu.py build` in $NH_DIR, default /tmp/models):
#   bash bench/gpu_session.sh N   # the GPU test of pushes into a running NemotronH engine vs a fresh engine (small
#                                 # dense and MoE hybrids; four engine starts of ~90-120 s each on a fresh host)
#   bash bench/gpu_session.sh O   # the same check on the 1.7B Nano-3-shaped model (bench/nemotron_h_gpu.py install)
#   bash bench/gpu_session.sh P   # the 1.7B Nemotron-H async on one GPU (recipes/gpu-1xh200-async.yaml), 5 steps;
#                                 # needs Ray and Megatron-Core in /tmp/site (WITH_RAY_MCORE=1, or their wheels);
#                                 # NH_EXTRA: more recipe overrides (e.g. logger.parity_max_gen_kl_ratio=0)
#   (bench/nemotron_h_noise.py: the 1.7B install vs the engine's own run-to-run noise; see its docstring)
# The seed and off-policy correction on one H200 (issues 36, 37; the bundle with EXTRA_REQS, docs/gpu.md):
#   bash bench/gpu_session.sh Q   # the seed's async recipe (NeMo-RL's file, unchanged) on a tiny random Nano-Omni,
#                                 # one GPU shared by engine and learner, 3 steps; the vllm_kwargs read back
#                                 # (tests/integration/services/test_seed_recipe_gpu.py)
#   BG_PHASES="Q:600 R:450 S:540" bash bench/gpu_session.sh BG  # those phases one after another in the background
#                                 # (into /tmp/bg), each with its own budget, past this call; then, in the next
#                                 # calls made back to back:
#   bash bench/gpu_session.sh BGW # wait for them and bring back the phases finished so far
#   bash bench/gpu_session.sh R   # routing replay off / on, the small Qwen3-MoE: one pool (engine and learner side by
#                                 # side, sync so every step trains at age 0, the engine returning its experts),
#                                 # two learner jobs attached in turn (replay off, then on), 3 steps each
#   bash bench/gpu_session.sh S   # the same with the small Nemotron-H MoE hybrid
#   bash bench/gpu_session.sh RS  # R then S in one call (each a pool start and two jobs); on a fresh H100 one
#                                 # pool start took 164-190 s, each job's learner start ~45 s and a step ~20 s,
#                                 # so give R and S ~7 min each there (BG_PHASES="R:450 S:540"; 370 s was short)
set -u
PHASE=${1:?phase A to S, or RS}
OUT=${OUT:-bench/results/gpu_session}
mkdir -p "$OUT" models
export PYTHONPATH=$PWD:${PYTHONPATH:-} INFLIGHT_OBJECT_STORE_MB=${INFLIGHT_OBJECT_STORE_MB:-8192}
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PY:-python3}
# datasets fingerprints through dill, which pickles a module by value when its path names no 'site-packages'
# (unsloth#9791): from /tmp/site, Dataset.from_dict died with "Can't pickle <class 'MonthDayNano'>" on the H200.
# The bundle's /tmp/site is reached as /tmp/site-packages instead.
if [ -d /tmp/site ] && [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]]; then
  ln -sfn /tmp/site /tmp/site-packages
  PYTHONPATH=$(echo ":$PYTHONPATH:" | sed 's#:/tmp/site:#:/tmp/site-packages:#; s#^:##; s#:$##'); export PYTHONPATH
fi
. "$(dirname "$0")/gpu_steps.sh"  # start, left, step
breakdown() {  # breakdown OUT_JSON SECONDS: sync vs async step breakdown, dense 0.6B, collective refit
  step step_breakdown "$2" $PY bench/step_breakdown.py --recipe recipes/gpu-2xh200-async.yaml --steps 5 \
    --out "$OUT/$1" policy.model_name=$dense $SHAPE policy.refit_transport=collective
}
throughput() {  # throughput NAME SECONDS [--eager]: pool engine vs raw vLLM, 0.6B, 32 x 16 x 256 tokens
  step "$1" "$2" $PY bench/rollout_throughput.py --size 0.6b --prompts 32 --group 16 --max-tokens 256 --repeats 1 \
    --variants llm,rollout_engine "${@:3}"
}
moe_parity() {  # moe_parity SECONDS: the GPU MoE parity test
  step moe_parity_test "$1" $PY -m pytest -m gpu -x -q -s tests/integration/services/test_gpu_moe_parity.py \
    -p no:cacheprovider
}
ray_logs() {  # ray_logs [TAG]: the last lines of every Ray worker's stderr (a run that hung says why there): the
  # runs under $OUT keep Ray's logs in RUN_DIR/logs/ray (2026-12-05: /tmp/ray/session_latest had none of them)
  find -L "$OUT" /tmp/ray/session_latest/logs -name 'worker-*.err' -size +0 2>/dev/null | while read -r f; do
    echo "== $f"; tail -n 40 "$f"; done > "$OUT/ray_worker_tails${1:+_$1}.log"
}
replay_pair() {  # replay_pair MODEL TAG KEEP_S: routing replay off / on on MODEL, leaving KEEP_S of the budget
  # One pool on the shared GPU, sync (age 0: the learner scores exactly the weights the engine sampled from), the
  # engine returning its experts; two learner jobs attached in turn. Parity may not stop the run (the Nemotron-H
  # bf16 gen KL is ~0.02, docs/benchmarks.md).
  local model=$1 tag=$2 keep=$3 cap
  local rep="--recipe ${REPLAY_RECIPE:-recipes/gpu-1xh200-async.yaml} grpo.async_grpo.enabled=false policy.model_name=$model $SHAPE
    policy.generation.vllm_cfg.moe_backend=triton policy.generation.vllm_cfg.enable_return_routed_experts=true
    logger.parity_max_gen_kl=1 logger.parity_max_gen_kl_ratio=0 logger.tensorboard_enabled=false
    checkpointing.enabled=false rollout_pool.http_port=8123"
  export INFLIGHT_HOME=$OUT/home_$tag
  # the deploy's own share: on a fresh H100 (2026-12-05) one engine took ~190 s to answer ready, and a deploy
  # stopped at 131 s took its Ray head down with it
  cap=$(( $(left) - keep - 160 )); [ "$cap" -gt 300 ] && cap=300
  stacks "$tag" 200
  step "${tag}_pool_deploy" $cap $PY -m services.cli pool deploy $rep --run-dir "$OUT/${tag}_pool"
  for replay in false true; do
    cap=$(( $(left) - keep - 40 )); [ $replay = false ] && cap=$(( cap / 2 ))
    step "${tag}_replay_$replay" $cap $PY -m services.cli learner attach --pool inflight-pool $rep grpo.max_num_steps=3 \
      policy.megatron_cfg.moe_enable_routing_replay=$replay --run-dir "$OUT/${tag}_replay_$replay"
    cp "$OUT/${tag}_replay_$replay/metrics.jsonl" "$OUT/${tag}_replay_${replay}_metrics.jsonl" 2>/dev/null
  done
  ray_logs "$tag"
  timeout 30 $PY -m services.cli pool shutdown --stop-cluster > "$OUT/${tag}_pool_shutdown.log" 2>&1
  $PY bench/replay_mismatch.py --run off="$OUT/${tag}_replay_false_metrics.jsonl" \
    --run on="$OUT/${tag}_replay_true_metrics.jsonl" --out "$OUT/replay_mismatch_$tag.json"
}
dense=models/qwen3-0.6b-random
moe=models/qwen3moe-small-random
NH_DIR=${NH_DIR:-/tmp/models}
build() {  # build DIR ARCH SIZE: a random bf16 model, initialised on the GPU (minutes on the CPU for 0.6B+)
  [ -d "$1" ] || $PY -c "import sys, torch; from services.models.tiny_model import make_tiny_model
with torch.device('cuda'): make_tiny_model(sys.argv[1], arch=sys.argv[2], size=sys.argv[3], dtype='bfloat16')" "$@"
}
# Recipes need omegaconf, which the vLLM bundle lacks (phase K's async run failed on it): install the wheels
# staged beside the bundle's parts (.carry/rN/wheels) when they came along.
if ! $PY -c "import omegaconf" 2>/dev/null && compgen -G ".carry/*/wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "${SITE:-/tmp/site}" .carry/*/wheels/*.whl \
    && echo "installed $(ls .carry/*/wheels/*.whl | xargs -n1 basename | tr '\n' ' ')into ${SITE:-/tmp/site}"
fi
# The bundle's wheels are installed with --no-compile: on a fresh H100 (2026-12-05, py-spy) each new process (the
# engine actor, vLLM's model-inspection subprocess, the engine core) compiled its modules from source, one after
# another, ~60 s before the engine core began. Compile them once, on all cores (not yet measured).
if [ -d /tmp/site ] && [ ! -f /tmp/site/.inflight_compiled ]; then
  t0=$(date +%s); $PY -m compileall -q -j 0 /tmp/site > /dev/null 2>&1; touch /tmp/site/.inflight_compiled
  echo "compiled /tmp/site in $(( $(date +%s) - t0 )) s"
fi
# py-spy, where its wheel came along (.carry/rN/wheels/py_spy-*.whl), for the stacks of a slow start: on a fresh H100
# (2026-12-05) 82 s passed in the Nano-Omni engine actor before vLLM's engine core began (about 6 s on CPU)
if ! command -v py-spy > /dev/null && compgen -G ".carry/*/wheels/py_spy-*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/pyspy .carry/*/wheels/py_spy-*.whl && PATH=/tmp/pyspy/bin:$PATH
fi
stacks() {  # stacks TAG SECONDS: every 15 s for SECONDS, in the background, the Python stacks of the engine actors
  # and engine cores (Ray names its actor processes ray::CLASS) into $OUT/stacks_TAG.log
  command -v py-spy > /dev/null || { echo "stacks: no py-spy" > "$OUT/stacks_$1.log"; return 0; }
  ( end=$(( $(date +%s) + $2 )); while [ "$(date +%s)" -lt $end ]; do sleep 15
      for pid in $(pgrep -f "ray::EngineActor|EngineCore"); do
        echo "== $(date +%T) pid $pid $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-80)"; py-spy dump --pid "$pid" 2>&1 | head -80
      done
    done > "$OUT/stacks_$1.log" 2>&1 ) &
}
profile_rank() {  # profile_rank TAG RUN_DIR SECONDS: once RUN_DIR has a step's metrics, SECONDS of the learner rank's
  # Python stacks (py-spy record, 100 Hz, collapsed) into $OUT/profile_TAG.txt, and the rank's thread settings: the loop
  # trained at 67 % of bench/learner_step.py's rate (2026-12-04), and Ray gives a num_cpus=0 actor OMP_NUM_THREADS=1
  command -v py-spy > /dev/null || { echo "profile_rank: no py-spy" > "$OUT/profile_$1.log"; return 0; }
  ( for _ in $(seq 1 200); do [ -s "$2/metrics.jsonl" ] && break; sleep 3; done
    pid=$(pgrep -f "ray::LearnerActor" | head -1)
    [ -n "$pid" ] || { echo "no ray::LearnerActor"; exit 0; }
    echo "pid $pid"; tr '\0' '\n' < "/proc/$pid/environ" | grep -E "^(OMP|MKL|CUDA_VISIBLE|PYTORCH)"
    py-spy record --pid "$pid" --duration "$3" --rate 100 --format raw --nonblocking -o "$OUT/profile_$1.txt"
  ) > "$OUT/profile_$1.log" 2>&1 &
}
case $PHASE in K|N|O|P|Q|BG|BGW|S) ;; MP|V|W|X) build $dense qwen2 0.6b ;; RS) build $moe qwen3_moe small ;; M) build $dense qwen2 0.6b ;; R) build $moe qwen3_moe small ;; *) build $dense qwen2 0.6b; build $moe qwen3_moe small ;; esac
SHAPE="policy.max_total_sequence_length=512 policy.generation.max_new_tokens=256 policy.sequence_packing.train_mb_tokens=4096"

case $PHASE in
A)
  breakdown step_breakdown_h200x2_collective.json 420
  step moe_async_loop 240 $PY -m services.cli run --recipe recipes/gpu-2xh200-async.yaml --steps 3 \
    --run-dir "$OUT/moe_async" policy.model_name=$moe $SHAPE policy.refit_transport=collective \
    policy.generation.vllm_cfg.moe_backend=flashinfer_cutlass logger.tensorboard_enabled=false \
    checkpointing.enabled=false
  ;;
B)
  (
    export CUDA_VISIBLE_DEVICES=0
    step colocated_sync 300 $PY -m services.cli run --recipe recipes/gpu-1xh200-sync.yaml --steps 4 \
      --run-dir "$OUT/colocated_sync" policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false \
      checkpointing.enabled=false
    step start_matrix 250 $PY bench/vllm_start_matrix.py --gpus 0,0 --deadline-s 60
  ) > "$OUT/track0.txt" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    moe_parity 210
    throughput throughput_graphs 180
    throughput throughput_eager 160 --eager
  ) > "$OUT/track1.txt" 2>&1 &
  wait
  cat "$OUT/track0.txt" "$OUT/track1.txt"
  ;;
C)
  CUDA_VISIBLE_DEVICES=0 moe_parity 200 > "$OUT/track0.txt" 2>&1 &
  step start_case 90 $PY bench/vllm_start_matrix.py --gpus 1 --deadline-s 75 --cases 0,0,0 > "$OUT/track1.txt" 2>&1
  wait
  cat "$OUT/track0.txt" "$OUT/track1.txt"
  breakdown step_breakdown_h200x2_collective.json 330
  ;;
D)
  (
    export CUDA_VISIBLE_DEVICES=0
    throughput throughput_eager 230 --eager
    step moe_sync_loop 320 $PY -m services.cli run --recipe recipes/gpu-1xh200-sync.yaml --steps 3 \
      --run-dir "$OUT/moe_sync" policy.model_name=$moe $SHAPE \
      policy.generation.vllm_cfg.moe_backend=flashinfer_cutlass logger.tensorboard_enabled=false \
      checkpointing.enabled=false
  ) > "$OUT/track0.txt" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    moe_parity 230
    throughput throughput_graphs 320
  ) > "$OUT/track1.txt" 2>&1 &
  wait
  cat "$OUT/track0.txt" "$OUT/track1.txt"
  ;;
E)
  step refit 200 $PY bench/refit.py --gpus 2 --out "$OUT/refit_h200_x2_direct.json"
  breakdown step_breakdown_h200x2_direct.json 360
  ;;
F)
  CUDA_VISIBLE_DEVICES=0 moe_parity 230 > "$OUT/track0.txt" 2>&1 &
  step refit 200 $PY bench/refit.py --gpus 2 --out "$OUT/refit_h200_x2_direct.json" > "$OUT/track1.txt" 2>&1
  wait
  cat "$OUT/track0.txt" "$OUT/track1.txt"
  if grep -q "direct load refused" "$OUT/refit.log"; then
    echo "[step_breakdown] skipped: plain load_weights was not proven for the dense model"
  else
    breakdown step_breakdown_h200x2_direct.json 330
  fi
  ;;
G)
  breakdown step_breakdown_h200x2_direct_run2.json 330
  ;;
H)
  MOE="policy.model_name=$moe $SHAPE policy.generation.vllm_cfg.moe_backend=flashinfer_cutlass \
    logger.tensorboard_enabled=false checkpointing.enabled=false"
  step moe_async_loop 260 $PY -m services.cli run --recipe recipes/gpu-2xh200-async.yaml --steps 4 \
    --run-dir "$OUT/moe_async" $MOE policy.refit_transport=collective
  step moe_ep2_sync_loop 290 $PY -m services.cli run --recipe recipes/gpu-1xh200-sync.yaml --steps 3 \
    --run-dir "$OUT/moe_ep2_sync" $MOE cluster.gpus_per_node=2 rollout_pool.num_engines=2 \
    policy.megatron_cfg.expert_model_parallel_size=2
  ;;
J)
  step dense_async_loop 250 $PY -m services.cli run --recipe recipes/gpu-2xh200-async.yaml --steps 4 \
    --run-dir "$OUT/dense_async" policy.model_name=$dense $SHAPE policy.refit_transport=collective \
    logger.tensorboard_enabled=false checkpointing.enabled=false
  ;;
I)
  step refit 210 $PY bench/refit.py --gpus 2 --out "$OUT/refit_h200_x2_copy.json"
  breakdown step_breakdown_h200x2_copy.json 330
  ;;
K)
  step ipc_gpu_tests 240 $PY -m pytest -m gpu -x -q -s -p no:cacheprovider tests/integration/rollout/test_ipc_refit_gpu.py
  step gpu_smoke 200 $PY bench/gpu_smoke.py --out "$OUT/gpu_smoke_h200_issue21.json"
  step refit_colocated 170 $PY bench/refit.py --gpus 1 --colocated --out "$OUT/refit_h200_colocated.json"
  t0=$(date +%s%N)
  step async_one_gpu 60 $PY -m services.cli run --recipe recipes/gpu-2xh200-async.yaml --steps 1 \
    --run-dir "$OUT/async_one_gpu" policy.model_name=tiny://qwen2 logger.tensorboard_enabled=false \
    checkpointing.enabled=false
  echo "[async_one_gpu] ended after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  grep -m3 -i "placement\|GPUs" "$OUT/async_one_gpu.log" | cut -c1-600
  ;;
L)
  SYNC="--recipe recipes/gpu-1xh200-sync.yaml --steps ${STEPS:-4} policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false \
    checkpointing.enabled=false"
  step colocated_sync_object_store 290 $PY -m services.cli run $SYNC --run-dir "$OUT/sync_object_store"
  step colocated_sync_cuda_ipc 270 $PY -m services.cli run $SYNC policy.refit_transport=cuda_ipc \
    --run-dir "$OUT/sync_cuda_ipc"
  for d in sync_object_store sync_cuda_ipc; do cp "$OUT/$d/metrics.jsonl" "$OUT/${d}_metrics.jsonl" 2>/dev/null; done
  ;;
M)
  ONE="--steps ${STEPS:-5} policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false checkpointing.enabled=false"
  step async_one_gpu 290 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml $ONE \
    --run-dir "$OUT/async_one_gpu"
  step colocated_sync 250 $PY -m services.cli run --recipe recipes/gpu-1xh200-sync.yaml $ONE \
    --run-dir "$OUT/colocated_sync"
  for d in async_one_gpu colocated_sync; do cp "$OUT/$d/metrics.jsonl" "$OUT/${d}_metrics.jsonl" 2>/dev/null; done
  if [ -f "$OUT/async_one_gpu_metrics.jsonl" ] && [ -f "$OUT/colocated_sync_metrics.jsonl" ]; then
    $PY bench/step_breakdown.py --steps ${STEPS:-5} --out "$OUT/step_breakdown_h200_one_gpu.json" \
      --metrics sync="$OUT/colocated_sync_metrics.jsonl" --metrics async="$OUT/async_one_gpu_metrics.jsonl"
  fi
  ;;
W)  # the async one-GPU run and the colocated sync loop with CUDA IPC (the pause/refit/overlap goals and the
  # colocated CUDA IPC goal of issue 21), STEPS each; a fresh machine's first vLLM start takes ~100 s (compile,
  # CUDA graphs: H200 2026-12-06), so the object-store loop of M/L does not fit the same call
  ONE="--steps ${STEPS:-6} policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false checkpointing.enabled=false"
  step async_one_gpu 240 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml $ONE \
    --run-dir "$OUT/async_one_gpu"
  step sync_cuda_ipc 220 $PY -m services.cli run --recipe recipes/gpu-1xh200-sync.yaml $ONE \
    policy.refit_transport=cuda_ipc --run-dir "$OUT/sync_cuda_ipc"
  for d in async_one_gpu sync_cuda_ipc; do cp "$OUT/$d/metrics.jsonl" "$OUT/${d}_metrics.jsonl" 2>/dev/null; done
  ;;
X)  # the CUDA IPC pack beside a busy GPU, eager vs one CUDA graph replay (bench/ipc_export_contention.py), the
  # graph pack's GPU test, then W's async run with the eager pack (policy.refit_cuda_graph=false: the before of W)
  step ipc_export_contention 150 $PY bench/ipc_export_contention.py --shape qwen3-0.6b --reps 6 \
    --out "$OUT/ipc_export_contention.json"
  step ipc_graph_gpu_test 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/integration/learner/test_ipc_graph_gpu.py
  ONE="--steps ${STEPS:-6} policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false checkpointing.enabled=false"
  step async_one_gpu_eager_pack 250 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml $ONE \
    policy.refit_cuda_graph=false --run-dir "$OUT/async_one_gpu_eager_pack"
  cp "$OUT/async_one_gpu_eager_pack/metrics.jsonl" "$OUT/async_one_gpu_eager_pack_metrics.jsonl" 2>/dev/null
  ;;
MP)  # the async one-GPU run of M alone, its learner rank profiled over warm steps (issue 35: loop vs bench)
  profile_rank async_one_gpu "$OUT/async_one_gpu" 25
  step async_one_gpu 290 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml --steps 5 \
    policy.model_name=$dense $SHAPE logger.tensorboard_enabled=false checkpointing.enabled=false \
    --run-dir "$OUT/async_one_gpu"
  cp "$OUT/async_one_gpu/metrics.jsonl" "$OUT/async_one_gpu_metrics.jsonl" 2>/dev/null
  ;;
V)  # sdpa once per sequence against sdpa_batched (one call per length bucket): MP's profile put two thirds of the
  # learner rank's forward in the per-sequence SDPA calls (2026-12-05); both against attention written out on the
  # GPU (the unit test's cuda cases), the bench at the loop's shape, then the loop
  step attention_gpu_test 90 $PY -m pytest -m gpu -q -p no:cacheprovider tests/unit/learner/test_attention.py
  step learner_step_backends 220 $PY bench/learner_step.py --shape qwen3-0.6b --seq-len 320 --groups 16 --group-size 16 \
    --mb-tokens 4096,8192 --backends sdpa,sdpa_batched --no-two-step --steps 4 --out "$OUT/learner_step_batched.json"
  profile_rank async_batched "$OUT/async_batched" 25
  step async_batched 290 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml --steps 5 \
    policy.model_name=$dense $SHAPE policy.megatron_cfg.attention_backend=sdpa_batched logger.tensorboard_enabled=false \
    checkpointing.enabled=false --run-dir "$OUT/async_batched"
  cp "$OUT/async_batched/metrics.jsonl" "$OUT/async_batched_metrics.jsonl" 2>/dev/null
  ;;
N)
  step nemotron_h_gpu_test 560 $PY -m pytest -m gpu -q -s -p no:cacheprovider tests/integration/rollout/test_nemotron_h_gpu.py
  grep -h "^NEMOTRON_H_GPU" "$OUT/nemotron_h_gpu_test.log" | cut -c1-1500
  ;;
O)
  for seed in 0 1; do name=nemotron-h-$([ $seed = 0 ] && echo a || echo b)
    [ -d "$NH_DIR/$name" ] || $PY bench/nemotron_h_gpu.py build "$NH_DIR/$name" --seed $seed > /dev/null; done
  step nemotron_h_install 400 $PY bench/nemotron_h_gpu.py install "$NH_DIR/nemotron-h-a" "$NH_DIR/nemotron-h-b" \
    --out "$OUT/nemotron_h_install_h200.json"
  ;;
P)
  step nemotron_h_async_one_gpu 520 $PY -m services.cli run --recipe recipes/gpu-1xh200-async.yaml --steps 5 \
    --run-dir "$OUT/nemotron_h_async" policy.model_name="$NH_DIR/nemotron-h-a" $SHAPE \
    policy.generation.vllm_cfg.moe_backend=triton logger.tensorboard_enabled=false checkpointing.enabled=false \
    ${NH_EXTRA:-}
  cp "$OUT/nemotron_h_async/metrics.jsonl" "$OUT/nemotron_h_async_metrics.jsonl" 2>/dev/null
  ;;
Q)
  [ -d data/clevr-gpu ] && export INFLIGHT_SEED_CLEVR=$PWD/data/clevr-gpu  # made on the CPU machine, carried
  stacks Q 300
  # --basetemp: the run directory (driver.log, the pool's and Ray's logs) comes back in the tarball even when the
  # test is stopped (2026-12-05: stopped at 500 s with nothing to read)
  step seed_recipe_gpu_test "${Q_LIMIT_S:-560}" $PY -m pytest -m gpu -x -q -s -p no:cacheprovider --basetemp "$OUT/pytest" \
    tests/integration/services/test_seed_recipe_gpu.py
  grep -ho "SEED_GPU .*" "$OUT/seed_recipe_gpu_test.log" > "$OUT/seed_recipe_gpu.jsonl"
  grep -h "read_back" "$OUT/seed_recipe_gpu.jsonl" | cut -c1-3000
  ray_logs
  ;;
BG|BGW)  # BG: the phases of BG_PHASES ("Q:600 R:450 S:540": phase and its budget in s) one after another in the
  # background, each into /tmp/bg/PHASE, past this call: a command's processes die when it returns unless they start
  # their own session (device README), and on a fresh host the Nano-Omni engine alone took ~190 s (2026-12-05).
  # Both then wait for the chain and bring back the phases finished so far (BGW: in the calls that follow).
  if [ "$PHASE" = BG ]; then
    mkdir -p /tmp/bg/sent
    setsid nohup bash -c 'for pb in $0; do p=${pb%%:*} b=${pb#*:}; echo "== $p ($b s) $(date +%T)"
      OUT=/tmp/bg/$p BUDGET_S=$b Q_LIMIT_S=$(( b - 40 )) bash bench/gpu_session.sh $p; done; touch /tmp/bg/done' \
      "${BG_PHASES:-Q:600 R:450 S:540}" > /tmp/bg/log 2>&1 < /dev/null &
  fi
  while [ ! -f /tmp/bg/done ] && [ "$(left)" -gt 25 ]; do sleep 5; done
  cat /tmp/bg/log
  for t in /tmp/bg/*.tgz; do [ -f "$t" ] && cp "$t" "$OUT/" && mv "$t" /tmp/bg/sent/; done  # each brought back once
  [ -f /tmp/bg/done ] || for d in /tmp/bg/*/; do  # the phase still running: its logs so far
    [ "$d" = /tmp/bg/sent/ ] || tar czf "$OUT/running_$(basename "$d").tgz" "$d" 2>/dev/null; done
  ;;
R|S|RS)
  [ "$PHASE" = R ] || { [ -d "$NH_DIR/nemotron-h-moe-small" ] || build "$NH_DIR/nemotron-h-moe-small" nemotron_h_moe small; }
  case $PHASE in
    R) replay_pair "$moe" R 0 ;;
    S) replay_pair "$NH_DIR/nemotron-h-moe-small" S 0 ;;
    RS) replay_pair "$moe" R $(( $(left) / 2 )); replay_pair "$NH_DIR/nemotron-h-moe-small" S 0 ;;
  esac
  ;;
esac

cp bench/results/*.json "$OUT/" 2>/dev/null
tar czf "$OUT.tgz" "$OUT" 2>/dev/null && rm -rf "$OUT"  # one file comes back, whatever the count
echo "phase $PHASE done in $(( $(date +%s) - start )) s"
