"""An exported encoder: its format (config.json + model.safetensors), save_encoder/load_encoder, the
random-init twin, the MONAI adapters (its ViT; a UNETR around it), HubEncoder (Hugging Face's
save_pretrained / from_pretrained).

An export (`python encoder.py export`, export.py) loads without train.py or the checkpoint:
load_encoder(DIR) -> PretrainedEncoder, volume [B,1,D,H,W] -> tokens [B,N,E] or a pooled embedding
(model.pool_tokens). config.json holds the architecture, the preprocessing contract, the
training-time augmentation and where the weights came from; model.safetensors the Encoder's weights
with that contract in their metadata, so the weights' sha256 covers both. ExportedEncoder,
monai_vit, monai_unetr and export_contract are copied from this source (and model.py's) into the
repository's standalone octjepa_encoder.py (export.model_definitions): they use nothing of octjepa
but model.py. An export folder holds data only (config.json, model.safetensors, README.md);
load_encoder imports nothing from it and refuses a folder that holds anything else (a planted
huggingface_hub.py would run under `import`).
"""

import hashlib
import json
import os
from typing import List, Optional, Sequence

import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

from config import Config, ConfigError, load_config
from model import VJEPA3D, Encoder, check_encoder_input, pool_name, pool_tokens, tubelet_embedding
from storage import exists, glob_paths, read_bytes, write_atomic

# optional (requirements-dev.txt): HubEncoder's save_pretrained, from_pretrained and push_to_hub
try:
    from huggingface_hub import PyTorchModelHubMixin
except ImportError:
    PyTorchModelHubMixin = object

EXPORT_FORMAT = "octjepa-encoder"
# bump when config.json or the weights' layout changes meaning; newer exports are refused
EXPORT_VERSION = 5
# (2: architecture.patch_stem; 3: the weights bind all of config.json, provenance and code files'
# sha256 included; 4: architecture.stem_cell; 5: architecture.stem_width) the names Hugging Face's
# hub tools read
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
EARLIER_WEIGHTS_FILE = "encoder.safetensors"  # what exports before 2026-11-25 named their weights
# the model card of an export (export.model_card), the file Hugging Face's hub shows
MODEL_CARD = "README.md"
# the loader: the repository's, in a folder by opt-in
STANDALONE_MODULE, HUBCONF = "octjepa_encoder.py", "hubconf.py"
# finetune.save_fold's, beside a fine-tuned export's weights
FOLD_FILES = ("heads.safetensors", "fold.json")
GIT_FILES = (".git", ".gitattributes")  # a Hugging Face hub repo cloned with git
ARCHITECTURE_FIELDS = (
    "image_size",
    "patch_size",
    "patch_stem",
    "stem_cell",
    "stem_width",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
)
# the fields earlier format_versions did not write, as they were then: {last version without: fields}
UNWRITTEN_ARCHITECTURE = {
    1: {"patch_stem": "linear"},
    3: {"stem_cell": [1, 2, 2]},
    4: {"stem_width": 0.5},
}
# from this format_version on, the weights bind all of config.json (export_contract)
FULLY_BOUND_VERSION = 3
PREPROCESSING_FIELDS = (
    "image_size",
    "target_spacing",
    "missing_spacing",
    "clip_percentiles",
    "sop_classes",
)
AUGMENTATION_FIELDS = ("flip_prob", "intensity_jitter")  # training-time only: fine-tuning uses them
# what data.load_val_sample does with the fields above; documentation in config.json
PREPROCESSING_STEPS = (
    "read the DICOM volume [D,H,W] (frames, rows = depth, columns)",
    "resample to target_spacing mm (none: resize to image_size), anti-aliased",
    "clip to the volume's own clip_percentiles and map onto the full range of its storage type",
    (
        "crop or zero-pad to image_size: centred, and axially centred on the retina"
        " (intensity-weighted mean row)"
    ),
    "normalize: zero mean and unit standard deviation over the cropped volume",
)


class ExportError(ConfigError):
    """An encoder export that cannot be loaded as it is: the message names the file, key or
    field."""

    prefix = "encoder export error: "


