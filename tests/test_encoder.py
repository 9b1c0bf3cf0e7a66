"""encoder.py and model.load_encoder: a researcher exports the encoder of a real training run, loads it from plain
Python, embeds a folder or bucket (killed and resumed), and looks at its features."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

import encoder as encoder_cli
from data import load_val_sample
from index import find_files, scan_files
from model import ExportError, load_encoder, random_encoder, save_encoder
from probe import read_model_checkpoint
from test_probe import one_thread  # noqa: F401 (autouse: tiny models, one thread)

REPO = Path(__file__).resolve().parents[1]


def test_export_then_load_gives_the_training_target_encoders_tokens(export_dir, trained_checkpoint):
    trained, cfg, state = read_model_checkpoint(trained_checkpoint)
    encoder = load_encoder(export_dir)
    volume = torch.randn(3, 1, *cfg.image_size, generator=torch.Generator().manual_seed(1))
    assert float((encoder.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    assert torch.equal(encoder.embed(volume), encoder.encode(volume).mean(1))
    config = json.loads(Path(export_dir, "config.json").read_text())
    assert config["source"]["checkpoint"] == os.path.basename(trained_checkpoint)  # the newest step; no folder
    assert config["source"]["update"] == 4 and config["source"]["plan"]["total_steps"] == 4
    assert config["preprocessing"]["image_size"] == cfg.image_size == encoder.image_size
    assert config["preprocessing"]["clip_percentiles"] == cfg.clip_percentiles
    assert encoder.settings.flip_prob == cfg.flip_prob and encoder.settings.patch_size == cfg.patch_size


def test_axial_pooling_keeps_each_depth_row_and_averages_to_the_mean_pool(export_dir):
    encoder = load_encoder(export_dir)
    volume = torch.randn(2, 1, *encoder.image_size, generator=torch.Generator().manual_seed(2))
    gh, width = encoder.grid[1], encoder.embed_dim
    axial = encoder.embed(volume, "axial")  # [B, gh*E]
    assert axial.shape == (2, gh * width) == (2, encoder.embedding_size("axial"))
    torch.testing.assert_close(axial.view(2, gh, width).mean(1), encoder.embed(volume, "mean"))


def test_a_volume_of_the_wrong_shape_is_refused_with_both_shapes(export_dir):
    encoder = load_encoder(export_dir)
    with pytest.raises(ValueError, match=r"expected shape \['B', 1, 8, 32, 32\], got \[1, 1, 8, 64, 64\]"):
        encoder(torch.zeros(1, 1, 8, 64, 64))


def rewrite_weights(directory: Path, edit) -> None:
    """Change the tensors of an export and record the new weights' sha256, as a careless user would."""
    tensors = safetensors.torch.load_file(directory / "encoder.safetensors")
    edit(tensors)
    config = json.loads((directory / "config.json").read_text())
    save_encoder(tensors, {k: v for k, v in config.items() if k != "weights"}, str(directory))


def resign(directory: Path, payload: bytes) -> None:
    """Replace an export's weights file and record its sha256 in config.json, as a careless user would."""
    directory.joinpath("encoder.safetensors").write_bytes(payload)
    edit_config(directory, lambda c: c["weights"].update(sha256=hashlib.sha256(payload).hexdigest()))


def edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


TAMPERINGS = {
    "weights changed after export": (
        lambda d: d.joinpath("encoder.safetensors").write_bytes(d.joinpath("encoder.safetensors").read_bytes()[:-4]
                                                                 + b"\0\0\0\0"), "weights.sha256"),
    "a tensor missing": (lambda d: rewrite_weights(d, lambda t: t.pop("blocks.1.mlp.fc2.bias")),
                         "key blocks.1.mlp.fc2.bias is missing"),
    "a tensor too many": (lambda d: rewrite_weights(d, lambda t: t.update(extra=torch.zeros(1))),
                          "unexpected key extra"),
    "a tensor of another shape": (lambda d: rewrite_weights(d, lambda t: t.update({"norm.weight": torch.ones(7)})),
                                  "key norm.weight is torch.float32 [7]"),
    "another architecture": (lambda d: edit_config(d, lambda c: c["architecture"].update(depth=3)),
                             "differs from what its weights were exported with (architecture.depth: 2 -> 3)"),
    "other heads": (lambda d: edit_config(d, lambda c: c["architecture"].update(num_heads=2)),
                    "(architecture.num_heads: 4 -> 2)"),
    "another clip": (lambda d: edit_config(d, lambda c: c["preprocessing"].update(clip_percentiles=[1.0, 99.0])),
                     "(preprocessing.clip_percentiles: [0.5, 99.5] -> [1.0, 99.0])"),
    "an architecture too large to build": (
        lambda d: edit_config(d, lambda c: c["architecture"].update(embed_dim=8192, depth=64, num_heads=64)),
        "architecture.depth: 2 -> 64; architecture.embed_dim: 48 -> 8192; architecture.num_heads: 4 -> 64"),
    "a JSON list": (lambda d: d.joinpath("config.json").write_text("[1, 2]"), "holds a JSON list"),
    "not UTF-8": (lambda d: d.joinpath("config.json").write_bytes(b'{"format": "\xff\xfe"}'), "is not valid JSON"),
    "weights cut short and re-signed": (lambda d: resign(d, d.joinpath("encoder.safetensors").read_bytes()[:-64]),
                                        "cut short or padded"),
    "a field missing": (lambda d: edit_config(d, lambda c: c["architecture"].pop("embed_dim")),
                        "architecture.embed_dim is missing"),
    "an unknown field": (lambda d: edit_config(d, lambda c: c["preprocessing"].update(gamma=2)),
                         "preprocessing.gamma is not a field"),
    "input sizes that disagree": (lambda d: edit_config(d, lambda c: c["preprocessing"].update(image_size=[8, 64, 64])),
                                  "preprocessing.image_size [8, 64, 64] differs from architecture.image_size"),
    "a garbled value": (lambda d: edit_config(d, lambda c: c["preprocessing"].update(clip_percentiles=[99, 1])),
                        "clip_percentiles: [99.0, 1.0] must satisfy"),
    "a newer format": (lambda d: edit_config(d, lambda c: c.update(format_version=99)), "format_version 99"),
    "no config.json": (lambda d: d.joinpath("config.json").unlink(), "config.json not found"),
}


