"""Nothing leaked: patient keys that neither reverse nor link across sites, and outputs that carry no identifier.
The fixture is clinic-like: phantoms rewritten with 7-digit MRNs as PatientID, names and birth dates, in folders
named LAST_FIRST_MRN (real DICOM files, real processes)."""
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
from config import ConfigError, load_config
from helpers import REPO
from index import list_sources, read_index, scan_files


def clinic_copy(phantom_dir, out):
    """The phantom set rewritten as a clinic's: each patient gets a 7-digit MRN, a name and a birth date, and their
    files move into a folder LAST_FIRST_MRN (labels.csv follows). Returns (folder, identifiers written)."""
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
        identifiers |= {mrn, last, f"{last.upper()}_{first.upper()}_{mrn}", "19560314", str(ds.StudyInstanceUID),
                        str(ds.SeriesInstanceUID), str(ds.SOPInstanceUID)}
    return str(out), identifiers


def scan_keys(folder):
    """{path: patient key} of a real scan of a folder."""
    files = sorted(list_sources(folder, None))
    return {r["paths"][0]: r["patient"] for r in scan_files(files) if r["ok"]}


def test_patient_keys_neither_reverse_nor_link_across_sites_unless_they_share_the_key_file(
        tmp_path, phantom_dir, monkeypatch):
    clinic, identifiers = clinic_copy(phantom_dir, tmp_path / "clinic")
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_a" / "site.key"))
    site_a = scan_keys(clinic)
    key_file = tmp_path / "site_a" / "site.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # created once, readable by its owner only
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_b" / "site.key"))
    site_b = scan_keys(clinic)
    assert set(site_a.values()).isdisjoint(site_b.values())  # two sites' tables do not join on the key
    mrns = {pydicom.dcmread(p).PatientID for p in site_a}
    dictionary = {hashlib.sha256(m.encode()).hexdigest()[:16] for m in mrns}  # a dictionary of MRNs finds none
    assert not dictionary & set(site_a.values()) and not any(m in k for m in mrns for k in site_a.values())
    assert len(set(site_a.values())) == len(mrns)  # one key per patient, as before
    shutil.copy(key_file, tmp_path / "site_b_linked.key")  # linking on purpose: the same secret at both sites
    monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", str(tmp_path / "site_b_linked.key"))
    assert scan_keys(clinic) == site_a
    secret = key_file.read_text().strip()
    assert secret not in json.dumps(site_a)


def test_an_index_with_old_reversible_keys_is_migrated_with_its_data_and_refused_without(tmp_path, phantom_dir):
    index_path = tmp_path / "index.jsonl"
    scan = subprocess.run([sys.executable, str(REPO / "data.py"), "scan", phantom_dir, "--out", str(index_path)],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert scan.returncode == 0, scan.stderr[-2000:]
    lines = [json.loads(line) for line in index_path.read_text().splitlines()]
    for record in lines[1:]:  # as an older octjepa wrote them: sha256(PatientID)[:16]
        if record["ok"]:
            record["patient"] = hashlib.sha256(pydicom.dcmread(record["paths"][0]).PatientID.encode()).hexdigest()[:16]
    lines[0]["built_from"].pop("patient_keys")
    index_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ConfigError, match="older octjepa wrote .* python data.py scan DATA_ROOT --out"):
        data.index_records(load_config(["--index_path", str(index_path)]))
    migrated = data.index_records(load_config(["--index_path", str(index_path), "--data_root", phantom_dir]))
    assert all(r["patient"].startswith("pk1-") for r in migrated if r["ok"])
    assert read_index(str(index_path)) == migrated  # rewritten with keyed keys


def tool(script, *flags):
    """Run one of the repo's scripts as its own process; its completed process."""
    done = subprocess.run([sys.executable, str(REPO / script), *flags], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert done.returncode == 0, f"{script} {flags}: {done.stderr[-3000:]}"
    return done


def texts_of(path):
    """What a file holds, as text: its bytes, and for an .npz every array's values too (it may be compressed)."""
    raw = path.read_bytes()
    texts = [raw.decode("latin-1")]
    if path.suffix == ".npz":
        import numpy as np
        with np.load(path) as z:
            texts += [" ".join(map(str, z[k].ravel().tolist())) for k in z.files]
    return "\n".join(texts)


@pytest.mark.slow
def test_nothing_that_leaves_the_machine_names_a_patient_a_study_or_a_source_path(tmp_path, smoke_phantoms):
    clinic, identifiers = clinic_copy(smoke_phantoms, tmp_path / "clinic")
    identifiers |= {clinic, str(tmp_path), "HOFFMANN"}
    labels = Path(clinic) / "labels.csv"
    names = {p.name: p.relative_to(clinic) for p in Path(clinic).rglob("*") if p.parent.parent == Path(clinic)}
    rows = [line.split(",") for line in (Path(smoke_phantoms) / "labels.csv").read_text().splitlines()[1:]]
    labels.write_text("path,label\n" + "".join(f"{names[path]},{'none' if label == 'none' else 'lesion'}\n"
                                               for path, label in rows if path in names))
    runs, share = tmp_path / "runs", tmp_path / "share"
    tool("train.py", "--config", "configs/smoke.yaml", "--data_root", clinic, "--out_dir", str(runs), "--run_name",
         "r", "--max_steps", "4", "--wandb", "offline", "--phantom_dir", smoke_phantoms)
    tool("data.py", "scan", clinic, "--out", str(tmp_path / "index.jsonl"))  # the index stays on this machine
    tool("encoder.py", "export", "--ckpt", str(runs / "r" / "checkpoints"), "--out", str(share / "encoder"))
    tool("encoder.py", "embed", "--encoder", str(share / "encoder"), "--data_root", clinic, "--out",
         str(share / "embeddings.npz"), "--workers", "0")
    tool("finetune.py", "--encoder", str(share / "encoder"), "--labels", str(labels), "--out", str(share / "ft"),
         "--folds", "2", "--modes", "full", "--epochs", "1", "--batch_size", "4")
    synced = [p for p in (runs / "r" / "wandb").rglob("*") if not p.name.startswith("debug")]  # W&B's own local logs
    leaving = [p for p in [*share.rglob("*"), *synced] if p.is_file()]  # (debug*.log) are never uploaded
    assert {p.name for p in leaving} >= {"config.json", "embeddings.npz", "fold.json", "report.json"}
    assert any(p.suffix == ".wandb" for p in leaving)  # the W&B run as it would be synced
    found = {str(p.relative_to(tmp_path)): sorted(i for i in identifiers if i in texts_of(p)) for p in leaving}
    assert {p: i for p, i in found.items() if i} == {}

