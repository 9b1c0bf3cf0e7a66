"""Train a 3D V-JEPA on OCT volumes. The loop is spelled out top to bottom in main().

    python train.py                                   # the built-in demo (phantoms, CPU, a few minutes)
    python train.py --config configs/pretrain_single_domain.yaml --data_root gs://bucket/oct
    python train.py --config ... --dry_run            # preflight: sizes, FLOPs, memory, schedules; runs nothing
    torchrun --standalone --nproc_per_node=8 train.py --config ...   # DDP on one machine

Outputs go to out_dir/run_name/: config.yaml, metrics.jsonl, events.jsonl, checkpoints/, plots.
Exit codes: 0 done, 2 bad config, 3 no usable data, 4 diverged beyond recovery.
"""
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np
import torch

from config import Config, ConfigError, RunPlan, config_to_dict, load_config, plan_run, save_config
from data import (NoUsableData, build_datasets, describe_masks, format_reason_table, make_loader,
                  mask_generator_from_config, mask_stats)
from model import VJEPA3D, activation_bytes_per_sample, training_flops_per_sample
from runtime import (checkpoint_path, list_checkpoints, newest_readable_checkpoint, read_checkpoint,
                     save_checkpoint, write_bytes_atomic)

EXIT_OK, EXIT_CONFIG, EXIT_NO_DATA, EXIT_DIVERGED = 0, 2, 3, 4


class Diverged(Exception):
    """Training cannot recover from non-finite updates; the message is the diagnosis (exit 4)."""


# ----------------------------------------------------------------------------------------------------------
# Schedules: pure functions of the optimizer-update count (incidents 2, 3). No state, no restarts.
# ----------------------------------------------------------------------------------------------------------

def cosine_ramp(step: float, start_step: int, end_step: int, start: float, end: float) -> float:
    """Half-cosine from `start` at start_step to `end` at end_step; holds `end` afterwards."""
    if step >= end_step:
        return end
    progress = max(0.0, (step - start_step) / max(1, end_step - start_step))
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * progress))


def schedule_clock(step: int, plan: RunPlan) -> float:
    """Update `step` on the clock of the run's first plan. Each --extend stretches what was left of the schedules
    over the longer run, so they continue from the values they had (a finished run holds its final values)."""
    clock = float(step)
    for at, old_total, new_total in reversed(plan.extensions):
        if clock > at:
            clock = at + (clock - at) * max(0, old_total - 1 - at) / (new_total - 1 - at)
    return clock


def lr_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """LR of update number `step` (0-based): linear warmup to base_lr, cosine to min_lr, then min_lr.
    The first update (step 0) already uses a non-zero LR: base_lr / warmup_steps."""
    if cfg.schedule == "constant":
        return cfg.base_lr
    clock = schedule_clock(step, plan)
    if clock < plan.warmup_steps:
        return cfg.base_lr * (clock + 1) / plan.warmup_steps
    return cosine_ramp(clock, plan.warmup_steps, plan.planned_steps - 1, cfg.base_lr, cfg.min_lr)


def wd_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """Weight decay of update `step`: cosine from weight_decay to weight_decay_end (constant when None)."""
    end = cfg.weight_decay if cfg.weight_decay_end is None else cfg.weight_decay_end
    return cosine_ramp(schedule_clock(step, plan), 0, plan.planned_steps - 1, cfg.weight_decay, end)


def ema_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """EMA momentum of the target update after update `step`: from ema_base to ema_end, cosine or linear."""
    clock = schedule_clock(step, plan)
    if cfg.ema_schedule == "linear":
        return cfg.ema_base + (cfg.ema_end - cfg.ema_base) * min(1.0, clock / max(1, plan.planned_steps - 1))
    return cosine_ramp(clock, 0, plan.planned_steps - 1, cfg.ema_base, cfg.ema_end)


# ----------------------------------------------------------------------------------------------------------
# Devices and processes
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Runtime:
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
        return self.process_index == 0

    @property
    def ddp(self) -> bool:
        """Several DDP processes: a torch.distributed process group joins them."""
        return self.kind != "xla" and self.world_size > 1