@pytest.mark.parametrize("case", TAMPERINGS)
def test_a_tampered_or_mismatched_export_fails_naming_the_key_or_field(export_dir, tmp_path, case):
    tamper, message = TAMPERINGS[case]
    directory = tmp_path / "encoder"
    shutil.copytree(export_dir, directory)
    tamper(directory)
    with pytest.raises(ExportError, match=re.escape(message)):
        load_encoder(str(directory))


def test_a_tampered_export_stops_a_command_with_exit_2(export_dir, tmp_path, phantom_dir, capsys):
    directory = tmp_path / "encoder"
    shutil.copytree(export_dir, directory)
    TAMPERINGS["a tensor missing"][0](directory)
    assert encoder_cli.main(["embed", "--encoder", str(directory), "--data_root", phantom_dir,
                             "--out", str(tmp_path / "e.npz")]) == 2
    assert "encoder export error: " in capsys.readouterr().err and not (tmp_path / "e.npz").exists()


def test_export_refuses_to_overwrite_an_export_and_config_flags_that_do_not_apply(export_dir, trained_checkpoint,
                                                                                  capsys):
    assert encoder_cli.main(["export", "--ckpt", trained_checkpoint, "--out", export_dir]) == 2
    assert "already holds an export" in capsys.readouterr().err
    assert encoder_cli.main(["embed", "--encoder", export_dir, "--out", "x.npz", "--embed_dim", "8"]) == 2
    assert "--embed_dim: the export brings its own model" in capsys.readouterr().err


