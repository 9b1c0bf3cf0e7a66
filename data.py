"""OCT volumes -> training batches: preprocessing, the decoded-volume cache, Dataset, sampler and
loader, and the data command line. dicom.py reads the files (and says why one cannot be used),
index.py scans a source into an index, masks.py draws each sample's patch mask; this module turns
what they give into batches of static shape.

    python data.py scan SRC [--out index.jsonl] [--sop_classes any] [config flags]   # what is usable, and why not
    python data.py prepare SRC --cache DIR [config flags]      # decode + resample once into a local cache

SRC is a folder (recursive), a glob, a gs:// prefix or glob, or a manifest (--manifest_path, a
TSV/CSV with a `filepath` column relative to SRC). gs:// goes through gcsfs (storage.py); set
STORAGE_EMULATOR_HOST to use a local emulator. A sample is: read the DICOM (index.read_volume: any
maker, multi-frame or one file per B-scan, Zeiss Cirrus unscrambled; only one stack of parallel,
evenly spaced B-scans is a volume) -> resample to target_spacing (or resize to image_size) -> robust
percentile clip, stored as uint8 (8-bit sources) or uint16 (what the cache holds) -> crop and pad to
image_size, axially centred on the retina (random elsewhere and jittered for train, centred for val)
-> zero mean, unit std over the sample -> flip and intensity jitter (train) -> patch mask (masks.py:
a fixed count of context and target tokens per sample, incident 6). Files that cannot be used raise
dicom.UnusableFile with a stable reason code (dicom.REASONS), whatever is wrong with them; the
loader replaces them and reports them (incident 11). A file that `scan` accepts is one the loader
reads. `python phantom.py` writes a synthetic phantom set.
"""

import functools
import hashlib
import io
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import shlex
import signal
import sys
import threading
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from config import (
    Config,
    ConfigError,
    NoUsableData,
    ScriptParser,
    StorageFailed,
    load_config,
    script_main,
)
from dicom import BENIGN_REASONS, UnusableFile
from index import (
    Volume,
    format_reason_table,
    format_scan_report,
    index_records,
    index_source,
    list_sources,
    read_volume,
    reason_counts,
    scan_command,
    source_identity,
    source_paths,
    update_index,
    uses_builtin_phantoms,
    write_index,
)
from masks import mask_generator_from_config
from privacy import site_secret
from storage import storage_errors, write_atomic


