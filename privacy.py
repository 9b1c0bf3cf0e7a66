"""Patient data: the keyed patient key, and what outputs that leave the machine may carry
(docs/privacy.md).

A patient key is HMAC-SHA256 of the DICOM PatientID (else of the file's path: the file is then its
own patient) under a secret of this site: 32 random bytes in a key file created once, readable by
its owner only, outside every output (OCTJEPA_PATIENT_KEY_FILE, an absolute path, else
~/.config/octjepa/site.key). Without the secret a key neither reverses (no dictionary of MRNs finds
it) nor links with another site's keys; two sites that mean to link their tables use the same key
file (copy it, as one copies a password). The secret is never logged nor written anywhere else; an
index, a checkpoint, an embed table and a fine-tuning's results record which secret made their keys
as a keyed fingerprint (key_fingerprint), so that one made with another secret is refused, naming
the key file; what joins keys of several sources checks they share one (check_same_key,
check_recorded_key).
"""

import hashlib
import hmac
import os
import secrets
import stat
import sys
from typing import Dict, Optional

from config import PATH_FIELDS, ConfigError

KEY_FILE_ENV = "OCTJEPA_PATIENT_KEY_FILE"
DEFAULT_KEY_FILE = "~/.config/octjepa/site.key"
# a keyed patient key; older indexes hold a bare sha256 of PatientID or "file:<path>"
KEY_PREFIX = "pk1-"
# in a key file: someone's template, not a secret
PLACEHOLDER_WORDS = (
    b"changeme",
    b"change-me",
    b"change_me",
    b"password",
    b"placeholder",
    b"example",
    b"xxxxxxxx",
    b"replace",
)
_SECRETS: Dict[str, bytes] = {}  # key file -> its secret, read once per process


def patient_key_file() -> str:
    """Where this site's patient-key secret lives: $OCTJEPA_PATIENT_KEY_FILE, else
    ~/.config/octjepa/site.key. A relative path is a ConfigError: the key file, and with it every
    key and split, would follow the folder a command is started in."""
    given = os.environ.get(KEY_FILE_ENV, DEFAULT_KEY_FILE)
    if not given.strip():
        raise ConfigError(
            f"{KEY_FILE_ENV} is set but empty, so it names no key file; give the absolute path of"
            f" this site's key file (export {KEY_FILE_ENV}=/secure/place/site.key), or unset it for"
            f" the default {DEFAULT_KEY_FILE} (unset {KEY_FILE_ENV})."
        )
    path = os.path.expanduser(given)
    if not os.path.isabs(path):
        raise ConfigError(
            f"{KEY_FILE_ENV}: {given!r} is a relative path, so the key file would depend on the"
            " folder a command starts in (and could land inside a git clone); give an absolute"
            f" path, e.g. {os.path.abspath(path)}."
        )
    return path


def site_secret(create: bool = False) -> bytes:
    """This site's secret, read once per process from its key file (patient_key_file). create: a
    missing key file is made first (32 random bytes, owner-only, whole or not at all so that
    processes starting together agree), said on stderr with its path; only a command that reads a
    data source without an index that names its secret creates one (index.scan_files, a labels CSV).
    A key file this user cannot use is a ConfigError naming it and the fix."""
    path = patient_key_file()
    if path not in _SECRETS:
        if create and not os.path.lexists(path):
            _create_key_file(path)
        _SECRETS[path] = _read_key_file(path)
    return _SECRETS[path]


def _create_key_file(path: str) -> None:
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(
            f"{KEY_FILE_ENV}: cannot create the key file {path} ({e.strerror or e}). Make its"
            f" folder {os.path.dirname(path)} writable by this user (mkdir -p -m 700"
            f" {os.path.dirname(path)}), or point {KEY_FILE_ENV} at a writable place (export"
            f" {KEY_FILE_ENV}=/secure/place/site.key); if this site has a key file, point it there."
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # fails when another process created it first: theirs is kept
        print(
            f"{KEY_FILE_ENV}: created this site's patient-key secret {path} (readable by its owner"
            " only). Keep it: every patient key, train/val split and keyed id follows it, and a"
            " new one changes them all (docs/privacy.md).",
            file=sys.stderr,
        )
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)


