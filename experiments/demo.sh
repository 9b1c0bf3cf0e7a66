#!/bin/bash
# One demo experiment: `python train.py --seed SEED` (the demo config, built-in phantoms in data/phantoms, its
# end-of-run summary probe against a random init) with other train.py flags, then the summary to
# experiments/demo/NAME_sSEED.json (summary_probe, the last validation line, wall and CPU seconds, the flags).
#   experiments/demo.sh NAME SEED [train.py flags...]
#   python experiments/table.py demo NAME [NAME...]      # one row per run, and paired over the seeds per arm
# The run goes to experiments/runs/NAME_sSEED and is not trained again when it finished.
set -e
cd "$(dirname "$0")/.."
name=$1_s$2; seed=$2; shift 2
export OMP_NUM_THREADS=1  # two runs at a time on 2 cores
mkdir -p experiments/runs experiments/demo
if [ ! -e "experiments/runs/$name/checkpoints/done" ]; then
  rm -rf "experiments/runs/$name"
  /usr/bin/time -o "experiments/runs/$name.time" -f '{"wall_s": %e, "cpu_s": %U}' \
    python train.py --seed "$seed" --out_dir experiments/runs --run_name "$name" "$@" > "experiments/runs/$name.log" 2>&1
  touch "experiments/runs/$name/checkpoints/done"
fi
python - "$name" "$@" <<'PY'
import json, sys
name, run = sys.argv[1], f"experiments/runs/{sys.argv[1]}"
events = [json.loads(line) for line in open(f"{run}/events.jsonl")]
metrics = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
report = {"summary_probe": [e for e in events if e["event"] == "summary_probe"][-1],
          "last_val": [m for m in metrics if m["split"] == "val"][-1],
          "pretrain": {**json.load(open(f"{run}.time")), "args": sys.argv[2:]}}
json.dump(report, open(f"experiments/demo/{name}.json", "w"), indent=1)
PY
tail -12 "experiments/runs/$name.log"
