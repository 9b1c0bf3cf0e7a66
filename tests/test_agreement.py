"""scan and read_volume decide alike: both follow index.units, the one rule for what a set of
files is (a volume, several volumes, or files rejected with a reason). First the folders they once
disagreed on, then folders drawn from seeds: mixed sizes, mixed series, two eyes, line scans, other
objects, copies, broken files, shuffled names."""

import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pydicom
import pytest

from corpora import write_photo
from dicom import BENIGN_REASONS, UnusableFile
from index import find_files, read_volume, scan_files
from phantom import STYLES, write_oct, write_phantom

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CASES = 30  # generated folders (tiny B-scans: a few seconds in all)


def read_verdict(source, sop_classes: str = "oct"):
    """read_volume's verdict: the shape [D,H,W] it read, or the reason it gave."""
    try:
        return list(read_volume(source, sop_classes).voxels.shape)
    except UnusableFile as e:
        return e.reason


def scan_verdict(record: dict):
    return record["shape"] if record["ok"] else record["reason"]


def series_into(folder: Path, name: str, seed: int) -> tuple:
    """A one-file-per-B-scan phantom series written into `folder` as name_*.dcm: (voxels, paths in
    stack order)."""
    voxels, _, paths = write_phantom(
        str(folder.parent / f"{folder.name}-{name}"),
        "optovue_series",
        shape=(12, 64, 64),
        seed=seed,
    )
    folder.mkdir(exist_ok=True)
    moved = [str(folder / f"{name}_{os.path.basename(p)}") for p in paths]
    for old, new in zip(paths, moved):
        shutil.move(old, new)
    return voxels, moved


# --- the folders scan and read_volume disagreed on ---


@pytest.mark.parametrize("sop_classes", ["oct", "any"])
def test_an_slo_image_in_a_series_folder_is_left_out_by_scan_and_read_alike(tmp_path, sop_classes):
    voxels, paths = series_into(tmp_path / "s", "bscan", seed=0)
    write_photo(
        str(tmp_path / "s" / "slo.dcm"), voxels[0], pydicom.dcmread(paths[0]).SeriesInstanceUID
    )
    records = scan_files(find_files(str(tmp_path / "s")), sop_classes)
    # `any`: a 2D image of its own, not a B-scan
    slo = "not_oct" if sop_classes == "oct" else "too_small"
    assert sorted(map(str, (scan_verdict(r) for r in records))) == sorted(
        map(str, ([12, 64, 64], slo))
    )
    np.testing.assert_array_equal(read_volume(str(tmp_path / "s"), sop_classes).voxels, voxels)


def test_a_series_with_a_b_scan_of_another_size_is_rejected_by_scan_and_read_alike(tmp_path):
    voxels, paths = series_into(tmp_path / "s", "bscan", seed=0)
    ds = pydicom.dcmread(paths[-1])  # the last B-scan, 48 columns wide
    ds.Columns, ds.PixelData = 48, np.ascontiguousarray(voxels[-1][:, :48]).tobytes()
    ds.save_as(paths[-1])
    records = scan_files(find_files(str(tmp_path / "s")))
    # not 11 B-scans, silently
    assert [(r["reason"], len(r["paths"])) for r in records] == [("bad_header", 12)]
    assert read_verdict(str(tmp_path / "s")) == "bad_header"


def test_two_eyes_in_one_folder_are_two_volumes_to_scan_and_several_to_read(tmp_path):
    # the same B-scan positions, another series
    right, _ = series_into(tmp_path / "f", "od", seed=0)
    left, _ = series_into(tmp_path / "f", "os", seed=1)
    records = scan_files(find_files(str(tmp_path / "f")))
    assert [scan_verdict(r) for r in records] == [[12, 64, 64], [12, 64, 64]]
    assert read_verdict(str(tmp_path / "f")) == "several_volumes"
    for record, voxels in zip(records, (right, left)):
        np.testing.assert_array_equal(read_volume(record["paths"]).voxels, voxels)


# --- generated folders ---


def _edit_all(paths, edit) -> None:
    for path in paths:
        ds = pydicom.dcmread(path)
        edit(ds)
        ds.save_as(path)


