"""Markdown tables of the README's fine-tuning results from finetune.py reports (experiments/finetune.sh):
    python experiments/finetune_table.py REPORT_WITH_RANDOM.json [REPORT.json ...]
The first report must hold the random init (--vs_random); every report must have the same folds (the same labels,
--seed, --folds and --repeats), so that each encoder is compared with the random init fold by fold."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probe import interval  # noqa: E402

MODES = ("mean_pool", "attentive", "full")


def cell(values) -> str:
    iv = interval(values)
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]" if min(values) < 0 else \
        f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def scores(arm: dict, mode: str, metric: str) -> list:
    return [f[metric] for f in arm[mode]["folds"]]


def folds(arm: dict) -> list:
    return [(f["repeat"], f["fold"], f["test"]) for f in arm["full"]["folds"]]


def main(paths) -> None:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    random = reports[0]["arms"]["random init"]
    for metric in ("auroc", "balanced_accuracy"):
        print(f"\n{metric} per fold, mean [95% t-interval over folds]\n")
        print("| encoder | mean-pool probe | attentive probe | full fine-tuning | full - attentive (paired) |")
        print("|---|---|---|---|---|")
        rows = [(Path(p).stem, r["arms"]["encoder"]) for p, r in zip(paths, reports)] + [("random init", random)]
        for name, arm in rows:
            assert folds(arm) == folds(random), f"{name}: other folds than the random init's"
            gain = [a - b for a, b in zip(scores(arm, "full", metric), scores(arm, "attentive", metric))]
            print(f"| {name} | " + " | ".join(cell(scores(arm, m, metric)) for m in MODES) + f" | {cell(gain)} |")
        print("\npretrained - random init, paired by fold\n")
        print("| encoder | mean-pool probe | attentive probe | full fine-tuning |")
        print("|---|---|---|---|")
        pooled = {m: [] for m in MODES}
        for name, arm in rows[:-1]:
            cells = []
            for m in MODES:
                differences = [a - b for a, b in zip(scores(arm, m, metric), scores(random, m, metric))]
                pooled[m].append(sum(differences) / len(differences))
                cells.append(cell(differences))
            print(f"| {name} | " + " | ".join(cells) + " |")
        if len(rows) > 2:
            print(f"| mean of the {len(rows) - 1} pretraining seeds (interval over seeds) | "
                  + " | ".join(cell(pooled[m]) for m in MODES) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
