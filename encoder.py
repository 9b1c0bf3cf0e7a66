"""Use a pretrained encoder: export it, embed a dataset with it, look at what it sees
(docs/encoder.md). After the demo (`python train.py`, which writes runs/demo/ and its labelled
phantoms data/phantoms_suite/):

    python encoder.py export --ckpt runs/demo/checkpoints --out runs/demo/encoder
    python encoder.py embed --encoder runs/demo/encoder --data_root data/phantoms --out runs/demo/embeddings.npz
    python encoder.py show --encoder runs/demo/encoder --labels data/phantoms_suite/labels.csv --out runs/demo/show.png
    python encoder.py embed --encoder DIR --data_root gs://bucket/oct --out oct.npz --pool depth_rows --device cuda

Fine-tuning on labelled volumes is finetune.py. An export is a folder of data that loads anywhere
(torch, safetensors and numpy) and runs no code of its own: model.safetensors (the EMA target
encoder, keys as model.Encoder), config.json (format version, architecture, the preprocessing
contract, the training-time augmentation, the input sizes, the weights' sha256, and where they came
from) and README.md (the model card). In this checkout: pretrained.load_encoder(DIR), and
data.load_val_sample(path, encoder.settings) preprocesses a DICOM file or series as the contract
says; elsewhere the repository's octjepa_encoder.py (load(DIR)) and hubconf.py
(torch.hub.load(OCTJEPA, "encoder", path=DIR)). export --with_loader_code also writes those two into
the folder, where torch.hub.load(DIR, "encoder", source="local") runs them: only for a receiver who
trusts the sender.

embed writes one row per usable volume to an .npz (numpy only), safe to share (docs/privacy.md):
volume (a keyed id of its path below data_root: privacy.volume_key), files, patient (the index's
keyed hash of PatientID), laterality, manufacturer, model, spacing [dz,dy,dx] mm (nan when unknown),
shape [D,H,W] as stored, embedding [M,E] (--pool mean_pool) or [M, gh*E] (--pool depth_rows: the
mean of each depth row of tokens; model.pool_tokens, as probe.py's read-outs of those names), each
dimension's mean and std (standardize before cosine or kNN; --standardize stores standardized rows),
position_share (the share of token variance grid position explains), key_fingerprint (which
patient-key secret made the patient column: tables join only under one, join_embedding_tables); and
skipped_volume, skipped_reason for every file the reader or the preprocessing could not use (the
reason codes of `python data.py scan`). --with_paths adds path (the file, or the folder of a series'
files), study, series, skipped_path and skipped_detail, for this machine only. Every --save_every
volumes the rows done are saved in OUT.partial/: the same command started again after a kill
computes only the rest (only rows of the same export's contract are reused), and its file equals an
uninterrupted run's byte for byte; a second embed into the same OUT while one runs is refused (exit
2). Static shapes (the last batch is padded): it runs on cpu, cuda and xla.

show draws, for one labelled volume of each class and for the encoder beside a random init of its
architecture: a B-scan and the en-face view of the input, the first three principal components of
the patch features as RGB on both, and where an attentive probe (probe.py) trained on the labelled
volumes looks (the PCA and the probe fit on at most --fit_volumes of them, a sample drawn per class:
time and memory do not grow with the labels file).

Each command takes only the config flags it lists under its --help; the export brings its own model
and preprocessing. Exit codes: config.EXIT_CODES (a bad argument or export is a ConfigError, no
usable volume NoUsableData).
"""

import contextlib
import io
import json
import math
import os
import shutil
import sys
import zipfile
from collections import Counter
from dataclasses import replace
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.decomposition import PCA

from checkpoint import resolve_checkpoint
from config import (
    Config,
    ConfigError,
    NoUsableData,
    ScriptParser,
    given_flags,
    load_config,
    script_main,
)
from data import load_prepared, load_val_sample, to_sample, worker_processes
from dicom import UnusableFile
from runlog import new_figure, position_share, position_share_of_sums, position_sums
from export import HUBCONF, MODEL_CARD, STANDALONE_MODULE, export
from index import format_reason_table, index_records, read_volume
from model import POOLS, pool_name, pool_tokens
from pretrained import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    PretrainedEncoder,
    export_contract,
    load_encoder,
    random_encoder,
)
from lock import LOCK_NAME, release_lock, take_lock
from privacy import (
    check_same_key,
    key_fingerprint,
    keyed_id,
    share_safe_source,
    table_key_fingerprint,
    volume_key,
)
from labels import read_label_table, task_targets
from readouts import fit_attentive, stratified_split
from progress import counted, progress
from runtime import fetch_to_host, probe_device, release_freed_memory, setup_runtime, to_device
from storage import write_atomic
from tokens import encode_volumes

CLI_FIELDS = {
    "export": (),
    "embed": ("device", "cache_dir", "workers", "data_root", "manifest_path", "index_path"),
    "show": ("device", "cache_dir", "seed"),
}
# --------------------------------------------------------------------------------------------------
# Embed a dataset
# --------------------------------------------------------------------------------------------------


class EmbedInputs(torch.utils.data.Dataset):
    """The model input [1,D,H,W] of each index record, preprocessed like a validation sample, or
    (None, reason, detail) when the preprocessing cannot use it."""

    def __init__(self, records: List[dict], cfg: Config):
        self.records, self.cfg = records, cfg

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        record = self.records[i]
        try:
            prepared = load_prepared(record["paths"], self.cfg, record.get("sources"))
        except UnusableFile as e:
            return None, e.reason, e.detail
        return to_sample(prepared, self.cfg, None, train=False), "", ""


