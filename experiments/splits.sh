#!/bin/bash
# Issue 56's depth-split arms on the CPU: learn.yaml (hmlp stem, local loss 0.5) with local_loss_split SPLIT,
# 3000 updates, then probe.py on `lesion` and `inner_lesion` (10 splits, attentive, beside its random init).
#   experiments/splits.sh SPLIT SEED        # e.g. experiments/splits.sh 1,1,1 0
# Writes experiments/splits/splitABC_sS.json (the probe report, with the pretraining run's wall and CPU
# seconds under "pretrain"); the run goes to experiments/runs/splitABC_sS and is not trained again once done.
# OMP_NUM_THREADS=1 and nice: two arms share the 2-core CI machine, shared with other jobs.
set -e
cd "$(dirname "$0")/.."
split=$1 seed=$2
name="split${split//,/}_s$seed"
export OMP_NUM_THREADS=1
mkdir -p experiments/runs experiments/splits
log="experiments/runs/$name.log"
if [ ! -e "experiments/runs/$name/checkpoints/done" ]; then
  /usr/bin/time -o "experiments/runs/$name.time" -f '{"wall_s": %e, "cpu_s": %U, "sys_s": %S}' \
    nice -n 10 python train.py --config configs/learn.yaml --local_loss_split "$split" --seed "$seed" \
    --out_dir experiments/runs --run_name "$name" --summary_probe false > "$log" 2>&1
  touch "experiments/runs/$name/checkpoints/done"
fi
nice -n 10 python probe.py --ckpt "experiments/runs/$name/checkpoints" --vs_random --no_reference \
  --tasks lesion,inner_lesion --readouts attentive --seeds 10 --json "experiments/splits/$name.json" >> "$log" 2>&1
python - "$name" "$split" "$seed" <<'PY'
import json, sys
name, split, seed = sys.argv[1:4]
report = json.load(open(f"experiments/splits/{name}.json"))
report["pretrain"] = {**json.load(open(f"experiments/runs/{name}.time")),
                      "args": ["--config", "configs/learn.yaml", "--local_loss_split", split, "--seed", seed]}
json.dump(report, open(f"experiments/splits/{name}.json", "w"), indent=1)
PY
tail -20 "$log"
