"""Use a pretrained encoder: export it, embed a dataset with it, look at what it sees.

    python encoder.py export --ckpt runs/learn/checkpoints --out runs/learn/encoder   # safetensors + config.json
    python encoder.py embed --encoder runs/learn/encoder --data_root /data/oct --out oct.npz
    python encoder.py embed --encoder DIR --data_root gs://bucket/oct --out oct.npz --pool axial --device cuda
    python encoder.py show --encoder runs/learn/encoder --labels data/phantoms_learn_probe/labels.csv --out show.png

Fine-tuning on labelled volumes is finetune.py. An export is a folder: encoder.safetensors (the EMA target encoder,
keys as model.Encoder) and config.json (format version, architecture, the preprocessing contract, the training-time
augmentation, the weights' sha256, and where they came from: checkpoint, update, plan, training config). In Python:
model.load_encoder(DIR), and data.load_val_sample(path, encoder.settings) preprocesses a DICOM file or series
as the contract says.

embed writes one row per usable volume to an .npz (numpy only), safe to share (docs/privacy.md): volume (a keyed id
of its path below data_root: privacy.volume_key), files, patient (the index's keyed hash of PatientID), laterality,
manufacturer, model, spacing [dz,dy,dx] mm (nan when unknown), shape [D,H,W] as stored, embedding [M,E] (--pool
mean) or [M, gh*E] (--pool axial: the mean of each depth row of tokens); and skipped_volume, skipped_reason for every
file the reader or the preprocessing could not use (the reason codes of `python data.py scan`). --with_paths adds
path (the file, or the folder of a series' files), study, series, skipped_path and skipped_detail, for this machine.
Every --save_every volumes the rows done are saved in OUT.partial/: the same command started again after a kill
computes only the rest (only rows of the same export's contract are reused), and its file equals an uninterrupted
run's byte for byte. Static shapes (the last batch is padded): it runs on cpu, cuda and xla.

show draws, for one labelled volume of each class and for the encoder beside a random init of its architecture: a
B-scan and the en-face view of the input, the first three principal components of the patch features as RGB on
both, and where an attentive probe (probe.py) trained on the labelled volumes looks.

The config flags that apply: device, cache_dir, workers and (embed) data_root, manifest_path, index_path; the export
brings its own model and preprocessing. Exit codes: 0 done, 2 bad arguments or export, 3 no usable volume.
"""
import io
import json
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
from matplotlib.figure import Figure
from sklearn.decomposition import PCA
from tqdm import tqdm

from config import Config, ConfigError, ScriptParser, given_flags, load_config, script_main
from data import NoUsableData, index_records, load_prepared, to_sample
from dicom import UnusableFile
from index import format_reason_table
from model import (CONFIG_FILE, POOLS, VJEPA3D, ExportError, PretrainedEncoder, export_config, export_contract,
                   load_encoder, random_encoder, save_encoder)
from privacy import share_safe_source, volume_key
from probe import (Task, encode_volumes, fit_attentive, load_labelled_volumes, probe_device, read_model_checkpoint,
                   resolve_checkpoint, task_targets)
from runtime import fetch_to_host, setup_runtime, to_device
from storage import exists, write_atomic

CLI_FIELDS = {"export": (), "embed": ("device", "cache_dir", "workers", "data_root", "manifest_path", "index_path"),
              "show": ("device", "cache_dir", "seed")}
ROUND_TRIP_TOLERANCE = 1e-6


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------

