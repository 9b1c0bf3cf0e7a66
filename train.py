"""Train a 3D V-JEPA on OCT volumes. The loop is spelled out top to bottom in train_loop(), one
iteration per optimizer update; devices and processes are in runtime.py, checkpoint files in
checkpoint.py, logs and pictures in runlog.py, the dry run's plan in plan.py.

    python train.py                                   # the built-in demo (phantoms, CPU, a few minutes): runs/demo/
    python train.py --config configs/pretrain_single_domain.yaml --data_root gs://bucket/oct
    python train.py --config ... --dry_run            # preflight: sizes, FLOPs, memory, schedules; runs nothing
    torchrun --standalone --nproc_per_node=8 train.py --config ...   # DDP on one machine

Outputs go to out_dir/run_name/: config.yaml, metrics.jsonl, events.jsonl, checkpoints/, plots.
Exit codes: config.EXIT_CODES, the one table (0 done; ConfigError, NoUsableData, Diverged,
StorageFailed, Preempted). "incident N" in the comments: the failures of the previous system listed
in docs/incidents.md.
"""

from config import (
    DEMO_FLAGS,
    EXIT_OK,
    Config,
    ConfigError,
    Diverged,
    NoUsableData,
    Preempted,
    RunPlan,
    ScriptParser,
    StorageFailed,
    load_config,
    plan_run,
    preempt_at_once_on_stop_signals,
    save_config,
    script_main,
)

# a stop while the imports run (seconds) is a preemption too, until the run's own handlers
if __name__ == "__main__":
    preempt_at_once_on_stop_signals("train.py")

import contextlib
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data import build_datasets, format_reason_table, make_loader, make_val_loader
from index import uses_builtin_phantoms
from masks import mask_generator_from_config
from model import VJEPA3D
from runlog import (
    RunLog,
    Throughput,
    format_train_line,
    json_number,
    position_share_of_sums,
    position_sums,
    rankme,
    save_training_plot,
    summary,
)
from plan import choose_auto_settings, dry_run_report
from checkpoint import (
    carry_out,
    check_checkpoint_folder,
    checkpoint_everywhere,
    checkpoint_path,
    list_checkpoints,
    load_resume_checkpoint,
    plan_record,
    read_checkpoint,
    resolve_run_dir,
    restore,
    resumed_plan,
    split_fingerprint,
)
from lock import lease_lost, run_folder_lock, stop_if_taken_over
from runtime import (
    PendingDeviceStats,
    Runtime,
    StopRequested,
    StopSignals,
    adamw_state,
    any_process,
    check_ranks_agree,
    gather_objects,
    global_value,
    mark_step,
    master_decides,
    materialize_state,
    place_model,
    probes_in_this_process,
    reduce_mean,
    setup_runtime,
    state_bytes_per_device,
    to_device,
    wrap_ddp,
)
from privacy import KEY_FILE_ENV, site_secret
from schedules import Hyperparameters, describe_extension, hyperparameters_at

# --------------------------------------------------------------------------------------------------
# The optimizer update
# --------------------------------------------------------------------------------------------------


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
    """AdamW over the model's parameter groups, with its state created up front (the NaN guard can
    then restore the very first update, and XLA compiles the update once). Its own weight decay
    stays 0: optimizer_step applies the scheduled one. CPU and CUDA use the fused kernel (one pass
    over all parameters; 2.3x faster than the for-loop AdamW on CPU at the demo size). On XLA it is
    capturable: lr and the step count stay on the device."""
    implementation = rt.adamw_options
    optimizer = torch.optim.AdamW(
        model.param_groups(),
        lr=cfg.base_lr,
        weight_decay=0.0,
        betas=tuple(cfg.adam_betas),
        **implementation,
    )
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = adamw_state(p, rt)

    def keep_this_devices_implementation(opt: torch.optim.Optimizer) -> None:
        # load_state_dict takes the param groups' flags from the checkpoint, i.e. from the device
        # that wrote it.
        for group in opt.param_groups:
            group.update(implementation)
            for p in group["params"]:
                if "step" in opt.state[p]:
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device, torch.float32)

    optimizer.register_load_state_dict_post_hook(keep_this_devices_implementation)
    return optimizer


@torch.no_grad()
def optimizer_step(
    optimizer: torch.optim.Optimizer, lr, wd, skip: Optional[torch.Tensor] = None
) -> None:
    """AdamW's decoupled weight decay (p *= 1 - lr * wd on the groups the model marks apply_wd),
    then optimizer.step(). Decayed here rather than by AdamW: on XLA a scheduled wd is a device
    tensor, which AdamW would read on the host once per parameter. `skip` (a 0-d bool device tensor;
    the fused AdamW of CPU and CUDA): where True, nothing changes, decided on the device: the decay
    multiplies by 1 and AdamW skips its kernel and step count (found_inf, as torch's GradScaler has
    it skip)."""
    decay = [
        p
        for group in optimizer.param_groups
        if group["apply_wd"]
        for p in group["params"]
        if p.grad is not None
    ]
    if decay:
        torch._foreach_mul_(
            decay, 1 - lr * wd if skip is None else torch.where(skip, 1.0, 1 - lr * wd)
        )
    optimizer.found_inf = None if skip is None else skip.float()
    optimizer.step()


