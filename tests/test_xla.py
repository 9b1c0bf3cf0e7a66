"""The XLA path, run for real on torch_xla's CPU PJRT device (the same graphs a TPU runs).

torch_xla needs its own torch version, so these tests run train.py in the torch_xla venv
(requirements-xla.txt) as subprocesses: OCTJEPA_XLA_PYTHON names its python (.ci/run builds it and
sets it; a local .venv-xla is found by itself). Without one they are skipped, unless
OCTJEPA_REQUIRE_XLA=1 (CI), where that is a failure.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import encoder
from checkpoint import list_checkpoints
from helpers import (
    assert_holds_a_share,
    assert_same_state,
    final_checkpoint,
    free_port,
    losses,
    read_jsonl,
    smoke_flags,
    train_lines,
)
from train import main

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.xla, pytest.mark.slow]


@pytest.fixture(scope="module")
def xla_python() -> str:
    path = os.environ.get("OCTJEPA_XLA_PYTHON") or str(REPO / ".venv-xla" / "bin" / "python")
    if not os.path.exists(path):
        message = (
            f"no torch_xla python at {path}: build it with `python3 -m venv .venv-xla && "
            ".venv-xla/bin/pip install -r requirements-xla.txt` or set OCTJEPA_XLA_PYTHON"
        )
        if os.environ.get("OCTJEPA_REQUIRE_XLA") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """One decoded-volume cache for every run here: the runs differ in devices, not in data."""
    return str(tmp_path_factory.mktemp("xla_cache"))


def run_train(python: str, flags: list, devices: int = 1, script: str = "train.py"):
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(devices),
        "XLA_FLAGS": "--xla_backend_optimization_level=0",
    }  # 3x faster compiles, same results
    result = subprocess.run(
        [python, str(REPO / script), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def flags_for(tmp_path, phantoms, cache_dir, *extra):
    return smoke_flags(
        tmp_path, phantoms, "--cache_dir", cache_dir, "--val_every_steps", "1000", *extra
    )


REFERENCE_FLAGS = (
    "--max_steps",
    "20",
    "--per_core_batch_size",
    "4",
    "--log_every_steps",
    "1",
    "--ckpt_every_steps",
    "4",
    "--keep_last",
    "5",
)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, smoke_phantoms, cache_dir, xla_python) -> dict:
    """Run folders of the same 20 updates of 4 volumes (a checkpoint every 4): {"xla": on one XLA
    device, nothing sharded (also the reference of the sharded runs), "xla_venv_cpu": on the CPU of
    the torch_xla venv (the same torch: the same initial weights), "cpu": on the CPU of this process
    (plain torch of another version, without torch_xla)}."""
    out = tmp_path_factory.mktemp("reference_runs")
    for name, device in (("xla", "xla"), ("xla_venv_cpu", "cpu")):
        run_train(
            xla_python,
            flags_for(out / name, smoke_phantoms, cache_dir, *REFERENCE_FLAGS, "--device", device),
        )
    assert (
        main(flags_for(out / "cpu", smoke_phantoms, cache_dir, *REFERENCE_FLAGS, "--device", "cpu"))
        == 0
    )
    return {name: out / name / "runs" / "r" for name in ("xla", "xla_venv_cpu", "cpu")}


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_xla_loop_matches_the_cpu_loop_over_20_updates(reference_runs):
    xla, cpu = train_lines(reference_runs["xla"]), train_lines(reference_runs["xla_venv_cpu"])
    assert [r["step"] for r in xla] == list(range(1, 21))
    np.testing.assert_allclose([r["loss"] for r in xla], [r["loss"] for r in cpu], rtol=1e-4)
    np.testing.assert_allclose(
        [r["grad_norm"] for r in xla], [r["grad_norm"] for r in cpu], rtol=1e-3
    )


def test_xla_step_compiles_once_and_reads_the_device_only_at_log_steps(
    tmp_path, smoke_phantoms, cache_dir, xla_python
):
    # Gradient accumulation, a cosine LR with warmup, the WD and EMA schedules: every value changes
    # each update.
    run_train(
        xla_python,
        flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            "--device",
            "xla",
            "--max_steps",
            "30",
            "--log_every_steps",
            "5",
            "--grad_accum_steps",
            "2",
            "--per_core_batch_size",
            "2",
            "--schedule",
            "cosine",
            "--warmup_steps",
            "5",
            "--ckpt_dir",
            "none",
        ),
    )
    lines = train_lines(tmp_path / "runs" / "r")
    assert [r["step"] for r in lines] == [1, 5, 10, 15, 20, 25, 30]
    assert (
        len({r["lr"] for r in lines}) == len(lines) and len({r["ema_momentum"] for r in lines}) > 1
    )
    # Update 1 compiled the graph of them all: the first update's state is the one every later
    # update finds.
    assert {r["xla_compiles"] for r in lines} == {lines[0]["xla_compiles"]}, lines
    # One batched device-to-host read per log step, none inside the updates between them.
    after_warmup = [r for r in lines if r["step"] >= 5]
    transfers = [r["xla_transfers"] for r in after_warmup]
    assert np.diff(transfers).tolist() == [1] * (len(transfers) - 1), lines


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_spmd_over_4_devices_matches_1_device(
    tmp_path, smoke_phantoms, cache_dir, xla_python, reference_runs
):
    four = run_train(
        xla_python,
        flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            *REFERENCE_FLAGS,
            "--device",
            "xla",
            "--per_core_batch_size",
            "1",
        ),
        devices=4,
    )
    assert "xla x 4" in four.stdout
    one, four = train_lines(reference_runs["xla"]), train_lines(tmp_path / "runs" / "r")
    np.testing.assert_allclose([r["loss"] for r in four], [r["loss"] for r in one], rtol=1e-4)
    np.testing.assert_allclose(
        [r["grad_norm"] for r in four], [r["grad_norm"] for r in one], rtol=1e-4
    )


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_fsdp_over_4_xla_devices_trains_like_1_device_on_a_quarter_of_the_memory_without_recompiles(
    tmp_path, smoke_phantoms, cache_dir, xla_python, reference_runs
):
    # With grad checkpointing (torch_xla's: torch's fails on XLA), which changes no value: the hmlp
    # stem it recomputes trains as it does without (a reentrant checkpoint left it without
    # gradients: experiments/NOTES.md 25).
    run_train(
        xla_python,
        flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            *REFERENCE_FLAGS,
            "--device",
            "xla",
            "--per_core_batch_size",
            "1",
            "--shard",
            "fsdp",
            "--grad_checkpointing",
            "true",
        ),
        devices=4,
    )
    sharded, one_device = tmp_path / "runs" / "r", reference_runs["xla"]
    np.testing.assert_allclose(losses(sharded), losses(one_device), rtol=1e-5)
    # written whole from the shards
    assert_same_state(final_checkpoint(sharded), final_checkpoint(one_device))
    assert_holds_a_share(sharded, one_device, 1 / 4)
    # Nothing compiles again after the first update, checkpoints (at 4, 8, 12) included.
    assert {r["xla_compiles"] for r in train_lines(sharded)[1:]} == {
        train_lines(sharded)[0]["xla_compiles"]
    }


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_a_data_x_fsdp_mesh_of_xla_devices_resumes_an_unsharded_checkpoint_and_continues_it_exactly(
    tmp_path, smoke_phantoms, cache_dir, xla_python, reference_runs
):
    one_device = reference_runs["xla"]
    run_train(
        xla_python,
        flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            *REFERENCE_FLAGS,
            "--device",
            "xla",
            "--per_core_batch_size",
            "1",
            "--shard",
            "fsdp",
            "--fsdp_size",
            "2",
            "--resume",
            str(one_device / "checkpoints" / "step_0000012.pt"),
        ),
        devices=4,
    )
    sharded = tmp_path / "runs" / "r"  # 2 copies of the weights, each sharded over 2 devices
    assert len(losses(sharded)) == 8
    np.testing.assert_allclose(losses(sharded), losses(one_device, after=12), rtol=1e-5)
    assert_same_state(final_checkpoint(sharded), final_checkpoint(one_device))
    assert_holds_a_share(sharded, one_device, 1 / 2)
    assert {r["xla_compiles"] for r in train_lines(sharded)[1:]} == {
        train_lines(sharded)[0]["xla_compiles"]
    }


def test_nan_on_xla_is_skipped_on_the_device_without_a_recompile(
    tmp_path, smoke_phantoms, cache_dir, xla_python
):
    result = run_train(
        xla_python,
        [
            "7",
            *flags_for(
                tmp_path,
                smoke_phantoms,
                cache_dir,
                "--device",
                "xla",
                "--max_steps",
                "15",
                "--log_every_steps",
                "5",
                "--per_core_batch_size",
                "4",
                "--ckpt_dir",
                "none",
            ),
        ],
        script="tests/xla_inject_nan.py",
    )
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"exit": 0, "weights_unchanged": True}
    lines = train_lines(tmp_path / "runs" / "r")
    assert [(r["step"], r["nonfinite_skipped"]) for r in lines] == [
        (1, 0),
        (5, 0),
        (10, 1),
        (15, 1),
    ]
    assert lines[1]["xla_compiles"] == lines[2]["xla_compiles"] == lines[3]["xla_compiles"]
    skips = [
        e
        for e in read_jsonl(tmp_path / "runs" / "r" / "events.jsonl")
        if e["event"] == "nonfinite_skipped"
    ]
    assert [e["step"] for e in skips] == [7] and skips[0]["files"]


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_checkpoints_move_between_xla_and_plain_cpu_torch(
    tmp_path, smoke_phantoms, cache_dir, xla_python, reference_runs
):
    """Written on XLA, resumed by torch without torch_xla (this process), and the other way round:
    the resumed updates give the losses the uninterrupted run had."""
    for writer, reader in (("xla", "cpu"), ("cpu", "xla")):
        (step_4,) = [
            p
            for p in list_checkpoints(str(reference_runs[writer] / "checkpoints"))
            if p.endswith("step_0000004.pt")
        ]
        flags = flags_for(
            tmp_path / f"{writer}_to_{reader}",
            smoke_phantoms,
            cache_dir,
            *REFERENCE_FLAGS,
            "--device",
            reader,
            "--resume",
            step_4,
        )
        if reader == "xla":
            run_train(xla_python, flags)
        else:
            assert main(flags) == 0
        resumed = tmp_path / f"{writer}_to_{reader}" / "runs" / "r"
        assert len(losses(resumed)) == 16
        np.testing.assert_allclose(
            losses(resumed),
            losses(reference_runs[writer], after=4),
            rtol=1e-4,
            err_msg=f"{writer} to {reader}",
        )


@pytest.mark.xdist_group("xla_reference")  # on the worker that made reference_runs (once)
def test_bf16_autocast_on_xla_gives_the_fp32_loss(
    tmp_path, smoke_phantoms, cache_dir, xla_python, reference_runs
):
    """A bf16 mean over thousands of loss terms, reduced in bf16 by XLA, once read 0.60 for an fp32
    loss of 0.88."""
    run_train(
        xla_python,
        flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            *REFERENCE_FLAGS,
            "--device",
            "xla",
            "--use_bf16",
            "true",
            "--ckpt_dir",
            "none",
        ),
    )
    np.testing.assert_allclose(
        losses(tmp_path / "runs" / "r"), losses(reference_runs["xla"]), rtol=1e-2
    )


def test_two_xla_hosts_resume_from_one_checkpoint_or_both_stop(
    tmp_path, smoke_phantoms, cache_dir, xla_python
):
    """A pod of two hosts, simulated on this machine: two processes, each with its own XLA CPU
    device, joined by the gloo group runtime.py makes over the hosts (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT name them: PJRT's CPU client spans one process only). Host 0 chooses the checkpoint;
    host 1 loads that same file or both stop."""

    def pod(faults, *extra):
        port, logs = free_port(), [tmp_path / f"host{rank}.log" for rank in (0, 1)]
        flags = flags_for(
            tmp_path,
            smoke_phantoms,
            cache_dir,
            "--device",
            "xla",
            "--ckpt_every_steps",
            "2",
            "--keep_last",
            "5",
            "--ckpt_dir_shared",
            "true",
            "--ckpt_retry_minutes",
            "0.1",
            *extra,
        )
        hosts = [
            subprocess.Popen(
                [xla_python, str(REPO / "tests" / "faults.py"), f"report,{faults}", *flags],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=open(log, "w"),
                env={
                    **os.environ,
                    "PJRT_DEVICE": "CPU",
                    "CPU_NUM_DEVICES": "1",
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "XLA_FLAGS": "--xla_backend_optimization_level=0",
                },
            )
            for rank, log in enumerate(logs)
        ]
        return [(host.wait(timeout=600), log.read_text()) for host, log in zip(hosts, logs)]

    # on CPU
    assert (
        main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--ckpt_every_steps", "2"))
        == 0
    )
    # Host 1's first two reads of the checkpoint fail (a transient storage error): it retries, and
    # both hosts go on from update 4 (each host choosing alone, host 1 would have fallen back to
    # update 2).
    for rank, (code, err) in enumerate(
        pod("read_twice", "--max_steps", "6", "--resume", "auto", "--extend", "true")
    ):
        assert code == 0, err[-3000:]
        assert f"process {rank}: resumed at update 4" in err
    # A read error on host 1 that does not pass: both stop, before either trains, with the storage
    # exit code.
    for code, err in pod("read_always", "--max_steps", "8", "--resume", "auto", "--extend", "true"):
        assert code == 74 and "process 1" in err and "none trains" in err, err[-3000:]


def test_an_exported_encoder_embeds_on_xla_as_on_cpu(tmp_path, export_dir, phantom_dir, xla_python):
    """load_encoder and the forward pass on the XLA device (4 devices: the batch is sharded) against
    the CPU of this process (another torch version)."""

    def embed(name, python, device, devices=1):
        out = tmp_path / f"{name}.npz"
        flags = [
            "embed",
            "--encoder",
            export_dir,
            "--data_root",
            phantom_dir,
            "--out",
            str(out),
            "--device",
            device,
            "--workers",
            "0",
            "--batch_size",
            "4",
            "--with_paths",
        ]
        if python:
            run_train(python, flags, devices, script="encoder.py")
        else:
            assert encoder.main(flags) == 0
        with np.load(out) as z:
            return z["embedding"], list(z["path"])

    xla, paths = embed("xla", xla_python, "xla", devices=4)
    here, here_paths = embed("cpu", None, "cpu")  # in this process
    assert paths == here_paths and xla.shape == (10, 48)
    np.testing.assert_allclose(xla, here, atol=1e-5)
