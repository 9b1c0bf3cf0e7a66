"""Checkpoints and the run folder: the checkpoint file (local or gs://, through storage.py) and its
content, the resume timeline (which file a resume continues from; a file is set aside only when
shown to be damaged, and a run never starts from scratch over its own history unless told to, which
moves it aside), restore, the plan and settings a resume continues, and the run folder (its lock:
lock.py).

train.py calls these; probe.py and encoder.py read a trained model with read_model_checkpoint.
runtime.py gives the devices, processes and collectives they run on.
"""

import contextlib
import difflib
import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import time
import uuid
import zipfile
from dataclasses import asdict, replace
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from config import (
    Config,
    ConfigError,
    ExitError,
    RunPlan,
    StorageFailed,
    load_config,
    plan_run,
    without_removed_fields,
)
from model import VJEPA3D
from privacy import KEY_FILE_ENV, key_fingerprint, patient_key_file
from lock import LOCK_NAME, fenced, lease_lost, lease_metadata, stale_commits, stop_if_taken_over
from runtime import (
    Runtime,
    any_process,
    broadcast_from_master,
    gather_objects,
    master_decides,
    place_model_state,
    place_optimizer_state,
    state_to_host,
)
from storage import (
    Fenced,
    copy_atomic,
    exists,
    gcs_filesystem,
    glob_paths,
    is_transient,
    open_atomic,
    read_bytes,
    remove,
    remove_stale_tmp,
    rename,
    retry,
    storage_errors,
    write_atomic,
)


def step_of(path: str) -> int:
    """The update number in a step checkpoint's name (step_0000050.pt -> 50)."""
    return int(re.search(r"step_(\d+)\.pt$", path).group(1))


def list_checkpoints(ckpt_dir: str) -> List[str]:
    """Step checkpoints in ckpt_dir, newest first (temp files of interrupted writes, set-aside files
    and, on gs://, a stalled holder's commits after a takeover ignored: lock.stale_commits)."""
    stale = stale_commits(ckpt_dir)
    paths = [
        p
        for p in glob_paths(ckpt_dir.rstrip("/") + "/step_*.pt")
        if re.search(r"step_\d+\.pt$", p) and p not in stale
    ]
    return sorted(paths, key=step_of, reverse=True)


class UnreadableCheckpoint(Exception):
    """A checkpoint shown to be damaged: not a whole zip file, a part whose checksum does not match,
    or no 'model'."""


class CheckpointNotLoaded(StorageFailed):
    """A checkpoint that may be intact did not load (too little memory, a type this version refuses,
    a storage error): the run stops and renames nothing."""

    prefix = "checkpoint not loaded: "


def read_checkpoint(path: str, retry_seconds: float = 0.0) -> dict:
    """Load a checkpoint (local or gs://) to CPU tensors (weights_only: no code runs on load); a
    local file is mapped, not copied (each process holds it once). A failed load first asks the file
    whether it is damaged (checkpoint_damage: a truncated copy is damage, not a storage error to
    wait for): UnreadableCheckpoint. Else a transient storage error is retried for retry_seconds,
    then raised; any other failure is CheckpointNotLoaded (exit 74) or, for a type this version
    refuses or a format newer than it knows, ConfigError (exit 2)."""
    ckpt = retry(_load_or_diagnose, path, seconds=retry_seconds)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UnreadableCheckpoint(f"{path}: not an octjepa checkpoint (no 'model')")
    if ckpt.get("version", 1) > CHECKPOINT_VERSION:
        raise ConfigError(
            f"checkpoint: {path} has format {ckpt['version']}, newer than this octjepa reads "
            f"(up to {CHECKPOINT_VERSION}); read it with the octjepa version that wrote it."
        )
    return ckpt


def _load_or_diagnose(path: str) -> dict:
    try:
        return load_file(path)
    # torch.load raises many types: only the file itself can say whether it is damaged
    except Exception as e:
        if out_of_memory(e):
            raise load_failure(path, e) from None
        # a storage error here is raised (and retried when transient)
        damage = checkpoint_damage(path)
        if damage:
            raise UnreadableCheckpoint(
                f"{path}: {damage} ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        if isinstance(e, storage_errors()):
            raise
        raise load_failure(path, e) from None


def load_file(path: str) -> dict:
    """torch.load of a checkpoint file (weights_only) to the CPU: a local file mapped, a gs://
    object downloaded."""
    if path.startswith("gs://"):
        return torch.load(io.BytesIO(read_bytes(path)), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def checkpoint_damage(path: str) -> Optional[str]:
    """What shows a checkpoint file damaged (torch.save writes a zip whose parts carry a CRC-32):
    not a whole zip, or the first part whose content does not match its checksum, or a folder where
    the file should be; None when every part is as written. A storage error while opening or reading
    it is raised (it says nothing about the file)."""
    if not path.startswith("gs://") and os.path.isdir(path):
        return "damaged: a folder, not a checkpoint file"
    with gcs_filesystem().open(path, "rb") if path.startswith("gs://") else open(path, "rb") as f:
        try:
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError) as e:
            return f"damaged: not a whole checkpoint file ({e})"
        # a seek the zip's own offsets send before the start: a cut file
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) and e.errno != errno.EINVAL:
                raise
            return f"damaged: not a whole checkpoint file (its zip offsets point outside it: {e})"
    return f"damaged: its part {bad} does not match its checksum" if bad else None


