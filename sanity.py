"""A one-minute CPU check before a long run: every failure of DESIGN.md's incident list that can be caught
without the real data or hardware.

    python sanity.py [--config FILE] [flags]           # table of checks, exit 0 only if all pass
    python sanity.py --config FILE --lr_sweep          # measure a stable LR instead of guessing (incident 4)
    python sanity.py --lr_sweep 1e-5,1e-4,1e-3         # your own LR grid
    python sanity.py --checks masks,overfit            # only some checks (names: sanity.CHECKS)

The config's model, masking, optimizer and schedule settings are kept; the model and the volume are scaled
down so it runs on a laptop CPU; data are the built-in phantoms unless --data_root is given.
"""
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional

import numpy as np
import torch

import train
from config import Config, ConfigError, load_config, plan_run
from model import VJEPA3D

EXIT_OK, EXIT_FAILED = 0, 1
DEFAULT_SWEEP = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
COLLAPSE_STD = 0.05  # target_std below this: the target features are (nearly) constant
OVERFIT_UPDATES = 400


@dataclass
class Check:
    name: str
    passed: bool
    value: str
    threshold: str
    hint: str = ""  # likely cause and fix, shown when the check fails


def scaled_down(cfg: Config) -> Config:
    """The config with a tiny model and small volumes; everything else (masking, optimizer, schedules) kept."""
    return replace(cfg, image_size=[16, 64, 64], patch_size=[4, 8, 8], embed_dim=48, depth=2, num_heads=4,
                   pred_embed_dim=32, pred_depth=1, pred_num_heads=4, device="cpu", workers=0,
                   grad_checkpointing=False, target_spacing=None, per_core_batch_size=2, global_batch_size=2,
                   grad_accum_steps=1)


def cpu_runtime() -> train.Runtime:
    return train.Runtime(torch.device("cpu"), "cpu", 1, 0, 1, 1)


def fixed_batch(dataset, size: int) -> dict:
    """The first `size` training samples (epoch 0) as one batch."""
    from data import collate
    return collate([dataset[(0, i)] for i in range(size)])


def run_updates(model: VJEPA3D, batch: dict, cfg: Config, lrs: List[float], ema: float) -> List[train.UpdateResult]:
    """One optimizer update per LR in `lrs` on one batch, through train.train_update (the code train.py runs)."""
    rt = cpu_runtime()
    optimizer = train.make_optimizer(model, cfg, rt)
    return [train.train_update(model, model, optimizer, [batch], lr, cfg.weight_decay, ema, cfg, rt) for lr in lrs]


def fresh_model(cfg: Config) -> VJEPA3D:
    torch.manual_seed(cfg.seed)
    return VJEPA3D.from_config(cfg)


# ----------------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------------

def check_overfit(small: Config, batch: dict) -> List[Check]:
    """Frozen target: the loss on one sample falls by >= 90%; every grad norm is > 0 and finite."""
    fit = replace(small, weight_decay=0.0, grad_clip=None)  # nothing may hold the weights back from fitting
    one = {k: v[:1] for k, v in batch.items()}  # a model that learns at all fits one sample
    results = run_updates(fresh_model(fit), one, fit, [3e-3] * OVERFIT_UPDATES, ema=1.0)
    losses = [float(r.loss) for r in results]
    norms = [float(r.grad_norm) for r in results]
    drop = 1 - losses[-1] / losses[0] if math.isfinite(losses[-1]) else 0.0
    bad_norms = [i for i, g in enumerate(norms) if not (math.isfinite(g) and g > 0)]
    return [
        Check("overfit (frozen target)", drop >= 0.9, f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (-{drop:.0%})",
              f"falls >= 90% in {OVERFIT_UPDATES} updates",
              "the model cannot fit one batch: check the loss (pred vs target), the optimizer param groups, "
              "and that gradients reach encoder and predictor"),
        Check("grad norm", not bad_norms, f"min {min(norms):.3g}, max {max(norms):.3g}",
              "> 0 and finite on every update",
              f"grad_norm is 0 or non-finite at updates {bad_norms[:5]}: if it is 0, gradients are measured after "
              f"zero_grad (incident 1) - measure with clip_grad_norm_ before optimizer.step() and zero_grad()"),
    ]


