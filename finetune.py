"""Fine-tune an exported encoder (encoder.py export) on labelled volumes, with patient-level
cross-validation.

    python finetune.py --encoder runs/learn/encoder --labels labels.csv --out runs/finetune
    python finetune.py --encoder DIR --labels labels.csv --folds 5 --repeats 3 --vs_random      # vs a random init
    python finetune.py --encoder DIR --labels labels.csv --splits probe --repeats 5 --modes frozen   # = probe.py

Labels: probe.py's CSV (paths relative to the CSV's folder; a series folder is one volume),
extended:
    path,label             one class per volume: binary or multi-class
    path,drusen,fluid      multi-label: no `label` column; every other column is a class, 1 or 0 per
                           volume
    ...,patient            optional with either: the patient of each volume (default: the reader's
                           key of the DICOM PatientID, else the file), so that no patient is on two
                           sides of a split

Modes: `frozen` runs probe.py's probes (readouts.split_scores: logistic regression on mean-pooled
tokens, attentive probe; the budget probe.py uses) on the frozen encoder. `full` fine-tunes the
whole encoder, starting from those attentive probes (linear probing, then fine-tuning: a fresh head
trained in batches of 8 did not even fit the training volumes of the labelled phantoms,
experiments/README.md): AdamW, layer-wise LR decay (block i of L at lr * layer_decay ** (L - i), the
patch embedding at lr * layer_decay ** (L + 1), heads and final norm at lr), one warmup epoch then
cosine, the augmentation the encoder was pretrained with (crop jitter, flip, intensity jitter),
early stopping on the loss of a validation part of each fold's training patients (--val_fraction)
after --patience epochs without a better one; the weights of the best epoch (0: the probes on the
frozen encoder) are tested and kept. Multi-label: a binary probe per class (frozen), a binary
attentive head per class (full); scores are means over the classes.

Splits: `kfold` (default): scikit-learn's StratifiedGroupKFold over patients (no patient in two
folds), repeated --repeats times with other shuffles. `probe`: probe.py's splits (seed r for repeat
r, 40% held out; by patient when the CSV has a patient column, else by volume: patients may then be
on both sides), for comparing with probe.py. Scores per fold: AUROC (macro one-vs-rest) and balanced
accuracy, with mean and 95% t-interval over all folds; --vs_random runs a random init of the same
architecture with the same splits, seeds and budget and adds the paired differences (pretrained -
random).

Writes each split's result to OUT/folds/ as it finishes (the same command after a kill computes only
the rest; --out is checked writable before any work), then OUT/report.json and, per fold of the
export's full fine-tuning, OUT/full/r{repeat}_f{fold}/: config.json and model.safetensors
(pretrained.load_encoder reads them), heads.safetensors (the heads of finetune.Classifier) and
fold.json (classes, task, the keyed ids of each part's volumes, scores, the loss of every epoch);
none of them holds a path (docs/privacy.md). The config flags that apply: device, seed (splits,
probes, heads and the random init follow from it).
"""

from config import (
    Config,
    ConfigError,
    Preempted,
    ScriptParser,
    given_flags,
    load_config,
    preempt_at_once_on_stop_signals,
    script_main,
)

# a stop while the imports run (seconds: nothing started yet) is a preemption too
if __name__ == "__main__":
    preempt_at_once_on_stop_signals("finetune.py")

import copy
import glob
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from sklearn.model_selection import StratifiedGroupKFold

from checkpoint import list_checkpoints
from data import resample_and_clip, to_sample
from dicom import UnusableFile
from index import format_reason_table, read_volume
from labels import classification_targets, read_label_table
from lock import process_is_gone, process_started, this_machine
from pretrained import ExportError, PretrainedEncoder, load_encoder, random_encoder, save_encoder
from privacy import (
    KEY_FILE_ENV,
    check_recorded_key,
    key_fingerprint,
    share_safe_source,
    site_secret,
    volume_key,
)
from readouts import (
    SCORE_BOUNDS,
    AttentiveProbe,
    classification_scores,
    fit_attentive,
    interval,
    paired_difference,
    probe_split,
    split_scores,
)
from progress import counted
from runtime import StopRequested, StopSignals, probe_device, release_freed_memory
from schedules import cosine_ramp
from storage import write_atomic
from tokens import TokenFile, encode_volumes

CLI_FIELDS = ("device", "seed")
MODES = ("frozen", "full")


TMP_PREFIX = "octjepa-finetune-"  # + the owner's pid.start.pid-namespace.boot-id- + a random suffix


