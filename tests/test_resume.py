"""Resume, extend, rollback and multi-process runs: no silent schedule restarts (incident 2), no
split brains."""

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from config import load_config, plan_run
from data import split_by_patient
from checkpoint import list_checkpoints
from runtime import Runtime, probes_in_this_process
from schedules import ema_at, lr_at, wd_at
from train import main
from helpers import (
    REPO,
    SMOKE,
    ddp_flags,
    events,
    free_port,
    metrics,
    read_jsonl,
    read_wandb_offline_history,
    run_files,
    smoke_flags,
    stderr_excerpt,
    torchrun,
)

# --- 1. the plan a checkpoint was written for ---


def test_resume_with_a_longer_run_is_refused_not_restarted(tmp_path, smoke_phantoms, capsys):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8")) == 0
    run_dir = tmp_path / "runs" / "r"
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    capsys.readouterr()
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "16", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "total_steps: 8 -> 16" in err and "--extend true" in err and "another --run_name" in err
    assert {name: (run_dir / name).read_bytes() for name in before} == before  # nothing was touched


def test_resume_with_another_lr_or_batch_names_each_change(tmp_path, smoke_phantoms, capsys):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")) == 0
    capsys.readouterr()
    assert (
        main(
            smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "4",
                "--resume",
                "auto",
                "--base_lr",
                "1e-3",
                "--global_batch_size",
                "2",
                "--extend",
                "true",
            )
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "base_lr: 0.0005 -> 0.001" in err and "global_batch_size: 4 -> 2" in err
    # extending is offered only when the length is all that changed
    assert "--extend true (" not in err


def test_extending_a_finished_run_continues_the_lr_from_its_last_value(tmp_path, smoke_phantoms):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8")) == 0
    run_dir = tmp_path / "runs" / "r"
    last_lr = metrics(run_dir)[-1]["lr"]
    assert (
        main(
            smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "16",
                "--resume",
                "auto",
                "--extend",
                "true",
            )
        )
        == 0
    )
    lines = metrics(run_dir)
    assert [r["step"] for r in lines] == list(range(1, 17))
    # a finished cosine holds min_lr
    assert all(r["lr"] == pytest.approx(last_lr) for r in lines[8:])
    (extend,) = events(run_dir, "extend")
    assert (
        extend["step"] == 8 and extend["from_total_steps"] == 8 and extend["to_total_steps"] == 16
    )
    # The extended plan is the run's plan from now on: resuming it needs no flag and changes
    # nothing.
    assert torch.load(list_checkpoints(str(run_dir / "checkpoints"))[0])["plan"]["extensions"] == [
        [8, 8, 16]
    ]
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "16", "--resume", "auto")) == 0


