"""The schedules of a run: LR, weight decay and EMA momentum as pure functions of the
optimizer-update count (incidents 2, 3): no state, no restarts. One linear warmup and cosine per
segment of the run (its first plan; the updates an `--extend_schedule rewarm` added), stretched over
the longer run by `--extend_schedule stretch`. train.py reads them for every update; sanity.py
checks their shape; --dry_run plots them.
"""

import math
from dataclasses import dataclass

from config import Config, RunPlan


def cosine_ramp(step: float, start_step: int, end_step: int, start: float, end: float) -> float:
    """Half-cosine from `start` at start_step to `end` at end_step; holds `end` afterwards."""
    if step >= end_step:
        return end
    progress = max(0.0, (step - start_step) / max(1, end_step - start_step))
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * progress))


@dataclass
class Segment:
    """The part of a run one warmup+cosine schedule spans: the first plan, or the updates an
    `--extend_schedule rewarm` added. `clock` is an update on the segment's own clock: each later
    `--extend_schedule stretch` stretched what was left of the segment over the longer run, so its
    schedules continue from the values they had (a finished run holds its final values)."""

    start: int  # its first update
    end: int  # the run length it was planned for (its schedules end at update end - 1)
    warmup: int
    clock: float


def schedule_segment(step: int, plan: RunPlan) -> Segment:
    """The schedule segment that update `step` is in, with the update on that segment's clock."""
    start, end, warmup, stretches = 0, plan.planned_steps, plan.warmup_steps, []
    for extension in plan.extensions:  # [at_step, old_total, new_total] (+ "rewarm"), oldest first
        at, old_total, new_total = extension[:3]
        if extension[3:] == ["rewarm"]:
            if step < at:
                break
            start, end, warmup, stretches = (
                at,
                new_total,
                max(1, min(plan.warmup_steps, (new_total - at) // 2)),
                [],
            )
        else:
            stretches.append((at, old_total, new_total))
    clock = float(step)
    for at, old_total, new_total in reversed(stretches):
        if clock > at:
            clock = at + (clock - at) * max(0, old_total - 1 - at) / (new_total - 1 - at)
    return Segment(start, end, warmup, clock)


def lr_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """LR of update number `step` (0-based): linear warmup to base_lr, cosine to min_lr, then
    min_lr. The first update (step 0) already uses a non-zero LR: base_lr / warmup_steps. A rewarm
    segment warms up from the LR where the run was (never a jump: incident 2)."""
    if cfg.schedule == "constant":
        return cfg.base_lr
    seg = schedule_segment(step, plan)
    if seg.clock - seg.start < seg.warmup:
        from_lr = 0.0 if seg.start == 0 else lr_at(seg.start - 1, cfg, plan)
        return from_lr + (cfg.base_lr - from_lr) * (seg.clock - seg.start + 1) / seg.warmup
    return cosine_ramp(seg.clock, seg.start + seg.warmup, seg.end - 1, cfg.base_lr, cfg.min_lr)


def wd_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """Weight decay of update `step`: cosine from weight_decay to weight_decay_end (constant when
    None)."""
    end = cfg.weight_decay if cfg.weight_decay_end is None else cfg.weight_decay_end
    seg = schedule_segment(step, plan)
    return cosine_ramp(seg.clock, seg.start, seg.end - 1, cfg.weight_decay, end)


def ema_at(step: int, cfg: Config, plan: RunPlan) -> float:
    """EMA momentum of the target update after update `step`: from ema_base to ema_end, cosine or
    linear."""
    seg = schedule_segment(step, plan)
    if cfg.ema_schedule == "linear":
        progress = min(1.0, (seg.clock - seg.start) / max(1, seg.end - 1 - seg.start))
        return cfg.ema_base + (cfg.ema_end - cfg.ema_base) * progress
    return cosine_ramp(seg.clock, seg.start, seg.end - 1, cfg.ema_base, cfg.ema_end)


@dataclass
class Hyperparameters:
    """The schedules' values for one optimizer update."""

    lr: float
    wd: float
    ema: float


def hyperparameters_at(
    step: int, cfg: Config, plan: RunPlan, lr_scale: float = 1.0
) -> Hyperparameters:
    """LR (times the rollbacks' lr_scale), weight decay and EMA momentum of update `step`."""
    return Hyperparameters(
        lr_at(step, cfg, plan) * lr_scale, wd_at(step, cfg, plan), ema_at(step, cfg, plan)
    )


def describe_extension(
    cfg: Config, plan: RunPlan, step: int, extended_from: int, lr_scale: float, resumed_from: str
) -> str:
    """The console line of an --extend at update `step` of a run planned for `extended_from` updates
    (resumed from the checkpoint `resumed_from`): what the LR, weight decay and EMA momentum do over
    the added updates."""
    now, end = (hyperparameters_at(s, cfg, plan, lr_scale) for s in (step, plan.total_steps - 1))
    head = f"extend: {extended_from} -> {plan.total_steps} updates from update {step}"
    if cfg.extend_schedule == "rewarm":
        return (
            f"{head} (rewarm): the LR warms up from {now.lr:.3g} to base_lr {cfg.base_lr:g} over"
            f" {schedule_segment(step, plan).warmup} updates, then falls along a cosine to"
            f" {end.lr:.3g}; weight decay and the EMA momentum ramp again from {now.wd:.3g} and"
            f" ema_base {now.ema:g} to {end.wd:.3g} and {end.ema:g}, as in a new run"
        )
    if step < extended_from:
        return (
            f"{head}: the LR continues from {now.lr:.3g} and the schedules stretch over the longer"
            f" run (LR {end.lr:.3g}, EMA momentum {end.ema:g} at its end)"
        )
    frozen = ": the target encoder no longer moves" if now.ema >= 1 else ""
    return (
        f"{head}: the run had finished, so its schedules hold their final values: LR {now.lr:.3g},"
        f" weight decay {now.wd:.3g}, EMA momentum {now.ema:g}{frozen}. These updates are a"
        " cool-down at the final LR. To keep learning instead, stop and run again with --resume"
        f" {resumed_from} --extend true --extend_schedule rewarm (a new warmup to base_lr and"
        " cosine over the added updates, the EMA from ema_base again)."
    )
