"""Labelled volumes: a labels CSV (path,label[,patient] or other columns) checked row by row with a message that
names each problem and its fix, the built-in labelled phantom sets, and the volumes of either read and preprocessed
as validation samples, and their targets (their frozen tokens: tokens.py). probe.py, finetune.py and encoder.py's
show read their labels here.
"""
import csv
import os
import sys
from collections import Counter
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from config import Config, ConfigError, phantom_set_labels_path
from data import load_val_sample
from dicom import UnusableFile
from phantom import ensure_phantom_set
from progress import counted

PROBE_PHANTOMS = 240  # volumes of the plain labelled phantom set (plain_lesion, and the probe during pretraining)
PROBE_PHANTOM_SEED = 1  # the pretraining phantoms use seed 0
SUITE_PHANTOMS = 300  # volumes of the varied labelled phantom set (lesion, lesion_tokens)
SUITE_PHANTOM_SEED = 2
INNER_PHANTOMS = 300  # volumes of the varied labelled set of inner-retina lesions (inner_lesion, inner_lesion_tokens)
INNER_PHANTOM_SEED = 3
# The built-in labelled phantom sets by kind (probe.SUITE's keys): (volumes, seed, varied eyes, phantom lesions)
PHANTOM_SETS = {"plain": (PROBE_PHANTOMS, PROBE_PHANTOM_SEED, False, "rpe"),
                "varied": (SUITE_PHANTOMS, SUITE_PHANTOM_SEED, True, "rpe"),
                "inner": (INNER_PHANTOMS, INNER_PHANTOM_SEED, True, "inner")}


MISSING_LABEL_WORDS = ("nan", "na", "n/a", "null")  # what a spreadsheet writes for an empty cell


def read_label_rows(path: str, header_hint: str) -> List[dict]:
    """The rows of a labels CSV as dicts (an Excel BOM is fine), their `path` made absolute (relative to the CSV's
    folder unless a URL or absolute). A ConfigError naming the rows and the fix, adding header_hint (what the CSV
    should hold): a missing file, a header alone, a header cell in another case or padded (`Label`), an empty path
    or one leaving the CSV's folder (`..`), the same volume twice, an empty, NaN or padded value, a blank patient
    cell, no path that exists. Paths that do not exist, when others do, are named on stderr (and left out later)."""
    if not os.path.isfile(path):
        raise ConfigError(f"labels: {path} not found; {header_hint}.")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    for cell in header:
        if cell != cell.strip().lower() and cell.strip().lower() in ("path", "label", "patient"):
            raise ConfigError(f"labels: {path}: the header cell {cell!r} should read {cell.strip().lower()!r} (lower "
                              f"case, no spaces); {header_hint}.")
    if not rows:
        raise ConfigError(f"labels: {path} holds a header ({','.join(header) or 'empty'}) but no rows; {header_hint}.")
    root = os.path.dirname(os.path.abspath(path))
    problems, seen = [], {}
    for line, r in enumerate(rows, start=2):
        given = r.get("path")
        if given is None:
            continue
        if given.strip() in ("", ".") or os.path.normpath(given).split(os.sep)[0] == "..":
            problems.append(f"line {line}: path {given!r} is not a volume inside the CSV's folder")
            continue
        if "://" not in given and not os.path.isabs(given):
            r["path"] = os.path.normpath(os.path.join(root, given))
        same = file_identity(r["path"])
        if same in seen:
            problems.append(f"line {line}: {given} is the volume of line {seen[same]} again"
                            + ("" if same == r["path"] else " (the same file or folder through a link or another path)"))
        seen.setdefault(same, line)
        for column, value in r.items():
            if column in ("path", None):  # None: cells beyond the header
                continue
            if value is None or value.strip() == "" or value.strip().lower() in MISSING_LABEL_WORDS:
                problems.append(f"line {line}: {column} is empty ({value!r})")
            elif value != value.strip():
                problems.append(f"line {line}: {column} {value!r} has spaces around it")
    if problems:
        raise ConfigError(f"labels: {path}:\n    " + "\n    ".join(problems[:10]) +
                          (f"\n    ... and {len(problems) - 10} more" if len(problems) > 10 else "") +
                          "\nFix these rows (every volume once, a value in every cell).")
    local = [r["path"] for r in rows if r.get("path") and "://" not in r["path"]]
    unknown = [p for p in local if not os.path.exists(p)]
    if unknown and len(unknown) == len(rows):
        raise ConfigError(f"labels: none of the {len(rows)} paths in {path} exists (e.g. {unknown[0]}); paths are "
                          f"relative to the CSV's folder {root}.")
    if unknown:
        print(f"labels: {len(unknown)} paths in {path} do not exist and are left out: {', '.join(unknown[:5])}"
              + (" ..." if len(unknown) > 5 else ""), file=sys.stderr)
    return rows


