"""Does pretraining work? Linear probes on frozen target-encoder features (incident 12).

    python probe.py --ckpt runs/demo/checkpoints/best.pt          # the built-in labelled phantom set
    python probe.py --ckpt random                                 # the baseline a JEPA must beat
    python probe.py --ckpt random --config configs/demo.yaml      # ... of another architecture
    python probe.py --ckpt PATH --labels labels.csv --json probe.json
    python probe.py --ckpt PATH --data_root /data/oct             # = --labels /data/oct/labels.csv

Labels: a CSV with the columns path,label (paths relative to the CSV's folder; a series folder is one volume).
Without --labels or --data_root: PROBE_PHANTOMS phantom volumes (none / drusen / fluid), written once to
PHANTOM_DIR_probe with another seed than the pretraining phantoms, so the probe never sees a training volume.
A checkpoint brings its own model and preprocessing; config flags (--config, --embed_dim, ...) shape the
random model and only phantom_dir, cache_dir and device apply to a checkpoint.

Features: the frozen EMA target encoder's tokens [N, E] per volume, pooled by their mean (then a logistic
regression) and by learned attention (attentive probe). Reported: AUROC (one-vs-rest, macro) and balanced
accuracy on held-out volumes, mean and 95% t-interval over seeds (each seed: a new stratified split and a new
probe initialisation). Exit 2 for a missing or incompatible checkpoint or labels file.

During pretraining, train.py calls prepare_probe_set(cfg) once and probe_auroc(model, probe_set, device) every
probe_every_steps updates.
"""
import argparse
import csv
import dataclasses
import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from config import Config, ConfigError, load_config, parse_flags
from model import VJEPA3D

PROBE_PHANTOMS = 240  # volumes of the built-in labelled phantom set
PROBE_PHANTOM_SEED = 1  # the pretraining phantoms use seed 0
TEST_FRACTION = 0.4  # share of each class held out
PROBE_SET_VOLUMES = 240  # at most this many volumes are kept in memory for probing during pretraining
CKPT_FIELDS = ("phantom_dir", "cache_dir", "device")  # the config flags that apply to a checkpoint


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------

def binary_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of scores for the boolean positive (ties count half); 0.5 = chance, nan
    without both classes."""
    positive = np.asarray(positive, bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # mean 1-based rank of each group of ties
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def macro_auroc(probs: np.ndarray, labels: np.ndarray) -> float:
    """One-vs-rest AUROC averaged over the classes present: probs [M, C], labels [M]."""
    aucs = [binary_auroc(probs[:, c], labels == c) for c in range(probs.shape[1])]
    aucs = [a for a in aucs if not math.isnan(a)]
    return float(np.mean(aucs)) if aucs else math.nan


def balanced_accuracy(pred: np.ndarray, labels: np.ndarray) -> float:
    """Mean over the classes present of their recall; 1/C = chance."""
    return float(np.mean([(pred[labels == c] == c).mean() for c in np.unique(labels)]))


# Student's t 0.975 quantiles for 1..30 degrees of freedom (beyond: the normal 1.96, at most 2% narrower).
T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10,
       2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def interval(values: Sequence[float]) -> dict:
    """Mean and 95% t-interval of per-seed values (one value: an infinite interval)."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        half = math.inf
    else:
        t = T95[len(v) - 2] if len(v) - 1 <= len(T95) else 1.96
        half = t * v.std(ddof=1) / math.sqrt(len(v))
    return {"mean": float(v.mean()), "low": float(v.mean() - half), "high": float(v.mean() + half),
            "values": [float(x) for x in v]}


# ----------------------------------------------------------------------------------------------------------
# Probes
# ----------------------------------------------------------------------------------------------------------

