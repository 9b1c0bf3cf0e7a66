"""What the tests share: the smoke config's command lines and runs (train.py in this process, a
subprocess or torchrun with tests/faults.py), reading a run's metrics, events and W&B log, comparing
sharded and unsharded runs, a local GCS emulator and small fixtures. Test modules import from here
(and tests/corpora.py), never from each other."""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")
# 14 updates of 4 volumes, a checkpoint every 4; one process with per_core_batch_size 4 is the
# reference of the sharded runs (tests/test_shard.py).
SHARD_FLAGS = (
    "--max_steps",
    "14",
    "--ckpt_every_steps",
    "4",
    "--keep_last",
    "5",
    "--val_every_steps",
    "100",
    "--log_every_steps",
    "1",
)


# --- train.py runs and what they write ---


def index_beside(phantom_dir) -> str:
    """Where the scan index of a phantom set is kept for the runs on it: beside it, as its
    decoded-volume cache."""
    return str(phantom_dir).rstrip("/") + "-index.jsonl"


def phantom_flags(phantom_dir, *flags):
    """--phantom_dir, and --index_path of the set's index beside it unless `flags` name other data
    (--data_root, --manifest_path): the first run on the set scans it into that index and the others
    reuse it, as a user's runs reuse the index of `data.py scan --out` (conftest's smoke_phantoms
    writes it once a session)."""
    other_data = {"--data_root", "--manifest_path"} & {str(f).split("=")[0] for f in flags}
    return [
        "--phantom_dir",
        str(phantom_dir),
        *([] if other_data else ["--index_path", index_beside(phantom_dir)]),
    ]


def smoke_flags(tmp_path, phantom_dir, *flags):
    """train.py flags of a smoke-config run named r in tmp_path/runs on a phantom set
    (phantom_flags), then `flags`."""
    return [
        "--config",
        SMOKE,
        *phantom_flags(phantom_dir, *flags),
        "--out_dir",
        str(tmp_path / "runs"),
        "--run_name",
        "r",
        *flags,
    ]


def ddp_flags(tmp_path, phantoms, *flags):
    """train.py flags of a smoke-config run in tmp_path/runs (unnamed: process 0 names it), 2
    volumes a process."""
    return [
        "--config",
        SMOKE,
        *phantom_flags(phantoms, *flags),
        "--out_dir",
        str(tmp_path / "runs"),
        "--per_core_batch_size",
        "2",
        *flags,
    ]


def run_cli(args, cwd=REPO, timeout=600, env=None):
    """train.py with `args` in a subprocess, its output captured (env: added to this process's)."""
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def train_process(flags, address_space_kb=None, popen=None):
    """`python train.py FLAGS` as its own process (under an address-space cap, as clusters set one):
    started with Popen's `popen` arguments, or, without them, run to its end with its output."""
    cap = f"ulimit -v {address_space_kb}; " if address_space_kb else ""
    command = [
        "bash",
        "-c",
        cap + 'exec "$@"',
        "bash",
        sys.executable,
        str(REPO / "train.py"),
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen is not None:
        return subprocess.Popen(command, cwd=REPO, env=env, text=True, **popen)
    return subprocess.run(command, cwd=REPO, env=env, text=True, capture_output=True, timeout=600)


def wait_for(condition, process, what):
    """Poll until condition() holds; fails if `process` ended first."""
    while not condition():
        assert process.poll() is None, (
            f"the first run ended (exit {process.returncode}) before {what}"
        )
        time.sleep(0.5)


def torchrun(tmp_path, faults, *flags, nnodes=1, node_rank=0, port=None, nproc=2, popen=False):
    """tests/faults.py (train.py with `faults` injected) in nproc gloo processes under torchrun;
    nnodes > 1: this machine is node node_rank of a rendezvous on `port`. popen: started, not waited
    for."""
    node = (
        [
            "--nnodes",
            str(nnodes),
            "--node_rank",
            str(node_rank),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"127.0.0.1:{port}",
            "--rdzv_id",
            "octjepa-test",
        ]
        if nnodes > 1
        else ["--standalone"]
    )
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *node,
        f"--nproc_per_node={nproc}",
        str(REPO / "tests" / "faults.py"),
        faults,
        *flags,
    ]
    # a crash in native code prints each thread's Python stack
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    started = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if popen:
        return started
    try:
        stdout, stderr = started.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        stdout, stderr = stop_hung_torchrun(started)
        pytest.fail(
            f"torchrun {faults} hung for 600 s; each worker's stacks:\n{stderr[-20000:]}\nstdout:\n"
            f"{stdout[-3000:]}"
        )
    return subprocess.CompletedProcess(args, started.returncode, stdout, stderr)


