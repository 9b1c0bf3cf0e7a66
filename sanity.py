"""A one-minute CPU check before a long run: every failure of docs/incidents.md that can be caught
without the real data or hardware.

    python sanity.py [--config FILE] [flags]           # table of checks, exit 0 only if all pass
    python sanity.py --checks grad_norm,checkpoint     # only some checks (names as in the table)
    python sanity.py --config FILE --lr_sweep          # measure a stable LR instead of guessing (incident 4)
    python sanity.py --lr_sweep 1e-5,1e-4,1e-3         # your own LR grid

The LR and EMA schedules are checked for the full configured run. Everything else runs the config's
masking, loss, optimizer and clipping on a scaled-down model (tiny width, a volume of 2 x 4 x 4
patches, CPU, fp32); the data are the built-in phantoms unless --data_root (or --manifest_path) is
given, then a sample of those files. Exit codes (config.EXIT_CODES): EXIT_OK when all checks passed
(sweep: an LR was recommended), EXIT_FAILED when a check failed, ConfigError's for a bad config.
"""

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import List, Optional

import numpy as np
import torch
from matplotlib.figure import Figure

import checkpoint
import runtime
import schedules
import train
from config import (
    EXIT_FAILED,
    EXIT_OK,
    Config,
    ConfigError,
    NoUsableData,
    ScriptParser,
    load_config,
    plan_run,
    script_main,
)
from data import OCTDataset, build_datasets, collate
from dicom import BENIGN_REASONS
from index import find_files, format_reason_table, reason_counts, scan_command, scan_files
from masks import mask_generator_from_config
from model import JEPAOutput, VJEPA3D
from phantom import ensure_builtin_phantoms

DEFAULT_SWEEP = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
# tokens per axis of the scaled-down volume: milliseconds per update on one core
SCALED_GRID = [2, 4, 4]
FIT_LR = 1e-2  # the scaled model fits its batch to -90% in ~100-150 updates at this LR
OVERFIT_UPDATES = 300
EMA_UPDATES = 100
SWEEP_UPDATES = 80
DATA_SAMPLE_FILES = 200


@dataclass
class Check:
    """One row of the table: the verdict, what was measured, what was expected and, on failure, why
    and the fix."""

    passed: bool
    value: str
    threshold: str
    hint: str = ""  # likely cause and fix, shown when the check fails
    details: str = ""  # shown below the table whether or not the check passed


def scaled_down(cfg: Config) -> Config:
    """The config on a tiny model and a volume of SCALED_GRID patches of its patch size, on CPU in
    fp32, with each update split into two micro-batches of one volume; masking, loss, optimizer,
    clipping are kept."""
    return replace(
        cfg,
        image_size=[g * p for g, p in zip(SCALED_GRID, cfg.patch_size)],
        target_spacing=None,
        embed_dim=48,
        depth=2,
        num_heads=4,
        pred_embed_dim=32,
        pred_depth=1,
        pred_num_heads=4,
        device="cpu",
        workers=0,
        use_bf16=False,
        grad_checkpointing=False,
        per_core_batch_size=1,
        global_batch_size=2,
        grad_accum_steps=2,
    )


def sampled_files(records: List[dict]) -> int:
    """The number of files behind index records (each file is in exactly one record)."""
    return sum(len(r["paths"]) for r in records)


