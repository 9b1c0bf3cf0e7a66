#!/bin/bash
# One learning experiment: pretrain (train.py flags after NAME), then probe the last checkpoint on the probe suite
# against a random init of its architecture.
#   experiments/run.sh NAME [train.py flags...]
#   PROBE="--seeds 10" experiments/run.sh NAME ...    # probe.py flags (default: --seeds 5 --no_reference)
#   PHANTOMS=data/phantoms256v experiments/run.sh NAME --config configs/learn.yaml ...   # another pretraining set
# PHANTOMS (default data/phantoms256, plain) must hold the kind of set the run asks for: learn.yaml pretrains on
# varied phantoms (data/phantoms256v); its plain arm (--phantom_varied false --mask_type multiblock) the default folder.
# Writes experiments/learn/NAME.json (the probe report, with the pretraining run's wall and CPU seconds, flags and
# pretraining phantom folder under "pretrain");
# the run goes to experiments/runs/NAME and is not trained again when its last checkpoint is there. The probe sets
# are the ones of data/phantoms256 for every run. The hand-made features and the supervised CNN do not depend on
# the encoder: experiments/learn/reference.json holds them (experiments/run.sh reference, below).
# OMP_NUM_THREADS=1: on a CPU shared with other jobs, torch's 2 threads ran 10x slower than one.
set -e
cd "$(dirname "$0")/.."
name=$1; shift
export OMP_NUM_THREADS=1
mkdir -p experiments/runs
log="experiments/runs/$name.log"
if [ "$name" = reference ]; then  # hand-made features and the supervised CNN on the suite's splits, once
  nice -n 5 python probe.py --ckpt random --config configs/learn.yaml --phantom_dir data/phantoms256 \
    ${PROBE:---seeds 5} --readouts mean_pool --json experiments/learn/reference.json "$@" > "$log" 2>&1
  tail -40 "$log"
  exit
fi
if [ ! -e "experiments/runs/$name/checkpoints/done" ]; then
  /usr/bin/time -o "experiments/runs/$name.time" -f '{"wall_s": %e, "cpu_s": %U, "sys_s": %S}' \
    nice -n 5 python train.py --phantom_dir "${PHANTOMS:-data/phantoms256}" --out_dir experiments/runs \
    --run_name "$name" --summary_probe false "$@" > "$log" 2>&1
  touch "experiments/runs/$name/checkpoints/done"
fi
nice -n 5 python probe.py --ckpt "experiments/runs/$name/checkpoints" --phantom_dir data/phantoms256 --vs_random \
  ${PROBE:---seeds 5 --no_reference} --json "experiments/learn/$name.json" >> "$log" 2>&1
python - "$name" "${PHANTOMS:-data/phantoms256}" "$@" <<'PY'
import json, sys
name, phantoms = sys.argv[1:3]
report = json.load(open(f"experiments/learn/{name}.json"))
report["pretrain"] = {**json.load(open(f"experiments/runs/{name}.time")), "args": sys.argv[3:], "phantoms": phantoms}
json.dump(report, open(f"experiments/learn/{name}.json", "w"), indent=1)
PY
tail -30 "$log"