def compile_model(model: VJEPA3D, batch_size: int, cfg: Config, rt: Runtime, log: RunLog) -> None:
    """With cfg.compile: compile the model's parts now in cfg.compile_mode, on inputs of the
    training update's shapes and dtypes (a forward and backward whose gradients are dropped), and
    print how long that took (never on XLA: plan.choose_auto_settings turns it off there)."""
    if not cfg.compile:
        return
    start = time.perf_counter()
    model.compile_parts(cfg.compile_mode)
    # [Nc], [Nt] or [M, Nc], [M, Nt]
    context, target = mask_generator_from_config(cfg)(np.random.default_rng(0))
    volume = torch.zeros(batch_size, 1, *cfg.image_size, device=rt.device)
    context_idx, target_idx = (
        torch.from_numpy(i).to(rt.device).expand(batch_size, *i.shape) for i in (context, target)
    )
    with rt.autocast(cfg.use_bf16):
        out = model(volume, context_idx.contiguous(), target_idx.contiguous())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    log.print(
        f"compile: encoders, predictor and loss compiled in {time.perf_counter() - start:.1f} s"
        f" (mode {cfg.compile_mode})"
    )


def forward_backward(model, micro_batches: list, cfg: Config, rt: Runtime):
    """Accumulate gradients over the micro-batches; return (mean loss, mean target_std) as device
    tensors. `model`: VJEPA3D, or DDP around it (which then all-reduces the gradients in the last
    backward only)."""
    loss_sum, std_sum = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
    for i, batch in enumerate(micro_batches):
        accumulating = isinstance(model, DistributedDataParallel) and i < len(micro_batches) - 1
        with (
            model.no_sync() if accumulating else contextlib.nullcontext(),
            rt.autocast(cfg.use_bf16),
        ):
            out = model(batch["volume"], batch["context_idx"], batch["target_idx"])
            (out.loss / len(micro_batches)).backward()
        loss_sum += out.loss.detach()
        std_sum += out.target_std
    return loss_sum / len(micro_batches), std_sum / len(micro_batches)


def clip_and_measure(model: VJEPA3D, cfg: Config) -> torch.Tensor:
    """Pre-clip total grad norm of this update (all shards), measured before the step and zero_grad
    (incident 1)."""
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    return global_value(torch.nn.utils.clip_grad_norm_(params, max_norm))


@torch.no_grad()
def guarded_step(
    optimizer: torch.optim.Optimizer, apply: torch.Tensor, step: Callable[[], None]
) -> None:
    """step() (an optimizer update), kept only where `apply` (a 0-d bool tensor) is True: otherwise
    every weight and every optimizer state tensor keeps its old value exactly. Decided on the
    device, so XLA needs no host sync."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    old_params = [p.clone() for p in params]
    old_states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
    step()
    for p, old in zip(params, old_params):
        p.copy_(torch.where(apply, p, old))
    for p, old in zip(params, old_states):
        for key, value in optimizer.state[p].items():
            value.copy_(torch.where(apply, value, old[key]))


@dataclass
class UpdateResult:
    """One optimizer update's measurements, as device tensors (read by the host only at sync
    points)."""

    loss: torch.Tensor  # mean over micro-batches and replicas
    target_std: torch.Tensor
    grad_norm: torch.Tensor  # pre-clip total norm of this update
    applied: torch.Tensor  # bool; False when the NaN guard skipped the update
    # [loss, target_std, grad_norm, applied]: what the host reads at a sync point, in one go
    stats: torch.Tensor


def train_update(
    model, optimizer, micro_batches: list, hp: Hyperparameters, cfg: Config, rt: Runtime
) -> UpdateResult:
    """One optimizer update of `model` (VJEPA3D, or DDP around it): accumulate gradients, measure
    and clip the grad norm, step the optimizer and the EMA target. A non-finite loss or grad norm
    changes nothing (NaN guard, decided on the device: the update reads nothing on the host)."""
    raw_model = model.module if isinstance(model, DistributedDataParallel) else model
    lr, wd, ema = rt.update_scalars(hp.lr, hp.wd, hp.ema)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # compile_mode reduce-overhead: the last update's graph outputs are consumed, not its
    if raw_model.cudagraphs:
        # micro-batches' gradients (their graphs stay apart within one)
        torch.compiler.cudagraph_mark_step_begin()
    loss, target_std = forward_backward(model, micro_batches, cfg, rt)
    # same on all ranks
    loss, target_std = reduce_mean(torch.stack([loss, target_std]).float(), rt).unbind()
    # before optimizer.step() and zero_grad (incident 1)
    grad_norm = clip_and_measure(raw_model, cfg)
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
    # the fused AdamW skips itself: no copies, no host sync (CUDA runs ahead)
    if rt.adamw_options["fused"]:
        optimizer_step(optimizer, lr, wd, skip=~finite)
    else:  # XLA's AdamW (capturable) cannot skip itself: select old or new values
        guarded_step(optimizer, finite, lambda: optimizer_step(optimizer, lr, wd))
    # momentum 1 (no change) when skipped, on the device
    raw_model.update_target(torch.where(finite, ema, 1.0))
    optimizer.zero_grad(set_to_none=True)
    # before the XLA sync (no recompile)
    stats = torch.stack([loss, target_std, grad_norm.float(), finite.float()])
    return UpdateResult(loss, target_std, grad_norm, finite, stats)


# --------------------------------------------------------------------------------------------------
# The data of each update
# --------------------------------------------------------------------------------------------------


def train_loader(run: "Run"):
    """This process's training batches from the run's position to its end. The data order is a
    function of the position in updates, so a resume or a rollback continues it exactly."""
    plan, state, rt = run.plan, run.state, run.rt
    keys_per_update = plan.grad_accum_steps * run.local_batch
    position = state.step + state.data_skip
    epoch, update_in_epoch = divmod(position, plan.steps_per_epoch)
    last_position = plan.total_steps - 1 + state.data_skip
    return make_loader(
        run.train_ds,
        run.local_batch,
        train=True,
        workers=run.cfg.workers,
        rank=rt.process_index,
        world_size=rt.process_count,
        epoch=epoch,
        start=update_in_epoch * keys_per_update,
        seed=run.cfg.seed,
        epochs=last_position // plan.steps_per_epoch - epoch + 1,
        per_epoch=plan.steps_per_epoch * keys_per_update,
    )


def micro_batch_groups(loader, accum: int):
    """Yield lists of `accum` consecutive micro-batches (one optimizer update each)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []


