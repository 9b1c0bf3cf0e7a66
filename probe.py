"""Does pretraining work? Probes of frozen target-encoder features beside a floor, a shortcut and a ceiling
(incident 12; the evidence: experiments/README.md).

    python probe.py --ckpt runs/learn/checkpoints --vs_random     # the built-in suite: the run's last checkpoint
    python probe.py --ckpt random                                 # a random init of the config's architecture
    python probe.py --ckpt random --config configs/demo.yaml      # ... of another architecture
    python probe.py --ckpt PATH --labels labels.csv --json probe.json
    python probe.py --ckpt PATH --data_root /data/oct             # = --labels /data/oct/labels.csv

Every report puts the encoder (and with --vs_random a random init of its architecture: the floor) beside the best of
a small set of hand-made features (the shortcut a label can be read from without learning anything: HANDMADE) and a
small 3D CNN trained on the same training split (the supervised ceiling: SmallCNN), with the same volumes and
splits. A task is valid when the best hand-made features are near chance and the CNN is well above it (VALID_*).

The built-in suite (SUITE), on labelled phantoms written once with other seeds than any pretraining set:
  plain_lesion   none / drusen / fluid on PROBE_PHANTOMS plain phantoms (PHANTOM_DIR_probe): the task of earlier
                 reports, kept for continuity; a depth profile gives it away (the lesions sit at one depth).
  lesion         none / drusen / fluid on SUITE_PHANTOMS varied phantoms (PHANTOM_DIR_suite; phantom.draw_eye: depth
                 position, tilt, curvature, eye motion, layer thickness and reflectivity, brightness, speckle, vessels).
  thickness      regression of the retina's thickness (phantom.retina_thickness) on the varied phantoms.
  lesion_10shot  the lesion task from 10 training volumes per class.
  lesion_tokens  which tokens hold lesion voxels, per token, on the varied phantoms (dense.py: the dense task).
Labels (labels.py): a CSV path,label (paths relative to its folder; a series folder is one volume) is one task,
`label`. A checkpoint brings its own model, preprocessing and phantom folder; config flags shape the random model.

Read-outs of the frozen tokens [M, N, E] (READOUTS): mean_pool (their mean, a linear model), depth_rows (their mean
per depth row of the token grid, concatenated: where along the A-scan a feature is survives), attentive (learned
attention pooling on standardized tokens, a fixed budget of full-batch AdamW steps). Linear models are
scikit-learn's (logistic regression or ridge on standardized features, the regularisation chosen by cross-validation
on the training split).
Metrics: classification: macro one-vs-rest AUROC and balanced accuracy; regression: concordance (the share of
volume pairs put in the right order: 0.5 = chance, the AUROC of a continuous target) and R^2. Each probe seed is a
new split (TEST_FRACTION held out) and a new probe initialisation; reported: mean and 95% t-interval over the
seeds, and paired differences (the same splits) with their 95% intervals. Exit codes: config.EXIT_CODES.

During pretraining, train.py calls prepare_probe_set(cfg) once and probe_auroc(model, probe_set, device) every
probe_every_steps updates; at the end of the run compare_with_random (summary_probe) says whether the encoder beats
a random one on the linear read-outs (mean_pool, depth_rows).
"""
import dataclasses
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import scipy.stats
import torch
import torch.nn as nn
import torch.nn.functional as F
from matplotlib.figure import Figure
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, RidgeCV
from sklearn.metrics import balanced_accuracy_score, r2_score, roc_auc_score
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import dense
from checkpoint import list_checkpoints, read_checkpoint
from config import Config, ConfigError, ExitError, ScriptParser, given_flags, load_config, script_main
from labels import (Tokens, chunk_rows, encode_volumes, load_labelled_volumes, phantom_labels, task_targets,
                    token_chunks)
from model import POOLS, VJEPA3D, pool_tokens
from phantom import set_voxel_layers
from runtime import device_kind

TEST_FRACTION = 0.4  # share of each class held out
PROBE_SET_VOLUMES = 240  # at most this many volumes are kept in memory for probing during pretraining
CKPT_FIELDS = ("phantom_dir", "cache_dir", "device")  # the config flags that apply to a checkpoint
LINEAR_CS = (0.003, 0.03, 0.3, 3.0)  # logistic regression: inverse L2 strengths tried by cross-validation
RIDGE_ALPHAS = tuple(np.logspace(-1, 4, 11))  # ridge regression: L2 strengths tried (leave-one-out)
READOUTS = (*POOLS, "attentive")  # POOLS: model.pool_tokens of the tokens, then a linear model
LINEAR_READOUTS = POOLS  # the cheap ones: the end-of-run verdict and the in-training probe
HANDMADE = ("depth_profile", "histogram", "pooled_voxels", "profile_histogram")
HISTOGRAM_BINS = 32  # over [-3, 3] standard deviations of the normalized volume
POOLED_GRID = (4, 8, 8)  # raw voxels average-pooled to this [D, H, W] grid
VALID_SHORTCUT_MAX = 0.65  # a valid task: the best hand-made features score at most this (0.5 = chance) ...
VALID_CEILING_MIN = 0.75  # ... and the supervised CNN at least this


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------

