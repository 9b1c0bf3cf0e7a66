"""OCT data for octjepa: patch masks, DICOM reading, preprocessing, datasets and loader, cache, CLI.

    python data.py scan SRC [--out index.jsonl] [--sop_classes any] [config flags]   # what is usable, and why not
    python data.py prepare SRC --cache DIR [config flags]      # decode + resample once into a local cache
    python data.py phantoms DIR [--n N] [--size D,H,W]         # write a synthetic phantom set

SRC is a folder (recursive), a glob, a gs:// prefix or glob, or a manifest (--manifest_path, a TSV/CSV with a
`filepath` column relative to SRC). gs:// goes through gcsfs; set STORAGE_EMULATOR_HOST to use a local
emulator. A sample is: read the DICOM (any maker, multi-frame or one file per B-scan, Zeiss Cirrus unscrambled;
only one stack of parallel, evenly spaced B-scans is a volume) -> resample to target_spacing (or resize to
image_size) -> robust percentile clip, stored as uint8 (8-bit sources) or uint16 (what the cache holds) ->
crop and pad to image_size, axially centred on the retina (random elsewhere and jittered for train, centred
for val) -> zero mean, unit std over the sample -> flip and intensity jitter (train) -> patch mask. Files that
cannot be used raise UnusableFile with a stable reason code (REASONS), whatever is wrong with them; the loader
replaces them and reports them (incident 11). A file that `scan` accepts is one the loader reads.

Masks are index tensors of a fixed length per sample (incident 6): every sample of a config has exactly
`n_target = round(mask_ratio * N)` target tokens and `N - n_target` context tokens, disjoint and covering
all N tokens, so batches have static shapes and no token is thrown away.
"""
import csv
import glob
import hashlib
import io
import json
import math
import os
import re
import secrets
import socket
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

# Before any gcsfs import: otherwise every gcsfs call waits 60 s on an experimental gRPC check.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import numpy as np
import pydicom
import torch
import torch.nn.functional as F
from pydicom.errors import InvalidDicomError
from tqdm import tqdm

from config import Config, ConfigError, ExitError, ScriptParser, load_config, script_main
from phantom import add_phantom_options, phantom_set_complete, write_phantom_set, write_phantoms_of

# ----------------------------------------------------------------------------------------------------------
# Patch masks
# ----------------------------------------------------------------------------------------------------------

MASK_TYPES = ("multiblock", "multiblock_inside", "random")


