"""The volume task `lesion` read from tokens that hold only their own voxel statistics (dense.py's hand-made token
features, on both tubelet grids): probe.py's attentive and mean_pool read-outs, its splits (seeds 0..N-1). What an
encoder could read that kept each token's statistics and nothing else: the reference for the local loss's arms.

    python experiments/dense/handmade_attentive.py [SEEDS] > experiments/dense/handmade_attentive.json
"""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from config import load_config  # noqa: E402
from dense import handmade_token_features  # noqa: E402
from labels import load_labelled_volumes, phantom_labels, task_targets  # noqa: E402
from probe import Task, readout_scores  # noqa: E402

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
cfg = load_config(["--config", "configs/learn.yaml", "--phantom_dir", "data/phantoms256"])
labels_csv = phantom_labels(cfg, varied=True)
cfg = dataclasses.replace(cfg, cache_dir=os.path.dirname(labels_csv) + "-cache")
volumes, values, _ = load_labelled_volumes(cfg, labels_csv, columns=["lesion"])
task = Task("lesion", "lesion")
targets, _ = task_targets(task, values["lesion"], labels_csv)
report = {"labels": os.path.relpath(labels_csv), "seeds": seeds, "task": "lesion", "features": {}}
for patch in ([4, 8, 8], [4, 4, 8]):
    grid = [s // p for s, p in zip(cfg.image_size, patch)]
    for name, features in handmade_token_features(volumes, grid).items():
        scores = readout_scores(torch.from_numpy(features).float(), grid, targets, task, range(seeds),
                                ("attentive", "mean_pool"))
        report["features"][f"{name} {','.join(map(str, patch))}"] = scores
        print(name, patch, {r: round(s["auroc"]["mean"], 3) for r, s in scores.items()}, file=sys.stderr)
print(json.dumps(report, indent=1))
