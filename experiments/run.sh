#!/bin/bash
# One learning experiment: pretrain (flags after NAME), then probe the last checkpoint vs a random init.
#   experiments/run.sh NAME [train.py flags...]
# Writes experiments/NAME.json (probe report + run summary) and experiments/NAME.png; the run in experiments/runs/NAME.
# OMP_NUM_THREADS=1: on a CPU shared with other jobs, torch's 2 threads ran 10x slower than one.
set -e
cd "$(dirname "$0")/.."
name=$1; shift
export OMP_NUM_THREADS=1
nice -n 5 python train.py --phantom_dir data/phantoms256 --out_dir experiments/runs --run_name "$name" "$@" \
  > "experiments/runs/$name.log" 2>&1
nice -n 5 python probe.py --ckpt "experiments/runs/$name/checkpoints" --phantom_dir data/phantoms256 --vs_random \
  --seeds 5 --json "experiments/$name.json" --plot "experiments/$name.png" >> "experiments/runs/$name.log" 2>&1
tail -8 "experiments/runs/$name.log"