def rankme(embeddings: torch.Tensor, eps: float = 1e-7) -> float:
    """RankMe: exp of the entropy of the normalized singular values of [M, E] embeddings (1 = collapsed)."""
    s = torch.linalg.svdvals(embeddings.float())
    p = s / (s.sum() + eps) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def classification_scores(probs: np.ndarray, labels: np.ndarray) -> dict:
    """Macro one-vs-rest AUROC (0.5 = chance) and balanced accuracy (1/C = chance) of class probabilities
    probs [M, C] for class ids labels [M] (scikit-learn)."""
    num_classes = probs.shape[1]
    if num_classes == 2:
        auroc = roc_auc_score(labels, probs[:, 1])
    else:
        auroc = roc_auc_score(labels, probs, multi_class="ovr", average="macro", labels=np.arange(num_classes))
    return {"auroc": float(auroc), "balanced_accuracy": float(balanced_accuracy_score(labels, probs.argmax(1)))}


def regression_scores(predicted: np.ndarray, targets: np.ndarray) -> dict:
    """Concordance (share of pairs in the right order, (Kendall tau + 1) / 2: 0.5 = chance, 1 = a perfect ranking)
    and R^2 of predictions [M] for targets [M]."""
    tau = scipy.stats.kendalltau(predicted, targets).statistic
    return {"concordance": 0.5 if np.isnan(tau) else float((tau + 1) / 2), "r2": float(r2_score(targets, predicted))}


def interval(values: Sequence[float]) -> dict:
    """Mean and 95% Student-t interval of per-seed values (one value: an infinite interval)."""
    v = np.asarray(values, dtype=float)
    half = math.inf if len(v) < 2 else float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return {"mean": float(v.mean()), "low": float(v.mean() - half), "high": float(v.mean() + half),
            "values": [float(x) for x in v]}


def beats(a: dict, b: dict) -> bool:
    """Interval a lies above interval b and above chance (0.5): a reference that scores below chance on a small set
    is beaten only by learning something."""
    return bool(a["low"] > max(b["high"], 0.5))


def paired_difference(a: dict, b: dict) -> dict:
    """The interval of the per-seed differences a - b of two intervals measured on the same seeds (splits)."""
    return interval(np.asarray(a["values"]) - np.asarray(b["values"]))


# ----------------------------------------------------------------------------------------------------------
# Tasks and splits
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """What a probe predicts: a column of a labels CSV, as classes or as a number, from all of the training split
    or from `shots` training volumes per class."""
    name: str
    column: str = "label"
    regression: bool = False
    shots: Optional[int] = None
    dense: bool = False  # a target per token: where the phantom drew its lesions (dense.py), not the column

    @property
    def metric(self) -> str:
        """The headline metric: 0.5 is chance for both."""
        return "concordance" if self.regression else "auroc"


SUITE = {"plain": (Task("plain_lesion"),),
         "varied": (Task("lesion", "lesion"), Task("thickness", "retina_thickness", regression=True),
                    Task("lesion_10shot", "lesion", shots=10),
                    Task("lesion_tokens", "lesion", dense=True))}  # the built-in tasks, by the phantom set they use


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


def task_split(targets: np.ndarray, task: Task, seed: int,
               test_fraction: float = TEST_FRACTION) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of one probe seed: stratified by class (by quintile of a regression target), then
    `shots` training volumes per class kept for a few-shot task. The test split does not depend on shots."""
    strata = targets
    if task.regression:
        strata = np.searchsorted(np.quantile(targets, [0.2, 0.4, 0.6, 0.8]), targets)
    train, test = stratified_split(strata, test_fraction, seed)
    if task.shots is not None:
        rng = np.random.default_rng([seed, task.shots])
        train = np.sort(np.concatenate([rng.permutation(train[strata[train] == c])[:task.shots]
                                        for c in np.unique(strata[train])]))
    return train, test


def scores_of(task: Task, outputs: np.ndarray, targets: np.ndarray) -> dict:
    """Scores of a model's outputs on held-out volumes: class probabilities [M, C] or predictions [M]."""
    return regression_scores(outputs, targets) if task.regression else classification_scores(outputs, targets)


# ----------------------------------------------------------------------------------------------------------
# Read-outs of frozen tokens
# ----------------------------------------------------------------------------------------------------------

def fit_linear(x: np.ndarray, y: np.ndarray, regression: bool = False):
    """A scikit-learn pipeline on standardized features x [M, F]: ridge regression (regression) or a multinomial
    logistic regression, the L2 strength chosen by cross-validation on (x, y)."""
    if regression:
        model = make_pipeline(StandardScaler(), RidgeCV(alphas=RIDGE_ALPHAS))
    else:
        model = make_pipeline(StandardScaler(), LogisticRegression(C=LINEAR_CS[2], max_iter=1000))
        folds = min(3, int(np.bincount(y)[np.unique(y)].min()))  # every class in each fold
        if folds >= 2:
            model = GridSearchCV(model, {"logisticregression__C": LINEAR_CS}, scoring="neg_log_loss",
                                 cv=StratifiedKFold(folds, shuffle=True, random_state=0))
    with warnings.catch_warnings():  # constant features (a collapsed encoder) make the solver warn; it scores chance
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        return model.fit(x, y)


