"""Test corpora: what real OCT folders hold besides clean volumes, written as real DICOM files with
the phantom writer (phantom.py). write_decoys: other objects that share OCT folders (en-face,
fundus, analysis, report, OCT as secondary capture); write_broken_corpus: broken files a reader must
report, not crash on (incident 11); write_odd_cases: the shapes real exports take that are not clean
raster volumes (two stacks, radial scans, broken series, garbled headers...). Each returns the
reason the reader must give for every file it wrote. write_photo: an SLO/fundus image that an export
puts into a series folder; jpeg_lossless: the one encoder the tests need that no installed library
has.
"""

import io
import os
import shutil
from typing import Dict, Optional, Sequence

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, JPEGBaseline8Bit

from phantom import (
    DEFAULT_SIZE,
    STYLES,
    Style,
    base_dataset,
    item_of,
    save_dicom,
    set_pixels,
    quantize,
    spacing_for,
    synth_reflectivity,
    uid_for,
    write_oct,
)

SOP_CLASSES = {
    "en_face": "1.2.840.10008.5.1.4.1.1.77.1.5.1",  # Ophthalmic Photography 8 Bit
    "bscan_analysis": "1.2.840.10008.5.1.4.1.1.77.1.5.8",  # OCT B-scan Volume Analysis
    # Multi-frame Grayscale Byte Secondary Capture
    "secondary_capture": "1.2.840.10008.5.1.4.1.1.7.2",
    "basic_text_sr": "1.2.840.10008.5.1.4.1.1.88.11",
}


def write_decoys(
    directory: str, shape: Sequence[int] = DEFAULT_SIZE
) -> Dict[str, Dict[str, Optional[str]]]:
    """Non-OCT objects that share OCT folders; returns {file name: {'oct': reason, 'any': reason or
    None}}."""
    style = STYLES["heidelberg"]
    rng = np.random.default_rng(11)
    volume = quantize(synth_reflectivity(shape, rng), 8)
    spacing = spacing_for(style, shape)
    expected = {}

    photo = base_dataset(
        SOP_CLASSES["en_face"],
        uid_for("decoy", "en_face"),
        ExplicitVRLittleEndian,
        "DECOY-1",
        style.manufacturer,
        style.model,
        uid_for("decoy-series", "en_face"),
    )
    set_pixels(
        photo,
        volume.mean(axis=1, keepdims=True).astype(np.uint8).transpose(1, 0, 2),
        ExplicitVRLittleEndian,
    )  # en-face projection [1, D, W]
    del photo.NumberOfFrames
    save_dicom(photo, os.path.join(directory, "en_face.dcm"))
    expected["en_face.dcm"] = {"oct": "not_oct", "any": "too_small"}

    fundus = base_dataset(
        "1.2.840.10008.5.1.4.1.1.77.1.5.1",
        uid_for("decoy", "fundus"),
        ExplicitVRLittleEndian,
        "DECOY-1",
        "Topcon",
        "Maestro2",
        uid_for("decoy-series", "fundus"),
    )
    rgb = np.repeat(volume[:1, :, :, None], 3, axis=-1)[0]  # [H,W,3]
    fundus.Rows, fundus.Columns, fundus.SamplesPerPixel = rgb.shape[0], rgb.shape[1], 3
    fundus.PhotometricInterpretation, fundus.PlanarConfiguration = "RGB", 0
    fundus.BitsAllocated, fundus.BitsStored, fundus.HighBit, fundus.PixelRepresentation = 8, 8, 7, 0
    fundus.PixelData = rgb.tobytes()
    save_dicom(fundus, os.path.join(directory, "fundus_rgb.dcm"))
    expected["fundus_rgb.dcm"] = {"oct": "not_oct", "any": "not_grayscale"}

    analysis = base_dataset(
        SOP_CLASSES["bscan_analysis"],
        uid_for("decoy", "analysis"),
        ExplicitVRLittleEndian,
        "DECOY-1",
        style.manufacturer,
        style.model,
        uid_for("decoy-series", "analysis"),
    )
    analysis.Modality = "OPT"
    save_dicom(analysis, os.path.join(directory, "bscan_analysis.dcm"))
    expected["bscan_analysis.dcm"] = {"oct": "not_oct", "any": "not_image"}

    report = base_dataset(
        SOP_CLASSES["basic_text_sr"],
        uid_for("decoy", "report"),
        ExplicitVRLittleEndian,
        "DECOY-1",
        style.manufacturer,
        style.model,
        uid_for("decoy-series", "report"),
    )
    report.Modality, report.ValueType = "SR", "CONTAINER"
    save_dicom(report, os.path.join(directory, "report_sr.dcm"))
    expected["report_sr.dcm"] = {"oct": "not_oct", "any": "not_image"}

    # OCT exported as multi-frame secondary capture: only `sop_classes: any` accepts it.
    write_oct(
        os.path.join(directory, "oct_as_secondary_capture.dcm"),
        volume,
        spacing,
        style,
        patient_id="DECOY-2",
        uid_seed="decoy-sc",
        sop_class=SOP_CLASSES["secondary_capture"],
    )
    expected["oct_as_secondary_capture.dcm"] = {"oct": "not_oct", "any": None}
    return expected


