"""Nothing lost: a checkpoint is set aside only when it is shown to be damaged, a best.pt is never overwritten by an
earlier timeline, and one process at a time works in a run folder (real processes, real files)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import list_checkpoints
from test_resume import events
from test_train import REPO, smoke_flags
from train import main


def train_process(flags, address_space_kb=None, **popen):
    """`python train.py FLAGS` as its own process (under an address-space cap, as clusters set one); the Popen, or
    the finished process with its output."""
    cap = f"ulimit -v {address_space_kb}; " if address_space_kb else ""
    command = ["bash", "-c", cap + 'exec "$@"', "bash", sys.executable, str(REPO / "train.py"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, text=True, **popen)
    return subprocess.run(command, cwd=REPO, env=env, text=True, capture_output=True, timeout=600)


def run_files(run_dir):
    """Every file under a run folder with its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(Path(run_dir).rglob("*")) if p.is_file()}


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
    assert run_files(run_dir) == before  # no checkpoint set aside, no metrics dropped, best.pt as it was


def test_a_checkpoint_holding_a_type_this_version_refuses_stops_with_exit_2_and_renames_nothing(
        tmp_path, smoke_phantoms):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    step_file = run_dir / "checkpoints" / "step_0000004.pt"
    ckpt = torch.load(step_file, weights_only=True)
    ckpt["train_state"]["best_val_loss"] = np.float64(ckpt["train_state"]["best_val_loss"])  # another version's
    torch.save(ckpt, step_file)
    before = run_files(run_dir)
    relaunch = train_process([*flags, "--resume", "auto"])
    assert relaunch.returncode == 2, relaunch.stderr[-2000:]
    assert "step_0000004.pt is intact" in relaunch.stderr and "numpy" in relaunch.stderr
    assert "Nothing was renamed" in relaunch.stderr
    assert run_files(run_dir) == before


@pytest.mark.slow
def test_a_best_checkpoint_written_after_the_resumed_update_is_set_aside_not_overwritten(tmp_path, smoke_phantoms):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "12", "--ckpt_every_steps", "4", "--keep_last", "3",
                        "--val_every_steps", "4")
    assert main(flags) == 0
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    (ckpt_dir / "best.pt").write_bytes((ckpt_dir / "step_0000012.pt").read_bytes())  # the best was update 12
    best_of_update_12 = (ckpt_dir / "best.pt").read_bytes()
    assert main([*flags, "--resume", str(ckpt_dir / "step_0000004.pt")]) == 0  # back to update 4 by hand
    (set_aside,) = [e for e in events(tmp_path / "runs" / "r", "abandoned_checkpoint") if
                    e["path"].endswith("best.pt")]
    assert Path(set_aside["moved_to"]).read_bytes() == best_of_update_12
    assert [Path(p).name for p in list_checkpoints(str(ckpt_dir))] == [
        "step_0000012.pt", "step_0000008.pt", "step_0000004.pt"]
