#!/bin/bash
# Issue 56 on one GPU lease (15 minutes of device time, this workplace's device tool), in two calls:
#   bash experiments/gpu/gpu56.sh start OUT    # carry .whl and .ref; timeout_s 590
#   bash experiments/gpu/gpu56.sh finish OUT   # right after (the machine stays warm 30 s); timeout_s 300
#   SMOKE=1 bash experiments/gpu/gpu56.sh start OUT; SMOKE=1 bash experiments/gpu/gpu56.sh finish OUT   # the CPU
# What start does, in the issue's order of need:
#   1. the learning arms: experiments/gpu/recipe.py --arms geometry,splits in its own session (the production tubelet's
#      three arms, recipe / linear stem with the local loss / linear stem, and learn.yaml's depth splits 1,1,1 / 1,2,1 /
#      1,4,1; seeds 0-2, several at once, each probed as it ends). It writes its phantom sets and caches on the CPU
#      cores first; meanwhile the GPU is free for
#   2. bench.py train at ViT-L (pretrain_vitl.yaml, one device, batch 2, bf16): the recipe (the stem from 1x4x4
#      cells with E/2 and with E/4 channels, from 2x4x4 cells with E/2), the linear stem with the local loss and
#      without it, interleaved in one process: ms/update, MFU of the same-run matmul peak, peak memory;
#   3. experiments/gpu/reference.py at ViT-L: the update against facebookresearch/jepa's (REF, default .ref/jepa),
#      eager, same architecture and inputs;
#   then the arms train for TRAIN seconds (runs still going get SIGTERM: train.py saves the update it is on, and the
#   probe report says which update it read). finish waits for the probes and returns reports.tar.gz (probe JSON,
#   timings, commands), logs.tar.gz and ckpts_K.tar.gz (slim target encoders, to probe again on a CPU).
# OUT after start: gpu56.log, bench_vitl.json, reference.json; after finish: the arms' archives too.
# TRAIN, PROBE: recipe.py's budgets (default 240 and 150 s); BENCH, REF_SECONDS: steps 2 and 3's timeouts (170, 120).
set -u
cd "$(dirname "$0")/../.."
repo=$(pwd)
mode=$1; out=$2
work=${TMPDIR:-/tmp}/lease56
train=${TRAIN:-240}; probe=${PROBE:-150}
mkdir -p "$work" "$out"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/gpu56.log"; }
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -n "${SMOKE:-}" ]; then  # in a copy of the tree: its small phantom sets never replace the full ones in data/
  device=cpu; smoke=--smoke; vitl=(--config configs/smoke.yaml); refargs=(--smoke); train=${TRAIN:-60}
  if [ "$mode" = start ]; then
    rm -rf "$work/tree" && mkdir -p "$work/tree" && git ls-files -z | xargs -0 cp --parents -t "$work/tree"
  fi
  out=$(realpath "$out"); cd "$work/tree"
else
  device=cuda; smoke=; vitl=(--config configs/pretrain_vitl.yaml --shard none --global_batch_size 2
    --grad_accum_steps none); refargs=(--rounds 5 --warmup 2)
fi
case $mode in
start)
  if [ -d .whl ]; then  # pydicom and the JPEG plugins, which the GPU machine's image lacks
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
      .whl/*.whl && export PYTHONPATH=$work/site
  fi
  rm -f "$work/GO"
  setsid nohup $py experiments/gpu/recipe.py "$work/out" --arms geometry,splits --go "$work/GO" \
    --train_seconds "$train" --probe_seconds "$probe" $smoke > "$work/recipe.out" 2>&1 < /dev/null &
  log "recipe.py started (pid $!): preparing its data on the CPU"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  } >> "$out/gpu56.log" 2>&1
  log "bench at ViT-L, interleaved: the config's recipe, its stem at E/4, from 2x4x4 cells, linear_local, linear"
  timeout --signal=INT --kill-after=15 "${BENCH:-170}" $py bench.py train "${vitl[@]}" --device $device \
    --per_core_batch_size 2 --variants eager,hmlp_1x4x4,hmlp_1x4x4_narrow,hmlp_2x4x4,linear_local,linear \
    --warmup 2 --repeats 6 --json "$out/bench_vitl.json" >> "$out/gpu56.log" 2>&1
  log "bench: rc $?"
  log "reference: octjepa against facebookresearch/jepa at ViT-L, eager"
  timeout --signal=INT --kill-after=15 "${REF_SECONDS:-120}" env OUT="$out" $py experiments/gpu/reference.py \
    --ref_dir "${REF:-.ref/jepa}" --device $device "${refargs[@]}" >> "$out/gpu56.log" 2>&1
  log "reference: rc $?"
  touch "$work/GO"
  log "the arms train for $train s"
  sleep "$train"
  tail -5 "$work/recipe.out" | tee -a "$out/gpu56.log"
  ;;
finish)  # lease.sh's finish on this lease's folder
  WORK=$work PROBE=$probe bash "$repo/experiments/gpu/lease.sh" finish "$out"
  ;;
esac
