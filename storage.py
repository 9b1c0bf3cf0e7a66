"""Files on local disk or in Google Cloud Storage (gs://), for everything that reads or writes them:
checkpoints, logs, indexes, caches and the DICOM reader. Writes are atomic and streamed
(open_atomic); a storage error that may pass by itself (a network or server error, a full disk) can
be retried with backoff (retry). Low on purpose: it imports neither torch nor the reader, so writing
a checkpoint or a log line loads no DICOM code.

gs:// goes through gcsfs, one filesystem per process, created on first use and never pickled
(DataLoader workers and pool processes make their own: incident 11). STORAGE_EMULATOR_HOST (e.g.
http://127.0.0.1:9023) points it at a local emulator (tests/conftest.py starts one).
"""

import contextlib
import errno
import glob
import os
import secrets
import shutil
import socket
import sys
import time
from typing import Callable, List, Optional

# Before any gcsfs import: otherwise every gcsfs call waits 60 s on an experimental gRPC check.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

TMP_INFIX = ".tmp-"  # open_atomic's tmp files: path + TMP_INFIX + host-pid-random
# (process id, emulator) -> GCSFileSystem: created lazily in each process, never pickled (incident
# 11)
_GCS = {}


class Fenced(Exception):
    """A write refused at its commit: this process no longer holds the folder it writes to
    (lock.fenced: its lease was taken over), or, on gs://, the object was replaced since the write
    began. Not a storage error: never retried."""


def gcs_filesystem():
    """This process's gcsfs filesystem; STORAGE_EMULATOR_HOST (e.g. http://127.0.0.1:9023) points it
    at an emulator."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    key = (os.getpid(), emulator)
    if key not in _GCS:
        import gcsfs

        if emulator:
            endpoint = emulator if "://" in emulator else f"http://{emulator}"
            _GCS[key] = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")
        else:
            _GCS[key] = gcsfs.GCSFileSystem()
    return _GCS[key]


def exists(path: str) -> bool:
    """Whether a local path or a gs:// object exists."""
    return gcs_filesystem().exists(path) if path.startswith("gs://") else os.path.exists(path)


@contextlib.contextmanager
def open_atomic(path: str, fence: Optional[Callable] = None, metadata: Optional[dict] = None):
    """A binary file to write `path` through (local or gs://), streamed: readers see the old state
    or the whole new file, never a part, and nothing is held in memory beyond a buffer. Local: a tmp
    file beside it, named for this host, process and call (a shared NFS folder), fsynced, then
    renamed. gs://: a resumable upload, whose object appears only when it completes. With `fence` (a
    context manager factory, lock.fenced: it raises Fenced when this process no longer holds the
    folder) the last step, the rename or (gs://: the upload goes to a tmp object) a server-side copy
    with a precondition on the object's generation when the write began, runs inside it: a process
    stalled past its lease never replaces what the folder's new holder wrote. gs:// objects carry
    `metadata` (custom metadata: lock.lease_metadata), which the copy keeps. On an exception (a full
    disk, a kill's KeyboardInterrupt, Fenced) the tmp file or the upload is discarded and the
    exception raised."""
    tmp = f"{path}{TMP_INFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    if path.startswith("gs://"):
        generation = _generation(path) if fence is not None else None
        f = gcs_filesystem().open(tmp if fence is not None else path, "wb", metadata=metadata)
        try:
            yield _InBlocks(f)
            f.close()
        except BaseException:
            with contextlib.suppress(Exception):  # the storage may be what failed
                f.discard()  # cancels the upload session, if one was started
            # else fsspec's __del__ would close, i.e. upload the part written so far
            f.closed = True
            raise
        if fence is not None:
            try:
                with fence():
                    _rewrite(tmp, path, generation)
            finally:
                with contextlib.suppress(Exception):
                    gcs_filesystem().rm(tmp)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with fence() if fence is not None else contextlib.nullcontext():
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _generation(path: str) -> str:
    """A gs:// object's generation now ('0': there is none)."""
    fs = gcs_filesystem()
    fs.invalidate_cache(path)
    try:
        return str(fs.info(path).get("generation") or "0")
    except FileNotFoundError:
        return "0"


def _rewrite(source: str, destination: str, generation: str) -> None:
    """Server-side copy of a gs:// object, only while the destination's generation is still
    `generation` ('0': only while absent); Fenced (GCS's 412) when another writer replaced it
    since."""
    fs = gcs_filesystem()
    (b1, k1), (b2, k2) = (p[len("gs://") :].split("/", 1) for p in (source, destination))
    token = None
    try:
        while True:
            out = fs.call(
                "POST",
                "b/{}/o/{}/rewriteTo/b/{}/o/{}",
                b1,
                k1,
                b2,
                k2,
                json_out=True,
                headers={"Content-Type": "application/json"},
                ifGenerationMatch=generation,
                rewriteToken=token,
            )
            if out.get("done", True) is True:
                break
            token = out["rewriteToken"]
    except FileExistsError:  # 412
        raise Fenced(
            f"{destination} was replaced by another writer since this write began: not overwritten"
        ) from None
    finally:
        fs.invalidate_cache(destination)


