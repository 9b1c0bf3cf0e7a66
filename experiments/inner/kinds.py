"""The `inner_lesion` task's shortcut (and with --cnn its ceiling) per kind of lesion: foci against
none, cysts against none, on the suite's own volumes and probe splits (references.py), so that a
kind that a histogram reads cannot hide behind the other in the pooled task.

    python experiments/inner/kinds.py [SEEDS] [--cnn] [--json experiments/inner/kinds.json]
"""

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from config import load_config  # noqa: E402
from labels import load_labelled_volumes, phantom_set_labels, task_targets  # noqa: E402
from references import handmade_scores, supervised_scores  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("seeds", nargs="?", type=int, default=10, help="probe splits (default 10)")
    parser.add_argument("--cnn", action="store_true", help="also the supervised CNN per kind")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = load_config(["--config", "configs/learn.yaml"])
    labels_csv = phantom_set_labels(cfg, "inner")
    # probe.py's cache
    cfg = dataclasses.replace(cfg, cache_dir=os.path.dirname(labels_csv) + "-cache")
    volumes, values, _ = load_labelled_volumes(cfg, labels_csv, columns=["label", "lesion"])
    out = {"labels": labels_csv, "seeds": args.seeds, "kinds": {}}
    for kind in ("foci", "cysts"):
        keep = np.isin(values["label"], ["none", kind])
        y, _ = task_targets(values["lesion"][keep])
        handmade = handmade_scores(volumes[keep], y, range(args.seeds))
        row = {"volumes": int(keep.sum()), "handmade": {f: s["auroc"] for f, s in handmade.items()}}
        if args.cnn:
            row["supervised"] = supervised_scores(volumes[keep], y, range(args.seeds))["auroc"]
        out["kinds"][kind] = row
        print(
            kind,
            {f: round(s["mean"], 3) for f, s in row["handmade"].items()},
            "CNN",
            round(row["supervised"]["mean"], 3) if args.cnn else "not run",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