def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) indices holding every class on both sides, test_fraction of each class held out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(len(idx) - 1, max(1, round(test_fraction * len(idx))))
        test += list(idx[:n_test])
        train += list(idx[n_test:])
    return np.array(sorted(train)), np.array(sorted(test))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float = 1e-2,
                 steps: int = 100) -> torch.nn.Module:
    """Multinomial logistic regression (L2) fit on standardized features x [M, E]; returns a classifier of raw x."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    linear = torch.nn.Linear(x.shape[1], num_classes)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    opt = torch.optim.LBFGS(linear.parameters(), lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")
    xs = (x - mean) / std

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(linear(xs), y) + l2 * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return torch.nn.Sequential(Standardize(mean, std), linear)


class Standardize(torch.nn.Module):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        return (x - self.mean) / self.std


class AttentiveProbe(torch.nn.Module):
    """Attention pooling of frozen tokens [M, N, E] (one learned score vector per head), then a linear classifier.
    Starts as mean pooling (zero scores)."""

    def __init__(self, dim: int, num_classes: int, num_heads: int = 4):
        super().__init__()
        self.scores = torch.nn.Linear(dim, num_heads)
        self.head = torch.nn.Linear(num_heads * dim, num_classes)
        torch.nn.init.zeros_(self.scores.weight)
        torch.nn.init.zeros_(self.scores.bias)

    def forward(self, tokens):
        return self.classify(F.layer_norm(tokens, tokens.shape[-1:]))

    def classify(self, normed):
        """Logits [M, C] of layer-normed tokens [M, N, E]."""
        weights = torch.softmax(self.scores(normed), dim=1)  # [M, N, heads]
        return self.head(torch.einsum("mnh,mne->mhe", weights, normed).flatten(1))


def fit_attentive(tokens: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int, steps: int = 150,
                  lr: float = 2e-2, weight_decay: float = 1e-2) -> AttentiveProbe:
    """An AttentiveProbe trained full-batch on tokens [M, N, E] with labels y [M]."""
    torch.manual_seed(seed)
    probe = AttentiveProbe(tokens.shape[-1], num_classes)
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)
    normed = F.layer_norm(tokens, tokens.shape[-1:])  # once: the tokens are frozen
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(probe.classify(normed), y).backward()
            opt.step()
    return probe


@torch.no_grad()
def evaluate(classifier: torch.nn.Module, x: torch.Tensor, y: np.ndarray) -> dict:
    """Macro AUROC and balanced accuracy of a classifier on inputs x with class ids y."""
    probs = F.softmax(classifier(x), dim=-1).numpy()
    return {"auroc": macro_auroc(probs, y), "balanced_accuracy": balanced_accuracy(probs.argmax(1), y)}


def probe_scores(tokens: torch.Tensor, labels: np.ndarray, seeds: Sequence[int], attentive: bool = True) -> dict:
    """Per probe (mean_pool, attentive), the interval over seeds of held-out AUROC and balanced accuracy.
    tokens: [M, N, E] frozen features of M labelled volumes; labels: [M] class ids."""
    num_classes = int(labels.max()) + 1
    pooled = tokens.mean(1)  # [M, E]
    runs: Dict[str, Dict[str, list]] = {}
    for seed in seeds:
        tr, te = stratified_split(labels, TEST_FRACTION, seed)
        y_tr = torch.from_numpy(labels[tr]).long()
        scores = {"mean_pool": evaluate(fit_logistic(pooled[tr], y_tr, num_classes), pooled[te], labels[te])}
        if attentive:
            scores["attentive"] = evaluate(fit_attentive(tokens[tr], y_tr, num_classes, seed), tokens[te], labels[te])
        for probe, metrics in scores.items():
            for metric, value in metrics.items():
                runs.setdefault(probe, {}).setdefault(metric, []).append(value)
    return {probe: {metric: interval(values) for metric, values in metrics.items()} for probe, metrics in runs.items()}


# ----------------------------------------------------------------------------------------------------------
# Labelled volumes and their features
# ----------------------------------------------------------------------------------------------------------

def read_labels(path: str) -> List[Tuple[str, str]]:
    """(path, label) rows of a labels CSV with the columns path,label (paths relative to the CSV's folder)."""
    if not os.path.isfile(path):
        raise ConfigError(f"labels: {path} not found; give a CSV with the header path,label (paths relative to its "
                          f"folder), or leave --labels and --data_root out to probe the built-in phantom set.")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"path", "label"} <= set(rows[0]):
        raise ConfigError(f"labels: {path} needs a header line path,label and at least one row.")
    root = os.path.dirname(os.path.abspath(path))
    return [(r["path"] if "://" in r["path"] or os.path.isabs(r["path"]) else os.path.join(root, r["path"]),
             r["label"]) for r in rows]


