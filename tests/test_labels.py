"""Labels CSV: every mistake a spreadsheet makes is refused with the row and the fix, by the one
reader that probe.py, encoder.py show, finetune.py and the verdict share (real phantom DICOM files
beside the CSV)."""

import os
import shutil
from pathlib import Path

import pytest

from config import ConfigError

LABEL_CASES = {  # what a labels CSV holds -> what the message must say
    "header only": ("path,label\n", "holds a header (path,label) but no rows"),
    "Label header": ("path,Label\n{a},yes\n", "'Label' should read 'label'"),
    "empty label": ("path,label\n{a},yes\n{b},\n", "line 3: label is empty"),
    "nan label": ("path,label\n{a},yes\n{b},nan\n", "line 3: label is empty ('nan')"),
    "padded label": (
        "path,label\n{a},yes\n{b},yes \n",
        "line 3: label 'yes ' has spaces around it",
    ),
    "duplicate path": (
        "path,label\n{a},yes\n{a},no\n",
        "line 3: {a} is the volume of line 2 again",
    ),
    "dot dot path": (
        "path,label\n..,yes\n{a},no\n",
        "line 2: path '..' is not a volume inside the CSV's folder",
    ),
    "empty path": (
        "path,label\n,yes\n{a},no\n",
        "line 2: path '' is not a volume inside the CSV's folder",
    ),
    "blank patient": ("path,label,patient\n{a},yes,p1\n{b},no, \n", "line 3: patient is empty"),
    "no known path": ("path,label\nmissing1.dcm,yes\nmissing2.dcm,no\n", "none of the 2 paths"),
}


@pytest.mark.parametrize("case", sorted(LABEL_CASES))
def test_a_labels_csv_with_a_mistake_is_refused_by_probe_and_finetune_naming_the_row(
    case, tmp_path, phantom_dir
):
    from labels import read_label_table

    text, message = LABEL_CASES[case]
    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, tmp_path / name)
    labels = tmp_path / "labels.csv"
    labels.write_text(text.format(a=a, b=b))
    with pytest.raises(ConfigError) as refused:
        read_label_table(str(labels), ("label",))
    assert message.format(a=a) in str(refused.value)


def test_a_labels_csv_saved_by_excel_with_a_bom_reads_and_unknown_paths_are_named(
    tmp_path, phantom_dir, capsys
):
    from labels import classification_targets, read_label_table

    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, tmp_path / name)
    labels = tmp_path / "labels.csv"
    labels.write_bytes(f"\ufeffpath,label\n{a},yes\n{b},no\ngone.dcm,no\n".encode())
    assert list(read_label_table(str(labels)).values["label"]) == ["yes", "no", "no"]
    assert "gone.dcm" in capsys.readouterr().err
    one_class = tmp_path / "one.csv"
    one_class.write_text(f"path,label\n{a},yes\n{b},yes\n")
    with pytest.raises(ConfigError, match="needs at least two classes"):
        classification_targets(read_label_table(str(one_class)), str(one_class))


@pytest.mark.parametrize("alias", ["symlinked folder", "symlink", "hard link"])
def test_one_scan_listed_twice_through_a_link_is_refused_by_probe_and_finetune(
    alias, tmp_path, phantom_dir
):
    from labels import read_label_table

    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    (tmp_path / "scans").mkdir()
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, tmp_path / "scans" / name)
    if alias == "symlinked folder":
        (tmp_path / "mirror").symlink_to(tmp_path / "scans", target_is_directory=True)
        again = f"mirror/{a}"
    elif alias == "symlink":
        (tmp_path / "alias.dcm").symlink_to(tmp_path / "scans" / a)
        again = "alias.dcm"
    else:
        os.link(tmp_path / "scans" / a, tmp_path / "alias.dcm")
        again = "alias.dcm"
    # the alias as another patient: one scan would sit in train and in test
    labels = tmp_path / "labels.csv"
    labels.write_text(f"path,label,patient\nscans/{a},yes,p1\nscans/{b},no,p2\n{again},yes,p3\n")
    with pytest.raises(ConfigError, match=f"line 4: {again} is the volume of line 2 again"):
        read_label_table(str(labels), ("label", "patient"))


def test_one_number_written_two_ways_is_one_class_but_patient_ids_stay_as_written(
    tmp_path, phantom_dir, capsys
):
    from labels import classification_targets, read_label_table

    names = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:4]
    for name in names:
        shutil.copy(Path(phantom_dir) / name, tmp_path / name)
    labels = tmp_path / "labels.csv"  # a spreadsheet that wrote 1.0 for some rows and 1 for others
    labels.write_text(
        "path,label,patient\n"
        + "".join(
            f"{n},{v},{p}\n"
            for n, v, p in zip(names, ("1", "1.0", "0", "0.0"), ("001", "1", "7", "7"))
        )
    )
    table = read_label_table(str(labels))
    targets, classes, task = classification_targets(table, str(labels))
    assert classes == ["0", "1"] and task == "binary" and list(targets) == [1, 1, 0, 0]
    # two patients 001 and 1: ids are not numbers
    assert list(table.patients) == ["001", "1", "7", "7"]
    assert "read as" in capsys.readouterr().err


