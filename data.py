"""OCT data for octjepa: patch masks, DICOM reading, preprocessing, datasets and loader, cache, CLI.

    python data.py scan SRC [--out index.jsonl] [--sop_classes any] [config flags]   # what is usable, and why not
    python data.py prepare SRC --cache DIR [config flags]      # decode + resample once into a local cache
    python data.py phantoms DIR [--n N] [--size D,H,W]         # write a synthetic phantom set

SRC is a folder (recursive), a glob, a gs:// prefix or glob, or a manifest (--manifest_path, a TSV/CSV with a
`filepath` column relative to SRC). gs:// goes through gcsfs; set STORAGE_EMULATOR_HOST to use a local
emulator. A sample is: read the DICOM (any maker, multi-frame or one file per B-scan) -> resample to
target_spacing (or resize to image_size) -> robust percentile clip, stored as uint16 (what the cache holds)
-> random (train) / center (val) crop and pad to image_size -> zero mean, unit std over the sample -> flip
and intensity jitter (train) -> patch mask. Files that cannot be used raise UnusableFile with a stable
reason code (REASONS); the loader replaces them and reports them (incident 11).

Masks are index tensors of a fixed length per sample (incident 6): every sample of a config has exactly
`n_target = round(mask_ratio * N)` target tokens and `N - n_target` context tokens, disjoint and covering
all N tokens, so batches have static shapes and no token is thrown away.
"""
import argparse
import csv
import glob
import hashlib
import io
import json
import math
import os
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

from config import Config, ConfigError, load_config

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
PIXEL_DATA = 0x7FE00010
MIN_SHAPE = (4, 32, 32)  # [D,H,W]: a smaller volume holds too little to crop a training sample from
SPACING_RANGE_MM = (1e-4, 5.0)  # plausible OCT voxel sizes; a value outside is garbled
SIDECAR_EXTENSIONS = (".csv", ".tsv", ".json", ".jsonl", ".txt", ".md", ".yaml", ".yml", ".log")

REASONS = {  # stable codes used in the scan index, events.jsonl and NoUsableData -> what they mean
    "empty_file": "the file has 0 bytes",
    "not_dicom": "not a DICOM file (no DICM prefix)",
    "truncated": "the file ends before its data does (interrupted copy or upload)",
    "empty_dataset": "pydicom read no data elements",
    "read_error": "the file could not be read (I/O or unexpected parser error)",
    "not_oct": "another object (en-face, fundus, analysis, report...); --sop_classes any accepts generic images",
    "not_image": "no pixel data and not an OCT object (report, analysis, DICOMDIR...)",
    "not_grayscale": "a colour image (more than one sample per pixel)",
    "no_pixel_data": "an OCT object without PixelData",
    "bad_header": "image tags missing or inconsistent (Rows, Columns, BitsAllocated, series geometry)",
    "frame_count_mismatch": "the pixel data holds another number of frames than NumberOfFrames says",
    "undecodable": "the pixel data could not be decoded (obfuscated or corrupt stream, e.g. Zeiss Cirrus)",
    "too_small": f"fewer voxels than {list(MIN_SHAPE)} [D,H,W]",
    "bad_spacing": "voxel spacing missing or garbled, and missing_spacing is skip",
    "blank": "constant intensity: nothing to learn from",
}
BENIGN_REASONS = ("not_dicom", "not_oct", "not_image", "not_grayscale")  # other objects: listed, not bad files


