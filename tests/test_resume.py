"""Resume, extend, rollback and multi-process runs: no silent schedule restarts (incident 2), no split brains."""
import os
import re
import shutil
import socket
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
from runtime import Runtime, list_checkpoints, probes_in_this_process
from train import ema_at, lr_at, main, wd_at
from test_train import REPO, SMOKE, read_jsonl, read_wandb_offline_history, smoke_flags


def events(run_dir, kind=None):
    return [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if kind is None or e["event"] == kind]


def metrics(run_dir, split="train"):
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["split"] == split]


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
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--resume", "auto", "--base_lr", "1e-3",
                            "--global_batch_size", "2", "--extend", "true")) == 2
    err = capsys.readouterr().err
    assert "base_lr: 0.0005 -> 0.001" in err and "global_batch_size: 4 -> 2" in err
    assert "--extend true (" not in err  # extending is offered only when the length is all that changed


def test_extending_a_finished_run_continues_the_lr_from_its_last_value(tmp_path, smoke_phantoms):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8")) == 0
    run_dir = tmp_path / "runs" / "r"
    last_lr = metrics(run_dir)[-1]["lr"]
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "16", "--resume", "auto", "--extend",
                            "true")) == 0
    lines = metrics(run_dir)
    assert [r["step"] for r in lines] == list(range(1, 17))
    assert all(r["lr"] == pytest.approx(last_lr) for r in lines[8:])  # a finished cosine holds min_lr
    (extend,) = events(run_dir, "extend")
    assert extend["step"] == 8 and extend["from_total_steps"] == 8 and extend["to_total_steps"] == 16
    # The extended plan is the run's plan from now on: resuming it needs no flag and changes nothing.
    assert torch.load(list_checkpoints(str(run_dir / "checkpoints"))[0])["plan"]["extensions"] == [[8, 8, 16]]
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "16", "--resume", "auto")) == 0


def test_extending_mid_run_stretches_the_rest_of_the_schedules_without_a_jump():
    cfg = load_config([], epochs=20, warmup_epochs=2, weight_decay_end=0.4, ema_base=0.99)
    plan = plan_run(cfg, world_size=1, train_volumes=cfg.global_batch_size * 10)
    at = plan.total_steps // 2
    longer = replace(plan, total_steps=3 * plan.total_steps, extensions=[[at, plan.total_steps, 3 * plan.total_steps]])
    for fn in (lr_at, wd_at, ema_at):
        before, after = [fn(s, cfg, plan) for s in range(at + 1)], [fn(s, cfg, longer) for s in range(at + 1)]
        assert after == before  # the updates already done keep their values
        values = [fn(s, cfg, longer) for s in range(longer.total_steps + 5)]
        steps = np.abs(np.diff(values[at:]))
        assert steps.max() <= 1.01 * np.abs(np.diff(values[plan.warmup_steps:at + 1])).max()  # no jump
        assert values[-1] == pytest.approx(fn(plan.total_steps - 1, cfg, plan))  # ends where the plan ended
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
    _, val_after_loss = split_by_patient(records[1:], 0.1, seed=0)  # one patient lost (a read error on rescan)
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
def test_a_rollback_drops_the_metrics_it_rewinds_and_wandb_keeps_every_update(tmp_path, smoke_phantoms,
                                                                             monkeypatch):
    real, updates = train.forward_backward, []

    def poisoned(*args, **kwargs):  # updates 5-7 are non-finite: three skips in a row, then a rollback to update 4
        loss, target_std = real(*args, **kwargs)
        updates.append(len(updates) + 1)
        return (loss * float("nan") if 5 <= updates[-1] <= 7 else loss), target_std

    monkeypatch.setattr(train, "forward_backward", poisoned)
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "10", "--wandb", "offline")) == 0
    run_dir = tmp_path / "runs" / "r"
    assert [e["step"] for e in events(run_dir, "rollback")] == [4]
    lines = metrics(run_dir)
    assert [r["step"] for r in lines] == list(range(1, 11))  # 5-7 once, from after the rollback
    assert all(r["loss"] is not None for r in lines)
    rows = {}
    for row in read_wandb_offline_history(run_dir):  # W&B's own step only increases; the update counter goes back
        if "train/loss" in row:
            rows[row["update"]] = row
    for r in lines:
        assert rows[r["step"]]["train/loss"] == pytest.approx(r["loss"]), r["step"]


# --- 6. a batch larger than the data ---

def test_max_steps_with_a_train_split_smaller_than_the_batch_exits_2(tmp_path, smoke_phantoms, capsys):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--global_batch_size", "32",
                            "--per_core_batch_size", "32")) == 2
    assert "global_batch_size: 32 is larger than the" in capsys.readouterr().err


