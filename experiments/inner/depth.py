"""Where the suite's lesions sit in a token: drusen and fluid (the `lesion` task's set) beside foci
and cysts (the `inner_lesion` task's), replayed from the phantom sets' parameters
(phantom.set_member, voxel_layers: no files).

    python experiments/inner/depth.py [N] [--json experiments/inner/depth.json]    # N volumes of each set (60)

For each token geometry (model input and tubelet; the 32x128x128 phantoms are resized to the input,
so a token covers D/gd x H/gh x W/gw phantom voxels) and each kind of lesion: the share of its
voxels in each depth quarter of their token (the quarters of learn.yaml's local_loss_split [1, 4,
1]), the share in tokens that also hold RPE voxels, and how far above the top of the RPE they lie,
in phantom rows and in token rows (0: the token row of the RPE's top).
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from labels import PHANTOM_SETS  # noqa: E402
from phantom import DEFAULT_SIZE, INNER_LAYERS, LAYERS, set_member, voxel_layers  # noqa: E402

GEOMETRIES = {
    "learn.yaml: 4x8x8 tubelets on 16x64x64": ((16, 64, 64), (4, 8, 8)),
    "4x16x16 tubelets on 16x128x128": ((16, 128, 128), (4, 16, 16)),
}
# voxel layer ids of phantom.voxel_layers
NAMES = [name for name, _, _ in LAYERS] + list(INNER_LAYERS)
KINDS = {"varied": ("drusen", "fluid"), "inner": INNER_LAYERS}
RPE = NAMES.index("rpe")


def lesion_depths(layers: np.ndarray, lesion: int, token: tuple) -> dict:
    """Per voxel of the lesion layer id in a layer map [D, H, W] cut into tokens of `token`
    (B-scans, rows, columns) phantom voxels: the depth quarter of its token, its rows above the top
    of the RPE in its A-scan, its token row relative to the token row of that RPE top, and whether
    its token holds RPE voxels."""
    (D, H, W), (b, rows, c) = layers.shape, token
    d, r, w = np.nonzero(layers == lesion)
    rpe_top = (layers == RPE).argmax(1)  # [D, W] first RPE row of each A-scan
    # [gd, gh, gw]
    rpe_tokens = (layers == RPE).reshape(D // b, b, H // rows, rows, W // c, c).any((1, 3, 5))
    return {
        "quarter": (r % rows) * 4 // rows,
        "above_rpe": rpe_top[d, w] - r,
        "token_row": r // rows - rpe_top[d, w] // rows,
        "rpe_token": rpe_tokens[d // b, r // rows, w // c],
    }


def summary(rows: list) -> dict:
    """The measurements of one kind of lesion, over its voxels in every volume."""
    # volumes without such voxels add none
    cat = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    above = cat["above_rpe"]
    return {
        "voxels": int(len(above)),
        "quarter_share": [round(float((cat["quarter"] == q).mean()), 3) for q in range(4)],
        "in_rpe_tokens": round(float(cat["rpe_token"].mean()), 3),
        "rows_above_rpe_top": {
            p: round(float(np.percentile(above, q)), 1)
            for p, q in (("p5", 5), ("median", 50), ("p95", 95))
        },
        "token_rows_above_rpe_top": {
            str(int(-t)): round(float((cat["token_row"] == t).mean()), 3)
            for t in sorted(set(cat["token_row"].tolist()))
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "n", nargs="?", type=int, default=60, help="volumes of each set (default 60)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {"phantom_size": list(DEFAULT_SIZE), "volumes_per_set": args.n, "geometries": {}}
    maps = {}
    for kind, names in KINDS.items():
        _, seed, varied, lesions = PHANTOM_SETS[kind]
        for i in range(args.n):
            _, _, label, eye = set_member(i, seed, varied, lesions)
            if label != "none":
                maps.setdefault(kind, []).append(
                    voxel_layers(DEFAULT_SIZE, seed * 100003 + i, label, eye)
                )
    for geometry, (size, patch) in GEOMETRIES.items():
        grid = [s // p for s, p in zip(size, patch)]
        token = tuple(n // g for n, g in zip(DEFAULT_SIZE, grid))
        report = {"token_phantom_voxels": list(token)}
        for kind, names in KINDS.items():
            for name in names:
                found = [lesion_depths(layers, NAMES.index(name), token) for layers in maps[kind]]
                report[name] = summary(found)
        out["geometries"][geometry] = report
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
