"""The files of a source and its scan index: find the candidate files of a source, scan them into
index records (one per volume or rejected file, with its reason) and keep an index up to date.
`python data.py scan SRC` is this module's command. Which files make a volume, and why the others
cannot be used, is decided by volumes.units, the rule that read_volume follows too, so a scan and
the loader cannot disagree.

Finding files: a folder (recursive), a glob, a gs:// prefix or glob, or a manifest (a TSV/CSV with a
`filepath` column); hidden files and sidecars are left out. The index (one JSON line per volume or
rejected file) records what it was built from, and update_index scans again only new and changed
files, read errors and the series a new file joins. index_records(cfg) is the index of a config's
data (the built-in phantoms without data_root), reused or brought up to date.
"""

import csv
import glob
import hashlib
import io
import json
import os
import shlex
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from config import Config, ConfigError
from dicom import REASONS, TRANSIENT_REASONS, UnusableFile, folder_files, inspect_file, is_candidate
from privacy import KEY_PREFIX, check_index_key, is_keyed, key_fingerprint, site_secret
from storage import exists, gcs_filesystem, read_bytes, write_atomic
from volumes import Unit, units

# --------------------------------------------------------------------------------------------------
# Finding files
# --------------------------------------------------------------------------------------------------


def _manifest_paths(manifest_path: str, root: Optional[str]) -> List[str]:
    """The `filepath` column of a TSV/CSV manifest; relative paths are relative to root (else the
    manifest's folder)."""
    text = read_bytes(manifest_path).decode("utf-8-sig")
    first_line = text.split("\n", 1)[0]
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t" if "\t" in first_line else ","))
    if not rows or "filepath" not in rows[0]:
        raise ConfigError(
            f"manifest_path: {manifest_path} needs a header with a `filepath` column "
            f"(found {first_line[:200]!r})."
        )
    if root is None:
        root = os.path.dirname(manifest_path) or "."
    return [
        p if p.startswith("gs://") or os.path.isabs(p) else f"{root.rstrip('/')}/{p}"
        for p in (r["filepath"].strip() for r in rows)
        if p
    ]


def scan_command(data_root: Optional[str], manifest_path: Optional[str] = None) -> str:
    """The `python data.py scan` command line that lists the same files as list_sources(data_root,
    manifest_path): a manifest's relative paths are relative to data_root, else to the manifest's
    folder."""
    if manifest_path is None:
        return f"python data.py scan {shlex.quote(data_root)}"
    root = data_root if data_root is not None else os.path.dirname(manifest_path) or "."
    return f"python data.py scan {shlex.quote(root)} --manifest_path {shlex.quote(manifest_path)}"


def list_sources(data_root: Optional[str], manifest_path: Optional[str] = None) -> Dict[str, str]:
    """{path: identity} of every candidate file of a source, sorted by path: the manifest's
    `filepath` column when given, else data_root as a folder (recursive), a glob or a single file,
    local or gs://. Hidden files and sidecars (csv, json, txt...) are left out. The identity
    (source_identity) of a gs:// folder's objects comes with the listing; gs:// paths of a manifest
    are not looked up one by one ('': a new manifest is what counts)."""
    if manifest_path is not None:
        paths = set(_manifest_paths(manifest_path, data_root))
        return {p: "" if p.startswith("gs://") else source_identity(p) for p in sorted(paths)}
    if data_root is None:
        raise ConfigError(
            "data_root: give a folder, glob or gs:// prefix of DICOM files (or a manifest_path)."
        )
    is_glob = any(c in data_root for c in "*?[")
    if data_root.startswith("gs://"):
        fs = gcs_filesystem()
        found = fs.glob(data_root, detail=True) if is_glob else fs.find(data_root, detail=True)
        listing = {
            "gs://" + name: _gcs_version(info)
            for name, info in found.items()
            if info.get("type") == "file"
        }
    elif is_glob:
        listing = {
            p: source_identity(p) for p in glob.glob(data_root, recursive=True) if os.path.isfile(p)
        }
    elif os.path.isdir(data_root):
        listing = {p: source_identity(p) for p in folder_files(data_root)}
    elif os.path.isfile(data_root):
        listing = {data_root: source_identity(data_root)}
    else:
        raise ConfigError(f"data_root: {data_root!r} is not a folder, glob or file.")
    return {p: listing[p] for p in sorted(listing) if is_candidate(p)}


