"""Preemption: SIGTERM (Kubernetes, spot VMs, torchrun passing it on) and Ctrl-C stop a run at an
update boundary with a checkpoint of that update and exit 75; `--resume auto` then continues as if
nothing had happened. Real processes, real signals, real torchrun."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from checkpoint import checkpoint_path, list_checkpoints, step_of
from helpers import REPO, ddp_flags, events, metrics, run_cli, smoke_flags, stderr_excerpt, torchrun
from train import main

PREEMPTED = 75


def signal_after(
    process: subprocess.Popen, run_dir: Path, update: int, sig: int, group: bool = False
) -> None:
    """Send `sig` to the process (`group`: to its process group, as a terminal's Ctrl-C does) once
    its metrics.jsonl logged `update` (log_every_steps 1)."""
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(
            r["step"] >= update for r in metrics(run_dir)
        ):
            os.killpg(process.pid, sig) if group else process.send_signal(sig)
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended (or hung) before update {update}: {process.poll()}")


def start_train(args, script="train.py", env=None) -> subprocess.Popen:
    """train.py in a process group of its own (with its DataLoader workers), like a job in a
    terminal."""
    return subprocess.Popen(
        [sys.executable, str(REPO / script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


@pytest.mark.slow
def test_sigterm_sigkill_and_ctrl_c_lose_no_completed_update_and_the_resumed_run_has_the_uninterrupted_losses(
    tmp_path, smoke_phantoms
):
    flags = [
        "--max_steps",
        "30",
        "--ckpt_every_steps",
        "5",
        "--val_every_steps",
        "10",
        "--workers",
        "2",
    ]
    straight = run_cli(smoke_flags(tmp_path / "a", smoke_phantoms, *flags))
    assert straight.returncode == 0, stderr_excerpt(straight)
    run_dir, ckpt_dir = tmp_path / "b" / "runs" / "r", tmp_path / "b" / "runs" / "r" / "checkpoints"
    resumed_at = []
    for sig, after in ((signal.SIGTERM, 6), (signal.SIGKILL, 13), (signal.SIGINT, 20)):
        process = start_train(
            smoke_flags(tmp_path / "b", smoke_phantoms, *flags, *["--resume", "auto"] * (after > 6))
        )
        # SIGTERM and Ctrl-C to the whole process group, DataLoader workers included, as torchrun
        # and a terminal do.
        signal_after(process, run_dir, after, sig, group=sig != signal.SIGKILL)
        _, err = process.communicate(timeout=300)
        newest = list_checkpoints(str(ckpt_dir))[0]
        resumed_at.append(step_of(newest))
        # no chance to save: the next run redoes the updates after the last checkpoint
        if sig == signal.SIGKILL:
            assert process.returncode == -signal.SIGKILL
            continue
        assert process.returncode == PREEMPTED, err[-3000:]
        stop = events(run_dir, "preempted")[-1]
        assert stop["signals"] == [signal.Signals(sig).name] and stop["step"] >= after
        # the update it stopped at
        assert newest == stop["checkpoint"] == checkpoint_path(str(ckpt_dir), stop["step"])
        assert (
            f"preempted: {signal.Signals(sig).name} at update {stop['step']}" in err
            and "--resume auto" in err
        )
        # Ctrl-C too: no traceback, no "DataLoader worker exited unexpectedly"
        assert "Traceback" not in err
    resumed = run_cli(smoke_flags(tmp_path / "b", smoke_phantoms, *flags, "--resume", "auto"))
    assert resumed.returncode == 0, stderr_excerpt(resumed)
    assert [e["step"] for e in events(run_dir, "resume")] == resumed_at
    a, b = tmp_path / "a" / "runs" / "r", run_dir
    # no update lost, none logged twice
    assert [r["step"] for r in metrics(b)] == list(range(1, 31))
    assert [r["loss"] for r in metrics(b)] == [r["loss"] for r in metrics(a)]
    assert [r["grad_norm"] for r in metrics(b)] == [r["grad_norm"] for r in metrics(a)]
    assert [r["loss"] for r in metrics(b, "val")] == [r["loss"] for r in metrics(a, "val")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_during_the_summary_probe_is_a_preemption_after_the_last_checkpoint(
    tmp_path, smoke_phantoms, phantom_dir, sig
):
    """The signal comes while the verdict reads a labelled volume, inside the DICOM reader's `except
    Exception` (tests/faults.py): it once ended there as an unusable file, and the run went on to
    exit 0."""
    fault = {signal.SIGTERM: "sigterm_in_probe", signal.SIGINT: "sigint_in_probe"}[sig]
    stopped = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "faults.py"),
            fault,
            *smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "4",
                "--summary_probe",
                "true",
                "--probe_labels",
                f"{phantom_dir}/labels.csv",
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    (stop,) = events(run_dir, "preempted")
    assert stop["signals"] == [signal.Signals(sig).name] and stop["step"] == 4
    assert stop["checkpoint"].endswith("step_0000004.pt")
    assert not events(run_dir, "summary_probe") and "Traceback" not in stopped.stderr
    assert f"preempted: {signal.Signals(sig).name} at update 4" in stopped.stderr


@pytest.mark.slow
def test_sigterm_while_the_verdict_writes_its_labelled_phantoms_is_a_preemption_and_the_relaunch_finishes(
    tmp_path, smoke_phantoms
):
    """A fresh run's verdict first writes the 300 labelled phantoms of its task (JPEG 2000 files): a
    SIGTERM that came while openjpeg's C encoder ran (tests/faults.py) once crashed the process
    (exit 139, no message, no event)."""
    flags = smoke_flags(
        tmp_path,
        smoke_phantoms,
        "--max_steps",
        "4",
        "--summary_probe",
        "true",
        # the labelled set goes to phantoms_suite
        "--phantom_dir",
        str(tmp_path / "phantoms"),
    )
    stopped = subprocess.run(
        [sys.executable, str(REPO / "tests" / "faults.py"), "sigterm_in_encoder", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    assert "preempted: SIGTERM at update 4" in stopped.stderr and "Traceback" not in stopped.stderr
    run_dir = tmp_path / "runs" / "r"
    (stop,) = events(run_dir, "preempted")
    assert stop["signals"] == ["SIGTERM"] and stop["checkpoint"].endswith("step_0000004.pt")
    # no half set
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("phantoms_suite")) == []

    relaunched = run_cli([*flags, "--resume", "auto"])
    assert relaunched.returncode == 0, stderr_excerpt(relaunched)
    assert [e["step"] for e in events(run_dir, "resume")] == [4] and len(
        events(run_dir, "summary_probe")
    ) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("phantoms_suite")) == [
        "phantoms_suite"
    ]


def test_a_first_signal_asks_to_stop_and_a_second_one_stops_the_process_at_once():
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); from runtime import"
                " StopSignals\nwith StopSignals() as stop:\n    os.kill(os.getpid(),"
                " signal.SIGINT); time.sleep(0.1)\n    print('asked to stop by', stop.received,"
                " flush=True)\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n   "
                " print('still running', flush=True)\n"
            ),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout == "asked to stop by SIGINT\n"
    assert "send it again to stop at once" in child.stderr
    # killed by the second Ctrl-C, not a KeyboardInterrupt traceback
    assert child.returncode == -signal.SIGINT


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_processes_at_one_update_and_any_number_of_processes_resumes_it(
    tmp_path, smoke_phantoms
):
    flags = ddp_flags(
        tmp_path,
        smoke_phantoms,
        "--run_name",
        "r",
        "--max_steps",
        "30",
        "--ckpt_every_steps",
        "50",
        "--val_every_steps",
        "10",
        "--val_fraction",
        "0.3",
        "--workers",
        "1",
    )
    straight = torchrun(
        tmp_path / "straight",
        "none",
        *[f.replace(str(tmp_path / "runs"), str(tmp_path / "straight")) for f in flags],
    )
    assert straight.returncode == 0, stderr_excerpt(straight)
    expected, expected_val = (
        metrics(tmp_path / "straight" / "r"),
        metrics(tmp_path / "straight" / "r", "val"),
    )
    assert len(expected_val) == 3

    # What Kubernetes does to a pod: SIGTERM to its main process, torchrun, which passes it to its
    # workers.
    run_dir = tmp_path / "runs" / "r"
    preempted = torchrun(tmp_path, "report", *flags, popen=True)
    signal_after(preempted, run_dir, 8, signal.SIGTERM)
    _, err = preempted.communicate(timeout=300)
    assert re.findall(r"exitcode\s*:\s*(\d+)", err) in ([], [str(PREEMPTED)] * 2), err[-3000:]
    assert err.count("preempted: ") == 2, err[-3000:]  # both processes stopped at the same update
    (stop,) = events(run_dir, "preempted")
    assert stop["signals"] == ["SIGTERM", "SIGTERM"] and 8 <= stop["step"] < 30
    assert list_checkpoints(str(run_dir / "checkpoints"))[0] == stop["checkpoint"]
    # Only the writer built the checkpoints' states (process 1 would hold a full copy for nothing):
    # the stop's, and the best one of update 10's validation when the signal came after it (on a
    # busy machine).
    written = len(events(run_dir, "checkpoint"))
    assert "process 1: checkpoint states built: 0" in err, err[-3000:]
    assert f"process 0: checkpoint states built: {written}" in err, err[-3000:]

    # The same checkpoint resumed on 1 process (a smaller spot pool) instead of 2: world size is not
    # in the plan.
    one = tmp_path / "one"
    shutil.copytree(tmp_path / "runs", one)
    assert (
        main([*[f.replace(str(tmp_path / "runs"), str(one)) for f in flags], "--resume", "auto"])
        == 0
    )

    # process 1's first read fails: retried
    resumed = torchrun(tmp_path, "read_once", *flags, "--resume", "auto")
    assert resumed.returncode == 0, stderr_excerpt(resumed)
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 31))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in expected]

    on_one = metrics(one / "r")
    assert [r["step"] for r in on_one] == list(range(1, 31))
    np.testing.assert_allclose(
        [r["loss"] for r in on_one], [r["loss"] for r in expected], rtol=1e-5
    )
    # Validation uses the same volumes on 1 and on 2 processes: the val losses agree as the weights
    # do.
    np.testing.assert_allclose(
        [r["loss"] for r in metrics(one / "r", "val")], [r["loss"] for r in expected_val], rtol=1e-5
    )

    # A read error that does not pass stops every process, before any of them trains from other
    # weights.
    failed = torchrun(
        tmp_path,
        "read_always",
        *flags,
        "--max_steps",
        "32",
        "--extend",
        "true",
        "--resume",
        "auto",
        "--ckpt_retry_minutes",
        "0.02",
    )
    assert re.search(r"exitcode\s*:\s*74", failed.stderr), stderr_excerpt(failed)
    assert "process 1" in failed.stderr and "none trains" in failed.stderr
