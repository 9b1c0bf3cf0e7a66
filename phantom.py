"""Synthetic OCT volumes written as real DICOM files in each maker's style, for the demo and the
tests.

    python phantom.py [DIR] [--n N] [--size D,H,W] [--seed S]      # default: data/phantoms, 48 volumes

A phantom looks like a macular OCT cube: curved retinal layers of different reflectivity with a
foveal pit, speckle, shadows under superficial vessels and, for some volumes, subtle pathology whose
label is written to DIR/labels.csv (path,label: none/drusen/fluid): small domes scattered at random
places, of drusen (the RPE lifted over medium-bright material) or of subretinal fluid (the retina
lifted off the RPE by a dark gap). A set of `--lesions inner` draws lesions of the inner and middle
retina instead (labels none/foci/cysts): hyperreflective foci (bright dots of a few voxels in the
INL, OPL and ONL) or intraretinal cysts (dark round spaces in the INL and OPL). The lesions change
no global statistic, and the same seed gives the same retina whatever the label. Each volume is an
Ophthalmic Tomography Image Storage object in the style of one device:

| style           | maker, model                        | encoding                      | spacing tags          |
|-----------------|-------------------------------------|-------------------------------|-----------------------|
| heidelberg      | Heidelberg Engineering Spectralis   | uncompressed 16-bit           | shared groups         |
| topcon_triton   | Topcon DRI OCT Triton               | JPEG 2000 lossless, 8-bit     | shared groups         |
| zeiss_cirrus    | Carl Zeiss Meditec Cirrus HD-OCT    | scrambled JP2 lossless, 8-bit | per-frame, garbled    |
| topcon_maestro2 | Topcon Maestro2                     | JPEG 2000 lossy, 8-bit        | shared groups         |
| optovue_series  | Optovue RTVue XR Avanti             | one file per B-scan, 8-bit    | top-level tags        |

Zeiss frames are stored in reverse stack order (InStackPositionNumber says where each goes) and the
series files are named in shuffled order, so a reader must order B-scans by their tags, not by file
position. Zeiss frames are also scrambled like real Cirrus (CZM) exports: JP2 files whose bytes are
permuted in blocks and every 7th byte XORed with 0x5A (`czm_scramble`, the inverse of the public
unscrambler of https://github.com/pydicom/pydicom/discussions/1618), with PixelSpacing written the
Cirrus way, "0.0117,0.0469\\x00" (a comma, a NUL). Spacing tags are scaled to the volume size so
that the field of view stays that of the real device. The other objects that share real folders,
broken files and odd exports that a reader must report are the tests' own (tests/corpora.py).
"""

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import sys
import threading
import warnings
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.sequence import Sequence as DicomSequence
from pydicom.tag import Tag
from pydicom.uid import (
    JPEG2000,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
    UID,
    generate_uid,
)

from config import Config, ConfigError, ScriptParser, script_main
from dicom import OPT_SOP
from index import uses_builtin_phantoms
from storage import process_is_running

# bump when the look or the files change: ensure_phantom_set then rewrites old sets
PHANTOM_VERSION = 3
DEFAULT_SIZE = (32, 128, 128)  # [D, H, W]: small so that the demo and CI stay fast
LABELS = ("none", "drusen", "fluid")
# the labels of a varied set in turn: half without lesions
VARIED_LABELS = ("none", "drusen", "none", "fluid")
# B-scan rows run along x, columns go down in depth (-z); B-scans are stacked along y = row x
# column.
ORIENTATION = [1, 0, 0, 0, 0, -1]


@dataclass(frozen=True)
class Style:
    manufacturer: str
    model: str
    transfer_syntax: UID
    bits: int
    fov_mm: Tuple[float, float, float]  # (z: B-scan span, y: scan depth, x: B-scan width)
    spacing_tags: str  # where PixelSpacing/SliceThickness go: shared | per_frame | top_level
    series: bool = False  # one file per B-scan instead of one multi-frame file
    # frames stored last-to-first; InStackPositionNumber gives the order
    reverse_frames: bool = False
    czm: bool = False  # Zeiss Cirrus export: scrambled JP2 frames, garbled PixelSpacing string


STYLES: Dict[str, Style] = {
    "heidelberg": Style(
        "Heidelberg Engineering",
        "Spectralis",
        ExplicitVRLittleEndian,
        16,
        (5.8, 1.92, 5.8),
        "shared",
    ),
    "topcon_triton": Style(
        "Topcon", "DRI OCT Triton", JPEG2000Lossless, 8, (7.0, 2.6, 7.0), "shared"
    ),
    "zeiss_cirrus": Style(
        "Carl Zeiss Meditec",
        "Cirrus HD-OCT 5000",
        JPEG2000Lossless,
        8,
        (6.0, 2.0, 6.0),
        "per_frame",
        reverse_frames=True,
        czm=True,
    ),
    "topcon_maestro2": Style("Topcon", "Maestro2", JPEG2000, 8, (6.0, 2.3, 6.0), "shared"),
    "optovue_series": Style(
        "Optovue",
        "RTVue XR Avanti",
        ExplicitVRLittleEndian,
        8,
        (6.0, 2.0, 6.0),
        "top_level",
        series=True,
    ),
}


# --------------------------------------------------------------------------------------------------
# Synthetic retina
# --------------------------------------------------------------------------------------------------