def write_photo(
    path: str,
    image: np.ndarray,
    series_uid: str,
    patient_id: str = "PHANTOM-000",
    uid_seed: str = "photo",
) -> None:
    """An 8-bit Ophthalmic Photography image [H,W] (an SLO or fundus picture) in the series
    `series_uid`."""
    style = STYLES["heidelberg"]
    ds = base_dataset(
        SOP_CLASSES["en_face"],
        uid_for("photo", uid_seed),
        ExplicitVRLittleEndian,
        patient_id,
        style.manufacturer,
        style.model,
        series_uid,
    )
    set_pixels(ds, image[None].astype(np.uint8), ExplicitVRLittleEndian)
    del ds.NumberOfFrames
    save_dicom(ds, path)


def jpeg_lossless(frame: np.ndarray) -> bytes:
    """One frame [H,W] (uint8/uint16) as a JPEG lossless codestream (process 14, first-order
    prediction, selection value 1: the JPEGLosslessSV1 syntax) with one table of 5-bit Huffman
    codes. pydicom encodes RLE and (with pylibjpeg-openjpeg) JPEG 2000, but no installed library
    encodes JPEG lossless."""
    rows, cols = frame.shape
    bits = frame.dtype.itemsize * 8
    x = frame.astype(np.int64)
    prediction = np.empty_like(x)
    prediction[:, 1:] = x[:, :-1]  # the sample to the left...
    prediction[1:, 0] = x[:-1, 0]  # ...the one above at the start of a row...
    prediction[0, 0] = 1 << (bits - 1)  # ...half the range for the first one
    diff = (x - prediction).ravel() % 65536  # differences are modulo 2^16 (ITU T.81, H.1.2.1)
    diff = np.where(diff >= 32768, diff - 65536, diff)
    # the category SSSS
    size = np.where(diff == -32768, 16, np.ceil(np.log2(np.abs(diff) + 1)).astype(int))
    # SSSS low bits after the code; none for 16
    extra = np.where(diff < 0, diff + (1 << size) - 1, diff)
    code = "".join(
        f"{s:05b}" + (f"{e:0{s}b}" if 0 < s < 16 else "")
        for s, e in zip(size.tolist(), extra.tolist())
    )
    code += "1" * (-len(code) % 8)
    # byte stuffing
    data = int(code, 2).to_bytes(len(code) // 8, "big").replace(b"\xff", b"\xff\x00")
    # 17 categories, all 5-bit codes
    huffman = bytes([0, 0, 0, 0, 17] + [0] * 11) + bytes(range(17))
    return (
        b"\xff\xd8"
        + b"\xff\xc3"
        + (11).to_bytes(2, "big")
        + bytes([bits])
        + rows.to_bytes(2, "big")
        + cols.to_bytes(2, "big")
        + bytes([1, 1, 0x11, 0])
        + b"\xff\xc4"
        + (3 + len(huffman)).to_bytes(2, "big")
        + b"\x00"
        + huffman
        + b"\xff\xda"
        + (8).to_bytes(2, "big")
        + bytes([1, 1, 0, 1, 0, 0])
        + data
        + b"\xff\xd9"
    )


def write_broken_corpus(directory: str, shape: Sequence[int] = (8, 64, 64)) -> Dict[str, str]:
    """Broken files a reader must report, not crash on; returns {file name: expected reason}.

    The garbled-spacing file is readable (reason None here): its spacing is None and only
    `missing_spacing: skip` turns it into `bad_spacing`.
    """
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(5)
    voxels = quantize(synth_reflectivity(shape, rng), 8)
    heid, zeiss = STYLES["heidelberg"], STYLES["zeiss_cirrus"]
    spacing = spacing_for(heid, shape)
    expected = {}

    def good(name: str, style: Style, **kwargs) -> bytes:
        path = os.path.join(directory, name)
        write_oct(path, voxels, spacing, style, uid_seed=name, **kwargs)
        with open(path, "rb") as f:
            return f.read()

    def raw(name: str, payload: bytes, reason: str) -> None:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(payload)
        expected[name] = reason

    native = good("_native.dcm", heid)
    j2k = good("_j2k.dcm", zeiss)
    os.remove(os.path.join(directory, "_native.dcm"))
    os.remove(os.path.join(directory, "_j2k.dcm"))
    # preamble, DICM, group length element
    meta_end = 132 + 12 + int.from_bytes(native[140:144], "little")
    pixel_start = native.rindex(b"\xe0\x7f\x10\x00")
    for name, data in (("native", native), ("j2k", j2k)):
        for cut in (meta_end - 20, meta_end + 40, len(data) // 2, len(data) - 7):
            raw(f"truncated_{name}_at_{cut}.dcm", data[:cut], "truncated")
    raw("truncated_native_in_pixel_header.dcm", native[: pixel_start + 6], "truncated")
    raw("empty.dcm", b"", "empty_file")
    raw("notes.dcm", b"Patient notes, not an image\n" * 20, "not_dicom")
    raw("meta_only.dcm", native[:meta_end], "empty_dataset")

    ds = pydicom.dcmread(io.BytesIO(native))
    del ds.PixelData
    save_dicom(ds, os.path.join(directory, "no_pixel_data.dcm"))
    expected["no_pixel_data.dcm"] = "no_pixel_data"

    ds = pydicom.dcmread(io.BytesIO(native))
    ds.NumberOfFrames = shape[0] + 3
    save_dicom(ds, os.path.join(directory, "frame_count_mismatch.dcm"))
    expected["frame_count_mismatch.dcm"] = "frame_count_mismatch"

    good("wrong_sop_class.dcm", heid, sop_class=SOP_CLASSES["en_face"])
    expected["wrong_sop_class.dcm"] = "not_oct"

    # not the CZM scheme
    good("zeiss_obfuscated.dcm", zeiss, obfuscate=True, transfer_syntax=JPEG2000Lossless)
    expected["zeiss_obfuscated.dcm"] = "undecodable"

    write_oct(
        os.path.join(directory, "tiny.dcm"), voxels[:2, :8, :8], spacing, heid, uid_seed="tiny"
    )
    expected["tiny.dcm"] = "too_small"

    ds = pydicom.dcmread(io.BytesIO(native))
    ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing = ["0", "-0.0117"]
    for item in ds.PerFrameFunctionalGroupsSequence:
        del item.PlanePositionSequence
    save_dicom(ds, os.path.join(directory, "garbled_spacing.dcm"))
    expected["garbled_spacing.dcm"] = None
    return expected


def patch_bytes(path: str, old: bytes, new: bytes) -> None:
    """Replace bytes in a written file (same length): garbles a value the way a broken exporter
    does."""
    with open(path, "rb") as f:
        data = f.read()
    if len(old) != len(new) or data.count(old) != 1:
        raise ValueError(f"{old!r} must occur once in {path} and keep its length")
    with open(path, "wb") as f:
        f.write(data.replace(old, new))


def _edit(path: str, edit) -> None:
    """Rewrite a DICOM file after edit(dataset)."""
    ds = pydicom.dcmread(path)
    edit(ds)
    save_dicom(ds, path)


def _set_frame_geometry(
    ds: Dataset,
    orientations: Sequence[Sequence[float]],
    positions: Sequence[Sequence[float]],
    stack_ids: Optional[Sequence[str]] = None,
) -> None:
    """Give each frame its own PlaneOrientation/PlanePosition (and StackID), InStackPositionNumber
    dropped."""
    for k, item in enumerate(ds.PerFrameFunctionalGroupsSequence):
        item.PlaneOrientationSequence = DicomSequence(
            [item_of(ImageOrientationPatient=list(orientations[k]))]
        )
        item.PlanePositionSequence = DicomSequence(
            [item_of(ImagePositionPatient=[round(v, 6) for v in positions[k]])]
        )
        content = item.FrameContentSequence[0]
        del content.InStackPositionNumber
        if stack_ids is not None:
            content.StackID = stack_ids[k]
    del ds.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence


def write_odd_cases(
    directory: str, shape: Sequence[int] = (12, 64, 64)
) -> Dict[str, Optional[str]]:
    """The shapes real exports take that are not clean raster volumes, each in its own file or
    series folder; returns {name: the reason a reader must give, or None for a usable volume}."""
    os.makedirs(directory, exist_ok=True)
    D, H, W = shape
    voxels = quantize(synth_reflectivity(shape, np.random.default_rng(13)), 8)
    heid, optovue = STYLES["heidelberg"], STYLES["optovue_series"]
    dz, dy, dx = spacing = spacing_for(heid, shape)
    expected = {}

    def volume(
        name: str, reason: Optional[str], style: Style = heid, frames: np.ndarray = voxels, **kwargs
    ) -> list:
        expected[name] = reason
        return write_oct(
            os.path.join(directory, name),
            frames,
            spacing,
            style,
            uid_seed=name,
            patient_id=f"ODD-{name}",
            **kwargs,
        )

    # Two stacks in one file, a horizontal and a vertical raster, without InStackPositionNumber.
    path = volume("two_stacks.dcm", "multiple_stacks", frames=np.concatenate([voxels, voxels]))[0]
    horizontal, vertical = [1, 0, 0, 0, 0, -1], [0, 1, 0, 0, 0, -1]
    _edit(
        path,
        lambda ds: _set_frame_geometry(
            ds,
            [horizontal] * D + [vertical] * D,
            [[0, k * dz, 0] for k in range(D)] + [[k * dz, 0, 0] for k in range(D)],
            ["1"] * D + ["2"] * D,
        ),
    )

    # Radial scan: the B-scan rotates 15 degrees a frame around one centre.
    path = volume("radial.dcm", "not_raster")[0]
    angles = np.deg2rad(15 * np.arange(D))
    rows = [[float(np.cos(a)), float(np.sin(a)), 0.0] for a in angles]
    _edit(
        path,
        lambda ds: _set_frame_geometry(
            ds,
            [r + [0, 0, -1] for r in rows],
            [[-W / 2 * dx * r[0], -W / 2 * dx * r[1], 0] for r in rows],
        ),
    )

    def positions(ks):
        return lambda ds: _set_frame_geometry(
            ds, [horizontal] * len(ks), [[0, k * dz, 0] for k in ks]
        )

    repeated, missing = (
        [*range(D // 2), *range(D // 2 - 1, D)],
        [k for k in range(D) if k != D // 2],
    )
    _edit(
        volume("duplicate_frames.dcm", "duplicate_frames", frames=voxels[repeated])[0],
        positions(repeated),
    )
    _edit(volume("missing_bscan.dcm", "series_gap", frames=voxels[missing])[0], positions(missing))
    gaps = np.cumsum([0] + [1.0 if k % 2 else 1.4 for k in range(D - 1)])
    path = volume("uneven_gaps.dcm", "not_raster")[0]
    _edit(path, positions(list(gaps)))

    path = volume("volumetric_flag_no.dcm", "not_raster")[0]
    _edit(path, lambda ds: setattr(ds, "OphthalmicVolumetricPropertiesFlag", "NO"))

    def thickness(value):
        def edit(ds):
            measures = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
            measures.SliceThickness = value
            del measures.SpacingBetweenSlices

        return edit

    _edit(volume("slice_thickness_zero.dcm", None)[0], thickness(0))
    _edit(volume("slice_thickness_disagrees.dcm", None)[0], thickness(round(2 * dz, 6)))

    path = volume("number_of_frames_garbled.dcm", "bad_header")[0]
    number = f"{D}".encode() + b" " * (len(str(D)) % 2)
    patch_bytes(
        path,
        b"(\x00\x08\x00IS" + len(number).to_bytes(2, "little") + number,
        b"(\x00\x08\x00IS" + len(number).to_bytes(2, "little") + number[:-1] + b"a",
    )
    path = volume("orientation_garbled.dcm", "bad_header")[0]
    patch_bytes(path, b"0.0\\0.0\\-1", b"0.0\\0.0\\-x")
    path = volume("rescale_garbled.dcm", "bad_header", rescale=(1.5, 0.0))[0]
    patch_bytes(path, b"1.5 ", b"1.x ")

    path = volume("jpeg_truncated_frame.dcm", "truncated", transfer_syntax=JPEGBaseline8Bit)[0]
    ds = pydicom.dcmread(path)
    frames = list(generate_frames(ds.PixelData, number_of_frames=D))
    frames[D // 2] = frames[D // 2][: len(frames[D // 2]) // 2]
    ds.PixelData = encapsulate(frames)
    save_dicom(ds, path)

    path = volume("trailing_bytes.dcm", None)[0]
    with open(path, "ab") as f:
        f.write(b"\x00" * 16)
    volume("zeiss_cirrus_czm.dcm", None, style=STYLES["zeiss_cirrus"])

    # One file per B-scan: a copied file, a missing file, files without any tag that orders them.
    paths = volume("series_with_copy", None, style=optovue)
    shutil.copy(paths[0], os.path.join(directory, "series_with_copy", "copy_of_first.dcm"))
    paths = volume("series_missing_bscan", "series_gap", style=optovue)
    os.remove(paths[D // 2])

    def unordered(ds):
        del ds.ImagePositionPatient, ds.InstanceNumber

    for p in volume("series_without_order", "no_stack_order", style=optovue):
        _edit(p, unordered)
    return expected
