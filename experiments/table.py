"""Markdown tables of experiments/README.md from the probe reports experiments/learn/NAME.json
(experiments/run.sh) and experiments/learn/reference.json (the hand-made features and the supervised
CNN on the same splits).

    python experiments/table.py runs NAME [NAME...]   # one row per run and task: every read-out,
                                                      # + random init
    python experiments/table.py arms ARM [ARM...]     # one row per arm (runs ARM_s0, ARM_s1, ...)
                                                      # and task: the mean over pretraining seeds of
                                                      # each read-out, the 95% interval over seeds,
                                                      # and the runs that beat hand-made
    python experiments/table.py compare ARM_A ARM_B [READOUT...]   # paired differences A - B over
                                                      # pretraining seeds (default: every read-out
                                                      # they hold)
    python experiments/table.py reference             # the floor's companions: hand-made features
                                                      # and CNN
    python experiments/table.py demo ARM [ARM...]     # demo runs (experiments/demo.sh:
                                                      # experiments/demo/ARM_sK.json): each seed's
                                                      # summary probe, and per arm the paired
                                                      # difference to random init over the seeds
    python experiments/table.py --reports splits10 arms vrlong   # the reports (and reference.json)
                                                      # of another folder of experiments/ than
                                                      # learn/: 10-split probes

Each run's value is the mean over its probe seeds (splits); an arm's interval is a t-interval over
its pretraining seeds, paired by seed in `compare` (the seed also draws the init and the data
order).
"""

import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# where the reports are read: experiments/learn, or the folder of --reports
REPORTS = os.path.join(HERE, "learn")
DEMO = os.path.join(HERE, "demo")  # the demo's reports (experiments/demo.sh)
sys.path.insert(0, os.path.dirname(HERE))
from readouts import READOUTS, interval  # noqa: E402  (the repo's flat modules)


def load(name: str, folder: str = "") -> dict:
    """The report NAME.json in FOLDER (default: the reports' folder)."""
    with open(os.path.join(folder or REPORTS, f"{name}.json")) as f:
        return json.load(f)


def cell(iv: dict) -> str:
    return f"{iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def signed(iv: dict) -> str:
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def reference_scores(task: str) -> dict:
    """{"best_handmade": (name, interval), "supervised": interval} of a task from the reports'
    reference.json."""
    t = load("reference")["tasks"][task]
    best = t["best_handmade"]
    return {
        "best_handmade": (best, t["handmade"][best][t["metric"]]),
        "supervised": t["supervised"][t["metric"]],
    }


def seeds_of(arm: str, folder: str = "") -> list:
    """The run names ARM_s<k> that have a report in FOLDER (default: the reports' folder), by
    seed."""
    names = [
        os.path.basename(p)[:-5]
        for p in glob.glob(os.path.join(folder or REPORTS, f"{arm}_s*.json"))
    ]
    return sorted(
        (n for n in names if re.fullmatch(rf"{re.escape(arm)}_s\d+", n)),
        key=lambda n: int(n.rsplit("s", 1)[1]),
    )


def runs_table(names: list) -> None:
    print(
        "| run | task | "
        + " | ".join(f"{r}: pretrained" for r in READOUTS)
        + " | "
        + " | ".join(f"{r}: random" for r in READOUTS)
        + " |"
    )
    print("|---|---|" + "---|" * 2 * len(READOUTS))
    for name in names:
        for task, t in load(name)["tasks"].items():
            m = t["metric"]
            cells = [
                cell(t["encoders"][arm][r][m]) if r in t["encoders"][arm] else "-"
                for arm in ("pretrained", "random")
                for r in READOUTS
            ]
            print(f"| {name} | {task} | " + " | ".join(cells) + " |")


def arm_means(arm: str, task: str, readout: str, encoder: str = "pretrained") -> list:
    """Per pretraining seed: the mean over probe seeds of a read-out on a task."""
    out = []
    for name in seeds_of(arm):
        t = load(name)["tasks"][task]
        out.append(t["encoders"][encoder][readout][t["metric"]]["mean"])
    return out


def readouts_of(names: list) -> list:
    """READOUTS, then any other read-out the reports NAMES hold (a dense task's token_linear)."""
    held = {
        r
        for name in names
        for t in load(name)["tasks"].values()
        for r in t["encoders"]["pretrained"]
    }
    return [*READOUTS, *sorted(held - set(READOUTS))]


def arms_table(arms: list) -> None:
    columns = readouts_of([seeds_of(arm)[0] for arm in arms])
    print(
        "| arm (seeds) | task | "
        + " | ".join(columns)
        + " | random init (best read-out) | beats best hand-made (runs, best read-out) |"
    )
    print("|---|---|" + "---|" * (len(columns) + 2))
    measured = os.path.exists(os.path.join(REPORTS, "reference.json"))
    for arm in arms:
        names = seeds_of(arm)
        for task, t in load(names[0])["tasks"].items():
            # no hand-made features measured on these splits
            if measured and task not in load("reference")["tasks"]:
                continue
            read = [
                r for r in columns if r in t["encoders"]["pretrained"]
            ]  # the probe's --readouts
            cells = []
            for r in columns:
                values = arm_means(arm, task, r) if r in read else []
                cells.append(
                    cell(interval(values))
                    if len(values) > 1
                    else f"{values[0]:.3f}"
                    if values
                    else "not read"
                )
            random = max(interval(arm_means(arm, task, r, "random"))["mean"] for r in read)
            wins = "no reference.json yet"
            if measured:
                hand = reference_scores(task)["best_handmade"][1]
                beat = sum(
                    max(
                        load(n)["tasks"][task]["encoders"]["pretrained"][r][t["metric"]]["low"]
                        for r in read
                    )
                    > max(hand["high"], 0.5)
                    for n in names
                )
                wins = f"{beat}/{len(names)}"
            print(
                f"| {arm} ({len(names)}) | {task} | "
                + " | ".join(cells)
                + f" | {random:.3f} | {wins} |"
            )