# Layers from the vitreous down: (name, thickness as a share of the scan depth, reflectivity).
LAYERS = (
    ("vitreous", 0.0, 0.02),
    ("rnfl", 0.030, 0.80),
    ("gcl_ipl", 0.060, 0.45),
    ("inl", 0.035, 0.15),
    ("opl", 0.025, 0.50),
    ("onl", 0.070, 0.12),
    ("is_os", 0.012, 0.75),
    ("os", 0.020, 0.30),
    ("fluid", 0.0, 0.03),
    ("rpe", 0.016, 1.00),
    ("drusen", 0.0, 0.35),
    ("choroid", 0.120, 0.45),
    ("sclera", 1.0, 0.15),
)
# lesions per diseased eye: scattered, so that the context of a masked block shows them too
LESION_COUNT = (4, 9)
LESION_SIGMA = (0.08, 0.15)  # en-face radius of a lesion (volume width = 2)
LESION_HEIGHT = (0.01, 0.03)  # peak height as a share of the scan depth
# the inner retina that the foveal pit pushes aside
FOVEA_THINNED = ("rnfl", "gcl_ipl", "inl", "opl")
# the layers Eye.thickness scales
RETINA = ("rnfl", "gcl_ipl", "inl", "opl", "onl", "is_os", "os", "fluid", "rpe")
# their nominal thickness: 0.268
RETINA_SHARE = sum(share for name, share, _ in LAYERS if name in RETINA)
CHOROID_SHARE = dict((name, share) for name, share, _ in LAYERS)["choroid"]
# Lesions of the inner and middle retina (a set of `lesions="inner"`), one kind per diseased eye:
# hyperreflective foci (bright dots of a few voxels in the INL, OPL and ONL, as in diabetic
# retinopathy) or intraretinal cysts (dark round spaces centred in the INL and OPL, as in macular
# edema). Their voxels get layer ids past LAYERS' (LAYERS keeps its length: draw_eye draws a
# reflectivity factor per entry); a lesion paints only voxels of the layers it may fill.
INNER_LABELS = ("foci", "cysts")
# layer ids len(LAYERS), len(LAYERS) + 1: the voxels of each kind of lesion
INNER_LAYERS = ("focus", "cyst")
INNER_REFLECTIVITY = (0.9, 0.02)  # as bright as the RPE before the eye's factors / as dark as fluid
# the layers a focus / a cyst may paint over
INNER_FILLS = (("inl", "opl", "onl"), ("inl", "opl", "onl"))
# its centre lies between the top of the first and the bottom of
INNER_CENTRES = (("inl", "onl"), ("inl", "opl"))
# the second, at a depth share drawn per lesion that follows the layers (tilt, curvature, eye
# motion) [min, max) lesions per diseased eye; with these radii ~3200 voxels of 32x128x128
INNER_COUNT = ((30, 60), (6, 12))
# (an eye's drusen or fluid: ~5300). A third as many: the supervised CNN read chance
# (experiments/NOTES.md, 20) a focus's semi-axes (z, y, x): across B-scans and
INNER_RADIUS = (
    ((0.10, 0.16), (0.015, 0.025), (0.04, 0.07)),
    # laterally volume width = 2, in depth scan depth = 1
    ((0.15, 0.30), (0.025, 0.045), (0.08, 0.16)),
)
INNER_VARIED_LABELS = ("none", "foci", "none", "cysts")  # VARIED_LABELS of a set of inner lesions
INNER_DEPTH_SHARE = (0.15, 0.85)  # where between INNER_CENTRES' boundaries a lesion's centre lies
# a phantom set's labels by its `lesions`
LESION_KINDS = {"rpe": LABELS, "inner": ("none",) + INNER_LABELS}
# a label's index here seeds the phantom's generator (LABELS' stay theirs)
ALL_LABELS = LABELS + INNER_LABELS


@dataclass(frozen=True)
class Eye:
    """What makes one phantom eye look unlike another besides its lesions. The defaults are the
    plain phantom of the demo and the tests; draw_eye gives the varied eyes of the probe suite: what
    differs between real scans."""

    depth_shift: float = 0.0  # the retina moved down by this share of the scan depth
    # surface slope across B-scans (z) and along them (x): depth per half width
    tilt: Tuple[float, float] = (0.0, 0.0)
    # the bowl of the surface: extra depth at the corners, share of the scan depth
    curvature: float = 0.06
    # std of the axial jump from one B-scan to the next (eye motion), share of the scan depth
    motion: float = 0.0
    # factor on the RNFL..RPE layers: the regression target retina_thickness follows it
    thickness: float = 1.0
    choroid: float = 1.0  # factor on the choroid thickness
    reflectivity: Optional[Tuple[float, ...]] = None  # factor per layer of LAYERS; None = all 1
    gain: float = 1.0  # signal strength before the log display mapping (brightness and contrast)
    falloff: float = 1.5  # signal attenuation with depth below the surface
    speckle_looks: float = 2.0  # gamma shape of the speckle (more looks: smoother)
    noise: float = 0.01  # noise floor
    vessels: Tuple[int, int] = (3, 6)  # [min, max) superficial vessels
    shadow: float = 0.6  # share of the signal under a vessel that its shadow removes
    # range of the lesions' peak height, share of the scan depth
    lesion_height: Tuple[float, float] = LESION_HEIGHT