def out_of_memory(error: Exception) -> bool:
    """Whether an error says memory (or address space) ran out: MemoryError, ENOMEM, or torch's
    allocator."""
    return (
        isinstance(error, MemoryError)
        or getattr(error, "errno", None) == errno.ENOMEM
        or "allocate memory" in str(error).lower()
    )


def load_failure(path: str, error: Exception) -> ExitError:
    """The error that stops a run whose checkpoint is intact but did not load, saying why and what
    to do."""
    # in torch's long text
    refused = re.search(r"Unsupported global: .*|WeightsUnpickler error: .+", str(error))
    what = (
        f"{path} is intact (every part matches its checksum) but did not load"
        f" ({type(error).__name__}: {refused.group(0) if refused else str(error)[:300]})"
    )
    if isinstance(error, pickle.UnpicklingError):
        return ConfigError(
            f"resume: {what}: it holds a type this version of octjepa/torch refuses to load without"
            " running code. Nothing was renamed. Load it with the version that wrote it, or resume"
            " from another checkpoint (--resume PATH)."
        )
    if out_of_memory(error):
        return CheckpointNotLoaded(
            f"{what}: too little memory. Nothing was renamed; run the same command again "
            "with more memory (a higher ulimit -v or job memory limit)."
        )
    return CheckpointNotLoaded(
        f"{what}. Nothing was renamed; run the same command again once this is fixed."
    )


def resolve_checkpoint(ckpt: str) -> str:
    """A run's checkpoints folder -> its newest step checkpoint (a not-found path when it has none);
    any other path as it is."""
    if os.path.isdir(ckpt):
        return (list_checkpoints(ckpt) or [os.path.join(ckpt, "step_*.pt")])[0]
    return ckpt


def read_model_checkpoint(ckpt: str) -> Tuple[VJEPA3D, Config, dict]:
    """(model, its config, the whole checkpoint) of a train.py checkpoint file (local or gs://), for
    the commands that use a trained model (probe.py, encoder.py export). Raises ConfigError, naming
    the fix, for a missing or incompatible checkpoint."""
    fix = (
        "pass a checkpoint written by train.py (OUT_DIR/RUN_NAME/checkpoints/best.pt or step_*.pt)"
        " or --ckpt random"
    )
    try:
        state = read_checkpoint(ckpt)
    except FileNotFoundError:
        raise ConfigError(f"ckpt: {ckpt} not found; {fix}.") from None
    except ExitError:
        raise
    # torch.load raises many types for a file that is not a weights-only checkpoint
    except Exception as e:
        raise ConfigError(
            f"ckpt: {ckpt} is not a readable checkpoint ({type(e).__name__}: {e}); {fix}."
        ) from None
    if not isinstance(state, dict) or not {"model", "config"} <= set(state):
        raise ConfigError(f"ckpt: {ckpt} has no 'model' and 'config' entries; {fix}.")
    try:
        ckpt_cfg = load_config([], **state["config"])
        model = VJEPA3D.from_config(ckpt_cfg)
        model.load_state_dict(state["model"])
    except (ConfigError, RuntimeError, TypeError) as e:
        raise ConfigError(
            f"ckpt: {ckpt} does not fit this version of config.py/model.py ({e}); read it with the "
            "octjepa version that wrote it."
        ) from None
    return model, ckpt_cfg, state


# 2: + plan and config; 3: + the plan's patient_keys (the key file's fingerprint)
CHECKPOINT_VERSION = 3


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    """The step checkpoint of update `step` in ckpt_dir."""
    return f"{ckpt_dir.rstrip('/')}/step_{step:07d}.pt"


def save_checkpoint(
    path: str,
    state: dict,
    keep_last: int,
    best: bool,
    retry_seconds: float = 0.0,
    on_error: Optional[Callable[[Exception, float], None]] = None,
    fence: Optional[Callable] = None,
) -> None:
    """Stream the checkpoint into its file or object atomically (and copy it to best.pt beside it),
    retrying a transient storage error for retry_seconds (on_error is told of each); then delete the
    step checkpoints older than it beyond keep_last. Never it, nor a newer one: the newest
    checkpoint is always the one just written. With `fence` (lock.fenced) each file is committed,
    and the old ones deleted, only while this process holds the run folder: storage.Fenced
    otherwise."""
    ckpt_dir = path.rsplit("/", 1)[0]
    retry(_write_checkpoint, path, state, fence, seconds=retry_seconds, on_error=on_error)
    if best:
        retry(
            copy_atomic,
            path,
            f"{ckpt_dir}/best.pt",
            fence,
            seconds=retry_seconds,
            on_error=on_error,
        )
    older = [p for p in list_checkpoints(ckpt_dir) if step_of(p) < step_of(path)]
    with contextlib.suppress(*storage_errors()), fence() if fence else contextlib.nullcontext():
        # a file left over is deleted by the next checkpoint's pass
        for old in older[keep_last - 1 :]:
            remove(old)


