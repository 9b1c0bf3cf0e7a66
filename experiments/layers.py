"""Where along the encoder a probe task's signal is: probe.py's read-outs (its procedure, splits and
seeds) on the target encoder's tokens after the tubelet embedding (+ positions), after each block,
and after the final norm (the tokens probe.py reads). experiments/README.md and experiments/NOTES.md
section 9 quote it.

    python experiments/layers.py CKPT [CKPT:random ...] [--task lesion] [--readouts attentive] [--seeds 5]

CKPT: a train.py checkpoint file or its run's checkpoints folder; CKPT:random: the random init of
that run's architecture and seed (as probe.py --vs_random builds it). The labelled phantoms are the
suite's, next to data/phantoms256 as experiments/run.sh probes them, preprocessed for the first
CKPT's image size.
"""

import argparse
import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from config import load_config  # noqa: E402  (the repo's flat modules)
from checkpoint import read_model_checkpoint, resolve_checkpoint  # noqa: E402
from labels import load_labelled_volumes, phantom_set_labels, task_targets  # noqa: E402
from tokens import encode_volumes  # noqa: E402
from probe import SUITE  # noqa: E402
from readouts import READOUTS, readout_scores  # noqa: E402
from runprobe import random_model  # noqa: E402


def layer_tokens(model: torch.nn.Module, volumes: torch.Tensor) -> list:
    """[embedding, block 1, ..., block L, output]: the target encoder's tokens [M, N, E] of volumes
    [M,1,D,H,W] at each layer, read by hooks during probe.py's own encoding (the output is what
    probe.py reads)."""
    blocks = model.target_encoder.blocks
    calls = []  # per batch: [the first block's input, each block's output]
    hooks = [blocks[0].register_forward_pre_hook(lambda block, args: calls.append([args[0]]))]
    hooks += [
        block.register_forward_hook(lambda block, args, out: calls[-1].append(out))
        for block in blocks
    ]
    try:
        output = encode_volumes({"model": model.eval()}, volumes, "cpu")["model"]
    finally:
        for hook in hooks:
            hook.remove()
    # the last batch is padded at its end
    return [torch.cat(layer)[: len(volumes)] for layer in zip(*calls)] + [output]


def main() -> None:
    tasks = {t.name: (kind, t) for kind, suite in SUITE.items() for t in suite}
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ckpts", nargs="+", metavar="CKPT")
    parser.add_argument("--task", default="lesion", choices=sorted(tasks))
    parser.add_argument(
        "--readouts", default="attentive", help=f"comma-separated, of {', '.join(READOUTS)}"
    )
    parser.add_argument(
        "--seeds", type=int, default=5, help="probe seeds (splits), as probe.py --seeds"
    )
    args = parser.parse_args()
    kind, task = tasks[args.task]
    cfg = load_config(
        [
            "--config",
            os.path.join(os.path.dirname(HERE), "configs/learn.yaml"),
            "--phantom_dir",
            "data/phantoms256",
        ]
    )
    labels = phantom_set_labels(cfg, kind)
    volumes = None
    for spec in args.ckpts:
        model, model_cfg, _ = read_model_checkpoint(
            resolve_checkpoint(spec.removesuffix(":random"))
        )
        if spec.endswith(":random"):
            model = random_model(model_cfg)
        if volumes is None:
            volumes, values, _ = load_labelled_volumes(
                dataclasses.replace(
                    model_cfg, phantom_dir=cfg.phantom_dir, cache_dir=cfg.cache_dir
                ),
                labels,
                columns=[task.column],
            )
            targets, _ = task_targets(values[task.column])
        layers = layer_tokens(model, volumes)
        names = ["embedding"] + [f"block {i}" for i in range(1, len(layers) - 1)] + ["output"]
        for name, tokens in zip(names, layers):
            scores = readout_scores(
                tokens, model.grid, targets, range(args.seeds), args.readouts.split(",")
            )
            cells = ", ".join(
                f"{r} {s[task.metric]['mean']:.3f} [{s[task.metric]['low']:.3f}, "
                f"{s[task.metric]['high']:.3f}]"
                for r, s in scores.items()
            )
            print(f"{spec} | {args.task} | {name}: {cells}", flush=True)


if __name__ == "__main__":
    main()
