"""The reader (dicom.py) and data.py on the shapes real OCT exports take: Zeiss Cirrus, non-raster
scans, broken series, garbled headers, per-frame functional groups, line scans, damaged files, stale
indexes and caches; whatever a scan accepts is read without an exception."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from collections import Counter

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.datadict import dictionary_VR
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.tag import Tag
from pydicom.uid import JPEGBaseline8Bit

from config import load_config
from corpora import patch_bytes, write_odd_cases
from data import (
    OCTDataset,
    build_datasets,
    cache_path,
    crop_starts,
    load_prepared,
    main as data_main,
    resample_and_clip,
    to_sample,
)
from dicom import REASONS, UnusableFile, unscramble_czm
from index import find_files, index_records, read_index, read_volume, scan_files
from phantom import (
    STYLES,
    czm_scramble,
    item_of,
    jp2_file,
    quantize,
    synth_reflectivity,
    write_oct,
    write_phantom,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings(
    "ignore:End of file reached before delimiter", "ignore::UserWarning"
)


def config(**overrides):
    return load_config(
        [], **{"image_size": [8, 32, 32], "patch_size": [4, 8, 8], "workers": 0, **overrides}
    )


def top_name(record, root):
    return Path(os.path.relpath(record["paths"][0], root)).parts[0]


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    return root, write_odd_cases(str(root))


@pytest.fixture(scope="module")
def odd_records(odd_dir):
    root, _ = odd_dir
    records = sorted(
        scan_files(find_files(str(root))), key=lambda r: r["reason"] != "duplicate_instance"
    )
    # a series folder: its volume, not the copy in it
    return {top_name(r, root): r for r in records}


# --- each odd case gets its reason, from scan and from read alike (findings 1-7, 12) ---


@pytest.mark.parametrize(
    "name",
    [
        "two_stacks.dcm",
        "radial.dcm",
        "duplicate_frames.dcm",
        "missing_bscan.dcm",
        "uneven_gaps.dcm",
        "volumetric_flag_no.dcm",
        "slice_thickness_zero.dcm",
        "slice_thickness_disagrees.dcm",
        "number_of_frames_garbled.dcm",
        "orientation_garbled.dcm",
        "rescale_garbled.dcm",
        "jpeg_truncated_frame.dcm",
        "trailing_bytes.dcm",
        "zeiss_cirrus_czm.dcm",
        "series_with_copy",
        "series_missing_bscan",
        "series_without_order",
    ],
)
def test_each_odd_export_gets_the_same_verdict_from_scan_and_from_read(odd_dir, odd_records, name):
    root, expected = odd_dir
    record = odd_records[name]
    assert record["reason"] == expected[name], record
    if expected[name] is None:
        volume = read_volume(record["paths"])
        assert list(volume.voxels.shape) == record["shape"]
        assert to_sample(
            resample_and_clip(volume, config()), config(), np.random.default_rng(0), True
        ).shape == (1, 8, 32, 32)
    else:
        assert expected[name] in REASONS
        with pytest.raises(UnusableFile) as error:
            read_volume(record["paths"])
        assert error.value.reason == expected[name]


def test_two_stacks_without_in_stack_numbers_do_not_crash_the_loader(odd_dir):
    root, _ = odd_dir
    records = scan_files([str(root / "two_stacks.dcm")])
    dataset = OCTDataset(
        [{**records[0], "ok": True}] + scan_files([str(root / "trailing_bytes.dcm")]),
        config(),
        train=True,
    )
    sample = dataset[(0, 0)]  # the two-stack file is replaced, never a TypeError
    assert sample["skipped"][0][1] == "multiple_stacks"


def test_a_copied_b_scan_file_is_listed_once_and_the_volume_keeps_its_count(odd_records, odd_dir):
    root, _ = odd_dir
    records = scan_files(find_files(str(root / "series_with_copy")))
    volume = [r for r in records if r["ok"]]
    assert len(volume) == 1 and volume[0]["shape"][0] == 12
    copies = [r for r in records if not r["ok"]]
    assert [r["reason"] for r in copies] == ["duplicate_instance"]
    assert sum(len(r["paths"]) for r in records) == 13  # every file appears exactly once


def test_a_bad_member_file_marks_its_series_bad(tmp_path):
    paths = write_oct(
        str(tmp_path / "s"),
        quantize(synth_reflectivity((8, 64, 64), np.random.default_rng(2)), 8),
        (0.1, 0.03, 0.09),
        STYLES["optovue_series"],
    )
    ds = pydicom.dcmread(paths[3])
    ds.BitsAllocated = 12
    ds.save_as(paths[3])
    records = scan_files(find_files(str(tmp_path / "s")))
    assert not any(r["ok"] for r in records)
    assert {r["reason"] for r in records} == {"bad_header"}


def test_garbled_number_of_frames_does_not_stop_the_scan_of_the_others(odd_dir, tmp_path):
    root, _ = odd_dir
    records = scan_files(
        [str(root / "number_of_frames_garbled.dcm"), str(root / "trailing_bytes.dcm")]
    )
    assert [r["reason"] for r in records] == ["bad_header", None]


# --- Zeiss Cirrus (finding 6) ---


def test_czm_unscrambler_inverts_the_scrambling_of_real_cirrus_exports():
    jp2 = jp2_file(quantize(synth_reflectivity((1, 64, 64), np.random.default_rng(3)), 8)[0])
    scrambled = czm_scramble(jp2)
    assert scrambled != jp2 and len(scrambled) == len(jp2)
    assert unscramble_czm(scrambled) == jp2


@pytest.mark.parametrize("bits", [8, 16])
def test_zeiss_cirrus_volume_reads_back_the_written_voxels_and_garbled_spacing(tmp_path, bits):
    voxels, spacing, paths = write_phantom(
        str(tmp_path / "z.dcm"), "zeiss_cirrus", shape=(12, 64, 64), bits=bits
    )
    raw = (
        pydicom.dcmread(paths[0])
        .PerFrameFunctionalGroupsSequence[0]
        .PixelMeasuresSequence[0]["PixelSpacing"]
    )
    assert "," in str(raw.value)  # written the Cirrus way
    volume = read_volume(paths[0])
    np.testing.assert_array_equal(volume.voxels, voxels)
    assert volume.spacing == pytest.approx(spacing)
    assert scan_files(paths)[0]["ok"]


# --- spacing (finding 7) ---


def test_b_scan_spacing_comes_from_positions_and_a_disagreeing_slice_thickness_is_reported(
    odd_records,
):
    for name in ("slice_thickness_zero.dcm", "slice_thickness_disagrees.dcm"):
        record = odd_records[name]
        dz = record["spacing"][0]
        assert dz == pytest.approx(5.8 / 12, rel=1e-4), name  # the positions' gap
    assert "SliceThickness" in odd_records["slice_thickness_disagrees.dcm"]["spacing_issue"]


# --- index provenance (finding 8) ---


def test_new_files_under_a_reused_index_are_scanned(tmp_path):
    root = tmp_path / "data"
    write_phantom(str(root / "a.dcm"), "heidelberg", shape=(8, 64, 64))
    cfg = config(data_root=str(root), index_path=str(tmp_path / "index.jsonl"))
    assert len([r for r in index_records(cfg) if r["ok"]]) == 1
    write_phantom(str(root / "b.dcm"), "heidelberg", shape=(8, 64, 64), seed=1)
    assert len([r for r in index_records(cfg) if r["ok"]]) == 2
    assert len(read_index(cfg.index_path)) == 2


def test_a_passing_failure_in_a_reused_index_is_checked_again(tmp_path):
    root = tmp_path / "data"
    write_phantom(str(root / "a.dcm"), "heidelberg", shape=(8, 64, 64))
    cfg = config(data_root=str(root), index_path=str(tmp_path / "index.jsonl"))
    index_records(cfg)
    header, line = Path(cfg.index_path).read_text().splitlines()
    record = {
        **json.loads(line),
        "ok": False,
        "reason": "read_error",
        "detail": "503 from the bucket",
    }
    Path(cfg.index_path).write_text(f"{header}\n{json.dumps(record)}\n")
    assert index_records(cfg)[0]["ok"]


def test_an_index_of_other_settings_is_not_reused(tmp_path):
    root = tmp_path / "data"
    write_phantom(str(root / "a.dcm"), "heidelberg", shape=(8, 64, 64))
    write_oct(
        str(root / "sc.dcm"),
        quantize(synth_reflectivity((8, 64, 64), np.random.default_rng(1)), 8),
        (0.1, 0.03, 0.09),
        STYLES["heidelberg"],
        sop_class="1.2.840.10008.5.1.4.1.1.7.2",
        uid_seed="sc",
    )
    cfg = config(data_root=str(root), index_path=str(tmp_path / "index.jsonl"))
    assert sum(r["ok"] for r in index_records(cfg)) == 1
    assert sum(r["ok"] for r in index_records(replace(cfg, sop_classes="any"))) == 2


# --- folder walk (finding 9) ---


def test_the_folder_walk_follows_symlinked_sub_folders_like_the_glob(tmp_path):
    write_phantom(str(tmp_path / "elsewhere" / "a.dcm"), "heidelberg", shape=(8, 64, 64))
    (tmp_path / "root").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "linked")
    os.symlink(tmp_path / "root", tmp_path / "root" / "loop")  # a cycle is walked once
    walked = find_files(str(tmp_path / "root"))
    assert [os.path.basename(p) for p in walked] == ["a.dcm"]
    assert [os.path.basename(p) for p in find_files(str(tmp_path / "root" / "*" / "*.dcm"))] == [
        "a.dcm"
    ]


# --- cache (findings 2, 10) ---


def test_a_re_exported_file_at_the_same_path_is_not_served_from_the_cache(tmp_path):
    path = str(tmp_path / "v.dcm")
    write_phantom(path, "heidelberg", shape=(8, 64, 64), seed=0)
    cfg = config(cache_dir=str(tmp_path / "cache"))
    first = np.array(load_prepared([path], cfg))
    write_phantom(path, "heidelberg", shape=(8, 64, 64), seed=5)
    assert not np.array_equal(np.array(load_prepared([path], cfg)), first)


def test_an_8_bit_source_is_cached_as_8_bit(tmp_path):
    path = str(tmp_path / "v.dcm")
    write_phantom(path, "topcon_triton", shape=(8, 64, 64))
    cfg = config(cache_dir=str(tmp_path / "cache"))
    load_prepared([path], cfg)
    assert np.load(cache_path(cfg, [path])).dtype == np.uint8


def test_a_full_disk_while_caching_serves_the_volume_uncached_and_leaves_no_tmp_file(tmp_path):
    path = str(tmp_path / "v.dcm")
    write_phantom(path, "heidelberg", shape=(8, 64, 64))
    cache = tmp_path / "cache"
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(REPO)!r})
from config import load_config
from data import OCTDataset
from index import scan_files
cfg = load_config([], image_size=[8, 32, 32], patch_size=[4, 8, 8], workers=0, cache_dir={str(cache)!r})
dataset = OCTDataset(scan_files([{path!r}]), cfg, train=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # a full disk
for epoch in range(3):
    assert dataset[(epoch, 0)]["volume"].shape == (1, 8, 32, 32)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("not cached") == 1  # reported once
    assert os.listdir(cache) == []  # no tmp file left behind


# --- preprocessing (findings 11, 12) ---


def test_the_axial_crop_is_centred_on_the_retina():
    prepared = np.zeros((8, 128, 32), np.uint16)
    prepared[:, 90:100] = 60000  # the retina sits low in a tall scan
    starts = crop_starts(prepared, (8, 32, 32), None, train=False)
    assert starts[1] <= 95 - 16 + 1 and starts[1] + 32 >= 100
    for seed in range(20):
        start = crop_starts(prepared, (8, 32, 32), np.random.default_rng(seed), train=True)[1]
        assert start <= 90 and start + 32 >= 100  # jitter never cuts the retina out


def test_a_bright_low_contrast_crop_is_normalized_to_unit_std():
    prepared = (
        np.random.default_rng(0).normal(60100, 58, (8, 32, 32)).clip(0, 65535).astype(np.uint16)
    )
    x = to_sample(prepared, config(intensity_jitter=0.0), None, train=False)
    assert float(x.mean()) == pytest.approx(0, abs=1e-3) and float(x.std()) == pytest.approx(
        1, abs=1e-3
    )


# --- the command line (acceptance) ---


def test_scan_cli_on_phantoms_and_odd_cases_lists_every_reason_and_exits_0(
    phantom_dir, odd_dir, tmp_path, capsys
):
    root, expected = odd_dir
    shutil.copytree(phantom_dir, tmp_path / "all" / "phantoms")
    shutil.copytree(root, tmp_path / "all" / "odd")
    assert data_main(["scan", str(tmp_path / "all")]) == 0
    # the per-reason table after the maker table
    table = capsys.readouterr().out.split("reason ", 1)[1]
    counts = {line.split()[0]: int(line.split()[1]) for line in table.splitlines()[1:]}
    wanted = Counter(r for r in expected.values() if r)
    # each odd case under its own reason, nothing else
    assert counts == {**wanted, "duplicate_instance": 1}


# --- the contract: whatever scan accepts is read; whatever it rejects, read rejects for the same
# reason ---


def _set_raw(place, keyword, text: bytes):
    """Write a string tag's bytes as they are, garbage included (pydicom would refuse to convert
    them)."""
    tag = Tag(keyword)
    text += b" " * (len(text) % 2)
    place[tag] = RawDataElement(tag, dictionary_VR(tag), len(text), text, 0, False, True)


def _tilted() -> Dataset:
    item = Dataset()
    item.ImageOrientationPatient = [0.9, 0.43589, 0, 0, 0, -1]
    return item


def _header_mutations():
    """(name, edit(dataset)) pairs: garbage values, dropped tags, duplicated and moved frames."""
    shared = lambda ds: ds.SharedFunctionalGroupsSequence[0]  # noqa: E731
    frame = lambda ds, k: ds.PerFrameFunctionalGroupsSequence[k]  # noqa: E731
    garbage = [
        ("frames_x1", lambda ds: _set_raw(ds, "NumberOfFrames", b"x1")),
        ("frames_0", lambda ds: _set_raw(ds, "NumberOfFrames", b"0")),
        ("frames_nul", lambda ds: _set_raw(ds, "NumberOfFrames", b"8\x00")),
        (
            "orientation_2_values",
            lambda ds: _set_raw(
                shared(ds).PlaneOrientationSequence[0], "ImageOrientationPatient", b"1\\0"
            ),
        ),
        (
            "orientation_zero",
            lambda ds: _set_raw(
                shared(ds).PlaneOrientationSequence[0],
                "ImageOrientationPatient",
                b"0\\0\\0\\0\\0\\0",
            ),
        ),
        (
            "spacing_nan",
            lambda ds: _set_raw(shared(ds).PixelMeasuresSequence[0], "PixelSpacing", b"nan\\1"),
        ),
        (
            "thickness_negative",
            lambda ds: _set_raw(shared(ds).PixelMeasuresSequence[0], "SliceThickness", b"-1"),
        ),
        (
            "position_2_values",
            lambda ds: _set_raw(
                frame(ds, 0).PlanePositionSequence[0], "ImagePositionPatient", b"1\\2"
            ),
        ),
        (
            "position_text",
            lambda ds: _set_raw(
                frame(ds, 3).PlanePositionSequence[0], "ImagePositionPatient", b"a\\b\\c"
            ),
        ),
        ("slope_zero", lambda ds: _set_raw(ds, "RescaleSlope", b"0")),
        ("slope_text", lambda ds: _set_raw(ds, "RescaleSlope", b"abc")),
        ("rows_0", lambda ds: setattr(ds, "Rows", 0)),
        ("columns_odd", lambda ds: setattr(ds, "Columns", 63)),
        ("bits_12", lambda ds: setattr(ds, "BitsAllocated", 12)),
        ("samples_3", lambda ds: setattr(ds, "SamplesPerPixel", 3)),
        (
            "in_stack_repeats",
            lambda ds: setattr(frame(ds, 2).FrameContentSequence[0], "InStackPositionNumber", 1),
        ),
        ("volumetric_no", lambda ds: setattr(ds, "OphthalmicVolumetricPropertiesFlag", "NO")),
    ]
    dropped = [
        (f"no_{name}", lambda ds, name=name: delattr(ds, name))
        for name in (
            "NumberOfFrames",
            "Rows",
            "SOPClassUID",
            "Manufacturer",
            "PhotometricInterpretation",
            "SharedFunctionalGroupsSequence",
            "PerFrameFunctionalGroupsSequence",
        )
    ]
    dropped += [
        ("no_position_of_frame_3", lambda ds: delattr(frame(ds, 3), "PlanePositionSequence")),
        ("no_frame_content_2", lambda ds: delattr(frame(ds, 2), "FrameContentSequence")),
        (
            "no_pixel_spacing",
            lambda ds: delattr(shared(ds).PixelMeasuresSequence[0], "PixelSpacing"),
        ),
    ]
    moved = [
        (
            "frame_2_at_3",
            lambda ds: setattr(
                frame(ds, 2), "PlanePositionSequence", frame(ds, 3).PlanePositionSequence
            ),
        ),
        (
            "frame_0_far_away",
            lambda ds: setattr(
                frame(ds, 0).PlanePositionSequence[0], "ImagePositionPatient", [0.0, 40.0, 0.0]
            ),
        ),
        (
            "frame_1_tilted",
            lambda ds: setattr(
                frame(ds, 1), "PlaneOrientationSequence", DicomSequence([_tilted()])
            ),
        ),
    ]
    return garbage + dropped + moved


def _mutants(directory: Path):
    """Valid files of several encodings, then each of them truncated and edited in many ways."""
    voxels = quantize(synth_reflectivity((8, 64, 64), np.random.default_rng(4)), 8)
    bases = {}
    for name, style, syntax in (
        ("native", "heidelberg", None),
        ("czm", "zeiss_cirrus", None),
        ("j2k", "topcon_triton", None),
        ("jpeg", "heidelberg", JPEGBaseline8Bit),
    ):
        path = directory / f"{name}.dcm"
        write_oct(
            str(path),
            voxels,
            (0.1, 0.03, 0.09),
            STYLES[style],
            uid_seed=name,
            transfer_syntax=syntax,
        )
        bases[name] = path
    mutants = list(bases.values())
    for name, path in bases.items():
        data = path.read_bytes()
        for cut in (200, len(data) // 3, len(data) // 2, len(data) - 300, len(data) - 3):
            mutants.append(directory / f"{name}_cut_{cut}.dcm")
            mutants[-1].write_bytes(data[:cut])
        for edit_name, edit in _header_mutations():
            ds = pydicom.dcmread(path)
            try:
                edit(ds)
            except (AttributeError, IndexError, KeyError):  # this base file has no such tag
                continue
            mutants.append(directory / f"{name}_{edit_name}.dcm")
            ds.save_as(mutants[-1])
    return mutants


def test_whatever_scan_accepts_is_read_by_read_volume_the_loader_and_prepare(tmp_path):
    cfg = config(cache_dir=str(tmp_path / "cache"))
    mutants = _mutants(tmp_path)
    # never raises, whatever the files hold
    records = [r for p in mutants for r in scan_files([str(p)])]
    assert len(records) == len(mutants)  # each on its own: they share their SOPInstanceUID
    verdicts = Counter()
    for record in records:
        verdicts[record["reason"]] += 1
        if record["ok"]:
            volume = read_volume(record["paths"])
            assert list(volume.voxels.shape) == record["shape"]
            prepared = load_prepared(record["paths"], cfg, record["sources"])
            assert to_sample(prepared, cfg, np.random.default_rng(0), True).shape == (1, 8, 32, 32)
        else:
            assert record["reason"] in REASONS, record
            with pytest.raises(UnusableFile) as error:
                read_volume(record["paths"])
            assert error.value.reason == record["reason"], record["paths"]
    # the valid files pass; many reasons are named
    assert verdicts[None] >= 4 and len(verdicts) >= 6, verdicts
    dataset = OCTDataset([{**r, "ok": True, "patient": "p"} for r in records], cfg, train=True)
    for index in range(0, len(dataset), 7):  # the loader replaces rejected files, never raises
        assert dataset[(0, index)]["volume"].shape == (1, 8, 32, 32)


def test_the_data_page_lists_every_reason_with_its_meaning():
    page = (REPO / "docs" / "data.md").read_text()
    for reason, meaning in REASONS.items():
        assert f"| `{reason}` | {meaning}" in page, reason


# --- stack order, per-frame groups, line scans, damaged files ---


@pytest.mark.parametrize("keys", ["InstanceNumber", "none"])
def test_a_series_without_orientation_reads_the_same_whatever_order_its_files_are_listed_in(
    tmp_path, keys
):
    voxels, spacing, paths = write_phantom(str(tmp_path / "s"), "optovue_series", shape=(8, 64, 64))
    for path in paths:  # paths: in stack order; positions and InstanceNumber both ascend
        ds = pydicom.dcmread(path)
        del ds.ImageOrientationPatient
        if keys == "none":  # then the stack runs towards +y, the patient axis the positions follow
            del ds.InstanceNumber
        ds.save_as(path)
    for listing in (paths, paths[::-1], sorted(paths), sorted(paths, reverse=True)):
        volume = read_volume(listing)
        # never mirrored: a left eye stays a left eye
        np.testing.assert_array_equal(volume.voxels, voxels)
        assert volume.spacing == pytest.approx(spacing)
        assert scan_files(listing)[0]["paths"] == paths


def _per_frame(path, group, values):
    """Give frame k of a multi-frame file its own functional group `group` with the tags of
    values[k]."""
    ds = pydicom.dcmread(path)
    for item, tags in zip(ds.PerFrameFunctionalGroupsSequence, values):
        setattr(item, group, DicomSequence([item_of(**tags)]))
    ds.save_as(path)


def test_each_frame_gets_the_rescale_of_its_own_functional_group(tmp_path):
    voxels = quantize(synth_reflectivity((8, 64, 64), np.random.default_rng(6)), 16)
    path = str(tmp_path / "v.dcm")
    write_oct(path, voxels, (0.1, 0.004, 0.012), STYLES["heidelberg"])
    # a float-to-integer converter's
    slope, intercept = 0.5 + 0.25 * np.arange(8), -100.0 + 10 * np.arange(8)
    _per_frame(
        path,
        "PixelValueTransformationSequence",
        [
            {"RescaleSlope": s, "RescaleIntercept": i, "RescaleType": "US"}
            for s, i in zip(slope, intercept)
        ],
    )
    got = read_volume(path).voxels
    np.testing.assert_array_equal(got, voxels * slope[:, None, None] + intercept[:, None, None])


def test_each_frames_own_pixel_spacing_is_read_and_must_agree(tmp_path):
    voxels = quantize(synth_reflectivity((8, 64, 64), np.random.default_rng(7)), 8)
    path = str(tmp_path / "v.dcm")
    write_oct(
        path, voxels, (0.1, 0.004, 0.012), replace(STYLES["heidelberg"], spacing_tags="per_frame")
    )
    # from the frames' own groups
    assert read_volume(path).spacing == pytest.approx((0.1, 0.004, 0.012))
    _per_frame(
        path,
        "PixelMeasuresSequence",
        [{"PixelSpacing": [0.004, 0.012 if k != 5 else 0.024]} for k in range(8)],
    )
    # one B-scan twice as wide: not one volume
    assert scan_files([path])[0]["reason"] == "not_raster"
    with pytest.raises(UnusableFile) as error:
        read_volume(path)
    assert error.value.reason == "not_raster" and "PixelSpacing" in error.value.detail


def test_line_scans_are_listed_but_do_not_count_against_max_bad_fraction(tmp_path):
    rng = np.random.default_rng(8)
    for k in range(4):
        write_phantom(
            str(tmp_path / "data" / f"v{k}.dcm"),
            "heidelberg",
            shape=(8, 64, 64),
            seed=k,
            patient_id=f"P{k}",
        )
    for k in range(2):  # a single B-scan, and a cross of two
        write_oct(
            str(tmp_path / "data" / f"line{k}.dcm"),
            quantize(synth_reflectivity((k + 1, 64, 64), rng), 8),
            (0.1, 0.004, 0.012),
            STYLES["heidelberg"],
            uid_seed=f"line{k}",
            patient_id=f"L{k}",
        )
    records = scan_files(find_files(str(tmp_path / "data")))
    assert Counter(r["reason"] for r in records) == {None: 4, "line_scan": 2}
    # no exit 3
    train, val = build_datasets(config(data_root=str(tmp_path / "data"), max_bad_fraction=0.2))
    assert len(train) + len(val) == 4


def _damage(path: Path, how: str) -> None:
    """Damage a valid multi-frame file the ways broken copies and exporters do."""
    data = path.read_bytes()
    ds = pydicom.dcmread(path)
    groups_end = (
        ds.get_item("PerFrameFunctionalGroupsSequence").value_tell
        + ds.get_item("PerFrameFunctionalGroupsSequence").length
    )
    if how == "cut_in_a_sequence_of_undefined_length":
        ds["PerFrameFunctionalGroupsSequence"].is_undefined_length = True
        ds.save_as(path)
        data = path.read_bytes()
        path.write_bytes(data[: data.index(b"\xe0\x7f\x10\x00") - 200])
    elif how == "cut_inside_the_next_elements_tag":
        path.write_bytes(data[: groups_end + 2])
    # (7FE0,0010) OW became (0018,0050) OW: out of order, no PixelData
    elif how == "pixel_data_tag_damaged":
        patch_bytes(str(path), b"\xe0\x7f\x10\x00OW", b"\x18\x00\x50\x00OW")
    elif how == "empty_pixel_data":
        ds.PixelData = b""
        ds.save_as(path)
    elif how == "rows_vr_damaged":
        patch_bytes(str(path), b"\x28\x00\x10\x00US", b"\x28\x00\x10\x00U\x17")
    elif how == "sop_class_damaged":  # the dataset's SOPClassUID, not the file meta's
        _set_raw(ds, "SOPClassUID", b"1.2.840.10008.5.1.4.1.1.7\x83.1.5.4")
        ds.save_as(path)


@pytest.mark.parametrize(
    "how, reason",
    [
        # was read_error: checked again every run
        ("cut_in_a_sequence_of_undefined_length", "truncated"),
        ("cut_inside_the_next_elements_tag", "truncated"),  # was no_pixel_data
        ("pixel_data_tag_damaged", "corrupt"),  # was no_pixel_data
        # was bad_header "TypeError: object of type 'NoneType' has no len()"
        ("empty_pixel_data", "no_pixel_data"),
        ("rows_vr_damaged", "corrupt"),  # was a NotImplementedError out of scan_files
        ("sop_class_damaged", "corrupt"),
    ],
)  # was not_oct: another object, not a bad file
def test_a_damaged_file_gets_a_reason_that_says_what_happened(tmp_path, how, reason):
    path = tmp_path / "v.dcm"
    write_phantom(str(path), "heidelberg", shape=(8, 64, 64))
    _damage(path, how)
    (record,) = scan_files([str(path)])
    assert record["reason"] == reason and "NoneType" not in record["detail"], record["detail"]
    with pytest.raises(UnusableFile) as error:
        read_volume(str(path))
    assert error.value.reason == reason


def test_a_damaged_element_that_the_reader_does_not_need_leaves_the_volume_usable(tmp_path):
    path = tmp_path / "v.dcm"
    voxels, _, _ = write_phantom(str(path), "heidelberg", shape=(8, 64, 64))
    patch_bytes(str(path), b"\x08\x00\x70\x00LO", b"\x08\x00\x70\x00L\x17")  # Manufacturer's VR
    (record,) = scan_files([str(path)])  # was a NotImplementedError out of scan_files
    assert record["ok"] and record["manufacturer"] == ""
    np.testing.assert_array_equal(read_volume(str(path)).voxels, voxels)


def test_one_image_encoded_in_other_transfer_syntaxes_is_one_image_and_its_copies(tmp_path):
    names = [
        "MR_small.dcm",
        "MR_small_RLE.dcm",
        "MR_small_bigendian.dcm",
        "MR_small_implicit.dcm",
        # pydicom's own: one SOPInstanceUID
        "MR_small_jp2klossless.dcm",
        "MR_small_jpeg_ls_lossless.dcm",
    ]
    paths = [shutil.copy(get_testdata_file(name), tmp_path / name) for name in names]
    records = scan_files([str(p) for p in paths], sop_classes="any")
    # one 2D image
    assert Counter(r["reason"] for r in records) == {"too_small": 1, "duplicate_instance": 5}


def test_a_series_whose_files_share_one_sop_instance_uid_is_a_broken_anonymizer_not_copies(
    tmp_path,
):
    _, _, paths = write_phantom(str(tmp_path / "s"), "optovue_series", shape=(12, 64, 64))
    for path in paths:
        ds = pydicom.dcmread(path)
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = "1.2.3.4"
        ds.save_as(path)
    records = scan_files(find_files(str(tmp_path / "s")))
    assert [(r["reason"], len(r["paths"])) for r in records] == [("shared_instance_uid", 12)]
    with pytest.raises(UnusableFile) as error:
        read_volume(str(tmp_path / "s"))
    assert error.value.reason == "shared_instance_uid"


@pytest.mark.slow
def test_an_object_uploaded_again_to_a_gs_prefix_is_scanned_again(gcs_emulator, tmp_path):
    write_phantom(str(tmp_path / "a" / "v.dcm"), "heidelberg", shape=(8, 64, 64))
    url = gcs_emulator.upload(str(tmp_path / "a"), "reexport")
    cfg = config(data_root=url, index_path=str(tmp_path / "index.jsonl"))
    first = index_records(cfg)
    assert index_records(cfg) == first  # nothing changed: the index is reused as it is
    # re-exported
    write_phantom(str(tmp_path / "a" / "v.dcm"), "heidelberg", shape=(12, 64, 64), seed=3)
    gcs_emulator.upload(str(tmp_path / "a"), "reexport")
    again = index_records(cfg)
    assert again[0]["sources"] != first[0]["sources"] and again[0]["shape"][0] == 12