class MaskGenerator:
    """Samples (context_idx, target_idx) int64 arrays over a (gd, gh, gw) token grid: [Nc] and [Nt] for one
    mask set, [M, Nc] and [M, Nt] for M mask sets per sample (V-JEPA: each set is predicted on its own).

    block_scale holds one (min, max) pair per mask set, e.g. (0.02, 0.05, 0.3, 0.5): a short-range set of many
    small blocks and a long-range set of a few large ones. Every set has exactly n_target target tokens.
    multiblock: 3D blocks of random scale (share of all tokens) and aspect ratio are added one by one until
    the union holds exactly n_target tokens; the last block is added from its center outwards and stops at
    the exact count. Block starts range over [-(extent-1), grid-1] and are clipped, so every position is
    covered equally often (no border bias), but a block near a border is smaller than its nominal scale.
    multiblock_inside: the same, with every block placed fully inside the grid: its size is its nominal scale.
    random: n_target tokens drawn uniformly without replacement.
    tube_axis: blocks span the whole grid along this axis (0 = across B-scans); the scale sets their volume.
    """

    def __init__(self, grid: Sequence[int], mask_ratio: float, mask_type: str = "multiblock",
                 block_scale: Sequence[float] = (0.1, 0.3), block_aspect: float = 1.5,
                 tube_axis: Optional[int] = None):
        self.grid = tuple(int(g) for g in grid)
        self.num_tokens = math.prod(self.grid)
        self.n_target = round(mask_ratio * self.num_tokens)
        self.n_context = self.num_tokens - self.n_target
        if self.n_target < 1 or self.n_context < 1:
            raise ValueError(f"mask_ratio {mask_ratio} of {self.num_tokens} tokens leaves no context or no target")
        if mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type must be one of {', '.join(MASK_TYPES)}, got {mask_type!r}")
        if len(block_scale) % 2 or not block_scale:
            raise ValueError(f"block_scale must hold (min, max) pairs, one per mask set, got {block_scale!r}")
        if tube_axis not in (None, 0, 1, 2):
            raise ValueError(f"tube_axis must be None, 0, 1 or 2, got {tube_axis!r}")
        self.mask_type = mask_type
        self.set_scales = [tuple(block_scale[i:i + 2]) for i in range(0, len(block_scale), 2)]
        self.block_aspect = block_aspect
        self.tube_axis = tube_axis
        self._coords = np.stack(np.meshgrid(*[np.arange(g) for g in self.grid], indexing="ij"), -1)  # [gd,gh,gw,3]

    @property
    def num_sets(self) -> int:
        return len(self.set_scales)

    def __call__(self, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        masks = [self.sample_set(rng, scale)[0] for scale in self.set_scales]
        context = np.stack([np.flatnonzero(~m) for m in masks]).astype(np.int64)  # [M, Nc]
        target = np.stack([np.flatnonzero(m) for m in masks]).astype(np.int64)  # [M, Nt]
        return (context[0], target[0]) if self.num_sets == 1 else (context, target)

    def sample_set(self, rng: np.random.Generator, scale: Tuple[float, float]) -> Tuple[np.ndarray, List[tuple]]:
        """(is_target [N] bool, [(nominal tokens, tokens inside the grid, extent inside the grid) per block]) of one
        mask set (no blocks for random masks)."""
        if self.mask_type == "random":
            is_target = np.zeros(self.num_tokens, dtype=bool)
            is_target[rng.choice(self.num_tokens, self.n_target, replace=False)] = True
            return is_target, []
        return self._multiblock(rng, scale)

    def _block_extent(self, rng: np.random.Generator, scale: Tuple[float, float]) -> Tuple[float, np.ndarray]:
        """(nominal tokens, extent per axis) of one block: scale * N tokens, shape distorted by a random aspect."""
        nominal = rng.uniform(*scale) * self.num_tokens
        grid = np.array(self.grid, dtype=float)
        free = [a for a in range(3) if a != self.tube_axis]
        log_aspect = rng.uniform(-math.log(self.block_aspect), math.log(self.block_aspect), size=len(free))
        log_aspect -= log_aspect.mean()  # product of the factors is 1: the volume is kept
        extent = grid.copy()  # a tube axis keeps the whole grid
        share = nominal / grid.prod()
        extent[free] = grid[free] * share ** (1 / len(free)) * np.exp(log_aspect)
        extent = np.clip(np.round(extent), 1, grid)
        # The longest free axis absorbs the rounding of the others, so the block volume stays near nominal.
        last = max(free, key=lambda a: extent[a])
        rest = np.prod([extent[a] for a in range(3) if a != last])
        extent[last] = np.clip(round(nominal / rest), 1, grid[last])
        return nominal, extent.astype(int)

    def _multiblock(self, rng: np.random.Generator, scale: Tuple[float, float]) -> Tuple[np.ndarray, List[tuple]]:
        is_target = np.zeros(self.grid, dtype=bool)
        blocks = []
        count = 0
        while count < self.n_target:
            nominal, extent = self._block_extent(rng, scale)
            if self.mask_type == "multiblock_inside":
                start = np.array([rng.integers(0, g - e + 1) for e, g in zip(extent, self.grid)])
            else:
                start = np.array([rng.integers(-(e - 1), g) for e, g in zip(extent, self.grid)])
            lo, hi = np.maximum(start, 0), np.minimum(start + extent, self.grid)
            blocks.append((nominal, int(np.prod(hi - lo)), tuple(hi - lo)))
            block = tuple(slice(a, b) for a, b in zip(lo, hi))
            new = ~is_target[block]
            n_new = int(new.sum())
            if count + n_new <= self.n_target:
                is_target[block] = True
                count += n_new
                continue
            # Last block: take its new tokens nearest to the block center first, stop at the exact count.
            center = (start + (extent - 1) / 2.0)
            coords = self._coords[block][new]  # [n_new, 3]
            order = np.argsort(((coords - center) ** 2).sum(-1), kind="stable")[: self.n_target - count]
            chosen = coords[order]
            is_target[chosen[:, 0], chosen[:, 1], chosen[:, 2]] = True
            count = self.n_target
        return is_target.reshape(-1), blocks


def mask_generator_from_config(cfg) -> MaskGenerator:
    """The MaskGenerator described by a Config."""
    return MaskGenerator(cfg.grid_size(), cfg.mask_ratio, cfg.mask_type, tuple(cfg.mask_block_scale),
                         cfg.mask_block_aspect, cfg.mask_tube_axis)


def context_neighbour_share(is_target: np.ndarray) -> List[float]:
    """Per axis, the share of target tokens with a context token directly before or after them along it:
    is_target [gd, gh, gw] bool. Such a target can be copied from its neighbour rather than predicted."""
    shares = []
    for axis in range(3):
        near = np.zeros_like(is_target)
        for shift in (1, -1):
            context = ~np.roll(is_target, shift, axis=axis)
            edge = [slice(None)] * 3
            edge[axis] = slice(0, 1) if shift == 1 else slice(-1, None)
            context[tuple(edge)] = False  # np.roll wraps around: the wrapped neighbour does not exist
            near |= context
        shares.append(float((near & is_target).sum() / max(1, is_target.sum())))
    return shares


def mask_stats(gen: MaskGenerator, samples: int = 100, seed: int = 0) -> dict:
    """What a mask design does, measured over `samples` masks per set: realised block size as a share of
    nominal (mean), share of blocks at most 2 tokens thick on some axis, and the per-axis context-neighbour
    share of target tokens (context_neighbour_share)."""
    rng = np.random.default_rng(seed)
    ratios, thin, near = [], [], []
    for _ in range(samples):
        for scale in gen.set_scales:
            is_target, blocks = gen.sample_set(rng, scale)
            ratios += [inside / nominal for nominal, inside, _ in blocks]
            thin += [min(extent) <= 2 for _, _, extent in blocks]
            near.append(context_neighbour_share(is_target.reshape(gen.grid)))
    return {"block_size_ratio": float(np.mean(ratios)) if ratios else None,
            "thin_block_share": float(np.mean(thin)) if thin else None,
            "context_neighbour_share": [float(x) for x in np.mean(near, axis=0)]}


def describe_masks(gen: MaskGenerator) -> str:
    """Lines for the dry run: the mask design and what it realises (mask_stats)."""
    stats = mask_stats(gen)
    sets = ", ".join(f"[{lo:g}, {hi:g}]" for lo, hi in gen.set_scales)
    tube = "" if gen.tube_axis is None else f", tubes along axis {gen.tube_axis}"
    lines = [f"masks             {gen.mask_type}, {gen.num_sets} set(s) per sample, block scale {sets}{tube}: "
             f"{gen.n_target} target / {gen.n_context} context tokens per set"]
    if stats["block_size_ratio"] is not None:
        lines.append(f"                  realised block size {stats['block_size_ratio']:.2f} x nominal; "
                     f"{stats['thin_block_share']:.0%} of blocks are at most 2 tokens thick on some axis")
    near = stats["context_neighbour_share"]
    lines.append(f"                  target tokens with a context neighbour along axis 0 (B-scans) {near[0]:.0%}, "
                 f"1 (depth) {near[1]:.0%}, 2 (lateral) {near[2]:.0%}")
    return "\n".join(lines)


def sample_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on (seed, keys): the same sample gets the same mask after a resume."""
    return np.random.default_rng([seed, *keys])


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


_GCS = {}  # (process id, emulator) -> GCSFileSystem: created lazily in each process, never pickled (incident 11)


def gcs_filesystem():
    """This process's gcsfs filesystem; STORAGE_EMULATOR_HOST (e.g. http://127.0.0.1:9023) points it at an emulator."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    key = (os.getpid(), emulator)
    if key not in _GCS:
        import gcsfs
        if emulator:
            endpoint = emulator if "://" in emulator else f"http://{emulator}"
            _GCS[key] = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")
        else:
            _GCS[key] = gcsfs.GCSFileSystem()
    return _GCS[key]


def exists(path: str) -> bool:
    """Whether a local path or a gs:// object exists."""
    return gcs_filesystem().exists(path) if path.startswith("gs://") else os.path.exists(path)


def write_atomic(path: str, payload) -> None:
    """Write bytes (or a buffer) to a local file or a gs:// object so that readers see the old state or the whole new
    file, never a part. gs://: one upload (an object appears only once complete). Local: into a tmp name unique to
    this host, process and call (a shared NFS folder), fsynced, then renamed; a failed write (a full disk) removes
    the tmp file and raises."""
    if path.startswith("gs://"):
        gcs_filesystem().pipe_file(path, bytes(payload))
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_bytes(path: str) -> bytes:
    """The whole content of a local file or a gs:// object."""
    if path.startswith("gs://"):
        return gcs_filesystem().cat_file(path)
    with open(path, "rb") as f:
        return f.read()


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
    eight blocks put back in place (the public scheme of pydicom discussion #1618). Raises ValueError when no JP2
    header shows up where the scheme puts it."""
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


def _source_paths(source: Union[str, Sequence[str]]) -> List[str]:
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
    files = [_read_file(p, sop_classes) for p in _source_paths(source)]
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


def _read_index_file(path: str) -> Tuple[Optional[dict], List[dict]]:
    """(what the index was built from, or None for an index without that line; records)."""
    lines = [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]
    if lines and "built_from" in lines[0]:
        return lines[0]["built_from"], lines[1:]
    return None, lines


def read_index(path: str) -> List[dict]:
    """The records of an index written by write_index / `python data.py scan --out`."""
    return _read_index_file(path)[1]


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


# ----------------------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------------------

PERCENTILE_SAMPLE = 2 ** 18  # voxels that the clip percentiles are estimated from
AXIAL_JITTER = 0.1  # train crops move the retina up to this share of the crop height off the crop centre


def resampled_shape(shape: Sequence[int], spacing: Optional[Sequence[float]], cfg: Config) -> Tuple[int, int, int]:
    """[d,h,w] after resampling: to cfg.target_spacing when it and the volume's spacing are known, else image_size."""
    if cfg.target_spacing is None or spacing is None:
        return tuple(cfg.image_size)
    return tuple(max(1, round(n * s / t)) for n, s, t in zip(shape, spacing, cfg.target_spacing))


def resample(voxels: np.ndarray, size: Sequence[int]) -> torch.Tensor:
    """float32 [d,h,w] of voxels [D,H,W]: linear interpolation, anti-aliased along axes that shrink (the
    triangle filter is widened by the scale factor, so downsampling averages instead of skipping voxels)."""
    # 8-bit B-scans take torch's much faster uint8 path for the in-plane filter (output rounded to uint8)
    x = torch.from_numpy(voxels if voxels.dtype == np.uint8 else voxels.astype(np.float32))  # [D,H,W]
    (D, H, W), (d, h, w) = x.shape, size
    if (h, w) != (H, W):
        x = F.interpolate(x[:, None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)[:, 0]
    x = x.float()
    if d != D:  # [D,h,w] -> [1,1,D,h*w]: the same filter along the B-scan axis only
        x = F.interpolate(x.reshape(1, 1, D, h * w), size=(d, h * w), mode="bilinear", antialias=True,
                          align_corners=False).reshape(d, h, w)
    return x


def clip_limits(x: torch.Tensor, percentiles: Sequence[float]) -> Tuple[float, float]:
    """The intensity percentiles of a volume [d,h,w], estimated on an even subsample of PERCENTILE_SAMPLE voxels."""
    step = max(1, math.ceil((x.numel() / PERCENTILE_SAMPLE) ** (1 / 3)))
    lo, hi = np.percentile(x[::step, ::step, ::step].numpy(), percentiles)
    return float(lo), float(hi)


def prepare(volume: Volume, cfg: Config) -> np.ndarray:
    """The cacheable part of preprocessing: [d,h,w] = the volume resampled, clipped to its cfg.clip_percentiles
    and mapped onto the full range of its storage type (0 = low percentile, the dark background): uint8 for 8-bit
    sources (half the disk of 16 bits, no precision lost), else uint16."""
    if volume.spacing is None and cfg.target_spacing is not None and cfg.missing_spacing == "skip":
        raise UnusableFile("bad_spacing", volume.spacing_issue or "no spacing", volume.manufacturer, volume.model)
    x = resample(volume.voxels, resampled_shape(volume.voxels.shape, volume.spacing, cfg))  # [d,h,w]
    lo, hi = clip_limits(x, cfg.clip_percentiles)
    if not hi > lo:
        raise UnusableFile("blank", f"percentiles {cfg.clip_percentiles} are both {lo:g}", volume.manufacturer,
                           volume.model)
    dtype = np.uint8 if volume.voxels.dtype == np.uint8 else np.uint16
    levels = np.iinfo(dtype).max
    return x.clamp_(lo, hi).sub_(lo).mul_(levels / (hi - lo)).round_().numpy().astype(dtype)


def retina_row(prepared: np.ndarray) -> float:
    """The intensity-weighted mean row of a prepared volume [d,h,w]: where the retina is along the axial axis
    (the background is 0 after clipping). Estimated on about 4 B-scans: a cached volume is memory-mapped and each
    B-scan read costs disk pages."""
    d, h, w = prepared.shape
    sub = np.asarray(prepared[::max(1, d // 4), :, ::max(1, w // 32)], dtype=np.float64)  # [~4,h,~32]
    profile = sub.sum(axis=(0, 2))  # [h]
    total = profile.sum()
    return float(profile @ np.arange(h) / total) if total > 0 else (h - 1) / 2


def crop_starts(prepared: np.ndarray, size: Sequence[int], rng: Optional[np.random.Generator],
                train: bool) -> List[int]:
    """First voxel of the crop window of a prepared volume [d,h,w] per axis (negative: padding before). Axially the
    window is centred on the retina (retina_row), moved by up to AXIAL_JITTER of its height for train; the other
    axes are random for train and centred for val."""
    shape = prepared.shape
    starts = [(n - s) // 2 if not train else int(rng.integers(min(0, n - s), max(0, n - s) + 1))
              for n, s in zip(shape, size)]
    n, s = shape[1], size[1]
    axial = retina_row(prepared) - (s - 1) / 2
    if train:
        axial += rng.uniform(-AXIAL_JITTER, AXIAL_JITTER) * s
    starts[1] = int(np.clip(round(axial), min(0, n - s), max(0, n - s)))
    return starts


def to_sample(prepared: np.ndarray, cfg: Config, rng: Optional[np.random.Generator], train: bool) -> torch.Tensor:
    """float32 [1,D,H,W] model input of a prepared volume [d,h,w]: crop/pad to image_size, flip (train),
    zero mean and unit std over the sample, intensity jitter (train)."""
    size = cfg.image_size
    starts = crop_starts(prepared, size, rng, train)
    src = tuple(slice(max(a, 0), min(a + s, n)) for a, s, n in zip(starts, size, prepared.shape))
    region = prepared[src]
    if list(region.shape) != list(size):  # pad with 0: the clipped background
        padded = np.zeros(size, region.dtype)
        padded[tuple(slice(max(-a, 0), max(-a, 0) + n) for a, n in zip(starts, region.shape))] = region
        region = padded
    if train and rng.random() < cfg.flip_prob:
        region = region[:, :, ::-1]  # across the lateral axis
    x = torch.from_numpy(region.astype(np.float32))  # [D,H,W]; numpy's allocation page-faults far less than torch's
    # Normalized after crop/pad, always (incident 5): every sample has mean 0 and std 1 before jitter. Two passes
    # (mean, then deviations): one pass of sums of squares loses the std of bright low-contrast crops.
    flat = x.view(-1)
    std, mean = (float(v) for v in torch.std_mean(flat))
    gain, offset = 1.0, 0.0
    if train and cfg.intensity_jitter:
        gain, offset = 1.0 + rng.uniform(-1, 1) * cfg.intensity_jitter, rng.uniform(-1, 1) * cfg.intensity_jitter
    scale = gain / max(std, 1e-6)
    torch.add(torch.tensor(offset - mean * scale), flat, alpha=scale, out=flat)  # x * scale + shift in one pass
    return x[None]


# ----------------------------------------------------------------------------------------------------------
# Decoded-volume cache
# ----------------------------------------------------------------------------------------------------------

CACHE_VERSION = 2  # bump when prepare() changes: files of older versions are then never read
_CACHE_FAILED = []  # this process's first failure to write the cache, reported once


def cache_path(cfg: Config, paths: Sequence[str], sources: Optional[Sequence[str]] = None) -> str:
    """The cache file of a volume: its name hashes the sources, their identity (source_identity: a file written
    again gets a new entry) and every setting that prepare() depends on."""
    sources = list(sources) if sources else [source_identity(p) for p in paths]
    key = {"version": CACHE_VERSION, "paths": sorted(zip(paths, sources)), "target_spacing": cfg.target_spacing,
           "image_size": cfg.image_size, "clip_percentiles": cfg.clip_percentiles}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cfg.cache_dir, f"{digest}.npy")


def _cache(path: str, prepared: np.ndarray) -> None:
    """Store a prepared volume; when that fails (full disk, read-only folder) the volume is used uncached and
    the first failure of this process is reported."""
    try:
        buffer = io.BytesIO()
        np.save(buffer, prepared)
        write_atomic(path, buffer.getbuffer())
    except OSError as e:
        if not _CACHE_FAILED:
            _CACHE_FAILED.append(path)
            print(f"warning: volumes are not cached in {os.path.dirname(path)} ({type(e).__name__}: {e}); they are "
                  f"read from their source each time", file=sys.stderr)


def load_prepared(paths: Sequence[str], cfg: Config, sources: Optional[Sequence[str]] = None) -> np.ndarray:
    """The prepared volume [d,h,w] (uint8 or uint16) of one record: from cfg.cache_dir when cached there, else read
    and prepared (and cached when cfg.cache_dir is set). `sources` are the record's source identities (else they
    are looked up). Raises UnusableFile."""
    if cfg.cache_dir is None:
        return prepare(read_volume(paths, cfg.sop_classes), cfg)
    path = cache_path(cfg, paths, sources)
    try:
        cached = np.load(path, mmap_mode="r")  # only the crop is read from disk
        if cached.dtype in (np.uint8, np.uint16) and cached.ndim == 3:
            return cached
    except FileNotFoundError:
        pass
    except (ValueError, OSError, EOFError):
        pass  # a damaged file (e.g. cut by a full disk or a copy): rebuilt below, never read
    prepared = prepare(read_volume(paths, cfg.sop_classes), cfg)
    _cache(path, prepared)
    return prepared


# ----------------------------------------------------------------------------------------------------------
# Datasets and loader
# ----------------------------------------------------------------------------------------------------------

# Reserved "epochs" of sample_rng, beyond any run, so that no two streams share a generator.
VAL_EPOCH = 2 ** 32 - 1  # validation samples: sample_rng(seed, VAL_EPOCH, index), the same every time
ORDER_EPOCH = 2 ** 32 - 2  # the permutation of epoch e: sample_rng(seed, ORDER_EPOCH, e)
MAX_TRIES = 8  # files tried for one sample before the loader gives up


class NoUsableData(ExitError):
    """Nothing (or too little) to train on; the message holds the per-reason table."""
    exit_code = 3
    prefix = "no usable data:\n"


class OCTDataset(torch.utils.data.Dataset):
    """Samples of usable index records, keyed (epoch, index).

    Train samples draw crop, flip, jitter and mask from sample_rng(seed, epoch, index); validation samples
    are center crops without augmentation with a fixed mask per index. So a resumed run sees the same
    samples. A file that fails is replaced by other records chosen from the same key, and reported in
    the sample's `skipped` list: the batch stays full (incident 11).
    """

    def __init__(self, records: Sequence[dict], cfg: Config, train: bool):
        self.records, self.cfg, self.train = list(records), cfg, train
        self.masks = mask_generator_from_config(cfg)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: Tuple[int, int]) -> dict:
        epoch, index = key
        epoch = epoch if self.train else VAL_EPOCH
        skipped = []
        for attempt in range(MAX_TRIES):
            pick = index if attempt == 0 else int(sample_rng(self.cfg.seed, epoch, index, attempt).integers(len(self)))
            record = self.records[pick]
            try:
                prepared = load_prepared(record["paths"], self.cfg, record.get("sources"))
            except UnusableFile as e:
                skipped.append((record["paths"][0], e.reason, e.detail))
                continue
            rng = sample_rng(self.cfg.seed, epoch, index)
            volume = to_sample(prepared, self.cfg, rng, self.train)
            context, target = self.masks(rng)
            return {"volume": volume, "context_idx": torch.from_numpy(context), "target_idx": torch.from_numpy(target),
                    "path": record["paths"][0], "maker": record["manufacturer"], "skipped": skipped}
        raise NoUsableData(f"{MAX_TRIES} files in a row could not be used for sample {key}:\n"
                           f"{format_reason_table(Counter(reason for _, reason, _ in skipped))}")

    def geometry_report(self) -> str:
        """One line for --dry_run: the mean share of each axis cropped away or padded after resampling."""
        if not self.records:
            return "geometry          no volumes"
        shapes = np.array([resampled_shape(r["shape"], r["spacing"], self.cfg) for r in self.records])  # [N,3]
        size = np.array(self.cfg.image_size)
        crop = np.clip(1 - size / shapes, 0, None).mean(0)
        pad = np.clip(1 - shapes / size, 0, None).mean(0)
        mode = f"to {self.cfg.target_spacing} mm" if self.cfg.target_spacing else f"resized to {self.cfg.image_size}"
        return (f"geometry          after resampling ({mode}): cropped D/H/W {crop[0]:.0%}/{crop[1]:.0%}/"
                f"{crop[2]:.0%}, padded {pad[0]:.0%}/{pad[1]:.0%}/{pad[2]:.0%} (mean of {len(shapes)} volumes)")


class EpochSampler(torch.utils.data.Sampler):
    """(epoch, index) keys of one rank for `epochs` consecutive epochs from `epoch`: each a permutation from
    (seed, epoch) (identity when not shuffled), this rank's shard perm[rank::world_size] cut to `per_epoch` keys
    (default num_items // world_size, so that all ranks have the same count); the first epoch without its
    first `start` keys (resume mid-epoch)."""

    def __init__(self, num_items: int, rank: int = 0, world_size: int = 1, seed: int = 0, epoch: int = 0,
                 shuffle: bool = True, start: int = 0, epochs: int = 1, per_epoch: Optional[int] = None):
        self.num_items, self.rank, self.world_size = num_items, rank, world_size
        self.seed, self.epoch, self.shuffle, self.start, self.epochs = seed, epoch, shuffle, start, epochs
        self.per_epoch = num_items // world_size if per_epoch is None else min(per_epoch, num_items // world_size)

    def __iter__(self):
        n = self.num_items
        for epoch in range(self.epoch, self.epoch + self.epochs):
            order = sample_rng(self.seed, ORDER_EPOCH, epoch).permutation(n) if self.shuffle else np.arange(n)
            shard = order[self.rank::self.world_size][: self.per_epoch]
            yield from ((epoch, int(i)) for i in shard[self.start if epoch == self.epoch else 0:])

    def __len__(self) -> int:
        return max(0, self.per_epoch * self.epochs - self.start)


def collate(samples: List[dict]) -> dict:
    """One batch: volume [B,1,D,H,W], context_idx [B,Nc], target_idx [B,Nt]; path and maker lists; all skipped files."""
    stack = torch.utils.data.default_collate  # in a worker it stacks straight into shared memory
    return {"volume": stack([s["volume"] for s in samples]),
            "context_idx": stack([s["context_idx"] for s in samples]),
            "target_idx": stack([s["target_idx"] for s in samples]),
            "path": [s["path"] for s in samples], "maker": [s["maker"] for s in samples],
            "skipped": [item for s in samples for item in s["skipped"]]}


def make_loader(dataset: OCTDataset, batch_size: int, train: bool, workers: int, rank: int = 0, world_size: int = 1,
                epoch: int = 0, start: int = 0, seed: int = 0, epochs: int = 1,
                per_epoch: Optional[int] = None) -> torch.utils.data.DataLoader:
    """Batches of one rank over `epochs` epochs from `epoch` (one set of worker processes for all of them),
    shuffled for train and in order for val, always without a partial batch (static shapes: a smaller batch
    would compile a new XLA graph and cannot be split over the devices). `start` skips keys already consumed
    (resume mid-epoch); `per_epoch` keys of each epoch are used (a multiple of batch_size: no batch spans two)."""
    sampler = EpochSampler(len(dataset), rank, world_size, seed, epoch, shuffle=train, start=start, epochs=epochs,
                           per_epoch=per_epoch)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                                       collate_fn=collate, drop_last=True)


def ensure_phantoms(cfg: Config) -> str:
    """cfg.phantom_dir holding the built-in phantom set of cfg.phantom_count volumes, written once."""
    if not phantom_set_complete(cfg.phantom_dir, cfg.phantom_count, varied=cfg.phantom_varied):
        print(f"writing {cfg.phantom_count} phantom OCT volumes to {cfg.phantom_dir} (once)", file=sys.stderr)
        try:
            write_phantom_set(cfg.phantom_dir, cfg.phantom_count, varied=cfg.phantom_varied)
        except FileExistsError as e:
            raise ConfigError(f"phantom_dir: {e}") from None
    return cfg.phantom_dir


def index_records(cfg: Config) -> List[dict]:
    """The index of cfg's data. With cfg.index_path: the index there is reused when it was built from the same
    data_root, manifest, sop_classes and listing; else only what is new, changed or failed in passing (read errors)
    is scanned again, and the index is rewritten. With neither data_root nor manifest_path: the built-in phantom
    set (or, when index_path exists, that index as it is)."""
    root = cfg.data_root
    if root is None and cfg.manifest_path is None:
        if cfg.index_path is not None and exists(cfg.index_path):
            return read_index(cfg.index_path)
        root = ensure_phantoms(cfg)
    identities = list_sources(root, cfg.manifest_path)
    built_from = index_source(root, cfg.manifest_path, cfg.sop_classes, identities)
    old_from, records = (None, [])
    if cfg.index_path is not None and exists(cfg.index_path):
        old_from, records = _read_index_file(cfg.index_path)
    if old_from == built_from and not any(r["reason"] in TRANSIENT_REASONS for r in records):
        return records
    same_source = old_from is not None and all(old_from[k] == built_from[k] for k in ("data_root", "manifest_path",
                                                                                     "sop_classes"))
    records = update_index(records if same_source else [], identities, cfg.sop_classes, progress=True)
    if cfg.index_path is not None:
        write_index(records, cfg.index_path, built_from)
    return records


def val_draw(seed: int, patient: str) -> float:
    """A number in [0, 1) that depends only on (seed, patient): the patient is in val when it is < val_fraction."""
    digest = hashlib.sha256(f"{seed}/{patient}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def split_by_patient(records: Sequence[dict], val_fraction: float, seed: int) -> Tuple[List[dict], List[dict]]:
    """(train, val) records: whole patients (PatientID, else file) go to val by a hash of (seed, patient), so a
    patient's side never depends on the other patients (a lost or added file moves no one else). A set too small
    for that still gets one val patient and keeps one train patient."""
    draws = {p: val_draw(seed, p) for p in {r["patient"] for r in records}}
    val_patients = {p for p, u in draws.items() if u < val_fraction}
    by_draw = sorted(draws, key=draws.get)
    if val_fraction > 0 and not val_patients and len(by_draw) > 1:
        val_patients = {by_draw[0]}
    if len(val_patients) == len(by_draw) and by_draw:
        val_patients.discard(by_draw[-1])
    return ([r for r in records if r["patient"] not in val_patients],
            [r for r in records if r["patient"] in val_patients])


def build_datasets(cfg: Config) -> Tuple[OCTDataset, OCTDataset]:
    """(train, val) datasets of cfg's data, split by patient. Raises NoUsableData when no volume is usable or
    the share of bad files passes cfg.max_bad_fraction (other objects such as reports are not bad files)."""
    if cfg.cache_dir is not None and cfg.cache_dir.startswith("gs://"):
        raise ConfigError("cache_dir: the decoded-volume cache must be a local folder (it is read at every step).")
    if cfg.data_root is None and cfg.manifest_path is None and cfg.cache_dir is None:
        cfg = replace(cfg, cache_dir=cfg.phantom_dir.rstrip("/") + "-cache")  # decode the built-in phantoms once
    records = index_records(cfg)
    if cfg.target_spacing is not None and cfg.missing_spacing == "skip":
        records = [{**r, "ok": False, "reason": "bad_spacing", "detail": r.get("spacing_issue")}
                   if r["ok"] and r["spacing"] is None else r for r in records]
    usable = [r for r in records if r["ok"]]
    bad = [r for r in records if not r["ok"] and r["reason"] not in BENIGN_REASONS]
    if not usable or len(bad) > cfg.max_bad_fraction * (len(usable) + len(bad)):
        source = cfg.data_root or cfg.manifest_path or cfg.phantom_dir
        raise NoUsableData(f"{len(usable)} usable volumes and {len(bad)} unusable files in {source} (max_bad_fraction "
                           f"{cfg.max_bad_fraction}; {', '.join(BENIGN_REASONS)} are other objects, not counted):\n"
                           f"{format_reason_table(reason_counts(records))}\n"
                           f"run `python data.py scan {source}` for the details of each file")
    if len(usable) < len(records):  # incident 11: every file that is not used is reported, by reason
        print(f"{len(records) - len(usable)} of {len(records)} index records are not used:\n"
              f"{format_reason_table(reason_counts(records))}", file=sys.stderr)
    train, val = split_by_patient(usable, cfg.val_fraction, cfg.seed)
    return OCTDataset(train, cfg, train=True), OCTDataset(val, cfg, train=False)


def load_training_volume(path: Union[str, Sequence[str]], cfg: Config) -> torch.Tensor:
    """float32 [1,D,H,W] of one file, series folder or list of series files, preprocessed like validation
    samples (center crop, no augmentation). Raises UnusableFile."""
    return to_sample(load_prepared(_source_paths(path), cfg), cfg, None, train=False)


# ----------------------------------------------------------------------------------------------------------
# Command line: scan, prepare, phantoms
# ----------------------------------------------------------------------------------------------------------

def _prepare_one(job: Tuple[List[str], List[str], Config]) -> Optional[Tuple[str, str, str]]:
    paths, sources, cfg = job
    try:
        load_prepared(paths, cfg, sources)
        return None
    except UnusableFile as e:
        return paths[0], e.reason, e.detail


def prepare_cache(cfg: Config, progress: bool = True) -> Tuple[int, List[Tuple[str, str, str]]]:
    """Decode and prepare every usable volume of cfg's data into cfg.cache_dir with cfg.workers processes;
    returns (volumes cached, [(path, reason, detail) of failures])."""
    usable = [r for r in index_records(cfg) if r["ok"]]
    jobs = [(r["paths"], r.get("sources"), cfg) for r in usable]
    with ProcessPoolExecutor(max(1, cfg.workers)) as pool:
        results = list(tqdm(pool.map(_prepare_one, jobs, chunksize=4), total=len(jobs), unit="volume",
                            desc="prepare", disable=None if progress else True))
    failed = [r for r in results if r is not None]
    return len(jobs) - len(failed), failed


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="data.py")
    commands = parser.add_subparsers(dest="command", required=True)
    scan = commands.add_parser("scan", help="list usable volumes and rejected files by maker and reason")
    scan.add_argument("src", help="folder, glob or gs:// prefix (manifest paths are relative to it)")
    scan.add_argument("--out", help="write the JSON-lines index here (training reuses it via --index_path)")
    prep = commands.add_parser("prepare", help="decode and resample every volume once into a local cache")
    prep.add_argument("src", help="folder, glob or gs:// prefix")
    prep.add_argument("--cache", required=True, help="cache folder (train with --cache_dir DIR)")
    add_phantom_options(commands.add_parser("phantoms", config_flags=False, help="write a phantom set"))
    args, rest = parser.parse(argv)
    if args.command == "phantoms":
        if rest:
            parser.error(f"phantoms takes no config flags: {' '.join(rest)}")
        return write_phantoms_of(args)
    cfg = load_config(rest, data_root=args.src)
    if args.command == "scan":
        identities = list_sources(cfg.data_root, cfg.manifest_path)
        records = update_index([], identities, cfg.sop_classes, progress=True)
        print(format_scan_report(records))
        if args.out:
            write_index(records, args.out, index_source(cfg.data_root, cfg.manifest_path, cfg.sop_classes, identities))
            print(f"index of {len(records)} records written to {args.out}")
        return 0
    done, failed = prepare_cache(replace(cfg, cache_dir=args.cache))
    print(f"{done} volumes prepared in {args.cache}; train with --cache_dir {args.cache} and the same "
          f"image_size/target_spacing/clip_percentiles")
    if failed:
        print(f"{len(failed)} volumes failed:\n{format_reason_table(Counter(reason for _, reason, _ in failed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