class Setup:
    """What the checks share, each part built on first use: the configured run's plan, the scaled
    config, its data, a fixed batch and a frozen-target training run."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.small = scaled_down(cfg)
        self.rt = runtime.Runtime(torch.device("cpu"), "cpu", 1, 0, 1, 1)
        self.real_data = cfg.data_root is not None or cfg.manifest_path is not None

    @cached_property
    def data_sample(self):
        """(number of files found, index records of a seeded random sample of them): real data
        only."""
        files = find_files(self.cfg.data_root, self.cfg.manifest_path)
        pick = np.random.default_rng(self.cfg.seed).permutation(len(files))[:DATA_SAMPLE_FILES]
        return len(files), scan_files([files[i] for i in sorted(pick)], self.cfg.sop_classes)

    @cached_property
    def train_ds(self):
        if not self.real_data:
            ensure_builtin_phantoms(self.small)
            return build_datasets(self.small)[0]
        usable = [r for r in self.data_sample[1] if r["ok"]]
        if not usable:
            raise NoUsableData("no usable volume in the sample of the data: see the `data` check")
        return OCTDataset(usable, self.small, train=True)

    @cached_property
    def train_volumes(self) -> int:
        """Training volumes of the configured run (real data: estimated from the sample)."""
        if not self.real_data:
            return len(self.train_ds)
        found, records = self.data_sample
        usable = sum(r["ok"] for r in records)
        return max(
            1, round(usable / max(1, sampled_files(records)) * found * (1 - self.cfg.val_fraction))
        )

    @cached_property
    def plan(self):
        """The configured run's RunPlan; the world size is taken as global / (per-core x
        accumulation), which changes no step count (those follow from global_batch_size)."""
        cfg = self.cfg
        world = 1
        if cfg.per_core_batch_size is not None and cfg.global_batch_size is not None:
            world = max(
                1, cfg.global_batch_size // (cfg.per_core_batch_size * (cfg.grad_accum_steps or 1))
            )
        return plan_run(cfg, world, self.train_volumes)

    @cached_property
    def samples(self) -> List[dict]:
        return [
            self.train_ds[(0, i % len(self.train_ds))] for i in range(self.small.global_batch_size)
        ]

    @cached_property
    def batch(self) -> dict:
        return collate(self.samples)

    @cached_property
    def micro_batches(self) -> List[dict]:
        return [collate([s]) for s in self.samples]

    @cached_property
    def frozen_run(self) -> List[train.UpdateResult]:
        """OVERFIT_UPDATES updates on the fixed batch with the target frozen (EMA momentum 1)."""
        return self.run_updates(
            self.fresh_model(), self.micro_batches, OVERFIT_UPDATES, FIT_LR, 1.0
        )

    def fresh_model(self) -> VJEPA3D:
        """The scaled model with the config's seed: every check starts from the same weights."""
        torch.manual_seed(self.cfg.seed)
        return VJEPA3D.from_config(self.small)

    def run_updates(
        self,
        model: VJEPA3D,
        micro_batches: List[dict],
        steps: int,
        lr: float,
        ema: float,
        optimizer=None,
    ) -> List[train.UpdateResult]:
        """`steps` optimizer updates through train.train_update, the code train.py runs."""
        if optimizer is None:
            optimizer = train.make_optimizer(model, self.small, self.rt)
        hp = schedules.Hyperparameters(lr, self.small.weight_decay, ema)
        return [
            train.train_update(model, optimizer, micro_batches, hp, self.small, self.rt)
            for _ in range(steps)
        ]


# --------------------------------------------------------------------------------------------------
# The checks, in the order of a run's life. Each takes the Setup and returns a Check.
# --------------------------------------------------------------------------------------------------


