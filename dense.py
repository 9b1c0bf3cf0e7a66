"""Token-level measurements: the position share of an encoder's tokens, and the dense lesion task.

position_share(tokens [V, N, E]): the share of token variance explained by grid position, a health figure beside
RankMe and target_std (logged at validation): near 1, the tokens say where they are and little of what is there.

The dense lesion task: which tokens of a held-out volume hold a lesion, read from each token on its own.

The phantom generator knows where it drew every lesion (phantom.set_voxel_layers replays a set's geometry), so each
token of the varied labelled set gets a target: 1 when at least LESION_SHARE of its voxels are drusen or fluid, 0
otherwise. Only the tokens where a lesion could be are scored, those that hold RPE or lesion voxels (the RPE band):
every other token is negative by its depth alone, which a position code would read without seeing any lesion. A
logistic regression per token (the same for every token) reads each encoder's tokens, each token's own voxel
statistics (the hand-made features) and, as the supervised reference, a small fully convolutional network trained on
the training volumes' token maps; AUROC and average precision over the scored tokens of the held-out volumes.
probe.py runs it as the task `lesion_tokens` (probe.SUITE), on the volume splits of the `lesion` task.
"""
import os
import warnings
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from objectives import LOCAL_BINS
from phantom import LAYERS

TARGET_PATCH = (4, 8, 8)  # the token targets' grid: model-input voxels per target token (finer tubelets are pooled)
LESION_SHARE = 0.02  # a lesion token: at least this share of its voxels are drusen or fluid
LESION_LAYERS = [i for i, (name, _, _) in enumerate(LAYERS) if name in ("drusen", "fluid")]
RPE_LAYER = [name for name, _, _ in LAYERS].index("rpe")
TOKEN_CS = (0.01, 0.1, 1.0)  # logistic regression: inverse L2 strengths tried by cross-validation over volumes
TOKEN_PERCENTILES = (10, 25, 50, 75, 90)
FCN_STEPS, FCN_BATCH, FCN_LR, FCN_WIDTH = 300, 8, 2e-3, 8  # the supervised reference's fixed budget


def position_sums(tokens: torch.Tensor) -> torch.Tensor:
    """Per grid position, the sum and the sum of squares over volumes of tokens [V, N, E]: [2, N, E] (float64), what
    position_share_of_sums needs; the sums of several batches of volumes add up."""
    t = tokens.detach().cpu().double()
    return torch.stack([t.sum(0), t.pow(2).sum(0)])


def position_share_of_sums(sums: torch.Tensor, volumes: int) -> float:
    """position_share of the tokens of `volumes` volumes whose position_sums (added over batches) are sums [2, N, E]."""
    s1, s2 = sums / volumes  # [N, E] each: per-position means of x and x^2
    within = (s2 - s1 ** 2).clamp_min(0).sum(-1).mean()  # mean over positions of the variance over volumes
    total = (s2.mean(0) - s1.mean(0) ** 2).clamp_min(0).sum()  # variance over all tokens of all volumes
    return float(1.0 - within / total) if total > 0 else 0.0


def position_share(tokens: torch.Tensor) -> float:
    """The share of token variance explained by grid position, for tokens [V, N, E] of V volumes: 1 - (mean over the
    N positions of the variance over volumes) / (variance over all V*N tokens), variances summed over the E features.
    1: every token is where it is, nothing of its volume (a position code); 0: position tells nothing."""
    return position_share_of_sums(position_sums(tokens), tokens.shape[0])