def sample_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on (seed, keys): the same sample gets the same mask after a
    resume."""
    return np.random.default_rng([seed, *keys])


# --------------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------------

PERCENTILE_SAMPLE = 2**18  # voxels that the clip percentiles are estimated from
# train crops move the retina up to this share of the crop height off the crop centre
AXIAL_JITTER = 0.1


def resampled_shape(
    shape: Sequence[int], spacing: Optional[Sequence[float]], cfg: Config
) -> Tuple[int, int, int]:
    """[d,h,w] after resampling: to cfg.target_spacing when it and the volume's spacing are known,
    else image_size."""
    if cfg.target_spacing is None or spacing is None:
        return tuple(cfg.image_size)
    return tuple(max(1, round(n * s / t)) for n, s, t in zip(shape, spacing, cfg.target_spacing))


def resample(voxels: np.ndarray, size: Sequence[int]) -> torch.Tensor:
    """float32 [d,h,w] of voxels [D,H,W]: linear interpolation, anti-aliased along axes that shrink
    (the triangle filter is widened by the scale factor, so downsampling averages instead of
    skipping voxels)."""
    # 8-bit B-scans take torch's much faster uint8 path for the in-plane filter (output rounded to
    # uint8) [D,H,W]
    x = torch.from_numpy(voxels if voxels.dtype == np.uint8 else voxels.astype(np.float32))
    (D, H, W), (d, h, w) = x.shape, size
    if (h, w) != (H, W):
        x = F.interpolate(
            x[:, None], size=(h, w), mode="bilinear", antialias=True, align_corners=False
        )[:, 0]
    x = x.float()
    if d != D:  # [D,h,w] -> [1,1,D,h*w]: the same filter along the B-scan axis only
        x = F.interpolate(
            x.reshape(1, 1, D, h * w),
            size=(d, h * w),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        ).reshape(d, h, w)
    return x


def clip_limits(x: torch.Tensor, percentiles: Sequence[float]) -> Tuple[float, float]:
    """The intensity percentiles of a volume [d,h,w], estimated on an even subsample of
    PERCENTILE_SAMPLE voxels."""
    step = max(1, math.ceil((x.numel() / PERCENTILE_SAMPLE) ** (1 / 3)))
    lo, hi = np.percentile(x[::step, ::step, ::step].numpy(), percentiles)
    return float(lo), float(hi)


def resample_and_clip(volume: Volume, cfg: Config) -> np.ndarray:
    """The cacheable part of preprocessing: [d,h,w] = the volume resampled, clipped to its
    cfg.clip_percentiles and mapped onto the full range of its storage type (0 = low percentile, the
    dark background): uint8 for 8-bit sources (half the disk of 16 bits, no precision lost), else
    uint16."""
    if volume.spacing is None and cfg.target_spacing is not None and cfg.missing_spacing == "skip":
        raise UnusableFile(
            "bad_spacing", volume.spacing_issue or "no spacing", volume.manufacturer, volume.model
        )
    # [d,h,w]
    x = resample(volume.voxels, resampled_shape(volume.voxels.shape, volume.spacing, cfg))
    lo, hi = clip_limits(x, cfg.clip_percentiles)
    if not hi > lo:
        raise UnusableFile(
            "blank",
            f"percentiles {cfg.clip_percentiles} are both {lo:g}",
            volume.manufacturer,
            volume.model,
        )
    dtype = np.uint8 if volume.voxels.dtype == np.uint8 else np.uint16
    levels = np.iinfo(dtype).max
    return x.clamp_(lo, hi).sub_(lo).mul_(levels / (hi - lo)).round_().numpy().astype(dtype)


def retina_row(prepared: np.ndarray) -> float:
    """The intensity-weighted mean row of a prepared volume [d,h,w]: where the retina is along the
    axial axis (the background is 0 after clipping). Estimated on about 4 B-scans: a cached volume
    is memory-mapped and each B-scan read costs disk pages."""
    d, h, w = prepared.shape
    # [~4,h,~32]
    sub = np.asarray(prepared[:: max(1, d // 4), :, :: max(1, w // 32)], dtype=np.float64)
    profile = sub.sum(axis=(0, 2))  # [h]
    total = profile.sum()
    return float(profile @ np.arange(h) / total) if total > 0 else (h - 1) / 2


def crop_starts(
    prepared: np.ndarray, size: Sequence[int], rng: Optional[np.random.Generator], train: bool
) -> List[int]:
    """First voxel of the crop window of a prepared volume [d,h,w] per axis (negative: padding
    before). Axially the window is centred on the retina (retina_row), moved by up to AXIAL_JITTER
    of its height for train; the other axes are random for train and centred for val."""
    shape = prepared.shape
    starts = [
        (n - s) // 2 if not train else int(rng.integers(min(0, n - s), max(0, n - s) + 1))
        for n, s in zip(shape, size)
    ]
    n, s = shape[1], size[1]
    axial = retina_row(prepared) - (s - 1) / 2
    if train:
        axial += rng.uniform(-AXIAL_JITTER, AXIAL_JITTER) * s
    starts[1] = int(np.clip(round(axial), min(0, n - s), max(0, n - s)))
    return starts


def to_sample(
    prepared: np.ndarray, cfg: Config, rng: Optional[np.random.Generator], train: bool
) -> torch.Tensor:
    """float32 [1,D,H,W] model input of a prepared volume [d,h,w]: crop/pad to image_size, flip
    (train), zero mean and unit std over the sample, intensity jitter (train)."""
    size = cfg.image_size
    starts = crop_starts(prepared, size, rng, train)
    src = tuple(slice(max(a, 0), min(a + s, n)) for a, s, n in zip(starts, size, prepared.shape))
    region = prepared[src]
    if list(region.shape) != list(size):  # pad with 0: the clipped background
        padded = np.zeros(size, region.dtype)
        padded[tuple(slice(max(-a, 0), max(-a, 0) + n) for a, n in zip(starts, region.shape))] = (
            region
        )
        region = padded
    if train and rng.random() < cfg.flip_prob:
        region = region[:, :, ::-1]  # across the lateral axis
    # [D,H,W]; numpy's allocation page-faults far less than torch's
    x = torch.from_numpy(region.astype(np.float32))
    # Normalized after crop/pad, always (incident 5): every sample has mean 0 and std 1 before
    # jitter. Two passes (mean, then deviations): one pass of sums of squares loses the std of
    # bright low-contrast crops.
    flat = x.view(-1)
    std, mean = (float(v) for v in torch.std_mean(flat))
    gain, offset = 1.0, 0.0
    if train and cfg.intensity_jitter:
        gain, offset = (
            1.0 + rng.uniform(-1, 1) * cfg.intensity_jitter,
            rng.uniform(-1, 1) * cfg.intensity_jitter,
        )
    scale = gain / max(std, 1e-6)
    # x * scale + shift in one pass
    torch.add(torch.tensor(offset - mean * scale), flat, alpha=scale, out=flat)
    return x[None]


# --------------------------------------------------------------------------------------------------
# Decoded-volume cache
# --------------------------------------------------------------------------------------------------

# bump when resample_and_clip() changes: files of older versions are then never read
CACHE_VERSION = 2
_CACHE_FAILED = []  # this process's first failure to write the cache, reported once


def cache_path(cfg: Config, paths: Sequence[str], sources: Optional[Sequence[str]] = None) -> str:
    """The cache file of a volume: its name hashes the sources, their identity (source_identity: a
    file written again gets a new entry) and every setting that resample_and_clip() depends on."""
    sources = list(sources) if sources else [source_identity(p) for p in paths]
    key = {
        "version": CACHE_VERSION,
        "paths": sorted(zip(paths, sources)),
        "target_spacing": cfg.target_spacing,
        "image_size": cfg.image_size,
        "clip_percentiles": cfg.clip_percentiles,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cfg.cache_dir, f"{digest}.npy")


def _cache(path: str, prepared: np.ndarray) -> None:
    """Store a prepared volume; when that fails (full disk, read-only folder) the volume is used
    uncached and the first failure of this process is reported."""
    try:
        buffer = io.BytesIO()
        np.save(buffer, prepared)
        write_atomic(path, buffer.getbuffer())
    except OSError as e:
        if not _CACHE_FAILED:
            _CACHE_FAILED.append(path)
            print(
                f"warning: volumes are not cached in {os.path.dirname(path)} ({type(e).__name__}:"
                f" {e}); they are read from their source each time",
                file=sys.stderr,
            )


def load_prepared(
    paths: Sequence[str], cfg: Config, sources: Optional[Sequence[str]] = None
) -> np.ndarray:
    """The prepared volume [d,h,w] (uint8 or uint16) of one record: from cfg.cache_dir when cached
    there, else read and prepared (and cached when cfg.cache_dir is set). `sources` are the record's
    source identities (else they are looked up). Raises UnusableFile."""
    if cfg.cache_dir is None:
        return resample_and_clip(read_volume(paths, cfg.sop_classes), cfg)
    path = cache_path(cfg, paths, sources)
    try:
        cached = np.load(path, mmap_mode="r")  # only the crop is read from disk
        if cached.dtype in (np.uint8, np.uint16) and cached.ndim == 3:
            return cached
    except FileNotFoundError:
        pass
    except (ValueError, OSError, EOFError):
        pass  # a damaged file (e.g. cut by a full disk or a copy): rebuilt below, never read
    prepared = resample_and_clip(read_volume(paths, cfg.sop_classes), cfg)
    _cache(path, prepared)
    return prepared


# --------------------------------------------------------------------------------------------------
# Datasets and loader
# --------------------------------------------------------------------------------------------------

# Reserved "epochs" of sample_rng, beyond any run, so that no two streams share a generator.
# validation samples: sample_rng(seed, VAL_EPOCH, index), the same every time
VAL_EPOCH = 2**32 - 1
ORDER_EPOCH = 2**32 - 2  # the permutation of epoch e: sample_rng(seed, ORDER_EPOCH, e)
MAX_TRIES = 8  # files tried for one sample before the loader gives up


class OCTDataset(torch.utils.data.Dataset):
    """Samples of usable index records, keyed (epoch, index).

    Train samples draw crop, flip, jitter and mask from sample_rng(seed, epoch, index); validation
    samples are center crops without augmentation with a fixed mask per index. So a resumed run sees
    the same samples. A file that fails is replaced by other records chosen from the same key, and
    reported in the sample's `skipped` list: the batch stays full (incident 11).
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
            pick = (
                index
                if attempt == 0
                else int(sample_rng(self.cfg.seed, epoch, index, attempt).integers(len(self)))
            )
            record = self.records[pick]
            try:
                prepared = load_prepared(record["paths"], self.cfg, record.get("sources"))
            except UnusableFile as e:
                skipped.append((record["paths"][0], e.reason, e.detail))
                continue
            rng = sample_rng(self.cfg.seed, epoch, index)
            volume = to_sample(prepared, self.cfg, rng, self.train)
            context, target = self.masks(rng)
            return {
                "volume": volume,
                "context_idx": torch.from_numpy(context),
                "target_idx": torch.from_numpy(target),
                "path": record["paths"][0],
                "maker": record["manufacturer"],
                "skipped": skipped,
            }
        raise NoUsableData(
            f"{MAX_TRIES} files in a row could not be used for sample {key}:\n"
            f"{format_reason_table(Counter(reason for _, reason, _ in skipped))}"
        )

    def geometry_report(self) -> str:
        """One line for --dry_run: the mean share of each axis cropped away or padded after
        resampling."""
        if not self.records:
            return "geometry          no volumes"
        # [N,3]
        shapes = np.array(
            [resampled_shape(r["shape"], r["spacing"], self.cfg) for r in self.records]
        )
        size = np.array(self.cfg.image_size)
        crop = np.clip(1 - size / shapes, 0, None).mean(0)
        pad = np.clip(1 - shapes / size, 0, None).mean(0)
        mode = (
            f"to {self.cfg.target_spacing} mm"
            if self.cfg.target_spacing
            else f"resized to {self.cfg.image_size}"
        )
        return (
            f"geometry          after resampling ({mode}): cropped D/H/W"
            f" {crop[0]:.0%}/{crop[1]:.0%}/{crop[2]:.0%}, padded"
            f" {pad[0]:.0%}/{pad[1]:.0%}/{pad[2]:.0%} (mean of {len(shapes)} volumes)"
        )


