"""compile: true: the compiled update is the eager update; no graph breaks, no recompiles in steady
state or validation; checkpoints are unchanged (resume across compile on/off); DDP and
grad_checkpointing."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from bench import synthetic_batch
from config import ConfigError, load_config
from model import VJEPA3D
from checkpoint import checkpoint_path, read_checkpoint
from runtime import Runtime
from schedules import Hyperparameters
from train import main, make_optimizer, train_update, validate

from helpers import REPO, SMOKE, assert_same_first_update, run_cli, smoke_flags, train_lines

CPU = Runtime(torch.device("cpu"), "cpu", 1, 0, 1, 1)


def train_losses(run_dir) -> dict:
    """{step: (loss, grad_norm)} of a run's train metrics."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train_lines(run_dir)}


def one_update(cfg, micro_batches, compiled: bool, mode: str = "default"):
    torch.manual_seed(0)
    model = VJEPA3D.from_config(cfg)
    if compiled:
        model.compile_parts(mode)
    optimizer = make_optimizer(model, cfg, CPU)
    return (
        model,
        optimizer,
        train_update(model, optimizer, micro_batches, Hyperparameters(1e-3, 0.05, 0.99), cfg, CPU),
    )


def halves(batch: dict) -> list:
    """The batch as two micro-batches of one update (their gradients add up)."""
    return [{k: v[i::2] for k, v in batch.items()} for i in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("grad_checkpointing", [False, True])
def test_a_compiled_update_gives_the_eager_loss_and_grad_norm_without_graph_breaks(
    grad_checkpointing,
):
    cfg = load_config(["--config", SMOKE, "--grad_checkpointing", str(grad_checkpointing).lower()])
    batch = synthetic_batch(cfg, cfg.per_core_batch_size)
    torch._dynamo.reset()
    counters.clear()
    _, _, eager = one_update(cfg, [batch], compiled=False)
    model, optimizer, compiled = one_update(cfg, [batch], compiled=True)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled.grad_norm, eager.grad_norm, rtol=1e-5, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0

    # Steady state, validation (eval, no_grad, a smaller batch) and encode reuse what is compiled or
    # run eagerly.
    train_update(
        model,
        optimizer,
        [synthetic_batch(cfg, cfg.per_core_batch_size, seed=1)],
        Hyperparameters(1e-3, 0.05, 0.99),
        cfg,
        CPU,
    )
    val = validate(model, [synthetic_batch(cfg, 1, seed=2)], 1, cfg, CPU)
    model.encode(synthetic_batch(cfg, 3)["volume"])
    assert np.isfinite(val["loss"])
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_the_reduce_overhead_mode_gives_the_eager_update_and_marks_each_update(monkeypatch):
    """compile_mode reduce-overhead: CUDA graphs on a GPU; on the CPU the default mode, which this
    checks: the same loss, grad norm and weights as eager for an update of two micro-batches, and
    each update (not each micro-batch, nor validation) starts a CUDA-graph step. Every update has
    the same shapes: one compile, not two."""
    cfg = load_config(["--config", SMOKE, "--compile_mode", "reduce-overhead"])
    # the shapes of every update here
    micro_batches = halves(synthetic_batch(cfg, cfg.per_core_batch_size))
    torch._dynamo.reset()
    eager_model, eager_optimizer, eager = one_update(cfg, micro_batches, compiled=False)
    model, optimizer, compiled = one_update(
        cfg, micro_batches, compiled=True, mode=cfg.compile_mode
    )
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled.grad_norm, eager.grad_norm, rtol=1e-5, atol=0)
    assert_same_first_update(model, optimizer, eager_model, eager_optimizer)
    assert model.cudagraphs and not eager_model.cudagraphs
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    train_update(
        model,
        make_optimizer(model, cfg, CPU),
        halves(synthetic_batch(cfg, cfg.per_core_batch_size, seed=1)),
        Hyperparameters(1e-3, 0.05, 0.99),
        cfg,
        CPU,
    )
    validate(model, [synthetic_batch(cfg, 1, seed=2)], 1, cfg, CPU)
    assert steps == [1]