def check_lr_schedule(setup: Setup) -> Check:
    """The full run's LR: warmup rises to base_lr, then never rises, is never 0, ends at min_lr and
    holds it; a constant schedule is base_lr throughout."""
    cfg, plan = setup.cfg, setup.plan
    total, warm = plan.total_steps, plan.warmup_steps
    # past the end: holds min_lr
    lrs = np.array([schedules.lr_at(step, cfg, plan) for step in range(total + 10)])
    problems = []
    dead = ~(np.isfinite(lrs) & (lrs > 0))
    if dead.any():
        at = int(np.argmax(dead))
        problems.append(
            f"LR is {lrs[at]:g} at update {at}: nothing is learned and nothing says so (incident"
            " 3); `schedule: constant` must mean base_lr and lr_at must never return 0"
        )
    elif cfg.schedule == "constant":
        if not (lrs == cfg.base_lr).all():
            problems.append(f"the constant schedule is not base_lr {cfg.base_lr:g} at every update")
    else:
        if not (np.diff(lrs[:warm]) > 0).all() or not math.isclose(
            lrs.max(), cfg.base_lr, rel_tol=1e-6
        ):
            problems.append(
                f"warmup does not rise to base_lr {cfg.base_lr:g} over its {warm} updates"
            )
        rises = np.flatnonzero(np.diff(lrs[warm:]) > 1e-9 * cfg.base_lr)
        if rises.size:
            at = warm + int(rises[0]) + 1
            problems.append(
                f"LR rises again at update {at} ({lrs[at - 1]:.3g} -> {lrs[at]:.3g}): a restart"
                " (incident 2: an epoch-based schedule stepped per update); lr_at must be one"
                " warmup + cosine over the optimizer-update count"
            )
        if (
            not math.isclose(lrs[total - 1], cfg.min_lr, rel_tol=1e-6)
            or not (lrs[total:] == lrs[total - 1]).all()
        ):
            problems.append(
                f"the run ends at {lrs[total - 1]:.3g} and then {lrs[-1]:.3g}, not at min_lr "
                f"{cfg.min_lr:g} held after the end"
            )
    return Check(
        not problems,
        f"{total} updates, warmup {warm}, peak {lrs.max():.3g}, last {lrs[total - 1]:.3g}",
        "warmup rises, then never rises, never 0, ends at min_lr",
        "; ".join(problems),
    )


def check_ema_schedule(setup: Setup) -> Check:
    """The full run's EMA momentum stays within [ema_base, 1] and never decreases."""
    cfg, plan = setup.cfg, setup.plan
    emas = np.array([schedules.ema_at(step, cfg, plan) for step in range(plan.total_steps + 10)])
    falls = np.flatnonzero(np.diff(emas) < 0)
    ok = emas.min() >= cfg.ema_base and emas.max() <= 1.0 and not falls.size
    return Check(
        bool(ok),
        f"{emas.min():.5f} .. {emas.max():.5f}"
        + (f", falls at update {falls[0] + 1}" if falls.size else ""),
        f"within [{cfg.ema_base:g}, 1], non-decreasing",
        "the target's EMA momentum must rise from ema_base to ema_end as a function of the"
        " optimizer-update count (schedules.ema_at): above 1 it pushes the target away from the"
        " encoder, a falling momentum lets the target chase the encoder (collapse, incident 12)",
    )


def check_real_data(setup: Setup) -> Check:
    """A sample of the real files is scanned: some volumes are usable and few files are bad; the
    reject table."""
    found, records = setup.data_sample
    usable = sum(r["ok"] for r in records)
    bad = sum(not r["ok"] and r["reason"] not in BENIGN_REASONS for r in records)
    counts = reason_counts(records)
    table = (
        f"rejected files of the sample, by reason:\n{format_reason_table(counts)}" if counts else ""
    )
    return Check(
        usable > 0 and bad <= setup.cfg.max_bad_fraction * (usable + bad),
        f"{usable} usable volumes, {bad} bad files in {sampled_files(records)} of {found} files",
        f"some usable, bad <= {setup.cfg.max_bad_fraction:.0%}",
        f"too many files cannot be used (see the table below; {', '.join(BENIGN_REASONS)} are not"
        f" counted as bad); run `{scan_command(setup.cfg.data_root, setup.cfg.manifest_path)}` for"
        " every file",
        table,
    )


