"""Issue 46's arms on one GPU in one lease: which recipe the configs ship, measured over pretraining seeds.

    python experiments/gpu/recipe.py OUT [--budget 420] [--arms demo,geometry,splits,long] [--smoke]

Every arm is train.py with configs/learn.yaml (or configs/demo.yaml) and a few flags, as a user runs it; all runs of a
phase go at once (one GPU, OMP_NUM_THREADS=1 each), and probe.py probes each run's last checkpoint:

  demo      configs/demo.yaml, seeds 0-2: the old recipe (linear stem, no local loss), the recipe (hmlp stem, local
            loss 0.5 on depth quarters), the recipe on varied phantoms; each run's own end-of-run verdict (summary_probe)
  geometry  the production tubelet (4x16x16) on 16x128x128 inputs from the same 32x128x128 phantoms (learn.yaml's 4x8x8
            token grid), 3000 updates, seeds 0-2: the old recipe, the recipe with local_loss_split 1,4,1 and 1,8,1
  splits    learn.yaml (hmlp stem) with local_loss_split 1,1,1 / 1,2,1 / 1,4,1, seeds 0-2: is the split tuned to where the
            suite's drusen and fluid sit? (probed on lesion and the tasks beyond it)
  long      learn.yaml with 4x the updates (12000), seeds 0-2: the JEPA half's length lever

A phase's runs still going when its share of --budget seconds is spent get SIGTERM (train.py saves the update it is
on; the report says which update was probed). OUT gets reports.tar.gz (probe JSON, verdict events, timings, the
commands), logs.tar.gz, and slim checkpoints (target encoder only) of the runs, for probing elsewhere. --smoke: tiny
phantom sets and runs on whatever device is there (the CPU here), to check the script end to end.
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
GEOMETRY = ["--image_size", "16,128,128", "--patch_size", "4,16,16"]


def arms(smoke: bool) -> dict:
    """{phase: [(run name, train.py flags)]} of the arms above."""
    seeds = [0] if smoke else [0, 1, 2]
    learn = ["--config", "configs/learn.yaml"] + (["--max_steps", "20", "--phantom_count", "24"] if smoke else [])
    demo = ["--config", "configs/demo.yaml"] + (["--max_steps", "20"] if smoke else [])
    out = {"demo": [], "geometry": [], "splits": [], "long": []}
    for s in seeds:
        seed = ["--seed", str(s)]
        out["demo"] += [(f"demo_old_s{s}", demo + OLD + seed),
                        (f"demo_recipe_s{s}", demo + RECIPE + ["--local_loss_split", "1,4,1"] + seed),
                        (f"demo_varied_s{s}", demo + RECIPE + ["--local_loss_split", "1,4,1", "--phantom_varied",
                                                               "true", "--phantom_dir", "data/phantoms_varied"] + seed)]
        out["geometry"] += [(f"geo_old_s{s}", learn + GEOMETRY + OLD + seed),
                            (f"geo_q_s{s}", learn + GEOMETRY + RECIPE + ["--local_loss_split", "1,4,1"] + seed),
                            (f"geo_e_s{s}", learn + GEOMETRY + RECIPE + ["--local_loss_split", "1,8,1"] + seed)]
        out["splits"] += [(f"split{''.join(sp.split(','))}_s{s}", learn + RECIPE + ["--local_loss_split", sp] + seed)
                          for sp in ("1,1,1", "1,2,1", "1,4,1")]
        out["long"] += [(f"long_s{s}", learn + RECIPE + ["--local_loss_split", "1,4,1", "--max_steps",
                                                         "80" if smoke else "12000"] + seed)]
    return out


def log(out: str, text: str, start=time.time()) -> None:
    line = f"[{time.time() - start:6.0f} s] {text}"
    print(line, flush=True)
    with open(os.path.join(out, "recipe.log"), "a") as f:
        f.write(line + "\n")


def prepare(out: str, smoke: bool) -> None:
    """Every phantom set and decoded cache the runs and probes read, written once, in parallel processes."""
    script = ("import sys, dataclasses; from config import load_config; from data import prepare_cache; "
              "from labels import phantom_labels, load_labelled_volumes; import probe\n"
              "cfg = load_config(sys.argv[1:])\n"
              "print(prepare_cache(dataclasses.replace(cfg, cache_dir=cfg.phantom_dir + '-cache', workers=4), "
              "progress=False))\n"
              "for kind, tasks in [(k, t) for k, t in probe.SUITE.items() if k != 'plain']:\n"
              "    csv = probe.suite_sets(cfg, None, [t.name for t in tasks])[0][0]\n"
              "    import os; load_labelled_volumes(dataclasses.replace(cfg, cache_dir=os.path.dirname(csv) + '-cache'),"
              " csv, columns=sorted({t.column for t in tasks}))\n")
    small = ["--phantom_count", "24"] if smoke else []
    chains = [[["--config", "configs/learn.yaml"] + small, ["--config", "configs/learn.yaml"] + GEOMETRY + small],
              [["--config", "configs/demo.yaml"]],
              [["--config", "configs/demo.yaml", "--phantom_varied", "true", "--phantom_dir", "data/phantoms_varied"]]]

    def run_chain(chain):  # configs sharing a phantom folder, one after the other
        for flags in chain:
            result = subprocess.run([sys.executable, "-c", script, *flags], cwd=REPO, capture_output=True, text=True)
            log(out, f"prepared {' '.join(flags)}: rc {result.returncode} {result.stdout.strip()[-200:]}"
                     f"{result.stderr.strip()[-800:] if result.returncode else ''}")

    with ThreadPoolExecutor(len(chains)) as pool:
        list(pool.map(run_chain, chains))


def train_all(out: str, runs: list, budget: float, smoke: bool) -> dict:
    """Start every run at once; SIGTERM those still going after `budget` seconds; {name: seconds, rc}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, started = {}, time.time()
    os.makedirs(RUNS, exist_ok=True)
    for name, flags in runs:
        command = [sys.executable, "train.py", *flags, "--out_dir", RUNS, "--run_name", name, "--workers", "1",
                   "--probe_every_steps", "none", "--ckpt_every_steps", "1000000"] + \
                  ([] if name.startswith("demo") else ["--summary_probe", "false"])
        with open(os.path.join(out, "commands.log"), "a") as f:
            f.write(" ".join(command) + "\n")
        procs[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(os.path.join(RUNS, f"{name}.log"), "w"),
                                       stderr=subprocess.STDOUT)
    while any(p.poll() is None for p in procs.values()) and time.time() - started < budget:
        time.sleep(2)
    for name, p in procs.items():
        if p.poll() is None:
            log(out, f"{name}: still going at the phase budget, SIGTERM")
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        p.wait()
    return {name: {"rc": p.returncode, "seconds": round(time.time() - started)} for name, p in procs.items()}


