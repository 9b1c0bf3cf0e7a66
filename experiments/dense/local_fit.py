"""How well a run's tokens hold each token's own voxel statistics (the local loss's targets,
model.token_voxel_statistics): the local head's l1 error on the context and on the target
encoder's tokens (runs with --local_loss_weight), and the held-out R^2 of a ridge regression from
each encoder's tokens to the statistics (half the tokens fit, half scored), on 60 of the suite's
labelled varied phantoms, no masking.

    python experiments/dense/local_fit.py RUN [RUN...]     # RUN: a folder of experiments/runs/
"""

import os
import sys

import torch
from sklearn.linear_model import RidgeCV

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from model import token_voxel_statistics  # noqa: E402
from checkpoint import read_model_checkpoint, resolve_checkpoint  # noqa: E402
from suite import lesion_suite  # noqa: E402  (experiments/dense/suite.py)

volumes = lesion_suite(max_volumes=60)[1]
for run in sys.argv[1:]:
    model, run_cfg, _ = read_model_checkpoint(
        resolve_checkpoint(f"experiments/runs/{run}/checkpoints")
    )
    model.eval()
    with torch.no_grad():
        # [M, N, S * F]
        stats = token_voxel_statistics(volumes, run_cfg.patch_size, run_cfg.local_loss_split)
        # [M, N, E] each
        tokens = {"target": model.target_encoder(volumes), "context": model.encoder(volumes)}
    out = {}
    if model.local_head is not None:
        with torch.no_grad():
            out.update(
                {
                    f"head_l1_{name}": round(float((model.local_head(t) - stats).abs().mean()), 3)
                    for name, t in tokens.items()
                }
            )
    y = stats.reshape(-1, stats.shape[-1]).numpy()
    for name, t in tokens.items():
        x = t.reshape(-1, t.shape[-1]).numpy()
        half = len(x) // 2
        out[f"ridge_r2_{name}"] = round(
            float(
                RidgeCV(alphas=[1e-3, 1e-1, 10]).fit(x[:half], y[:half]).score(x[half:], y[half:])
            ),
            3,
        )
    print(run, out, flush=True)
