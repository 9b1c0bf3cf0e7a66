"""Labelled volumes: a labels CSV (path,label[,patient] or other columns) checked row by row with a
message that names each problem and its fix, the built-in labelled phantom sets, and the volumes of
either read and preprocessed as validation samples, and their targets (their frozen tokens:
tokens.py). probe.py, finetune.py and encoder.py's show read their labels here.
"""

import csv
import io
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pydicom
import torch

from config import Config, ConfigError, phantom_set_labels_path
from data import load_val_sample
from dicom import UnusableFile, inspect_file
from phantom import ensure_phantom_set
from progress import counted
from storage import gcs_filesystem
from index import _instances, source_paths

# volumes of the plain labelled phantom set (plain_lesion, and the probe during pretraining)
PROBE_PHANTOMS = 240
PROBE_PHANTOM_SEED = 1  # the pretraining phantoms use seed 0
SUITE_PHANTOMS = 300  # volumes of the varied labelled phantom set (lesion, lesion_tokens)
SUITE_PHANTOM_SEED = 2
# volumes of the varied labelled set of inner-retina lesions (inner_lesion, inner_lesion_tokens)
INNER_PHANTOMS = 300
INNER_PHANTOM_SEED = 3
# The built-in labelled phantom sets by kind (probe.SUITE's keys): (volumes, seed, varied eyes,
# phantom lesions)
PHANTOM_SETS = {
    "plain": (PROBE_PHANTOMS, PROBE_PHANTOM_SEED, False, "rpe"),
    "varied": (SUITE_PHANTOMS, SUITE_PHANTOM_SEED, True, "rpe"),
    "inner": (INNER_PHANTOMS, INNER_PHANTOM_SEED, True, "inner"),
}


# the optional column that groups volumes by patient (patient-level splits)
PATIENT_COLUMN = "patient"
MISSING_LABEL_WORDS = ("nan", "na", "n/a", "null")  # what a spreadsheet writes for an empty cell
# what reading a gs:// file's DICOM header fetches at a time (not the whole object)
HEADER_BLOCK_BYTES = 256 * 1024


def read_label_rows(path: str, header_hint: str) -> List[dict]:
    """The rows of a labels CSV as dicts (an Excel BOM is fine), their `path` made absolute
    (relative to the CSV's folder unless a URL or absolute). A ConfigError naming the rows and the
    fix, adding header_hint (what the CSV should hold): a missing file, a file that is not UTF-8
    (read_utf8), a header alone, a header cell in another case or padded (`Label`), an empty path or
    one leaving the CSV's folder (`..`), the same volume twice (also through a link), an empty, NaN
    or padded value, a blank patient cell, no path that exists, a copy of another row's scan
    (copied_rows: a byte copy, perhaps under another PatientID). Paths that do not exist, when
    others do, are named on stderr (and left out later)."""
    if not os.path.isfile(path):
        raise ConfigError(f"labels: {path} not found; {header_hint}.")
    reader = csv.DictReader(io.StringIO(read_utf8(path), newline=""))
    rows, header = list(reader), reader.fieldnames or []
    for cell in header:
        if cell != cell.strip().lower() and cell.strip().lower() in ("path", "label", "patient"):
            raise ConfigError(
                f"labels: {path}: the header cell {cell!r} should read {cell.strip().lower()!r}"
                f" (lower case, no spaces); {header_hint}."
            )
    if not rows:
        raise ConfigError(
            f"labels: {path} holds a header ({','.join(header) or 'empty'}) but no rows;"
            f" {header_hint}."
        )
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
            problems.append(
                f"line {line}: {given} is the volume of line {seen[same]} again"
                + (
                    ""
                    if same == r["path"]
                    else " (the same file or folder through a link or another path)"
                )
            )
        seen.setdefault(same, line)
        for column, value in r.items():
            if column in ("path", None):  # None: cells beyond the header
                continue
            if value is None or value.strip() == "" or value.strip().lower() in MISSING_LABEL_WORDS:
                problems.append(f"line {line}: {column} is empty ({value!r})")
            elif value != value.strip():
                problems.append(f"line {line}: {column} {value!r} has spaces around it")
    if problems:
        raise ConfigError(
            f"labels: {path}:\n    "
            + "\n    ".join(problems[:10])
            + (f"\n    ... and {len(problems) - 10} more" if len(problems) > 10 else "")
            + "\nFix these rows (every volume once, a value in every cell)."
        )
    local = [r["path"] for r in rows if r.get("path") and "://" not in r["path"]]
    unknown = [p for p in local if not os.path.exists(p)]
    if unknown and len(unknown) == len(rows):
        raise ConfigError(
            f"labels: none of the {len(rows)} paths in {path} exists (e.g. {unknown[0]}); paths are"
            f" relative to the CSV's folder {root}."
        )
    if unknown:
        print(
            f"labels: {len(unknown)} paths in {path} do not exist and are left out:"
            f" {', '.join(unknown[:5])}" + (" ..." if len(unknown) > 5 else ""),
            file=sys.stderr,
        )
    copies = [
        f"line {line}: {shown(rows[line - 2]['path'], root)} holds a copy of the scan of line"
        f" {first} ({shown(rows[first - 2]['path'], root)}): the same SOPInstanceUID and voxels"
        for line, first in copied_rows([r.get("path") or "" for r in rows])
    ]
    if copies:
        raise ConfigError(
            f"labels: {path}:\n    "
            + "\n    ".join(copies[:10])
            + (f"\n    ... and {len(copies) - 10} more" if len(copies) > 10 else "")
            + "\nA copied file is one scan (`python data.py scan` calls it duplicate_instance),"
            " here on two rows, maybe under another patient: it could land on both sides of a"
            " split. Keep one row per scan: delete the copy's row (or the copied file)."
        )
    return rows