def export_config(cfg: Config, source: dict) -> dict:
    """The config.json of an export of an encoder trained with cfg (save_encoder adds the weights'
    checksum): architecture, the preprocessing contract, training-time augmentation and `source`
    (where the weights came from: checkpoint, update, the run's plan and config)."""
    return {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "architecture": {k: getattr(cfg, k) for k in ARCHITECTURE_FIELDS},
        "preprocessing": {
            **{k: getattr(cfg, k) for k in PREPROCESSING_FIELDS},
            "steps": list(PREPROCESSING_STEPS),
        },
        "augmentation": {k: getattr(cfg, k) for k in AUGMENTATION_FIELDS},
        "input_sizes": {
            "trained": [list(cfg.image_size)],
            "accepted": (
                "any [D, H, W] that is a multiple of "
                "patch_size: the sin-cos positions are built for its token grid"
            ),
        },
        "source": source,
    }


def unwritten_architecture(version: int) -> dict:
    """The architecture fields an export of format_version `version` did not write, with the values
    they had then."""
    return {
        name: value
        for last, fields in UNWRITTEN_ARCHITECTURE.items()
        if version <= last
        for name, value in fields.items()
    }


def export_settings(config: dict, where: str = CONFIG_FILE) -> Config:
    """A Config holding an export's architecture, preprocessing and augmentation (the rest at
    defaults), for data.load_val_sample and fine-tuning. Raises ExportError naming the field that is
    missing or wrong."""
    if config.get("format") != EXPORT_FORMAT:
        raise ExportError(
            f"{where}: format is {config.get('format')!r}, expected {EXPORT_FORMAT!r}; export a "
            "checkpoint with `python encoder.py export --ckpt CKPT --out DIR`."
        )
    version = config.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= EXPORT_VERSION:
        raise ExportError(
            f"{where}: format_version {version!r} is not one this octjepa reads (1 to"
            f" {EXPORT_VERSION}); load it with the octjepa version that wrote it."
        )
    fields = {}
    for section, names in (
        ("architecture", ARCHITECTURE_FIELDS),
        ("preprocessing", PREPROCESSING_FIELDS),
        ("augmentation", AUGMENTATION_FIELDS),
    ):
        values = config.get(section)
        if not isinstance(values, dict):
            raise ExportError(f"{where}: no '{section}' section.")
        if section == "architecture":
            values = {**unwritten_architecture(version), **values}
        extra = set(values) - set(names) - ({"steps"} if section == "preprocessing" else set())
        missing = [n for n in names if n not in values]
        if missing or extra:
            raise ExportError(
                f"{where}: {section}."
                + (
                    f"{missing[0]} is missing"
                    if missing
                    else f"{sorted(extra)[0]} is not a field of this format"
                )
            )
        if (
            "image_size" in names
            and "image_size" in fields
            and values["image_size"] != fields["image_size"]
        ):
            raise ExportError(
                f"{where}: {section}.image_size {values['image_size']} differs from "
                f"architecture.image_size {fields['image_size']}."
            )
        fields.update({n: values[n] for n in names})
    try:
        return load_config([], **fields)
    except ConfigError as e:
        raise ExportError(f"{where}: {e}") from None