def draw_eye(rng: np.random.Generator) -> Eye:
    """A varied eye: the nuisances of real scans drawn at random (position, tilt and curvature of
    the retina, eye motion between B-scans, layer thickness and reflectivity, brightness and
    contrast, speckle, vessel shadows), and lesions taller than the plain phantom's. The choroid
    takes up what the retina's thickness leaves of a tissue band of nearly constant depth, so that
    the band's extent in a depth profile does not give the thickness away."""
    thickness = float(rng.uniform(0.75, 1.25))
    choroid_share = CHOROID_SHARE + RETINA_SHARE * (1.0 - thickness)
    return Eye(
        depth_shift=float(rng.uniform(-0.12, 0.12)),
        tilt=tuple(float(t) for t in rng.uniform(-0.06, 0.06, 2)),
        curvature=float(rng.uniform(0.0, 0.15)),
        motion=float(rng.uniform(0.0, 0.006)),
        thickness=thickness,
        choroid=choroid_share / CHOROID_SHARE * float(rng.uniform(0.85, 1.15)),
        reflectivity=tuple(float(r) for r in rng.uniform(0.7, 1.3, len(LAYERS))),
        gain=float(np.exp(rng.uniform(np.log(0.4), np.log(2.5)))),
        falloff=float(rng.uniform(0.8, 2.5)),
        speckle_looks=float(rng.uniform(1.0, 4.0)),
        noise=float(rng.uniform(0.005, 0.04)),
        vessels=(2, 9),
        shadow=float(rng.uniform(0.3, 0.8)),
        lesion_height=(0.05, 0.10),
    )


def retina_thickness(eye: Eye) -> float:
    """The regression target of a phantom eye: RNFL..RPE thickness away from the fovea, share of the
    scan depth."""
    return eye.thickness * RETINA_SHARE


def lesion_thickness(
    z: np.ndarray,
    x: np.ndarray,
    rng: np.random.Generator,
    height_range: Tuple[float, float] = LESION_HEIGHT,
) -> np.ndarray:
    """Thickness [D,W] (share of the scan depth) of small dome-shaped lesions at random places."""
    domes = np.zeros((z.shape[0], x.shape[1]), np.float32)
    for _ in range(rng.integers(*LESION_COUNT)):
        cz, cx = rng.uniform(-0.8, 0.8, 2)
        sigma, height = rng.uniform(*LESION_SIGMA), rng.uniform(*height_range)
        domes += height * np.exp(-((z - cz) ** 2 + (x - cx) ** 2) / (2 * sigma**2))
    return domes


def retina_geometry(
    shape: Sequence[int], rng: np.random.Generator, label: str = "none", eye: Eye = Eye()
) -> Tuple[np.ndarray, np.ndarray, Dict[str, int]]:
    """(layer of every voxel [D, H, W] (int8, index into LAYERS), the layer boundaries [K+1, D, W]
    (depth share, the surface first), {layer name: the row of its upper boundary}) of a macular OCT
    cube: the first draws of `rng` that synth_reflectivity makes."""
    D, H, W = shape
    lesion_rng = np.random.default_rng(rng.integers(2**63))  # the same retina whatever the label
    z = np.linspace(-1, 1, D, dtype=np.float32)[:, None]  # [D,1]
    x = np.linspace(-1, 1, W, dtype=np.float32)[None, :]  # [1,W]
    fovea = rng.uniform(-0.15, 0.15, 2)
    r2 = (z - fovea[0]) ** 2 + (x - fovea[1]) ** 2  # [D,W]
    pit = np.exp(-r2 / 0.03)  # [D,W] 1 at the fovea
    thickness = []
    for name, share, _ in LAYERS[1:-1]:
        t = np.full((D, W), share * (eye.thickness if name in RETINA else eye.choroid), np.float32)
        if name in FOVEA_THINNED:
            t = t * (1.0 - 0.9 * pit)  # the fovea has almost no inner retina...
        if name == "onl":
            t = t + 0.02 * eye.thickness * pit  # ...and a thicker outer nuclear layer
        thickness.append(t)
    thickness = np.stack(thickness)  # [K,D,W]
    inner = thickness[: len(FOVEA_THINNED) + 1].sum(0)  # [D,W] rnfl..onl
    dip = inner.max() - inner  # the surface dips at the fovea while the RPE below stays smooth
    # [D,W] retina surface
    top = 0.2 + eye.curvature * (z**2 + x**2) + rng.uniform(-0.03, 0.03) + dip
    top = top + eye.depth_shift + eye.tilt[0] * z + eye.tilt[1] * x
    if eye.motion:  # each B-scan moved axially by the eye's drift since the first one
        drift = np.cumsum(rng.normal(0.0, eye.motion, D)).astype(np.float32)
        top = top + (drift - drift.mean())[:, None]
    # thickness[k[n]]; lower boundary bounds[k[n] + 1]
    k = {name: i for i, (name, _, _) in enumerate(LAYERS[1:-1])}
    # RPE lifted over drusen, or the retina lifted off the RPE by fluid; ONL gives way
    if label in ("drusen", "fluid"):
        lesions = lesion_thickness(z, x, lesion_rng, eye.lesion_height)
        thickness[k[label]] += lesions
        thickness[k["onl"]] = np.maximum(thickness[k["onl"]] - lesions, 0.01)
    # [K,D,W] lower boundary of each layer but the last
    bounds = top[None] + np.cumsum(thickness, axis=0)
    bounds = np.concatenate([top[None], bounds])
    y = np.linspace(0, 1, H, dtype=np.float32)[None, :, None]  # [1,H,1]
    layer = np.zeros((D, H, W), np.int8)
    for b in bounds:
        layer += y >= b[:, None, :]
    if label in INNER_LABELS:
        inner_lesions(layer, bounds, k, lesion_rng, label)
    return layer, bounds, k


