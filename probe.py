"""Does pretraining work? Probes on frozen target-encoder features, pretrained vs a random init (incident 12).

    python probe.py --ckpt runs/demo/checkpoints/best.pt          # the built-in labelled phantom set
    python probe.py --ckpt runs/demo/checkpoints --vs_random      # the run's last checkpoint vs a random init
    python probe.py --ckpt random                                 # the baseline a JEPA must beat
    python probe.py --ckpt random --config configs/demo.yaml      # ... of another architecture
    python probe.py --ckpt PATH --labels labels.csv --json probe.json
    python probe.py --ckpt PATH --data_root /data/oct             # = --labels /data/oct/labels.csv

Labels: a CSV with the columns path,label (paths relative to the CSV's folder; a series folder is one volume).
Without --labels or --data_root: PROBE_PHANTOMS phantom volumes (none / drusen / fluid), written once to
PHANTOM_DIR_probe with another seed than the pretraining phantoms, so the probe never sees a training volume.
A checkpoint brings its own model and preprocessing; config flags (--config, --embed_dim, ...) shape the
random model and only phantom_dir, cache_dir and device apply to a checkpoint.

Features: the frozen EMA target encoder's tokens [N, E] per volume, pooled by their mean (then a scikit-learn
logistic regression on standardized features) and by learned attention (attentive probe, torch). Reported: AUROC (one-vs-rest, macro) and balanced
accuracy on held-out volumes, mean and 95% t-interval over seeds (each seed: a new stratified split and a new
probe initialisation). Exit 2 for a missing or incompatible checkpoint or labels file.

The learning benchmark (README "Does it learn"): --vs_random probes the checkpoint and a random init of its
architecture with the same volumes, splits, probes and budget, prints the table, and with --plot draws the run's
in-training probe AUROC against pretraining updates with the random-init level:

    python probe.py --ckpt runs/learn/checkpoints --vs_random --seeds 10 --json learn.json --plot learn_probe.png

During pretraining, train.py calls prepare_probe_set(cfg) once and probe_auroc(model, probe_set, device) every
probe_every_steps updates; at the end of the run compare_with_random (summary_probe) says whether the encoder
beats a random one on the mean-pool probe.
"""
import csv
import dataclasses
import json
import math
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from config import Config, ConfigError, ScriptParser, given_flags, load_config, script_main
from data import load_val_sample
from dicom import UnusableFile
from model import VJEPA3D
from phantom import ensure_phantom_set
from runtime import device_kind, list_checkpoints, read_checkpoint

PROBE_PHANTOMS = 240  # volumes of the built-in labelled phantom set
PROBE_PHANTOM_SEED = 1  # the pretraining phantoms use seed 0
TEST_FRACTION = 0.4  # share of each class held out
PROBE_SET_VOLUMES = 240  # at most this many volumes are kept in memory for probing during pretraining
CKPT_FIELDS = ("phantom_dir", "cache_dir", "device")  # the config flags that apply to a checkpoint
LINEAR_C = 0.3  # inverse L2 strength of the linear probe (on standardized features), the same for every encoder


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


def interval(values: Sequence[float]) -> dict:
    """Mean and 95% Student-t interval of per-seed values (one value: an infinite interval)."""
    v = np.asarray(values, dtype=float)
    half = math.inf if len(v) < 2 else float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
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


def fit_linear(x: np.ndarray, y: np.ndarray):
    """A scikit-learn pipeline: standardized features x [M, E] -> multinomial L2 logistic regression."""
    return make_pipeline(StandardScaler(), LogisticRegression(C=LINEAR_C, max_iter=1000)).fit(x, y)


def linear_probe(pooled: np.ndarray, labels: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray) -> dict:
    """Held-out scores (classification_scores) of fit_linear on pooled features [M, E]."""
    with warnings.catch_warnings():  # constant features (a collapsed encoder) make the solver warn; it scores chance
        warnings.simplefilter("ignore", ConvergenceWarning)
        classifier = fit_linear(pooled[train_idx], labels[train_idx])
    probs = np.zeros((len(test_idx), int(labels.max()) + 1))
    probs[:, classifier.classes_] = classifier.predict_proba(pooled[test_idx])
    return classification_scores(probs, labels[test_idx])


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

    def attention(self, tokens):
        """Each head's pooling weights [M, N, heads] over tokens [M, N, E] (they sum to 1 over N): where it looks."""
        return torch.softmax(self.scores(F.layer_norm(tokens, tokens.shape[-1:])), dim=1)

    def classify(self, normed):
        """Logits [M, C] of layer-normed tokens [M, N, E]."""
        weights = torch.softmax(self.scores(normed), dim=1)  # [M, N, heads]
        return self.head(torch.einsum("mnh,mne->mhe", weights, normed).flatten(1))


