"""The tubelet embedding alone at a config's sizes: what each stem costs an update, timed alternately in
one process, with the local loss's targets beside them.

    python experiments/speed/stem_alone.py [CONFIG] [--repeats N] [--json OUT]   # default: pretrain_vitl.yaml

For each stem (the linear one; the hmlp stem from 1x4x4 cells with E/2 and with E/4 channels, and
from 2x4x4 cells with E/2), in an Encoder without blocks, as an update runs it on one volume: the
target encoder's embedding of every token (no gradient) and the context encoder's of its tokens
only (Encoder.embed_kept, a random mask's context tokens), forward and backward, the stem recomputed
in backward as in training. The median seconds of `repeats` rounds after one warm-up, each round
timing every stem once, and model.token_voxel_statistics (the local loss's targets) of the same
volume.
"""

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
from config import load_config  # noqa: E402
from model import Encoder, token_voxel_statistics  # noqa: E402

# bench.py's recipe variants whose stems are timed here
STEMS = {
    name: bench.RECIPES[name]
    for name in ("linear", "hmlp_1x4x4", "hmlp_1x4x4_narrow", "hmlp_2x4x4")
}


def embedding_only(cfg) -> Encoder:
    """The config's encoder without its blocks: the tubelet embedding and the positions."""
    return Encoder(
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        dim=cfg.embed_dim,
        depth=0,
        num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_ratio,
        patch_stem=cfg.patch_stem,
        stem_cell=cfg.stem_cell,
        stem_width=cfg.stem_width,
    )


def seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="configs/pretrain_vitl.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    cfg = load_config(["--config", args.config, "--device", "cpu"])
    torch.manual_seed(0)
    volume = torch.randn(1, 1, *cfg.image_size)
    n_context = cfg.token_counts()[0]
    keep_idx = torch.randperm(math.prod(cfg.image_size) // math.prod(cfg.patch_size))
    keep_idx = keep_idx[:n_context][None]  # [1, K]
    encoders = {name: embedding_only(replace(cfg, **fields)) for name, fields in STEMS.items()}

    def target(encoder):
        with torch.no_grad():
            encoder.embed_tubelets(volume)

    def context(encoder):
        encoder.embed_kept(volume, keep_idx).square().mean().backward()

    parts = {"target": target, "context": context}
    times = {f"{name} {part}": [] for name in encoders for part in parts}
    times["local loss targets"] = []
    for round_ in range(args.repeats + 1):
        for name, encoder in encoders.items():
            for part, run in parts.items():
                t = seconds(lambda: run(encoder))
                if round_:
                    times[f"{name} {part}"].append(t)
        t = seconds(lambda: token_voxel_statistics(volume, cfg.patch_size, cfg.local_loss_split))
        if round_:
            times["local loss targets"].append(t)
    medians = {key: statistics.median(values) for key, values in times.items()}
    for key, value in medians.items():
        print(f"{key:32s} {value:7.2f} s  (of {', '.join(f'{t:.2f}' for t in times[key])})")
    for name in encoders:
        extra = sum(medians[f"{name} {p}"] - medians[f"linear {p}"] for p in parts)
        print(f"{name}: +{extra:.2f} s an update over the linear stem")
    if args.json:
        report = {
            "config": args.config,
            "context_tokens": n_context,
            "threads": torch.get_num_threads(),
            "seconds": times,
            "median_s": medians,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