def inner_lesions(
    layer: np.ndarray, bounds: np.ndarray, k: Dict[str, int], rng: np.random.Generator, label: str
) -> None:
    """Paint the lesions of an inner label (INNER_LABELS: foci or cysts) into a layer map [D, H, W]
    in place: INNER_COUNT ellipsoids of INNER_RADIUS at random en-face places, each centred at a
    depth share of its own between the boundaries of INNER_CENTRES (so that it follows the layers),
    filling only voxels of INNER_FILLS. bounds and k: retina_geometry's."""
    j = INNER_LABELS.index(label)
    D, H, W = layer.shape
    z, x = np.linspace(-1, 1, D, dtype=np.float32), np.linspace(-1, 1, W, dtype=np.float32)
    y = np.linspace(0, 1, H, dtype=np.float32)[None, :, None]  # [1,H,1]
    first, last = INNER_CENTRES[j]
    upper, lower = bounds[k[first]], bounds[k[last] + 1]  # [D,W]
    # the layer map counts the vitreous as 0
    fill = np.isin(layer, [k[name] + 1 for name in INNER_FILLS[j]])
    for _ in range(rng.integers(*INNER_COUNT[j])):
        cz, cx = rng.uniform(-0.9, 0.9, 2)
        rz, ry, rx = (rng.uniform(*r) for r in INNER_RADIUS[j])
        share = rng.uniform(*INNER_DEPTH_SHARE)
        zs, xs = np.flatnonzero(np.abs(z - cz) <= rz), np.flatnonzero(np.abs(x - cx) <= rx)
        if not len(zs) or not len(xs):  # between two B-scans
            continue
        box = (slice(zs[0], zs[-1] + 1), slice(None), slice(xs[0], xs[-1] + 1))
        # [dz,1,dx] its depth there
        centre = (upper + share * (lower - upper))[box[0], box[2]][:, None, :]
        inside = (((z[box[0]] - cz) / rz) ** 2)[:, None, None] + (((x[box[2]] - cx) / rx) ** 2)[
            None, None, :
        ] + ((y - centre) / ry) ** 2 <= 1  # [dz,H,dx]
        layer[box][inside & fill[box]] = len(LAYERS) + j


def synth_reflectivity(
    shape: Sequence[int], rng: np.random.Generator, label: str = "none", eye: Eye = Eye()
) -> np.ndarray:
    """Display intensity in [0, 1], float32 [D, H, W] (B-scans, depth, lateral), of a macular OCT
    cube."""
    D, H, W = shape
    layer, bounds, k = retina_geometry(shape, rng, label, eye)
    top = bounds[0]  # [D,W] retina surface
    z = np.linspace(-1, 1, D, dtype=np.float32)[:, None]  # [D,1]
    x = np.linspace(-1, 1, W, dtype=np.float32)[None, :]  # [1,W]
    y = np.linspace(0, 1, H, dtype=np.float32)[None, :, None]  # [1,H,1]
    reflectivity = np.array([r for _, _, r in LAYERS], np.float32)
    if eye.reflectivity is not None:
        reflectivity *= np.array(eye.reflectivity, np.float32)
    # INNER_LAYERS' ids
    reflectivity = np.concatenate([reflectivity, np.array(INNER_REFLECTIVITY, np.float32)])
    refl = reflectivity[layer]  # [D,H,W]
    refl *= 1.0 + 0.15 * np.sin(40 * y + 6 * z[:, :, None])  # choroidal / layer texture

    # Superficial vessels shadow everything below the nerve fibre layer.
    shadow = np.zeros((D, W), np.float32)
    for _ in range(rng.integers(*eye.vessels)):
        angle, offset = rng.uniform(-0.5, 0.5) + rng.choice([0, np.pi]), rng.uniform(-0.8, 0.8)
        bend = rng.uniform(-0.3, 0.3)
        dist = np.abs(np.sin(angle) * x - np.cos(angle) * z + offset + bend * x**2)
        shadow = np.maximum(shadow, np.exp(-((dist / 0.02) ** 2)))
    below = y > bounds[k["rnfl"] + 1][:, None, :]  # [D,H,W]
    refl *= 1.0 - eye.shadow * shadow[:, None, :] * below
    # signal falls off with depth
    refl *= np.exp(-eye.falloff * np.clip(y - top[:, None, :], 0, None))

    looks = eye.speckle_looks
    # speckle intensity, looks averaged
    speckle = rng.gamma(looks, 1.0 / looks, size=(D, H, W)).astype(np.float32)
    intensity = refl * speckle + eye.noise * rng.random((D, H, W), np.float32)
    return (
        (np.log1p(60.0 * eye.gain * intensity) / np.log1p(60.0 * 3.0)).clip(0, 1).astype(np.float32)
    )


def quantize(img: np.ndarray, bits: int) -> np.ndarray:
    """[0, 1] intensities as unsigned integers of `bits` bits (16-bit data use the raw range,
    incident 5)."""
    if bits == 8:
        return np.round(img * 255).astype(np.uint8)
    return np.round(img * 60000).astype(np.uint16)


# --------------------------------------------------------------------------------------------------
# DICOM writing
# --------------------------------------------------------------------------------------------------


def uid_for(*parts) -> str:
    """A reproducible UID: the same phantom set gets the same UIDs."""
    return generate_uid(entropy_srcs=["octjepa-phantom", *map(str, parts)])


def spacing_for(style: Style, shape: Sequence[int]) -> Tuple[float, float, float]:
    """(dz, dy, dx) mm that keep the device's field of view at this volume size."""
    return tuple(round(f / n, 6) for f, n in zip(style.fov_mm, shape))


def item_of(**tags) -> Dataset:
    """A DICOM dataset of these tags, as an item of a sequence (DicomSequence([item_of(...)]))."""
    ds = Dataset()
    for key, value in tags.items():
        setattr(ds, key, value)
    return ds