class ExportedEncoder(Encoder):
    """An encoder built from an export's config.json (a dict; nothing else of octjepa needed).
    forward: volume [B,1,D,H,W] with D, H, W multiples of patch_size (the trained image_size, or any
    other: positions are built for its grid) -> tokens [B,N,E]; embed: -> [B,E] (pool 'mean_pool')
    or [B, gh*E] ('depth_rows'). Its state_dict keys are those of the export's weights file."""

    def __init__(self, config: dict):
        a = {**unwritten_architecture(config["format_version"]), **config["architecture"]}
        super().__init__(
            image_size=a["image_size"],
            patch_size=a["patch_size"],
            dim=a["embed_dim"],
            depth=a["depth"],
            num_heads=a["num_heads"],
            mlp_ratio=a["mlp_ratio"],
            patch_stem=a["patch_stem"],
            stem_cell=a["stem_cell"],
            stem_width=a["stem_width"],
        )
        self.architecture = a  # config.json's, with the fields its format_version did not write
        self.config = config
        self.image_size, self.patch_size, self.embed_dim = (
            list(a["image_size"]),
            list(a["patch_size"]),
            a["embed_dim"],
        )

    def forward(
        self, volume: torch.Tensor, keep_idx: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """volume [B,1,D,H,W] -> tokens [B,N,E] (or [B*M,K,E] for keep_idx, as Encoder.forward); the
        shape is checked."""
        check_encoder_input(volume, self.patch_size, self.image_size)
        return super().forward(volume, keep_idx)

    def token_grid(self, volume: torch.Tensor) -> List[int]:
        """The (gd, gh, gw) token grid of a volume [B,1,D,H,W]."""
        return [s // p for s, p in zip(volume.shape[2:], self.patch_size)]

    def embed(self, volume: torch.Tensor, pool: str = "mean_pool") -> torch.Tensor:
        """The pooled embedding of a volume [B,1,D,H,W] (pool_tokens)."""
        return pool_tokens(self(volume), self.token_grid(volume), pool)

    def embedding_size(self, pool: str = "mean_pool") -> int:
        """The width of embed(volume, pool) at the trained image_size: E for 'mean_pool', gh*E for
        'depth_rows'."""
        return self.embed_dim * (self.grid[1] if pool_name(pool) == "depth_rows" else 1)

    @torch.no_grad()
    def encode(self, volume: torch.Tensor) -> torch.Tensor:
        """Frozen tokens [B,N,E] without gradients, as VJEPA3D.encode gives them
        (tokens.encode_volumes uses either)."""
        return self(volume)


MONAI_VIT_KEYS = (
    ("patch_embed.", "patch_embedding.patch_embeddings."),
    (".attn.proj.", ".attn.out_proj."),
    # Encoder key -> monai ViT key
    (".mlp.fc1.", ".mlp.linear1."),
    (".mlp.fc2.", ".mlp.linear2."),
)


def monai_vit(encoder: ExportedEncoder, img_size: Optional[Sequence[int]] = None) -> nn.Module:
    """The encoder as MONAI's 3D ViT (monai.networks.nets.ViT, the backbone of its UNETR) for inputs
    of img_size (default: the trained size; any multiple of patch_size): the same weights, and the
    encoder's sin-cos positions copied in (MONAI builds its own in another axis order).
    vit(volume)[0] equals encoder(volume). Needs monai. The hmlp stem replaces MONAI's
    one-convolution patch embedding (vit.patch_embedding.patch_embeddings): it is called the same
    way, volume [B,1,D,H,W] -> [B,E,gd,gh,gw], so UNETR and MONAI's other users take it as it is."""
    from monai.networks.nets import ViT

    a = encoder.architecture
    size = list(img_size or encoder.image_size)
    vit = ViT(
        in_channels=1,
        img_size=size,
        patch_size=encoder.patch_size,
        hidden_size=a["embed_dim"],
        mlp_dim=int(a["embed_dim"] * a["mlp_ratio"]),
        num_layers=a["depth"],
        num_heads=a["num_heads"],
        proj_type="conv",
        pos_embed_type="sincos",
        classification=False,
        dropout_rate=0.0,
        spatial_dims=3,
        qkv_bias=True,
    )
    if a["patch_stem"] != "linear":
        vit.patch_embedding.patch_embeddings = tubelet_embedding(
            encoder.patch_size,
            a["embed_dim"],
            a["patch_stem"],
            a["stem_cell"],
            a["stem_width"],
        )
    state = vit.state_dict()  # its norm_cross_attn (unused without cross-attention) stays as built
    for key, value in encoder.state_dict().items():
        for ours, theirs in MONAI_VIT_KEYS:
            key = key.replace(ours, theirs)
        state[key] = value
    grid = [s // p for s, p in zip(size, encoder.patch_size)]
    # [1, N, E]
    state["patch_embedding.position_embeddings"] = encoder.positions(grid)[None].detach().clone()
    vit.load_state_dict(state, strict=True)
    return vit.eval()


UNETR_PATCH = 16  # what MONAI's UNETR assumes of its vit: 16-voxel patches on every axis,
UNETR_BLOCKS = 12  # and 12 blocks (its skip connections read blocks 3, 6 and 9)


class UNETRBackbone(nn.Module):
    """An encoder's MONAI ViT (monai_vit) as MONAI's UNETR calls its `vit`: volume [B,1,D,H,W] ->
    (tokens, 12 hidden states), each [B, n, E] on UNETR's grid (D, H, W // 16), average-pooled from
    the encoder's token grid (tubelets of 4 x 8 x 8 voxels: 4 x 2 x 2 tokens to one); hidden state i
    is the encoder's block at the same share of its depth as block i of UNETR's 12."""

    def __init__(self, vit: nn.Module, patch_size: Sequence[int]):
        super().__init__()
        self.vit, self.patch_size = vit, list(patch_size)

    def forward(self, volume: torch.Tensor):
        tokens, hidden = self.vit(volume)
        grid = [s // p for s, p in zip(volume.shape[2:], self.patch_size)]
        unetr_grid = [s // UNETR_PATCH for s in volume.shape[2:]]

        def on_unetr_grid(x: torch.Tensor) -> torch.Tensor:  # [B, N, E] -> [B, n, E]
            feature_map = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *grid)
            return F.adaptive_avg_pool3d(feature_map, unetr_grid).flatten(2).transpose(1, 2)

        taps = [
            hidden[max(0, round(len(hidden) * (i + 1) / UNETR_BLOCKS) - 1)]
            for i in range(UNETR_BLOCKS)
        ]
        return on_unetr_grid(tokens), [on_unetr_grid(h) for h in taps]


def monai_unetr(
    encoder: ExportedEncoder,
    out_channels: int,
    img_size: Optional[Sequence[int]] = None,
    **unetr_args,
) -> nn.Module:
    """MONAI's 3D UNETR (monai.networks.nets.UNETR) for inputs of img_size (default: the trained
    size; a multiple of 16 and of patch_size on every axis) with the encoder as its `vit`: volume
    [B,1,D,H,W] -> [B,out_channels,D,H,W]. MONAI's UNETR takes no patch size (it assumes 16 voxels
    and 12 blocks), so its own ViT cannot be swapped for monai_vit's; UNETRBackbone wraps that one
    to what UNETR reads. unetr_args: UNETR's others (feature_size, norm_name, ...). Needs monai."""
    from monai.networks.nets import UNETR

    a = encoder.architecture
    size = list(img_size or encoder.image_size)
    if any(s % UNETR_PATCH or s % p for s, p in zip(size, encoder.patch_size)):
        raise ValueError(
            f"img_size {size}: MONAI's UNETR needs a multiple of {UNETR_PATCH} on every axis (it "
            "upsamples its feature grid 16x), and the encoder one of its patch size "
            f"{encoder.patch_size}."
        )
    unetr = UNETR(
        in_channels=1,
        out_channels=out_channels,
        img_size=size,
        hidden_size=a["embed_dim"],
        mlp_dim=int(a["embed_dim"] * a["mlp_ratio"]),
        num_heads=a["num_heads"],
        qkv_bias=True,
        **unetr_args,
    )
    unetr.vit = UNETRBackbone(monai_vit(encoder, size), encoder.patch_size)
    return unetr


class PretrainedEncoder(ExportedEncoder):
    """An exported encoder with its export's settings checked: `settings` is a Config of its
    architecture, preprocessing and augmentation (data.load_val_sample(path, encoder.settings)
    preprocesses a DICOM file)."""

    def __init__(self, config: dict, where: str = CONFIG_FILE):
        settings = export_settings(config, where)  # validated before anything is built from it
        super().__init__(config)
        self.settings = settings


def random_encoder(config: dict, seed: int) -> PretrainedEncoder:
    """A random init of an export's architecture: the target encoder of a VJEPA3D built after
    torch.manual_seed(seed), as pretraining starts and as runprobe.random_model builds it (the same
    weights, given the export's training config: the predictor's size moves the random stream). The
    floor to beat; the global RNG is left as it was."""
    source = config.get("source") or {}
    config = {
        **{k: v for k, v in config.items() if k != "weights"},
        "source": {"encoder": "random init", "seed": seed},
    }
    encoder = PretrainedEncoder(config)
    try:
        cfg = load_config([], **source["training_config"])
    # no training config (e.g. a fine-tuned export): the predictor's default
    except (KeyError, TypeError, ConfigError):
        cfg = encoder.settings
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        encoder.load_state_dict(VJEPA3D.from_config(cfg).encoder_state_dict())
    return encoder.eval()


def _sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
# config.json's parts bound to the weights
CONTRACT_SECTIONS = ("architecture", "preprocessing", "augmentation")


def export_contract(config: dict) -> str:
    """What the weights are bound to, as canonical JSON (save_encoder stores it in their metadata):
    from format 3 on all of config.json but their own sha256 (provenance and the code files' sha256
    too), before CONTRACT_SECTIONS."""
    sections = (
        CONTRACT_SECTIONS
        if config.get("format_version", 1) < FULLY_BOUND_VERSION
        else sorted(set(config) - {"weights"})
    )
    return json.dumps({k: config.get(k) for k in sections}, sort_keys=True)


def save_encoder(state: dict, config: dict, directory: str) -> None:
    """Write an export to a local or gs:// folder: model.safetensors (the Encoder state `state`,
    with the export's contract in its metadata), then config.json with the weights' sha256, each
    atomically (config.json last: an export without it is incomplete)."""
    weights = safetensors.torch.save(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        metadata={
            "format": EXPORT_FORMAT,
            "format_version": str(EXPORT_VERSION),
            "contract": export_contract(config),
        },
    )
    config = {**config, "weights": {"file": WEIGHTS_FILE, "sha256": _sha256(weights)}}
    write_atomic(f"{directory.rstrip('/')}/{WEIGHTS_FILE}", weights)
    write_atomic(
        f"{directory.rstrip('/')}/{CONFIG_FILE}", (json.dumps(config, indent=2) + "\n").encode()
    )


def read_export_config(directory: str) -> dict:
    """The config.json of an export; ExportError when it is missing or not JSON."""
    path = f"{directory.rstrip('/')}/{CONFIG_FILE}"
    try:
        config = json.loads(read_bytes(path))
    except FileNotFoundError:
        raise ExportError(
            f"{path} not found; export a checkpoint with `python encoder.py export --ckpt CKPT"
            f" --out {directory}`."
        ) from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ExportError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ExportError(
            f"{path} holds a JSON {type(config).__name__}, not the object an export writes; export"
            " the checkpoint again."
        )
    return config


def weights_header(payload: bytes, path: str) -> dict:
    """The header of a safetensors payload ({key: {dtype, shape, data_offsets}, '__metadata__':
    {...}}), read without loading a tensor; ExportError when the file is cut short or not
    safetensors."""
    try:
        size = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8 : 8 + size])
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ExportError(
            f"{path} is not a safetensors file ({e!r}); export the checkpoint again."
        ) from None
    if len(payload) != 8 + size + end:
        raise ExportError(
            f"{path} is {len(payload)} bytes, its header says {8 + size + end}: cut short or"
            " padded; copy the whole export again."
        )
    return header


def check_bound(config: dict, header: dict, directory: str) -> None:
    """That config.json is what the weights were exported with (export_contract, in their metadata
    since format 2): ExportError naming each field that differs, or for weights that carry none
    (saved again without it)."""
    bound, where = (
        (header.get("__metadata__") or {}).get("contract"),
        f"{directory.rstrip('/')}/{CONFIG_FILE}",
    )
    if bound is None and config.get("format_version", 1) >= 2:
        raise ExportError(
            f"{directory.rstrip('/')}/{WEIGHTS_FILE} carries no export contract in its metadata"
            f" (saved again without it, or by another tool) while {where} says format 2 or later;"
            " export the checkpoint again."
        )
    if bound is not None and bound != export_contract(config):
        signed, given = (
            {
                f"{s}.{k}".rstrip("."): x
                for s, v in json.loads(c).items()
                for k, x in (v.items() if isinstance(v, dict) else [("", v)])
            }
            for c in (bound, export_contract(config))
        )
        changed = [
            f"{k}: {str(signed.get(k))[:80]} -> {str(given.get(k))[:80]}"
            for k in sorted({*signed, *given})
            if signed.get(k) != given.get(k)
        ]
        raise ExportError(
            f"{where} differs from what its weights were exported with ({'; '.join(changed)}): it"
            " was edited, or the weights belong to another export; export the checkpoint again."
        )


def check_folder_files(config: dict, directory: str) -> None:
    """That the folder holds only what load_encoder knows: config.json, the weights, the model card,
    a fine-tuned fold's heads and fold.json, a git clone's .git, and the loader files of an export
    written with --with_loader_code (what torch.hub.load(FOLDER) and `import octjepa_encoder` would
    run) only when their sha256 is config.json `code`'s. ExportError naming the others: a module
    beside the weights (huggingface_hub.py, safetensors/) would run when Python imports that name
    from the folder. Runs none of them."""
    where, code = f"{directory.rstrip('/')}/{CONFIG_FILE}", config.get("code", {})
    if (
        not isinstance(code, dict)
        or not set(code) <= {STANDALONE_MODULE, HUBCONF}
        or not all(isinstance(d, str) for d in code.values())
    ):
        raise ExportError(
            f"{where}: code {str(code)[:120]} is not what an export writes (a dict of "
            f"{STANDALONE_MODULE} and {HUBCONF} to their sha256); export the checkpoint again."
        )
    weights = config.get("weights") if isinstance(config.get("weights"), dict) else {}
    known = {
        CONFIG_FILE,
        WEIGHTS_FILE,
        MODEL_CARD,
        *FOLD_FILES,
        *GIT_FILES,
        *code,
        *([EARLIER_WEIGHTS_FILE] if weights.get("file") == EARLIER_WEIGHTS_FILE else []),
    }
    if directory.startswith("gs://"):
        found = {p.rstrip("/").rsplit("/", 1)[-1] for p in glob_paths(f"{directory.rstrip('/')}/*")}
    else:
        found = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    unknown = sorted(found - known)
    if unknown:
        raise ExportError(
            f"{directory.rstrip('/')} holds"
            f" {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}, which an export does"
            " not: files of code or data that came with the folder (Python would import a module"
            f" of that name from it). Delete them, or copy only {CONFIG_FILE}, {WEIGHTS_FILE} and"
            f" {MODEL_CARD} into a new folder, and load that."
        )
    for name, digest in code.items():
        path = f"{directory.rstrip('/')}/{name}"  # a loader file left out runs nothing
        if name in found and _sha256(read_bytes(path)) != digest:
            raise ExportError(
                f"{path} is not the file that was exported (its sha256 differs from {CONFIG_FILE} "
                "code): torch.hub.load and `import octjepa_encoder` would run it; export it again."
            )


def load_encoder(
    directory: str, encoder_class: type = PretrainedEncoder, allow_older_format: bool = False
) -> PretrainedEncoder:
    """The encoder exported to `directory` (local or gs://), in eval mode on the CPU, importing
    nothing of the folder. The folder must hold only an export's files (check_folder_files), the
    weights must match config.json exactly (sha256, check_bound, every key, shape and dtype: all
    checked before the architecture is built). Raises ExportError naming the file, key or field. An
    export of an older format_version (its weights bind less of config.json) is refused unless
    allow_older_format. encoder_class: PretrainedEncoder or a subclass (HubEncoder). These checks
    find damage and edits made by hand; they cannot prove who made an export (anyone can recompute a
    sha256): trust a received export as much as its sender."""
    config = read_export_config(directory)
    # every field, before any weight
    settings = export_settings(config, f"{directory.rstrip('/')}/{CONFIG_FILE}")
    if config["format_version"] < FULLY_BOUND_VERSION and not allow_older_format:
        raise ExportError(
            f"{directory.rstrip('/')}/{CONFIG_FILE}: format_version {config['format_version']},"
            f" older than {FULLY_BOUND_VERSION}: its weights bind less of config.json."
            " Export the checkpoint again, or load_encoder(DIR, allow_older_format=True) if you"
            " trust its sender."
        )
    check_folder_files(config, directory)
    weights = config.get("weights") if isinstance(config.get("weights"), dict) else {}
    name = (
        weights.get("file")
        if weights.get("file") in (WEIGHTS_FILE, EARLIER_WEIGHTS_FILE)
        else WEIGHTS_FILE
    )
    path = f"{directory.rstrip('/')}/{name}"
    try:
        payload = read_bytes(path)
    except FileNotFoundError:
        raise ExportError(
            f"{path} not found (config.json without its weights: copy the whole export folder)."
        ) from None
    if _sha256(payload) != weights.get("sha256"):
        raise ExportError(
            f"{path}: its sha256 {_sha256(payload)[:16]}... differs from {CONFIG_FILE}"
            f" weights.sha256 {str(weights.get('sha256'))[:16]}...: the weights were changed or"
            " belong to another export."
        )
    header = weights_header(payload, path)
    check_bound(config, header, directory)
    # the architecture's shapes without its memory: checked before it is built
    with torch.device("meta"):
        expected = {
            k: (v.shape, v.dtype)
            for k, v in (
                PretrainedEncoder(config, f"{directory.rstrip('/')}/{CONFIG_FILE}")
                .state_dict()
                .items()
            )
        }
    found = {
        k: (torch.Size(t["shape"]), t["dtype"]) for k, t in header.items() if k != "__metadata__"
    }
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        problem = f"key {missing[0]} is missing" if missing else f"unexpected key {unexpected[0]}"
        raise ExportError(
            f"{path}: {problem} for the architecture in {CONFIG_FILE} ({settings.depth} blocks "
            f"of width {settings.embed_dim})."
        )
    for key, (shape, dtype) in found.items():
        if shape != expected[key][0] or SAFETENSORS_DTYPES.get(dtype) != expected[key][1]:
            raise ExportError(
                f"{path}: key {key} is {SAFETENSORS_DTYPES.get(dtype, dtype)} {list(shape)}, the "
                f"architecture in {CONFIG_FILE} needs {expected[key][1]} {list(expected[key][0])}."
            )
    encoder = encoder_class(config, f"{directory.rstrip('/')}/{CONFIG_FILE}")
    encoder.load_state_dict(safetensors.torch.load(payload), strict=True)
    return encoder.eval()


class HubEncoder(PretrainedEncoder, PyTorchModelHubMixin):
    """An exported encoder with Hugging Face's save_pretrained / push_to_hub / from_pretrained
    (needs huggingface_hub), octjepa's code doing both sides: from_pretrained(local folder or hub
    repo) is load_encoder of its config.json, model.safetensors and README.md (no code of the folder
    runs); save_pretrained(folder) writes those three: the weights with their contract
    (save_encoder), and the model card it was loaded with, so load_encoder reads the folder. No code
    files (an export written with --with_loader_code keeps its octjepa_encoder.py and
    hubconf.py)."""

    card: Optional[bytes] = None  # README.md of the folder it was loaded from

    def _save_pretrained(self, save_directory) -> None:
        """config.json, model.safetensors and the model card (the mixin writes its generic card only
        where there was none)."""
        save_encoder(self.state_dict(), self.config, str(save_directory))
        if self.card is not None:
            write_atomic(f"{save_directory}/{MODEL_CARD}", self.card)

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision,
        cache_dir,
        force_download,
        local_files_only,
        token,
        **model_kwargs,
    ) -> "HubEncoder":
        """load_encoder of a local folder, or of a hub repo's config.json, model.safetensors and
        README.md."""
        folder = model_id
        if not exists(f"{model_id.rstrip('/')}/{CONFIG_FILE}"):
            from huggingface_hub import snapshot_download

            folder = snapshot_download(
                model_id,
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                force_download=force_download,
                local_files_only=local_files_only,
                allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, MODEL_CARD],
            )
        encoder = load_encoder(folder, cls)
        encoder.card = (
            read_bytes(f"{folder.rstrip('/')}/{MODEL_CARD}")
            if exists(f"{folder}/{MODEL_CARD}")
            else None
        )
        return encoder
