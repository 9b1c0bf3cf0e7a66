"""Issues 46 and 56's arms on one GPU in one lease: which recipe the configs ship, measured over pretraining
seeds.

    python experiments/gpu/recipe.py OUT [--train_seconds 210] [--probe_seconds 120] [--go FILE] [--smoke]

Every arm is train.py with configs/learn.yaml (or configs/demo.yaml) and a few flags, as a user runs
it; --parallel runs go at once (one GPU, OMP_NUM_THREADS=1 each), and probe.py probes each run's
last checkpoint as soon as the run ends:

  geometry  the production tubelet (4x16x16) on 16x128x128 inputs from the same 32x128x128 phantoms
            (learn.yaml's 256-token grid), 3000 updates, seeds 0-2, issue 56's three arms: the recipe
            (hmlp stem, local loss 0.5 on depth quarters), the linear stem with that local loss, the
            linear stem without it; and the recipe from 1x4x4 first cells (the cheaper stem), with
            E/2 and with E/4 channels inside the stem, and from 2x4x4 first cells with E/2
  splits    learn.yaml (hmlp stem) with local_loss_split 1,1,1 / 1,2,1 / 1,4,1, seeds 0-2: is the
            split tuned to where the suite's drusen and fluid sit? (probed on lesion and on the tasks
            beyond it)
  demo      configs/demo.yaml with the recipe, on its plain phantoms and on varied ones, seeds 0-2:
            each run's own end-of-run verdict (summary_probe)

The phantom sets and caches are written first (with --go, the runs then wait for that file: another
job can time the GPU meanwhile). Runs still going after --train_seconds get SIGTERM (train.py saves
the update it is on; the report says which update was probed); probes not done after --probe_seconds
more are cut. Probes here read `lesion` and the tasks beyond it with the attentive (on the GPU) and
linear read-outs, beside each run's random init; the hand-made features and the CNN once per
geometry; the dense task is left to the slim checkpoints. OUT gets reports.tar.gz (probe JSON, the
demo runs' events, timings, commands), logs.tar.gz, and ckpts_K.tar.gz (the target encoders, for
probing elsewhere). --smoke: tiny runs on whatever device is there (the CPU here), to check the
script end to end.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
RUNS = os.path.join(REPO, "experiments", "runs46")
RECIPE = ["--patch_stem", "hmlp", "--local_loss_weight", "0.5"]
OLD = ["--patch_stem", "linear", "--local_loss_weight", "0"]
LINEAR_LOCAL = [
    "--patch_stem",
    "linear",
    "--local_loss_weight",
    "0.5",
    "--local_loss_split",
    "1,4,1",
]
GEOMETRY = ["--image_size", "16,128,128", "--patch_size", "4,16,16"]


def arms(smoke: bool) -> dict:
    """{phase: [(run name, train.py flags)]} of the arms above."""
    seeds = [0] if smoke else [0, 1, 2]
    learn = ["--config", "configs/learn.yaml"] + (
        ["--max_steps", "20", "--phantom_count", "24"] if smoke else []
    )
    demo = ["--config", "configs/demo.yaml"] + (["--max_steps", "20"] if smoke else [])
    out = {"geometry": [], "splits": [], "demo": []}
    for s in seeds:
        seed = ["--seed", str(s)]
        out["demo"] += [
            (f"demo_recipe_s{s}", demo + RECIPE + ["--local_loss_split", "1,4,1"] + seed),
            (
                f"demo_varied_s{s}",
                demo
                + RECIPE
                + [
                    "--local_loss_split",
                    "1,4,1",
                    "--phantom_varied",
                    "true",
                    "--phantom_dir",
                    "data/phantoms_varied",
                ]
                + seed,
            ),
        ]
        out["geometry"] += [
            (
                f"geo_recipe_s{s}",
                learn + GEOMETRY + RECIPE + ["--local_loss_split", "1,4,1"] + seed,
            ),
            (
                f"geo_cell_s{s}",
                learn
                + GEOMETRY
                + RECIPE
                + ["--local_loss_split", "1,4,1", "--stem_cell", "1,4,4"]
                + seed,
            ),
            (
                f"geo_narrow_s{s}",
                learn
                + GEOMETRY
                + RECIPE
                + ["--local_loss_split", "1,4,1", "--stem_cell", "1,4,4", "--stem_width", "0.25"]
                + seed,
            ),
            (
                f"geo_deep_cell_s{s}",
                learn
                + GEOMETRY
                + RECIPE
                + ["--local_loss_split", "1,4,1", "--stem_cell", "2,4,4"]
                + seed,
            ),
            (f"geo_linear_local_s{s}", learn + GEOMETRY + LINEAR_LOCAL + seed),
            (f"geo_linear_s{s}", learn + GEOMETRY + OLD + seed),
        ]
        out["splits"] += [
            (
                f"split{''.join(sp.split(','))}_s{s}",
                learn + RECIPE + ["--local_loss_split", sp] + seed,
            )
            for sp in ("1,1,1", "1,2,1", "1,4,1")
        ]
    return out


def log(out: str, text: str, start=time.time()) -> None:
    line = f"[{time.time() - start:6.0f} s] {text}"
    print(line, flush=True)
    with open(os.path.join(out, "recipe.log"), "a") as f:
        f.write(line + "\n")


def prepare(out: str, smoke: bool) -> None:
    """Every phantom set and decoded cache the runs and probes read, written once, in parallel
    processes."""
    script = (
        "import sys, dataclasses; from config import load_config; from data import prepare_cache; "
        "from labels import phantom_labels, load_labelled_volumes; import probe\n"
        "cfg = load_config(sys.argv[1:])\n"
        "from phantom import ensure_builtin_phantoms; ensure_builtin_phantoms(cfg)\n"
        "print(prepare_cache(dataclasses.replace(cfg, cache_dir=cfg.phantom_dir + '-cache',"
        " workers=4), "
        "progress=False))\n"
        "for kind, tasks in [(k, t) for k, t in probe.SUITE.items() if k != 'plain']:\n"
        "    csv = probe.suite_sets(cfg, None, [t.name for t in tasks])[0][0]\n"
        "    import os; load_labelled_volumes(dataclasses.replace(cfg,"
        " cache_dir=os.path.dirname(csv) + '-cache'),"
        " csv, columns=sorted({t.column for t in tasks}))\n"
        # the verdict's volumes, cached
        "from runprobe import prepare_probe_set; prepare_probe_set(cfg)\n"
    )
    small = ["--phantom_count", "24"] if smoke else []
    chains = [
        [
            ["--config", "configs/learn.yaml"] + small,
            ["--config", "configs/learn.yaml"] + GEOMETRY + small,
        ],
        [["--config", "configs/demo.yaml"]],
        [
            [
                "--config",
                "configs/demo.yaml",
                "--phantom_varied",
                "true",
                "--phantom_dir",
                "data/phantoms_varied",
            ]
        ],
    ]

    def run_chain(chain):  # configs sharing a phantom folder, one after the other
        for flags in chain:
            result = subprocess.run(
                [sys.executable, "-c", script, *flags], cwd=REPO, capture_output=True, text=True
            )
            log(
                out,
                f"prepared {' '.join(flags)}: rc {result.returncode} {result.stdout.strip()[-200:]}"
                f"{result.stderr.strip()[-800:] if result.returncode else ''}",
            )

    with ThreadPoolExecutor(len(chains)) as pool:
        list(pool.map(run_chain, chains))


def train_command(out: str, name: str, flags: list) -> list:
    """train.py of one arm, into RUNS/name, written to OUT/commands.log."""
    command = [
        sys.executable,
        "train.py",
        *flags,
        "--out_dir",
        RUNS,
        "--run_name",
        name,
        "--workers",
        "1",
        "--probe_every_steps",
        "none",
        "--ckpt_every_steps",
        "1000000",
        "--compile",
        "false",
    ] + ([] if name.startswith("demo") else ["--summary_probe", "false"])
    with open(os.path.join(out, "commands.log"), "a") as f:
        f.write(" ".join(command) + "\n")
    return command


def probe_command(out: str, name: str, smoke: bool) -> list:
    """probe.py of a run's last checkpoint (lesion and the tasks beyond it; no dense task, no
    references), or for reference_learn / reference_geometry the hand-made features and the CNN on a
    random init of that geometry."""
    import probe

    tasks = ",".join(
        t.name for kind, ts in probe.SUITE.items() if kind != "plain" for t in ts if not t.dense
    )
    seeds = "2" if smoke else "10"
    if name.startswith("reference"):
        flags = [
            "--ckpt",
            "random",
            "--config",
            "configs/learn.yaml",
            *(GEOMETRY if name.endswith("geometry") else []),
        ]
        flags += ["--phantom_count", "24"] if smoke else []
    else:
        flags = [
            "--ckpt",
            os.path.join(RUNS, name, "checkpoints"),
            "--vs_random",
            "--no_reference",
            "--readouts",
            "attentive,mean_pool,depth_rows",
        ]
    command = [
        sys.executable,
        "probe.py",
        *flags,
        "--tasks",
        tasks,
        "--seeds",
        seeds,
        "--json",
        os.path.join(out, f"{name}.json"),
    ]
    with open(os.path.join(out, "commands.log"), "a") as f:
        f.write(" ".join(command) + "\n")
    return command


def pipeline(
    out: str, runs: list, train_seconds: float, probe_seconds: float, smoke: bool, parallel: int
) -> dict:
    """At most `parallel` runs at once (the next starts when one ends), each probed as soon as it
    ends (at most 10 probes at a time, the references first); runs
    still going after train_seconds get SIGTERM, probes still going probe_seconds later are killed.
    {name: what happened} (train.py's and probe.py's return codes, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    os.makedirs(RUNS, exist_ok=True)
    start = time.time()
    pending, training = list(runs), {}
    waiting, probing, report = ["reference_geometry", "reference_learn"], {}, {}
    stopped = False
    while pending or training or waiting or probing:
        now = time.time() - start
        while pending and len(training) < parallel and not stopped:
            name, flags = pending.pop(0)
            training[name] = subprocess.Popen(
                train_command(out, name, flags),
                cwd=REPO,
                env=env,
                stderr=subprocess.STDOUT,
                stdout=open(os.path.join(RUNS, f"{name}.log"), "w"),
            )
        for name, p in list(training.items()):
            if p.poll() is not None:
                report[name] = {"train_rc": p.returncode, "train_seconds": round(now)}
                del training[name]
                if not name.startswith("demo"):
                    waiting.append(name)
        if not stopped and now > train_seconds and training:
            log(out, f"training budget spent: SIGTERM to {sorted(training)}")
            for p in training.values():
                p.send_signal(signal.SIGTERM)
            stopped = True
        for name, p in list(probing.items()):
            if p.poll() is not None:
                report.setdefault(name, {}).update(probe_rc=p.returncode, probe_done=round(now))
                del probing[name]
        while waiting and len(probing) < 10:
            name = waiting.pop(0)
            probing[name] = subprocess.Popen(
                probe_command(out, name, smoke),
                cwd=REPO,
                env=env,
                stderr=subprocess.STDOUT,
                stdout=open(os.path.join(RUNS, f"{name}.probe.log"), "w"),
            )
        if now > train_seconds + probe_seconds:
            for name, p in probing.items():
                p.kill()
                report.setdefault(name, {}).update(probe_rc="cut at the probe budget")
            report.update({name: {"probe_rc": "not started"} for name in waiting})
            report.update({name: {"train_rc": "not started"} for name, _ in pending})
            break
        time.sleep(2)
    return report


def slim(name: str) -> str:
    """A checkpoint of the run's last update with only what probe.py reads (config, train state, the
    target encoder; the other weights zeroed, so it still loads into VJEPA3D): about a fifth of the
    file."""
    import torch
    from checkpoint import list_checkpoints, read_checkpoint

    path = list_checkpoints(os.path.join(RUNS, name, "checkpoints"))[0]
    state = read_checkpoint(path)
    model = {
        k: v if k.startswith("target_encoder.") else torch.zeros_like(v)
        for k, v in state["model"].items()
    }
    slim_path = os.path.join(RUNS, f"{name}.slim.pt")
    torch.save(
        {
            "model": model,
            "config": state["config"],
            "train_state": state.get("train_state"),
            "plan": state.get("plan"),
        },
        slim_path,
    )
    return slim_path


def pack(out: str, names: list) -> None:
    """reports.tar.gz (the JSON in OUT), logs.tar.gz (every run's and probe's log), ckpts_K.tar.gz
    (slim checkpoints, split to stay under 16 MiB a file)."""
    with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as tar:
        for f in sorted(os.listdir(RUNS)):
            if f.endswith(".log"):
                tar.add(os.path.join(RUNS, f), arcname=f)
            if os.path.exists(os.path.join(RUNS, f, "metrics.jsonl")):
                for part in ("metrics.jsonl", "events.jsonl", "config.yaml"):
                    tar.add(os.path.join(RUNS, f, part), arcname=f"{f}/{part}")
    with tarfile.open(os.path.join(out, "reports.tar.gz"), "w:gz") as tar:
        for f in sorted(os.listdir(out)):
            if f.endswith(".json") or f in ("recipe.log", "commands.log"):
                tar.add(os.path.join(out, f), arcname=f)
    part, size, tar = 0, 0, None
    for name in names:
        try:
            path = slim(name)
        except (IndexError, OSError, KeyError) as e:
            log(out, f"{name}: no checkpoint to slim ({e!r})")
            continue
        if tar is None or size > 12 * 2**20:
            tar = tarfile.open(os.path.join(out, f"ckpts_{part}.tar.gz"), "w:gz")
            part, size = part + 1, 0
        tar.add(path, arcname=os.path.basename(path))
        tar.fileobj.flush()
        size = os.path.getsize(tar.name)
    if tar is not None:
        tar.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--train_seconds", type=float, default=210)
    parser.add_argument("--probe_seconds", type=float, default=120)
    parser.add_argument(
        "--go", default=None, help="after writing the data, wait for this file before training"
    )
    parser.add_argument("--arms", default="geometry,splits,demo")
    parser.add_argument(
        "--parallel",
        type=int,
        default=12,
        help=(
            "runs at once (24 on one H100 with 16 cores: 19 of "
            "them stopped after their first validation, 2026-11-27)"
        ),
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    prepare(args.out, args.smoke)
    while args.go and not os.path.exists(args.go):
        time.sleep(1)
    plan = arms(args.smoke)
    runs = [run for phase in args.arms.split(",") for run in plan[phase]]
    log(args.out, f"{len(runs)} runs, {args.parallel} at once")
    report = pipeline(
        args.out, runs, args.train_seconds, args.probe_seconds, args.smoke, args.parallel
    )
    with open(os.path.join(args.out, "timings.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(args.out, f"runs and probes: {report}")
    pack(args.out, [name for name, _ in runs])
    log(args.out, "done")
    open(os.path.join(args.out, "DONE"), "w").close()


if __name__ == "__main__":
    main()
