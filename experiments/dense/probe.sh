#!/bin/bash
# Probe one pretraining run of experiments/dense/pretrain.sh on the volume task `lesion` (attentive and mean_pool),
# the dense task `lesion_tokens` and the guard `plain_lesion` (depth_rows), 10 splits each:
#   experiments/dense/probe.sh NAME            -> experiments/dense/NAME.json, with a random init of its architecture
#   WITH_RANDOM=no experiments/dense/probe.sh NAME  -> the same without the random init (compared with another arm's)
#   experiments/dense/probe.sh ARM_sK STEP     -> its checkpoint of update STEP: experiments/dense/ARMuSTEP_sK.json
#                                                 (a point of the learning curve; summary.py reads it as arm ARMuSTEP)
# The report gets "pretrain": the run's wall and CPU seconds, its command and its last validation (loss, target_std,
# RankMe, position share); paths in it are relative to the repository.
set -e
cd "$(dirname "$0")/../.."
name=$1
export OMP_NUM_THREADS=1
vs_random=$([ "${WITH_RANDOM:-yes}" = no ] || echo --vs_random)
ckpt="experiments/runs/$name/checkpoints"
run=$name
if [ -n "$2" ]; then
  ckpt="$ckpt/$(printf 'step_%07d.pt' "$2")"
  name="${name%_s*}u$2_s${name##*_s}"
fi
python probe.py --ckpt "$ckpt" --phantom_dir data/phantoms256 $vs_random --seeds 10 --no_reference \
  --tasks lesion,lesion_tokens --readouts attentive,mean_pool --json "experiments/runs/$name.varied.json" \
  > "experiments/runs/$name.probe.log" 2>&1
python probe.py --ckpt "$ckpt" --phantom_dir data/phantoms256 $vs_random --seeds 10 --no_reference \
  --tasks plain_lesion --readouts depth_rows --json "experiments/runs/$name.plain.json" >> "experiments/runs/$name.probe.log" 2>&1
python - "$name" "$PWD" "$run" <<'PY'
import json, sys
name, root, run = sys.argv[1:4]
report = json.load(open(f"experiments/runs/{name}.varied.json"))
report["tasks"].update(json.load(open(f"experiments/runs/{name}.plain.json"))["tasks"])
for t in report["tasks"].values():  # without a random init the encoder is called "encoder": it is the pretrained one
    t["encoders"] = {("pretrained" if k == "encoder" else k): v for k, v in t["encoders"].items()}
    share = t.get("position_share", {})
    if "encoder" in share:
        share["pretrained"] = share.pop("encoder")
    t["versus"] = {("pretrained" if k == "encoder" else k): v for k, v in t["versus"].items()}
step = int(name.split("u")[-1].split("_s")[0]) if name != run else None  # a learning-curve point: its update
val = [r for r in map(json.loads, open(f"experiments/runs/{run}/metrics.jsonl")) if r.get("split") == "val"
       and (step is None or r["step"] <= step)]
args = [line for line in open("experiments/dense/commands.log")  # its pretraining, or student.py making it
        if f"pretrain.sh {run} " in line or ("student.py" in line and line.split("#")[0].split()[-1] == run)][-1]
report["pretrain"] = {**json.load(open(f"experiments/runs/{run}.time")), "command": args.split(" ", 1)[1].strip(),
                      "last_val": val[-1]}
open(f"experiments/dense/{name}.json", "w").write(json.dumps(report, indent=1).replace(root + "/", ""))
PY
tail -30 "experiments/runs/$name.probe.log"