def base_dataset(
    sop_class: str,
    sop_uid: str,
    transfer_syntax: UID,
    patient_id: str,
    maker: str,
    model: str,
    series_uid: str,
) -> Dataset:
    """A DICOM dataset without pixels holding what every phantom file has: file meta, SOP class and
    instance, patient, study, series and device (set_pixels and save_dicom make it a file;
    tests/corpora.py builds on it)."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.file_meta.MediaStorageSOPInstanceUID = sop_uid
    ds.file_meta.TransferSyntaxUID = transfer_syntax
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class, sop_uid
    ds.PatientID, ds.PatientName = patient_id, f"Phantom^{patient_id}"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = uid_for("study", patient_id), series_uid
    ds.Manufacturer, ds.ManufacturerModelName = maker, model
    ds.StudyDate, ds.SeriesNumber = "20240101", 1
    return ds


def set_pixels(
    ds: Dataset,
    frames: np.ndarray,
    transfer_syntax: UID,
    photometric: str = "MONOCHROME2",
    obfuscate: bool = False,
    czm: bool = False,
) -> None:
    """Store frames [F,H,W] (uint8/uint16) as PixelData in `transfer_syntax` (scrambled JP2 files
    when `czm`)."""
    F, H, W = frames.shape
    bits = frames.dtype.itemsize * 8
    ds.Rows, ds.Columns, ds.NumberOfFrames = H, W, F
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = bits, bits, bits - 1, 0
    ds.PixelData = frames.tobytes()
    if transfer_syntax in (JPEG2000Lossless, RLELossless):
        ds.compress(transfer_syntax, frames)
    elif transfer_syntax == JPEG2000:
        ds.compress(transfer_syntax, frames, j2k_psnr=[48])
    elif transfer_syntax == JPEGBaseline8Bit:
        from PIL import Image

        encoded = []
        for frame in frames:
            out = io.BytesIO()
            Image.fromarray(frame).save(out, format="JPEG", quality=95)
            encoded.append(out.getvalue())
        ds.PixelData = encapsulate(encoded)
        ds["PixelData"].VR = "OB"
        ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
        ds.LossyImageCompression = "01"
    elif transfer_syntax == ExplicitVRBigEndian:
        ds.PixelData = frames.astype(frames.dtype.newbyteorder(">")).tobytes()
    if czm:
        ds.PixelData = encapsulate([czm_scramble(jp2_file(frame)) for frame in frames])
        ds.file_meta.TransferSyntaxUID = JPEG2000Lossless
    if obfuscate:
        # An unknown obfuscation: the frames are real JPEG 2000 codestreams with scrambled main
        # headers.
        scrambled = []
        for frame in generate_frames(ds.PixelData, number_of_frames=F):
            key = np.random.default_rng(len(frame)).integers(0, 256, 120, dtype=np.uint8)
            head = np.frombuffer(frame[2:122], np.uint8) ^ key
            scrambled.append(frame[:2] + head.tobytes() + frame[122:])
        ds.PixelData = encapsulate(scrambled)


# the scheme moves fixed blocks up to byte 1016 and needs the JP2 header at >= 3/5 of the frame
CZM_MIN_BYTES = 1694


def jp2_file(frame: np.ndarray) -> bytes:
    """A lossless JP2 file (boxes around a JPEG 2000 codestream) of one frame [H,W], at least
    CZM_MIN_BYTES long: a small frame gets a `free` box before its codestream box, which decoders
    skip."""
    import openjpeg

    jp2 = bytes(openjpeg.encode(np.ascontiguousarray(frame), codec_format=1))
    missing = CZM_MIN_BYTES - len(jp2)
    if missing > 0:
        at = jp2.index(b"jp2c") - 4
        size = max(missing, 8)
        jp2 = jp2[:at] + size.to_bytes(4, "big") + b"free" + bytes(size - 8) + jp2[at:]
    return jp2


def czm_scramble(jp2: bytes) -> bytes:
    """A JP2 file scrambled like a Zeiss Cirrus (CZM) frame: the exact inverse of the public
    unscrambler (https://github.com/pydicom/pydicom/discussions/1618), which XORs every 7th byte
    with 0x5A and reorders eight blocks."""
    n = len(jp2)
    offset = n * 3 // 5  # where the JP2 header goes in the scrambled frame
    if n < CZM_MIN_BYTES:
        raise ValueError(f"a CZM frame needs at least {CZM_MIN_BYTES} bytes, got {n}")
    # The unscrambler's output is these slices of the scrambled frame, in this order.
    blocks = (
        (offset, offset + 253),
        (993, 1016),
        (276, 763),
        (23, 276),
        (1016, offset),
        (0, 23),
        (763, 993),
        (offset + 253, n),
    )
    scrambled = np.zeros(n, np.uint8)
    source = np.frombuffer(jp2, np.uint8)
    start = 0
    for a, b in blocks:
        scrambled[a:b] = source[start : start + b - a]
        start += b - a
    scrambled[::7] ^= 0x5A
    return scrambled.tobytes()


def _czm_pixel_spacing(dy: float, dx: float) -> RawDataElement:
    """PixelSpacing as Cirrus writes it: one string with a comma and a trailing NUL, not two DS
    values."""
    value = f"{dy},{dx}\x00".encode()
    value += b" " * (len(value) % 2)
    return RawDataElement(Tag("PixelSpacing"), "DS", len(value), value, 0, False, True)


def save_dicom(ds: Dataset, path: str) -> None:
    """Write a dataset as a DICOM file (its folders made), in the byte order and VR encoding its
    transfer syntax says."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    big_endian = ds.file_meta.TransferSyntaxUID == ExplicitVRBigEndian
    # pydicom's note on a garbled value written on purpose (Cirrus PixelSpacing)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The value length", UserWarning)
        ds.save_as(
            path,
            enforce_file_format=True,
            little_endian=not big_endian,
            implicit_vr=ds.file_meta.TransferSyntaxUID == ImplicitVRLittleEndian,
        )


def _pixel_measures(spacing, czm: bool = False) -> Dataset:
    dz, dy, dx = spacing
    item = item_of(PixelSpacing=[dy, dx], SliceThickness=dz, SpacingBetweenSlices=dz)
    if czm:
        item[Tag("PixelSpacing")] = _czm_pixel_spacing(dy, dx)
    return item


def add_frame_groups(
    ds: Dataset, D: int, spacing: Optional[Sequence[float]], style: Style, uid_seed: str
) -> List[int]:
    """Give a multi-frame dataset its shared and per-frame functional groups (orientation, each
    frame's stack position, spacing where `style` puts it); returns the stack position of each frame."""
    # stack position of each frame
    stack = list(range(D))[::-1] if style.reverse_frames else list(range(D))
    shared = item_of(
        PlaneOrientationSequence=DicomSequence([item_of(ImageOrientationPatient=ORIENTATION)])
    )
    if spacing is not None and style.spacing_tags == "shared":
        shared.PixelMeasuresSequence = DicomSequence([_pixel_measures(spacing)])
    if spacing is not None and style.spacing_tags == "top_level":
        ds.PixelSpacing, ds.SliceThickness = [spacing[1], spacing[2]], spacing[0]
    ds.SharedFunctionalGroupsSequence = DicomSequence([shared])
    per_frame = []
    for k in stack:
        item = item_of(
            FrameContentSequence=DicomSequence(
                [item_of(InStackPositionNumber=k + 1, StackID="1", DimensionIndexValues=[1, k + 1])]
            )
        )
        if spacing is not None:
            position = [0.0, round(k * spacing[0], 6), 0.0]
            item.PlanePositionSequence = DicomSequence([item_of(ImagePositionPatient=position)])
            if style.spacing_tags == "per_frame":
                item.PixelMeasuresSequence = DicomSequence([_pixel_measures(spacing, style.czm)])
        per_frame.append(item)
    ds.PerFrameFunctionalGroupsSequence = DicomSequence(per_frame)
    ds.DimensionOrganizationSequence = DicomSequence(
        [item_of(DimensionOrganizationUID=uid_for("dim", uid_seed))]
    )
    return stack


def write_oct(
    path: str,
    voxels: np.ndarray,
    spacing: Optional[Sequence[float]],
    style: Style,
    *,
    patient_id: str = "PHANTOM-000",
    uid_seed: str = "0",
    transfer_syntax: Optional[UID] = None,
    sop_class: str = OPT_SOP,
    photometric: str = "MONOCHROME2",
    rescale: Optional[Tuple[float, float]] = None,
    obfuscate: bool = False,
    laterality: str = "R",
) -> list:
    """Write voxels [D,H,W] (uint8/uint16, stack order) as OCT DICOM in `style`; returns the paths
    written.

    A series style writes a folder `path` with one file per B-scan. `rescale` = (slope, intercept)
    written as RescaleSlope/Intercept (the voxels are the stored values); MONOCHROME1 stores max -
    voxel, so a reader that honours the tags gets `voxels` back either way.
    """
    syntax = transfer_syntax or style.transfer_syntax
    series_uid = uid_for("series", uid_seed)
    D = voxels.shape[0]
    stored = voxels
    if photometric == "MONOCHROME1":
        stored = (np.iinfo(voxels.dtype).max - voxels).astype(voxels.dtype)

    def common(ds: Dataset) -> None:
        ds.Modality, ds.ImageLaterality, ds.Laterality = "OPT", laterality, laterality
        ds.ImageType = ["ORIGINAL", "PRIMARY"]
        if rescale is not None:
            ds.RescaleSlope, ds.RescaleIntercept = rescale

    if style.series:
        # file names say nothing
        order = np.random.default_rng(zlib.crc32(uid_seed.encode())).permutation(D)
        paths = []
        for k in range(D):
            ds = base_dataset(
                sop_class,
                uid_for("sop", uid_seed, k),
                syntax,
                patient_id,
                style.manufacturer,
                style.model,
                series_uid,
            )
            common(ds)
            ds.InstanceNumber = k + 1
            if spacing is not None:
                dz, dy, dx = spacing
                ds.PixelSpacing, ds.SliceThickness = [dy, dx], dz
                ds.ImagePositionPatient = [0.0, round(k * dz, 6), 0.0]
                ds.ImageOrientationPatient = ORIENTATION
            set_pixels(ds, stored[k : k + 1], syntax, photometric, obfuscate)
            paths.append(os.path.join(path, f"bscan_{order[k]:03d}.dcm"))
            save_dicom(ds, paths[-1])
        return paths

    ds = base_dataset(
        sop_class,
        uid_for("sop", uid_seed),
        syntax,
        patient_id,
        style.manufacturer,
        style.model,
        series_uid,
    )
    common(ds)
    ds.InstanceNumber = 1
    stack = add_frame_groups(ds, D, spacing, style, uid_seed)
    set_pixels(
        ds, stored[stack], syntax, photometric, obfuscate, czm=style.czm and transfer_syntax is None
    )
    save_dicom(ds, path)
    return [path]


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_held():
    """SIGTERM and Ctrl-C held back while it runs, then handed to the handlers they had. The JPEG
    2000 encoder (openjpeg's encode_buffer) crashes the process (SIGSEGV) when a Python signal
    handler raises while it encodes a frame (train.py's verdict raises StopRequested, a plain Ctrl-C
    raises KeyboardInterrupt): it waits for the volume being written instead, then stops between
    volumes."""
    # Python runs handlers in the main thread only
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: held.append(signum))
        for sig in STOP_SIGNALS
        # (None: a handler not set from Python, left alone)
        if signal.getsignal(sig) is not None
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in held:
            # its handler runs here, in Python code (the default action: the process ends)
            signal.raise_signal(sig)