def setup_runtime(cfg: Config) -> Runtime:
    """Pick the device (auto: xla if configured, else cuda, else cpu) and join the process group if any."""
    kind = cfg.device
    if kind == "auto":
        kind = "xla" if _xla_configured() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but torch sees no CUDA device; use --device cpu or auto.")
    if kind == "xla":
        return _setup_xla()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        torch.distributed.init_process_group("nccl" if kind == "cuda" else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: processes on this machine
    return Runtime(device, kind, world, rank, world, 1, multi_host=local_world < world)


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


def runs_probe(rt: Runtime) -> bool:
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
# Run directory, logs, checkpoints
# ----------------------------------------------------------------------------------------------------------

class RunLog:
    """metrics.jsonl, events.jsonl, console and W&B; everything is a no-op off the master process."""

    def __init__(self, run_dir: str, cfg: Config, active: bool):
        self.active = active
        self.run_dir = run_dir
        self.cfg = cfg
        self.wandb_run = None
        self.history: List[dict] = []
        self.collapsing: set = set()  # (split, metric) pairs warned about and not recovered since
        if active:
            os.makedirs(run_dir, exist_ok=True)
            self.wandb_run = start_wandb(cfg, run_dir)

    def metrics(self, record: dict) -> None:
        """Append one metrics line (and send it to W&B)."""
        if not self.active:
            return
        record = {k: _json_number(v) for k, v in record.items()}
        self.history.append(record)
        _append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), record)
        if self.wandb_run is not None:  # no step=: W&B drops a log whose step goes back, as after a rollback
            self.wandb_run.log({"update": record["step"], **{f"{record['split']}/{k}": v for k, v in record.items()
                                                             if k not in ("split", "step") and v is not None}})
        warnings = collapse_warnings(self.history, self.cfg)
        for w in warnings:
            if (w["split"], w["metric"]) not in self.collapsing:
                self.event("collapse_warning", record["step"], **w)
                self.print(f"WARNING step {record['step']}: {w['split']} {w['metric']} {w['reason']}: the "
                           f"representations may be collapsing (check the EMA schedule, the LR, the masks)")
        self.collapsing = {(w["split"], w["metric"]) for w in warnings}

    def drop_metrics_after(self, step: int) -> None:
        """Drop the metrics lines after update `step`: a resume or a rollback logs those updates again."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not self.active or not os.path.exists(path):
            return
        with open(path) as f:
            lines = f.readlines()
        keep = [line for line in lines if json.loads(line)["step"] <= step]
        if len(keep) < len(lines):
            write_bytes_atomic(path, "".join(keep).encode())
            self.event("metrics_truncated", step, dropped_lines=len(lines) - len(keep))
        self.history = [json.loads(line) for line in keep]

    def event(self, kind: str, step: int, **fields) -> None:
        """Append one line to events.jsonl (skips, rollbacks, unreadable files, resumes...)."""
        if self.active:
            _append_jsonl(os.path.join(self.run_dir, "events.jsonl"),
                          {"event": kind, "step": step, "time": time.time(), **fields})

    def print(self, *args) -> None:
        """One console line on stdout, written above the progress bar."""
        if self.active:
            from tqdm import tqdm
            tqdm.write(" ".join(str(a) for a in args))

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def collapse_warnings(history: List[dict], cfg: Config) -> List[dict]:
    """Collapse signs in the newest metrics record: target_std or RankMe under its floor, or under half of its
    highest value of the last collapse_window_steps updates; the probe AUROC (probe_every_steps) back below half
    of its best gain over chance (0.5) of that window. A falling loss proves nothing while they fall."""
    new = history[-1]
    floors = {"target_std": cfg.collapse_min_target_std, "rankme": cfg.collapse_min_rankme, "probe_auroc": None}
    found = []
    for metric, floor in floors.items():
        value = new.get(metric)
        if value is None:
            continue
        window = [r[metric] for r in history[:-1] if r["split"] == new["split"] and r.get(metric) is not None
                  and new["step"] - r["step"] <= cfg.collapse_window_steps]
        chance = 0.5 if metric == "probe_auroc" else 0.0  # a drop is measured by what was gained over this
        if floor is not None and value < floor:
            reason = f"is {value:.4g}, under the floor {floor:g}"
        elif window and value - chance < 0.5 * (max(window) - chance):
            reason = f"fell from {max(window):.4g} to {value:.4g} within {cfg.collapse_window_steps} updates"
        else:
            continue
        found.append({"split": new["split"], "metric": metric, "value": value, "reason": reason})
    return found


def _json_number(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null marks a non-finite measurement
    return v


def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def start_wandb(cfg: Config, run_dir: str):
    """A W&B run, or None. auto = online when WANDB_API_KEY is set, else offline; never waits on a network."""
    mode = cfg.wandb
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode == "disabled":
        return None
    import wandb
    settings = wandb.Settings(init_timeout=30, silent=True)
    try:
        run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=os.path.basename(run_dir),
                         dir=run_dir, mode=mode, config=config_to_dict(cfg), settings=settings)
    except Exception as e:  # an unreachable server must not stop the run: log offline instead
        if mode != "online":
            raise
        print(f"wandb online failed ({e}); logging offline to {run_dir}/wandb", file=sys.stderr)
        run = wandb.init(project=cfg.wandb_project, name=os.path.basename(run_dir), dir=run_dir,
                         mode="offline", config=config_to_dict(cfg), settings=settings)
    run.define_metric("update")
    run.define_metric("*", step_metric="update")  # charts use the optimizer update as x-axis
    return run


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
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


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
# The optimizer update
# ----------------------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    """Everything besides weights and optimizer that a resume needs."""
    step: int = 0  # optimizer updates done (skipped non-finite updates count: the data moved on)
    data_skip: int = 0  # updates' worth of batches skipped by rollbacks (moves past offending data)
    lr_scale: float = 1.0  # lowered by each rollback
    rollbacks: int = 0
    nonfinite_skipped: int = 0  # cumulative
    consecutive_nonfinite: int = 0
    best_val_loss: float = math.inf


def make_optimizer(model: VJEPA3D, cfg: Config, rt: Runtime) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups, with its state created up front (the NaN guard can then restore
    the very first update, and XLA compiles the update once). CPU and CUDA use the fused kernel (one pass over all
    parameters; 2.3x faster than the for-loop AdamW on CPU at the demo size). On XLA it is capturable: lr and the
    step count stay on the device."""
    xla = rt.kind == "xla"
    implementation = {"capturable": xla, "foreach": False if xla else None, "fused": None if xla else True}
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.base_lr, betas=tuple(cfg.adam_betas),
                                  **implementation)
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def keep_this_devices_implementation(opt: torch.optim.Optimizer) -> None:
        # load_state_dict takes the param groups' flags from the checkpoint, i.e. from the device that wrote it.
        for group in opt.param_groups:
            group.update(implementation)
            for p in group["params"]:
                if "step" in opt.state[p]:
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device, torch.float32)

    optimizer.register_load_state_dict_post_hook(keep_this_devices_implementation)
    return optimizer


