#!/bin/bash
# learn.yaml arms pretrained on one GPU as parallel processes (the device machine of this workplace, one lease);
# their checkpoints come back slimmed to what probe.py reads, and experiments/dense/probe.sh probes them here:
#   experiments/dense/gpu.sh smoke OUT                  # phantoms + cache; 200 updates alone, then 100 in 6 runs at once
#   LONG=12000 BUDGET=470 experiments/dense/gpu.sh arms OUT
#       glf_s0-2   learn.yaml on the GPU (3000 updates): the platform check against the CPU's lfl_s0-2
#       gl4_s0-2   learn.yaml with 4x4x8 tubelets (3000 updates)
#       glfLONG_s0-2  learn.yaml with LONG updates, a checkpoint every CURVE=3000 (keep_last also counts the
#                     best-validation checkpoints, which can push these out: NOTES.md section 16)
# (SHORT=3000: the updates of the first two arms; SEEDS="0 1 2": the pretraining seeds; ONLY_LONG=1: the third arm only)
# Runs still going BUDGET seconds after the start are stopped (SIGTERM: train.py saves the update it is on).
# OUT gets gpu.log, runs.tar.gz (logs, metrics, configs, timings, commands) and tarballs of slim checkpoints (one per
# short arm, one per long run)
# (the target encoder's weights; the context encoder, predictor and AdamW state zeroed or dropped).
# .whl/ (git-ignored; the call carries it): cp312 wheels of pydicom and the pylibjpeg plugins for the device's Python,
# made here with the device README's `pip download` line (experiments/NOTES.md section 16).
set -u
cd "$(dirname "$0")/../.."
mode=$1; out=$2; budget=${BUDGET:-470}; long=${LONG:-12000}; short=${SHORT:-3000}; curve=${CURVE:-3000}; seeds=${SEEDS:-0 1 2}
t0=$(date +%s)
mkdir -p "$out" experiments/runs
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/gpu.log"; }
if [ -d .whl ]; then  # pydicom and the JPEG plugins, which the device image lacks
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    && export PYTHONPATH=$site
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
phantoms=data/phantoms256v
runs=experiments/runs

launch() {  # NAME [train.py flags]: one pretraining run in the background; NAME.time gets its wall and CPU seconds
  local name=$1; shift
  echo "$(date +%H:%M) PHANTOMS=$phantoms experiments/dense/pretrain.sh $name --config configs/learn.yaml $* --probe_every_steps none   # on the GPU: experiments/dense/gpu.sh" >> "$out/commands.log"
  ( start=$(date +%s)
    python3 train.py --config configs/learn.yaml --phantom_dir $phantoms --out_dir $runs --run_name "$name" \
      --summary_probe false --probe_every_steps none "$@" > "$runs/$name.log" 2>&1
    rc=$?
    times > "$runs/$name.times"  # this subshell's children: the run's user and system CPU time
    python3 - "$runs/$name.times" $(( $(date +%s) - start )) $rc > "$runs/$name.time" <<'PY'
import json, re, sys
seconds = [int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", open(sys.argv[1]).readlines()[-1])]
print(json.dumps({"wall_s": int(sys.argv[2]), "cpu_s": seconds[0], "sys_s": seconds[1], "rc": int(sys.argv[3])}))
PY
  ) &
  last=$!
}

last_train_row() {  # NAME: step and median step time of its last 5 logged train rows
  python3 - "$runs/$1/metrics.jsonl" <<'PY'
import json, statistics, sys
import os
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("split") == "train"][-5:] if os.path.exists(sys.argv[1]) else []
print(f'{rows[-1]["step"]} {statistics.median(r["step_time_s"] for r in rows):.4f}' if rows else "not started")
PY
}

prepare() {  # the phantoms and their decoded cache, written once before the runs read them
  python3 - $phantoms <<'PY'
import sys
from dataclasses import replace
from config import load_config
from data import prepare_cache
phantoms = sys.argv[1]
cfg = load_config(["--config", "configs/learn.yaml", "--phantom_dir", phantoms])
print(prepare_cache(replace(cfg, cache_dir=phantoms + "-cache", workers=12), progress=False))
PY
}