def npz_bytes(arrays: dict) -> bytes:
    """An .npz (np.load reads it) whose bytes depend only on the arrays: zip entries without a time
    stamp."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, value in arrays.items():
            write_npz_entry(archive, name, value)
    return buffer.getvalue()


def record_key(record: dict) -> str:
    """What identifies a volume's input in a saved chunk: a keyed id (privacy.keyed_id) of its files
    and their identities (a file written again is another input), never its paths."""
    return keyed_id("embed-input", json.dumps([record["paths"], record.get("sources") or []]))


def read_chunk(path: str, keys: List[str], settings: dict):
    """The arrays of a saved chunk of rows, or None when it is missing, damaged, holds other volumes
    or was written before chunks held their position sums (they are computed again). ConfigError
    when it was embedded with other settings (another encoder, pool or batch size)."""
    try:
        with np.load(path) as saved:
            chunk = {k: saved[k] for k in saved.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    saved = json.loads(str(chunk["settings"]))
    # an older chunk (its keys are paths: done again)
    saved = {**saved, "with_paths": saved.get("with_paths", False)}
    if saved != settings:
        raise ConfigError(
            f"out: {os.path.dirname(path)} holds rows embedded with other settings"
            f" ({str(chunk['settings'])}, now {json.dumps(settings)}); rerun with those, or delete"
            " that folder to start over."
        )
    return chunk if chunk["key"].tolist() == keys and "position_sums" in chunk else None


def embed_batch(
    encoder: PretrainedEncoder, samples: List[torch.Tensor], batch_size: int, pool: str, rt
) -> Tuple[np.ndarray, torch.Tensor]:
    """(pooled embeddings [n, F] (float32), position_sums [2, N, E] of their tokens) of n <=
    batch_size samples [1,D,H,W], run as one batch of batch_size (the last one padded: one shape, so
    XLA compiles once and every row is computed in the same batch every time)."""
    batch = torch.stack(samples)  # [n,1,D,H,W]
    n = len(batch)
    batch = torch.cat([batch, batch[-1:].expand(batch_size - n, *batch.shape[1:])])
    with torch.no_grad():
        tokens = encoder(to_device({"volume": batch}, rt)["volume"])  # [batch_size, N, E]
        pooled = pool_tokens(tokens, encoder.grid, pool)
    tokens = fetch_to_host(tokens, rt).float()[:n]
    return fetch_to_host(pooled, rt).float().numpy()[:n], position_sums(tokens)


def embed_chunk(
    encoder: PretrainedEncoder, inputs, count: int, batch_size: int, pool: str, rt, progress
) -> Tuple[np.ndarray, list, torch.Tensor]:
    """(embeddings [count, F], zero rows for unusable volumes; [(reason, detail)] per row, ('', '')
    when embedded; the position_sums [2, N, E] of the embedded volumes' tokens) of the next `count`
    volumes of the `inputs` iterator."""
    # rows: (row, embedding); pending: (row, sample) of the batch being filled
    rows, reasons, pending = [], [], []
    sums = torch.zeros(2, math.prod(encoder.grid), encoder.embed_dim, dtype=torch.float64)
    for row in range(count):
        sample, reason, detail = next(inputs)
        reasons.append((reason, detail))
        if sample is not None:
            pending.append((row, sample))
        if len(pending) == batch_size or (row == count - 1 and pending):
            pooled, batch_sums = embed_batch(encoder, [s for _, s in pending], batch_size, pool, rt)
            rows += zip([r for r, _ in pending], pooled)
            sums += batch_sums
            pending = []
            release_freed_memory()
        progress.update(1)
    embeddings = np.zeros((count, encoder.embedding_size(pool)), np.float32)
    for row, embedding in rows:
        embeddings[row] = embedding
    return embeddings, reasons, sums


def embed_records(
    encoder: PretrainedEncoder,
    records: List[dict],
    cfg: Config,
    partial: str,
    pool: str,
    batch_size: int,
    save_every: int,
    rt,
    with_paths: bool = False,
) -> Tuple[List[str], int]:
    """(the chunk files, in order, that hold the rows of the usable index records; how many volumes
    were computed now). Chunks of save_every volumes (a multiple of batch_size) are saved in
    `partial` as they are done (each: key, embedding, reason, detail, position_sums, settings);
    chunks already there are not computed again. Only one chunk is in memory at a time. A chunk
    holds no path: its key is keyed (record_key), and the reader's details (which may name a file)
    only with_paths."""
    size = -(-save_every // batch_size) * batch_size
    chunks = [records[i : i + size] for i in range(0, len(records), size)]
    settings = {
        "encoder": encoder.config["weights"]["sha256"],
        "pool": pool,
        "batch_size": batch_size,
        # another export's rows are never mixed in
        "contract": export_contract(encoder.config),
        "with_paths": with_paths,
    }
    paths = [os.path.join(partial, f"chunk_{k:06d}.npz") for k in range(len(chunks))]
    todo = [
        k
        for k, (p, c) in enumerate(zip(paths, chunks))
        if read_chunk(p, [record_key(r) for r in c], settings) is None
    ]
    done = len(records) - sum(len(chunks[k]) for k in todo)
    if done:
        print(
            f"resuming: {done} of {len(records)} volumes already embedded in {partial}",
            file=sys.stderr,
        )
    loader = torch.utils.data.DataLoader(
        EmbedInputs([r for k in todo for r in chunks[k]], cfg),
        batch_size=None,
        num_workers=cfg.workers,
        **worker_processes(cfg.workers),
    )
    inputs = iter(loader)
    with progress(len(records), "embed", "volume", initial=done) as bar:
        for k in todo:
            embeddings, reasons, sums = embed_chunk(
                encoder, inputs, len(chunks[k]), batch_size, pool, rt, bar
            )
            chunk = {
                "key": np.array([record_key(r) for r in chunks[k]]),
                "embedding": embeddings,
                "reason": np.array([r for r, _ in reasons]),
                "detail": np.array([d if with_paths else "" for _, d in reasons]),
                "position_sums": sums.numpy(),
                "settings": np.array(json.dumps(settings)),
            }
            try:
                write_atomic(paths[k], npz_bytes(chunk))
            except OSError as e:
                raise write_failure(e, partial) from None
    return paths, len(records) - done


def write_failure(error: OSError, partial: str) -> ConfigError:
    """The error for a write of embed's output that its storage refused (a full disk, no
    permission): the rows done so far stay in `partial`, and the same command continues from
    them."""
    return ConfigError(
        f"out: cannot write into {os.path.dirname(os.path.abspath(partial))}"
        f" ({error.strerror or error}); free space there or make it writable, then run the same"
        f" command again: it continues from the rows saved in {partial} (or give another --out)."
    )


def volume_path(paths: List[str]) -> str:
    """The path of a volume: its file, or the folder holding a series' files."""
    return paths[0] if len(paths) == 1 else os.path.dirname(os.path.commonprefix(paths) + "x")