def checkpoint_everywhere(
    path: str,
    model: torch.nn.Module,
    optimizer,
    state,
    plan: dict,
    cfg: Config,
    rt: Runtime,
    best: bool,
    on_error: Optional[Callable[[Exception, float], None]] = None,
) -> Optional[str]:
    """Checkpoint the current update (`state`: train.TrainState; `plan`: the plan record) to `path`,
    with save_checkpoint's retries for ckpt_retry_minutes. The master builds the state and writes it
    (on XLA every host takes part in fetching it, and every FSDP2 process in gathering it: a sharded
    array needs them all); then every process learns how that went, so none rolls back to a file not
    written yet. Returns the write's last error (repr, and whether it was retried) or None, the same
    in every process. Every process stops (ConfigError) when the master's run-folder lock was taken
    over by another process, before the write or at its commit (lock.fenced): it never writes over
    the new holder's files."""
    stop_if_taken_over(any_process([rt.is_master and lease_lost(read=True)], rt)[0])
    error, lost = None, False
    if rt.is_master or rt.kind == "xla" or rt.sharded:
        ckpt = {**checkpoint_state(model, optimizer, state, cfg, rt), "plan": plan}
    if rt.is_master:
        try:
            save_checkpoint(
                path, ckpt, cfg.keep_last, best, 60 * cfg.ckpt_retry_minutes, on_error, fenced
            )
        except Fenced:
            lost = True
        except storage_errors() as e:  # what happened, as the event and the messages say it
            error = (
                f"{e!r}, still failing after retrying for {cfg.ckpt_retry_minutes:g} min"
                if is_transient(e)
                else f"{e!r}, a permanent error (not retried)"
            )
    error, lost = broadcast_from_master((error, lost), rt)
    stop_if_taken_over(lost)
    return error


def _write_checkpoint(path: str, state: dict, fence: Optional[Callable] = None) -> None:
    with open_atomic(path, fence, lease_metadata(path)) as f:
        try:
            torch.save(state, f)
        # torch's zip writer, closed after a failed write, hides the storage's error
        except RuntimeError as e:
            if isinstance(e.__context__, storage_errors()):
                raise e.__context__ from None
            raise


def rng_state() -> dict:
    """torch, numpy and python RNG states as tensors and plain types (loadable with
    weights_only)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }


def set_rng_state(state: dict) -> None:
    """Set the torch, numpy and python RNGs to a state of rng_state()."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def checkpoint_state(model: torch.nn.Module, optimizer, state, cfg: Config, rt: Runtime) -> dict:
    """Everything a resume needs (`state`: train.TrainState), as CPU tensors and plain types
    (torch.load(weights_only=True) reads it, on a machine with or without torch_xla)."""
    model_state, optimizer_state = state_to_host([model.state_dict(), optimizer.state_dict()], rt)
    for group in optimizer_state["param_groups"]:
        group["lr"] = float(group["lr"])  # a device tensor on XLA
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "train_state": dict(vars(state)),
        "rng": rng_state(),
        "config": asdict(cfg),
        "version": CHECKPOINT_VERSION,
    }


def restore(ckpt: dict, model: torch.nn.Module, optimizer, state, rt: Runtime, path: str) -> None:
    """Load weights, optimizer, schedule position, data position and RNG states from the checkpoint
    `path` (written on any device, sharded or not: make_optimizer's load hook keeps this device's
    AdamW implementation flags, and a sharded run takes only its shards); a ConfigError when its
    weights are not this model's (check_fits)."""
    check_fits(ckpt, model, path)
    model.load_state_dict(place_model_state(ckpt["model"], model, rt))
    optimizer.load_state_dict(place_optimizer_state(ckpt["optimizer"], optimizer, rt))
    for key, value in ckpt["train_state"].items():
        setattr(state, key, value)
    set_rng_state(ckpt["rng"])


# What a resume must find unchanged (incident 2: a changed plan restarts or jumps the schedules).
# The number of processes is not part of it: each update's global batch is the same set of volumes
# on any number.
PLAN_FIELDS = ("total_steps", "warmup_steps", "steps_per_epoch", "global_batch_size")
SCHEDULE_FIELDS = (
    "schedule",
    "base_lr",
    "min_lr",
    "weight_decay",
    "weight_decay_end",
    "ema_base",
    "ema_end",
    "ema_schedule",
    "seed",
)


