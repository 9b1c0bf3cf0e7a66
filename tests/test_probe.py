"""probe.py: linear probes on frozen target-encoder features, the evidence that pretraining learned
something."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import labels
import probe
import readouts
import references
import runprobe
from config import EXIT_CODES, Preempted, load_config
from runlog import rankme
from model import VJEPA3D, feature_std
from phantom import (
    INNER_VARIED_LABELS,
    VARIED_LABELS,
    Eye,
    draw_eye,
    synth_reflectivity,
    write_phantom_set,
)
import tokens as tokens_module
from tokens import TokenFile
from helpers import (
    REPO,
    one_thread,  # noqa: F401 (autouse: tiny models in one thread)
    phantom_flags,
)

TINY = [
    "--image_size",
    "8,32,32",
    "--patch_size",
    "4,8,8",
    "--embed_dim",
    "24",
    "--depth",
    "1",
    "--num_heads",
    "2",
    "--pred_embed_dim",
    "12",
    "--pred_depth",
    "1",
    "--pred_num_heads",
    "2",
]


def tokens_with_signal(n_per_class=20, classes=3, tokens=32, dim=16, strength=6.0, seed=0):
    """Random tokens [M,N,E] where a few tokens of each volume carry a class-dependent offset."""
    g = torch.Generator().manual_seed(seed)
    labels = np.repeat(np.arange(classes), n_per_class)
    x = torch.randn(len(labels), tokens, dim, generator=g)
    for i, c in enumerate(labels):
        x[i, :2, c] += strength  # a local "lesion": 2 of 32 tokens
    return x, labels


def test_scores_are_chance_for_uninformative_and_one_for_perfect_probabilities():
    labels = np.repeat(np.arange(3), 10)
    assert readouts.classification_scores(np.full((30, 3), 1 / 3), labels) == {
        "auroc": 0.5,
        "balanced_accuracy": 1 / 3,
    }
    assert readouts.classification_scores(np.eye(3)[labels], labels) == {
        "auroc": 1.0,
        "balanced_accuracy": 1.0,
    }
    two = np.array([0, 0, 1, 1])
    assert (
        readouts.classification_scores(
            np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]]), two
        )["auroc"]
        == 1.0
    )


def test_interval_is_a_t_interval_over_seeds():
    iv = readouts.interval([0.6, 0.7, 0.8])
    assert iv["mean"] == pytest.approx(0.7)
    # t(0.975, 2 dof) = 4.303
    assert iv["high"] - iv["mean"] == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-3)
    assert readouts.interval([0.5] * 4)["low"] == readouts.interval([0.5] * 4)["high"] == 0.5
    assert readouts.interval([0.5])["high"] == math.inf


def test_stratified_split_holds_out_every_class_and_changes_with_the_seed():
    labels = np.array([0] * 10 + [1] * 5 + [2] * 2)
    train, test = readouts.stratified_split(labels, 0.4, seed=0)
    assert sorted(np.concatenate([train, test])) == list(range(17))
    assert set(labels[train]) == set(labels[test]) == {0, 1, 2}
    assert list(np.bincount(labels[test])) == [4, 2, 1]
    assert not np.array_equal(test, readouts.stratified_split(labels, 0.4, seed=1)[1])


GRID = (2, 4, 4)  # the token grid of tokens_with_signal: 32 tokens


def test_probes_find_a_label_carried_by_a_few_tokens():
    tokens, labels = tokens_with_signal()
    report = readouts.readout_scores(tokens, GRID, labels, seeds=range(2))
    for readout in readouts.READOUTS:
        assert report[readout]["auroc"]["mean"] > 0.9, readout


def test_probes_of_tokens_in_a_file_read_a_few_volumes_at_a_time_learn_what_they_learn_in_memory(
    tmp_path, monkeypatch
):
    tokens, targets = tokens_with_signal()
    train, test = readouts.stratified_split(targets, readouts.TEST_FRACTION, seed=0)
    in_memory = readouts.fit_attentive(tokens, targets, train, seed=0)  # one chunk: full batch
    expected = readouts.split_scores(tokens, targets, train, test, 0, readouts.READOUTS, GRID)
    stored = TokenFile(str(tmp_path / "tokens"))
    for i in range(0, len(tokens), 7):
        stored.append(tokens[i : i + 7])
    # 5 volumes at a time
    monkeypatch.setattr(tokens_module, "TOKEN_CHUNK_BYTES", 5 * tokens[0].numel() * 4)
    from_file = readouts.fit_attentive(stored, targets, train, seed=0)
    assert stored.shape == tokens.shape and torch.equal(stored[test], tokens[test])
    for name, weights in in_memory.state_dict().items():
        # a shift of every token's score, which the softmax ignores: rounding noise drives it
        if name != "scores.bias":
            torch.testing.assert_close(from_file.state_dict()[name], weights, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_file(tokens), in_memory(tokens), rtol=1e-5, atol=1e-5)
    scores = readouts.split_scores(stored, targets, train, test, 0, readouts.READOUTS, GRID)
    for readout in readouts.READOUTS:
        assert scores[readout] == pytest.approx(expected[readout]), readout


def test_depth_rows_keep_where_along_the_a_scan_a_feature_is():
    g = torch.Generator().manual_seed(0)
    labels = np.repeat(np.arange(2), 20)
    tokens = torch.randn(len(labels), 32, 16, generator=g) * 0.1
    # the same feature in every volume, in the top depth row (0) or the bottom one (3)
    for i, c in enumerate(labels):
        tokens[i].view(*GRID, 16)[:, 3 * c, :, 0] += 1.0
    report = readouts.readout_scores(tokens, GRID, labels, range(2), readouts.LINEAR_READOUTS)
    assert report["depth_rows"]["auroc"]["mean"] > 0.95
    # the mean of the tokens is the same for both classes
    assert report["mean_pool"]["auroc"]["mean"] < 0.75


def test_linear_probe_scores_near_one_on_a_trivially_separable_set():
    labels = np.repeat(np.arange(3), 20)
    # [M, E]: the class, plus noise
    pooled = np.eye(3)[labels] * 5 + np.random.default_rng(0).normal(0, 0.3, (60, 3))
    train, test = readouts.stratified_split(labels, readouts.TEST_FRACTION, seed=0)
    scores = readouts.linear_probe(pooled, labels, train, test)
    assert scores["auroc"] > 0.99 and scores["balanced_accuracy"] > 0.95


def test_probe_on_constant_features_scores_chance():
    _, labels = tokens_with_signal()
    # a collapsed encoder: the same features for every volume
    tokens = torch.ones(len(labels), 32, 16)
    report = readouts.readout_scores(tokens, GRID, labels, seeds=range(2))
    for name in readouts.READOUTS:
        assert report[name]["auroc"]["mean"] == pytest.approx(0.5)
        assert report[name]["balanced_accuracy"]["mean"] == pytest.approx(1 / 3)


def collapsed_model(cfg) -> VJEPA3D:
    """A model whose target encoder outputs the same features everywhere (its final norm zeroed)."""
    model = VJEPA3D.from_config(cfg)
    torch.nn.init.zeros_(model.target_encoder.norm.weight)
    torch.nn.init.constant_(model.target_encoder.norm.bias, 0.3)
    return model


def test_collapsed_encoder_scores_chance_and_is_flagged_by_the_collapse_metrics():
    cfg = load_config(TINY)
    g = torch.Generator().manual_seed(0)
    labels = np.repeat(np.arange(2), 12)
    volumes = torch.randn(len(labels), 1, *cfg.image_size, generator=g)
    volumes[labels == 1, :, :, :8] += 2.0  # a label that any working encoder sees
    train_idx, test_idx = readouts.stratified_split(labels, readouts.TEST_FRACTION, seed=0)
    probe_set = runprobe.ProbeSet(
        volumes.half(), labels, ["a", "b"], train_idx, test_idx, "label (a test)"
    )

    healthy = runprobe.probe_auroc(VJEPA3D.from_config(cfg), probe_set, "cpu")
    collapsed_model_ = collapsed_model(cfg)
    collapsed = runprobe.probe_auroc(collapsed_model_, probe_set, "cpu")
    assert healthy["probe_auroc"] > 0.9
    assert collapsed == {"probe_auroc": 0.5, "probe_bal_acc": 0.5, "probe_rows_auroc": 0.5}
    tokens = collapsed_model_.encode(volumes[:4].float())
    assert float(feature_std(tokens)) < 1e-6
    assert rankme(tokens.flatten(0, 1)) < 1.5  # 1 = every token the same vector


def test_probe_auroc_leaves_the_model_as_it_found_it(phantom_dir):
    cfg = load_config(TINY + ["--probe_labels", f"{phantom_dir}/labels.csv"])
    probe_set = runprobe.prepare_probe_set(cfg)
    assert probe_set.volumes.dtype == torch.float16 and probe_set.volumes.shape == (
        10,
        1,
        8,
        32,
        32,
    )
    assert probe_set.classes == ["drusen", "fluid", "none"]
    model = VJEPA3D.from_config(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scores = runprobe.probe_auroc(model, probe_set, "cpu")
    assert (
        set(scores) == {"probe_auroc", "probe_bal_acc", "probe_rows_auroc"}
        and 0 <= scores["probe_auroc"] <= 1
    )
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_labels_may_hold_series_folders_and_absolute_paths(tmp_path):
    rows = [("/abs/a.dcm", "x"), ("sub/b", "y")]
    # one path that exists: the other is named on stderr
    (tmp_path / "sub" / "b").mkdir(parents=True)
    (tmp_path / "labels.csv").write_text(
        "path,label\n" + "".join(f"{p},{label}\n" for p, label in rows)
    )
    assert labels.read_label_table(str(tmp_path / "labels.csv")).paths == [
        "/abs/a.dcm",
        str(tmp_path / "sub/b"),
    ]


def test_unreadable_labelled_files_are_counted_by_reason(tmp_path, phantom_dir):
    lines = open(f"{phantom_dir}/labels.csv").read().splitlines()
    lines = [lines[0]] + [f"{phantom_dir}/{line}" for line in lines[1:]] + ["missing.dcm,none"]
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "missing.dcm").write_bytes(b"")
    _, values, skipped = labels.load_labelled_volumes(
        load_config(TINY), str(tmp_path / "labels.csv")
    )
    assert len(values["label"]) == 10 and skipped == {"empty_file": 1}


# --------------------------------------------------------------------------------------------------
# Command line: clear errors (exit 2) and a report
# --------------------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = probe.main(list(argv))
    return code, capsys.readouterr().err


def test_missing_checkpoint_exits_2_naming_the_fix(capsys, tmp_path):
    code, err = run_cli(capsys, "--ckpt", str(tmp_path / "nope.pt"))
    assert code == 2 and "not found" in err and "--ckpt random" in err and "best.pt" in err


def test_a_file_that_is_not_a_checkpoint_exits_2(capsys, tmp_path):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    code, err = run_cli(capsys, "--ckpt", str(tmp_path / "notes.pt"))
    assert code == 2 and "not a readable checkpoint" in err
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    code, err = run_cli(capsys, "--ckpt", str(tmp_path / "other.pt"))
    assert code == 2 and "not an octjepa checkpoint (no 'model')" in err


def test_checkpoint_whose_weights_do_not_fit_its_config_exits_2(capsys, tmp_path):
    cfg = load_config(TINY)
    state = {
        "model": VJEPA3D.from_config(cfg).state_dict(),
        "config": {**asdict(cfg), "embed_dim": 48},
    }
    torch.save(state, tmp_path / "bad.pt")
    code, err = run_cli(capsys, "--ckpt", str(tmp_path / "bad.pt"))
    assert code == 2 and "does not fit" in err


def test_model_flags_with_a_checkpoint_exit_2(capsys, tmp_path):
    code, err = run_cli(capsys, "--ckpt", str(tmp_path / "x.pt"), "--embed_dim", "48")
    assert code == 2 and "--embed_dim" in err and "brings its own model" in err


def test_missing_or_malformed_labels_exit_2(capsys, tmp_path):
    code, err = run_cli(capsys, "--ckpt", "random", "--labels", str(tmp_path / "labels.csv"), *TINY)
    assert code == 2 and "not found" in err and "path,label" in err
    (tmp_path / "labels.csv").write_text("file,diagnosis\na.dcm,none\n")
    code, err = run_cli(capsys, "--ckpt", "random", "--data_root", str(tmp_path), *TINY)
    assert code == 2 and "header" in err


def test_labels_with_a_single_class_exit_2(capsys, tmp_path, phantom_dir):
    first, second = (
        line.split(",")[0] for line in open(f"{phantom_dir}/labels.csv").read().splitlines()[1:3]
    )
    (tmp_path / "labels.csv").write_text(
        f"path,label\n{phantom_dir}/{first},none\n{phantom_dir}/{second},none\n"
    )
    code, err = run_cli(capsys, "--ckpt", "random", "--labels", str(tmp_path / "labels.csv"), *TINY)
    assert code == 2 and "two classes" in err


def patient_labels(path: Path, phantom_dir: str, label_of) -> str:
    """A user's labels.csv path,label,patient of the 10 volumes of phantom_dir: two scans per
    patient (p0 to p4), label_of(patient number) the label of both."""
    names = [
        line.split(",")[0] for line in open(f"{phantom_dir}/labels.csv").read().splitlines()[1:]
    ]
    rows = [f"{phantom_dir}/{name},{label_of(i // 2)},p{i // 2}" for i, name in enumerate(names)]
    path.write_text("path,label,patient\n" + "\n".join(rows) + "\n")
    return str(path)


def test_scans_of_one_patient_never_sit_on_both_sides_of_a_probe_split(
    capsys, tmp_path, phantom_dir
):
    """Several scans per patient: a split by volume let the probes meet a test patient in
    training."""
    labels_csv = patient_labels(
        tmp_path / "labels.csv", phantom_dir, lambda patient: "ab"[patient % 2]
    )
    code = probe.main(
        [
            "--ckpt",
            "random",
            *TINY,
            "--labels",
            labels_csv,
            "--seeds",
            "3",
            "--readouts",
            "mean_pool",
            "--no_reference",
            "--json",
            str(tmp_path / "probe.json"),
        ]
    )
    assert code == 0
    task = json.loads((tmp_path / "probe.json").read_text())["tasks"]["label"]
    assert task["split_by"] == "patient" and task["patients"] == 5
    assert "label: auroc, 10 volumes of 5 patients (split by patient)" in capsys.readouterr().out
    rng = np.random.default_rng(0)  # the splits probe.py draws, on 30 patients of one to four scans
    patients = np.repeat(np.arange(30), rng.integers(1, 5, size=30)).astype(str)
    targets = np.array([int(p) % 3 for p in patients])
    for train, test in probe.probe_splits(targets, ["a", "b", "c"], patients, 10, labels_csv):
        assert not set(patients[train]) & set(patients[test])
        assert sorted(np.concatenate([train, test])) == list(range(len(patients)))
        assert set(targets[train]) == set(targets[test]) == {0, 1, 2}
    # no patients:
    for seed, split in enumerate(probe.probe_splits(targets, ["a", "b", "c"], None, 3, labels_csv)):
        # the built-in suite's splits
        assert all(map(np.array_equal, split, readouts.probe_split(targets, seed)))


def test_a_class_of_a_single_patient_exits_2_naming_the_fix(capsys, tmp_path, phantom_dir):
    labels_csv = patient_labels(
        tmp_path / "labels.csv", phantom_dir, lambda patient: "abacb"[patient]
    )
    code, err = run_cli(capsys, "--ckpt", "random", *TINY, "--labels", labels_csv, "--no_reference")
    assert (
        code == 2
        and "split by patient, class c has no volume to hold out" in err
        and "two patients" in err
    )


def test_probe_shows_the_progress_of_encoding_each_read_out_and_each_cnn_fit(
    capsys, phantom_dir, monkeypatch
):
    """It once printed nothing for 7 minutes while the supervised CNN trained (stderr is a log here:
    plain lines)."""
    # short fits
    monkeypatch.setattr(
        references, "VOLUME_CNN", dataclasses.replace(references.VOLUME_CNN, steps=20)
    )
    code, err = run_cli(
        capsys,
        "--ckpt",
        "random",
        *TINY,
        "--data_root",
        phantom_dir,
        "--seeds",
        "2",
        "--readouts",
        "mean_pool",
    )
    assert code == 0
    for line in (
        "encode: 10/10 volumes",
        "encoder read-outs: 2/2 splits",
        "hand-made features: 2/2 splits",
        "supervised CNN, split 1 of 2: 20/20 steps",
        "supervised CNN, split 2 of 2: 20/20 steps",
    ):
        assert line in err, err[-2000:]


# A probe.py process that gets Ctrl-C as its second task starts (the first one finished), in a small
# built-in suite
INTERRUPTED_PROBE = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import labels, probe
labels.PHANTOM_SETS["varied"] = (8, *labels.PHANTOM_SETS["varied"][1:])
real_dense_report = probe.dense_report
def dense_report(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return real_dense_report(*args, **kwargs)
probe.dense_report = dense_report
sys.exit(probe.main(sys.argv[2:]))
"""