def check_inputs(setup: Setup, per_maker: int = 4) -> Check:
    """Training samples of each maker have mean ~0 and std ~1 (up to the intensity jitter) and are
    finite."""
    ds, cfg = setup.train_ds, setup.small
    by_maker = {}
    for i, record in enumerate(ds.records):
        by_maker.setdefault(record["manufacturer"] or "(unknown)", []).append(i)
    tolerance = 0.1 + cfg.intensity_jitter
    stats, bad = [], []
    for maker, indices in sorted(by_maker.items()):
        v = torch.stack([ds[(0, i)]["volume"] for i in indices[:per_maker]])
        mean, std, finite = float(v.mean()), float(v.std()), bool(torch.isfinite(v).all())
        stats.append((mean, std))
        if not finite or abs(mean) > tolerance or abs(std - 1) > tolerance:
            bad.append(
                f"{maker} (mean {mean:.4g}, std {std:.4g}, max {float(v.max()):.4g}"
                f"{'' if finite else ', NaN/Inf'})"
            )
    means, stds = [abs(m) for m, _ in stats], [s for _, s in stats]
    return Check(
        not bad,
        f"{len(stats)} makers: |mean| <= {max(means):.3g}, std {min(stds):.3g} .. {max(stds):.3g}",
        f"|mean| and |std - 1| <= {tolerance:g}, finite",
        f"inputs are not normalized per volume: {'; '.join(bad)}. Raw OCT values (up to 77,785)"
        " blow up the activations (incident 5): data.to_sample must scale every sample to zero"
        " mean and unit std",
    )


def mask_problems(
    context_idx: torch.Tensor, target_idx: torch.Tensor, cfg: Config, where: str
) -> List[str]:
    """What is wrong with a batch of masks: shapes [B, Nc] / [B, Nt], int64, disjoint and together
    every token."""
    n_context, n_target = cfg.token_counts()
    B = len(context_idx)
    if list(context_idx.shape) != [B, n_context] or list(target_idx.shape) != [B, n_target]:
        return [
            f"{where}: shapes {list(context_idx.shape)} / {list(target_idx.shape)}, expected "
            f"[{B}, {n_context}] / [{B}, {n_target}]"
        ]
    if context_idx.dtype != torch.long or target_idx.dtype != torch.long:
        return [f"{where}: dtypes {context_idx.dtype} / {target_idx.dtype}, expected torch.int64"]
    every_token = torch.arange(cfg.num_tokens())
    return [
        f"{where}, sample {b}: context and target overlap or miss tokens"
        for b in range(B)
        if not torch.equal(torch.cat([context_idx[b], target_idx[b]]).sort().values, every_token)
    ]


def check_masks(setup: Setup) -> Check:
    """The loader's masks, and the configured grid's masks, are index tensors [B, Nc] / [B, Nt] with
    exact counts, disjoint and complete (incident 6)."""
    batch = setup.batch
    full = [
        mask_generator_from_config(setup.cfg)(np.random.default_rng([setup.cfg.seed, i]))
        for i in range(4)
    ]
    full_context, full_target = (torch.from_numpy(np.stack([m[k] for m in full])) for k in (0, 1))
    problems = mask_problems(
        batch["context_idx"], batch["target_idx"], setup.small, "loader batch"
    ) + mask_problems(
        full_context, full_target, setup.cfg, f"configured grid {setup.cfg.grid_size()}"
    )
    n_context, n_target = setup.cfg.token_counts()
    return Check(
        not problems,
        f"batch {list(batch['context_idx'].shape)} / {list(batch['target_idx'].shape)}; "
        f"full grid {n_context} / {n_target} tokens",
        "[B, Nc] / [B, Nt], exact, disjoint, complete",
        "; ".join(problems)
        + ". Masks must be int64 index tensors of a fixed length per sample, not "
        "[D,H,W] grids (incident 6: that crashed deep inside XLA)",
    )