def phantom_labels(cfg: Config) -> str:
    """labels.csv of the built-in labelled phantom set in cfg.phantom_dir + '_probe' (written once)."""
    from phantom import phantom_set_complete, write_phantom_set
    directory = cfg.phantom_dir.rstrip("/") + "_probe"
    if not phantom_set_complete(directory, PROBE_PHANTOMS, seed=PROBE_PHANTOM_SEED):
        print(f"writing {PROBE_PHANTOMS} labelled phantom volumes to {directory} (once)", file=sys.stderr)
        try:
            write_phantom_set(directory, PROBE_PHANTOMS, seed=PROBE_PHANTOM_SEED)
        except FileExistsError as e:
            raise ConfigError(f"phantom_dir: {e}") from None
    return os.path.join(directory, "labels.csv")


def load_labelled_volumes(cfg: Config, labels_csv: str, max_volumes: Optional[int] = None):
    """(volumes [M,1,D,H,W] float32 preprocessed like validation samples, class ids [M], class names,
    {reason: count} of unusable files) of a labels CSV; at most max_volumes, drawn at random."""
    from data import UnusableFile, load_training_volume
    rows = read_labels(labels_csv)
    if max_volumes is not None and len(rows) > max_volumes:
        keep = np.random.default_rng(0).permutation(len(rows))[:max_volumes]
        rows = [rows[i] for i in sorted(keep)]
    volumes, labels, skipped = [], [], Counter()
    for path, label in rows:
        try:
            volumes.append(load_training_volume(path, cfg))
        except UnusableFile as e:
            skipped[e.reason] += 1
            continue
        labels.append(label)
    counts = Counter(labels)
    if len(counts) < 2 or min(counts.values()) < 2:
        raise ConfigError(f"labels: {labels_csv} gives {dict(counts)} usable volumes per class "
                          f"(unusable files: {dict(skipped) or 'none'}); a held-out split needs two classes with "
                          f"at least 2 volumes each (20 or more for a useful interval).")
    names = sorted(counts)
    return torch.stack(volumes), np.array([names.index(label) for label in labels]), names, dict(skipped)


@torch.no_grad()
def encode_volumes(model: VJEPA3D, volumes: torch.Tensor, device, batch_size: int = 8) -> torch.Tensor:
    """Frozen target-encoder tokens [M, N, E] (float32, CPU) of volumes [M,1,D,H,W]. Every batch has batch_size
    volumes (the last one padded), so that a compiled device sees one shape."""
    out = []
    for i in range(0, len(volumes), batch_size):
        batch = volumes[i:i + batch_size]
        n = len(batch)
        if n < batch_size:
            batch = torch.cat([batch, batch[-1:].expand(batch_size - n, *batch.shape[1:])])
        out.append(model.encode(batch.to(device).float()).float().cpu()[:n])
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------
# Probing during pretraining
# ----------------------------------------------------------------------------------------------------------

@dataclass
class ProbeSet:
    """A labelled set kept in memory (CPU) for probing during pretraining, with one fixed split."""
    volumes: torch.Tensor  # [M,1,D,H,W] float16, preprocessed like validation samples
    labels: np.ndarray  # [M] class ids
    classes: List[str]
    train_idx: np.ndarray
    test_idx: np.ndarray


def prepare_probe_set(cfg: Config, labels_csv: Optional[str] = None, max_volumes: int = PROBE_SET_VOLUMES) -> ProbeSet:
    """The probe set of a run: labels_csv (default: the built-in labelled phantom set), preprocessed with cfg.
    Raises ConfigError for a missing or unusable labels file."""
    volumes, labels, classes, _ = load_labelled_volumes(cfg, labels_csv or phantom_labels(cfg), max_volumes)
    train_idx, test_idx = stratified_split(labels, TEST_FRACTION, seed=0)
    return ProbeSet(volumes.half(), labels, classes, train_idx, test_idx)


def probe_auroc(model: VJEPA3D, probe_set: ProbeSet, device) -> Dict[str, float]:
    """Held-out macro AUROC and balanced accuracy of a logistic regression on the mean-pooled features of the
    model's current target encoder: {"probe_auroc", "probe_bal_acc"}."""
    was_training = model.training
    model.eval()
    pooled = encode_volumes(model, probe_set.volumes, device).mean(1)  # [M, E]
    model.train(was_training)
    tr, te = probe_set.train_idx, probe_set.test_idx
    classifier = fit_logistic(pooled[tr], torch.from_numpy(probe_set.labels[tr]).long(), len(probe_set.classes))
    scores = evaluate(classifier, pooled[te], probe_set.labels[te])
    return {"probe_auroc": scores["auroc"], "probe_bal_acc": scores["balanced_accuracy"]}


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------