# Settings a resume may change: where things are, how the run is watched, and how the same updates
# are computed. Every other setting (model, preprocessing, masks, loss, optimizer; a new field too)
# is what the run learns with, and a change is refused; the plan and schedules are compared on their
# own (PLAN_FIELDS, SCHEDULE_FIELDS). grad_clip and use_bf16 change the updates themselves (their
# size; their precision), so they are refused too.
RESUME_FREE_FIELDS = (
    "data_root",
    "manifest_path",
    "index_path",
    "phantom_dir",
    "phantom_count",
    "phantom_varied",
    "sop_classes",
    "val_fraction",
    "cache_dir",
    "workers",
    "max_bad_fraction",
    "global_batch_size",
    "per_core_batch_size",
    "grad_accum_steps",
    "epochs",
    "max_steps",
    "warmup_steps",
    "warmup_epochs",
    "compile",
    "compile_mode",
    "grad_checkpointing",
    "max_consecutive_nonfinite",
    "max_rollbacks",
    "rollback_lr_factor",
    "log_every_steps",
    "val_every_steps",
    "val_batches",
    "probe_every_steps",
    "probe_labels",
    "summary_probe",
    "collapse_min_target_std",
    "collapse_min_rankme",
    "collapse_window_steps",
    "ckpt_dir",
    "ckpt_every_steps",
    "ckpt_every_minutes",
    "ckpt_retry_minutes",
    "keep_last",
    "resume",
    "extend",
    "extend_schedule",
    "ckpt_dir_shared",
    "wandb",
    "wandb_project",
    "wandb_entity",
    "device",
    "shard",
    "fsdp_size",
    "out_dir",
    "run_name",
    "dry_run",
)


def changed_settings(saved_config: dict, cfg: Config) -> List[str]:
    """'field: saved -> now' for each model, preprocessing, mask, loss or optimizer setting that
    differs from the checkpoint's config (a field the checkpoint does not know counts as changed
    only from a non-default value)."""
    # active ones: their patch
    saved_config = without_removed_fields(saved_config, "resume: the checkpoint's ")
    now, default = asdict(cfg), asdict(Config())
    skip = set(RESUME_FREE_FIELDS) | set(PLAN_FIELDS) | set(SCHEDULE_FIELDS)
    return (
        [
            f"{k}: {saved_config.get(k, default[k])} -> {now[k]}"
            for k in now
            if k not in skip and now[k] != saved_config.get(k, default[k])
        ]
        if saved_config
        else []
    )


def split_fingerprint(train_ds, val_ds) -> str:
    """A short hash of which volumes are in the train split and which in the val split, by their
    paths below the folder all of them share (the same data moved to another root keeps it)."""
    return _fingerprint(train_ds, val_ds, relative=True)


def _fingerprint(train_ds, val_ds, relative: bool) -> str:
    paths = [p for ds in (train_ds, val_ds) for r in ds.records for p in r["paths"]]
    root = os.path.commonprefix(paths).rpartition("/")[0] if relative and paths else ""
    split = [
        sorted([p[len(root) :] for p in r["paths"]] for r in ds.records)
        for ds in (train_ds, val_ds)
    ]
    return hashlib.sha256(json.dumps(split).encode()).hexdigest()[:16]


def plan_record(cfg: Config, plan: RunPlan, train_ds, val_ds) -> dict:
    """The run's plan, schedule settings, data-order seed, train/val split and which patient-key
    secret drew the split (privacy.key_fingerprint), as stored in its checkpoints."""
    return {
        **{k: getattr(plan, k) for k in PLAN_FIELDS},
        **{k: getattr(cfg, k) for k in SCHEDULE_FIELDS},
        "train_volumes": len(train_ds),
        "val_volumes": len(val_ds),
        "split": split_fingerprint(train_ds, val_ds),
        "patient_keys": key_fingerprint(),
        "extensions": plan.extensions,
    }


def resumed_plan(
    saved: dict,
    cfg: Config,
    plan: RunPlan,
    train_ds,
    val_ds,
    step: int,
    ckpt_path: str,
    saved_config: Optional[dict] = None,
) -> RunPlan:
    """The plan a resumed run continues: the checkpoint's, or with cfg.extend the same plan made
    longer from update `step` on. Any other difference, in the plan or in a setting the run learns
    with (changed_settings of the checkpoint's `saved_config`), is a ConfigError that names each
    change and how to proceed."""
    reference = plan_run(
        replace(cfg, max_steps=saved["total_steps"]), plan.world_size, len(train_ds)
    )
    now = plan_record(cfg, reference, train_ds, val_ds)
    if saved.get("split") == _fingerprint(train_ds, val_ds, relative=False):
        # a checkpoint of an older octjepa: the split by absolute paths
        now["split"] = saved["split"]
    changes = [
        f"{k}: {saved[k]} -> {now[k]}"
        for k in now
        if k != "extensions"
        and now[k] != saved.get(k)
        # an older checkpoint records no key fingerprint
        and (k in saved or k != "patient_keys")
    ]
    if any(change.startswith("patient_keys:") for change in changes):
        changes.append(
            f"(the split follows the patient keys: the key file {patient_key_file()} holds another"
            f" secret than the one this run started with; point {KEY_FILE_ENV} at that run's key"
            " file)"
        )
    changes += changed_settings(saved_config or {}, cfg)
    longer = plan.total_steps > saved["total_steps"]
    if plan.total_steps != saved["total_steps"] and not (longer and cfg.extend):
        changes.insert(0, f"total_steps: {saved['total_steps']} -> {plan.total_steps}")
    if changes:
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        raise ConfigError(
            f"resume: {ckpt_path} was written for another plan:\n    "
            + "\n    ".join(changes)
            + "\nA resume continues the plan it was started with (a changed plan would restart or"
            " jump the LR, EMA and data order). The later checkpoints were left in place. To"
            f" continue this run: use its settings (--config {run_dir}/config.yaml --resume"
            f" {cfg.resume or 'auto'}; with --data_root where the data is now, if it moved)."
            + (
                " To train longer on purpose: add --extend true (the LR, weight decay and EMA"
                " continue from their last values, never back up)."
                if longer and not cfg.extend and len(changes) == 1
                else ""
            )
            + " To train with the new settings: start a new run (another --run_name)."
        )
    extensions = list(saved["extensions"])
    if longer:
        rewarm = ["rewarm"] if cfg.extend_schedule == "rewarm" else []
        extensions.append([step, saved["total_steps"], plan.total_steps] + rewarm)
    return replace(reference, total_steps=plan.total_steps, extensions=extensions)


