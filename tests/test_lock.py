"""One process at a time in a run folder, however processes meet it: two trainers racing for a dead
holder's lock, a live holder in another PID namespace, a holder on another machine (a relaunched
pod), a lock file left empty or damaged, a holder whose lease was taken over while it was suspended,
and the same on gs:// (real processes, real files, a real GCS emulator with GCS's generation
preconditions)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lock
from checkpoint import list_checkpoints, step_of
from config import ConfigError
from helpers import REPO, events, smoke_flags, train_process, wait_for
from train import main


def dead_pid() -> int:
    """The pid of a process of this machine that has ended."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def write_lock(folder: Path, **holder) -> Path:
    """A lock record in `folder` as another process would leave it: this process's identity, with
    `holder`'s."""
    path = folder / lock.LOCK_NAME
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**lock.lock_holder(), **holder}))
    return path


@pytest.mark.slow
def test_two_trainers_racing_for_a_dead_holders_lock_one_trains_and_the_other_exits_2(
    tmp_path, smoke_phantoms
):
    for attempt in range(3):
        run_dir = tmp_path / f"runs{attempt}" / "r"
        # same machine and PID namespace, its process gone: free at once
        write_lock(run_dir, pid=dead_pid())
        flags = smoke_flags(
            tmp_path, smoke_phantoms, "--out_dir", str(run_dir.parent), "--max_steps", "3"
        )
        ready, go = tmp_path / f"ready{attempt}", tmp_path / f"go{attempt}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "OCTJEPA_TEST_READY": str(ready),
            "OCTJEPA_TEST_GO": str(go),
        }
        racers = [
            subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "faults.py"), "race_lock", *flags],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in "ab"
        ]
        try:
            # both at the lock, then both go at once
            while len(list(tmp_path.glob(f"ready{attempt}.*"))) < 2:
                assert all(r.poll() is None for r in racers), [r.communicate() for r in racers]
                time.sleep(0.05)
            go.touch()
            results = {r.pid: (r.communicate(timeout=600)[1], r.returncode)[::-1] for r in racers}
        finally:
            for r in racers:
                r.kill()
        assert sorted(code for code, _ in results.values()) == [0, 2], results
        (winner,) = [pid for pid, (code, _) in results.items() if code == 0]
        (loser_err,) = [err for code, err in results.values() if code == 2]
        assert f"is in use by process {winner} on" in loser_err and "Traceback" not in loser_err
        # one run's checkpoints, not two
        assert [e["step"] for e in events(run_dir, "checkpoint")] == [3]
        assert not (run_dir / lock.LOCK_NAME).exists()


def unshare_works() -> bool:
    """Whether this machine lets a process start in its own PID namespace (root, or user namespaces
    allowed)."""
    return (
        bool(shutil.which("unshare"))
        and subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow
def test_a_live_holder_in_another_pid_namespace_keeps_its_run_folder(tmp_path, smoke_phantoms):
    if not unshare_works():
        pytest.skip(
            "unshare --pid --fork --mount-proc is not allowed here (it needs root or user"
            " namespaces)"
        )
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "400", "--ckpt_every_steps", "2")
    run_dir = tmp_path / "runs" / "r"
    holder = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            sys.executable,
            str(REPO / "train.py"),
            *flags,
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: list_checkpoints(str(run_dir / "checkpoints")), holder, "its first checkpoint"
        )
        record = json.loads((run_dir / lock.LOCK_NAME).read_text())
        assert (
            record["pid_namespace"] != lock.this_machine()["pid_namespace"] and record["pid"] < 10
        )
        second = train_process(
            [*flags, "--resume", "auto"],
            popen={"stdout": subprocess.PIPE, "stderr": subprocess.PIPE},
        )
        try:
            err = second.communicate(timeout=300)[1]
        finally:
            second.kill()
        assert second.returncode == 2, err[-2000:]
        assert (
            f"in use by process {record['pid']}" in err
            and "another PID namespace of this machine" in err
        )
        assert holder.poll() is None  # the holder trains on
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_on_another_machine_blocks_a_relaunch_until_its_lease_runs_out(
    tmp_path, smoke_phantoms, capsys
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "3")
    assert main(flags) == 0
    run_dir = tmp_path / "runs" / "r"
    other_pod = {"host": "octjepa-worker-0", "boot_id": "another-machine", "pid": 1}
    # killed (SIGKILL) a moment ago
    path = write_lock(run_dir, **other_pod, expires=time.time() + 300)
    relaunch = [*flags, "--max_steps", "5", "--extend", "true", "--resume", "auto"]
    capsys.readouterr()
    assert main(relaunch) == 2
    err = capsys.readouterr().err
    assert (
        "in use by process 1 on octjepa-worker-0 (another machine" in err
        and "its lease runs out at" in err
    )
    assert "a relaunch with --resume auto then takes the folder over" in err
    write_lock(run_dir, **other_pod, expires=time.time() - 1)
    written = time.time() - lock.LEASE_SECONDS - 60
    os.utime(path, (written, written))  # not renewed for a lease: gone
    assert main(relaunch) == 0
    assert [e["step"] for e in events(run_dir, "resume")] == [3] and not path.exists()


