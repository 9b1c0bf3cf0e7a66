"""OCT DICOM files, one at a time: read a file into its Header and frames, or say why it cannot be
trained on (UnusableFile with a stable reason code). index.py decides what a set of files is
(`units`: volumes, or files rejected with a reason) and reads a volume [D,H,W] with its spacing;
index.py scans a whole source into an index with the same decision; data.py turns a Volume into
training batches.

Reading a file: parse (pydicom; pixel data not decoded) -> Header (maker, size, bit depth, per-frame
geometry and rescale, spacing tags, a keyed hash of PatientID) -> decode every frame with pydicom's
plugins (every transfer syntax they decode: native little and big endian, deflated, RLE, JPEG,
JPEG-LS, JPEG 2000, HTJ2K; never a rewritten syntax: incident 11) -> MONOCHROME1 and each frame's
rescale. Per-frame functional groups are honoured per frame: a frame's own
PlaneOrientation/PlanePosition/PixelValueTransformation/PixelMeasures, else the shared groups, else
the top level.

Whatever is wrong with a file, the reader raises UnusableFile with a stable reason code (REASONS),
never another exception; a file that a scan accepts is one read_volume reads (inspect_file decodes
every frame too).

Maker quirks (what the reader does for each maker; everything else takes the standard's generic
path):
- Heidelberg Engineering (Spectralis): nothing maker-specific; multi-frame files whose spacing may
  sit in a frame's functional groups, the shared groups or the top level are looked up in that order
  (_places).
- Topcon (Triton, Maestro2): JPEG 2000 lossless or lossy 8-bit frames, decoded for real by
  pylibjpeg-openjpeg (_decode_as_stored; incident 11: the old reader rewrote the transfer syntax
  instead, and 10-20% of the Topcon/Zeiss files looked "corrupt"). A frame cut before its end marker
  is `truncated` (_decode_encapsulated).
- Zeiss (Carl Zeiss Meditec, Cirrus): JPEG 2000 frames scrambled the CZM way are unscrambled
  (_czm_scrambled decides from the Manufacturer and the frame signatures; unscramble_czm undoes the
  public scheme of https://github.com/pydicom/pydicom/discussions/1618; the full decode verifies
  it); PixelSpacing written as one string with a comma and a NUL ("0.0039,0.0113\\x00") is parsed
  (_numbers); frames stored in reverse stack order are put in order by their positions or
  InStackPositionNumber (index._layout).
- One file per B-scan (e.g. Optovue): the series' files make one volume (index.py says how they
  are ordered).
"""

import hashlib
import io
import math
import os
import re
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pydicom
from pydicom.dataelem import RawDataElement
from pydicom.errors import BytesLengthException, InvalidDicomError

from config import ConfigError
from privacy import patient_key
from storage import gcs_filesystem

# --------------------------------------------------------------------------------------------------
# Reading OCT DICOM
# --------------------------------------------------------------------------------------------------

OPT_SOP = "1.2.840.10008.5.1.4.1.1.77.1.5.4"  # Ophthalmic Tomography Image Storage
MIN_SHAPE = (4, 32, 32)  # [D,H,W]: a smaller volume holds too little to crop a training sample from
PIXEL_SPACING_TOLERANCE = 1e-3  # PixelSpacing of two B-scans closer than this share is the same
SIDECAR_EXTENSIONS = (".csv", ".tsv", ".json", ".jsonl", ".txt", ".md", ".yaml", ".yml", ".log")
CZM_MANUFACTURER = "Carl Zeiss Meditec"
JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"  # the first box of a JP2 file
J2K_START = b"\xff\x4f\xff\x51"  # a JPEG 2000 codestream: SOC then SIZ
# Encapsulated frames of these syntaxes end with an EOI/EOC marker: a frame without one was cut (a
# JPEG decoder fills the rest with grey without an error).
EOI_SYNTAXES = frozenset(
    pydicom.uid.JPEGTransferSyntaxes
    + pydicom.uid.JPEGLSTransferSyntaxes
    + pydicom.uid.JPEG2000TransferSyntaxes
)
UID_PATTERN = re.compile(r"[0-9]+(\.[0-9]+)*")
# What pydicom raises on an element whose bytes it cannot read (an unknown VR, a value of impossible
# length, a sequence item cut off): the file is damaged, not its values garbled.
ELEMENT_ERRORS = (NotImplementedError, BytesLengthException, OSError, EOFError)

