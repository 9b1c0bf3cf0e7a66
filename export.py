"""An encoder export: the folder `python encoder.py export` writes, which loads in any project (docs/encoder.md).

    model.safetensors   the EMA target encoder's weights (pretrained.save_encoder)
    config.json         architecture, preprocessing contract, augmentation, input sizes, sha256, provenance
    octjepa_encoder.py  pretrained.py's ExportedEncoder, monai_vit and monai_unetr with what they need, copied from
                        the source of model.py and pretrained.py (never a hand-kept copy), and a loader; torch,
                        safetensors and numpy only
    hubconf.py          torch.hub.load(FOLDER, "encoder", source="local")
    README.md           the model card (no paths)

export() builds it in a local staging folder, loads it back with both loaders and compares the tokens with the
checkpoint's target encoder before anything reaches `out` (nothing is written when they differ, or when the
weights hold NaN).
"""
import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import tempfile
from typing import Sequence, Tuple

import torch

from checkpoint import read_model_checkpoint, resolve_checkpoint
from config import Config, ConfigError
from model import VJEPA3D
from pretrained import (CONFIG_FILE, EXPORT_FORMAT, EXPORT_VERSION, MODEL_CARD, WEIGHTS_FILE, ExportedEncoder,
                        ExportError, export_config, load_encoder, save_encoder)
from privacy import share_safe_source
from storage import exists, write_atomic

ROUND_TRIP_TOLERANCE = 1e-6


def export(ckpt: str, out: str, force: bool = False) -> float:
    """Write the EMA target encoder of a train.py checkpoint (a file, or a run's checkpoints folder: its newest
    step) to `out` as an export; returns the round-trip error: the largest |difference| between the loaded export's
    tokens and the checkpoint's target encoder's on a random batch (ExportError above ROUND_TRIP_TOLERANCE)."""
    path = resolve_checkpoint(ckpt)
    model, cfg, state = read_model_checkpoint(path)
    if exists(f"{out.rstrip('/')}/{CONFIG_FILE}") and not force:
        raise ConfigError(f"out: {out} already holds an export; choose another --out, or --force to replace it.")
    source = {"checkpoint": path, "encoder": "target (EMA)", "update": state.get("train_state", {}).get("step"),
              "plan": state.get("plan"), "training_config": state["config"]}
    state_dict = model.encoder_state_dict()
    broken = [k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:
        raise ExportError(f"{path}: the target encoder's {broken[0]} (and {len(broken) - 1} more) holds NaN or inf; "
                          f"export an earlier checkpoint (best.pt or a step before the run diverged).")
    code = {STANDALONE_MODULE: standalone_module(), HUBCONF: HUBCONF_SOURCE}  # what torch.hub and an import run
    config = {**export_config(cfg, share_safe_source(source)),  # no paths of this machine
              "code": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in code.items()}}
    with tempfile.TemporaryDirectory() as staging:  # built and checked here, then copied: config.json last
        save_encoder(state_dict, config, staging)  # the weights bind config.json, the code files' sha256 included
        for name, text in (*code.items(), (MODEL_CARD, model_card(config, cfg))):
            with open(os.path.join(staging, name), "wb") as f:
                f.write(text.encode())
        error = max(round_trip_error(model, load_encoder(staging)),
                    round_trip_error(model, import_standalone(staging).load(staging)))
        if not error <= ROUND_TRIP_TOLERANCE:  # nan too
            raise ExportError(f"{out}: the loaded encoder differs from the checkpoint's by up to {error:.3g}; "
                              f"nothing was written.")
        for name in (WEIGHTS_FILE, STANDALONE_MODULE, HUBCONF, MODEL_CARD, CONFIG_FILE):
            with open(os.path.join(staging, name), "rb") as f:
                write_atomic(f"{out.rstrip('/')}/{name}", f.read())
    return error


def round_trip_error(model: VJEPA3D, encoder: ExportedEncoder) -> float:
    """The largest |difference| between the tokens of a loaded export and of the model's target encoder on a fixed
    random batch of two volumes."""
    volume = torch.randn(2, 1, *encoder.image_size, generator=torch.Generator().manual_seed(0))
    return float((encoder.encode(volume) - model.encode(volume)).abs().max())