def next_update_batches(groups, run: "Run") -> list:
    """The micro-batches of the next update. The files any process had to replace in them are
    logged, once each; too many bad files, or a NoUsableData in any process, stops every process
    with exit 3 (none is left waiting in a collective)."""
    try:
        micro_batches, error = next(groups, None), None
    except NoUsableData as e:
        micro_batches, error = None, str(e)
    skipped = [item for batch in micro_batches or [] for item in batch["skipped"]]
    # one small all-reduce
    (anything_to_report,) = any_process([bool(skipped) or error is not None], run.rt)
    reports = gather_objects((skipped, error), run.rt) if anything_to_report else []
    errors = [e for _, e in reports if e is not None]
    if errors:
        raise NoUsableData(errors[0])
    if micro_batches is None:
        raise RuntimeError(
            f"the loader ended before update {run.state.step}: the sampler yields fewer batches "
            "than plan_run counted"
        )
    for path, reason, detail in [item for skipped, _ in reports for item in skipped]:
        if path not in run.bad_files:
            run.bad_files[path] = reason
            run.log.event(
                "unreadable_file", run.state.step, path=path, reason=reason, detail=detail
            )
    total_files = len(run.train_ds) + len(run.val_ds)
    if len(run.bad_files) > run.cfg.max_bad_fraction * total_files:
        raise NoUsableData(
            f"{len(run.bad_files)} of {total_files} files failed during training, more than "
            f"max_bad_fraction {run.cfg.max_bad_fraction}:\n"
            f"{format_reason_table(Counter(run.bad_files.values()))}"
        )
    return micro_batches


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def validate(
    model: VJEPA3D, loader, volumes: int, cfg: Config, rt: Runtime, max_tokens: int = 4096
) -> dict:
    """Val loss (their mean), target_std (their target tokens), RankMe (a fixed set of each one's
    target-encoder tokens) and position share (all of those) of the run's `volumes` val volumes, the
    same on any process count."""
    model.eval()
    # the order of make_val_loader's volumes
    indices = iter(range(rt.process_index, volumes, rt.process_count))
    # then make_val_loader's padding, if any
    unseen = len(range(rt.process_index, volumes, rt.process_count))
    per_volume = math.ceil(max_tokens / max(1, volumes))
    # feats: (index, [per_volume, E])
    loss_sum, target_tokens, target_sums, token_sums, feats = 0.0, 0, 0.0, 0.0, []
    with model.eager():  # compiled parts are for the training update: no eval recompiles
        for batch in loader:
            batch = to_device(batch, rt)
            with rt.autocast(cfg.use_bf16):
                out = model(batch["volume"], batch["context_idx"], batch["target_idx"])
                tokens = model.encode(batch["volume"]).float().cpu()  # [B, N, E]
            # a padding batch: run only so that a sharded model's processes gather weights together
            if unseen <= 0:
                continue
            unseen -= len(tokens)
            target = out.target.float().cpu().double().flatten(0, -2)  # [B * Nt, E]
            loss_sum, target_tokens = (
                loss_sum + float(out.loss) * len(tokens),
                target_tokens + len(target),
            )
            token_sums = token_sums + position_sums(tokens)  # [2, N, E]
            target_sums = target_sums + torch.stack([target.sum(0), target.pow(2).sum(0)])  # [2, E]
            for volume_tokens, index in zip(tokens, indices):
                keep = torch.randperm(
                    len(volume_tokens), generator=torch.Generator().manual_seed(index)
                )[:per_volume]
                feats.append((index, volume_tokens[keep]))
    model.train()
    # DDP: + the other processes' (XLA: global)
    mine = (loss_sum, target_tokens, target_sums, feats, token_sums)
    parts = gather_objects(mine, rt) if rt.ddp else [mine]
    loss_sum, target_tokens, token_sums = (sum(p[i] for p in parts) for i in (0, 1, 4))
    feats = sorted((item for p in parts for item in p[3]), key=lambda item: item[0])
    if not feats:
        return {}
    s1, s2 = sum(p[2] for p in parts if p[1])  # [E] each
    target_std = ((s2 - s1**2 / target_tokens) / (target_tokens - 1)).clamp_min(0).sqrt().mean()
    return {
        "loss": loss_sum / len(feats),
        "target_std": float(target_std),
        "position_share": position_share_of_sums(token_sums, len(feats)),
        "rankme": rankme(torch.cat([f for _, f in feats])),
    }


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What the loop works with."""

    cfg: Config
    rt: Runtime
    plan: RunPlan
    train_ds: object
    val_ds: object
    model: Optional[VJEPA3D]  # None in a dry run
    optimizer: Optional[torch.optim.Optimizer]
    state: TrainState = field(default_factory=TrainState)
    # stored in every checkpoint: a resume checks it continues it
    plan_record: dict = field(default_factory=dict)
    log: Optional[RunLog] = None
    ddp_model: Optional[torch.nn.Module] = None  # what the update calls: model, or DDP around it
    val_loader: object = None
    probe_set: object = None
    last_ckpt: Optional[str] = None  # where a rollback returns to
    # for ckpt_every_minutes (the master's clock)
    last_ckpt_time: float = field(default_factory=time.monotonic)
    failed_ckpts: int = 0  # checkpoints in a row that could not be written
    bad_files: dict = field(default_factory=dict)  # path -> reason, of every process
    recent_grad_norms: List[float] = field(default_factory=list)
    # what compile and grad_checkpointing auto chose, and why
    auto_notes: List[str] = field(default_factory=list)

    @property
    def run_dir(self) -> str:
        """out_dir/run_name: config.yaml, metrics, events, plots (and checkpoints/ by default)."""
        return os.path.join(self.cfg.out_dir, self.cfg.run_name)

    @property
    def local_batch(self) -> int:
        """Volumes per micro-batch of this process (all of its devices on XLA)."""
        return self.plan.per_core_batch_size * self.rt.local_replicas

    @property
    def val_volumes(self) -> int:
        """The first val_batches x global_batch_size val volumes, the same on any number of
        processes (XLA: a multiple of the device count, as every device takes part in each forward);
        0 turns validation off."""
        volumes = min(len(self.val_ds), self.cfg.val_batches * self.plan.global_batch_size)
        return volumes - volumes % self.rt.replicas_per_forward

    @property
    def checkpoint_time_due(self) -> bool:
        """ckpt_every_minutes have passed since the last checkpoint, on the master's clock (the
        others say False)."""
        minutes = self.cfg.ckpt_every_minutes
        return (
            self.rt.is_master
            and minutes is not None
            and time.monotonic() - self.last_ckpt_time >= 60 * minutes
        )


def check_resumed_key_file(cfg: Config) -> None:
    """Before the data is keyed: a run that continues a checkpoint (--resume PATH, or auto where one
    was written) drew its split with this site's patient-key secret, so the key file must be there
    already: read, never created (a resume that is then refused leaves no new secret behind).
    Whether it holds that same secret, resumed_plan checks with the rest of the plan."""
    if cfg.resume in (None, "restart") or (
        cfg.resume == "auto" and not list_checkpoints(cfg.ckpt_dir)
    ):
        return  # a start from scratch: a scan of its data may create the key file
    try:
        site_secret()
    except ConfigError as e:
        raise ConfigError(
            f"resume: {cfg.resume} continues a run whose train/val split its patient keys drew,"
            f" which a new secret cannot continue: point {KEY_FILE_ENV} at the key file it started"
            f" with. {e}"
        ) from None


def prepare_run(cfg: Config, rt: Runtime) -> Run:
    """The data and train/val split (the same in every process), the plan, the model and optimizer
    (None: dry run)."""
    torch.manual_seed(cfg.seed)
    check_resumed_key_file(cfg)
    if uses_builtin_phantoms(cfg):  # the demo's data: written once, before the index reads it
        # here, not at the top: a run on real data never loads the thousand lines of eye drawing
        from phantom import ensure_builtin_phantoms

        ensure_builtin_phantoms(cfg)
    train_ds, val_ds = build_datasets(cfg)
    check_ranks_agree(
        split_fingerprint(train_ds, val_ds), "the train/val split (use an index_path)", rt
    )
    plan = plan_run(cfg, rt.world_size, len(train_ds))
    cfg, notes = choose_auto_settings(cfg, rt, plan.per_core_batch_size)  # decided for this device
    # whole, or sharded (shard: fsdp)
    model = None if cfg.dry_run else place_model(VJEPA3D.from_config(cfg), rt)
    return Run(
        cfg,
        rt,
        plan,
        train_ds,
        val_ds,
        model,
        None if cfg.dry_run else make_optimizer(model, cfg, rt),
        auto_notes=notes,
    )


def resume(run: Run) -> Tuple[Optional[dict], List[dict]]:
    """Restore the checkpoint that cfg.resume names, if any, in every process: weights, optimizer,
    position, RNG states and the plan it was written for (any change is refused; --extend lengthens
    it). Returns (the checkpoint or None, what the start did to the run's files:
    checkpoint.choose_resume_checkpoint). The later checkpoints that resuming an earlier one
    abandons are set aside only once the resume was accepted: a refusal changes nothing."""
    cfg, rt = run.cfg, run.rt
    run.last_ckpt, ckpt, set_aside = load_resume_checkpoint(cfg, rt)
    if ckpt is not None:
        if "plan" in ckpt:
            run.plan = resumed_plan(
                ckpt["plan"],
                cfg,
                run.plan,
                run.train_ds,
                run.val_ds,
                ckpt["train_state"]["step"],
                run.last_ckpt,
                ckpt.get("config"),
            )
        restore(ckpt, run.model, run.optimizer, run.state, rt, run.last_ckpt)
        check_ranks_agree(run.state.step, f"the update they resume {run.last_ckpt} at", rt)
    set_aside = master_decides(rt, carry_out, set_aside)
    run.plan_record = plan_record(cfg, run.plan, run.train_ds, run.val_ds)
    return ckpt, set_aside


def open_log(run: Run, ckpt: Optional[dict], set_aside: List[dict]) -> RunLog:
    """The run's log (written by the master only), opened with what the start of the run found.
    metrics.jsonl keeps only the updates before the resumed one (all of them on a start from
    scratch): the run logs the rest again."""
    cfg, rt, state, plan = run.cfg, run.rt, run.state, run.plan
    log = RunLog(run.run_dir, cfg, active=rt.is_master)
    for note in run.auto_notes:
        log.print(note)
    abandoned = [found["path"] for found in set_aside if found["event"] == "abandoned_checkpoint"]
    if abandoned:  # a deliberate rollback: it says what it moved, and how to go back
        log.print(
            f"resume {run.last_ckpt}: {len(abandoned)} later checkpoint(s) of the timeline left"
            " behind are set aside (renamed, not deleted; to go back to them, rename them back and"
            " --resume auto):"
        )
    for found in set_aside:  # stale tmp files removed, checkpoints set aside
        log.event(found["event"], state.step, **{k: v for k, v in found.items() if k != "event"})
        log.print(f"{found['path']}: {found['why']}")
    if cfg.resume == "auto" and ckpt is None:
        log.print(f"resume auto: no checkpoint in {cfg.ckpt_dir} yet; starting from scratch")
    if ckpt is not None:
        log.event("resume", state.step, path=run.last_ckpt)
        log.print(f"resumed from {run.last_ckpt} at update {state.step}")
        if "plan" not in ckpt:
            log.print(
                f"WARNING: {run.last_ckpt} records no plan (an older octjepa wrote it): the"
                " schedules follow this config's plan, which nothing could compare with the one"
                " the run started with"
            )
        extended_from = ckpt.get("plan", {}).get("total_steps", plan.total_steps)
        if extended_from < plan.total_steps:
            hp = hyperparameters_at(state.step, cfg, plan, state.lr_scale)
            log.event(
                "extend",
                state.step,
                from_total_steps=extended_from,
                to_total_steps=plan.total_steps,
                lr=hp.lr,
                schedule=cfg.extend_schedule,
                finished=state.step >= extended_from,
                ema_momentum=hp.ema,
            )
            log.print(
                describe_extension(
                    cfg, plan, state.step, extended_from, state.lr_scale, run.last_ckpt
                )
            )
    log.drop_metrics_after(state.step)
    if log.active:
        save_config(cfg, os.path.join(run.run_dir, "config.yaml"))
        if cfg.ckpt_dir is None:
            log.print("ckpt_dir is null: no checkpoints will be written for this run")
        if cfg.data_root is None:
            log.print(
                f"data_root is null: training on the built-in phantom set in {cfg.phantom_dir}"
            )
        if run.val_volumes == 0:
            log.print(
                f"validation is off: the val split holds {len(run.val_ds)} volumes, fewer than the "
                f"{rt.world_size} devices; raise val_fraction or the dataset size"
            )
        log.print(
            f"run {run.run_dir}: {plan.total_steps} updates of {plan.global_batch_size} volumes on "
            f"{rt.kind} x {rt.world_size}, {run.model.num_trainable_params():,} parameters"
        )
    return log


def train(cfg: Config, rt: Runtime) -> int:
    """Pretrain for the run's plan (or only print the dry run's report); returns the exit code, or
    raises ExitError."""
    run = prepare_run(cfg, rt)
    if cfg.dry_run:  # preflight (incident 9): the report and pictures; nothing trains
        if rt.is_master:
            dry_run_report(
                run.cfg, run.plan, run.train_ds, run.val_ds, rt, run.run_dir, run.auto_notes
            )
        return EXIT_OK
    ckpt, set_aside = resume(run)
    run.log = open_log(run, ckpt, set_aside)
    with StopSignals() as signals:  # from here on a preemption loses no completed update
        # its compile decided for this device
        compile_model(run.model, run.local_batch, run.cfg, rt, run.log)
        # after the restore: DDP starts every process from the same weights
        run.ddp_model = wrap_ddp(run.model, rt)
        if cfg.probe_every_steps is not None and probes_in_this_process(rt):
            # (imported where a run probes: see probe_and_log)
            from runprobe import prepare_probe_set

            run.probe_set = prepare_probe_set(cfg)  # loaded once; features recomputed at each probe
        if run.val_volumes:
            run.val_loader = make_val_loader(
                run.val_ds,
                run.val_volumes,
                run.local_batch,
                workers=cfg.workers,
                rank=rt.process_index,
                process_count=rt.process_count,
            )
        # XLA: update 1 then compiles the graph that every later update reuses
        materialize_state(run.model, rt)
        # collective
        run.log.device_memory(
            run.state.step, state_bytes_per_device(run.model, run.optimizer, rt), rt
        )
        train_loop(run, signals)
        finish(run, signals)
    return EXIT_OK


def train_loop(run: Run, signals: StopSignals) -> None:
    """The updates from the run's position to its end; a stop signal in any process ends them in all
    (Preempted)."""
    cfg, rt, state, plan = run.cfg, run.rt, run.state, run.plan
    pending, speed = PendingDeviceStats(rt), Throughput()
    bar = tqdm(
        total=plan.total_steps,
        initial=state.step,
        disable=not (rt.is_master and sys.stderr.isatty()),
        unit="update",
        dynamic_ncols=True,
    )

    # --- the loop: one iteration = one optimizer update ---
    while state.step < plan.total_steps:
        # One loader (one set of workers) for the rest of the run; rebuilt only after a rollback.
        groups = micro_batch_groups(train_loader(run), plan.grad_accum_steps)
        for _ in range(plan.total_steps - state.step):
            t0 = time.perf_counter()
            micro_batches = next_update_batches(groups, run)
            speed.data_time += time.perf_counter() - t0

            # One optimizer update: schedules first, as pure functions of the update count.
            hp = hyperparameters_at(state.step, cfg, plan, state.lr_scale)
            update = train_update(
                run.ddp_model, run.optimizer, [to_device(b, rt) for b in micro_batches], hp, cfg, rt
            )
            mark_step(rt)
            pending.add(
                update.stats,
                step=state.step,
                lr=hp.lr,
                files=[p for b in micro_batches for p in b["path"]],
            )
            state.step += 1
            speed.updates += 1
            bar.update(1)
            # Every process says whether it got a stop signal (one small all-reduce): all stop here,
            # or none.
            stop, time_due, lost = any_process(
                [bool(signals.received), run.checkpoint_time_due, lease_lost()], rt
            )
            # another process took the run folder over (lock.py): nothing more is written
            stop_if_taken_over(lost)
            is_last = state.step == plan.total_steps
            is_log = state.step % cfg.log_every_steps == 0 or is_last or state.step == 1
            is_val = run.val_loader is not None and (
                state.step % cfg.val_every_steps == 0 or is_last
            )
            is_ckpt = cfg.ckpt_dir is not None and (
                state.step % cfg.ckpt_every_steps == 0 or is_last or time_due or stop
            )
            is_probe = run.probe_set is not None and (
                state.step % cfg.probe_every_steps == 0 or is_last
            )
            if not (is_log or is_val or is_ckpt or is_probe or pending.read_every_update or stop):
                continue

            # --- the host reads what the device did: every update on CPU/CUDA, only here on XLA ---
            newest = count_skipped_updates(pending.read(), run)
            if state.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                rollback(run, hp.lr)
                bar.reset(total=plan.total_steps)
                bar.update(state.step)
                break  # restart the data loader at the new position
            if is_log:
                record = log_train(run, newest, hp, speed)
                bar.set_postfix(loss=record["loss"], lr=f"{hp.lr:.2e}")
            # best.pt is judged only on a validation of these weights
            best = is_val and validate_and_log(run)
            if is_probe:
                probe_and_log(run)
            # a new best val loss is checkpointed at once
            if is_ckpt or (best and cfg.ckpt_dir is not None):
                save(run, best, final=is_last or stop)
            if stop:
                bar.close()
                raise preempted(run, gather_objects(signals.received, rt))
    bar.close()


def preempted(run: Run, signals: List[Optional[str]]) -> Preempted:
    """Log the stop (the checkpoint of this update is written) and return the Preempted error that
    ends the run."""
    cfg, step = run.cfg, run.state.step
    # events.jsonl says which process got which
    got = " and ".join(sorted({name for name in signals if name}))
    saved = run.last_ckpt if cfg.ckpt_dir is not None else None
    run.log.event("preempted", step, signals=signals, checkpoint=saved)
    run.log.close()
    resume_with = (
        f"The same command with --run_name {cfg.run_name} --resume auto continues from update"
        f" {step}"
        if saved
        else "ckpt_dir is null, so no checkpoint was written: --resume restart starts it over"
    )
    return Preempted(
        f"{got} at update {step} of {run.plan.total_steps}; checkpoint {saved}. {resume_with}."
    )


def count_skipped_updates(read: list, run: Run) -> dict:
    """Count and log the updates the NaN guard skipped among those just read from the device
    ((notes, stats) pairs); returns the newest update's loss, target_std and grad_norm."""
    for notes, (loss, target_std, grad_norm, applied) in read:
        run.recent_grad_norms = (run.recent_grad_norms + [grad_norm])[-10:]
        if applied:
            run.state.consecutive_nonfinite = 0
        else:  # the NaN guard left weights and optimizer state untouched; the data moved on
            run.state.nonfinite_skipped += 1
            run.state.consecutive_nonfinite += 1
            run.log.event(
                "nonfinite_skipped",
                notes["step"],
                lr=notes["lr"],
                loss=json_number(loss),
                grad_norm=json_number(grad_norm),
                files=notes["files"],
            )
    return {"loss": loss, "target_std": target_std, "grad_norm": grad_norm}


