"""What a run writes besides checkpoints: metrics.jsonl, events.jsonl, console lines, W&B, the
collapse warnings and the health figures they watch (rankme, position_share: the last section), the
end-of-run summary and the pictures (schedules.png and mask.png of the dry run, training.png). Only
the master process writes (incident 10: one run, not one per worker)."""

import errno
import json
import math
import os
import secrets
import shlex
import sys
import time
from collections import deque
from dataclasses import asdict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from tqdm import tqdm

from config import Config, RunPlan, StorageFailed, phantom_labels_path
from privacy import share_safe_config
from storage import write_atomic


class RunLog:
    """metrics.jsonl, events.jsonl, console and W&B; everything is a no-op off the master
    process."""

    def __init__(self, run_dir: str, cfg: Config, active: bool):
        self.active = active
        self.run_dir = run_dir
        self.cfg = cfg
        self.wandb_run = None
        self.history: List[dict] = []
        self.collapse = CollapseWatch(cfg)
        if active:
            os.makedirs(run_dir, exist_ok=True)
            self.wandb_run = start_wandb(cfg, run_dir)

    def metrics(self, record: dict) -> None:
        """Append one metrics line (and send it to W&B)."""
        if not self.active:
            return
        record = {k: json_number(v) for k, v in record.items()}
        self.history.append(record)
        _append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), record)
        # no step=: W&B drops a log whose step goes back, as after a rollback
        if self.wandb_run is not None:
            self.wandb_run.log(
                {
                    "update": record["step"],
                    **{
                        f"{record['split']}/{k}": v
                        for k, v in record.items()
                        if k not in ("split", "step") and v is not None
                    },
                }
            )
        for w in self.collapse.add(record):
            self.event("collapse_warning", record["step"], **w)
            self.print(
                f"WARNING step {record['step']}: {w['split']} {w['metric']} {w['reason']}: the "
                "representations may be collapsing (check the EMA schedule, the LR, the masks)"
            )

    def drop_metrics_after(self, step: int) -> None:
        """Keep the metrics lines up to update `step` (none for 0): a resume, a rollback or a start
        from scratch logs the later updates again. A line that does not parse (cut short by a full
        disk or a kill mid-write) or names no update ('step') is dropped with a warning."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not self.active or not os.path.exists(path):
            return
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
        records = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record, why = None, "is not a whole JSON line (a write cut short)"
            else:
                why = "has no update number ('step'; written by another tool, or edited)"
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append((record, line))
                continue
            self.event(
                "metrics_line_dropped", step, line=number, text=line[:200].decode(errors="replace")
            )
            self.print(f"WARNING {path}: line {number} {why}: dropped")
        keep = [(record, line) for record, line in records if record["step"] <= step]
        if len(keep) < len(lines):
            write_atomic(
                path, b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line in keep)
            )
            self.event("metrics_truncated", step, dropped_lines=len(lines) - len(keep))
        self.history = [record for record, _ in keep]
        self.collapse = CollapseWatch(self.cfg)
        for record in self.history:
            self.collapse.add(record)

    def event(self, kind: str, step: int, **fields) -> None:
        """Append one line to events.jsonl (skips, rollbacks, unreadable files, resumes...)."""
        if self.active:
            _append_jsonl(
                os.path.join(self.run_dir, "events.jsonl"),
                {"event": kind, "step": step, "time": time.time(), **fields},
            )

    def device_memory(self, step: int, held: dict, rt) -> None:
        """Log the measured bytes of weights, EMA target and AdamW state on the fullest device
        (runtime.state_bytes_per_device) as a device_memory event; as a console line too when
        sharded."""
        self.event("device_memory", step, fsdp_size=rt.fsdp_size, **held)
        if rt.sharded:
            self.print(
                f"sharded (fsdp) over {rt.fsdp_size} of {rt.world_size} devices; on the fullest"
                f" device: weights {size_text(held['weights'])}, EMA target"
                f" {size_text(held['ema_target'])}, AdamW {size_text(held['adamw'])}"
            )

    def print(self, *args) -> None:
        """One console line on stdout, written above the progress bar."""
        if self.active:
            tqdm.write(" ".join(str(a) for a in args))

    def close(self) -> None:
        """Finish the W&B run. wandb-core writes its files in its own process and may complete them
        a moment later."""
        if self.wandb_run is not None:
            self.wandb_run.finish()


def format_train_line(record: dict, plan: RunPlan) -> str:
    """The console line of one train metrics record (a non-finite value reads 'nan', not a
    crash)."""

    def fmt(key, spec):
        return "nan" if record[key] is None else format(record[key], spec)

    return (
        f"train step {record['step']:>6d}/{plan.total_steps} | loss {fmt('loss', '.4f')} | lr"
        f" {record['lr']:.2e} | grad_norm {fmt('grad_norm', '.3f')} | target_std"
        f" {fmt('target_std', '.3f')} | {record['samples_per_s']:.1f} samples/s"
    )


class Throughput:
    """Updates and data-loading time since the last train metrics line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new window (after each train metrics line)."""
        self.start, self.data_time, self.updates = time.perf_counter(), 0.0, 0

    def rates(self, global_batch_size: int) -> dict:
        """samples_per_s, step_time_s and data_time_s of the window."""
        elapsed = time.perf_counter() - self.start
        return {
            "samples_per_s": self.updates * global_batch_size / elapsed,
            "step_time_s": elapsed / self.updates,
            "data_time_s": self.data_time / self.updates,
        }


def collapse_signs(history: List[dict], cfg: Config) -> Dict[tuple, tuple]:
    """The collapse signs (CollapseWatch) still present at the end of a run's metrics: {(split,
    metric): (the best value, the last one)}."""
    watch = CollapseWatch(cfg)
    for record in history:
        watch.add(record)
    signs = {}
    for split, metric in sorted(watch.reported):
        values = [r[metric] for r in history if r["split"] == split and r.get(metric) is not None]
        signs[(split, metric)] = (max(values), values[-1])
    return signs


class CollapseWatch:
    """Collapse signs in each new metrics record: target_std or RankMe under its floor, or under
    half of its highest value of the last collapse_window_steps updates; the probe AUROC
    (probe_every_steps) back below half of its best gain over chance (0.5) of that window. A falling
    loss proves nothing while they fall. Each sign is reported once, until it goes away. Only the
    window is kept: a record costs the same at update 100 and at update 100,000."""

    FLOORS = {
        "target_std": "collapse_min_target_std",
        "rankme": "collapse_min_rankme",
        "probe_auroc": None,
    }

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # (split, metric) -> (step, value) of the window, oldest first
        self.windows: Dict[tuple, deque] = {}
        self.reported: set = set()  # (split, metric) pairs warned about and not recovered since

    def add(self, record: dict) -> List[dict]:
        """Take one metrics record; returns the new warnings ({split, metric, value, reason})."""
        found = []
        for metric, floor_field in self.FLOORS.items():
            value = record.get(metric)
            if value is None:
                continue
            key = (record["split"], metric)
            window = self.windows.setdefault(key, deque())
            while window and record["step"] - window[0][0] > self.cfg.collapse_window_steps:
                window.popleft()
            floor = getattr(self.cfg, floor_field) if floor_field else None
            # a drop is measured by what was gained over this
            chance = 0.5 if metric == "probe_auroc" else 0.0
            best = max((v for _, v in window), default=None)
            window.append((record["step"], value))
            if floor is not None and value < floor:
                reason = f"is {value:.4g}, under the floor {floor:g}"
            elif best is not None and value - chance < 0.5 * (best - chance):
                reason = (
                    f"fell from {best:.4g} to {value:.4g} within {self.cfg.collapse_window_steps}"
                    " updates"
                )
            else:
                self.reported.discard(key)
                continue
            if key not in self.reported:
                found.append(
                    {"split": record["split"], "metric": metric, "value": value, "reason": reason}
                )
            self.reported.add(key)
        return found


def json_number(v):
    """A metric as a JSON value: a tensor as its number, a non-finite float as null."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null marks a non-finite measurement
    return v