def fit_attentive(tokens: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int, steps: int = 300,
                  lr: float = 1e-2, weight_decay: float = 1e-2) -> AttentiveProbe:
    """An AttentiveProbe trained full-batch on tokens [M, N, E] with labels y [M]. The budget (300 steps at lr 1e-2)
    is the same for every encoder; it halved the seed-to-seed spread of 150 steps at 2e-2 (README, Does it learn)."""
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
def attentive_scores(probe: AttentiveProbe, tokens: torch.Tensor, labels: np.ndarray) -> dict:
    """Held-out scores (classification_scores) of an attentive probe on tokens [M, N, E]."""
    return classification_scores(F.softmax(probe(tokens), dim=-1).numpy(), labels)


def split_scores(tokens: torch.Tensor, labels: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray, seed: int,
                 attentive: bool = True) -> Dict[str, dict]:
    """Per probe (mean_pool, attentive), the held-out scores (classification_scores) on test_idx of the probe trained
    on train_idx, initialised from `seed`. tokens: [M, N, E] frozen features of M labelled volumes; labels: [M] class
    ids. The one place that says which probes there are: probe_scores and finetune.py call it."""
    scores = {"mean_pool": linear_probe(tokens.mean(1).numpy(), labels, train_idx, test_idx)}
    if attentive:
        probe = fit_attentive(tokens[train_idx], torch.from_numpy(labels[train_idx]).long(), int(labels.max()) + 1,
                              seed)
        scores["attentive"] = attentive_scores(probe, tokens[test_idx], labels[test_idx])
    return scores


def probe_scores(tokens: torch.Tensor, labels: np.ndarray, seeds: Sequence[int], attentive: bool = True) -> dict:
    """Per probe (split_scores), the interval over seeds of held-out AUROC and balanced accuracy, each seed a new
    stratified_split. tokens: [M, N, E] frozen features of M labelled volumes; labels: [M] class ids."""
    runs: Dict[str, Dict[str, list]] = {}
    for seed in seeds:
        tr, te = stratified_split(labels, TEST_FRACTION, seed)
        scores = split_scores(tokens, labels, tr, te, seed, attentive)
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
    directory = cfg.phantom_dir.rstrip("/") + "_probe"
    ensure_phantom_set(directory, PROBE_PHANTOMS, PROBE_PHANTOM_SEED, "labelled phantom volumes")
    return os.path.join(directory, "labels.csv")


def load_labelled_volumes(cfg: Config, labels_csv: str, max_volumes: Optional[int] = None):
    """(volumes [M,1,D,H,W] float32 preprocessed like validation samples, class ids [M], class names,
    {reason: count} of unusable files) of a labels CSV; at most max_volumes, drawn at random."""
    rows = read_labels(labels_csv)
    if max_volumes is not None and len(rows) > max_volumes:
        keep = np.random.default_rng(0).permutation(len(rows))[:max_volumes]
        rows = [rows[i] for i in sorted(keep)]
    volumes, labels, skipped = [], [], Counter()
    for path, label in rows:
        try:
            volumes.append(load_val_sample(path, cfg))
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
    pooled = encode_volumes(model, probe_set.volumes, device).mean(1).numpy()  # [M, E]
    model.train(was_training)
    scores = linear_probe(pooled, probe_set.labels, probe_set.train_idx, probe_set.test_idx)
    return {"probe_auroc": scores["auroc"], "probe_bal_acc": scores["balanced_accuracy"]}


