"""Nothing lost: a checkpoint is set aside only when it is shown to be damaged, a best.pt is never
overwritten by an earlier timeline, and one process at a time works in a run folder (real processes,
real files)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import CHECKPOINT_VERSION, list_checkpoints, step_of
from helpers import events, run_files, smoke_flags, train_process, wait_for
from train import main


@pytest.mark.slow
def test_a_resume_short_of_memory_stops_with_exit_74_and_renames_nothing(tmp_path, smoke_phantoms):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    step_file = run_dir / "checkpoints" / "step_0000004.pt"
    ckpt = torch.load(step_file, weights_only=True)
    ckpt["optimizer_extra"] = torch.zeros(2**28)  # 1 GiB more: a large model's checkpoint
    torch.save(ckpt, step_file)
    before = run_files(run_dir)
    relaunch = train_process([*flags, "--resume", "auto"], address_space_kb=1_800_000)
    assert relaunch.returncode == 74, relaunch.stderr[-2000:]
    assert "too little memory" in relaunch.stderr and "Nothing was renamed" in relaunch.stderr
    # no checkpoint set aside, no metrics dropped, best.pt as it was
    assert run_files(run_dir) == before


def test_a_checkpoint_holding_a_type_this_version_refuses_stops_with_exit_2_and_renames_nothing(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    step_file = run_dir / "checkpoints" / "step_0000004.pt"
    ckpt = torch.load(step_file, weights_only=True)
    # another version's
    ckpt["train_state"]["best_val_loss"] = np.float64(ckpt["train_state"]["best_val_loss"])
    torch.save(ckpt, step_file)
    before = run_files(run_dir)
    relaunch = train_process([*flags, "--resume", "auto"])
    assert relaunch.returncode == 2, relaunch.stderr[-2000:]
    assert "step_0000004.pt is intact" in relaunch.stderr and "numpy" in relaunch.stderr
    assert "Nothing was renamed" in relaunch.stderr
    assert run_files(run_dir) == before


@pytest.mark.slow
def test_a_best_checkpoint_written_after_the_resumed_update_is_set_aside_not_overwritten(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "12",
        "--ckpt_every_steps",
        "4",
        "--keep_last",
        "3",
        "--val_every_steps",
        "4",
    )
    assert main(flags) == 0
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    # the best was update 12
    (ckpt_dir / "best.pt").write_bytes((ckpt_dir / "step_0000012.pt").read_bytes())
    best_of_update_12 = (ckpt_dir / "best.pt").read_bytes()
    # back to update 4 by hand
    assert main([*flags, "--resume", str(ckpt_dir / "step_0000004.pt")]) == 0
    (set_aside,) = [
        e
        for e in events(tmp_path / "runs" / "r", "abandoned_checkpoint")
        if e["path"].endswith("best.pt")
    ]
    assert Path(set_aside["moved_to"]).read_bytes() == best_of_update_12
    assert [Path(p).name for p in list_checkpoints(str(ckpt_dir))] == [
        "step_0000012.pt",
        "step_0000008.pt",
        "step_0000004.pt",
    ]


def test_a_second_process_on_a_live_run_folder_exits_2_naming_it_and_a_killed_ones_lock_is_taken_over(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "400", "--ckpt_every_steps", "2")
    run_dir = tmp_path / "runs" / "r"
    first = train_process(flags, popen={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL})
    try:
        wait_for(
            lambda: list_checkpoints(str(run_dir / "checkpoints")), first, "its first checkpoint"
        )
        second = train_process([*flags, "--resume", "auto"])
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by process {first.pid} on {socket.gethostname()}" in second.stderr
        assert "another --run_name" in second.stderr
        assert first.poll() is None  # the first run goes on, its files untouched by the second
    finally:
        first.kill()
        first.wait()
    assert (run_dir / ".octjepa-lock").exists()  # left by the killed process
    third = train_process(
        [*flags, "--resume", "auto"], popen={"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    )
    try:
        wait_for(
            lambda: '"event": "resume"' in (run_dir / "events.jsonl").read_text(),
            third,
            "it resumed",
        )
        assert f'"pid": {third.pid}' in (run_dir / ".octjepa-lock").read_text()
        # a checkpoint past it: the loop (and its stop signals) runs
        resumed = events(run_dir, "resume")[-1]["step"]
        wait_for(
            lambda: step_of(list_checkpoints(str(run_dir / "checkpoints"))[0]) > resumed,
            third,
            "it trained on",
        )
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=300) == 75
    finally:
        third.kill()
        third.wait()
    assert not (run_dir / ".octjepa-lock").exists()  # given back at the end


def test_a_gcs_checkpoint_folder_is_leased_to_one_run_at_a_time(
    tmp_path, smoke_phantoms, gcs_emulator
):
    from storage import exists

    ckpt_dir = f"gs://{gcs_emulator.bucket}/leased/checkpoints"
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "400",
        "--ckpt_every_steps",
        "2",
        "--ckpt_dir",
        ckpt_dir,
    )
    first = train_process(flags, popen={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL})
    try:
        wait_for(lambda: exists(f"{ckpt_dir}/.octjepa-lock"), first, "it took its lease")
        other_run = train_process([*flags, "--run_name", "other", "--resume", "auto"])
        assert other_run.returncode == 2, other_run.stderr[-2000:]
        assert f"{ckpt_dir} is in use by process {first.pid}" in other_run.stderr
    finally:
        first.kill()
        first.wait()
    events_file = tmp_path / "runs" / "other" / "events.jsonl"
    taken_over = train_process(
        [*flags, "--run_name", "other", "--resume", "auto"],
        popen={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL},
    )
    try:  # a killed process's lease does not block the folder
        wait_for(
            lambda: events_file.exists() and '"event": "resume"' in events_file.read_text(),
            taken_over,
            "it resumed",
        )
        taken_over.send_signal(signal.SIGTERM)
        assert taken_over.wait(timeout=300) == 75
    finally:
        taken_over.kill()
        taken_over.wait()
    assert not exists(f"{ckpt_dir}/.octjepa-lock")


def test_the_stale_tmp_cleanup_leaves_a_running_writers_file_alone(tmp_path):
    from storage import TMP_INFIX, remove_stale_tmp

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    live = tmp_path / f"step_0000004.pt{TMP_INFIX}{socket.gethostname()}-{os.getpid()}-ab12cd34"
    stale = (
        tmp_path
        / f"step_0000002.pt{TMP_INFIX}{socket.gethostname()}-{gone.stdout.strip()}-ab12cd34"
    )
    live.write_bytes(b"being written")
    stale.write_bytes(b"left by a kill")
    assert remove_stale_tmp(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def test_resume_with_a_changed_model_preprocessing_or_loss_exits_2_naming_each_field(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    before = run_files(tmp_path / "runs" / "r")
    capsys.readouterr()
    assert (
        main(
            [
                *flags,
                "--resume",
                "auto",
                "--num_heads",
                "2",
                "--image_size",
                "16,32,32",
                "--depth",
                "3",
                "--embed_dim",
                "64",
                "--loss",
                "mse",
                "--mask_ratio",
                "0.5",
                "--clip_percentiles",
                "1,99",
                "--grad_clip",
                "0.5",
                "--use_bf16",
                "true",
            ]
        )
        == 2
    )
    stderr = capsys.readouterr().err
    for change in (
        "num_heads: 4 -> 2",
        "image_size: [8, 32, 32] -> [16, 32, 32]",
        "depth: 2 -> 3",
        "embed_dim: 48 -> 64",
        "loss: l1 -> mse",
        "mask_ratio: 0.6 -> 0.5",
        "clip_percentiles: [0.5, 99.5] -> [1.0, 99.0]",
        "grad_clip: 1.0 -> 0.5",
        "use_bf16: False -> True",
    ):
        assert change in stderr
    assert "Traceback" not in stderr and "another --run_name" in stderr
    assert run_files(tmp_path / "runs" / "r") == before  # config.yaml and metrics as they were


def test_a_run_whose_data_moved_to_another_root_resumes(tmp_path, smoke_phantoms):
    shutil.copytree(smoke_phantoms, tmp_path / "old_root" / "oct")
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "4",
        "--data_root",
        str(tmp_path / "old_root" / "oct"),
    )
    assert main(flags) == 0
    (tmp_path / "old_root").rename(tmp_path / "new_root")
    assert (
        main(
            [
                *flags,
                "--data_root",
                str(tmp_path / "new_root" / "oct"),
                "--max_steps",
                "6",
                "--extend",
                "true",
                "--resume",
                "auto",
            ]
        )
        == 0
    )
    assert [e["step"] for e in events(tmp_path / "runs" / "r", "resume")] == [4]


def cut_out_the_middle(path):
    """An interrupted copy that lost a stretch of the file: the zip's offsets point outside it
    (EINVAL on a seek)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2] + data[len(data) // 2 + 4096 :])


@pytest.mark.slow
def test_a_truncated_checkpoint_or_a_folder_in_its_place_is_set_aside_at_once_not_waited_for(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(
        tmp_path, smoke_phantoms, "--max_steps", "6", "--ckpt_every_steps", "2", "--keep_last", "3"
    )
    assert main(flags) == 0
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    cut_out_the_middle(ckpt_dir / "step_0000004.pt")
    (ckpt_dir / "step_0000006.pt").unlink()
    (ckpt_dir / "step_0000006.pt").mkdir()  # a copy tool's folder where the file should be
    # Retrying would take ckpt_retry_minutes (30): damage is known at once, and the run goes on from
    # update 2.
    assert main([*flags, "--resume", "auto", "--ckpt_retry_minutes", "30"]) == 0
    set_aside = {
        Path(e["path"]).name: e for e in events(tmp_path / "runs" / "r", "unreadable_checkpoint")
    }
    assert sorted(set_aside) == ["step_0000004.pt", "step_0000006.pt"]
    assert "a folder, not a checkpoint file" in set_aside["step_0000006.pt"]["why"]
    assert Path(set_aside["step_0000004.pt"]["moved_to"]).is_file()  # kept, renamed
    assert [e["step"] for e in events(tmp_path / "runs" / "r", "resume")] == [2]


def test_a_checkpoint_without_train_state_an_extra_weight_or_a_newer_format_stops_with_a_message(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "3")
    assert main(flags) == 0
    step_file = tmp_path / "runs" / "r" / "checkpoints" / "step_0000003.pt"
    whole = torch.load(step_file, weights_only=True)
    assert whole["version"] == CHECKPOINT_VERSION
    edits = {
        "without train_state": (lambda c: c.pop("train_state"), "has no 'train_state'"),
        "an extra weight": (
            lambda c: c["model"].update(extra=torch.zeros(2)),
            "the extra weights extra",
        ),
        "a newer format": (
            lambda c: c.update(version=99),
            "has format 99, newer than this octjepa reads",
        ),
    }
    for name, (edit, message) in edits.items():
        ckpt = torch.load(step_file, weights_only=True)
        edit(ckpt)
        torch.save(ckpt, step_file)
        before = run_files(tmp_path / "runs" / "r")
        capsys.readouterr()
        assert main([*flags, "--resume", "auto"]) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)
        assert run_files(tmp_path / "runs" / "r") == before, name  # nothing renamed, nothing logged
        torch.save(whole, step_file)
