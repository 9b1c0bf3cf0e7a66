"""Read-outs of frozen encoder tokens, and the statistics every comparison of encoders uses.

    tokens [M, N, E] of M labelled volumes --read-out trained on a split--> held-out scores, per
    probe seed
    read-outs (READOUTS): mean_pool (the mean token, a linear model), depth_rows (the mean of each
                 depth row of the token grid, concatenated: where along the A-scan a feature is
                 survives), attentive (learned attention pooling of standardized tokens, a fixed
                 budget of full-batch AdamW steps)
    linear models: scikit-learn's logistic regression on standardized features, the L2 strength
                 chosen by cross-validation on the training split
    metrics:     macro one-vs-rest AUROC (0.5 = chance) and balanced accuracy of the held-out class
                 probabilities
    statistics:  each probe seed is a new split (TEST_FRACTION of each class held out) and a new
                 initialisation; mean and 95% t-interval over seeds, and paired differences (the
                 same splits) with their intervals

probe.py runs these beside a floor, a shortcut and a ceiling (references.py); finetune.py scores its
folds with them.
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
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from model import POOLS, pool_tokens
from progress import counted
from tokens import Tokens, chunk_rows, token_chunks

TEST_FRACTION = 0.4  # share of each class held out
# logistic regression: inverse L2 strengths tried by cross-validation
LINEAR_CS = (0.003, 0.03, 0.3, 3.0)
READOUTS = (*POOLS, "attentive")  # POOLS: model.pool_tokens of the tokens, then a linear model
LINEAR_READOUTS = POOLS  # the cheap ones: the end-of-run verdict and the in-training probe


# --------------------------------------------------------------------------------------------------
# Metrics and intervals
# --------------------------------------------------------------------------------------------------


def classification_scores(probs: np.ndarray, labels: np.ndarray) -> dict:
    """Macro one-vs-rest AUROC (0.5 = chance) and balanced accuracy (1/C = chance) of class
    probabilities probs [M, C] for class ids labels [M] (scikit-learn)."""
    num_classes = probs.shape[1]
    if num_classes == 2:
        auroc = roc_auc_score(labels, probs[:, 1])
    else:
        auroc = roc_auc_score(
            labels, probs, multi_class="ovr", average="macro", labels=np.arange(num_classes)
        )
    return {
        "auroc": float(auroc),
        "balanced_accuracy": float(balanced_accuracy_score(labels, probs.argmax(1))),
    }


# every score here: AUROC, balanced accuracy, average precision (dense.py)
SCORE_BOUNDS = (0.0, 1.0)


def interval(values: Sequence[float], bounds: Tuple[float, float] = (-math.inf, math.inf)) -> dict:
    """Mean and 95% Student-t interval of per-seed values (one value: an infinite interval), clipped
    to `bounds`: a bounded metric's interval stays in its range (the t-interval of a few seeds can
    reach past it; it is only clipped, not recomputed)."""
    v = np.asarray(values, dtype=float)
    half = (
        math.inf
        if len(v) < 2
        else float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    )
    return {
        "mean": float(v.mean()),
        "low": float(max(v.mean() - half, bounds[0])),
        "high": float(min(v.mean() + half, bounds[1])),
        "values": [float(x) for x in v],
    }


def intervals(runs: List[dict]) -> Dict[str, dict]:
    """{metric: interval} of per-seed score dicts, each within SCORE_BOUNDS."""
    return {metric: interval([r[metric] for r in runs], SCORE_BOUNDS) for metric in runs[0]}


def beats(a: dict, b: dict) -> bool:
    """Interval a lies above interval b and above chance (0.5): a reference that scores below chance
    on a small set is beaten only by learning something."""
    return bool(a["low"] > max(b["high"], 0.5))


def paired_difference(a: dict, b: dict) -> dict:
    """The interval of the per-seed differences a - b of two score intervals measured on the same
    seeds (splits), within [-1, 1]: the range of a difference of two scores in SCORE_BOUNDS."""
    return interval(np.asarray(a["values"]) - np.asarray(b["values"]), (-1.0, 1.0))


# --------------------------------------------------------------------------------------------------
# Tasks and splits
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """What a probe predicts: the classes of a column of a labels CSV, one per volume, or with
    `dense` which tokens hold a lesion (dense.py)."""

    name: str
    column: str = "label"
    # a target per token: where the phantom drew its lesions (dense.py), not the column
    dense: bool = False


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) indices holding every class on both sides, test_fraction of each class held
    out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(len(idx) - 1, max(1, round(test_fraction * len(idx))))
        test += list(idx[:n_test])
        train += list(idx[n_test:])
    return np.array(sorted(train)), np.array(sorted(test))


def probe_split(
    labels: np.ndarray, seed: int, patients: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of probe seed `seed`: TEST_FRACTION of each class held out
    (stratified_split), or with patients [M] (a labels CSV's patient column) each patient's volumes
    on one side (patient_split)."""
    if patients is None:
        return stratified_split(labels, TEST_FRACTION, seed)
    return patient_split(labels, patients, seed)