REASONS = {  # stable codes used in the scan index, events.jsonl and NoUsableData -> what they mean
    "empty_file": "the file has 0 bytes",
    "not_dicom": "not a DICOM file (no DICM prefix)",
    "truncated": (
        "the file or one of its frames ends before its data does (interrupted copy or upload)"
    ),
    "empty_dataset": "pydicom read no data elements",
    "corrupt": (
        "the file's structure is damaged (an element pydicom cannot read, elements out of order):"
        " copy it again"
    ),
    "read_error": (
        "the file could not be read (missing, permissions, network); checked again by the next run"
    ),
    "not_oct": (
        "another object (en-face, fundus, analysis, report...); --sop_classes any accepts generic"
        " images"
    ),
    "not_image": "no pixel data and not an OCT object (report, analysis, DICOMDIR...)",
    "not_grayscale": "a colour image (more than one sample per pixel)",
    "duplicate_instance": (
        "a copy of another file (same SOPInstanceUID and voxels): the other one is used"
    ),
    "line_scan": "an OCT object of fewer than 4 B-scans (a line or cross scan): not a volume",
    "shared_instance_uid": (
        "files with one SOPInstanceUID but other voxels (a broken anonymizer): not used"
    ),
    "no_pixel_data": "an OCT object without PixelData, or with an empty one",
    "bad_header": (
        "tags missing, garbled or inconsistent (Rows, NumberOfFrames, orientation, rescale...)"
    ),
    "frame_count_mismatch": (
        "the pixel data holds another number of frames than NumberOfFrames says"
    ),
    "undecodable": (
        "the pixel data could not be decoded (corrupt stream, or obfuscated otherwise than Zeiss"
        " CZM)"
    ),
    "not_raster": (
        "not parallel, evenly spaced B-scans of one pixel size (radial or circle scan, uneven gaps,"
        " volumetric flag NO)"
    ),
    "multiple_stacks": (
        "more than one stack of B-scans in one volume (e.g. a horizontal and a vertical raster)"
    ),
    "duplicate_frames": "two B-scans at the same place or with the same stack position",
    "series_gap": (
        "B-scans missing from the stack (a gap of 1.5 spacings or more, or a missing stack number)"
    ),
    "no_stack_order": (
        "one file per B-scan, without positions, InStackPositionNumber or InstanceNumber to order"
        " them"
    ),
    "too_small": f"fewer voxels than {list(MIN_SHAPE)} [D,H,W] (and not a line scan)",
    "bad_spacing": "voxel spacing missing or garbled, and missing_spacing is skip",
    "blank": "constant intensity: nothing to learn from",
    "several_volumes": (
        "read_volume was given more than one volume (e.g. two eyes in one folder): scan lists each"
    ),
}
# Other objects, copies and line scans: listed, not bad files (max_bad_fraction does not count
# them).
BENIGN_REASONS = (
    "not_dicom",
    "not_oct",
    "not_image",
    "not_grayscale",
    "duplicate_instance",
    "line_scan",
)
# may pass on another try: a reused index checks these files again
TRANSIENT_REASONS = ("read_error",)