def stop_hung_torchrun(launcher: subprocess.Popen):
    """Ask torchrun's workers for every thread's Python stack (tests/faults.py registers SIGUSR1 to
    print them), then kill torchrun and every process under it (a hung loader worker keeps the
    output pipes open); (stdout, stderr) of all of them."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        children.setdefault(parent_pid(stat), []).append(int(stat.split("/")[2]))
    tree, queue = [], [launcher.pid]
    while queue:
        tree.append(queue.pop())
        queue += children.get(tree[-1], [])
    for pid in children.get(launcher.pid, []):  # one after the other: the stacks do not interleave
        os.kill(pid, signal.SIGUSR1)
        time.sleep(2)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return launcher.communicate(timeout=60)


def parent_pid(stat_path: str) -> Optional[int]:
    """The parent process id in a /proc/PID/stat file, None when that process is gone."""
    try:
        with open(stat_path) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path):
    """The records of a JSON-lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def train_lines(run_dir):
    """The train lines of a run's metrics.jsonl."""
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["split"] == "train"]


def events(run_dir, kind=None):
    """The events of a run's events.jsonl (of one kind, when given)."""
    return [
        e for e in read_jsonl(Path(run_dir) / "events.jsonl") if kind is None or e["event"] == kind
    ]


def metrics(run_dir, split="train"):
    """The metrics lines of one split of a run."""
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["split"] == split]


