"""Does pretraining work? The probe suite: read-outs of frozen target-encoder features beside a
floor, a shortcut and a ceiling (incident 12; the evidence: experiments/README.md).

    python probe.py --ckpt runs/learn/checkpoints --vs_random     # the built-in suite: the run's last checkpoint
    python probe.py --ckpt random                                 # a random init of the config's architecture
    python probe.py --ckpt random --config configs/demo.yaml      # ... of another architecture
    python probe.py --ckpt PATH --labels labels.csv --json probe.json
    python probe.py --ckpt PATH --data_root /data/oct             # = --labels /data/oct/labels.csv

Every report puts the encoder (and with --vs_random a random init of its architecture: the floor)
beside the best of a small set of hand-made features (the shortcut a label can be read from without
learning anything) and a small 3D CNN trained on the same training split (the supervised ceiling),
with the same volumes and splits (references.py). A task is valid when the best hand-made features
are near chance and the CNN is well above it (references.VALID_*).

The built-in suite (SUITE), on labelled phantoms written once with other seeds than any pretraining
set:
  plain_lesion   none / drusen / fluid on PROBE_PHANTOMS plain phantoms (PHANTOM_DIR_probe): the
  task of earlier
                 reports, kept for continuity; a depth profile gives it away (the lesions sit at one
                 depth).
  lesion         none / drusen / fluid on SUITE_PHANTOMS varied phantoms (PHANTOM_DIR_suite;
  phantom.draw_eye: depth
                 position, tilt, curvature, eye motion, layer thickness and reflectivity,
                 brightness, speckle, vessels).
  lesion_tokens  which tokens hold lesion voxels, per token, on the varied phantoms (dense.py: the
  dense task). inner_lesion   none / foci / cysts on INNER_PHANTOMS varied phantoms
  (PHANTOM_DIR_inner): lesions of another kind
                 at another depth, in the same kind of eyes: hyperreflective foci (bright dots of a
                 few voxels in the INL, OPL and ONL) or intraretinal cysts (dark round spaces in the
                 INL and OPL), lesion yes / no.
  inner_lesion_tokens  which tokens hold foci or cysts, per token, in the band of the INL, OPL and
  ONL (dense.py).
Labels (labels.py): a CSV path,label (paths relative to its folder; a series folder is one volume)
is one task, `label`; with a column `patient` every split keeps each patient's volumes on one side
(readouts.patient_split), as finetune.py does. A checkpoint brings its own model, preprocessing and
phantom folder; config flags shape the random model. The read-outs, metrics and intervals:
readouts.py. Long work shows progress on stderr. Ctrl-C (or SIGTERM) stops at once: the tasks
finished so far are printed and written to --json and --plot, marked partial, and the exit code is
75 (config.EXIT_CODES).
"""

import dataclasses
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from matplotlib.figure import Figure

import dense
from checkpoint import read_model_checkpoint, resolve_checkpoint
from config import (
    Config,
    ConfigError,
    Preempted,
    ScriptParser,
    given_flags,
    load_config,
    script_main,
)
from runlog import position_share
from labels import PATIENT_COLUMN, load_labelled_volumes, phantom_set_labels, task_targets
from phantom import set_voxel_layers
from progress import counted
from readouts import (
    READOUTS,
    TEST_FRACTION,
    Task,
    beats,
    intervals,
    paired_difference,
    probe_split,
    readout_scores,
)
from references import (
    VALID_CEILING_MIN,
    VALID_SHORTCUT_MAX,
    Split,
    handmade_scores,
    supervised_scores,
)
from runprobe import random_model
from runtime import StopRequested, StopSignals, probe_device
from tokens import encode_volumes

CKPT_FIELDS = ("phantom_dir", "cache_dir", "device")  # the config flags that apply to a checkpoint
# The built-in tasks, by the phantom set they use (labels.PHANTOM_SETS); a dense task's targets:
# dense.TOKEN_TASKS
SUITE = {
    "plain": (Task("plain_lesion"),),
    "varied": (Task("lesion", "lesion"), Task("lesion_tokens", "lesion", dense=True)),
    "inner": (Task("inner_lesion", "lesion"), Task("inner_lesion_tokens", "lesion", dense=True)),
}


# --------------------------------------------------------------------------------------------------
# Splits: by volume, or by patient
# --------------------------------------------------------------------------------------------------


