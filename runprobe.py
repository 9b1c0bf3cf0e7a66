"""The probes a run makes of itself: the in-training probe and the end-of-run verdict (incident 12, while it trains).

    prepare_probe_set(cfg)   a labelled set kept in memory with one fixed split (default: the plain labelled phantoms)
    probe_auroc(model, ...)  every probe_every_steps updates: held-out AUROC of linear read-outs of the target encoder
    compare_with_random(...) at the end of the run (summary_probe): the linear read-outs of the encoder and of a random
                             init of its architecture on the same splits, paired

train.py uses these; the full suite with its shortcut and ceiling is probe.py.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from config import Config
from labels import encode_volumes, load_labelled_volumes, phantom_labels, task_targets
from model import VJEPA3D, pool_tokens
from readouts import LINEAR_READOUTS, TEST_FRACTION, linear_probe, paired_difference, readout_scores, stratified_split

PROBE_SET_VOLUMES = 240  # at most this many volumes are kept in memory for probing during pretraining


@dataclass
class ProbeSet:
    """A labelled set kept in memory (CPU) for probing during pretraining, with one fixed split."""
    volumes: torch.Tensor  # [M,1,D,H,W] float16, preprocessed like validation samples
    labels: np.ndarray  # [M] class ids
    classes: List[str]
    train_idx: np.ndarray
    test_idx: np.ndarray


def prepare_probe_set(cfg: Config, labels_csv: Optional[str] = None, max_volumes: int = PROBE_SET_VOLUMES) -> ProbeSet:
    """The probe set of a run: labels_csv (default: the plain labelled phantom set), preprocessed with cfg.
    Raises ConfigError for a missing or unusable labels file."""
    labels_csv = labels_csv or phantom_labels(cfg)
    volumes, values, skipped = load_labelled_volumes(cfg, labels_csv, max_volumes)
    labels, classes = task_targets(values["label"], f"{labels_csv} (unusable files: {skipped or 'none'})")
    train_idx, test_idx = stratified_split(labels, TEST_FRACTION, seed=0)
    return ProbeSet(volumes.half(), labels, classes, train_idx, test_idx)


def random_model(cfg: Config) -> VJEPA3D:
    """A random init of cfg's architecture, seeded with cfg.seed: the weights pretraining starts from, the floor to
    beat (probe.py --ckpt random builds the same)."""
    torch.manual_seed(cfg.seed)
    return VJEPA3D.from_config(cfg)


def frozen_tokens(model: VJEPA3D, volumes: torch.Tensor, device) -> torch.Tensor:
    """The target encoder's tokens [M, N, E] of volumes [M, 1, D, H, W] (labels.encode_volumes) in eval mode, leaving
    the model's training mode as it was."""
    was_training = model.training
    tokens = encode_volumes({"model": model.eval()}, volumes, device)["model"]
    model.train(was_training)
    return tokens


def probe_auroc(model: VJEPA3D, probe_set: ProbeSet, device) -> Dict[str, float]:
    """Held-out macro AUROC of a logistic regression on the model's current target-encoder features, on the probe
    set's fixed split: {"probe_auroc" (mean_pool), "probe_bal_acc" (mean_pool), "probe_rows_auroc" (depth_rows)}."""
    tokens = frozen_tokens(model, probe_set.volumes, device)
    split = (probe_set.labels, probe_set.train_idx, probe_set.test_idx)
    mean = linear_probe(pool_tokens(tokens, model.grid, "mean_pool").numpy(), *split)
    rows = linear_probe(pool_tokens(tokens, model.grid, "depth_rows").numpy(), *split)
    return {"probe_auroc": mean["auroc"], "probe_bal_acc": mean["balanced_accuracy"], "probe_rows_auroc": rows["auroc"]}


def compare_with_random(model: VJEPA3D, cfg: Config, probe_set: ProbeSet, device, seeds: int = 5) -> dict:
    """The linear read-outs (LINEAR_READOUTS) of the model's target encoder and of a random init of the same
    architecture (seeded like probe.py --ckpt random: random_model) on the same splits of the probe set: {"pretrained":
    {readout: AUROC interval}, "random": {...}, "difference": {readout: the interval of the paired differences
    pretrained - random}, "beats_random": {readout: that interval lies above 0 and the pretrained one above chance}}.
    Paired on the same splits, as every comparison of arms: the split-to-split spread that both arms share cancels."""
    with torch.random.fork_rng():
        random_init = random_model(cfg).to(device)
    out = {}
    for arm, arm_model in (("pretrained", model), ("random", random_init)):
        tokens = frozen_tokens(arm_model, probe_set.volumes, device)
        scores = readout_scores(tokens, model.grid, probe_set.labels, range(seeds), LINEAR_READOUTS)
        out[arm] = {readout: s["auroc"] for readout, s in scores.items()}
    out["difference"] = {r: paired_difference(out["pretrained"][r], out["random"][r]) for r in LINEAR_READOUTS}
    out["beats_random"] = {r: bool(out["difference"][r]["low"] > 0 and out["pretrained"][r]["low"] > 0.5)
                           for r in LINEAR_READOUTS}
    return out