class PreparedVolumes:
    """Prepared volumes [d,h,w] kept on disk, in a temporary folder ($TMPDIR; removed with this
    object, or at exit) and read one at a time, so that memory stays flat in their number. Their
    frozen tokens go there too (labelled_tokens). The folder's name says which process owns it: the
    folders of killed ones go first (remove_stale_folders)."""

    def __init__(self):
        remove_stale_folders()
        here = this_machine()
        owner = f"{os.getpid()}.{process_started(os.getpid())}.{here['pid_namespace']}.{here['boot_id']}-"
        self.folder = tempfile.TemporaryDirectory(
            prefix=TMP_PREFIX + "".join(c for c in owner if c not in "[:]")
        )
        self.count = 0

    def append(self, volume: np.ndarray) -> None:
        np.save(os.path.join(self.folder.name, f"{self.count}.npy"), volume)
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        return np.load(os.path.join(self.folder.name, f"{i}.npy"))


def remove_stale_folders() -> None:
    """Delete the temporary folders (patient pixels) that fine-tunings of this user killed before
    their clean-up (SIGKILL, out of memory) left in $TMPDIR: those whose owner is a process of this
    machine and PID namespace that no longer runs (a folder of a process elsewhere, or of an older
    octjepa, is left alone)."""
    for folder in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), TMP_PREFIX + "*")):
        owner = os.path.basename(folder)[len(TMP_PREFIX) :].split(".", 3)
        if len(owner) < 4 or not owner[0].isdigit() or os.stat(folder).st_uid != os.getuid():
            continue
        pid, started, namespace, boot_id = (
            int(owner[0]),
            owner[1],
            f"pid:[{owner[2][3:]}]",
            owner[3][:36],
        )
        if process_is_gone(
            {"pid": pid, "pid_started": started, "pid_namespace": namespace, "boot_id": boot_id}
        ):
            shutil.rmtree(folder, ignore_errors=True)
            print(
                f"removed {folder}: prepared volumes that a killed fine-tuning (process {pid})"
                " left",
                file=sys.stderr,
            )


@dataclass
class LabelledSet:
    """Labelled volumes, preprocessed up to the crop (data.resample_and_clip, the cacheable part),
    on disk."""

    prepared: PreparedVolumes  # [d,h,w] uint8/uint16 per volume
    targets: np.ndarray  # [M] class ids, or [M, C] of 0/1 (multilabel)
    classes: List[str]
    task: str  # binary | multiclass | multilabel
    patients: np.ndarray  # [M] patient keys
    paths: List[str]
    skipped: Dict[str, int]  # {reason: count} of unusable files
    # the patients come from the CSV's patient column (else from the DICOM headers)
    patients_listed: bool = False

    @property
    def strata(self) -> np.ndarray:
        """[M] what the splits balance: the class id, or (multilabel) the id of the volume's set of
        classes."""
        if self.task != "multilabel":
            return self.targets
        return np.unique(self.targets, axis=0, return_inverse=True)[1].reshape(-1)


@dataclass
class FullSettings:
    """The budget and optimizer of full fine-tuning (the same for every encoder compared)."""

    epochs: int = 30
    lr: float = 3e-4
    layer_decay: float = 0.75
    weight_decay: float = 0.05
    batch_size: int = 8
    patience: int = 8
    val_fraction: float = 0.2


# --------------------------------------------------------------------------------------------------
# Labelled volumes
# --------------------------------------------------------------------------------------------------


def load_labelled_set(labels_csv: str, cfg: Config, create_key: bool = True) -> LabelledSet:
    """The labelled volumes of a CSV read and prepared with cfg (an export's settings); unusable
    files are left out and counted by reason. A read of a source without an index: it may create the
    site's key file (privacy), unless not create_key (a resumed fine-tuning, whose finished folds
    name their secret)."""
    site_secret(create=create_key)
    table = read_label_table(labels_csv)
    targets, classes, task = classification_targets(table, labels_csv)
    paths, patients = table.paths, table.patients
    keep, prepared, keys, skipped = [], PreparedVolumes(), [], Counter()
    for i, path in enumerate(counted(paths, "read", "volume")):
        try:
            volume = read_volume(path, cfg.sop_classes)
            prepared.append(resample_and_clip(volume, cfg))
        except UnusableFile as e:
            skipped[e.reason] += 1
            continue
        keep.append(i)
        keys.append(patients[i] if patients is not None else volume.patient)
        release_freed_memory()
    return LabelledSet(
        prepared,
        targets[keep],
        classes,
        task,
        np.array(keys),
        [paths[i] for i in keep],
        dict(skipped),
        patients is not None,
    )