class _InBlocks:
    """A gcsfs file written in pieces of its block size, so that it uploads as it goes: fsspec would
    buffer one large write (a tensor of a checkpoint) whole, and copy it again to send it."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.f.blocksize):
            self.f.write(view[start : start + self.f.blocksize])
        return len(view)

    def flush(self) -> None:
        self.f.flush()  # uploads a whole block if one is buffered; the rest goes at the end


def write_atomic(path: str, payload) -> None:
    """Write bytes (or a buffer) to a local file or a gs:// object, atomically (open_atomic)."""
    with open_atomic(path) as f:
        f.write(payload)


def copy_atomic(source: str, destination: str, fence: Optional[Callable] = None) -> None:
    """Copy a file or object to another path on the same storage, atomically (gs://: a server-side
    copy); with `fence`, committed inside it (open_atomic)."""
    if source.startswith("gs://"):
        if fence is None:
            gcs_filesystem().copy(source, destination)
            return
        generation = _generation(destination)
        with fence():
            _rewrite(source, destination, generation)
        return
    with open(source, "rb") as src, open_atomic(destination, fence) as dst:
        shutil.copyfileobj(src, dst, 2**24)


def rename(source: str, destination: str) -> None:
    """Rename a file (gs://: copy and delete the object)."""
    if source.startswith("gs://"):
        gcs_filesystem().mv(source, destination)
    else:
        os.replace(source, destination)


def remove_stale_tmp(folder: str) -> List[str]:
    """Delete the tmp files that writers killed mid-write left in a local folder (open_atomic's;
    gs:// uploads leave none); returns their paths. Only for a folder no one else is writing to now
    (the run folder's lock); even so, the tmp file of a process still running on this host is left
    alone."""
    if folder.startswith("gs://"):
        return []
    stale = []
    for path in glob.glob(os.path.join(glob.escape(folder), f"*{TMP_INFIX}*")):
        host, pid, _ = path.rsplit(TMP_INFIX, 1)[1].rsplit("-", 2)
        if not (pid.isdigit() and process_is_running(host, int(pid))):
            os.remove(path)
            stale.append(path)
    return stale


def process_is_running(host: str, pid: int) -> bool:
    """Whether process `pid` runs on `host`: on another host, assumed so (nothing here can tell)."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def storage_errors() -> tuple:
    """The exception types a failing storage raises: OSError (disk, permissions, timeouts,
    connection errors) and, once gs:// was used, gcsfs's HTTP and aiohttp's client errors."""
    types = (OSError,)
    if "gcsfs" in sys.modules:
        import aiohttp
        from gcsfs.retry import HttpError

        types += (HttpError, aiohttp.ClientError)
    return types


PERMANENT_STORAGE_ERRORS = (
    PermissionError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
)


def is_transient(error: BaseException) -> bool:
    """Whether a storage error may pass by itself (a network or server error, a timeout, a full
    disk), so that trying again makes sense; a wrong path, missing permissions, a read-only
    filesystem or an invalid argument (a seek outside a file) do not pass."""
    if isinstance(error, PERMANENT_STORAGE_ERRORS) or getattr(error, "errno", None) in (
        errno.EROFS,
        errno.EINVAL,
    ):
        return False
    if isinstance(error, OSError):
        return True
    if "gcsfs" in sys.modules:
        from gcsfs.retry import is_retriable

        return is_retriable(error)
    return False


def retry(
    fn: Callable,
    *args,
    seconds: float,
    on_error: Optional[Callable[[Exception, float], None]] = None,
):
    """fn(*args), tried again after 1, 2, 4... (at most 60) s while it raises a transient storage
    error (is_transient) and `seconds` have not passed; on_error(error, pause) is told before each
    pause. The last error, and any other, is raised."""
    deadline, pause = time.monotonic() + seconds, 1.0
    while True:
        try:
            return fn(*args)
        except storage_errors() as e:
            if not is_transient(e) or time.monotonic() + pause > deadline:
                raise
            if on_error is not None:
                on_error(e, pause)
        time.sleep(pause)
        pause = min(2 * pause, 60.0)


def read_bytes(path: str) -> bytes:
    """The whole content of a local file or a gs:// object."""
    if path.startswith("gs://"):
        return gcs_filesystem().cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def glob_paths(pattern: str) -> List[str]:
    """The local files or gs:// objects (as gs:// URLs) that a glob pattern matches."""
    if pattern.startswith("gs://"):
        return ["gs://" + p for p in gcs_filesystem().glob(pattern)]
    return glob.glob(pattern)


def remove(path: str) -> None:
    """Delete a local file or a gs:// object."""
    if path.startswith("gs://"):
        gcs_filesystem().rm(path)
    else:
        os.remove(path)
