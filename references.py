"""What an encoder's read-outs are measured against, beside a random init (the floor): the shortcut
and the ceiling.

    the shortcut   hand-made features a label may be read from without learning anything: per volume
                   (HANDMADE: a depth profile, an intensity histogram, pooled voxels) and per token
                   (each token's own voxel statistics: handmade_token_features)
    the ceiling    SmallCNN, a small 3D CNN trained from scratch on the same training split by
                   fit_cnn, one net and one training loop for both: a head per volume (VOLUME_CNN)
                   or a lesion logit per token (TOKEN_CNN)

A task is valid when its best hand-made features are near chance and the CNN is well above it
(probe.py).
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import LOCAL_BINS
from progress import counted, progress
from readouts import classification_scores, intervals, linear_probe, probe_split, train_steps

HANDMADE = ("depth_profile", "histogram", "pooled_voxels", "profile_histogram")
HISTOGRAM_BINS = 32  # over [-3, 3] standard deviations of the normalized volume
POOLED_GRID = (4, 8, 8)  # raw voxels average-pooled to this [D, H, W] grid
TOKEN_PERCENTILES = (10, 25, 50, 75, 90)
# a valid task: the best hand-made features score at most this (0.5 = chance) ...
VALID_SHORTCUT_MAX = 0.65
VALID_CEILING_MIN = 0.75  # ... and the supervised CNN at least this
Split = Tuple[np.ndarray, np.ndarray]  # (train, test) indices of a probe split


# --------------------------------------------------------------------------------------------------
# The shortcut: hand-made features
# --------------------------------------------------------------------------------------------------


def handmade_features(volumes: torch.Tensor) -> Dict[str, np.ndarray]:
    """HANDMADE features [M, F] of normalized volumes [M, 1, D, H, W], each a shortcut a label may
    be read from: depth_profile (mean intensity per depth row: H numbers), histogram
    (HISTOGRAM_BINS-bin intensity histogram), pooled_voxels (the volume average-pooled to
    POOLED_GRID), profile_histogram (the first two together)."""
    x = volumes.float()[:, 0]  # [M, D, H, W]
    profile = x.mean((1, 3)).numpy()  # [M, H]
    flat = x.flatten(1)  # [M, voxels]
    histogram = (
        torch.stack([torch.histc(v.clamp(-3, 3), HISTOGRAM_BINS, -3, 3) for v in flat]).numpy()
        / flat.shape[1]
    )
    pooled = F.adaptive_avg_pool3d(x[:, None], POOLED_GRID).flatten(1).numpy()  # [M, 4*8*8]
    return {
        "depth_profile": profile,
        "histogram": histogram,
        "pooled_voxels": pooled,
        "profile_histogram": np.concatenate([profile, histogram], axis=1),
    }


def handmade_scores(
    volumes: torch.Tensor,
    labels: np.ndarray,
    seeds: Sequence[int],
    splits: Optional[Sequence[Split]] = None,
) -> Dict[str, Dict[str, dict]]:
    """{feature set: {metric: interval}} of a linear model on each HANDMADE feature set for the
    class ids labels [M], on the same probe splits as the encoders' read-outs: each seed's
    probe_split, or the `splits` given."""
    features = handmade_features(volumes)
    runs: Dict[str, List[dict]] = {name: [] for name in features}
    for train, test in counted(
        splits or [probe_split(labels, seed) for seed in seeds], "hand-made features", "split"
    ):
        for name, x in features.items():
            runs[name].append(linear_probe(x, labels, train, test))
    return {name: intervals(r) for name, r in runs.items()}


def per_token(x: np.ndarray, grid: Sequence[int]) -> np.ndarray:
    """Voxels [D, H, W] (each axis a multiple of the grid's) grouped by token: [N, voxels per
    token]."""
    (D, H, W), (gd, gh, gw) = x.shape, grid
    if D % gd or H % gh or W % gw:
        raise ValueError(
            f"a volume of {list(x.shape)} voxels does not split into a token grid of {list(grid)}"
        )
    # [gd,gh,gw,d,h,w]
    blocks = x.reshape(gd, D // gd, gh, H // gh, gw, W // gw).transpose(0, 2, 4, 1, 3, 5)
    return blocks.reshape(gd * gh * gw, -1)


def handmade_token_features(volumes: torch.Tensor, grid: Sequence[int]) -> Dict[str, np.ndarray]:
    """Each token's own voxel statistics [M, N, F] of normalized volumes [M, 1, D, H, W]:
    token_stats (mean, std, TOKEN_PERCENTILES), token_histogram (the local loss's LOCAL_BINS bins
    over [-3, 3] std) and both together."""
    x = volumes.float()[:, 0].numpy()
    voxels = np.stack([per_token(v, grid) for v in x])  # [M, N, v]
    stats = np.concatenate(
        [
            voxels.mean(-1, keepdims=True),
            voxels.std(-1, keepdims=True),
            np.moveaxis(np.percentile(voxels, TOKEN_PERCENTILES, axis=-1), 0, -1),
        ],
        axis=-1,
    )
    edges = np.linspace(-3, 3, LOCAL_BINS + 1)
    # [M, N, v] bin of each voxel
    bins = np.clip(np.digitize(voxels, edges[1:-1]), 0, LOCAL_BINS - 1)
    histogram = np.stack([(bins == b).mean(-1) for b in range(LOCAL_BINS)], axis=-1)
    return {
        "token_stats": stats,
        "token_histogram": histogram,
        "token_stats_histogram": np.concatenate([stats, histogram], axis=-1),
    }


# --------------------------------------------------------------------------------------------------
# The ceiling: a small 3D CNN trained on the labels
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CNNBudget:
    """A SmallCNN's shape and its fixed training budget (the same for every arm compared)."""

    width: int
    strides: tuple  # of the 3x3x3 convolutions, whose channels are width, 2 x width, then 4 x width
    steps: int
    batch_size: int
    lr: float = 2e-3


