"""Checkpoint storage that fails: a read-only folder, a full disk, a GCS outage; and checkpoints
that stream to their file or object without a copy in memory. Real filesystems, a real resource
limit, a real (stopped) GCS emulator."""

import os
import resource
import subprocess
import sys
import time

import pytest

import lock
from checkpoint import list_checkpoints, read_checkpoint
from config import ConfigError
from helpers import REPO, GCSEmulator, events, metrics, smoke_flags
from train import main

STORAGE_FAILED = 74


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no one can write into: chmod for a user, the immutable attribute for root (which
    ignores modes)."""
    path = tmp_path / "read_only"
    path.mkdir()
    os.chmod(path, 0o555)
    immutable = os.geteuid() == 0
    if (
        immutable
        and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0
    ):
        pytest.skip("running as root without chattr +i: no folder here is read-only")
    yield path
    if immutable:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_checkpoint_folder_is_refused_before_anything_trains(
    tmp_path, smoke_phantoms, read_only_dir, capsys
):
    assert (
        main(smoke_flags(tmp_path, smoke_phantoms, "--ckpt_dir", str(read_only_dir / "ckpts"))) == 2
    )
    err = capsys.readouterr().err
    assert f"ckpt_dir: cannot write checkpoints to {read_only_dir / 'ckpts'}" in err
    # found at start, not 30 updates in
    assert not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_full_disk_skips_one_checkpoint_then_stops_with_exit_74_and_loses_nothing(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--ckpt_every_steps", "2")
    assert main(flags) == 0
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    limit = 512 * 1024  # a 1.4 MB checkpoint does not fit any more; log lines still do

    def full_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail with EFBIG

    extended = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            *flags,
            "--max_steps",
            "12",
            "--resume",
            "auto",
            "--extend",
            "true",
            "--ckpt_every_steps",
            "3",
            "--ckpt_retry_minutes",
            "0.02",
            "--val_every_steps",
            "100",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=full_disk,
    )
    assert extended.returncode == STORAGE_FAILED, extended.stderr[-3000:]
    run_dir = tmp_path / "runs" / "r"
    # skipped one, went on, then stopped
    assert [e["step"] for e in events(run_dir, "checkpoint_failed")] == [6, 9]
    assert "File too large" in events(run_dir, "checkpoint_failed")[0]["error"]
    assert "a second checkpoint in a row" in extended.stderr and "--resume auto" in extended.stderr
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 10))
    # no tmp file, nothing overwritten
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before
    assert read_checkpoint(str(ckpt_dir / "step_0000004.pt"))["train_state"]["step"] == 4


def test_a_run_folder_that_fills_up_stops_with_exit_74_naming_the_log_and_keeps_what_was_written(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--log_every_steps", "1")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    metrics_path = run_dir / "metrics.jsonl"
    first = metrics_path.read_bytes()
    # a long run's log: bigger than a checkpoint
    metrics_path.write_bytes(first * (3 * 2**20 // len(first)))
    written = metrics_path.read_bytes()
    # room for the checkpoints, the events and the lock, not for another metrics line
    limit = len(written) + 100

    def full_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    resumed = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            *flags,
            "--max_steps",
            "8",
            "--resume",
            "auto",
            "--extend",
            "true",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=full_disk,
    )
    assert resumed.returncode == STORAGE_FAILED, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr and "metrics.jsonl" in resumed.stderr
    assert "--resume auto" in resumed.stderr
    assert metrics_path.read_bytes().startswith(written)  # nothing written before is lost
    # the lock given back, no tmp file of it left
    assert not list(run_dir.glob(f"{lock.LOCK_NAME}*"))


def test_a_lock_record_that_does_not_fit_on_the_disk_leaves_no_tmp_file(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # writes past 10 bytes fail with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, hard))
    try:
        with pytest.raises(ConfigError, match="cannot take the lock"):
            lock.take_lock(str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [p.name for p in tmp_path.iterdir() if p.name != lock.LOCK_NAME] == []


def test_a_checkpoint_that_fails_for_a_permanent_reason_says_it_was_not_retried(
    tmp_path, smoke_phantoms, capsys
):
    ckpt_dir = tmp_path / "runs" / "r" / "checkpoints"
    # a folder where best.pt goes: os.replace fails, EISDIR
    (ckpt_dir / "best.pt").mkdir(parents=True)
    assert (
        main(smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4", "--summary_probe", "false"))
        == STORAGE_FAILED
    )
    error = events(tmp_path / "runs" / "r", "checkpoint_failed")[0]["error"]
    assert (
        "IsADirectoryError" in error
        and "a permanent error (not retried)" in error
        and "min" not in error
    )
    err = capsys.readouterr().err
    assert (
        "a permanent error (not retried)" in err and "retries" not in err and "retrying" not in err
    )


@pytest.mark.slow
def test_a_gcs_outage_longer_than_gcsfs_retries_is_outlasted(tmp_path, smoke_phantoms, monkeypatch):
    emulator = GCSEmulator(tmp_path)
    # this test's own reads of gs:// and the run's
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)
    ckpt_dir, err = f"gs://{emulator.bucket}/ckpts/r", tmp_path / "train.err"
    run = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            *smoke_flags(
                tmp_path,
                smoke_phantoms,
                "--max_steps",
                "12",
                "--ckpt_every_steps",
                "2",
                "--ckpt_dir",
                ckpt_dir,
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(err, "w"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        run_dir = tmp_path / "runs" / "r"
        while not (run_dir / "events.jsonl").exists() or not events(run_dir, "checkpoint"):
            assert run.poll() is None, err.read_text()[-3000:]
            time.sleep(0.05)
        emulator.stop()  # the next checkpoint write meets a dead endpoint
        # It stays dead until gcsfs's own retries (6 tries over 31-39 s) gave up and train.py's
        # retry took over.
        assert any("; again in" in line for line in run.stdout), err.read_text()[-3000:]
        # back, empty (it keeps objects in memory)
        emulator = GCSEmulator(tmp_path, port=emulator.port)
        run.stdout.read()
        assert run.wait(timeout=600) == 0, err.read_text()[-3000:]
        assert not events(run_dir, "checkpoint_failed")
        assert [p.rsplit("/", 1)[1] for p in list_checkpoints(ckpt_dir)] == [
            "step_0000012.pt",
            "step_0000010.pt",
        ]
    finally:
        run.kill()
        emulator.stop()


@pytest.mark.slow
def test_a_checkpoint_streams_into_its_file_or_object_without_a_copy_in_memory(
    tmp_path, gcs_emulator
):
    size = 160 * 2**20
    # The child's peak memory during the write, over its memory before it: Linux's peak (VmHWM) is
    # reset just before (ru_maxrss would also count the pages of this process, which the child
    # shared until its exec).
    measure = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from checkpoint import"
        " save_checkpoint\ndef kib(field): return int(next(l for l in open('/proc/self/status') if"
        " l.startswith(field)).split()[1])\nsave_checkpoint(sys.argv[2].replace('0001', '0000'),"
        " {'model': {}}, 2, False)  # imports, connections\nstate = {'model': {'weights':"
        " torch.ones(int(sys.argv[3]) // 4)}}\nopen('/proc/self/clear_refs', 'w').write('5')  #"
        " resets VmHWM to the resident memory now\nbefore ="
        " kib('VmRSS')\nsave_checkpoint(sys.argv[2], state, 2, True)\nprint((kib('VmHWM') - before)"
        " * 1024)"
    )
    for path in (
        str(tmp_path / "step_0000001.pt"),
        f"gs://{gcs_emulator.bucket}/stream/step_0000001.pt",
    ):
        child = subprocess.run(
            [sys.executable, "-c", measure, str(REPO), path, str(size)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        # the old writer held 1-2x its size
        assert int(child.stdout) < 0.5 * size, (path, int(child.stdout) / size)
        for written in (path, path.replace("step_0000001.pt", "best.pt")):
            assert read_checkpoint(written)["model"]["weights"].numel() == size // 4