def _drawn_series(work: Path, name: str, rng: np.random.Generator) -> list:
    """One file per B-scan, 4-6 tiny B-scans, maybe without orientation or numbers, with a B-scan of
    another size or missing, a file cut short, an SLO image, a copy of a file, or one SOPInstanceUID
    for all its files."""
    depth = int(rng.integers(4, 7))
    voxels = rng.integers(0, 256, (depth, 32, 32), dtype=np.uint8)
    # None: no positions, InstanceNumber orders them
    spacing = None if rng.random() < 0.1 else (0.2, 0.05, 0.05)
    paths = write_oct(
        str(work / name),
        voxels,
        spacing,
        STYLES["optovue_series"],
        uid_seed=name,
        patient_id=f"P-{name}",
        laterality=str(rng.choice(["R", "L"])),
    )
    if rng.random() < 0.3:
        _edit_all(paths, lambda ds: ds.pop("ImageOrientationPatient", None))
    if rng.random() < 0.15:
        _edit_all(paths, lambda ds: ds.pop("InstanceNumber", None))
    if rng.random() < 0.15:
        _edit_all(
            paths[-1:],
            lambda ds: (
                setattr(ds, "Rows", 16) or setattr(ds, "PixelData", voxels[-1, :16].tobytes())
            ),
        )
    if rng.random() < 0.15:
        os.remove(paths.pop(depth // 2))
    if rng.random() < 0.1:
        data = Path(paths[0]).read_bytes()
        Path(paths[0]).write_bytes(data[: len(data) - 100])
    if rng.random() < 0.1:
        _edit_all(paths, lambda ds: setattr(ds, "SOPInstanceUID", f"1.2.3.{len(name)}"))
    extra = []
    if rng.random() < 0.3:
        extra.append(str(work / f"{name}_slo.dcm"))
        write_photo(
            extra[-1], voxels[0], pydicom.dcmread(paths[-1]).SeriesInstanceUID, uid_seed=name
        )
    if rng.random() < 0.2:
        extra.append(str(work / f"{name}_copy.dcm"))
        shutil.copy(paths[-1], extra[-1])
    return paths + extra


def _drawn_multi_frame(work: Path, name: str, rng: np.random.Generator) -> list:
    """One multi-frame file: 1-6 B-scans (fewer than 4: a line scan), 32 or 48 columns."""
    voxels = rng.integers(
        0, 256, (int(rng.integers(1, 7)), 32, int(rng.choice([32, 48]))), dtype=np.uint8
    )
    return write_oct(
        str(work / f"{name}.dcm"),
        voxels,
        (0.2, 0.05, 0.05),
        STYLES["heidelberg"],
        uid_seed=name,
        patient_id=f"P-{name}",
    )


def write_drawn_folder(folder: Path, seed: int) -> None:
    """What a real export folder may hold, drawn from `seed`: 0-2 series and 0-2 multi-frame files
    (sharing their B-scan positions, like two eyes), maybe a note and a photo of no series, all
    under shuffled names, some in a sub-folder."""
    rng = np.random.default_rng(seed)
    work = folder.parent / f"{folder.name}-work"
    files = []
    for j in range(int(rng.integers(0, 3))):
        files += _drawn_series(work, f"{seed}s{j}", rng)
    for j in range(int(rng.integers(0, 3))):
        files += _drawn_multi_frame(work, f"{seed}m{j}", rng)
    if rng.random() < 0.3:
        files.append(str(work / "note"))
        Path(files[-1]).write_text("exported by the clinic's PACS\n" * 20)
    if rng.random() < 0.2:
        files.append(str(work / "photo.dcm"))
        write_photo(
            files[-1],
            rng.integers(0, 256, (64, 64), dtype=np.uint8),
            f"2.25.{seed}",
            uid_seed=str(seed),
        )
    for path, name in zip(files, rng.permutation(len(files))):
        target = folder / ("sub" if rng.random() < 0.3 else "") / f"{name:04x}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)


@pytest.mark.slow
def test_scan_and_read_volume_agree_on_every_drawn_folder(tmp_path):
    seen = Counter()
    for seed in range(CASES):
        folder = tmp_path / f"case{seed}"
        folder.mkdir()
        write_drawn_folder(folder, seed)
        sop_classes = "any" if seed % 4 == 3 else "oct"
        files = find_files(str(folder))
        records = scan_files(files, sop_classes)
        # every file exactly once
        assert sorted(p for r in records for p in r["paths"]) == files, seed
        shuffled = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
        # the listing order changes nothing
        assert scan_files(shuffled, sop_classes) == records, seed
        for record in records:
            seen[record["reason"]] += 1
            if record["reason"] == "duplicate_instance":
                continue  # a copy alone is no copy: its verdict needs the original beside it
            assert read_verdict(record["paths"], sop_classes) == scan_verdict(record), (
                seed,
                record,
            )
            if record["ok"]:
                reversed_order = read_volume(record["paths"][::-1], sop_classes).voxels
                np.testing.assert_array_equal(
                    reversed_order, read_volume(record["paths"], sop_classes).voxels
                )
        volumes = [scan_verdict(r) for r in records if r["ok"]]
        folder_verdict = read_verdict(str(folder), sop_classes)
        if len(volumes) > 1:
            assert folder_verdict == "several_volumes", seed
        elif volumes:
            assert folder_verdict == volumes[0], seed
        elif records:
            bad = {r["reason"] for r in records if r["reason"] not in BENIGN_REASONS}
            assert folder_verdict in (bad or {r["reason"] for r in records}), seed
        seen[f"folder of {min(len(volumes), 2)} volumes"] += 1
    # the draws reach the cases the rule is about
    for wanted in (
        None,
        "line_scan",
        "not_oct",
        "duplicate_instance",
        "series_gap",
        "bad_header",
        "truncated",
        "shared_instance_uid",
        "not_dicom",
        "folder of 0 volumes",
        "folder of 1 volumes",
        "folder of 2 volumes",
    ):
        assert seen[wanted] > 0, (wanted, seen)