class UnusableFile(Exception):
    """An input that cannot be trained on: `reason` is a stable code of REASONS, `detail` says more;
    `series` and `sop_class` are the file's SeriesInstanceUID and SOPClassUID when it was read that
    far (a bad file makes its whole series bad)."""

    def __init__(
        self,
        reason: str,
        detail: str = "",
        manufacturer: str = "",
        model: str = "",
        series: str = "",
        sop_class: str = "",
    ):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.manufacturer, self.model = (
            reason,
            detail,
            manufacturer,
            model,
        )
        self.series, self.sop_class = series, sop_class

    def __reduce__(self):  # keep the fields across processes (DataLoader workers, prepare pool)
        return UnusableFile, (
            self.reason,
            self.detail,
            self.manufacturer,
            self.model,
            self.series,
            self.sop_class,
        )


@dataclass
class Frame:
    """Where one B-scan lies, from its tags."""

    # [6] ImageOrientationPatient: row and column direction cosines
    orientation: Optional[np.ndarray]
    position: Optional[np.ndarray]  # [3] ImagePositionPatient, mm
    stack_id: Optional[str]
    in_stack: Optional[int]  # InStackPositionNumber
    dimension_index: Optional[Tuple[int, ...]]  # DimensionIndexValues
    instance: Optional[int]  # InstanceNumber of a single-frame file


@dataclass
class Header:
    """What the reader takes from the tags of one image file, parsed once for scan and read
    alike."""

    path: str
    manufacturer: str
    model: str
    frames: int
    rows: int
    cols: int
    bits: int
    transfer_syntax: str
    sop_class: str
    sop_uid: str
    series: str  # SeriesInstanceUID, else the path
    patient: str  # see _patient_key
    study: str  # StudyInstanceUID
    laterality: str  # R or L (ImageLaterality, else Laterality); '' when neither is there
    # [F,2] (RescaleSlope, RescaleIntercept) of each frame, or [1,2] for all of them
    rescale: np.ndarray
    # one per per-frame group (frames of a valid file); empty for a file without them
    geometry: List[Frame]
    raster_flag: Optional[str]  # OphthalmicVolumetricPropertiesFlag: YES, NO or None
    pixel_spacing: Optional[Tuple[float, float]]  # (dy, dx) mm
    # (tag name, mm) of SpacingBetweenSlices or SliceThickness
    slice_spacing: Optional[Tuple[str, float]]
    spacing_error: Optional[str]  # why the spacing tags could not be parsed
    # of the decoded voxels: a copy has the same, a broken anonymizer's other image another
    digest: str = ""


def _ends_cleanly(ds: pydicom.Dataset, f, size: int) -> bool:
    """False when the file `f` stops inside an element: pydicom then silently drops or shortens it,
    and returns an empty dataset for a JPEG 2000 file cut inside its pixel data (with only a
    warning, not an error). Bytes after the last element are padding (some writers add it) when they
    are zeros or no next element's tag, else a next element cut inside its header. A deflated
    dataset was checked whole by zlib (its element positions count in the inflated stream, not in
    the file)."""
    if len(ds) == 0:
        meta_length = ds.file_meta.get("FileMetaInformationGroupLength")
        # a meta header only: empty
        return size >= 144 if meta_length is None else 132 + 12 + meta_length == size
    if ds.file_meta.get("TransferSyntaxUID") == pydicom.uid.DeflatedExplicitVRLittleEndian:
        return True
    last_tag = max(ds.keys())
    last = ds.get_item(last_tag)
    if last is None or not getattr(last, "is_raw", False) or last.length == 0xFFFFFFFF:
        return True
    end = last.value_tell + last.length
    if end >= size:
        return end == size
    f.seek(end)
    rest = f.read(4)
    if not rest.strip(b"\x00"):
        return True
    order = (
        "little"
        if ds.file_meta.get("TransferSyntaxUID", pydicom.uid.ExplicitVRLittleEndian)
        != pydicom.uid.ExplicitVRBigEndian
        else "big"
    )
    next_tag = (int.from_bytes(rest[:2], order) << 16) | int.from_bytes(rest[2:4], order)
    return len(rest) == 4 and not last_tag < next_tag < 0xFFFE0000