class EpochSampler(torch.utils.data.Sampler):
    """(epoch, index) keys of one rank for `epochs` consecutive epochs from `epoch`: each a
    permutation from (seed, epoch) (identity when not shuffled), this rank's shard
    perm[rank::world_size] cut to `per_epoch` keys (default num_items // world_size, so that all
    ranks have the same count); the first epoch without its first `start` keys (resume
    mid-epoch)."""

    def __init__(
        self,
        num_items: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        start: int = 0,
        epochs: int = 1,
        per_epoch: Optional[int] = None,
    ):
        self.num_items, self.rank, self.world_size = num_items, rank, world_size
        self.seed, self.epoch, self.shuffle, self.start, self.epochs = (
            seed,
            epoch,
            shuffle,
            start,
            epochs,
        )
        self.per_epoch = (
            num_items // world_size
            if per_epoch is None
            else min(per_epoch, num_items // world_size)
        )

    def __iter__(self):
        n = self.num_items
        for epoch in range(self.epoch, self.epoch + self.epochs):
            order = (
                sample_rng(self.seed, ORDER_EPOCH, epoch).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            shard = order[self.rank :: self.world_size][: self.per_epoch]
            yield from ((epoch, int(i)) for i in shard[self.start if epoch == self.epoch else 0 :])

    def __len__(self) -> int:
        return max(0, self.per_epoch * self.epochs - self.start)


def collate(samples: List[dict]) -> dict:
    """One batch: volume [B,1,D,H,W], context_idx [B,Nc], target_idx [B,Nt]; path and maker lists;
    all skipped files."""
    stack = torch.utils.data.default_collate  # in a worker it stacks straight into shared memory
    return {
        "volume": stack([s["volume"] for s in samples]),
        "context_idx": stack([s["context_idx"] for s in samples]),
        "target_idx": stack([s["target_idx"] for s in samples]),
        "path": [s["path"] for s in samples],
        "maker": [s["maker"] for s in samples],
        "skipped": [item for s in samples for item in s["skipped"]],
    }


def make_loader(
    dataset: OCTDataset,
    batch_size: int,
    train: bool,
    workers: int,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    start: int = 0,
    seed: int = 0,
    epochs: int = 1,
    per_epoch: Optional[int] = None,
) -> torch.utils.data.DataLoader:
    """Batches of one rank over `epochs` epochs from `epoch` (one set of worker processes for all of
    them), shuffled for train and in order for val, always without a partial batch (static shapes: a
    smaller batch would compile a new XLA graph and cannot be split over the devices). `start` skips
    keys already consumed (resume mid-epoch); `per_epoch` keys of each epoch are used (a multiple of
    batch_size: no batch spans two)."""
    sampler = EpochSampler(
        len(dataset),
        rank,
        world_size,
        seed,
        epoch,
        shuffle=train,
        start=start,
        epochs=epochs,
        per_epoch=per_epoch,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        drop_last=True,
        **worker_processes(workers),
    )


def make_val_loader(
    dataset: OCTDataset,
    volumes: int,
    batch_size: int,
    workers: int,
    rank: int = 0,
    process_count: int = 1,
) -> torch.utils.data.DataLoader:
    """The first `volumes` volumes of a validation split, volume i read by process i %
    process_count, in order, in batches of up to batch_size (the last one may be smaller): the same
    volumes, crops and masks on any number of processes. Every process gets as many batches (a
    sharded forward needs them all): one that runs out first gets a last batch of volume 0 alone,
    which train.validate leaves out."""
    keys = [(0, i) for i in range(rank, volumes, process_count)]
    if math.ceil(len(keys) / batch_size) < math.ceil(
        math.ceil(volumes / process_count) / batch_size
    ):
        keys.append((0, 0))
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=keys,
        num_workers=workers,
        collate_fn=collate,
        **worker_processes(workers),
        # one start for all of a run's validations
        persistent_workers=workers > 0,
    )


def worker_processes(workers: int) -> dict:
    """The DataLoader arguments that start its `workers` processes (none for 0): from the
    forkserver (worker_context), each set up by start_worker with this process's environment as it
    is now (a forked worker had it; the server's is the one of its own start)."""
    if not workers:
        return {}
    return {
        "multiprocessing_context": worker_context(),
        "worker_init_fn": functools.partial(start_worker, environment=dict(os.environ)),
    }


def worker_context() -> multiprocessing.context.BaseContext:
    """How the loader's worker processes start: from a forkserver (a clean process started once,
    holding the reader's modules), where the platform has one. A fork of the training process itself
    copies the locks its other threads hold at that instant (gloo's, the lock lease's, gcsfs's I/O
    loop): one validation worker hung for good in CPython's after-fork setup while gloo's threads
    released a collective's tensors (the DDP preemption test, twice on the 2-core CI machine).
    Python 3.14 makes the forkserver the Linux default for this reason. A script that trains through
    train.main() guards its own run with `if __name__ == "__main__":`, as multiprocessing asks: the
    workers import the main module again."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context()
    context = multiprocessing.get_context("forkserver")
    # torch imported once in the server, not in every worker; the project's modules are imported in
    # each worker, on the training process's sys.path (CPython 3.11's server ignores that path and
    # would resolve `data` in the working directory: a data/ folder there is not data.py).
    context.set_forkserver_preload(["torch"])
    # The server starts with SIGINT and SIGTERM ignored, as nohup starts a command, and so do the
    # workers it forks (an ignored signal stays ignored across fork and exec): a stop signal to the
    # whole process group (Ctrl-C, torchrun's) is the training process's to handle, and it still
    # needs the server for its next loader. Blocked meanwhile, a signal to this process waits for
    # its own handler (Linux never discards a blocked signal).
    if threading.current_thread() is threading.main_thread():  # (started, or restarted if it died)
        stops = (signal.SIGINT, signal.SIGTERM)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        handlers = {stop: signal.signal(stop, signal.SIG_IGN) for stop in stops}
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for stop, handler in handlers.items():
                signal.signal(stop, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return context


def start_worker(worker_id: int, environment: Optional[dict] = None) -> None:
    """Set up a DataLoader worker: it takes `environment` as its own, it ignores SIGINT and
    SIGTERM, and it ends when the training process ends. Ctrl-C reaches every process of the terminal, and torchrun signals a worker's whole
    process group: the training process finishes its update, checkpoints, then ends its workers
    itself (a worker that died first would end the run with "DataLoader worker exited
    unexpectedly"). A training process killed outright (SIGKILL, the OOM killer) cannot end them:
    torch's own check watches the worker's parent, here the forkserver, which lives while a worker
    does, so each worker watches the training process itself."""
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = multiprocessing.parent_process()
    if trainer is not None and trainer.pid != os.getppid():  # started by a forkserver
        threading.Thread(target=end_with, args=(trainer,), daemon=True).start()


def end_with(process: multiprocessing.process.BaseProcess) -> None:
    """Wait for `process` to end, then end this one at once."""
    multiprocessing.connection.wait([process.sentinel])
    os._exit(0)


def val_draw(seed: int, patient: str) -> float:
    """A number in [0, 1) that depends only on (seed, patient): the patient is in val when it is <
    val_fraction."""
    digest = hashlib.sha256(f"{seed}/{patient}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_patient(
    records: Sequence[dict],
    val_fraction: float,
    seed: int,
    unit: Optional[Callable[[dict], str]] = None,
    exact_count: bool = False,
) -> Tuple[List[dict], List[dict]]:
    """(train, val) records: whole patients (PatientID, else file; or another `unit` of a record) go
    to val by a hash of (seed, patient), so a patient's side never depends on the other patients (a
    lost or added file moves no one else). A set too small for that still gets one val patient and
    keeps one train patient. exact_count: val holds round(val_fraction x patients) of them, the
    lowest draws, so that every seed trains on as many."""
    unit = unit or (lambda record: record["patient"])
    draws = {p: val_draw(seed, p) for p in {unit(r) for r in records}}
    by_draw = sorted(draws, key=draws.get)
    val_patients = (
        set(by_draw[: round(val_fraction * len(by_draw))])
        if exact_count
        else {p for p, u in draws.items() if u < val_fraction}
    )
    if val_fraction > 0 and not val_patients and len(by_draw) > 1:
        val_patients = {by_draw[0]}
    if len(val_patients) == len(by_draw) and by_draw:
        val_patients.discard(by_draw[-1])
    return (
        [r for r in records if unit(r) not in val_patients],
        [r for r in records if unit(r) in val_patients],
    )


def build_datasets(cfg: Config) -> Tuple[OCTDataset, OCTDataset]:
    """(train, val) datasets of cfg's data, split by patient. Raises NoUsableData when no volume is
    usable or the share of bad files passes cfg.max_bad_fraction (other objects such as reports,
    copies and line scans are not bad files: BENIGN_REASONS)."""
    if cfg.cache_dir is not None and cfg.cache_dir.startswith("gs://"):
        raise ConfigError(
            "cache_dir: the decoded-volume cache must be a local folder (it is read at every step)."
        )
    builtin = uses_builtin_phantoms(cfg)
    if cfg.data_root is None and cfg.manifest_path is None and cfg.cache_dir is None:
        # decode the built-in phantoms once
        cfg = replace(cfg, cache_dir=cfg.phantom_dir.rstrip("/") + "-cache")
    records = index_records(cfg)
    if cfg.target_spacing is not None and cfg.missing_spacing == "skip":
        records = [
            (
                {**r, "ok": False, "reason": "bad_spacing", "detail": r.get("spacing_issue")}
                if r["ok"] and r["spacing"] is None
                else r
            )
            for r in records
        ]
    usable = [r for r in records if r["ok"]]
    bad = [r for r in records if not r["ok"] and r["reason"] not in BENIGN_REASONS]
    if not usable or len(bad) > cfg.max_bad_fraction * (len(usable) + len(bad)):
        source = cfg.data_root or cfg.manifest_path or cfg.phantom_dir
        scan = scan_command(
            cfg.data_root if cfg.data_root or cfg.manifest_path else cfg.phantom_dir,
            cfg.manifest_path,
        )
        raise NoUsableData(
            f"{len(usable)} usable volumes and {len(bad)} unusable files in {source}"
            f" (max_bad_fraction {cfg.max_bad_fraction}; {', '.join(BENIGN_REASONS)} are not"
            f" counted):\n{format_reason_table(reason_counts(records))}\nrun `{scan}` for the"
            " details of each file"
        )
    # incident 11: every file that is not used is reported, by reason
    if len(usable) < len(records):
        print(
            f"{len(records) - len(usable)} of {len(records)} index records are not used:\n"
            f"{format_reason_table(reason_counts(records))}",
            file=sys.stderr,
        )
    # The built-in phantoms hold no patients: they split by file name, the same on every machine
    # (their keyed patient ids follow the site key, which would draw another split, and another run
    # length, per machine), and into an exact share, so that every seed trains as many updates (a
    # drawn share gave seed 4 of the demo 480).
    unit = (
        (lambda record: os.path.relpath(record["paths"][0], cfg.phantom_dir)) if builtin else None
    )
    train, val = split_by_patient(usable, cfg.val_fraction, cfg.seed, unit, exact_count=builtin)
    return OCTDataset(train, cfg, train=True), OCTDataset(val, cfg, train=False)


def load_val_sample(path: Union[str, Sequence[str]], cfg: Config) -> torch.Tensor:
    """float32 [1,D,H,W] of one file, series folder or list of series files, preprocessed like
    validation samples (center crop, no augmentation): a read of a source without an index, which
    may create the site's key file (privacy.site_secret). Raises UnusableFile."""
    site_secret(create=True)
    return to_sample(load_prepared(source_paths(path), cfg), cfg, None, train=False)


# --------------------------------------------------------------------------------------------------
# Command line: scan, prepare
# --------------------------------------------------------------------------------------------------


def _prepare_one(job: Tuple[List[str], List[str], Config]) -> Optional[Tuple[str, str, str]]:
    paths, sources, cfg = job
    try:
        load_prepared(paths, cfg, sources)
        return None
    except UnusableFile as e:
        return paths[0], e.reason, e.detail


def prepare_cache(cfg: Config, progress: bool = True) -> Tuple[int, List[Tuple[str, str, str]]]:
    """Decode and prepare every usable volume of cfg's data into cfg.cache_dir with cfg.workers
    processes; returns (volumes cached, [(path, reason, detail) of failures])."""
    usable = [r for r in index_records(cfg) if r["ok"]]
    jobs = [(r["paths"], r.get("sources"), cfg) for r in usable]
    with ProcessPoolExecutor(
        max(1, cfg.workers),
        mp_context=worker_context(),
        initializer=start_worker,
        initargs=(0, dict(os.environ)),
    ) as pool:
        results = list(
            tqdm(
                pool.map(_prepare_one, jobs, chunksize=4),
                total=len(jobs),
                unit="volume",
                desc="prepare",
                disable=None if progress else True,
            )
        )
    failed = [r for r in results if r is not None]
    return len(jobs) - len(failed), failed


class IndexNotWritten(StorageFailed):
    """`scan --out` could not write its index (exit 74, as for checkpoint storage)."""

    prefix = "index storage failed: "


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="data.py")
    commands = parser.add_subparsers(dest="command", required=True)
    scan = commands.add_parser(
        "scan", help="list usable volumes and rejected files by maker and reason"
    )
    scan.add_argument(
        "src", help="folder, glob or gs:// prefix (manifest paths are relative to it)"
    )
    scan.add_argument(
        "--out", help="write the JSON-lines index here (training reuses it via --index_path)"
    )
    prep = commands.add_parser(
        "prepare", help="decode and resample every volume once into a local cache"
    )
    prep.add_argument("src", help="folder, glob or gs:// prefix")
    prep.add_argument("--cache", required=True, help="cache folder (train with --cache_dir DIR)")
    args, rest = parser.parse(argv)
    cfg = load_config(rest, data_root=args.src)
    if args.command == "scan":
        identities = list_sources(cfg.data_root, cfg.manifest_path)
        records = update_index([], identities, cfg.sop_classes, progress=True)
        print(format_scan_report(records))
        if args.out:
            try:  # written whole or not at all (an index already at --out stays as it was)
                write_index(
                    records,
                    args.out,
                    index_source(cfg.data_root, cfg.manifest_path, cfg.sop_classes, identities),
                )
            except storage_errors() as e:  # a full disk, a read-only folder, a bucket that refuses
                raise IndexNotWritten(
                    f"the index {args.out} could not be written ({e.strerror or e}); the files at "
                    "--out are as they were. Free space there (or choose another --out) and run "
                    f"the same command again: {shlex.join(['python', 'data.py', *argv])}"
                ) from None
            print(f"index of {len(records)} records written to {args.out}")
        return 0
    done, failed = prepare_cache(replace(cfg, cache_dir=args.cache))
    print(
        f"{done} volumes prepared in {args.cache}; train with --cache_dir {args.cache} and the same"
        " image_size/target_spacing/clip_percentiles"
    )
    if failed:
        print(
            f"{len(failed)} volumes"
            f" failed:\n{format_reason_table(Counter(reason for _, reason, _ in failed))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
