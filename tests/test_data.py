"""dicom.py and data.py: every maker's OCT DICOM to static-shape normalized batches, bad files
reported, gs://, cache (incidents 5, 11)."""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch
from pydicom.data import get_testdata_file
from pydicom.encaps import encapsulate, generate_frames
from pydicom.uid import (
    JPEG2000,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGLosslessSV1,
    JPEGLSLossless,
    RLELossless,
)

from config import ConfigError, load_config
from corpora import jpeg_lossless, write_broken_corpus, write_decoys
from data import (
    EpochSampler,
    NoUsableData,
    OCTDataset,
    build_datasets,
    cache_path,
    collate,
    load_prepared,
    load_val_sample,
    main as data_main,
    make_loader,
    resample,
    split_by_patient,
)
from dicom import UnusableFile
from index import find_files, format_reason_table, read_index, read_volume, scan_files, write_index
from phantom import (
    STYLES,
    ensure_builtin_phantoms,
    quantize,
    synth_reflectivity,
    write_oct,
    write_phantom,
)

SMALL = (8, 64, 64)
# pydicom's own note on each truncated JPEG 2000 file of the broken corpus; data.py reports them as
# `truncated`
pytestmark = pytest.mark.filterwarnings("ignore:End of file reached before delimiter")


def config(**overrides):
    return load_config(
        [], **{"image_size": [8, 32, 32], "patch_size": [4, 8, 8], "workers": 0, **overrides}
    )