def set_aside(path: str, reason: str, why: str, now: bool = True) -> dict:
    """Rename a step checkpoint out of the run's timeline (list_checkpoints no longer sees it;
    nothing is deleted): step_0000060.pt -> step_0000060.pt.<reason>-<time>. Returns what was done,
    for the console and events.jsonl; now=False: only what would be done ('pending': carry_out
    renames it once the resume was accepted)."""
    moved_to = f"{path}.{reason}-{time.strftime('%Y%m%d-%H%M%S')}"
    if now:
        rename(path, moved_to)
    return {
        "event": f"{reason}_checkpoint",
        "path": path,
        "moved_to": moved_to,
        "why": f"{why}; set aside as {moved_to}",
        **({} if now else {"pending": True}),
    }


def carry_out(moves: List[dict]) -> List[dict]:
    """Rename the files a resume sets aside (choose_resume_checkpoint's pending moves), once every
    check of the resume passed: a refused resume changes nothing. Returns the moves as done."""
    done = []
    for move in moves:
        if move.pop("pending", False):
            try:
                retry(rename, move["path"], move["moved_to"], seconds=60)
            except storage_errors() as e:
                raise StorageFailed(
                    f"resume: {move['path']} could not be set aside as {move['moved_to']} ({e!r}); "
                    f"the files set aside so far: {[m['path'] for m in done if 'moved_to' in m]}. "
                    "Run the same command again when the storage is back."
                ) from None
        done.append(move)
    return done


def choose_resume_checkpoint(cfg: Config) -> Tuple[Optional[str], Optional[dict], List[dict]]:
    """The master's choice of what the run resumes from: (path, checkpoint), or (None, None) to
    start from scratch; plus what it did to the run's files on the way ({event, path, why}). First
    the tmp files of writers stopped mid-write go. resume auto: the newest step checkpoint that
    loads; each newer one shown to be damaged is set aside ('unreadable'). A start from scratch on a
    run folder that holds an earlier run's history (run_history) stops the run (exit 2,
    history_refusal) unless resume is 'restart', or 'auto' where that run never wrote a checkpoint
    (never_checkpointed: killed before its first), which first move that history aside (nothing is
    deleted). Then every step checkpoint past the resumed update, and a best.pt written after it, is
    set aside ('abandoned': a timeline left by resuming an earlier file), so neither a later
    `--resume auto`, keep_last nor a new best overwrites it, and on gs:// so is what a stalled holder
    committed after a takeover ('stale'; other_timelines): only planned here ('pending'), and done
    by carry_out once the checkpoint's plan and weights were accepted (a refused resume changes
    nothing). A checkpoint that may be intact but does not load stops the run with nothing renamed
    (read_checkpoint); a storage error that outlasts ckpt_retry_minutes is StorageFailed, with
    nothing set aside."""
    retry_seconds = cfg.ckpt_retry_minutes * 60
    path, ckpt = None, None
    moved = [
        {
            "event": "stale_tmp_removed",
            "path": tmp,
            "why": "left by a writer stopped mid-write: removed",
        }
        for folder in {os.path.join(cfg.out_dir, cfg.run_name), cfg.ckpt_dir} - {None}
        for tmp in remove_stale_tmp(folder)
    ]
    try:
        if cfg.resume == "auto":
            for candidate in list_checkpoints(cfg.ckpt_dir):
                try:
                    ckpt = read_checkpoint(candidate, retry_seconds)
                except UnreadableCheckpoint as e:
                    moved.append(set_aside(candidate, "unreadable", str(e)))
                    continue
                path = candidate
                break
        elif cfg.resume not in (None, "restart"):
            path = cfg.resume
            ckpt = read_checkpoint(path, retry_seconds)
        if ckpt is None:
            history = run_history(cfg)
            restart = cfg.resume == "restart" or (
                cfg.resume == "auto" and never_checkpointed(cfg, history)
            )
            if history and not restart:
                raise history_refusal(cfg, history)
            # the rest of the folder too (an export): nothing stale stays
            if history or cfg.resume == "restart":
                history += other_run_files(cfg, history)
            moved += move_history_aside(
                cfg,
                history,
                (
                    "--resume restart"
                    if cfg.resume == "restart"
                    else (
                        "--resume auto and the earlier run never wrote a checkpoint (stopped before"
                        " its first)"
                    )
                ),
            )
            return None, None, moved
        check_resumable(path, ckpt)
        if cfg.ckpt_dir is not None:
            moved += other_timelines(cfg.ckpt_dir, path, ckpt["train_state"]["step"], retry_seconds)
    except FileNotFoundError as e:
        raise ConfigError(
            f"resume: {cfg.resume} is not a checkpoint file ({e}); give the path of a step_*.pt or "
            "best.pt, or auto."
        ) from None
    except UnreadableCheckpoint as e:
        raise ConfigError(
            f"resume: {e}; choose another checkpoint (or auto: the newest that loads)."
        ) from None
    except storage_errors() as e:
        raise StorageFailed(
            f"resume: the checkpoints in {cfg.ckpt_dir or cfg.resume} could not be read for "
            f"{cfg.ckpt_retry_minutes:g} min ({e!r}); nothing was changed: run the same command "
            "again when the storage is back."
        ) from None
    return path, ckpt, moved


