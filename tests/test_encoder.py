"""encoder.py and pretrained.load_encoder: a researcher exports the encoder of a real training run,
loads it from plain Python, embeds a folder or bucket (killed and resumed), and looks at its
features."""

import inspect
import itertools
import hashlib
import json
import os
import re
import shlex
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
import export
import finetune
import runlog
import model
import octjepa_encoder
import pretrained
import train
from config import DEMO_FLAGS, ConfigError, load_config
from data import load_val_sample
from helpers import (
    one_thread,  # noqa: F401 (autouse: tiny models in one thread)
    phantom_flags,
)
from index import find_files, read_volume, scan_files
from labels import read_label_table
from model import Encoder
from pretrained import ExportError, load_encoder, random_encoder, save_encoder
from checkpoint import read_model_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_export_then_load_gives_the_training_target_encoders_tokens(export_dir, trained_checkpoint):
    trained, cfg, state = read_model_checkpoint(trained_checkpoint)
    encoder = load_encoder(export_dir)
    volume = torch.randn(3, 1, *cfg.image_size, generator=torch.Generator().manual_seed(1))
    assert float((encoder.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    assert torch.equal(encoder.embed(volume), encoder.encode(volume).mean(1))
    config = json.loads(Path(export_dir, "config.json").read_text())
    # the newest step; no folder
    assert config["source"]["checkpoint"] == os.path.basename(trained_checkpoint)
    assert config["source"]["update"] == 4 and config["source"]["plan"]["total_steps"] == 4
    assert config["preprocessing"]["image_size"] == cfg.image_size == encoder.image_size
    assert config["preprocessing"]["clip_percentiles"] == cfg.clip_percentiles
    assert (
        encoder.settings.flip_prob == cfg.flip_prob
        and encoder.settings.patch_size == cfg.patch_size
    )


def test_axial_pooling_keeps_each_depth_row_and_averages_to_the_mean_pool(export_dir):
    encoder = load_encoder(export_dir)
    volume = torch.randn(2, 1, *encoder.image_size, generator=torch.Generator().manual_seed(2))
    gh, width = encoder.grid[1], encoder.embed_dim
    axial = encoder.embed(volume, "depth_rows")  # [B, gh*E]
    assert axial.shape == (2, gh * width) == (2, encoder.embedding_size("depth_rows"))
    torch.testing.assert_close(axial.view(2, gh, width).mean(1), encoder.embed(volume, "mean_pool"))


def test_a_volume_that_is_not_a_multiple_of_the_patch_size_is_refused_naming_the_sizes(export_dir):
    encoder = load_encoder(export_dir)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "multiples of the patch size [4, 8, 8] (trained on [8, 32, 32]), got [1, 1, 8, 36, 32]"
        ),
    ):
        encoder(torch.zeros(1, 1, 8, 36, 32))


def test_another_input_size_gives_the_tokens_of_an_encoder_built_natively_at_that_size(export_dir):
    encoder = load_encoder(export_dir)
    size = [12, 48, 64]  # another multiple of the patch size on every axis
    settings = encoder.settings
    native = Encoder(
        image_size=size,
        patch_size=settings.patch_size,
        dim=settings.embed_dim,
        depth=settings.depth,
        num_heads=settings.num_heads,
        mlp_ratio=settings.mlp_ratio,
        patch_stem=settings.patch_stem,
    )
    native.load_state_dict(encoder.state_dict())
    volume = torch.randn(2, 1, *size, generator=torch.Generator().manual_seed(4))
    tokens = encoder.encode(volume)
    assert tokens.shape == (2, 3 * 6 * 8, encoder.embed_dim)
    with torch.no_grad():
        assert float((tokens - native.eval()(volume)).abs().max()) <= 1e-6
    # gh rows of this grid
    assert encoder.embed(volume, "depth_rows").shape == (2, 6 * encoder.embed_dim)
    config = json.loads(Path(export_dir, "config.json").read_text())
    assert config["input_sizes"]["trained"] == [encoder.image_size]


LOAD_IN_ANOTHER_PROJECT = """
import os
import sys
import numpy as np
import torch
sys.path.insert(0, PROJECT)  # its own config.py, data.py, model.py and pretrained.py, and octjepa's octjepa_encoder.py
encoder = torch.hub.load(OCTJEPA, "encoder", source="local", path=EXPORT)  # octjepa's hubconf.py, not the folder's
from octjepa_encoder import load
again = load(EXPORT)
volume = torch.from_numpy(np.load("volume.npy"))
with torch.no_grad():
    np.save("tokens.npy", encoder(volume).numpy())
    np.save("again.npy", again.embed(volume).numpy())
assert not {"config", "data", "model", "pretrained", "probe", "train"} & set(sys.modules), sorted(sys.modules)
assert not [m.__file__ for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(EXPORT)]
"""


def plant_modules(export: Path, witness: Path) -> None:
    """What a hostile sender adds to an export: modules that Python would import from the folder by
    their names (huggingface_hub, safetensors), each leaving a witness file when it runs."""
    code = f"open({str(witness)!r}, 'w').write('ran')\nraise ImportError('planted')\n"
    (export / "huggingface_hub.py").write_text(code)
    (export / "safetensors").mkdir()
    (export / "safetensors" / "__init__.py").write_text(code)


