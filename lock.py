"""The run folder's lock: one process at a time writes a run folder (out_dir/run_name, and ckpt_dir when it lies
elsewhere). Local folders: a lock file created only if absent; gs://: a lease object created only if absent and
renewed by a thread. train.py takes it for the whole run (run_folder_lock).
"""
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Optional, Tuple

from config import Config, ConfigError
from runtime import Runtime, master_decides
from storage import gcs_filesystem, process_is_running, read_bytes, storage_errors


LOCK_NAME = ".octjepa-lock"  # in the run folder (and in ckpt_dir when it lies elsewhere)
LEASE_SECONDS = 600  # a gs:// lock not renewed for this long (its process gone) is taken over; renewed every 1/4


@contextlib.contextmanager
def run_folder_lock(cfg: Config, rt: Runtime):
    """One process at a time in a run folder: the master takes the lock of out_dir/run_name (and of ckpt_dir when it
    lies elsewhere, e.g. gs://) for as long as the block runs. A folder that another live process holds stops every
    process with a ConfigError naming the holder; the lock of a process gone from this host (or, on gs://, not
    renewed for LEASE_SECONDS) is taken over. A dry run writes nothing and takes none."""
    folders = [] if cfg.dry_run else [os.path.join(cfg.out_dir, cfg.run_name)]
    if cfg.ckpt_dir is not None and folders and not os.path.abspath(cfg.ckpt_dir).startswith(
            os.path.abspath(folders[0]) + os.sep):
        folders.append(cfg.ckpt_dir)
    held = []  # the master's locks (a lease's renewal thread stays in its process)
    try:
        master_decides(rt, lambda: held.extend(take_lock(folder) for folder in folders))
        yield
    finally:
        for lock in held:
            release_lock(lock)


def process_started(pid: int) -> Optional[str]:
    """When a process of this host started (clock ticks after boot, /proc/PID/stat's field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def lock_holder() -> dict:
    """Who takes a lock: this process (host, pid and its start, to tell a reused pid), a unique token, the time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": process_started(os.getpid()),
            "token": uuid.uuid4().hex, "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "expires": time.time() + LEASE_SECONDS}


def holder_is_gone(holder: dict, gcs: bool) -> bool:
    """Whether a lock's holder no longer runs: a process gone from this host (or its pid now another process's),
    or, on gs://, a lease not renewed in time."""
    if gcs and holder.get("expires", 0) < time.time():
        return True
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if not process_is_running(holder["host"], holder["pid"]):
        return True
    started = process_started(holder["pid"])
    return None not in (started, holder.get("pid_started")) and started != holder["pid_started"]


def take_lock(folder: str) -> dict:
    """Take `folder`'s lock (local: a file created only if absent; gs://: a lease object created only if absent,
    renewed by a thread); the lock, for release_lock. ConfigError naming the holder when a live process has it."""
    path = f"{folder.rstrip('/')}/{LOCK_NAME}"
    gcs = path.startswith("gs://")
    for _ in range(3):  # a holder gone is removed, then the lock taken again; a race lost ends in the error
        holder = lock_holder()
        try:
            (_create_lease if gcs else _create_lock_file)(path, holder)
        except FileExistsError:
            try:
                current, generation = _read_lock(path)
            except FileNotFoundError:
                continue  # released meanwhile
            if not holder_is_gone(current, gcs):
                raise ConfigError(
                    f"run folder: {folder} is in use by process {current.get('pid')} on {current.get('host')} "
                    f"(since {current.get('since')}; lock {path}). One process at a time writes a run folder: wait "
                    f"for it to finish, or choose another --run_name. If that process is gone (another machine), "
                    f"delete {path}" + (" or wait until its lease runs out" if gcs else "") + ".") from None
            _remove_lock(path, generation)
            continue
        except OSError as e:
            raise ConfigError(f"run folder: cannot create the lock {path} ({e!r}); make {folder} writable or choose "
                              f"another --out_dir.") from None
        lock = {"path": path, "holder": holder, "stop": threading.Event()}
        if gcs:
            threading.Thread(target=_renew_lease, args=(lock,), daemon=True).start()
        return lock
    raise ConfigError(f"run folder: could not take the lock {path}: other processes keep taking it; run one at a time.")


def _create_lock_file(path: str, holder: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{holder['token']}"
    with open(tmp, "w") as f:
        json.dump(holder, f)
    try:
        os.link(tmp, path)  # whole or absent, never a part (also on NFS); FileExistsError when held
    finally:
        os.remove(tmp)


def _create_lease(path: str, holder: dict) -> None:
    fs = gcs_filesystem()
    fs.invalidate_cache(path)
    if fs.exists(path):  # GCS checks the precondition below itself; a store that ignores it, here
        raise FileExistsError(path)
    try:
        fs.pipe_file(path, json.dumps(holder).encode(), mode="create")  # ifGenerationMatch=0: only if absent
    except Exception as e:
        if "412" in str(e) or isinstance(e, FileExistsError):
            raise FileExistsError(path) from None
        raise


def _read_lock(path: str) -> Tuple[dict, Optional[str]]:
    """The holder a lock file or lease names ({} when unreadable) and, on gs://, its generation."""
    if path.startswith("gs://"):
        fs = gcs_filesystem()
        fs.invalidate_cache(path)
        generation = fs.info(path).get("generation")
    else:
        generation = None
    try:
        holder = json.loads(read_bytes(path))
    except ValueError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), generation


def _remove_lock(path: str, generation: Optional[str]) -> None:
    """Remove a lock whose holder is gone: on gs://, only the generation that was read (a lease taken meanwhile
    stays)."""
    with contextlib.suppress(FileNotFoundError):
        if path.startswith("gs://"):
            bucket, key = path[len("gs://"):].split("/", 1)
            gcs_filesystem().call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation)
            gcs_filesystem().invalidate_cache(path)
        else:
            os.remove(path)


def _renew_lease(lock: dict) -> None:
    while not lock["stop"].wait(LEASE_SECONDS / 4):
        with contextlib.suppress(Exception):  # a missed renewal is tried again; the lease lasts 4 of them
            lock["holder"]["expires"] = time.time() + LEASE_SECONDS
            gcs_filesystem().pipe_file(lock["path"], json.dumps(lock["holder"]).encode())


def release_lock(lock: dict) -> None:
    """Give a lock back (only while it still names this holder)."""
    lock["stop"].set()
    with contextlib.suppress(*storage_errors()):
        holder, generation = _read_lock(lock["path"])
        if holder.get("token") == lock["holder"]["token"]:
            _remove_lock(lock["path"], generation)