def test_a_holder_whose_clock_lags_by_more_than_a_lease_keeps_its_lock(tmp_path):
    """Its record was written a moment ago (the file's own time says so), but by a clock behind this
    one's by more than a lease: the expiry it wrote has passed here already."""
    write_lock(
        tmp_path,
        host="octjepa-worker-0",
        boot_id="another-machine",
        pid=1,
        expires=time.time() - 60,
    )
    with pytest.raises(ConfigError, match="is in use by process 1 on octjepa-worker-0"):
        lock.take_lock(str(tmp_path))


def test_this_machines_own_lock_from_before_a_reboot_is_taken_at_once(tmp_path, monkeypatch):
    booted = lock.booted_at()
    if booted is None:
        pytest.skip("no /proc/stat btime here")
    # as if it rebooted a minute ago
    monkeypatch.setattr(lock, "LEASE_SECONDS", time.time() - booted + 3600)
    path = write_lock(
        tmp_path,
        boot_id="the boot before this one",
        pid=12345,
        expires=time.time() + lock.LEASE_SECONDS,
    )
    os.utime(path, (booted - 60, booted - 60))  # last renewed just before the machine went down
    taken = lock.take_lock(str(tmp_path))
    lock.release_lock(taken)
    path = write_lock(tmp_path, host="octjepa-worker-0", boot_id="another-machine", pid=1)
    os.utime(path, (booted - 60, booted - 60))  # another machine's: only its lease can tell
    with pytest.raises(ConfigError, match="in use by process 1"):
        lock.take_lock(str(tmp_path))