@pytest.mark.slow
def test_extending_a_finished_run_says_its_target_is_frozen_and_how_to_keep_learning(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8")
    assert main(flags) == 0
    capsys.readouterr()
    assert main([*flags, "--max_steps", "12", "--resume", "auto", "--extend", "true"]) == 0
    out = capsys.readouterr().out
    assert (
        "EMA momentum 1: the target encoder no longer moves" in out
        and "--extend_schedule rewarm" in out
    )
    assert {r["ema_momentum"] for r in metrics(tmp_path / "runs" / "r")[8:]} == {1.0}
    assert events(tmp_path / "runs" / "r", "extend")[0]["finished"] is True


@pytest.mark.slow
def test_extend_schedule_rewarm_warms_the_lr_up_again_and_moves_the_target_encoder(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    last_lr = metrics(run_dir)[-1]["lr"]
    assert (
        main(
            [
                *flags,
                "--max_steps",
                "16",
                "--resume",
                "auto",
                "--extend",
                "true",
                "--extend_schedule",
                "rewarm",
            ]
        )
        == 0
    )
    added = metrics(run_dir)[8:]
    lrs = [r["lr"] for r in added]
    # from where it was, up over warmup_steps (2)
    assert last_lr < lrs[0] < lrs[1] == pytest.approx(5e-4)
    # then down again
    assert all(b <= a for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] == pytest.approx(1e-5)
    ema_base = load_config(["--config", SMOKE]).ema_base
    assert added[0]["ema_momentum"] == pytest.approx(ema_base) and added[-2]["ema_momentum"] < 1.0
    assert torch.load(list_checkpoints(str(run_dir / "checkpoints"))[0])["plan"]["extensions"] == [
        [8, 8, 16, "rewarm"]
    ]
    assert events(run_dir, "extend")[0]["schedule"] == "rewarm"


def test_a_stretch_after_a_rewarm_stretches_what_is_left_of_the_new_segment():
    cfg = load_config([], warmup_steps=10, max_steps=100)
    plan = plan_run(cfg, world_size=1, train_volumes=cfg.global_batch_size * 10)
    rewarm = replace(plan, total_steps=200, extensions=[[100, 100, 200, "rewarm"]])
    both = replace(plan, total_steps=300, extensions=[[100, 100, 200, "rewarm"], [150, 200, 300]])
    for fn in (lr_at, wd_at, ema_at):
        assert [fn(s, cfg, both) for s in range(151)] == [fn(s, cfg, rewarm) for s in range(151)]
        # ends where the segment ended
        assert fn(299, cfg, both) == pytest.approx(fn(199, cfg, rewarm))
    lrs = [lr_at(s, cfg, both) for s in range(300)]
    # smooth after its warmup
    assert max(abs(b - a) for a, b in zip(lrs[110:], lrs[111:])) < 2 * cfg.base_lr / 100


def test_extending_mid_run_stretches_the_rest_of_the_schedules_without_a_jump():
    cfg = load_config([], epochs=20, warmup_epochs=2, weight_decay_end=0.4, ema_base=0.99)
    plan = plan_run(cfg, world_size=1, train_volumes=cfg.global_batch_size * 10)
    at = plan.total_steps // 2
    longer = replace(
        plan,
        total_steps=3 * plan.total_steps,
        extensions=[[at, plan.total_steps, 3 * plan.total_steps]],
    )
    for fn in (lr_at, wd_at, ema_at):
        before, after = (
            [fn(s, cfg, plan) for s in range(at + 1)],
            [fn(s, cfg, longer) for s in range(at + 1)],
        )
        assert after == before  # the updates already done keep their values
        values = [fn(s, cfg, longer) for s in range(longer.total_steps + 5)]
        steps = np.abs(np.diff(values[at:]))
        # no jump
        assert steps.max() <= 1.01 * np.abs(np.diff(values[plan.warmup_steps : at + 1])).max()
        # ends where the plan ended
        assert values[-1] == pytest.approx(fn(plan.total_steps - 1, cfg, plan))
    lrs = [lr_at(s, cfg, longer) for s in range(plan.warmup_steps, longer.total_steps)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))  # never back up (incident 2)


def test_resume_on_a_grown_dataset_is_refused_with_what_changed(tmp_path, smoke_phantoms, capsys):
    data_root = tmp_path / "data"
    entries = sorted(p for p in Path(smoke_phantoms).iterdir() if p.name[0].isdigit())
    data_root.mkdir()

    def add(paths):
        for p in paths:
            (shutil.copytree if p.is_dir() else shutil.copy)(p, data_root / p.name)

    add(entries[:12])
    flags = smoke_flags(tmp_path, smoke_phantoms, "--data_root", str(data_root), "--max_steps", "4")
    assert main(flags) == 0
    add(entries[12:])
    capsys.readouterr()
    assert main([*flags, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "split:" in err and ("train_volumes" in err or "val_volumes" in err)


# --- 2. validation membership ---


def test_val_membership_does_not_depend_on_the_other_patients():
    records = [{"patient": f"P{i:03d}", "paths": [f"/d/{i}.dcm"]} for i in range(200)]
    _, val = split_by_patient(records, 0.1, seed=0)
    # one patient lost (a read error on rescan)
    _, val_after_loss = split_by_patient(records[1:], 0.1, seed=0)
    assert {r["patient"] for r in val} - {"P000"} == {r["patient"] for r in val_after_loss}
    assert 5 <= len(val) <= 40  # about val_fraction of the patients
    assert split_by_patient(records, 0.1, seed=1)[1] != val  # the seed chooses the split


def test_a_tiny_dataset_still_gets_one_val_and_one_train_patient():
    records = [{"patient": p, "paths": [p]} for p in ("a", "b")]
    for fraction in (0.01, 0.99):
        train_records, val = split_by_patient(records, fraction, seed=0)
        assert len(train_records) == 1 and len(val) == 1


# --- 3. rollbacks in metrics.jsonl and W&B ---


@pytest.mark.slow
def test_a_rollback_drops_the_metrics_it_rewinds_and_wandb_keeps_every_update(
    tmp_path, smoke_phantoms, monkeypatch
):
    real, updates = train.forward_backward, []

    # updates 5-7 are non-finite: three skips in a row, then a rollback to update 4
    def poisoned(*args, **kwargs):
        loss, target_std = real(*args, **kwargs)
        updates.append(len(updates) + 1)
        return (loss * float("nan") if 5 <= updates[-1] <= 7 else loss), target_std

    monkeypatch.setattr(train, "forward_backward", poisoned)
    assert (
        main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "10", "--wandb", "offline")) == 0
    )
    run_dir = tmp_path / "runs" / "r"
    assert [e["step"] for e in events(run_dir, "rollback")] == [4]
    lines = metrics(run_dir)
    assert [r["step"] for r in lines] == list(range(1, 11))  # 5-7 once, from after the rollback
    assert all(r["loss"] is not None for r in lines)
    rows = {}
    # W&B's own step only increases; the update counter goes back
    for row in read_wandb_offline_history(run_dir):
        if "train/loss" in row:
            rows[row["update"]] = row
    for r in lines:
        assert rows[r["step"]]["train/loss"] == pytest.approx(r["loss"]), r["step"]


# --- 6. a batch larger than the data ---


def test_max_steps_with_a_train_split_smaller_than_the_batch_exits_2(
    tmp_path, smoke_phantoms, capsys
):
    assert (
        main(
            smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "4",
                "--global_batch_size",
                "32",
                "--per_core_batch_size",
                "32",
            )
        )
        == 2
    )
    assert "global_batch_size: 32 is larger than the" in capsys.readouterr().err


