#!/bin/bash
# Probe one pretraining run of experiments/dense/pretrain.sh on the volume task `lesion` (10 splits, every read-out),
# the dense task `lesion_tokens` and the guard `plain_lesion`, against a random init of its architecture:
#   experiments/dense/probe.sh NAME        -> experiments/dense/NAME.json
# The report gets "pretrain": the run's wall and CPU seconds, its flags and its last validation (loss, target_std,
# RankMe, position share); paths in it are relative to the repository.
set -e
cd "$(dirname "$0")/../.."
name=$1
export OMP_NUM_THREADS=1
python probe.py --ckpt "experiments/runs/$name/checkpoints" --phantom_dir data/phantoms256 --vs_random \
  --seeds 10 --no_reference --tasks lesion,plain_lesion,lesion_tokens --json "experiments/dense/$name.json" \
  > "experiments/runs/$name.probe.log" 2>&1
python - "$name" "$PWD" <<'PY'
import json, sys
name, root = sys.argv[1:3]
path = f"experiments/dense/{name}.json"
report = json.load(open(path))
val = [r for r in map(json.loads, open(f"experiments/runs/{name}/metrics.jsonl")) if r.get("split") == "val"]
args = [line for line in open("experiments/dense/commands.log") if f"pretrain.sh {name} " in line][-1]
report["pretrain"] = {**json.load(open(f"experiments/runs/{name}.time")), "command": args.split(" ", 1)[1].strip(),
                      "last_val": val[-1]}
text = json.dumps(report, indent=1).replace(root + "/", "")
open(path, "w").write(text)
PY
tail -40 "experiments/runs/$name.probe.log"
