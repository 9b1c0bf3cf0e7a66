"""The volume task `lesion` read from tokens that hold only their own voxel statistics (dense.py's
hand-made token features, on both tubelet grids): probe.py's attentive and mean_pool read-outs, its
splits (seeds 0..N-1). What an encoder could read that kept each token's statistics and nothing
else: the reference for the local loss's arms. Also 4x8x8 tokens that hold the statistics of their
sub-blocks (`--local_loss_split`'s targets: e.g. "by 1,2,1", each token's two depth halves), the
reference for the local loss on sub-blocks.

    python experiments/dense/handmade_attentive.py [SEEDS] > experiments/dense/handmade_attentive.json
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from config import phantom_labels_path  # noqa: E402
from references import handmade_token_features  # noqa: E402
from readouts import readout_scores  # noqa: E402
from suite import lesion_suite  # noqa: E402  (experiments/dense/suite.py)

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
cfg, volumes, task, targets = lesion_suite()


def by_token(features: np.ndarray, grid: list, split: list) -> np.ndarray:
    """Features [M, N*S, F] of the sub-block grid (grid times split per axis) grouped by token of
    `grid`: [M, N, S*F]."""
    (gd, gh, gw), (sd, sh, sw), (M, _, F) = grid, split, features.shape
    # [M, gd, gh, gw, sd, sh, sw, F]
    x = features.reshape(M, gd, sd, gh, sh, gw, sw, F).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(M, gd * gh * gw, -1)


report = {
    "labels": os.path.relpath(phantom_labels_path(cfg, varied=True)),
    "seeds": seeds,
    "task": "lesion",
    "features": {},
}
for patch, split in (
    ([4, 8, 8], [1, 1, 1]),
    ([4, 4, 8], [1, 1, 1]),
    ([4, 8, 8], [1, 2, 1]),
    ([4, 8, 8], [1, 4, 1]),
):
    grid = [s // p for s, p in zip(cfg.image_size, patch)]
    sub_grid = [g * n for g, n in zip(grid, split)]
    for name, features in handmade_token_features(volumes, sub_grid).items():
        if split != [1, 1, 1] and name != "token_stats_histogram":
            continue
        scores = readout_scores(
            torch.from_numpy(by_token(features, grid, split)).float(),
            grid,
            targets,
            range(seeds),
            ("attentive", "mean_pool"),
        )
        key = f"{name} {','.join(map(str, patch))}" + (
            f" by {','.join(map(str, split))}" if split != [1, 1, 1] else ""
        )
        report["features"][key] = scores
        print(key, {r: round(s["auroc"]["mean"], 3) for r, s in scores.items()}, file=sys.stderr)
print(json.dumps(report, indent=1))