class UnusableFile(Exception):
    """An input that cannot be trained on: `reason` is a stable code of REASONS, `detail` says more."""

    def __init__(self, reason: str, detail: str = "", manufacturer: str = "", model: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.manufacturer, self.model = reason, detail, manufacturer, model

    def __reduce__(self):  # keep the fields across processes (DataLoader workers, prepare pool)
        return UnusableFile, (self.reason, self.detail, self.manufacturer, self.model)


@dataclass
class Volume:
    """One OCT volume as stored: voxels [D,H,W] = frames, rows, columns in stack order."""
    voxels: np.ndarray  # native dtype (uint8/uint16/int16), float32 when RescaleSlope/Intercept apply
    spacing: Optional[Tuple[float, float, float]]  # (dz, dy, dx) mm; None when missing or garbled
    manufacturer: str
    model: str
    source: str  # path or URL (the first file of a series)
    spacing_issue: Optional[str] = None  # why spacing is None


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


def read_bytes(path: str) -> bytes:
    """The whole content of a local file or a gs:// object."""
    if path.startswith("gs://"):
        return gcs_filesystem().cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def _ends_cleanly(ds: pydicom.Dataset, size: int) -> bool:
    """False when the file stops inside an element: pydicom then silently drops or shortens it, and returns an
    empty dataset for a JPEG 2000 file cut inside its pixel data (with only a warning, not an error)."""
    if len(ds) == 0:
        meta_length = ds.file_meta.get("FileMetaInformationGroupLength")
        return meta_length is None or 132 + 12 + meta_length == size  # only a meta header: empty, not cut
    last = ds.get_item(max(ds.keys()))
    if last is None or not getattr(last, "is_raw", False) or last.length == 0xFFFFFFFF:
        return True
    return last.value_tell + last.length == size


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
        except InvalidDicomError as e:
            raise UnusableFile("not_dicom", str(e).split(".")[0]) from None
        except EOFError as e:
            raise UnusableFile("truncated", f"{size} bytes: {e}") from None
        except Exception as e:
            raise UnusableFile("read_error", f"{type(e).__name__}: {e}") from None
    if not _ends_cleanly(ds, size):
        what = "pydicom returned an empty dataset" if len(ds) == 0 else f"{len(ds)} elements read"
        raise UnusableFile("truncated", f"{size} bytes, {what}")
    if len(ds) == 0:
        raise UnusableFile("empty_dataset", "no data elements after the file meta information")
    return ds


def _maker(ds: pydicom.Dataset) -> Tuple[str, str]:
    return str(ds.get("Manufacturer", "") or ""), str(ds.get("ManufacturerModelName", "") or "")


def _check_header(ds: pydicom.Dataset, sop_classes: str) -> Tuple[int, int, int]:
    """(frames, rows, columns) of an image that `sop_classes` accepts."""
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
    return int(ds.get("NumberOfFrames") or 1), int(rows), int(cols)


def _check_frames(ds: pydicom.Dataset, frames: int, rows: int, cols: int) -> None:
    """The pixel data holds exactly NumberOfFrames frames."""
    if ds.file_meta.TransferSyntaxUID.is_encapsulated:
        try:
            found = sum(1 for _ in pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=frames))
        except Exception as e:  # fewer fragments than frames, broken item tags
            raise UnusableFile("frame_count_mismatch", f"NumberOfFrames {frames}: {e}") from None
        if found != frames:
            raise UnusableFile("frame_count_mismatch", f"{found} encoded frames, NumberOfFrames {frames}")
        return
    frame_bytes = rows * cols * ds.BitsAllocated // 8
    size = len(ds.PixelData)
    if size // frame_bytes != frames or size % frame_bytes > 1:  # one padding byte is allowed
        raise UnusableFile("frame_count_mismatch", f"{size / frame_bytes:g} frames of {rows}x{cols} in "
                                                   f"{size} bytes, NumberOfFrames {frames}")


