"""The dense lesion tasks: which tokens of a held-out volume hold a lesion, read from each token on
its own.

The phantom generator knows where it drew every lesion (phantom.set_voxel_layers replays a set's
geometry), so each token of a varied labelled set gets a target: 1 when at least a share of its
voxels are lesion, 0 otherwise. Only the tokens where a lesion could be are scored, those that hold
voxels of the task's band or of a lesion: every other token is negative by its depth alone, which a
position code would read without seeing any lesion. Each task says which voxels are lesions and
which layers make its band (TokenTask, TOKEN_TASKS): `lesion_tokens`, drusen or fluid in the RPE
band (at least LESION_SHARE of a token); `inner_lesion_tokens`, foci or cysts (phantom.INNER_LAYERS)
in the band of the INL, OPL and ONL (at least INNER_SHARE of a token; tokens holding fewer lesion
voxels than that are not scored: the edge of a focus is a few voxels, neither clearly a lesion token
nor clearly not). A logistic regression per token (the same for every token) reads each encoder's
tokens, each token's own voxel statistics (references.handmade_token_features) and, as the
supervised reference, references.SmallCNN with a logit per token (TOKEN_CNN) trained on the training
volumes' token maps; AUROC and average precision over the scored tokens of the held-out volumes.
probe.py runs them as the tasks `lesion_tokens` and `inner_lesion_tokens` (probe.SUITE), on the
volume splits of the `lesion` and `inner_lesion` tasks.
"""

import os
import warnings
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from phantom import INNER_LAYERS, LAYERS
from references import TOKEN_CNN, CNNBudget, SmallCNN, fit_cnn, handmade_token_features, per_token

# the token targets' grid over a volume, the same for every input size and tubelet ...
TARGET_GRID = (4, 8, 8)
# ... unless it would cut fewer model-input voxels than these per target token
TARGET_PATCH = (4, 8, 8)
LESION_SHARE = 0.02  # a lesion token: at least this share of its voxels are drusen or fluid
LESION_LAYERS = [i for i, (name, _, _) in enumerate(LAYERS) if name in ("drusen", "fluid")]
RPE_LAYER = [name for name, _, _ in LAYERS].index("rpe")
# an inner lesion token: at least this share of its voxels (8 of a 4x8x8 token's 2048 phantom
INNER_SHARE = 0.004
# voxels at learn.yaml's geometry: one model-input voxel) are foci or cysts
# logistic regression: inverse L2 strengths tried by cross-validation over volumes
TOKEN_CS = (0.01, 0.1, 1.0)


@dataclass(frozen=True)
class TokenTask:
    """Which tokens of a dense task are lesion tokens and which are scored, from
    phantom.voxel_layers ids."""

    lesions: Tuple[int, ...]  # the voxel layer ids of its lesions
    band: Tuple[int, ...]  # a token holding voxels of these layers (or lesion voxels) is scored
    share: float  # a lesion token: at least this share of its voxels are lesion
    # False: a token holding lesion voxels, but fewer than `share`, is not scored
    partial_scored: bool = True


INNER_BAND = tuple(i for i, (name, _, _) in enumerate(LAYERS) if name in ("inl", "opl", "onl"))
TOKEN_TASKS = {
    "lesion_tokens": TokenTask(tuple(LESION_LAYERS), (RPE_LAYER,), LESION_SHARE),
    "inner_lesion_tokens": TokenTask(
        tuple(range(len(LAYERS), len(LAYERS) + len(INNER_LAYERS))),
        INNER_BAND,
        INNER_SHARE,
        partial_scored=False,
    ),
}


def token_targets(
    layers: np.ndarray, grid: Sequence[int], task: TokenTask = TOKEN_TASKS["lesion_tokens"]
) -> np.ndarray:
    """The dense targets of one phantom from its voxel_layers [D, H, W]: int8 [N], 1 a lesion token
    (the task's share), 0 a token of the task's band without a lesion, -1 a token that is not
    scored."""
    voxels = per_token(layers, grid)  # [N, v]
    lesion = np.isin(voxels, task.lesions).mean(1)  # [N] share of lesion voxels
    band = np.isin(voxels, task.band).any(1) | (lesion > 0)
    if not task.partial_scored:
        band &= (lesion == 0) | (lesion >= task.share)
    return np.where(lesion >= task.share, 1, np.where(band, 0, -1)).astype(np.int8)


def set_token_targets(
    voxel_layers: Dict[str, np.ndarray],
    paths: Sequence[str],
    grid: Sequence[int],
    task: TokenTask = TOKEN_TASKS["lesion_tokens"],
) -> np.ndarray:
    """token_targets [M, N] of the volumes at `paths` (file names in the set of voxel_layers, any
    folder prefix)."""
    return np.stack(
        [
            token_targets(voxel_layers[os.path.basename(os.path.normpath(p))], grid, task)
            for p in paths
        ]
    )


def tokens_on_grid(
    tokens: torch.Tensor, grid: Sequence[int], target_grid: Sequence[int]
) -> torch.Tensor:
    """Tokens [M, N, E] of a grid average-pooled onto a coarser target grid (integer factors per
    axis): [M, N', E], so that finer tubelets are scored on the same token targets."""
    if list(grid) == list(target_grid):
        return tokens
    M, _, E = tokens.shape
    x = tokens.transpose(1, 2).reshape(M, E, *grid)  # [M, E, gd, gh, gw]
    return F.adaptive_avg_pool3d(x, tuple(target_grid)).flatten(2).transpose(1, 2)


