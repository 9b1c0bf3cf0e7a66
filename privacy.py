"""Patient data: the keyed patient key, and what outputs that leave the machine may carry (docs/privacy.md).

A patient key is HMAC-SHA256 of the DICOM PatientID (else of the file's path: the file is then its own patient) under
a secret of this site: 32 random bytes in a key file created once, readable by its owner only, outside every output
(OCTJEPA_PATIENT_KEY_FILE, else ~/.config/octjepa/site.key). Without the secret a key neither reverses (no dictionary
of MRNs finds it) nor links with another site's keys; two sites that mean to link their tables use the same key
file (copy it, as one copies a password). The secret is never logged nor written anywhere else.
"""
import hashlib
import hmac
import os
import secrets
from typing import Dict, Optional

from config import PATH_FIELDS, ConfigError

KEY_FILE_ENV = "OCTJEPA_PATIENT_KEY_FILE"
KEY_PREFIX = "pk1-"  # a keyed patient key; older indexes hold a bare sha256 of PatientID or "file:<path>"
_SECRETS: Dict[str, bytes] = {}  # key file -> its secret, read once per process


def patient_key_file() -> str:
    """Where this site's patient-key secret lives: $OCTJEPA_PATIENT_KEY_FILE, else ~/.config/octjepa/site.key."""
    return os.path.abspath(os.path.expanduser(os.environ.get(KEY_FILE_ENV) or "~/.config/octjepa/site.key"))


def site_secret() -> bytes:
    """This site's secret, from its key file; created (owner-only) the first time, whole or not at all, so that
    processes starting together agree on one secret."""
    path = patient_key_file()
    if path not in _SECRETS:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # fails when another process created it first: theirs is kept
            except FileExistsError:
                pass
            finally:
                os.remove(tmp)
        with open(path) as f:
            secret = f.read().strip()
        if len(secret) < 32:
            raise ConfigError(f"{KEY_FILE_ENV}: {path} holds no patient-key secret (at least 32 characters); delete it "
                             f"to create a new one (the keys of existing indexes then change: scan them again).")
        _SECRETS[path] = secret.encode()
    return _SECRETS[path]


def patient_key(patient_id: str, path: str) -> str:
    """The keyed patient key of a file: of its PatientID, else of its path (the file is then its own patient)."""
    unit = f"PatientID\0{patient_id}" if patient_id else f"file\0{path}"
    return KEY_PREFIX + hmac.new(site_secret(), unit.encode(), hashlib.sha256).hexdigest()[:24]


def is_keyed(key) -> bool:
    """Whether a patient key was made with a site secret (not an older, reversible one)."""
    return isinstance(key, str) and key.startswith(KEY_PREFIX)


def volume_key(path: str, root: Optional[str] = None) -> str:
    """The keyed id of a volume in outputs that leave the machine, in place of its path (whose folders may name the
    patient): HMAC of the path below `root` (the data_root or the labels CSV's folder: moving the data keeps it).
    This site recomputes it from a path to find the row; nobody without the secret can."""
    if root and path.startswith(root.rstrip("/") + "/"):
        path = path[len(root.rstrip("/")) + 1:]
    return "vk1-" + hmac.new(site_secret(), f"volume\0{path}".encode(), hashlib.sha256).hexdigest()[:24]


def share_safe_config(config: dict) -> dict:
    """A run's config (Config as a dict) for outputs that leave the machine: without the fields that name files,
    folders or URLs (config.PATH_FIELDS: data, labels, cache, checkpoint and run locations)."""
    return {k: v for k, v in config.items() if k not in PATH_FIELDS}


def share_safe_source(source: dict) -> dict:
    """An export's `source` (where its weights came from) for outputs that leave the machine: file names without
    their folders, training configs without paths (share_safe_config), nested sources likewise."""
    safe = {}
    for k, v in source.items():
        if isinstance(v, dict):
            safe[k] = share_safe_config(v) if k == "training_config" else share_safe_source(v)
        elif isinstance(v, str) and ("/" in v or os.sep in v):
            safe[k] = os.path.basename(v.rstrip("/"))
        else:
            safe[k] = v
    return safe
