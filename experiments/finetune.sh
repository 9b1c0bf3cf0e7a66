#!/bin/bash
# Full fine-tuning of pretrained encoders against a random init with the same budget (experiments/README.md,
# "Fine-tuning"): pretrain configs/learn.yaml with seeds 0, 1, 2 and export each encoder; export the random init
# of the same architecture (model.random_encoder, seed 0: the one finetune.py --vs_random uses); run finetune.py on
# the 240 labelled phantoms (patient-level 5-fold CV, the same folds for all) for each; then the tables.
# OMP_NUM_THREADS=1: on a CPU shared with other jobs, torch's 2 threads ran 10x slower than one.
set -e
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
runs=experiments/runs
labels=data/phantoms_learn_probe/labels.csv  # written by the first pretraining run (its summary probe)
for seed in 0 1 2; do
  python train.py --config configs/learn.yaml --seed $seed --run_name learn-s$seed --out_dir $runs \
    > $runs/learn-s$seed.log 2>&1
  python encoder.py export --ckpt $runs/learn-s$seed/checkpoints --out $runs/learn-s$seed/encoder
done
python -c "from model import load_encoder, random_encoder, save_encoder
e = load_encoder('$runs/learn-s0/encoder'); r = random_encoder(e.config, 0)
save_encoder(r.state_dict(), {k: v for k, v in e.config.items() if k != 'weights'}, '$runs/random/encoder')"
for name in random learn-s0 learn-s1 learn-s2; do
  python finetune.py --encoder $runs/$name/encoder --labels $labels --out $runs/finetune-$name \
    > $runs/finetune-$name.log 2>&1
  cp $runs/finetune-$name/report.json experiments/finetune/$name.json
done
python experiments/finetune_table.py experiments/finetune/random.json experiments/finetune/learn-s{0,1,2}.json