def model_inputs(
    data: LabelledSet, idx, cfg: Config, rng: Optional[np.random.Generator] = None
) -> torch.Tensor:
    """Volumes [len(idx),1,D,H,W] of data[idx]: validation crops, or training samples (augmented)
    given an rng."""
    return torch.stack([to_sample(data.prepared[i], cfg, rng, train=rng is not None) for i in idx])


def labelled_tokens(
    encoder: PretrainedEncoder,
    data: LabelledSet,
    cfg: Config,
    device,
    name: str,
    batch_size: int = 8,
) -> TokenFile:
    """Frozen tokens [M, N, E] of every labelled volume (tokens.encode_volumes of their validation
    crops, made one at a time) in the file `name` beside the prepared volumes: neither is held in
    memory."""
    crops = (model_inputs(data, [i], cfg)[0] for i in range(len(data.paths)))
    return encode_volumes(
        {name: encoder}, crops, device, batch_size, folder=data.prepared.folder.name
    )[name]


# --------------------------------------------------------------------------------------------------
# Splits and scores
# --------------------------------------------------------------------------------------------------


def patient_folds(data: LabelledSet, folds: int, seed: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(train, test) indices of StratifiedGroupKFold over patients: no patient on both sides,
    classes balanced."""
    patients = len(set(data.patients))
    largest = int(np.bincount(data.strata).max())
    if patients < folds or largest < folds:
        raise ConfigError(
            f"folds: {folds} folds need at least {folds} patients and a class (multi-label: a set"
            f" of classes) of {folds} volumes; the labels have {patients} patients and at most"
            f" {largest} volumes per class."
        )
    split = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
    # "the least populated class has fewer members than folds": check_fold says more
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return list(split.split(np.zeros(len(data.strata)), data.strata, data.patients))


def validation_split(data: LabelledSet, train_idx: np.ndarray, fraction: float, seed: int):
    """(fit, val) indices: about `fraction` of train_idx's patients (at least one) held out for
    early stopping, classes balanced."""
    patients = len(set(data.patients[train_idx]))
    if patients < 2:
        raise ConfigError(
            f"folds: a fold's training part holds {patients} patient, too few to hold some out for "
            "early stopping; use fewer --folds or label more patients."
        )
    # scikit-learn wants a class at least this large
    largest = int(np.bincount(data.strata[train_idx]).max())
    split = StratifiedGroupKFold(
        n_splits=max(2, min(patients, largest, round(1 / fraction))),
        shuffle=True,
        random_state=seed,
    )
    # a rare class may miss the validation part: its loss still stops early
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fit, val = next(
            split.split(np.zeros(len(train_idx)), data.strata[train_idx], data.patients[train_idx])
        )
    return train_idx[fit], train_idx[val]


def check_fold(data: LabelledSet, idx: np.ndarray, what: str) -> None:
    """ConfigError unless every class can be scored on data[idx]: present (and, multilabel, also
    absent)."""
    if data.task == "multilabel":
        counts = data.targets[idx].sum(0)
        bad = [c for c, n in zip(data.classes, counts) if n in (0, len(idx))]
    else:
        bad = [c for i, c in enumerate(data.classes) if not (data.targets[idx] == i).any()]
    if bad:
        lacks = "only one value of" if data.task == "multilabel" else "no"
        raise ConfigError(
            f"folds: the {what} of a fold has {lacks} class {bad[0]} ({len(idx)} volumes); use"
            " fewer --folds or label more patients."
        )


def task_scores(probs: np.ndarray, targets: np.ndarray, task: str) -> dict:
    """AUROC and balanced accuracy of probabilities [M, C]: readouts.classification_scores, or
    (multilabel: sigmoid probabilities, targets [M, C] of 0/1) its mean over the classes, each
    scored as a binary task."""
    if task != "multilabel":
        return classification_scores(probs, targets)
    per_class = [
        classification_scores(np.stack([1 - p, p], 1), t) for p, t in zip(probs.T, targets.T)
    ]
    return {k: float(np.mean([s[k] for s in per_class])) for k in ("auroc", "balanced_accuracy")}


def frozen_fold(
    tokens: TokenFile, data: LabelledSet, train_idx, test_idx, seed: int
) -> Dict[str, dict]:
    """readouts.split_scores on one fold (multilabel: on each class as a binary task, averaged):
    {probe: scores}."""
    if data.task != "multilabel":
        return split_scores(tokens, data.targets, train_idx, test_idx, seed)
    per_class = [split_scores(tokens, t, train_idx, test_idx, seed) for t in data.targets.T]
    return {
        probe: {
            k: float(np.mean([s[probe][k] for s in per_class]))
            for k in ("auroc", "balanced_accuracy")
        }
        for probe in per_class[0]
    }


# --------------------------------------------------------------------------------------------------
# Full fine-tuning
# --------------------------------------------------------------------------------------------------


class Classifier(torch.nn.Module):
    """An encoder with attentive heads (readouts.AttentiveProbe): volume [B,1,D,H,W] -> tokens
    [B,N,E] -> logits [B,C]. One head over the classes, or (multilabel) one binary head per class,
    whose two logits' difference is the class's log-odds."""

    def __init__(self, encoder: PretrainedEncoder, heads: List[AttentiveProbe], multilabel: bool):
        super().__init__()
        self.encoder, self.heads, self.multilabel = encoder, torch.nn.ModuleList(heads), multilabel

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(volume)  # [B, N, E]
        if not self.multilabel:
            return self.heads[0](tokens)
        logits = [head(tokens) for head in self.heads]  # C x [B, 2]
        return torch.stack([two[:, 1] - two[:, 0] for two in logits], dim=1)  # [B, C]


def probe_heads(
    tokens: TokenFile, data: LabelledSet, fit_idx: np.ndarray, seed: int
) -> List[AttentiveProbe]:
    """probe.py's attentive probe trained on the frozen tokens [M,N,E] of data[fit_idx] (multilabel:
    one binary probe per class): where full fine-tuning starts from (linear probing, then
    fine-tuning)."""
    if data.task != "multilabel":
        return [fit_attentive(tokens, data.targets, fit_idx, seed)]
    return [fit_attentive(tokens, t, fit_idx, seed) for t in data.targets.T]


def layer_decay_groups(model: Classifier, settings: FullSettings) -> List[dict]:
    """AdamW parameter groups with layer-wise LR decay: depth L+1 (heads, final norm) at lr, block i
    at lr * layer_decay ** (L - i), the patch embedding at lr * layer_decay ** (L + 1); weight decay
    on weight matrices and kernels only. Each group's 'lr_scale' multiplies the scheduled LR."""
    depth = len(model.encoder.blocks)
    groups = {}
    for name, p in model.named_parameters():
        if name.startswith("encoder.blocks."):
            layer = int(name.split(".")[2]) + 1
        else:
            layer = 0 if name.startswith("encoder.patch_embed") else depth + 1
        decay = p.ndim >= 2
        group = groups.setdefault(
            (layer, decay),
            {
                "params": [],
                "lr_scale": settings.layer_decay ** (depth + 1 - layer),
                "weight_decay": settings.weight_decay if decay else 0.0,
            },
        )
        group["params"].append(p)
    return list(groups.values())


