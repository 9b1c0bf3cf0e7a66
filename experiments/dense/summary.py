"""Markdown tables of issue 33's runs from the probe reports experiments/dense/ARM_sK.json
(experiments/dense/probe.sh) and the references on the same splits
(experiments/dense/reference.json: hand-made token features and the token FCN;
experiments/dense/random448_sK.json: random inits with 4x4x8 tubelets). A run probed without its
random init (WITH_RANDOM=no experiments/dense/probe.sh) is compared with the random init of the run
of the same seed in the arm RANDOM_FROM names for it (b4 unless named), or of that arm's seed 0
where that one has none: the same encoder architecture (random inits of other seeds or tubelet sizes
differ).

    python experiments/dense/summary.py arms ARM [ARM...]     # per arm and read-out: mean over pretraining seeds
                                                              # [95% interval], random init,
                                                              pretrained - random
    python experiments/dense/summary.py compare ARM_A ARM_B   # A - B paired over pretraining seeds
    python experiments/dense/summary.py health ARM [ARM...]   # position share, RankMe, target_std, CPU seconds
    python experiments/dense/summary.py curve ARM [ARM...]    # the learning curve: each read-out at each probed update
    python experiments/dense/summary.py reference             # the dense task's references and its validity
    python experiments/dense/summary.py shortcut ARM [ARM...] # pretrained - tokens that are only their own voxel
                                                              # statistics, paired over the same
                                                              probe splits
"""

import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from readouts import interval  # noqa: E402  (the repo's flat modules)
from table import cell, signed  # noqa: E402  (experiments/table.py)

ROWS = (
    ("lesion", "attentive"),
    ("lesion", "mean_pool"),
    ("lesion_tokens", "token_linear"),
    ("plain_lesion", "depth_rows"),
)  # what experiments/dense/probe.sh measures


def load(name: str) -> dict:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return json.load(f)


def runs_of(arm: str) -> dict:
    """{seed: report} of the runs ARM_s<k> that have a report."""
    names = [os.path.basename(p)[:-5] for p in glob.glob(os.path.join(HERE, f"{arm}_s*.json"))]
    return {
        int(n.rsplit("s", 1)[1]): load(n)
        for n in names
        if re.fullmatch(rf"{re.escape(arm)}_s\d+", n)
    }


# The arm whose random inits stand in for an arm's runs probed without their own (b4 for any arm not
# named here; a learning-curve point ARMuSTEP: ARM's). b4first: section 11's b4 runs (commit
# 720a850), which v4's were paired with. fr4's context head moves the random stream, so t4's inits
# only stand in for fr4c's: its exact init is fr4's frozen target (`compare fr4c fr4`); fn4's init
# is t4's to the last digit.
RANDOM_FROM = {
    "glf": "lf",
    "lfq": "lf",
    "lfh": "lf",
    "lfqw2": "lf",
    "glf12000": "lf",
    "gl4": "t4",
    "loc4": "t4",
    "loc4w2": "t4",
    "llog4": "t4",
    "lfl": "lf",
    "fr4": "t4",
    "fn4": "t4",
    "fr4c": "t4",
    "fn4c": "t4",
    "v4": "b4first",
    "tg4": "t4",
    "tgs15": "t15",
    "hmlpq": "hmlp",
}


def random_arm(arm: str) -> str:
    """The arm holding the random inits that `arm`'s runs are compared with."""
    run_arm = re.sub(r"u\d+$", "", arm)
    return RANDOM_FROM.get(run_arm, run_arm if run_arm != arm else "b4")


def with_random(report: dict, arm: str, seed: int) -> dict:
    """The report itself if it holds a random init, else the run of that seed of random_arm(arm) if
    that one does, else that arm's seed 0."""
    if "random" in report["tasks"]["lesion"]["encoders"]:
        return report
    runs = runs_of(random_arm(arm))
    same = runs.get(seed)
    return same if same is not None and "random" in same["tasks"]["lesion"]["encoders"] else runs[0]


