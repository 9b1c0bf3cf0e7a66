"""probe.py: linear probes on frozen target-encoder features, the evidence that pretraining learned something."""
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import probe
from config import load_config
from model import VJEPA3D, feature_std
from probe import rankme

TINY = ["--image_size", "8,32,32", "--patch_size", "4,8,8", "--embed_dim", "24", "--depth", "1", "--num_heads", "2",
        "--pred_embed_dim", "12", "--pred_depth", "1", "--pred_num_heads", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    """The probes here fit tiny tensors, where OpenMP threads only spin on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert probe.classification_scores(np.full((30, 3), 1 / 3), labels) == {"auroc": 0.5, "balanced_accuracy": 1 / 3}
    assert probe.classification_scores(np.eye(3)[labels], labels) == {"auroc": 1.0, "balanced_accuracy": 1.0}
    two = np.array([0, 0, 1, 1])
    assert probe.classification_scores(np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]]), two)["auroc"] == 1.0


def test_interval_is_a_t_interval_over_seeds():
    iv = probe.interval([0.6, 0.7, 0.8])
    assert iv["mean"] == pytest.approx(0.7)
    assert iv["high"] - iv["mean"] == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-3)  # t(0.975, 2 dof) = 4.303
    assert probe.interval([0.5] * 4)["low"] == probe.interval([0.5] * 4)["high"] == 0.5
    assert probe.interval([0.5])["high"] == math.inf


def test_stratified_split_holds_out_every_class_and_changes_with_the_seed():
    labels = np.array([0] * 10 + [1] * 5 + [2] * 2)
    train, test = probe.stratified_split(labels, 0.4, seed=0)
    assert sorted(np.concatenate([train, test])) == list(range(17))
    assert set(labels[train]) == set(labels[test]) == {0, 1, 2}
    assert list(np.bincount(labels[test])) == [4, 2, 1]
    assert not np.array_equal(test, probe.stratified_split(labels, 0.4, seed=1)[1])


def test_probes_find_a_label_carried_by_a_few_tokens():
    tokens, labels = tokens_with_signal()
    report = probe.probe_scores(tokens, labels, seeds=range(2))
    assert report["mean_pool"]["auroc"]["mean"] > 0.9
    assert report["attentive"]["auroc"]["mean"] > 0.9


def test_linear_probe_scores_near_one_on_a_trivially_separable_set():
    labels = np.repeat(np.arange(3), 20)
    pooled = np.eye(3)[labels] * 5 + np.random.default_rng(0).normal(0, 0.3, (60, 3))  # [M, E]: the class, plus noise
    train, test = probe.stratified_split(labels, probe.TEST_FRACTION, seed=0)
    scores = probe.linear_probe(pooled, labels, train, test)
    assert scores["auroc"] > 0.99 and scores["balanced_accuracy"] > 0.95


def test_probe_on_constant_features_scores_chance():
    _, labels = tokens_with_signal()
    tokens = torch.ones(len(labels), 32, 16)  # a collapsed encoder: the same features for every volume
    report = probe.probe_scores(tokens, labels, seeds=range(2))
    for name in ("mean_pool", "attentive"):
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
    train_idx, test_idx = probe.stratified_split(labels, probe.TEST_FRACTION, seed=0)
    probe_set = probe.ProbeSet(volumes.half(), labels, ["a", "b"], train_idx, test_idx)

    healthy = probe.probe_auroc(VJEPA3D.from_config(cfg), probe_set, "cpu")
    collapsed_model_ = collapsed_model(cfg)
    collapsed = probe.probe_auroc(collapsed_model_, probe_set, "cpu")
    assert healthy["probe_auroc"] > 0.9
    assert collapsed == {"probe_auroc": 0.5, "probe_bal_acc": 0.5}
    tokens = collapsed_model_.encode(volumes[:4].float())
    assert float(feature_std(tokens)) < 1e-6
    assert rankme(tokens.flatten(0, 1)) < 1.5  # 1 = every token the same vector


def test_probe_auroc_leaves_the_model_as_it_found_it(phantom_dir):
    cfg = load_config(TINY)
    probe_set = probe.prepare_probe_set(cfg, f"{phantom_dir}/labels.csv")
    assert probe_set.volumes.dtype == torch.float16 and probe_set.volumes.shape == (10, 1, 8, 32, 32)
    assert probe_set.classes == ["drusen", "fluid", "none"]
    model = VJEPA3D.from_config(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scores = probe.probe_auroc(model, probe_set, "cpu")
    assert set(scores) == {"probe_auroc", "probe_bal_acc"} and 0 <= scores["probe_auroc"] <= 1
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_labels_may_hold_series_folders_and_absolute_paths(tmp_path):
    rows = [("/abs/a.dcm", "x"), ("sub/b", "y")]
    (tmp_path / "labels.csv").write_text("path,label\n" + "".join(f"{p},{l}\n" for p, l in rows))
    assert probe.read_labels(str(tmp_path / "labels.csv")) == [("/abs/a.dcm", "x"), (str(tmp_path / "sub/b"), "y")]


def test_unreadable_labelled_files_are_counted_by_reason(tmp_path, phantom_dir):
    lines = open(f"{phantom_dir}/labels.csv").read().splitlines()
    lines = [lines[0]] + [f"{phantom_dir}/{line}" for line in lines[1:]] + ["missing.dcm,none"]
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "missing.dcm").write_bytes(b"")
    _, labels, _, skipped = probe.load_labelled_volumes(load_config(TINY), str(tmp_path / "labels.csv"))
    assert len(labels) == 10 and skipped == {"empty_file": 1}


# ----------------------------------------------------------------------------------------------------------
# Command line: clear errors (exit 2) and a report
# ----------------------------------------------------------------------------------------------------------

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
    state = {"model": VJEPA3D.from_config(cfg).state_dict(), "config": {**asdict(cfg), "embed_dim": 48}}
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
    first = open(f"{phantom_dir}/labels.csv").read().splitlines()[1].split(",")[0]
    (tmp_path / "labels.csv").write_text(f"path,label\n{phantom_dir}/{first},none\n{phantom_dir}/{first},none\n")
    code, err = run_cli(capsys, "--ckpt", "random", "--labels", str(tmp_path / "labels.csv"), *TINY)
    assert code == 2 and "two classes" in err


@pytest.mark.slow
def test_probe_of_a_checkpoint_reports_intervals_over_seeds(capsys, tmp_path, phantom_dir):
    cfg = load_config(TINY)
    torch.save({"model": VJEPA3D.from_config(cfg).state_dict(), "config": asdict(cfg)}, tmp_path / "c.pt")
    code = probe.main(["--ckpt", str(tmp_path / "c.pt"), "--data_root", phantom_dir, "--seeds", "2",
                       "--json", str(tmp_path / "probe.json"), "--device", "cpu"])
    assert code == 0
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["volumes"] == 10 and report["classes"] == ["drusen", "fluid", "none"]
    for name in ("mean_pool", "attentive"):
        auroc = report[name]["auroc"]
        assert len(auroc["values"]) == 2 and auroc["low"] <= auroc["mean"] <= auroc["high"]
    assert "mean_pool" in capsys.readouterr().out


@pytest.mark.slow
def test_vs_random_probes_both_encoders_alike_and_plots_the_run(capsys, tmp_path, phantom_dir):
    cfg = load_config(TINY)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.manual_seed(cfg.seed)  # the checkpoint IS the random init: it cannot beat itself
    torch.save({"model": VJEPA3D.from_config(cfg).state_dict(), "config": asdict(cfg)},
               run / "checkpoints" / "step_0000004.pt")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"split": "probe", "step": s, "probe_auroc": a}) + "\n"
                                               for s, a in ((2, 0.5), (4, 0.6))))
    code = probe.main(["--ckpt", str(run / "checkpoints"), "--data_root", phantom_dir, "--seeds", "2", "--vs_random",
                       "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"), "--device", "cpu"])
    assert code == 0
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["ckpt"].endswith("step_0000004.pt")
    assert report["pretrained"] == report["random"]
    assert report["beats_random"] == {"mean_pool": False, "attentive": False}
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "does NOT beat" in capsys.readouterr().out


def test_end_of_run_verdict_compares_with_a_random_init_on_the_same_splits(phantom_dir):
    cfg = load_config(TINY)
    probe_set = probe.prepare_probe_set(cfg, f"{phantom_dir}/labels.csv")
    torch.manual_seed(cfg.seed)
    same_as_random = probe.compare_with_random(VJEPA3D.from_config(cfg), cfg, probe_set, "cpu", seeds=3)
    assert same_as_random["pretrained"] == same_as_random["random"] and not same_as_random["beats_random"]
    collapsed = probe.compare_with_random(collapsed_model(cfg), cfg, probe_set, "cpu", seeds=3)
    assert collapsed["pretrained"]["mean"] == 0.5 and not collapsed["beats_random"]


def test_train_summary_says_whether_the_encoder_beats_a_random_one(tmp_path, smoke_phantoms, phantom_dir, capsys):
    import train
    smoke = str(Path(__file__).parents[1] / "configs" / "smoke.yaml")
    code = train.main(["--config", smoke, "--phantom_dir", smoke_phantoms, "--out_dir", str(tmp_path), "--run_name", "r",
                       "--max_steps", "3", "--summary_probe", "true",
                       "--probe_labels", f"{phantom_dir}/labels.csv"])
    assert code == 0
    assert "vs random init" in capsys.readouterr().out
    events = [json.loads(line) for line in open(tmp_path / "r" / "events.jsonl")]
    verdict = [e for e in events if e["event"] == "summary_probe"]
    assert len(verdict) == 1 and set(verdict[0]) >= {"pretrained", "random", "beats_random"}