def other_timelines(ckpt_dir: str, path: str, step: int, retry_seconds: float) -> List[dict]:
    """The files of ckpt_dir that a run resuming `path` (at update `step`) sets aside, as pending
    moves (set_aside): on gs://, what a stalled holder committed after a takeover ('stale':
    lock.stale_commits); every step checkpoint past `step`, and a best.pt written after it
    ('abandoned': a timeline left by resuming an earlier file)."""
    moves = [
        set_aside(stale, "stale", why, now=False)
        for stale, why in sorted(stale_commits(ckpt_dir).items())
        if stale != path and re.search(r"(step_\d+|best)\.pt$", stale)
    ]
    for later in list_checkpoints(ckpt_dir):
        if step_of(later) > step and later != path:
            moves.append(
                set_aside(later, "abandoned", f"past update {step}, where this run resumes", False)
            )
    best = f"{ckpt_dir.rstrip('/')}/best.pt"
    if best not in {path, *(m["path"] for m in moves)} and best_step(best, retry_seconds) > step:
        moves.append(
            set_aside(
                best, "abandoned", f"written after update {step}, where this run resumes", False
            )
        )
    return moves


def check_resumable(path: str, ckpt: dict) -> None:
    """A ConfigError naming what is missing when a checkpoint that loaded holds no training state to
    continue (a file written by another tool, or edited)."""
    missing = [k for k in ("model", "optimizer", "train_state", "rng") if k not in ckpt]
    if missing or not isinstance(ckpt["train_state"], dict) or "step" not in ckpt["train_state"]:
        raise ConfigError(
            f"resume: {path} is not a training checkpoint of train.py: it has no"
            f" {', '.join(repr(k) for k in missing) or 'train_state step'} (it holds"
            f" {', '.join(sorted(map(str, ckpt)))}). Nothing was renamed; resume from a step_*.pt"
            " that train.py wrote (--resume PATH), or move this file out of the checkpoints"
            " folder."
        )


def check_fits(ckpt: dict, model: torch.nn.Module, path: str) -> None:
    """A ConfigError naming the keys when a checkpoint's weights are not those of `model` (tensors
    it lacks or has besides): a file edited, or written by another version of model.py."""
    saved, expected = set(ckpt["model"]), set(model.state_dict())
    if saved != expected:
        extra, missing = sorted(saved - expected), sorted(expected - saved)
        raise ConfigError(
            f"resume: {path} does not fit this model: "
            + "; ".join(
                f"{what} {', '.join(keys[:5])}"
                + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
                for what, keys in (("it has the extra weights", extra), ("it lacks", missing))
                if keys
            )
            + ". Nothing was renamed; resume it with the octjepa version that wrote it, or from"
            " another checkpoint."
        )


# in out_dir/run_name
HISTORY_FILES = ("metrics.jsonl", "events.jsonl", "config.yaml", "wandb_id", "training.png")


