"""The demo's verdict again on finished runs, with more splits or more probe volumes: how much of
its spread is the read-out's. Each run's newest checkpoint is read and judged by runprobe.verdict,
as at the end of training, on the first VOLUMES labelled phantoms and SPLITS splits; the report
holds the per-split values, so the first 5 splits of a 10-split verdict are the 5-split verdict the
run printed.

    python experiments/demo_verdicts.py --volumes 240,300 --splits 10 experiments/runs/varied_s0 ...
    # -> experiments/demo/verdicts/RUN.json: {"VOLUMESxSPLITS": the verdict's attentive read-out,
    ...}
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import (
    read_model_checkpoint,
    resolve_checkpoint,
)  # noqa: E402  (the repo's flat modules)
from runprobe import prepare_probe_set, verdict  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "verdicts")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="+", help="run folders (experiments/demo.sh's experiments/runs/NAME_sS)"
    )
    parser.add_argument("--volumes", default="240,300", help="probe set sizes, comma-separated")
    parser.add_argument("--splits", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    for run in args.runs:
        model, cfg, _ = read_model_checkpoint(resolve_checkpoint(os.path.join(run, "checkpoints")))
        report = {}
        for volumes in map(int, args.volumes.split(",")):
            result = verdict(
                model,
                cfg,
                prepare_probe_set(cfg, max_volumes=volumes),
                torch.device("cpu"),
                seeds=args.splits,
            )
            report[f"{volumes}x{args.splits}"] = {
                **result["readouts"]["attentive"],
                "task": result["task"],
            }
            a = result["readouts"]["attentive"]
            print(
                f"{os.path.basename(run)} {volumes}x{args.splits}: {a['pretrained']['mean']:.3f} vs"
                f" random {a['vs_random']['mean']:+.3f} [{a['vs_random']['low']:+.3f},"
                f" {a['vs_random']['high']:+.3f}] vs hand-made {a['vs_handmade']['mean']:+.3f}"
                f" [{a['vs_handmade']['low']:+.3f}]",
                flush=True,
            )
        with open(os.path.join(OUT, f"{os.path.basename(run.rstrip('/'))}.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
