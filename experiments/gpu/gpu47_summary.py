"""The tables of experiments/gpu/gpu47.sh's measurements (issue 47), from what its steps wrote.

    python experiments/gpu/gpu47_summary.py fastest OUT/attention.json  # the SDPA kernel to time, if not auto's
    python experiments/gpu/gpu47_summary.py table OUT WORK  # OUT/summary.md, bench_production.json, train_e2e.json

`table` merges the production benches (WORK/prod_*.json) into OUT/bench_production.json, reads the
train.py run (WORK/runs/e2e: its metrics and checkpoint events) into OUT/train_e2e.json, and writes
and prints OUT/summary.md.
"""

import glob
import json
import os
import statistics
import sys

KERNELS = {
    "flash": "_scaled_dot_product_flash",
    "cudnn": "_scaled_dot_product_cudnn",
    "efficient": "_scaled_dot_product_efficient",
}


def load(path):
    """A JSON file's object, or None when the step that writes it did not."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def fastest(path) -> str:
    """The SDPA kernel (KERNELS) with the least time over the attention bench's shapes, when it is
    not the one auto runs; '' otherwise."""
    report = load(path)
    if not report:
        return ""
    shapes = report["attention"]["shapes"].values()
    totals = {
        name: sum(row[name]["ms"] for row in shapes)
        for name in KERNELS
        if all("ms" in row.get(name, {}) for row in shapes)
    }
    auto = next(iter(shapes))["auto"].get("kernel") or ""
    best = min(totals, key=totals.get) if totals else ""
    return "" if not best or KERNELS[best] in auto else best


def train_e2e(run_dir: str, bench_ms) -> dict:
    """The train.py run's update time where no validation or checkpoint fell in a logged window,
    against bench.py's eager update, and the seconds of each checkpoint (events.jsonl) and of the
    windows they fell in."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    train = [r for r in rows if r["split"] == "train"]
    stalls = {e["step"] for e in events if e["event"] == "checkpoint"} | {
        r["step"] for r in rows if r["split"] == "val"
    }
    quiet, previous = [], 0
    for r in train:
        if previous >= 10 and not any(previous <= s < r["step"] for s in stalls):
            quiet.append(r)
        previous = r["step"]
    median = statistics.median(r["step_time_s"] for r in quiet) if quiet else None
    data = 1e3 * statistics.median(r["data_time_s"] for r in quiet) if quiet else None
    return {
        "steady_step_ms": median and 1e3 * median,
        "steady_data_ms": data,
        "updates_per_s": median and 1 / median,
        "bench_eager_ms": bench_ms,
        "train_over_bench": median and bench_ms and 1e3 * median / bench_ms,
        "checkpoints": [
            {"step": e["step"], "seconds": e.get("seconds")}
            for e in events
            if e["event"] == "checkpoint"
        ],
        "windows": [{k: r[k] for k in ("step", "step_time_s", "data_time_s")} for r in train],
    }


def number(x, spec: str) -> str:
    """x in `spec`, or '-' for None."""
    return "-" if x is None else format(x, spec)


def bench_rows(name: str, report: dict) -> list:
    """Markdown rows of one bench.py train --sizes report."""
    rows = []
    for size, o in (report or {}).get("train", {}).items():
        for variant in o["variants"]:
            f = o if variant == o["variants"][0] else o[variant]
            ops = f.get("ops") or {}
            card = f"{100 * f['mfu_card']:.1f}%" if f.get("mfu_card") is not None else "unknown"
            compile_s = "-" if f.get("compile_time_s") is None else f"{f['compile_time_s']:.0f}"
            memory = (
                "-" if f["peak_memory_bytes"] is None else f"{f['peak_memory_bytes'] / 2**30:.2f}"
            )
            rows.append(
                f"| {name} | {size} | {variant} | {f['step_time_s_median'] * 1e3:.2f} |"
                f" {100 * f['mfu']:.1f}% / {card} | {memory} |"
                f" {'on' if o['grad_checkpointing'] else 'off'} | {o['sdpa']} | {compile_s} |"
                f" {ops.get('total_aten_ops', '-')} / {ops.get('total_launches', '-')} |"
                f" {f['loss']:.5f} |"
            )
    return rows


def table(out: str, work: str) -> str:
    """summary.md's text; writes it and the merged production and train.py figures into `out`."""
    production = {
        os.path.basename(p)[5:-5]: load(p)
        for p in sorted(glob.glob(os.path.join(work, "prod_*.json")))
    }
    with open(os.path.join(out, "bench_production.json"), "w") as f:
        json.dump(production, f, indent=2)
    lines = [
        "# issue 47 on the GPU (experiments/gpu/gpu47.sh)",
        "",
        (
            "| run | size | variant | ms/update | MFU run peak / card | peak GiB | checkpointing |"
            " SDPA | compile s | torch ops / launches | loss |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("learn", "demo"):
        lines += bench_rows(name, load(os.path.join(out, f"bench_{name}.json")))
    for name, report in production.items():
        lines += bench_rows(name, report)
    attention = load(os.path.join(out, "attention.json"))
    if attention:
        lines += ["", f"SDPA ({attention['attention']['dtype']}, ms fwd[+bwd] / TFLOP/s):"]
        for where, row in attention["attention"]["shapes"].items():
            cells = [
                f"{n} {r['ms']:.2f}/{r['tflops']:.0f}" if "ms" in r else f"{n} -"
                for n, r in row.items()
                if isinstance(r, dict)
            ]
            lines.append(
                f"- {where} {row['shape']}: {', '.join(cells)}; auto runs"
                f" {row['auto'].get('kernel')}"
            )
    # production (smoke: smoke)
    auto = next(iter((production.get("auto") or {}).get("train", {}).values()), None)
    run_dir = os.path.join(work, "runs", "e2e")
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        e2e = train_e2e(run_dir, auto and 1e3 * auto["step_time_s_median"])
        with open(os.path.join(out, "train_e2e.json"), "w") as f:
            json.dump(e2e, f, indent=2)
        lines += [
            "",
            f"train.py end to end: {number(e2e['steady_step_ms'], '.1f')} ms/update in steady"
            f" windows (data {number(e2e['steady_data_ms'], '.1f')} ms), bench eager"
            f" {number(e2e['bench_eager_ms'], '.1f')} ms: train/bench"
            f" {number(e2e['train_over_bench'], '.3f')}; checkpoints (update: seconds) "
            + ", ".join(f"{c['step']}: {c['seconds']}" for c in e2e["checkpoints"]),
        ]
    reference = load(os.path.join(out, "reference.json"))
    for size, entry in ((reference or {}).get("sizes") or {}).items():
        for phase, res in entry["phases"].items():
            o, r = res["octjepa"], res["reference"]
            lines.append(
                f"reference {size} {phase}: octjepa {o['median_s'] * 1e3:.1f} ms, reference "
                f"{r['median_s'] * 1e3:.1f} ms, ratio {o['median_s'] / r['median_s']:.3f}"
                + (
                    f", compile {o['compile_s']:.0f} / {r['compile_s']:.0f} s"
                    if "compile_s" in o
                    else ""
                )
            )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    print(
        fastest(sys.argv[2]) if sys.argv[1] == "fastest" else table(sys.argv[2], sys.argv[3]),
        end="",
    )