def loss_of(logits: torch.Tensor, targets: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy (binary, multiclass: targets [B] class ids) or binary cross-entropy per class
    (multilabel)."""
    if task == "multilabel":
        return F.binary_cross_entropy_with_logits(logits, targets.float())
    return F.cross_entropy(logits, targets)


@torch.no_grad()
def predict(
    model: Classifier, data: LabelledSet, idx: np.ndarray, cfg: Config, batch_size: int, device
) -> Tuple[np.ndarray, float]:
    """(probabilities [len(idx), C], mean loss) of data[idx] (validation crops)."""
    model.eval()
    logits = torch.cat(
        [
            model(model_inputs(data, idx[i : i + batch_size], cfg).to(device)).float().cpu()
            for i in range(0, len(idx), batch_size)
        ]
    )
    targets = torch.from_numpy(data.targets[idx])
    probs = torch.sigmoid(logits) if data.task == "multilabel" else F.softmax(logits, dim=-1)
    return probs.numpy(), float(loss_of(logits, targets, data.task))


def finetune_fold(
    encoder: PretrainedEncoder,
    tokens: TokenFile,
    data: LabelledSet,
    fit_idx: np.ndarray,
    val_idx: np.ndarray,
    cfg: Config,
    settings: FullSettings,
    seed: int,
    device,
) -> Tuple[Classifier, dict]:
    """Fine-tune a copy of the encoder with attentive heads, first fitted on its frozen tokens
    [M,N,E] (probe_heads), on data[fit_idx] until the validation loss on data[val_idx] has not
    improved for `patience` epochs (or `epochs` ran); returns the model at its best epoch (0: the
    probe heads on the frozen encoder) and the training log."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = Classifier(
        copy.deepcopy(encoder), probe_heads(tokens, data, fit_idx, seed), data.task == "multilabel"
    )
    model.to(device)
    groups = layer_decay_groups(model, settings)
    optimizer = torch.optim.AdamW(groups, lr=settings.lr)
    steps_per_epoch = math.ceil(len(fit_idx) / settings.batch_size)
    total = settings.epochs * steps_per_epoch
    val_loss = predict(model, data, val_idx, cfg, settings.batch_size, device)[1]
    best = {"val_loss": val_loss, "epoch": 0, "state": copy.deepcopy(model.state_dict())}
    step, history = 0, [{"epoch": 0, "train_loss": None, "val_loss": val_loss}]
    for epoch in range(1, settings.epochs + 1):
        model.train()
        order = rng.permutation(fit_idx)
        losses = []
        for i in range(0, len(order), settings.batch_size):
            batch = order[i : i + settings.batch_size]
            lr = (
                settings.lr * (step + 1) / steps_per_epoch
                if step < steps_per_epoch
                else cosine_ramp(step, steps_per_epoch, total - 1, settings.lr, settings.lr / 100)
            )
            for group in groups:
                group["lr"] = lr * group["lr_scale"]
            logits = model(model_inputs(data, batch, cfg, rng).to(device))
            loss = loss_of(logits, torch.from_numpy(data.targets[batch]).to(device), data.task)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            losses.append(float(loss.detach()))
        val_loss = predict(model, data, val_idx, cfg, settings.batch_size, device)[1]
        history.append({"epoch": epoch, "train_loss": float(np.mean(losses)), "val_loss": val_loss})
        if val_loss < best["val_loss"]:
            best = {
                "val_loss": val_loss,
                "epoch": epoch,
                "state": copy.deepcopy(model.state_dict()),
            }
        elif epoch - best["epoch"] >= settings.patience:
            break
    model.load_state_dict(best["state"])
    return model, {
        "epochs": epoch,
        "best_epoch": best["epoch"],
        "val_loss": best["val_loss"],
        "history": history,
    }


