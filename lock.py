"""The run folder's lock: one process at a time writes a run folder (out_dir/run_name, and ckpt_dir
when it lies elsewhere). train.py takes it for the whole run (run_folder_lock).

The lock is a lease: a small record (.octjepa-lock) naming its holder (a token, the machine's boot
id, the process's PID namespace, pid and start time, the host name for messages) and when it
expires; a thread of the holder renews it. Another process takes it over only once its holder is
shown gone: on the same machine and PID namespace, its process no longer runs; anywhere else
(another machine, a relaunched pod, a container or an `unshare`d job whose PIDs this process cannot
see), its lease ran out, LEASE_SECONDS after its last renewal. Every change is atomic, so of two
processes that find a stale lock exactly one takes it: a local record is changed only under an flock
of the lock file and replaced by rename (flock works across PID namespaces and, through the kernel's
NFS locks, across machines; the kernel drops it with its process, so a kill leaves no stale guard);
a gs:// record only with a generation precondition. A holder whose record was taken over (it stopped
renewing for a lease, e.g. suspended) learns it at its next renewal or checkpoint (locks_lost,
check_locks) and stops without writing again; a checkpoint it was writing meanwhile is committed
only under the lock (fenced: locally its rename happens under the flock after the record was read
again; on gs:// the lease is read again right before a copy whose precondition is the object's
generation when the write began), so a holder stalled past its lease (suspended, a VM pause, a
storage stall) never replaces what the new holder wrote. GCS has no precondition on another object,
so on gs:// a holder that stalls exactly between that read and the copy can still commit one object:
each commit carries when its lease began (lease_metadata), and stale_commits tells such an object
apart (committed after a later lease began), for the checkpoint timeline to leave out.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

from config import Config, ConfigError
from runtime import Runtime, master_decides
from storage import Fenced, gcs_filesystem, storage_errors

LOCK_NAME = ".octjepa-lock"  # in the run folder (and in ckpt_dir when it lies elsewhere)
# a lock its holder has not renewed for this long is taken over (clocks must agree within it)
LEASE_SECONDS = 600
RENEW_SECONDS = LEASE_SECONDS / 10  # a few missed renewals (a storage hiccup) do not lose the lease
# =lease: a lease-only lock, for a filesystem without flock (NFS nolock, some FUSE)
LOCK_MODE_ENV = "OCTJEPA_LOCK"
# what flock raises where a filesystem has none
NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
# file descriptors this process holds an flock on: closed in a forked child
_OPEN_GUARDS: set = set()
_HELD: List[dict] = []  # this process's run-folder locks (run_folder_lock)


@contextlib.contextmanager
def run_folder_lock(cfg: Config, rt: Runtime):
    """One process at a time in a run folder: the master takes the lock of out_dir/run_name (and of
    ckpt_dir when it lies elsewhere, e.g. gs://) for as long as the block runs (lease_lost says
    whether another process took one over since). A folder whose lock another process holds stops
    every process with a ConfigError naming the holder and when its lease runs out. A dry run writes
    nothing and takes none."""
    folders = [] if cfg.dry_run else [os.path.join(cfg.out_dir, cfg.run_name)]
    if (
        cfg.ckpt_dir is not None
        and folders
        and not os.path.abspath(cfg.ckpt_dir).startswith(os.path.abspath(folders[0]) + os.sep)
    ):
        folders.append(cfg.ckpt_dir)
    held = []  # the master's locks (a lease's renewal thread stays in its process)
    try:
        master_decides(rt, lambda: held.extend(take_lock(folder) for folder in folders))
        _HELD.extend(held)
        yield
    finally:
        for lock in held:  # also those taken before another folder's lock was refused
            release_lock(lock)
        _HELD[:] = [lock for lock in _HELD if all(lock is not mine for mine in held)]


# --------------------------------------------------------------------------------------------------
# Who holds a lock, and whether it is gone
# --------------------------------------------------------------------------------------------------


def process_started(pid: int) -> Optional[str]:
    """When a process of this PID namespace started (clock ticks after boot, /proc/PID/stat's field
    22); None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_machine() -> dict:
    """What tells this kernel and PID namespace from others: the boot id (the same in every
    container of a machine, another on every machine and boot) and the PID namespace (pid:[inode]);
    None each where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot_id = namespace = None
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid_namespace": namespace}


def lock_holder() -> dict:
    """A new holder record for this process: a unique token, this machine, pid and its start time
    (to tell a reused pid), when it was taken and when its lease expires."""
    return {
        "token": uuid.uuid4().hex,
        **this_machine(),
        "pid": os.getpid(),
        "pid_started": process_started(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "expires": time.time() + LEASE_SECONDS,
    }


def holder_is_gone(
    holder: dict, written_at: Optional[float] = None, now: Optional[float] = None
) -> bool:
    """Whether a lock's holder no longer holds it: its lease expired, or it is a process of this
    machine and PID namespace that no longer runs (process_is_gone), or one of an earlier boot of
    this machine (rebooted_since). A holder elsewhere (another machine, container or PID namespace)
    is judged by its lease alone: its PID means nothing here. A local record's lease is its age on
    the storage's own clock (written_at: the file's mtime; now: a file written now, storage_now), so
    no machine's clock, ahead or behind, cuts a live holder's lease short; a gs:// record's is the
    expiry its holder wrote."""
    if written_at is not None and now is not None:
        expired = written_at + LEASE_SECONDS < now
    else:
        expired = holder.get("expires", 0) < time.time()
    return expired or process_is_gone(holder) is True or rebooted_since(holder, written_at)


def booted_at() -> Optional[float]:
    """When this machine booted (/proc/stat's btime, seconds since the epoch); None where
    unknown."""
    try:
        with open("/proc/stat") as f:
            return float(next(line.split()[1] for line in f if line.startswith("btime ")))
    except (OSError, StopIteration, ValueError):
        return None


def rebooted_since(holder: dict, written_at: Optional[float]) -> bool:
    """Whether a local record was left by this machine before it rebooted: the same host name,
    another boot id, and last written before this boot (a live holder on another machine of that
    name renews it every RENEW_SECONDS)."""
    booted, here = booted_at(), this_machine()
    return (
        written_at is not None
        and booted is not None
        and holder.get("host") == here["host"]
        and None not in (holder.get("boot_id"), here["boot_id"])
        and holder.get("boot_id") != here["boot_id"]
        and written_at < booted
    )


def storage_now(folder: str) -> float:
    """The time now on the clock of the storage that holds a local `folder` (an NFS server's): the
    mtime of a small file written there now, and removed."""
    probe = os.path.join(folder, f"{LOCK_NAME}.clock-{uuid.uuid4().hex}")
    try:
        with open(probe, "w") as f:
            return os.fstat(f.fileno()).st_mtime
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def process_is_gone(holder: dict) -> Optional[bool]:
    """Whether the process a record names (boot_id, pid_namespace, pid, pid_started: lock_holder's)
    no longer runs, or its pid is now another process's; None when it is not one of this machine and
    PID namespace (then nothing here can tell)."""
    here = this_machine()
    if (
        None in (here["boot_id"], here["pid_namespace"])
        or not isinstance(holder.get("pid"), int)
        or (holder.get("boot_id"), holder.get("pid_namespace"))
        != (here["boot_id"], here["pid_namespace"])
    ):
        return None
    started = process_started(holder["pid"])
    return started is None or started != holder.get("pid_started", started)


def judge(
    content: bytes, written_at: float, path: str, folder: str, now: Optional[float] = None
) -> Optional[dict]:
    """The live holder of a lock record, or None when the lock is free: no record, an empty one (a
    take whose writer stopped before writing it) or a holder that is gone. A record that is not one
    (damaged, or written by another tool) counts as held until a lease after it was last written; a
    ConfigError names the holder and the way on. `now`: the storage's clock (storage_now) for a
    local record, whose lease is then its age (holder_is_gone)."""
    if not content.strip():
        return None
    try:
        holder = json.loads(content)
    except ValueError:
        holder = None
    if not isinstance(holder, dict) or "token" not in holder:
        if written_at + LEASE_SECONDS < (time.time() if now is None else now):
            return None
        raise ConfigError(
            f"run folder: the lock {path} holds no lock record ({content[:80]!r}: damaged, or"
            f" written by another tool) and was written at {time.ctime(written_at)}. If no run uses"
            f" {folder}, delete {path}; else it is taken over once it is {LEASE_SECONDS // 60} min"
            f" old ({time.ctime(written_at + LEASE_SECONDS)})."
        )
    return None if holder_is_gone(holder, written_at if now is not None else None, now) else holder


def refusal(holder: dict, path: str, folder: str) -> ConfigError:
    """The error for a folder whose lock a live process holds."""
    here = this_machine()
    where = "this machine" if holder.get("boot_id") == here["boot_id"] else "another machine"
    if where == "this machine" and holder.get("pid_namespace") != here["pid_namespace"]:
        where = "another PID namespace of this machine (a container or an unshared job)"
    return ConfigError(
        f"run folder: {folder} is in use by process {holder.get('pid')} on {holder.get('host')}"
        f" ({where}; since {holder.get('since')}; lock {path}). One process at a time writes a run"
        " folder: wait for it to finish, or choose another --run_name. If that process is gone,"
        f" its lease runs out at {time.ctime(holder.get('expires', 0))} ({LEASE_SECONDS // 60} min"
        " after its last renewal): a relaunch with --resume auto then takes the folder over; to"
        f" take it over earlier, make sure it is gone and delete {path}."
    )


# --------------------------------------------------------------------------------------------------
# Taking, renewing, checking and giving back a lock (local file or gs:// object)
# --------------------------------------------------------------------------------------------------


def take_lock(folder: str) -> dict:
    """Take `folder`'s lock (its record written atomically when free; see judge) and start the
    thread that renews it; the lock, for release_lock. ConfigError naming the holder when a live
    process has it."""
    path = f"{folder.rstrip('/')}/{LOCK_NAME}"
    holder = lock_holder()
    try:
        began = None  # gs://: when this lease began, which every commit under it carries
        if path.startswith("gs://"):
            generation, began = _take_lease(path, folder, holder)
        else:
            with _flocked(path) as (content, written_at):
                current = judge(content, written_at, path, folder, storage_now(folder))
                if current is not None:
                    raise refusal(current, path, folder)
                _replace(path, holder)
            generation = None
            # no flock: a racer that wrote after this one wins; the other sees it and gives way
            if lease_only():
                time.sleep(1.0)
                with _flocked(path) as (content, _):
                    if _token(content) != holder["token"]:
                        raise refusal(json.loads(content), path, folder)
    except (OSError, *storage_errors()) as e:
        if getattr(e, "errno", None) in NO_FLOCK_ERRNOS:
            raise ConfigError(
                f"run folder: {folder} is on a filesystem without file locks (flock: {e!r}; NFS"
                " mounted nolock, some FUSE mounts). Choose an --out_dir (and --ckpt_dir) on one"
                f" with them, or run with {LOCK_MODE_ENV}=lease in the environment: a lease-only"
                " lock (its record and lease, without flock; two processes starting within a"
                " second of each other could both take it: start one at a time). See"
                " docs/outputs.md."
            ) from None
        raise ConfigError(
            f"run folder: cannot take the lock {path} ({e!r}); make {folder} writable (on a "
            "filesystem with file locks: flock) or choose another --out_dir."
        ) from None
    lock = {
        "path": path,
        "folder": folder,
        "holder": holder,
        "generation": generation,
        "began": began,
        "stop": threading.Event(),
        "lost": threading.Event(),
    }
    threading.Thread(target=_renew_until_stopped, args=(lock,), daemon=True).start()
    return lock


def _take_lease(path: str, folder: str, holder: dict) -> Tuple[str, str]:
    """Write a gs:// lock record where it is free, under a precondition on the generation that was
    judged (0: none), so that of two processes exactly one writes it; (its new generation, when the
    lease began: the record's GCS time)."""
    for _ in range(3):  # a lost race is judged again; a live winner ends in the refusal
        content, generation, written_at = _read_lease(path)
        current = judge(content, written_at, path, folder)
        if current is not None:
            raise refusal(current, path, folder)
        try:
            written = _write_lease_record(path, holder, generation)
            return str(written["generation"]), written["updated"]
        except FileExistsError:  # 412: another process wrote it since it was read
            continue
    raise ConfigError(
        f"run folder: could not take the lock {path}: other processes keep taking it; run one at a"
        " time."
    )


def _renew_until_stopped(lock: dict) -> None:
    while not lock["stop"].wait(RENEW_SECONDS):
        # a missed renewal is tried again; the lease lasts several
        with contextlib.suppress(*storage_errors()):
            if not renew_lock(lock):
                print(f"WARNING: {lost_message(lock)}", file=sys.stderr, flush=True)
                return


def renew_lock(lock: dict) -> bool:
    """Push the lease's expiry on, only while the record still names this holder; False (and
    lock['lost'] set) when another process has taken it over: the renewal never overwrites it."""
    lock["holder"]["expires"] = time.time() + LEASE_SECONDS
    if lock["generation"] is not None:
        try:
            lock["generation"] = _write_lease(lock["path"], lock["holder"], lock["generation"])
            return True
        except FileExistsError:
            return retake_if_vanished(lock)
    with _flocked(lock["path"]) as (content, _):
        if content and _token(content) != lock["holder"]["token"]:
            lock["lost"].set()
            return False
        # also where the record vanished: no other process wrote one
        _replace(lock["path"], lock["holder"])
    return True


def retake_if_vanished(lock: dict) -> bool:
    """Where a gs:// lock record no longer names this holder: write it again if it vanished (a
    bucket restored or emptied: no other process took the folder, or its record would be there),
    only while it is still absent; else the lock is lost (lock['lost'] set). Whether this process
    still holds it."""
    content, generation, _ = _read_lease(lock["path"])
    if not content:
        try:
            lock["generation"] = _write_lease(lock["path"], lock["holder"], "0")
            print(
                f"WARNING: run folder: the lock {lock['path']} had vanished; written again",
                file=sys.stderr,
                flush=True,
            )
            return True
        except FileExistsError:  # another process wrote one since
            pass
    held = generation == lock["generation"] and _token(content) == lock["holder"]["token"]
    if not held:
        lock["lost"].set()
    return held


def lock_is_held(lock: dict) -> bool:
    """Whether the record still names this holder (read now: the fencing check before a checkpoint
    is written); sets lock['lost'] when not."""
    if not lock["lost"].is_set():
        if lock["generation"] is not None:
            return retake_if_vanished(lock)
        try:
            with open(lock["path"], "rb") as f:
                held = _token(f.read()) == lock["holder"]["token"]
        # vanished (no other process took the folder: its record would be there)
        except FileNotFoundError:
            held = renew_lock(lock)
        if not held:
            lock["lost"].set()
    return not lock["lost"].is_set()


@contextlib.contextmanager
def fenced():
    """While the block runs (the commit of a checkpoint write: storage.open_atomic's fence), every
    run-folder lock of this process names it: its record read now, a local one held under its flock
    until the block ends, so that no takeover falls between the check and the write. Fenced (and the
    lock's 'lost' set) when one was taken over."""
    with contextlib.ExitStack() as held:
        for lock in _HELD:
            # gs://: read now (a takeover also changes the generation)
            if lock["generation"] is not None:
                if not lock_is_held(lock):
                    raise Fenced(lost_message(lock))
                continue
            content, _ = held.enter_context(_flocked(lock["path"]))
            # vanished (no other process took the folder: its record would be there)
            if not content:
                _replace(lock["path"], lock["holder"])
            elif _token(content) != lock["holder"]["token"]:
                lock["lost"].set()
            if lock["lost"].is_set():
                raise Fenced(lost_message(lock))
        yield


# the custom metadata each fenced gs:// commit carries: when the lease it was made under began
LEASE_METADATA = "octjepa-lease"


def lease_metadata(path: str) -> Dict[str, str]:
    """The custom metadata of a gs:// object this process writes under a run-folder lock: when the
    lease that covers `path` began (GCS's own time, the lock record's first write); {} elsewhere."""
    for lock in _HELD:
        if lock["began"] is not None and path.startswith(lock["folder"].rstrip("/") + "/"):
            return {LEASE_METADATA: lock["began"]}
    return {}


def stale_commits(folder: str) -> Dict[str, str]:
    """The objects of a gs:// folder that a holder committed after its lease was taken over, each
    with why: committed (its `updated`) after a later lease began, one that another object in the
    folder carries or the one this process holds. GCS has no precondition on another object, so a
    holder that stalled past its lease between its fencing check and its commit (lock.fenced) can
    still commit once; its object is then told apart here, by GCS's times alone (no machine's clock).
    {} for a local folder: its commit happens under the flock."""
    if not folder.startswith("gs://"):
        return {}
    try:
        objects = gcs_filesystem().ls(folder, detail=True, refresh=True)
    except FileNotFoundError:  # nothing written there yet
        return {}
    leases = {(o.get("metadata") or {}).get(LEASE_METADATA) for o in objects} | set(
        lease_metadata(folder.rstrip("/") + "/").values()
    )
    began = sorted((gcs_time(lease), lease) for lease in leases - {None})
    stale = {}
    for o in objects:
        lease = (o.get("metadata") or {}).get(LEASE_METADATA)  # GCS may give null for none
        if lease is None or not o.get("updated"):
            continue
        own, committed = gcs_time(lease), gcs_time(o["updated"])
        later = [text for at, text in began if own < at < committed]
        if later:
            stale[f"gs://{o['name']}"] = (
                f"committed at {o['updated']} under the lease that began at {lease}, after another"
                f" process's lease began at {later[0]} (its holder stalled past its lease)"
            )
    return stale


def lease_lost(read: bool = False) -> bool:
    """Whether another process took over a run-folder lock of this process, as its renewals found;
    read: reading each lock now (lock_is_held: the fencing check before a checkpoint is written; a
    storage error counts as held, the write then fails or succeeds as storage does)."""
    for lock in _HELD if read else []:
        with contextlib.suppress(*storage_errors()):
            lock_is_held(lock)
    return any(lock["lost"].is_set() for lock in _HELD)


def stop_if_taken_over(lost: bool) -> None:
    """Stop this process with a ConfigError when `lost` (lease_lost of process 0, agreed by every
    process)."""
    if lost:
        raise ConfigError(
            next(
                (lost_message(lock) for lock in _HELD if lock["lost"].is_set()),
                "run folder: process 0's lock was taken over by another process; this process stops"
                " without writing to the run folder again.",
            )
        )


def lost_message(lock: dict) -> str:
    """Why a process stops writing: its lease was taken over."""
    return (
        f"run folder: the lock {lock['path']} no longer names this process: its lease ran out (not"
        f" renewed for {LEASE_SECONDS // 60} min: the process was suspended, or its storage"
        f" unreachable) and another process took {lock['folder']} over. This process stops without"
        " writing to it again."
    )


def release_lock(lock: dict) -> None:
    """Stop renewing and give the lock back: removed only while its record still names this
    holder."""
    lock["stop"].set()
    with contextlib.suppress(OSError, *storage_errors()):
        if lock["generation"] is not None:
            bucket, key = lock["path"][len("gs://") :].split("/", 1)
            gcs_filesystem().call(
                "DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=lock["generation"]
            )
            gcs_filesystem().invalidate_cache(lock["path"])
            return
        with _flocked(lock["path"]) as (content, _):
            if _token(content) == lock["holder"]["token"]:
                os.remove(lock["path"])


def _token(content: bytes) -> Optional[str]:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return json.loads(content).get("token")
    return None


@contextlib.contextmanager
def _flocked(path: str):
    """(content, time last written) of a local lock file, held under an exclusive flock while the
    block runs (created empty if absent); changes inside it replace the file by rename. The flock is
    on the file that is at `path` now: a process that waited for it while another one replaced or
    removed the file tries again on the new one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _OPEN_GUARDS.add(fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if not (e.errno in NO_FLOCK_ERRNOS and lease_only()):
                    raise
                _warn_lease_only(path, e)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:  # removed while this process waited
            pass
        except BaseException:
            _close(fd)
            raise
        _close(fd)
    try:
        with open(fd, "rb", closefd=False) as f:
            yield f.read(), os.fstat(fd).st_mtime
    finally:
        _close(fd)


def lease_only() -> bool:
    """Whether the environment asks for a lease-only lock (OCTJEPA_LOCK=lease): for a filesystem
    without flock."""
    return os.environ.get(LOCK_MODE_ENV, "").strip().lower() == "lease"


_WARNED: set = set()


def _warn_lease_only(path: str, error: OSError) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        print(
            f"WARNING: run folder: {path} is on a filesystem without file locks ({error!r});"
            f" {LOCK_MODE_ENV}=lease: a lease-only lock, which two processes starting within a"
            " second of each other could both take: start one at a time.",
            file=sys.stderr,
            flush=True,
        )


def _close(fd: int) -> None:
    _OPEN_GUARDS.discard(fd)
    os.close(fd)


def _close_guards_in_child() -> None:
    # A DataLoader worker forked while a renewal held an flock would hold it for the worker's life.
    for fd in list(_OPEN_GUARDS):
        _close(fd)


os.register_at_fork(after_in_child=_close_guards_in_child)


def _replace(path: str, holder: dict) -> None:
    tmp = f"{path}.{holder['token']}"
    try:
        with open(tmp, "w") as f:
            json.dump(holder, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no tmp file left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _read_lease(path: str) -> Tuple[bytes, str, float]:
    """(content, generation, time last written) of a gs:// lock record; (b'', '0', 0) when there is
    none. The generation is read first: a record changed after it is refused by the precondition of
    the write that follows."""
    fs = gcs_filesystem()
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
        content = fs.cat_file(path)
    except FileNotFoundError:
        return b"", "0", 0.0
    updated = info.get("updated") or info.get("mtime")
    return (
        content,
        str(info.get("generation") or "0"),
        gcs_time(updated) if updated else time.time(),
    )


def gcs_time(stamp) -> float:
    """A GCS time (RFC 3339 text, as `updated`, or a datetime) in seconds since the epoch."""
    if isinstance(stamp, datetime.datetime):
        return stamp.timestamp()
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _write_lease(path: str, holder: dict, generation: str) -> str:
    """Write a gs:// lock record only if its generation is still `generation` ('0': only if absent);
    its new generation. FileExistsError (GCS's 412) when it is not."""
    return str(_write_lease_record(path, holder, generation)["generation"])


def _write_lease_record(path: str, holder: dict, generation: str) -> dict:
    """_write_lease's write; the object GCS answers with (its generation, updated...)."""
    fs = gcs_filesystem()
    bucket, key = path[len("gs://") :].split("/", 1)
    written = fs.call(
        "POST",
        f"{fs._location}/upload/storage/v1/b/{bucket}/o",
        uploadType="media",
        name=key,
        ifGenerationMatch=str(generation),
        data=json.dumps(holder).encode(),
        json_out=True,
        headers={"Content-Type": "application/octet-stream"},
    )
    fs.invalidate_cache(path)
    return written