def token_scores(scores: np.ndarray, targets: np.ndarray) -> dict:
    """AUROC and average precision of token scores [K] for the scored tokens' targets [K] (0/1)."""
    return {
        "auroc": float(roc_auc_score(targets, scores)),
        "ap": float(average_precision_score(targets, scores)),
    }


def scored(
    features: np.ndarray, targets: np.ndarray, idx: np.ndarray
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [K, F], targets [K], volume of each [K]) of the scored tokens of the volumes
    idx."""
    keep = targets[idx] >= 0  # [m, N]
    return features[idx][keep], targets[idx][keep], np.broadcast_to(idx[:, None], keep.shape)[keep]


def linear_token_probe(
    features: np.ndarray, targets: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray
) -> dict:
    """token_scores of a logistic regression on standardized per-token features [M, N, F], fit on
    the scored tokens of the training volumes (the L2 strength chosen by 3-fold cross-validation
    over volumes)."""
    x, y, groups = scored(features, targets, train_idx)
    model = GridSearchCV(
        make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)),
        {"logisticregression__C": TOKEN_CS},
        scoring="roc_auc",
        cv=GroupKFold(3),
    )
    # constant features (a collapsed encoder) make the solver warn; it scores chance
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(x, y, groups=groups)
    x_test, y_test, _ = scored(features, targets, test_idx)
    return token_scores(model.predict_proba(x_test)[:, 1], y_test)


def token_loss(logits: torch.Tensor, token_maps: torch.Tensor) -> torch.Tensor:
    """The TOKEN_CNN's loss: binary cross-entropy of lesion logits [m, N] on the scored tokens of
    target maps [m, gd, gh, gw] (1 lesion, 0 not, -1 not scored)."""
    t = token_maps.flatten(1)
    return F.binary_cross_entropy_with_logits(logits, t.clamp_min(0), weight=(t >= 0).float())


def fit_token_cnn(
    volumes: torch.Tensor,
    targets: np.ndarray,
    train_idx: np.ndarray,
    grid: Sequence[int],
    seed: int,
    budget: CNNBudget = TOKEN_CNN,
    device="cpu",
) -> SmallCNN:
    """The supervised reference of the dense task: references.fit_cnn (on `device`) of a SmallCNN
    with a lesion logit per token of the grid, on the token targets [M, N] (set_token_targets) of
    the training volumes."""
    # [M, gd, gh, gw]
    token_maps = torch.from_numpy(targets.astype(np.float32)).view(len(targets), *grid)
    return fit_cnn(
        volumes,
        token_maps,
        train_idx,
        token_loss,
        1,
        budget,
        seed,
        grid,
        device,
        f"token CNN, seed {seed}",
    )


def target_grid(image_size: Sequence[int]) -> List[int]:
    """The grid of the token targets for model inputs of image_size: TARGET_GRID (learn.yaml's token
    grid, at 16x64x64 with 4x8x8 tubelets), so that the task is the same at any geometry (16x128x128
    with 4x16x16 tubelets: the same grid), coarser only where an axis has fewer than TARGET_PATCH
    voxels per target token. Finer token grids are pooled onto it (tokens_on_grid)."""
    return [min(g, s // p) for g, s, p in zip(TARGET_GRID, image_size, TARGET_PATCH)]


def split_scores(
    tokens: Dict[str, torch.Tensor],
    token_grid: Sequence[int],
    volumes: torch.Tensor,
    targets: np.ndarray,
    train_idx: np.ndarray,
    test_idx: np.ndarray,
    seed: int,
    reference: bool = True,
    device="cpu",
) -> Dict[str, dict]:
    """One volume split's token_scores {name: scores}: each encoder's tokens ({name: [M, N, E]} on
    token_grid, pooled onto the targets' grid), and with `reference` the hand-made features
    ('handmade:NAME') and the token CNN ('supervised', trained on `device`). targets [M, N']:
    set_token_targets on target_grid of the volumes [M, 1, D, H, W]."""
    grid = target_grid(volumes.shape[2:])
    out = {
        name: linear_token_probe(
            tokens_on_grid(t, token_grid, grid).numpy(), targets, train_idx, test_idx
        )
        for name, t in tokens.items()
    }
    if reference:
        for name, x in handmade_token_features(volumes, grid).items():
            out[f"handmade:{name}"] = linear_token_probe(x, targets, train_idx, test_idx)
        fcn = fit_token_cnn(volumes, targets, train_idx, grid, seed, device=device)
        with torch.no_grad():
            logits = torch.cat(
                [
                    fcn(volumes[test_idx[i : i + 32]].float().to(device)).cpu()
                    for i in range(0, len(test_idx), 32)
                ]
            ).numpy()
        keep = targets[test_idx] >= 0
        out["supervised"] = token_scores(logits[keep], targets[test_idx][keep])
    return out


def stack_runs(runs: List[Dict[str, dict]]) -> Dict[str, List[dict]]:
    """Per-split results [{name: scores}] regrouped by name: {name: [scores of each split]}."""
    return {name: [r[name] for r in runs] for name in runs[0]}
