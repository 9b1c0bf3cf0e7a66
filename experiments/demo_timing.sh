#!/bin/bash
# The README's first command from a fresh clone of this checkout's HEAD, timed: each output line stamped with its
# seconds since the start, under a new key file (the site's first run).
#   experiments/demo_timing.sh [LOG]      # default LOG: experiments/runs/demo_timing.log
set -e
repo="$(cd "$(dirname "$0")/.." && pwd)"
log="$(realpath -m "${1:-$repo/experiments/runs/demo_timing.log}")"
mkdir -p "$(dirname "$log")"
work="$(mktemp -d)"
git clone -q "$repo" "$work/octjepa" && cd "$work/octjepa"
export OCTJEPA_PATIENT_KEY_FILE="$work/site.key"
start=$(date +%s.%N)
( python3 -m venv .venv && . .venv/bin/activate && pip install -q -r requirements.txt && echo INSTALLED && python train.py ) 2>&1 \
  | while IFS= read -r line; do printf '%7.1f %s\n' "$(echo "$(date +%s.%N) - $start" | bc)" "$line"; done > "$log"
echo "total $(echo "$(date +%s.%N) - $start" | bc)" >> "$log"
tail -1 "$log"