def linear_probe(features: np.ndarray, targets: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray,
                 task: Task = Task("label")) -> dict:
    """Held-out scores (scores_of) of fit_linear on features [M, F]."""
    model = fit_linear(features[train_idx], targets[train_idx], task.regression)
    if task.regression:
        return scores_of(task, model.predict(features[test_idx]), targets[test_idx])
    probs = np.zeros((len(test_idx), int(targets.max()) + 1))
    probs[:, model.classes_] = model.predict_proba(features[test_idx])
    return scores_of(task, probs, targets[test_idx])


class AttentiveProbe(torch.nn.Module):
    """Attention pooling of frozen tokens [M, N, E] (one learned score vector per head), then a linear layer to
    out_dim outputs (class logits, or one regression output). Starts as mean pooling (zero scores). The tokens are
    standardized per feature (the training tokens' mean and std: set_standardization), then layer-normed."""

    def __init__(self, dim: int, out_dim: int, num_heads: int = 4):
        super().__init__()
        self.scores = torch.nn.Linear(dim, num_heads)
        self.head = torch.nn.Linear(num_heads * dim, out_dim)
        torch.nn.init.zeros_(self.scores.weight)
        torch.nn.init.zeros_(self.scores.bias)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def set_standardization(self, chunks: Iterable[torch.Tensor]) -> None:
        """Standardize features with the mean and std over all tokens of the training volumes, given in chunks
        [m, N, E] (float64 sums, shifted by the first chunk's mean: no cancellation)."""
        shift, count, total, squares = None, 0, 0.0, 0.0
        for chunk in chunks:
            x = chunk.reshape(-1, chunk.shape[-1]).double()  # [m * N, E]
            shift = x.mean(0) if shift is None else shift
            x -= shift
            count, total, squares = count + len(x), total + x.sum(0), squares + (x * x).sum(0)
        mean = total / count
        self.mean.copy_(shift + mean)
        self.std.copy_(((squares - count * mean * mean) / (count - 1)).clamp_min(0).sqrt() + 1e-6)

    def normalize(self, tokens: torch.Tensor) -> torch.Tensor:
        """What classify takes: standardized, layer-normed tokens [M, N, E]."""
        return F.layer_norm((tokens - self.mean) / self.std, tokens.shape[-1:])

    def forward(self, tokens):
        return self.classify(self.normalize(tokens))

    def attention(self, tokens):
        """Each head's pooling weights [M, N, heads] over tokens [M, N, E] (they sum to 1 over N): where it looks."""
        return self.pooling_weights(self.normalize(tokens))

    def pooling_weights(self, normed):
        """Pooling weights [M, N, heads] of normalized tokens [M, N, E]."""
        return torch.softmax(self.scores(normed), dim=1)

    def classify(self, normed):
        """Outputs [M, out_dim] of layer-normed tokens [M, N, E]."""
        weights = self.pooling_weights(normed)  # [M, N, heads]
        return self.head(torch.einsum("mnh,mne->mhe", weights, normed).flatten(1))


def output_dim(task: Task, targets: np.ndarray) -> int:
    """Outputs of a trained read-out: one per class, or one for a regression."""
    return 1 if task.regression else int(targets.max()) + 1


def training_targets(task: Task, targets: np.ndarray, fit: np.ndarray) -> torch.Tensor:
    """The targets [M] a torch model trains on and is scored against: class ids, or the regression target
    standardized with the mean and std of the fit split (R^2 and concordance do not change)."""
    if not task.regression:
        return torch.from_numpy(targets).long()
    return torch.from_numpy((targets - targets[fit].mean()) / max(targets[fit].std(), 1e-8)).float()


