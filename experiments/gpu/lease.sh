#!/bin/bash
# One GPU lease (15 minutes of device time, this workplace's device tool) for issues 46 and 47, in two calls:
#   bash experiments/gpu/lease.sh start OUT    # carry .whl and .ref; timeout_s 590
#       the wheels installed; experiments/gpu/recipe.py (issue 46's arms) started in its own session: it writes its
#       phantom sets and caches on the CPU cores while experiments/gpu/gpu47.sh times the GPU (issue 47), then trains
#       its arms once gpu47.sh is done; this call returns gpu47.sh's 8 files when the arms' training time is up
#   bash experiments/gpu/lease.sh finish OUT   # right after (the machine stays warm 30 s); timeout_s 300
#       waits for recipe.py's probes and packing, and returns its reports, logs and slim checkpoints
# BUDGET (gpu47.sh's seconds, default 300), TRAIN and PROBE (recipe.py's, default 210 and 120).
set -u
cd "$(dirname "$0")/../.."
mode=$1; out=$2
work=${WORK:-${TMPDIR:-/tmp}/lease46}  # WORK: gpu56.sh's, for its finish
train=${TRAIN:-210}; probe=${PROBE:-120}
case $mode in
start)
  mkdir -p "$work" "$out"
  if [ -d .whl ]; then  # pydicom and the JPEG plugins, which the GPU machine's image lacks
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
      .whl/*.whl && export PYTHONPATH=$work/site
  fi
  setsid nohup python3 experiments/gpu/recipe.py "$work/out" --go "$work/GO" --train_seconds "$train" \
    --probe_seconds "$probe" > "$work/recipe.out" 2>&1 < /dev/null &
  BUDGET=${BUDGET:-300} bash experiments/gpu/gpu47.sh "$out"
  touch "$work/GO"
  sleep "$train"
  tail -5 "$work/recipe.out"
  ;;
finish)
  for _ in $(seq "$(( probe + 120 ))"); do
    [ -f "$work/out/DONE" ] && break
    sleep 1
  done
  tail -25 "$work/recipe.out"
  cp "$work"/out/*.tar.gz "$out"/ 2>/dev/null
  ls -la "$out"
  ;;
esac