def check_model(setup: Setup) -> Check:
    """The output dataclass has finite fields of the right shapes; gradients reach the encoder and
    predictor and never the target encoder, which stays unchanged by an update with EMA momentum
    1."""
    model, batch = setup.fresh_model(), setup.batch
    out = model(batch["volume"], batch["context_idx"], batch["target_idx"])
    B, n_target = batch["target_idx"].shape
    expected = {
        "loss": [],
        "pred": [B, n_target, setup.small.embed_dim],
        "target": [B, n_target, setup.small.embed_dim],
        "target_std": [],
    }
    problems = []
    if not isinstance(out, JEPAOutput):
        problems.append(f"forward returned {type(out).__name__}, not JEPAOutput (incident 7)")
    else:
        for name, shape in expected.items():
            value = getattr(out, name)
            if list(value.shape) != shape or not torch.isfinite(value).all():
                problems.append(
                    f"{name}: shape {list(value.shape)} (expected {shape}), finite "
                    f"{bool(torch.isfinite(value).all())}"
                )
        out.loss.backward()
        leaked = [
            n
            for n, p in model.target_encoder.named_parameters()
            if p.requires_grad or p.grad is not None
        ]
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if leaked:
            problems.append(
                f"{len(leaked)} target-encoder tensors take gradients (e.g. {leaked[0]}): the"
                " target must move only through the EMA (incident 12); compute it under"
                " torch.no_grad and set requires_grad_(False)"
            )
        if missing:
            problems.append(f"no gradient reaches {missing[:3]}")
        model.zero_grad(set_to_none=True)
        before = [p.clone() for p in model.target_encoder.parameters()]
        setup.run_updates(model, setup.micro_batches, 1, FIT_LR, 1.0)
        if not all(torch.equal(a, b) for a, b in zip(before, model.target_encoder.parameters())):
            problems.append(
                "an update with EMA momentum 1 changed the target encoder: the optimizer holds its "
                "parameters (check model.param_groups and train.make_optimizer)"
            )
    value = (
        f"loss {float(out.loss.detach()):.4f}, target_std {float(out.target_std):.3f}"
        if isinstance(out, JEPAOutput)
        else type(out).__name__
    )
    return Check(not problems, value, "finite fields; no grad into the target", "; ".join(problems))


def check_overfit(setup: Setup) -> Check:
    """With the target frozen, the loss of one tiny batch falls by >= 90%."""
    losses = [float(r.loss) for r in setup.frozen_run]
    drop = 1 - losses[-1] / losses[0] if math.isfinite(losses[-1]) else 0.0
    return Check(
        drop >= 0.9,
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (-{drop:.0%})",
        f"falls >= 90% in {OVERFIT_UPDATES} updates at lr {FIT_LR:g}",
        "the model cannot fit one batch: check that optimizer.step() runs on every update, that the"
        " loss compares the prediction with the target at the same tokens, and that the optimizer"
        " holds the encoder and predictor parameters",
    )


def check_grad_norm(setup: Setup) -> Check:
    """The grad norm train.py logs is > 0 and finite on every update (two micro-batches each)."""
    norms = np.array([float(r.grad_norm) for r in setup.frozen_run])
    zero, nonfinite = np.flatnonzero(norms == 0), np.flatnonzero(~np.isfinite(norms))
    hint = ""
    if zero.size:
        hint = (
            f"grad_norm is 0 at {zero.size} of {norms.size} updates (first {zero[0]}): gradients"
            " are measured after zero_grad (incident 1); measure the pre-clip norm with"
            " clip_grad_norm_ after the last micro-batch's backward and before optimizer.step()"
            " and zero_grad() (train.clip_and_measure)"
        )
    elif nonfinite.size:
        hint = (
            f"grad_norm is not finite at {nonfinite.size} updates (first {nonfinite[0]}): check the"
            " inputs (`inputs` check) and the loss"
        )
    return Check(
        not hint,
        f"{norms.min():.3g} .. {norms.max():.3g} over {norms.size} updates",
        "> 0 and finite on every update",
        hint,
    )


