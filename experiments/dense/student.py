"""Probe the context encoder (the student) of a run instead of its target encoder: for a frozen
teacher (`--ema_base 1.0 --ema_end 1.0`: dBOT's stage 1), where the target encoder stays the random
init and what was learnt is in the student. Writes experiments/runs/NAME/ (its newest checkpoint
with the student's weights as the target encoder's, its metrics.jsonl and timing) for
experiments/dense/probe.sh NAME:
    python experiments/dense/student.py RUN NAME
"""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from checkpoint import list_checkpoints, read_checkpoint, save_checkpoint  # noqa: E402


def main(run: str, name: str) -> None:
    runs = ROOT / "experiments" / "runs"
    newest = list_checkpoints(str(runs / run / "checkpoints"))[0]
    state = read_checkpoint(newest)
    model = state["model"]
    student = {k.removeprefix("encoder."): v for k, v in model.items() if k.startswith("encoder.")}
    for key, value in student.items():
        model[f"target_encoder.{key}"] = value.clone()
    out = runs / name / "checkpoints"
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(str(out / Path(newest).name), state, keep_last=1, best=False)
    shutil.copy(runs / run / "metrics.jsonl", runs / name / "metrics.jsonl")
    shutil.copy(runs / f"{run}.time", runs / f"{name}.time")
    print(
        f"{out / Path(newest).name}: the student of {run} ({len(student)} tensors) as the target"
        " encoder"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