@pytest.mark.slow
def test_a_filesystem_without_file_locks_is_refused_with_the_lease_only_way_and_runs_with_it(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "4")
    command = [sys.executable, str(REPO / "tests" / "faults.py"), "no_flock", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    refused = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "without file locks" in refused.stderr and "OCTJEPA_LOCK=lease" in refused.stderr
    leased = subprocess.run(
        command,
        cwd=REPO,
        env={**env, "OCTJEPA_LOCK": "lease"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert leased.returncode == 0, leased.stderr[-2000:]
    assert "WARNING: run folder" in leased.stderr and "lease-only lock" in leased.stderr
    assert [e["step"] for e in events(tmp_path / "runs" / "r", "checkpoint")][-1] == 4
    assert not (tmp_path / "runs" / "r" / lock.LOCK_NAME).exists()


def test_an_empty_lock_file_is_free_and_a_damaged_one_names_the_way_out(tmp_path):
    path = tmp_path / lock.LOCK_NAME
    path.write_text("")  # a take whose writer stopped before writing its record
    lock.release_lock(lock.take_lock(str(tmp_path)))
    path.write_text("{not json")
    with pytest.raises(ConfigError) as refused:
        lock.take_lock(str(tmp_path))
    assert "holds no lock record" in str(refused.value) and f"delete {path}" in str(refused.value)
    written = time.time() - lock.LEASE_SECONDS - 60
    os.utime(path, (written, written))  # untouched for a lease: taken over
    lock.release_lock(lock.take_lock(str(tmp_path)))
    assert not path.exists()


@pytest.mark.slow
def test_a_trainer_whose_lease_was_taken_over_stops_before_writing_another_checkpoint(
    tmp_path, smoke_phantoms
):
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "400", "--ckpt_every_steps", "2")
    run_dir = tmp_path / "runs" / "r"
    first = train_process(flags, popen={"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE})
    try:
        wait_for(
            lambda: list_checkpoints(str(run_dir / "checkpoints")), first, "its first checkpoint"
        )
        # suspended past its lease; another process took the folder over
        first.send_signal(signal.SIGSTOP)
        new_holder = write_lock(run_dir, pid=os.getpid(), host="new-holder")
        last = step_of(list_checkpoints(str(run_dir / "checkpoints"))[0])
        first.send_signal(signal.SIGCONT)
        err = first.communicate(timeout=300)[1]
    finally:
        first.kill()
    assert first.returncode == 2, err[-2000:]
    assert "no longer names this process" in err and "Traceback" not in err
    # never overwritten nor removed
    assert json.loads(new_holder.read_text())["host"] == "new-holder"
    # No checkpoint begun after the takeover: at most the one being written when the process was
    # suspended.
    assert max(map(step_of, list_checkpoints(str(run_dir / "checkpoints")))) <= last + 2


@pytest.mark.slow
def test_a_holder_stalled_mid_checkpoint_past_a_takeover_writes_nothing_when_it_wakes(
    tmp_path, smoke_phantoms
):
    """Suspended after its fencing check and before its write (a VM pause, a storage stall in a long
    save), for longer than its lease: another process took the folder over and wrote its own best.pt
    meanwhile."""
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "400", "--ckpt_every_steps", "2")
    run_dir, ready, go = tmp_path / "runs" / "r", tmp_path / "ready", tmp_path / "go"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OCTJEPA_TEST_READY": str(ready),
        "OCTJEPA_TEST_GO": str(go),
    }
    stalled = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "faults.py"), "stall_in_save", *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not ready.exists():
            assert stalled.poll() is None, stalled.communicate()
            time.sleep(0.05)
        new_holder = write_lock(run_dir, pid=os.getpid(), host="new-holder")
        (run_dir / "checkpoints" / "best.pt").write_bytes(b"the new holder's best weights")
        before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
        go.touch()
        err = stalled.communicate(timeout=300)[1]
    finally:
        stalled.kill()
    assert stalled.returncode == 2, err[-2000:]
    assert "no longer names this process" in err and "Traceback" not in err
    # nothing written nor left
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before
    assert json.loads(new_holder.read_text())["host"] == "new-holder"


def test_a_gcs_write_committed_after_a_takeover_is_refused_and_leaves_nothing(gcs_emulator):
    import storage

    folder = f"gs://{gcs_emulator.bucket}/fenced"
    held = lock.take_lock(folder)
    lock._HELD.append(held)
    try:
        with storage.open_atomic(f"{folder}/best.pt", lock.fenced) as f:
            f.write(b"the holder's weights")
        with pytest.raises(storage.Fenced, match="no longer names this process"):
            with storage.open_atomic(f"{folder}/best.pt", lock.fenced) as f:
                f.write(b"older weights of a stalled holder")
                # its lease ran out meanwhile: taken over
                taker = {**lock.lock_holder(), "host": "new-holder"}
                lock._write_lease(held["path"], taker, lock._read_lease(held["path"])[1])
        assert storage.read_bytes(f"{folder}/best.pt") == b"the holder's weights"
        assert [p for p in storage.glob_paths(f"{folder}/*") if storage.TMP_INFIX in p] == []
    finally:
        lock._HELD.remove(held)
        lock.release_lock(held)


def test_a_gcs_commit_never_replaces_an_object_another_writer_wrote_since_the_write_began(
    gcs_emulator,
):
    import storage

    folder = f"gs://{gcs_emulator.bucket}/replaced"
    held = lock.take_lock(folder)
    lock._HELD.append(held)
    try:
        with pytest.raises(storage.Fenced, match="replaced by another writer"):
            with storage.open_atomic(f"{folder}/best.pt", lock.fenced) as f:
                f.write(b"this writer's weights")
                storage.write_atomic(f"{folder}/best.pt", b"another writer's weights")
        assert storage.read_bytes(f"{folder}/best.pt") == b"another writer's weights"
    finally:
        lock._HELD.remove(held)
        lock.release_lock(held)


def training_state(step: int) -> dict:
    """What a resume needs of a step checkpoint to choose it (checkpoint.check_resumable)."""
    return {"model": {}, "optimizer": {}, "rng": {}, "train_state": {"step": step}}


def test_a_gcs_checkpoint_a_stalled_holder_commits_after_a_takeover_is_left_out_then_set_aside(
    tmp_path, gcs_emulator, monkeypatch
):
    """A holder passes its fencing check for update 20, then stalls (a VM pause) past its lease just
    before the copy that commits it: GCS has no precondition on another object, so the commit lands,
    after another process took the folder over and checkpointed update 15. Neither a resume, nor
    keep_last, nor probe.py --ckpt FOLDER may take update 20 for the folder's timeline."""
    import storage
    from checkpoint import carry_out, checkpoint_path, choose_resume_checkpoint, save_checkpoint
    from config import Config

    folder = f"gs://{gcs_emulator.bucket}/stalled"
    real_rewrite, taken = storage._rewrite, []

    def commit_after_a_stall(source, destination, generation):
        if destination.endswith("step_0000020.pt") and not taken:
            # meanwhile its lease runs out, and a process on another machine takes the folder over
            lock._HELD.remove(old)
            old["stop"].set()
            gone = {**lock.lock_holder(), "host": "paused-vm", "boot_id": "x", "expires": 0}
            lock._write_lease(old["path"], gone, lock._read_lease(old["path"])[1])
            taken.append(lock.take_lock(folder))
            lock._HELD.append(taken[0])
            save_checkpoint(
                checkpoint_path(folder, 15), training_state(15), 5, True, fence=lock.fenced
            )
        real_rewrite(source, destination, generation)

    old = lock.take_lock(folder)
    lock._HELD.append(old)
    try:
        save_checkpoint(checkpoint_path(folder, 10), training_state(10), 5, True, fence=lock.fenced)
        monkeypatch.setattr(storage, "_rewrite", commit_after_a_stall)
        save_checkpoint(
            checkpoint_path(folder, 20), training_state(20), 5, False, fence=lock.fenced
        )
        assert storage.exists(checkpoint_path(folder, 20))  # the commit landed
        assert list_checkpoints(folder) == [checkpoint_path(folder, s) for s in (15, 10)]
    finally:
        for held in (old, *taken):
            if held in lock._HELD:
                lock._HELD.remove(held)
            lock.release_lock(held)
    # the new holder is gone too (no lock held here): the leases its files carry still tell
    assert list_checkpoints(folder) == [checkpoint_path(folder, s) for s in (15, 10)]
    cfg = Config(out_dir=str(tmp_path), run_name="r", ckpt_dir=folder, resume="auto")
    path, ckpt, moves = choose_resume_checkpoint(cfg)
    assert path == checkpoint_path(folder, 15) and ckpt["train_state"]["step"] == 15
    assert storage.exists(checkpoint_path(folder, 20))  # planned only: a refusal changes nothing
    (move,) = carry_out(moves)
    assert move["event"] == "stale_checkpoint" and move["path"] == checkpoint_path(folder, 20)
    assert "after another process's lease began" in move["why"]
    assert not storage.exists(checkpoint_path(folder, 20))
    assert storage.exists(move["moved_to"]) and ".stale-" in move["moved_to"]  # set aside, kept
    # the folder's checkpoints are one timeline again; what was set aside still says what it is
    assert set(lock.stale_commits(folder)) == {move["moved_to"]}


def test_a_gcs_lease_taken_over_is_never_overwritten_by_the_old_holders_renewal(
    gcs_emulator, monkeypatch
):
    monkeypatch.setattr(lock, "RENEW_SECONDS", 0.2)
    held = lock.take_lock(f"gs://{gcs_emulator.bucket}/renewed")
    try:
        for _ in range(2):  # renewals while it holds the lease
            generation = held["generation"]
            deadline = time.monotonic() + 60
            while held["generation"] == generation and time.monotonic() < deadline:
                time.sleep(0.05)
        assert held["generation"] != generation and not held["lost"].is_set()
        # its lease ran out; another process took it over
        taker = {**lock.lock_holder(), "host": "new-holder"}
        while True:
            # a renewal came first: taken over at the next generation
            with contextlib.suppress(FileExistsError):
                taken = lock._write_lease(held["path"], taker, lock._read_lease(held["path"])[1])
                break
        assert held["lost"].wait(timeout=60)  # the renewal found it and stopped
        time.sleep(1)
        content, generation, _ = lock._read_lease(held["path"])
        assert generation == taken and json.loads(content)["host"] == "new-holder"
        assert not lock.lock_is_held(held)
    finally:
        lock.release_lock(held)
    # the release leaves the new holder's lease alone
    assert lock._read_lease(held["path"])[1] == taken


def test_a_lock_record_that_vanished_is_written_again_by_its_holder_not_taken_as_lost(
    tmp_path, gcs_emulator
):
    """A bucket emptied or restored (a GCS emulator restarted, an admin's cleanup): no other process
    took the folder, or its record would be there, so the holder writes its own again and keeps
    writing its checkpoints."""
    for folder in (str(tmp_path / "local"), f"gs://{gcs_emulator.bucket}/vanished"):
        held = lock.take_lock(folder)
        try:
            if folder.startswith("gs://"):
                lock.gcs_filesystem().rm(held["path"])
            else:
                os.remove(held["path"])
            assert lock.lock_is_held(held) and not held["lost"].is_set()
            gcs = folder.startswith("gs://")
            content = lock._read_lease(held["path"])[0] if gcs else Path(held["path"]).read_bytes()
            assert json.loads(content)["token"] == held["holder"]["token"]
        finally:
            lock.release_lock(held)


RACE = """
import os, sys, time
sys.path.insert(0, {repo!r})
import lock
from config import ConfigError
open({go!r} + f".ready.{{os.getpid()}}", "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.01)
try:
    lock.take_lock({folder!r})
    print("took it", flush=True)
    time.sleep(3)
except ConfigError as e:
    print("refused:", e, flush=True)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_two_processes_racing_for_an_expired_gcs_lease_one_takes_it(
    tmp_path, gcs_emulator, attempt
):
    folder = f"gs://{gcs_emulator.bucket}/race{attempt}"
    lock._write_lease(
        f"{folder}/{lock.LOCK_NAME}",
        {**lock.lock_holder(), "host": "gone-pod", "boot_id": "x", "expires": time.time() - 1},
        "0",
    )
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE.format(repo=str(REPO), go=str(go), folder=folder)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in "ab"
    ]
    while len(list(tmp_path.glob("go.ready.*"))) < 2:  # both imported (torch) and waiting
        assert all(r.poll() is None for r in racers)
        time.sleep(0.05)
    go.touch()
    outputs = sorted(r.communicate(timeout=300)[0].split(":")[0].strip() for r in racers)
    assert outputs == ["refused", "took it"]