def test_ctrl_c_keeps_the_tasks_finished_marked_partial_and_says_where(tmp_path):
    out_json, out_png = tmp_path / "probe.json", tmp_path / "probe.png"
    stopped = subprocess.run(
        [
            sys.executable,
            "-c",
            INTERRUPTED_PROBE,
            str(REPO),
            "--ckpt",
            "random",
            *TINY,
            "--device",
            "cpu",
            "--phantom_dir",
            str(tmp_path / "phantoms"),
            "--tasks",
            "lesion,lesion_tokens",
            "--seeds",
            "2",
            "--readouts",
            "mean_pool",
            "--no_reference",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert stopped.returncode == Preempted.exit_code and Preempted.exit_code in EXIT_CODES, (
        stopped.stderr[-3000:]
    )
    assert "Traceback" not in stopped.stderr
    assert (
        stopped.stderr.splitlines()[-1]
        == "preempted: SIGINT: probe.py interrupted; kept the tasks finished "
        f"(lesion), marked partial, in {out_json} and {out_png}"
    )
    report = json.loads(out_json.read_text())
    assert (
        report["partial"] is True
        and report["stopped_by"] == "SIGINT"
        and list(report["tasks"]) == ["lesion"]
    )
    assert "lesion: auroc, 8 volumes" in stopped.stdout and out_png.stat().st_size > 0


@pytest.mark.slow
def test_probe_of_a_checkpoint_reports_intervals_over_seeds(capsys, tmp_path, phantom_dir):
    cfg = load_config(TINY)
    torch.save(
        {"model": VJEPA3D.from_config(cfg).state_dict(), "config": asdict(cfg)}, tmp_path / "c.pt"
    )
    code = probe.main(
        [
            "--ckpt",
            str(tmp_path / "c.pt"),
            "--data_root",
            phantom_dir,
            "--seeds",
            "2",
            "--json",
            str(tmp_path / "probe.json"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    task = json.loads((tmp_path / "probe.json").read_text())["tasks"]["label"]
    assert task["volumes"] == 10 and list(task["class_counts"]) == ["drusen", "fluid", "none"]
    for iv in [
        *(task["encoders"]["encoder"][r]["auroc"] for r in readouts.READOUTS),
        task["supervised"]["auroc"],
        # the floor... and the ceiling and shortcut
        *(task["handmade"][f]["auroc"] for f in references.HANDMADE),
    ]:
        assert len(iv["values"]) == 2 and iv["low"] <= iv["mean"] <= iv["high"]
    assert task["best_handmade"] in references.HANDMADE and isinstance(task["valid"], bool)
    out = capsys.readouterr().out
    assert "depth_rows" in out and "small 3D CNN" in out and "(best hand-made)" in out


@pytest.mark.slow
def test_vs_random_probes_both_encoders_alike_and_plots_the_run(capsys, tmp_path, phantom_dir):
    cfg = load_config(TINY)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.manual_seed(cfg.seed)  # the checkpoint IS the random init: it cannot beat itself
    torch.save(
        {"model": VJEPA3D.from_config(cfg).state_dict(), "config": asdict(cfg)},
        run / "checkpoints" / "step_0000004.pt",
    )
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"split": "probe", "step": s, "probe_auroc": a}) + "\n"
            for s, a in ((2, 0.5), (4, 0.6))
        )
    )
    code = probe.main(
        [
            "--ckpt",
            str(run / "checkpoints"),
            "--data_root",
            phantom_dir,
            "--seeds",
            "2",
            "--vs_random",
            "--json",
            str(tmp_path / "p.json"),
            "--plot",
            str(tmp_path / "p.png"),
            "--device",
            "cpu",
            "--no_reference",
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["ckpt"].endswith("step_0000004.pt")
    task = report["tasks"]["label"]
    assert task["encoders"]["pretrained"] == task["encoders"]["random"]
    assert {
        r: v["random"]["beats"] for r, v in task["versus"]["pretrained"].items()
    } == dict.fromkeys(readouts.READOUTS, False)
    assert "handmade" not in task and "supervised" not in task  # --no_reference
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "BEATS" not in capsys.readouterr().out


def test_end_of_run_verdict_compares_with_a_random_init_and_hand_made_features_on_the_same_splits(
    phantom_dir,
):
    cfg = load_config(TINY + ["--probe_labels", f"{phantom_dir}/labels.csv"])
    probe_set = runprobe.prepare_probe_set(cfg)
    torch.manual_seed(cfg.seed)
    same_as_random = runprobe.verdict(VJEPA3D.from_config(cfg), cfg, probe_set, "cpu", seeds=3)
    for r in same_as_random["readouts"].values():
        assert r["pretrained"] == r["random"] and not r["beats_random"]
        assert r["vs_handmade"]["values"] == list(
            np.subtract(r["pretrained"]["values"], r["handmade"]["values"])
        )
    shares = same_as_random["position_share"]
    assert shares["pretrained"] == shares["random"] and 0 < shares["random"] < 1
    collapsed = runprobe.verdict(collapsed_model(cfg), cfg, probe_set, "cpu", seeds=3)
    for r in collapsed["readouts"].values():
        assert r["pretrained"]["mean"] == 0.5 and not r["beats_random"] and not r["beats_handmade"]
    assert collapsed["best_handmade"] in references.HANDMADE


def test_train_summary_says_whether_the_encoder_beats_a_random_init_and_hand_made_features(
    tmp_path, smoke_phantoms, phantom_dir, capsys
):
    import train

    smoke = str(Path(__file__).parents[1] / "configs" / "smoke.yaml")
    code = train.main(
        [
            "--config",
            smoke,
            *phantom_flags(smoke_phantoms),
            "--out_dir",
            str(tmp_path),
            "--run_name",
            "r",
            "--max_steps",
            "3",
            "--summary_probe",
            "true",
            "--probe_labels",
            f"{phantom_dir}/labels.csv",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "probe attentive" in out and "vs random init" in out and "vs hand-made" in out
    assert "probe depth_rows" not in out  # a line that read chance on the demo and said nothing
    assert "position share" in out and "verdict" in out and "a random init; " in out
    events = [json.loads(line) for line in open(tmp_path / "r" / "events.jsonl")]
    verdict = [e for e in events if e["event"] == "summary_probe"]
    assert len(verdict) == 1 and set(verdict[0]["readouts"]) == set(runprobe.VERDICT_READOUTS)


def test_the_verdict_never_says_beats_when_hand_made_features_do_better():
    """The old demo printed BEATS on a task a histogram solved (0.982 against its 0.77)."""
    from runlog import verdict_line

    iv = lambda m: {"mean": m, "low": m - 0.02, "high": m + 0.02, "values": [m] * 5}  # noqa: E731
    result = {
        "task": "plain_lesion (240 volumes)",
        "best_handmade": "histogram",
        "shortcut_free": False,
        "readouts": {
            "attentive": {
                "pretrained": iv(0.77),
                "random": iv(0.57),
                "handmade": iv(0.98),
                "vs_random": iv(0.2),
                "vs_handmade": iv(-0.21),
                "beats_random": True,
                "beats_handmade": False,
            }
        },
    }
    line = verdict_line(result)
    assert (
        "BEATS" not in line and "does not beat hand-made features" in line and "says little" in line
    )


# --------------------------------------------------------------------------------------------------
# The suite: tasks that need 3D structure, the shortcut and the ceiling
# --------------------------------------------------------------------------------------------------


def lesion_volumes(eye_of, n=96, kinds=VARIED_LABELS):
    """n normalized volumes [n,1,16,64,64] with lesions in every other one (labels [n]: 1 = lesion),
    eye_of(i) the eye of volume i, the labels `kinds` in turn."""
    volumes, labels = [], []
    for i in range(n):
        label = kinds[i % len(kinds)]
        v = torch.from_numpy(
            synth_reflectivity((16, 64, 64), np.random.default_rng([9, i]), label, eye_of(i))
        )
        volumes.append(((v - v.mean()) / v.std())[None])
        labels.append(int(label != "none"))
    return torch.stack(volumes), np.array(labels)


def best_handmade_auroc(volumes, labels) -> float:
    scores = references.handmade_scores(volumes, labels, seeds=range(2))
    return max(s["auroc"]["mean"] for s in scores.values())


def test_handmade_features_read_lesions_that_sit_at_one_depth():
    """The shortcut of the plain phantoms: the retina at one depth, so the lesions change the same
    rows."""
    volumes, labels = lesion_volumes(
        lambda i: Eye(lesion_height=draw_eye(np.random.default_rng(0)).lesion_height)
    )
    assert best_handmade_auroc(volumes, labels) > 0.95


def test_handmade_features_are_near_chance_on_the_varied_lesion_task():
    """The same lesions in varied eyes (position, tilt, brightness, speckle...): no shortcut
    left."""
    volumes, labels = lesion_volumes(lambda i: draw_eye(np.random.default_rng([9, i, 11])))
    assert best_handmade_auroc(volumes, labels) < references.VALID_SHORTCUT_MAX


def test_handmade_features_are_near_chance_on_the_inner_lesion_task():
    """Foci and cysts of the inner retina in the same varied eyes: small and scattered, no global
    cue either."""
    volumes, labels = lesion_volumes(
        lambda i: draw_eye(np.random.default_rng([9, i, 11])), kinds=INNER_VARIED_LABELS
    )
    assert best_handmade_auroc(volumes, labels) < probe.VALID_SHORTCUT_MAX


def test_the_inner_lesion_task_has_its_own_balanced_set_apart_from_the_others(
    tmp_path, monkeypatch
):
    n, seed, varied, lesions = labels.PHANTOM_SETS["inner"]
    assert varied and lesions == "inner" and n == labels.INNER_PHANTOMS
    # no seed of another set or pretraining
    assert len({s for _, s, _, _ in labels.PHANTOM_SETS.values()} | {0}) == 4
    assert [t.name for t in probe.SUITE["inner"]] == ["inner_lesion", "inner_lesion_tokens"]
    monkeypatch.setitem(labels.PHANTOM_SETS, "inner", (8, seed, varied, lesions))
    cfg = load_config(TINY + ["--phantom_dir", str(tmp_path / "phantoms")])
    [(csv_path, tasks)] = probe.suite_sets(cfg, None, ["inner_lesion"])
    assert csv_path == str(tmp_path / "phantoms_inner" / "labels.csv") and [
        t.name for t in tasks
    ] == ["inner_lesion"]
    rows = labels.read_label_rows(csv_path, "")
    assert {r["label"] for r in rows} == {"none", "foci", "cysts"}
    targets, names = labels.task_targets(np.array([r[tasks[0].column] for r in rows]))
    assert names == ["no", "yes"] and list(np.bincount(targets)) == [4, 4]


@pytest.fixture(scope="module")
def varied_set(tmp_path_factory) -> str:
    return write_phantom_set(
        str(tmp_path_factory.mktemp("varied") / "set"), n=8, shape=(8, 32, 32), varied=True
    )


def test_suite_tasks_have_balanced_labels_and_reproducible_splits(varied_set, tmp_path):
    rows = {
        c: labels.read_label_table(f"{varied_set}/labels.csv", (c,)).values[c] for c in ("lesion",)
    }
    for task in probe.SUITE["varied"]:
        targets, names = labels.task_targets(rows[task.column])
        assert names == ["no", "yes"] and list(np.bincount(targets)) == [4, 4]  # balanced
        train, test = readouts.probe_split(targets, seed=0)
        again = readouts.probe_split(targets, seed=0)
        assert (
            np.array_equal(train, again[0])
            and np.array_equal(test, again[1])
            and not set(train) & set(test)
        )
    other = write_phantom_set(str(tmp_path / "again"), n=8, shape=(8, 32, 32), varied=True)
    assert open(f"{other}/labels.csv").read() == open(f"{varied_set}/labels.csv").read()


def test_a_checkpoint_is_probed_with_its_own_phantom_folder_unless_one_is_given():
    ckpt_cfg = load_config(TINY + ["--phantom_dir", "runs/elsewhere/phantoms", "--device", "cuda"])
    cli = load_config(["--phantom_dir", "mine", "--device", "cpu"])
    kept = probe.checkpoint_probe_config(ckpt_cfg, load_config([]), given=set())
    # this machine's device
    assert kept.phantom_dir == "runs/elsewhere/phantoms" and kept.device == "auto"
    given = probe.checkpoint_probe_config(ckpt_cfg, cli, given={"phantom_dir", "device"})
    assert (
        given.phantom_dir == "mine"
        and given.device == "cpu"
        and given.embed_dim == ckpt_cfg.embed_dim
    )
