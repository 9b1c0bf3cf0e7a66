"""Does pretraining work? Linear probes on frozen target-encoder features (incident 12).

    python probe.py --ckpt runs/demo/checkpoints/best.pt          # phantom pathology labels
    python probe.py --ckpt random --config configs/demo.yaml      # the baseline a JEPA must beat
    python probe.py --ckpt PATH --labels labels.csv --data_root /data/oct --json probe.json

Features: the frozen EMA target encoder's tokens [N, E] per volume, pooled by mean (then a logistic
regression) and by a learned attention query (attentive probe). Reported: AUROC (one-vs-rest, macro) and
balanced accuracy on held-out volumes, mean and 95% interval over several seeds (each seed = a new
stratified split and a new probe initialisation).
"""
import argparse
import csv
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from config import ConfigError, load_config
from model import VJEPA3D


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------

def binary_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tie correction); 0.5 = chance."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks of ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def macro_auroc(probs: np.ndarray, labels: np.ndarray) -> float:
    """One-vs-rest AUROC averaged over the classes present: probs [M, C], labels [M]."""
    aucs = [binary_auroc(probs[:, c], labels == c) for c in range(probs.shape[1])]
    aucs = [a for a in aucs if not math.isnan(a)]
    return float(np.mean(aucs)) if aucs else math.nan


def balanced_accuracy(pred: np.ndarray, labels: np.ndarray) -> float:
    """Mean over classes of the recall; 1/C = chance."""
    return float(np.mean([(pred[labels == c] == c).mean() for c in np.unique(labels)]))


def interval(values: Sequence[float]) -> dict:
    """Mean and a 95% t-interval over seeds."""
    v = np.asarray(values, dtype=float)
    t95 = {1: math.inf, 2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}
    half = t95.get(len(v), 1.96) * v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else math.inf
    return {"mean": float(v.mean()), "low": float(v.mean() - half), "high": float(v.mean() + half),
            "values": [float(x) for x in v]}


# ----------------------------------------------------------------------------------------------------------
# Probes
# ----------------------------------------------------------------------------------------------------------

