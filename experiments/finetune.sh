#!/bin/bash
# Full fine-tuning of pretrained encoders against a random init with the same budget, on the valid task `lesion`
# (experiments/README.md, "Fine-tuning"): pretrain configs/learn.yaml with seeds 0, 1, 2 on the varied phantoms and
# export each encoder; export the random init of the same architecture (pretrained.random_encoder, seed 0: the one
# finetune.py --vs_random uses); run finetune.py on the suite's 300 labelled varied phantoms (probe.py's `lesion`
# task; patient-level 5-fold CV, the same folds for all) for each; then the tables. The runs of 2026-11-26 ran these
# steps two at a time (experiments/finetune/lesion.commands.log), with learn.yaml before its local loss (git show
# 03a17bc:configs/learn.yaml). The 2026-11-24 runs (plain phantoms, the
# learn.yaml of that day): `git show b99fd57:experiments/finetune.sh`.
# OMP_NUM_THREADS=1: on a CPU shared with other jobs, torch's 2 threads ran 10x slower than one.
set -e
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
runs=experiments/runs
python -c 'import probe, config; cfg = config.load_config(["--phantom_dir", "data/phantoms256"]); probe.phantom_labels(cfg, varied=True)'
labels=data/phantoms256_suite/labels.csv
for seed in 0 1 2; do
  PHANTOMS=data/phantoms256v experiments/dense/pretrain.sh lf_s$seed --config configs/learn.yaml --seed $seed \
    --probe_every_steps none
  python encoder.py export --ckpt $runs/lf_s$seed/checkpoints --out $runs/lf_s$seed/encoder
done
python -c "from pretrained import load_encoder, random_encoder, save_encoder
e = load_encoder('$runs/lf_s0/encoder'); r = random_encoder(e.config, 0)
save_encoder(r.state_dict(), {k: v for k, v in e.config.items() if k != 'weights'}, '$runs/lf_random/encoder')"
mkdir -p experiments/finetune/lesion
for lr in 3e-4 1e-3; do  # 3e-4: finetune.py's default (reports NAME.json); 1e-3: the pilot's (NAME-lr1e-3.json)
  suffix=$([ $lr = 3e-4 ] || echo -lr$lr)
  for name in lf_random lf_s0 lf_s1 lf_s2; do
    python finetune.py --encoder $runs/$name/encoder --labels $labels --out $runs/finetune-$name$suffix --lr $lr \
      > $runs/finetune-$name$suffix.log 2>&1
    cp $runs/finetune-$name$suffix/report.json experiments/finetune/lesion/$name$suffix.json
  done
  python experiments/finetune_table.py experiments/finetune/lesion/lf_random$suffix.json \
    experiments/finetune/lesion/lf_s{0,1,2}$suffix.json
done