def log_train(run: Run, newest: dict, hp: Hyperparameters, speed: Throughput) -> dict:
    """Write the train metrics line of the current update (and its console line); returns the
    record."""
    state, plan = run.state, run.plan
    record = {
        "split": "train",
        "step": state.step,
        "epoch": (state.step - 1 + state.data_skip) // plan.steps_per_epoch,
        "loss": newest["loss"],
        "lr": hp.lr,
        "wd": hp.wd,
        "ema_momentum": hp.ema,
        "grad_norm": newest["grad_norm"],
        "target_std": newest["target_std"],
        "nonfinite_skipped": state.nonfinite_skipped,
        **speed.rates(plan.global_batch_size),
        **run.rt.compiler_counters(),
    }
    run.log.metrics(record)
    run.log.print(format_train_line(record, plan))
    speed.reset()
    return record


def validate_and_log(run: Run) -> bool:
    """Validate the current weights and log the result; True when the val loss is the best of the
    run so far."""
    metrics = validate(run.model, run.val_loader, run.val_volumes, run.cfg, run.rt)
    if not metrics:
        return False
    step = run.state.step
    run.log.metrics({"split": "val", "step": step, **metrics})
    run.log.print(
        f"val   step {step:>6d} | loss {metrics['loss']:.4f} | target_std"
        f" {metrics['target_std']:.4f} | rankme {metrics['rankme']:.1f} | position share"
        f" {metrics['position_share']:.3f}"
    )
    best = metrics["loss"] < run.state.best_val_loss
    run.state.best_val_loss = min(run.state.best_val_loss, metrics["loss"])
    return best


