"""OCT DICOM files -> index records and volumes: find the files of a source, read one file or one series into a
Volume [D,H,W] with its spacing, scan a whole source into an index that says, for every file, why it can or cannot
be trained on. data.py turns a Volume into training batches; `python data.py scan SRC` is this module's command.

Reading a file: parse (pydicom; pixel data not decoded) -> Header (maker, size, bit depth, per-frame geometry,
spacing tags, a hash of PatientID) -> decode every frame with pydicom's plugins (every transfer syntax they decode,
never a rewritten syntax: incident 11) -> MONOCHROME1 and rescale -> order the B-scans into one stack (_layout).
Only one stack of parallel, evenly spaced B-scans is a volume (a gap of 1.5 spacings is a missing B-scan); the
B-scan spacing comes from the frame positions when they exist. Whatever is wrong with a file, the reader raises
UnusableFile with a stable reason code (REASONS), never another exception; a file that scan_files accepts is one
read_volume reads (scan decodes every frame too).

Finding files: a folder (recursive), a glob, a gs:// prefix or glob, or a manifest (a TSV/CSV with a `filepath`
column); hidden files and sidecars are left out. The index (one JSON line per volume or rejected file) records what
it was built from, and update_index scans again only new and changed files, read errors and the series a new file
joins.

Maker quirks (what the reader does for each maker; everything else takes the standard's generic path):
- Heidelberg Engineering (Spectralis): nothing maker-specific; multi-frame files whose spacing may sit in a frame's
  functional groups, the shared groups or the top level are looked up in that order (_places).
- Topcon (Triton, Maestro2): JPEG 2000 lossless or lossy 8-bit frames, decoded for real by pylibjpeg-openjpeg
  (_decode_as_stored; incident 11: the old reader rewrote the transfer syntax instead, and 10-20% of the
  Topcon/Zeiss files looked "corrupt"). A frame cut before its end marker is `truncated` (_decode_encapsulated).
- Zeiss (Carl Zeiss Meditec, Cirrus): JPEG 2000 frames scrambled the CZM way are unscrambled (_czm_scrambled decides
  from the Manufacturer and the frame signatures; unscramble_czm undoes the public scheme of
  https://github.com/pydicom/pydicom/discussions/1618; the full decode verifies it); PixelSpacing written as one
  string with a comma and a NUL ("0.0039,0.0113\\x00") is parsed (_numbers); frames stored in reverse stack order
  are put in order by their positions or InStackPositionNumber (_layout).
- One file per B-scan (e.g. Optovue): the files of a series are ordered by ImagePositionPatient, else
  InStackPositionNumber, DimensionIndexValues or InstanceNumber (_layout); a copied file (same SOPInstanceUID) is
  listed as `duplicate_instance` and the original is used.
"""
import csv
import glob
import hashlib
import io
import json
import math
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from tqdm import tqdm

from config import ConfigError
from storage import gcs_filesystem, read_bytes, write_atomic

# ----------------------------------------------------------------------------------------------------------
# Reading OCT DICOM
# ----------------------------------------------------------------------------------------------------------

OPT_SOP = "1.2.840.10008.5.1.4.1.1.77.1.5.4"  # Ophthalmic Tomography Image Storage
MIN_SHAPE = (4, 32, 32)  # [D,H,W]: a smaller volume holds too little to crop a training sample from
SPACING_RANGE_MM = (1e-4, 5.0)  # plausible OCT voxel sizes; a value outside is garbled
SPACING_TOLERANCE = 0.1  # SliceThickness further than this share from the positions' gap is reported
GAP_TOLERANCE = 0.2  # B-scan gaps within this share of their median are even; 1.5x or more is a missing B-scan
ORIENTATION_TOLERANCE = 1e-3  # direction cosines closer than this are the same orientation
SIDECAR_EXTENSIONS = (".csv", ".tsv", ".json", ".jsonl", ".txt", ".md", ".yaml", ".yml", ".log")
CZM_MANUFACTURER = "Carl Zeiss Meditec"
JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"  # the first box of a JP2 file
J2K_START = b"\xff\x4f\xff\x51"  # a JPEG 2000 codestream: SOC then SIZ
# Encapsulated frames of these syntaxes end with an EOI/EOC marker: a frame without one was cut (a JPEG decoder
# fills the rest with grey without an error).
EOI_SYNTAXES = frozenset(pydicom.uid.JPEGTransferSyntaxes + pydicom.uid.JPEGLSTransferSyntaxes
                         + pydicom.uid.JPEG2000TransferSyntaxes)

REASONS = {  # stable codes used in the scan index, events.jsonl and NoUsableData -> what they mean
    "empty_file": "the file has 0 bytes",
    "not_dicom": "not a DICOM file (no DICM prefix)",
    "truncated": "the file or one of its frames ends before its data does (interrupted copy or upload)",
    "empty_dataset": "pydicom read no data elements",
    "read_error": "the file could not be read (missing, permissions, network); checked again by the next run",
    "not_oct": "another object (en-face, fundus, analysis, report...); --sop_classes any accepts generic images",
    "not_image": "no pixel data and not an OCT object (report, analysis, DICOMDIR...)",
    "not_grayscale": "a colour image (more than one sample per pixel)",
    "duplicate_instance": "a copy of another file (same SOPInstanceUID): the other one is used",
    "no_pixel_data": "an OCT object without PixelData",
    "bad_header": "tags missing, garbled or inconsistent (Rows, NumberOfFrames, orientation, rescale...)",
    "frame_count_mismatch": "the pixel data holds another number of frames than NumberOfFrames says",
    "undecodable": "the pixel data could not be decoded (corrupt stream, or obfuscated otherwise than Zeiss CZM)",
    "not_raster": "not parallel, evenly spaced B-scans (radial or circle scan, uneven gaps, volumetric flag NO)",
    "multiple_stacks": "more than one stack of B-scans in one volume (e.g. a horizontal and a vertical raster)",
    "duplicate_frames": "two B-scans at the same place or with the same stack position",
    "series_gap": "B-scans missing from the stack (a gap of 1.5 spacings or more, or a missing stack number)",
    "no_stack_order": "one file per B-scan, without positions, InStackPositionNumber or InstanceNumber to order them",
    "too_small": f"fewer voxels than {list(MIN_SHAPE)} [D,H,W]",
    "bad_spacing": "voxel spacing missing or garbled, and missing_spacing is skip",
    "blank": "constant intensity: nothing to learn from",
}
# Other objects and copies: listed, not bad files.
BENIGN_REASONS = ("not_dicom", "not_oct", "not_image", "not_grayscale", "duplicate_instance")
TRANSIENT_REASONS = ("read_error",)  # may pass on another try: a reused index checks these files again