def read_chunks(paths: List[str]):
    """Each saved chunk's arrays in turn (one in memory at a time)."""
    for path in paths:
        with np.load(path) as saved:
            yield {k: saved[k] for k in saved.files}


def chunk_statistics(paths: List[str]) -> dict:
    """Over the embedded rows of the saved chunks: how many, each dimension's mean and standard
    deviation (float32, computed in float64), the position share of their tokens, and how many rows
    hold NaN or inf (nonfinite)."""
    count, nonfinite, sums, token_sums = 0, 0, 0.0, 0.0
    for chunk in read_chunks(paths):
        rows = chunk["embedding"][chunk["reason"] == ""].astype(np.float64)
        count += len(rows)
        nonfinite += int((~np.isfinite(rows).all(1)).sum())
        sums = sums + np.stack([rows.sum(0), (rows**2).sum(0)])
        token_sums = token_sums + torch.from_numpy(chunk["position_sums"])
    if not count:
        return {"rows": 0, "nonfinite": 0}
    mean = sums[0] / count
    std = np.sqrt(np.maximum(sums[1] / count - mean**2, 0))
    return {
        "rows": count,
        "nonfinite": nonfinite,
        "mean": mean.astype(np.float32),
        "std": std.astype(np.float32),
        "position_share": position_share_of_sums(token_sums, count),
    }


def write_npz_entry(archive: zipfile.ZipFile, name: str, value) -> None:
    """One array into an open .npz archive, its entry without a time stamp (the file depends only on
    the arrays)."""
    with archive.open(
        zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w", force_zip64=True
    ) as f:
        np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)


def write_embedding_table(
    out: str,
    records: List[dict],
    paths: List[str],
    rejected: List[dict],
    extra: dict,
    stats: dict,
    standardize: bool,
    root: Optional[str] = None,
    with_paths: bool = False,
) -> dict:
    """Write the embed file `out` (atomically): a row per embedded volume, a skipped_ row per
    unusable file or volume, mean and std, and `extra`; the embedding column streamed chunk by chunk
    from the saved chunks, standardized with mean and std when `standardize`. Returns its arrays but
    the embeddings, and their shape. Safe to share by default: a volume is its keyed id
    (privacy.volume_key below `root`), never its path, UIDs or the reader's details; with_paths adds
    path, study, series, skipped_path and skipped_detail (for this machine only)."""
    reasons = [
        (r, d)
        for c in read_chunks(paths)
        for r, d in zip(c["reason"].tolist(), c["detail"].tolist())
    ]
    rows = [r for r, (reason, _) in zip(records, reasons) if not reason]
    skipped = [(r["paths"][0], r["reason"], r["detail"] or "") for r in rejected]
    skipped += [
        (r["paths"][0], reason, detail) for r, (reason, detail) in zip(records, reasons) if reason
    ]

    def column(key: str) -> np.ndarray:  # '' where an older index has no such field
        return np.array([str(r.get(key) or "") for r in rows], dtype=str)

    width = len(stats.get("mean", [])) or (
        next(read_chunks(paths))["embedding"].shape[1] if paths else 0
    )
    table = {
        "volume": np.array([volume_key(volume_path(r["paths"]), root) for r in rows], dtype=str),
        "files": np.array([len(r["paths"]) for r in rows], dtype=np.int64),
        "patient": column("patient"),
        "laterality": column("laterality"),
        "manufacturer": column("manufacturer"),
        "model": column("model"),
        "spacing": (
            np.array([r["spacing"] or [np.nan] * 3 for r in rows], dtype=np.float64).reshape(-1, 3)
        ),
        "shape": np.array([r["shape"] for r in rows], dtype=np.int64).reshape(-1, 3),
        "skipped_volume": np.array([volume_key(s[0], root) for s in skipped], dtype=str),
        "skipped_reason": np.array([s[1] for s in skipped], dtype=str),
        "mean": stats.get("mean", np.zeros(width, np.float32)),
        "std": stats.get("std", np.zeros(width, np.float32)),
        "standardized": np.array(standardize),
        **extra,
    }
    if with_paths:
        table.update(
            {
                "path": np.array([volume_path(r["paths"]) for r in rows], dtype=str),
                "study": column("study"),
                "series": column("series"),
                "skipped_path": np.array([s[0] for s in skipped], dtype=str),
                "skipped_detail": np.array([s[2] for s in skipped], dtype=str),
            }
        )
    try:
        write_table_file(out, table, paths, (len(rows), width), standardize)
    except OSError as e:
        raise write_failure(e, out + ".partial") from None
    return {**table, "embedding_shape": (len(rows), width)}