def export(ckpt: str, out: str, force: bool = False) -> float:
    """Write the EMA target encoder of a train.py checkpoint (a file, or a run's checkpoints folder: its newest
    step) to `out` as an export; returns the round-trip error: the largest |difference| between the loaded export's
    tokens and the checkpoint's target encoder's on a random batch (ExportError above ROUND_TRIP_TOLERANCE)."""
    path = resolve_checkpoint(ckpt)
    model, cfg, state = read_model_checkpoint(path)
    if exists(f"{out.rstrip('/')}/{CONFIG_FILE}") and not force:
        raise ConfigError(f"out: {out} already holds an export; choose another --out, or --force to replace it.")
    source = {"checkpoint": path, "encoder": "target (EMA)", "update": state.get("train_state", {}).get("step"),
              "plan": state.get("plan"), "training_config": state["config"]}
    state_dict = model.encoder_state_dict()
    broken = [k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:
        raise ExportError(f"{path}: the target encoder's {broken[0]} (and {len(broken) - 1} more) holds NaN or inf; "
                          f"export an earlier checkpoint (best.pt or a step before the run diverged).")
    save_encoder(state_dict, export_config(cfg, share_safe_source(source)), out)  # no paths
    error = round_trip_error(model, load_encoder(out))
    if not error <= ROUND_TRIP_TOLERANCE:  # nan too
        raise ExportError(f"{out}: the loaded encoder differs from the checkpoint's by up to {error:.3g}.")
    return error


def round_trip_error(model: VJEPA3D, encoder: PretrainedEncoder) -> float:
    """The largest |difference| between the tokens of a loaded export and of the model's target encoder on a fixed
    random batch of two volumes."""
    volume = torch.randn(2, 1, *encoder.image_size, generator=torch.Generator().manual_seed(0))
    return float((encoder.encode(volume) - model.encode(volume)).abs().max())


# ----------------------------------------------------------------------------------------------------------
# Embed a dataset
# ----------------------------------------------------------------------------------------------------------

class EmbedInputs(torch.utils.data.Dataset):
    """The model input [1,D,H,W] of each index record, preprocessed like a validation sample, or (None, reason,
    detail) when the preprocessing cannot use it."""

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
    """An .npz (np.load reads it) whose bytes depend only on the arrays: zip entries without a time stamp."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, value in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w") as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)
    return buffer.getvalue()


def record_key(record: dict) -> str:
    """What identifies a volume's input: its files and their identities (a file written again is another input)."""
    return json.dumps([record["paths"], record.get("sources") or []])


def read_chunk(path: str, keys: List[str], settings: dict):
    """The arrays of a saved chunk of rows, or None when it is missing, damaged or holds other volumes (they are
    computed again). ConfigError when it was embedded with other settings (another encoder, pool or batch size)."""
    try:
        with np.load(path) as saved:
            chunk = {k: saved[k] for k in saved.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    if json.loads(str(chunk["settings"])) != settings:
        raise ConfigError(f"out: {os.path.dirname(path)} holds rows embedded with other settings "
                          f"({str(chunk['settings'])}, now {json.dumps(settings)}); rerun with those, or delete that "
                          f"folder to start over.")
    return chunk if chunk["key"].tolist() == keys else None


def embed_batch(encoder: PretrainedEncoder, samples: List[torch.Tensor], batch_size: int, pool: str, rt) -> np.ndarray:
    """Pooled embeddings [n, F] (float32) of n <= batch_size samples [1,D,H,W], run as one batch of batch_size (the
    last one padded: one shape, so XLA compiles once and every row is computed in the same batch every time)."""
    batch = torch.stack(samples)  # [n,1,D,H,W]
    n = len(batch)
    batch = torch.cat([batch, batch[-1:].expand(batch_size - n, *batch.shape[1:])])
    with torch.no_grad():
        pooled = encoder.embed(to_device({"volume": batch}, rt)["volume"], pool)
    return fetch_to_host(pooled, rt).float().numpy()[:n]


def embed_chunk(encoder: PretrainedEncoder, inputs, count: int, batch_size: int, pool: str, rt,
                progress) -> Tuple[np.ndarray, list]:
    """(embeddings [count, F], zero rows for unusable volumes; [(reason, detail)] per row, ('', '') when embedded) of
    the next `count` volumes of the `inputs` iterator."""
    rows, reasons, pending = [], [], []  # rows: (row, embedding); pending: (row, sample) of the batch being filled
    for row in range(count):
        sample, reason, detail = next(inputs)
        reasons.append((reason, detail))
        if sample is not None:
            pending.append((row, sample))
        if len(pending) == batch_size or (row == count - 1 and pending):
            rows += zip([r for r, _ in pending], embed_batch(encoder, [s for _, s in pending], batch_size, pool, rt))
            pending = []
        progress.update(1)
    embeddings = np.zeros((count, encoder.embedding_size(pool)), np.float32)
    for row, embedding in rows:
        embeddings[row] = embedding
    return embeddings, reasons


def embed_records(encoder: PretrainedEncoder, records: List[dict], cfg: Config, partial: str, pool: str,
                  batch_size: int, save_every: int, rt) -> Tuple[np.ndarray, list, int]:
    """(embeddings [M, F], [(reason, detail)] per record, how many were computed now) of usable index records.
    Chunks of save_every volumes (a multiple of batch_size) are saved in `partial` as they are done; chunks already
    there are not computed again."""
    size = -(-save_every // batch_size) * batch_size
    chunks = [records[i:i + size] for i in range(0, len(records), size)]
    settings = {"encoder": encoder.config["weights"]["sha256"], "pool": pool, "batch_size": batch_size,
                "contract": export_contract(encoder.config)}  # another export's rows are never mixed in
    paths = [os.path.join(partial, f"chunk_{k:06d}.npz") for k in range(len(chunks))]
    saved = [read_chunk(p, [record_key(r) for r in c], settings) for p, c in zip(paths, chunks)]
    todo = [k for k, chunk in enumerate(saved) if chunk is None]
    done = sum(len(chunks[k]) for k in range(len(chunks)) if saved[k] is not None)
    if done:
        print(f"resuming: {done} of {len(records)} volumes already embedded in {partial}", file=sys.stderr)
    loader = torch.utils.data.DataLoader(EmbedInputs([r for k in todo for r in chunks[k]], cfg), batch_size=None,
                                         num_workers=cfg.workers)
    inputs = iter(loader)
    with tqdm(total=len(records), initial=done, unit="volume", desc="embed", disable=None) as progress:
        for k in todo:
            embeddings, reasons = embed_chunk(encoder, inputs, len(chunks[k]), batch_size, pool, rt, progress)
            saved[k] = {"key": np.array([record_key(r) for r in chunks[k]]), "embedding": embeddings,
                        "reason": np.array([r for r, _ in reasons]), "detail": np.array([d for _, d in reasons]),
                        "settings": np.array(json.dumps(settings))}
            write_atomic(paths[k], npz_bytes(saved[k]))
    embeddings = np.concatenate([np.zeros((0, encoder.embedding_size(pool)), np.float32)] +
                                [c["embedding"] for c in saved])
    reasons = [(r, d) for c in saved for r, d in zip(c["reason"].tolist(), c["detail"].tolist())]
    return embeddings, reasons, len(records) - done


def volume_path(paths: List[str]) -> str:
    """The path of a volume: its file, or the folder holding a series' files."""
    return paths[0] if len(paths) == 1 else os.path.dirname(os.path.commonprefix(paths) + "x")


def embedding_table(records: List[dict], embeddings: np.ndarray, reasons: list, rejected: List[dict],
                    root: Optional[str] = None, with_paths: bool = False) -> dict:
    """The arrays of the embed file: a row per embedded volume, a skipped_ row per unusable file or volume. Safe to
    share by default: a volume is its keyed id (privacy.volume_key below `root`), never its path, UIDs or the
    reader's details; with_paths adds path, study, series, skipped_path and skipped_detail (for this machine only)."""
    rows = [(r, e) for r, e, (reason, _) in zip(records, embeddings, reasons) if not reason]
    skipped = [(r["paths"][0], r["reason"], r["detail"] or "") for r in rejected]
    skipped += [(r["paths"][0], reason, detail) for r, (reason, detail) in zip(records, reasons) if reason]
    def column(key: str) -> np.ndarray:  # '' where an older index has no such field
        return np.array([str(r.get(key) or "") for r, _ in rows], dtype=str)

    table = {"volume": np.array([volume_key(volume_path(r["paths"]), root) for r, _ in rows], dtype=str),
             "files": np.array([len(r["paths"]) for r, _ in rows], dtype=np.int64),
             "patient": column("patient"),
             "laterality": column("laterality"), "manufacturer": column("manufacturer"), "model": column("model"),
             "spacing": np.array([r["spacing"] or [np.nan] * 3 for r, _ in rows], dtype=np.float64).reshape(-1, 3),
             "shape": np.array([r["shape"] for r, _ in rows], dtype=np.int64).reshape(-1, 3),
             "embedding": np.stack([e for _, e in rows]) if rows else embeddings[:0],
             "skipped_volume": np.array([volume_key(s[0], root) for s in skipped], dtype=str),
             "skipped_reason": np.array([s[1] for s in skipped], dtype=str)}
    if with_paths:
        table.update({"path": np.array([volume_path(r["paths"]) for r, _ in rows], dtype=str),
                      "study": column("study"), "series": column("series"),
                      "skipped_path": np.array([s[0] for s in skipped], dtype=str),
                      "skipped_detail": np.array([s[2] for s in skipped], dtype=str)})
    return table


def embed(encoder_dir: str, out: str, cli: Config, pool: str = "mean", batch_size: int = 8,
          save_every: int = 256, with_paths: bool = False) -> Tuple[dict, int]:
    """Embed every usable volume of cli's data_root / manifest_path (with its device, cache_dir, workers,
    index_path) with an export and write `out` (.npz); returns its arrays and how many volumes were computed now.
    Resumes from out.partial/ (see embed_records), removed once `out` is written."""
    if not out.endswith(".npz") or out.startswith("gs://"):
        raise ConfigError(f"out: {out} must be a local file ending in .npz (one array per column; np.load reads it); "
                          f"copy it to a bucket afterwards.")
    if os.path.exists(out):
        raise ConfigError(f"out: {out} exists; choose another --out or delete it (nothing is overwritten).")
    if cli.data_root is None and cli.manifest_path is None:
        raise ConfigError("data_root: give the folder, glob or gs:// prefix of the DICOM files to embed "
                          "(or --manifest_path).")
    encoder = load_encoder(encoder_dir)
    cfg = replace(encoder.settings, **{k: getattr(cli, k) for k in CLI_FIELDS["embed"]})
    rt = setup_runtime(cfg)
    if batch_size % rt.local_replicas:
        raise ConfigError(f"batch_size: {batch_size} does not divide over this host's {rt.local_replicas} devices.")
    records = index_records(cfg)
    usable = [r for r in records if r["ok"]]
    if not usable:
        raise NoUsableData(f"no usable volume in {cfg.data_root or cfg.manifest_path}:\n"
                           f"{format_reason_table(Counter(r['reason'] for r in records))}")
    partial = out + ".partial"
    embeddings, reasons, computed = embed_records(encoder.to(rt.device), usable, cfg, partial, pool, batch_size,
                                                  save_every, rt)
    nonfinite = [i for i, e in enumerate(embeddings) if not np.isfinite(e).all()]
    if nonfinite:
        raise ExportError(f"{encoder_dir}: the encoder gives NaN or inf embeddings for {len(nonfinite)} of "
                          f"{len(usable)} volumes (e.g. {volume_path(usable[nonfinite[0]]['paths'])}); nothing was "
                          f"written to {out}. Check the export (encoder.py export refuses NaN weights) and that file.")
    table = embedding_table(usable, embeddings, reasons, [r for r in records if not r["ok"]], cfg.data_root,
                            with_paths)
    shared_config = {**encoder.config, "source": share_safe_source(encoder.config.get("source", {}))}
    write_atomic(out, npz_bytes({**table, "pool": np.array(pool), "encoder": np.array(json.dumps(shared_config))}))
    shutil.rmtree(partial, ignore_errors=True)
    return table, computed


# ----------------------------------------------------------------------------------------------------------
# Show what the encoder sees
# ----------------------------------------------------------------------------------------------------------

def feature_colours(tokens: torch.Tensor, shown: List[int]) -> np.ndarray:
    """RGB [S, N, 3] in [0, 1] of the shown volumes' tokens: their projection on the first three principal components
    of all tokens [M, N, E], each stretched from its 1st to its 99th percentile over all tokens."""
    pca = PCA(3, random_state=0).fit(tokens.flatten(0, 1).numpy())
    every = pca.transform(tokens.flatten(0, 1).numpy())  # [M*N, 3]
    lo, hi = np.percentile(every, [1, 99], axis=0)
    rgb = (pca.transform(tokens[shown].flatten(0, 1).numpy()) - lo) / np.maximum(hi - lo, 1e-12)
    return np.clip(rgb, 0, 1).reshape(len(shown), tokens.shape[1], 3)


def looks(encoder: PretrainedEncoder, volumes: torch.Tensor, labels: np.ndarray, shown: List[int], device) -> dict:
    """What one encoder shows for the shown volumes: PCA colours of their tokens [S,gd,gh,gw,3] and of their
    depth-averaged (en face) tokens [S,gd,gw,3], the attention [S,gd,gh,gw] (mean over heads) of an attentive probe
    trained on the other labelled volumes, and its probability of each shown volume's class [S]."""
    tokens = encode_volumes(encoder.to(device), volumes, device)  # [M, N, E]
    M, _, E = tokens.shape
    grid = encoder.grid
    enface = tokens.view(M, *grid, E).mean(2).flatten(1, 2)  # [M, gd*gw, E]
    train = np.setdiff1d(np.arange(M), shown)  # the shown volumes are held out: p is a held-out prediction
    head = fit_attentive(tokens, labels, train, Task("label"), seed=0)
    with torch.no_grad():
        attention = head.attention(tokens[shown]).mean(-1)  # [S, N]
        probs = F.softmax(head(tokens[shown]), dim=-1)[torch.arange(len(shown)), labels[shown]]
    return {"rgb": feature_colours(tokens, shown).reshape(len(shown), *grid, 3),
            "rgb_enface": feature_colours(enface, shown).reshape(len(shown), grid[0], grid[2], 3),
            "attention": attention.numpy().reshape(len(shown), *grid), "prob": probs.numpy()}


def draw_volume_row(axes, volume: np.ndarray, look: dict, s: int, slab: int, patch_depth: int) -> None:
    """Six panels of one volume [D,H,W] for one encoder: the middle B-scan of token slab `slab`, its PCA colours
    and the probe's attention over it; the same en face (the mean over depth; attention summed over depth)."""
    D, H, W = volume.shape
    frame = slab * patch_depth + patch_depth // 2
    attention = look["attention"][s]  # [gd, gh, gw]
    enface = volume.mean(1)  # [D, W]
    bscan_extent, enface_extent = (0, W, H, 0), (0, W, D, 0)
    panels = [(volume[frame], None, bscan_extent), (look["rgb"][s][slab], None, bscan_extent),
              (volume[frame], attention[slab], bscan_extent), (enface, None, enface_extent),
              (look["rgb_enface"][s], None, enface_extent), (enface, attention.sum(1), enface_extent)]
    for ax, (image, heat, extent) in zip(axes, panels):
        ax.imshow(image, cmap="gray" if image.ndim == 2 else None, extent=extent, aspect="auto",
                  interpolation="nearest")
        if heat is not None:
            ax.imshow(heat / heat.max(), cmap="inferno", alpha=0.55, extent=extent, aspect="auto", vmin=0, vmax=1,
                      interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_xlabel(f"B-scan {frame} of {D}", fontsize=8)


def show(encoder_dir: str, labels_csv: str, out: str, cli: Config, vs_random: bool = True) -> None:
    """PNG of one labelled volume of each class: input, PCA colours of the patch features and an attentive probe's
    attention, on a B-scan and en face, for the export and (vs_random) a random init of its architecture. The
    B-scan is the middle one of the token slab that the export's probe attends to most."""
    encoder = load_encoder(encoder_dir)
    cfg = replace(encoder.settings, **{k: getattr(cli, k) for k in CLI_FIELDS["show"]})
    device = probe_device(cfg)
    volumes, values, skipped = load_labelled_volumes(cfg, labels_csv)
    labels, classes = task_targets(Task("label"), values["label"], labels_csv)
    if skipped:
        print(f"skipped unusable files: {skipped}", file=sys.stderr)
    shown = [int(np.flatnonzero(labels == c)[0]) for c in range(len(classes))]  # the first volume of each class
    arms = {"pretrained": encoder, "random init": random_encoder(encoder.config, cfg.seed)} if vs_random \
        else {"encoder": encoder}
    looked = {arm: looks(e, volumes, labels, shown, device) for arm, e in arms.items()}
    titles = ["input B-scan", "features (PCA 1-3 as RGB)", "attentive probe's attention", "input en face",
              "features en face (PCA)", "attention en face"]
    fig = Figure(figsize=(14, 2.1 * len(shown) * len(arms) + 0.6))
    axes = fig.subplots(len(shown) * len(arms), len(titles), squeeze=False)
    for ax, title in zip(axes[0], titles):
        ax.set_title(title, fontsize=10)
    for i, s in enumerate(shown):
        slab = int(looked[next(iter(arms))]["attention"][i].sum((1, 2)).argmax())
        for j, (arm, look) in enumerate(looked.items()):
            row = axes[i * len(arms) + j]
            draw_volume_row(row, volumes[s, 0].numpy(), look, i, slab, encoder.settings.patch_size[0])
            row[0].set_ylabel(f"{arm}\n{classes[labels[s]]}, p={look['prob'][i]:.2f}", fontsize=9)
    fig.suptitle(f"{encoder_dir}: one volume per class of {len(labels)} labelled "
                 f"volumes; p = the probe's held-out probability of its class", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------

@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="encoder.py")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a checkpoint's EMA encoder as safetensors + config.json")
    ex.add_argument("--ckpt", required=True, help="a train.py checkpoint, or a run's checkpoints folder (newest step)")
    ex.add_argument("--out", required=True, help="the export folder")
    ex.add_argument("--force", action="store_true", help="replace an export already in --out")
    em = commands.add_parser("embed", help="one embedding per volume of a folder, manifest or gs:// prefix")
    em.add_argument("--encoder", required=True, help="an export folder")
    em.add_argument("--out", required=True, help="the .npz to write (OUT.partial/ holds the rows done so far)")
    em.add_argument("--pool", default="mean", choices=POOLS, help="mean: [E]; axial: each depth row's mean [gh*E]")
    em.add_argument("--batch_size", type=int, default=8, help="volumes per forward pass (default 8)")
    em.add_argument("--save_every", type=int, default=256, help="save the rows done every N volumes (default 256)")
    em.add_argument("--with_paths", action="store_true", help="add each volume's path, StudyInstanceUID and "
                    "SeriesInstanceUID (a table for this machine only: docs/privacy.md)")
    sh = commands.add_parser("show", help="PNG: PCA of the patch features and an attentive probe's attention")
    sh.add_argument("--encoder", required=True, help="an export folder")
    sh.add_argument("--labels", required=True, help="labels CSV (path,label) whose volumes fit the PCA and the probe")
    sh.add_argument("--out", required=True, help="the PNG to write")
    sh.add_argument("--no_random", action="store_true", help="leave out the random init of the architecture")
    args, rest = parser.parse(argv)
    other = sorted(given_flags(rest) - set(CLI_FIELDS[args.command]))
    if other:
        allowed = ", ".join(f"--{f}" for f in CLI_FIELDS[args.command]) or "none"
        raise ConfigError(f"{', '.join('--' + o for o in other)}: the export brings its own model and preprocessing; "
                          f"the config flags that `{args.command}` takes: {allowed}.")
    cli = load_config(rest)
    if args.command == "export":
        error = export(args.ckpt, args.out, args.force)
        print(f"exported the EMA encoder of {resolve_checkpoint(args.ckpt)} to {args.out} (config.json, "
              f"encoder.safetensors); round trip: largest |difference| of the loaded tokens {error:.1g}")
    elif args.command == "embed":
        if args.batch_size < 1 or args.save_every < 1:
            parser.error("--batch_size and --save_every must be at least 1")
        table, computed = embed(args.encoder, args.out, cli, args.pool, args.batch_size, args.save_every,
                                args.with_paths)
        print(f"{len(table['volume'])} volumes embedded in {args.out} ({table['embedding'].shape[1]} numbers each, "
              f"{computed} computed now)")
        if len(table["skipped_reason"]):
            print(f"{len(table['skipped_reason'])} files or volumes skipped:\n"
                  f"{format_reason_table(Counter(table['skipped_reason'].tolist()))}")
    else:
        show(args.encoder, args.labels, args.out, cli, vs_random=not args.no_random)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