def probe_splits(
    labels: np.ndarray, classes: List[str], patients: Optional[np.ndarray], seeds: int, source: str
) -> List[Split]:
    """(train, test) of each probe seed of the class ids labels [M] (class names `classes`):
    readouts.probe_split of the volumes, or with patients [M] readouts.patient_split. ConfigError
    (naming `source`) when a class cannot be held out."""
    splits = [probe_split(labels, seed, patients) for seed in range(seeds)]
    if patients is None:
        return splits
    missing = [
        c for i, c in enumerate(classes) if not all((labels[test] == i).any() for _, test in splits)
    ]
    if missing:
        raise ConfigError(
            f"labels: {source}: split by patient, class {missing[0]} has no volume to hold out: a"
            f" class needs two patients whose volumes have the same classes ({len(set(patients))}"
            " patients)."
        )
    return splits


# --------------------------------------------------------------------------------------------------
# A task's report: every encoder and read-out beside the shortcut and the ceiling
# --------------------------------------------------------------------------------------------------


def task_report(
    labels: np.ndarray,
    tokens: Dict[str, torch.Tensor],
    grid: Sequence[int],
    volumes: torch.Tensor,
    splits: Sequence[Split],
    readouts: Sequence[str] = READOUTS,
    reference: bool = True,
    device="cpu",
) -> dict:
    """One task with class ids labels [M], on the (train, test) splits (split i: probe seed i): each
    encoder's read-outs (tokens: {encoder name: [M, N, E]}; 'random' is the floor) and, with
    `reference`, the hand-made features (the shortcut), the supervised CNN (the ceiling) and the
    task's validity (the attentive read-out and the CNN trained on `device`): {"metric", "encoders":
    {name: {readout: {metric: interval}}}, "handmade": {features: ...}, "best_handmade",
    "supervised": {metric: interval}, "valid", "versus": {name: {readout: comparisons}}}."""
    metric, seeds = "auroc", range(len(splits))
    report = {
        "metric": metric,
        "encoders": {
            name: readout_scores(
                t, grid, labels, seeds, readouts, device, splits, f"{name} read-outs"
            )
            for name, t in tokens.items()
        },
    }
    if reference:
        report = with_references(
            report,
            handmade_scores(volumes, labels, seeds, splits),
            supervised_scores(volumes, labels, seeds, device, splits),
        )
    report["versus"] = {
        name: {readout: comparisons(report, scores[readout][metric], readout) for readout in scores}
        for name, scores in report["encoders"].items()
        if name != "random"
    }
    return report


def dense_report(
    paths: np.ndarray,
    labels_csv: str,
    tokens: Dict[str, torch.Tensor],
    grid: Sequence[int],
    volumes: torch.Tensor,
    splits: Sequence[Split],
    reference: bool = True,
    device="cpu",
    task: dense.TokenTask = dense.TOKEN_TASKS["lesion_tokens"],
) -> dict:
    """A dense task (dense.py: which tokens the TokenTask says are lesion and scored) in
    task_report's layout, its one read-out `token_linear`, on the volume splits given (those of the
    set's volume task; split i: probe seed i), for the phantom set of labels_csv (the volumes' paths
    [M])."""
    targets = dense.set_token_targets(
        set_voxel_layers(os.path.dirname(labels_csv)),
        paths,
        dense.target_grid(volumes.shape[2:]),
        task,
    )
    runs = dense.stack_runs(
        [
            dense.split_scores(tokens, grid, volumes, targets, train, test, s, reference, device)
            for s, (train, test) in enumerate(counted(splits, "dense read-outs", "split"))
        ]
    )
    report = {
        "metric": "auroc",
        "scored_tokens": int((targets >= 0).sum()),
        "lesion_tokens": int((targets == 1).sum()),
        "position_share": {name: position_share(t) for name, t in tokens.items()},
        "encoders": {name: {"token_linear": intervals(runs[name])} for name in tokens},
    }
    if reference:
        report = with_references(
            report,
            {
                n.split(":", 1)[1]: intervals(r)
                for n, r in runs.items()
                if n.startswith("handmade:")
            },
            intervals(runs["supervised"]),
        )
    report["versus"] = {
        name: {"token_linear": comparisons(report, scores["token_linear"]["auroc"], "token_linear")}
        for name, scores in report["encoders"].items()
        if name != "random"
    }
    return report


