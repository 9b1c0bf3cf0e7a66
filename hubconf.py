"""torch.hub entry point of octjepa: torch.hub.load("path/to/octjepa", "encoder", source="local",
path=EXPORT) (or "OWNER/octjepa" from GitHub) loads the export folder EXPORT with the octjepa_encoder.py beside this
file, importing nothing from EXPORT. An export written with --with_loader_code holds a copy of both files:
torch.hub.load(EXPORT, "encoder", source="local") runs that copy (trust its sender first)."""
import importlib.util
import os

dependencies = ["torch", "safetensors", "numpy"]


def encoder(path: str = None):
    """The encoder exported to the folder `path` (default: this file's folder, an export written with
    --with_loader_code), in eval mode on the CPU: octjepa_encoder.load(path)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if path is None and not os.path.exists(os.path.join(here, "config.json")):
        raise ValueError('give the export folder: torch.hub.load(..., "encoder", path="path/to/export")')
    spec = importlib.util.spec_from_file_location("octjepa_encoder", os.path.join(here, "octjepa_encoder.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load(path or here)