# --- 7. best.pt ---


def test_best_checkpoint_is_judged_only_on_a_validation_of_its_own_weights(
    tmp_path, smoke_phantoms
):
    assert (
        main(
            smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "8",
                "--val_every_steps",
                "2",
                "--ckpt_every_steps",
                "3",
                "--keep_last",
                "10",
            )
        )
        == 0
    )
    run_dir = tmp_path / "runs" / "r"
    val = {r["step"]: r["loss"] for r in metrics(run_dir, "val")}
    best_steps = [e["step"] for e in events(run_dir, "checkpoint") if e["best"]]
    assert best_steps and all(step in val for step in best_steps)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["train_state"]["step"] == min(val, key=val.get)
    assert best["train_state"]["best_val_loss"] == pytest.approx(min(val.values()))


# --- 8. probing on a TPU pod ---


def test_the_probe_runs_in_every_process_of_an_xla_pod_and_on_the_master_of_ddp():
    def rt(kind, index):
        return Runtime(
            torch.device("cpu"),
            kind,
            world_size=8,
            process_index=index,
            process_count=2,
            local_replicas=4 if kind == "xla" else 1,
            multi_host=True,
        )

    # an SPMD graph must run on every host
    assert probes_in_this_process(rt("xla", 0)) and probes_in_this_process(rt("xla", 1))
    assert probes_in_this_process(rt("cpu", 0)) and not probes_in_this_process(rt("cpu", 1))


# --- 9. one checkpoint timeline; a metrics.jsonl that survives ---


def preempt_during(update, monkeypatch):
    """The next main() gets a real SIGTERM, from itself, during the `update`th update it runs."""
    real, runs = train.train_update, []

    def train_update(*args, **kwargs):
        runs.append(1)
        if len(runs) == update:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "train_update", train_update)