def find_files(data_root: Optional[str], manifest_path: Optional[str] = None) -> List[str]:
    """Every candidate file of a source, sorted (see list_sources)."""
    return list(list_sources(data_root, manifest_path))


def _gcs_version(info: dict) -> str:
    version = (
        info.get("generation") or info.get("etag") or info.get("md5Hash") or info.get("updated")
    )
    return f"{info.get('size')}:{version}"


def source_identity(path: str) -> str:
    """What changes when a file is written again: size and mtime (local), generation or etag
    (gs://); '' if gone."""
    try:
        if path.startswith("gs://"):
            return _gcs_version(gcs_filesystem().info(path))
        stat = os.stat(path)
        return f"{stat.st_size}:{stat.st_mtime_ns}"
    except Exception:  # gone or unreadable: the scan says why
        return ""


# --------------------------------------------------------------------------------------------------
# Scanning them, and the index
# --------------------------------------------------------------------------------------------------


def scan_files(
    files: Sequence[str],
    sop_classes: str = "oct",
    progress: bool = False,
    threads: int = 8,
    identities: Optional[Dict[str, str]] = None,
) -> List[dict]:
    """Index records, one per volumes.units verdict (a volume: a multi-frame file or the
    single-frame files of one series; or files rejected together), so every file appears exactly
    once. A record has paths, sources (source_identity of each), ok, reason (None when ok), detail,
    manufacturer, model, series, shape [D,H,W], spacing [dz,dy,dx] or None, spacing_issue, patient,
    study, laterality. `identities` ({path: source_identity}, e.g. from list_sources) saves looking
    them up. The site's key file is read (or created: privacy.site_secret) before any file.
    """
    # a key file this user cannot use stops the scan here, not as every file "corrupt"
    site_secret(create=True)

    def inspect(path):
        identity = (
            identities[path]
            if identities is not None and path in identities
            else source_identity(path)
        )
        try:
            return identity, inspect_file(path, sop_classes)
        except UnusableFile as e:
            return identity, e

    with ThreadPoolExecutor(threads) as pool:  # fetching (gs://) and file reads overlap
        results = list(
            tqdm(
                pool.map(inspect, files),
                total=len(files),
                unit="file",
                desc="scan",
                disable=None if progress else True,  # None: a bar on a terminal only
            )
        )
    identities = {path: identity for path, (identity, _) in zip(files, results)}
    return [
        _record(unit, identities)
        for unit in units({path: r for path, (_, r) in zip(files, results)})
    ]


def _record(unit: Unit, identities: Dict[str, str]) -> dict:
    """The index record of a volumes.units verdict."""
    sources = [identities.get(p, "") for p in unit.paths]
    if unit.error is not None:
        e = unit.error
        return {
            "paths": unit.paths,
            "sources": sources,
            "ok": False,
            "reason": e.reason,
            "detail": e.detail,
            "manufacturer": e.manufacturer,
            "model": e.model,
            "series": e.series or None,
            "shape": None,
            "spacing": None,
        }
    h = unit.header
    return {
        "paths": unit.paths,
        "sources": sources,
        "ok": True,
        "reason": None,
        "detail": None,
        "manufacturer": h.manufacturer,
        "model": h.model,
        "series": h.series,
        "shape": unit.shape,
        "spacing": list(unit.spacing) if unit.spacing else None,
        "spacing_issue": unit.note,
        "patient": h.patient,
        "study": h.study,
        "laterality": h.laterality,
        "transfer_syntax": h.transfer_syntax,
        "bits": h.bits,
    }


def write_index(records: Sequence[dict], path: str, built_from: Optional[dict] = None) -> None:
    """JSON lines, one record each after a first line saying what the index was built from, written
    so that readers never see a partial index."""
    write_atomic(
        path, "".join(json.dumps(r) + "\n" for r in [{"built_from": built_from}, *records]).encode()
    )