def probe_all(out: str, names: list, budget: float, smoke: bool) -> dict:
    """probe.py on each run's last checkpoint and its random init (lesion and every task beyond it; the hand-made
    features and the CNN once per geometry), at most 12 at once; {name: rc}."""
    import probe
    tasks = [t.name for kind, ts in probe.SUITE.items() if kind != "plain" for t in ts]
    seeds = "2" if smoke else "10"
    jobs = [(n, ["--ckpt", os.path.join(RUNS, n, "checkpoints"), "--vs_random", "--no_reference",
                 "--readouts", "attentive,mean_pool,depth_rows", "--tasks", ",".join(tasks)]) for n in names
            if not n.startswith("demo")]
    for ref, flags in (("reference_learn", []), ("reference_geometry", GEOMETRY)):
        jobs.append((ref, ["--ckpt", "random", "--config", "configs/learn.yaml", *flags, "--tasks", ",".join(tasks)]
                     + (["--phantom_count", "24"] if smoke else [])))
    started = time.time()

    def run(job):
        name, flags = job
        left = budget - (time.time() - started)
        if left < 20:
            return name, "skipped: no time left"
        command = [sys.executable, "probe.py", *flags, "--seeds", seeds, "--json", os.path.join(out, f"{name}.json")]
        try:
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=left,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return name, "timed out"
        with open(os.path.join(RUNS, f"{name}.probe.log"), "w") as f:
            f.write(result.stdout + result.stderr)
        return name, result.returncode

    with ThreadPoolExecutor(12) as pool:
        return dict(pool.map(run, jobs))


def slim(name: str) -> str:
    """A checkpoint of the run's last update with only what probe.py reads (config, train state, the target encoder;
    the other weights zeroed, so it still loads into VJEPA3D): about a fifth of the file."""
    import torch
    from checkpoint import list_checkpoints, read_checkpoint
    path = list_checkpoints(os.path.join(RUNS, name, "checkpoints"))[0]
    state = read_checkpoint(path)
    model = {k: v if k.startswith("target_encoder.") else torch.zeros_like(v) for k, v in state["model"].items()}
    slim_path = os.path.join(RUNS, f"{name}.slim.pt")
    torch.save({"model": model, "config": state["config"], "train_state": state.get("train_state"),
                "plan": state.get("plan")}, slim_path)
    return slim_path


def pack(out: str, names: list) -> None:
    """reports.tar.gz (the JSON in OUT), logs.tar.gz (every run's and probe's log), ckpts_K.tar.gz (slim checkpoints,
    split to stay under 16 MiB a file)."""
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
        if tar is None or size > 12 * 2 ** 20:
            tar = tarfile.open(os.path.join(out, f"ckpts_{part}.tar.gz"), "w:gz")
            part, size = part + 1, 0
        tar.add(path, arcname=os.path.basename(path))
        tar.fileobj.flush()
        size = os.path.getsize(tar.name)
    if tar is not None:
        tar.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--budget", type=float, default=420, help="seconds for the training and probing phases")
    parser.add_argument("--arms", default="demo,geometry,splits,long")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    prepare(args.out, args.smoke)
    plan = arms(args.smoke)
    runs = [run for phase in args.arms.split(",") for run in plan[phase]]
    left = args.budget - (time.time() - start)
    log(args.out, f"{len(runs)} runs at once, {left * 0.6:.0f} s for them")
    timings = train_all(args.out, runs, left * 0.6, args.smoke)
    with open(os.path.join(args.out, "timings.json"), "w") as f:
        json.dump(timings, f, indent=1)
    names = [name for name, _ in runs]
    probed = probe_all(args.out, names, args.budget - (time.time() - start) - 30, args.smoke)
    log(args.out, f"probes: {probed}")
    pack(args.out, names)
    log(args.out, "done")


if __name__ == "__main__":
    main()