def damage(path):
    """Cut a checkpoint short, as a disk that filled while it was written would."""
    Path(path).write_bytes(Path(path).read_bytes()[:1000])


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_never_outranks_the_ones_written_after_it(
    tmp_path, smoke_phantoms, monkeypatch, capsys
):
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "20",
        "--ckpt_every_steps",
        "5",
        "--keep_last",
        "5",
        "--val_every_steps",
        "100",
    )
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    preempt_during(13, monkeypatch)
    assert main(flags) == 75  # preempted at update 13: step 5, 10, 13
    damage(ckpt_dir / "step_0000013.pt")
    # Resumed from update 10 with keep_last 1, and preempted again at update 12, before the damaged
    # 13.
    monkeypatch.undo()
    preempt_during(2, monkeypatch)
    capsys.readouterr()
    assert main([*flags, "--resume", "auto", "--keep_last", "1"]) == 75
    assert [Path(p).name for p in list_checkpoints(str(ckpt_dir))] == ["step_0000012.pt"]
    (set_aside,) = events(tmp_path / "runs" / "r", "unreadable_checkpoint")
    assert set_aside["path"].endswith("step_0000013.pt") and Path(set_aside["moved_to"]).exists()
    assert set_aside["moved_to"] in capsys.readouterr().out
    monkeypatch.undo()
    assert main([*flags, "--resume", "auto"]) == 0
    assert [e["step"] for e in events(tmp_path / "runs" / "r", "resume")] == [10, 12]
    assert [r["step"] for r in metrics(tmp_path / "runs" / "r")] == list(range(1, 21))


@pytest.mark.slow
def test_a_manual_rollback_abandons_the_later_checkpoints_for_good(
    tmp_path, smoke_phantoms, monkeypatch
):
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "20",
        "--ckpt_every_steps",
        "5",
        "--keep_last",
        "5",
        "--val_every_steps",
        "100",
    )
    assert main(flags) == 0
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    # Back to update 10 by hand (say, the loss looked wrong after it), preempted at update 13.
    preempt_during(3, monkeypatch)
    assert main([*flags, "--resume", str(ckpt_dir / "step_0000010.pt")]) == 75
    monkeypatch.undo()
    abandoned = events(tmp_path / "runs" / "r", "abandoned_checkpoint")
    # best.pt (validated at update 20) is newer than update 10: set aside too, never overwritten by
    # the new timeline
    assert sorted(Path(e["path"]).name for e in abandoned) == [
        "best.pt",
        "step_0000015.pt",
        "step_0000020.pt",
    ]
    # continues the rolled-back timeline, not the abandoned one
    assert main([*flags, "--resume", "auto"]) == 0
    assert [e["step"] for e in events(tmp_path / "runs" / "r", "resume")] == [10, 13]
    assert [r["step"] for r in metrics(tmp_path / "runs" / "r")] == list(range(1, 21))