def score(
    report: dict, task: str, readout: str, encoder: str = "pretrained", arm: str = "", seed: int = 0
) -> float:
    """The mean over probe splits of a read-out's AUROC (a random init: with_random's)."""
    if encoder == "random":
        report = with_random(report, arm, seed)
    return report["tasks"][task]["encoders"][encoder][readout]["auroc"]["mean"]


def arms_table(arms: list) -> None:
    print("| arm (seeds) | task | read-out | pretrained | random init | pretrained - random init |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        runs = runs_of(arm)
        for task, readout in ROWS:
            p = [score(r, task, readout) for r in runs.values()]
            q = [score(r, task, readout, "random", arm, seed) for seed, r in runs.items()]
            print(
                f"| {arm} ({len(runs)}) | {task} | {readout} | {cell(interval(p))} |"
                f" {cell(interval(q))} | {signed(interval([a - b for a, b in zip(p, q)]))} |"
            )


def compare_table(a: str, b: str) -> None:
    runs_a, runs_b = runs_of(a), runs_of(b)
    seeds = sorted(set(runs_a) & set(runs_b))
    print(f"{a} - {b}, paired over pretraining seeds {', '.join(map(str, seeds))}")
    print(f"| task | read-out | {a} | {b} | difference | per seed |")
    print("|---|---|---|---|---|---|")
    for task, readout in ROWS:
        va = [score(runs_a[s], task, readout) for s in seeds]
        vb = [score(runs_b[s], task, readout) for s in seeds]
        diff = [x - y for x, y in zip(va, vb)]
        print(
            f"| {task} | {readout} | {cell(interval(va))} | {cell(interval(vb))} |"
            f" {signed(interval(diff))} | " + ", ".join(f"{d:+.3f}" for d in diff) + " |"
        )


def health_table(arms: list) -> None:
    print(
        "| run | position share: pretrained / random init (probe set) | val position share | RankMe"
        " | target_std | pretraining CPU s |"
    )
    print("|---|---|---|---|---|---|")
    for arm in arms:
        for seed, r in sorted(runs_of(arm).items()):
            share, val = r["tasks"]["lesion_tokens"]["position_share"], r["pretrain"]["last_val"]
            val_share = f"{val['position_share']:.3f}" if "position_share" in val else "-"
            random = with_random(r, arm, seed)["tasks"]["lesion_tokens"]["position_share"]["random"]
            print(
                f"| {arm}_s{seed} | {share['pretrained']:.3f} / {random:.3f} | {val_share} | "
                f"{val['rankme']:.1f} | {val['target_std']:.3f} | {r['pretrain']['cpu_s']:.0f} |"
            )


def steps_of(report: dict) -> int:
    """The run's length in updates (its --max_steps): where its final report was probed."""
    return int(re.search(r"--max_steps (\d+)", report["pretrain"]["command"]).group(1))


def curve_table(arms: list) -> None:
    print(
        "| arm | update | pretraining CPU s (share of the run's) | "
        + " | ".join(f"{t} {r}" for t, r in ROWS)
        + " | position share |"
    )
    print("|---|---|---|" + "---|" * (len(ROWS) + 1))
    for arm in arms:
        points = sorted(
            {
                int(m.group(1))
                for p in glob.glob(os.path.join(HERE, f"{arm}u*_s*.json"))
                if (m := re.fullmatch(rf"{re.escape(arm)}u(\d+)_s\d+", os.path.basename(p)[:-5]))
            }
        )
        for point in [0, *points, None]:
            name = arm if point is None else f"{arm}u{point}"
            runs = runs_of(arm if point == 0 else name)
            if not runs:
                continue
            final = runs_of(arm)
            step = 0 if point == 0 else point or steps_of(next(iter(final.values())))
            encoder = "random" if point == 0 else "pretrained"
            cpu = [r["pretrain"]["cpu_s"] * step / steps_of(r) for r in final.values()]
            cells = [
                cell(interval([score(r, t, ro, encoder, arm, seed) for seed, r in runs.items()]))
                for t, ro in ROWS
            ]
            share = [
                (with_random(r, arm, seed) if point == 0 else r)["tasks"]["lesion_tokens"][
                    "position_share"
                ][encoder]
                for seed, r in runs.items()
            ]
            print(
                f"| {arm} ({len(runs)}) | {step}{' (random init)' if point == 0 else ''} |"
                f" {sum(cpu) / len(cpu):.0f} | "
                + " | ".join(cells)
                + f" | {sum(share) / len(share):.3f} |"
            )


def reference_table() -> None:
    t = load("reference")["tasks"]["lesion_tokens"]
    print(
        f"lesion_tokens: {t['scored_tokens']} scored tokens, {t['lesion_tokens']} of them lesion"
        f" tokens, {t['volumes']} volumes; valid: {t['valid']}"
    )
    print("| features | AUROC | average precision |")
    print("|---|---|---|")
    rows = {f"hand-made {n}": s for n, s in t["handmade"].items()}
    rows["supervised token FCN"] = t["supervised"]
    rows["random init 4x8x8 (seed 0)"] = t["encoders"]["encoder"]["token_linear"]
    for seed, r in sorted(runs_of("random448").items()):
        rows[f"random init 4x4x8 (seed {seed}), pooled 2:1"] = r["tasks"]["lesion_tokens"][
            "encoders"
        ]["encoder"]["token_linear"]
    for name, s in rows.items():
        print(f"| {name} | {cell(s['auroc'])} | {cell(s['ap'])} |")


def shortcut_table(arms: list) -> None:
    """Each run minus the hand-made token features (each token's mean, std, percentiles and
    histogram) on the same probe splits: `lesion_tokens` against reference.json's, `lesion`
    attentive against handmade_attentive.json's (the same attentive probe over those tokens, on the
    run's tubelet grid), and against tokens holding those statistics for each of their four depth
    quarters (4x8x8 grid only)."""
    dense = load("reference")["tasks"]["lesion_tokens"]["handmade"]["token_stats_histogram"][
        "auroc"
    ]["values"]
    attentive = load("handmade_attentive")["features"]
    print(
        "| run | `lesion` attentive - token statistics | `lesion` attentive - depth-quarter"
        " statistics | `lesion_tokens` - token statistics |"
    )
    print("|---|---|---|---|")
    for arm in arms:
        means = {"token": [], "quarters": [], "dense": []}
        for seed, r in sorted(runs_of(arm).items()):
            grid = "4,4,8" if "--patch_size 4,4,8" in r["pretrain"]["command"] else "4,8,8"
            volume = r["tasks"]["lesion"]["encoders"]["pretrained"]["attentive"]["auroc"]["values"]
            quarters = attentive.get(f"token_stats_histogram {grid} by 1,4,1")
            references = {  # name: (the run's values, the reference's on the same splits, or None)
                "token": (
                    volume,
                    attentive[f"token_stats_histogram {grid}"]["attentive"]["auroc"]["values"],
                ),
                "quarters": (volume, quarters and quarters["attentive"]["auroc"]["values"]),
                "dense": (
                    r["tasks"]["lesion_tokens"]["encoders"]["pretrained"]["token_linear"]["auroc"][
                        "values"
                    ],
                    dense,
                ),
            }
            cells = []
            for name, (values, reference) in references.items():
                if reference is None:
                    cells.append("")
                    continue
                diff = [a - b for a, b in zip(values, reference, strict=True)]
                means[name].append(sum(diff) / len(diff))
                cells.append(signed(interval(diff)))
            print(f"| {arm}_s{seed} ({grid}) | " + " | ".join(cells) + " |")
        print(
            f"| {arm}: mean over seeds | "
            + " | ".join(signed(interval(m)) if m else "" for m in means.values())
            + " |"
        )


if __name__ == "__main__":
    command, args = (sys.argv[1:2] or ["help"])[0], sys.argv[2:]
    {
        "arms": lambda: arms_table(args),
        "compare": lambda: compare_table(*args),
        "health": lambda: health_table(args),
        "curve": lambda: curve_table(args),
        "shortcut": lambda: shortcut_table(args),
        "reference": reference_table,
    }.get(command, lambda: sys.exit(__doc__))()