def check_ema_training(small: Config, batch: dict) -> Check:
    """EMA target on: the loss falls and target_std stays above the collapse threshold."""
    results = run_updates(fresh_model(small), batch, small, [1e-3] * 100, ema=small.ema_base)
    losses = [float(r.loss) for r in results]
    stds = [float(r.target_std) for r in results]
    ok = losses[-1] < losses[0] and min(stds) > COLLAPSE_STD
    return Check("EMA training", ok, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, min target_std {min(stds):.3f}",
                 f"loss falls, target_std > {COLLAPSE_STD}",
                 "with the EMA target on, the loss does not fall or the target collapses: check update_target "
                 "(momentum near 1, called after optimizer.step) and that the target sees the whole volume")


def schedule_plan(cfg: Config, train_volumes: int):
    """The full configured run's plan (world size from the batch sizes when accumulation is derived)."""
    accum = cfg.grad_accum_steps or 1
    world = max(1, (cfg.global_batch_size or cfg.per_core_batch_size) // (cfg.per_core_batch_size * accum))
    return plan_run(cfg, world, train_volumes)


def check_lr_schedule(cfg: Config, train_volumes: int) -> Check:
    """Warmup rises, no increase after warmup, no restart, never 0, ends at min_lr (constant: base_lr)."""
    plan = schedule_plan(cfg, train_volumes)
    steps = np.arange(plan.total_steps + 10)
    lrs = np.array([train.lr_at(int(s), cfg, plan) for s in steps])
    warm = plan.warmup_steps
    problems = []
    if (lrs <= 0).any():
        problems.append(f"LR is 0 at update {int(np.argmax(lrs <= 0))} (incident 3)")
    if cfg.schedule == "constant":
        if not np.all(lrs == cfg.base_lr):
            problems.append("constant schedule is not base_lr everywhere")
    else:
        if warm > 1 and not np.all(np.diff(lrs[:warm]) > 0):
            problems.append("warmup does not rise")
        rises = np.flatnonzero(np.diff(lrs[warm:]) > 1e-12 * cfg.base_lr)
        if rises.size:
            problems.append(f"LR rises again at update {warm + int(rises[0]) + 1}: a restart (incident 2)")
        if not math.isclose(lrs[plan.total_steps - 1], cfg.min_lr, rel_tol=1e-6) or lrs[-1] != lrs[plan.total_steps - 1]:
            problems.append(f"ends at {lrs[-1]:.3g}, not min_lr {cfg.min_lr:.3g}")
    return Check("LR schedule (full run)", not problems,
                 f"{plan.total_steps} updates, warmup {warm}, lr {lrs.min():.2g}..{lrs.max():.2g}",
                 "warmup rises, then never rises, never 0, ends at min_lr", "; ".join(problems))


def check_ema_schedule(cfg: Config, train_volumes: int) -> Check:
    plan = schedule_plan(cfg, train_volumes)
    emas = np.array([train.ema_at(s, cfg, plan) for s in range(plan.total_steps + 10)])
    ok = emas.min() >= cfg.ema_base and emas.max() <= 1.0 and np.all(np.diff(emas) >= 0)
    return Check("EMA momentum schedule", bool(ok), f"{emas.min():.5f}..{emas.max():.5f}",
                 f"within [{cfg.ema_base}, 1], non-decreasing",
                 "the EMA momentum must start at ema_base and rise to ema_end on the optimizer-update clock")


def check_inputs(dataset, per_maker: int = 4) -> Check:
    """Batches from each maker: mean ~0, std ~1, all finite (incident 5)."""
    by_maker = {}
    for i in range(len(dataset)):
        sample = dataset[(0, i)]
        by_maker.setdefault(sample["maker"], [])
        if len(by_maker[sample["maker"]]) < per_maker:
            by_maker[sample["maker"]].append(sample["volume"])
    stats, problems = [], []
    for maker, volumes in sorted(by_maker.items()):
        v = torch.stack(volumes)
        mean, std, finite = float(v.mean()), float(v.std()), bool(torch.isfinite(v).all())
        stats.append(f"{maker}: {mean:+.2f}/{std:.2f}")
        if not finite or abs(mean) > 0.1 or not 0.8 < std < 1.2:
            problems.append(maker)
    return Check("input normalization", not problems, ", ".join(stats), "|mean| < 0.1, 0.8 < std < 1.2, finite",
                 f"inputs of {problems} are not normalized per volume (incident 5: raw OCT values reach 77,785 and "
                 f"blow up activations); check the normalization in data.py")


def check_masks(batch: dict, cfg: Config) -> Check:
    """Masks are [B, Nc] / [B, Nt] index tensors with exact counts, disjoint and complete (incident 6)."""
    n_context, n_target = cfg.token_counts()
    ctx, tgt = batch["context_idx"], batch["target_idx"]
    B = len(batch["volume"])
    problems = []
    if list(ctx.shape) != [B, n_context] or list(tgt.shape) != [B, n_target]:
        problems.append(f"shapes {list(ctx.shape)} / {list(tgt.shape)}, expected [{B}, {n_context}] / [{B}, {n_target}]")
    elif ctx.dtype != torch.long or tgt.dtype != torch.long:
        problems.append(f"dtypes {ctx.dtype} / {tgt.dtype}, expected torch.int64")
    else:
        for b in range(B):
            both = torch.cat([ctx[b], tgt[b]]).sort().values
            if not torch.equal(both, torch.arange(cfg.num_tokens())):
                problems.append(f"sample {b}: context and target overlap or miss tokens")
    return Check("masks", not problems, f"context {list(ctx.shape)}, target {list(tgt.shape)}",
                 "[B, Nc] / [B, Nt], disjoint, complete",
                 "; ".join(problems) + " - masks must be index tensors of a fixed length per sample")


def check_model_outputs(small: Config, batch: dict) -> Check:
    """Output fields present and finite; gradients reach encoder and predictor, never the target encoder."""
    model = fresh_model(small)
    out = model(batch["volume"], batch["context_idx"], batch["target_idx"])
    problems = [f for f in ("loss", "pred", "target", "target_std") if not torch.isfinite(getattr(out, f)).all()]
    out.loss.backward()
    leaked = [n for n, p in model.named_parameters() if n.startswith("target_encoder.") and
              (p.requires_grad or p.grad is not None)]
    missing = [n for n, p in model.named_parameters() if not n.startswith("target_encoder.") and p.grad is None]
    if leaked:
        problems.append(f"{len(leaked)} target-encoder tensors receive gradients (e.g. {leaked[0]}): the target "
                        f"must change only through the EMA (incident 12)")
    if missing:
        problems.append(f"no gradient reaches {missing[:3]}")
    return Check("model outputs and gradients", not problems, f"loss {float(out.loss.detach()):.3f}",
                 "finite fields; no grad into target encoder", "; ".join(problems))


def check_checkpoint_roundtrip(small: Config, batch: dict) -> Check:
    """Save after a few updates, load into a fresh model and optimizer: the next two updates give identical
    losses (the second one also depends on the optimizer state and the EMA target the checkpoint restored)."""
    rt = cpu_runtime()

    def two_updates(model, optimizer):
        return [float(train.train_update(model, model, optimizer, [batch], 1e-3, small.weight_decay, 0.99, small,
                                         rt).loss) for _ in range(2)]

    model = fresh_model(small)
    optimizer = train.make_optimizer(model, small, rt)
    two_updates(model, optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        path = train.checkpoint_path(tmp, 2)
        train.save_checkpoint(path, train.checkpoint_state(model, optimizer, train.TrainState(step=2), small, rt), 1,
                              False)
        expected = two_updates(model, optimizer)
        torch.manual_seed(small.seed + 1)  # other initial weights: everything must come from the checkpoint
        model2 = VJEPA3D.from_config(small)
        optimizer2 = train.make_optimizer(model2, small, rt)
        train.restore(train.read_checkpoint(path), model2, optimizer2, train.TrainState())
    got = two_updates(model2, optimizer2)
    return Check("checkpoint round trip", got == expected,
                 f"next losses {expected[0]:.6f}, {expected[1]:.6f} vs {got[0]:.6f}, {got[1]:.6f}", "identical",
                 "a resumed run would not continue the same training: check what the checkpoint saves and "
                 "restores (model incl. target encoder, optimizer state)")


def check_real_data(cfg: Config, sample_files: int = 200) -> Check:
    """Scan a sample of the real files and show the reject table."""
    from data import find_files, format_reason_table, scan_files
    files = find_files(cfg.data_root, cfg.manifest_path)[:sample_files]
    records = scan_files(files, sop_classes=cfg.sop_classes)
    ok = [r for r in records if r["ok"]]
    counts = {}
    for r in records:
        if not r["ok"]:
            counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    bad_share = 1 - len(ok) / max(1, len(records))
    table = format_reason_table(counts) if counts else ""
    return Check("real data sample", bool(ok) and bad_share <= cfg.max_bad_fraction,
                 f"{len(ok)}/{len(records)} usable volumes from {len(files)} files",
                 f"some usable, rejects <= {cfg.max_bad_fraction:.0%}",
                 f"too many files cannot be used:\n{table}\nrun `python data.py scan {cfg.data_root}` for details")


CHECKS = ("lr_schedule", "ema_schedule", "inputs", "masks", "model", "overfit", "ema_training", "checkpoint",
          "real_data")


def run_checks(cfg: Config, only: Optional[List[str]] = None) -> List[Check]:
    """The checks named in `only` (default: all), in the order of a run's life."""
    from data import build_datasets
    wanted = set(only or CHECKS)
    small = scaled_down(cfg)
    checks = []
    if "lr_schedule" in wanted:
        checks.append(check_lr_schedule(cfg, 1000))
    if "ema_schedule" in wanted:
        checks.append(check_ema_schedule(cfg, 1000))
    if wanted & {"inputs", "masks", "model", "overfit", "ema_training", "checkpoint"}:
        train_ds, _ = build_datasets(small)
        batch = fixed_batch(train_ds, 2)
        steps = {"inputs": lambda: [check_inputs(train_ds)], "masks": lambda: [check_masks(batch, small)],
                 "model": lambda: [check_model_outputs(small, batch)], "overfit": lambda: check_overfit(small, batch),
                 "ema_training": lambda: [check_ema_training(small, batch)],
                 "checkpoint": lambda: [check_checkpoint_roundtrip(small, batch)]}
        for name, run in steps.items():
            if name in wanted:
                checks += run()
    if "real_data" in wanted and cfg.data_root is not None:
        checks.append(check_real_data(cfg))
    return checks


def format_table(checks: List[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  {'measured':<44} threshold"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {'PASS' if c.passed else 'FAIL':<6}  {c.value:<44} {c.threshold}")
    for c in checks:
        if not c.passed:
            lines.append(f"\nFAIL {c.name}: {c.hint}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# LR sweep (incident 4: measure, don't guess)
# ----------------------------------------------------------------------------------------------------------

def lr_sweep(cfg: Config, lrs: List[float], steps: int = 60, out_png: Optional[str] = None) -> dict:
    """Short runs of the scaled model at each LR from the same weights and data; recommends the largest LR
    whose loss fell without any non-finite value or grad-norm blow-up."""
    from data import build_datasets, collate
    small = scaled_down(cfg)
    train_ds, _ = build_datasets(small)
    n = len(train_ds)
    batches = [collate([train_ds[(0, (2 * i + j) % n)] for j in range(2)]) for i in range(8)]
    rows, curves = [], {}
    for lr in lrs:
        model = fresh_model(small)
        optimizer = train.make_optimizer(model, small, cpu_runtime())
        losses, norms = [], []
        for step in range(steps):
            r = train.train_update(model, model, optimizer, [batches[step % len(batches)]], lr, small.weight_decay,
                                   small.ema_base, small, cpu_runtime())
            losses.append(float(r.loss))
            norms.append(float(r.grad_norm))
        finite = all(math.isfinite(x) for x in losses + norms)
        start, end = float(np.mean(losses[:5])), float(np.mean(losses[-5:]))
        fell = finite and end < 0.95 * start
        spiked = finite and max(losses) > 1.5 * losses[0]  # a blow-up the loss later recovers from
        rows.append({"lr": lr, "max_grad_norm": max(norms), "loss_start": start, "loss_end": end,
                     "fell": bool(fell), "nonfinite": not finite, "spiked": bool(spiked),
                     "stable": bool(fell and not spiked)})
        curves[lr] = losses
    good = [r["lr"] for r in rows if r["stable"]]
    result = {"rows": rows, "recommended_lr": max(good) if good else None}
    if out_png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for lr, losses in curves.items():
            ax.plot(losses, label=f"lr {lr:g}")
        ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_png, dpi=80)
        plt.close(fig)
    return result


def format_sweep(result: dict) -> str:
    lines = [f"{'lr':>9}  {'max grad norm':>13}  {'loss start':>10}  {'loss end':>9}  fell  non-finite  verdict"]
    for r in result["rows"]:
        verdict = ("stable" if r["stable"] else "UNSTABLE" if r["nonfinite"] or r["spiked"] else
                   "loss did not fall")
        lines.append(f"{r['lr']:>9.1e}  {r['max_grad_norm']:>13.3g}  {r['loss_start']:>10.4f}  {r['loss_end']:>9.4f}  "
                     f"{'yes' if r['fell'] else 'no':<4}  {'yes' if r['nonfinite'] else 'no':<10}  {verdict}")
    rec = result["recommended_lr"]
    lines.append(f"\nrecommended base_lr: {rec:g} (the largest LR that was stable and whose loss fell)" if rec else
                 "\nno LR was stable: check the data and the model before a long run")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = None
    if "--checks" in argv:  # --checks lr_schedule,masks: run only these
        i = argv.index("--checks")
        only = argv[i + 1].split(",") if i + 1 < len(argv) else []
        argv = argv[:i] + argv[i + 2:]
        unknown = [c for c in only if c not in CHECKS]
        if unknown or not only:
            print(f"config error: --checks takes names from {','.join(CHECKS)}; got {unknown or 'nothing'}",
                  file=sys.stderr)
            return train.EXIT_CONFIG
    sweep = None
    for i, arg in enumerate(argv):
        if arg == "--lr_sweep" or arg.startswith("--lr_sweep="):
            value = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--")
                                              else "")
            argv = argv[:i] + argv[i + (1 if arg.startswith("--lr_sweep=") or not value else 2):]
            try:
                sweep = [float(v) for v in value.strip("[]").split(",") if v.strip()] or DEFAULT_SWEEP
            except ValueError:
                print(f"config error: --lr_sweep takes a list of LRs like 1e-5,1e-4,1e-3, got {value!r}",
                      file=sys.stderr)
                return train.EXIT_CONFIG
            break
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return train.EXIT_CONFIG
    start = time.time()
    if sweep is not None:
        png = os.path.join(cfg.out_dir, "lr_sweep.png")
        os.makedirs(cfg.out_dir, exist_ok=True)
        result = lr_sweep(cfg, sweep, out_png=png)
        print(format_sweep(result))
        print(f"loss curves: {png} ({time.time() - start:.0f} s)")
        return EXIT_OK if result["recommended_lr"] else EXIT_FAILED
    checks = run_checks(cfg, only)
    print(format_table(checks))
    passed = all(c.passed for c in checks)
    print(f"\n{'all checks passed' if passed else 'SOME CHECKS FAILED'} in {time.time() - start:.0f} s")
    return EXIT_OK if passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