def save_fold(
    model: Classifier,
    encoder: PretrainedEncoder,
    data: LabelledSet,
    fold: dict,
    parts: dict,
    directory: str,
    source: dict,
) -> None:
    """A fold's fine-tuned model: an export of its encoder (load_encoder reads it),
    heads.safetensors and fold.json (classes, task, the keyed ids of each part's volumes
    (privacy.volume_key below the CSV's folder), scores and training log): no path, safe to
    share."""
    config = {k: v for k, v in encoder.config.items() if k != "weights"}
    save_encoder(
        model.encoder.state_dict(),
        {
            **config,
            "source": share_safe_source(
                {**source, "encoder": "fine-tuned (full)", "pretrained": encoder.config["source"]}
            ),
        },
        directory,
    )
    safetensors.torch.save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.heads.state_dict().items()},
        os.path.join(directory, "heads.safetensors"),
    )
    outputs = 2 if model.multilabel else len(data.classes)
    heads = (
        f"{len(model.heads)} x readouts.AttentiveProbe({encoder.embed_dim}, {outputs})"
        " (finetune.Classifier)"
    )
    # the CSV's folder: keys of its relative paths
    root = os.path.dirname(os.path.abspath(source["labels"]))
    record = {
        "classes": data.classes,
        "task": data.task,
        "heads": heads,
        **fold,
        **{
            f"{part}_volumes": [volume_key(data.paths[i], root) for i in idx]
            for part, idx in parts.items()
        },
    }
    with open(os.path.join(directory, "fold.json"), "w") as f:
        json.dump(record, f, indent=1)


# --------------------------------------------------------------------------------------------------
# Cross-validation and report
# --------------------------------------------------------------------------------------------------


def fold_splits(data: LabelledSet, splits: str, folds: int, repeats: int, seed: int) -> List[dict]:
    """Every (repeat, fold): its train and test indices and the seed its probes and training start
    from. kfold: patient_folds with shuffle seed+repeat; probe: probe.py's split of seed `repeat`
    (readouts.probe_split: by patient when the CSV lists patients, as probe.py splits)."""
    if splits == "probe":
        if data.task == "multilabel":
            raise ConfigError(
                "splits: probe.py's splits take one class per volume; use --splits kfold for "
                "multi-label."
            )
        return [
            {
                "repeat": r,
                "fold": 0,
                "seed": r,
                "split": probe_split(
                    data.targets, r, data.patients if data.patients_listed else None
                ),
            }
            for r in range(repeats)
        ]
    out = []
    for r in range(repeats):
        for f, split in enumerate(patient_folds(data, folds, seed + r)):
            out.append({"repeat": r, "fold": f, "seed": (seed + r) * folds + f, "split": split})
    for s in out:
        check_fold(data, s["split"][1], "test part")
        check_fold(data, s["split"][0], "training part")
    return out