def _read_key_file(path: str) -> bytes:
    """The secret in a key file; a ConfigError for one this user cannot use: missing, a dangling
    link, a folder, readable or writable by others than its owner (refused, as ssh refuses such a
    private key), unreadable by this user, empty or too short."""
    where = f"{KEY_FILE_ENV}: {path}"
    if not os.path.exists(path):
        if os.path.islink(path):
            raise ConfigError(
                f"{where} is a link to {os.readlink(path)}, which does not exist; restore this"
                f" site's key file there, or point {KEY_FILE_ENV} at it."
            )
        raise ConfigError(
            f"{where} does not exist. If this site has a key file (another HOME or container, a"
            f" typo in {KEY_FILE_ENV}), point {KEY_FILE_ENV} at it: a new secret gives every"
            " patient another key. A scan of a data source without an index creates it (`python"
            " data.py scan DATA_ROOT`)."
        )
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise ConfigError(
            f"{where} is a folder, not a key file; point {KEY_FILE_ENV} at the file itself."
        )
    if mode & 0o077:
        raise ConfigError(
            f"{where} can be read or written by others than its owner (mode"
            f" {stat.S_IMODE(mode):o}): anyone who reads it can link the keys back to patients. Run"
            f" chmod 600 {path}."
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(
            f"{where} cannot be read by this user (uid {os.getuid()}; {e}); run as its owner, or"
            " give this user a copy of it (chmod 600)."
        ) from None
    try:
        secret = raw.decode().strip().encode()  # octjepa writes 64 hex characters and a newline
    except UnicodeDecodeError:
        secret = raw  # random bytes (head -c 32 /dev/urandom): the secret as they are
    if len(secret) < 32:
        raise ConfigError(
            f"{where} holds no patient-key secret (at least 32 characters; it holds {len(secret)})."
            " Restore this site's key file there; or delete it, and a scan creates a new one (then"
            " every key changes: scan every index again, start new runs)."
        )
    if len(set(secret)) < 8 or any(word in secret.lower() for word in PLACEHOLDER_WORDS):
        raise ConfigError(
            f"{where} holds a placeholder, not a secret (a known word such as 'changeme', or fewer"
            " than 8 different characters): whoever guesses it can link the keys back to patients."
            f" Restore this site's key file there; or delete it (rm {path}), and a scan creates a"
            " random one (then every key changes: scan every index again, start new runs)."
        )
    return secret


def key_fingerprint() -> str:
    """Which secret makes this site's keys, for an index or a checkpoint to record: a keyed hash of
    a fixed text under the secret (the same secret gives the same fingerprint anywhere), never the
    secret."""
    return (
        "kf1-"
        + hmac.new(site_secret(), b"octjepa-index-fingerprint", hashlib.sha256).hexdigest()[:16]
    )


def check_index_key(built_from: Optional[dict], index_path: str) -> None:
    """That the key file holds the secret an index was made with (its built_from's key_fingerprint):
    else a ConfigError naming the key file, since a scan that kept some records and keyed the new
    ones with another secret would give one patient two keys (and put them on both sides of the
    train/val split). An index that records no secret (an older octjepa's) may create the key file
    (its records are then all scanned again: index.py)."""
    recorded = (built_from or {}).get("key_fingerprint")
    if recorded is None:
        site_secret(create=True)
        return
    try:
        now = key_fingerprint()
    except ConfigError as e:
        raise ConfigError(
            f"index_path: {index_path} was made with the patient-key secret {recorded}, and {e}"
        ) from None
    if now != recorded:
        raise ConfigError(
            f"index_path: {index_path} was made with another patient-key secret ({recorded}) than"
            f" the key file {patient_key_file()} holds ({now}). Keys of both would give one patient"
            f" two keys. Point {KEY_FILE_ENV} at the key file that made the index; or, to key the"
            " whole index with this one on purpose, scan it again: `python data.py scan DATA_ROOT"
            f" --out {index_path}` (every key and split changes: start new runs, embed again)."
        )


def table_key_fingerprint(table: dict) -> Optional[str]:
    """The key_fingerprint a table (an embed .npz's arrays, a report) records, or None for one made
    before tables recorded it."""
    recorded = table.get("key_fingerprint")
    return None if recorded is None else str(recorded)


def check_same_key(fingerprints: Dict[str, Optional[str]], fix: str) -> str:
    """That patient keys meeting from several sources ({source: the key_fingerprint it records}:
    embed tables to join, a resumed fine-tuning's finished folds and this run) were made with one
    secret; returns it. Else a ConfigError naming each source's fingerprint, the key file and `fix`
    (the command that makes them agree): keys of two secrets never join, so a merge would split
    every patient in two (and put them on both sides of a split)."""
    unknown = [source for source, fingerprint in fingerprints.items() if fingerprint is None]
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)} records no patient-key fingerprint (made before octjepa recorded"
            f" one), so nothing shows that its patient keys join the others'. To fix: {fix}."
        )
    if len(set(fingerprints.values())) > 1:
        listed = "; ".join(
            f"{source}: {fingerprint}" for source, fingerprint in fingerprints.items()
        )
        raise ConfigError(
            f"patient keys of different secrets ({listed}) never join: merged, every patient would"
            f" be two patients. The key file {patient_key_file()} makes {_fingerprint_or_none()}."
            f" To fix: {fix}."
        )
    return next(iter(fingerprints.values()))