def run_history(cfg: Config) -> List[str]:
    """What a run folder holds of an earlier run (a start from scratch would empty or overwrite it):
    its logs and config (HISTORY_FILES), and in ckpt_dir best.pt and every step checkpoint, also
    those set aside; oldest kind first."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    found = [
        os.path.join(run_dir, name)
        for name in HISTORY_FILES
        if os.path.exists(os.path.join(run_dir, name))
    ]
    if cfg.ckpt_dir is not None:
        # a local folder of that name holds no checkpoint
        for pattern in ("best.pt*", "step_*.pt*"):
            found += [
                p
                for p in sorted(glob_paths(f"{cfg.ckpt_dir.rstrip('/')}/{pattern}"))
                if not os.path.isdir(p)
            ]
    return found


def history_refusal(cfg: Config, history: List[str]) -> ConfigError:
    """The error that stops a start from scratch on a run folder's history: what was found, and the
    flags that continue the run or start it over on purpose."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    lines = []
    for path in history[:12]:
        what = os.path.relpath(path, run_dir) if not path.startswith("gs://") else path
        if path.endswith("metrics.jsonl"):
            what += last_logged_update(path)
        elif re.search(r"\.pt\.\w+-\d{8}-\d{6}$", path):
            what += ": set aside (" + path.rsplit(".", 1)[1].split("-")[0] + ")"
        lines.append(what)
    lines += [f"... and {len(history) - 12} more"] if len(history) > 12 else []
    # no --resume: the run's checkpoints are there
    if any(re.search(r"step_\d+\.pt$", p) for p in history):
        lead, continue_with = (
            f"run_name: {run_dir} holds an earlier run with its step checkpoints",
            ["--resume auto"],
        )
    else:
        lead = (
            f"resume: {run_dir} holds the history of an earlier run but no step checkpoint to"
            f" continue it from (ckpt_dir {cfg.ckpt_dir})"
        )
        earlier_ckpt_dir = saved_ckpt_dir(run_dir)
        continue_with = [
            "--resume auto with --ckpt_dir where its step checkpoints are"
            + (
                f" (its config.yaml says --ckpt_dir {earlier_ckpt_dir})"
                if earlier_ckpt_dir not in (None, cfg.ckpt_dir)
                else ""
            )
        ]
        if cfg.ckpt_dir is not None and any(p.endswith("/best.pt") for p in history):
            continue_with.append(
                f"--resume {cfg.ckpt_dir.rstrip('/')}/best.pt (from the update it was written at)"
            )
    return ConfigError(
        f"{lead}:\n    "
        + "\n    ".join(lines)
        + "\nA run never starts over on its own history by itself. To continue it:"
        f" {', or '.join(continue_with)}. To start it over on purpose: --resume restart (the"
        " history is moved into a restarted-<time> folder beside it; nothing is deleted). Or"
        " choose another --run_name."
    )


def last_logged_update(metrics_path: str) -> str:
    """' (up to update N)' of a metrics.jsonl's last whole line; '' when it has none."""
    for line in reversed(read_bytes(metrics_path).splitlines()):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return f" (up to update {json.loads(line)['step']})"
    return ""


def saved_ckpt_dir(run_dir: str) -> Optional[str]:
    """The ckpt_dir that a run folder's config.yaml names (None when it has none or it does not
    read)."""
    try:
        return load_config(["--config", os.path.join(run_dir, "config.yaml")]).ckpt_dir
    except (ExitError, OSError):
        return None


def other_run_files(cfg: Config, history: List[str]) -> List[str]:
    """What else a local run folder holds besides its history (an export, pictures, notes), for a
    start over to move aside with it: all but the lock, earlier restarted-* folders and the
    checkpoints folder."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if run_dir.startswith("gs://") or not os.path.isdir(run_dir):
        return []
    ckpt_dir = (
        os.path.abspath(cfg.ckpt_dir)
        if cfg.ckpt_dir and not cfg.ckpt_dir.startswith("gs://")
        else None
    )
    return [
        os.path.join(run_dir, name)
        for name in sorted(os.listdir(run_dir))
        if not name.startswith((LOCK_NAME, "restarted-"))
        and os.path.join(run_dir, name) not in history
        and os.path.abspath(os.path.join(run_dir, name)) != ckpt_dir
    ]


def never_checkpointed(cfg: Config, history: List[str]) -> bool:
    """Whether the earlier run of a run folder stopped before its first checkpoint (a kill, an OOM):
    its history holds no checkpoint file, set aside or not, its events.jsonl logs no checkpoint, and
    its config.yaml names this ckpt_dir (a relaunch that forgot its --ckpt_dir is refused instead).
    `--resume auto` then starts it over."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    if any(re.search(r"/(best|step_\d+)\.pt", p) for p in history) or saved_ckpt_dir(
        run_dir
    ) not in (None, cfg.ckpt_dir):
        return False
    events_path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(events_path):
        return True
    for line in read_bytes(events_path).splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(line).get("event") in ("checkpoint", "checkpoint_failed", "resume"):
                return False
    return True


def move_history_aside(
    cfg: Config, history: List[str], why: str = "--resume restart"
) -> List[dict]:
    """Move a run folder's history (run_history) into restarted-<time>/ beside it (checkpoints: in
    ckpt_dir), for a run started over on purpose; returns what was done, for the console and
    events.jsonl."""
    if not history:
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    moved = []
    for path in history:
        folder = (
            os.path.dirname(path)
            if path.startswith("gs://")
            else os.path.dirname(os.path.abspath(path))
        )
        moved_to = f"{folder}/restarted-{stamp}/{os.path.basename(path)}"
        if not moved_to.startswith("gs://"):
            os.makedirs(os.path.dirname(moved_to), exist_ok=True)
        rename(path, moved_to)
        moved.append(
            {
                "event": "restarted",
                "path": path,
                "moved_to": moved_to,
                "why": f"{why}: {run_dir} starts over; its earlier history moved to {moved_to}",
            }
        )
    return moved


def best_step(best: str, retry_seconds: float) -> int:
    """The update a best.pt was written at; 0 when there is none or it is damaged (the next best
    replaces it)."""
    if not exists(best):
        return 0
    try:
        return read_checkpoint(best, retry_seconds)["train_state"]["step"]
    except UnreadableCheckpoint:
        return 0