def read_index_with_source(path: str) -> Tuple[Optional[dict], List[dict]]:
    """(what the index was built from, or None for an index without that line; records)."""
    lines = [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]
    if lines and "built_from" in lines[0]:
        return lines[0]["built_from"], lines[1:]
    return None, lines


def read_index(path: str) -> List[dict]:
    """The records of an index written by write_index / `python data.py scan SRC --out INDEX`. An
    index whose patient keys are not keyed (an older octjepa's: reversible, and the same at every
    site), or were keyed with another secret than the key file's (privacy.check_index_key), is a
    ConfigError saying how to scan it again (with data_root, update_index does that by itself for
    the former)."""
    built_from, records = read_index_with_source(path)
    check_index_key(built_from, path)
    if any(r["ok"] and not is_keyed(r.get("patient")) for r in records):
        raise ConfigError(
            f"index_path: {path} holds patient keys an older octjepa wrote (a plain hash of"
            " PatientID, reversible and the same at every site); give --data_root with"
            " --index_path (it is migrated) or scan the data again with this version, then delete"
            f" any table made from the old index: python data.py scan DATA_ROOT --out {path}"
        )
    return records


def _unchanged(record: dict, identities: Dict[str, str]) -> bool:
    """The record's files are all still listed, unchanged, and its verdict was not a passing
    failure."""
    sources = record.get("sources") or []
    return (
        record["reason"] not in TRANSIENT_REASONS
        and len(sources) == len(record["paths"])
        # an older index's reversible keys: again
        and (not record["ok"] or is_keyed(record.get("patient")))
        and all(p in identities and identities[p] == s for p, s in zip(record["paths"], sources))
    )


def index_source(
    data_root: Optional[str],
    manifest_path: Optional[str],
    sop_classes: str,
    identities: Dict[str, str],
) -> dict:
    """What an index is built from: the source, the sop_classes setting, a hash of the listing
    (every file's path and identity), the kind of patient keys (privacy.KEY_PREFIX) and which secret
    keyed them (privacy.key_fingerprint)."""
    listing = "\n".join(f"{p}\t{identities[p]}" for p in sorted(identities))
    return {
        "data_root": data_root,
        "manifest_path": manifest_path,
        "sop_classes": sop_classes,
        "listing": hashlib.sha256(listing.encode()).hexdigest()[:32],
        "patient_keys": KEY_PREFIX,
        "key_fingerprint": key_fingerprint(),
    }


def update_index(
    records: Sequence[dict], identities: Dict[str, str], sop_classes: str, progress: bool = False
) -> List[dict]:
    """The records of the files in `identities` ({path: source_identity}): records whose files are
    unchanged are kept; new and changed files, passing failures (read errors) and the series that a
    new file joins are scanned again."""
    keep = [r for r in records if _unchanged(r, identities)]
    known = {p for r in keep for p in r["paths"]}
    fresh = scan_files(
        [p for p in sorted(identities) if p not in known],
        sop_classes,
        progress,
        identities=identities,
    )
    joined = {r["series"] for r in fresh if r.get("series")} & {r.get("series") for r in keep}
    # a new B-scan of an indexed series, or a copy of an indexed file: its series is scanned again
    if joined:
        again = [p for r in keep + fresh if r.get("series") in joined for p in r["paths"]]
        keep = [r for r in keep if r.get("series") not in joined]
        fresh = [r for r in fresh if r.get("series") not in joined] + scan_files(
            sorted(again), sop_classes, identities=identities
        )
    return sorted(keep + fresh, key=lambda r: r["paths"][0])