def test_compile_with_device_xla_is_a_config_error_that_says_what_to_do():
    with pytest.raises(
        ConfigError, match="compile: XLA already compiles the whole update; use --compile false"
    ):
        load_config(["--compile", "true", "--device", "xla"])


def test_an_optimizer_state_written_on_another_device_resumes_with_this_devices_adamw():
    cfg = load_config(["--config", SMOKE])
    model = VJEPA3D.from_config(cfg)
    optimizer = make_optimizer(model, cfg, CPU)
    state = optimizer.state_dict()
    for group in state["param_groups"]:  # as a TPU run writes it
        group.update(capturable=True, foreach=False, fused=None)
    optimizer.load_state_dict(state)
    assert all(
        g["fused"] and not g["capturable"] and not g["foreach"] for g in optimizer.param_groups
    )


@pytest.mark.slow
def test_compiled_and_eager_runs_write_the_same_checkpoints_and_resume_across_compile(
    tmp_path, smoke_phantoms
):
    compiled = run_cli(smoke_flags(tmp_path / "c", smoke_phantoms, "--compile", "true"))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "compile: encoders, predictor and loss compiled in" in compiled.stdout
    assert main(smoke_flags(tmp_path / "e", smoke_phantoms)) == 0
    c_ckpt = read_checkpoint(checkpoint_path(str(tmp_path / "c" / "runs" / "r" / "checkpoints"), 4))
    e_ckpt = read_checkpoint(checkpoint_path(str(tmp_path / "e" / "runs" / "r" / "checkpoints"), 4))
    assert list(c_ckpt["model"]) == list(e_ckpt["model"])
    assert not any("_orig_mod" in key for key in c_ckpt["model"])
    assert c_ckpt["optimizer"]["param_groups"] == e_ckpt["optimizer"]["param_groups"]

    # The compiled run's checkpoint resumes without compile and continues with the compiled run's
    # losses.
    assert (
        main(
            smoke_flags(
                tmp_path / "x",
                smoke_phantoms,
                "--resume",
                checkpoint_path(str(tmp_path / "c" / "runs" / "r" / "checkpoints"), 4),
            )
        )
        == 0
    )
    a, b = train_losses(tmp_path / "c" / "runs" / "r"), train_losses(tmp_path / "x" / "runs" / "r")
    steps = [s for s in sorted(a) if s > 4]
    assert steps and all(s in b for s in steps)
    np.testing.assert_allclose([a[s] for s in steps], [b[s] for s in steps], rtol=1e-4)


@pytest.mark.slow
def test_compiled_ddp_with_grad_checkpointing_matches_one_eager_process(tmp_path, smoke_phantoms):
    flags = ["--max_steps", "4", "--ckpt_dir", "none", "--val_every_steps", "100"]
    assert (
        main(smoke_flags(tmp_path / "one", smoke_phantoms, *flags, "--per_core_batch_size", "4"))
        == 0
    )
    ddp = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "train.py"),
            *smoke_flags(
                tmp_path / "two",
                smoke_phantoms,
                *flags,
                "--per_core_batch_size",
                "2",
                "--compile",
                "true",
                "--grad_checkpointing",
                "true",
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one, two = (
        train_losses(tmp_path / "one" / "runs" / "r"),
        train_losses(tmp_path / "two" / "runs" / "r"),
    )
    assert sorted(one) == sorted(two)
    np.testing.assert_allclose(
        [one[s][0] for s in sorted(one)], [two[s][0] for s in sorted(two)], rtol=1e-4
    )
    np.testing.assert_allclose(
        [one[s][1] for s in sorted(one)], [two[s][1] for s in sorted(two)], rtol=1e-3
    )