def load_resume_checkpoint(
    cfg: Config, rt: Runtime
) -> Tuple[Optional[str], Optional[dict], List[dict]]:
    """(path, checkpoint) that this run resumes from, or (None, None); plus what the master did to
    the run's files (choose_resume_checkpoint). The master chooses
    (choose_resume_checkpoint); every process loads that same file, retrying transient read errors
    for ckpt_retry_minutes, or every process stops with StorageFailed."""
    path = ckpt = error = None
    moved = []
    if rt.is_master:
        try:
            path, ckpt, moved = choose_resume_checkpoint(cfg)
        except ExitError as e:
            error = e
    path, moved, error = broadcast_from_master((path, moved, error), rt)
    if error is not None:
        raise error
    if path is not None and ckpt is None:
        try:
            ckpt = read_checkpoint(path, cfg.ckpt_retry_minutes * 60)
        except (UnreadableCheckpoint, ExitError, *storage_errors()) as e:
            error = repr(e)
    failed = [
        f"process {rank}: {e}" for rank, e in enumerate(gather_objects(error, rt)) if e is not None
    ]
    if failed:
        raise StorageFailed(
            f"resume: {path} could not be read ({'; '.join(failed)}). Every process must start from"
            " the same checkpoint, so none trains; run the same command again when the storage is"
            " back."
        )
    return path, ckpt, moved


def resolve_run_dir(cfg: Config) -> Config:
    """Fill run_name and ckpt_dir 'auto' (a run folder's earlier history is checked under its lock:
    choose_resume_checkpoint); a ConfigError for a resume that is neither auto, restart nor an
    existing file."""
    if cfg.resume == "auto" and cfg.run_name is None:
        raise ConfigError("resume: 'auto' continues the run named by --run_name; give --run_name.")
    run_name = cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    ckpt_dir = (
        os.path.join(cfg.out_dir, run_name, "checkpoints")
        if cfg.ckpt_dir == "auto"
        else cfg.ckpt_dir
    )
    cfg = replace(cfg, run_name=run_name, ckpt_dir=ckpt_dir)
    if cfg.resume == "auto" and ckpt_dir is None:
        raise ConfigError("resume: 'auto' needs checkpoints, but ckpt_dir is null.")
    # a dry run too: before any run
    if cfg.resume not in (None, "auto", "restart") and not exists(cfg.resume):
        close = difflib.get_close_matches(cfg.resume, ["auto", "restart"], n=1)
        raise ConfigError(
            f"resume: {cfg.resume!r} is neither 'auto', 'restart' nor a checkpoint file"
            + (
                f"; did you mean --resume {close[0]}?"
                if close
                else "; give the path of a step_*.pt or best.pt, auto (the newest) or restart."
            )
        )
    return cfg


def check_checkpoint_folder(cfg: Config, rt: Runtime) -> None:
    """Before anything trains: the master writes a small file into ckpt_dir and deletes it again. A
    folder that cannot take it (read-only, no permission, a wrong path) is a ConfigError naming it;
    a storage error that outlasts ckpt_retry_minutes is StorageFailed. Every process of a
    multi-machine run must resume from the same files: ckpt_dir on gs://, or a local path declared
    shared with ckpt_dir_shared, where every process must see that file."""
    if cfg.ckpt_dir is None or cfg.dry_run:  # a dry run writes nothing
        return
    shared = rt.multi_host and not cfg.ckpt_dir.startswith("gs://")
    if shared and not cfg.ckpt_dir_shared:
        raise ConfigError(
            f"ckpt_dir: {cfg.ckpt_dir} is local to each machine, but the processes of this run are"
            " on several machines and must all resume from the same checkpoint; use a gs://"
            " ckpt_dir, or add --ckpt_dir_shared true if every machine mounts it."
        )
    probe = master_decides(rt, write_probe, cfg)
    blind = (
        [rank for rank, seen in enumerate(gather_objects(exists(probe), rt)) if not seen]
        if shared
        else []
    )
    if rt.is_master:
        retry(remove, probe, seconds=cfg.ckpt_retry_minutes * 60)
    if blind:
        raise ConfigError(
            f"ckpt_dir_shared: processes {blind} cannot see {probe}, written by process 0:"
            f" {cfg.ckpt_dir} is not shared by every machine; use a gs:// ckpt_dir or a filesystem"
            " that all of them mount."
        )


def write_probe(cfg: Config) -> str:
    """A small file with a unique name in ckpt_dir (created if missing); its path. ConfigError when
    the folder cannot take it, StorageFailed when the storage stayed unreachable for
    ckpt_retry_minutes."""
    probe = f"{cfg.ckpt_dir.rstrip('/')}/.write-probe-{uuid.uuid4().hex}"
    try:
        retry(write_atomic, probe, b"octjepa", seconds=cfg.ckpt_retry_minutes * 60)
    except storage_errors() as e:
        if is_transient(e):
            raise StorageFailed(
                f"ckpt_dir: {cfg.ckpt_dir} could not be written for {cfg.ckpt_retry_minutes:g} "
                f"min ({e!r}); run the same command again when the storage is back."
            ) from None
        raise ConfigError(
            f"ckpt_dir: cannot write checkpoints to {cfg.ckpt_dir} ({e!r}); make it writable, or "
            "choose another --ckpt_dir (none: no checkpoints)."
        ) from None
    return probe