def file_identity(path: str):
    """What one file or folder is, whatever the path to it: (device, inode) of a local one that exists (a symlink,
    a symlinked folder or a hard link lead to the same), else the path itself."""
    if "://" in path:
        return path
    try:
        stat = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (stat.st_dev, stat.st_ino)


def read_labels(path: str, columns: Sequence[str] = ("label",)) -> List[Tuple[str, ...]]:
    """(path, *columns) rows of a labels CSV with a header path,label,... (paths relative to the CSV's folder)."""
    rows = read_label_rows(path, "give a CSV with the header path,label (paths relative to its folder), or leave "
                                 "--labels and --data_root out to probe the built-in phantom suite")
    if not rows or not {"path", *columns} <= set(rows[0]):
        raise ConfigError(f"labels: {path} needs a header line path,{','.join(columns)} and at least one row.")
    return [(r["path"], *(r[c] for c in columns)) for r in rows]


def phantom_labels(cfg: Config, varied: bool = False) -> str:
    """labels.csv of a built-in labelled phantom set, written once: the plain set in cfg.phantom_dir + '_probe', or
    the varied one (varied eyes, balanced labels, retina_thickness) in cfg.phantom_dir + '_suite'."""
    return phantom_set_labels(cfg, "varied" if varied else "plain")


def phantom_set_labels(cfg: Config, kind: str) -> str:
    """labels.csv of the built-in labelled phantom set of a kind (PHANTOM_SETS), written once beside cfg.phantom_dir
    (config.PHANTOM_SET_SUFFIXES): plain, varied (varied eyes, drusen or fluid in half, retina_thickness) or inner
    (the same eyes with foci or cysts of the inner retina in half: phantom.INNER_LABELS)."""
    n, seed, varied, lesions = PHANTOM_SETS[kind]
    path = phantom_set_labels_path(cfg, kind)
    ensure_phantom_set(os.path.dirname(path), n, seed, "labelled phantom volumes", varied, lesions)
    return path


def load_labelled_volumes(cfg: Config, labels_csv: str, max_volumes: Optional[int] = None,
                          columns: Sequence[str] = ("label",)):
    """(volumes [M,1,D,H,W] float32 preprocessed like validation samples, {column: values [M] (strings)},
    {reason: count} of unusable files) of a labels CSV; at most max_volumes, drawn at random."""
    rows = read_labels(labels_csv, columns)
    if max_volumes is not None and len(rows) > max_volumes:
        keep = np.random.default_rng(0).permutation(len(rows))[:max_volumes]
        rows = [rows[i] for i in sorted(keep)]
    volumes, kept, skipped = [], [], Counter()
    for row in counted(rows, "read labelled volumes", "volume"):
        try:
            volumes.append(load_val_sample(row[0], cfg))
        except UnusableFile as e:
            skipped[e.reason] += 1
            continue
        kept.append(row[1:])
    values = {c: np.array([r[i] for r in kept], dtype=str) for i, c in enumerate(columns)}
    if not volumes:
        raise ConfigError(f"labels: no usable volume in {labels_csv} (unusable files: {dict(skipped)}).")
    return torch.stack(volumes), values, dict(skipped)


def task_targets(values: np.ndarray, source: str = "labels") -> Tuple[np.ndarray, List[str]]:
    """(class ids [M], class names sorted) of a label column's values [M]. Raises ConfigError when a held-out split
    is impossible."""
    counts = Counter(values)
    if len(counts) < 2 or min(counts.values()) < 2:
        raise ConfigError(f"labels: {source} gives {dict(counts)} usable volumes per class; a held-out split needs "
                          f"two classes with at least 2 volumes each (20 or more for a useful interval).")
    names = sorted(counts)
    return np.array([names.index(v) for v in values]), names


