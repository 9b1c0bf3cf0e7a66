"""finetune.py: a researcher fine-tunes an exported encoder on labelled volumes with patient-level
folds, and gets probe.py's numbers back when asking for probe.py's splits."""

import csv
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

import encoder as encoder_cli
import finetune
import lock
import probe
import readouts
from helpers import REPO, one_thread  # noqa: F401 (one_thread: autouse, tiny models, one thread)
from pretrained import load_encoder, random_encoder
from privacy import volume_key
from readouts import AttentiveProbe


def write_labels(path: Path, phantoms: str, header, row) -> str:
    """A labels CSV over the phantom files of a folder: `row(i, name)` gives each file's values
    after the path."""
    names = sorted(n for n in os.listdir(phantoms) if n.endswith(".dcm"))
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(
            [header] + [[os.path.join(phantoms, n), *row(i, n)] for i, n in enumerate(names)]
        )
    return str(path)


@pytest.fixture
def binary_labels(tmp_path, smoke_phantoms) -> str:
    """16 volumes of 8 patients (2 each); a patient's volumes share its label, 4 patients per
    label."""
    return write_labels(
        tmp_path / "labels.csv",
        smoke_phantoms,
        ["path", "label", "patient"],
        lambda i, _: ["ab"[(i // 2) % 2], f"p{i // 2}"],
    )


def run(argv) -> dict:
    assert finetune.main(argv) == 0
    out = argv[argv.index("--out") + 1]
    return json.loads(Path(out, "report.json").read_text())


@pytest.mark.slow
def test_frozen_probes_reproduce_probe_py_on_its_splits(
    trained_checkpoint, export_dir, binary_labels, tmp_path
):
    assert (
        probe.main(
            [
                "--ckpt",
                trained_checkpoint,
                "--labels",
                binary_labels,
                "--seeds",
                "3",
                "--vs_random",
                "--readouts",
                "mean_pool,attentive",
                "--no_reference",
                "--json",
                str(tmp_path / "probe.json"),
            ]
        )
        == 0
    )
    expected = json.loads((tmp_path / "probe.json").read_text())["tasks"]["label"]["encoders"]
    report = run(
        [
            "--encoder",
            export_dir,
            "--labels",
            binary_labels,
            "--splits",
            "probe",
            "--repeats",
            "3",
            "--modes",
            "frozen",
            "--vs_random",
            "--out",
            str(tmp_path / "ft"),
        ]
    )
    encoder, random = report["arms"]["encoder"], report["arms"]["random init"]
    for name in ("mean_pool", "attentive"):
        for metric in ("auroc", "balanced_accuracy"):
            assert encoder[name][metric]["values"] == expected["pretrained"][name][metric]["values"]
            assert random[name][metric]["values"] == expected["random"][name][metric]["values"]
            differences = [
                a - b
                for a, b in zip(encoder[name][metric]["values"], random[name][metric]["values"])
            ]
            assert report["pretrained_minus_random"][name][metric]["values"] == pytest.approx(
                differences
            )


def test_patient_folds_keep_each_patient_on_one_side_and_every_class_in_each_test_fold():
    rng = np.random.default_rng(0)
    # 1 to 4 volumes per patient
    patients = np.repeat(np.arange(30), rng.integers(1, 5, size=30)).astype(str)
    targets = np.array([int(p) % 3 for p in patients])
    data = finetune.LabelledSet(
        [], targets, ["a", "b", "c"], "multiclass", patients, [""] * len(patients), {}
    )
    folds = finetune.patient_folds(data, 5, seed=0)
    assert sorted(np.concatenate([test for _, test in folds])) == list(range(len(patients)))
    for train, test in folds:
        assert not set(patients[train]) & set(patients[test])
        assert set(targets[test]) == {0, 1, 2}
        fit, val = finetune.validation_split(data, train, 0.2, seed=0)
        assert sorted(np.concatenate([fit, val])) == sorted(train) and not set(patients[fit]) & set(
            patients[val]
        )
    assert [list(t) for _, t in folds] != [
        list(t) for _, t in finetune.patient_folds(data, 5, seed=1)
    ]


def test_layer_wise_lr_decay_gives_deeper_layers_larger_steps_and_spares_norms_and_biases(
    export_dir,
):
    encoder = load_encoder(export_dir)
    model = finetune.Classifier(encoder, [AttentiveProbe(encoder.embed_dim, 3)], multilabel=False)
    groups = finetune.layer_decay_groups(
        model, finetune.FullSettings(layer_decay=0.5, weight_decay=0.05)
    )
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert sorted(scale) == sorted(id(p) for p in named.values())  # every parameter, once
    # the recipe's hmlp: 3 convolutions
    stem = [name for name in named if name.startswith("encoder.patch_embed.")]
    # 2 blocks: stem, blocks, head
    assert len(stem) == 6 and {scale[id(named[name])] for name in stem} == {0.5**3}
    assert {decay[id(named[name])] for name in stem if name.endswith(".weight")} == {0.05}
    assert {decay[id(named[name])] for name in stem if name.endswith(".bias")} == {0.0}
    assert scale[id(named["encoder.blocks.0.attn.qkv.weight"])] == 0.5**2
    assert scale[id(named["encoder.blocks.1.attn.qkv.weight"])] == 0.5
    assert scale[id(named["encoder.norm.weight"])] == scale[id(named["heads.0.head.weight"])] == 1.0
    assert decay[id(named["encoder.blocks.1.mlp.fc1.weight"])] == 0.05
    assert (
        decay[id(named["encoder.blocks.1.mlp.fc1.bias"])]
        == decay[id(named["encoder.norm.weight"])]
        == 0.0
    )


@pytest.mark.slow
def test_full_finetuning_keeps_each_folds_best_model_which_loads_and_scores_as_reported(
    export_dir, binary_labels, tmp_path
):
    out = tmp_path / "ft"
    report = run(
        [
            "--encoder",
            export_dir,
            "--labels",
            binary_labels,
            "--modes",
            "full",
            "--folds",
            "2",
            "--epochs",
            "4",
            "--patience",
            "1",
            "--batch_size",
            "4",
            "--out",
            str(out),
        ]
    )
    folds = report["arms"]["encoder"]["full"]["folds"]
    assert [(f["repeat"], f["fold"]) for f in folds] == [(0, 0), (0, 1)]
    patients = {
        volume_key(row["path"]): row["patient"] for row in csv.DictReader(open(binary_labels))
    }
    for f in folds:
        # stopped 1 epoch after its best, or at 4
        assert f["best_epoch"] <= f["epochs"] <= min(4, f["best_epoch"] + 1)
        # epoch 0: the probe heads alone
        assert [h["epoch"] for h in f["history"]] == list(range(f["epochs"] + 1))
        saved = json.loads((out / "full" / f"r0_f{f['fold']}" / "fold.json").read_text())
        parts = [
            {patients[v] for v in saved[f"{part}_volumes"]} for part in ("train", "val", "test")
        ]
        assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    directory = out / "full" / "r0_f1"
    encoder = load_encoder(str(directory))
    model = finetune.Classifier(encoder, [AttentiveProbe(encoder.embed_dim, 2)], multilabel=False)
    model.heads.load_state_dict(safetensors.torch.load_file(directory / "heads.safetensors"))
    data = finetune.load_labelled_set(binary_labels, model.encoder.settings)
    saved = json.loads((directory / "fold.json").read_text())
    keys = [volume_key(p, os.path.dirname(os.path.abspath(binary_labels))) for p in data.paths]
    test = np.array([keys.index(v) for v in saved["test_volumes"]])
    val = np.array([keys.index(v) for v in saved["val_volumes"]])
    probs, _ = finetune.predict(model, data, test, model.encoder.settings, 4, "cpu")
    assert finetune.task_scores(probs, data.targets[test], "binary")["auroc"] == pytest.approx(
        folds[1]["auroc"]
    )
    assert finetune.predict(model, data, val, model.encoder.settings, 4, "cpu")[1] == pytest.approx(
        saved["val_loss"]
    )


@pytest.mark.slow
def test_the_labelled_volumes_wait_on_disk_not_in_memory(export_dir, binary_labels):
    settings = load_encoder(export_dir).settings
    finetune.load_labelled_set(binary_labels, settings)  # the reader's imports and caches, once
    tracemalloc.start()  # numpy's arrays are traced
    data = finetune.load_labelled_set(binary_labels, settings)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    volumes = sum(data.prepared[i].nbytes for i in range(len(data.paths)))
    # before: all of them and more; memory flat in their number
    assert held < volumes, (held, volumes)


def test_multi_label_csv_is_read_with_a_column_per_class_and_scored_per_class(
    export_dir, smoke_phantoms, tmp_path
):
    labels = write_labels(
        tmp_path / "multi.csv",
        smoke_phantoms,
        ["path", "drusen", "fluid", "patient"],
        lambda i, _: [(i // 2) % 2, (i // 4) % 2, f"p{i // 2}"],
    )
    report = run(
        [
            "--encoder",
            export_dir,
            "--labels",
            labels,
            "--folds",
            "2",
            "--epochs",
            "2",
            "--batch_size",
            "4",
            "--out",
            str(tmp_path / "ft"),
        ]
    )
    assert report["task"] == "multilabel" and report["classes"] == ["drusen", "fluid"]
    for mode in ("mean_pool", "attentive", "full"):
        for fold in report["arms"]["encoder"][mode]["folds"]:
            assert 0.0 <= fold["auroc"] <= 1.0 and 0.0 <= fold["balanced_accuracy"] <= 1.0


def test_bad_labels_and_too_many_folds_stop_with_a_message_naming_the_fix(
    export_dir, smoke_phantoms, binary_labels, tmp_path, capsys
):
    flags = ["--encoder", export_dir, "--out", str(tmp_path / "ft"), "--modes", "frozen"]
    two = write_labels(
        tmp_path / "two.csv", smoke_phantoms, ["path", "drusen"], lambda i, _: [i % 3]
    )
    assert finetune.main(flags + ["--labels", two]) == 2
    assert "the class columns (drusen) must hold 1 or 0" in capsys.readouterr().err
    assert finetune.main(flags + ["--labels", binary_labels, "--folds", "9"]) == 2
    assert "9 folds need at least 9 patients and a class" in capsys.readouterr().err
    assert finetune.main(flags + ["--labels", binary_labels, "--embed_dim", "8"]) == 2
    assert "the config flags that finetune.py takes: --device, --seed" in capsys.readouterr().err


def test_intervals_of_scores_stay_in_their_range_when_a_few_folds_vary_wildly():
    """Three folds of a small set score AUROC 1.0, 0.4 and 0.75: their t-interval would run from
    -0.03 to 1.46. The table a user reads keeps AUROC and balanced accuracy in [0, 1] and their
    paired differences in [-1, 1]."""

    def arm(aurocs, accuracies):
        return finetune.summarize(
            {
                "attentive": [
                    {"auroc": a, "balanced_accuracy": b} for a, b in zip(aurocs, accuracies)
                ]
            }
        )

    encoder, random = (
        arm((1.0, 0.4, 0.75), (1.0, 0.5, 0.75)),
        arm((0.0, 0.6, 0.25), (0.5, 0.5, 0.5)),
    )
    report = {
        "fold_count": 3,
        "splits": "kfold",
        "volumes": 12,
        "patients": 6,
        "task": "binary",
        "arms": {"encoder": encoder, "random init": random},
        "pretrained_minus_random": finetune.paired_differences(encoder, random),
    }
    table = finetune.format_report(report)
    assert "encoder        attentive   0.717 [ 0.000,  1.000]     0.750 [ 0.129,  1.000]" in table
    assert "enc - random   attentive  +0.433 [-1.000, +1.000]    +0.250 [-0.371, +0.871]" in table
    # probe.py's intervals over seeds too; a value that is not a score keeps its whole t-interval
    seeds = readouts.intervals([{"auroc": a} for a in (1.0, 0.4, 0.75)])["auroc"]
    assert (seeds["low"], seeds["high"]) == (0.0, 1.0)
    assert readouts.interval([1.0, 0.4, 0.75])["high"] == pytest.approx(1.465, abs=1e-3)
    # one seed: the whole range instead of an infinite interval; as before, it beats nothing and
    # nothing beats it
    one = readouts.intervals([{"auroc": 0.9}])["auroc"]
    assert (one["low"], one["high"]) == (0.0, 1.0)
    assert not readouts.beats(one, seeds) and not readouts.beats(seeds, one)


def test_a_checkpoint_given_as_encoder_gets_the_export_command_that_makes_one(
    trained_checkpoint, binary_labels, tmp_path, capsys
):
    """`finetune.py --encoder runs/demo/checkpoints` (a training run's checkpoints, not an export)
    prints the export command; run as printed, it writes runs/demo/encoder, which finetune.py then
    loads."""
    run_dir = tmp_path / "runs" / "demo"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(trained_checkpoint, run_dir / "checkpoints")
    flags = [
        "--labels",
        binary_labels,
        "--out",
        str(tmp_path / "ft"),
        "--modes",
        "frozen",
        "--folds",
        "2",
    ]
    commands = []
    for given in (
        run_dir / "checkpoints",
        run_dir / "checkpoints" / os.path.basename(trained_checkpoint),
    ):
        assert finetune.main(["--encoder", str(given), *flags]) == 2
        err = capsys.readouterr().err
        commands.append(shlex.split(err.split("`")[1]))
        export = [
            "python",
            "encoder.py",
            "export",
            "--ckpt",
            str(given),
            "--out",
            str(run_dir / "encoder"),
        ]
        assert commands[-1] == export
        assert f"then give --encoder {run_dir / 'encoder'}" in err
    assert encoder_cli.main(commands[0][2:]) == 0  # the folder's command, as printed
    assert finetune.load_export(str(run_dir / "encoder")).config["source"][
        "checkpoint"
    ] == os.path.basename(trained_checkpoint)


def test_random_init_is_the_architecture_initialised_as_pretraining_starts(export_dir):
    encoder = load_encoder(export_dir)
    a, b = random_encoder(encoder.config, seed=0), random_encoder(encoder.config, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # 4 updates moved every tensor of the trained encoder off the init (its norm weights by about
    # 2e-6)
    assert not torch.equal(a.norm.weight, encoder.norm.weight)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, encoder.blocks[0].attn.qkv.weight)
    assert a.config["source"] == {"encoder": "random init", "seed": 0} and "weights" not in a.config


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_a_killed_or_preempted_finetuning_resumes_from_its_folds_and_leaves_no_patient_pixels_behind(
    export_dir, binary_labels, tmp_path, stop, capsys
):
    flags = [
        sys.executable,
        str(REPO / "finetune.py"),
        "--encoder",
        export_dir,
        "--labels",
        binary_labels,
        "--modes",
        "frozen,full",
        "--folds",
        "2",
        "--epochs",
        "8",
        "--patience",
        "8",
        "--batch_size",
        "4",
    ]
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    here = lock.this_machine()  # a live fine-tuning's folder (this process's) is kept
    live = (
        tmp_path
        / "tmp"
        / f"{finetune.TMP_PREFIX}{os.getpid()}.{lock.process_started(os.getpid())}.pid{here['pid_namespace'][5:-1]}.{here['boot_id']}-live"
    )
    live.mkdir()
    (tmp_path / "a_file").write_text("")
    # in this process
    assert finetune.main([*flags[2:], "--out", str(tmp_path / "a_file" / "ft")]) == 2
    assert "cannot write into" in capsys.readouterr().err
    out = tmp_path / "ft"
    first = subprocess.Popen(
        [*flags, "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    fold_0 = out / "folds" / "encoder-full-r0_f0.json"
    # the second fold's 8 epochs leave the signal time to land in it on a loaded machine
    while not fold_0.exists():
        assert first.poll() is None, "the fine-tuning ended before its first fold"
        time.sleep(0.05)
    first.send_signal(getattr(signal, stop))  # in the second fold
    err = first.communicate(timeout=300)[1]
    left = sorted(p.name for p in (tmp_path / "tmp").iterdir() if p != live)
    if stop == "SIGTERM":  # the preemption handling: exit 75, its folder removed by itself
        assert first.returncode == 75 and "preempted: SIGTERM" in err and "Traceback" not in err, (
            err[-2000:]
        )
        assert left == []
    else:
        # kill -9: no clean-up ran
        assert len(left) == 1 and left[0].startswith(finetune.TMP_PREFIX)
    written = fold_0.read_text()
    assert not (out / "report.json").exists()
    again = subprocess.run(
        [*flags, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    # fold 0 not trained again
    assert "repeat 0 fold 0" not in again.stderr and "repeat 0 fold 1" in again.stderr
    folds = json.loads((out / "report.json").read_text())["arms"]["encoder"]["full"]["folds"]
    assert folds[0] == json.loads(written)["result"] and [f["fold"] for f in folds] == [0, 1]
    # the killed run's pixels are gone
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [live.name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_signal_while_finetuning_starts_is_a_preemption_too(
    export_dir, binary_labels, tmp_path, sig
):
    """A preemption can come at any time, also in the seconds finetune.py spends importing torch (it
    once died there of the signal: exit 143 in a shell, no message): exit 75, and the same command
    runs it."""
    out = tmp_path / "ft"
    started = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "finetune.py"),
            "--encoder",
            export_dir,
            "--labels",
            binary_labels,
            "--out",
            str(out),
            "--modes",
            "frozen",
            "--folds",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    maps = Path(f"/proc/{started.pid}/maps")
    while started.poll() is None and "libtorch" not in maps.read_text():  # it is importing torch
        time.sleep(0.01)
    started.send_signal(sig)
    err = started.communicate(timeout=300)[1]
    assert started.returncode == 75, err[-2000:]
    assert f"preempted: {signal.Signals(sig).name}" in err and "Traceback" not in err
    assert not (out / "report.json").exists()
