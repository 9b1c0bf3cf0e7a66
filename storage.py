"""Files on local disk or in Google Cloud Storage (gs://), for everything that reads or writes them: checkpoints,
logs, indexes, caches and the DICOM reader. Low on purpose: it imports neither torch nor the reader, so writing a
checkpoint or a log line loads no DICOM code.

gs:// goes through gcsfs, one filesystem per process, created on first use and never pickled (DataLoader workers
and pool processes make their own: incident 11). STORAGE_EMULATOR_HOST (e.g. http://127.0.0.1:9023) points it at
a local emulator (tests/conftest.py starts one).
"""
import glob
import os
import secrets
import socket
from typing import List

# Before any gcsfs import: otherwise every gcsfs call waits 60 s on an experimental gRPC check.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_GCS = {}  # (process id, emulator) -> GCSFileSystem: created lazily in each process, never pickled (incident 11)


def gcs_filesystem():
    """This process's gcsfs filesystem; STORAGE_EMULATOR_HOST (e.g. http://127.0.0.1:9023) points it at an emulator."""
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


def write_atomic(path: str, payload) -> None:
    """Write bytes (or a buffer) to a local file or a gs:// object so that readers see the old state or the whole new
    file, never a part. gs://: one upload (an object appears only once complete). Local: into a tmp name unique to
    this host, process and call (a shared NFS folder), fsynced, then renamed; a failed write (a full disk) removes
    the tmp file and raises."""
    if path.startswith("gs://"):
        gcs_filesystem().pipe_file(path, bytes(payload))
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