def probe_and_log(run: Run) -> None:
    """Probe the target encoder on the labelled probe set (probe_every_steps) and log the scores."""
    # Imported here, not at the top: scikit-learn and SciPy take over a second to import, which each
    # run that does not probe (a smoke test, every process of a sharded run, a dry run) would pay at
    # its start.
    from runprobe import probe_auroc

    scores = probe_auroc(run.model, run.probe_set, run.rt.device)
    run.log.metrics({"split": "probe", "step": run.state.step, **scores})
    run.log.print(
        f"probe step {run.state.step:>6d} | auroc {scores['probe_auroc']:.3f} (mean-pool),"
        f" {scores['probe_rows_auroc']:.3f} (depth rows) | balanced accuracy"
        f" {scores['probe_bal_acc']:.3f}"
    )


def save(run: Run, best: bool, final: bool = False) -> None:
    """Checkpoint the current update (and best.pt when `best`) in every process. A failed write (a
    transient error after ckpt_retry_minutes of retries, a permanent one at once) is skipped
    (checkpoint_failed event); a second failure in a row, or a failed `final` checkpoint (end of
    run, preemption), stops every process (exit 74)."""
    cfg, state, log = run.cfg, run.state, run.log
    path, start = checkpoint_path(cfg.ckpt_dir, state.step), time.monotonic()
    error = checkpoint_everywhere(
        path,
        run.model,
        run.optimizer,
        state,
        run.plan_record,
        cfg,
        run.rt,
        best,
        lambda e, pause: log.print(f"checkpoint {path}: {e!r}; again in {pause:.0f} s"),
    )
    run.last_ckpt_time = time.monotonic()
    if error is None:
        run.last_ckpt, run.failed_ckpts = path, 0
        log.event(
            "checkpoint",
            state.step,
            path=path,
            best=best,
            seconds=round(run.last_ckpt_time - start, 2),
        )
        return
    run.failed_ckpts += 1
    log.event("checkpoint_failed", state.step, path=path, error=error)
    if final or run.failed_ckpts > 1:
        which = (
            "the checkpoint of the run's last update" if final else "a second checkpoint in a row"
        )
        raise StorageFailed(
            f"{which}, {path}, could not be written: {error}. The last checkpoint written is "
            f"{run.last_ckpt or 'none'}; run the same command with --resume auto when the storage "
            "is back."
        )
    log.print(
        f"WARNING: checkpoint {path} skipped ({error}); training goes on from "
        f"{run.last_ckpt or 'no checkpoint'}; a second failure in a row stops the run (exit 74)"
    )