@pytest.mark.slow
def test_a_refused_rollback_changes_nothing_and_an_accepted_one_says_what_it_set_aside(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(
        tmp_path, smoke_phantoms, "--max_steps", "8", "--ckpt_every_steps", "2", "--keep_last", "4"
    )
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    step_4 = str(run_dir / "checkpoints" / "step_0000004.pt")
    before = run_files(run_dir)
    capsys.readouterr()
    # back to update 4, with another LR
    assert main([*flags, "--resume", step_4, "--base_lr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "base_lr" in err and f"--config {run_dir}/config.yaml --resume {step_4}" in err
    assert run_files(run_dir) == before  # nothing set aside, metrics.jsonl whole
    assert main([*flags, "--resume", step_4]) == 0  # the rollback, on purpose
    out = capsys.readouterr().out
    assert f"resume {step_4}: 3 later checkpoint(s)" in out
    for name in ("step_0000006.pt", "step_0000008.pt", "best.pt"):
        assert (
            f"checkpoints/{name}: past update 4" in out
            or f"checkpoints/{name}: written after update 4" in out
        )
    assert sorted(Path(e["path"]).name for e in events(run_dir, "abandoned_checkpoint")) == [
        "best.pt",
        "step_0000006.pt",
        "step_0000008.pt",
    ]


@pytest.mark.slow
def test_a_run_whose_checkpoints_are_all_damaged_stops_instead_of_starting_from_scratch(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "6", "--ckpt_every_steps", "2")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    ckpt_dir = run_dir / "checkpoints"
    for path in list_checkpoints(str(ckpt_dir)):  # step 4 and 6 (keep_last 2)
        damage(path)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*flags, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "no step checkpoint to continue it from" in err and "step_0000006.pt.unreadable-" in err
    assert "--resume restart" in err and "another --run_name" in err
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    # and again: the set-aside files still say a run was here
    assert main([*flags, "--resume", "auto"]) == 2
    assert main([*flags, "--resume", "restart"]) == 0  # started over on purpose
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 7))
    (restarted,) = {
        Path(e["moved_to"]).parent
        for e in events(run_dir, "restarted")
        if e["path"].endswith("metrics.jsonl")
    }
    # the old history kept beside it
    assert (restarted / "metrics.jsonl").read_bytes() == metrics_before


def test_resume_without_step_checkpoints_refuses_instead_of_starting_over(
    tmp_path, smoke_phantoms, capsys
):
    elsewhere = tmp_path / "elsewhere"
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main([*flags, "--ckpt_dir", str(elsewhere)]) == 0
    run_dir = tmp_path / "runs" / "r"
    history = {**run_files(run_dir), **{f"ckpt/{k}": v for k, v in run_files(elsewhere).items()}}
    capsys.readouterr()
    assert main([*flags, "--resume", "auto"]) == 2  # a relaunch that forgot its --ckpt_dir
    err = capsys.readouterr().err
    assert (
        "metrics.jsonl (up to update 4)" in err
        and f"config.yaml says --ckpt_dir {elsewhere}" in err
    )
    for path in elsewhere.glob("step_*.pt"):  # step files deleted to save space, best.pt kept
        path.unlink()
    for resume in (["--resume", "auto"], []):
        assert main([*flags, "--ckpt_dir", str(elsewhere), *resume]) == 2
        err = capsys.readouterr().err
        assert (
            "holds the history of an earlier run" in err and f"--resume {elsewhere}/best.pt" in err
        )
        assert "--resume restart" in err and "Traceback" not in err
    assert run_files(run_dir) == {k: v for k, v in history.items() if not k.startswith("ckpt/")}
    # best.pt of the old run untouched
    assert run_files(elsewhere) == {"best.pt": history["ckpt/best.pt"]}
    assert main([*flags, "--ckpt_dir", str(elsewhere), "--resume", "restart"]) == 0
    moved = {Path(e["path"]).name: Path(e["moved_to"]) for e in events(run_dir, "restarted")}
    assert moved["metrics.jsonl"].read_bytes() == history["metrics.jsonl"]
    assert (
        moved["best.pt"].read_bytes() == history["ckpt/best.pt"]
        and moved["best.pt"].parent.parent == elsewhere
    )
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def test_a_metrics_line_cut_short_is_dropped_with_a_warning_when_the_run_resumes(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    torn = len(read_jsonl(run_dir / "metrics.jsonl")) + 1
    with open(run_dir / "metrics.jsonl", "a") as f:
        # a full disk (or a kill) in the middle of a line
        f.write('{"split": "train", "step": 5, "lo')
    assert main([*flags, "--max_steps", "6", "--resume", "auto", "--extend", "true"]) == 0
    assert f"line {torn} is not a whole JSON line" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 7))
    (dropped,) = events(run_dir, "metrics_line_dropped")
    assert dropped["text"].startswith('{"split": "train", "step": 5')


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_is_relaunched_by_the_same_command(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "30",
        "--ckpt_every_steps",
        "100",
        "--val_every_steps",
        "100",
        "--log_every_steps",
        "1",
        "--resume",
        "auto",
    )
    run_dir = tmp_path / "runs" / "r"
    killed = subprocess.run(
        [sys.executable, str(REPO / "tests" / "faults.py"), "sigkill_at_3", *flags],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    killed_metrics = (run_dir / "metrics.jsonl").read_bytes()
    assert not (run_dir / "checkpoints").exists() or not list(
        (run_dir / "checkpoints").glob("*.pt")
    )
    capsys.readouterr()
    assert main(flags) == 0  # the same command, as a job scheduler relaunches it
    assert "never wrote a checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 31))
    moved = {Path(e["path"]).name: Path(e["moved_to"]) for e in events(run_dir, "restarted")}
    # the killed attempt's log kept beside it
    assert moved["metrics.jsonl"].read_bytes() == killed_metrics


def test_a_misspelt_resume_is_refused_even_in_a_dry_run(tmp_path, smoke_phantoms, capsys):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main([*flags, "--dry_run", "true", "--resume", "autoo"]) == 2
    err = capsys.readouterr().err
    assert (
        "'autoo' is neither 'auto', 'restart' nor a checkpoint file; did you mean --resume auto?"
        in err
    )


def test_a_restart_moves_the_old_runs_export_and_notes_aside_with_its_history(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "export").mkdir()
    (run_dir / "export" / "encoder.safetensors").write_bytes(b"the old run's encoder")
    (run_dir / "notes.txt").write_text("what I saw in the old run")
    capsys.readouterr()
    assert main([*flags, "--resume", "restart"]) == 0
    out = capsys.readouterr().out
    # nothing stale looks current
    assert not (run_dir / "export").exists() and not (run_dir / "notes.txt").exists()
    moved = {Path(e["path"]).name: Path(e["moved_to"]) for e in events(run_dir, "restarted")}
    assert (moved["export"] / "encoder.safetensors").read_bytes() == b"the old run's encoder"
    assert (
        moved["notes.txt"].read_text() == "what I saw in the old run"
        and str(moved["export"]) in out
    )


def test_a_metrics_line_without_an_update_number_is_dropped_with_a_warning_when_the_run_resumes(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    odd = len(read_jsonl(run_dir / "metrics.jsonl")) + 1
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"split": "train", "note": "added by a notebook"}\n')
    capsys.readouterr()
    assert main([*flags, "--max_steps", "6", "--resume", "auto", "--extend", "true"]) == 0
    assert f"line {odd} has no update number" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 7))
    (dropped,) = events(run_dir, "metrics_line_dropped")
    assert "added by a notebook" in dropped["text"]


