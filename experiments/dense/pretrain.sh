#!/bin/bash
# Pretraining only (run.sh's training step, same flags and timing file); experiments/run.sh NAME later probes the
# checkpoint without training again.   experiments/dense/pretrain.sh NAME [train.py flags...]
set -e
cd "$(dirname "$0")/../.."
name=$1; shift
export OMP_NUM_THREADS=1
mkdir -p experiments/runs
/usr/bin/time -o "experiments/runs/$name.time" -f '{"wall_s": %e, "cpu_s": %U, "sys_s": %S}' \
  python train.py --phantom_dir "${PHANTOMS:-data/phantoms256}" --out_dir experiments/runs \
  --run_name "$name" --summary_probe false "$@" > "experiments/runs/$name.log" 2>&1
touch "experiments/runs/$name/checkpoints/done"
