"""sanity.py: it passes on a healthy setup, and each check fails when the thing it guards is broken."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import sanity
import train
from model import VJEPA3D

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")


def run_sanity(smoke_phantoms, tmp_path, *args):
    return sanity.main(["--config", SMOKE, "--phantom_dir", smoke_phantoms, "--out_dir", str(tmp_path), *args])


@pytest.mark.slow
def test_sanity_passes_on_the_demo_config(smoke_phantoms, tmp_path):
    """`python sanity.py` as a user runs it (the demo config; only the phantom set is the tests' own)."""
    result = subprocess.run([sys.executable, str(REPO / "sanity.py"), "--phantom_dir", smoke_phantoms,
                             "--phantom_count", "16"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout and "FAIL" not in result.stdout
    for name in ("LR schedule", "EMA momentum", "input normalization", "masks", "model outputs", "overfit",
                 "grad norm", "EMA training", "checkpoint round trip"):
        assert name in result.stdout


def test_sanity_fails_a_schedule_that_restarts(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda step, cfg, plan: real(step % 50, cfg, plan))  # incident 2
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "lr_schedule", "--max_steps", "200") == 1
    assert "restart" in capsys.readouterr().out


def test_sanity_fails_an_lr_that_is_0_after_the_first_update(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda step, cfg, plan: real(step, cfg, plan) if step == 0 else 0.0)
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "lr_schedule") == 1
    assert "LR is 0 at update 1" in capsys.readouterr().out  # incident 3


def test_sanity_fails_when_gradients_are_zeroed_before_measuring(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = train.clip_and_measure

    def measured_after_zero_grad(model, cfg):  # incident 1
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        return real(model, cfg)

    monkeypatch.setattr(train, "clip_and_measure", measured_after_zero_grad)
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "overfit") == 1
    out = capsys.readouterr().out
    assert "FAIL grad norm" in out and "gradients are measured after zero_grad" in out


def test_sanity_fails_unnormalized_inputs(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = data.to_sample
    monkeypatch.setattr(data, "to_sample", lambda *args, **kwargs: real(*args, **kwargs) * 300 + 2000)  # incident 5
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "inputs") == 1
    assert "not normalized" in capsys.readouterr().out


def test_sanity_fails_a_mask_of_the_wrong_shape(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = data.MaskGenerator.__call__

    def short_context(self, rng):  # incident 6
        context, target = real(self, rng)
        return context[:-1], target

    monkeypatch.setattr(data.MaskGenerator, "__call__", short_context)
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "masks") == 1
    out = capsys.readouterr().out
    assert "FAIL masks" in out and "shapes" in out


def test_sanity_fails_a_target_encoder_that_receives_gradients(smoke_phantoms, tmp_path, monkeypatch, capsys):
    real = sanity.fresh_model

    def leaky_model(cfg):  # incident 12: the target must move only through the EMA
        model = real(cfg)
        model.target_encoder.requires_grad_(True)
        model.target_features = VJEPA3D.target_features.__wrapped__.__get__(model)  # without torch.no_grad
        return model

    monkeypatch.setattr(sanity, "fresh_model", leaky_model)
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "model") == 1
    assert "target-encoder tensors receive gradients" in capsys.readouterr().out


def test_sanity_fails_a_checkpoint_that_forgets_the_optimizer_state(smoke_phantoms, tmp_path, monkeypatch, capsys):
    def forgetful_restore(ckpt, model, optimizer, state):
        model.load_state_dict(ckpt["model"])

    monkeypatch.setattr(train, "restore", forgetful_restore)
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "checkpoint") == 1
    assert "FAIL checkpoint round trip" in capsys.readouterr().out


def test_sanity_passes_its_quick_checks_on_the_smoke_config(smoke_phantoms, tmp_path, capsys):
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "lr_schedule,ema_schedule,inputs,masks,model") == 0
    assert "all checks passed" in capsys.readouterr().out


def test_unknown_check_name_is_a_config_error(smoke_phantoms, tmp_path, capsys):
    assert run_sanity(smoke_phantoms, tmp_path, "--checks", "mask") == 2
    assert "--checks takes names from" in capsys.readouterr().err


@pytest.mark.slow
def test_lr_sweep_recommends_a_stable_lr_and_marks_an_exploding_one(smoke_phantoms, tmp_path, capsys):
    torch.manual_seed(0)
    assert run_sanity(smoke_phantoms, tmp_path, "--lr_sweep", "1e-4,3e-4,1e-1") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith(("1.0e", "3.0e"))}
    assert rows["1.0e-01"].endswith("UNSTABLE") and rows["3.0e-04"].endswith("stable")
    assert "recommended base_lr: 0.0003" in out
    assert (tmp_path / "lr_sweep.png").exists()