def stratified_split(labels: np.ndarray, test_fraction: float, seed: int):
    """Train/test indices with every class in both parts (when it has >= 2 members)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = max(1, round(test_fraction * len(idx))) if len(idx) > 1 else 0
        test += list(idx[:n_test])
        train += list(idx[n_test:])
    return np.array(sorted(train)), np.array(sorted(test))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, num_classes: int, weight_decay: float = 1e-3,
                 steps: int = 300) -> torch.nn.Module:
    """Multinomial logistic regression on standardized features (full-batch L-BFGS, L2 penalty)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    linear = torch.nn.Linear(x.shape[1], num_classes)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    opt = torch.optim.LBFGS(linear.parameters(), lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")
    xs = (x - mean) / std

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(linear(xs), y) + weight_decay * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return torch.nn.Sequential(_Standardize(mean, std), linear)


class _Standardize(torch.nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        return (x - self.mean) / self.std


class AttentiveProbe(torch.nn.Module):
    """One learned query cross-attends over the frozen tokens [M, N, E], then a linear classifier."""

    def __init__(self, dim: int, num_classes: int, num_heads: int = 4):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.query = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.attn = torch.nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.head = torch.nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.norm(tokens)
        pooled, _ = self.attn(self.query.expand(len(x), -1, -1), x, x)  # [M, 1, E]
        return self.head(pooled[:, 0])


def fit_attentive(tokens: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int, steps: int = 200):
    torch.manual_seed(seed)
    dim = tokens.shape[-1]
    probe = AttentiveProbe(dim, num_classes, num_heads=4 if dim % 4 == 0 else 1)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(probe(tokens), y).backward()
        opt.step()
    return probe


@torch.no_grad()
def evaluate(classifier, x: torch.Tensor, y: np.ndarray) -> dict:
    probs = F.softmax(classifier(x), dim=-1).numpy()
    return {"auroc": macro_auroc(probs, y), "balanced_accuracy": balanced_accuracy(probs.argmax(1), y)}


def probe_scores(tokens: torch.Tensor, labels: np.ndarray, seeds: Sequence[int], test_fraction: float = 0.4,
                 attentive: bool = True) -> dict:
    """Fit mean-pool logistic and attentive probes on each seed's split; intervals of AUROC and balanced acc.
    tokens: [M, N, E] frozen features of M labelled volumes; labels: [M] class ids."""
    num_classes = int(labels.max()) + 1
    pooled = tokens.mean(1)  # [M, E]
    runs: Dict[str, Dict[str, list]] = {"mean_pool": {"auroc": [], "balanced_accuracy": []}}
    if attentive:
        runs["attentive"] = {"auroc": [], "balanced_accuracy": []}
    for seed in seeds:
        tr, te = stratified_split(labels, test_fraction, seed)
        y_tr = torch.from_numpy(labels[tr]).long()
        scores = {"mean_pool": evaluate(fit_logistic(pooled[tr], y_tr, num_classes), pooled[te], labels[te])}
        if attentive:
            scores["attentive"] = evaluate(fit_attentive(tokens[tr], y_tr, num_classes, seed), tokens[te], labels[te])
        for name, s in scores.items():
            for metric, value in s.items():
                runs[name][metric].append(value)
    return {name: {metric: interval(values) for metric, values in metrics.items()} for name, metrics in runs.items()}


# ----------------------------------------------------------------------------------------------------------
# Features of a labelled set
# ----------------------------------------------------------------------------------------------------------

def read_labels(path: str) -> List[tuple]:
    """(path, label) rows of a labels CSV with columns path,label (paths relative to the CSV's folder)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"path", "label"} <= set(rows[0]):
        raise ConfigError(f"labels: {path} needs a header with the columns path,label")
    root = os.path.dirname(os.path.abspath(path))
    return [(r["path"] if "://" in r["path"] or os.path.isabs(r["path"]) else os.path.join(root, r["path"]),
             r["label"]) for r in rows]


@torch.no_grad()
def encode_volumes(model: VJEPA3D, volumes: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Frozen target-encoder tokens of preprocessed volumes [M,1,D,H,W] -> [M, N, E] (float32, CPU)."""
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([model.encode(volumes[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(volumes), batch_size)])


def load_labelled_volumes(cfg, labels_csv: str):
    """Preprocessed volumes [M,1,D,H,W] (validation preprocessing) and class ids [M] of a labels CSV."""
    from data import UnusableFile, load_training_volume
    rows = read_labels(labels_csv)
    names = sorted({label for _, label in rows})
    volumes, ids, skipped = [], [], 0
    for path, label in rows:
        try:
            volumes.append(load_training_volume(path, cfg))
        except UnusableFile:
            skipped += 1
            continue
        ids.append(names.index(label))
    if len(set(ids)) < 2:
        raise ConfigError(f"labels: {labels_csv} yields fewer than two classes of readable volumes")
    return torch.stack(volumes), np.array(ids), names, skipped


def load_model(ckpt: str, cfg) -> VJEPA3D:
    """The model of a checkpoint (its own config), or a randomly initialised one for ckpt='random'."""
    if ckpt == "random":
        torch.manual_seed(cfg.seed)
        return VJEPA3D.from_config(cfg)
    from train import read_checkpoint
    state = read_checkpoint(ckpt)
    model = VJEPA3D.from_config(load_config([], **{k: v for k, v in state["config"].items()}))
    model.load_state_dict(state["model"])
    return model


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint path (local or gs://) or 'random'")
    parser.add_argument("--labels", default=None, help="CSV path,label (default: the phantom set's labels.csv)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--no_attentive", action="store_true", help="only the mean-pool logistic probe")
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest)
        model = load_model(args.ckpt, cfg)
        if args.ckpt != "random":  # preprocess exactly like the pretraining run did
            from train import read_checkpoint
            cfg = load_config([], **read_checkpoint(args.ckpt)["config"])
        labels_csv = args.labels
        if labels_csv is None:
            from data import ensure_phantoms
            labels_csv = os.path.join(ensure_phantoms(cfg), "labels.csv")
        volumes, ids, names, skipped = load_labelled_volumes(cfg, labels_csv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    tokens = encode_volumes(model, volumes)
    report = {"ckpt": args.ckpt, "labels": labels_csv, "classes": names, "volumes": len(ids), "skipped": skipped,
              "class_counts": {n: int((ids == i).sum()) for i, n in enumerate(names)},
              **probe_scores(tokens, ids, seeds=range(args.seeds), attentive=not args.no_attentive)}
    for probe in ("mean_pool", "attentive"):
        if probe in report:
            a, b = report[probe]["auroc"], report[probe]["balanced_accuracy"]
            print(f"{probe:<10} AUROC {a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}]   balanced acc "
                  f"{b['mean']:.3f} [{b['low']:.3f}, {b['high']:.3f}]   ({args.seeds} seeds, {len(ids)} volumes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
