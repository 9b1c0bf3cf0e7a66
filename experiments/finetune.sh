#!/bin/bash
# Full fine-tuning of a pretrained encoder against a random init with the same budget (README "Fine-tune on
# labelled volumes"): pretrain configs/learn.yaml with seeds 0, 1, 2, export each encoder, run finetune.py on the
# 240 labelled phantoms (patient-level 5-fold CV; the random init once, with seed 0's run: it is the same for all),
# then the table: python experiments/finetune_table.py experiments/finetune_s0.json experiments/finetune_s1.json ...
# OMP_NUM_THREADS=1: on a CPU shared with other jobs, torch's 2 threads ran 10x slower than one.
set -e
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
labels=data/phantoms_learn_probe/labels.csv  # written by the first pretraining run (its summary probe)
for seed in 0 1 2; do
  run=learn-s$seed
  python train.py --config configs/learn.yaml --seed $seed --run_name $run --out_dir experiments/runs \
    > experiments/runs/$run.log 2>&1
  python encoder.py export --ckpt experiments/runs/$run/checkpoints --out experiments/runs/$run/encoder
  random=$([ $seed = 0 ] && echo --vs_random || true)
  python finetune.py --encoder experiments/runs/$run/encoder --labels $labels $random \
    --out experiments/runs/finetune-s$seed > experiments/runs/finetune-s$seed.log 2>&1
  cp experiments/runs/finetune-s$seed/report.json experiments/finetune_s$seed.json
done
python experiments/finetune_table.py experiments/finetune_s0.json experiments/finetune_s1.json experiments/finetune_s2.json