class UnusableFile(Exception):
    """An input that cannot be trained on: `reason` is a stable code of REASONS, `detail` says more; `series` is
    the file's SeriesInstanceUID when it was read that far (a bad file makes its whole series bad)."""

    def __init__(self, reason: str, detail: str = "", manufacturer: str = "", model: str = "", series: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.manufacturer, self.model = reason, detail, manufacturer, model
        self.series = series

    def __reduce__(self):  # keep the fields across processes (DataLoader workers, prepare pool)
        return UnusableFile, (self.reason, self.detail, self.manufacturer, self.model, self.series)


@dataclass
class Volume:
    """One OCT volume as stored: voxels [D,H,W] = frames, rows, columns in stack order."""
    voxels: np.ndarray  # native dtype (uint8/uint16/int16), float32 when RescaleSlope/Intercept apply
    spacing: Optional[Tuple[float, float, float]]  # (dz, dy, dx) mm; None when missing or garbled
    manufacturer: str
    model: str
    source: str  # path or URL (the first file of a series)
    spacing_issue: Optional[str] = None  # why spacing is None, or how the spacing tags disagree with positions


@dataclass
class Frame:
    """Where one B-scan lies, from its tags."""
    orientation: Optional[np.ndarray]  # [6] ImageOrientationPatient: row and column direction cosines
    position: Optional[np.ndarray]  # [3] ImagePositionPatient, mm
    stack_id: Optional[str]
    in_stack: Optional[int]  # InStackPositionNumber
    dimension_index: Optional[Tuple[int, ...]]  # DimensionIndexValues
    instance: Optional[int]  # InstanceNumber of a single-frame file


@dataclass
class Header:
    """What the reader takes from the tags of one image file, parsed once for scan and read alike."""
    path: str
    manufacturer: str
    model: str
    frames: int
    rows: int
    cols: int
    bits: int
    transfer_syntax: str
    sop_uid: str
    series: str  # SeriesInstanceUID, else the path
    patient: str  # see _patient_key
    slope: float
    intercept: float
    geometry: List[Frame]  # one per per-frame group (frames of a valid file); empty for a file without them
    raster_flag: Optional[str]  # OphthalmicVolumetricPropertiesFlag: YES, NO or None
    pixel_spacing: Optional[Tuple[float, float]]  # (dy, dx) mm
    slice_spacing: Optional[Tuple[str, float]]  # (tag name, mm) of SpacingBetweenSlices or SliceThickness
    spacing_error: Optional[str]  # why the spacing tags could not be parsed


def _ends_cleanly(ds: pydicom.Dataset, f, size: int) -> bool:
    """False when the file `f` stops inside an element: pydicom then silently drops or shortens it, and returns an
    empty dataset for a JPEG 2000 file cut inside its pixel data (with only a warning, not an error). Bytes after
    the last element are padding (some writers add it), unless they start a next element cut inside its header."""
    if len(ds) == 0:
        meta_length = ds.file_meta.get("FileMetaInformationGroupLength")
        return meta_length is None or 132 + 12 + meta_length == size  # only a meta header: empty, not cut
    last_tag = max(ds.keys())
    last = ds.get_item(last_tag)
    if last is None or not getattr(last, "is_raw", False) or last.length == 0xFFFFFFFF:
        return True
    end = last.value_tell + last.length
    if end >= size:
        return end == size
    f.seek(end)
    rest = f.read(4)
    order = "little" if ds.file_meta.get("TransferSyntaxUID", pydicom.uid.ExplicitVRLittleEndian) != \
        pydicom.uid.ExplicitVRBigEndian else "big"
    next_tag = (int.from_bytes(rest[:2], order) << 16) | int.from_bytes(rest[2:4], order)
    return len(rest) < 4 or not last_tag < next_tag < 0xFFFE0000


def _parse(path: str) -> pydicom.Dataset:
    """The DICOM dataset of one file (pixel data not decoded)."""
    try:
        if path.startswith("gs://"):
            data = gcs_filesystem().cat_file(path)  # one request; gcsfs's default read cache made pydicom 1000x slower
            f, size = io.BytesIO(data), len(data)
        else:
            f = open(path, "rb")  # pydicom reads the file directly: one copy of the pixel data, not two
            size = os.fstat(f.fileno()).st_size
    except Exception as e:  # missing file, permissions, network: the file is unusable, the run goes on
        raise UnusableFile("read_error", f"{type(e).__name__}: {e}") from None
    if size == 0:
        raise UnusableFile("empty_file", "0 bytes")
    with f:
        try:
            ds = pydicom.dcmread(f)
            cut = not _ends_cleanly(ds, f, size)
        except InvalidDicomError as e:
            raise UnusableFile("not_dicom", str(e).split(".")[0]) from None
        except EOFError as e:
            raise UnusableFile("truncated", f"{size} bytes: {e}") from None
        except OSError as e:  # the storage failed while reading: may pass next time
            raise UnusableFile("read_error", f"{type(e).__name__}: {e}") from None
        except Exception as e:  # the parser met garbage: the same next time
            raise UnusableFile("bad_header", f"pydicom cannot parse it: {type(e).__name__}: {e}") from None
    if cut:
        what = "pydicom returned an empty dataset" if len(ds) == 0 else f"{len(ds)} elements read"
        raise UnusableFile("truncated", f"{size} bytes, {what}")
    if len(ds) == 0:
        raise UnusableFile("empty_dataset", "no data elements after the file meta information")
    return ds


def _maker(ds: pydicom.Dataset) -> Tuple[str, str]:
    return str(ds.get("Manufacturer", "") or ""), str(ds.get("ManufacturerModelName", "") or "")


def _groups(ds: pydicom.Dataset, name: str) -> List[pydicom.Dataset]:
    seq = ds.get(name)
    return list(seq) if seq else []


def _places(ds: pydicom.Dataset, macro: str, item: Optional[pydicom.Dataset] = None) -> List[pydicom.Dataset]:
    """Where the tags of a functional-group macro may be, in order: a frame's own groups (`item`, else the first
    frame's), the shared groups, the top level."""
    frame = [item] if item is not None else _groups(ds, "PerFrameFunctionalGroupsSequence")[:1]
    groups = frame + _groups(ds, "SharedFunctionalGroupsSequence")[:1]
    return [place for group in groups for place in _groups(group, macro)[:1]] + [ds]


def _first(places: Sequence[pydicom.Dataset], *names: str):
    """The first value of the given tags found in the places, in order."""
    for place in places:
        for name in names:
            value = place.get(name)
            if value is not None and value != "":
                return value
    return None


def _numbers(place: pydicom.Dataset, name: str) -> Optional[List[float]]:
    """The values of a decimal/integer string tag (DS, IS), None when absent. Also reads the Zeiss Cirrus way of
    writing them, one string with commas and a NUL ("0.0039,0.0113\\x00"). Raises ValueError on garbage."""
    element = place.get_item(name)
    value = None if element is None else element.value
    if value is None:
        return None
    if isinstance(value, bytes):  # not converted yet: the raw string
        text = value.decode("latin-1")
    elif isinstance(value, (list, pydicom.multival.MultiValue)):
        text = "\\".join(map(str, value))
    else:
        text = str(value)
    text = text.replace("\x00", " ").strip()
    return [float(v) for v in re.split(r"[\\,]", text)] if text else None


def _first_numbers(places: Sequence[pydicom.Dataset], *names: str) -> Optional[Tuple[str, List[float]]]:
    """(tag name, values) of the first of the tags found in the places, in order."""
    for place in places:
        for name in names:
            values = _numbers(place, name)
            if values is not None:
                return name, values
    return None


def _scalar(places: Sequence[pydicom.Dataset], name: str, default: float) -> float:
    """One finite number of a DS tag found in the places, else `default`."""
    found = _first_numbers(places, name)
    return default if found is None else float(_vector(found, 1)[0])


def _count(value: Optional[List[float]], name: str, default: Optional[int] = None) -> Optional[int]:
    """One positive integer of an IS tag."""
    if value is None:
        return default
    if len(value) != 1 or not value[0].is_integer() or value[0] < 1:
        raise ValueError(f"{name} {value} is not a positive integer")
    return int(value[0])


def _vector(found: Optional[Tuple[str, List[float]]], size: int) -> Optional[np.ndarray]:
    if found is None:
        return None
    name, values = found
    vector = np.array(values, dtype=np.float64)
    if len(vector) != size or not np.isfinite(vector).all():
        raise ValueError(f"{name} {values} needs {size} finite numbers")
    return vector


def _frame(ds: pydicom.Dataset, item: Optional[pydicom.Dataset], single: bool) -> Frame:
    """The geometry of one frame: a per-frame group item of a multi-frame file, or a single-frame file (item None
    or its one per-frame item). Raises ValueError on garbled tags."""
    orientation = _vector(_first_numbers(_places(ds, "PlaneOrientationSequence", item), "ImageOrientationPatient"), 6)
    if orientation is not None and np.linalg.norm(np.cross(orientation[:3], orientation[3:])) < 0.5:
        raise ValueError(f"ImageOrientationPatient {list(orientation)}: row and column are not orthogonal unit vectors")
    own = [] if item is None else [item]  # a multi-frame file's top level describes no single frame
    top = [ds] if single else []
    position_places = [p for i in own for p in _groups(i, "PlanePositionSequence")[:1]] + top
    position = _vector(_first_numbers(position_places, "ImagePositionPatient"), 3)
    content = [p for i in own for p in _groups(i, "FrameContentSequence")[:1] + [i]] + top
    in_stack = _first(content, "InStackPositionNumber")
    dimension_index = _first(content, "DimensionIndexValues")
    stack_id = _first(content, "StackID")
    instance = _scalar([ds], "InstanceNumber", math.nan) if single else math.nan
    if not (math.isnan(instance) or instance.is_integer()):
        raise ValueError(f"InstanceNumber {instance} is not an integer")
    return Frame(orientation, position, None if stack_id is None else str(stack_id),
                 None if in_stack is None else int(in_stack),
                 None if dimension_index is None else tuple(int(v) for v in np.atleast_1d(dimension_index)),
                 None if math.isnan(instance) else int(instance))


def _patient_key(ds: pydicom.Dataset, path: str) -> str:
    """A hash of PatientID (the index holds no identifiers), else the file: the unit of the train/val split."""
    patient = str(ds.get("PatientID", "") or "").strip()
    return hashlib.sha256(patient.encode()).hexdigest()[:16] if patient else f"file:{path}"


def _spacing_tags(ds: pydicom.Dataset):
    """(pixel spacing (dy, dx), (tag, B-scan spacing), error): the first value found (a frame's groups, shared groups,
    top level) is used; a garbled one is reported, never silently replaced by a value found later."""
    places = _places(ds, "PixelMeasuresSequence")
    try:
        pixel = _vector(_first_numbers(places, "PixelSpacing"), 2)
        found = _first_numbers(places, "SpacingBetweenSlices", "SliceThickness")
        slice_spacing = None if found is None else (found[0], float(_vector(found, 1)[0]))
    except ValueError as e:
        return None, None, f"garbled: {e}"
    return None if pixel is None else (float(pixel[0]), float(pixel[1])), slice_spacing, None


def _header(ds: pydicom.Dataset, path: str, sop_classes: str) -> Header:
    """The Header of an image that `sop_classes` accepts. Raises UnusableFile; ValueError/TypeError on garbled tags."""
    sop = str(ds.get("SOPClassUID", "") or ds.file_meta.get("MediaStorageSOPClassUID", ""))
    sop_name = pydicom.uid.UID(sop).name if sop else "no SOPClassUID"
    if sop_classes == "oct" and sop != OPT_SOP:
        raise UnusableFile("not_oct", sop_name)
    if "PixelData" not in ds:
        raise UnusableFile("no_pixel_data" if sop == OPT_SOP else "not_image", sop_name)
    if int(ds.get("SamplesPerPixel", 1) or 1) != 1:
        raise UnusableFile("not_grayscale", f"SamplesPerPixel {ds.SamplesPerPixel}")
    rows, cols, bits = ds.get("Rows"), ds.get("Columns"), ds.get("BitsAllocated")
    if not rows or not cols or bits not in (8, 16):
        raise UnusableFile("bad_header", f"Rows {rows}, Columns {cols}, BitsAllocated {bits}")
    frames = _count(_numbers(ds, "NumberOfFrames"), "NumberOfFrames", 1)
    transform = _places(ds, "PixelValueTransformationSequence")
    slope, intercept = _scalar(transform, "RescaleSlope", 1.0), _scalar(transform, "RescaleIntercept", 0.0)
    if slope == 0:
        raise ValueError("RescaleSlope 0")
    items = _groups(ds, "PerFrameFunctionalGroupsSequence")
    if frames == 1:
        geometry = [_frame(ds, items[0] if items else None, single=True)]
    else:
        geometry = [_frame(ds, item, single=False) for item in items]
    flag = ds.get("OphthalmicVolumetricPropertiesFlag")
    pixel_spacing, slice_spacing, spacing_error = _spacing_tags(ds)
    manufacturer, model = _maker(ds)
    return Header(path, manufacturer, model, frames, int(rows), int(cols), int(bits),
                  ds.file_meta.TransferSyntaxUID.name, str(ds.get("SOPInstanceUID", "") or ""),
                  str(ds.get("SeriesInstanceUID", "") or path), _patient_key(ds, path), slope, intercept, geometry,
                  None if flag is None else str(flag).upper(), pixel_spacing, slice_spacing, spacing_error)


def unscramble_czm(frame: bytes) -> bytes:
    """A Zeiss Cirrus (CZM) JPEG 2000 frame as the plain JP2 file it hides: every 7th byte XORed with 0x5A and
    eight blocks put back in place (the public scheme of https://github.com/pydicom/pydicom/discussions/1618).
    Raises ValueError when no JP2 header shows up where the scheme puts it."""
    data = np.frombuffer(frame, np.uint8).copy()
    data[::7] ^= 0x5A
    data = data.tobytes()
    offset = len(data) * 3 // 5  # where Cirrus puts the JP2 header; else the signature box is searched for
    if data[offset:offset + len(JP2_SIGNATURE)] != JP2_SIGNATURE:
        offset = data.find(JP2_SIGNATURE)
    if offset < 1016 or offset + 253 > len(data):
        raise ValueError("no JP2 signature box after unscrambling: not a CZM-scrambled frame")
    blocks = ((offset, offset + 253), (993, 1016), (276, 763), (23, 276), (1016, offset), (0, 23), (763, 993),
              (offset + 253, len(data)))
    return b"".join(data[a:b] for a, b in blocks)


def _encoded_frames(ds: pydicom.Dataset, frames: int) -> List[bytes]:
    """The encapsulated frames: exactly NumberOfFrames of them."""
    try:
        found = list(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=frames))
    except Exception as e:  # fewer fragments than frames, broken item tags
        raise UnusableFile("frame_count_mismatch", f"NumberOfFrames {frames}: {e}") from None
    if len(found) != frames:
        raise UnusableFile("frame_count_mismatch", f"{len(found)} encoded frames, NumberOfFrames {frames}")
    return found


