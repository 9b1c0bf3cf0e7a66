"""phantom.py: synthetic OCT that looks like OCT, written as real DICOM in each maker's style, once
and atomically."""

import csv
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.encaps import generate_frames

from dicom import JP2_SIGNATURE, OPT_SOP, unscramble_czm
from phantom import (
    INNER_LABELS,
    INNER_LAYERS,
    LABELS,
    LAYERS,
    MARKER,
    STYLES,
    draw_eye,
    phantom_set_complete,
    retina_geometry,
    set_member,
    set_voxel_layers,
    synth_reflectivity,
    voxel_layers,
    write_phantom,
    write_phantom_set,
)

REPO = Path(__file__).resolve().parents[1]


def test_phantom_set_holds_every_maker_style_as_real_oct_dicom(phantom_dir):
    seen = set()
    for path in sorted(Path(phantom_dir).rglob("*.dcm")):
        ds = pydicom.dcmread(path)
        assert ds.SOPClassUID == OPT_SOP and ds.Modality == "OPT"
        seen.add((ds.Manufacturer, ds.ManufacturerModelName, ds.file_meta.TransferSyntaxUID))
    assert seen == {(s.manufacturer, s.model, s.transfer_syntax) for s in STYLES.values()}


def test_phantom_set_labels_cover_patients_with_several_volumes(phantom_dir):
    with open(os.path.join(phantom_dir, "labels.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and {r["label"] for r in rows} <= set(LABELS)
    assert len({r["label"] for r in rows}) >= 2
    assert all(os.path.exists(os.path.join(phantom_dir, r["path"])) for r in rows)
    first_files = [
        (
            min(Path(phantom_dir, r["path"]).rglob("*.dcm"))
            if r["path"].endswith("series")
            # a series folder: any of its files
            else Path(phantom_dir, r["path"])
        )
        for r in rows
    ]
    patients = [pydicom.dcmread(f, stop_before_pixels=True).PatientID for f in first_files]
    assert max(patients.count(p) for p in patients) >= 3


def test_retina_has_bright_layers_below_a_dark_vitreous():
    img = synth_reflectivity((8, 128, 128), np.random.default_rng(0))
    profile = img.mean(axis=(0, 2))  # mean intensity by depth
    assert profile[:15].mean() < 0.3 * profile.max()  # vitreous on top
    assert profile.argmax() > 20  # the brightest band lies inside the retina


def test_pathology_is_local_not_a_global_intensity_change():
    none = synth_reflectivity((16, 96, 96), np.random.default_rng(3), "none")
    for label in ("drusen", "fluid"):
        sick = synth_reflectivity((16, 96, 96), np.random.default_rng(3), label)
        # the same retina: only the voxels of the lesions differ
        assert 0 < (sick != none).mean() < 0.05
        # no trivial global cue for a linear probe
        assert abs(float(sick.mean() - none.mean())) < 0.02


def test_inner_lesions_are_bright_foci_or_dark_cysts_of_the_inner_retina_and_nothing_else():
    shape, eye = (16, 96, 96), draw_eye(np.random.default_rng(5))
    none = synth_reflectivity(shape, np.random.default_rng(3), "none", eye)
    plain_layers = retina_geometry(shape, np.random.default_rng(3), "none", eye)[0]
    names = [name for name, _, _ in LAYERS]
    for label, kind, sign in zip(INNER_LABELS, INNER_LAYERS, (1, -1)):
        sick = synth_reflectivity(shape, np.random.default_rng(3), label, eye)
        layers = retina_geometry(shape, np.random.default_rng(3), label, eye)[0]
        lesion = layers == len(LAYERS) + INNER_LAYERS.index(kind)
        # small, of one kind
        assert 0 < lesion.mean() < 0.01 and (layers >= len(LAYERS)).sum() == lesion.sum()
        # the same retina around them ...
        assert np.array_equal(layers[~lesion], plain_layers[~lesion])
        # ... inside
        assert set(plain_layers[lesion].tolist()) <= {names.index(n) for n in ("inl", "opl", "onl")}
        # only there
        assert (sick != none).mean() < 0.01 and not (sick[~lesion] != none[~lesion]).any()
        # foci brighter, cysts darker
        assert sign * (sick[lesion].mean() - none[lesion].mean()) > 0.1
        assert abs(float(sick.mean() - none.mean())) < 0.005  # no global cue


# (set seed, varied, member, label, sha256[:16] of voxel_layers, sum of synth_reflectivity) at
# 8x32x32, as written before the sets of inner lesions were added (commit d62dfd3): the RNG streams
# of existing sets never change
EXISTING_SETS = (
    (0, False, 0, "none", "dc9f75a4812a73fb", 2755.7569),
    (0, False, 1, "drusen", "b540e13989322566", 2741.7800),
    (0, False, 3, "fluid", "3212d8f4dfc03b36", 2753.7754),
    (1, False, 0, "none", "60f339d6f6259942", 2712.6012),
    (1, False, 1, "fluid", "d906e1cdc9471595", 2693.1095),
    (1, False, 3, "drusen", "cf7249c45fbb593b", 2717.9030),
    (0, True, 0, "none", "b80a670d93c48c94", 2992.9185),
    (0, True, 1, "drusen", "bcbb9268e3ef91ad", 3063.4456),
    (0, True, 3, "fluid", "392972c8d6c83d06", 2266.8141),
    (2, True, 0, "none", "4b5a46a4bef7e14d", 2103.4205),
    (2, True, 1, "drusen", "9e2a3f5725569407", 1822.8566),
    (2, True, 3, "fluid", "36f6e928f71cce6c", 3426.1555),
)


@pytest.mark.parametrize("seed,varied,i,label,layers_sha,total", EXISTING_SETS)
def test_existing_phantom_sets_keep_their_volumes(seed, varied, i, label, layers_sha, total):
    """The demo's and pretraining's sets (seed 0), the plain probe set (1) and the suite (2) draw
    what they drew: a change here rewrites everyone's phantoms and breaks every recorded number
    (then bump PHANTOM_VERSION)."""
    _, _, drawn_label, eye = set_member(i, seed, varied)
    layers = voxel_layers((8, 32, 32), seed * 100003 + i, label, eye)
    img = synth_reflectivity(
        (8, 32, 32), np.random.default_rng([seed * 100003 + i, LABELS.index(label)]), label, eye
    )
    assert drawn_label == label and hashlib.sha256(layers.tobytes()).hexdigest()[:16] == layers_sha
    assert float(img.astype(np.float64).sum()) == pytest.approx(total, abs=1e-3)


def test_a_set_of_inner_lesions_is_deterministic_balanced_and_apart_from_the_others(tmp_path):
    first = write_phantom_set(
        str(tmp_path / "a"), n=8, shape=(8, 32, 32), seed=3, varied=True, lesions="inner"
    )
    again = write_phantom_set(
        str(tmp_path / "b"), n=8, shape=(8, 32, 32), seed=3, varied=True, lesions="inner"
    )
    rows = list(csv.DictReader(open(os.path.join(first, "labels.csv"))))
    assert [r["label"] for r in rows] == ["none", "foci", "none", "cysts"] * 2
    assert [r["lesion"] for r in rows].count("yes") == 4  # half without lesions
    assert (
        open(os.path.join(again, "labels.csv")).read()
        == open(os.path.join(first, "labels.csv")).read()
    )
    assert (
        open(os.path.join(first, "0000_heidelberg.dcm"), "rb").read()
        == open(os.path.join(again, "0000_heidelberg.dcm"), "rb").read()
    )
    layers = set_voxel_layers(first)
    assert [bool((layers[r["path"]] >= len(LAYERS)).any()) for r in rows] == [
        r["lesion"] == "yes" for r in rows
    ]
    assert phantom_set_complete(first, 8, (8, 32, 32), 3, varied=True, lesions="inner")
    # not a set of drusen and fluid
    assert not phantom_set_complete(first, 8, (8, 32, 32), 3, varied=True)
    with open(os.path.join(first, MARKER)) as f:
        assert json.load(f)["lesions"] == "inner"


def test_varied_eyes_move_the_retina_and_change_its_look():
    def surface_row(img):  # the first depth row brighter than half the brightest row
        profile = img.mean(axis=(0, 2))
        return int(np.argmax(profile > 0.5 * profile.max()))

    plain = [synth_reflectivity((8, 64, 64), np.random.default_rng(i)) for i in range(8)]
    varied = [
        synth_reflectivity(
            (8, 64, 64), np.random.default_rng(i), eye=draw_eye(np.random.default_rng([i, 11]))
        )
        for i in range(8)
    ]
    assert np.std([surface_row(v) for v in varied]) > 2 * np.std([surface_row(v) for v in plain])
    # brightness, contrast, ...
    assert np.std([v.mean() for v in varied]) > 2 * np.std([v.mean() for v in plain])


def test_sixteen_bit_phantoms_use_the_raw_range(tmp_path):
    voxels, _, paths = write_phantom(str(tmp_path / "h.dcm"), "heidelberg", shape=(8, 64, 64))
    assert voxels.dtype == np.uint16 and voxels.max() > 30000  # incident 5: raw values far above 1
    assert pydicom.dcmread(paths[0]).BitsAllocated == 16


def test_existing_set_is_reused_not_rewritten(tmp_path):
    target = str(tmp_path / "set")
    write_phantom_set(target, n=2, shape=(8, 64, 64))
    stamp = os.stat(os.path.join(target, MARKER)).st_mtime_ns
    assert phantom_set_complete(target, 2, (8, 64, 64))
    write_phantom_set(target, n=2, shape=(8, 64, 64))
    assert os.stat(os.path.join(target, MARKER)).st_mtime_ns == stamp
    # other parameters: the old set is replaced whole
    write_phantom_set(target, n=3, shape=(8, 64, 64))
    assert phantom_set_complete(target, 3, (8, 64, 64)) and not phantom_set_complete(
        target, 2, (8, 64, 64)
    )


def test_a_folder_of_other_files_is_never_replaced(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        write_phantom_set(str(tmp_path), n=1, shape=(8, 64, 64))
    assert (tmp_path / "mine.txt").read_text() == "precious"


@pytest.mark.slow
def test_killed_writer_leaves_no_set_that_looks_complete(tmp_path):
    target = tmp_path / "set"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "phantom.py"), str(target), "--n", "200"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not any(
        p.name.startswith("set.partial") and any(p.iterdir()) for p in tmp_path.iterdir()
    ):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not phantom_set_complete(str(target), 200)
    assert not target.exists()  # only the sibling temp folder holds the half set
    (half,) = [p for p in tmp_path.iterdir() if p.name.startswith("set.partial")]
    write_phantom_set(str(target), n=2, shape=(8, 64, 64))
    assert phantom_set_complete(str(target), 2, (8, 64, 64))
    # the next writer deleted the half set of the killed one (its process is gone)
    assert not half.exists()


def test_a_stopped_writer_deletes_its_half_set_and_leaves_a_live_writers_alone(tmp_path):
    """Ctrl-C (or train.py's stop signal) while a set is written: no DIR.partial-* folder is left
    behind, and another writer's folder, still being written, is not touched."""
    target, live = tmp_path / "set", tmp_path / f"set.partial-{socket.gethostname()}-{os.getpid()}"
    live.mkdir()
    script = (
        # Python raises KeyboardInterrupt only where SIGINT was not ignored when it started (a
        # suite run as a background job inherits it ignored)
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "sys.path.insert(0, sys.argv[1]); import phantom\nreal ="
        " phantom.write_oct\ndef write_oct(path, *args, **kwargs):\n    if"
        " path.endswith('0002_zeiss_cirrus.dcm'): os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C,"
        " mid-set\n    return real(path, *args, **kwargs)\nphantom.write_oct ="
        " write_oct\nphantom.write_phantom_set(sys.argv[2], 10, (8, 64, 64))\n"
    )
    stopped = subprocess.run(
        [sys.executable, "-c", script, str(REPO), str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "KeyboardInterrupt" in stopped.stderr and stopped.returncode != 0
    # its own half set gone, the live one kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_phantom_cli_says_so_and_leaves_no_half_set(tmp_path, sig):
    target = tmp_path / "set"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "phantom.py"), str(target), "--n", "200"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not any(
        p.name.startswith("set.partial") and any(p.iterdir()) for p in tmp_path.iterdir()
    ):
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 75 and "Traceback" not in err, err[-2000:]
    assert (
        f"stopped ({signal.Signals(sig).name}): no phantom set was written; the same command"
        " writes it" in err
    )
    assert list(tmp_path.iterdir()) == []


def test_phantom_cli_writes_a_set_and_rejects_bad_sizes(tmp_path):
    ok = subprocess.run(
        [
            sys.executable,
            str(REPO / "phantom.py"),
            str(tmp_path / "x"),
            "--n",
            "3",
            "--size",
            "8,64,64",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert phantom_set_complete(str(tmp_path / "x"), 3, (8, 64, 64))
    bad = subprocess.run(
        [sys.executable, str(REPO / "phantom.py"), str(tmp_path / "y"), "--size", "8,64"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--size" in bad.stderr


def test_a_set_of_an_older_phantom_version_is_rewritten_with_scrambled_zeiss_files(tmp_path):
    target = str(tmp_path / "set")
    write_phantom_set(target, n=3, shape=(8, 64, 64))
    marker = os.path.join(target, MARKER)
    with open(marker) as f:
        spec = json.load(f)
    with open(marker, "w") as f:
        # a set written before the Zeiss files were scrambled
        json.dump({**spec, "version": spec["version"] - 1}, f)
    assert not phantom_set_complete(target, 3, (8, 64, 64))
    write_phantom_set(target, n=3, shape=(8, 64, 64))
    assert phantom_set_complete(target, 3, (8, 64, 64))
    ds = pydicom.dcmread(os.path.join(target, "0002_zeiss_cirrus.dcm"))
    first = next(generate_frames(ds.PixelData, number_of_frames=ds.NumberOfFrames))
    # Cirrus way
    assert not first.startswith(JP2_SIGNATURE) and unscramble_czm(first).startswith(JP2_SIGNATURE)