def patient_split(
    labels: np.ndarray, patients: np.ndarray, seed: int
) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) indices of probe seed `seed` with each patient's volumes on one side:
    stratified_split of the patients, TEST_FRACTION of each stratum held out, a patient's stratum
    the set of classes of their volumes (patients [M] of the class ids labels [M])."""
    names, patient_of = np.unique(patients, return_inverse=True)
    classes = np.zeros((len(names), int(labels.max()) + 1), dtype=bool)
    classes[patient_of, labels] = True
    strata = np.unique(classes, axis=0, return_inverse=True)[1].reshape(-1)
    train, test = stratified_split(strata, TEST_FRACTION, seed)
    return np.flatnonzero(np.isin(patient_of, train)), np.flatnonzero(np.isin(patient_of, test))


# --------------------------------------------------------------------------------------------------
# Read-outs of frozen tokens
# --------------------------------------------------------------------------------------------------


def fit_linear(x: np.ndarray, y: np.ndarray):
    """A scikit-learn pipeline on standardized features x [M, F]: a multinomial logistic regression,
    the L2 strength chosen by cross-validation on (x, y)."""
    model = make_pipeline(StandardScaler(), LogisticRegression(C=LINEAR_CS[2], max_iter=1000))
    folds = min(3, int(np.bincount(y)[np.unique(y)].min()))  # every class in each fold
    if folds >= 2:
        model = GridSearchCV(
            model,
            {"logisticregression__C": LINEAR_CS},
            scoring="neg_log_loss",
            cv=StratifiedKFold(folds, shuffle=True, random_state=0),
        )
    # constant features (a collapsed encoder) make the solver warn; it scores chance
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        return model.fit(x, y)


def linear_probe(
    features: np.ndarray, labels: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray
) -> dict:
    """Held-out classification_scores of fit_linear on features [M, F] for class ids labels [M]."""
    model = fit_linear(features[train_idx], labels[train_idx])
    probs = np.zeros((len(test_idx), int(labels.max()) + 1))
    probs[:, model.classes_] = model.predict_proba(features[test_idx])
    return classification_scores(probs, labels[test_idx])


def pooled_features(tokens: Tokens, grid: Optional[Sequence[int]], pool: str) -> np.ndarray:
    """model.pool_tokens of every volume's tokens: features [M, F]."""
    return torch.cat(
        [pool_tokens(chunk, grid, pool) for _, chunk in token_chunks(tokens, range(len(tokens)))]
    ).numpy()


class AttentiveProbe(torch.nn.Module):
    """Attention pooling of frozen tokens [M, N, E] (one learned score vector per head), then a
    linear layer to out_dim class logits. Starts as mean pooling (zero scores). The tokens are
    standardized per feature (the training tokens' mean and std: set_standardization), then
    layer-normed."""

    def __init__(self, dim: int, out_dim: int, num_heads: int = 4):
        super().__init__()
        self.scores = torch.nn.Linear(dim, num_heads)
        self.head = torch.nn.Linear(num_heads * dim, out_dim)
        torch.nn.init.zeros_(self.scores.weight)
        torch.nn.init.zeros_(self.scores.bias)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def set_standardization(self, chunks: Iterable[torch.Tensor]) -> None:
        """Standardize features with the mean and std over all tokens of the training volumes, given
        in chunks [m, N, E] (float64 sums, shifted by the first chunk's mean: no cancellation)."""
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
        """Each head's pooling weights [M, N, heads] over tokens [M, N, E] (they sum to 1 over N):
        where it looks."""
        return self.pooling_weights(self.normalize(tokens))

    def pooling_weights(self, normed):
        """Pooling weights [M, N, heads] of normalized tokens [M, N, E]."""
        return torch.softmax(self.scores(normed), dim=1)

    def classify(self, normed):
        """Outputs [M, out_dim] of layer-normed tokens [M, N, E]."""
        weights = self.pooling_weights(normed)  # [M, N, heads]
        return self.head(torch.einsum("mnh,mne->mhe", weights, normed).flatten(1))


