"""The files of a source and its scan index: find the candidate files of a source, scan them into
index records (one per volume or rejected file, with its reason) and keep an index up to date.
`python data.py scan SRC` is this module's command. Which files make a volume, and why the others
cannot be used, is decided by index.units, the rule that read_volume follows too, so a scan and
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
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from tqdm import tqdm

from config import Config, ConfigError
from dicom import (
    BENIGN_REASONS,
    MIN_SHAPE,
    OPT_SOP,
    REASONS,
    TRANSIENT_REASONS,
    Frame,
    Header,
    UnusableFile,
    check_pixel_spacing,
    folder_files,
    inspect_file,
    is_candidate,
    read_file,
)
from privacy import KEY_PREFIX, check_index_key, is_keyed, key_fingerprint, site_secret
from storage import exists, gcs_filesystem, read_bytes, write_atomic

# --------------------------------------------------------------------------------------------------
# Which files make a volume, and reading one: `units` (volumes, or files rejected together with a
# reason) is the one rule that the scan above and read_volume both follow; dicom.py reads each file.
#
# The rule: copies are set aside, a multi-frame file or the single-frame files of one series form a
# unit, a broken file rejects its series, and a unit is a volume only if it is one stack of
# parallel, evenly spaced B-scans (_layout; a gap of 1.5 spacings is a missing B-scan). The B-scan
# spacing comes from the frame positions when they exist.
#
# One file per B-scan (e.g. Optovue): the files of a series are ordered by ImagePositionPatient,
# else InStackPositionNumber, DimensionIndexValues or InstanceNumber (_layout); without
# ImageOrientationPatient the stack runs the way InStackPositionNumber or InstanceNumber increases,
# whatever order the files are listed in (_stack_direction); a copied file (same SOPInstanceUID and
# voxels) is `duplicate_instance` and the original is used (units). An SLO or fundus image exported
# into the series folder is another object, set aside.
# --------------------------------------------------------------------------------------------------


SPACING_RANGE_MM = (1e-4, 5.0)  # plausible OCT voxel sizes; a value outside is garbled
# SliceThickness further than this share from the positions' gap is reported
SPACING_TOLERANCE = 0.1
# B-scan gaps within this share of their median are even; 1.5x or more is a missing B-scan
GAP_TOLERANCE = 0.2
ORIENTATION_TOLERANCE = 1e-3  # direction cosines closer than this are the same orientation


@dataclass
class Volume:
    """One OCT volume as stored: voxels [D,H,W] = frames, rows, columns in stack order."""

    # native dtype (uint8/uint16/int16), float32 when RescaleSlope/Intercept apply
    voxels: np.ndarray
    spacing: Optional[Tuple[float, float, float]]  # (dz, dy, dx) mm; None when missing or garbled
    manufacturer: str
    model: str
    source: str  # path or URL (the first file of a series)
    # why spacing is None, or how the spacing tags disagree with positions
    spacing_issue: Optional[str] = None
    patient: str = ""  # see dicom._patient_key: the unit of patient-level splits
    study: str = ""  # StudyInstanceUID
    series: str = ""  # SeriesInstanceUID, else the path
    laterality: str = ""  # R or L (ImageLaterality, else Laterality); '' when neither is there


@dataclass
class Unit:
    """One verdict of `units`: a volume (error None) or files rejected together with one reason."""

    paths: List[str]  # a volume's files in stack order, a rejected unit's in path order
    error: Optional[UnusableFile] = None
    header: Optional[Header] = None  # a volume's first file
    # a volume's B-scans in stack order: (path, frame)
    frames: List[Tuple[str, int]] = field(default_factory=list)
    spacing: Optional[Tuple[float, float, float]] = None  # (dz, dy, dx) mm
    note: Optional[str] = None  # Volume.spacing_issue
    shape: Optional[List[int]] = None  # [D,H,W]


def units(results: Dict[str, Union[Header, UnusableFile]]) -> List[Unit]:
    """What a set of files is, given each file's Header or the UnusableFile that reading it raised:
    volumes and rejected files, every file in exactly one Unit, sorted by first path, whatever order
    the files came in. scan_files and read_volume both decide by it, so they cannot disagree. The
    rule, in order:
    1. A file that cannot be read is rejected with its reason.
    2. Of the files with one SOPInstanceUID the first (by path) is used, and the others are copies
       (duplicate_instance) when their voxels are the same; when they differ, a broken anonymizer
       gave one UID to different images (shared_instance_uid rejects their units).
    3. A multi-frame file is a unit; single-frame files form one unit per (SeriesInstanceUID, SOP
       class), so an SLO image of the series is not one of its B-scans.
    4. A file rejected for a reason not in BENIGN_REASONS whose series has single-frame files
       rejects that series' unit with its reason and joins it (the first by path gives the reason):
       a stack is never used without one of its files.
    5. A unit is a volume when _layout makes one stack of parallel, evenly spaced B-scans of one
       size and pixel spacing of it; fewer than 4 B-scans of an OCT object are a line scan
       (line_scan, not a bad file).
    """
    ordered = sorted(results.items())
    failed = {path: r for path, r in ordered if isinstance(r, UnusableFile)}
    headers, copies, shared = _instances([r for _, r in ordered if isinstance(r, Header)])
    found = [
        Unit(
            [copy.path],
            _error(
                copy, "duplicate_instance", f"same SOPInstanceUID and voxels as {original.path}"
            ),
        )
        for copy, original in copies
    ]
    groups, broken = {}, {}  # unit key -> headers; unit key -> paths of the series' rejected files
    for h in headers:
        groups.setdefault((h.path,) if h.frames > 1 else (h.series, h.sop_class), []).append(h)
    for path, e in failed.items():
        if e.reason not in BENIGN_REASONS and (e.series, e.sop_class) in groups:
            broken.setdefault((e.series, e.sop_class), []).append(path)
        else:
            found.append(Unit([path], e))
    for key, members in groups.items():
        paths, bad = sorted(h.path for h in members), broken.get(key, [])
        sharing = [h for h in members if h.path in shared]
        if sharing:
            found.append(
                Unit(
                    sorted(paths + bad),
                    _error(
                        sharing[0],
                        "shared_instance_uid",
                        f"{len(sharing)} files have SOPInstanceUID {sharing[0].sop_uid} with other"
                        " voxels than other files",
                    ),
                )
            )
        elif bad:
            first = failed[bad[0]]
            more = f" and {len(bad) - 1} more of its files" if len(bad) > 1 else ""
            found.append(
                Unit(
                    sorted(paths + bad),
                    UnusableFile(
                        first.reason,
                        f"{bad[0]}{more} of this series: {first.detail}",
                        first.manufacturer,
                        first.model,
                        first.series,
                        first.sop_class,
                    ),
                )
            )
        else:
            found.append(_assess(members))
    return sorted(found, key=lambda u: u.paths[0])


def _error(h: Header, reason: str, detail: str) -> UnusableFile:
    return UnusableFile(reason, detail, h.manufacturer, h.model, h.series, h.sop_class)


def _instances(headers: Sequence[Header]) -> Tuple[List[Header], List[Tuple[Header, Header]], set]:
    """(headers without copies, [(copy, original)], paths of the files whose SOPInstanceUID other
    files with other voxels have), in the order given: the first file of a SOPInstanceUID is the
    original."""
    by_uid = {}
    for h in headers:
        by_uid.setdefault(h.sop_uid or h.path, []).append(h)
    kept, copies, shared = [], [], set()
    for same in by_uid.values():
        if len({h.digest for h in same}) > 1:
            kept += same
            shared |= {h.path for h in same}
        else:
            kept.append(same[0])
            copies += [(copy, same[0]) for copy in same[1:]]
    return sorted(kept, key=lambda h: h.path), copies, shared


def _assess(headers: Sequence[Header]) -> Unit:
    """A volume of one multi-frame file or the single-frame files of one series, or their rejection
    (_layout)."""
    first = headers[0]
    try:
        pairs, spacing, note, shape = _layout(headers)
    except UnusableFile as e:
        return Unit(sorted(h.path for h in headers), _error(first, e.reason, e.detail))
    except Exception as e:  # a combination of tags that the checks did not name
        return Unit(
            sorted(h.path for h in headers), _error(first, "bad_header", f"{type(e).__name__}: {e}")
        )
    frames = [(headers[i].path, k) for i, k in pairs]
    return Unit(
        list(dict.fromkeys(path for path, _ in frames)),
        None,
        headers[pairs[0][0]],
        frames,
        spacing,
        note,
        shape,
    )


def source_paths(source: Union[str, Sequence[str]]) -> List[str]:
    """The files of a read_volume source: a path or gs:// URL, the candidate files under a local
    folder (folder_files), or a list of paths."""
    if isinstance(source, str):
        return folder_files(source) if os.path.isdir(source) else [source]
    return list(source)


def read_volume(source: Union[str, Sequence[str]], sop_classes: str = "oct") -> Volume:
    """The OCT volume of a path, a gs:// URL, or a series (a list of paths or a local folder, one
    file per B-scan). The files are judged by `units`, as a scan judges them: other objects beside
    the volume (an SLO image, a report, a copy) are left out, and the files of more than one volume
    (two eyes in one folder) are `several_volumes`.

    Raises UnusableFile with a stable reason code when the input cannot be used, whatever is wrong
    with it.
    """
    results, pixels = {}, {}  # path -> Header or UnusableFile; path -> frames [F,H,W]
    for path in source_paths(source):
        try:
            results[path], pixels[path] = read_file(path, sop_classes)
        except UnusableFile as e:
            results[path] = e
    found = units(results)
    volumes = [u for u in found if u.error is None]
    if len(volumes) != 1:
        raise _why_not_one(found, volumes, source)
    volume, first = volumes[0], volumes[0].header
    voxels = np.stack([pixels[path][k] for path, k in volume.frames])  # [D,H,W]
    return Volume(
        voxels,
        volume.spacing,
        first.manufacturer,
        first.model,
        volume.paths[0],
        volume.note,
        first.patient,
        first.study,
        first.series,
        first.laterality,
    )


def _why_not_one(found: Sequence[Unit], volumes: Sequence[Unit], source) -> UnusableFile:
    """Why a read_volume source is not one volume: several, or the rejection of its largest bad unit
    (else of its largest other object)."""
    if volumes:
        first = volumes[0].header
        return UnusableFile(
            "several_volumes",
            f"{len(volumes)} volumes, the first files "
            f"{', '.join(v.paths[0] for v in volumes[:3])}: read one at a time",
            first.manufacturer,
            first.model,
        )
    if not found:
        return UnusableFile("read_error", f"no files in {source}")
    return min(
        found, key=lambda u: (u.error.reason in BENIGN_REASONS, -len(u.paths), u.paths[0])
    ).error


def _stack_direction(positions: np.ndarray, frames: Sequence[Frame]) -> np.ndarray:
    """The stack normal [3] of B-scans without ImageOrientationPatient, whatever order they were
    listed in: the main axis of their positions [F,3], pointing the way InStackPositionNumber (else
    InstanceNumber) increases along it, else towards the positive end of the patient axis (x, y or
    z) it follows most."""
    centred = positions - positions.mean(axis=0)
    axis = np.linalg.svd(centred, full_matrices=False)[2][0]  # [3] unit vector, of either sign
    along = centred @ axis  # [F]
    for numbers in ([f.in_stack for f in frames], [f.instance for f in frames]):
        if None not in numbers:
            trend = float(along @ (np.array(numbers, dtype=np.float64) - np.mean(numbers)))
            if trend != 0:
                return axis if trend > 0 else -axis
    return axis if axis[np.argmax(np.abs(axis))] > 0 else -axis


def _order_by_position(frames: Sequence[Frame]) -> Tuple[np.ndarray, float]:
    """(stack order, B-scan gap in mm) of frames that all have a position: sorted along the stack
    normal, the gaps must be even (a gap of 1.5 or more is a missing B-scan; 0 a duplicate)."""
    positions = np.stack([f.position for f in frames])  # [F,3]
    orientation = frames[0].orientation
    if orientation is not None:
        normal = np.cross(orientation[:3], orientation[3:])
    else:
        normal = _stack_direction(positions, frames)
    along = positions @ normal  # [F] mm
    order = np.argsort(along, kind="stable")
    gaps = np.diff(along[order])  # [F-1]
    gap = float(np.median(gaps))
    if gap <= 0 or (gaps < 0.01 * gap).any():
        raise UnusableFile(
            "duplicate_frames",
            f"{int((gaps < 0.01 * max(gap, 1e-9)).sum())} B-scans at the same "
            "position along the stack",
        )
    relative = gaps / gap
    if relative.max() >= 1.5:
        raise UnusableFile(
            "series_gap",
            f"a gap of {relative.max():.1f} B-scan spacings ({gaps.max():.4g} mm) after "
            f"B-scan {int(relative.argmax())} of {len(frames)}",
        )
    if np.abs(relative - 1).max() > GAP_TOLERANCE:
        raise UnusableFile(
            "not_raster", f"uneven B-scan gaps {gaps.min():.4g}..{gaps.max():.4g} mm"
        )
    return order, gap


def _order_by_number(frames: Sequence[Frame], series: bool) -> np.ndarray:
    """Stack order from InStackPositionNumber, else DimensionIndexValues, else InstanceNumber: the
    first key that every frame has, which must not repeat (and, for the numbers, not skip). Frames
    of a multi-frame file without any key keep the stored order; files of a series without any key
    cannot be ordered."""
    keys = (
        ("InStackPositionNumber", lambda f: f.in_stack),
        ("DimensionIndexValues", lambda f: f.dimension_index),
        ("InstanceNumber", lambda f: f.instance),
    )
    for name, key_of in keys:
        values = [key_of(f) for f in frames]
        if any(v is None for v in values):
            continue
        if len(set(values)) < len(values):
            raise UnusableFile(
                "duplicate_frames", f"{name} repeats: {len(values) - len(set(values))} frames"
            )
        if name != "DimensionIndexValues" and max(values) - min(values) + 1 != len(values):
            raise UnusableFile(
                "series_gap", f"{name} {min(values)}..{max(values)} for {len(values)} B-scans"
            )
        return np.array(sorted(range(len(values)), key=values.__getitem__))
    if series:
        raise UnusableFile(
            "no_stack_order",
            f"{len(frames)} files without ImagePositionPatient, "
            "InStackPositionNumber or InstanceNumber",
        )
    return np.arange(len(frames))


def _check_one_stack(frames: Sequence[Frame]) -> None:
    """All frames belong to one stack of parallel B-scans."""
    stacks = {f.stack_id for f in frames if f.stack_id is not None}
    if len(stacks) > 1:
        raise UnusableFile("multiple_stacks", f"StackID {', '.join(sorted(stacks))}")
    orientations = [f.orientation for f in frames if f.orientation is not None]
    if (
        not orientations
        or max(np.abs(o - orientations[0]).max() for o in orientations) <= ORIENTATION_TOLERANCE
    ):
        return
    groups = Counter(tuple(np.round(o, 2)) for o in orientations)
    if min(groups.values()) >= MIN_SHAPE[0]:
        raise UnusableFile(
            "multiple_stacks",
            f"{len(groups)} B-scan orientations of {', '.join(map(str, groups.values()))} frames",
        )
    raise UnusableFile(
        "not_raster",
        f"the B-scan orientation changes between frames ({len(groups)} orientations "
        f"in {len(frames)} frames: a radial or circle scan)",
    )


def _layout(
    headers: Sequence[Header],
) -> Tuple[List[Tuple[int, int]], Optional[Tuple[float, float, float]], Optional[str], List[int]]:
    """How one multi-frame file, or the single-frame files of one series, form a volume:
    ((file, frame) pairs in stack order, spacing (dz, dy, dx) mm or None, spacing note, shape
    [D,H,W]).

    Only one stack of parallel, evenly spaced B-scans of one size and pixel spacing is a volume
    (fewer than 4 B-scans of an OCT object are a line scan); raises UnusableFile otherwise.
    """
    first = headers[0]
    if len(headers) > 1 and any(
        (h.frames, h.rows, h.cols, h.bits) != (1, first.rows, first.cols, first.bits)
        for h in headers
    ):
        raise UnusableFile(
            "bad_header",
            "a series needs single-frame files of one size and bit depth: "
            f"{sorted({(h.frames, h.rows, h.cols, h.bits) for h in headers})}",
        )
    pairs = [(i, k) for i, h in enumerate(headers) for k in range(h.frames)]
    shape = [len(pairs), first.rows, first.cols]
    if any(n < m for n, m in zip(shape, MIN_SHAPE)):
        if first.sop_class == OPT_SOP and all(n >= m for n, m in zip(shape[1:], MIN_SHAPE[1:])):
            raise UnusableFile(
                "line_scan", f"{shape[0]} B-scan(s) of {shape[1]}x{shape[2]}: not a volume"
            )
        raise UnusableFile("too_small", f"shape {shape} < {list(MIN_SHAPE)}")
    if any(h.raster_flag == "NO" for h in headers):
        raise UnusableFile("not_raster", "OphthalmicVolumetricPropertiesFlag NO")
    check_pixel_spacing([h.pixel_spacing for h in headers])
    frames = [f for h in headers for f in h.geometry]
    gap = None
    if len(frames) == len(pairs):
        _check_one_stack(frames)
        if all(f.position is not None for f in frames):
            order, gap = _order_by_position(frames)
        else:
            order = _order_by_number(frames, series=len(headers) > 1)
        pairs = [pairs[i] for i in order]
    spacing, note = _spacing(first, gap)
    return pairs, spacing, note, shape


def _spacing(
    h: Header, gap: Optional[float]
) -> Tuple[Optional[Tuple[float, float, float]], Optional[str]]:
    """((dz, dy, dx) mm or None, note). PixelSpacing is [axial, lateral]; the B-scan spacing is the
    gap between the frame positions when they exist, else SpacingBetweenSlices or SliceThickness.
    The note says why the spacing is None, or that the spacing tag disagrees with the positions by
    more than SPACING_TOLERANCE."""
    if h.spacing_error:
        return None, h.spacing_error
    tag_dz = None if h.slice_spacing is None else h.slice_spacing[1]
    dz = gap if gap is not None else tag_dz
    if h.pixel_spacing is None or dz is None:
        return None, f"missing {'PixelSpacing' if h.pixel_spacing is None else 'B-scan spacing'}"
    spacing = (float(dz), *h.pixel_spacing)
    lo, hi = SPACING_RANGE_MM
    if not all(lo <= s <= hi for s in spacing):  # also false for nan
        return None, f"garbled: (dz, dy, dx) = {spacing} mm"
    if gap is not None and tag_dz is not None and abs(tag_dz - gap) > SPACING_TOLERANCE * gap:
        return (
            spacing,
            (
                f"{h.slice_spacing[0]} {tag_dz:g} mm disagrees with the B-scan positions' gap"
                f" {gap:.6g} mm (the positions are used)"
            ),
        )
    return spacing, None


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
    """Index records, one per index.units verdict (a volume: a multi-frame file or the
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
    """The index record of a units verdict."""
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


def uses_builtin_phantoms(cfg: Config) -> bool:
    """Whether a config trains on the built-in phantom set in cfg.phantom_dir: it names no data
    (data_root, manifest_path, or an index_path that exists)."""
    return (
        cfg.data_root is None
        and cfg.manifest_path is None
        and not (cfg.index_path and exists(cfg.index_path))
    )


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