def compare_table(a: str, b: str, readouts: list) -> None:
    seeds_a = {n.rsplit("_s", 1)[1]: n for n in seeds_of(a)}
    seeds_b = {n.rsplit("_s", 1)[1]: n for n in seeds_of(b)}
    common = sorted(set(seeds_a) & set(seeds_b), key=int)
    print(f"{a} - {b}, paired over pretraining seeds {', '.join(common)}")
    print("| task | read-out | " + f"{a} | {b} | difference |")
    print("|---|---|---|---|---|")
    reports_a = [load(seeds_a[s]) for s in common]
    reports_b = [load(seeds_b[s]) for s in common]
    for task, t in reports_a[0]["tasks"].items():
        if not all(task in r["tasks"] for r in reports_a + reports_b):  # probed on some runs only
            continue
        for r in [r for r in readouts if r in t["encoders"]["pretrained"]]:
            va = [
                report["tasks"][task]["encoders"]["pretrained"][r][t["metric"]]["mean"]
                for report in reports_a
            ]
            vb = [
                report["tasks"][task]["encoders"]["pretrained"][r][t["metric"]]["mean"]
                for report in reports_b
            ]
            diff = interval([x - y for x, y in zip(va, vb)])
            print(
                f"| {task} | {r} | {cell(interval(va))} | {cell(interval(vb))} | {signed(diff)} |"
            )


def reference_table() -> None:
    report = load("reference")
    print(
        "| task | metric | "
        + " | ".join(report["tasks"][next(iter(report["tasks"]))]["handmade"])
        + " | small 3D CNN | valid |"
    )
    print(
        "|---|---|" + "---|" * (len(report["tasks"][next(iter(report["tasks"]))]["handmade"]) + 2)
    )
    for task, t in report["tasks"].items():
        m = t["metric"]
        print(
            f"| {task} | {m} | "
            + " | ".join(cell(s[m]) for s in t["handmade"].values())
            + f" | {cell(t['supervised'][m])} | {'yes' if t['valid'] else 'no'} |"
        )


def demo_table(arms: list, readout: str = "attentive") -> None:
    """One row per demo run (its verdict's read-out, paired with its random init and the best
    hand-made features on its splits; *: a 5-split verdict judged again on 300 volumes and 10 splits
    by experiments/demo_verdicts.py), per arm the mean over seeds with its 95% interval and the runs
    that beat each, and each later arm paired by seed with the first."""
    print(
        "| arm | seed | updates | pretrained | random init | vs random init | vs hand-made | beats"
        " random / hand-made | last val target_std, RankMe | wall / CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    margins = {}
    for arm in arms:
        names = seeds_of(arm, DEMO)
        margins[arm] = {}
        for name in names:
            run = load(name, DEMO)
            probe, val, time = run["summary_probe"], run["last_val"], run["pretrain"]
            r = probe["readouts"][readout]
            # experiments/demo_verdicts.py: 300 volumes, 10 splits
            again = os.path.join(DEMO, "verdicts", f"{name}.json")
            if len(r["pretrained"]["values"]) < 10 and os.path.exists(again):
                r = {**load(name, os.path.join(DEMO, "verdicts"))["300x10"], "recomputed": True}
            seed = name.rsplit("_s", 1)[1] + ("*" if r.get("recomputed") else "")
            margins[arm][seed.rstrip("*")] = (
                r["pretrained"]["mean"],
                r["vs_random"]["mean"],
                r["vs_handmade"]["mean"],
                r["beats_random"],
                r["beats_handmade"],
            )
            print(
                f"| {arm} | {seed} | {probe['step']} | {cell(r['pretrained'])} |"
                f" {r['random']['mean']:.3f} | {signed(r['vs_random'])} |"
                f" {signed(r['vs_handmade'])} | {'yes' if r['beats_random'] else 'no'} /"
                f" {'yes' if r['beats_handmade'] else 'no'} | {val['target_std']:.2f},"
                f" {val['rankme']:.1f} | {time['wall_s']:.0f} / {time['cpu_s']:.0f} |"
            )
        rows = list(margins[arm].values())
        if len(rows) > 1:
            print(
                f"| {arm}: mean over {len(rows)} seeds | | | {cell(interval([m[0] for m in rows]))}"
                f" | | {signed(interval([m[1] for m in rows]))} |"
                f" {signed(interval([m[2] for m in rows]))} | {sum(m[3] for m in rows)} /"
                f" {sum(m[4] for m in rows)} of {len(rows)} | | |"
            )
    first = arms[0]
    for arm in arms[1:]:
        seeds = sorted(set(margins[arm]) & set(margins[first]), key=int)
        if len(seeds) > 1:
            diff = interval([margins[arm][s][0] - margins[first][s][0] for s in seeds])
            print(
                f"| {arm} - {first}, paired over seeds {','.join(seeds)} | | | {signed(diff)} | | |"
                " | | | |"
            )


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--reports"]:
        REPORTS, argv = os.path.join(HERE, argv[1]), argv[2:]
    command, args = argv[0], argv[1:]
    if command == "runs":
        runs_table(args)
    elif command == "arms":
        arms_table(args)
    elif command == "compare":
        compare_table(args[0], args[1], args[2:] or readouts_of(seeds_of(args[0])))
    elif command == "reference":
        reference_table()
    elif command == "demo":
        demo_table(args)
    else:
        sys.exit(__doc__)