def task_loss(task: Task, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits [M, C], or the mean squared error of predictions [M, 1]."""
    return F.mse_loss(outputs[:, 0], y) if task.regression else F.cross_entropy(outputs, y)


def task_outputs(task: Task, outputs: torch.Tensor) -> np.ndarray:
    """What scores_of takes: class probabilities [M, C] or predictions [M]."""
    return outputs[:, 0].numpy() if task.regression else F.softmax(outputs, dim=-1).numpy()


def train_steps(model: nn.Module, accumulate_gradient, steps: int, lr: float, weight_decay: float) -> nn.Module:
    """AdamW on model for `steps` updates, each on the gradient accumulate_gradient() leaves in its parameters;
    returns the model in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            accumulate_gradient()
            opt.step()
    return model.eval()


def pooled_features(tokens: Tokens, grid: Optional[Sequence[int]], pool: str) -> np.ndarray:
    """model.pool_tokens of every volume's tokens: features [M, F]."""
    return torch.cat([pool_tokens(chunk, grid, pool) for _, chunk in token_chunks(tokens, range(len(tokens)))]).numpy()


def fit_attentive(tokens: Tokens, targets: np.ndarray, train_idx: np.ndarray, task: Task, seed: int,
                  steps: int = 300, lr: float = 1e-2, weight_decay: float = 1e-2) -> AttentiveProbe:
    """An AttentiveProbe trained full-batch on the tokens [M, N, E] of train_idx for a fixed budget, the same for
    every encoder. Standardizing the features raised the AUROC; early stopping on a fifth of the training volumes
    lowered it and doubled its spread over probe seeds (experiments/README.md)."""
    torch.manual_seed(seed)
    probe = AttentiveProbe(tokens.shape[-1], output_dim(task, targets))
    probe.set_standardization(chunk for _, chunk in token_chunks(tokens, train_idx))
    y = training_targets(task, targets, train_idx)

    def normalized_chunks():
        """(part of train_idx, its standardized, layer-normed tokens), read from `tokens` again."""
        return ((part, probe.normalize(chunk)) for part, chunk in token_chunks(tokens, train_idx))

    one_chunk = len(train_idx) <= chunk_rows(tokens)
    kept = list(normalized_chunks()) if one_chunk else None  # normalized once: the tokens are frozen

    def full_batch_gradient():
        """The gradient of the mean loss over train_idx: each chunk's mean loss weighted by its share of them."""
        for part, normed in kept or normalized_chunks():
            loss = task_loss(task, probe.classify(normed), y[part])
            (loss * (len(part) / len(train_idx))).backward()

    return train_steps(probe, full_batch_gradient, steps, lr, weight_decay)


@torch.no_grad()
def attentive_outputs(probe: AttentiveProbe, tokens: Tokens, idx: np.ndarray) -> torch.Tensor:
    """The probe's outputs [len(idx), out_dim] on the tokens of idx."""
    return torch.cat([probe(chunk) for _, chunk in token_chunks(tokens, idx)])


def split_scores(tokens: Tokens, targets: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray, seed: int,
                 readouts: Sequence[str] = ("mean_pool", "attentive"), grid: Optional[Sequence[int]] = None,
                 task: Task = Task("label")) -> Dict[str, dict]:
    """{readout: held-out scores (scores_of) on test_idx} of each read-out trained on train_idx, initialised from
    `seed`. tokens: [M, N, E] frozen features of M labelled volumes (token grid `grid`, needed for depth_rows);
    targets: [M] class ids or numbers. The one place that says how a read-out is scored: readout_scores and
    finetune.py call it."""
    scores = {}
    for readout in readouts:
        if readout == "attentive":
            outputs = attentive_outputs(fit_attentive(tokens, targets, train_idx, task, seed), tokens, test_idx)
            y = training_targets(task, targets, train_idx).numpy()
            scores[readout] = scores_of(task, task_outputs(task, outputs), y[test_idx])
        else:
            scores[readout] = linear_probe(pooled_features(tokens, grid, readout), targets, train_idx, test_idx, task)
    return scores


def readout_scores(tokens: torch.Tensor, grid: Sequence[int], targets: np.ndarray, task: Task, seeds: Sequence[int],
                   readouts: Sequence[str] = READOUTS) -> Dict[str, Dict[str, dict]]:
    """{readout: {metric: interval over seeds}} of one encoder's frozen tokens [M, N, E] (token grid `grid`) on a
    task with per-volume targets [M] (class ids or numbers)."""
    runs: Dict[str, List[dict]] = {r: [] for r in readouts}
    for seed in seeds:
        train, test = task_split(targets, task, seed)
        for readout, scores in split_scores(tokens, targets, train, test, seed, readouts, grid, task).items():
            runs[readout].append(scores)
    return {r: intervals(s) for r, s in runs.items()}


def intervals(runs: List[dict]) -> Dict[str, dict]:
    """{metric: interval} of per-seed score dicts."""
    return {metric: interval([r[metric] for r in runs]) for metric in runs[0]}


# ----------------------------------------------------------------------------------------------------------
# The shortcut (hand-made features) and the ceiling (a supervised CNN)
# ----------------------------------------------------------------------------------------------------------

def handmade_features(volumes: torch.Tensor) -> Dict[str, np.ndarray]:
    """HANDMADE features [M, F] of normalized volumes [M, 1, D, H, W], each a shortcut a label may be read from:
    depth_profile (mean intensity per depth row: H numbers), histogram (HISTOGRAM_BINS-bin intensity histogram),
    pooled_voxels (the volume average-pooled to POOLED_GRID), profile_histogram (the first two together)."""
    x = volumes.float()[:, 0]  # [M, D, H, W]
    profile = x.mean((1, 3)).numpy()  # [M, H]
    flat = x.flatten(1)  # [M, voxels]
    histogram = torch.stack([torch.histc(v.clamp(-3, 3), HISTOGRAM_BINS, -3, 3) for v in flat]).numpy() / flat.shape[1]
    pooled = F.adaptive_avg_pool3d(x[:, None], POOLED_GRID).flatten(1).numpy()  # [M, 4*8*8]
    return {"depth_profile": profile, "histogram": histogram, "pooled_voxels": pooled,
            "profile_histogram": np.concatenate([profile, histogram], axis=1)}


def handmade_scores(volumes: torch.Tensor, targets: np.ndarray, task: Task,
                    seeds: Sequence[int]) -> Dict[str, Dict[str, dict]]:
    """{feature set: {metric: interval}} of a linear model on each HANDMADE feature set, the same splits as the
    encoders' read-outs."""
    features = handmade_features(volumes)
    runs: Dict[str, List[dict]] = {name: [] for name in features}
    for seed in seeds:
        train, test = task_split(targets, task, seed)
        for name, x in features.items():
            runs[name].append(linear_probe(x, targets, train, test, task))
    return {name: intervals(r) for name, r in runs.items()}


class SmallCNN(nn.Module):
    """The supervised reference: four 3x3x3 convolutions (strides 1x2x2, 2, 2, 1; BatchNorm, GELU), mean and max
    pooled, then a linear layer to out_dim outputs. [M, 1, D, H, W] -> [M, out_dim]."""

    def __init__(self, out_dim: int, width: int = 16):
        super().__init__()
        channels, strides, layers = [1, width, 2 * width, 4 * width, 4 * width], [(1, 2, 2), 2, 2, 1], []
        for c_in, c_out, stride in zip(channels, channels[1:], strides):
            layers += [nn.Conv3d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm3d(c_out), nn.GELU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(2 * channels[-1], out_dim)

    def forward(self, volume):
        h = self.features(volume).flatten(2)  # [M, C, voxels]
        return self.head(torch.cat([h.mean(-1), h.amax(-1)], dim=1))


CNN_STEPS, CNN_BATCH, CNN_LR = 600, 16, 2e-3  # the supervised reference's fixed budget


def fit_cnn(volumes: torch.Tensor, targets: np.ndarray, train_idx: np.ndarray, task: Task, seed: int,
            steps: int = CNN_STEPS, batch_size: int = CNN_BATCH, lr: float = CNN_LR) -> SmallCNN:
    """A SmallCNN trained from scratch on the volumes [M, 1, D, H, W] of train_idx (random lateral flips) for a
    fixed budget. Early stopping on a fifth of the training volumes lowered the AUROC (experiments/README.md)."""
    torch.manual_seed(seed)
    cnn = SmallCNN(output_dim(task, targets))
    y = training_targets(task, targets, train_idx)
    x = volumes.float()
    rng = np.random.default_rng(seed)

    def batch_gradient():
        idx = rng.choice(train_idx, size=min(batch_size, len(train_idx)), replace=False)
        batch = x[idx]
        flip = torch.from_numpy(rng.random(len(idx)) < 0.5)
        batch = torch.where(flip[:, None, None, None, None], batch.flip(-1), batch)
        task_loss(task, cnn(batch), y[idx]).backward()

    return train_steps(cnn, batch_gradient, steps, lr, 1e-4)


def supervised_scores(volumes: torch.Tensor, targets: np.ndarray, task: Task, seeds: Sequence[int]) -> Dict[str, dict]:
    """{metric: interval} of the SmallCNN trained on each seed's training split, the same splits as the read-outs."""
    runs = []
    for seed in seeds:
        train, test = task_split(targets, task, seed)
        cnn = fit_cnn(volumes, targets, train, task, seed)
        with torch.no_grad():
            y = training_targets(task, targets, train).numpy()
            runs.append(scores_of(task, task_outputs(task, cnn(volumes[test].float())), y[test]))
    return intervals(runs)


# ----------------------------------------------------------------------------------------------------------
# A task's report: every encoder and read-out beside the shortcut and the ceiling
# ----------------------------------------------------------------------------------------------------------

def task_report(task: Task, targets: np.ndarray, tokens: Dict[str, torch.Tensor], grid: Sequence[int],
                volumes: torch.Tensor, seeds: Sequence[int], readouts: Sequence[str] = READOUTS,
                reference: bool = True) -> dict:
    """One task: each encoder's read-outs (tokens: {encoder name: [M, N, E]}; 'random' is the floor) and, with
    `reference`, the hand-made features (the shortcut), the supervised CNN (the ceiling) and the task's validity:
    {"metric", "encoders": {name: {readout: {metric: interval}}}, "handmade": {features: ...}, "best_handmade",
    "supervised": {metric: interval}, "valid", "versus": {name: {readout: comparisons}}}."""
    metric = task.metric
    report = {"metric": metric, "regression": task.regression, "shots": task.shots,
              "encoders": {name: readout_scores(t, grid, targets, task, seeds, readouts) for name, t in tokens.items()}}
    if reference:
        report = with_references(report, handmade_scores(volumes, targets, task, seeds),
                                 supervised_scores(volumes, targets, task, seeds))
    report["versus"] = {name: {readout: comparisons(report, scores[readout][metric], readout) for readout in scores}
                        for name, scores in report["encoders"].items() if name != "random"}
    return report


def dense_report(labels: np.ndarray, paths: np.ndarray, labels_csv: str, tokens: Dict[str, torch.Tensor],
                 grid: Sequence[int], volumes: torch.Tensor, seeds: Sequence[int], reference: bool = True) -> dict:
    """The dense task (dense.py) in task_report's layout, its one read-out `token_linear`, on the volume splits of
    the volume labels [M] (the `lesion` task's), for the phantom set of labels_csv (the volumes' paths [M])."""
    targets = dense.set_token_targets(set_voxel_layers(os.path.dirname(labels_csv)), paths,
                                      dense.target_grid(volumes.shape[2:]))
    runs = dense.stack_runs([dense.split_scores(tokens, grid, volumes, targets, *task_split(labels, Task("lesion"), s),
                                                s, reference) for s in seeds])
    report = {"metric": "auroc", "regression": False, "shots": None, "scored_tokens": int((targets >= 0).sum()),
              "lesion_tokens": int((targets == 1).sum()),
              "position_share": {name: dense.position_share(t) for name, t in tokens.items()},
              "encoders": {name: {"token_linear": intervals(runs[name])} for name in tokens}}
    if reference:
        report = with_references(report, {n.split(":", 1)[1]: intervals(r) for n, r in runs.items()
                                          if n.startswith("handmade:")}, intervals(runs["supervised"]))
    report["versus"] = {name: {"token_linear": comparisons(report, scores["token_linear"]["auroc"], "token_linear")}
                        for name, scores in report["encoders"].items() if name != "random"}
    return report


def with_references(report: dict, handmade: Dict[str, dict], supervised: dict) -> dict:
    """The report with the shortcut (handmade: {features: {metric: interval}} and the best of them), the ceiling
    (supervised: {metric: interval}) and whether the task is valid (the shortcut near chance, the ceiling above)."""
    metric = report["metric"]
    best = max(handmade, key=lambda f: handmade[f][metric]["mean"])
    valid = handmade[best][metric]["mean"] <= VALID_SHORTCUT_MAX and supervised[metric]["mean"] >= VALID_CEILING_MIN
    return {**report, "handmade": handmade, "best_handmade": best, "supervised": supervised, "valid": bool(valid)}


def comparisons(report: dict, scores: dict, readout: str) -> dict:
    """An encoder read-out's headline interval `scores` against what the task report holds: the random init's same
    read-out, the best hand-made features, the supervised CNN. Per reference: the paired difference (same splits)
    and whether it beats the reference (its interval lies above the reference's and above chance)."""
    metric, out = report["metric"], {}
    references = {"random": report["encoders"].get("random", {}).get(readout, {}).get(metric),
                  "handmade": report.get("handmade", {}).get(report.get("best_handmade"), {}).get(metric),
                  "supervised": report.get("supervised", {}).get(metric)}
    for name, iv in references.items():
        if iv is not None:
            out[name] = {"difference": paired_difference(scores, iv), "beats": beats(scores, iv)}
    return out


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
    """The probe set of a run: labels_csv (default: the plain labelled phantom set), preprocessed with cfg.
    Raises ConfigError for a missing or unusable labels file."""
    labels_csv = labels_csv or phantom_labels(cfg)
    volumes, values, skipped = load_labelled_volumes(cfg, labels_csv, max_volumes)
    labels, classes = task_targets(Task("label"), values["label"], f"{labels_csv} (unusable files: {skipped or 'none'})")
    train_idx, test_idx = stratified_split(labels, TEST_FRACTION, seed=0)
    return ProbeSet(volumes.half(), labels, classes, train_idx, test_idx)


def frozen_tokens(model: VJEPA3D, volumes: torch.Tensor, device) -> torch.Tensor:
    """encode_volumes in eval mode, leaving the model's training mode as it was."""
    was_training = model.training
    tokens = encode_volumes(model.eval(), volumes, device)
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
    architecture (seeded like probe.py --ckpt random) on the same splits of the probe set: {"pretrained":
    {readout: AUROC interval}, "random": {...}, "difference": {readout: the interval of the paired differences
    pretrained - random}, "beats_random": {readout: that interval lies above 0 and the pretrained one above chance}}.
    Paired on the same splits, as every comparison of arms: the split-to-split spread that both arms share cancels."""
    with torch.random.fork_rng():
        random_model = load_model("random", cfg)[0].to(device)
    out = {}
    for arm, arm_model in (("pretrained", model), ("random", random_model)):
        tokens = frozen_tokens(arm_model, probe_set.volumes, device)
        scores = readout_scores(tokens, model.grid, probe_set.labels, Task("label"), range(seeds), LINEAR_READOUTS)
        out[arm] = {readout: s["auroc"] for readout, s in scores.items()}
    out["difference"] = {r: paired_difference(out["pretrained"][r], out["random"][r]) for r in LINEAR_READOUTS}
    out["beats_random"] = {r: bool(out["difference"][r]["low"] > 0 and out["pretrained"][r]["low"] > 0.5)
                           for r in LINEAR_READOUTS}
    return out


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------

def load_model(ckpt: str, cfg: Config) -> Tuple[VJEPA3D, Config]:
    """(model, its config) of a train.py checkpoint (local or gs://), or a random init from cfg for 'random'.
    Raises ConfigError, naming the fix, for a missing or incompatible checkpoint."""
    if ckpt == "random":
        torch.manual_seed(cfg.seed)
        return VJEPA3D.from_config(cfg), cfg
    model, ckpt_cfg, _ = read_model_checkpoint(ckpt)
    return model, ckpt_cfg


def resolve_checkpoint(ckpt: str) -> str:
    """A run's checkpoints folder -> its newest step checkpoint (a not-found path when it has none); any other path
    as it is."""
    if os.path.isdir(ckpt):
        return (list_checkpoints(ckpt) or [os.path.join(ckpt, "step_*.pt")])[0]
    return ckpt


def read_model_checkpoint(ckpt: str) -> Tuple[VJEPA3D, Config, dict]:
    """(model, its config, the whole checkpoint) of a train.py checkpoint file (local or gs://). Raises ConfigError,
    naming the fix, for a missing or incompatible checkpoint."""
    fix = "pass a checkpoint written by train.py (OUT_DIR/RUN_NAME/checkpoints/best.pt or step_*.pt) or --ckpt random"
    try:
        state = read_checkpoint(ckpt)
    except FileNotFoundError:
        raise ConfigError(f"ckpt: {ckpt} not found; {fix}.") from None
    except ExitError:
        raise
    except Exception as e:  # torch.load raises many types for a file that is not a weights-only checkpoint
        raise ConfigError(f"ckpt: {ckpt} is not a readable checkpoint ({type(e).__name__}: {e}); {fix}.") from None
    if not isinstance(state, dict) or not {"model", "config"} <= set(state):
        raise ConfigError(f"ckpt: {ckpt} has no 'model' and 'config' entries; {fix}.")
    try:
        ckpt_cfg = load_config([], **state["config"])
        model = VJEPA3D.from_config(ckpt_cfg)
        model.load_state_dict(state["model"])
    except (ConfigError, RuntimeError, TypeError) as e:
        raise ConfigError(f"ckpt: {ckpt} does not fit this version of config.py/model.py ({e}); read it with the "
                          f"octjepa version that wrote it.") from None
    return model, ckpt_cfg, state


def probe_device(cfg: Config) -> torch.device:
    """cuda when cfg.device is auto or cuda and a GPU is there, else cpu (runtime.device_kind without xla)."""
    if cfg.device == "xla":
        raise ConfigError("device: probe.py runs on cpu or cuda; use --device cpu or auto.")
    return torch.device(device_kind(cfg, xla=False))


def checkpoint_probe_config(ckpt_cfg: Config, cli_cfg: Config, given: Set[str]) -> Config:
    """The config a checkpoint is probed with: its own (model, preprocessing, phantom folder, cache), this command
    line's device, and the phantom_dir and cache_dir of this command line where it names them (`given` flags)."""
    return dataclasses.replace(ckpt_cfg, device=cli_cfg.device,
                               **{k: getattr(cli_cfg, k) for k in ("phantom_dir", "cache_dir") if k in given})


def suite_sets(cfg: Config, labels_csv: Optional[str], names: Optional[Sequence[str]] = None
               ) -> List[Tuple[str, Tuple[Task, ...]]]:
    """(labels CSV, its tasks) to probe: a user's CSV (one classification task, 'label'), or the built-in suite's
    tasks (those in `names`; None = all), their phantom sets written first if need be."""
    if labels_csv:
        if names:
            raise ConfigError("tasks: --tasks picks built-in tasks; a labels CSV is one task ('label').")
        return [(labels_csv, (Task("label"),))]
    known = [t.name for tasks in SUITE.values() for t in tasks]
    if names and set(names) - set(known):
        raise ConfigError(f"tasks: {','.join(names)!r} names a task that is not one of {', '.join(known)}.")
    picked = {kind: tuple(t for t in tasks if not names or t.name in names) for kind, tasks in SUITE.items()}
    return [(phantom_labels(cfg, varied=kind == "varied"), tasks) for kind, tasks in picked.items() if tasks]


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="probe.py")
    parser.add_argument("--ckpt", required=True, help="checkpoint path (local or gs://) or 'random'")
    parser.add_argument("--labels", default=None, help="CSV path,label (default: the built-in phantom suite)")
    parser.add_argument("--data_root", default=None, help="a folder holding labels.csv (instead of --labels)")
    parser.add_argument("--tasks", default=None, help="comma-separated built-in tasks to run (default: all)")
    parser.add_argument("--seeds", type=int, default=5, help="splits and probe initialisations (default 5)")
    parser.add_argument("--readouts", default=",".join(READOUTS), help=f"comma-separated, of {','.join(READOUTS)}")
    parser.add_argument("--no_reference", action="store_true",
                        help="leave out the hand-made features and the supervised CNN (faster; no validity)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--vs_random", action="store_true",
                        help="also probe a random init of the checkpoint's architecture, the same way, and compare")
    parser.add_argument("--plot", default=None, help="PNG of the run's probe AUROC against pretraining updates "
                                                     "(probe_every_steps), with the random-init level (--vs_random)")
    args, rest = parser.parse(argv)
    readouts = args.readouts.split(",")
    if args.seeds < 2:
        parser.error("--seeds needs at least 2 for an interval")
    if not readouts or set(readouts) - set(READOUTS):
        parser.error(f"--readouts takes a comma-separated list of {', '.join(READOUTS)}, got {args.readouts!r}")
    if args.vs_random and args.ckpt == "random":
        parser.error("--vs_random compares a checkpoint with a random init; give --ckpt PATH")
    ckpt = resolve_checkpoint(args.ckpt)
    given = given_flags(rest)
    if args.ckpt != "random":
        other = sorted(given - set(CKPT_FIELDS))
        if other:
            raise ConfigError(f"{', '.join('--' + o for o in other)}: the checkpoint brings its own model and "
                              f"preprocessing; with --ckpt PATH only --{', --'.join(CKPT_FIELDS)} apply.")
    cli_cfg = load_config(rest)
    device = probe_device(cli_cfg)
    model, cfg = load_model(ckpt, cli_cfg)
    cfg = checkpoint_probe_config(cfg, cli_cfg, given)
    if args.labels and args.data_root:
        raise ConfigError("labels: give --labels or --data_root (a folder holding labels.csv), not both.")
    labels_csv = args.labels or (os.path.join(args.data_root, "labels.csv") if args.data_root else None)
    sets = suite_sets(cfg, labels_csv, args.tasks.split(",") if args.tasks else None)
    arms = {"pretrained": model} if args.vs_random else {"encoder": model}
    if args.vs_random:
        arms["random"] = load_model("random", cfg)[0]
    report = {"ckpt": ckpt, "test_fraction": TEST_FRACTION, "seeds": args.seeds, "readouts": readouts, "tasks": {}}
    for csv_path, tasks in sets:
        probe_cfg = cfg if labels_csv else dataclasses.replace(cfg, cache_dir=os.path.dirname(csv_path) + "-cache")
        columns = sorted({t.column for t in tasks} | ({"path"} if any(t.dense for t in tasks) else set()))
        volumes, values, skipped = load_labelled_volumes(probe_cfg, csv_path, columns=columns)
        if skipped:
            print(f"{csv_path}: skipped unusable files: {skipped}", file=sys.stderr)
        targets = {t.name: task_targets(t, values[t.column], f"{csv_path} (unusable files: {skipped or 'none'})")
                   for t in tasks}  # checked before any encoding
        tokens = {arm: encode_volumes(m.to(device).eval(), volumes, device) for arm, m in arms.items()}
        for task in tasks:
            print(f"probing {task.name} ({len(volumes)} volumes of {csv_path})", file=sys.stderr)
            y, names = targets[task.name]
            counts = {"class_counts": {n: int((y == i).sum()) for i, n in enumerate(names)}} if names else {}
            report["tasks"][task.name] = {
                "labels": csv_path, "column": task.column, "volumes": len(volumes), "skipped": skipped, **counts,
                **(dense_report(y, values["path"], csv_path, tokens, model.grid, volumes, range(args.seeds),
                                not args.no_reference) if task.dense else
                   task_report(task, y, tokens, model.grid, volumes, range(args.seeds), readouts,
                               reference=not args.no_reference))}
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        metrics = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "metrics.jsonl")
        save_probe_plot(metrics, report, args.plot)
    return 0


def cell(iv: dict) -> str:
    """'mean [low, high]' of an interval."""
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def signed_cell(iv: dict) -> str:
    """'+mean [+low, +high]' of an interval of differences."""
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def format_report(report: dict) -> str:
    """The console tables of a probe report: per task, the headline metric of every encoder and read-out, the
    hand-made features, the supervised CNN, the task's validity and the paired differences."""
    lines = [f"{report['seeds']} probe seeds (splits), {report['test_fraction']:.0%} held out; 95% intervals"]
    for name, t in report["tasks"].items():
        metric = t["metric"]
        valid = ("" if "valid" not in t else
                 "  VALID" if t["valid"] else f"  not valid (needs the best hand-made <= {VALID_SHORTCUT_MAX} and the "
                                              f"CNN >= {VALID_CEILING_MIN})")
        shots = f", {t['shots']} per class to train" if t["shots"] else ""
        lines += ["", f"{name}: {metric}, {t['volumes']} volumes{shots}{valid}"]
        for encoder, scores in t["encoders"].items():
            for readout, s in scores.items():
                lines.append(f"  {encoder:<11}{readout:<19}{cell(s[metric])}")
        for feature, s in t.get("handmade", {}).items():
            best = " (best hand-made)" if feature == t["best_handmade"] else ""
            lines.append(f"  {'hand-made':<11}{feature:<19}{cell(s[metric])}{best}")
        if "supervised" in t:
            lines.append(f"  {'supervised':<11}{'small 3D CNN':<19}{cell(t['supervised'][metric])}")
        for encoder, readouts in t["versus"].items():
            for readout, versus in readouts.items():
                diffs = ", ".join(f"{'BEATS' if c['beats'] else 'vs'} {other} {signed_cell(c['difference'])}"
                                  for other, c in versus.items())
                if diffs:
                    lines.append(f"  {encoder} {readout}: {diffs}")
    return "\n".join(lines)


def save_probe_plot(metrics_path: str, report: dict, path: str) -> None:
    """PNG of the in-training probe AUROC (metrics.jsonl 'probe' lines) against pretraining updates, with the
    random-init level of the report's first task's mean-pool read-out (mean and 95% interval) drawn in."""
    probes = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            probes = [r for r in map(json.loads, f) if r["split"] == "probe"]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if probes:
        ax.plot([r["step"] for r in probes], [r["probe_auroc"] for r in probes], "o-", label="pretrained (mean-pool)")
        rows = [r for r in probes if "probe_rows_auroc" in r]
        if rows:
            ax.plot([r["step"] for r in rows], [r["probe_rows_auroc"] for r in rows], "s-", label="pretrained (depth rows)")
    task = next(iter(report["tasks"].values()), {})
    random = task.get("encoders", {}).get("random", {}).get("mean_pool", {}).get(task.get("metric"))
    if random:
        ax.axhline(random["mean"], color="gray", ls="--", label="random init (mean-pool)")
        ax.axhspan(random["low"], random["high"], color="gray", alpha=0.2)
    ax.set_xlabel("pretraining updates")
    ax.set_ylabel("held-out probe AUROC")
    ax.set_title("probe AUROC during pretraining" if probes else f"no probe lines in {metrics_path}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