def with_references(report: dict, handmade: Dict[str, dict], supervised: dict) -> dict:
    """The report with the shortcut (handmade: {features: {metric: interval}} and the best of them),
    the ceiling (supervised: {metric: interval}) and whether the task is valid (the shortcut near
    chance, the ceiling above)."""
    metric = report["metric"]
    best = max(handmade, key=lambda f: handmade[f][metric]["mean"])
    valid = (
        handmade[best][metric]["mean"] <= VALID_SHORTCUT_MAX
        and supervised[metric]["mean"] >= VALID_CEILING_MIN
    )
    return {
        **report,
        "handmade": handmade,
        "best_handmade": best,
        "supervised": supervised,
        "valid": bool(valid),
    }


def comparisons(report: dict, scores: dict, readout: str) -> dict:
    """An encoder read-out's headline interval `scores` against what the task report holds: the
    random init's same read-out, the best hand-made features, the supervised CNN. Per reference: the
    paired difference (same splits) and whether it beats the reference (its interval lies above the
    reference's and above chance)."""
    metric, out = report["metric"], {}
    references = {
        "random": report["encoders"].get("random", {}).get(readout, {}).get(metric),
        "handmade": report.get("handmade", {}).get(report.get("best_handmade"), {}).get(metric),
        "supervised": report.get("supervised", {}).get(metric),
    }
    for name, iv in references.items():
        if iv is not None:
            out[name] = {"difference": paired_difference(scores, iv), "beats": beats(scores, iv)}
    return out


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def checkpoint_probe_config(ckpt_cfg: Config, cli_cfg: Config, given: Set[str]) -> Config:
    """The config a checkpoint is probed with: its own (model, preprocessing, phantom folder,
    cache), this command line's device, and the phantom_dir and cache_dir of this command line where
    it names them (`given` flags)."""
    return dataclasses.replace(
        ckpt_cfg,
        device=cli_cfg.device,
        **{k: getattr(cli_cfg, k) for k in ("phantom_dir", "cache_dir") if k in given},
    )


def suite_sets(
    cfg: Config, labels_csv: Optional[str], names: Optional[Sequence[str]] = None
) -> List[Tuple[str, Tuple[Task, ...]]]:
    """(labels CSV, its tasks) to probe: a user's CSV (one classification task, 'label'), or the
    built-in suite's tasks (those in `names`; None = all), their phantom sets written first if need
    be."""
    if labels_csv:
        if names:
            raise ConfigError(
                "tasks: --tasks picks built-in tasks; a labels CSV is one task ('label')."
            )
        return [(labels_csv, (Task("label"),))]
    known = [t.name for tasks in SUITE.values() for t in tasks]
    if names and set(names) - set(known):
        raise ConfigError(
            f"tasks: {','.join(names)!r} names a task that is not one of {', '.join(known)}."
        )
    picked = {
        kind: tuple(t for t in tasks if not names or t.name in names)
        for kind, tasks in SUITE.items()
    }
    return [(phantom_set_labels(cfg, kind), tasks) for kind, tasks in picked.items() if tasks]


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="probe.py")
    parser.add_argument(
        "--ckpt", required=True, help="checkpoint path (local or gs://) or 'random'"
    )
    parser.add_argument(
        "--labels", default=None, help="CSV path,label (default: the built-in phantom suite)"
    )
    parser.add_argument(
        "--data_root", default=None, help="a folder holding labels.csv (instead of --labels)"
    )
    parser.add_argument(
        "--tasks", default=None, help="comma-separated built-in tasks to run (default: all)"
    )
    parser.add_argument(
        "--seeds", type=int, default=5, help="splits and probe initialisations (default 5)"
    )
    parser.add_argument(
        "--readouts", default=",".join(READOUTS), help=f"comma-separated, of {','.join(READOUTS)}"
    )
    parser.add_argument(
        "--no_reference",
        action="store_true",
        help="leave out the hand-made features and the supervised CNN (faster; no validity)",
    )
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument(
        "--vs_random",
        action="store_true",
        help="also probe a random init of the checkpoint's architecture, the same way, and compare",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help=(
            "PNG of the run's probe AUROC against pretraining updates "
            "(probe_every_steps), with the random-init level (--vs_random)"
        ),
    )
    args, rest = parser.parse(argv)
    readouts = args.readouts.split(",")
    if args.seeds < 2:
        parser.error("--seeds needs at least 2 for an interval")
    if not readouts or set(readouts) - set(READOUTS):
        parser.error(
            f"--readouts takes a comma-separated list of {', '.join(READOUTS)}, got"
            f" {args.readouts!r}"
        )
    if args.vs_random and args.ckpt == "random":
        parser.error("--vs_random compares a checkpoint with a random init; give --ckpt PATH")
    ckpt = resolve_checkpoint(args.ckpt)
    given = given_flags(rest)
    if args.ckpt != "random":
        other = sorted(given - set(CKPT_FIELDS))
        if other:
            raise ConfigError(
                f"{', '.join('--' + o for o in other)}: the checkpoint brings its own model and "
                f"preprocessing; with --ckpt PATH only --{', --'.join(CKPT_FIELDS)} apply."
            )
    cli_cfg = load_config(rest)
    report = {
        "ckpt": ckpt,
        "test_fraction": TEST_FRACTION,
        "seeds": args.seeds,
        "readouts": readouts,
        "partial": False,
        "tasks": {},
    }
    # Ctrl-C or SIGTERM stops at once; the tasks finished so far are kept (exit 75)
    with StopSignals() as signals:
        try:
            with signals.at_once():
                probe_tasks(report, args, cli_cfg, given)
        except StopRequested as stop:
            raise Preempted(
                f"{stop}: probe.py interrupted; {keep_partial(report, args, str(stop))}"
            ) from None
    print(format_report(report))
    save_outputs(report, args)
    return 0