def _out_of_order(ds: pydicom.Dataset) -> Optional[str]:
    """Where the top-level elements stop ascending by tag in the file (the standard keeps them
    ascending): a damaged tag or length made pydicom read other bytes as elements. None when they
    ascend. Zero padding that pydicom read as elements (0000,0000) is left out."""
    placed = sorted(
        (e.value_tell if isinstance(e, RawDataElement) else e.file_tell or 0, e.tag)
        for e in ds.elements()
        if e.tag != 0
    )
    for (_, before), (at, tag) in zip(placed, placed[1:]):
        if tag <= before:
            return f"element {tag} at byte {at} follows {before}"
    return None


def _parse(path: str) -> pydicom.Dataset:
    """The DICOM dataset of one file (pixel data not decoded)."""
    try:
        if path.startswith("gs://"):
            # one request; gcsfs's default read cache made pydicom 1000x slower
            data = gcs_filesystem().cat_file(path)
            f, size = io.BytesIO(data), len(data)
        else:
            # pydicom reads the file directly: one copy of the pixel data, not two
            f = open(path, "rb")
            size = os.fstat(f.fileno()).st_size
    # missing file, permissions, network: the file is unusable, the run goes on
    except Exception as e:
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
        except zlib.error as e:  # a deflated dataset: its stream cut short, or damaged
            raise UnusableFile(
                "truncated" if "truncated" in str(e) else "corrupt", f"deflated data: {e}"
            ) from None
        except OSError as e:
            if e.errno is not None:  # the storage failed while reading: may pass next time
                raise UnusableFile("read_error", f"{type(e).__name__}: {e}") from None
            # pydicom's own (no errno): a sequence item whose header the end of the file cut
            raise UnusableFile("truncated", f"{size} bytes: {e}") from None
        except Exception as e:  # the parser met garbage: the same next time
            # it failed at the end of the file: cut there
            reason = "truncated" if f.tell() >= size else "corrupt"
            raise UnusableFile(
                reason, f"pydicom cannot parse it: {type(e).__name__}: {e}"
            ) from None
    if cut:
        what = "pydicom returned an empty dataset" if len(ds) == 0 else f"{len(ds)} elements read"
        raise UnusableFile("truncated", f"{size} bytes, {what}")
    if len(ds) == 0:
        raise UnusableFile("empty_dataset", "no data elements after the file meta information")
    return ds


def _text(ds: pydicom.Dataset, name: str) -> str:
    """A string tag's value; '' when absent or unreadable (a damaged element fails where the reader
    needs it)."""
    try:
        return str(ds.get(name, "") or "")
    except Exception:
        return ""


def _maker(ds: pydicom.Dataset) -> Tuple[str, str]:
    return _text(ds, "Manufacturer"), _text(ds, "ManufacturerModelName")


def _sop_class(ds: pydicom.Dataset) -> str:
    return _text(ds, "SOPClassUID") or str(ds.file_meta.get("MediaStorageSOPClassUID", "") or "")


def _identity(ds: pydicom.Dataset) -> Tuple[str, str, str, str]:
    """(manufacturer, model, SeriesInstanceUID, SOP class) of a file, as far as they can be read."""
    return (*_maker(ds), _text(ds, "SeriesInstanceUID"), _sop_class(ds))


def _groups(ds: pydicom.Dataset, name: str) -> List[pydicom.Dataset]:
    seq = ds.get(name)
    return list(seq) if seq else []


def _places(
    ds: pydicom.Dataset, macro: str, item: Optional[pydicom.Dataset] = None
) -> List[pydicom.Dataset]:
    """Where the tags of a functional-group macro may be, in order: a frame's own groups (`item`,
    else the first frame's), the shared groups, the top level."""
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
    """The values of a decimal/integer string tag (DS, IS), None when absent. Also reads the Zeiss
    Cirrus way of writing them, one string with commas and a NUL ("0.0039,0.0113\\x00"). Raises
    ValueError on garbage."""
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


