"""sanity.py: every check passes on a healthy setup and fails, with its cause and exit code 1, when
the thing it guards is broken the way the incidents of docs/incidents.md broke it; the LR sweep
tells a stable LR from an exploding one."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import masks
import model
import checkpoint
import sanity
import schedules
import train
from helpers import phantom_flags

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def run_sanity(capsys, tmp_path, phantoms, *flags):
    """(exit code, stdout + stderr) of `python sanity.py --config smoke.yaml ...`, run
    in-process."""
    code = sanity.main(
        ["--config", SMOKE, *phantom_flags(phantoms, *flags), "--out_dir", str(tmp_path), *flags]
    )
    out = capsys.readouterr()
    return code, out.out + out.err


def row(output, name):
    """The table row of one check."""
    return next(line for line in output.splitlines() if line.startswith(f"{name} "))


def test_sanity_passes_its_quick_checks_on_a_healthy_setup(capsys, tmp_path, smoke_phantoms):
    # the others: the CLI test
    quick = ["lr_schedule", "ema_schedule", "inputs", "masks", "model", "checkpoint"]
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", ",".join(quick))
    assert code == 0, out
    assert all("PASS" in row(out, name) for name in quick) and "all checks passed" in out


# --- LR and EMA schedules of the full run (incidents 2, 3, 12) ---


def test_sanity_fails_when_the_lr_schedule_restarts(capsys, tmp_path, smoke_phantoms, monkeypatch):
    # incident 2: a per-epoch cosine stepped per update restarts every 3 updates
    def restarting(step, cfg, plan):
        return schedules.cosine_ramp(step % 3, 0, 3, cfg.base_lr, cfg.min_lr)

    monkeypatch.setattr(schedules, "lr_at", restarting)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "lr_schedule")
    assert code == 1
    assert "FAIL" in row(out, "lr_schedule")
    assert "LR rises again at update 3" in out and "a restart" in out


def test_sanity_fails_when_the_lr_is_zero_after_the_first_update(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    def disabled_scheduler(step, cfg, plan):  # incident 3: LambdaLR switched off left the LR at 0
        return cfg.base_lr if step == 0 else 0.0

    monkeypatch.setattr(schedules, "lr_at", disabled_scheduler)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "lr_schedule")
    assert code == 1
    assert "LR is 0 at update 1" in out and "incident 3" in out


def test_sanity_fails_on_a_config_whose_lr_is_zero_even_past_validation(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    import config

    monkeypatch.setattr(config, "validate", lambda cfg: None)
    code, out = run_sanity(
        capsys,
        tmp_path,
        smoke_phantoms,
        "--checks",
        "lr_schedule",
        "--schedule",
        "constant",
        "--warmup_steps",
        "0",
        "--base_lr",
        "0",
    )
    assert code == 1
    assert "LR is 0 at update 0" in out


def test_sanity_rejects_a_config_whose_lr_would_end_at_zero_with_exit_2(
    capsys, tmp_path, smoke_phantoms
):
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--min_lr", "0")
    assert code == 2
    assert "config error: min_lr" in out


def test_sanity_fails_when_the_ema_momentum_falls_or_passes_one(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    monkeypatch.setattr(schedules, "ema_at", lambda step, cfg, plan: 1.001 - 0.001 * step)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "ema_schedule")
    assert code == 1
    assert "FAIL" in row(out, "ema_schedule") and "falls at update 1" in out


# --- training signals (incidents 1, 12) ---


def test_sanity_fails_when_gradients_are_zeroed_before_measuring(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    measure = train.clip_and_measure

    def measured_after_zero_grad(model, cfg):  # incident 1
        model.zero_grad(set_to_none=False)
        return measure(model, cfg)

    monkeypatch.setattr(train, "clip_and_measure", measured_after_zero_grad)
    # the run the grad norms come from: shorter, same verdict
    monkeypatch.setattr(sanity, "OVERFIT_UPDATES", 20)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "grad_norm")
    assert code == 1
    assert "FAIL" in row(out, "grad_norm")
    assert (
        "grad_norm is 0 at 20 of 20 updates" in out
        and "gradients are measured after zero_grad" in out
    )


def test_sanity_fails_when_the_optimizer_never_steps(capsys, tmp_path, smoke_phantoms, monkeypatch):
    monkeypatch.setattr(train, "optimizer_step", lambda optimizer, lr, wd, skip=None: None)
    # shorter runs, same verdict: the loss never moves
    monkeypatch.setattr(sanity, "OVERFIT_UPDATES", 30)
    monkeypatch.setattr(sanity, "EMA_UPDATES", 30)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "overfit,ema_training")
    assert code == 1
    assert "FAIL" in row(out, "overfit") and "FAIL" in row(out, "ema_training")
    assert "the model cannot fit one batch" in out


def test_sanity_fails_when_the_target_collapses_to_a_constant(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    def constant_target(self, volume, rows):  # the loss falls to 0 and means nothing (incident 12)
        return torch.zeros(rows, self.num_tokens, self.target_encoder.norm.normalized_shape[0])

    monkeypatch.setattr(model.VJEPA3D, "all_target_features", constant_target)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "ema_training")
    assert code == 1
    assert "min target_std 0.000" in row(out, "ema_training")
    assert "collapse to a constant" in out


def test_sanity_fails_when_the_target_encoder_receives_gradients(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    build = model.VJEPA3D.from_config

    def trainable_target(cfg):
        m = build(cfg)
        m.target_encoder.requires_grad_(True)
        return m

    monkeypatch.setattr(model.VJEPA3D, "from_config", staticmethod(trainable_target))
    # no no_grad
    monkeypatch.setattr(
        model.VJEPA3D, "all_target_features", model.VJEPA3D.all_target_features.__wrapped__
    )
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "model")
    assert code == 1
    assert "FAIL" in row(out, "model")
    assert "target-encoder tensors take gradients" in out and "changed the target encoder" in out


# --- inputs and masks (incidents 5, 6) ---


def test_sanity_fails_on_unnormalized_inputs(capsys, tmp_path, smoke_phantoms, monkeypatch):
    monkeypatch.setattr(
        data,
        "to_sample",
        lambda prepared, cfg, rng, train: torch.from_numpy(np.asarray(prepared, np.float32))[None],
    )  # raw 0..65535 intensities (incident 5)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "inputs")
    assert code == 1
    assert "FAIL" in row(out, "inputs") and "not normalized per volume" in out


def test_sanity_fails_when_masks_are_dhw_grids_instead_of_index_lists(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    sample = masks.MaskGenerator.__call__

    def grid_masks(self, rng):  # incident 6: [D,H,W] masks instead of [num_tokens] index lists
        context, target = sample(self, rng)
        is_target = np.zeros(self.num_tokens, np.int64)
        is_target[target] = 1
        return (1 - is_target).reshape(self.grid), is_target.reshape(self.grid)

    monkeypatch.setattr(masks.MaskGenerator, "__call__", grid_masks)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "masks,model")
    assert code == 1
    assert "loader batch: shapes [2, 2, 4, 4] / [2, 2, 4, 4], expected [2, 13] / [2, 19]" in out
    assert "FAIL" in row(out, "model") and "ValueError: context_idx: expected shape" in out


# --- checkpoints ---


def test_sanity_fails_when_a_checkpoint_loses_the_optimizer_state(
    capsys, tmp_path, smoke_phantoms, monkeypatch
):
    save_state = checkpoint.checkpoint_state

    def without_optimizer_state(*args):
        state = save_state(*args)
        state["optimizer"]["state"] = {}
        return state

    monkeypatch.setattr(checkpoint, "checkpoint_state", without_optimizer_state)
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "checkpoint")
    assert code == 1
    assert "weights differ" in row(out, "checkpoint") and "a resumed run would not continue" in out


# --- real data, command line ---


def test_sanity_scans_real_data_and_shows_the_reject_table(
    capsys, tmp_path, smoke_phantoms, phantom_dir
):
    code, out = run_sanity(
        capsys, tmp_path, smoke_phantoms, "--checks", "data", "--data_root", phantom_dir
    )
    assert code == 0, out
    assert "PASS" in row(out, "data")

    broken = tmp_path / "broken"
    broken.mkdir()
    for dcm in sorted(Path(phantom_dir).glob("*.dcm"))[:2]:
        shutil.copy(dcm, broken)
        for i in range(2):  # interrupted uploads
            (broken / f"cut{i}_{dcm.name}").write_bytes(dcm.read_bytes()[:3000])
    code, out = run_sanity(
        capsys, tmp_path, smoke_phantoms, "--checks", "data", "--data_root", str(broken)
    )
    assert code == 1
    assert "2 usable volumes, 4 bad files in 6 of 6 files" in row(out, "data")
    assert "truncated       4" in out and f"python data.py scan {broken}" in out


def test_sanity_names_the_field_of_a_bad_flag_with_exit_2(capsys, tmp_path, smoke_phantoms):
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--checks", "overfit,gradnorm")
    assert code == 2 and "checks: gradnorm; choose from" in out
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--ckpt_dir", "None", "--base_lr", "x")
    assert code == 2 and "base_lr" in out
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--lr_sweep", "1e-3,fast")
    assert code == 2 and "lr_sweep" in out


# --- LR sweep (incident 4) ---


@pytest.mark.slow
def test_lr_sweep_picks_a_stable_lr_and_marks_an_exploding_one_unstable(
    capsys, tmp_path, smoke_phantoms
):
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--lr_sweep", "[1e-3,1e-1]")
    assert code == 0, out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("1.0e-")}
    assert lines["1.0e-03"].endswith("stable") and lines["1.0e-01"].endswith("UNSTABLE")
    assert "recommended base_lr: 0.001" in out
    assert (
        tmp_path / "lr_sweep.png"
    ).stat().st_size > 0 and f"loss curves: {tmp_path}/lr_sweep.png" in out


@pytest.mark.slow
def test_lr_sweep_whose_best_lr_is_at_an_edge_of_its_grid_gives_the_flag_that_extends_it(
    capsys, tmp_path, smoke_phantoms
):
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--lr_sweep", "1e-4,1e-3")
    assert code == 0 and "recommended base_lr: 0.001" in out
    assert "0.001 is the largest LR tried, and a larger one may be stable too" in out
    flag = re.search(r"extend the grid upward with (--lr_sweep \S+)", out).group(1)
    assert flag == "--lr_sweep 0.001,0.003,0.01,0.03,0.1"
    # the user reruns with it
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, *flag.split())
    lines = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.strip().startswith(("1.0e-", "3.0e-"))
    }
    # the grid now reaches past the stable LRs
    assert code == 0 and lines["1.0e-01"].endswith("UNSTABLE")
    assert "recommended base_lr" in out and "LR tried" not in out
    # only the smallest stable
    code, out = run_sanity(capsys, tmp_path, smoke_phantoms, "--lr_sweep", "1e-3,1e-1")
    assert (
        code == 0
        and "0.001 is the smallest LR tried, the only one stable with a falling loss" in out
    )
    assert "extend it downward with --lr_sweep 1e-05,3e-05,0.0001,0.0003,0.001" in out


def test_lr_sweep_takes_its_default_grid_without_a_value():
    names, sweep, flags = sanity.parse_command_line(["--lr_sweep", "--config", "x.yaml"])
    assert names is None and sweep == sanity.DEFAULT_SWEEP and flags == ["--config", "x.yaml"]
    assert sanity.parse_command_line(["--lr_sweep=1e-4,3e-4"])[1] == [1e-4, 3e-4]
    assert math.isclose(sanity.parse_command_line(["--lr_sweep", "[5e-4]"])[1][0], 5e-4)


@pytest.mark.slow
def test_sanity_cli_passes_on_the_demo_config(tmp_path, smoke_phantoms):
    """`python sanity.py` as a user runs it: the demo config (only the phantom set is the tests'
    own: 16 plain eyes)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "sanity.py"),
            *phantom_flags(smoke_phantoms),
            "--phantom_count",
            "16",
            "--phantom_varied",
            "false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and "FAIL" not in proc.stdout