def _check_native_size(ds: pydicom.Dataset, h: Header) -> None:
    """Native pixel data holds exactly NumberOfFrames frames."""
    frame_bytes = h.rows * h.cols * h.bits // 8
    size = len(ds.PixelData)
    if size // frame_bytes != h.frames or size % frame_bytes > 1:  # one padding byte is allowed
        raise UnusableFile("frame_count_mismatch", f"{size / frame_bytes:g} frames of {h.rows}x{h.cols} in "
                                                   f"{size} bytes, NumberOfFrames {h.frames}")


def _decode_as_stored(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W] in file order, decoded by the plugins (pylibjpeg-openjpeg for JPEG 2000), never a
    rewritten syntax (incident 11)."""
    syntax = ds.file_meta.TransferSyntaxUID
    ds.NumberOfFrames = h.frames  # as parsed: pydicom would choke on a garbled string
    try:
        voxels = ds.pixel_array
    except Exception as e:
        raise UnusableFile("undecodable", f"{syntax.name}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if voxels.size != h.frames * h.rows * h.cols:
        raise UnusableFile("undecodable", f"{syntax.name}: decoded {voxels.shape}, expected "
                                          f"{h.frames}x{h.rows}x{h.cols}")
    return voxels.reshape(h.frames, h.rows, h.cols)


def _czm_scrambled(ds: pydicom.Dataset, h: Header, encoded: Sequence[bytes]) -> bool:
    """A Zeiss Cirrus JPEG 2000 file whose frames are neither a JP2 file nor a J2K codestream as stored."""
    return (h.manufacturer.startswith(CZM_MANUFACTURER)
            and ds.file_meta.TransferSyntaxUID in (pydicom.uid.JPEG2000Lossless, pydicom.uid.JPEG2000)
            and not all(f.startswith(JP2_SIGNATURE) or f.startswith(J2K_START) for f in encoded))


def _decode_encapsulated(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W]; a scrambled Zeiss Cirrus stream is unscrambled first (the full decode verifies it).
    Every frame of a JPEG family syntax must end with its end marker."""
    encoded = _encoded_frames(ds, h.frames)
    if _czm_scrambled(ds, h, encoded):
        try:
            encoded = [unscramble_czm(frame) for frame in encoded]
        except ValueError as e:
            raise UnusableFile("undecodable", f"Zeiss CZM stream: {e}") from None
        ds.PixelData = pydicom.encaps.encapsulate(encoded)
    voxels = _decode_as_stored(ds, h)
    if ds.file_meta.TransferSyntaxUID in EOI_SYNTAXES:
        for k, frame in enumerate(encoded):
            if b"\xff\xd9" not in frame[-4:]:  # the end marker, then at most padding (a 0, or a 0 XORed by CZM)
                raise UnusableFile("truncated", f"frame {k} of {h.frames} has no end marker: the stream was cut")
    return voxels


