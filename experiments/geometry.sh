#!/bin/bash
# Issue 56's production-tubelet arms on the CPU: learn.yaml at the production tubelet, 4x16x16 on 16x128x128 inputs
# (the same 256-token grid, the same varied phantoms), 3000 updates, then probe.py on `lesion`, `inner_lesion` and the
# dense task `lesion_tokens` (10 splits, attentive, beside its random init).
#   experiments/geometry.sh ARM SEED     # ARM: recipe (hmlp stem from 1x2x2 cells, local loss 0.5 on depth
#                                        # quarters), cell (the same from 1x4x4 cells: 64 cells a tubelet, as
#                                        # learn.yaml's stem at 4x8x8), narrow (the cell arm with stem_width
#                                        # 0.25: E/4 channels inside the stem, as Touvron's), deep_cell
#                                        # (the cell arm from 2x4x4 cells: a first cell two slices
#                                        # deep, half the first maps), linear_local
#                                        # (linear stem, the same local loss), linear (linear stem alone)
#   experiments/geometry.sh reference    # the hand-made features and the CNNs at this geometry, on the same splits
#                                        # (the CNN: ~9 min a split on 2 cores, about 3 hours for the three tasks)
# Writes experiments/geometry/geo_ARM_sS.json (the probe report, with the pretraining run's wall and CPU seconds
# under "pretrain"); the run goes to experiments/runs/geo_ARM_sS and is not trained again once done.
# OMP_NUM_THREADS=1 and nice: two arms share the 2-core CI machine, shared with other jobs.
set -e
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
geometry=(--config configs/learn.yaml --image_size 16,128,128 --patch_size 4,16,16)
tasks=lesion,inner_lesion,lesion_tokens
mkdir -p experiments/runs experiments/geometry
if [ "$1" = reference ]; then
  exec nice -n 10 python probe.py --ckpt random "${geometry[@]}" --tasks "$tasks" --readouts attentive --seeds 10 \
    --json experiments/geometry/reference.json
fi
arm=$1 seed=$2
case $arm in
  recipe) flags=(--patch_stem hmlp --local_loss_weight 0.5 --local_loss_split 1,4,1) ;;
  cell) flags=(--patch_stem hmlp --stem_cell 1,4,4 --local_loss_weight 0.5 --local_loss_split 1,4,1) ;;
  narrow) flags=(--patch_stem hmlp --stem_cell 1,4,4 --stem_width 0.25 --local_loss_weight 0.5
                 --local_loss_split 1,4,1) ;;
  deep_cell) flags=(--patch_stem hmlp --stem_cell 2,4,4 --local_loss_weight 0.5 --local_loss_split 1,4,1) ;;
  linear_local) flags=(--patch_stem linear --local_loss_weight 0.5 --local_loss_split 1,4,1) ;;
  linear) flags=(--patch_stem linear --local_loss_weight 0) ;;
  *) echo "ARM is recipe, cell, narrow, deep_cell, linear_local or linear, got '$arm'" >&2; exit 2 ;;
esac
name="geo_${arm}_s$seed"
log="experiments/runs/$name.log"
if [ ! -e "experiments/runs/$name/checkpoints/done" ]; then
  /usr/bin/time -o "experiments/runs/$name.time" -f '{"wall_s": %e, "cpu_s": %U, "sys_s": %S}' \
    nice -n 10 python train.py "${geometry[@]}" "${flags[@]}" --seed "$seed" \
    --out_dir experiments/runs --run_name "$name" --summary_probe false --probe_every_steps none > "$log" 2>&1
  touch "experiments/runs/$name/checkpoints/done"
fi
nice -n 10 python probe.py --ckpt "experiments/runs/$name/checkpoints" --vs_random --no_reference \
  --tasks "$tasks" --readouts attentive --seeds 10 --json "experiments/geometry/$name.json" >> "$log" 2>&1
python - "$name" "${geometry[@]}" "${flags[@]}" --seed "$seed" <<'PY'
import json, sys
name, args = sys.argv[1], sys.argv[2:]
report = json.load(open(f"experiments/geometry/{name}.json"))
report["pretrain"] = {**json.load(open(f"experiments/runs/{name}.time")), "args": args}
json.dump(report, open(f"experiments/geometry/{name}.json", "w"), indent=1)
PY
tail -20 "$log"