# --- 7. best.pt ---

def test_best_checkpoint_is_judged_only_on_a_validation_of_its_own_weights(tmp_path, smoke_phantoms):
    assert main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "8", "--val_every_steps", "2",
                            "--ckpt_every_steps", "3", "--keep_last", "10")) == 0
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
        return Runtime(torch.device("cpu"), kind, world_size=8, process_index=index, process_count=2,
                       local_replicas=4 if kind == "xla" else 1, multi_host=True)
    assert probes_in_this_process(rt("xla", 0)) and probes_in_this_process(rt("xla", 1))  # an SPMD graph must run on every host
    assert probes_in_this_process(rt("cpu", 0)) and not probes_in_this_process(rt("cpu", 1))


# --- 4, 5. DDP processes agree (real gloo processes under torchrun) ---

def torchrun(tmp_path, faults, *flags, nnodes=1, node_rank=0, port=None, nproc=2, popen=False):
    node = ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "octjepa-test"] if nnodes > 1 else ["--standalone"]
    args = [sys.executable, "-m", "torch.distributed.run", *node, f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "ddp_faults.py"), faults, *flags]
    if popen:
        return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)


def ddp_flags(tmp_path, phantoms, *flags):
    return ["--config", SMOKE, "--phantom_dir", phantoms, "--out_dir", str(tmp_path / "runs"),
            "--per_core_batch_size", "2", *flags]


@pytest.mark.slow
def test_ddp_processes_share_a_run_folder_roll_back_together_and_leave_the_group_at_exit(tmp_path, smoke_phantoms):
    result = torchrun(tmp_path, "late_start,nan_5_7,exit_report", *ddp_flags(tmp_path, smoke_phantoms,
                                                                             "--max_steps", "10"))
    assert result.returncode == 0, result.stderr[-3000:]
    # Both left the process group before interpreter teardown, where a gloo thread can abort the process.
    assert result.stderr.count("gloo worker threads at exit: 0") == 2, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # no --run_name: process 0 named it for both
    assert [e["step"] for e in events(run_dir, "rollback")] == [4]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 11))


@pytest.mark.slow
def test_ddp_resume_survives_a_transient_read_error_in_one_process(tmp_path, smoke_phantoms):
    flags = ddp_flags(tmp_path, smoke_phantoms, "--run_name", "r", "--max_steps", "8", "--ckpt_every_steps", "4",
                      "--keep_last", "5")
    straight = torchrun(tmp_path, "none", *flags)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    expected = metrics(run_dir)
    os.remove(run_dir / "checkpoints" / "step_0000008.pt")  # as if the run had stopped after update 4
    resumed = torchrun(tmp_path, "read_once", *flags, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resume,) = events(run_dir, "resume")
    assert resume["step"] == 4
    got = metrics(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in expected], rtol=1e-5)
    # A read error that does not pass stops every process, before any of them trains from other weights.
    failed = torchrun(tmp_path, "read_always", *flags, "--resume", "auto")
    assert failed.returncode != 0 and "process 1" in failed.stderr and "none trains" in failed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["bad_files", "no_data"])
def test_unreadable_data_in_one_process_stops_every_process_with_exit_3(tmp_path, smoke_phantoms, fault):
    result = torchrun(tmp_path, fault, *ddp_flags(tmp_path, smoke_phantoms, "--run_name", "r", "--max_steps", "8",
                                                 "--ckpt_dir", "none", "--max_bad_fraction", "0.1"))
    # Both processes stop with the data diagnosis (torchrun itself exits 1 and ends the others on a first exit 3;
    # a process left waiting in a collective would print nothing).
    assert result.stderr.count("no usable data") == 2, result.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*3", result.stderr)
    if fault == "bad_files":  # process 1's files are counted and logged by the master
        logged = events(tmp_path / "runs" / "r", "unreadable_file")
        assert logged and all("heidelberg" in e["path"] for e in logged)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_multi_machine_ddp_run_needs_a_shared_checkpoint_folder(tmp_path, smoke_phantoms):
    def two_machines(*extra):
        port = free_port()
        flags = ddp_flags(tmp_path, smoke_phantoms, "--run_name", "r", "--max_steps", "4", *extra)
        nodes = [torchrun(tmp_path, "none", *flags, nnodes=2, node_rank=n, port=port, nproc=1, popen=True)
                 for n in (0, 1)]
        return [(n.communicate(timeout=600)[1], n.returncode)[::-1] for n in nodes]

    for code, err in two_machines():
        assert code != 0 and "ckpt_dir" in err and "--ckpt_dir_shared true" in err
    for code, err in two_machines("--ckpt_dir_shared", "true"):  # both "machines" see this folder: it works
        assert code == 0, err[-3000:]