def write_table_file(
    out: str, table: dict, paths: List[str], shape: Tuple[int, int], standardize: bool
) -> None:
    """The embed file: the embedding column (`shape`) streamed from the saved chunks, standardized
    with the table's mean and std when `standardize`, then the table's columns; written beside `out`
    and renamed (a failed write leaves nothing)."""
    scale = np.where(table["std"] > 0, table["std"], 1).astype(np.float32)
    writing = out + ".writing"
    try:
        with zipfile.ZipFile(writing, "w") as archive:
            with archive.open(
                zipfile.ZipInfo("embedding.npy", date_time=(1980, 1, 1, 0, 0, 0)),
                "w",
                force_zip64=True,
            ) as f:
                np.lib.format.write_array_header_1_0(
                    f,
                    {
                        "descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                        "fortran_order": False,
                        "shape": shape,
                    },
                )
                for chunk in read_chunks(paths):
                    embedded = chunk["embedding"][chunk["reason"] == ""]  # [rows of this chunk, F]
                    embedded = (embedded - table["mean"]) / scale if standardize else embedded
                    f.write(embedded.astype(np.float32).tobytes())
            for name, value in table.items():
                write_npz_entry(archive, name, value)
        os.replace(writing, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(writing)
        raise


def embed(
    encoder_dir: str,
    out: str,
    cli: Config,
    pool: str = "mean_pool",
    batch_size: int = 8,
    save_every: int = 256,
    standardize: bool = False,
    with_paths: bool = False,
) -> Tuple[dict, int]:
    """Embed every usable volume of cli's data_root / manifest_path (with its device, cache_dir,
    workers, index_path) with an export and write `out` (.npz); returns its arrays (the embeddings'
    shape in 'embedding_shape', not the embeddings) and how many volumes were computed now. Resumes
    from out.partial/ (see embed_records), removed once `out` is written. The memory it needs does
    not grow with the rows but for their identity columns."""
    pool = pool_name(pool)
    if not out.endswith(".npz") or out.startswith("gs://"):
        raise ConfigError(
            f"out: {out} must be a local file ending in .npz (one array per column; np.load reads"
            " it); copy it to a bucket afterwards."
        )
    if os.path.exists(out):
        raise ConfigError(
            f"out: {out} exists; choose another --out or delete it (nothing is overwritten)."
        )
    if cli.data_root is None and cli.manifest_path is None:
        raise ConfigError(
            "data_root: give the folder, glob or gs:// prefix of the DICOM files to embed "
            "(or --manifest_path)."
        )
    partial = out + ".partial"
    with embed_lock(out, partial):
        table, computed = embed_locked(
            encoder_dir, out, partial, cli, pool, batch_size, save_every, standardize, with_paths
        )
    shutil.rmtree(partial, ignore_errors=True)  # once the lock in it is given back
    return table, computed


@contextlib.contextmanager
def embed_lock(out: str, partial: str):
    """One embed at a time into `out`: the lock of its OUT.partial/ folder (lock.take_lock) for as
    long as the block runs. Another embed writing it now is a ConfigError (exit 2) naming it, as is
    an `out` written meanwhile."""
    try:
        lock = take_lock(partial)
    except ConfigError as e:
        record = os.path.join(partial, LOCK_NAME)
        try:
            with open(record) as f:
                holder = json.load(f)
            who = f"process {holder['pid']} on {holder['host']}, since {holder['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"out: cannot take the lock of {out} ({e}).") from None
        raise ConfigError(
            f"out: another `encoder.py embed` ({who}) is writing {out} now; wait for it to finish"
            " (its table is then there), or give another --out. If that process is gone on another"
            f" machine, delete {record} and run the same command again: it continues from the rows"
            " saved (one gone on this machine is noticed by itself)."
        ) from None
    try:
        if os.path.exists(out):  # the other one finished while this one started
            raise ConfigError(
                f"out: {out} exists; choose another --out or delete it (nothing is overwritten)."
            )
        yield
    finally:
        release_lock(lock)


def embed_locked(
    encoder_dir: str,
    out: str,
    partial: str,
    cli: Config,
    pool: str,
    batch_size: int,
    save_every: int,
    standardize: bool,
    with_paths: bool,
) -> Tuple[dict, int]:
    """embed's work once it holds the lock of `out` (embed_lock): the scan, the rows, then the
    table."""
    encoder = load_encoder(encoder_dir)
    cfg = replace(encoder.settings, **{k: getattr(cli, k) for k in CLI_FIELDS["embed"]})
    rt = setup_runtime(cfg)
    if batch_size % rt.local_replicas:
        raise ConfigError(
            f"batch_size: {batch_size} does not divide over this host's {rt.local_replicas}"
            " devices."
        )
    records = index_records(cfg)
    if not records:
        raise NoUsableData(
            f"no files under {cfg.data_root or cfg.manifest_path}: check the path (a folder, a glob"
            " or a gs:// prefix of DICOM files; --manifest_path for a list of files)."
        )
    usable = [r for r in records if r["ok"]]
    if not usable:
        raise NoUsableData(
            f"no usable volume in {cfg.data_root or cfg.manifest_path}:\n"
            f"{format_reason_table(Counter(r['reason'] for r in records))}"
        )
    paths, computed = embed_records(
        encoder.to(rt.device), usable, cfg, partial, pool, batch_size, save_every, rt, with_paths
    )
    stats = chunk_statistics(paths)
    if stats["nonfinite"]:
        raise ExportError(
            f"{encoder_dir}: the encoder gives NaN or inf embeddings for {stats['nonfinite']} of"
            f" {len(usable)} volumes; nothing was written to {out}. Check the export (encoder.py"
            " export refuses NaN weights) and those files."
        )
    shared_config = {
        **encoder.config,
        "source": share_safe_source(encoder.config.get("source", {})),
    }
    extra = {
        "pool": np.array(pool),
        "encoder": np.array(json.dumps(shared_config)),
        "position_share": np.array(stats.get("position_share", np.nan)),
        # which secret made the patient keys (privacy.py)
        "key_fingerprint": np.array(key_fingerprint()),
    }
    table = write_embedding_table(
        out,
        usable,
        paths,
        [r for r in records if not r["ok"]],
        extra,
        stats,
        standardize,
        cfg.data_root,
        with_paths,
    )
    return table, computed


ROW_COLUMNS = (
    "volume",
    "files",
    "patient",
    "laterality",
    "manufacturer",
    "model",
    "spacing",
    "shape",
    "embedding",
)
SKIPPED_COLUMNS = ("skipped_volume", "skipped_reason")


def join_embedding_tables(paths: List[str]) -> dict:
    """The rows of several embed tables (e.g. two sites' or two data roots') as one table's arrays,
    for one analysis across them: only tables whose patient keys join (the same key_fingerprint:
    privacy.check_same_key), of one encoder and pool, none standardized (each has its own mean). A
    ConfigError naming the tables and the fix otherwise: tables of two secrets share no patient key,
    so their merge would split every patient in two."""
    tables = []
    for path in paths:
        with np.load(path) as table:
            tables.append({k: table[k] for k in table.files})
    check_same_key(
        {p: table_key_fingerprint(t) for p, t in zip(paths, tables)},
        "embed every data root again under one key file (the same OCTJEPA_PATIENT_KEY_FILE: `python"
        " encoder.py embed --encoder DIR --data_root ROOT --out NEW.npz`), then join those",
    )
    made_by = {(json.loads(str(t["encoder"]))["weights"]["sha256"], str(t["pool"])) for t in tables}
    if len(made_by) > 1 or any(bool(t["standardized"]) for t in tables):
        raise ConfigError(
            f"{', '.join(paths)}: only tables of one encoder and --pool, without --standardize,"
            f" join (they hold {len(made_by)} encoder and pool pairs); embed them again alike."
        )
    joined = {c: np.concatenate([t[c] for t in tables]) for c in ROW_COLUMNS + SKIPPED_COLUMNS}
    return {
        **joined,
        "pool": tables[0]["pool"],
        "encoder": tables[0]["encoder"],
        "key_fingerprint": tables[0]["key_fingerprint"],
        "standardized": np.array(False),
    }


# --------------------------------------------------------------------------------------------------
# Show what the encoder sees
# --------------------------------------------------------------------------------------------------


def feature_colours(
    tokens: torch.Tensor, shown: List[int], centre: bool = True
) -> Tuple[np.ndarray, np.ndarray]:
    """(RGB [S, N, 3] in [0, 1] of the shown volumes' tokens, the share of variance of each of the 3
    components): their projection on the first three principal components of all tokens [M, N, E],
    each stretched from its 1st to its 99th percentile over all tokens. centre: each grid position's
    mean token over the M volumes is subtracted first, so the components show what differs between
    volumes, not where a token is (position)."""
    if centre:
        tokens = tokens - tokens.mean(0, keepdim=True)  # [M, N, E] minus [1, N, E]
    pca = PCA(3, random_state=0).fit(tokens.flatten(0, 1).numpy())
    every = pca.transform(tokens.flatten(0, 1).numpy())  # [M*N, 3]
    lo, hi = np.percentile(every, [1, 99], axis=0)
    rgb = (pca.transform(tokens[shown].flatten(0, 1).numpy()) - lo) / np.maximum(hi - lo, 1e-12)
    return np.clip(rgb, 0, 1).reshape(len(shown), tokens.shape[1], 3), pca.explained_variance_ratio_


def looks(tokens: torch.Tensor, grid: List[int], labels: np.ndarray, shown: List[int]) -> dict:
    """What one encoder's tokens [M, N, E] of the labelled volumes show for the shown ones: PCA
    colours of their position-centred tokens [S,gd,gh,gw,3] and of their depth-averaged (en face)
    tokens [S,gd,gw,3], the attention [S,gd,gh,gw] (mean over heads) of an attentive probe trained
    on the other labelled volumes, its probability of each shown volume's class [S], and the tokens'
    position share."""
    M, _, E = tokens.shape
    enface = tokens.view(M, *grid, E).mean(2).flatten(1, 2)  # [M, gd*gw, E]
    # the shown volumes are held out: p is a held-out prediction
    train = np.setdiff1d(np.arange(M), shown)
    head = fit_attentive(tokens, labels, train, seed=0)
    with torch.no_grad():
        attention = head.attention(tokens[shown]).mean(-1)  # [S, N]
        probs = F.softmax(head(tokens[shown]), dim=-1)[torch.arange(len(shown)), labels[shown]]
    rgb, explained = feature_colours(tokens, shown)
    return {
        "rgb": rgb.reshape(len(shown), *grid, 3),
        "explained": explained,
        "rgb_enface": feature_colours(enface, shown)[0].reshape(len(shown), grid[0], grid[2], 3),
        "attention": attention.numpy().reshape(len(shown), *grid),
        "prob": probs.numpy(),
        "position_share": position_share(tokens),
    }


def input_spacing(path: str, cfg: Config) -> Optional[List[float]]:
    """The voxel spacing [dz, dy, dx] mm of a file's model input (cfg's preprocessing), None when
    unknown."""
    volume = read_volume(path)
    if volume.spacing is None:
        return None
    if cfg.target_spacing is not None:
        return list(cfg.target_spacing)
    return [s * n / m for s, n, m in zip(volume.spacing, volume.voxels.shape, cfg.image_size)]


def fitting_rows(
    labels: List[str], wanted: Optional[List[int]], limit: int, seed: int
) -> List[int]:
    """The rows of a labels file (1 = the first) whose tokens fit the PCA and the probe: every row
    when there are at most `limit`, else `limit` of them drawn per class in proportion (seed), and
    the `wanted` rows; in file order."""
    if len(labels) <= limit:
        return list(range(1, len(labels) + 1))
    classes = np.unique(labels, return_inverse=True)[1]
    _, drawn = stratified_split(classes, limit / len(labels), seed)
    return sorted(set((drawn + 1).tolist()) | set(wanted or []))


def labelled_tokens(
    encoders: dict,
    cfg: Config,
    labels_csv: str,
    wanted: Optional[List[int]],
    device,
    fit_volumes: int,
):
    """One pass over the fitting_rows of a labels CSV (at most fit_volumes and the wanted ones, so
    that memory does not grow with the file), a volume in memory at a time: ({arm: tokens [M, N, E]}
    of every usable one, their labels [M] and class names, the indices of the shown ones (the rows
    `wanted`, 1 = the first data row, else the first volume of each class), their inputs [S,1,D,H,W]
    and their labels-file rows, {reason: count} skipped, and how many rows the file has)."""
    table = read_label_table(labels_csv, ("label",))
    rows = list(zip(table.paths, table.values["label"]))
    if wanted and not all(1 <= w <= len(rows) for w in wanted):
        raise ConfigError(f"volumes: {labels_csv} has rows 1 to {len(rows)}, not {wanted}.")
    fitting = set(fitting_rows([label for _, label in rows], wanted, fit_volumes, cfg.seed))
    values, shown, inputs, skipped = [], [], {}, Counter()

    def usable_volumes():
        """The fitting rows' model inputs [1, D, H, W], read one at a time; noting labels, shown
        ones and skips."""
        for row, (path, label) in counted(
            [(r, v) for r, v in enumerate(rows, start=1) if r in fitting],
            f"show: encode (at most --fit_volumes {fit_volumes})",
            "volume",
        ):
            try:
                volume = load_val_sample(path, cfg)  # [1,D,H,W]
            except UnusableFile as e:
                if row in (wanted or []):
                    raise ConfigError(
                        f"volumes: row {row} of {labels_csv} cannot be used ({e.reason})."
                    ) from None
                skipped[e.reason] += 1
                continue
            if (row in wanted) if wanted else label not in [values[s] for s in shown]:
                shown.append(len(values))
                inputs[len(values)] = (volume, row, input_spacing(path, cfg))
            values.append(label)
            yield volume

    tokens = encode_volumes(encoders, usable_volumes(), device, batch_size=1)
    labels, classes = task_targets(np.array(values, dtype=str), labels_csv)
    return tokens, labels, classes, shown, inputs, dict(skipped), len(rows)


def draw_volume_row(
    fig,
    axes,
    volume: np.ndarray,
    look: dict,
    s: int,
    slab: int,
    patch_depth: int,
    spacing: Optional[List[float]],
) -> None:
    """Six panels of one volume [D,H,W] for one encoder: the middle B-scan of token slab `slab`, its
    PCA colours and the probe's attention over it; the same en face (the mean over depth; attention
    summed over depth), at the volume's true aspect ratio where its spacing is known. Colour bars on
    the input and the attention."""
    D, H, W = volume.shape
    frame = slab * patch_depth + patch_depth // 2
    attention = look["attention"][s]  # [gd, gh, gw]
    enface = volume.mean(1)  # [D, W]
    bscan_extent = (0, W, H, 0)
    # mm when known
    enface_extent = (0, W * spacing[2], D * spacing[0], 0) if spacing else (0, W, D, 0)
    panels = [
        (volume[frame], None, bscan_extent),
        (look["rgb"][s][slab], None, bscan_extent),
        (volume[frame], attention[slab], bscan_extent),
        (enface, None, enface_extent),
        (look["rgb_enface"][s], None, enface_extent),
        (enface, attention.sum(1), enface_extent),
    ]
    for k, (ax, (image, heat, extent)) in enumerate(zip(axes, panels)):
        aspect = "equal" if extent is enface_extent and spacing else "auto"
        shown = ax.imshow(
            image,
            cmap="gray" if image.ndim == 2 else None,
            extent=extent,
            aspect=aspect,
            interpolation="nearest",
        )
        if heat is not None:
            shown = ax.imshow(
                heat / heat.max(),
                cmap="inferno",
                alpha=0.55,
                extent=extent,
                aspect=aspect,
                vmin=0,
                vmax=1,
                interpolation="nearest",
            )
        if image.ndim == 2 and k in (0, 2, 5):
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_xlabel(f"B-scan {frame} of {D}", fontsize=8)
    if spacing:
        axes[3].set_xlabel(f"{W * spacing[2]:.1f} x {D * spacing[0]:.1f} mm", fontsize=8)


def show(
    encoder_dir: str,
    labels_csv: str,
    out: str,
    cli: Config,
    vs_random: bool = True,
    volumes: Optional[List[int]] = None,
    fit_volumes: int = 256,
) -> dict:
    """PNG of labelled volumes (`volumes`: rows of the labels CSV, 1 = the first; default one of
    each class): input, PCA colours of the position-centred patch features and an attentive probe's
    attention, on a B-scan and en face, for the export and (vs_random) a random init of its
    architecture; the PCA and the probe fit on at most fit_volumes labelled volumes (a
    class-stratified sample of a larger file). The B-scan is the middle one of the token slab that
    the export's probe attends to most. Returns what it drew: looks (per arm), rows, labels,
    title."""
    encoder = load_encoder(encoder_dir)
    cfg = replace(encoder.settings, **{k: getattr(cli, k) for k in CLI_FIELDS["show"]})
    device = probe_device(cfg)
    arms = (
        {"pretrained": encoder, "random init": random_encoder(encoder.config, cfg.seed)}
        if vs_random
        else {"encoder": encoder}
    )
    arms = {arm: e.to(device) for arm, e in arms.items()}
    tokens, labels, classes, shown, inputs, skipped, rows = labelled_tokens(
        arms, cfg, labels_csv, volumes, device, fit_volumes
    )
    if skipped:
        print(f"skipped unusable files: {skipped}", file=sys.stderr)
    looked = {arm: looks(t, encoder.grid, labels, shown) for arm, t in tokens.items()}
    titles = [
        "input B-scan",
        "features (PCA 1-3 as RGB)",
        "attentive probe's attention",
        "input en face",
        "features en face (PCA)",
        "attention en face",
    ]
    fig = new_figure((15, 2.3 * len(shown) * len(arms) + 0.8))
    axes = fig.subplots(len(shown) * len(arms), len(titles), squeeze=False)
    for ax, title in zip(axes[0], titles):
        ax.set_title(title, fontsize=10)
    for i, s in enumerate(shown):
        volume, row, spacing = inputs[s]
        slab = int(looked[next(iter(arms))]["attention"][i].sum((1, 2)).argmax())
        for j, (arm, look) in enumerate(looked.items()):
            axes_row = axes[i * len(arms) + j]
            draw_volume_row(
                fig,
                axes_row,
                volume[0].numpy(),
                look,
                i,
                slab,
                encoder.settings.patch_size[0],
                spacing,
            )
            axes_row[0].set_ylabel(
                f"{arm}, row {row}\n{classes[labels[s]]}, p={look['prob'][i]:.2f}", fontsize=9
            )
    update = (encoder.config.get("source") or {}).get("update")
    shares = ", ".join(f"{arm} {look['position_share']:.0%}" for arm, look in looked.items())
    explained = ", ".join(f"{v:.0%}" for v in looked[next(iter(arms))]["explained"])
    fitted = f"{len(labels)} labelled volumes" + (
        f" (a sample of the file's {rows})" if len(labels) < rows else ""
    )
    title = (
        f"encoder after {update} updates: rows of the labels file, of {fitted}; p = the probe's"
        " held-out probability of the class.\nPCA of the tokens minus their grid position's mean"
        f" (PC1-3: {explained} of that variance); grid position explains {shares} of these volumes'"
        " token variance"
    )
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return {
        "looks": looked,
        "rows": [inputs[s][1] for s in shown],
        "labels": labels[shown],
        "title": title,
    }


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def add_show_flags(sh: ScriptParser) -> None:
    """The flags of encoder.py show."""
    sh.add_argument("--encoder", required=True, help="an export folder")
    sh.add_argument(
        "--labels",
        required=True,
        help="labels CSV (path,label) whose volumes fit the PCA and the probe",
    )
    sh.add_argument("--out", required=True, help="the PNG to write")
    sh.add_argument(
        "--no_random", action="store_true", help="leave out the random init of the architecture"
    )
    sh.add_argument(
        "--fit_volumes",
        type=int,
        default=256,
        help=(
            "the sample size: read, encode and fit the PCA and the probe on at most N labelled"
            " volumes, drawn per class in proportion (reproducibly: --seed) from a larger file, and"
            " the --volumes drawn. Time and memory grow with N, not the file: e.g. 32 for a quick"
            " look. Default 256, as before: bounded, so a large file costs no more; fewer volumes"
            " leave the held-out probe fewer of each class to learn from"
        ),
    )
    sh.add_argument(
        "--volumes",
        type=lambda v: [int(r) for r in v.split(",")],
        default=None,
        help=(
            "rows of the labels CSV to draw, 1 = the first data row (e.g. 1,5,9; default: the first"
            " volume of each class)"
        ),
    )


def command_line() -> ScriptParser:
    """encoder.py's flags: the export, embed and show commands."""
    parser = ScriptParser(__doc__, prog="encoder.py", config_flags=False)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> ScriptParser:
        flags = ", ".join(f"--{f}" for f in CLI_FIELDS[name]) or "none"
        return commands.add_parser(
            name,
            help=summary,
            config_flags=False,
            epilog=(
                f"The config flags it takes: {flags} "
                "(the export brings its own model and preprocessing; any other is refused)."
            ),
        )

    ex = command(
        "export",
        "write a checkpoint's EMA encoder as a folder that loads anywhere (docs/encoder.md)",
    )
    ex.add_argument(
        "--ckpt",
        required=True,
        help="a train.py checkpoint, or a run's checkpoints folder (newest step)",
    )
    ex.add_argument("--out", required=True, help="the export folder")
    ex.add_argument("--force", action="store_true", help="replace an export already in --out")
    ex.add_argument(
        "--with_loader_code",
        action="store_true",
        help=(
            "also write octjepa_encoder.py and hubconf.py into the folder: torch.hub.load(FOLDER,"
            " ...) then runs the folder's code (load such a folder only from a sender you trust);"
            " by default the folder holds data only"
        ),
    )
    em = command("embed", "one embedding per volume of a folder, manifest or gs:// prefix")
    em.add_argument("--encoder", required=True, help="an export folder")
    em.add_argument(
        "--out", required=True, help="the .npz to write (OUT.partial/ holds the rows done so far)"
    )
    em.add_argument(
        "--pool",
        default="mean_pool",
        choices=POOLS,
        help="mean_pool: [E]; depth_rows: each depth row's mean [gh*E]",
    )
    em.add_argument(
        "--batch_size", type=int, default=8, help="volumes per forward pass (default 8)"
    )
    em.add_argument(
        "--save_every",
        type=int,
        default=256,
        help="save the rows done every N volumes (default 256)",
    )
    em.add_argument(
        "--standardize",
        action="store_true",
        help="store (embedding - mean) / std per dimension (mean and std are stored either way)",
    )
    em.add_argument(
        "--with_paths",
        action="store_true",
        help=(
            "add each volume's path, StudyInstanceUID and "
            "SeriesInstanceUID (a table for this machine only: docs/privacy.md)"
        ),
    )
    add_show_flags(
        command("show", "PNG: PCA of the patch features and an attentive probe's attention")
    )
    return parser


@script_main
def main(argv: List[str]) -> int:
    parser = command_line()
    args, rest = parser.parse(argv)
    other = sorted(given_flags(rest) - set(CLI_FIELDS[args.command]))
    if other:
        allowed = ", ".join(f"--{f}" for f in CLI_FIELDS[args.command]) or "none"
        raise ConfigError(
            f"{', '.join('--' + o for o in other)}: the export brings its own model and"
            f" preprocessing; the config flags that `{args.command}` takes: {allowed}."
        )
    cli = load_config(rest)
    if args.command == "export":
        error = export(args.ckpt, args.out, args.force, args.with_loader_code)
        code = f", {STANDALONE_MODULE}, {HUBCONF}" if args.with_loader_code else ""
        print(
            f"exported the EMA encoder of {resolve_checkpoint(args.ckpt)} to {args.out}"
            f" ({CONFIG_FILE}, {WEIGHTS_FILE}, {MODEL_CARD}{code}); round trip: largest"
            f" |difference| of the loaded tokens {error:.1g}"
        )
    elif args.command == "embed":
        if args.batch_size < 1 or args.save_every < 1:
            parser.error("--batch_size and --save_every must be at least 1")
        table, computed = embed(
            args.encoder,
            args.out,
            cli,
            args.pool,
            args.batch_size,
            args.save_every,
            args.standardize,
            args.with_paths,
        )
        print(
            f"{len(table['volume'])} volumes embedded in {args.out} ({table['embedding_shape'][1]}"
            f" numbers each, {computed} computed"
            f" now{', standardized' if args.standardize else ''}); grid position explains"
            f" {float(table['position_share']):.0%} of these volumes' token variance"
            " (position_share). Standardize each dimension before cosine, kNN or clustering:"
            " (embedding - mean) / std (docs/encoder.md)."
        )
        if len(table["skipped_reason"]):
            print(
                f"{len(table['skipped_reason'])} files or volumes skipped:\n"
                f"{format_reason_table(Counter(table['skipped_reason'].tolist()))}"
            )
    else:
        if args.fit_volumes < 2:
            parser.error("--fit_volumes must be at least 2 (the probe needs volumes of each class)")
        show(
            args.encoder,
            args.labels,
            args.out,
            cli,
            vs_random=not args.no_random,
            volumes=args.volumes,
            fit_volumes=args.fit_volumes,
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