def check_recorded_key(recorded: Optional[str], source: str, fix: str) -> None:
    """That this site's key file exists and holds the secret whose fingerprint `source` recorded (a
    resumed run's finished results): never creates a key file. A ConfigError naming the source, the
    key file and `fix` otherwise (check_same_key)."""
    try:
        now = key_fingerprint()
    except ConfigError as e:
        raise ConfigError(
            f"{source}: made with the patient-key secret"
            f" {recorded or '(not recorded: an older octjepa)'}; {e} To continue, {fix}."
        ) from None
    check_same_key({source: recorded, f"the key file {patient_key_file()}": now}, fix)


def _fingerprint_or_none() -> str:
    try:
        return key_fingerprint()
    except ConfigError:
        return "no fingerprint (it cannot be used now)"


def keyed_id(kind: str, text: str) -> str:
    """A keyed id of `text` (HMAC under the site secret): stands for a path or a list of files in a
    file that may leave the machine; this site recomputes it, nobody without the secret can."""
    return (
        "id1-"
        + hmac.new(site_secret(), f"{kind}\0{text}".encode(), hashlib.sha256).hexdigest()[:24]
    )


def patient_key(patient_id: str, path: str) -> str:
    """The keyed patient key of a file: of its PatientID, else of its path (the file is then its own
    patient)."""
    unit = f"PatientID\0{patient_id}" if patient_id else f"file\0{path}"
    return KEY_PREFIX + hmac.new(site_secret(), unit.encode(), hashlib.sha256).hexdigest()[:24]


def is_keyed(key) -> bool:
    """Whether a patient key was made with a site secret (not an older, reversible one)."""
    return isinstance(key, str) and key.startswith(KEY_PREFIX)


def volume_key(path: str, root: Optional[str] = None) -> str:
    """The keyed id of a volume in outputs that leave the machine, in place of its path (whose
    folders may name the patient): HMAC of the path below `root` (the data_root or the labels CSV's
    folder: moving the data keeps it). This site recomputes it from a path to find the row; nobody
    without the secret can."""
    if root and path.startswith(root.rstrip("/") + "/"):
        path = path[len(root.rstrip("/")) + 1 :]
    return (
        "vk1-"
        + hmac.new(site_secret(), f"volume\0{path}".encode(), hashlib.sha256).hexdigest()[:24]
    )


def share_safe_config(config: dict) -> dict:
    """A run's config (Config as a dict) for outputs that leave the machine: without the fields that
    name files, folders or URLs (config.PATH_FIELDS: data, labels, cache, checkpoint and run
    locations)."""
    return {k: v for k, v in config.items() if k not in PATH_FIELDS}


def share_safe_source(source: dict) -> dict:
    """An export's `source` (where its weights came from) for outputs that leave the machine: file
    names without their folders, training configs without paths (share_safe_config), nested sources
    likewise."""
    safe = {}
    for k, v in source.items():
        if isinstance(v, dict):
            safe[k] = share_safe_config(v) if k == "training_config" else share_safe_source(v)
        elif isinstance(v, str) and ("/" in v or os.sep in v):
            safe[k] = os.path.basename(v.rstrip("/"))
        else:
            safe[k] = v
    return safe
