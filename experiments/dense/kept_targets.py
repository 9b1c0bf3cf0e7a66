"""Do a run's tokens keep the part of the local loss's targets that reads the lesion? probe.py's
attentive read-out of `lesion` (its splits, seeds 0..9) on the suite's 300 labelled varied phantoms,
from (a) the exact targets (model.token_voxel_statistics with --local_loss_split SPLIT, [M, N,
S * F]) and, for each run, (b) their ridge prediction from the run's target-encoder tokens
(cross-fitted: each half of the volumes predicted by a fit on the other half) and (c) the tokens
themselves, standardized. (a) high and (b) low: the tokens hold the bulk of the targets
(local_fit.py's R^2) but not what tells a lesion.

    python experiments/dense/kept_targets.py SPLIT RUN [RUN...]     # SPLIT e.g. 1,4,1; RUN: a folder of experiments/runs/
"""

import os
import sys

import numpy as np
import torch
from sklearn.linear_model import Ridge

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from model import token_voxel_statistics  # noqa: E402
from checkpoint import read_model_checkpoint, resolve_checkpoint  # noqa: E402
from readouts import readout_scores  # noqa: E402
from suite import lesion_suite  # noqa: E402  (experiments/dense/suite.py)

split, runs = [int(n) for n in sys.argv[1].split(",")], sys.argv[2:]
cfg, volumes, task, targets = lesion_suite()


def attentive(name: str, features: np.ndarray) -> None:
    """Print the attentive read-out of `lesion` from per-token features [M, N, F] on learn.yaml's
    grid."""
    auroc = readout_scores(
        torch.as_tensor(features).float(), cfg.grid_size(), targets, range(10), ("attentive",)
    )["attentive"]["auroc"]
    print(f"{name}: {auroc['mean']:.3f} [{auroc['low']:.3f}, {auroc['high']:.3f}]", flush=True)


stats = token_voxel_statistics(volumes, cfg.patch_size, split).numpy()  # [M, N, S * F]
attentive(f"exact targets by {sys.argv[1]}", stats)
for run in runs:
    model, _, _ = read_model_checkpoint(resolve_checkpoint(f"experiments/runs/{run}/checkpoints"))
    model.eval()
    with torch.no_grad():
        # [M, N, E]
        tokens = torch.cat([model.target_encoder(v) for v in volumes.split(20)]).numpy()
    predicted, M = np.zeros_like(stats), len(volumes)
    for fit, out in ((slice(0, M // 2), slice(M // 2, M)), (slice(M // 2, M), slice(0, M // 2))):
        ridge = Ridge(alpha=1.0).fit(
            tokens[fit].reshape(-1, tokens.shape[-1]), stats[fit].reshape(-1, stats.shape[-1])
        )
        predicted[out] = ridge.predict(tokens[out].reshape(-1, tokens.shape[-1])).reshape(
            stats[out].shape
        )
    attentive(f"{run}: the targets predicted from its tokens", predicted)
    flat = tokens.reshape(-1, tokens.shape[-1])
    attentive(f"{run}: its tokens, standardized", (tokens - flat.mean(0)) / flat.std(0))