def train_steps(
    model: nn.Module, accumulate_gradient, steps: int, lr: float, weight_decay: float
) -> nn.Module:
    """AdamW on model for `steps` updates, each on the gradient accumulate_gradient() leaves in its
    parameters; returns the model in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            accumulate_gradient()
            opt.step()
    return model.eval()


def fit_attentive(
    tokens: Tokens,
    labels: np.ndarray,
    train_idx: np.ndarray,
    seed: int,
    steps: int = 300,
    lr: float = 1e-2,
    weight_decay: float = 1e-2,
    device="cpu",
) -> AttentiveProbe:
    """An AttentiveProbe trained full-batch on `device` on the tokens [M, N, E] of train_idx to
    their class ids labels [M], for a fixed budget, the same for every encoder. Standardizing the
    features raised the AUROC; early stopping on a fifth of the training volumes lowered it and
    doubled its spread over probe seeds (experiments/NOTES.md)."""
    torch.manual_seed(seed)
    probe = AttentiveProbe(tokens.shape[-1], int(labels.max()) + 1)
    probe.set_standardization(chunk for _, chunk in token_chunks(tokens, train_idx))
    probe.to(device)
    y = torch.from_numpy(labels).long().to(device)

    def normalized_chunks():
        """(part of train_idx, its standardized, layer-normed tokens), read from `tokens` again."""
        return (
            (part, probe.normalize(chunk.to(device)))
            for part, chunk in token_chunks(tokens, train_idx)
        )

    one_chunk = len(train_idx) <= chunk_rows(tokens)
    # normalized once: the tokens are frozen
    kept = list(normalized_chunks()) if one_chunk else None

    def full_batch_gradient():
        """The gradient of the mean loss over train_idx: each chunk's mean loss weighted by its
        share of them."""
        for part, normed in kept or normalized_chunks():
            loss = F.cross_entropy(probe.classify(normed), y[part])
            (loss * (len(part) / len(train_idx))).backward()

    return train_steps(probe, full_batch_gradient, steps, lr, weight_decay)


@torch.no_grad()
def attentive_outputs(probe: AttentiveProbe, tokens: Tokens, idx: np.ndarray) -> torch.Tensor:
    """The probe's outputs [len(idx), out_dim] (CPU) on the tokens of idx, computed where the probe
    is."""
    device = probe.mean.device
    return torch.cat([probe(chunk.to(device)).cpu() for _, chunk in token_chunks(tokens, idx)])


def split_scores(
    tokens: Tokens,
    labels: np.ndarray,
    train_idx: np.ndarray,
    test_idx: np.ndarray,
    seed: int,
    readouts: Sequence[str] = ("mean_pool", "attentive"),
    grid: Optional[Sequence[int]] = None,
    device="cpu",
) -> Dict[str, dict]:
    """{readout: held-out classification_scores on test_idx} of each read-out trained on train_idx,
    initialised from `seed`. tokens: [M, N, E] frozen features of M labelled volumes (token grid
    `grid`, needed for depth_rows); labels: [M] class ids; the attentive read-out trains on
    `device`. The one place that says how a read-out is scored: readout_scores and finetune.py call
    it."""
    scores = {}
    for readout in readouts:
        if readout == "attentive":
            outputs = attentive_outputs(
                fit_attentive(tokens, labels, train_idx, seed, device=device), tokens, test_idx
            )
            scores[readout] = classification_scores(
                F.softmax(outputs, dim=-1).numpy(), labels[test_idx]
            )
        else:
            scores[readout] = linear_probe(
                pooled_features(tokens, grid, readout), labels, train_idx, test_idx
            )
    return scores


def readout_scores(
    tokens: torch.Tensor,
    grid: Sequence[int],
    labels: np.ndarray,
    seeds: Sequence[int],
    readouts: Sequence[str] = READOUTS,
    device="cpu",
    splits: Optional[Sequence[tuple]] = None,
    desc: Optional[str] = None,
) -> Dict[str, Dict[str, dict]]:
    """{readout: {metric: interval over seeds}} of one encoder's frozen tokens [M, N, E] (token grid
    `grid`) for the class ids labels [M], on the probe splits of `seeds` or the (train, test)
    `splits` given, one per seed (the attentive read-out trained on `device`); with `desc`, progress
    of the splits under that name."""
    runs: Dict[str, List[dict]] = {r: [] for r in readouts}
    splits = splits if splits is not None else [probe_split(labels, seed) for seed in seeds]
    for (train, test), seed in zip(counted(splits, desc, "split") if desc else splits, seeds):
        for readout, scores in split_scores(
            tokens, labels, train, test, seed, readouts, grid, device
        ).items():
            runs[readout].append(scores)
    return {r: intervals(s) for r, s in runs.items()}