def _pixels(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W] in file order, after MONOCHROME1 inversion and rescale."""
    if ds.file_meta.TransferSyntaxUID.is_encapsulated:
        voxels = _decode_encapsulated(ds, h)
    else:
        _check_native_size(ds, h)
        voxels = _decode_as_stored(ds, h)
    if ds.get("PhotometricInterpretation") == "MONOCHROME1":  # stored with black as the maximum
        voxels = (2 ** int(ds.get("BitsStored", h.bits)) - 1 - voxels if voxels.dtype.kind == "u"
                  else ~voxels).astype(voxels.dtype)
    if (h.slope, h.intercept) != (1.0, 0.0):
        voxels = voxels.astype(np.float32) * np.float32(h.slope) + np.float32(h.intercept)
    return voxels


def _read_file(path: str, sop_classes: str) -> Tuple[Header, np.ndarray]:
    """(header, all frames [F,H,W] in file order) of one file. Any failure is an UnusableFile with a reason:
    garbled tags that break the reader are `bad_header`, never an exception of another kind."""
    ds = _parse(path)
    manufacturer, model = _maker(ds)
    series = str(ds.get("SeriesInstanceUID", "") or "")
    try:
        header = _header(ds, path, sop_classes)
        pixels = _pixels(ds, header)
        if header.geometry and len(header.geometry) != header.frames:
            raise UnusableFile("bad_header", f"{len(header.geometry)} per-frame groups for {header.frames} frames")
        return header, pixels
    except UnusableFile as e:
        raise UnusableFile(e.reason, e.detail, manufacturer, model, series) from None
    except Exception as e:  # garbled values that the checks above did not name
        raise UnusableFile("bad_header", f"{type(e).__name__}: {e}", manufacturer, model, series) from None


def _order_by_position(frames: Sequence[Frame]) -> Tuple[np.ndarray, float]:
    """(stack order, B-scan gap in mm) of frames that all have a position: sorted along the stack normal, the gaps
    must be even (a gap of 1.5 or more is a missing B-scan; 0 a duplicate)."""
    positions = np.stack([f.position for f in frames])  # [F,3]
    orientation = frames[0].orientation
    if orientation is not None:
        normal = np.cross(orientation[:3], orientation[3:])
    else:
        normal = positions[-1] - positions[0]
        normal = normal / max(float(np.linalg.norm(normal)), 1e-12)
    along = positions @ normal  # [F] mm
    order = np.argsort(along, kind="stable")
    gaps = np.diff(along[order])  # [F-1]
    gap = float(np.median(gaps))
    if gap <= 0 or (gaps < 0.01 * gap).any():
        raise UnusableFile("duplicate_frames", f"{int((gaps < 0.01 * max(gap, 1e-9)).sum())} B-scans at the same "
                                               f"position along the stack")
    relative = gaps / gap
    if relative.max() >= 1.5:
        raise UnusableFile("series_gap", f"a gap of {relative.max():.1f} B-scan spacings ({gaps.max():.4g} mm) after "
                                         f"B-scan {int(relative.argmax())} of {len(frames)}")
    if np.abs(relative - 1).max() > GAP_TOLERANCE:
        raise UnusableFile("not_raster", f"uneven B-scan gaps {gaps.min():.4g}..{gaps.max():.4g} mm")
    return order, gap


def _order_by_number(frames: Sequence[Frame], series: bool) -> np.ndarray:
    """Stack order from InStackPositionNumber, else DimensionIndexValues, else InstanceNumber: the first key that
    every frame has, which must not repeat (and, for the numbers, not skip). Frames of a multi-frame file without
    any key keep the stored order; files of a series without any key cannot be ordered."""
    keys = (("InStackPositionNumber", lambda f: f.in_stack), ("DimensionIndexValues", lambda f: f.dimension_index),
            ("InstanceNumber", lambda f: f.instance))
    for name, key_of in keys:
        values = [key_of(f) for f in frames]
        if any(v is None for v in values):
            continue
        if len(set(values)) < len(values):
            raise UnusableFile("duplicate_frames", f"{name} repeats: {len(values) - len(set(values))} frames")
        if name != "DimensionIndexValues" and max(values) - min(values) + 1 != len(values):
            raise UnusableFile("series_gap", f"{name} {min(values)}..{max(values)} for {len(values)} B-scans")
        return np.array(sorted(range(len(values)), key=values.__getitem__))
    if series:
        raise UnusableFile("no_stack_order", f"{len(frames)} files without ImagePositionPatient, "
                                             f"InStackPositionNumber or InstanceNumber")
    return np.arange(len(frames))


def _check_one_stack(frames: Sequence[Frame]) -> None:
    """All frames belong to one stack of parallel B-scans."""
    stacks = {f.stack_id for f in frames if f.stack_id is not None}
    if len(stacks) > 1:
        raise UnusableFile("multiple_stacks", f"StackID {', '.join(sorted(stacks))}")
    orientations = [f.orientation for f in frames if f.orientation is not None]
    if not orientations or max(np.abs(o - orientations[0]).max() for o in orientations) <= ORIENTATION_TOLERANCE:
        return
    groups = Counter(tuple(np.round(o, 2)) for o in orientations)
    if min(groups.values()) >= MIN_SHAPE[0]:
        raise UnusableFile("multiple_stacks", f"{len(groups)} B-scan orientations of "
                                              f"{', '.join(map(str, groups.values()))} frames")
    raise UnusableFile("not_raster", f"the B-scan orientation changes between frames ({len(groups)} orientations "
                                     f"in {len(frames)} frames: a radial or circle scan)")


def _layout(headers: Sequence[Header]) -> Tuple[List[Tuple[int, int]], Optional[Tuple[float, float, float]],
                                               Optional[str], List[int]]:
    """How one multi-frame file, or the single-frame files of one series, form a volume:
    ((file, frame) pairs in stack order, spacing (dz, dy, dx) mm or None, spacing note, shape [D,H,W]).

    Only one stack of parallel, evenly spaced B-scans is a volume; raises UnusableFile otherwise.
    """
    first = headers[0]
    if len(headers) > 1 and any((h.frames, h.rows, h.cols, h.bits) != (1, first.rows, first.cols, first.bits)
                                for h in headers):
        raise UnusableFile("bad_header", "a series needs single-frame files of one size and bit depth: "
                                         f"{sorted({(h.frames, h.rows, h.cols, h.bits) for h in headers})}")
    if any(h.raster_flag == "NO" for h in headers):
        raise UnusableFile("not_raster", "OphthalmicVolumetricPropertiesFlag NO")
    pairs = [(i, k) for i, h in enumerate(headers) for k in range(h.frames)]
    shape = [len(pairs), first.rows, first.cols]
    if any(n < m for n, m in zip(shape, MIN_SHAPE)):
        raise UnusableFile("too_small", f"shape {shape} < {list(MIN_SHAPE)}")
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


def _spacing(h: Header, gap: Optional[float]) -> Tuple[Optional[Tuple[float, float, float]], Optional[str]]:
    """((dz, dy, dx) mm or None, note). PixelSpacing is [axial, lateral]; the B-scan spacing is the gap between the
    frame positions when they exist, else SpacingBetweenSlices or SliceThickness. The note says why the spacing is
    None, or that the spacing tag disagrees with the positions by more than SPACING_TOLERANCE."""
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
        return spacing, f"{h.slice_spacing[0]} {tag_dz:g} mm disagrees with the B-scan positions' gap {gap:.6g} mm " \
                        f"(the positions are used)"
    return spacing, None


def source_paths(source: Union[str, Sequence[str]]) -> List[str]:
    """The files of a read_volume source: a path or gs:// URL, the candidate files under a local folder (find_files),
    or a list of paths."""
    if isinstance(source, str):
        return find_files(source) if os.path.isdir(source) else [source]
    return list(source)


def _unique_instances(headers: Sequence[Header]) -> Tuple[List[Header], List[Tuple[Header, Header]]]:
    """(headers without copies, [(copy, original)]): files with the SOPInstanceUID of an earlier file are copies."""
    seen, unique, copies = {}, [], []
    for h in headers:
        if h.sop_uid and h.sop_uid in seen:
            copies.append((h, seen[h.sop_uid]))
        else:
            seen.setdefault(h.sop_uid or h.path, h)
            unique.append(h)
    return unique, copies


def read_volume(source: Union[str, Sequence[str]], sop_classes: str = "oct") -> Volume:
    """The OCT volume of a path, a gs:// URL, or a series (a list of paths or a local folder, one file per B-scan).

    Raises UnusableFile with a stable reason code when the input cannot be used, whatever is wrong with it.
    """
    files = [_read_file(p, sop_classes) for p in source_paths(source)]
    pixels = {id(h): frames for h, frames in files}  # frames [F,H,W] of each file
    headers, _ = _unique_instances([h for h, _ in files])
    first = headers[0]
    try:
        pairs, spacing, note, _ = _layout(headers)
        voxels = np.stack([pixels[id(headers[i])][k] for i, k in pairs])  # [D,H,W]
    except UnusableFile as e:
        raise UnusableFile(e.reason, e.detail, first.manufacturer, first.model, first.series) from None
    except Exception as e:  # a combination of tags that the checks did not name
        raise UnusableFile("bad_header", f"{type(e).__name__}: {e}", first.manufacturer, first.model) from None
    return Volume(voxels, spacing, first.manufacturer, first.model, first.path, note)


# ----------------------------------------------------------------------------------------------------------
# Finding files and scanning them
# ----------------------------------------------------------------------------------------------------------

def _is_candidate(path: str) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return not name.startswith(".") and not name.lower().endswith(SIDECAR_EXTENSIONS) and name != "DICOMDIR"


def _manifest_paths(manifest_path: str, root: Optional[str]) -> List[str]:
    """The `filepath` column of a TSV/CSV manifest; relative paths are relative to root (else the manifest's folder)."""
    text = read_bytes(manifest_path).decode("utf-8-sig")
    first_line = text.split("\n", 1)[0]
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t" if "\t" in first_line else ","))
    if not rows or "filepath" not in rows[0]:
        raise ConfigError(f"manifest_path: {manifest_path} needs a header with a `filepath` column "
                          f"(found {first_line[:200]!r}).")
    if root is None:
        root = os.path.dirname(manifest_path) or "."
    return [p if p.startswith("gs://") or os.path.isabs(p) else f"{root.rstrip('/')}/{p}"
            for p in (r["filepath"].strip() for r in rows) if p]


def _walk(folder: str) -> List[str]:
    """Every file under a local folder, following symlinked sub-folders like a glob does (each real folder once,
    so a link back up is no loop); hidden folders (.git, writers' temp folders) are left out."""
    paths, seen = [], set()
    for parent, subfolders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = [f for f in subfolders if not f.startswith(".")]
        paths += [os.path.join(parent, f) for f in files]
    return paths


def list_sources(data_root: Optional[str], manifest_path: Optional[str] = None) -> Dict[str, str]:
    """{path: identity} of every candidate file of a source, sorted by path: the manifest's `filepath` column when
    given, else data_root as a folder (recursive), a glob or a single file, local or gs://. Hidden files and
    sidecars (csv, json, txt...) are left out. The identity (source_identity) of a gs:// folder's objects comes with
    the listing; gs:// paths of a manifest are not looked up one by one ('': a new manifest is what counts)."""
    if manifest_path is not None:
        paths = set(_manifest_paths(manifest_path, data_root))
        return {p: "" if p.startswith("gs://") else source_identity(p) for p in sorted(paths)}
    if data_root is None:
        raise ConfigError("data_root: give a folder, glob or gs:// prefix of DICOM files (or a manifest_path).")
    is_glob = any(c in data_root for c in "*?[")
    if data_root.startswith("gs://"):
        fs = gcs_filesystem()
        found = fs.glob(data_root, detail=True) if is_glob else fs.find(data_root, detail=True)
        listing = {"gs://" + name: _gcs_version(info) for name, info in found.items() if info.get("type") == "file"}
    elif is_glob:
        listing = {p: source_identity(p) for p in glob.glob(data_root, recursive=True) if os.path.isfile(p)}
    elif os.path.isdir(data_root):
        listing = {p: source_identity(p) for p in _walk(data_root)}
    elif os.path.isfile(data_root):
        listing = {data_root: source_identity(data_root)}
    else:
        raise ConfigError(f"data_root: {data_root!r} is not a folder, glob or file.")
    return {p: listing[p] for p in sorted(listing) if _is_candidate(p)}


def find_files(data_root: Optional[str], manifest_path: Optional[str] = None) -> List[str]:
    """Every candidate file of a source, sorted (see list_sources)."""
    return list(list_sources(data_root, manifest_path))


def _gcs_version(info: dict) -> str:
    version = info.get("generation") or info.get("etag") or info.get("md5Hash") or info.get("updated")
    return f"{info.get('size')}:{version}"


def source_identity(path: str) -> str:
    """What changes when a file is written again: size and mtime (local), generation or etag (gs://); '' if gone."""
    try:
        if path.startswith("gs://"):
            return _gcs_version(gcs_filesystem().info(path))
        stat = os.stat(path)
        return f"{stat.st_size}:{stat.st_mtime_ns}"
    except Exception:  # gone or unreadable: the scan says why
        return ""


def inspect_file(path: str, sop_classes: str = "oct") -> Header:
    """The Header of one file after reading it as read_volume does, every frame decoded, so that a file the scan
    accepts is one the loader reads. Raises UnusableFile."""
    header, _ = _read_file(path, sop_classes)
    return header


def _reject(paths: Sequence[str], error: UnusableFile, identities: Dict[str, str]) -> dict:
    return {"paths": list(paths), "sources": [identities.get(p, "") for p in paths], "ok": False,
            "reason": error.reason, "detail": error.detail, "manufacturer": error.manufacturer, "model": error.model,
            "series": error.series or None, "shape": None, "spacing": None}


def _volume_record(headers: List[Header], identities: Dict[str, str]) -> dict:
    """The index record of one volume: a multi-frame file, or single-frame files of one series in stack order."""
    first = headers[0]
    try:
        pairs, spacing, note, shape = _layout(headers)
    except UnusableFile as e:
        return _reject([h.path for h in headers], UnusableFile(e.reason, e.detail, first.manufacturer, first.model,
                                                               first.series), identities)
    paths = list(dict.fromkeys(headers[i].path for i, _ in pairs))  # files in stack order
    return {"paths": paths, "sources": [identities.get(p, "") for p in paths], "ok": True, "reason": None,
            "detail": None, "manufacturer": first.manufacturer, "model": first.model, "series": first.series,
            "shape": shape, "spacing": list(spacing) if spacing else None, "spacing_issue": note,
            "patient": first.patient, "transfer_syntax": first.transfer_syntax, "bits": first.bits}


def scan_files(files: Sequence[str], sop_classes: str = "oct", progress: bool = False, threads: int = 8,
               identities: Optional[Dict[str, str]] = None) -> List[dict]:
    """Index records: one per volume (a multi-frame file, or the single-frame files of one series) and one
    per rejected file, so every file appears exactly once. A record has paths, sources (source_identity of each),
    ok, reason (None when ok), detail, manufacturer, model, series, shape [D,H,W], spacing [dz,dy,dx] or None,
    spacing_issue, patient. Copies of a file (same SOPInstanceUID) are listed as duplicate_instance; a bad file of
    a series makes the whole series bad. `identities` ({path: source_identity}, e.g. from list_sources) saves
    looking them up.
    """
    def inspect(path):
        identity = identities[path] if identities is not None and path in identities else source_identity(path)
        try:
            return identity, inspect_file(path, sop_classes)
        except UnusableFile as e:
            return identity, e

    with ThreadPoolExecutor(threads) as pool:  # fetching (gs://) and file reads overlap
        results = list(tqdm(pool.map(inspect, files), total=len(files), unit="file", desc="scan",
                            disable=None if progress else True))  # None: a bar on a terminal only
    identities = {path: identity for path, (identity, _) in zip(files, results)}
    failed = {path: r for path, (_, r) in zip(files, results) if isinstance(r, UnusableFile)}
    headers, copies = _unique_instances([r for _, r in results if isinstance(r, Header)])
    records = [_reject([path], e, identities) for path, e in failed.items()]
    records += [_reject([copy.path], UnusableFile("duplicate_instance", f"same SOPInstanceUID as {original.path}",
                                                  copy.manufacturer, copy.model, copy.series), identities)
                for copy, original in copies]
    bad_member = {e.series: (path, e) for path, e in failed.items() if e.series and e.reason not in BENIGN_REASONS}
    series = {}
    for h in headers:
        if h.frames > 1:
            records.append(_volume_record([h], identities))
        else:
            series.setdefault((h.series, h.rows, h.cols), []).append(h)
    for (uid, _, _), members in series.items():
        if uid in bad_member:
            path, e = bad_member[uid]
            error = UnusableFile(e.reason, f"{path} of this series: {e.detail}", e.manufacturer, e.model, uid)
            records.append(_reject([h.path for h in members], error, identities))
        else:
            records.append(_volume_record(members, identities))
    return sorted(records, key=lambda r: r["paths"][0])


def write_index(records: Sequence[dict], path: str, built_from: Optional[dict] = None) -> None:
    """JSON lines, one record each after a first line saying what the index was built from, written so that
    readers never see a partial index."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in [{"built_from": built_from}, *records]).encode())


def read_index_with_source(path: str) -> Tuple[Optional[dict], List[dict]]:
    """(what the index was built from, or None for an index without that line; records)."""
    lines = [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]
    if lines and "built_from" in lines[0]:
        return lines[0]["built_from"], lines[1:]
    return None, lines


def read_index(path: str) -> List[dict]:
    """The records of an index written by write_index / `python data.py scan --out`."""
    return read_index_with_source(path)[1]


def _unchanged(record: dict, identities: Dict[str, str]) -> bool:
    """The record's files are all still listed, unchanged, and its verdict was not a passing failure."""
    sources = record.get("sources") or []
    return (record["reason"] not in TRANSIENT_REASONS and len(sources) == len(record["paths"])
            and all(p in identities and identities[p] == s for p, s in zip(record["paths"], sources)))


def index_source(data_root: Optional[str], manifest_path: Optional[str], sop_classes: str,
                 identities: Dict[str, str]) -> dict:
    """What an index is built from: the source, the sop_classes setting and a hash of the listing (every file's
    path and identity)."""
    listing = "\n".join(f"{p}\t{identities[p]}" for p in sorted(identities))
    return {"data_root": data_root, "manifest_path": manifest_path, "sop_classes": sop_classes,
            "listing": hashlib.sha256(listing.encode()).hexdigest()[:32]}


def update_index(records: Sequence[dict], identities: Dict[str, str], sop_classes: str,
                 progress: bool = False) -> List[dict]:
    """The records of the files in `identities` ({path: source_identity}): records whose files are unchanged are
    kept; new and changed files, passing failures (read errors) and the series that a new file joins are scanned
    again."""
    keep = [r for r in records if _unchanged(r, identities)]
    known = {p for r in keep for p in r["paths"]}
    fresh = scan_files([p for p in sorted(identities) if p not in known], sop_classes, progress,
                       identities=identities)
    joined = {r["series"] for r in fresh if r.get("series")} & {r.get("series") for r in keep}
    if joined:  # a new B-scan of an indexed series, or a copy of an indexed file: its series is scanned again
        again = [p for r in keep + fresh if r.get("series") in joined for p in r["paths"]]
        keep = [r for r in keep if r.get("series") not in joined]
        fresh = [r for r in fresh if r.get("series") not in joined] + scan_files(sorted(again), sop_classes,
                                                                                  identities=identities)
    return sorted(keep + fresh, key=lambda r: r["paths"][0])


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
    """Per manufacturer and model: files, accepted volumes, volumes without spacing or whose spacing tags disagree
    with their positions, rejects by reason, shape and spacing medians."""
    groups = {}
    for r in records:
        groups.setdefault((r["manufacturer"] or "(unknown)", r["model"] or ""), []).append(r)
    header = (f"{'manufacturer':<24} {'model':<20} {'files':>6} {'volumes':>7} {'no spacing':>10} {'disagree':>8}  "
              f"{'median shape D,H,W':<19} {'median spacing dz,dy,dx mm':<27} rejected")
    lines = [header]
    for (maker, model), rs in sorted(groups.items()):
        ok = [r for r in rs if r["ok"]]
        shape = ",".join(str(int(v)) for v in np.median([r["shape"] for r in ok], axis=0)) if ok else "-"
        spaced = [r["spacing"] for r in ok if r["spacing"]]
        disagree = sum(1 for r in ok if r["spacing"] and r.get("spacing_issue"))
        spacing = ",".join(f"{v:.4f}" for v in np.median(spaced, axis=0)) if spaced else "-"
        rejects = ", ".join(f"{k} {v}" for k, v in sorted(reason_counts(rs).items())) or "-"
        lines.append(f"{maker[:24]:<24} {model[:20]:<20} {sum(len(r['paths']) for r in rs):>6} {len(ok):>7} "
                     f"{len(ok) - len(spaced):>10} {disagree:>8}  {shape:<19} {spacing:<27} {rejects}")
    n_files = sum(len(r["paths"]) for r in records)
    n_ok = sum(r["ok"] for r in records)
    lines.append(f"\n{n_files} files: {n_ok} usable volumes, {len(records) - n_ok} rejected")
    counts = reason_counts(records)
    if counts:
        lines.append(format_reason_table(counts))
    return "\n".join(lines)