# a label per volume
VOLUME_CNN = CNNBudget(width=16, strides=((1, 2, 2), 2, 2, 1), steps=600, batch_size=16)
# a lesion logit per token
TOKEN_CNN = CNNBudget(width=8, strides=((1, 2, 2), 2, 1), steps=300, batch_size=8)


class SmallCNN(nn.Module):
    """3x3x3 convolutions (BatchNorm, GELU) with the budget's strides, then a head: per volume (mean
    and max pooled, a linear layer to out_dim outputs: [M,1,D,H,W] -> [M, out_dim]), or with a token
    grid per token (average-pooled onto the grid, a 1x1x1 convolution to one logit each: -> [M,
    N])."""

    def __init__(self, out_dim: int, budget: CNNBudget, grid: Optional[Sequence[int]] = None):
        super().__init__()
        channels, layers = (
            [1] + [budget.width * min(2**i, 4) for i in range(len(budget.strides))],
            [],
        )
        for c_in, c_out, stride in zip(channels, channels[1:], budget.strides):
            layers += [
                nn.Conv3d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm3d(c_out),
                nn.GELU(),
            ]
        self.features = nn.Sequential(*layers)
        self.grid = tuple(grid) if grid is not None else None
        self.head = (
            nn.Linear(2 * channels[-1], out_dim)
            if grid is None
            else nn.Conv3d(channels[-1], out_dim, 1)
        )

    def forward(self, volume):
        h = self.features(volume)  # [M, C, d, h, w]
        if self.grid is not None:
            return self.head(F.adaptive_avg_pool3d(h, self.grid)).flatten(1)  # [M, N] (out_dim 1)
        h = h.flatten(2)  # [M, C, voxels]
        return self.head(torch.cat([h.mean(-1), h.amax(-1)], dim=1))


def fit_cnn(
    volumes: torch.Tensor,
    targets: torch.Tensor,
    train_idx: np.ndarray,
    loss: Callable,
    out_dim: int,
    budget: CNNBudget,
    seed: int,
    grid: Optional[Sequence[int]] = None,
    device="cpu",
    desc: str = "supervised CNN",
) -> SmallCNN:
    """A SmallCNN trained from scratch on `device` with AdamW for the budget's steps on random
    batches of the volumes [M, 1, D, H, W] of train_idx, each volume flipped laterally at random (a
    per-token target map [M, gd, gh, gw] flips with it); loss(outputs, targets of the batch). Its
    steps show progress on stderr, named `desc`. Early stopping on a fifth of the training volumes
    lowered the AUROC (experiments/NOTES.md)."""
    torch.manual_seed(seed)
    cnn = SmallCNN(out_dim, budget, grid).to(device)
    rng = np.random.default_rng(seed)
    bar = progress(budget.steps, desc, "step")

    def batch_gradient():
        idx = rng.choice(train_idx, size=min(budget.batch_size, len(train_idx)), replace=False)
        flip = torch.from_numpy(rng.random(len(idx)) < 0.5).to(device)
        x = volumes[idx].float().to(device)
        batch = torch.where(flip[:, None, None, None, None], x.flip(-1), x)
        y = targets[idx].to(device)
        if y.dim() == 4:  # a token map [m, gd, gh, gw]
            y = torch.where(flip[:, None, None, None], y.flip(-1), y)
        loss(cnn(batch), y).backward()
        bar.update(1)

    with bar:
        return train_steps(cnn, batch_gradient, budget.steps, budget.lr, 1e-4)


def supervised_scores(
    volumes: torch.Tensor,
    labels: np.ndarray,
    seeds: Sequence[int],
    device="cpu",
    splits: Optional[Sequence[Split]] = None,
) -> Dict[str, dict]:
    """{metric: interval} of a SmallCNN (VOLUME_CNN) trained on `device` to the class ids labels [M]
    on each seed's training split, the same probe splits as the read-outs: each seed's probe_split,
    or the `splits` given."""
    runs, y = [], torch.from_numpy(labels).long()
    splits = splits or [probe_split(labels, seed) for seed in seeds]
    for seed, (train, test) in zip(seeds, splits):
        cnn = fit_cnn(
            volumes,
            y,
            train,
            F.cross_entropy,
            int(labels.max()) + 1,
            VOLUME_CNN,
            seed,
            device=device,
            desc=f"supervised CNN, split {len(runs) + 1} of {len(splits)}",
        )
        with torch.no_grad():
            outputs = torch.cat(
                [
                    cnn(volumes[test[i : i + 32]].float().to(device)).cpu()
                    for i in range(0, len(test), 32)
                ]
            )
            runs.append(classification_scores(F.softmax(outputs, dim=-1).numpy(), labels[test]))
    return intervals(runs)