def compile_model(model: VJEPA3D, batch_size: int, cfg: Config, rt: Runtime, log: RunLog) -> None:
    """With cfg.compile: compile the model's parts now, on inputs of the training update's shapes and dtypes
    (a forward and backward whose gradients are dropped), and print how long that took. Ignored on XLA, which
    compiles the whole update by itself."""
    if not cfg.compile:
        return
    if rt.kind == "xla":
        log.print("compile: ignored on xla (XLA compiles the whole update by itself)")
        return
    start = time.perf_counter()
    model.compile_parts()
    context, target = mask_generator_from_config(cfg)(np.random.default_rng(0))  # [Nc], [Nt] or [M, Nc], [M, Nt]
    volume = torch.zeros(batch_size, 1, *cfg.image_size, device=rt.device)
    context_idx, target_idx = (torch.from_numpy(i).to(rt.device).expand(batch_size, *i.shape) for i in (context, target))
    with torch.autocast(rt.kind, dtype=torch.bfloat16, enabled=cfg.use_bf16):
        out = model(volume, context_idx.contiguous(), target_idx.contiguous())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    log.print(f"compile: encoders, predictor and loss compiled in {time.perf_counter() - start:.1f} s")


def set_hyperparameters(optimizer: torch.optim.Optimizer, lr) -> None:
    """The update's LR in every group. Weight decay is applied by guarded_optimizer_step, so the groups' stays 0
    (a tensor weight_decay inside AdamW reads it on the host once per parameter)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["weight_decay"] = 0.0


def forward_backward(model, ddp_model, micro_batches: list, cfg: Config, rt: Runtime):
    """Accumulate gradients over the micro-batches; return (mean loss, mean target_std) as device tensors."""
    loss_sum = torch.zeros((), device=rt.device)
    std_sum = torch.zeros((), device=rt.device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or ddp_model is model else ddp_model.no_sync()
        autocast = torch.autocast(rt.kind, dtype=torch.bfloat16, enabled=cfg.use_bf16)
        with sync, autocast:
            out = ddp_model(batch["volume"], batch["context_idx"], batch["target_idx"])
            (out.loss / len(micro_batches)).backward()
        loss_sum += out.loss.detach()
        std_sum += out.target_std
    return loss_sum / len(micro_batches), std_sum / len(micro_batches)


def clip_and_measure(model: VJEPA3D, cfg: Config) -> torch.Tensor:
    """Pre-clip total grad norm of this update, measured before the optimizer step and zero_grad (incident 1)."""
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


@dataclass
class UpdateResult:
    """One optimizer update's measurements, as device tensors (read by the host only at sync points)."""
    loss: torch.Tensor  # mean over micro-batches and replicas
    target_std: torch.Tensor
    grad_norm: torch.Tensor  # pre-clip total norm of this update
    applied: torch.Tensor  # bool; False when the NaN guard skipped the update
    stats: torch.Tensor  # [loss, target_std, grad_norm, applied]: what the host reads at a sync point, in one go


@torch.no_grad()
def optimizer_step(optimizer: torch.optim.Optimizer, lr, wd) -> None:
    """AdamW's decoupled weight decay (p *= 1 - lr * wd on the decay groups), then optimizer.step()."""
    decay = [p for group in optimizer.param_groups if group["apply_wd"] for p in group["params"] if p.grad is not None]
    if decay:
        torch._foreach_mul_(decay, 1 - lr * wd)
    optimizer.step()


@torch.no_grad()
def guarded_optimizer_step(optimizer: torch.optim.Optimizer, apply: torch.Tensor, lr, wd) -> None:
    """optimizer_step, kept only where `apply` (a 0-d bool tensor) is True: otherwise every weight and every
    optimizer state tensor keeps its old value exactly. Decided on the device, so XLA needs no host sync."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    old_params = [p.clone() for p in params]
    old_states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
    optimizer_step(optimizer, lr, wd)
    for p, old in zip(params, old_params):
        p.copy_(torch.where(apply, p, old))
    for p, old in zip(params, old_states):
        for key, value in optimizer.state[p].items():
            value.copy_(torch.where(apply, value, old[key]))


def train_update(model: VJEPA3D, ddp_model, optimizer, micro_batches: list, lr, wd, ema, cfg: Config,
                 rt: Runtime) -> UpdateResult:
    """One optimizer update: accumulate gradients, measure and clip the grad norm, step the optimizer and the
    EMA target. A non-finite loss or grad norm changes nothing (NaN guard). lr, wd, ema: the schedules' floats."""
    if rt.kind == "xla":
        # One 1-d device tensor: a Python 0.0/1.0 or a 0-d tensor would be baked into the graph as a constant
        # and every new value would compile a new graph.
        lr, wd, ema = torch.tensor([lr, wd, ema], dtype=torch.float32).to(rt.device).unbind()
    set_hyperparameters(optimizer, lr)
    loss, target_std = forward_backward(model, ddp_model, micro_batches, cfg, rt)
    loss, target_std = reduce_mean(torch.stack([loss, target_std]).float(), rt).unbind()  # same on all ranks
    grad_norm = clip_and_measure(model, cfg)  # before optimizer.step() and zero_grad (incident 1)
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
    if rt.kind == "xla":  # no host sync inside the XLA step: select old or new values on the device
        guarded_optimizer_step(optimizer, finite, lr, wd)
        model.update_target(torch.where(finite, ema, 1.0))
    elif finite:  # CPU/CUDA read the verdict (the loop reads every update anyway): cheaper than undoing a step
        optimizer_step(optimizer, lr, wd)
        model.update_target(ema)
    optimizer.zero_grad(set_to_none=True)
    stats = torch.stack([loss, target_std, grad_norm.float(), finite.float()])  # before the XLA sync (no recompile)
    return UpdateResult(loss, target_std, grad_norm, finite, stats)


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