def test_an_export_loads_from_an_empty_folder_of_another_project_and_runs_none_of_the_folders_files(
    export_dir, trained_checkpoint, tmp_path
):
    """The default ways to load a received export without an octjepa checkout: torch.hub.load of
    octjepa's hubconf.py (a copy of the repository's two loader files, as torch.hub fetches them)
    with path=EXPORT, and `from octjepa_encoder import load` with that file copied into the project.
    The export came with modules planted beside its weights (the hostile review's repro): neither
    route imports them."""
    project, octjepa, elsewhere, copied = (
        tmp_path / name for name in ("their_project", "octjepa", "empty", "export")
    )
    for folder in (project, octjepa, elsewhere):
        folder.mkdir()
    for name in ("config", "data", "model", "pretrained"):
        (project / f"{name}.py").write_text(
            f"raise ImportError('their own {name}.py, not octjepa\\'s')\n"
        )
    shutil.copy(REPO / "octjepa_encoder.py", project)  # the loader file, copied into their project
    for name in ("hubconf.py", "octjepa_encoder.py"):
        shutil.copy(REPO / name, octjepa)
    shutil.copytree(export_dir, copied)  # the folder alone: no octjepa checkout beside it
    plant_modules(copied, tmp_path / "PWNED")
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(5))
    np.save(elsewhere / "volume.npy", volume.numpy())
    code = (
        f"PROJECT, OCTJEPA, EXPORT = {str(project)!r}, {str(octjepa)!r}, {str(copied)!r}\n"
        + LOAD_IN_ANOTHER_PROJECT
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-I", "-c", code],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        # -I: neither the checkout nor PYTHONPATH on sys.path
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = trained.encode(volume).numpy()
    assert np.abs(np.load(elsewhere / "tokens.npy") - expected).max() <= 1e-6
    assert np.abs(np.load(elsewhere / "again.npy") - expected.mean(1)).max() <= 1e-6
    assert not (tmp_path / "PWNED").exists()


def test_load_encoder_imports_nothing_of_a_received_export_and_refuses_the_modules_planted_in_it(
    export_dir, tmp_path
):
    """The hostile review's repro, in a checkout: a module beside unchanged files is refused by
    name, never run."""
    directory = tmp_path / "export"
    shutil.copytree(export_dir, directory)
    plant_modules(directory, tmp_path / "PWNED")
    with pytest.raises(
        ExportError,
        match=re.escape(
            f"{directory} holds huggingface_hub.py, safetensors, which an export does not"
        ),
    ):
        load_encoder(str(directory))
    assert not (tmp_path / "PWNED").exists()
    shutil.rmtree(directory / "safetensors")
    (directory / "huggingface_hub.py").unlink()
    assert load_encoder(str(directory)).embed_dim == 48  # the folder as exported loads


def test_an_export_whose_hashes_and_contract_were_recomputed_around_a_planted_file_is_still_refused(
    export_dir, tmp_path
):
    """Anyone can recompute a sha256: a sender who adds a module and re-signs config.json and the
    weights passes every checksum, and is refused for the file itself, or for a `code` list that
    names it."""
    directory = tmp_path / "export"
    shutil.copytree(export_dir, directory)
    (directory / "huggingface_hub.py").write_text("raise ImportError\n")
    config = {
        k: v
        for k, v in json.loads((directory / "config.json").read_text()).items()
        if k != "weights"
    }
    # re-signed
    save_encoder(
        safetensors.torch.load_file(directory / "model.safetensors"), config, str(directory)
    )
    with pytest.raises(ExportError, match="holds huggingface_hub.py, which an export does not"):
        load_encoder(str(directory))
    listed = {
        **config,
        "code": {"huggingface_hub.py": hashlib.sha256(b"raise ImportError\n").hexdigest()},
    }
    save_encoder(
        safetensors.torch.load_file(directory / "model.safetensors"), listed, str(directory)
    )
    with pytest.raises(
        ExportError, match="code {'huggingface_hub.py': .* is not what an export writes"
    ):
        load_encoder(str(directory))


def test_the_repositorys_loader_files_are_generated_from_the_projects_code_not_copies_that_can_drift():
    """octjepa_encoder.py and hubconf.py at the repository root (what torch.hub.load and a copied
    file run) are what export.py generates: after an edit of model.py or pretrained.py, regenerate
    them."""
    fix = 'regenerate them: python -c "import export; export.write_loader_files()"'
    module = (REPO / "octjepa_encoder.py").read_text()
    assert module == export.standalone_module(), fix
    assert (REPO / "hubconf.py").read_text() == export.HUBCONF_SOURCE, fix
    for definition in (
        model.sincos_pos_embed_3d,
        model.Block,
        model.Encoder,
        model.pool_tokens,
        pretrained.ExportedEncoder,
        pretrained.monai_vit,
        pretrained.export_contract,
    ):
        assert inspect.getsource(definition) in module
    assert not re.search(
        r"^(import|from) (config|data|storage|dicom|pretrained|model)\b", module, re.MULTILINE
    )


@pytest.fixture(scope="module")
def loader_code_export(tmp_path_factory, trained_checkpoint) -> str:
    """The smoke run's encoder exported with --with_loader_code: the folder holds the loader's code
    too."""
    out = str(tmp_path_factory.mktemp("with_code") / "encoder")
    assert (
        encoder_cli.main(
            ["export", "--ckpt", trained_checkpoint, "--out", out, "--with_loader_code"]
        )
        == 0
    )
    return out


def test_an_export_with_its_loader_code_is_an_opt_in_that_torch_hub_runs_and_load_encoder_checks(
    loader_code_export, trained_checkpoint, tmp_path
):
    """A sender who wants `torch.hub.load(FOLDER, ...)` to work asks for it; the folder then holds
    code, and the card says that whoever loads it that way runs it."""
    assert sorted(os.listdir(loader_code_export)) == [
        "README.md",
        "config.json",
        "hubconf.py",
        "model.safetensors",
        "octjepa_encoder.py",
    ]
    for name in ("hubconf.py", "octjepa_encoder.py"):
        assert Path(loader_code_export, name).read_text() == (REPO / name).read_text()
    config = json.loads(Path(loader_code_export, "config.json").read_text())
    assert (
        all(
            hashlib.sha256(Path(loader_code_export, name).read_bytes()).hexdigest() == digest
            for name, digest in config["code"].items()
        )
        and len(config["code"]) == 2
    )
    assert "run those files" in Path(loader_code_export, "README.md").read_text()
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(11))
    copied = tmp_path / "copied"
    shutil.copytree(loader_code_export, copied)
    for loaded in (
        load_encoder(loader_code_export),
        torch.hub.load(str(copied), "encoder", source="local"),
    ):
        assert float((loaded.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    changed = tmp_path / "changed"
    shutil.copytree(loader_code_export, changed)
    (changed / "hubconf.py").write_text(
        (changed / "hubconf.py").read_text() + "\nimport os  # and anything else\n"
    )
    with pytest.raises(ExportError, match="hubconf.py is not the file that was exported"):
        load_encoder(str(changed))


def test_hugging_face_from_pretrained_reads_the_export_and_saves_it_back(
    export_dir, trained_checkpoint, tmp_path
):
    pytest.importorskip(
        "huggingface_hub", reason="huggingface-hub (requirements-dev.txt) is not installed"
    )
    standalone = octjepa_encoder  # the repository's loader, which imports nothing from the folder
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(6))
    hub = standalone.OCTJEPAEncoder.from_pretrained(export_dir)
    with torch.no_grad():
        assert float((hub(volume) - trained.encode(volume)).abs().max()) <= 1e-6
        hub.save_pretrained(tmp_path / "saved")
        again = standalone.OCTJEPAEncoder.from_pretrained(tmp_path / "saved")
        assert float((again(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    card = (Path(export_dir) / "README.md").read_text()
    for section in (
        "## Intended use",
        "## Training data",
        "## Evaluation",
        "## Licence",
        "## Code",
    ):
        assert section in card
    assert "license: other" in card and re.search(r"commit [0-9a-f]{40}", card)
    assert str(Path(export_dir).parent) not in card and "/tmp" not in card and "runs/" not in card


def test_hugging_face_save_pretrained_keeps_the_card_and_writes_a_folder_load_encoder_reads(
    export_dir, trained_checkpoint, tmp_path
):
    """A researcher saves the export the Hugging Face way before push_to_hub (local folders only: no
    network)."""
    pytest.importorskip(
        "huggingface_hub", reason="huggingface-hub (requirements-dev.txt) is not installed"
    )
    encoder = pretrained.HubEncoder.from_pretrained(export_dir)
    encoder.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    # data only, no code
    assert sorted(os.listdir(saved)) == ["README.md", "config.json", "model.safetensors"]
    card = (saved / "README.md").read_text()
    assert card == Path(export_dir, "README.md").read_text()
    assert (
        "## Preprocessing" in card
        and "## Intended use" in card
        and "HubEncoder.from_pretrained" in card
    )
    config, exported = (
        json.loads(Path(folder, "config.json").read_text()) for folder in (saved, export_dir)
    )
    # the weights' sha256: of the file written
    assert {**config, "weights": None} == {**exported, "weights": None}
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(6))
    again = pretrained.HubEncoder.from_pretrained(saved)
    for loaded in (load_encoder(str(saved)), again):
        assert float((loaded.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    again.save_pretrained(tmp_path / "twice")  # a second trip keeps the card too
    assert (tmp_path / "twice" / "README.md").read_text() == card


@pytest.fixture(scope="module")
def linear_export(tmp_path_factory, smoke_phantoms) -> str:
    """The export of a 3-update run of the smoke config with the linear tubelet stem (the default
    before the recipe; the stem of every format_version 1 export)."""
    tmp = tmp_path_factory.mktemp("linear")
    assert (
        train.main(
            [
                "--config",
                str(REPO / "configs" / "smoke.yaml"),
                *phantom_flags(smoke_phantoms),
                "--out_dir",
                str(tmp / "runs"),
                "--run_name",
                "r",
                "--max_steps",
                "3",
                "--ckpt_every_steps",
                "3",
                "--patch_stem",
                "linear",
            ]
        )
        == 0
    )
    assert (
        encoder_cli.main(
            [
                "export",
                "--ckpt",
                str(tmp / "runs" / "r" / "checkpoints"),
                "--out",
                str(tmp / "encoder"),
            ]
        )
        == 0
    )
    return str(tmp / "encoder")


def linear_export_checkpoint(linear_export: str) -> str:
    """The checkpoint that linear_export was exported from."""
    return str(Path(linear_export).parent / "runs" / "r" / "checkpoints" / "step_0000003.pt")


def test_monai_vit_holds_a_linear_stem_encoder_in_its_own_patch_embedding_exactly_at_the_trained_and_another_size(
    linear_export,
):
    pytest.importorskip("monai", reason="monai (requirements-dev.txt) is not installed")
    pytest.importorskip(
        "einops", reason="einops (monai's ViT needs it; requirements-dev.txt) is not installed"
    )
    encoder = load_encoder(linear_export)
    assert encoder.settings.patch_stem == "linear"
    for size in (encoder.image_size, [12, 48, 64]):
        vit = pretrained.monai_vit(encoder, size)
        volume = torch.randn(2, 1, *size, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            assert float((vit(volume)[0] - encoder(volume)).abs().max()) <= 1e-6


def test_the_recipes_hmlp_export_loads_with_both_loaders_and_in_monai_with_its_stem_swapped_in(
    export_dir, trained_checkpoint
):
    # the smoke config with the default (the recipe's) stem
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    assert (
        cfg.patch_stem == "hmlp"
        and json.loads(Path(export_dir, "config.json").read_text())["architecture"]["patch_stem"]
        == "hmlp"
    )
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(8))
    for loaded in (load_encoder(export_dir), octjepa_encoder.load(export_dir)):
        assert "patch_embed.2.weight" in loaded.state_dict()
        assert float((loaded.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6
    pytest.importorskip("monai", reason="monai (requirements-dev.txt) is not installed")
    encoder = load_encoder(export_dir)
    # its stem in MONAI's patch embedding: the same tokens
    for size in (encoder.image_size, [12, 48, 64]):
        vit = pretrained.monai_vit(encoder, size)
        sized = torch.randn(2, 1, *size, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            assert float((vit(sized)[0] - encoder(sized)).abs().max()) <= 1e-5
    assert isinstance(vit.patch_embedding.patch_embeddings, torch.nn.Sequential)
    with torch.no_grad():  # the standalone module's copy of monai_vit does the same
        assert (
            float(
                (
                    octjepa_encoder.monai_vit(octjepa_encoder.load(export_dir))(volume)[0]
                    - encoder(volume)
                )
                .abs()
                .max()
            )
            <= 1e-5
        )


def test_monai_unetr_segments_with_the_encoder_inside_at_both_shipped_patch_sizes(export_dir):
    """MONAI's UNETR takes no patch size (16 voxels on every axis); configs/ ship [4, 8, 8] and [4,
    16, 16] tubelets."""
    pytest.importorskip("monai", reason="monai (requirements-dev.txt) is not installed")
    exported = load_encoder(export_dir)  # [4, 8, 8], trained
    config = json.loads(Path(export_dir, "config.json").read_text())
    production = [  # the hmlp stem from 1x2x2, 1x4x4 and 2x4x4 cells, E/2 and E/4 channels inside
        pretrained.ExportedEncoder(
            {
                **config,
                "architecture": {
                    **config["architecture"],
                    "patch_size": [4, 16, 16],
                    "stem_cell": cell,
                    "stem_width": width,
                },
            }
        )
        for cell, width in (([1, 2, 2], 0.5), ([1, 4, 4], 0.5), ([1, 4, 4], 0.25), ([2, 4, 4], 0.5))
    ]
    assert production[1].patch_embed[0].kernel_size == (1, 4, 4)
    assert production[3].patch_embed[0].kernel_size == (2, 4, 4)
    embed_dim = config["architecture"]["embed_dim"]
    assert production[2].patch_embed[0].out_channels == embed_dim // 4
    size = [16, 32, 32]  # UNETR's grid: [1, 2, 2]
    volume = torch.randn(2, 1, *size, generator=torch.Generator().manual_seed(10))
    for encoder in (exported, *production):
        unetr = pretrained.monai_unetr(encoder, out_channels=2, img_size=size)
        logits = unetr(volume)
        assert logits.shape == (2, 2, *size)
        with torch.no_grad():
            tokens = encoder(volume).view(2, *encoder.token_grid(volume), -1)
            # the encoder inside
            assert float((unetr.vit.vit(volume)[0] - encoder(volume)).abs().max()) <= 1e-5
            # tokens per UNETR cell
            gd, gh, gw = [g // u for g, u in zip(encoder.token_grid(volume), [1, 2, 2])]
            first_cell = tokens[:, :gd, :gh, :gw].mean((1, 2, 3))
            assert float((unetr.vit(volume)[0][:, 0] - first_cell).abs().max()) <= 1e-5
        logits.square().mean().backward()  # fine-tuning UNETR trains the encoder's weights
        assert float(unetr.vit.vit.blocks[0].attn.qkv.weight.grad.abs().sum()) > 0
    # the documented route runs
    code = docs_block("python", 3).replace("path/to/encoder", export_dir)
    scope = {"x": torch.randn(1, 1, 16, 64, 64)}
    exec(code, scope)
    assert scope["logits"].shape == (1, 2, 16, 64, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        pretrained.monai_unetr(exported, out_channels=2)  # the trained size, [8, 32, 32]


@pytest.mark.parametrize(
    "written", ["encoder.safetensors without a contract", "model.safetensors with its contract"]
)
def test_an_export_of_format_version_1_loads_with_the_linear_stem_it_had_when_asked(
    linear_export, tmp_path, written
):
    """Exports are shared and kept: those of format_version 1 (no architecture.patch_stem) load as
    octjepa wrote them, at first with the weights in encoder.safetensors and no contract in their
    metadata, when the caller asks for an older format (its weights bind less of config.json): by
    default it is refused."""
    config = json.loads(Path(linear_export, "config.json").read_text())
    config["format_version"] = 1
    del config["architecture"]["patch_stem"], config["weights"]
    tensors = safetensors.torch.load_file(Path(linear_export, "model.safetensors"))
    if written == "model.safetensors with its contract":
        save_encoder(tensors, config, str(tmp_path))
    else:
        payload = safetensors.torch.save(tensors)  # no metadata
        tmp_path.joinpath("encoder.safetensors").write_bytes(payload)
        config["weights"] = {
            "file": "encoder.safetensors",
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        tmp_path.joinpath("config.json").write_text(json.dumps(config))
    trained, cfg, _ = read_model_checkpoint(linear_export_checkpoint(linear_export))
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(9))
    with pytest.raises(
        ExportError,
        match="format_version 1, older than 3: .*allow_older_format=True",
    ):
        load_encoder(str(tmp_path))
    encoder = load_encoder(str(tmp_path), allow_older_format=True)
    assert encoder.settings.patch_stem == "linear"
    assert float((encoder.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6


@pytest.mark.parametrize(
    "version, unwritten", [(3, ("stem_cell", "stem_width")), (4, ("stem_width",))]
)
def test_an_export_of_an_earlier_fully_bound_format_loads_by_default_with_the_stem_it_had(
    export_dir, trained_checkpoint, tmp_path, version, unwritten
):
    """Format 4 added architecture.stem_cell, format 5 stem_width; a format 3 or 4 export (its
    weights bind all of config.json too) loads as it was written, with the hmlp stem's 1x2x2 cells
    and E/2 channels of then, and no allow_older_format."""
    config = json.loads(Path(export_dir, "config.json").read_text())
    assert config["architecture"]["stem_cell"] == [1, 2, 2]
    assert config["architecture"]["stem_width"] == 0.5
    config["format_version"] = version
    del config["weights"]
    for name in unwritten:
        del config["architecture"][name]
    save_encoder(
        safetensors.torch.load_file(Path(export_dir, "model.safetensors")), config, str(tmp_path)
    )
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    volume = torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(11))
    for loaded in (load_encoder(str(tmp_path)), octjepa_encoder.load(str(tmp_path))):
        assert loaded.architecture["stem_cell"] == [1, 2, 2]
        assert loaded.architecture["stem_width"] == 0.5
        assert float((loaded.encode(volume) - trained.encode(volume)).abs().max()) <= 1e-6


def rewrite_weights(directory: Path, edit) -> None:
    """Change the tensors of an export and record the new weights' sha256, as a careless user
    would."""
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    edit(tensors)
    config = json.loads((directory / "config.json").read_text())
    save_encoder(tensors, {k: v for k, v in config.items() if k != "weights"}, str(directory))


def resign(directory: Path, payload: bytes) -> None:
    """Replace an export's weights file and record its sha256 in config.json, as a careless user
    would."""
    directory.joinpath(pretrained.WEIGHTS_FILE).write_bytes(payload)
    edit_config(
        directory, lambda c: c["weights"].update(sha256=hashlib.sha256(payload).hexdigest())
    )


def weights_of_another_export(directory: Path) -> bytes:
    """The weights file an export of other provenance (update 999) would hold: the same tensors,
    bound to its config."""
    config = json.loads((directory / "config.json").read_text())
    other = {
        **{k: v for k, v in config.items() if k != "weights"},
        "source": {**config["source"], "update": 999},
    }
    elsewhere = directory.parent / "other_export"
    save_encoder(
        safetensors.torch.load_file(directory / pretrained.WEIGHTS_FILE), other, str(elsewhere)
    )
    return (elsewhere / pretrained.WEIGHTS_FILE).read_bytes()


def edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


TAMPERINGS = {
    "weights changed after export": (
        lambda d: d.joinpath("model.safetensors").write_bytes(
            d.joinpath("model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"
        ),
        "weights.sha256",
    ),
    "a tensor missing": (
        lambda d: rewrite_weights(d, lambda t: t.pop("blocks.1.mlp.fc2.bias")),
        "key blocks.1.mlp.fc2.bias is missing",
    ),
    "a tensor too many": (
        lambda d: rewrite_weights(d, lambda t: t.update(extra=torch.zeros(1))),
        "unexpected key extra",
    ),
    "a tensor of another shape": (
        lambda d: rewrite_weights(d, lambda t: t.update({"norm.weight": torch.ones(7)})),
        "key norm.weight is torch.float32 [7]",
    ),
    "another architecture": (
        lambda d: edit_config(d, lambda c: c["architecture"].update(depth=3)),
        "differs from what its weights were exported with (architecture.depth: 2 -> 3)",
    ),
    "other heads": (
        lambda d: edit_config(d, lambda c: c["architecture"].update(num_heads=2)),
        "(architecture.num_heads: 4 -> 2)",
    ),
    "another clip": (
        lambda d: edit_config(d, lambda c: c["preprocessing"].update(clip_percentiles=[1.0, 99.0])),
        "(preprocessing.clip_percentiles: [0.5, 99.5] -> [1.0, 99.0])",
    ),
    "an architecture too large to build": (
        lambda d: edit_config(
            d, lambda c: c["architecture"].update(embed_dim=8192, depth=64, num_heads=64)
        ),
        (
            "architecture.depth: 2 -> 64; architecture.embed_dim: 48 -> 8192;"
            " architecture.num_heads: 4 -> 64"
        ),
    ),
    "a JSON list": (lambda d: d.joinpath("config.json").write_text("[1, 2]"), "holds a JSON list"),
    "not UTF-8": (
        lambda d: d.joinpath("config.json").write_bytes(b'{"format": "\xff\xfe"}'),
        "is not valid JSON",
    ),
    "weights cut short and re-signed": (
        lambda d: resign(d, d.joinpath(pretrained.WEIGHTS_FILE).read_bytes()[:-64]),
        "cut short or padded",
    ),
    "a field missing": (
        lambda d: edit_config(d, lambda c: c["architecture"].pop("embed_dim")),
        "architecture.embed_dim is missing",
    ),
    "an unknown field": (
        lambda d: edit_config(d, lambda c: c["preprocessing"].update(gamma=2)),
        "preprocessing.gamma is not a field",
    ),
    "input sizes that disagree": (
        lambda d: edit_config(d, lambda c: c["preprocessing"].update(image_size=[8, 64, 64])),
        "preprocessing.image_size [8, 64, 64] differs from architecture.image_size",
    ),
    "a garbled value": (
        lambda d: edit_config(d, lambda c: c["preprocessing"].update(clip_percentiles=[99, 1])),
        "clip_percentiles: [99.0, 1.0] must satisfy",
    ),
    "a newer format": (
        lambda d: edit_config(d, lambda c: c.update(format_version=99)),
        "format_version 99",
    ),
    "a module beside the weights": (
        lambda d: d.joinpath("huggingface_hub.py").write_text("raise ImportError\n"),
        "holds huggingface_hub.py, which an export does not",
    ),
    "a code list that is not a dict": (
        lambda d: edit_config(d, lambda c: c.update(code="hubconf.py")),
        "code hubconf.py is not what an export writes",
    ),
    "a code list of another file": (
        lambda d: edit_config(d, lambda c: c.update(code={"model.py": "0" * 64})),
        "is not what an export writes",
    ),
    "weights saved again without metadata": (
        lambda d: resign(
            d, safetensors.torch.save(safetensors.torch.load_file(d / pretrained.WEIGHTS_FILE))
        ),
        "carries no export contract in its metadata",
    ),
    "another export's weights, their sha256 recorded": (
        lambda d: resign(d, weights_of_another_export(d)),
        "(source.update: 999 -> ",
    ),
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
    assert (
        encoder_cli.main(
            [
                "embed",
                "--encoder",
                str(directory),
                "--data_root",
                phantom_dir,
                "--out",
                str(tmp_path / "e.npz"),
            ]
        )
        == 2
    )
    assert "encoder export error: " in capsys.readouterr().err and not (tmp_path / "e.npz").exists()


def test_export_refuses_to_overwrite_an_export_and_config_flags_that_do_not_apply(
    export_dir, trained_checkpoint, capsys
):
    assert encoder_cli.main(["export", "--ckpt", trained_checkpoint, "--out", export_dir]) == 2
    assert "already holds an export" in capsys.readouterr().err
    assert (
        encoder_cli.main(["embed", "--encoder", export_dir, "--out", "x.npz", "--embed_dim", "8"])
        == 2
    )
    assert "--embed_dim: the export brings its own model" in capsys.readouterr().err


KILLED_AT_STEP = """
import os, signal, sys
steps = 0


def kill_at_step(event, args):  # every change of the disk under PARENT, counted; SIGKILL before the STEP-th
    global steps
    paths = [a for a in (args[1] if event == "ctypes.call_function" else args) if isinstance(a, (str, bytes))]
    written = event != "open" or (set(args[1]) & set("wax+") if isinstance(args[1], str) else
                                  args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if event in CHANGES and written and any(os.fsencode(p).startswith(os.fsencode(PARENT)) for p in paths):
        steps += 1
        if steps == STEP:
            os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(kill_at_step)
import encoder
sys.exit(encoder.main(["export", "--ckpt", CKPT, "--out", OUT, "--force"]))
"""
DISK_CHANGES = (
    "open",
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "shutil.rmtree",
    "ctypes.call_function",
)


@pytest.mark.slow
def test_export_force_killed_at_any_step_leaves_the_old_export_or_the_new_one_each_loading(
    export_dir, trained_checkpoint, linear_export, tmp_path
):
    """A researcher replaces an export with another checkpoint's, and the job is killed: whenever
    the kill comes, the folder holds the old export or the new one, and loads (never new weights
    beside the old config.json)."""
    out = tmp_path / "encoder"
    shutil.copytree(export_dir, out)
    new_checkpoint = linear_export_checkpoint(linear_export)
    encoders = [read_model_checkpoint(c)[0] for c in (trained_checkpoint, new_checkpoint)]
    volume = torch.randn(
        1, 1, *load_encoder(export_dir).image_size, generator=torch.Generator().manual_seed(12)
    )
    step, loaded, finished = 0, [], False
    while not finished:
        step += 1
        code = (
            f"PARENT, CKPT, OUT, STEP, CHANGES = {str(tmp_path)!r}, {new_checkpoint!r},"
            f" {str(out)!r}, {step}, {DISK_CHANGES!r}\n" + KILLED_AT_STEP
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert result.returncode in (0, -signal.SIGKILL), result.stderr[-3000:]
        tokens = load_encoder(str(out)).encode(volume)
        gaps = [float((tokens - e.encode(volume)).abs().max()) for e in encoders]
        loaded.append("old" if gaps[0] <= 1e-6 else "new")
        assert min(gaps) <= 1e-6, (step, gaps)
        finished = result.returncode == 0
    assert (
        loaded == sorted(loaded, key=["old", "new"].index)
        and loaded[-1] == "new"
        and loaded.count("old") >= 3
    )
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.slow
def test_an_export_in_a_bucket_is_replaced_and_checked_like_a_local_one(
    export_dir, linear_export, gcs_emulator, tmp_path
):
    url = gcs_emulator.upload(export_dir, "exports/encoder")
    assert load_encoder(url).settings.patch_stem == "hmlp"
    assert (
        encoder_cli.main(
            ["export", "--ckpt", linear_export_checkpoint(linear_export), "--out", url, "--force"]
        )
        == 0
    )
    assert load_encoder(url).settings.patch_stem == "linear"  # the new export, whole
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "huggingface_hub.py").write_text("raise ImportError\n")
    gcs_emulator.upload(str(planted), "exports/encoder")
    with pytest.raises(ExportError, match="holds huggingface_hub.py, which an export does not"):
        load_encoder(url)


def load_npz(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_embed_writes_a_row_per_volume_with_its_identity_and_the_reason_for_each_unusable_file(
    export_dir, phantom_dir, tmp_path, capsys
):
    data = tmp_path / "data"
    shutil.copytree(phantom_dir, data)
    first = sorted(p for p in os.listdir(data) if p.endswith(".dcm"))[0]
    blob = (data / first).read_bytes()
    (data / "cut.dcm").write_bytes(blob[: len(blob) // 2])  # an interrupted copy
    out = tmp_path / "emb.npz"
    assert (
        encoder_cli.main(
            [
                "embed",
                "--encoder",
                export_dir,
                "--data_root",
                str(data),
                "--out",
                str(out),
                "--workers",
                "0",
                "--batch_size",
                "3",
                "--save_every",
                "4",
                "--with_paths",
            ]
        )
        == 0
    )
    table = load_npz(out)
    records = [r for r in scan_files(find_files(str(data))) if r["ok"]]
    encoder = load_encoder(export_dir)
    assert len(table["path"]) == len(records) == 10 and table["embedding"].shape == (
        10,
        encoder.embed_dim,
    )
    assert list(table["skipped_path"]) == [str(data / "cut.dcm")] and list(
        table["skipped_reason"]
    ) == ["truncated"]
    assert set(table["laterality"]) <= {"R", "L"} and all(
        p.startswith("pk1-") for p in table["patient"]
    )
    assert list(table["series"]) == [r["series"] for r in records] and all(
        s.startswith("1.2.") for s in table["study"]
    )
    assert np.isfinite(table["spacing"]).all() and (table["shape"] > 0).all()
    assert json.loads(str(table["encoder"]))["weights"] == encoder.config["weights"]
    assert not (tmp_path / "emb.npz.partial").exists()
    # each row is what the plain-Python route (README) gives for that path
    for i in (0, 7):
        volume = load_val_sample(str(table["path"][i]), encoder.settings)[None]
        np.testing.assert_allclose(
            table["embedding"][i], encoder.embed(volume)[0].detach().numpy(), atol=1e-6
        )
    assert "truncated" in capsys.readouterr().out


def cosines(rows: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarities of rows [M, F], each pair once."""
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return (unit @ unit.T)[np.triu_indices(len(rows), 1)]


def test_embed_stores_what_standardizing_needs_and_the_position_share_of_the_tokens(
    export_dir, phantom_dir, tmp_path, capsys
):
    flags = [
        "embed",
        "--encoder",
        export_dir,
        "--data_root",
        phantom_dir,
        "--workers",
        "0",
        "--batch_size",
        "4",
        "--save_every",
        "4",
    ]
    assert encoder_cli.main(flags + ["--out", str(tmp_path / "raw.npz"), "--with_paths"]) == 0
    printed = capsys.readouterr()
    assert "of these volumes' token variance (position_share)" in printed.out
    # no terminal (stderr captured): plain progress lines, with the time left until the last
    assert re.search(r"^embed: 1/10 volumes, \d+s, about \S+ left$", printed.err, re.MULTILINE), (
        printed.err
    )
    assert re.search(r"^embed: 10/10 volumes, \S+$", printed.err, re.MULTILINE)
    assert encoder_cli.main(flags + ["--out", str(tmp_path / "std.npz"), "--standardize"]) == 0
    raw, standardized = load_npz(tmp_path / "raw.npz"), load_npz(tmp_path / "std.npz")
    np.testing.assert_allclose(raw["mean"], raw["embedding"].astype(np.float64).mean(0), atol=1e-5)
    np.testing.assert_allclose(raw["std"], raw["embedding"].astype(np.float64).std(0), rtol=1e-4)
    np.testing.assert_allclose(
        standardized["embedding"], (raw["embedding"] - raw["mean"]) / raw["std"], atol=1e-5
    )
    assert bool(standardized["standardized"]) and not bool(raw["standardized"])
    assert np.median(cosines(standardized["embedding"])) < np.median(cosines(raw["embedding"]))
    encoder = load_encoder(export_dir)
    volumes = torch.stack([load_val_sample(str(p), encoder.settings) for p in raw["path"]])
    share = runlog.position_share(encoder.encode(volumes))
    assert float(raw["position_share"]) == pytest.approx(share, abs=1e-6) and 0 < share < 1


def test_embed_on_an_empty_folder_says_there_are_no_files_there(export_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert (
        encoder_cli.main(
            [
                "embed",
                "--encoder",
                export_dir,
                "--data_root",
                str(tmp_path / "empty"),
                "--out",
                str(tmp_path / "e.npz"),
            ]
        )
        == 3
    )
    assert f"no files under {tmp_path / 'empty'}" in capsys.readouterr().err


def test_embed_refuses_rows_saved_by_another_encoder_and_never_overwrites(
    export_dir, phantom_dir, tmp_path, capsys
):
    out = tmp_path / "emb.npz"
    other = random_encoder(load_encoder(export_dir).config, seed=3)
    save_encoder(other.state_dict(), other.config, str(tmp_path / "other"))
    records = [r for r in scan_files(find_files(phantom_dir)) if r["ok"]]
    encoder_cli.embed_records(
        load_encoder(str(tmp_path / "other")),
        records[:2],
        other.settings,
        str(out) + ".partial",
        "mean_pool",
        2,
        2,
        encoder_cli.setup_runtime(other.settings),
    )
    flags = [
        "embed",
        "--encoder",
        export_dir,
        "--data_root",
        phantom_dir,
        "--out",
        str(out),
        "--workers",
        "0",
    ]
    assert encoder_cli.main(flags + ["--batch_size", "2", "--save_every", "2"]) == 2
    assert "holds rows embedded with other settings" in capsys.readouterr().err
    out.write_bytes(b"precious")
    assert encoder_cli.main(flags) == 2 and out.read_bytes() == b"precious"


def key_file(path: Path, secret: str) -> str:
    """A site's key file (privacy.py) holding `secret`, readable by its owner only."""
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def test_tables_embedded_under_two_key_files_say_so_and_refuse_to_join_while_one_key_files_tables_join(
    export_dir, phantom_dir, tmp_path, monkeypatch
):
    flags = [
        "embed",
        "--encoder",
        export_dir,
        "--data_root",
        phantom_dir,
        "--workers",
        "0",
        "--index_path",
        "none",
    ]
    site_a = key_file(tmp_path / "a.key", "site-a-secret-" + "0123456789abcdef" * 3)
    site_b = key_file(tmp_path / "b.key", "site-b-secret-" + "fedcba9876543210" * 3)
    # site A's file, copied on purpose
    shared = key_file(tmp_path / "a_copy.key", Path(site_a).read_text().strip())
    for name, key in (("a", site_a), ("b", site_b), ("a_again", shared)):
        monkeypatch.setenv("OCTJEPA_PATIENT_KEY_FILE", key)
        assert encoder_cli.main(flags + ["--out", str(tmp_path / f"{name}.npz")]) == 0
    a, b, again = (load_npz(tmp_path / f"{n}.npz") for n in ("a", "b", "a_again"))
    assert str(a["key_fingerprint"]).startswith("kf1-") and str(a["key_fingerprint"]) != str(
        b["key_fingerprint"]
    )
    assert set(a["patient"]).isdisjoint(b["patient"])  # merged, every patient would be two
    with pytest.raises(ConfigError) as refused:
        encoder_cli.join_embedding_tables([str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    message = str(refused.value)
    assert "patient keys of different secrets" in message and str(a["key_fingerprint"]) in message
    assert (
        str(b["key_fingerprint"]) in message
        and "embed every data root again under one key file" in message
    )
    joined = encoder_cli.join_embedding_tables(
        [str(tmp_path / "a.npz"), str(tmp_path / "a_again.npz")]
    )
    assert len(joined["patient"]) == 2 * len(a["patient"]) == len(joined["embedding"])
    # one key file: the patients link
    assert set(joined["patient"]) == set(a["patient"]) == set(again["patient"])
    # a table of an octjepa before fingerprints
    older = {k: v for k, v in a.items() if k != "key_fingerprint"}
    np.savez(tmp_path / "older.npz", **older)
    with pytest.raises(ConfigError, match="records no patient-key fingerprint"):
        encoder_cli.join_embedding_tables([str(tmp_path / "older.npz"), str(tmp_path / "a.npz")])


def test_a_second_embed_into_the_same_out_while_one_runs_is_refused_and_the_first_table_is_whole(
    export_dir, phantom_dir, tmp_path, capsys
):
    out = tmp_path / "emb.npz"
    first = subprocess.Popen(
        embed_command(export_dir, phantom_dir, out),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lock = Path(str(out) + ".partial") / ".octjepa-lock"
    deadline = time.monotonic() + 600
    # its record written: the first holds the lock (a file created but still empty is a race either
    # may win, and exactly one does: tests/test_lock.py)
    while not (lock.exists() and lock.read_bytes().strip()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
        time.sleep(0.005)
    # at the same time
    assert encoder_cli.main(embed_command(export_dir, phantom_dir, out)[2:]) == 2
    err = capsys.readouterr().err
    assert (
        f"another `encoder.py embed` (process {first.pid} on " in err
        and f"is writing {out} now" in err
    )
    assert "wait for it to finish" in err and "give another --out" in err
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    table = load_npz(out)
    assert len(table["volume"]) == 10 and not Path(str(out) + ".partial").exists()
    # afterwards: never overwritten
    assert encoder_cli.main(embed_command(export_dir, phantom_dir, out)[2:]) == 2
    assert "exists; choose another --out" in capsys.readouterr().err


def embed_command(export_dir, data_root, out):
    return [
        sys.executable,
        str(REPO / "encoder.py"),
        "embed",
        "--encoder",
        export_dir,
        "--data_root",
        data_root,
        "--out",
        str(out),
        "--batch_size",
        "2",
        "--save_every",
        "2",
        "--workers",
        "0",
    ]


def kill_after_first_chunk(command, partial: Path) -> int:
    """Start the command, SIGKILL it as soon as it has saved its first chunk of rows; the chunks it
    had saved."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
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
    export_dir, phantom_dir, tmp_path, where, request, capsys
):
    data_root = (
        phantom_dir
        if where == "local"
        else request.getfixturevalue("gcs_emulator").upload(phantom_dir, "emb")
    )
    reference = tmp_path / "reference.npz"
    assert encoder_cli.main(embed_command(export_dir, data_root, reference)[2:]) == 0
    out = tmp_path / "killed.npz"
    saved = kill_after_first_chunk(
        embed_command(export_dir, data_root, out), Path(str(out) + ".partial")
    )
    assert 1 <= saved < 5 and not out.exists()  # 10 volumes in chunks of 2: killed halfway
    capsys.readouterr()
    # the same command, started again
    assert encoder_cli.main(embed_command(export_dir, data_root, out)[2:]) == 0
    printed = capsys.readouterr()
    assert f"resuming: {2 * saved} of 10 volumes already embedded" in printed.err
    assert f"{10 - 2 * saved} computed now" in printed.out
    assert out.read_bytes() == reference.read_bytes()


def test_show_draws_pretrained_and_random_features_and_attention(export_dir, phantom_dir, tmp_path):
    out = tmp_path / "show.png"
    assert (
        encoder_cli.main(
            [
                "show",
                "--encoder",
                export_dir,
                "--labels",
                f"{phantom_dir}/labels.csv",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    image = np.asarray(Image.open(out).convert("RGB"))
    # 3 classes x 2 encoders, 6 panels each
    assert image.shape[0] > 6 * 150 and image.shape[1] > 1200
    # colours: features, attention, the volumes
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 500


def test_show_draws_the_chosen_rows_and_names_no_local_path(export_dir, phantom_dir, tmp_path):
    drawn = encoder_cli.show(
        export_dir,
        f"{phantom_dir}/labels.csv",
        str(tmp_path / "show.png"),
        load_config(["--device", "cpu"]),
        vs_random=False,
        volumes=[2, 9],
    )
    assert (
        drawn["rows"] == [2, 9] and "/" not in drawn["title"] and export_dir not in drawn["title"]
    )
    assert "grid position explains" in drawn["title"]
    with pytest.raises(ConfigError, match="has rows 1 to 10"):
        encoder_cli.show(
            export_dir,
            f"{phantom_dir}/labels.csv",
            str(tmp_path / "x.png"),
            load_config([]),
            volumes=[11],
        )


def colour_gap(rgb: np.ndarray) -> float:
    """The mean |difference| of the RGB maps [S, ..., 3] of each pair of shown volumes."""
    return float(
        np.mean(
            [np.abs(rgb[a] - rgb[b]).mean() for a, b in itertools.combinations(range(len(rgb)), 2)]
        )
    )


def test_show_of_a_large_labels_file_fits_on_a_sample_of_each_class_and_the_chosen_rows(
    export_dir, phantom_dir, tmp_path
):
    """Memory grows with --fit_volumes, not with the labels file (docs/performance.md)."""
    labels = list(read_label_table(f"{phantom_dir}/labels.csv").values["label"])
    rows = encoder_cli.fitting_rows(labels, [10], 5, seed=0)
    assert 10 in rows and len(rows) <= 6 and {labels[r - 1] for r in rows} == set(labels)
    assert encoder_cli.fitting_rows(labels, None, 10, seed=0) == list(range(1, 11))
    drawn = encoder_cli.show(
        export_dir,
        f"{phantom_dir}/labels.csv",
        str(tmp_path / "show.png"),
        load_config(["--device", "cpu"]),
        vs_random=False,
        volumes=[10],
        fit_volumes=5,
    )
    assert drawn["rows"] == [10] and "(a sample of the file's 10)" in drawn["title"]


def test_show_for_a_quick_look_reads_the_sample_size_asked_the_same_each_time_and_names_the_flag(
    export_dir, phantom_dir, tmp_path, capsys
):
    """show took 170 s on 256 volumes: its progress lines and --help say how to ask for fewer, and
    why 256."""
    labels = list(read_label_table(f"{phantom_dir}/labels.csv").values["label"])
    sample = encoder_cli.fitting_rows(labels, None, 6, seed=3)
    assert sample == encoder_cli.fitting_rows(labels, None, 6, seed=3)  # reproducible: --seed
    assert {labels[r - 1] for r in sample} == set(labels)  # stratified: every class
    assert (
        encoder_cli.main(
            [
                "show",
                "--encoder",
                export_dir,
                "--labels",
                f"{phantom_dir}/labels.csv",
                "--out",
                str(tmp_path / "quick.png"),
                "--no_random",
                "--fit_volumes",
                "6",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert (
        f"show: encode (at most --fit_volumes 6): {len(sample)}/{len(sample)} volumes"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        encoder_cli.main(["show", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the sample size" in help_text and "Default 256, as before: bounded" in help_text


def test_shows_pca_of_position_centred_tokens_differs_between_classes_where_plain_pca_shows_position(
    export_dir, phantom_dir
):
    encoder = load_encoder(export_dir)
    tokens, labels, _, shown, _, _, _ = encoder_cli.labelled_tokens(
        {"e": encoder}, encoder.settings, f"{phantom_dir}/labels.csv", None, "cpu", 256
    )
    assert len(set(labels[shown])) == len(shown) == 3  # one volume of each class
    centred, _ = encoder_cli.feature_colours(tokens["e"], shown)
    plain, _ = encoder_cli.feature_colours(tokens["e"], shown, centre=False)
    # measured on the smoke run's encoder: 0.20 against 0.045 (position explains 92% of its token
    # variance)
    assert colour_gap(centred) > 0.1 and colour_gap(centred) > 2 * colour_gap(plain)


def readme_snippet() -> str:
    """The Python block of the README's section on loading an exported encoder."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Export, and load it in plain Python") :]
    return section[
        section.index("```python") + len("```python") : section.index(
            "```\n", section.index("```python")
        )
    ]


def test_the_readme_snippet_loads_the_export_without_train_py(export_dir, phantom_dir, tmp_path):
    first = sorted(p for p in os.listdir(phantom_dir) if p.endswith(".dcm"))[0]
    code = (
        readme_snippet()
        .replace("runs/learn/encoder", export_dir)
        .replace("scan.dcm", f"{phantom_dir}/{first}")
    )
    check = (
        "\nassert tokens.shape == (1, encoder.grid[0] * encoder.grid[1] * encoder.grid[2],"
        " encoder.embed_dim)\nassert embedding.shape == (1, encoder.embed_dim)\nimport sys; assert"
        " 'train' not in sys.modules and 'probe' not in sys.modules, sorted(sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code + check],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def docs_block(language: str, index: int = 0) -> str:
    """The index-th code block of that language in docs/encoder.md."""
    text = (REPO / "docs" / "encoder.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)[index]


@pytest.mark.slow
def test_the_docs_commands_run_in_order(smoke_phantoms, tmp_path, capsys):
    names = sorted(n for n in os.listdir(smoke_phantoms) if n.endswith(".dcm"))
    labels = tmp_path / "labels.csv"  # 16 volumes of 8 patients, two classes
    labels.write_text(
        "path,label,patient\n"
        + "".join(
            f"{smoke_phantoms}/{n},{'ab'[(i // 2) % 2]},p{i // 2}\n" for i, n in enumerate(names)
        )
    )
    runs = tmp_path / "runs"
    flags = [
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        *phantom_flags(smoke_phantoms),
        "--out_dir",
        str(runs),
        "--max_steps",
        "4",
        "--probe_labels",
        str(labels),
    ]
    assert train.main(flags + DEMO_FLAGS) == 0  # the demo's run folder: runs/demo
    summary = capsys.readouterr().out
    commands = [
        line.replace("runs/demo", f"{runs}/demo")
        .replace("data/phantoms_suite/labels.csv", str(labels))
        .replace("data/phantoms ", f"{smoke_phantoms} ")
        for line in docs_block("bash").splitlines()
    ]
    assert len(commands) == 4
    readme = (REPO / "README.md").read_text()
    # the README shows the same commands
    assert docs_block("bash") in readme[readme.index("## Use the encoder") :]
    for command in commands:
        assert command in summary  # the summary prints the docs' commands with the run's own paths
        argv = shlex.split(command)[2:]
        if command.startswith("python finetune.py"):
            # quick: no full fine-tuning
            assert finetune.main(argv + ["--modes", "frozen", "--folds", "2"]) == 0
        else:
            assert encoder_cli.main(argv) == 0
    for written in (
        "encoder/model.safetensors",
        "embeddings.npz",
        "show.png",
        "finetune/report.json",
    ):
        assert (runs / "demo" / written).exists(), written
    assert train.main(flags + DEMO_FLAGS) == 0  # the demo again: its run is done, its summary again
    assert commands[0] in capsys.readouterr().out


def test_the_docs_python_blocks_load_a_dicom_file_and_an_in_memory_volume_alike(
    export_dir, phantom_dir, tmp_path
):
    first = sorted(p for p in os.listdir(phantom_dir) if p.endswith(".dcm"))[0]
    checkout = (
        docs_block("python", 0)
        .replace("runs/demo/encoder", export_dir)
        .replace("scan.dcm", f"{phantom_dir}/{first}")
    )
    read = read_volume(f"{phantom_dir}/{first}")
    in_memory = (
        "x_file = x\n"
        + docs_block("python", 4)
        .replace("array_dhw", "read.voxels")
        .replace("(dz, dy, dx)", "read.spacing")
        + "assert torch.equal(x, x_file)\n"
    )
    exec(checkout + in_memory, {"read": read})


def test_each_commands_help_lists_the_config_flags_it_takes_and_claims_no_others(capsys):
    with pytest.raises(SystemExit) as stopped:
        encoder_cli.main(["embed", "--help"])
    printed = capsys.readouterr().out
    assert stopped.value.code == 0 and "Every Config field is also a flag" not in printed
    assert "The config flags it takes: --device, --cache_dir, --workers, --data_root" in " ".join(
        printed.split()
    )
    assert (
        "runs/demo/checkpoints" in encoder_cli.__doc__
        and "data/phantoms_suite/labels.csv" in encoder_cli.__doc__
    )


def test_the_scripts_import_no_compiler_before_parsing_their_arguments_and_train_no_probes_or_plots():
    code = (
        "import sys, train; assert 'sklearn' not in sys.modules, 'scikit-learn imported by"
        " train.py'\nassert 'matplotlib' not in sys.modules, 'matplotlib imported before a picture"
        " is drawn'\nimport encoder; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo"
        " imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_an_encoder_whose_weights_are_nan_is_neither_exported_nor_embedded(
    trained_checkpoint, export_dir, tmp_path, phantom_dir, capsys
):
    ckpt = torch.load(trained_checkpoint, weights_only=True)
    for key in ckpt["model"]:
        if key.startswith("target_encoder.") and ckpt["model"][key].is_floating_point():
            ckpt["model"][key] = torch.full_like(ckpt["model"][key], float("nan"))
    torch.save(ckpt, tmp_path / "diverged.pt")
    assert (
        encoder_cli.main(
            ["export", "--ckpt", str(tmp_path / "diverged.pt"), "--out", str(tmp_path / "e")]
        )
        == 2
    )
    assert (
        "holds NaN or inf" in capsys.readouterr().err
        and not (tmp_path / "e" / "config.json").exists()
    )
    nan_export = tmp_path / "nan_export"  # written by hand, past export's check
    config = json.loads(Path(export_dir, "config.json").read_text())
    weights = {
        k: torch.full_like(v, float("nan"))
        for k, v in load_encoder(export_dir).state_dict().items()
    }
    save_encoder(weights, {k: v for k, v in config.items() if k != "weights"}, str(nan_export))
    assert (
        encoder_cli.main(
            [
                "embed",
                "--encoder",
                str(nan_export),
                "--data_root",
                phantom_dir,
                "--out",
                str(tmp_path / "e.npz"),
                "--workers",
                "0",
            ]
        )
        == 2
    )
    assert "NaN or inf embeddings for 10 of 10 volumes" in capsys.readouterr().err
    assert not (tmp_path / "e.npz").exists()


def test_embed_on_a_full_disk_stops_with_a_message_and_leaves_no_half_written_table(
    tmp_path, export_dir, phantom_dir
):
    disk = tmp_path / "disk"
    disk.mkdir()
    tiny = [
        "unshare",
        "--mount",
        "sh",
        "-c",
        'mount -t tmpfs -o size=16k tmpfs "$0" && exec "$@"',
        str(disk),
    ]
    if subprocess.run([*tiny, "true"], capture_output=True).returncode:
        pytest.skip(
            "cannot mount a tiny tmpfs here (needs root in a mount namespace): no full disk to"
            " write to"
        )
    out = disk / "embeddings.npz"
    full = subprocess.run(
        [
            *tiny,
            sys.executable,
            str(REPO / "encoder.py"),
            "embed",
            "--encoder",
            export_dir,
            "--data_root",
            phantom_dir,
            "--out",
            str(out),
            "--workers",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert full.returncode == 2, full.stderr[-2000:]
    assert f"cannot write into {disk}" in full.stderr and "No space left on device" in full.stderr
    assert "Traceback" not in full.stderr and "run the same command again" in full.stderr


def test_the_docs_torch_hub_route_loads_a_data_only_export_with_octjepas_own_hubconf(
    export_dir, trained_checkpoint
):
    trained, cfg, _ = read_model_checkpoint(trained_checkpoint)
    scope = {"x": torch.randn(2, 1, *cfg.image_size, generator=torch.Generator().manual_seed(13))}
    exec(
        docs_block("python", 1)
        .replace("path/to/octjepa", str(REPO))
        .replace("path/to/encoder", export_dir),
        scope,
    )
    assert float((scope["tokens"] - trained.encode(scope["x"])).abs().max()) <= 1e-6
    # nothing ran there
    assert sorted(os.listdir(export_dir)) == ["README.md", "config.json", "model.safetensors"]


def test_the_model_card_says_the_folder_is_data_what_its_checks_prove_and_how_to_load_it_without_its_code(
    export_dir,
):
    # data only
    assert sorted(os.listdir(export_dir)) == ["README.md", "config.json", "model.safetensors"]
    umask = os.umask(0o022)
    os.umask(umask)
    # readable as a folder makedirs makes
    assert os.stat(export_dir).st_mode & 0o777 == 0o777 & ~umask
    card = (Path(export_dir) / "README.md").read_text()
    use = card[card.index("## Use") : card.index("## Preprocessing")]
    assert use.index("load_encoder") < use.index("torch.hub.load")  # the checkout's loader first
    # torch.hub runs octjepa's files
    assert 'path="THIS_FOLDER"' in use and "not this folder" in use
    assert "does not prove who made the export" in use and "recompute every sha256" in use
    assert "**run those files**" in use  # --with_loader_code: said for what it is
    docs = " ".join((REPO / "docs" / "encoder.md").read_text().split())
    assert "load_encoder" in docs_block("python", 0) and "torch.hub.load" in docs_block("python", 1)
    assert "damage" in docs and "not a hostile sender" in docs and "--with_loader_code" in docs
    config = json.loads((Path(export_dir) / "config.json").read_text())
    assert config["format_version"] == pretrained.EXPORT_VERSION == 5 and "code" not in config