class RunFolderFailed(StorageFailed):
    """The run folder stopped taking the run's logs (a full disk, a lost mount): exit 74, as for
    checkpoints."""

    prefix = "run folder storage failed: "


def _append_jsonl(path: str, record: dict) -> None:
    """One line, appended with one write: a kill leaves whole lines (or, on a full disk, a last line
    cut short that the next resume drops), never two lines mixed. A line the run folder cannot take
    (a full disk, a lost mount) stops the run with StorageFailed (exit 74), naming the file and the
    way on."""
    line = (json.dumps(record) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, f"{path}: only part of a line was written (disk full?)")
        finally:
            os.close(fd)
    except OSError as e:
        raise RunFolderFailed(
            f"the run folder could not take a line of {path} ({e!r}). What was written stays (a"
            " line cut short is dropped at the resume); make room there (or fix its storage), then"
            " run the same command with --resume auto: it continues from the last checkpoint."
        ) from None


def start_wandb(cfg: Config, run_dir: str):
    """A W&B run, or None: the run folder's own W&B run, resumed when it exists (wandb_id in the
    folder). auto = online when a W&B key is at hand (WANDB_API_KEY, or the netrc entry `wandb
    login` wrote for the server), else offline, said once on stderr with how to go online; deciding
    never waits on a network."""
    mode = cfg.wandb
    if mode == "auto":
        import netrc
        from urllib.parse import urlsplit

        server = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
        # where `wandb login` writes
        keys = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
        try:
            logged_in = netrc.netrc(keys).authenticators(server) is not None
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        mode = "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"
        if mode == "offline":
            offline_dir = os.path.join(run_dir, "wandb")
            print(
                f"W&B logs offline to {offline_dir} (wandb: auto, and no WANDB_API_KEY or `wandb"
                f" login` key for {server} in {keys}); to log online: `wandb login` or"
                " WANDB_API_KEY, or --wandb online; to upload this run later: wandb sync"
                f" {shlex.quote(offline_dir)}/offline-run-*",
                file=sys.stderr,
            )
    if mode == "disabled":
        return None
    import wandb

    # Metrics and a config without paths only: no console (a reader's warning may name a patient's
    # file), no command line, host, code or git metadata (docs/privacy.md); `host` is recorded even
    # without metadata.
    settings = wandb.Settings(
        init_timeout=30,
        silent=True,
        console="off",
        save_code=False,
        disable_code=True,
        disable_git=True,
        x_disable_meta=True,
        host="octjepa",
    )
    # One W&B run per run folder, however often it is resumed: its id is kept beside metrics.jsonl.
    id_path = os.path.join(run_dir, "wandb_id")
    if not os.path.exists(id_path):
        write_atomic(id_path, secrets.token_hex(6).encode())  # W&B ids: [a-z0-9]
    with open(id_path) as f:
        run_id = f.read().strip()
    same_run = dict(
        project=cfg.wandb_project,
        name=os.path.basename(run_dir),
        dir=run_dir,
        config=share_safe_config(asdict(cfg)),
        settings=settings,
        id=run_id,
        resume="allow",
    )
    try:
        run = wandb.init(entity=cfg.wandb_entity, mode=mode, **same_run)
    except Exception as e:  # an unreachable server must not stop the run: log offline instead
        if mode != "online":
            raise
        print(f"wandb online failed ({e}); logging offline to {run_dir}/wandb", file=sys.stderr)
        run = wandb.init(mode="offline", **same_run)
    run.define_metric("update")
    run.define_metric("*", step_metric="update")  # charts use the optimizer update as x-axis
    return run


