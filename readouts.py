"""Read-outs of frozen encoder tokens, and the statistics every comparison of encoders uses.

    tokens [M, N, E] of M labelled volumes --read-out trained on a split--> held-out scores, per probe seed
    read-outs (READOUTS): mean_pool (the mean token, a linear model), depth_rows (the mean of each depth row of the
                 token grid, concatenated: where along the A-scan a feature is survives), attentive (learned attention
                 pooling of standardized tokens, a fixed budget of full-batch AdamW steps)
    linear models: scikit-learn's logistic regression or ridge on standardized features, the L2 strength chosen by
                 cross-validation on the training split
    metrics:     classification: macro one-vs-rest AUROC and balanced accuracy; regression: concordance (the share of
                 volume pairs put in the right order: 0.5 = chance) and R^2
    statistics:  each probe seed is a new split (TEST_FRACTION of each class held out) and a new initialisation;
                 mean and 95% t-interval over seeds, and paired differences (the same splits) with their intervals

probe.py runs these beside a floor, a shortcut and a ceiling (references.py); finetune.py scores its folds with them.
"""
import math
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import scipy.stats
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, RidgeCV
from sklearn.metrics import balanced_accuracy_score, r2_score, roc_auc_score
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from labels import Tokens, chunk_rows, token_chunks
from model import POOLS, pool_tokens

TEST_FRACTION = 0.4  # share of each class held out
LINEAR_CS = (0.003, 0.03, 0.3, 3.0)  # logistic regression: inverse L2 strengths tried by cross-validation
RIDGE_ALPHAS = tuple(np.logspace(-1, 4, 11))  # ridge regression: L2 strengths tried (leave-one-out)
READOUTS = (*POOLS, "attentive")  # POOLS: model.pool_tokens of the tokens, then a linear model
LINEAR_READOUTS = POOLS  # the cheap ones: the end-of-run verdict and the in-training probe


# ----------------------------------------------------------------------------------------------------------
# Metrics and intervals
# ----------------------------------------------------------------------------------------------------------

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


def intervals(runs: List[dict]) -> Dict[str, dict]:
    """{metric: interval} of per-seed score dicts."""
    return {metric: interval([r[metric] for r in runs]) for metric in runs[0]}


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


def pooled_features(tokens: Tokens, grid: Optional[Sequence[int]], pool: str) -> np.ndarray:
    """model.pool_tokens of every volume's tokens: features [M, F]."""
    return torch.cat([pool_tokens(chunk, grid, pool) for _, chunk in token_chunks(tokens, range(len(tokens)))]).numpy()


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