STANDALONE_MODULE, HUBCONF = "octjepa_encoder.py", "hubconf.py"

STANDALONE_HEADER = '''"""An octjepa encoder, standalone: its architecture and its loader in one file that needs torch,
safetensors and numpy (huggingface_hub optional). Written by octjepa's `encoder.py export` (code {commit}); the
classes and functions below are copied unchanged from octjepa's model.py and pretrained.py. Importing this file, or torch.hub.load of
its folder, runs it: use it only from an export you trust (octjepa's pretrained.load_encoder runs none of it, and refuses
an export whose code files differ from the sha256 in config.json).

    import torch
    encoder = torch.hub.load("path/to/this/folder", "encoder", source="local")  # or, with this folder on sys.path:
    from octjepa_encoder import load; encoder = load("path/to/this/folder")
    tokens = encoder(volume)            # volume [B,1,D,H,W] -> [B,N,E]; D,H,W: any multiple of the patch size
    embedding = encoder.embed(volume)   # [B,E] (pool="depth_rows": [B, gh*E])
    OCTJEPAEncoder.from_pretrained("path/to/this/folder")   # with huggingface_hub installed
    vit = monai_vit(encoder)            # MONAI's ViT with these weights: vit(volume)[0] == tokens
    unetr = monai_unetr(encoder, out_channels=2, img_size=[16, 64, 64])   # MONAI's UNETR with this encoder inside

The input must be preprocessed as config.json's "preprocessing" says (octjepa's data.load_val_sample does it).
"""
{imports}
'''

STANDALONE_LOADER = '''

try:  # optional: save_pretrained / from_pretrained / push_to_hub of Hugging Face's hub tools
    from huggingface_hub import PyTorchModelHubMixin
    HUB_CARD = {{"library_name": "octjepa", "tags": ["oct", "ophthalmology", "3d", "v-jepa", "self-supervised"]}}
except ImportError:
    PyTorchModelHubMixin, HUB_CARD = object, {{}}


class OCTJEPAEncoder(ExportedEncoder, PyTorchModelHubMixin, **HUB_CARD):
    """The exported encoder (ExportedEncoder), loadable with huggingface_hub's from_pretrained(folder) where that
    package is installed."""


def load(folder: str) -> OCTJEPAEncoder:
    """The encoder exported to a local folder, in eval mode on the CPU. Raises ValueError when config.json is not an
    octjepa encoder export this file reads, or the weights' sha256 differs from config.json's; load_state_dict is
    strict (every key, every shape)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config.get("format") != {format!r} or config.get("format_version") != {version!r}:
        raise ValueError(f"{{folder}}/config.json: format {{config.get('format')!r}} version "
                         f"{{config.get('format_version')!r}}, expected {format!r} version {version!r}.")
    path = os.path.join(folder, {weights!r})
    with open(path, "rb") as f:
        payload = f.read()
    if hashlib.sha256(payload).hexdigest() != config["weights"]["sha256"]:
        raise ValueError(f"{{path}}: its sha256 differs from config.json's weights.sha256: the weights were changed "
                         f"or belong to another export.")
    header = json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])  # safetensors: size, JSON header
    if (header.get("__metadata__") or {{}}).get("contract") != export_contract(config):
        raise ValueError(f"{{folder}}/config.json differs from what the weights were exported with (architecture, "
                         f"preprocessing, provenance or code files' sha256): it was edited, or the weights belong to "
                         f"another export.")
    encoder = OCTJEPAEncoder(config)
    encoder.load_state_dict(safetensors.torch.load(payload), strict=True)
    return encoder.eval()
'''

HUBCONF_SOURCE = '''"""torch.hub entry point of this octjepa encoder export:
torch.hub.load(FOLDER, "encoder", source="local")."""
import importlib.util
import os

dependencies = ["torch", "safetensors", "numpy"]


def encoder():
    """The exported encoder of this folder (octjepa_encoder.load), in eval mode on the CPU."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("octjepa_encoder", os.path.join(here, "octjepa_encoder.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load(here)
'''