def _first_numbers(
    places: Sequence[pydicom.Dataset], *names: str
) -> Optional[Tuple[str, List[float]]]:
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
    """The geometry of one frame: a per-frame group item of a multi-frame file, or a single-frame
    file (item None or its one per-frame item). Raises ValueError on garbled tags."""
    orientation = _vector(
        _first_numbers(_places(ds, "PlaneOrientationSequence", item), "ImageOrientationPatient"), 6
    )
    if orientation is not None and np.linalg.norm(np.cross(orientation[:3], orientation[3:])) < 0.5:
        raise ValueError(
            f"ImageOrientationPatient {list(orientation)}: row and column are not orthogonal unit"
            " vectors"
        )
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
    return Frame(
        orientation,
        position,
        None if stack_id is None else str(stack_id),
        None if in_stack is None else int(in_stack),
        None if dimension_index is None else tuple(int(v) for v in np.atleast_1d(dimension_index)),
        None if math.isnan(instance) else int(instance),
    )


def _patient_key(ds: pydicom.Dataset, path: str) -> str:
    """The keyed hash of PatientID, else of the file (privacy.patient_key): the unit of the
    train/val split. The index holds this key, never the PatientID, but it does hold the files'
    paths (docs/privacy.md)."""
    return patient_key(str(ds.get("PatientID", "") or "").strip(), path)


def _spacing_tags(ds: pydicom.Dataset, items: Sequence[pydicom.Dataset]):
    """(pixel spacing (dy, dx), (tag, B-scan spacing), error): the first value found (a frame's
    groups, shared groups, top level) is used; a garbled one is reported, never silently replaced by
    a value found later. The other frames' own PixelSpacing (in their PixelMeasuresSequence) must
    agree with it (_check_pixel_spacing)."""
    places = _places(ds, "PixelMeasuresSequence")
    try:
        pixel = _vector(_first_numbers(places, "PixelSpacing"), 2)
        found = _first_numbers(places, "SpacingBetweenSlices", "SliceThickness")
        slice_spacing = None if found is None else (found[0], float(_vector(found, 1)[0]))
        own = [
            _vector(_first_numbers(_groups(item, "PixelMeasuresSequence")[:1], "PixelSpacing"), 2)
            for item in items[1:]
            if "PixelMeasuresSequence" in item
        ]
    except ValueError as e:
        return None, None, f"garbled: {e}"
    check_pixel_spacing([pixel, *own])
    return None if pixel is None else (float(pixel[0]), float(pixel[1])), slice_spacing, None


def check_pixel_spacing(values: Sequence[Optional[Sequence[float]]]) -> None:
    """The B-scans of a volume share one PixelSpacing (B-scans without one are left out)."""
    known = np.array([v for v in values if v is not None], dtype=np.float64).reshape(-1, 2)  # [N,2]
    if (np.abs(known - known[:1]) > PIXEL_SPACING_TOLERANCE * np.abs(known[:1])).any():
        raise UnusableFile(
            "not_raster",
            "PixelSpacing differs between B-scans: "
            f"{sorted({tuple(v) for v in known.tolist()})[:4]} mm",
        )


def _rescale(ds: pydicom.Dataset, items: Sequence[pydicom.Dataset]) -> np.ndarray:
    """(RescaleSlope, RescaleIntercept) of every frame [F,2], or one row [1,2] when no frame has its
    own: a frame's own PixelValueTransformationSequence (float-to-integer converters write one per
    frame), else the shared one, else the top level."""
    own = items if any("PixelValueTransformationSequence" in item for item in items) else [None]
    rescale = np.array(
        [
            (_scalar(places, "RescaleSlope", 1.0), _scalar(places, "RescaleIntercept", 0.0))
            for places in (_places(ds, "PixelValueTransformationSequence", item) for item in own)
        ]
    )
    if (rescale[:, 0] == 0).any():
        raise ValueError(f"RescaleSlope 0 (frame {int(np.argmin(np.abs(rescale[:, 0])))})")
    return rescale