def test_the_demo_verdict_reads_its_lesion_column_without_a_line_about_the_thickness_column(
    tmp_path, capsys
):
    """The varied phantoms' labels.csv holds retina_thickness (a regression target, written 0.2080).
    Reading its `lesion` column once printed '0.2080, ... read as 0.208, ... (one number, one
    class)' in every demo's summary."""
    from labels import read_label_table

    for name in ("a.dcm", "b.dcm"):
        # the reader checks that the paths exist; it does not decode them here
        (tmp_path / name).write_bytes(b"")
    labels = tmp_path / "labels.csv"
    labels.write_text(
        "path,label,lesion,retina_thickness\na.dcm,none,no,0.2080\nb.dcm,fluid,yes,0.3350\n"
    )
    table = read_label_table(str(labels), ("lesion",))
    assert list(table.values["lesion"]) == ["no", "yes"]
    # as written: no class column
    assert list(table.values["retina_thickness"]) == ["0.2080", "0.3350"]
    assert capsys.readouterr().err == ""


def test_every_tool_reads_a_labels_csv_with_the_one_reader():
    import ast

    repo = Path(__file__).resolve().parents[1]
    for tool in ("probe", "runprobe", "encoder", "finetune"):
        source = (repo / f"{tool}.py").read_text()
        assert "csv" not in {
            a.name
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Import)
            for a in n.names
        }, f"{tool}.py reads a CSV itself"
        assert "read_label_table" in source or "load_labelled_volumes" in source, tool


def test_a_byte_copy_of_a_scan_under_another_patient_id_is_refused_naming_both_rows(
    tmp_path, phantom_dir
):
    import pydicom
    from labels import read_label_table

    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, tmp_path / name)
    copy = pydicom.dcmread(tmp_path / a)  # an export of the same scan, filed under another patient
    copy.PatientID = "9999999"
    copy.save_as(tmp_path / "other_patient.dcm")
    labels = tmp_path / "labels.csv"  # as two patients, the one scan could sit in train and in test
    labels.write_text(f"path,label,patient\n{a},yes,p1\n{b},no,p2\nother_patient.dcm,yes,p3\n")
    with pytest.raises(ConfigError) as refused:
        read_label_table(str(labels), ("label", "patient"))
    message = str(refused.value)
    assert f"line 4: other_patient.dcm holds a copy of the scan of line 2 ({a})" in message
    assert "duplicate_instance" in message and "delete the copy's row" in message
    # one row per scan: read as before
    labels.write_text(f"path,label,patient\n{a},yes,p1\n{b},no,p2\n")
    assert len(read_label_table(str(labels)).paths) == 2


def test_a_byte_copy_of_a_scan_in_a_bucket_is_refused_as_on_a_local_disk(
    tmp_path, phantom_dir, gcs_emulator
):
    import pydicom
    from labels import read_label_table

    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    scans = tmp_path / "scans"
    scans.mkdir()
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, scans / name)
    copy = pydicom.dcmread(scans / a)  # an export of the same scan, filed under another patient
    copy.PatientID = "9999999"
    copy.save_as(scans / "other_patient.dcm")
    bucket = gcs_emulator.upload(str(scans), f"copied-{tmp_path.name}")
    labels = tmp_path / "labels.csv"  # the CSV on this machine, its scans in the bucket
    labels.write_text(
        f"path,label,patient\n{bucket}/{a},yes,p1\n{bucket}/{b},no,p2\n"
        f"{bucket}/other_patient.dcm,yes,p3\n"
    )
    with pytest.raises(ConfigError) as refused:
        read_label_table(str(labels), ("label", "patient"))
    assert (
        f"line 4: {bucket}/other_patient.dcm holds a copy of the scan of line 2 ({bucket}/{a})"
        in str(refused.value)
    )
    # one row per scan
    labels.write_text(f"path,label,patient\n{bucket}/{a},yes,p1\n{bucket}/{b},no,p2\n")
    assert len(read_label_table(str(labels)).paths) == 2


def test_a_labels_csv_saved_as_latin_1_is_refused_naming_the_line_and_how_to_save_it(
    tmp_path, phantom_dir
):
    from labels import read_label_table

    a, b = sorted(p.name for p in Path(phantom_dir).glob("*.dcm"))[:2]
    for name in (a, b):
        shutil.copy(Path(phantom_dir) / name, tmp_path / name)
    labels = tmp_path / "labels.csv"  # a spreadsheet's export in Latin-1: "drüsen" is one byte 0xfc
    labels.write_bytes(f"path,label\n{a},healthy\n{b},drüsen\n".encode("latin-1"))
    with pytest.raises(ConfigError) as refused:
        read_label_table(str(labels))
    assert "line 3 is not UTF-8" in str(refused.value) and "Save the CSV as UTF-8" in str(
        refused.value
    )
    labels.write_bytes(f"path,label\n{a},healthy\n{b},drüsen\n".encode())  # saved as UTF-8: read
    assert list(read_label_table(str(labels)).values["label"]) == ["healthy", "drüsen"]