if [ "$mode" = smoke ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$out/gpu.log" 2>&1
  python3 -c 'import torch, sklearn; print("torch", torch.__version__, torch.cuda.get_device_name(0), "sklearn", sklearn.__version__)' >> "$out/gpu.log" 2>&1
  prepare > "$out/prepare.log" 2>&1 &
  prepare=$!
  phantoms=data/phantoms_smoke
  steps=${SMOKE_STEPS:-200}
  launch smoke1 --phantom_count 24 --max_steps "$steps" --seed 0
  wait $last
  log "one run alone: $(cat $runs/smoke1.time) $(last_train_row smoke1)"
  tail -3 "$runs/smoke1.log" >> "$out/gpu.log"
  pids=()
  for k in 0 1 2; do launch "smokeA$k" --phantom_count 24 --max_steps $((steps / 2)) --seed $k; pids+=($last); done
  for k in 0 1 2; do launch "smokeC$k" --phantom_count 24 --max_steps $((steps / 2)) --seed $k --patch_size 4,4,8; pids+=($last); done
  wait "${pids[@]}"
  for n in smokeA0 smokeA1 smokeA2 smokeC0 smokeC1 smokeC2; do log "6 at once: $n $(cat $runs/$n.time) $(last_train_row $n)"; done
  wait $prepare; log "phantoms and cache: $(tail -1 $out/prepare.log)"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$out/gpu.log"
  tar czf "$out/runs.tar.gz" --exclude='*.pt' --exclude=encoder $runs/smoke* "$out/commands.log"
  rm "$out/commands.log"
  exit 0
fi

log "phantoms and cache: $(prepare 2>&1 | tail -1)"
if [ -z "${ONLY_LONG:-}" ]; then
  for k in $seeds; do launch "glf_s$k" --seed $k --max_steps "$short"; done
  for k in $seeds; do launch "gl4_s$k" --seed $k --max_steps "$short" --patch_size 4,4,8; done
fi
for k in $seeds; do launch "glf${long}_s$k" --seed $k --max_steps "$long" --ckpt_every_steps "$curve" --keep_last 20; done
log "runs launched (long: $long updates, seeds $seeds)"
while pgrep -f "train.py --config configs/learn.yaml" > /dev/null; do
  sleep 5
  if (( $(date +%s) - t0 > budget )); then
    log "budget reached: stopping $(pgrep -fc 'train.py --config configs/learn.yaml') runs"
    pkill -TERM -f "train.py --config configs/learn.yaml"; sleep 20; break
  fi
  (( ($(date +%s) - t0) % 60 < 5 )) && for d in $runs/gl*/; do log "$(basename "$d") at $(last_train_row "$(basename "$d")")"; done
done
sleep 2
for d in $runs/gl*/; do n=$(basename "$d"); log "$n: $(cat $runs/$n.time 2>/dev/null) $(last_train_row "$n")"; done
python3 - $runs "$out" "$curve" "glf${long}_" <<'PY'
import glob, os, sys, tarfile, torch
runs, out, curve, long_arm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tars = {}
for run in sorted(glob.glob(f"{runs}/gl*/checkpoints")):
    name = run.split("/")[-2]
    bundle = name if name.startswith(long_arm) else name.split("_s")[0]  # at most 8 files come back, 16 MiB each
    if bundle not in tars:
        tars[bundle] = tarfile.open(f"{out}/{bundle}.tar.gz", "w:gz")
    tar = tars[bundle]
    steps = sorted(glob.glob(f"{run}/step_*.pt"))  # the curve's doublings (curve, 2 curve, 4 curve...) and the last
    for path in [p for p in steps if (int(p[-10:-3]) // curve) & (int(p[-10:-3]) // curve - 1) == 0
                 and int(p[-10:-3]) % curve == 0 or p == steps[-1]]:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state.pop("optimizer", None)
        state["model"] = {k: v if k.startswith("target_encoder.") else torch.zeros_like(v)
                          for k, v in state["model"].items()}
        slim = path + ".slim"
        torch.save(state, slim)
        tar.add(slim, arcname=f"{name}/checkpoints/{os.path.basename(path)}")
for tar in tars.values():
    tar.close()
PY
ls -la "$out" >> "$out/gpu.log"
tar czf "$out/runs.tar.gz" --exclude='*.pt' --exclude='*.slim' --exclude=encoder $runs/gl* "$out/commands.log" "$out/gpu.log"
rm "$out/commands.log"