def trained_data(cfg: Config) -> str:
    """What the encoder was pretrained on, in words, without paths or identifiers."""
    if cfg.data_root is None and cfg.manifest_path is None:
        return (f"{cfg.phantom_count} synthetic OCT volumes (octjepa's phantom.py: layered retinas with drusen and "
                f"fluid lesions, written as DICOM in four makers' styles); no patient data.")
    return ("OCT volumes read from DICOM by octjepa's reader (the data source is not named in this card: whoever "
            "shares these weights describes it here, with its makers, devices, population and consent).")


def run_evaluation(cfg: Config) -> str:
    """The end-of-run probe of the training run (events.jsonl of its run folder), in words, or where to measure."""
    events = os.path.join(cfg.out_dir, cfg.run_name or "", "events.jsonl")
    try:
        with open(events) as f:
            probes = [e for e in map(json.loads, f) if e.get("event") == "summary_probe"]
    except (OSError, ValueError):
        probes = []
    if not probes:
        return ("Not measured at export. Measure it on your labelled volumes: `python finetune.py --encoder DIR "
                "--labels labels.csv --vs_random` (patient-level k-fold, beside a random init).")
    probe = probes[-1]
    rows = [f"- {readout}: AUROC {r['pretrained']['mean']:.3f} [{r['pretrained']['low']:.3f}, "
            f"{r['pretrained']['high']:.3f}], random init {r['random']['mean']:.3f}, hand-made features "
            f"{r['handmade']['mean']:.3f}" for readout, r in probe.get("readouts", {}).items()]
    return (f"The end-of-run probe ({probe.get('task', '').split(' ', 1)[0]}: read-outs of frozen tokens of labelled "
            f"volumes held out from pretraining, 95% intervals over splits):\n" + "\n".join(rows))


def model_card(config: dict, cfg: Config) -> str:
    """The README.md of an export: what it is, how to load it, what it was trained on, how it was evaluated."""
    a, p = config["architecture"], config["preprocessing"]
    update, plan = config["source"].get("update"), config["source"].get("plan") or {}
    return f"""---
library_name: octjepa
license: other
tags: [oct, ophthalmology, 3d, v-jepa, self-supervised, feature-extraction]
---
# octjepa encoder (3D V-JEPA for retinal OCT)

The EMA target encoder of a 3D V-JEPA pretrained with octjepa: a ViT of {a['depth']} blocks, width {a['embed_dim']},
{a['num_heads']} heads, on tubelets of {a['patch_size']} voxels embedded by the {a['patch_stem']} stem; trained on
inputs of {a['image_size']} [D, H, W] (any multiple of the patch size is accepted: the sin-cos positions are built
for its grid). Weights: `model.safetensors`; architecture, preprocessing contract and provenance: `config.json`.

## Use
With octjepa (runs no code of this folder; checks the weights, config.json and the code files' sha256):
```python
from pretrained import load_encoder    # in an octjepa checkout
encoder = load_encoder("THIS_FOLDER")
tokens = encoder(volume)          # volume [B, 1, D, H, W], preprocessed as below -> tokens [B, N, {a['embed_dim']}]
embedding = encoder.embed(volume) # [B, {a['embed_dim']}]: standardize each dimension before cosine or kNN
```
From the Hugging Face Hub, with octjepa and huggingface_hub: `from pretrained import HubEncoder`, then
`encoder = HubEncoder.from_pretrained("REPO_ID")` (load_encoder of config.json, model.safetensors and this card);
`encoder.save_pretrained(DIR)` and `encoder.push_to_hub(REPO_ID)` write those three, this card included.

Without octjepa, where this folder holds its code files (an export does, a save_pretrained copy does not),
`torch.hub.load("THIS_FOLDER", "encoder", source="local")`, `from octjepa_encoder import load` and
`OCTJEPAEncoder.from_pretrained("THIS_FOLDER")` (huggingface_hub) **run this folder's Python files**
(`hubconf.py`, `octjepa_encoder.py`): a received export is untrusted input, so use them only on one you trust, or
load it with octjepa first (which refuses code files that differ from what was exported).

## Preprocessing (config.json "preprocessing")
{chr(10).join(f"- {step}" for step in p['steps'])}

target_spacing {p['target_spacing'] or 'none (resized to image_size)'} mm, clip_percentiles {p['clip_percentiles']},
image_size {p['image_size']}.
octjepa's `data.load_val_sample(path, settings)` does exactly this for DICOM files.

## Intended use
Research: features of retinal OCT volumes for probes, retrieval, clustering and fine-tuning (octjepa's
finetune.py). Not a medical device; not validated for diagnosis or any clinical decision.

## Training data
{trained_data(cfg)}

## Training
Self-supervised (V-JEPA: predict the target encoder's features of masked tubelets), {update} of
{plan.get('total_steps', '?')} optimizer updates, global batch {cfg.global_batch_size}, mask {cfg.mask_type}
(ratio {cfg.mask_ratio}), EMA from {cfg.ema_base}. The whole training config is in config.json "source".

## Evaluation
{run_evaluation(cfg)}

## Licence
Set by whoever shares these weights (`license` above); the terms of the training data apply.

## Code
octjepa, {code_commit()}; `octjepa_encoder.py` holds the architecture copied from its model.py and pretrained.py.
"""