def rollback(run: Run, lr: float) -> None:
    """After max_consecutive_nonfinite skipped updates: reload the last good checkpoint, lower the
    LR and skip past the offending batches; raise Diverged when that is impossible or max_rollbacks
    is used up."""
    cfg, state, log = run.cfg, run.state, run.log
    diagnosis = (
        f"step {state.step}: {state.consecutive_nonfinite} non-finite updates in a row at lr"
        f" {lr:.3g}; recent grad norms {[round(g, 4) for g in run.recent_grad_norms]}; last good"
        f" checkpoint: {run.last_ckpt or 'none'}; rollbacks used"
        f" {state.rollbacks}/{cfg.max_rollbacks}."
    )
    if run.last_ckpt is None or state.rollbacks >= cfg.max_rollbacks:
        log.event(
            "diverged",
            state.step,
            lr=lr,
            grad_norms=run.recent_grad_norms,
            last_good_checkpoint=run.last_ckpt,
        )
        raise Diverged(
            diagnosis
            + "\nCheck the data named in events.jsonl; resume with a larger --max_rollbacks (each "
            "rollback multiplies the LR by rollback_lr_factor), or start a new run with a lower "
            "base_lr (measure one with `python sanity.py --lr_sweep`)."
        )
    failed_at = state.step + state.data_skip
    # load_state_dict moves them to the device
    ckpt = read_checkpoint(run.last_ckpt, 60 * cfg.ckpt_retry_minutes)
    rollbacks, lr_scale, skipped = (
        state.rollbacks + 1,
        state.lr_scale * cfg.rollback_lr_factor,
        state.nonfinite_skipped,
    )
    restore(ckpt, run.model, run.optimizer, state, run.rt, run.last_ckpt)
    state.rollbacks, state.lr_scale, state.nonfinite_skipped = rollbacks, lr_scale, skipped
    state.consecutive_nonfinite = 0
    state.data_skip = failed_at - state.step  # resume the data after the batches that failed
    log.drop_metrics_after(state.step)  # the updates after the checkpoint are logged again
    log.event(
        "rollback",
        state.step,
        checkpoint=run.last_ckpt,
        lr_scale=lr_scale,
        rollbacks=rollbacks,
        data_skip=state.data_skip,
    )
    log.print(
        f"rollback {rollbacks}/{cfg.max_rollbacks} to {run.last_ckpt}: lr x{lr_scale:g}, "
        f"skipping {state.data_skip} updates' worth of data"
    )