def run_files(run_dir):
    """Every file under a run folder with its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(Path(run_dir).rglob("*"))
        if p.is_file()
    }


def losses(run_dir, after: int = 0):
    """The train losses of a run after update `after`."""
    return [r["loss"] for r in train_lines(run_dir) if r["step"] > after]


def final_checkpoint(run_dir) -> dict:
    """The state in the newest step checkpoint of a run."""
    return torch.load(list_checkpoints(str(run_dir / "checkpoints"))[0], weights_only=True)


def read_wandb_records(path):
    """The protobuf records of a W&B transaction log (.wandb file: LevelDB-style 32 KiB blocks of
    fragments)."""
    import struct
    from wandb.proto import wandb_internal_pb2

    # 7-byte ':W&B' file header
    buf, pos, pending, records, block = path.read_bytes(), 7, b"", [], 32768
    while pos + 7 <= len(buf):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        pending += buf[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: one protobuf record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def read_wandb_offline_history(run_dir, timeout_s=120):
    """History rows of an offline W&B run. wandb-core writes the file in its own process and may
    still be writing when run.finish() has returned (seen on a loaded machine: the file still
    empty), so wait for its `exit` record."""
    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "exit" in kinds, (
        f"{path}: no exit record {timeout_s} s after the run finished (records: {kinds})"
    )
    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r, kind in zip(records, kinds)
        if kind == "history"
    ]


# --- one update ---


def assert_same_first_update(model, optimizer, expected_model, expected_optimizer) -> None:
    """Two models that made their first AdamW update from the same weights made the same one: the
    same gradients (each trained parameter's first moment, (1 - beta1) g) to float32 rounding; the
    same weights to 1e-5 relative and 1e-6 absolute wherever |g| >= 10 eps, and elsewhere no further
    apart than the gradients allow (the first step, lr g / (|g| + eps), has slope lr / eps near 0:
    the 1e-11 by which two float32 summation orders of one gradient differ move it by up to lr /
    1000; the recipe's hmlp stem and local loss head give a few such gradients); the same other
    state (the EMA target, buffers)."""
    group = expected_optimizer.param_groups[0]
    eps, beta1, lr = group["eps"], group["betas"][0], float(group["lr"])
    for (name, p), expected in zip(
        model.named_parameters(), expected_model.parameters(), strict=True
    ):
        if not p.requires_grad:
            continue
        moment, expected_moment = (
            optimizer.state[p]["exp_avg"],
            expected_optimizer.state[expected]["exp_avg"],
        )
        torch.testing.assert_close(
            moment,
            expected_moment,
            rtol=1e-5,
            atol=1e-6 * float(expected_moment.abs().max()),
            msg=lambda m: f"{name}: gradient: {m}",
        )
        conditioned = expected_moment.abs() >= 10 * eps * (1 - beta1)
        torch.testing.assert_close(
            p.detach()[conditioned],
            expected.detach()[conditioned],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"{name}: {m}",
        )
        gap = (moment - expected_moment).abs()[~conditioned] / (1 - beta1)
        apart = (p.detach() - expected.detach()).abs()[~conditioned]
        assert bool((apart <= 1e-6 + lr * gap / eps).all()), (
            name,
            float((apart - lr * gap / eps).max()),
        )
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    for (key, value), expected in zip(
        model.state_dict().items(), expected_model.state_dict().values(), strict=True
    ):
        if key not in trained:
            torch.testing.assert_close(
                value, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}"
            )


# --- sharded runs ---


def assert_same_state(got: dict, expected: dict) -> None:
    """EMA target weights and AdamW moments equal to 1e-5 relative (norm of the difference over the
    norm; for a target tensor, over the norm of the weights it averages where that is larger: a bias
    that starts at 0 has a target 1/100 of its weights after 14 updates, and one element whose first
    gradient is within eps of 0 moves 1e-7 apart in two summation orders, lr g / (|g| + eps) having
    slope lr / eps there)."""
    for key, value in expected["model"].items():
        if key.startswith("target_encoder."):
            averaged = expected["model"]["encoder." + key.removeprefix("target_encoder.")]
            scale = max(torch.norm(value), torch.norm(averaged))
            assert torch.norm(got["model"][key] - value) <= 1e-5 * scale, key
    for index, moments in expected["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.norm(
                got["optimizer"]["state"][index][name] - moments[name]
            ) <= 1e-5 * torch.norm(moments[name])


def assert_holds_a_share(sharded_run, unsharded_run, share: float) -> None:
    """The sharded run's fullest device holds `share` (up to 1.2x for uneven shards) of the weights,
    EMA target and AdamW state that every device of the unsharded run holds."""
    (held,), (whole,) = (
        [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "device_memory"]
        for run in (sharded_run, unsharded_run)
    )
    assert held["fsdp_size"] == round(1 / share) and whole["fsdp_size"] == 1
    for part in ("weights", "ema_target", "adamw"):
        assert share * whole[part] <= held[part] <= 1.2 * share * whole[part], (part, held, whole)


# --- the rest ---


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny probes and models in one thread, where OpenMP threads only spin on a busy machine
    (autouse in the modules that import it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class GCSEmulator:
    """A gcp-storage-emulator process on 127.0.0.1 that honours GCS's generation preconditions
    (tests/gcs_emulator.py); STORAGE_EMULATOR_HOST points gcsfs (storage.py) at it."""

    bucket = "octjepa-test"

    def __init__(self, tmp_dir: Path, port: Optional[int] = None):
        # a port again: the same emulator back after an outage (its objects gone)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_dir / "emulator.log", "a")
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "gcs_emulator.py"),
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--in-memory",
                "--default-bucket",
                self.bucket,
                "--quiet",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start; see {self.log.name}")
                time.sleep(0.1)

    def upload(self, local_dir: str, prefix: str) -> str:
        """Copy a local folder (recursively) to gs://bucket/prefix; returns that URL."""
        from storage import gcs_filesystem

        url = f"gs://{self.bucket}/{prefix}"
        fs = gcs_filesystem()
        for root, _, files in os.walk(local_dir):
            for name in files:
                path = os.path.join(root, name)
                fs.put_file(path, f"{url}/{os.path.relpath(path, local_dir)}")
        return url

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def stderr_excerpt(result, tail=3000):
    """The end of a finished process's stderr for an assertion message, led by any crash's stack
    dump (the 'Fatal Python error' that PYTHONFAULTHANDLER prints), which a crash in one of several
    processes pushes far up."""
    crash = result.stderr.find("Fatal Python error")
    lead = result.stderr[crash : crash + 4000] + "\n[...]\n" if crash >= 0 else ""
    return lead + result.stderr[-tail:]