def test_a_run_name_that_would_leave_out_dir_is_refused(tmp_path, smoke_phantoms, capsys):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--run_name", "../escaped")) == 2
    assert "run_name: '../escaped'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- 4, 5. DDP processes agree (real gloo processes under torchrun) ---


@pytest.mark.slow
# a sharded rollback restores each process's shards
@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_ddp_processes_share_a_run_folder_roll_back_together_and_leave_the_group_at_exit(
    tmp_path, smoke_phantoms, shard
):
    result = torchrun(
        tmp_path,
        "late_start,nan_5_7,exit_report",
        *ddp_flags(tmp_path, smoke_phantoms, "--max_steps", "10", "--shard", shard),
    )
    assert result.returncode == 0, stderr_excerpt(result)
    # Both left the process group before interpreter teardown, where a gloo thread can abort the
    # process.
    assert result.stderr.count("gloo worker threads at exit: 0") == 2, stderr_excerpt(result)
    (run_dir,) = (tmp_path / "runs").iterdir()  # no --run_name: process 0 named it for both
    assert [e["step"] for e in events(run_dir, "rollback")] == [4]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 11))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["bad_files", "no_data"])
def test_unreadable_data_in_one_process_stops_every_process_with_exit_3(
    tmp_path, smoke_phantoms, fault
):
    result = torchrun(
        tmp_path,
        fault,
        *ddp_flags(
            tmp_path,
            smoke_phantoms,
            "--run_name",
            "r",
            "--max_steps",
            "8",
            "--ckpt_dir",
            "none",
            "--max_bad_fraction",
            "0.1",
        ),
    )
    # Both processes stop with the data diagnosis (torchrun itself exits 1 and ends the others on a
    # first exit 3; a process left waiting in a collective would print nothing).
    assert result.stderr.count("no usable data") == 2, stderr_excerpt(result)
    assert re.search(r"exitcode\s*:\s*3", result.stderr)
    if fault == "bad_files":  # process 1's files are counted and logged by the master
        logged = events(tmp_path / "runs" / "r", "unreadable_file")
        assert logged and all("heidelberg" in e["path"] for e in logged)


@pytest.mark.slow
def test_a_multi_machine_ddp_run_needs_a_shared_checkpoint_folder(tmp_path, smoke_phantoms):
    def two_machines(*extra):
        port = free_port()
        flags = ddp_flags(tmp_path, smoke_phantoms, "--run_name", "r", "--max_steps", "4", *extra)
        nodes = [
            torchrun(
                tmp_path, "none", *flags, nnodes=2, node_rank=n, port=port, nproc=1, popen=True
            )
            for n in (0, 1)
        ]
        return [(n.communicate(timeout=600)[1], n.returncode)[::-1] for n in nodes]

    for code, err in two_machines():
        assert code != 0 and "ckpt_dir" in err and "--ckpt_dir_shared true" in err
    # both "machines" see this folder: it works
    for code, err in two_machines("--ckpt_dir_shared", "true"):
        assert code == 0, err[-3000:]