def mark_step(rt: Runtime) -> None:
    """XLA: cut the traced graph here and launch it (a no-op elsewhere)."""
    if rt.kind == "xla":
        import torch_xla
        torch_xla.sync()


def next_update_batches(groups, rt: Runtime) -> Tuple[Optional[list], list]:
    """(micro-batches of the next update, the files every process had to replace in them). A NoUsableData on any
    process stops every process with it (exit 3 everywhere, none left waiting in a collective)."""
    try:
        micro_batches, error = next(groups, None), None
    except NoUsableData as e:
        micro_batches, error = None, str(e)
    skipped = [item for batch in micro_batches or [] for item in batch["skipped"]]
    reports = gather_objects((skipped, error), rt)
    errors = [e for _, e in reports if e is not None]
    if errors:
        raise NoUsableData(errors[0])
    return micro_batches, [item for s, _ in reports for item in s]


def note_bad_files(skipped: list, bad_files: dict, step: int, total_files: int, cfg: Config, log) -> None:
    """Log each (path, reason, detail) the loaders had to replace, once; stop with exit 3 when too many are bad.
    `skipped` holds every process's files, so all processes take the same decision."""
    for path, reason, detail in skipped:
        if path not in bad_files:
            bad_files[path] = reason
            log.event("unreadable_file", step, path=path, reason=reason, detail=detail)
    if len(bad_files) > cfg.max_bad_fraction * total_files:
        counts = {}
        for reason in bad_files.values():
            counts[reason] = counts.get(reason, 0) + 1
        raise NoUsableData(f"{len(bad_files)} of {total_files} files failed during training, more than "
                           f"max_bad_fraction {cfg.max_bad_fraction}:\n{format_reason_table(counts)}")