def check_ema_training(setup: Setup) -> Check:
    """With the EMA target on (momentum ema_base), the loss falls by half and target_std stays above
    the collapse threshold."""
    floor = setup.cfg.collapse_min_target_std
    results = setup.run_updates(
        setup.fresh_model(), setup.micro_batches, EMA_UPDATES, FIT_LR, setup.cfg.ema_base
    )
    losses = [float(r.loss) for r in results]
    min_std = min(float(r.target_std) for r in results)
    ok = losses[-1] < 0.5 * losses[0] and min_std > floor
    return Check(
        ok,
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, min target_std {min_std:.3f}",
        f"loss halves, target_std > {floor:g}",
        "with the EMA target on, the loss does not fall or the target features collapse to a"
        " constant (a falling loss then means nothing, incident 12): the target encoder must be an"
        " EMA of the context encoder over the whole volume (model.update_target after"
        " optimizer.step), predicting its layer-normed features",
    )


def check_checkpoint(setup: Setup) -> Check:
    """Save after a few updates, restore into a new model and optimizer: the next two updates give
    identical losses, grad norms and weights."""

    def two_updates(model, optimizer):
        return setup.run_updates(
            model, setup.micro_batches, 2, FIT_LR, setup.cfg.ema_base, optimizer
        )

    model = setup.fresh_model()
    optimizer = train.make_optimizer(model, setup.small, setup.rt)
    two_updates(model, optimizer)
    state = train.TrainState(step=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.checkpoint_path(tmp, state.step)
        saved = checkpoint.checkpoint_state(model, optimizer, state, setup.small, setup.rt)
        checkpoint.save_checkpoint(path, saved, 1, False)
        # other initial weights: only the checkpoint can make them equal
        torch.manual_seed(setup.cfg.seed + 1)
        model2 = VJEPA3D.from_config(setup.small)
        optimizer2, state2 = train.make_optimizer(model2, setup.small, setup.rt), train.TrainState()
        checkpoint.restore(
            checkpoint.read_checkpoint(path), model2, optimizer2, state2, setup.rt, path
        )
    expected, got = two_updates(model, optimizer), two_updates(model2, optimizer2)
    same_updates = all(
        torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
        for a, b in zip(expected, got)
    )
    same_weights = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values())
    )
    ok = same_updates and same_weights and state2.step == state.step
    return Check(
        ok,
        "losses "
        + ", ".join(f"{float(a.loss):.6f}/{float(b.loss):.6f}" for a, b in zip(expected, got))
        + ("" if same_weights else ", weights differ"),
        "identical after restore",
        "a resumed run would not continue the same training: the checkpoint must hold the model"
        " (target encoder included), the optimizer state and the train state"
        " (checkpoint.checkpoint_state / restore)",
    )


CHECKS = {  # the names --checks takes; the table shows them in this order
    "data": check_real_data,
    "lr_schedule": check_lr_schedule,
    "ema_schedule": check_ema_schedule,
    "inputs": check_inputs,
    "masks": check_masks,
    "model": check_model,
    "overfit": check_overfit,
    "grad_norm": check_grad_norm,
    "ema_training": check_ema_training,
    "checkpoint": check_checkpoint,
}


def run_checks(cfg: Config, names: Optional[List[str]] = None) -> List[tuple]:
    """(name, Check) of the named checks (default: all; `data` only with real data), printing each
    row when done. A check that raises fails with the exception as its hint; a ConfigError stops
    everything (exit 2)."""
    setup = Setup(cfg)
    if names is None:
        names = [n for n in CHECKS if n != "data" or setup.real_data]
    elif "data" in names and not setup.real_data:
        raise ConfigError(
            "checks: the data check scans real files; give --data_root or --manifest_path."
        )
    width = max(map(len, CHECKS))
    print(f"{'check':<{width}}  result  {'measured':<52}  threshold", flush=True)
    rows = []
    for name in names:
        try:
            check = CHECKS[name](setup)
        except ConfigError:
            raise
        except Exception as e:  # one broken part must not hide the verdicts on the others
            check = Check(False, type(e).__name__, "runs without error", f"{type(e).__name__}: {e}")
        rows.append((name, check))
        print(
            f"{name:<{width}}  {'PASS' if check.passed else 'FAIL':<6}  {check.value:<52} "
            f" {check.threshold}",
            flush=True,
        )
    return rows