def new_figure(figsize: Tuple[float, float]):
    """A matplotlib Figure (no pyplot, so no display). matplotlib is imported here, at a process's
    first picture, not with this module: ~0.4 s of CPU at every train.py start, and a run's
    processes other than the first draw none."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def save_schedule_plot(schedules: Dict[str, List[float]], path: str) -> None:
    """PNG of each schedule (name -> its value at every update of the run)."""
    fig = new_figure((4 * len(schedules), 3))
    for ax, (name, values) in zip(fig.subplots(1, len(schedules)), schedules.items()):
        ax.plot(np.arange(len(values)), values)
        ax.set_title(name)
        ax.set_xlabel("optimizer update")
    # tight_layout cost 1-3 s a run
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.17, top=0.9, wspace=0.3)
    fig.savefig(path, dpi=80)


def save_mask_plot(sample: dict, cfg: Config, stats: dict, path: str) -> None:
    """PNG of one sample's masks: per mask set, the middle B-scan with its context (blue) and target
    (red) tokens overlaid and the en-face target map of every B-scan row, titled with the realised
    block size and the share of target tokens with a context neighbour along each axis (`stats`:
    masks.mask_stats over 100 masks)."""
    volume = sample["volume"][0].numpy()  # [D, H, W]
    gd, gh, gw = cfg.grid_size()
    pd, ph, pw = cfg.patch_size
    targets = sample["target_idx"].numpy().reshape(-1, sample["target_idx"].shape[-1])  # [M, Nt]
    frame = volume.shape[0] // 2
    fig = new_figure((15, 4 * len(targets)))
    for row, target_idx in zip(fig.subplots(len(targets), 3, squeeze=False), targets):
        is_target = np.zeros(gd * gh * gw, bool)
        is_target[target_idx] = True
        is_target = is_target.reshape(gd, gh, gw)
        overlay = np.kron(is_target[frame // pd], np.ones((ph, pw)))  # [H, W]
        row[0].imshow(volume[frame], cmap="gray")
        row[0].set_title(f"B-scan {frame} of {sample['path'].split('/')[-1]}")
        row[1].imshow(volume[frame], cmap="gray")
        row[1].imshow(
            np.ma.masked_where(overlay == 0, overlay), cmap="Reds", alpha=0.45, vmin=0, vmax=1
        )
        row[1].imshow(
            np.ma.masked_where(overlay == 1, 1 - overlay), cmap="Blues", alpha=0.25, vmin=0, vmax=1
        )
        row[1].set_title(
            f"target (red) {int(is_target.sum())} / context (blue) {int((~is_target).sum())} tokens"
        )
        # [gd, gw]: share of depth
        row[2].imshow(is_target.mean(1), cmap="Reds", vmin=0, vmax=1, aspect="auto")
        row[2].set_title("en face: target share of each column (rows = B-scans)")
        row[2].set_xlabel("lateral token")
        row[2].set_ylabel("B-scan token")
        for ax in row[:2]:
            ax.axis("off")
    size = (
        ""
        if stats["block_size_ratio"] is None
        else f"realised block size {stats['block_size_ratio']:.2f} x nominal; "
    )
    near = ", ".join(f"axis {a} {s:.0%}" for a, s in enumerate(stats["context_neighbour_share"]))
    fig.suptitle(f"{cfg.mask_type}: {size}target tokens with a context neighbour: {near}")
    # tight_layout cost 1-3 s a run
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.17, top=0.9, wspace=0.3)
    fig.savefig(path, dpi=80)


def save_training_plot(history: List[dict], path: str) -> None:
    """PNG of loss, target_std, grad norm and LR over the run."""
    train = [r for r in history if r["split"] == "train"]
    val = [r for r in history if r["split"] == "val"]
    if not train:
        return
    fig = new_figure((16, 3))
    for ax, key in zip(fig.subplots(1, 4), ("loss", "target_std", "grad_norm", "lr")):
        ax.plot([r["step"] for r in train], [r[key] for r in train], label="train")
        if key in ("loss", "target_std") and val:
            ax.plot([r["step"] for r in val], [r[key] for r in val], "o-", label="val")
            ax.legend()
        ax.set_title(key)
        ax.set_xlabel("optimizer update")
    # tight_layout cost 1-3 s a run
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.17, top=0.9, wspace=0.3)
    fig.savefig(path, dpi=80)


def next_commands(cfg: Config, run_dir: str) -> List[str]:
    """The commands that use a run's encoder (docs/encoder.md), with the run's real paths and labels
    (probe_labels, else the varied labelled phantoms that a phantom run's verdict reads, else a
    placeholder)."""

    def path(*parts: str) -> str:
        return shlex.quote(os.path.join(*parts))

    phantoms = cfg.data_root is None and cfg.manifest_path is None
    labels = cfg.probe_labels or (
        phantom_labels_path(cfg, varied=True) if phantoms else "LABELS.csv"
    )
    encoder, labels = path(run_dir, "encoder"), shlex.quote(labels)
    data = (
        f"--data_root {shlex.quote(cfg.data_root or cfg.phantom_dir)}"
        if cfg.manifest_path is None
        else f"--manifest_path {shlex.quote(cfg.manifest_path)}"
    )
    return [
        f"python encoder.py export --ckpt {shlex.quote(cfg.ckpt_dir)} --out {encoder}",
        (
            f"python encoder.py embed --encoder {encoder} {data} --out"
            f" {path(run_dir, 'embeddings.npz')}"
        ),
        (
            f"python encoder.py show --encoder {encoder} --labels {labels} --out"
            f" {path(run_dir, 'show.png')}"
        ),
        (
            f"python finetune.py --encoder {encoder} --labels {labels} --out"
            f" {path(run_dir, 'finetune')} --vs_random"
        ),
    ]


def verdict_line(result: dict) -> str:
    """The verdict in words, on the first read-out of a runprobe.verdict result: 'beats a random
    init; beats hand-made features', or what it does not beat; for a task hand-made features read,
    that it says little."""
    readout, r = next(iter(result["readouts"].items()))
    words = (
        f"{'beats' if r['beats_random'] else 'does NOT beat'} a random init; "
        f"{'beats' if r['beats_handmade'] else 'does not beat'} hand-made features "
        f"({result['task'].split(' ', 1)[0]}, {readout} read-out)"
    )
    if not result["shortcut_free"]:
        words += (
            f"; hand-made features read this task ({r['handmade']['mean']:.2f}), so it says little"
        )
    return words


def verdict_lines(result: dict, collapsed: dict) -> List[str]:
    """The summary's lines of a runprobe.verdict result: per read-out the encoder, then its random
    init and the best hand-made features with the paired differences; the position shares; the
    verdict in words (with a fix when the encoder does not beat its random init)."""
    lines = [f"probe set         {result['task']}"]
    for readout, r in result["readouts"].items():
        p = r["pretrained"]
        lines.append(
            f"probe {readout:<11} AUROC {p['mean']:.3f} [{p['low']:.3f}, {p['high']:.3f}] "
            f"({len(p['values'])} splits)"
        )
        for name, arm, d in (
            ("random init", "random", "vs_random"),
            (f"hand-made ({result['best_handmade']})", "handmade", "vs_handmade"),
        ):
            lines.append(
                f"  vs {name:<26} {r[arm]['mean']:.3f}, paired {r[d]['mean']:+.3f} "
                f"[{r[d]['low']:+.3f}, {r[d]['high']:+.3f}]"
            )
    share = result["position_share"]
    lines.append(
        f"position share    {share['pretrained']:.3f} of the probe volumes' token variance (random"
        f" init {share['random']:.3f})"
    )
    words = verdict_line(result)
    if not next(iter(result["readouts"].values()))["beats_random"]:
        words += (
            ": the target collapsed partly: a slower EMA (--ema_base 0.998) or a lower --base_lr"
            if any(metric == "target_std" for _, metric in collapsed)
            else ": pretrain longer or on more data"
        )
    return lines + [f"verdict           {words}"]


def summary(
    history: List[dict], run_dir: str, cfg: Config, state, result: Optional[dict] = None
) -> str:
    """The one-screen end-of-run summary (`state`: train.TrainState); result: runprobe.verdict's, if
    measured; the commands to run next."""
    train = [r for r in history if r["split"] == "train"]
    val = [r for r in history if r["split"] == "val"]
    lines = [
        "",
        "=" * 72,
        (
            f"done: {state.step} updates, {state.nonfinite_skipped} non-finite skipped, "
            f"{state.rollbacks} rollbacks"
        ),
    ]
    if train:
        lines.append(
            f"train loss        {train[0]['loss']:.4f} (update {train[0]['step']}) ->"
            f" {train[-1]['loss']:.4f} (update {train[-1]['step']})"
        )
        lines.append(
            f"target_std        {train[0]['target_std']:.4f} -> {train[-1]['target_std']:.4f}"
        )
    if val:
        lines.append(
            f"val loss          {val[0]['loss']:.4f} -> {val[-1]['loss']:.4f}, rankme"
            f" {val[-1]['rankme']:.1f}"
            + (
                f", position share {val[-1]['position_share']:.3f} of the val volumes' token"
                " variance"
                if "position_share" in val[-1]
                else ""
            )
        )
    collapsed = collapse_signs(history, cfg)
    if collapsed:
        lines.append(
            "collapse          "
            + ", ".join(
                f"{split} {metric} {lowest:.3g} (best {best:.3g})"
                for (split, metric), (best, lowest) in collapsed.items()
            )
            + " at the end (collapse_warning in events.jsonl)"
        )
    if result:
        lines += verdict_lines(result, collapsed)
    lines += [
        f"metrics           {run_dir}/metrics.jsonl (events: events.jsonl, plot: training.png)",
        f"checkpoints       {cfg.ckpt_dir if cfg.ckpt_dir else 'off (ckpt_dir null)'}",
    ]
    if cfg.ckpt_dir:
        commands = next_commands(cfg, run_dir)
        lines += [f"next (docs/encoder.md): {commands[0]}"] + [f"{'':24}{c}" for c in commands[1:]]
    lines.append("=" * 72)
    return "\n".join(lines)


def size_text(n_bytes: float) -> str:
    """Bytes as a short text in MiB or GiB (0.35 MiB, 12.4 GiB)."""
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f} MiB"


# --------------------------------------------------------------------------------------------------
# Health figures of an encoder's features, logged while it trains and reported after: does it
# still say something (rankme: the effective rank of [M, E] embeddings, 1 = collapsed; RankMe,
# Garrido et al. 2023), and does it say what is there or only where it is (position_share of tokens
# [V, N, E]: near 1, the tokens say where they are and little of what is there)? target_std is the
# loss's own: model.feature_std.
# --------------------------------------------------------------------------------------------------


def rankme(embeddings: torch.Tensor, eps: float = 1e-7) -> float:
    """RankMe: exp of the entropy of the normalized singular values of [M, E] embeddings (1 =
    collapsed)."""
    s = torch.linalg.svdvals(embeddings.float())
    p = s / (s.sum() + eps) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def position_sums(tokens: torch.Tensor) -> torch.Tensor:
    """Per grid position, the sum and the sum of squares over volumes of tokens [V, N, E]: [2, N, E]
    (float64), what position_share_of_sums needs; the sums of several batches of volumes add up."""
    t = tokens.detach().cpu().double()
    return torch.stack([t.sum(0), t.pow(2).sum(0)])


def position_share_of_sums(sums: torch.Tensor, volumes: int) -> float:
    """position_share of the tokens of `volumes` volumes whose position_sums (added over batches)
    are sums [2, N, E]."""
    s1, s2 = sums / volumes  # [N, E] each: per-position means of x and x^2
    # mean over positions of the variance over volumes
    within = (s2 - s1**2).clamp_min(0).sum(-1).mean()
    # variance over all tokens of all volumes
    total = (s2.mean(0) - s1.mean(0) ** 2).clamp_min(0).sum()
    return float(1.0 - within / total) if total > 0 else 0.0


def position_share(tokens: torch.Tensor) -> float:
    """The share of token variance explained by grid position, for tokens [V, N, E] of V volumes: 1
    - (mean over the N positions of the variance over volumes) / (variance over all V*N tokens),
      variances summed over the E features.
    1: every token is where it is, nothing of its volume (a position code); 0: position tells
    nothing."""
    return position_share_of_sums(position_sums(tokens), tokens.shape[0])
