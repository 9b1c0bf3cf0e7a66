"""Where the training update runs and what survives it: devices, processes, SPMD/DDP setup, host<->device
transfers, XLA counters, and checkpoints (files on local disk or gs:// through storage.py, their content, resume and
restore).

train.py runs the loop on these; probe.py and bench.py use them without importing the loop. Nothing here knows
the model or the loss.
"""
import atexit
import gc
import hashlib
import io
import json
import os
import random
import re
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Tuple

import numpy as np
import torch

from config import Config, ConfigError, RunPlan, plan_run
from storage import glob_paths, read_bytes, remove, write_atomic


# ----------------------------------------------------------------------------------------------------------
# Devices and processes
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Runtime:
    """The devices and processes of this run, as setup_runtime found them."""
    device: torch.device
    kind: str  # cpu | cuda | xla
    world_size: int  # data-parallel replicas (DDP processes, or XLA devices)
    process_index: int
    process_count: int
    local_replicas: int  # replicas fed by this process (XLA SPMD: its devices; DDP: 1)
    mesh: object = None  # XLA SPMD: 1-D device mesh with the axis 'data'
    multi_host: bool = False  # processes on more than one machine (they share no local disk)

    @property
    def is_master(self) -> bool:
        """The process that writes logs and checkpoints."""
        return self.process_index == 0

    @property
    def ddp(self) -> bool:
        """Several DDP processes: a torch.distributed process group joins them."""
        return self.kind != "xla" and self.world_size > 1


def setup_runtime(cfg: Config) -> Runtime:
    """Pick the device (device_kind) and join the process group if any."""
    kind = device_kind(cfg)
    if kind == "xla":
        return _setup_xla()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        torch.distributed.init_process_group("nccl" if kind == "cuda" else "gloo")
        atexit.register(leave_process_group)
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: processes on this machine
    return Runtime(device, kind, world, rank, world, 1, multi_host=local_world < world)


def device_kind(cfg: Config, xla: bool = True) -> str:
    """cpu | cuda | xla: cfg.device, where auto is xla if configured (and `xla` allows it), else cuda if torch sees
    a GPU, else cpu. ConfigError for cuda without a CUDA device."""
    kind = cfg.device
    if kind == "auto":
        kind = "xla" if xla and _xla_configured() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but torch sees no CUDA device; use --device cpu or auto.")
    return kind


def leave_process_group() -> None:
    """Leave the DDP process group while the interpreter is still whole (setup_runtime registers this to run at
    exit). Gloo's worker threads free a finished collective's tensors, which needs the GIL: left to interpreter
    teardown, a thread still doing so aborts the process (SIGABRT, "terminate called without an active exception"),
    and torchrun reports that signal instead of the exit code the run chose. The collection first frees the DDP
    wrapper, so the process group's last owner is torch's own, which waits for those threads without the GIL."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()


def _xla_configured() -> bool:
    if not os.environ.get("PJRT_DEVICE"):
        return False
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def _setup_xla() -> Runtime:
    """SPMD data parallel: this process drives all of its host's devices; one 1-D 'data' mesh spans every device
    of every host (one CPU device, CPU_NUM_DEVICES CPU devices, a TPU VM or all hosts of a pod)."""
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
    except ImportError as e:
        raise ConfigError(f"device: xla needs torch_xla ({e}); install requirements-xla.txt or use --device cpu.")
    xr.use_spmd()  # before any XLA tensor exists
    devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(devices), (devices,), ("data",))
    return Runtime(torch_xla.device(), "xla", devices, xr.process_index(), xr.process_count(),
                   xr.addressable_runtime_device_count(), mesh, multi_host=xr.process_count() > 1)


def reduce_mean(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Mean of a tensor over DDP processes (XLA SPMD tensors are already global)."""
    if rt.ddp:
        value = value.clone()
        torch.distributed.all_reduce(value)
        value /= rt.world_size
    return value


def gather_objects(obj, rt: Runtime) -> list:
    """[obj of process 0, obj of process 1, ...] in every DDP process; [obj] elsewhere."""
    if not rt.ddp:
        return [obj]
    out = [None] * rt.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_from_master(obj, rt: Runtime):
    """The master's obj, in every DDP process (obj itself elsewhere)."""
    if not rt.ddp:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def master_decides(rt: Runtime, fn, *args):
    """fn(*args), run by the master only in a DDP run; every process returns its result, or raises its ConfigError
    (so that no rank can decide differently, and none waits for a rank that stopped)."""
    result = error = None
    if rt.is_master or not rt.ddp:
        try:
            result = fn(*args)
        except ConfigError as e:
            error = str(e)
    result, error = broadcast_from_master((result, error), rt)
    if error is not None:
        raise ConfigError(error)
    return result