def micro_batch_groups(loader, accum: int):
    """Yield lists of `accum` consecutive micro-batches (one optimizer update each)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------

def rankme(embeddings: torch.Tensor, eps: float = 1e-7) -> float:
    """RankMe: exp of the entropy of the normalized singular values of [M, E] embeddings (1 = collapsed)."""
    s = torch.linalg.svdvals(embeddings.float())
    p = s / (s.sum() + eps) + eps
    return float(torch.exp(-(p * p.log()).sum()))


@torch.compiler.set_stance("force_eager")  # compiled parts are for the training update: no eval recompiles
@torch.no_grad()
def validate(model: VJEPA3D, loader, cfg: Config, rt: Runtime, max_tokens: int = 4096) -> dict:
    """Val loss and target_std with fixed masks and crops, and RankMe of target-encoder token embeddings."""
    model.eval()
    losses, stds, feats = [], [], []
    for i, batch in enumerate(loader):
        if i >= cfg.val_batches:
            break
        batch = to_device(batch, rt)
        with torch.autocast(rt.kind, dtype=torch.bfloat16, enabled=cfg.use_bf16):
            out = model(batch["volume"], batch["context_idx"], batch["target_idx"])
            tokens = model.encode(batch["volume"])  # [B, N, E]
        losses.append(reduce_mean(out.loss.detach().float(), rt))
        stds.append(reduce_mean(out.target_std, rt))
        feats.append(tokens.flatten(0, 1).float().cpu())
    model.train()
    if not losses:
        return {}
    feats = torch.cat(feats)
    keep = torch.randperm(len(feats), generator=torch.Generator().manual_seed(0))[:max_tokens]
    return {"loss": float(torch.stack(losses).mean()), "target_std": float(torch.stack(stds).mean()),
            "rankme": rankme(feats[keep])}


# ----------------------------------------------------------------------------------------------------------
# Dry run (preflight, incident 9)
# ----------------------------------------------------------------------------------------------------------

def describe_run(cfg: Config, plan: RunPlan, model: VJEPA3D, train_ds, val_ds, rt: Runtime) -> str:
    """The preflight report: sizes, tokens, FLOPs, memory, schedules at milestones."""
    n_context, n_target = cfg.token_counts()
    flops = training_flops_per_sample(cfg)
    act = activation_bytes_per_sample(cfg)
    params = model.num_trainable_params()
    state_bytes = params * 4 * 4 + sum(p.numel() for p in model.target_encoder.parameters()) * 4
    lines = [
        f"device            {rt.kind} x {rt.world_size} replica(s), {rt.process_count} process(es)",
        f"data              {len(train_ds)} train / {len(val_ds)} val volumes",
        f"batch             global {plan.global_batch_size} = {plan.per_core_batch_size} per replica x "
        f"{plan.world_size} replicas x {plan.grad_accum_steps} accumulation",
        f"updates           {plan.total_steps} ({plan.steps_per_epoch}/epoch), warmup {plan.warmup_steps}",
        f"parameters        {params:,} trainable (encoder + predictor), plus the EMA target encoder",
        f"tokens/sample     {n_context + n_target} (grid {cfg.grid_size()}): {n_context} context, {n_target} target",
        f"FLOPs/sample      {flops['total'] / 1e9:.2f} GFLOP per training step "
        f"(context {flops['context_encoder'] / 1e9:.2f}, predictor {flops['predictor'] / 1e9:.2f}, "
        f"target {flops['target_encoder'] / 1e9:.2f})",
        f"activations       ~{act / 2**20:.1f} MiB/sample, ~{act * plan.per_core_batch_size / 2**30:.2f} GiB per "
        f"replica at batch {plan.per_core_batch_size} (+ {state_bytes / 2**30:.2f} GiB weights, grads, AdamW)",
    ]
    lines.append(describe_masks(mask_generator_from_config(cfg)))
    geometry = getattr(train_ds, "geometry_report", None)
    if callable(geometry):
        lines.append(geometry())
    lines.append("schedule          step      lr         wd       ema")
    for step in sorted({0, plan.warmup_steps, plan.total_steps // 2, plan.total_steps - 1}):
        lines.append(f"                  {step:<9d} {lr_at(step, cfg, plan):<10.3g} {wd_at(step, cfg, plan):<8.3g} "
                     f"{ema_at(step, cfg, plan):.5f}")
    return "\n".join(lines)


def save_schedule_plot(cfg: Config, plan: RunPlan, path: str) -> None:
    """PNG of the LR, WD and EMA schedules over the whole run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = np.arange(plan.total_steps)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3))
    for ax, fn, name in zip(axes, (lr_at, wd_at, ema_at), ("lr", "weight decay", "EMA momentum")):
        ax.plot(steps, [fn(int(s), cfg, plan) for s in steps])
        ax.set_title(name)
        ax.set_xlabel("optimizer update")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save_mask_plot(sample: dict, cfg: Config, path: str) -> None:
    """PNG of one sample's masks: per mask set, the middle B-scan with its context (blue) and target (red) tokens
    overlaid and the en-face target map of every B-scan row, titled with the realised block size and the share
    of target tokens with a context neighbour along each axis (data.mask_stats over 100 masks)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    volume = sample["volume"][0].numpy()  # [D, H, W]
    gd, gh, gw = cfg.grid_size()
    pd, ph, pw = cfg.patch_size
    targets = sample["target_idx"].numpy().reshape(-1, sample["target_idx"].shape[-1])  # [M, Nt]
    stats = mask_stats(mask_generator_from_config(cfg))
    frame = volume.shape[0] // 2
    fig, axes = plt.subplots(len(targets), 3, figsize=(15, 4 * len(targets)), squeeze=False)
    for row, target_idx in zip(axes, targets):
        is_target = np.zeros(gd * gh * gw, bool)
        is_target[target_idx] = True
        is_target = is_target.reshape(gd, gh, gw)
        overlay = np.kron(is_target[frame // pd], np.ones((ph, pw)))  # [H, W]
        row[0].imshow(volume[frame], cmap="gray")
        row[0].set_title(f"B-scan {frame} of {sample['path'].split('/')[-1]}")
        row[1].imshow(volume[frame], cmap="gray")
        row[1].imshow(np.ma.masked_where(overlay == 0, overlay), cmap="autumn", alpha=0.45, vmin=0, vmax=1)
        row[1].imshow(np.ma.masked_where(overlay == 1, 1 - overlay), cmap="winter", alpha=0.25, vmin=0, vmax=1)
        row[1].set_title(f"target (red) {int(is_target.sum())} / context (blue) {int((~is_target).sum())} tokens")
        row[2].imshow(is_target.mean(1), cmap="Reds", vmin=0, vmax=1, aspect="auto")  # [gd, gw]: share of depth
        row[2].set_title("en face: target share of each column (rows = B-scans)")
        row[2].set_xlabel("lateral token")
        row[2].set_ylabel("B-scan token")
        for ax in row[:2]:
            ax.axis("off")
    size = "" if stats["block_size_ratio"] is None else f"realised block size {stats['block_size_ratio']:.2f} x nominal; "
    near = ", ".join(f"axis {a} {s:.0%}" for a, s in enumerate(stats["context_neighbour_share"]))
    fig.suptitle(f"{cfg.mask_type}: {size}target tokens with a context neighbour: {near}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save_training_plot(history: List[dict], path: str) -> None:
    """PNG of loss, target_std, grad norm and LR over the run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = [r for r in history if r["split"] == "train"]
    val = [r for r in history if r["split"] == "val"]
    if not train:
        return
    fig, axes = plt.subplots(1, 4, figsize=(16, 3))
    for ax, key in zip(axes, ("loss", "target_std", "grad_norm", "lr")):
        ax.plot([r["step"] for r in train], [r[key] for r in train], label="train")
        if key in ("loss", "target_std") and val:
            ax.plot([r["step"] for r in val], [r[key] for r in val], "o-", label="val")
            ax.legend()
        ax.set_title(key)
        ax.set_xlabel("optimizer update")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------

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


def main(argv: Optional[List[str]] = None) -> int:
    try:
        cfg = load_config(argv)
        rt = setup_runtime(cfg)
        cfg = master_decides(rt, resolve_run_dir, cfg)  # one run name and checkpoint folder for every process
        check_checkpoints_are_shared(cfg, rt)
        return train(cfg, rt)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NoUsableData as e:
        print(f"no usable data:\n{e}", file=sys.stderr)
        return EXIT_NO_DATA
    except Diverged as e:
        print(f"training diverged beyond recovery:\n{e}", file=sys.stderr)
        return EXIT_DIVERGED