def _decode(ds: pydicom.Dataset, frames: int, rows: int, cols: int, first_only: bool = False) -> np.ndarray:
    """All frames (or the first) [F,H,W] in file order, after MONOCHROME1 inversion and rescale."""
    syntax = ds.file_meta.TransferSyntaxUID
    frames = 1 if first_only else frames
    try:  # real decoding by the plugins (pylibjpeg-openjpeg for JPEG 2000), never a rewritten syntax (incident 11)
        voxels = pydicom.pixels.pixel_array(ds, index=0) if first_only else ds.pixel_array
    except Exception as e:
        raise UnusableFile("undecodable", f"{syntax.name}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if voxels.size != frames * rows * cols:
        raise UnusableFile("undecodable", f"{syntax.name}: decoded {voxels.shape}, expected {frames}x{rows}x{cols}")
    voxels = voxels.reshape(frames, rows, cols)
    if ds.get("PhotometricInterpretation") == "MONOCHROME1":  # stored with black as the maximum
        voxels = (2 ** int(ds.get("BitsStored", ds.BitsAllocated)) - 1 - voxels if voxels.dtype.kind == "u"
                  else ~voxels).astype(voxels.dtype)
    transform = _places(ds, "PixelValueTransformationSequence")
    slope, intercept = float(_first(transform, "RescaleSlope") or 1), float(_first(transform, "RescaleIntercept") or 0)
    if (slope, intercept) != (1.0, 0.0):
        voxels = voxels.astype(np.float32) * np.float32(slope) + np.float32(intercept)
    return voxels


def _groups(ds: pydicom.Dataset, name: str) -> List[pydicom.Dataset]:
    seq = ds.get(name)
    return list(seq) if seq else []


def _places(ds: pydicom.Dataset, macro: str) -> List[pydicom.Dataset]:
    """Where the tags of a functional-group macro may be: shared groups, the first frame's groups, top level."""
    groups = _groups(ds, "SharedFunctionalGroupsSequence")[:1] + _groups(ds, "PerFrameFunctionalGroupsSequence")[:1]
    return [item for group in groups for item in _groups(group, macro)[:1]] + [ds]


def _first(places: Sequence[pydicom.Dataset], *names: str):
    """The first value of the given tags found in the places, in order."""
    for place in places:
        for name in names:
            value = place.get(name)
            if value is not None and value != "":
                return value
    return None


def _frame_position(item: pydicom.Dataset) -> Optional[np.ndarray]:
    """ImagePositionPatient of a per-frame group item or of a single-frame dataset."""
    position = _first(_groups(item, "PlanePositionSequence")[:1] + [item], "ImagePositionPatient")
    return np.array([float(v) for v in position]) if position is not None and len(position) == 3 else None


def _frame_content(item: pydicom.Dataset, name: str):
    value = _first(_groups(item, "FrameContentSequence")[:1] + [item], name)
    return tuple(value) if isinstance(value, pydicom.multival.MultiValue) else value


def _stack_normal(ds: pydicom.Dataset) -> np.ndarray:
    """Normal of the B-scan planes (ImageOrientationPatient row x column); z when absent."""
    orientation = _first(_places(ds, "PlaneOrientationSequence"), "ImageOrientationPatient")
    if orientation is None or len(orientation) != 6:
        return np.array([0.0, 0.0, 1.0])
    values = [float(v) for v in orientation]
    return np.cross(values[:3], values[3:])


def _stack_order(items: Sequence[pydicom.Dataset], normal: np.ndarray) -> np.ndarray:
    """Indices that put frames (per-frame group items) or files (single-frame datasets) in stack order.

    By InStackPositionNumber, else DimensionIndexValues, else position along the stack normal, else
    InstanceNumber: the first key that every item has and no two items share; else as stored.
    """
    def along_normal(item):
        position = _frame_position(item)
        return None if position is None else round(float(position @ normal), 6)

    for key_of in (lambda item: _frame_content(item, "InStackPositionNumber"),
                   lambda item: _frame_content(item, "DimensionIndexValues"),
                   along_normal,
                   lambda item: item.get("InstanceNumber")):
        keys = [key_of(item) for item in items]
        if None not in keys and len(set(keys)) == len(keys):
            return np.array(sorted(range(len(items)), key=keys.__getitem__))
    return np.arange(len(items))


def _spacing(ds: pydicom.Dataset, frame_items: Sequence[pydicom.Dataset]):
    """((dz, dy, dx) mm, None) or (None, why). PixelSpacing is [axial, lateral]; the B-scan spacing is
    SpacingBetweenSlices or SliceThickness, else the distance between consecutive frame positions.

    The first value found (shared groups, first frame's groups, top level) is used; a garbled one is
    reported, never silently replaced by a value found later.
    """
    places = _places(ds, "PixelMeasuresSequence")
    try:
        pixel = _first(places, "PixelSpacing")
        dz = _first(places, "SpacingBetweenSlices", "SliceThickness")
        positions = [] if dz is not None else [p for p in map(_frame_position, frame_items) if p is not None]
        if len(positions) >= 2 and len(positions) == len(frame_items):
            dz = float(np.median(np.linalg.norm(np.diff(positions, axis=0), axis=1)))
        if pixel is None or dz is None:
            return None, f"missing {'PixelSpacing' if pixel is None else 'B-scan spacing'}"
        spacing = (float(dz), float(pixel[0]), float(pixel[1]))
    except (ValueError, TypeError, IndexError) as e:
        return None, f"garbled: {e}"
    lo, hi = SPACING_RANGE_MM
    if not all(lo <= s <= hi for s in spacing):  # also false for nan
        return None, f"garbled: (dz, dy, dx) = {spacing} mm"
    return spacing, None


def _source_paths(source: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(source, str):
        return find_files(source) if os.path.isdir(source) else [source]
    return list(source)


def read_volume(source: Union[str, Sequence[str]], sop_classes: str = "oct") -> Volume:
    """The OCT volume of a path, a gs:// URL, or a series (a list of paths or a local folder, one file per B-scan).

    Raises UnusableFile with a stable reason code when the input cannot be used.
    """
    paths = _source_paths(source)
    datasets = [_parse(p) for p in paths]
    ds = datasets[0]
    manufacturer, model = _maker(ds)
    try:
        shapes = [_check_header(d, sop_classes) for d in datasets]
        if len(datasets) > 1 and any(s != (1, *shapes[0][1:]) for s in shapes):
            raise UnusableFile("bad_header", f"a series needs single-frame files of one size: {sorted(set(shapes))}")
        for d, shape in zip(datasets, shapes):
            _check_frames(d, *shape)
        if len(datasets) == 1:
            voxels = _decode(ds, *shapes[0])
            frame_items = _groups(ds, "PerFrameFunctionalGroupsSequence")
            if len(frame_items) != len(voxels):
                frame_items = []
        else:
            voxels = np.concatenate([_decode(d, *s) for d, s in zip(datasets, shapes)])
            frame_items = datasets
        order = _stack_order(frame_items, _stack_normal(ds)) if frame_items else np.arange(len(voxels))
        if (order != np.arange(len(order))).any():
            voxels, frame_items = voxels[order], [frame_items[i] for i in order]
        if any(n < m for n, m in zip(voxels.shape, MIN_SHAPE)):
            raise UnusableFile("too_small", f"shape {list(voxels.shape)} < {list(MIN_SHAPE)}")
    except UnusableFile as e:
        raise UnusableFile(e.reason, e.detail, manufacturer, model) from None
    spacing, issue = _spacing(ds, frame_items)
    return Volume(np.ascontiguousarray(voxels), spacing, manufacturer, model, paths[0], issue)


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


def find_files(data_root: Optional[str], manifest_path: Optional[str] = None) -> List[str]:
    """Every candidate file of a source, sorted: the manifest's `filepath` column when given, else data_root as
    a folder (recursive), a glob or a single file, local or gs://. Hidden files and sidecars (csv, json, txt...)
    are left out."""
    if manifest_path is not None:
        return sorted(set(_manifest_paths(manifest_path, data_root)))
    if data_root is None:
        raise ConfigError("data_root: give a folder, glob or gs:// prefix of DICOM files (or a manifest_path).")
    is_glob = any(c in data_root for c in "*?[")
    if data_root.startswith("gs://"):
        fs = gcs_filesystem()
        found = fs.glob(data_root, detail=True) if is_glob else fs.find(data_root, detail=True)
        paths = ["gs://" + name for name, info in found.items() if info.get("type") == "file"]
    elif is_glob:
        paths = [p for p in glob.glob(data_root, recursive=True) if os.path.isfile(p)]
    elif os.path.isdir(data_root):
        paths = []
        for folder, subfolders, files in os.walk(data_root):
            subfolders[:] = [f for f in subfolders if not f.startswith(".")]  # .git, editors' and writers' temp folders
            paths += [os.path.join(folder, f) for f in files]
    elif os.path.isfile(data_root):
        paths = [data_root]
    else:
        raise ConfigError(f"data_root: {data_root!r} is not a folder, glob or file.")
    return sorted(p for p in paths if _is_candidate(p))


def _patient_key(ds: pydicom.Dataset, path: str) -> str:
    """A hash of PatientID (the index holds no identifiers), else the file: the unit of the train/val split."""
    patient = str(ds.get("PatientID", "") or "").strip()
    return hashlib.sha256(patient.encode()).hexdigest()[:16] if patient else f"file:{path}"


def _reject(paths: Sequence[str], error: UnusableFile) -> dict:
    return {"paths": list(paths), "ok": False, "reason": error.reason, "detail": error.detail,
            "manufacturer": error.manufacturer, "model": error.model, "shape": None, "spacing": None}


def inspect_file(path: str, sop_classes: str = "oct") -> dict:
    """Header facts of one file without decoding it all: maker, frames, rows, columns, spacing, series.

    Checks everything but the pixel values; encapsulated data get their first frame decoded, which catches
    obfuscated streams. Raises UnusableFile. Single-frame files keep their header (no pixels) in `_ds`.
    """
    ds = _parse(path)
    manufacturer, model = _maker(ds)
    try:
        frames, rows, cols = _check_header(ds, sop_classes)
        _check_frames(ds, frames, rows, cols)
        if ds.file_meta.TransferSyntaxUID.is_encapsulated:
            _decode(ds, frames, rows, cols, first_only=True)
    except UnusableFile as e:
        raise UnusableFile(e.reason, e.detail, manufacturer, model) from None
    frame_items = _groups(ds, "PerFrameFunctionalGroupsSequence")
    spacing, issue = _spacing(ds, frame_items if len(frame_items) == frames else [])
    del ds.PixelData
    return {"path": path, "frames": frames, "rows": rows, "cols": cols, "manufacturer": manufacturer,
            "model": model, "spacing": spacing, "spacing_issue": issue, "patient": _patient_key(ds, path),
            "series": str(ds.get("SeriesInstanceUID", "") or path), "bits": int(ds.BitsAllocated),
            "transfer_syntax": ds.file_meta.TransferSyntaxUID.name, "_ds": ds if frames == 1 else None}


def _volume_record(infos: List[dict]) -> dict:
    """The index record of one volume: a multi-frame file, or single-frame files of one series in stack order."""
    first = infos[0]
    if len(infos) > 1:
        datasets = [i["_ds"] for i in infos]
        infos = [infos[k] for k in _stack_order(datasets, _stack_normal(datasets[0]))]
        spacing, issue = _spacing(infos[0]["_ds"], [i["_ds"] for i in infos])
    else:
        spacing, issue = first["spacing"], first["spacing_issue"]
    shape = [sum(i["frames"] for i in infos), first["rows"], first["cols"]]
    record = {"paths": [i["path"] for i in infos], "ok": True, "reason": None, "detail": None,
              "manufacturer": first["manufacturer"], "model": first["model"], "shape": shape,
              "spacing": list(spacing) if spacing else None, "spacing_issue": issue, "patient": first["patient"],
              "transfer_syntax": first["transfer_syntax"], "bits": first["bits"]}
    if any(n < m for n, m in zip(shape, MIN_SHAPE)):
        record.update(ok=False, reason="too_small", detail=f"shape {shape} < {list(MIN_SHAPE)}")
    return record


def scan_files(files: Sequence[str], sop_classes: str = "oct", progress: bool = False, threads: int = 8) -> List[dict]:
    """Index records: one per volume (a multi-frame file, or the single-frame files of one series) and one
    per rejected file, so every file appears exactly once. A record has paths, ok, reason (None when ok),
    detail, manufacturer, model, shape [D,H,W], spacing [dz,dy,dx] or None, spacing_issue, patient.
    """
    def inspect(path):
        try:
            return inspect_file(path, sop_classes)
        except UnusableFile as e:
            return e

    from tqdm import tqdm
    with ThreadPoolExecutor(threads) as pool:  # fetching (gs://) and file reads overlap
        results = list(tqdm(pool.map(inspect, files), total=len(files), unit="file", desc="scan",
                            disable=None if progress else True))  # None: a bar on a terminal only
    records, series = [], {}
    for path, result in zip(files, results):
        if isinstance(result, UnusableFile):
            records.append(_reject([path], result))
        elif result["frames"] > 1:
            records.append(_volume_record([result]))
        else:
            series.setdefault((result["series"], result["rows"], result["cols"]), []).append(result)
    records += [_volume_record(infos) for infos in series.values()]
    return sorted(records, key=lambda r: r["paths"][0])


def write_index(records: Sequence[dict], path: str) -> None:
    """JSON lines, one record each, written so that readers never see a partial index."""
    payload = "".join(json.dumps(r) + "\n" for r in records).encode()
    if path.startswith("gs://"):
        gcs_filesystem().pipe_file(path, payload)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def read_index(path: str) -> List[dict]:
    """The records of an index written by write_index / `python data.py scan --out`."""
    return [json.loads(line) for line in read_bytes(path).decode().splitlines() if line.strip()]


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
    """Per manufacturer and model: files, accepted volumes, rejects by reason, shape and spacing medians."""
    groups = {}
    for r in records:
        groups.setdefault((r["manufacturer"] or "(unknown)", r["model"] or ""), []).append(r)
    header = (f"{'manufacturer':<24} {'model':<20} {'files':>6} {'volumes':>7} {'no spacing':>10}  "
              f"{'median shape D,H,W':<19} {'median spacing dz,dy,dx mm':<27} rejected")
    lines = [header]
    for (maker, model), rs in sorted(groups.items()):
        ok = [r for r in rs if r["ok"]]
        shape = ",".join(str(int(v)) for v in np.median([r["shape"] for r in ok], axis=0)) if ok else "-"
        spaced = [r["spacing"] for r in ok if r["spacing"]]
        spacing = ",".join(f"{v:.4f}" for v in np.median(spaced, axis=0)) if spaced else "-"
        rejects = ", ".join(f"{k} {v}" for k, v in sorted(reason_counts(rs).items())) or "-"
        lines.append(f"{maker[:24]:<24} {model[:20]:<20} {sum(len(r['paths']) for r in rs):>6} {len(ok):>7} "
                     f"{len(ok) - len(spaced):>10}  {shape:<19} {spacing:<27} {rejects}")
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

QUANT_MAX = 65535  # a prepared volume maps its clipped intensity range onto uint16 0..65535
PERCENTILE_SAMPLE = 2 ** 18  # voxels that the clip percentiles are estimated from


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
    """The cacheable part of preprocessing: uint16 [d,h,w] = the volume resampled, clipped to its
    cfg.clip_percentiles and mapped onto 0..65535 (0 = low percentile, the dark background)."""
    if volume.spacing is None and cfg.target_spacing is not None and cfg.missing_spacing == "skip":
        raise UnusableFile("bad_spacing", volume.spacing_issue or "no spacing", volume.manufacturer, volume.model)
    x = resample(volume.voxels, resampled_shape(volume.voxels.shape, volume.spacing, cfg))  # [d,h,w]
    lo, hi = clip_limits(x, cfg.clip_percentiles)
    if not hi > lo:
        raise UnusableFile("blank", f"percentiles {cfg.clip_percentiles} are both {lo:g}", volume.manufacturer,
                           volume.model)
    return x.clamp_(lo, hi).sub_(lo).mul_(QUANT_MAX / (hi - lo)).round_().numpy().astype(np.uint16)


def crop_starts(shape: Sequence[int], size: Sequence[int], rng: Optional[np.random.Generator],
                train: bool) -> List[int]:
    """First voxel of the crop window per axis (negative: padding before): random for train, centered for val."""
    if not train:
        return [(n - s) // 2 for n, s in zip(shape, size)]
    return [int(rng.integers(min(0, n - s), max(0, n - s) + 1)) for n, s in zip(shape, size)]


def to_sample(prepared: np.ndarray, cfg: Config, rng: Optional[np.random.Generator], train: bool) -> torch.Tensor:
    """float32 [1,D,H,W] model input of a prepared volume [d,h,w]: crop/pad to image_size, flip (train),
    zero mean and unit std over the sample, intensity jitter (train)."""
    size = cfg.image_size
    starts = crop_starts(prepared.shape, size, rng, train)
    src = tuple(slice(max(a, 0), min(a + s, n)) for a, s, n in zip(starts, size, prepared.shape))
    region = prepared[src]
    if list(region.shape) != list(size):  # pad with 0: the clipped background
        padded = np.zeros(size, np.uint16)
        padded[tuple(slice(max(-a, 0), max(-a, 0) + n) for a, n in zip(starts, region.shape))] = region
        region = padded
    if train and rng.random() < cfg.flip_prob:
        region = region[:, :, ::-1]  # across the lateral axis
    x = torch.from_numpy(region.astype(np.float32))  # [D,H,W]; numpy's allocation page-faults far less than torch's
    # Normalized after crop/pad, always (incident 5): every sample has mean 0 and std 1 before jitter.
    flat, n = x.view(-1), x.numel()
    total, squares = float(flat.sum()), float(torch.dot(flat, flat))  # two fast passes; error ~1e-4 of std
    mean = total / n
    std = math.sqrt(max(squares - total * mean, 0.0) / max(n - 1, 1))
    gain, offset = 1.0, 0.0
    if train and cfg.intensity_jitter:
        gain, offset = 1.0 + rng.uniform(-1, 1) * cfg.intensity_jitter, rng.uniform(-1, 1) * cfg.intensity_jitter
    scale = gain / max(std, 1e-6)
    torch.add(torch.tensor(offset - mean * scale), flat, alpha=scale, out=flat)  # x * scale + shift in one pass
    return x[None]


# ----------------------------------------------------------------------------------------------------------
# Decoded-volume cache
# ----------------------------------------------------------------------------------------------------------

CACHE_VERSION = 1  # bump when prepare() changes: files of older versions are then never read


def cache_path(cfg: Config, paths: Sequence[str]) -> str:
    """The cache file of a volume: its name hashes the sources and every setting that prepare() depends on."""
    key = {"version": CACHE_VERSION, "paths": sorted(paths), "target_spacing": cfg.target_spacing,
           "image_size": cfg.image_size, "clip_percentiles": cfg.clip_percentiles}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cfg.cache_dir, f"{digest}.npy")


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)  # readers see no file or the whole file


def load_prepared(paths: Sequence[str], cfg: Config) -> np.ndarray:
    """The prepared volume uint16 [d,h,w] of one record: from cfg.cache_dir when cached there, else read and
    prepared (and cached when cfg.cache_dir is set). Raises UnusableFile."""
    if cfg.cache_dir is None:
        return prepare(read_volume(paths, cfg.sop_classes), cfg)
    path = cache_path(cfg, paths)
    try:
        cached = np.load(path, mmap_mode="r")  # only the crop is read from disk
        if cached.dtype == np.uint16 and cached.ndim == 3:
            return cached
    except FileNotFoundError:
        pass
    except (ValueError, OSError, EOFError):
        pass  # a damaged file (e.g. cut by a full disk or a copy): rebuilt below, never read
    prepared = prepare(read_volume(paths, cfg.sop_classes), cfg)
    _save_npy_atomic(path, prepared)
    return prepared


# ----------------------------------------------------------------------------------------------------------
# Datasets and loader
# ----------------------------------------------------------------------------------------------------------

# Reserved "epochs" of sample_rng, beyond any run, so that no two streams share a generator.
VAL_EPOCH = 2 ** 32 - 1  # validation samples: sample_rng(seed, VAL_EPOCH, index), the same every time
ORDER_EPOCH = 2 ** 32 - 2  # the permutation of epoch e: sample_rng(seed, ORDER_EPOCH, e)
SPLIT_EPOCH = 2 ** 32 - 3  # the train/val split of patients
MAX_TRIES = 8  # files tried for one sample before the loader gives up


class NoUsableData(Exception):
    """Nothing (or too little) to train on; the message holds the per-reason table. train.py exits 3."""


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
                prepared = load_prepared(record["paths"], self.cfg)
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
    from phantom import phantom_set_complete, write_phantom_set
    if not phantom_set_complete(cfg.phantom_dir, cfg.phantom_count):
        print(f"writing {cfg.phantom_count} phantom OCT volumes to {cfg.phantom_dir} (once)", file=sys.stderr)
        try:
            write_phantom_set(cfg.phantom_dir, cfg.phantom_count)
        except FileExistsError as e:
            raise ConfigError(f"phantom_dir: {e}") from None
    return cfg.phantom_dir


def _exists(path: str) -> bool:
    return gcs_filesystem().exists(path) if path.startswith("gs://") else os.path.exists(path)


def index_records(cfg: Config) -> List[dict]:
    """The index of cfg's data: read from cfg.index_path when it exists, else scanned (and written there when set).
    With neither data_root nor manifest_path: the built-in phantom set."""
    if cfg.index_path is not None and _exists(cfg.index_path):
        return read_index(cfg.index_path)
    root = cfg.data_root
    if root is None and cfg.manifest_path is None:
        root = ensure_phantoms(cfg)
    records = scan_files(find_files(root, cfg.manifest_path), cfg.sop_classes, progress=True)
    if cfg.index_path is not None:
        write_index(records, cfg.index_path)
    return records


def split_by_patient(records: Sequence[dict], val_fraction: float, seed: int) -> Tuple[List[dict], List[dict]]:
    """(train, val) records: a deterministic share of patients (PatientID, else file) goes to val, whole."""
    patients = sorted({r["patient"] for r in records})
    order = sample_rng(seed, SPLIT_EPOCH).permutation(len(patients))
    n_val = min(len(patients) - 1, max(int(val_fraction > 0), round(val_fraction * len(patients))))
    val_patients = {patients[i] for i in order[:n_val]}
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

def _prepare_one(job: Tuple[List[str], Config]) -> Optional[Tuple[str, str, str]]:
    paths, cfg = job
    try:
        load_prepared(paths, cfg)
        return None
    except UnusableFile as e:
        return paths[0], e.reason, e.detail


def prepare_cache(cfg: Config, progress: bool = True) -> Tuple[int, List[Tuple[str, str, str]]]:
    """Decode and prepare every usable volume of cfg's data into cfg.cache_dir with cfg.workers processes;
    returns (volumes cached, [(path, reason, detail) of failures])."""
    from tqdm import tqdm
    usable = [r for r in index_records(cfg) if r["ok"]]
    jobs = [(r["paths"], cfg) for r in usable]
    with ProcessPoolExecutor(max(1, cfg.workers)) as pool:
        results = list(tqdm(pool.map(_prepare_one, jobs, chunksize=4), total=len(jobs), unit="volume",
                            desc="prepare", disable=None if progress else True))
    failed = [r for r in results if r is not None]
    return len(jobs) - len(failed), failed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    scan = commands.add_parser("scan", help="list usable volumes and rejected files by maker and reason")
    scan.add_argument("src", help="folder, glob or gs:// prefix (manifest paths are relative to it)")
    scan.add_argument("--out", help="write the JSON-lines index here (training reuses it via --index_path)")
    prep = commands.add_parser("prepare", help="decode and resample every volume once into a local cache")
    prep.add_argument("src", help="folder, glob or gs:// prefix")
    prep.add_argument("--cache", required=True, help="cache folder (train with --cache_dir DIR)")
    commands.add_parser("phantoms", add_help=False, help="write a phantom set: DIR [--n N] [--size D,H,W] [--seed S]")
    args, rest = parser.parse_known_args(argv)
    if args.command == "phantoms":
        from phantom import main as phantom_main
        return phantom_main(rest)
    try:
        cfg = load_config(rest, data_root=args.src)
        if args.command == "scan":
            records = scan_files(find_files(cfg.data_root, cfg.manifest_path), cfg.sop_classes, progress=True)
            print(format_scan_report(records))
            if args.out:
                write_index(records, args.out)
                print(f"index of {len(records)} records written to {args.out}")
            return 0
        cfg = replace(cfg, cache_dir=args.cache)
        done, failed = prepare_cache(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"{done} volumes prepared in {args.cache}; train with --cache_dir {args.cache} and the same "
          f"image_size/target_spacing/clip_percentiles")
    if failed:
        print(f"{len(failed)} volumes failed:\n{format_reason_table(Counter(reason for _, reason, _ in failed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
