"""Checkpoint files on local disk or gs://: atomic writes, listing, reading with retries, keep-last rotation.

train.py writes and resumes through these; probe.py and bench.py read checkpoints without importing the loop.
"""
import glob
import io
import os
import re
import time
from typing import List, Optional, Tuple

import torch

from data import gcs_filesystem, read_bytes


def _fs(path: str):
    """(filesystem, path) for a local path or a gs:// URL."""
    if path.startswith("gs://"):
        return gcs_filesystem(), path
    return None, path


def write_bytes_atomic(path: str, payload: bytes) -> None:
    """Write a file so that readers see either the old state or the complete new file, never a part."""
    fs, path = _fs(path)
    if fs is not None:
        fs.pipe_file(path, payload)  # a GCS object appears only once its upload is complete
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(ckpt_dir: str) -> List[str]:
    """Step checkpoints in ckpt_dir, newest first (temp files of interrupted writes are ignored)."""
    fs, root = _fs(ckpt_dir)
    pattern = root.rstrip("/") + "/step_*.pt"
    paths = ["gs://" + p for p in fs.glob(pattern)] if fs is not None else glob.glob(pattern)
    paths = [p for p in paths if re.search(r"step_\d+\.pt$", p)]
    return sorted(paths, key=lambda p: int(re.search(r"step_(\d+)\.pt$", p).group(1)), reverse=True)


def read_checkpoint(path: str, tries: int = 1) -> dict:
    """Load a checkpoint (local or gs://) to CPU tensors (weights_only: no code runs on load); a failed read (a
    transient storage error) is tried up to `tries` times in all."""
    for attempt in range(tries):
        try:
            payload = read_bytes(path)
            break
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(2 ** attempt)
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def newest_readable_checkpoint(ckpt_dir: str) -> Tuple[Optional[str], Optional[dict], List[Tuple[str, str]]]:
    """(path, checkpoint) of the newest step checkpoint that loads, or (None, None); plus (path, error) of each
    newer one that did not (a damaged file must not stop a resume: it falls back to the one before)."""
    unreadable = []
    for path in list_checkpoints(ckpt_dir):
        try:
            return path, read_checkpoint(path, tries=2), unreadable
        except Exception as e:
            unreadable.append((path, repr(e)))
    return None, None, unreadable


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return f"{ckpt_dir.rstrip('/')}/step_{step:07d}.pt"


def save_checkpoint(path: str, state: dict, keep_last: int, best: bool) -> None:
    """Write the checkpoint atomically (and best.pt beside it), then drop older step files beyond keep_last."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    ckpt_dir = path.rsplit("/", 1)[0]
    fs, root = _fs(ckpt_dir)
    if fs is None:
        os.makedirs(root, exist_ok=True)
    write_bytes_atomic(path, payload)
    if best:
        write_bytes_atomic(f"{ckpt_dir}/best.pt", payload)
    for old in list_checkpoints(ckpt_dir)[keep_last:]:
        if fs is not None:
            fs.rm(old)
        else:
            os.remove(old)