def _check_sop_class(ds: pydicom.Dataset, sop: str) -> None:
    """A SOPClassUID that is no UID, or that disagrees with the file meta's about an OCT object, is
    a damaged header (not another object)."""
    meta = str(ds.file_meta.get("MediaStorageSOPClassUID", "") or "")
    if sop and not UID_PATTERN.fullmatch(sop):
        raise UnusableFile(
            "corrupt", f"SOPClassUID {sop[:80]!r} is not a UID: the header is damaged"
        )
    if OPT_SOP in (sop, meta) and meta and sop != meta:
        raise UnusableFile(
            "bad_header",
            f"SOPClassUID {sop} disagrees with the file meta's MediaStorageSOPClassUID {meta}",
        )


def _header(ds: pydicom.Dataset, path: str, sop_classes: str) -> Header:
    """The Header of an image that `sop_classes` accepts. Raises UnusableFile; ValueError/TypeError
    on garbled tags."""
    sop = _sop_class(ds)
    _check_sop_class(ds, sop)
    sop_name = pydicom.uid.UID(sop).name if sop else "no SOPClassUID"
    if sop_classes == "oct" and sop != OPT_SOP:
        raise UnusableFile("not_oct", sop_name)
    if "PixelData" not in ds:
        damage = _out_of_order(ds)
        if damage:
            raise UnusableFile(
                "corrupt", f"no PixelData, and the elements are out of order ({damage})"
            )
        raise UnusableFile("no_pixel_data" if sop == OPT_SOP else "not_image", sop_name)
    if not ds.get_item("PixelData").value:
        raise UnusableFile(
            "no_pixel_data" if sop == OPT_SOP else "not_image", f"{sop_name}: PixelData is empty"
        )
    if int(ds.get("SamplesPerPixel", 1) or 1) != 1:
        raise UnusableFile("not_grayscale", f"SamplesPerPixel {ds.SamplesPerPixel}")
    rows, cols, bits, photometric = (
        ds.get(name) for name in ("Rows", "Columns", "BitsAllocated", "PhotometricInterpretation")
    )
    if photometric == "PALETTE COLOR":
        raise UnusableFile("not_grayscale", "PhotometricInterpretation PALETTE COLOR")
    if (
        not rows
        or not cols
        or bits not in (8, 16)
        or photometric not in ("MONOCHROME1", "MONOCHROME2")
    ):
        raise UnusableFile(
            "bad_header",
            f"Rows {rows}, Columns {cols}, BitsAllocated {bits}, "
            f"PhotometricInterpretation {photometric}",
        )
    frames = _count(_numbers(ds, "NumberOfFrames"), "NumberOfFrames", 1)
    items = _groups(ds, "PerFrameFunctionalGroupsSequence")[: 1 if frames == 1 else None]
    if frames == 1:
        geometry = [_frame(ds, items[0] if items else None, single=True)]
    else:
        geometry = [_frame(ds, item, single=False) for item in items]
    flag = ds.get("OphthalmicVolumetricPropertiesFlag")
    pixel_spacing, slice_spacing, spacing_error = _spacing_tags(ds, items)
    manufacturer, model = _maker(ds)
    return Header(
        path,
        manufacturer,
        model,
        frames,
        int(rows),
        int(cols),
        int(bits),
        ds.file_meta.TransferSyntaxUID.name,
        sop,
        str(ds.get("SOPInstanceUID", "") or ""),
        str(ds.get("SeriesInstanceUID", "") or path),
        _patient_key(ds, path),
        str(ds.get("StudyInstanceUID", "") or ""),
        str(ds.get("ImageLaterality", "") or ds.get("Laterality", "") or "").strip().upper(),
        _rescale(ds, items),
        geometry,
        None if flag is None else str(flag).upper(),
        pixel_spacing,
        slice_spacing,
        spacing_error,
    )


