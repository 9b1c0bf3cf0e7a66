"""Markdown tables of experiments/README.md's fine-tuning results from finetune.py reports
(experiments/finetune.sh):
    python experiments/finetune_table.py RANDOM.json REPORT.json [REPORT.json ...]
RANDOM.json is the report of finetune.py on an export of the random init
(pretrained.random_encoder), the others of the pretrained encoders; all must have the same folds
(the same labels, --seed, --folds and --repeats), so that each encoder is compared with the random
init fold by fold."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from readouts import interval  # noqa: E402

MODES = ("mean_pool", "attentive", "full")


def cell(values, signed: bool = False) -> str:
    """mean [95% t-interval] of `values`; signed: with + or - (differences)."""
    iv, sign = interval(values), "+" if signed else ""
    return f"{iv['mean']:{sign}.3f} [{iv['low']:{sign}.3f}, {iv['high']:{sign}.3f}]"


def scores(arm: dict, mode: str, metric: str) -> list:
    return [f[metric] for f in arm[mode]["folds"]]


def folds(arm: dict) -> list:
    return [(f["repeat"], f["fold"], f["test"]) for f in arm["full"]["folds"]]


def main(paths) -> None:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    random = reports[0]["arms"]["encoder"]
    for metric in ("auroc", "balanced_accuracy"):
        print(f"\n{metric} per fold, mean [95% t-interval over folds]\n")
        print(
            "| encoder | mean-pool probe | attentive probe | full fine-tuning | full - attentive"
            " (paired) |"
        )
        print("|---|---|---|---|---|")
        rows = [
            (Path(p).stem.removeprefix("finetune_"), r["arms"]["encoder"])
            for p, r in zip(paths[1:], reports[1:])
        ]
        rows.append(("random init", random))
        for name, arm in rows:
            assert folds(arm) == folds(random), f"{name}: other folds than the random init's"
            gain = [
                a - b for a, b in zip(scores(arm, "full", metric), scores(arm, "attentive", metric))
            ]
            print(
                f"| {name} | "
                + " | ".join(cell(scores(arm, m, metric)) for m in MODES)
                + f" | {cell(gain, True)} |"
            )
        print("\npretrained - random init, paired by fold\n")
        print("| encoder | mean-pool probe | attentive probe | full fine-tuning |")
        print("|---|---|---|---|")
        pooled = {m: [] for m in MODES}
        for name, arm in rows[:-1]:
            cells = []
            for m in MODES:
                differences = [
                    a - b for a, b in zip(scores(arm, m, metric), scores(random, m, metric))
                ]
                pooled[m].append(sum(differences) / len(differences))
                cells.append(cell(differences, True))
            print(f"| {name} | " + " | ".join(cells) + " |")
        if len(rows) > 2:
            print(
                f"| mean of the {len(rows) - 1} pretraining seeds (interval over seeds) | "
                + " | ".join(cell(pooled[m], True) for m in MODES)
                + " |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