def fold_result(
    done: Optional[dict], arm: str, mode: str, split: dict, compute: Callable[[], dict]
) -> dict:
    """A split's result of one arm and mode: read from done['directory'] when an earlier run of the
    same fine-tuning (done['fingerprint']) finished it, else computed and written there at once (a
    kill loses at most the split in progress). A result of another fine-tuning there is a
    ConfigError."""
    if done is None:
        return compute()
    path = os.path.join(
        done["directory"],
        f"{arm.replace(' ', '_')}-{mode}-r{split['repeat']}_f{split['fold']}.json",
    )
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("fingerprint") != done["fingerprint"]:
            raise ConfigError(
                f"out: {path} holds a result of another fine-tuning (another encoder, labels or "
                "settings); choose another --out."
            )
        return saved["result"]
    result = compute()
    write_atomic(
        path,
        json.dumps(
            {"fingerprint": done["fingerprint"], "result": result},
            indent=1,
            default=lambda o: o.tolist(),  # numpy numbers
        ).encode(),
    )
    return result


def run_arm(
    arm: str,
    encoder: PretrainedEncoder,
    data: LabelledSet,
    splits: List[dict],
    modes,
    cfg: Config,
    settings: FullSettings,
    device,
    save: Optional[dict] = None,
    done: Optional[dict] = None,
) -> Dict[str, List[dict]]:
    """{mode or probe: one result per split} of one encoder (named `arm` in the progress lines): the
    frozen probes (readouts.split_scores) and full fine-tuning. save: {'directory', 'source'} to
    keep each fold's fine-tuned model (save_fold). done: {'directory', 'fingerprint'} where each
    split's result is written as it finishes and found again by the same command after a kill
    (fold_result)."""
    results: Dict[str, List[dict]] = {}
    tokens = labelled_tokens(encoder.to(device), data, cfg, device, arm.replace(" ", "_"))
    if "frozen" in modes:
        for s in splits:
            train_idx, test_idx = s["split"]
            scored = fold_result(
                done,
                arm,
                "frozen",
                s,
                lambda: frozen_fold(tokens, data, train_idx, test_idx, s["seed"]),
            )
            for probe, scores in scored.items():
                results.setdefault(probe, []).append(
                    {
                        "repeat": s["repeat"],
                        "fold": s["fold"],
                        "train": len(train_idx),
                        "test": len(test_idx),
                        **scores,
                    }
                )
    if "full" in modes:
        for s in counted(splits, f"{arm}: full fine-tuning", "fold", every=1):
            results.setdefault("full", []).append(
                fold_result(
                    done,
                    arm,
                    "full",
                    s,
                    lambda: full_fold(arm, encoder, tokens, data, s, cfg, settings, device, save),
                )
            )
    return results


def full_fold(
    arm: str,
    encoder: PretrainedEncoder,
    tokens: TokenFile,
    data: LabelledSet,
    s: dict,
    cfg: Config,
    settings: FullSettings,
    device,
    save: Optional[dict],
) -> dict:
    """Full fine-tuning on one split `s`: its scores and training log (and its model kept, with
    save)."""
    train_idx, test_idx = s["split"]
    fit_idx, val_idx = validation_split(data, train_idx, settings.val_fraction, s["seed"])
    model, log = finetune_fold(
        encoder, tokens, data, fit_idx, val_idx, cfg, settings, s["seed"], device
    )
    probs, _ = predict(model, data, test_idx, cfg, settings.batch_size, device)
    fold = {
        "repeat": s["repeat"],
        "fold": s["fold"],
        "train": len(fit_idx),
        "val": len(val_idx),
        "test": len(test_idx),
        **task_scores(probs, data.targets[test_idx], data.task),
        **log,
    }
    print(
        f"{arm}, full fine-tuning, repeat {s['repeat']} fold {s['fold']}: AUROC"
        f" {fold['auroc']:.3f}, balanced accuracy {fold['balanced_accuracy']:.3f}, {log['epochs']}"
        f" epochs (best {log['best_epoch']})",
        file=sys.stderr,
    )
    if save:
        save_fold(
            model,
            encoder,
            data,
            fold,
            {"train": fit_idx, "val": val_idx, "test": test_idx},
            os.path.join(save["directory"], f"r{s['repeat']}_f{s['fold']}"),
            save["source"],
        )
    return fold


def summarize(results: Dict[str, List[dict]]) -> dict:
    """Per mode: its folds and the mean and 95% t-interval over them of AUROC and balanced accuracy
    (within [0, 1])."""
    return {
        mode: {
            "folds": folds,
            **{
                m: interval([f[m] for f in folds], SCORE_BOUNDS)
                for m in ("auroc", "balanced_accuracy")
            },
        }
        for mode, folds in results.items()
    }