def code_commit() -> str:
    """The git commit of this checkout ('+ local changes' when tracked files differ from it), or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=30)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if commit.returncode:
        return "unknown"
    return f"commit {commit.stdout.strip()}" + (" + local changes" if changed.stdout.strip() else "")


SOURCE_MODULES = ("model", "pretrained")  # what octjepa_encoder.py copies definitions from, in this order


def model_definitions(roots: Sequence[str]) -> Tuple[str, str]:
    """(import lines, source) of the top-level definitions of SOURCE_MODULES that `roots` need, found by name and
    kept in their modules' order: what the standalone module copies. RuntimeError when one of them needs another
    project module (the standalone module could not be loaded elsewhere)."""
    here = os.path.dirname(os.path.abspath(__file__))
    local = {os.path.splitext(f)[0] for f in os.listdir(here) if f.endswith(".py")}
    defined, imported, project, segments = {}, [], set(), {}
    for order, name in enumerate(SOURCE_MODULES):
        source = inspect.getsource(importlib.import_module(name))
        for node in ast.parse(source).body:
            segments[id(node)] = (order, node.lineno, source)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined[node.name] = node
            elif isinstance(node, ast.Assign):
                defined.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                module = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
                if module in local and module not in SOURCE_MODULES:
                    project |= {a.asname or a.name for a in node.names}
                elif module not in local and ast.get_source_segment(source, node) not in imported:
                    imported.append(ast.get_source_segment(source, node))
    needed, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            used = {n.id for n in ast.walk(defined[name]) if isinstance(n, ast.Name)}
            if used & project:
                raise RuntimeError(f"{name} uses {sorted(used & project)} of another octjepa module; the "
                                   f"standalone encoder module needs only torch, safetensors and numpy.")
            todo += sorted(used & set(defined))
    nodes = sorted({id(defined[n]): defined[n] for n in needed}.values(), key=lambda n: segments[id(n)][:2])
    blocks = []
    for node in nodes:
        source = segments[id(node)][2]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        blocks.append("\n".join(source.splitlines()[first - 1:node.end_lineno]))
    return "\n".join(imported), "\n\n\n".join(blocks)


def standalone_module() -> str:
    """The source of octjepa_encoder.py: pretrained.py's ExportedEncoder, monai_vit, monai_unetr and export_contract
    with what they need, and a loader."""
    imports, definitions = model_definitions(["ExportedEncoder", "monai_vit", "monai_unetr", "export_contract"])
    needed = ("import hashlib", "import json", "import os", "import safetensors.torch")
    imports += "".join(f"\n{line}" for line in needed if line not in imports.splitlines())
    return (STANDALONE_HEADER.format(commit=code_commit(), imports=imports) + "\n\n" + definitions + "\n" +
            STANDALONE_LOADER.format(format=EXPORT_FORMAT, version=EXPORT_VERSION, weights=WEIGHTS_FILE))


def import_standalone(folder: str):
    """The octjepa_encoder module of an export folder, imported from its file under a private name (so it neither
    takes nor meets an `octjepa_encoder` already imported)."""
    spec = importlib.util.spec_from_file_location(f"_octjepa_encoder_{abs(hash(folder))}",
                                                  os.path.join(folder, STANDALONE_MODULE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