def probe_tasks(report: dict, args, cli_cfg: Config, given: Set[str]) -> None:
    """main's work: the checkpoint (and with --vs_random a random init of its architecture) probed
    on each task, each task's report put in report['tasks'] as it finishes."""
    device = probe_device(cli_cfg)
    ckpt, readouts = report["ckpt"], report["readouts"]
    model, cfg = (
        (random_model(cli_cfg), cli_cfg) if ckpt == "random" else read_model_checkpoint(ckpt)[:2]
    )
    cfg = checkpoint_probe_config(cfg, cli_cfg, given)
    if args.labels and args.data_root:
        raise ConfigError(
            "labels: give --labels or --data_root (a folder holding labels.csv), not both."
        )
    labels_csv = args.labels or (
        os.path.join(args.data_root, "labels.csv") if args.data_root else None
    )
    sets = suite_sets(cfg, labels_csv, args.tasks.split(",") if args.tasks else None)
    arms = {"pretrained": model} if args.vs_random else {"encoder": model}
    if args.vs_random:
        arms["random"] = random_model(cfg)
    for csv_path, tasks in sets:
        probe_cfg = (
            cfg
            if labels_csv
            else dataclasses.replace(cfg, cache_dir=os.path.dirname(csv_path) + "-cache")
        )
        columns = sorted(
            {t.column for t in tasks} | ({"path"} if any(t.dense for t in tasks) else set())
        )
        volumes, values, skipped = load_labelled_volumes(probe_cfg, csv_path, columns=columns)
        by_patient = PATIENT_COLUMN in values
        if skipped:
            print(f"{csv_path}: skipped unusable files: {skipped}", file=sys.stderr)
        source = f"{csv_path} (unusable files: {skipped or 'none'})"
        patients = values[PATIENT_COLUMN] if by_patient else None
        # checked before any encoding
        targets = {t.name: task_targets(values[t.column], source) for t in tasks}
        splits = {
            name: probe_splits(y, names, patients, args.seeds, source)
            for name, (y, names) in targets.items()
        }
        tokens = encode_volumes(
            {arm: m.to(device).eval() for arm, m in arms.items()},
            counted(volumes, "encode", "volume"),
            device,
        )
        for task in tasks:
            print(f"probing {task.name} ({len(volumes)} volumes of {csv_path})", file=sys.stderr)
            y, names = targets[task.name]
            report["tasks"][task.name] = {
                "labels": csv_path,
                "column": task.column,
                "volumes": len(volumes),
                "skipped": skipped,
                "split_by": PATIENT_COLUMN if by_patient else "volume",
                "patients": len(set(patients)) if by_patient else None,
                "class_counts": {n: int((y == i).sum()) for i, n in enumerate(names)},
                **(
                    dense_report(
                        values["path"],
                        csv_path,
                        tokens,
                        model.grid,
                        volumes,
                        splits[task.name],
                        not args.no_reference,
                        device,
                        dense.TOKEN_TASKS[task.name],
                    )
                    if task.dense
                    else task_report(
                        y,
                        tokens,
                        model.grid,
                        volumes,
                        splits[task.name],
                        readouts,
                        not args.no_reference,
                        device,
                    )
                ),
            }