def load_npz(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_embed_writes_a_row_per_volume_with_its_identity_and_the_reason_for_each_unusable_file(
        export_dir, phantom_dir, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(phantom_dir, data)
    first = sorted(p for p in os.listdir(data) if p.endswith(".dcm"))[0]
    blob = (data / first).read_bytes()
    (data / "cut.dcm").write_bytes(blob[: len(blob) // 2])  # an interrupted copy
    out = tmp_path / "emb.npz"
    assert encoder_cli.main(["embed", "--encoder", export_dir, "--data_root", str(data), "--out", str(out),
                             "--workers", "0", "--batch_size", "3", "--save_every", "4", "--with_paths"]) == 0
    table = load_npz(out)
    records = [r for r in scan_files(find_files(str(data))) if r["ok"]]
    encoder = load_encoder(export_dir)
    assert len(table["path"]) == len(records) == 10 and table["embedding"].shape == (10, encoder.embed_dim)
    assert list(table["skipped_path"]) == [str(data / "cut.dcm")] and list(table["skipped_reason"]) == ["truncated"]
    assert set(table["laterality"]) <= {"R", "L"} and all(p.startswith("pk1-") for p in table["patient"])
    assert list(table["series"]) == [r["series"] for r in records] and all(s.startswith("1.2.") for s in table["study"])
    assert np.isfinite(table["spacing"]).all() and (table["shape"] > 0).all()
    assert json.loads(str(table["encoder"]))["weights"] == encoder.config["weights"]
    assert not (tmp_path / "emb.npz.partial").exists()
    # each row is what the plain-Python route (README) gives for that path
    for i in (0, 7):
        volume = load_val_sample(str(table["path"][i]), encoder.settings)[None]
        np.testing.assert_allclose(table["embedding"][i], encoder.embed(volume)[0].detach().numpy(), atol=1e-6)
    assert "truncated" in capsys.readouterr().out


def test_embed_refuses_rows_saved_by_another_encoder_and_never_overwrites(export_dir, phantom_dir, tmp_path, capsys):
    out = tmp_path / "emb.npz"
    other = random_encoder(load_encoder(export_dir).config, seed=3)
    save_encoder(other.state_dict(), other.config, str(tmp_path / "other"))
    records = [r for r in scan_files(find_files(phantom_dir)) if r["ok"]]
    encoder_cli.embed_records(load_encoder(str(tmp_path / "other")), records[:2], other.settings,
                              str(out) + ".partial", "mean", 2, 2, encoder_cli.setup_runtime(other.settings))
    flags = ["embed", "--encoder", export_dir, "--data_root", phantom_dir, "--out", str(out), "--workers", "0"]
    assert encoder_cli.main(flags + ["--batch_size", "2", "--save_every", "2"]) == 2
    assert "holds rows embedded with other settings" in capsys.readouterr().err
    out.write_bytes(b"precious")
    assert encoder_cli.main(flags) == 2 and out.read_bytes() == b"precious"


def embed_command(export_dir, data_root, out):
    return [sys.executable, str(REPO / "encoder.py"), "embed", "--encoder", export_dir, "--data_root", data_root,
            "--out", str(out), "--batch_size", "2", "--save_every", "2", "--workers", "0"]


def kill_after_first_chunk(command, partial: Path) -> int:
    """Start the command, SIGKILL it as soon as it has saved its first chunk of rows; the chunks it had saved."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 600
    while not (partial.exists() and any(p.suffix == ".npz" for p in partial.iterdir())):
        assert process.poll() is None, "the embed run ended before it saved anything"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return len([p for p in partial.iterdir() if p.suffix == ".npz"])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_embed_killed_halfway_finishes_the_rest_and_writes_an_uninterrupted_runs_file(
        export_dir, phantom_dir, tmp_path, where, request, capsys):
    data_root = phantom_dir if where == "local" else request.getfixturevalue("gcs_emulator").upload(phantom_dir, "emb")
    reference = tmp_path / "reference.npz"
    assert encoder_cli.main(embed_command(export_dir, data_root, reference)[2:]) == 0
    out = tmp_path / "killed.npz"
    saved = kill_after_first_chunk(embed_command(export_dir, data_root, out), Path(str(out) + ".partial"))
    assert 1 <= saved < 5 and not out.exists()  # 10 volumes in chunks of 2: killed halfway
    capsys.readouterr()
    assert encoder_cli.main(embed_command(export_dir, data_root, out)[2:]) == 0  # the same command, started again
    printed = capsys.readouterr()
    assert f"resuming: {2 * saved} of 10 volumes already embedded" in printed.err
    assert f"{10 - 2 * saved} computed now" in printed.out
    assert out.read_bytes() == reference.read_bytes()


def test_show_draws_pretrained_and_random_features_and_attention(export_dir, phantom_dir, tmp_path):
    out = tmp_path / "show.png"
    assert encoder_cli.main(["show", "--encoder", export_dir, "--labels", f"{phantom_dir}/labels.csv",
                             "--out", str(out)]) == 0
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape[0] > 6 * 150 and image.shape[1] > 1200  # 3 classes x 2 encoders, 6 panels each
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 500  # colours: features, attention, the volumes


def readme_snippet() -> str:
    """The Python block of the README's section on loading an exported encoder."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Export, and load it in plain Python"):]
    return section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python"))]


def test_the_readme_snippet_loads_the_export_without_train_py(export_dir, phantom_dir, tmp_path):
    first = sorted(p for p in os.listdir(phantom_dir) if p.endswith(".dcm"))[0]
    code = readme_snippet().replace("runs/learn/encoder", export_dir).replace("scan.dcm", f"{phantom_dir}/{first}")
    check = ("\nassert tokens.shape == (1, encoder.grid[0] * encoder.grid[1] * encoder.grid[2], encoder.embed_dim)"
             "\nassert embedding.shape == (1, encoder.embed_dim)"
             "\nimport sys; assert 'train' not in sys.modules and 'probe' not in sys.modules, sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code + check], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_encoder_whose_weights_are_nan_is_neither_exported_nor_embedded(trained_checkpoint, export_dir, tmp_path,
                                                                           phantom_dir, capsys):
    ckpt = torch.load(trained_checkpoint, weights_only=True)
    for key in ckpt["model"]:
        if key.startswith("target_encoder.") and ckpt["model"][key].is_floating_point():
            ckpt["model"][key] = torch.full_like(ckpt["model"][key], float("nan"))
    torch.save(ckpt, tmp_path / "diverged.pt")
    assert encoder_cli.main(["export", "--ckpt", str(tmp_path / "diverged.pt"), "--out", str(tmp_path / "e")]) == 2
    assert "holds NaN or inf" in capsys.readouterr().err and not (tmp_path / "e" / "config.json").exists()
    nan_export = tmp_path / "nan_export"  # written by hand, past export's check
    config = json.loads(Path(export_dir, "config.json").read_text())
    weights = {k: torch.full_like(v, float("nan")) for k, v in load_encoder(export_dir).state_dict().items()}
    save_encoder(weights, {k: v for k, v in config.items() if k != "weights"}, str(nan_export))
    assert encoder_cli.main(["embed", "--encoder", str(nan_export), "--data_root", phantom_dir,
                             "--out", str(tmp_path / "e.npz"), "--workers", "0"]) == 2
    assert "NaN or inf embeddings for 10 of 10 volumes" in capsys.readouterr().err
    assert not (tmp_path / "e.npz").exists()