def read_utf8(path: str) -> str:
    """The text of a labels CSV (an Excel BOM dropped); a ConfigError naming the first line that is
    not UTF-8 (a spreadsheet's Latin-1 or Windows-1252 export) and how to save it as UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"labels: {path}: line {line} is not UTF-8 (byte 0x{raw[e.start]:02x}, e.g. an accented"
            " letter saved as Latin-1 or Windows-1252). Save the CSV as UTF-8 (Excel: Save As 'CSV"
            f" UTF-8'; or iconv -f latin1 -t utf-8 {path} > utf8.csv and use that)."
        ) from None


def shown(path: str, root: str) -> str:
    """A row's path as the CSV gives it: below the CSV's folder `root` when it lies there."""
    return os.path.relpath(path, root) if path.startswith(root.rstrip("/") + "/") else path


def copied_rows(paths: Sequence[str]) -> List[Tuple[int, int]]:
    """(line, earlier line) of the labels CSV (2 = the first row) for each row whose volume holds a
    copy of a file of an earlier row's: the same SOPInstanceUID and voxels, the rule by which a scan
    calls a file duplicate_instance (index._instances). Local files and gs:// objects: their
    SOPInstanceUIDs are read first (from the head of the file), and only files that share one are
    read whole and decoded to compare their voxels."""
    by_uid: Dict[str, List[Tuple[int, str]]] = {}
    for row, path in enumerate(paths):
        if "://" not in path and not os.path.exists(path):
            continue
        for file in source_paths(path):
            uid = sop_instance_uid(file)
            if uid:
                by_uid.setdefault(uid, []).append((row, file))
    pairs = set()
    for same in by_uid.values():
        if len({row for row, _ in same}) < 2:
            continue
        row_of, headers = {}, []
        for row, file in same:
            try:
                headers.append(inspect_file(file))
            except UnusableFile:
                continue
            row_of[file] = row
        _, copies, _ = _instances(headers)
        pairs |= {
            (row_of[c.path] + 2, row_of[o.path] + 2)
            for c, o in copies
            if row_of[c.path] != row_of[o.path]
        }
    return sorted(pairs)


def sop_instance_uid(file: str) -> str:
    """The SOPInstanceUID of a local DICOM file or a gs:// object, read without its pixels (of an
    object, only the blocks that hold its header are fetched); '' for a file that is not one."""
    try:
        with (
            gcs_filesystem().open(file, "rb", block_size=HEADER_BLOCK_BYTES, cache_type="readahead")
            if file.startswith("gs://")
            else open(file, "rb")
        ) as f:
            return str(
                pydicom.dcmread(f, stop_before_pixels=True, specific_tags=["SOPInstanceUID"]).get(
                    "SOPInstanceUID", ""
                )
            )
    except Exception:  # not DICOM, unreadable: the volume's reader says why
        return ""


def file_identity(path: str):
    """What one file or folder is, whatever the path to it: (device, inode) of a local one that
    exists (a symlink, a symlinked folder or a hard link lead to the same), else the path itself."""
    if "://" in path:
        return path
    try:
        stat = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (stat.st_dev, stat.st_ino)


@dataclass
class LabelTable:
    """A labels CSV read and checked (read_label_rows): one volume per row."""

    paths: List[str]  # [M] each row's volume: absolute, or a URL
    # every column but path: its cells [M] (strings), `patient` among them
    values: Dict[str, np.ndarray]

    @property
    def patients(self) -> Optional[np.ndarray]:
        """[M] the patient column's cells, or None when the CSV has none (then each volume is its
        own group)."""
        return self.values.get(PATIENT_COLUMN)

    @property
    def class_columns(self) -> List[str]:
        """The columns that say what a volume is: every one but path and patient."""
        return [c for c in self.values if c != PATIENT_COLUMN]

    def take(self, rows: Sequence[int]) -> "LabelTable":
        """The table of those rows only, in that order."""
        rows = list(rows)
        return LabelTable(
            [self.paths[i] for i in rows], {c: v[rows] for c, v in self.values.items()}
        )


def read_label_table(path: str, columns: Sequence[str] = ()) -> LabelTable:
    """The one reader of a labels CSV (probe.py, encoder.py show, finetune.py, the verdict): a
    header path,label or path,<class>,<class>... (multi-label), an optional patient column, paths
    relative to the CSV's folder. A ConfigError names each bad row (read_label_rows) or a missing
    column of `columns`. In the columns read as classes (`columns`, else `label`, else every class
    column), numbers that are one number (1, 1.0, 01) are one class: they read as 1."""
    rows = read_label_rows(
        path,
        "give a CSV with the header path,label (or path,<class>,<class>... with 1 or 0, for "
        "multi-label; an optional patient column), paths relative to its folder",
    )
    header = [c for c in rows[0] if c is not None]
    missing = [c for c in ("path", *columns) if c not in header]
    if missing or len(header) < 2:
        raise ConfigError(
            f"labels: {path} needs a header line path,{','.join(columns or ['label'])} (it has "
            f"{','.join(header)}); missing: {', '.join(missing or ['a label column'])}."
        )
    values = {c: np.array([r[c] for r in rows], dtype=str) for c in header if c != "path"}
    classes = set(columns or (["label"] if "label" in values else values)) & set(values) - {
        PATIENT_COLUMN
    }
    # the columns read as classes; patient ids stay as written: 001 and 1 are two patients
    for column in classes:
        values[column] = same_numbers_as_one(values[column], f"{path}: {column}")
    return LabelTable([r["path"] for r in rows], values)


def same_numbers_as_one(cells: np.ndarray, where: str) -> np.ndarray:
    """A column's cells [M] with every number written one way (1.0 and 01 as 1, 2.50 as 2.5) when
    all of them are numbers, else as they are; a line on stderr when that joins cells written
    differently."""
    try:
        numbers = [float(c) for c in cells]
    except ValueError:
        return cells
    same = np.array([str(int(x)) if x.is_integer() else repr(x) for x in numbers], dtype=str)
    joined = {s for s, c in zip(same, cells) if s != c}
    if joined:
        print(
            f"labels: {where}: {', '.join(sorted({c for s, c in zip(same, cells) if s in joined}))}"
            f" read as {', '.join(sorted(joined))} (one number, one class)",
            file=sys.stderr,
        )
    return same


def classification_targets(table: LabelTable, path: str) -> Tuple[np.ndarray, List[str], str]:
    """(targets, classes, task) of a label table: with a label column, class ids [M] of the classes
    sorted (task binary or multiclass); else every class column holds 1 or 0 (task multilabel,
    targets [M, C]). A ConfigError for one class, or a multi-label cell that is not 1 or 0."""
    if "label" in table.values:
        classes = sorted(set(table.values["label"]))
        if len(classes) < 2:
            raise ConfigError(
                f"labels: every volume of {path} has the label {classes[0]!r}; a classifier needs"
                " at least two classes."
            )
        return (
            np.array([classes.index(v) for v in table.values["label"]]),
            classes,
            "binary" if len(classes) == 2 else "multiclass",
        )
    classes = table.class_columns
    cells = np.stack([table.values[c] for c in classes], axis=1)  # [M, C]
    if not np.isin(cells, ("0", "1")).all():
        raise ConfigError(
            f"labels: {path} has no `label` column, so it is multi-label: the class columns"
            f" ({', '.join(classes)}) must hold 1 or 0 (every column but path and patient is a"
            " class)."
        )
    return (cells == "1").astype(np.int64), classes, "multilabel"


def phantom_labels(cfg: Config, varied: bool = False) -> str:
    """labels.csv of a built-in labelled phantom set, written once: the plain set in cfg.phantom_dir
    + '_probe', or the varied one (varied eyes, balanced labels, retina_thickness) in
      cfg.phantom_dir + '_suite'."""
    return phantom_set_labels(cfg, "varied" if varied else "plain")


def phantom_set_labels(cfg: Config, kind: str) -> str:
    """labels.csv of the built-in labelled phantom set of a kind (PHANTOM_SETS), written once beside
    cfg.phantom_dir (config.PHANTOM_SET_SUFFIXES): plain, varied (varied eyes, drusen or fluid in
    half, retina_thickness) or inner (the same eyes with foci or cysts of the inner retina in half:
    phantom.INNER_LABELS)."""
    n, seed, varied, lesions = PHANTOM_SETS[kind]
    path = phantom_set_labels_path(cfg, kind)
    ensure_phantom_set(os.path.dirname(path), n, seed, "labelled phantom volumes", varied, lesions)
    return path


def load_labelled_volumes(
    cfg: Config,
    labels_csv: str,
    max_volumes: Optional[int] = None,
    columns: Sequence[str] = ("label",),
):
    """(volumes [M,1,D,H,W] float32 preprocessed like validation samples, {column: values [M]
    (strings)} of `columns` and of the patient column where the CSV has one, {reason: count} of
    unusable files) of a labels CSV; at most max_volumes, drawn at random."""
    table = read_label_table(labels_csv, columns)
    if max_volumes is not None and len(table.paths) > max_volumes:
        table = table.take(
            sorted(np.random.default_rng(0).permutation(len(table.paths))[:max_volumes])
        )
    volumes, kept, skipped = [], [], Counter()
    for row, path in enumerate(counted(table.paths, "read labelled volumes", "volume")):
        try:
            volumes.append(load_val_sample(path, cfg))
        except UnusableFile as e:
            skipped[e.reason] += 1
            continue
        kept.append(row)
    table = table.take(kept)
    values = {
        c: np.array(table.paths, dtype=str) if c == "path" else table.values[c] for c in columns
    }
    if table.patients is not None:
        values[PATIENT_COLUMN] = table.patients
    if not volumes:
        raise ConfigError(
            f"labels: no usable volume in {labels_csv} (unusable files: {dict(skipped)})."
        )
    return torch.stack(volumes), values, dict(skipped)


def task_targets(values: np.ndarray, source: str = "labels") -> Tuple[np.ndarray, List[str]]:
    """(class ids [M], class names sorted) of a label column's values [M]. Raises ConfigError when a
    held-out split is impossible."""
    counts = Counter(values)
    if len(counts) < 2 or min(counts.values()) < 2:
        raise ConfigError(
            f"labels: {source} gives {dict(counts)} usable volumes per class; a held-out split"
            " needs two classes with at least 2 volumes each (20 or more for a useful interval)."
        )
    names = sorted(counts)
    return np.array([names.index(v) for v in values]), names