def load_model(ckpt: str, cfg: Config) -> Tuple[VJEPA3D, Config]:
    """(model, its config) of a train.py checkpoint (local or gs://), or a random init from cfg for 'random'.
    Raises ConfigError, naming the fix, for a missing or incompatible checkpoint."""
    if ckpt == "random":
        torch.manual_seed(cfg.seed)
        return VJEPA3D.from_config(cfg), cfg
    from train import read_checkpoint
    fix = "pass a checkpoint written by train.py (OUT_DIR/RUN_NAME/checkpoints/best.pt or step_*.pt) or --ckpt random"
    try:
        state = read_checkpoint(ckpt)
    except FileNotFoundError:
        raise ConfigError(f"ckpt: {ckpt} not found; {fix}.") from None
    except Exception as e:  # torch.load raises many types for a file that is not a weights-only checkpoint
        raise ConfigError(f"ckpt: {ckpt} is not a readable checkpoint ({type(e).__name__}: {e}); {fix}.") from None
    if not isinstance(state, dict) or not {"model", "config"} <= set(state):
        raise ConfigError(f"ckpt: {ckpt} has no 'model' and 'config' entries; {fix}.")
    try:
        ckpt_cfg = load_config([], **state["config"])
        model = VJEPA3D.from_config(ckpt_cfg)
        model.load_state_dict(state["model"])
    except (ConfigError, RuntimeError, TypeError) as e:
        raise ConfigError(f"ckpt: {ckpt} does not fit this version of config.py/model.py ({e}); probe it with the "
                          f"octjepa version that wrote it.") from None
    return model, ckpt_cfg


def probe_device(cfg: Config) -> torch.device:
    """cuda when cfg.device is auto or cuda and a GPU is there, else cpu."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but torch sees no CUDA device; use --device cpu or auto.")
    if cfg.device == "xla":
        raise ConfigError("device: probe.py runs on cpu or cuda; use --device cpu or auto.")
    return torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint path (local or gs://) or 'random'")
    parser.add_argument("--labels", default=None, help="CSV path,label (default: the built-in labelled phantoms)")
    parser.add_argument("--data_root", default=None, help="a folder holding labels.csv (instead of --labels)")
    parser.add_argument("--seeds", type=int, default=5, help="splits and probe initialisations (default 5)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--no_attentive", action="store_true", help="only the mean-pool logistic probe")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.seeds < 2:
        parser.error("--seeds needs at least 2 for an interval")
    try:
        if args.ckpt != "random":
            other = sorted(set(parse_flags(rest)) - set(CKPT_FIELDS))
            if other:
                raise ConfigError(f"{', '.join('--' + o for o in other)}: the checkpoint brings its own model and "
                                  f"preprocessing; with --ckpt PATH only --{', --'.join(CKPT_FIELDS)} apply.")
        cli_cfg = load_config(rest)
        device = probe_device(cli_cfg)
        model, cfg = load_model(args.ckpt, cli_cfg)
        cfg = dataclasses.replace(cfg, **{k: getattr(cli_cfg, k) for k in CKPT_FIELDS})
        if args.labels and args.data_root:
            raise ConfigError("labels: give --labels or --data_root (a folder holding labels.csv), not both.")
        labels_csv = args.labels or (os.path.join(args.data_root, "labels.csv") if args.data_root else None)
        labels_csv = labels_csv or phantom_labels(cfg)
        volumes, labels, names, skipped = load_labelled_volumes(cfg, labels_csv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if skipped:
        print(f"skipped unusable files: {skipped}", file=sys.stderr)
    tokens = encode_volumes(model.to(device).eval(), volumes, device)
    report = {"ckpt": args.ckpt, "labels": labels_csv, "classes": names,
              "volumes": len(labels), "skipped": skipped, "test_fraction": TEST_FRACTION, "seeds": args.seeds,
              "class_counts": {n: int((labels == i).sum()) for i, n in enumerate(names)},
              **probe_scores(tokens, labels, seeds=range(args.seeds), attentive=not args.no_attentive)}
    for probe in ("mean_pool", "attentive"):
        if probe in report:
            a, b = report[probe]["auroc"], report[probe]["balanced_accuracy"]
            print(f"{probe:<10} AUROC {a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}]   balanced acc "
                  f"{b['mean']:.3f} [{b['low']:.3f}, {b['high']:.3f}]   ({args.seeds} seeds, {len(labels)} volumes, "
                  f"{TEST_FRACTION:.0%} held out)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