def probes_in_this_process(rt: Runtime) -> bool:
    """Whether this process computes the probe during pretraining: the master; on XLA every host, since an SPMD
    graph that only one host runs would leave it waiting for the others."""
    return rt.is_master or rt.kind == "xla"


def check_ranks_agree(value, what: str, rt: Runtime) -> None:
    """Stop every DDP process when they hold different `value`s (they would train on different data or weights)."""
    values = gather_objects(value, rt)
    if any(v != values[0] for v in values):
        raise RuntimeError(f"the {len(values)} processes disagree about {what}: "
                           + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))


# ----------------------------------------------------------------------------------------------------------
# Host <-> device
# ----------------------------------------------------------------------------------------------------------

def to_device(batch: dict, rt: Runtime) -> dict:
    """Tensors of a batch on the device. XLA: each host's local batch becomes its part of the global batch,
    sharded over the 'data' mesh axis on the batch dimension (SPMD data parallel)."""
    if rt.kind != "xla":
        return {k: (v.to(rt.device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            spec = xs.ShardingSpec(rt.mesh, ("data",) + (None,) * (value.dim() - 1), minibatch=True)
            (out[key],) = xm.send_cpu_data_to_device([value], rt.device, spec)
    return out


def fetch_to_host(obj, rt: Runtime):
    """A nested list/dict of device tensors as new CPU tensors (XLA: one batched transfer for all of them)."""
    if rt.kind == "xla":
        import torch_xla.core.xla_model as xm
        return xm._maybe_convert_to_cpu(obj)
    return to_cpu(obj)


def xla_counters() -> dict:
    """Cumulative XLA graph compiles and device-to-host transfers (a growing compile count after warm-up means
    something in the step changes shape or is baked in as a constant)."""
    import torch_xla.debug.metrics as met
    compiles, transfers = met.metric_data("CompileTime"), met.metric_data("TransferFromDeviceTime")
    return {"xla_compiles": compiles[0] if compiles else 0, "xla_transfers": transfers[0] if transfers else 0}


class PendingDeviceStats:
    """Per-update statistics still on the device, with host-side notes, until the host reads them. CPU/CUDA read
    them after every update (`read_every_update`); XLA only where the loop needs them anyway (log, validation,
    probe, checkpoint), all in one transfer: a read inside the step would cut the XLA graph, and the NaN guard
    decides there without the host."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.unread: List[Tuple[dict, torch.Tensor]] = []

    @property
    def read_every_update(self) -> bool:
        """Whether the host reads after every update (CPU/CUDA)."""
        return self.rt.kind != "xla"

    def add(self, stats: torch.Tensor, **notes) -> None:
        """Keep one update's 1-d stats tensor and its notes (step, LR, files...) until the next read."""
        self.unread.append((notes, stats))

    def read(self) -> List[Tuple[dict, List[float]]]:
        """(notes, stats as floats) of every update added since the last read, oldest first."""
        values = fetch_to_host([stats for _, stats in self.unread], self.rt)
        read = [(notes, v.tolist()) for (notes, _), v in zip(self.unread, values)]
        self.unread = []
        return read


def mark_step(rt: Runtime) -> None:
    """XLA: cut the traced graph here and launch it (a no-op elsewhere)."""
    if rt.kind == "xla":
        import torch_xla
        torch_xla.sync()


def to_cpu(obj):
    """Copy a (nested) state to CPU tensors, so a checkpoint from CUDA or XLA loads anywhere."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: files, content, the plan a resume continues, the run folder
# ----------------------------------------------------------------------------------------------------------

def list_checkpoints(ckpt_dir: str) -> List[str]:
    """Step checkpoints in ckpt_dir, newest first (temp files of interrupted writes are ignored)."""
    paths = [p for p in glob_paths(ckpt_dir.rstrip("/") + "/step_*.pt") if re.search(r"step_\d+\.pt$", p)]
    return sorted(paths, key=lambda p: int(re.search(r"step_(\d+)\.pt$", p).group(1)), reverse=True)


def read_checkpoint(path: str, tries: int = 1) -> dict:
    """Load a checkpoint (local or gs://) to CPU tensors (weights_only: no code runs on load); a failed read (a
    transient storage error) is tried up to `tries` times in all."""
    for attempt in range(tries):
        try:
            payload = read_bytes(path)
            break
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(2 ** attempt)
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def newest_readable_checkpoint(ckpt_dir: str) -> Tuple[Optional[str], Optional[dict], List[Tuple[str, str]]]:
    """(path, checkpoint) of the newest step checkpoint that loads, or (None, None); plus (path, error) of each
    newer one that did not (a damaged file must not stop a resume: it falls back to the one before)."""
    unreadable = []
    for path in list_checkpoints(ckpt_dir):
        try:
            return path, read_checkpoint(path, tries=2), unreadable
        except Exception as e:
            unreadable.append((path, repr(e)))
    return None, None, unreadable


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    """The step checkpoint of update `step` in ckpt_dir."""
    return f"{ckpt_dir.rstrip('/')}/step_{step:07d}.pt"


def save_checkpoint(path: str, state: dict, keep_last: int, best: bool) -> None:
    """Write the checkpoint atomically (and best.pt beside it), then drop older step files beyond keep_last."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    ckpt_dir = path.rsplit("/", 1)[0]
    write_atomic(path, buffer.getbuffer())
    if best:
        write_atomic(f"{ckpt_dir}/best.pt", buffer.getbuffer())
    for old in list_checkpoints(ckpt_dir)[keep_last:]:
        remove(old)


def rng_state() -> dict:
    """torch, numpy and python RNG states as tensors and plain types (loadable with weights_only)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
            "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss}}


def set_rng_state(state: dict) -> None:
    """Set the torch, numpy and python RNGs to a state of rng_state()."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def checkpoint_state(model: torch.nn.Module, optimizer, state, cfg: Config, rt: Runtime) -> dict:
    """Everything a resume needs (`state`: train.TrainState), as CPU tensors and plain types
    (torch.load(weights_only=True) reads it, on a machine with or without torch_xla)."""
    model_state, optimizer_state = fetch_to_host([model.state_dict(), optimizer.state_dict()], rt)
    for group in optimizer_state["param_groups"]:
        group["lr"] = float(group["lr"])  # a device tensor on XLA
    return {"model": model_state, "optimizer": optimizer_state, "train_state": dict(vars(state)),
            "rng": rng_state(), "config": asdict(cfg), "version": 2}


def restore(ckpt: dict, model: torch.nn.Module, optimizer, state) -> None:
    """Load weights, optimizer, schedule position, data position and RNG states from a checkpoint (written on any
    device: make_optimizer's load hook keeps this device's AdamW implementation flags)."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    for key, value in ckpt["train_state"].items():
        setattr(state, key, value)
    set_rng_state(ckpt["rng"])


# What a resume must find unchanged (incident 2: a changed plan restarts or jumps the schedules).
PLAN_FIELDS = ("total_steps", "warmup_steps", "steps_per_epoch", "global_batch_size", "world_size")
SCHEDULE_FIELDS = ("schedule", "base_lr", "min_lr", "weight_decay", "weight_decay_end", "ema_base", "ema_end",
                   "ema_schedule", "seed")


def split_fingerprint(train_ds, val_ds) -> str:
    """A short hash of which volumes are in the train split and which in the val split."""
    split = [sorted(r["paths"] for r in train_ds.records), sorted(r["paths"] for r in val_ds.records)]
    return hashlib.sha256(json.dumps(split).encode()).hexdigest()[:16]


def plan_record(cfg: Config, plan: RunPlan, train_ds, val_ds) -> dict:
    """The run's plan, schedule settings, data-order seed and train/val split, as stored in its checkpoints."""
    return {**{k: getattr(plan, k) for k in PLAN_FIELDS}, **{k: getattr(cfg, k) for k in SCHEDULE_FIELDS},
            "train_volumes": len(train_ds), "val_volumes": len(val_ds), "split": split_fingerprint(train_ds, val_ds),
            "extensions": plan.extensions}


def resumed_plan(saved: dict, cfg: Config, plan: RunPlan, train_ds, val_ds, step: int, ckpt_path: str) -> RunPlan:
    """The plan a resumed run continues: the checkpoint's, or with cfg.extend the same plan made longer from update
    `step` on. Any other difference is a ConfigError that says what changed and how to proceed."""
    reference = plan_run(replace(cfg, max_steps=saved["total_steps"]), plan.world_size, len(train_ds))
    now = plan_record(cfg, reference, train_ds, val_ds)
    changes = [f"{k}: {saved[k]} -> {now[k]}" for k in now if k != "extensions" and now[k] != saved.get(k)]
    longer = plan.total_steps > saved["total_steps"]
    if plan.total_steps != saved["total_steps"] and not (longer and cfg.extend):
        changes.insert(0, f"total_steps: {saved['total_steps']} -> {plan.total_steps}")
    if changes:
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        raise ConfigError(
            f"resume: {ckpt_path} was written for another plan:\n    " + "\n    ".join(changes) +
            "\nA resume continues the plan it was started with (a changed plan would restart or jump the LR, EMA and "
            f"data order). To continue this run: use its settings (--config {run_dir}/config.yaml --resume auto)."
            + (" To train longer on purpose: add --extend true (the LR, weight decay and EMA continue from their "
               "last values, never back up)." if longer and not cfg.extend and len(changes) == 1 else "")
            + " To train with the new settings: start a new run (another --run_name).")
    extensions = list(saved["extensions"])
    if longer:
        extensions.append([step, saved["total_steps"], plan.total_steps])
    return replace(reference, total_steps=plan.total_steps, extensions=extensions)


def load_resume_checkpoint(cfg: Config, rt: Runtime) -> Tuple[Optional[str], Optional[dict], list]:
    """(path, checkpoint) that this run resumes from, or (None, None); plus (path, error) of newer unreadable files.
    The master chooses; every process loads that same file (retrying a transient read error) or every one stops."""
    path, ckpt, unreadable = None, None, []
    if rt.is_master or not rt.ddp:
        if cfg.resume == "auto":
            path, ckpt, unreadable = newest_readable_checkpoint(cfg.ckpt_dir)
        else:
            path = cfg.resume
    path = broadcast_from_master(path, rt)
    error = None
    if path is not None and ckpt is None:
        try:
            ckpt = read_checkpoint(path, tries=3)
        except Exception as e:
            error = repr(e)
    failed = [f"process {rank}: {e}" for rank, e in enumerate(gather_objects(error, rt)) if e is not None]
    if failed:
        raise ConfigError(f"resume: {path} could not be read ({'; '.join(failed)}). Every process must start from "
                          f"the same checkpoint, so none trains; check the path and retry.")
    return path, ckpt, unreadable


def resolve_run_dir(cfg: Config) -> Config:
    """Fill run_name and ckpt_dir 'auto'; refuse to overwrite checkpoints of an earlier run by accident."""
    if cfg.resume == "auto" and cfg.run_name is None:
        raise ConfigError("resume: 'auto' continues the run named by --run_name; give --run_name.")
    run_name = cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    ckpt_dir = os.path.join(cfg.out_dir, run_name, "checkpoints") if cfg.ckpt_dir == "auto" else cfg.ckpt_dir
    cfg = replace(cfg, run_name=run_name, ckpt_dir=ckpt_dir)
    if cfg.resume == "auto" and ckpt_dir is None:
        raise ConfigError("resume: 'auto' needs checkpoints, but ckpt_dir is null.")
    if cfg.resume is None and ckpt_dir is not None and not cfg.dry_run and list_checkpoints(ckpt_dir):
        raise ConfigError(f"run_name: {ckpt_dir} already holds checkpoints of an earlier run; pass --resume auto "
                          f"to continue it or choose another --run_name.")
    return cfg


def check_checkpoints_are_shared(cfg: Config, rt: Runtime) -> None:
    """Every process of a multi-machine run must resume from the same files: ckpt_dir on gs://, or (DDP) a local
    path declared shared with ckpt_dir_shared, which every process must then see."""
    if not rt.multi_host or cfg.ckpt_dir is None or cfg.ckpt_dir.startswith("gs://"):
        return
    if rt.kind == "xla" or not cfg.ckpt_dir_shared:
        shared_flag = "" if rt.kind == "xla" else ", or add --ckpt_dir_shared true if every machine mounts it"
        raise ConfigError(f"ckpt_dir: {cfg.ckpt_dir} is local to each machine, but the processes of this run are on "
                          f"several machines and must all resume from the same checkpoint; use a gs:// ckpt_dir"
                          f"{shared_flag}.")
    marker = master_decides(rt, write_shared_marker, cfg.ckpt_dir)
    blind = [rank for rank, seen in enumerate(gather_objects(os.path.exists(marker), rt)) if not seen]
    if rt.is_master:
        os.remove(marker)
    if blind:
        raise ConfigError(f"ckpt_dir_shared: processes {blind} cannot see {marker}, written by process 0: "
                          f"{cfg.ckpt_dir} is not shared by every machine; use a gs:// ckpt_dir or a filesystem that "
                          f"all of them mount.")


def write_shared_marker(ckpt_dir: str) -> str:
    """An empty file with a unique name in ckpt_dir, for the other processes to look for."""
    os.makedirs(ckpt_dir, exist_ok=True)
    marker = os.path.join(ckpt_dir, f".shared-check-{uuid.uuid4().hex}")
    open(marker, "w").close()
    return marker