def unscramble_czm(frame: bytes) -> bytes:
    """A Zeiss Cirrus (CZM) JPEG 2000 frame as the plain JP2 file it hides: every 7th byte XORed
    with 0x5A and eight blocks put back in place (the public scheme of
    https://github.com/pydicom/pydicom/discussions/1618). Raises ValueError when no JP2 header shows up where the scheme puts it.
    """
    data = np.frombuffer(frame, np.uint8).copy()
    data[::7] ^= 0x5A
    data = data.tobytes()
    # where Cirrus puts the JP2 header; else the signature box is searched for
    offset = len(data) * 3 // 5
    if data[offset : offset + len(JP2_SIGNATURE)] != JP2_SIGNATURE:
        offset = data.find(JP2_SIGNATURE)
    if offset < 1016 or offset + 253 > len(data):
        raise ValueError("no JP2 signature box after unscrambling: not a CZM-scrambled frame")
    blocks = (
        (offset, offset + 253),
        (993, 1016),
        (276, 763),
        (23, 276),
        (1016, offset),
        (0, 23),
        (763, 993),
        (offset + 253, len(data)),
    )
    return b"".join(data[a:b] for a, b in blocks)


def _encoded_frames(ds: pydicom.Dataset, frames: int) -> List[bytes]:
    """The encapsulated frames: exactly NumberOfFrames of them."""
    try:
        found = list(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=frames))
    except Exception as e:  # fewer fragments than frames, broken item tags
        raise UnusableFile("frame_count_mismatch", f"NumberOfFrames {frames}: {e}") from None
    if len(found) != frames:
        raise UnusableFile(
            "frame_count_mismatch", f"{len(found)} encoded frames, NumberOfFrames {frames}"
        )
    return found


def _check_native_size(ds: pydicom.Dataset, h: Header) -> None:
    """Native pixel data holds exactly NumberOfFrames frames."""
    frame_bytes = h.rows * h.cols * h.bits // 8
    size = len(ds.PixelData)
    if size // frame_bytes != h.frames or size % frame_bytes > 1:  # one padding byte is allowed
        raise UnusableFile(
            "frame_count_mismatch",
            f"{size / frame_bytes:g} frames of {h.rows}x{h.cols} in "
            f"{size} bytes, NumberOfFrames {h.frames}",
        )


def _decode_as_stored(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W] in file order, decoded by the plugins (pylibjpeg-openjpeg for JPEG 2000),
    never a rewritten syntax (incident 11)."""
    syntax = ds.file_meta.TransferSyntaxUID
    ds.NumberOfFrames = h.frames  # as parsed: pydicom would choke on a garbled string
    try:
        voxels = ds.pixel_array
    except Exception as e:
        raise UnusableFile(
            "undecodable", f"{syntax.name}: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    if voxels.size != h.frames * h.rows * h.cols:
        raise UnusableFile(
            "undecodable",
            f"{syntax.name}: decoded {voxels.shape}, expected {h.frames}x{h.rows}x{h.cols}",
        )
    return voxels.reshape(h.frames, h.rows, h.cols)


def _czm_scrambled(ds: pydicom.Dataset, h: Header, encoded: Sequence[bytes]) -> bool:
    """A Zeiss Cirrus JPEG 2000 file whose frames are neither a JP2 file nor a J2K codestream as
    stored."""
    return (
        h.manufacturer.startswith(CZM_MANUFACTURER)
        and ds.file_meta.TransferSyntaxUID in (pydicom.uid.JPEG2000Lossless, pydicom.uid.JPEG2000)
        and not all(f.startswith(JP2_SIGNATURE) or f.startswith(J2K_START) for f in encoded)
    )


def _decode_encapsulated(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W]; a scrambled Zeiss Cirrus stream is unscrambled first (the full decode
    verifies it). Every frame of a JPEG family syntax must end with its end marker."""
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
            # the end marker, then at most padding (a 0, or a 0 XORed by CZM)
            if b"\xff\xd9" not in frame[-4:]:
                raise UnusableFile(
                    "truncated", f"frame {k} of {h.frames} has no end marker: the stream was cut"
                )
    return voxels