def train(cfg: Config, rt: Runtime) -> int:
    # --- data, model, optimizer ---
    torch.manual_seed(cfg.seed)
    train_ds, val_ds = build_datasets(cfg)
    check_ranks_agree(split_fingerprint(train_ds, val_ds), "the train/val split (use an index_path)", rt)
    plan = plan_run(cfg, rt.world_size, len(train_ds))
    model = VJEPA3D.from_config(cfg).to(rt.device)
    optimizer = make_optimizer(model, cfg, rt)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    local_batch = plan.per_core_batch_size * rt.local_replicas
    # Val batches are full like train batches (static shapes), and smaller when the val split is small.
    val_per_process = len(val_ds) // rt.process_count
    val_batch = min(local_batch, val_per_process - val_per_process % rt.local_replicas)

    if cfg.dry_run:
        if rt.is_master:
            os.makedirs(run_dir, exist_ok=True)
            print(describe_run(cfg, plan, model, train_ds, val_ds, rt))
            save_schedule_plot(cfg, plan, os.path.join(run_dir, "schedules.png"))
            save_mask_plot(train_ds[(0, 0)], cfg, os.path.join(run_dir, "mask.png"))
            print(f"dry run: nothing trained; schedule and mask pictures in {run_dir}/")
        return EXIT_OK

    # --- resume: the same checkpoint in every process, and the plan it was written for ---
    state = TrainState()
    resume_path, ckpt, unreadable = load_resume_checkpoint(cfg, rt)
    extended_from = None  # the total_steps of the plan this resume extends
    if ckpt is not None:
        if "plan" in ckpt:
            plan = resumed_plan(ckpt["plan"], cfg, plan, train_ds, val_ds, ckpt["train_state"]["step"], resume_path)
            if plan.total_steps > ckpt["plan"]["total_steps"]:
                extended_from = ckpt["plan"]["total_steps"]
        restore(ckpt, model, optimizer, state)
        check_ranks_agree(state.step, f"the update they resume {resume_path} at", rt)
    run_plan = plan_record(cfg, plan, train_ds, val_ds)  # stored in every checkpoint of this run
    log = RunLog(run_dir, cfg, active=rt.is_master)
    compile_model(model, local_batch, cfg, rt, log)
    ddp_model = model  # wrapped after the restore: DDP starts every process from the same weights
    if rt.ddp:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    for path, error in unreadable:
        log.event("unreadable_checkpoint", state.step, path=path, reason=error)
    if cfg.resume == "auto" and resume_path is None:
        log.print(f"resume auto: no checkpoint in {cfg.ckpt_dir}; starting from scratch")
    if resume_path is not None:
        log.event("resume", state.step, path=resume_path)
        log.print(f"resumed from {resume_path} at update {state.step}")
        if "plan" not in ckpt:
            log.print(f"WARNING: {resume_path} records no plan (an older octjepa wrote it): the schedules follow this "
                      f"config's plan, which nothing could compare with the one the run started with")
        log.drop_metrics_after(state.step)
    if extended_from is not None:
        lr = lr_at(state.step, cfg, plan) * state.lr_scale
        log.event("extend", state.step, from_total_steps=extended_from, to_total_steps=plan.total_steps, lr=lr,
                  ema_momentum=ema_at(state.step, cfg, plan))
        log.print(f"extend: {extended_from} -> {plan.total_steps} updates from update {state.step}; the LR continues "
                  f"from {lr:.3g} and the schedules stretch over the longer run")
    if log.active:
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
        if cfg.ckpt_dir is None:
            log.print("ckpt_dir is null: no checkpoints will be written for this run")
        if cfg.data_root is None:
            log.print(f"data_root is null: training on the built-in phantom set in {cfg.phantom_dir}")
        if val_batch == 0:
            log.print(f"validation is off: the val split holds {len(val_ds)} volumes, fewer than the "
                      f"{rt.local_replicas} devices of a process; raise val_fraction or the dataset size")
        log.print(f"run {run_dir}: {plan.total_steps} updates of {plan.global_batch_size} volumes on "
                  f"{rt.kind} x {rt.world_size}, {model.num_trainable_params():,} parameters")

    probe_set = None
    if cfg.probe_every_steps is not None and runs_probe(rt):
        from probe import prepare_probe_set
        probe_set = prepare_probe_set(cfg, cfg.probe_labels)  # loaded once; features are recomputed at each probe
    mark_step(rt)  # XLA: materialise weights and optimizer state now, so update 1 compiles the graph update 2 reuses
    val_loader = make_loader(val_ds, val_batch, train=False, workers=cfg.workers, rank=rt.process_index,
                             world_size=rt.process_count, seed=cfg.seed) if val_batch else None
    last_ckpt = resume_path
    recent_grad_norms: List[float] = []
    bad_files: dict = {}
    val_metrics: dict = {}
    pending: List[tuple] = []  # (step, lr, files, UpdateResult) not yet read by the host
    # The host reads the device only at sync points: every update on CPU/CUDA, every log on XLA (no host sync
    # inside the XLA step: the NaN guard decides on the device and the host learns of a skip here).
    sync_every = cfg.log_every_steps if rt.kind == "xla" else 1
    from tqdm import tqdm
    bar = tqdm(total=plan.total_steps, initial=state.step, disable=not (rt.is_master and sys.stderr.isatty()),
               unit="update", dynamic_ncols=True)
    window_start, data_time, window_updates = time.perf_counter(), 0.0, 0

    # --- the loop: one iteration = one optimizer update ---
    keys_per_update = plan.grad_accum_steps * local_batch
    while state.step < plan.total_steps:
        # One loader (one set of workers) for the rest of the run; rebuilt only after a rollback. The data
        # order is a function of the position in updates, so a resume or rollback continues it exactly.
        position = state.step + state.data_skip
        epoch, update_in_epoch = divmod(position, plan.steps_per_epoch)
        last_position = plan.total_steps - 1 + state.data_skip
        loader = make_loader(train_ds, local_batch, train=True, workers=cfg.workers, rank=rt.process_index,
                             world_size=rt.process_count, epoch=epoch, start=update_in_epoch * keys_per_update,
                             seed=cfg.seed, epochs=last_position // plan.steps_per_epoch - epoch + 1,
                             per_epoch=plan.steps_per_epoch * keys_per_update)
        groups = micro_batch_groups(loader, plan.grad_accum_steps)
        for _ in range(plan.total_steps - state.step):
            t0 = time.perf_counter()
            micro_batches, skipped = next_update_batches(groups, rt)
            if micro_batches is None:
                raise RuntimeError(f"the loader ended before update {state.step}: the sampler yields fewer batches "
                                   f"than plan_run counted")
            data_time += time.perf_counter() - t0
            note_bad_files(skipped, bad_files, state.step, len(train_ds) + len(val_ds), cfg, log)

            # One optimizer update: schedules first, as pure functions of the update count.
            lr = lr_at(state.step, cfg, plan) * state.lr_scale
            wd = wd_at(state.step, cfg, plan)
            ema = ema_at(state.step, cfg, plan)
            update = train_update(model, ddp_model, optimizer, [to_device(b, rt) for b in micro_batches],
                                  lr, wd, ema, cfg, rt)
            mark_step(rt)
            pending.append((state.step, lr, [p for b in micro_batches for p in b["path"]], update))
            state.step += 1
            window_updates += 1
            bar.update(1)
            is_last = state.step == plan.total_steps
            is_log = state.step % cfg.log_every_steps == 0 or is_last or state.step == 1
            is_val = val_loader is not None and (state.step % cfg.val_every_steps == 0 or is_last)
            is_ckpt = cfg.ckpt_dir is not None and (state.step % cfg.ckpt_every_steps == 0 or is_last)
            is_probe = probe_set is not None and (state.step % cfg.probe_every_steps == 0 or is_last)
            if not (is_log or is_val or is_ckpt or is_probe or state.step % sync_every == 0):
                continue

            # --- sync point: the host reads what the device did ---
            host_stats = fetch_to_host([result.stats for _, _, _, result in pending], rt)
            for (step, step_lr, files, _), stats in zip(pending, host_stats):
                loss, target_std, grad_norm, applied = stats.tolist()
                recent_grad_norms = (recent_grad_norms + [grad_norm])[-10:]
                if applied:
                    state.consecutive_nonfinite = 0
                else:  # the NaN guard left weights and optimizer state untouched; the data moved on
                    state.nonfinite_skipped += 1
                    state.consecutive_nonfinite += 1
                    log.event("nonfinite_skipped", step, lr=step_lr, loss=_json_number(loss),
                              grad_norm=_json_number(grad_norm), files=files)
            pending = []
            if state.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                last_ckpt = rollback(cfg, model, optimizer, state, last_ckpt, recent_grad_norms, lr, log, rt)
                bar.reset(total=plan.total_steps)
                bar.update(state.step)
                break  # restart the data loader at the new position

            if is_log:
                elapsed = time.perf_counter() - window_start
                epoch = (state.step - 1 + state.data_skip) // plan.steps_per_epoch
                record = {"split": "train", "step": state.step, "epoch": epoch,
                          "loss": loss, "lr": lr, "wd": wd, "ema_momentum": ema,
                          "grad_norm": grad_norm, "target_std": target_std,
                          "nonfinite_skipped": state.nonfinite_skipped,
                          "samples_per_s": window_updates * plan.global_batch_size / elapsed,
                          "step_time_s": elapsed / window_updates, "data_time_s": data_time / window_updates}
                if rt.kind == "xla":
                    record.update(xla_counters())
                log.metrics(record)
                log.print(format_train_line(record, plan))
                bar.set_postfix(loss=record["loss"], lr=f"{lr:.2e}")
                window_start, data_time, window_updates = time.perf_counter(), 0.0, 0

            best = False  # best.pt is judged only on a validation of these very weights
            if is_val:
                val_metrics = validate(model, val_loader, cfg, rt)
                if val_metrics:
                    log.metrics({"split": "val", "step": state.step, **val_metrics})
                    log.print(f"val   step {state.step:>6d} | loss {val_metrics['loss']:.4f} | target_std "
                              f"{val_metrics['target_std']:.4f} | rankme {val_metrics['rankme']:.1f}")
                    best = val_metrics["loss"] < state.best_val_loss
                    state.best_val_loss = min(state.best_val_loss, val_metrics["loss"])
            if is_probe:
                from probe import probe_auroc
                scores = probe_auroc(model, probe_set, rt.device)
                log.metrics({"split": "probe", "step": state.step, **scores})
                log.print(f"probe step {state.step:>6d} | auroc {scores['probe_auroc']:.3f} | balanced accuracy "
                          f"{scores['probe_bal_acc']:.3f}")
            if is_ckpt or (best and cfg.ckpt_dir is not None):  # a new best val loss is checkpointed at once
                last_ckpt = checkpoint_path(cfg.ckpt_dir, state.step)
                # every process: XLA gathers the shards; the plan lets a resume check it continues the same run
                ckpt = {**checkpoint_state(model, optimizer, state, cfg, rt), "plan": run_plan}
                if rt.is_master:
                    save_checkpoint(last_ckpt, ckpt, cfg.keep_last, best)
                    log.event("checkpoint", state.step, path=last_ckpt, best=best)
                if rt.ddp:
                    torch.distributed.barrier()  # no rank may roll back to a file that is not written yet

    bar.close()
    versus_random = None
    if cfg.summary_probe and runs_probe(rt):
        from probe import compare_with_random, prepare_probe_set
        versus_random = compare_with_random(model, cfg, probe_set or prepare_probe_set(cfg, cfg.probe_labels),
                                            rt.device)
        log.event("summary_probe", state.step, **versus_random)
    if log.active:
        save_training_plot(log.history, os.path.join(run_dir, "training.png"))
        log.print(summary(log.history, run_dir, cfg, state, versus_random))
    log.close()
    return EXIT_OK