def write_phantom(
    path: str,
    style_name: str,
    shape: Sequence[int] = DEFAULT_SIZE,
    seed: int = 0,
    label: str = "none",
    bits: Optional[int] = None,
    patient_id: str = "PHANTOM-000",
    eye: Eye = Eye(),
    **write_kwargs,
) -> Tuple[np.ndarray, Tuple[float, float, float], list]:
    """One phantom volume in a maker's style: (voxels [D,H,W] as written, spacing (dz,dy,dx),
    paths)."""
    style = STYLES[style_name]
    rng = np.random.default_rng([seed, ALL_LABELS.index(label)])
    voxels = quantize(synth_reflectivity(shape, rng, label, eye), bits or style.bits)
    spacing = spacing_for(style, shape)
    # a stop signal waits for the encoder (a crash otherwise): see stop_signals_held
    with stop_signals_held():
        paths = write_oct(
            path,
            voxels,
            spacing,
            style,
            patient_id=patient_id,
            uid_seed=f"{style_name}-{seed}",
            laterality="R" if seed % 2 == 0 else "L",
            **write_kwargs,
        )
    return voxels, spacing, paths


MARKER = ".phantom_set.json"  # written last: a folder without it is not a complete phantom set


def phantom_set_complete(
    directory: str,
    n: int,
    shape: Sequence[int] = DEFAULT_SIZE,
    seed: int = 0,
    varied: bool = False,
    lesions: str = "rpe",
) -> bool:
    """True when `directory` holds the complete phantom set of these parameters."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return json.load(f) == _set_spec(n, shape, seed, varied, lesions)
    except (OSError, ValueError):
        return False


def _set_spec(n: int, shape: Sequence[int], seed: int, varied: bool, lesions: str = "rpe") -> dict:
    spec = {"version": PHANTOM_VERSION, "n": n, "shape": list(shape), "seed": seed}
    # plain sets keep the marker (and the folder) they had
    spec = {**spec, "varied": True} if varied else spec
    # ... and so do sets of drusen and fluid
    return {**spec, "lesions": lesions} if lesions != "rpe" else spec


def set_member(i: int, seed: int, varied: bool, lesions: str = "rpe") -> Tuple[str, str, str, Eye]:
    """(file name, style, label, eye) of the i-th volume of a phantom set (write_phantom_set) of
    `lesions` (LESION_KINDS); its phantom seed is seed * 100003 + i."""
    names = list(STYLES)
    style_name = names[i % len(names)]
    if varied:
        labels = VARIED_LABELS if lesions == "rpe" else INNER_VARIED_LABELS
        label, eye = labels[i % len(labels)], draw_eye(np.random.default_rng([seed, i, 11]))
    else:
        label = LESION_KINDS[lesions][
            np.random.default_rng([seed, i, 7]).choice(3, p=[0.4, 0.3, 0.3])
        ]
        eye = Eye()
    return (
        f"{i:04d}_{style_name}" + ("" if STYLES[style_name].series else ".dcm"),
        style_name,
        label,
        eye,
    )


def voxel_layers(shape: Sequence[int], seed: int, label: str, eye: Eye = Eye()) -> np.ndarray:
    """The layer of every voxel of write_phantom(seed, label, eye): int8 [D, H, W], indices into
    LAYERS (its lesions are the voxels of the drusen or fluid layer, which only lesions give a
    thickness) or past it, INNER_LAYERS (the voxels of foci or cysts)."""
    return retina_geometry(
        shape, np.random.default_rng([seed, ALL_LABELS.index(label)]), label, eye
    )[0]


def set_voxel_layers(directory: str) -> Dict[str, np.ndarray]:
    """{file name: voxel_layers [D, H, W]} of every volume of the complete phantom set in
    `directory`, replayed from its parameters (the set's marker file). ValueError when `directory`
    holds no complete phantom set."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            spec = json.load(f)
    except (OSError, ValueError):
        raise ValueError(
            f"{directory} holds no complete phantom set (no {MARKER}); write it with"
            " write_phantom_set"
        )
    out = {}
    for i in range(spec["n"]):
        name, _, label, eye = set_member(
            i, spec["seed"], spec.get("varied", False), spec.get("lesions", "rpe")
        )
        out[name] = voxel_layers(spec["shape"], spec["seed"] * 100003 + i, label, eye)
    return out


# DIR.partial-HOST-PID: the set a writer is writing, renamed to DIR when complete
PARTIAL = ".partial-"


def remove_stale_partials(directory: str) -> None:
    """Delete the half-written sets of `directory` (DIR.partial-HOST-PID) whose writer on this host
    is gone (killed with SIGKILL, a crash): a live writer's folder, or another host's, is left
    alone."""
    prefix, parent = f"{os.path.basename(directory)}{PARTIAL}", os.path.dirname(directory)
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        # (DIR.partial-PID, of older versions: this host's)
        host, _, pid = name[len(prefix) :].rpartition("-")
        if (
            name.startswith(prefix)
            and pid.isdigit()
            and not process_is_running(host or socket.gethostname(), int(pid))
        ):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_phantom_set(
    directory: str,
    n: int,
    shape: Sequence[int] = DEFAULT_SIZE,
    seed: int = 0,
    varied: bool = False,
    lesions: str = "rpe",
) -> str:
    """Write n phantoms (makers in turn, three volumes per patient, random labels) and
    DIR/labels.csv. varied: every eye drawn by draw_eye (the nuisances of real scans), the labels
    none, drusen, none, fluid in turn, and labels.csv has two more columns: lesion (no for none, yes
    for drusen or fluid: balanced) and retina_thickness (the regression target). lesions="inner":
    foci and cysts of the inner retina (INNER_LABELS) in place of drusen and fluid.

    Nothing is written when `directory` already holds this set. Otherwise the set is written to a
    sibling temp folder that replaces `directory` only when complete, so a killed writer never
    leaves a half set behind; an existing folder is replaced only if it is a phantom set of other
    parameters.
    """
    directory = os.path.abspath(directory)
    if phantom_set_complete(directory, n, shape, seed, varied, lesions):
        return directory
    if (
        os.path.isdir(directory)
        and os.listdir(directory)
        and not os.path.exists(os.path.join(directory, MARKER))
    ):
        raise FileExistsError(
            f"{directory} exists and is not a phantom set; choose an empty or new folder"
        )
    remove_stale_partials(directory)
    tmp = f"{directory}{PARTIAL}{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    rows = []
    try:
        for i in range(n):
            name, style_name, label, eye = set_member(i, seed, varied, lesions)
            write_phantom(
                os.path.join(tmp, name),
                style_name,
                shape,
                seed=seed * 100003 + i,
                label=label,
                patient_id=f"PHANTOM-{seed:02d}-{i // 3:03d}",
                eye=eye,
            )
            rows.append(
                (name, label, "no" if label == "none" else "yes", f"{retina_thickness(eye):.4f}")
                if varied
                else (name, label)
            )
    except BaseException:  # a stop signal, Ctrl-C, a full disk: no half set is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    header = ("path", "label", "lesion", "retina_thickness") if varied else ("path", "label")
    with open(os.path.join(tmp, "labels.csv"), "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(_set_spec(n, shape, seed, varied, lesions), f)
    # another process finished first
    if phantom_set_complete(directory, n, shape, seed, varied, lesions):
        shutil.rmtree(tmp)
        return directory
    if os.path.isdir(directory):
        shutil.rmtree(directory)  # an older phantom set (it has the marker, checked above)
    try:
        os.replace(tmp, directory)
    except OSError:  # another process renamed its complete set into place just now
        shutil.rmtree(tmp)
        if not phantom_set_complete(directory, n, shape, seed, varied, lesions):
            raise
    return directory


def ensure_phantom_set(
    directory: str,
    n: int,
    seed: int = 0,
    what: str = "phantom OCT volumes",
    varied: bool = False,
    lesions: str = "rpe",
) -> str:
    """`directory`, holding the phantom set of n volumes of this seed (varied: write_phantom_set's
    varied eyes; lesions: its kind of lesions): written once (said on stderr), else left as it is.
    ConfigError (phantom_dir) when a folder that is not a phantom set is in the way."""
    if not phantom_set_complete(directory, n, seed=seed, varied=varied, lesions=lesions):
        print(f"writing {n} {what} to {directory} (once)", file=sys.stderr)
        try:
            write_phantom_set(directory, n, seed=seed, varied=varied, lesions=lesions)
        except FileExistsError as e:
            raise ConfigError(f"phantom_dir: {e}") from None
    return directory


def ensure_builtin_phantoms(cfg: Config) -> None:
    """The built-in phantom set of a config that names no data (data_root, manifest_path, or an
    index_path that exists), written once to cfg.phantom_dir: phantom_count volumes, varied eyes
    with phantom_varied. The scripts call it before they index the data (index.index_records reads
    cfg.phantom_dir then)."""
    if uses_builtin_phantoms(cfg):
        ensure_phantom_set(cfg.phantom_dir, cfg.phantom_count, varied=cfg.phantom_varied)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def stop_writing(signum, frame) -> None:
    """SIGTERM or Ctrl-C: a KeyboardInterrupt naming the signal, out of the writer."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@script_main
def main(argv: List[str]) -> int:
    """Write the phantom set of a command line; ConfigError for a bad size or a folder in the
    way."""
    parser = ScriptParser(__doc__, config_flags=False)
    parser.add_argument(
        "dir", nargs="?", default="data/phantoms", help="output folder (default data/phantoms)"
    )
    parser.add_argument("--n", type=int, default=48, help="number of volumes")
    parser.add_argument(
        "--size", default=",".join(map(str, DEFAULT_SIZE)), help="D,H,W voxels (default 32,128,128)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--varied",
        action="store_true",
        help=(
            "varied eyes (draw_eye), balanced labels and "
            "retina_thickness: the probe suite's kind of set"
        ),
    )
    parser.add_argument(
        "--lesions",
        default="rpe",
        choices=sorted(LESION_KINDS),
        help="rpe: drusen and fluid (default); inner: foci and cysts of the inner retina",
    )
    args = parser.parse_args(argv)
    try:
        shape = [int(s) for s in args.size.split(",")]
    except ValueError:
        shape = []
    if len(shape) != 3 or min(shape) < 8 or args.n < 1:
        raise ConfigError(
            f"--size needs three sizes >= 8 like 32,128,128 (got {args.size!r}) and --n >= 1."
        )
    for stop in STOP_SIGNALS:  # the half-written set is deleted, and the stop said in words
        signal.signal(stop, stop_writing)
    try:
        write_phantom_set(args.dir, args.n, shape, args.seed, args.varied, args.lesions)
    except FileExistsError as e:
        raise ConfigError(str(e)) from None
    except KeyboardInterrupt as e:
        print(
            f"stopped ({e}): no phantom set was written; the same command writes it",
            file=sys.stderr,
        )
        return 75  # config.Preempted's code: try again
    print(
        f"wrote {args.n} phantom volumes of {shape[0]}x{shape[1]}x{shape[2]} to {args.dir} "
        f"(labels in {os.path.join(args.dir, 'labels.csv')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