def format_findings(rows: List[tuple]) -> str:
    """Below the table: the cause and fix of each failed check, then any details (e.g. the data
    reject table)."""
    lines = [f"\nFAIL {name}: {check.hint}" for name, check in rows if not check.passed]
    lines += [f"\n{name}: {check.details}" for name, check in rows if check.details]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# LR sweep (incident 4: measure, don't guess)
# --------------------------------------------------------------------------------------------------


def lr_sweep(cfg: Config, lrs: List[float], png_path: str) -> dict:
    """Short runs of the scaled model at each LR from the same weights and data (EMA target on, no
    warmup); recommends the largest LR that stayed stable (finite, no loss above 1.1x its start, no
    collapse) and whose loss fell; saves the loss curves to png_path."""
    setup = Setup(cfg)
    ds = setup.train_ds
    batches = [collate([ds[(0, (2 * i + j) % len(ds))] for j in range(2)]) for i in range(8)]
    rows, curves = [], {}
    for lr in lrs:
        model = setup.fresh_model()
        optimizer = train.make_optimizer(model, setup.small, setup.rt)
        results = [
            setup.run_updates(
                model, [batches[step % len(batches)]], 1, lr, cfg.ema_base, optimizer
            )[0]
            for step in range(SWEEP_UPDATES)
        ]
        losses = np.array([float(r.loss) for r in results])
        norms = np.array([float(r.grad_norm) for r in results])
        finite = bool(np.isfinite(losses).all() and np.isfinite(norms).all())
        start, end = float(losses[:5].mean()), float(losses[-5:].mean())
        last_std = float(results[-1].target_std)
        stable = (
            finite and losses.max() <= 1.1 * losses[0] and last_std > cfg.collapse_min_target_std
        )
        rows.append(
            {
                "lr": lr,
                "max_grad_norm": float(np.nanmax(norms)),
                "loss_start": start,
                "loss_end": end,
                "target_std": last_std,
                "fell": finite and end < 0.95 * start,
                "nonfinite": not finite,
                "stable": stable,
            }
        )
        curves[lr] = np.where(np.isfinite(losses), losses, np.nan)
    good = [r["lr"] for r in rows if r["stable"] and r["fell"]]
    save_sweep_plot(curves, png_path)
    return {"rows": rows, "recommended_lr": max(good) if good else None}