def index_records(cfg: Config) -> List[dict]:
    """The index of cfg's data. With cfg.index_path: the index there is reused when it was built
    from the same data_root, manifest, sop_classes and listing; else only what is new, changed or
    failed in passing (read errors) is scanned again, and the index is rewritten; an index keyed
    with another secret is refused (privacy.check_index_key), one that records none is scanned again
    whole. With neither data_root nor manifest_path: the built-in phantom set in cfg.phantom_dir,
    which the scripts write first (phantom.ensure_builtin_phantoms), or, when index_path exists,
    that index as it is."""
    root = cfg.data_root
    if root is None and cfg.manifest_path is None:
        if cfg.index_path is not None and exists(cfg.index_path):
            return read_index(cfg.index_path)
        root = cfg.phantom_dir
        if not os.path.isdir(root):
            raise ConfigError(
                f"phantom_dir: {root} holds no phantom set; give a data_root, or write the set"
                " first (train.py and sanity.py write it when data_root is null)"
            )
    identities = list_sources(root, cfg.manifest_path)
    old_from, records = (None, [])
    if cfg.index_path is not None and exists(cfg.index_path):
        old_from, records = read_index_with_source(cfg.index_path)
    # before anything is keyed (a missing key file is created only here)
    check_index_key(old_from, cfg.index_path)
    built_from = index_source(root, cfg.manifest_path, cfg.sop_classes, identities)
    if old_from == built_from and not any(r["reason"] in TRANSIENT_REASONS for r in records):
        return records
    same_source = old_from is not None and all(
        old_from.get(k) == built_from[k]
        for k in (
            # keys of one secret only: never half
            "data_root",
            "manifest_path",
            "sop_classes",
            "key_fingerprint",
        )
    )
    records = update_index(
        records if same_source else [], identities, cfg.sop_classes, progress=True
    )
    if cfg.index_path is not None:
        write_index(records, cfg.index_path, built_from)
    return records


def format_reason_table(counts: Dict[str, int]) -> str:
    """A table of unusable files by reason: count and what the reason means."""
    width = max([len("reason"), *map(len, counts)])
    lines = [f"{'reason':<{width}}  {'files':>6}  meaning"]
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"{reason:<{width}}  {n:>6}  {REASONS.get(reason, '')}")
    return "\n".join(lines)


def reason_counts(records: Sequence[dict]) -> Dict[str, int]:
    """{reason: number of rejected records}."""
    return Counter(r["reason"] for r in records if not r["ok"])


def format_scan_report(records: Sequence[dict]) -> str:
    """Per manufacturer and model: files, accepted volumes, volumes without spacing or whose spacing
    tags disagree with their positions, rejects by reason, shape and spacing medians."""
    groups = {}
    for r in records:
        groups.setdefault((r["manufacturer"] or "(unknown)", r["model"] or ""), []).append(r)
    header = (
        f"{'manufacturer':<24} {'model':<20} {'files':>6} {'volumes':>7} {'no spacing':>10}"
        f" {'disagree':>8}  {'median shape D,H,W':<19} {'median spacing dz,dy,dx mm':<27} rejected"
    )
    lines = [header]
    for (maker, model), rs in sorted(groups.items()):
        ok = [r for r in rs if r["ok"]]
        shape = (
            ",".join(str(int(v)) for v in np.median([r["shape"] for r in ok], axis=0))
            if ok
            else "-"
        )
        spaced = [r["spacing"] for r in ok if r["spacing"]]
        disagree = sum(1 for r in ok if r["spacing"] and r.get("spacing_issue"))
        spacing = ",".join(f"{v:.4f}" for v in np.median(spaced, axis=0)) if spaced else "-"
        rejects = ", ".join(f"{k} {v}" for k, v in sorted(reason_counts(rs).items())) or "-"
        lines.append(
            f"{maker[:24]:<24} {model[:20]:<20} {sum(len(r['paths']) for r in rs):>6} {len(ok):>7} "
            f"{len(ok) - len(spaced):>10} {disagree:>8}  {shape:<19} {spacing:<27} {rejects}"
        )
    n_files = sum(len(r["paths"]) for r in records)
    n_ok = sum(r["ok"] for r in records)
    lines.append(f"\n{n_files} files: {n_ok} usable volumes, {len(records) - n_ok} rejected")
    counts = reason_counts(records)
    if counts:
        lines.append(format_reason_table(counts))
    return "\n".join(lines)
