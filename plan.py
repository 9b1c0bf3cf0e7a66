"""What a run will cost before it starts: the dry run's report (sizes, tokens, FLOPs, the memory
table per device and per fsdp size, the recipe's cost, the masks and the schedules at milestones)
and the device policy that decides `compile` and `grad_checkpointing` where they say auto (incident
9: no run learns its size by running out of memory)."""

import os
from dataclasses import replace
from typing import List, Tuple

import torch

from config import Config, RunPlan
from masks import describe_masks, mask_generator_from_config, mask_stats
from model import VJEPA3D, activation_bytes_per_sample, memory_per_device, training_flops_per_sample
from runlog import save_mask_plot, save_schedule_plot, size_text
from runtime import device_memory_bytes
from schedules import hyperparameters_at


def describe_run(
    cfg: Config, plan: RunPlan, train_ds, val_ds, rt, schedules: list, masks: str
) -> str:
    """The dry run's preflight report: sizes, tokens, FLOPs, memory, the masks (`masks`:
    masks.describe_masks's lines) and the schedules (schedules.Hyperparameters of every update) at
    milestones."""
    # the model's shapes only: no memory for weights (a ViT-g's would fill a laptop)
    with torch.device("meta"):
        model = VJEPA3D.from_config(cfg)
    n_context, n_target = cfg.token_counts()
    flops = training_flops_per_sample(cfg)
    params = model.num_trainable_params()
    fsdp = (cfg.fsdp_size or rt.world_size) if cfg.shard == "fsdp" else 1
    lines = [
        f"device            {rt.kind} x {rt.world_size} replica(s), {rt.process_count} process(es)",
        f"data              {len(train_ds)} train / {len(val_ds)} val volumes",
        (
            f"batch             global {plan.global_batch_size} = {plan.per_core_batch_size} per"
            f" replica x {plan.world_size} replicas x {plan.grad_accum_steps} accumulation"
        ),
        (
            f"updates           {plan.total_steps} ({plan.steps_per_epoch}/epoch), warmup"
            f" {plan.warmup_steps}"
        ),
        (
            f"parameters        {params:,} trainable (encoder + predictor), plus the EMA target"
            " encoder"
        ),
        (
            f"tokens/sample     {n_context + n_target} (grid {cfg.grid_size()}): {n_context}"
            f" context, {n_target} target"
        ),
        (
            f"FLOPs/sample      {flops['total'] / 1e9:.2f} GFLOP per training step (context"
            f" {flops['context_encoder'] / 1e9:.2f}, predictor {flops['predictor'] / 1e9:.2f},"
            f" target {flops['target_encoder'] / 1e9:.2f})"
        ),
        describe_memory(cfg, model, fsdp, plan.per_core_batch_size),
    ]
    if cfg.patch_stem != "linear" or cfg.local_loss_weight > 0:
        lines.append(describe_recipe_cost(cfg, rt.kind))
    lines.append(masks)
    geometry = getattr(train_ds, "geometry_report", None)
    if callable(geometry):
        lines.append(geometry())
    lines.append("schedule          step      lr         wd       ema")
    for step in sorted({0, plan.warmup_steps, plan.total_steps // 2, plan.total_steps - 1}):
        s = schedules[step]
        lines.append(f"                  {step:<9d} {s.lr:<10.3g} {s.wd:<8.3g} {s.ema:.5f}")
    return "\n".join(lines)


# The recipe's update time over the linear stem without the local loss, as bench.py measured it
# interleaved in one process (`python bench.py train --config CONFIG --variants eager,linear`), by the
# sizes it was measured at (image_size, patch_size, embed_dim, depth, stem_cell, stem_width) and
# device kind:
# (ratio, how it was measured), of the hmlp stem with the local loss. Where a config's sizes are not
# here, the dry run says so.
MEASURED_RECIPE_TIME = {
    ((64, 384, 384), (4, 16, 16), 384, 12, (1, 4, 4), 0.5, "cpu"): (
        1.00,
        "median of 3, fp32, batch 1, pretrain_single_domain.yaml; docs/performance.md",
    ),
    ((64, 384, 384), (4, 16, 16), 1024, 24, (1, 4, 4), 0.5, "cpu"): (
        1.15,
        "median of 3 pairs in 2 runs, 1.05x to 1.17x, fp32, batch 1, grad checkpointing,"
        " pretrain_vitl.yaml, on a CPU of 323-329 GFLOP/s fp32 matmuls; 1.01x on one of 88: the"
        " stem's share grows with the matmul speed; docs/performance.md",
    ),
}


def describe_recipe_cost(cfg: Config, device_kind: str) -> str:
    """The dry run's line of what the recipe (the hmlp stem, the local loss) costs over a linear
    stem without the local loss at the same sizes: FLOPs per sample, the activations kept for
    backward per sample, and the update's time where bench.py measured it at these sizes on this
    kind of device (MEASURED_RECIPE_TIME), else the bench.py command that measures it."""
    plain = replace(cfg, patch_stem="linear", local_loss_weight=0.0)
    flops, plain_flops = (
        training_flops_per_sample(cfg)["total"],
        training_flops_per_sample(plain)["total"],
    )
    extra = activation_bytes_per_sample(cfg) - activation_bytes_per_sample(plain)
    sizes = (
        tuple(cfg.image_size),
        tuple(cfg.patch_size),
        cfg.embed_dim,
        cfg.depth,
        tuple(cfg.stem_cell),
        cfg.stem_width,
        device_kind,
    )
    flags = (
        f"--image_size {','.join(map(str, cfg.image_size))} --patch_size"
        f" {','.join(map(str, cfg.patch_size))} --embed_dim {cfg.embed_dim} --depth {cfg.depth}"
        f" --num_heads {cfg.num_heads} --pred_embed_dim {cfg.pred_embed_dim} --pred_depth"
        f" {cfg.pred_depth} --pred_num_heads {cfg.pred_num_heads} --stem_cell"
        f" {','.join(map(str, cfg.stem_cell))} --stem_width {cfg.stem_width:g}"
    )
    time = (
        f"measured {MEASURED_RECIPE_TIME[sizes][0]:.2f}x the time ({MEASURED_RECIPE_TIME[sizes][1]})"
        if sizes in MEASURED_RECIPE_TIME and cfg.patch_stem == "hmlp" and cfg.local_loss_weight > 0
        else (
            f"its time not measured at these sizes on {device_kind}: python bench.py train"
            f" --variants eager,linear {flags} --per_core_batch_size 1 --warmup 1 --repeats 2"
        )
    )
    return (
        f"recipe cost       {cfg.patch_stem} stem"
        + (
            f" from {'x'.join(map(str, cfg.stem_cell))} cells through"
            f" {round(cfg.embed_dim * cfg.stem_width)} channels"
            if cfg.patch_stem == "hmlp"
            else ""
        )
        + f", local loss {cfg.local_loss_weight:g}:"
        f" {flops / plain_flops:.2f}x the FLOPs (+{(flops - plain_flops) / 1e9:.1f} GFLOP) and"
        f" +{extra / 2**30:.2f} GiB of activations per sample over a linear stem without the"
        f" local loss; {time}"
    )


def dry_run_report(
    cfg: Config, plan: RunPlan, train_ds, val_ds, rt, run_dir: str, notes: List[str]
) -> None:
    """The dry run (incident 9): print the preflight report (the auto settings' `notes`, then
    describe_run's) and save schedules.png and mask.png in run_dir; nothing trains."""
    os.makedirs(run_dir, exist_ok=True)
    schedules = [hyperparameters_at(step, cfg, plan) for step in range(plan.total_steps)]
    masks = mask_generator_from_config(cfg)
    print(
        "\n".join(
            notes
            + [describe_run(cfg, plan, train_ds, val_ds, rt, schedules, describe_masks(masks))]
        )
    )
    save_schedule_plot(
        {
            "lr": [s.lr for s in schedules],
            "weight decay": [s.wd for s in schedules],
            "EMA momentum": [s.ema for s in schedules],
        },
        os.path.join(run_dir, "schedules.png"),
    )
    save_mask_plot(train_ds[(0, 0)], cfg, mask_stats(masks), os.path.join(run_dir, "mask.png"))
    print(f"dry run: nothing trained; schedule and mask pictures in {run_dir}/")


# Memory of some accelerators (GiB), for the dry run's "fits / will not fit".
DEVICE_MEMORY_GIB = {
    "TPU v5e": 16,
    "L4": 24,
    "TPU v4": 32,
    "TPU v6e": 32,
    "A100 40GB": 40,
    "H100": 80,
    "TPU v5p": 95,
    "H200": 141,
}


# share of a device's memory a run may plan to use (the rest: runtime, compiler, fragmentation)
HEADROOM = 0.9


def describe_memory(cfg: Config, model, fsdp: int, batch: int) -> str:
    """The dry run's memory lines: model.memory_per_device with the weights sharded over `fsdp`
    devices at `batch` volumes per device, the named devices that fits (using HEADROOM of them) and
    will not fit, and the totals of other fsdp sizes."""
    parts = memory_per_device(cfg, model, fsdp, batch)
    total = sum(parts.values())
    named = {
        f"{name} ({size} GiB)": total <= HEADROOM * size * 2**30
        for name, size in DEVICE_MEMORY_GIB.items()
    }
    fits, too_small = [n for n, ok in named.items() if ok], [n for n, ok in named.items() if not ok]
    verdict = (
        f"will NOT fit {', '.join(too_small)}" + (f"; fits {', '.join(fits)}" if fits else "")
        if too_small
        else f"fits every named device, the smallest {fits[0]}"
    ) + f" (using {HEADROOM:.0%} of a device)"
    others = ", ".join(
        f"{n}: {size_text(sum(memory_per_device(cfg, model, n, batch).values()))}"
        for n in (1, 2, 4, 8, 16, 32, 64)
    )
    return "\n".join(
        [
            f"memory/device     ~{size_text(total)} at batch {batch} per device, "
            + (
                f"weights sharded over {fsdp} devices (shard: fsdp)"
                if fsdp > 1
                else "weights not sharded"
            ),
            (
                f"                  weights {size_text(parts['weights'])}, gradients"
                f" {size_text(parts['gradients'])}, AdamW {size_text(parts['adamw'])}, EMA target"
                f" {size_text(parts['ema_target'])}, gathered whole {size_text(parts['gathered'])},"
                f" activations {size_text(parts['activations'])}"
                f" ({size_text(activation_bytes_per_sample(cfg))}/sample)"
            ),
            f"                  {verdict}",
            f"by fsdp size      per device at batch {batch}: {others}",
        ]
    )


# The activation estimate was 0.7x the measured peak at ViT-L without checkpointing (14.5 GiB
# against 20.2 GiB, bf16, batch 2, one H100; shared/gpu-figures.md): auto plans with the estimate
# times this.
AUTO_MEMORY_MARGIN = 1.5


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS says, else the machine's
    count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_auto_settings(cfg: Config, rt, batch: int) -> Tuple[Config, List[str]]:
    """cfg with `compile` and `grad_checkpointing` decided where they say auto, for this run's
    device (rt) at `batch` volumes per device, and a console line for each decision saying what and
    why. compile: on CUDA only (fewer, fused kernels; on the CPU it bought 3-9% for minutes of
    compiling), and never on XLA, which compiles the whole update itself (a `compile: true` there is
    turned off with a line). workers: at most the CPU cores this process may use (more would only
    contend: torch warns of it). grad_checkpointing: off where the memory estimate without it
    (memory_per_device, times AUTO_MEMORY_MARGIN) fits HEADROOM of the device's memory (a device
    that does not say: the smallest of DEVICE_MEMORY_GIB), else on."""
    notes, changes = [], {}
    cores = usable_cores()
    if cfg.workers > cores:
        changes["workers"] = cores
        notes.append(
            f"workers {cfg.workers} -> {cores}: this machine gives the run {cores} CPU cores (the"
            " config's workers is an upper bound; --workers N to choose)"
        )
    if cfg.compile is True and rt.kind == "xla":
        changes["compile"] = False
        notes.append("compile: ignored on xla (XLA compiles the whole update by itself)")
    if cfg.compile == "auto":
        changes["compile"] = rt.kind == "cuda"
        why = {
            "cuda": "on CUDA: fused kernels, fewer launches",
            "cpu": "on the CPU it buys 3-9% for its compile time",
            "xla": "XLA compiles the whole update itself",
        }[rt.kind]
        notes.append(
            f"compile auto -> {'on' if changes['compile'] else 'off'} ({why}; --compile true/false"
            " to choose)"
        )
    if cfg.grad_checkpointing == "auto":
        with torch.device("meta"):
            model = VJEPA3D.from_config(cfg)
        need = {
            on: sum(
                memory_per_device(
                    replace(cfg, grad_checkpointing=on), model, rt.fsdp_size, batch
                ).values()
            )
            for on in (False, True)
        }
        memory, device = device_memory_bytes(rt)
        if memory is None:
            name, size = min(DEVICE_MEMORY_GIB.items(), key=lambda item: item[1])
            memory, device = size * 2**30, f"{device}, planned as a {name}"
        budget = HEADROOM * memory
        changes["grad_checkpointing"] = on = AUTO_MEMORY_MARGIN * need[False] > budget
        verdict = (
            f"{'does not fit' if on else 'fits'} {HEADROOM:.0%} of {device} ({size_text(memory)})"
            + (
                f"; with it ~{size_text(need[True])}"
                + (
                    " (will NOT fit either: shard, or a smaller batch)"
                    if need[True] > budget
                    else ""
                )
                if on
                else ""
            )
        )
        notes.append(
            f"grad_checkpointing auto -> {'on' if on else 'off'}: ~{size_text(need[False])} per"
            f" device without it at batch {batch} (x{AUTO_MEMORY_MARGIN} margin:"
            f" {size_text(AUTO_MEMORY_MARGIN * need[False])}) {verdict}"
        )
    return replace(cfg, **changes), notes