def format_train_line(record: dict, plan: RunPlan) -> str:
    """The console line of one train metrics record (a non-finite value reads 'nan', not a crash)."""
    def fmt(key, spec):
        return "nan" if record[key] is None else format(record[key], spec)
    return (f"train step {record['step']:>6d}/{plan.total_steps} | loss {fmt('loss', '.4f')} | lr {record['lr']:.2e} | "
            f"grad_norm {fmt('grad_norm', '.3f')} | target_std {fmt('target_std', '.3f')} | "
            f"{record['samples_per_s']:.1f} samples/s")


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


def checkpoint_state(model: VJEPA3D, optimizer, state: TrainState, cfg: Config, rt: Runtime) -> dict:
    """Everything a resume needs, as CPU tensors and plain types (torch.load(weights_only=True) reads it, on a
    machine with or without torch_xla)."""
    model_state, optimizer_state = fetch_to_host([model.state_dict(), optimizer.state_dict()], rt)
    for group in optimizer_state["param_groups"]:
        group["lr"] = float(group["lr"])  # a device tensor on XLA
    return {"model": model_state, "optimizer": optimizer_state, "train_state": dict(vars(state)),
            "rng": rng_state(), "config": config_to_dict(cfg), "version": 2}


def restore(ckpt: dict, model: VJEPA3D, optimizer, state: TrainState) -> None:
    """Load weights, optimizer, schedule position, data position and RNG states from a checkpoint (written on any
    device: make_optimizer's load hook keeps this device's AdamW implementation flags)."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    for key, value in ckpt["train_state"].items():
        setattr(state, key, value)
    set_rng_state(ckpt["rng"])


def rollback(cfg, model, optimizer, state: TrainState, last_ckpt, recent_grad_norms, lr, log, rt) -> Optional[str]:
    """After max_consecutive_nonfinite skipped updates: reload the last good checkpoint, lower the LR and skip
    past the offending batches; raise Diverged when that is impossible or max_rollbacks is used up."""
    diagnosis = (f"step {state.step}: {state.consecutive_nonfinite} non-finite updates in a row at lr {lr:.3g}; "
                 f"recent grad norms {[round(g, 4) for g in recent_grad_norms]}; "
                 f"last good checkpoint: {last_ckpt or 'none'}; rollbacks used {state.rollbacks}/{cfg.max_rollbacks}.")
    if last_ckpt is None or state.rollbacks >= cfg.max_rollbacks:
        log.event("diverged", state.step, lr=lr, grad_norms=recent_grad_norms, last_good_checkpoint=last_ckpt)
        raise Diverged(diagnosis + "\nCheck the data named in events.jsonl; resume with a larger --max_rollbacks (each "
                                   "rollback multiplies the LR by rollback_lr_factor), or start a new run with a lower "
                                   "base_lr (measure one with `python sanity.py --lr_sweep`).")
    failed_at = state.step + state.data_skip
    ckpt = read_checkpoint(last_ckpt, tries=3)  # load_state_dict moves the tensors to the model's device
    rollbacks, lr_scale, skipped = state.rollbacks + 1, state.lr_scale * cfg.rollback_lr_factor, state.nonfinite_skipped
    restore(ckpt, model, optimizer, state)
    state.rollbacks, state.lr_scale, state.nonfinite_skipped = rollbacks, lr_scale, skipped
    state.consecutive_nonfinite = 0
    state.data_skip = failed_at - state.step  # resume the data after the batches that failed
    log.drop_metrics_after(state.step)  # the updates after the checkpoint are logged again
    log.event("rollback", state.step, checkpoint=last_ckpt, lr_scale=lr_scale, rollbacks=rollbacks,
              data_skip=state.data_skip)
    log.print(f"rollback {rollbacks}/{cfg.max_rollbacks} to {last_ckpt}: lr x{lr_scale:g}, "
              f"skipping {state.data_skip} updates' worth of data")
    return last_ckpt


def summary(history: List[dict], run_dir: str, cfg: Config, state: TrainState,
            versus_random: Optional[dict] = None) -> str:
    """The one-screen end-of-run summary; versus_random: probe.compare_with_random's verdict, if measured."""
    train = [r for r in history if r["split"] == "train"]
    val = [r for r in history if r["split"] == "val"]
    lines = ["", "=" * 72, f"done: {state.step} updates, {state.nonfinite_skipped} non-finite skipped, "
                           f"{state.rollbacks} rollbacks"]
    if train:
        lines.append(f"train loss        {train[0]['loss']:.4f} (update {train[0]['step']}) -> {train[-1]['loss']:.4f} "
                     f"(update {train[-1]['step']})")
        lines.append(f"target_std        {train[0]['target_std']:.4f} -> {train[-1]['target_std']:.4f}")
    if val:
        lines.append(f"val loss          {val[0]['loss']:.4f} -> {val[-1]['loss']:.4f}, rankme {val[-1]['rankme']:.1f}")
    if versus_random:
        p, r = versus_random["pretrained"], versus_random["random"]
        verdict = ("BEATS a random init" if versus_random["beats_random"] else
                   "does NOT beat a random init (overlapping or lower 95% intervals): pretrain longer or on more data")
        lines.append(f"probe             mean-pool AUROC {p['mean']:.3f} [{p['low']:.3f}, {p['high']:.3f}] vs random "
                     f"init {r['mean']:.3f} [{r['low']:.3f}, {r['high']:.3f}] ({len(p['values'])} splits): the "
                     f"encoder {verdict}")
    lines += [f"metrics           {run_dir}/metrics.jsonl (events: events.jsonl, plot: training.png)",
              f"checkpoints       {cfg.ckpt_dir if cfg.ckpt_dir else 'off (ckpt_dir null)'}", "=" * 72]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