def paired_differences(a: dict, b: dict) -> dict:
    """Per mode of both summaries: mean and 95% t-interval of the per-fold differences a - b (the
    same folds; within [-1, 1])."""
    return {
        mode: {m: paired_difference(a[mode][m], b[mode][m]) for m in ("auroc", "balanced_accuracy")}
        for mode in a
        if mode in b
    }


def format_report(report: dict) -> str:
    """The console table: per encoder and mode, AUROC and balanced accuracy [95% interval]; the
    paired differences."""
    lines = [
        f"{'encoder':<15}{'mode':<11}{'AUROC [95% interval]':<27}balanced accuracy    "
        f" ({report['fold_count']} {'folds' if report['splits'] == 'kfold' else 'splits'},"
        f" {report['volumes']} volumes of {report['patients']} patients, {report['task']})"
    ]
    rows = [
        (arm, mode, s, "") for arm, modes in report["arms"].items() for mode, s in modes.items()
    ]
    rows += [
        ("enc - random", mode, s, "+")
        for mode, s in report.get("pretrained_minus_random", {}).items()
    ]
    for arm, mode, s, sign in rows:
        a, b = s["auroc"], s["balanced_accuracy"]
        lines.append(
            f"{arm:<15}{mode:<11}{a['mean']:{sign}6.3f} [{a['low']:{sign}6.3f},"
            f" {a['high']:{sign}6.3f}]{'':<4}{b['mean']:{sign}6.3f} [{b['low']:{sign}6.3f},"
            f" {b['high']:{sign}6.3f}]"
        )
    return "\n".join(lines)


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="finetune.py")
    parser.add_argument("--encoder", required=True, help="an export folder (encoder.py export)")
    parser.add_argument(
        "--labels", required=True, help="labels CSV: path,label or path,<class>,... [,patient]"
    )
    parser.add_argument(
        "--out",
        default="runs/finetune",
        help=(
            "report.json and the folds' models (default runs/finetune; must not hold a report yet)"
        ),
    )
    parser.add_argument(
        "--modes", default="frozen,full", help="frozen, full or both (default frozen,full)"
    )
    parser.add_argument(
        "--splits",
        default="kfold",
        choices=("kfold", "probe"),
        help="kfold: patient-level StratifiedGroupKFold; probe: probe.py's splits",
    )
    parser.add_argument("--folds", type=int, default=5, help="folds per repeat (kfold; default 5)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="k-fold partitions (probe: splits) (default 1)"
    )
    parser.add_argument(
        "--vs_random",
        action="store_true",
        help="also a random init, the same way; paired differences",
    )
    defaults = FullSettings()
    for name, value in vars(defaults).items():
        parser.add_argument(
            f"--{name}", type=type(value), default=value, help=f"full fine-tuning (default {value})"
        )
    args, rest = parser.parse(argv)
    other = sorted(given_flags(rest) - set(CLI_FIELDS))
    if other:
        raise ConfigError(
            f"{', '.join('--' + o for o in other)}: the export brings its own model and"
            f" preprocessing; the config flags that finetune.py takes: --{', --'.join(CLI_FIELDS)}."
        )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: {args.modes!r}: give frozen, full or frozen,full")
    settings = FullSettings(**{k: getattr(args, k) for k in vars(defaults)})
    if (
        min(args.folds, args.repeats, settings.epochs, settings.batch_size) < 1
        or args.folds < 2
        or not 0 < settings.val_fraction < 1
        or settings.lr <= 0
    ):
        parser.error(
            "--folds must be at least 2; --repeats, --epochs, --batch_size at least 1;"
            " --val_fraction in (0, 1); --lr positive"
        )
    report_path = os.path.join(args.out, "report.json")
    if os.path.exists(report_path):
        raise ConfigError(
            f"out: {report_path} exists; choose another --out (nothing is overwritten)."
        )
    try:  # before any work: an --out that cannot be written would lose it all
        write_atomic(os.path.join(args.out, "folds", ".write-probe"), b"octjepa")
    except OSError as e:
        raise ConfigError(
            f"out: cannot write into {args.out} ({e}); choose a writable --out."
        ) from None
    cli = load_config(rest)
    # a preemption (SIGTERM, Ctrl-C) keeps the finished splits: exit 75
    with StopSignals() as signals:
        try:
            with signals.at_once():
                report = finetune(args, settings, modes, cli)
        except StopRequested as stop:
            raise Preempted(
                f"{stop}: fine-tuning stopped; the splits finished so far are kept in "
                f"{os.path.join(args.out, 'folds')}, and the same command continues from them."
            ) from None
        # a signal from here on waits for the report: every split is done
        print(format_report(report))
        with open(report_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"report: {report_path}")
    return 0


