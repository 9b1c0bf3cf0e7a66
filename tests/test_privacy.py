"""Nothing leaked: patient keys that neither reverse nor link across sites, and outputs that carry
no identifier. The fixture is clinic-like: phantoms rewritten with 7-digit MRNs as PatientID, names
and birth dates, in folders named LAST_FIRST_MRN (real DICOM files, real processes)."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest

import data
import encoder
import finetune
from config import ConfigError, load_config
from helpers import REPO
from index import list_sources, read_index, scan_files


def clinic_copy(phantom_dir, out):
    """The phantom set rewritten as a clinic's: each patient gets a 7-digit MRN, a name and a birth
    date, and their files move into a folder LAST_FIRST_MRN (labels.csv follows). Returns (folder,
    identifiers written)."""
    out = Path(out)
    identifiers, patients = set(), {}
    for source in sorted(Path(phantom_dir).rglob("*.dcm")):
        ds = pydicom.dcmread(source)
        mrn = patients.setdefault(ds.PatientID, f"{4817203 + 7919 * len(patients):07d}")
        last, first = f"Hoffmann{len(patients)}", "Annegret"
        ds.PatientID, ds.PatientName, ds.PatientBirthDate = mrn, f"{last}^{first}", "19560314"
        relative = source.relative_to(phantom_dir)
        target = out / f"{last.upper()}_{first.upper()}_{mrn}" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        ds.save_as(target)
        identifiers |= {
            mrn,
            last,
            f"{last.upper()}_{first.upper()}_{mrn}",
            "19560314",
            str(ds.StudyInstanceUID),
            str(ds.SeriesInstanceUID),
            str(ds.SOPInstanceUID),
        }
    return str(out), identifiers


def scan_keys(folder):
    """{path: patient key} of a real scan of a folder."""
    files = sorted(list_sources(folder, None))
    return {r["paths"][0]: r["patient"] for r in scan_files(files) if r["ok"]}


def test_patient_keys_neither_reverse_nor_link_across_sites_unless_they_share_the_key_file(
    tmp_path, phantom_dir, monkeypatch
):
    clinic, identifiers = clinic_copy(phantom_dir, tmp_path / "clinic")
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_a" / "site.key"))
    site_a = scan_keys(clinic)
    key_file = tmp_path / "site_a" / "site.key"
    # created once, readable by its owner only
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_b" / "site.key"))
    site_b = scan_keys(clinic)
    # two sites' tables do not join on the key
    assert set(site_a.values()).isdisjoint(site_b.values())
    mrns = {pydicom.dcmread(p).PatientID for p in site_a}
    # a dictionary of MRNs finds none
    dictionary = {hashlib.sha256(m.encode()).hexdigest()[:16] for m in mrns}
    assert not dictionary & set(site_a.values()) and not any(
        m in k for m in mrns for k in site_a.values()
    )
    assert len(set(site_a.values())) == len(mrns)  # one key per patient, as before
    # linking on purpose: the same secret at both sites
    shutil.copy(key_file, tmp_path / "site_b_linked.key")
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_b_linked.key"))
    assert scan_keys(clinic) == site_a
    secret = key_file.read_text().strip()
    assert secret not in json.dumps(site_a)


def test_an_index_with_old_reversible_keys_is_migrated_with_its_data_and_refused_without(
    tmp_path, phantom_dir
):
    index_path = tmp_path / "index.jsonl"
    scan = subprocess.run(
        [sys.executable, str(REPO / "data.py"), "scan", phantom_dir, "--out", str(index_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert scan.returncode == 0, scan.stderr[-2000:]
    lines = [json.loads(line) for line in index_path.read_text().splitlines()]
    for record in lines[1:]:  # as an older octjepa wrote them: sha256(PatientID)[:16]
        if record["ok"]:
            record["patient"] = hashlib.sha256(
                pydicom.dcmread(record["paths"][0]).PatientID.encode()
            ).hexdigest()[:16]
    lines[0]["built_from"].pop("patient_keys")
    index_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(
        ConfigError, match="older octjepa wrote .* python data.py scan DATA_ROOT --out"
    ):
        data.index_records(load_config(["--index_path", str(index_path)]))
    migrated = data.index_records(
        load_config(["--index_path", str(index_path), "--data_root", phantom_dir])
    )
    assert all(r["patient"].startswith("pk1-") for r in migrated if r["ok"])
    assert read_index(str(index_path)) == migrated  # rewritten with keyed keys


def tool(script, *flags):
    """Run one of the repo's scripts as its own process; its completed process."""
    done = subprocess.run(
        [sys.executable, str(REPO / script), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert done.returncode == 0, f"{script} {flags}: {done.stderr[-3000:]}"
    return done


def texts_of(path):
    """What a file holds, as text: its bytes, and for an .npz every array's values too (it may be
    compressed)."""
    raw = path.read_bytes()
    texts = [raw.decode("latin-1")]
    if path.suffix == ".npz":
        import numpy as np

        with np.load(path) as z:
            texts += [" ".join(map(str, z[k].ravel().tolist())) for k in z.files]
    return "\n".join(texts)


@pytest.mark.slow
def test_nothing_that_leaves_the_machine_names_a_patient_a_study_or_a_source_path(
    tmp_path, smoke_phantoms
):
    clinic, identifiers = clinic_copy(smoke_phantoms, tmp_path / "clinic")
    identifiers |= {clinic, str(tmp_path), "HOFFMANN"}
    labels = Path(clinic) / "labels.csv"
    names = {
        p.name: p.relative_to(clinic)
        for p in Path(clinic).rglob("*")
        if p.parent.parent == Path(clinic)
    }
    rows = [
        line.split(",")
        for line in (Path(smoke_phantoms) / "labels.csv").read_text().splitlines()[1:]
    ]
    labels.write_text(
        "path,label\n"
        + "".join(
            f"{names[path]},{'none' if label == 'none' else 'lesion'}\n"
            for path, label in rows
            if path in names
        )
    )
    runs, share = tmp_path / "runs", tmp_path / "share"
    tool(
        "train.py",
        "--config",
        "configs/smoke.yaml",
        "--data_root",
        clinic,
        "--out_dir",
        str(runs),
        "--run_name",
        "r",
        "--max_steps",
        "4",
        "--wandb",
        "offline",
        "--phantom_dir",
        smoke_phantoms,
    )
    # The other scripts in this process: only train.py leaves its command line behind (in its W&B
    # record). the index stays on this machine
    assert data.main(["scan", clinic, "--out", str(tmp_path / "index.jsonl")]) == 0
    assert (
        encoder.main(
            ["export", "--ckpt", str(runs / "r" / "checkpoints"), "--out", str(share / "encoder")]
        )
        == 0
    )
    assert (
        encoder.main(
            [
                "embed",
                "--encoder",
                str(share / "encoder"),
                "--data_root",
                clinic,
                "--out",
                str(share / "embeddings.npz"),
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert (
        finetune.main(
            [
                "--encoder",
                str(share / "encoder"),
                "--labels",
                str(labels),
                "--out",
                str(share / "ft"),
                "--folds",
                "2",
                "--modes",
                "full",
                "--epochs",
                "1",
                "--batch_size",
                "4",
            ]
        )
        == 0
    )
    # W&B's own local logs
    synced = [p for p in (runs / "r" / "wandb").rglob("*") if not p.name.startswith("debug")]
    # (debug*.log) are never uploaded
    leaving = [p for p in [*share.rglob("*"), *synced] if p.is_file()]
    assert {p.name for p in leaving} >= {
        "config.json",
        "embeddings.npz",
        "fold.json",
        "report.json",
    }
    assert any(p.suffix == ".wandb" for p in leaving)  # the W&B run as it would be synced
    found = {
        str(p.relative_to(tmp_path)): sorted(i for i in identifiers if i in texts_of(p))
        for p in leaving
    }
    assert {p: i for p, i in found.items() if i} == {}


def scan_cli(folder, key_file, *flags, cwd=REPO, caps=()):
    """`python data.py scan FOLDER` as its own process with OCTJEPA_PATIENT_KEY_FILE=key_file (caps:
    setpriv's arguments that run it without some of root's capabilities)."""
    return subprocess.run(
        [*caps, sys.executable, str(REPO / "data.py"), "scan", str(folder), *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OCTJEPA_PATIENT_KEY_FILE": str(key_file)},
    )


def dry_run_cli(clinic, index_path, key_file):
    """`python train.py --dry_run` on a clinic folder through a reused index, as its own process.
    Every patient trains (val_fraction 0), so the split a new random secret draws cannot leave fewer
    volumes than a batch."""
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            "configs/smoke.yaml",
            "--data_root",
            str(clinic),
            "--index_path",
            str(index_path),
            "--dry_run",
            "--val_fraction",
            "0",
            "--global_batch_size",
            "2",
            "--out_dir",
            str(Path(index_path).parent / "runs"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OCTJEPA_PATIENT_KEY_FILE": str(key_file)},
    )


@pytest.mark.slow
def test_a_changed_key_secret_is_refused_by_a_reused_index_never_mixed_into_it(
    tmp_path, phantom_dir
):
    clinic, _ = clinic_copy(phantom_dir, tmp_path / "clinic")
    index_path, key_a, key_b = (
        tmp_path / "index.jsonl",
        tmp_path / "a" / "site.key",
        tmp_path / "b" / "site.key",
    )
    first = dry_run_cli(clinic, index_path, key_a)
    assert first.returncode == 0, first.stderr[-2000:]
    assert str(key_a) in first.stderr  # created on this first scan, and said so
    built_from = json.loads(index_path.read_text().splitlines()[0])["built_from"]
    assert (
        built_from["key_fingerprint"].startswith("kf1-")
        and key_a.read_text().strip() not in index_path.read_text()
    )
    before = index_path.read_bytes()
    new_patient = next(Path(clinic).iterdir())
    shutil.copytree(new_patient, Path(clinic) / "COPY_OF_A_PATIENT")  # new files for the next scan
    key_b.parent.mkdir()
    shutil.copy(key_a, key_b)
    # a new container, a new HOME, a typo
    key_b.write_text("another-site-secret-" + "0" * 44 + "\n")
    refused = dry_run_cli(clinic, index_path, key_b)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (
        f"the key file {key_b} holds" in refused.stderr
        and "another patient-key secret" in refused.stderr
    )
    assert index_path.read_bytes() == before  # neither half rekeyed nor touched
    # the key file gone: never made anew
    missing = dry_run_cli(clinic, index_path, tmp_path / "c" / "site.key")
    assert missing.returncode == 2 and "was made with the patient-key secret" in missing.stderr
    assert not (tmp_path / "c").exists()
    # the whole index keyed anew, on purpose
    rekeyed = scan_cli(clinic, key_b, "--out", str(index_path))
    assert rekeyed.returncode == 0, rekeyed.stderr[-2000:]
    old = {
        tuple(r["paths"]): r["patient"]
        for r in map(json.loads, before.decode().splitlines()[1:])
        if r["ok"]
    }
    new = {
        tuple(r["paths"]): r["patient"]
        for r in map(json.loads, index_path.read_text().splitlines()[1:])
        if r["ok"]
    }
    # every key anew, one secret: one key per patient, as before
    assert set(old.values()).isdisjoint(new.values())
    assert len(set(new.values())) == len(set(old.values()))


KEY_FILE_CASES = {  # how a key file this user cannot use looks -> what the message must say
    "empty": (lambda p: p.write_text(""), "holds no patient-key secret"),
    "too short": (lambda p: p.write_text("0123456789\n"), "holds no patient-key secret"),
    "a folder": (lambda p: p.mkdir(), "is a folder, not a key file"),
    "a dangling link": (lambda p: p.symlink_to(p.parent / "gone.key"), "which does not exist"),
    "readable by others": (lambda p: (p.write_text("s" * 64), p.chmod(0o644)), "chmod 600"),
    "a placeholder": (
        lambda p: p.write_text("changeme" * 4 + "\n"),
        "holds a placeholder, not a secret",
    ),
    # head -c 32 /dev/zero
    "one character": (lambda p: p.write_bytes(bytes(32)), "holds a placeholder, not a secret"),
}


@pytest.mark.parametrize("case", sorted(KEY_FILE_CASES))
def test_a_key_file_this_user_cannot_use_stops_the_scan_naming_it(case, tmp_path, phantom_dir):
    make, message = KEY_FILE_CASES[case]
    key_file = tmp_path / "keys" / "site.key"
    key_file.parent.mkdir()
    make(key_file)
    if key_file.is_file() and case != "readable by others":
        key_file.chmod(0o600)
    scan = scan_cli(phantom_dir, key_file)
    assert scan.returncode == 2, scan.stdout[-2000:] + scan.stderr[-2000:]
    assert (
        str(key_file) in scan.stderr and message in scan.stderr and "Traceback" not in scan.stderr
    )
    # no file blamed for the key
    assert "corrupt" not in scan.stdout and "bad_header" not in scan.stdout


def test_another_users_key_file_stops_the_scan_naming_it(tmp_path, phantom_dir):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip(
            "needs root and setpriv: root without its capability to read any file is 'another user'"
        )
    key_file = tmp_path / "site.key"
    key_file.write_text("s" * 64)
    key_file.chmod(0o600)
    os.chown(key_file, 65534, 65534)  # nobody's 0600 key file
    without_override = [
        "setpriv",
        "--inh-caps=-dac_override,-dac_read_search",
        "--bounding-set=-dac_override,-dac_read_search",
        "--",
    ]
    scan = scan_cli(phantom_dir, key_file, caps=without_override)
    assert scan.returncode == 2, scan.stdout[-2000:] + scan.stderr[-2000:]
    assert f"{key_file} cannot be read by this user" in scan.stderr and "corrupt" not in scan.stdout


def test_a_missing_key_file_is_created_on_a_first_scan_and_said_and_a_relative_path_is_refused(
    tmp_path, phantom_dir
):
    relative = scan_cli(phantom_dir, "site.key", cwd=tmp_path)
    assert relative.returncode == 2 and "'site.key' is a relative path" in relative.stderr
    # nothing created where the command happened to start
    assert not (tmp_path / "site.key").exists()
    key_file = tmp_path / "secure" / "site.key"
    first = scan_cli(phantom_dir, key_file)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"created this site's patient-key secret {key_file}" in first.stderr
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = scan_cli(phantom_dir, key_file)
    assert again.returncode == 0 and "created" not in again.stderr


def test_a_run_resumed_with_another_key_secret_is_refused_naming_the_key_file(
    tmp_path, smoke_phantoms, monkeypatch, capsys
):
    from train import main
    from helpers import smoke_flags

    # no stored index: one made with the old secret would be refused first
    # (privacy.check_index_key), not the checkpoint
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "3", "--index_path", "none")
    assert main(flags) == 0  # the tests' site key
    other = tmp_path / "other.key"
    other.write_text("another-site-secret-" + "1" * 44 + "\n")
    other.chmod(0o600)
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(other))
    capsys.readouterr()
    assert main([*flags, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "patient_keys: kf1-" in err and f"the key file {other} holds another secret" in err


def file_contents(folder):
    """{path: bytes} of every file below a folder."""
    return {p: p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def test_a_resume_in_a_fresh_home_is_refused_and_makes_no_new_key_secret(
    tmp_path, smoke_phantoms, monkeypatch, capsys
):
    from train import main
    from helpers import smoke_flags

    # no stored index: the run's data is scanned again, and a scan is what may create a key file
    flags = smoke_flags(tmp_path, smoke_phantoms, "--max_steps", "3", "--index_path", "none")
    assert main(flags) == 0  # the tests' site key
    run_dir = tmp_path / "runs" / "r"
    before = file_contents(run_dir)
    # a new container: no key file yet
    fresh = tmp_path / "fresh_home" / ".config" / "octjepa" / "site.key"
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(fresh))
    capsys.readouterr()
    assert main([*flags, "--resume", str(run_dir / "checkpoints" / "step_0000003.pt")]) == 2
    err = capsys.readouterr().err
    assert (
        f"resume: {run_dir / 'checkpoints' / 'step_0000003.pt'}" in err
        and f"{fresh} does not exist" in err
    )
    assert "point OCTJEPA_PATIENT_KEY_FILE at the key file" in err
    assert main([*flags, "--resume", "auto"]) == 2
    assert "resume: auto" in capsys.readouterr().err
    assert not (tmp_path / "fresh_home").exists()  # no new secret, not even its folder
    assert file_contents(run_dir) == before  # and the run folder as it was


def test_the_wandb_offline_record_holds_no_host_name(tmp_path, smoke_phantoms):
    if (
        not shutil.which("unshare")
        or subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode
    ):
        pytest.skip(
            "unshare --uts is not allowed here: the test names the host, which needs its own UTS"
            " namespace"
        )
    # a workstation named for its user and ward, as hospitals do
    host = "clinic-ws-hoffmann-4817203"
    run = subprocess.run(
        [
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host,
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            "configs/smoke.yaml",
            "--phantom_dir",
            smoke_phantoms,
            "--out_dir",
            str(tmp_path / "runs"),
            "--run_name",
            "r",
            "--max_steps",
            "3",
            "--wandb",
            "offline",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    synced = [
        p
        for p in (tmp_path / "runs" / "r" / "wandb").rglob("*")
        if p.is_file() and not p.name.startswith("debug")
    ]  # W&B's own local logs are never uploaded
    assert any(p.suffix == ".wandb" for p in synced)
    assert [p.name for p in synced if host in p.read_bytes().decode("latin-1")] == []


def test_an_interrupted_embed_keeps_keyed_ids_not_paths_in_its_partial_rows(
    tmp_path, phantom_dir, export_dir, monkeypatch
):
    clinic, identifiers = clinic_copy(phantom_dir, tmp_path / "clinic")
    identifiers |= {clinic, "HOFFMANN"}

    def killed(*args, **kwargs):  # a kill after the rows were saved, before the table
        raise KeyboardInterrupt

    monkeypatch.setattr(encoder, "write_embedding_table", killed)
    out = tmp_path / "share" / "embeddings.npz"
    with pytest.raises(KeyboardInterrupt):
        encoder.embed(
            export_dir,
            str(out),
            load_config(["--data_root", clinic, "--workers", "0"]),
            batch_size=2,
            save_every=2,
        )
    chunks = sorted((tmp_path / "share" / "embeddings.npz.partial").glob("chunk_*.npz"))
    assert len(chunks) >= 2  # beside the table meant to be shared
    assert {c.name: sorted(i for i in identifiers if i in texts_of(c)) for c in chunks} == {
        c.name: [] for c in chunks
    }
    monkeypatch.undo()
    table, computed = encoder.embed(
        export_dir,
        str(out),
        load_config(["--data_root", clinic, "--workers", "0"]),
        batch_size=2,
        save_every=2,
    )
    assert computed == 0 and len(table["volume"])  # the same command continues from the keyed rows


def test_a_key_file_of_32_random_bytes_is_a_secret_and_an_empty_or_unmakeable_key_file_is_refused(
    tmp_path, phantom_dir
):
    raw = tmp_path / "raw" / "site.key"  # head -c 32 /dev/urandom > site.key: bytes, not text
    raw.parent.mkdir()
    raw.write_bytes(b"\xff" + os.urandom(31))
    raw.chmod(0o600)
    scan = scan_cli(phantom_dir, raw)
    assert scan.returncode == 0, scan.stderr[-2000:]
    home = tmp_path / "home"  # an empty variable is no key file: never the default one of this HOME
    home.mkdir()
    empty = subprocess.run(
        [sys.executable, str(REPO / "data.py"), "scan", phantom_dir],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HOME": str(home), "OCTJEPA_PATIENT_KEY_FILE": ""},
    )
    assert empty.returncode == 2 and "OCTJEPA_PATIENT_KEY_FILE is set but empty" in empty.stderr
    assert "unset OCTJEPA_PATIENT_KEY_FILE" in empty.stderr and not (home / ".config").exists()
    (tmp_path / "a_file").write_text("")  # a key file whose folder cannot be made
    unmakeable = scan_cli(phantom_dir, tmp_path / "a_file" / "site.key")
    assert unmakeable.returncode == 2 and "Traceback" not in unmakeable.stderr, unmakeable.stderr[
        -2000:
    ]
    assert f"cannot create the key file {tmp_path / 'a_file' / 'site.key'}" in unmakeable.stderr


def finetune_cli(labels, export_dir, out, key_file, home):
    """`python finetune.py` (frozen probes, 2 folds) as its own process with its own HOME and key
    file."""
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "finetune.py"),
            "--encoder",
            export_dir,
            "--labels",
            labels,
            "--modes",
            "frozen",
            "--folds",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HOME": str(home),
            "OCTJEPA_PATIENT_KEY_FILE": str(key_file),
        },
    )


@pytest.mark.slow
def test_a_finetuning_resumed_under_another_or_a_missing_key_file_is_refused_and_creates_none(
    tmp_path, smoke_phantoms, export_dir
):
    names = sorted(n for n in os.listdir(smoke_phantoms) if n.endswith(".dcm"))
    # no patient column: the patients, so the folds, are the key file's keys
    labels = tmp_path / "labels.csv"
    labels.write_text(
        "path,label\n"
        + "".join(f"{smoke_phantoms}/{n},{'ab'[(i // 2) % 2]}\n" for i, n in enumerate(names))
    )
    key, home, out = tmp_path / "site.key", tmp_path / "home", tmp_path / "ft"
    key.write_text("clinic-secret-" + "0123456789abcdef" * 3 + "\n")
    key.chmod(0o600)
    home.mkdir()
    first = finetune_cli(labels, export_dir, out, key, home)
    assert first.returncode == 0, first.stderr[-2000:]
    recorded = json.loads((out / "report.json").read_text())["key_fingerprint"]
    assert recorded.startswith("kf1-")
    (out / "report.json").unlink()  # as if killed after its folds: the next run resumes from them
    fresh = tmp_path / "fresh_home"  # a new container: no key file in its HOME
    fresh.mkdir()
    missing = finetune_cli(
        labels, export_dir, out, fresh / ".config" / "octjepa" / "site.key", fresh
    )
    assert missing.returncode == 2 and "finished folds in" in missing.stderr, missing.stderr[-2000:]
    assert (
        f"made with the patient-key secret {recorded}" in missing.stderr
        and "does not exist" in missing.stderr
    )
    assert (
        "point OCTJEPA_PATIENT_KEY_FILE at the key file the finished folds were made with"
        in missing.stderr
    )
    assert not (fresh / ".config").exists()  # no new secret made before refusing
    other = tmp_path / "other.key"
    other.write_text("another-site-" + "fedcba9876543210" * 3 + "\n")
    other.chmod(0o600)
    mixed = finetune_cli(labels, export_dir, out, other, home)
    assert mixed.returncode == 2 and "patient keys of different secrets" in mixed.stderr, (
        mixed.stderr[-2000:]
    )
    assert recorded in mixed.stderr and "Traceback" not in mixed.stderr
    again = finetune_cli(labels, export_dir, out, key, home)  # the right key file: it continues
    assert again.returncode == 0, again.stderr[-2000:]