def per_token(x: np.ndarray, grid: Sequence[int]) -> np.ndarray:
    """Voxels [D, H, W] (each axis a multiple of the grid's) grouped by token: [N, voxels per token]."""
    (D, H, W), (gd, gh, gw) = x.shape, grid
    if D % gd or H % gh or W % gw:
        raise ValueError(f"a volume of {list(x.shape)} voxels does not split into a token grid of {list(grid)}")
    blocks = x.reshape(gd, D // gd, gh, H // gh, gw, W // gw).transpose(0, 2, 4, 1, 3, 5)  # [gd,gh,gw,d,h,w]
    return blocks.reshape(gd * gh * gw, -1)


def token_targets(layers: np.ndarray, grid: Sequence[int]) -> np.ndarray:
    """The dense targets of one phantom from its voxel_layers [D, H, W]: int8 [N], 1 a lesion token (LESION_SHARE),
    0 a token of the RPE band without a lesion, -1 a token that is not scored."""
    voxels = per_token(layers, grid)  # [N, v]
    lesion = np.isin(voxels, LESION_LAYERS).mean(1)  # [N] share of lesion voxels
    band = (voxels == RPE_LAYER).any(1) | (lesion > 0)
    return np.where(lesion >= LESION_SHARE, 1, np.where(band, 0, -1)).astype(np.int8)


def set_token_targets(voxel_layers: Dict[str, np.ndarray], paths: Sequence[str], grid: Sequence[int]) -> np.ndarray:
    """token_targets [M, N] of the volumes at `paths` (file names in the set of voxel_layers, any folder prefix)."""
    return np.stack([token_targets(voxel_layers[os.path.basename(os.path.normpath(p))], grid) for p in paths])


def tokens_on_grid(tokens: torch.Tensor, grid: Sequence[int], target_grid: Sequence[int]) -> torch.Tensor:
    """Tokens [M, N, E] of a grid average-pooled onto a coarser target grid (integer factors per axis): [M, N', E],
    so that finer tubelets are scored on the same token targets."""
    if list(grid) == list(target_grid):
        return tokens
    M, _, E = tokens.shape
    x = tokens.transpose(1, 2).reshape(M, E, *grid)  # [M, E, gd, gh, gw]
    return F.adaptive_avg_pool3d(x, tuple(target_grid)).flatten(2).transpose(1, 2)


def handmade_token_features(volumes: torch.Tensor, grid: Sequence[int]) -> Dict[str, np.ndarray]:
    """Each token's own voxel statistics [M, N, F] of normalized volumes [M, 1, D, H, W]: token_stats (mean, std,
    TOKEN_PERCENTILES), token_histogram (the local loss's LOCAL_BINS bins over [-3, 3] std) and both together."""
    x = volumes.float()[:, 0].numpy()
    voxels = np.stack([per_token(v, grid) for v in x])  # [M, N, v]
    stats = np.concatenate([voxels.mean(-1, keepdims=True), voxels.std(-1, keepdims=True),
                            np.moveaxis(np.percentile(voxels, TOKEN_PERCENTILES, axis=-1), 0, -1)], axis=-1)
    edges = np.linspace(-3, 3, LOCAL_BINS + 1)
    bins = np.clip(np.digitize(voxels, edges[1:-1]), 0, LOCAL_BINS - 1)  # [M, N, v] bin of each voxel
    histogram = np.stack([(bins == b).mean(-1) for b in range(LOCAL_BINS)], axis=-1)
    return {"token_stats": stats, "token_histogram": histogram,
            "token_stats_histogram": np.concatenate([stats, histogram], axis=-1)}


def token_scores(scores: np.ndarray, targets: np.ndarray) -> dict:
    """AUROC and average precision of token scores [K] for the scored tokens' targets [K] (0/1)."""
    return {"auroc": float(roc_auc_score(targets, scores)), "ap": float(average_precision_score(targets, scores))}


def scored(features: np.ndarray, targets: np.ndarray, idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [K, F], targets [K], volume of each [K]) of the scored tokens of the volumes idx."""
    keep = targets[idx] >= 0  # [m, N]
    return features[idx][keep], targets[idx][keep], np.broadcast_to(idx[:, None], keep.shape)[keep]


def linear_token_probe(features: np.ndarray, targets: np.ndarray, train_idx: np.ndarray,
                       test_idx: np.ndarray) -> dict:
    """token_scores of a logistic regression on standardized per-token features [M, N, F], fit on the scored tokens
    of the training volumes (the L2 strength chosen by 3-fold cross-validation over volumes)."""
    x, y, groups = scored(features, targets, train_idx)
    model = GridSearchCV(make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)),
                         {"logisticregression__C": TOKEN_CS}, scoring="roc_auc", cv=GroupKFold(3))
    with warnings.catch_warnings():  # constant features (a collapsed encoder) make the solver warn; it scores chance
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(x, y, groups=groups)
    x_test, y_test, _ = scored(features, targets, test_idx)
    return token_scores(model.predict_proba(x_test)[:, 1], y_test)


class TokenFCN(nn.Module):
    """The supervised reference: three 3x3x3 convolutions (BatchNorm, GELU; strides 1x2x2, 2, 1), average-pooled
    onto the token grid, then a 1x1x1 convolution to one lesion logit per token. [M, 1, D, H, W] -> [M, N]."""

    def __init__(self, grid: Sequence[int], width: int = FCN_WIDTH):
        super().__init__()
        self.grid = tuple(grid)
        channels, layers = [1, width, 2 * width, 4 * width], []
        for c_in, c_out, stride in zip(channels, channels[1:], ((1, 2, 2), 2, 1)):
            layers += [nn.Conv3d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm3d(c_out), nn.GELU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Conv3d(channels[-1], 1, 1)

    def forward(self, volume):
        return self.head(F.adaptive_avg_pool3d(self.features(volume), self.grid)).flatten(1)  # [M, N]


def fit_token_fcn(volumes: torch.Tensor, targets: np.ndarray, train_idx: np.ndarray, grid: Sequence[int],
                  seed: int, steps: int = FCN_STEPS) -> TokenFCN:
    """A TokenFCN trained from scratch (AdamW, random lateral flips) on the scored tokens of the training volumes."""
    torch.manual_seed(seed)
    fcn = TokenFCN(grid)
    opt = torch.optim.AdamW(fcn.parameters(), lr=FCN_LR, weight_decay=1e-4)
    rng = np.random.default_rng(seed)
    y = torch.from_numpy(targets.astype(np.float32)).view(len(targets), *grid)  # [M, gd, gh, gw]
    fcn.train()
    for _ in range(steps):
        idx = rng.choice(train_idx, size=min(FCN_BATCH, len(train_idx)), replace=False)
        x, t = volumes[idx].float(), y[idx]
        if rng.random() < 0.5:  # the token targets flip with the volume
            x, t = x.flip(-1), t.flip(-1)
        t = t.flatten(1)
        loss = F.binary_cross_entropy_with_logits(fcn(x), t.clamp_min(0), weight=(t >= 0).float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return fcn.eval()


def target_grid(image_size: Sequence[int]) -> List[int]:
    """The grid of the token targets for model inputs of image_size: TARGET_PATCH voxels per target token."""
    return [s // p for s, p in zip(image_size, TARGET_PATCH)]


def split_scores(tokens: Dict[str, torch.Tensor], token_grid: Sequence[int], volumes: torch.Tensor,
                 targets: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray, seed: int,
                 reference: bool = True) -> Dict[str, dict]:
    """One volume split's token_scores {name: scores}: each encoder's tokens ({name: [M, N, E]} on token_grid,
    pooled onto the targets' grid), and with `reference` the hand-made features ('handmade:NAME') and the TokenFCN
    ('supervised'). targets [M, N']: set_token_targets on target_grid of the volumes [M, 1, D, H, W]."""
    grid = target_grid(volumes.shape[2:])
    out = {name: linear_token_probe(tokens_on_grid(t, token_grid, grid).numpy(), targets, train_idx, test_idx)
           for name, t in tokens.items()}
    if reference:
        for name, x in handmade_token_features(volumes, grid).items():
            out[f"handmade:{name}"] = linear_token_probe(x, targets, train_idx, test_idx)
        fcn = fit_token_fcn(volumes, targets, train_idx, grid, seed)
        with torch.no_grad():
            logits = fcn(volumes[test_idx].float()).numpy()
        keep = targets[test_idx] >= 0
        out["supervised"] = token_scores(logits[keep], targets[test_idx][keep])
    return out


def stack_runs(runs: List[Dict[str, dict]]) -> Dict[str, List[dict]]:
    """Per-split results [{name: scores}] regrouped by name: {name: [scores of each split]}."""
    return {name: [r[name] for r in runs] for name in runs[0]}