def load_export(path: str) -> PretrainedEncoder:
    """load_encoder of --encoder; a train.py checkpoint given instead (a run's checkpoints folder or
    a .pt file) stops with the command that exports it into the run folder's encoder/, beside
    checkpoints/."""
    if not path.endswith(".pt"):  # an export is a folder
        try:
            return load_encoder(path)
        except ExportError:
            if not list_checkpoints(path):
                raise
    checkpoints = os.path.dirname(path) if path.endswith(".pt") else path.rstrip("/")
    out = shlex.quote(os.path.join(os.path.dirname(checkpoints), "encoder"))
    raise ExportError(
        f"--encoder {path} is a train.py checkpoint, not an export: export it with `python"
        f" encoder.py export --ckpt {shlex.quote(path)} --out {out}`, then give --encoder {out}."
    )


def finetune(args, settings: FullSettings, modes: List[str], cli: Config) -> dict:
    """The report of main's fine-tuning (its parsed `args`): every arm and mode over the splits,
    each split's result written to OUT/folds as it finishes (fold_result)."""
    encoder = load_export(args.encoder)
    cfg = replace(encoder.settings, **{k: getattr(cli, k) for k in CLI_FIELDS})
    device = probe_device(cfg)
    folds_dir = os.path.join(args.out, "folds")
    finished = sorted(glob.glob(os.path.join(glob.escape(folds_dir), "*.json")))
    # a resume: the key file that made the finished folds' keys and splits, never a new one
    if finished:
        check_resumed_key(finished[0], args.out)
    data = load_labelled_set(args.labels, cfg, create_key=not finished)
    if data.skipped:
        print(f"unusable files left out:\n{format_reason_table(data.skipped)}", file=sys.stderr)
    splits = fold_splits(data, args.splits, args.folds, args.repeats, cfg.seed)
    arms = {
        "encoder": encoder,
        **({"random init": random_encoder(encoder.config, cfg.seed)} if args.vs_random else {}),
    }
    source = {"finetuned_from": args.encoder, "labels": args.labels}
    report = {
        "encoder": os.path.basename(args.encoder.rstrip("/")),
        "labels": os.path.basename(args.labels),
        "task": data.task,
        "classes": data.classes,
        "volumes": len(data.paths),
        "patients": len(set(data.patients)),
        "skipped": data.skipped,
        "splits": args.splits,
        "folds": args.folds if args.splits == "kfold" else 1,
        "repeats": args.repeats,
        "fold_count": len(splits),
        "seed": cfg.seed,
        "full_settings": vars(settings),
        "arms": {},
    }
    with open(args.labels, "rb") as f:
        labels_sha = hashlib.sha256(f.read()).hexdigest()
    # which secret made the patient keys and volume ids (privacy.py)
    report["key_fingerprint"] = key_fingerprint()
    done = {
        "directory": folds_dir,
        "fingerprint": {
            "encoder": encoder.config["weights"]["sha256"],
            "labels": labels_sha,
            "splits": args.splits,
            "folds": args.folds,
            "seed": cfg.seed,
            "full_settings": vars(settings),
            "key_fingerprint": report["key_fingerprint"],
        },
    }
    for arm, arm_encoder in arms.items():
        save = (
            {"directory": os.path.join(args.out, "full"), "source": source}
            if arm == "encoder"
            else None
        )
        report["arms"][arm] = summarize(
            run_arm(arm, arm_encoder, data, splits, modes, cfg, settings, device, save, done)
        )
    if args.vs_random:
        report["pretrained_minus_random"] = paired_differences(
            report["arms"]["encoder"], report["arms"]["random init"]
        )
    return report


def check_resumed_key(finished: str, out: str) -> None:
    """That a resumed fine-tuning's key file is the one its finished split `finished` was made with
    (its patient keys draw the splits, its volume ids fill fold.json): a ConfigError naming the key
    file, before any key file is created, when it is missing or holds another secret
    (privacy.check_same_key)."""
    with open(finished) as f:
        recorded = (json.load(f).get("fingerprint") or {}).get("key_fingerprint")
    check_recorded_key(
        recorded,
        f"out: the finished folds in {os.path.join(out, 'folds')}",
        f"point {KEY_FILE_ENV} at the key file the finished folds were made with, or start over in "
        f"another --out (or delete {os.path.join(out, 'folds')})",
    )


if __name__ == "__main__":
    sys.exit(main())