def compare_with_random(model: VJEPA3D, cfg: Config, probe_set: ProbeSet, device, seeds: int = 5) -> dict:
    """The mean-pool linear probe of the model's target encoder and of a random init of the same architecture
    (seeded like probe.py --ckpt random) on the same splits of the probe set: {"pretrained": interval,
    "random": interval, "beats_random": the pretrained interval lies above the random one}."""
    with torch.random.fork_rng():
        random_model = load_model("random", cfg)[0]
    out = {}
    for arm, arm_model in (("pretrained", model), ("random", random_model)):
        was_training = arm_model.training
        pooled = encode_volumes(arm_model.to(device).eval(), probe_set.volumes, device).mean(1).numpy()  # [M, E]
        arm_model.train(was_training)
        aurocs = [linear_probe(pooled, probe_set.labels, *stratified_split(probe_set.labels, TEST_FRACTION, seed))
                  ["auroc"] for seed in range(seeds)]
        out[arm] = interval(aurocs)
    out["beats_random"] = out["pretrained"]["low"] > out["random"]["high"]
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


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="probe.py")
    parser.add_argument("--ckpt", required=True, help="checkpoint path (local or gs://) or 'random'")
    parser.add_argument("--labels", default=None, help="CSV path,label (default: the built-in labelled phantoms)")
    parser.add_argument("--data_root", default=None, help="a folder holding labels.csv (instead of --labels)")
    parser.add_argument("--seeds", type=int, default=5, help="splits and probe initialisations (default 5)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--no_attentive", action="store_true", help="only the mean-pool logistic probe")
    parser.add_argument("--vs_random", action="store_true",
                        help="also probe a random init of the checkpoint's architecture, the same way, and compare")
    parser.add_argument("--plot", default=None, help="PNG of the run's probe AUROC against pretraining updates "
                                                     "(probe_every_steps), with the random-init level (--vs_random)")
    args, rest = parser.parse(argv)
    if args.seeds < 2:
        parser.error("--seeds needs at least 2 for an interval")
    if args.vs_random and args.ckpt == "random":
        parser.error("--vs_random compares a checkpoint with a random init; give --ckpt PATH")
    ckpt = resolve_checkpoint(args.ckpt)
    if args.ckpt != "random":
        other = sorted(given_flags(rest) - set(CKPT_FIELDS))
        if other:
            raise ConfigError(f"{', '.join('--' + o for o in other)}: the checkpoint brings its own model and "
                              f"preprocessing; with --ckpt PATH only --{', --'.join(CKPT_FIELDS)} apply.")
    cli_cfg = load_config(rest)
    device = probe_device(cli_cfg)
    model, cfg = load_model(ckpt, cli_cfg)
    cfg = dataclasses.replace(cfg, **{k: getattr(cli_cfg, k) for k in CKPT_FIELDS})
    if args.labels and args.data_root:
        raise ConfigError("labels: give --labels or --data_root (a folder holding labels.csv), not both.")
    labels_csv = args.labels or (os.path.join(args.data_root, "labels.csv") if args.data_root else None)
    labels_csv = labels_csv or phantom_labels(cfg)
    volumes, labels, names, skipped = load_labelled_volumes(cfg, labels_csv)
    if skipped:
        print(f"skipped unusable files: {skipped}", file=sys.stderr)
    arms = {"pretrained": model} if args.vs_random else {"encoder": model}
    if args.vs_random:
        arms["random"] = load_model("random", cfg)[0]
    report = {"ckpt": ckpt, "labels": labels_csv, "classes": names,
              "volumes": len(labels), "skipped": skipped, "test_fraction": TEST_FRACTION, "seeds": args.seeds,
              "class_counts": {n: int((labels == i).sum()) for i, n in enumerate(names)}}
    for arm, arm_model in arms.items():  # the same volumes, splits, probes and budget for every arm
        tokens = encode_volumes(arm_model.to(device).eval(), volumes, device)
        report[arm] = probe_scores(tokens, labels, seeds=range(args.seeds), attentive=not args.no_attentive)
    if args.vs_random:
        report["beats_random"] = {p: report["pretrained"][p]["auroc"]["low"] > report["random"][p]["auroc"]["high"]
                                  for p in report["pretrained"]}
    else:
        report.update(report.pop("encoder"))  # one encoder: its probes at the top level
    print(format_report(report, len(labels)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        metrics = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "metrics.jsonl")
        save_probe_plot(metrics, report, args.plot)
    return 0


def format_report(report: dict, volumes: int) -> str:
    """The console table of a probe report: one row per encoder and probe, AUROC and balanced accuracy."""
    arms = [a for a in ("pretrained", "random") if a in report] or [None]
    lines = [f"{'encoder':<11}{'probe':<11}{'AUROC [95% interval]':<26}balanced accuracy   ({report['seeds']} seeds, "
             f"{volumes} volumes, {report['test_fraction']:.0%} held out)"]
    for arm in arms:
        scores = report[arm] if arm else report
        for probe in ("mean_pool", "attentive"):
            if probe in scores:
                a, b = scores[probe]["auroc"], scores[probe]["balanced_accuracy"]
                lines.append(f"{arm or 'encoder':<11}{probe:<11}{a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}]"
                             f"{'':<6}{b['mean']:.3f} [{b['low']:.3f}, {b['high']:.3f}]")
    for probe, beats in report.get("beats_random", {}).items():
        lines.append(f"{probe}: pretrained {'beats' if beats else 'does NOT beat'} random init "
                     f"({'non-overlapping' if beats else 'overlapping or lower'} 95% intervals)")
    return "\n".join(lines)


def save_probe_plot(metrics_path: str, report: dict, path: str) -> None:
    """PNG of the in-training probe AUROC (metrics.jsonl 'probe' lines) against pretraining updates, with the
    random-init level of the report's mean-pool probe (mean and 95% interval) drawn in."""
    probes = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            probes = [r for r in map(json.loads, f) if r["split"] == "probe"]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if probes:
        ax.plot([r["step"] for r in probes], [r["probe_auroc"] for r in probes], "o-", label="pretrained (mean-pool)")
    random = report.get("random", {}).get("mean_pool", {}).get("auroc")
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