def finish(run: Run, signals: StopSignals) -> None:
    """The end of the run: the verdict (summary_probe: does the encoder beat a random init and
    hand-made features?), training.png, the summary. A stop signal during the probe (or since the
    last update) ends the run as one in the loop does (Preempted)."""
    cfg, log = run.cfg, run.log
    result = None
    if cfg.summary_probe and probes_in_this_process(run.rt):
        try:
            with signals.at_once():
                # (imported where a run probes: see probe_and_log)
                from runprobe import prepare_probe_set, verdict

                result = verdict(
                    run.model, cfg, run.probe_set or prepare_probe_set(cfg), run.rt.device
                )
        except StopRequested:
            raise preempted(run, [signals.received]) from None
        log.event("summary_probe", run.state.step, **result)
    if log.active:
        save_training_plot(log.history, os.path.join(run.run_dir, "training.png"))
        log.print(summary(log.history, run.run_dir, cfg, run.state, result))
    log.close()


@script_main
def main(argv: List[str]) -> int:
    """Train with the config of a command line (`--config FILE`, `--field value`); returns the exit
    code."""
    _, flags = ScriptParser(__doc__, prog="train.py").parse(argv)
    cfg = load_config(flags or DEMO_FLAGS)
    rt = setup_runtime(cfg)
    # one run name and checkpoint folder for every process
    cfg = master_decides(rt, resolve_run_dir, cfg)
    # writable (and, over several machines, shared), before anything trains
    check_checkpoint_folder(cfg, rt)
    with run_folder_lock(cfg, rt):  # one process at a time in a run folder
        return train(cfg, rt)


if __name__ == "__main__":
    sys.exit(main())