def save_outputs(report: dict, args) -> List[str]:
    """The report written to --json and its plot to --plot, where given: the paths written."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        metrics = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(report["ckpt"]))), "metrics.jsonl"
        )
        save_probe_plot(metrics, report, args.plot)
    return [path for path in (args.json, args.plot) if path]


def keep_partial(report: dict, args, stopped_by: str) -> str:
    """What an interrupted run keeps: the tasks finished so far printed and saved (save_outputs),
    the report marked partial; the words that say what was kept and where."""
    if not report["tasks"]:
        return "no task had finished; nothing written"
    report.update(partial=True, stopped_by=stopped_by)
    print(format_report(report))
    finished = f"the tasks finished ({', '.join(report['tasks'])})"
    written = save_outputs(report, args)
    if not written:
        return f"{finished} are printed above (--json would keep them)"
    return f"kept {finished}, marked partial, in {' and '.join(written)}"


def cell(iv: dict) -> str:
    """'mean [low, high]' of an interval."""
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def signed_cell(iv: dict) -> str:
    """'+mean [+low, +high]' of an interval of differences."""
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def format_report(report: dict) -> str:
    """The console tables of a probe report: per task, the headline metric of every encoder and
    read-out, the hand-made features, the supervised CNN, the task's validity and the paired
    differences."""
    lines = [
        f"{report['seeds']} probe seeds (splits), {report['test_fraction']:.0%} held out; 95%"
        " intervals"
    ]
    for name, t in report["tasks"].items():
        metric = t["metric"]
        valid = (
            ""
            if "valid" not in t
            else (
                "  VALID"
                if t["valid"]
                else (
                    f"  not valid (needs the best hand-made <= {VALID_SHORTCUT_MAX} and the "
                    f"CNN >= {VALID_CEILING_MIN})"
                )
            )
        )
        patients = f" of {t['patients']} patients (split by patient)" if t.get("patients") else ""
        lines += ["", f"{name}: {metric}, {t['volumes']} volumes{patients}{valid}"]
        for encoder, scores in t["encoders"].items():
            for readout, s in scores.items():
                lines.append(f"  {encoder:<11}{readout:<19}{cell(s[metric])}")
        for feature, s in t.get("handmade", {}).items():
            best = " (best hand-made)" if feature == t["best_handmade"] else ""
            lines.append(f"  {'hand-made':<11}{feature:<19}{cell(s[metric])}{best}")
        if "supervised" in t:
            lines.append(f"  {'supervised':<11}{'small 3D CNN':<19}{cell(t['supervised'][metric])}")
        for encoder, readouts in t["versus"].items():
            for readout, versus in readouts.items():
                diffs = ", ".join(
                    f"{'BEATS' if c['beats'] else 'vs'} {other} {signed_cell(c['difference'])}"
                    for other, c in versus.items()
                )
                if diffs:
                    lines.append(f"  {encoder} {readout}: {diffs}")
    return "\n".join(lines)


def save_probe_plot(metrics_path: str, report: dict, path: str) -> None:
    """PNG of the in-training probe AUROC (metrics.jsonl 'probe' lines) against pretraining updates,
    with the random-init level of the report's first task's mean-pool read-out (mean and 95%
    interval) drawn in."""
    probes = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            probes = [r for r in map(json.loads, f) if r["split"] == "probe"]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if probes:
        ax.plot(
            [r["step"] for r in probes],
            [r["probe_auroc"] for r in probes],
            "o-",
            label="pretrained (mean-pool)",
        )
        rows = [r for r in probes if "probe_rows_auroc" in r]
        if rows:
            ax.plot(
                [r["step"] for r in rows],
                [r["probe_rows_auroc"] for r in rows],
                "s-",
                label="pretrained (depth rows)",
            )
    task = next(iter(report["tasks"].values()), {})
    random = task.get("encoders", {}).get("random", {}).get("mean_pool", {}).get(task.get("metric"))
    if random:
        ax.axhline(random["mean"], color="gray", ls="--", label="random init (mean-pool)")
        ax.axhspan(random["low"], random["high"], color="gray", alpha=0.2)
    ax.set_xlabel("pretraining updates")
    ax.set_ylabel("held-out probe AUROC")
    title = "probe AUROC during pretraining" if probes else f"no probe lines in {metrics_path}"
    ax.set_title(f"{title} (partial: {report['stopped_by']})" if report.get("partial") else title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