def save_sweep_plot(curves: dict, path: str) -> None:
    """PNG of the loss curve of each LR."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for lr, losses in curves.items():
        ax.plot(losses, label=f"lr {lr:g}")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def format_sweep(result: dict) -> str:
    """The sweep table and the recommendation; at an edge of the grid, the --lr_sweep that extends
    it past that edge."""
    lines = [
        f"{'lr':>9}  {'max grad norm':>13}  {'loss start':>10}  {'loss end':>9}  {'target_std':>10}"
        "  fell  non-finite  verdict"
    ]
    for r in result["rows"]:
        yes_no = {key: "yes" if r[key] else "no" for key in ("fell", "nonfinite")}
        lines.append(
            f"{r['lr']:>9.1e}  {r['max_grad_norm']:>13.3g}  {r['loss_start']:>10.4f} "
            f" {r['loss_end']:>9.4f}  {r['target_std']:>10.3f}  {yes_no['fell']:<4} "
            f" {yes_no['nonfinite']:<10}  {'stable' if r['stable'] else 'UNSTABLE'}"
        )
    rec, lrs = result["recommended_lr"], [r["lr"] for r in result["rows"]]
    lines.append(
        f"\nrecommended base_lr: {rec:g} (the largest LR that was stable and whose loss fell;"
        " measured on the scaled model: a wider model may need a lower one)"
        if rec
        else (
            "\nno LR was stable with a falling loss: check the data and the model before a long run"
        )
    )
    if rec and rec == max(lrs):  # the best LR may lie beyond the grid: the flag that extends it
        grid = ",".join(f"{rec * f:g}" for f in (1, 3, 10, 30, 100))
        lines.append(
            f"{rec:g} is the largest LR tried, and a larger one may be stable too: extend the grid"
            f" upward with --lr_sweep {grid}"
        )
    elif rec and rec == min(lrs):
        grid = ",".join(f"{rec * f:g}" for f in (0.01, 0.03, 0.1, 0.3, 1))
        lines.append(
            f"{rec:g} is the smallest LR tried, the only one stable with a falling loss: the grid"
            f" may start too high; extend it downward with --lr_sweep {grid}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def parse_checks(value: str) -> List[str]:
    """The check names of `--checks a,b`."""
    names = [v.strip() for v in value.strip("[] ").split(",") if v.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise ConfigError(
            f"checks: {', '.join(unknown) or 'no name given'}; choose from {', '.join(CHECKS)}."
        )
    return names


def parse_sweep(value: str) -> List[float]:
    """The LRs of `--lr_sweep 1e-5,1e-4` (DEFAULT_SWEEP for a bare --lr_sweep)."""
    try:
        sweep = [float(v) for v in value.strip("[] ").split(",") if v.strip()] or DEFAULT_SWEEP
    except ValueError:
        raise ConfigError(f"lr_sweep: takes LRs like 1e-5,1e-4,1e-3, got {value!r}.") from None
    if not all(lr > 0 and math.isfinite(lr) for lr in sweep):
        raise ConfigError(f"lr_sweep: every LR must be positive, got {sweep}.")
    return sweep


def parse_command_line(argv: List[str]):
    """(check names or None, sweep LRs or None, the config flags) of sanity's command line."""
    parser = ScriptParser(__doc__, prog="sanity.py")
    parser.add_argument(
        "--checks", metavar="NAMES", help=f"only these checks, comma-separated: {', '.join(CHECKS)}"
    )
    parser.add_argument(
        "--lr_sweep",
        nargs="?",
        const="",
        metavar="LRS",
        help=f"measure a stable LR instead of checking (default grid {DEFAULT_SWEEP})",
    )
    args, flags = parser.parse(argv)
    return (
        None if args.checks is None else parse_checks(args.checks),
        None if args.lr_sweep is None else parse_sweep(args.lr_sweep),
        flags,
    )


@script_main
def main(argv: List[str]) -> int:
    """Run the checks (or the LR sweep) of a command line; returns the exit code."""
    threads = torch.get_num_threads()
    # The scaled model's ops are tiny: more threads only wait on each other (10x slower on a busy
    # 2-core machine).
    torch.set_num_threads(1)
    start = time.time()
    try:
        names, sweep, flags = parse_command_line(argv)
        cfg = load_config(flags)
        if sweep is not None:
            os.makedirs(cfg.out_dir, exist_ok=True)
            png = os.path.join(cfg.out_dir, "lr_sweep.png")
            result = lr_sweep(cfg, sweep, png)
            print(format_sweep(result))
            print(f"loss curves: {png} ({time.time() - start:.0f} s)")
            return EXIT_OK if result["recommended_lr"] else EXIT_FAILED
        rows = run_checks(cfg, names)
    finally:
        torch.set_num_threads(threads)
    findings = format_findings(rows)
    if findings:
        print(findings)
    passed = all(check.passed for _, check in rows)
    print(
        f"\n{'all checks passed' if passed else 'SOME CHECKS FAILED'} in"
        f" {time.time() - start:.0f} s"
    )
    return EXIT_OK if passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