def _pixels(ds: pydicom.Dataset, h: Header) -> np.ndarray:
    """All frames [F,H,W] in file order, after MONOCHROME1 inversion and each frame's rescale."""
    if ds.file_meta.TransferSyntaxUID.is_encapsulated:
        voxels = _decode_encapsulated(ds, h)
    else:
        _check_native_size(ds, h)
        voxels = _decode_as_stored(ds, h)
    if h.geometry and len(h.geometry) != h.frames:
        raise UnusableFile(
            "bad_header", f"{len(h.geometry)} per-frame groups for {h.frames} frames"
        )
    # pydicom leaves signed big-endian data as is
    voxels = voxels.astype(voxels.dtype.newbyteorder("="), copy=False)
    if ds.get("PhotometricInterpretation") == "MONOCHROME1":  # stored with black as the maximum
        voxels = (
            2 ** int(ds.get("BitsStored", h.bits)) - 1 - voxels
            if voxels.dtype.kind == "u"
            else ~voxels
        ).astype(voxels.dtype)
    rescale = h.rescale.astype(np.float32)[:, :, None]  # [F,2,1]: (slope, intercept) of each frame
    if (rescale != np.array([[[1], [0]]])).any():
        voxels = voxels.astype(np.float32) * rescale[:, :1] + rescale[:, 1:]
    return voxels


def read_file(path: str, sop_classes: str) -> Tuple[Header, np.ndarray]:
    """(header, all frames [F,H,W] in file order) of one file. Any failure is an UnusableFile with a
    reason: garbled tags that break the reader are `bad_header`, elements pydicom cannot read
    `corrupt`, never an exception of another kind."""
    ds = _parse(path)
    try:
        header = _header(ds, path, sop_classes)
        pixels = _pixels(ds, header)
        header.digest = hashlib.blake2b(np.ascontiguousarray(pixels), digest_size=16).hexdigest()
        return header, pixels
    except UnusableFile as e:
        raise UnusableFile(e.reason, e.detail, *_identity(ds)) from None
    except ConfigError:  # the site's key file (privacy.site_secret), not this file
        raise
    except ELEMENT_ERRORS as e:
        raise UnusableFile(
            "corrupt", f"pydicom cannot read an element: {type(e).__name__}: {e}", *_identity(ds)
        ) from None
    except Exception as e:  # garbled values that the checks above did not name
        raise UnusableFile("bad_header", f"{type(e).__name__}: {e}", *_identity(ds)) from None


# --------------------------------------------------------------------------------------------------
# The files of a local folder (index.py finds those of any source: globs, gs://, manifests)
# --------------------------------------------------------------------------------------------------


def is_candidate(path: str) -> bool:
    """A file that may be DICOM: not hidden, not a sidecar (csv, json, txt...), not a DICOMDIR."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return (
        not name.startswith(".")
        and not name.lower().endswith(SIDECAR_EXTENSIONS)
        and name != "DICOMDIR"
    )


def folder_files(folder: str) -> List[str]:
    """The candidate files under a local folder, sorted: every file, following symlinked sub-folders
    like a glob does (each real folder once, so a link back up is no loop); hidden folders (.git,
    writers' temp folders) are left out."""
    paths, seen = [], set()
    for parent, subfolders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = [f for f in subfolders if not f.startswith(".")]
        paths += [os.path.join(parent, f) for f in files]
    return sorted(p for p in paths if is_candidate(p))


def inspect_file(path: str, sop_classes: str = "oct") -> Header:
    """The Header of one file after reading it as read_volume does, every frame decoded, so that a
    file the scan accepts is one the loader reads. Raises UnusableFile."""
    header, _ = read_file(path, sop_classes)
    return header
