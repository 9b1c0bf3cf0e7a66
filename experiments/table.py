"""Markdown rows of the README's "Does it learn" table from the probe reports experiments/NAME.json
(written by experiments/run.sh): python experiments/table.py NAME [NAME...]"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cell(iv: dict) -> str:
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def row(name: str) -> str:
    report = json.load(open(os.path.join(HERE, f"{name}.json")))
    p, r = report["pretrained"], report["random"]
    beats = ", ".join(k for k, v in report["beats_random"].items() if v) or "neither"
    return (f"| {name} | {cell(p['mean_pool']['auroc'])} | {cell(p['attentive']['auroc'])} | "
            f"{cell(r['mean_pool']['auroc'])} | {cell(r['attentive']['auroc'])} | {beats} |")


if __name__ == "__main__":
    print("| run | pretrained mean-pool | pretrained attentive | random mean-pool | random attentive | beats random |")
    print("|---|---|---|---|---|---|")
    for name in sys.argv[1:]:
        print(row(name))
