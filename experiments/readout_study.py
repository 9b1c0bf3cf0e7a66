"""How much of the demo verdict's spread is its attentive read-out's fit? The tokens of finished
demo runs (their newest checkpoint's target encoder, and the random init the verdict compares it
with) on the verdict's labelled phantoms, read by attentive read-outs of other budgets on the same
splits: the default (300 full-batch AdamW steps, lr 1e-2, weight decay 1e-2), and each variant
below. For each: per run, the mean over splits of the pretrained and random scores and their paired
difference, and the split-to-split std of that difference.

    python experiments/readout_study.py --volumes 300 --splits 10 experiments/runs/varied_s{0,1,2,3,4}
    # -> experiments/demo/readout_study.json
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint import (
    read_model_checkpoint,
    resolve_checkpoint,
)  # noqa: E402  (the repo's flat modules)
from readouts import (
    attentive_outputs,
    classification_scores,
    fit_attentive,
    probe_split,
)  # noqa: E402
from runprobe import frozen_tokens, prepare_probe_set, random_model  # noqa: E402

VARIANTS = {  # name: (fit_attentive keywords, inits averaged)
    "default": ({}, 1),
    "wd0.1": ({"weight_decay": 0.1}, 1),
    "steps100": ({"steps": 100}, 1),
    "lr3e-3": ({"lr": 3e-3}, 1),
    "ensemble3": ({}, 3),
}


def score(tokens, labels, train, test, seed, kwargs, inits):
    """Held-out AUROC of the attentive read-out, its class probabilities averaged over `inits`
    initialisations."""
    probs = (
        sum(
            F.softmax(
                attentive_outputs(
                    fit_attentive(tokens, labels, train, seed + 1000 * k, **kwargs), tokens, test
                ),
                dim=-1,
            )
            for k in range(inits)
        )
        / inits
    )
    return classification_scores(probs.numpy(), labels[test])["auroc"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--volumes", type=int, default=300)
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "readout_study.json")
    report = json.load(open(out)) if os.path.exists(out) else {}
    for run in args.runs:
        model, cfg, _ = read_model_checkpoint(resolve_checkpoint(os.path.join(run, "checkpoints")))
        probe_set = prepare_probe_set(cfg, max_volumes=args.volumes)
        with torch.random.fork_rng():
            tokens = frozen_tokens(
                {"pretrained": model, "random": random_model(cfg)}, probe_set.volumes, "cpu"
            )
        labels, name = probe_set.labels, os.path.basename(run.rstrip("/"))
        for variant in args.variants.split(","):
            kwargs, inits = VARIANTS[variant]
            values = {
                arm: [
                    score(t, labels, *probe_split(labels, s), s, kwargs, inits)
                    for s in range(args.splits)
                ]
                for arm, t in tokens.items()
            }
            diff = np.subtract(values["pretrained"], values["random"])
            report[f"{name} {variant} {args.volumes}x{args.splits}"] = values
            print(
                f"{name} {variant}: pretrained {np.mean(values['pretrained']):.3f} random "
                f"{np.mean(values['random']):.3f} diff {diff.mean():+.3f} sd"
                f" {diff.std(ddof=1):.3f}",
                flush=True,
            )
            with open(out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
