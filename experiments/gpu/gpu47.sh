#!/bin/bash
# Issue 47's GPU measurements in one call (~6 minutes on one H100; docs/performance.md, "Issue 47's levers"):
#   experiments/gpu/gpu47.sh OUT                 # on the GPU machine (.whl and .ref carried): ~6 min
#   SMOKE=1 SCALE=8 BUDGET=3000 experiments/gpu/gpu47.sh OUT   # the same steps on a CPU at the smoke size
# Steps, most wanted first, each under its own timeout and all under BUDGET seconds (default 360; with 8 minutes of
# wall, BUDGET=450): a step that fails or runs out of time is logged and the next one runs.
#   1 learn   bench.py train at learn.yaml's size: eager, compiled and reduce-overhead (CUDA graphs): the small-model
#             path (target <= 5 ms an update)
#   2 attn    bench.py attention: each SDPA kernel at ViT-L's shapes (bf16, head dim 64, 9216 tokens)
#   3 prod    bench.py train at ViT-L, batch 2, unsharded: eager, grad_checkpointing auto
#   4 e2e     train.py at ViT-L on built-in phantoms: 60 updates, 2 validations, checkpoints (their seconds)
#   5 ref     experiments/gpu/reference.py: octjepa against facebookresearch/jepa at ViT-L, eager and compiled
#             (--compile_style blocks: a fraction of the compile time)
#   6 demo    bench.py train at the demo's size: eager and reduce-overhead
#   7         as time allows, ViT-L with the fastest SDPA kernel of step 2 (if not torch's choice), and with
#             grad_checkpointing on
# OUT gets gpu47.log (all output), summary.md (the tables, printed last), attention.json, bench_learn.json,
# bench_demo.json, bench_production.json, train_e2e.json, reference.json: 8 files (at most 8 come back).
# REF: facebookresearch/jepa's src/ (default .ref/jepa, ignored); BUDGET: seconds for all steps; SCALE: see below.
set -u
cd "$(dirname "$0")/../.."
out=$1
mkdir -p "$out"
work=$(mktemp -d)
budget=${BUDGET:-360}
scale=${SCALE:-1}  # the steps' timeouts times this (a loaded CPU compiles for minutes: SMOKE=1 SCALE=8 BUDGET=3000)
ref=${REF:-.ref/jepa}
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/gpu47.log"; }
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # pydicom and the JPEG plugins, which the GPU machine's image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    .whl/*.whl && export PYTHONPATH=$work/site
fi
py=${PYTHON:-python3}

step() {  # NAME MAX_SECONDS COMMAND...: run COMMAND under a timeout of at most SCALE x MAX_SECONDS and the budget left
  local name=$1 max=$(( $2 * scale )); shift 2
  local left=$(( budget - ($(date +%s) - t0) ))
  local limit=$(( max < left ? max : left ))
  if (( limit < 20 )); then log "$name: skipped, ${left} s of the budget left"; return 1; fi
  log "$name: start (at most ${limit} s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >> "$out/gpu47.log" 2>&1
  local rc=$?
  log "$name: rc $rc$( ((rc == 124)) && echo ' (timed out)')"
  return $rc
}

if [ -n "${SMOKE:-}" ]; then
  device=cpu; learn="--sizes smoke"; demo="--sizes smoke"; prod="--sizes smoke"; attn="--config configs/smoke.yaml"
  reps=3
  e2e=(--config configs/smoke.yaml --max_steps 12 --val_every_steps 6 --ckpt_every_steps 8 --log_every_steps 2)
  refargs=(--smoke)
else
  device=cuda; learn="--sizes learn"; demo="--sizes demo"; prod="--sizes production"
  attn="--config configs/pretrain_vitl.yaml"; reps=30
  e2e=(--config configs/pretrain_vitl.yaml --shard none --per_core_batch_size 2 --global_batch_size 2
       --grad_accum_steps none --phantom_count 24 --max_steps 60 --val_every_steps 30 --val_batches 1
       --ckpt_every_steps 40 --log_every_steps 5 --warmup_steps 5 --workers 8)
  refargs=(--compile both --compile_style blocks --rounds 5 --warmup 2)
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} >> "$out/gpu47.log" 2>&1

step learn 150 $py bench.py train $learn --variants eager,compiled,reduce-overhead --device $device \
  --repeats $reps --warmup 5 --json "$out/bench_learn.json"
step attn 40 $py bench.py attention $attn --device $device --repeats 10 --json "$out/attention.json"
step prod 70 $py bench.py train $prod --variants eager --device $device --repeats 8 --warmup 2 \
  --json "$work/prod_auto.json"
step e2e 120 $py train.py "${e2e[@]}" --device $device --compile false --summary_probe false --wandb disabled \
  --phantom_dir "$work/phantoms" --out_dir "$work/runs" --run_name e2e
step ref 150 env OUT="$work" $py experiments/gpu/reference.py --ref_dir "$ref" "${refargs[@]}"
cp "$work/reference.json" "$out/reference.json" 2>/dev/null
step demo 90 $py bench.py train $demo --variants eager,reduce-overhead --device $device --repeats $reps --warmup 5 \
  --json "$out/bench_demo.json"
best=$($py experiments/gpu/gpu47_summary.py fastest "$out/attention.json")
if [ -n "$best" ]; then
  step prod-sdpa 50 $py bench.py train $prod --variants eager --device $device --repeats 8 --warmup 2 \
    --sdpa "$best" --json "$work/prod_sdpa_$best.json"
fi
step prod-ckpt 50 $py bench.py train $prod --variants eager --device $device --repeats 8 --warmup 2 \
  --grad_checkpointing true --json "$work/prod_ckpt_on.json"
$py experiments/gpu/gpu47_summary.py table "$out" "$work" 2>&1 | tee -a "$out/gpu47.log"
log "done"
