"""A quick validity screen of inner-lesion sizes: the hand-made features and the supervised CNN
(references.py) on N phantoms of the inner set drawn in memory (no DICOM: quantized to 8 bits,
resized to learn.yaml's 16x64x64, clipped at the 0.5/99.5 percentiles and normalized, as data.py
prepares them), with phantom constants overridden.

    python experiments/inner/screen.py N SEEDS ['{"INNER_COUNT": [[30, 60], [6, 12]], ...}'] [--no_cnn]

The suite's own measurement is `python probe.py --ckpt random --config configs/learn.yaml --tasks
inner_lesion`.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import phantom  # noqa: E402
from data import clip_limits, resample  # noqa: E402
from labels import PHANTOM_SETS  # noqa: E402
from references import handmade_scores, supervised_scores  # noqa: E402


def as_tuples(value):
    """JSON lists as the nested tuples of phantom's constants."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, list) else value


def drawn_volumes(n: int):
    """(volumes [n, 1, 16, 64, 64], lesion yes = 1 [n], labels [n]) of the first n members of the
    inner set."""
    _, seed, varied, lesions = PHANTOM_SETS["inner"]
    volumes, labels = [], []
    for i in range(n):
        _, _, label, eye = phantom.set_member(i, seed, varied, lesions)
        rng = np.random.default_rng([seed * 100003 + i, phantom.ALL_LABELS.index(label)])
        x = resample(
            phantom.quantize(phantom.synth_reflectivity(phantom.DEFAULT_SIZE, rng, label, eye), 8),
            (16, 64, 64),
        )
        x = x.clamp(*clip_limits(x, (0.5, 99.5)))
        volumes.append(((x - x.mean()) / x.std())[None])
        labels.append(label)
    labels = np.array(labels)
    return torch.stack(volumes), (labels != "none").astype(int), labels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("n", type=int)
    parser.add_argument("seeds", type=int)
    parser.add_argument("overrides", nargs="?", default="{}", help="JSON {phantom constant: value}")
    parser.add_argument("--no_cnn", action="store_true")
    args = parser.parse_args()
    for name, value in json.loads(args.overrides).items():
        setattr(phantom, name, as_tuples(value))
    volumes, y, labels = drawn_volumes(args.n)
    for kind in ("all", *phantom.INNER_LABELS):
        keep = np.ones(len(y), bool) if kind == "all" else np.isin(labels, ["none", kind])
        scores = handmade_scores(volumes[keep], y[keep], range(args.seeds))
        print(
            kind,
            "hand-made",
            {f: round(s["auroc"]["mean"], 3) for f, s in scores.items()},
            flush=True,
        )
    if not args.no_cnn:
        cnn = supervised_scores(volumes, y, range(args.seeds))["auroc"]
        print(f"CNN {cnn['mean']:.3f} [{cnn['low']:.3f}, {cnn['high']:.3f}]")


if __name__ == "__main__":
    main()