def run_data_cli(capsys, *args):
    """`python data.py ARGS`, run in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = data_main(list(args))
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def file_name(record):
    return Path(record["paths"][0]).name


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory):
    """The broken corpus and the decoys next to each other: {name: expected reason} per folder."""
    root = tmp_path_factory.mktemp("broken")
    return root, write_broken_corpus(str(root / "broken")), write_decoys(str(root / "decoys"))


# --- reading: every maker, bit depth, encoding, layout ---


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("style", list(STYLES))
def test_each_makers_phantom_reads_back_to_the_written_voxels_and_spacing(tmp_path, style, bits):
    voxels, spacing, paths = write_phantom(
        str(tmp_path / ("v" if STYLES[style].series else "v.dcm")),
        style,
        shape=(12, 64, 64),
        bits=bits,
    )
    volume = read_volume(paths if len(paths) > 1 else paths[0])
    assert volume.voxels.shape == voxels.shape and volume.voxels.dtype == voxels.dtype
    assert volume.spacing == pytest.approx(spacing)
    assert (volume.manufacturer, volume.model) == (STYLES[style].manufacturer, STYLES[style].model)
    if STYLES[style].transfer_syntax == JPEG2000:  # lossy: close, not equal
        assert (
            np.abs(volume.voxels.astype(float) - voxels).mean() < 0.01 * np.iinfo(voxels.dtype).max
        )
    else:
        np.testing.assert_array_equal(volume.voxels, voxels)


@pytest.mark.parametrize(
    "syntax",
    [
        ExplicitVRLittleEndian,
        ImplicitVRLittleEndian,
        ExplicitVRBigEndian,
        DeflatedExplicitVRLittleEndian,
        JPEG2000Lossless,
        JPEG2000,
        JPEGBaseline8Bit,
        RLELossless,
    ],
    ids=lambda s: s.name,
)
def test_every_transfer_syntax_is_really_decoded(tmp_path, syntax):
    """Each syntax that pydicom (RLE, deflate, native) or its plugins (pylibjpeg-openjpeg: JPEG
    2000) encode here; Pillow writes JPEG baseline."""
    bits = 8 if syntax == JPEGBaseline8Bit else 16
    voxels = quantize(synth_reflectivity(SMALL, np.random.default_rng(1)), bits)
    write_oct(
        str(tmp_path / "v.dcm"),
        voxels,
        (0.1, 0.004, 0.012),
        STYLES["heidelberg"],
        transfer_syntax=syntax,
    )
    # never rewritten (incident 11)
    assert pydicom.dcmread(tmp_path / "v.dcm").file_meta.TransferSyntaxUID == syntax
    got = read_volume(str(tmp_path / "v.dcm")).voxels
    if syntax in (JPEG2000, JPEGBaseline8Bit):
        assert np.abs(got.astype(float) - voxels).mean() < 0.02 * np.iinfo(voxels.dtype).max
    else:
        np.testing.assert_array_equal(got, voxels)


@pytest.mark.parametrize("syntax", [JPEGLSLossless, JPEGLosslessSV1], ids=lambda s: s.name)
def test_syntaxes_that_nothing_here_encodes_are_decoded_from_real_codestreams(tmp_path, syntax):
    """JPEG-LS: the frame of pydicom's own JPEG-LS test file (a CharLS codestream; no JPEG-LS
    encoder is installed), against the same image stored uncompressed. JPEG lossless:
    tests/corpora.py's encoder, against its input. (HTJ2K: pylibjpeg-openjpeg decodes it, but
    nothing here encodes it and pydicom ships no HTJ2K file.)"""
    if syntax == JPEGLSLossless:
        reference = pydicom.dcmread(get_testdata_file("MR_small.dcm")).pixel_array  # [64,64] int16
        encoded = pydicom.dcmread(get_testdata_file("MR_small_jpeg_ls_lossless.dcm")).PixelData
        frame = next(generate_frames(encoded, number_of_frames=1))
        voxels, frames = np.stack([reference] * 4), [frame] * 4  # [4,64,64]
    else:
        voxels = quantize(synth_reflectivity((4, 64, 64), np.random.default_rng(1)), 16)
        frames = [jpeg_lossless(v) for v in voxels]
    write_oct(
        str(tmp_path / "v.dcm"), voxels.astype(np.uint16), (0.1, 0.004, 0.012), STYLES["heidelberg"]
    )
    ds = pydicom.dcmread(tmp_path / "v.dcm")
    ds.PixelData, ds.PixelRepresentation = encapsulate(frames), int(voxels.dtype.kind == "i")
    ds["PixelData"].VR, ds.file_meta.TransferSyntaxUID = "OB", syntax
    ds.save_as(tmp_path / "v.dcm")
    got = read_volume(str(tmp_path / "v.dcm")).voxels
    assert got.dtype == voxels.dtype
    np.testing.assert_array_equal(got, voxels)


def test_monochrome1_is_inverted_and_rescale_applied(tmp_path):
    voxels = quantize(synth_reflectivity(SMALL, np.random.default_rng(2)), 16)
    write_oct(
        str(tmp_path / "m1.dcm"), voxels, None, STYLES["heidelberg"], photometric="MONOCHROME1"
    )
    np.testing.assert_array_equal(read_volume(str(tmp_path / "m1.dcm")).voxels, voxels)
    write_oct(str(tmp_path / "r.dcm"), voxels, None, STYLES["heidelberg"], rescale=(2.0, -100.0))
    np.testing.assert_allclose(read_volume(str(tmp_path / "r.dcm")).voxels, voxels * 2.0 - 100.0)


def test_zeiss_frames_stored_in_reverse_come_out_in_stack_order(tmp_path):
    voxels, _, paths = write_phantom(
        str(tmp_path / "z.dcm"),
        "zeiss_cirrus",
        shape=SMALL,
        # not scrambled: pydicom decodes it as stored
        transfer_syntax=JPEG2000Lossless,
    )
    as_stored = pydicom.dcmread(paths[0]).pixel_array
    np.testing.assert_array_equal(as_stored, voxels[::-1])
    np.testing.assert_array_equal(read_volume(paths[0]).voxels, voxels)


def test_series_is_ordered_by_position_not_by_file_name(tmp_path):
    voxels, spacing, paths = write_phantom(str(tmp_path / "s"), "optovue_series", shape=SMALL)
    by_name = sorted(paths)
    assert by_name != paths  # the file names are shuffled
    volume = read_volume(by_name)
    np.testing.assert_array_equal(volume.voxels, voxels)
    assert volume.spacing == pytest.approx(spacing)
    # a folder is one series
    np.testing.assert_array_equal(read_volume(str(tmp_path / "s")).voxels, voxels)


def test_b_scan_spacing_falls_back_to_frame_positions(tmp_path):
    voxels, spacing, paths = write_phantom(str(tmp_path / "h.dcm"), "heidelberg", shape=SMALL)
    ds = pydicom.dcmread(paths[0])
    measures = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    del measures.SliceThickness, measures.SpacingBetweenSlices
    ds.save_as(paths[0])
    assert read_volume(paths[0]).spacing == pytest.approx(spacing, rel=1e-4)


# --- reading: broken files and other objects ---


def test_every_broken_file_is_reported_with_its_reason(broken_dir):
    root, expected, _ = broken_dir
    for name, reason in expected.items():
        try:
            read_volume(str(root / "broken" / name))
            got = None
        except UnusableFile as e:
            got = e.reason
        assert got == reason, name
    by_name = {file_name(r): r for r in scan_files(find_files(str(root / "broken")))}
    assert {n: r["reason"] for n, r in by_name.items()} == expected


def test_truncated_jpeg2000_is_reported_not_crashed(broken_dir):
    root, expected, _ = broken_dir
    names = [n for n in expected if n.startswith("truncated_j2k")]
    assert len(names) >= 3
    for name in names:
        with pytest.raises(UnusableFile) as caught:
            read_volume(str(root / "broken" / name))
        assert caught.value.reason == "truncated"
    # pydicom returns an empty dataset for these with only a warning: the detail says so
    assert any(
        "empty dataset" in scan["detail"]
        for scan in scan_files([str(root / "broken" / n) for n in names])
    )


def test_obfuscated_zeiss_pixel_stream_is_undecodable(broken_dir):
    root, _, _ = broken_dir
    with pytest.raises(UnusableFile) as caught:
        read_volume(str(root / "broken" / "zeiss_obfuscated.dcm"))
    assert (
        caught.value.reason == "undecodable" and caught.value.manufacturer == "Carl Zeiss Meditec"
    )


@pytest.mark.parametrize("sop_classes", ["oct", "any"])
def test_other_objects_are_skipped_with_a_reason_and_any_accepts_secondary_capture(
    broken_dir, sop_classes
):
    root, _, decoys = broken_dir
    records = scan_files(find_files(str(root / "decoys")), sop_classes=sop_classes)
    assert {file_name(r): r["reason"] for r in records} == {
        n: want[sop_classes] for n, want in decoys.items()
    }
    if sop_classes == "any":
        assert (
            read_volume(str(root / "decoys" / "oct_as_secondary_capture.dcm"), "any").voxels.ndim
            == 3
        )


def test_garbled_spacing_is_resized_or_skipped_as_configured(broken_dir, tmp_path):
    root, _, _ = broken_dir
    volume = read_volume(str(root / "broken" / "garbled_spacing.dcm"))
    assert volume.spacing is None and "garbled" in volume.spacing_issue
    resize = config(target_spacing=[0.2, 0.02, 0.05])
    assert load_val_sample(str(root / "broken" / "garbled_spacing.dcm"), resize).shape == (
        1,
        8,
        32,
        32,
    )
    with pytest.raises(UnusableFile) as caught:
        load_val_sample(
            str(root / "broken" / "garbled_spacing.dcm"), replace(resize, missing_spacing="skip")
        )
    assert caught.value.reason == "bad_spacing"


# --- finding files, scan CLI ---


def test_scan_index_lists_every_file_exactly_once(phantom_dir, broken_dir, tmp_path):
    root, expected, decoys = broken_dir
    shutil.copytree(phantom_dir, tmp_path / "mix")
    shutil.copytree(root / "broken", tmp_path / "mix" / "broken")
    shutil.copytree(root / "decoys", tmp_path / "mix" / "decoys")
    files = find_files(str(tmp_path / "mix"))
    records = scan_files(files)
    listed = [p for r in records for p in r["paths"]]
    assert sorted(listed) == files and len(set(listed)) == len(listed)
    ok = [r for r in records if r["ok"]]
    assert len(ok) == 10 + 1  # the phantoms and the garbled-spacing file
    assert all(
        set(r) >= {"paths", "ok", "reason", "manufacturer", "model", "shape", "spacing"}
        for r in records
    )
    series = [r for r in ok if r["model"] == STYLES["optovue_series"].model]
    assert [len(r["paths"]) for r in series] == [32, 32]  # one record per series, not per file


def test_scan_cli_prints_the_maker_table_and_writes_the_index(
    phantom_dir, broken_dir, tmp_path, capsys
):
    root, expected, _ = broken_dir
    code, out, err = run_data_cli(
        capsys, "scan", str(root / "broken"), "--out", str(tmp_path / "index.jsonl")
    )
    assert code == 0, err  # rejects are a report, not a failure
    assert "Heidelberg Engineering" in out and "truncated" in out and "undecodable" in out
    index = read_index(str(tmp_path / "index.jsonl"))
    assert {Path(r["paths"][0]).name: r["reason"] for r in index} == expected
    code, out, _ = run_data_cli(capsys, "scan", phantom_dir, "--sop_classes", "any")
    assert code == 0 and "10 usable volumes" in out


@pytest.mark.parametrize(
    "args",
    [
        ["scan", "/no/such/folder"],
        ["scan"],
        ["scan", ".", "--sop_classes", "mri"],
        ["scan", ".", "--no_such_flag", "1"],
        ["bogus"],
    ],
)
def test_data_cli_bad_input_exits_2_with_a_message(args, capsys):
    code, _, err = run_data_cli(capsys, *args)
    assert code == 2 and err.strip()


def test_manifest_paths_are_relative_to_the_root(phantom_dir, tmp_path):
    names = ["0000_heidelberg.dcm", "0001_topcon_triton.dcm"]
    (tmp_path / "m.tsv").write_text("filepath\tsplit\n" + "".join(f"{n}\ttrain\n" for n in names))
    (tmp_path / "m.csv").write_text("patient,filepath\n" + "".join(f"p,{n}\n" for n in names))
    for manifest in ("m.tsv", "m.csv"):
        assert find_files(phantom_dir, str(tmp_path / manifest)) == [
            os.path.join(phantom_dir, n) for n in names
        ]
    (tmp_path / "bad.csv").write_text("path\nx.dcm\n")
    with pytest.raises(ConfigError, match="filepath"):
        find_files(phantom_dir, str(tmp_path / "bad.csv"))


def test_a_glob_selects_files(phantom_dir):
    assert [Path(p).name for p in find_files(os.path.join(phantom_dir, "*_heidelberg.dcm"))] == [
        "0000_heidelberg.dcm",
        "0005_heidelberg.dcm",
    ]


# --- preprocessing ---


@pytest.mark.parametrize("target_spacing", [None, [0.4, 0.03, 0.09]])
def test_normalized_batches_have_zero_mean_and_unit_std_for_every_maker(
    phantom_dir, target_spacing
):
    cfg = config(
        phantom_dir=phantom_dir,
        phantom_count=10,
        target_spacing=target_spacing,
        intensity_jitter=0.0,
        val_fraction=0.3,
    )
    train, val = build_datasets(cfg)
    for dataset in (train, val):
        batch = collate([dataset[(3, i)] for i in range(len(dataset))])
        assert batch["volume"].shape[1:] == (1, 8, 32, 32)
        for maker in set(batch["maker"]):  # incident 5: identical across makers and bit depths
            v = batch["volume"][[m == maker for m in batch["maker"]]]
            assert abs(float(v.mean())) < 0.05 and abs(float(v.std()) - 1) < 0.05, maker


def test_downsampling_averages_instead_of_aliasing():
    stripes = np.zeros((16, 64, 64), np.float32)
    stripes[:, :, ::2] = 1.0  # finest lateral pattern: aliasing would turn it into all 0 or all 1
    stripes[::2] = 1.0 - stripes[::2]
    out = resample(stripes, (8, 64, 16))
    assert out.shape == (8, 64, 16)
    np.testing.assert_allclose(out.numpy(), 0.5, atol=0.01)


def test_target_spacing_crops_large_and_pads_small_volumes_to_image_size(tmp_path):
    cfg = config(target_spacing=[0.2, 0.02, 0.05])
    voxels = quantize(synth_reflectivity(SMALL, np.random.default_rng(4)), 8)
    # 2x too many voxels
    write_oct(str(tmp_path / "big.dcm"), voxels, (0.4, 0.04, 0.1), STYLES["heidelberg"])
    # 1/4 of them
    write_oct(str(tmp_path / "small.dcm"), voxels, (0.05, 0.005, 0.0125), STYLES["heidelberg"])
    assert load_prepared([str(tmp_path / "big.dcm")], cfg).shape == (16, 128, 128)
    assert load_prepared([str(tmp_path / "small.dcm")], cfg).shape == (2, 16, 16)
    for name in ("big.dcm", "small.dcm"):
        sample = load_val_sample(str(tmp_path / name), cfg)
        assert sample.shape == (1, 8, 32, 32)
        assert abs(float(sample.mean())) < 1e-3 and abs(float(sample.std()) - 1) < 1e-3


def test_train_samples_depend_only_on_seed_epoch_and_index(phantom_dir):
    cfg = config(phantom_dir=phantom_dir, phantom_count=10, flip_prob=0.5)
    train, _ = build_datasets(cfg)
    a, b = train[(2, 1)], pickle.loads(pickle.dumps(train))[(2, 1)]
    assert torch.equal(a["volume"], b["volume"]) and torch.equal(a["target_idx"], b["target_idx"])
    others = [train[(epoch, 1)] for epoch in range(3, 8)]
    assert any(not torch.equal(a["volume"], o["volume"]) for o in others)
    assert any(not torch.equal(a["target_idx"], o["target_idx"]) for o in others)
    n_context, n_target = cfg.token_counts()
    assert a["context_idx"].shape == (n_context,) and a["target_idx"].dtype == torch.int64


def test_val_samples_are_fixed_center_crops_without_augmentation(phantom_dir):
    cfg = config(
        phantom_dir=phantom_dir,
        phantom_count=10,
        val_fraction=0.3,
        flip_prob=1.0,
        intensity_jitter=0.5,
    )
    _, val = build_datasets(cfg)
    first, later = val[(0, 0)], val[(9, 0)]
    assert torch.equal(first["volume"], later["volume"]) and torch.equal(
        first["target_idx"], later["target_idx"]
    )
    assert torch.equal(first["volume"], load_val_sample(val.records[0]["paths"], cfg))


# --- datasets, sampler, loader ---


def test_split_is_by_patient_and_deterministic():
    records = [{"patient": f"p{i // 3}", "paths": [f"f{i}"]} for i in range(90)]
    train, val = split_by_patient(records, 0.2, seed=1)
    assert (train, val) == split_by_patient(records, 0.2, seed=1)
    # whole patients (the count follows a hash of each patient: test_resume.py)
    assert val and len(val) % 3 == 0
    assert not {r["patient"] for r in train} & {r["patient"] for r in val}
    assert split_by_patient(records, 0.2, seed=2)[1] != val


def test_epoch_sampler_gives_equal_disjoint_shards_and_resumes_mid_epoch():
    shards = [list(EpochSampler(10, rank, 3, seed=0, epoch=4)) for rank in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    keys = [k for s in shards for k in s]
    assert len(set(keys)) == 9 and all(epoch == 4 for epoch, _ in keys)
    assert list(EpochSampler(10, 1, 3, seed=0, epoch=4, start=2)) == shards[1][2:]
    assert list(EpochSampler(10, 0, 1, seed=0, epoch=4)) != list(
        EpochSampler(10, 0, 1, seed=0, epoch=5)
    )
    assert list(EpochSampler(5, shuffle=False)) == [(0, i) for i in range(5)]
    assert len(EpochSampler(10, 0, 3, start=2)) == 1


def test_one_sampler_over_several_epochs_equals_the_epochs_one_by_one():
    """train.py keeps one loader for the whole run: same keys as a loader per epoch, each cut to
    whole updates."""
    spanning = list(EpochSampler(10, 1, 2, seed=3, epoch=2, start=1, epochs=3, per_epoch=4))
    one_by_one = [k for e in (2, 3, 4) for k in list(EpochSampler(10, 1, 2, seed=3, epoch=e))[:4]][
        1:
    ]
    assert (
        spanning == one_by_one and len(EpochSampler(10, 1, 2, start=1, epochs=3, per_epoch=4)) == 11
    )


def test_loader_with_workers_gives_the_same_batches_as_in_process(phantom_dir):
    cfg = config(phantom_dir=phantom_dir, phantom_count=10)
    train, _ = build_datasets(cfg)
    in_process = list(make_loader(train, 2, train=True, workers=0, epoch=1, seed=3))
    workers = list(make_loader(train, 2, train=True, workers=2, epoch=1, seed=3))
    assert len(in_process) == len(train) // 2
    for a, b in zip(in_process, workers):
        assert a["path"] == b["path"] and torch.equal(a["target_idx"], b["target_idx"])
        torch.testing.assert_close(a["volume"], b["volume"])


@pytest.mark.slow
def test_files_that_break_after_the_scan_are_replaced_and_batches_stay_full(phantom_dir, tmp_path):
    shutil.copytree(phantom_dir, tmp_path / "d")
    cfg = config(
        data_root=str(tmp_path / "d"),
        index_path=str(tmp_path / "index.jsonl"),
        val_fraction=0.0,
        max_bad_fraction=0.5,
    )
    train, _ = build_datasets(cfg)  # scans and writes the index
    broken = ["0001_topcon_triton.dcm", "0002_zeiss_cirrus.dcm", "0005_heidelberg.dcm"]
    for name in broken:  # an interrupted re-sync during the run (the next run's index rescans them)
        data = (tmp_path / "d" / name).read_bytes()
        (tmp_path / "d" / name).write_bytes(data[: len(data) // 2])
    assert len(train) == 10  # the loader meets them at run time
    batches = list(make_loader(train, 3, train=True, workers=2, epoch=0, seed=0))
    assert len(batches) == 3 and all(b["volume"].shape == (3, 1, 8, 32, 32) for b in batches)
    skipped = {(Path(path).name, reason) for b in batches for path, reason, _ in b["skipped"]}
    assert skipped and skipped <= {(name, "truncated") for name in broken}
    assert not {Path(p).name for b in batches for p in b["path"]} & set(broken)


def test_too_many_bad_files_stop_with_the_reason_table(broken_dir, phantom_dir, tmp_path):
    root, _, _ = broken_dir
    shutil.copytree(root / "broken", tmp_path / "d")
    shutil.copy(os.path.join(phantom_dir, "0000_heidelberg.dcm"), tmp_path / "d")
    with pytest.raises(NoUsableData) as caught:
        build_datasets(config(data_root=str(tmp_path / "d")))
    assert "truncated" in str(caught.value) and "undecodable" in str(caught.value)
    train, val = build_datasets(config(data_root=str(tmp_path / "d"), max_bad_fraction=1.0))
    assert len(train) + len(val) == 2  # the phantom and the garbled-spacing file


def test_no_usable_volume_is_no_usable_data_even_with_max_bad_fraction_1(broken_dir):
    root, _, _ = broken_dir
    with pytest.raises(NoUsableData, match="0 usable volumes"):
        build_datasets(config(data_root=str(root / "decoys"), max_bad_fraction=1.0))


def test_other_objects_do_not_count_as_bad_files(broken_dir, phantom_dir, tmp_path):
    root, _, _ = broken_dir
    shutil.copytree(phantom_dir, tmp_path / "d")
    shutil.copytree(root / "decoys", tmp_path / "d" / "decoys")  # 5 objects next to 10 volumes
    train, val = build_datasets(config(data_root=str(tmp_path / "d"), max_bad_fraction=0.01))
    assert len(train) + len(val) == 10


def test_reason_table_lists_counts_and_meanings():
    table = format_reason_table({"truncated": 3, "undecodable": 1})
    assert table.splitlines()[1].split()[:2] == ["truncated", "3"] and "obfuscated" in table


def test_index_path_is_reused_instead_of_scanning_again(phantom_dir, tmp_path):
    cfg = config(data_root=phantom_dir, index_path=str(tmp_path / "index.jsonl"))
    build_datasets(cfg)
    lines = Path(cfg.index_path).read_text().splitlines()
    # what it was built from, 4 records
    Path(cfg.index_path).write_text("\n".join(lines[: 1 + 4]) + "\n")
    train, val = build_datasets(cfg)
    assert len(train) + len(val) == 4


def test_built_in_phantoms_are_written_once_by_the_scripts_and_only_read_by_the_index(tmp_path):
    cfg = config(phantom_dir=str(tmp_path / "ph"), phantom_count=5)
    with pytest.raises(ConfigError, match="phantom_dir: .* holds no phantom set"):
        build_datasets(cfg)  # the reader writes nothing
    ensure_builtin_phantoms(cfg)  # what train.py and sanity.py do first
    train, val = build_datasets(cfg)
    assert len(train) + len(val) == 5 and len(val) >= 1
    marker = next((tmp_path / "ph").glob(".*"))
    stamp = marker.stat().st_mtime_ns
    ensure_builtin_phantoms(cfg)
    build_datasets(cfg)
    assert marker.stat().st_mtime_ns == stamp


def test_geometry_report_shows_crop_and_pad_per_axis(phantom_dir):
    train, _ = build_datasets(
        config(phantom_dir=phantom_dir, phantom_count=10, target_spacing=[0.1, 0.01, 0.1])
    )
    report = train.geometry_report()
    assert "cropped D/H/W" in report and "padded" in report


# --- cache ---


def test_cache_returns_the_same_tensors_as_the_uncached_path(phantom_dir, tmp_path):
    plain = config(phantom_dir=phantom_dir, phantom_count=10)
    cached = replace(plain, cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(plain)
    cached_train = OCTDataset(train.records, cached, train=True)
    for _ in range(2):  # first fills the cache, then reads it
        for i in range(len(train)):
            a, b = train[(1, i)], cached_train[(1, i)]
            assert torch.equal(a["volume"], b["volume"]) and torch.equal(
                a["target_idx"], b["target_idx"]
            )
    assert len(list((tmp_path / "cache").glob("*.npy"))) == len(train)


def test_cache_file_cut_in_half_is_detected_and_rebuilt(phantom_dir, tmp_path):
    cfg = config(cache_dir=str(tmp_path / "cache"))
    paths = [os.path.join(phantom_dir, "0000_heidelberg.dcm")]
    good = np.array(load_prepared(paths, cfg))
    path = cache_path(cfg, paths)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    np.testing.assert_array_equal(load_prepared(paths, cfg), good)
    assert Path(path).stat().st_size == len(data)


def test_cache_key_changes_with_spacing_size_and_version(monkeypatch, tmp_path):
    cfg = config(cache_dir=str(tmp_path))
    keys = {
        cache_path(cfg, ["a.dcm"]),
        cache_path(replace(cfg, image_size=[8, 64, 64]), ["a.dcm"]),
        cache_path(replace(cfg, target_spacing=[0.1, 0.01, 0.01]), ["a.dcm"]),
        cache_path(replace(cfg, clip_percentiles=[1.0, 99.0]), ["a.dcm"]),
        cache_path(cfg, ["b.dcm"]),
    }
    monkeypatch.setattr("data.CACHE_VERSION", 999)
    keys.add(cache_path(cfg, ["a.dcm"]))
    assert len(keys) == 6


def test_prepare_cli_fills_the_cache_that_training_reads(phantom_dir, tmp_path, capsys):
    code, out, err = run_data_cli(
        capsys,
        "prepare",
        phantom_dir,
        "--cache",
        str(tmp_path / "c"),
        "--image_size",
        "8,32,32",
        "--patch_size",
        "4,8,8",
        "--workers",
        "2",
    )
    assert code == 0, err
    assert "10 volumes prepared" in out
    assert len(list((tmp_path / "c").glob("*.npy"))) == 10
    cfg = config(data_root=phantom_dir, cache_dir=str(tmp_path / "c"))
    assert all(os.path.exists(cache_path(cfg, r["paths"])) for r in build_datasets(cfg)[0].records)


# --- gs:// through a real local emulator ---


@pytest.mark.slow
def test_gs_prefix_with_two_workers_gives_the_same_batches_as_the_local_copy(
    gcs_emulator, phantom_dir
):
    url = gcs_emulator.upload(phantom_dir, "phantoms")
    local, remote = config(data_root=phantom_dir), config(data_root=url)
    batches = []
    for cfg in (local, remote):
        train, val = build_datasets(cfg)
        batches.append(
            list(make_loader(train, 2, train=True, workers=2, epoch=2, seed=0))
            + list(make_loader(val, 2, train=False, workers=2))
        )
    assert len(batches[0]) == len(batches[1]) > 0
    for a, b in zip(*batches):
        assert [p.replace(phantom_dir, url) for p in a["path"]] == b["path"]
        torch.testing.assert_close(a["volume"], b["volume"])
        assert torch.equal(a["target_idx"], b["target_idx"])


@pytest.mark.slow
def test_gs_scan_lists_every_object_and_writes_the_index_to_the_bucket(gcs_emulator, broken_dir):
    root, expected, _ = broken_dir
    url = gcs_emulator.upload(str(root / "broken"), "broken")
    records = scan_files(find_files(url))
    assert {Path(r["paths"][0]).name: r["reason"] for r in records} == expected
    write_index(records, f"{url}/index.jsonl")
    assert read_index(f"{url}/index.jsonl") == json.loads(json.dumps(records))


def test_the_built_in_phantoms_split_alike_under_every_site_key_while_real_patients_follow_their_key(
    tmp_path, phantom_dir, monkeypatch
):
    """The demo trains the same volumes, and so makes the same number of updates, on every machine;
    a site's own data keeps its keyed patient split (two keys: two splits, neither linkable to the
    other)."""
    val_files = {}
    for key in ("site-a", "site-b"):  # two fixed secrets: the same outcome on every run of the test
        key_file = tmp_path / f"{key}.key"
        key_file.write_text(hashlib.sha256(key.encode()).hexdigest() + "\n")
        key_file.chmod(0o600)
        monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(key_file))
        for data in ("built-in", "own"):
            flags = [
                "--phantom_dir",
                phantom_dir,
                "--cache_dir",
                str(tmp_path / f"cache-{key}-{data}"),
                "--val_fraction",
                "0.4",
                "--index_path",
                str(tmp_path / f"index-{key}-{data}.jsonl"),
            ]
            _, val = build_datasets(
                load_config(flags + (["--data_root", phantom_dir] if data == "own" else []))
            )
            val_files[key, data] = sorted(os.path.basename(r["paths"][0]) for r in val.records)
    assert val_files["site-a", "built-in"] == val_files["site-b", "built-in"]
    assert val_files["site-a", "own"] != val_files["site-b", "own"]


def test_every_seed_of_the_demo_trains_on_as_many_built_in_phantoms_so_makes_as_many_updates():
    """A share drawn per file gave the demo's seed 4 a smaller training split than seeds 0-3 (4
    batches an epoch, not 5: 480 updates, not 600). The built-in phantoms hold round(val_fraction x
    files) back; real patients keep the drawn share, where a lost or added patient moves no one
    else."""
    files = [{"patient": f"p{i}", "paths": [f"data/phantoms/{i:04d}.dcm"]} for i in range(48)]
    by_name = lambda record: record["paths"][0]  # noqa: E731
    counts = {
        seed: len(split_by_patient(files, 0.1, seed, by_name, exact_count=True)[1])
        for seed in range(20)
    }
    assert set(counts.values()) == {5}, counts
    drawn = {len(split_by_patient(files, 0.1, seed, by_name)[1]) for seed in range(20)}
    assert len(drawn) > 1  # what the demo had: the draw decided its run length


def test_scan_out_on_a_full_disk_exits_74_with_a_message_and_keeps_the_index_there(
    phantom_dir, tmp_path
):
    """`data.py scan --out` to a full disk once ended in an OSError traceback: now the storage exit
    code, what happened and the command to run again, and the index already at --out is left whole
    (no tmp file beside it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # A 16 KiB disk, 12,000 bytes of it taken by the index of an earlier scan: the new index does
    # not fit.
    full_disk = (
        'mount -t tmpfs -o size=16k tmpfs "$0" && head -c 12000 /dev/zero | tr "\\0" x >'
        ' "$0/index.jsonl" && { "$@"; code=$?; ls -A "$0"; wc -c < "$0/index.jsonl"; exit $code; }'
    )
    if subprocess.run(
        ["unshare", "--mount", "sh", "-c", full_disk, str(disk), "true"], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a tiny tmpfs here (needs root in a mount namespace): no full disk to"
            " write to"
        )
    repo = Path(__file__).resolve().parents[1]
    full = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            full_disk,
            str(disk),
            sys.executable,
            str(repo / "data.py"),
            "scan",
            phantom_dir,
            "--out",
            str(disk / "index.jsonl"),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert full.returncode == 74, full.stderr[-2000:]
    assert (
        f"index storage failed: the index {disk / 'index.jsonl'} could not be written (No space"
        " left on device)"
        in full.stderr
        and "Traceback" not in full.stderr
    )
    assert (
        f"run the same command again: python data.py scan {phantom_dir} --out"
        f" {disk / 'index.jsonl'}" in full.stderr
    )
    # the earlier index whole, no tmp file left
    assert full.stdout.splitlines()[-2:] == ["index.jsonl", "12000"]
