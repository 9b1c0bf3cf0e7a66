"""Throughput benchmarks, with the machine's own peak as reference.

    python bench.py data [--quick] [--json OUT] [--config FILE] [config flags]   # the data pipeline
    python bench.py train ...                                                    # not built yet
    python bench.py all ...                                                      # data, then train

`data` writes OCT volumes of a realistic size (Spectralis-like 49x496x512; --quick: 16x128x128) in each
transfer syntax and measures, on one core (torch threads = 1): raw pydicom decode, the full uncached
pipeline (read, resample, clip, crop, normalize, mask), and the pipeline from the decoded-volume cache;
then the DataLoader with cfg.workers processes from the cache. The reference is this machine's
single-core memory copy bandwidth. Targets (issue 3): uncached costs at most 1.5x decode for uncompressed
data; the cache delivers at least 50 volumes/s per core at image_size [64,384,384].
"""
import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np
import pydicom
import torch
from pydicom.uid import JPEG2000, ExplicitVRLittleEndian, JPEG2000Lossless, JPEGBaseline8Bit, RLELossless

from config import ConfigError, config_to_dict, load_config, load_yaml, parse_flags
from data import OCTDataset, load_prepared, make_loader
from phantom import STYLES, quantize, spacing_for, synth_reflectivity, write_oct

SYNTAXES = (("uncompressed 8-bit", ExplicitVRLittleEndian, 8), ("uncompressed 16-bit", ExplicitVRLittleEndian, 16),
            ("JPEG 2000 lossless 8-bit", JPEG2000Lossless, 8), ("JPEG 2000 lossy 8-bit", JPEG2000, 8),
            ("RLE lossless 8-bit", RLELossless, 8), ("JPEG baseline 8-bit", JPEGBaseline8Bit, 8))
FULL = {"shape": (49, 496, 512), "files": 4, "min_seconds": 2.0, "image_size": [64, 384, 384],
        "patch_size": [4, 16, 16]}
QUICK = {"shape": (16, 128, 128), "files": 2, "min_seconds": 0.3, "image_size": [16, 64, 64], "patch_size": [4, 8, 8]}


def rate(fn, items, min_seconds: float) -> float:
    """Items per second of fn over `items`, repeated for at least min_seconds after one warm-up pass."""
    for item in items:
        fn(item)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        for item in items:
            fn(item)
        done += len(items)
    return done / (time.perf_counter() - start)


def memcpy_gbps() -> float:
    """Single-core memory copy bandwidth in GB/s (read + write counted once)."""
    src = np.ones(64 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    seconds = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / seconds / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def environment() -> dict:
    """Machine, versions and git commit, so that figures can be compared."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    versions = {"python": platform.python_version()}
    for package in ("torch", "numpy", "pydicom", "pylibjpeg", "pylibjpeg-openjpeg", "pylibjpeg-libjpeg",
                    "pylibjpeg-rle", "gcsfs"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.run(["git", *args], cwd=here, capture_output=True, text=True).stdout.strip()
    return {"device": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "torch_threads": 1},
            "versions": versions, "git_commit": git("rev-parse", "HEAD") or None,
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def write_bench_files(workdir: str, shape, files: int) -> dict:
    """{syntax name: [paths]}: one synthetic volume per bit depth, written in each transfer syntax."""
    voxels = {bits: quantize(synth_reflectivity(shape, np.random.default_rng(0)), bits) for bits in (8, 16)}
    style = STYLES["heidelberg"]
    spacing = spacing_for(style, shape)
    out = {}
    for name, syntax, bits in SYNTAXES:
        first = os.path.join(workdir, f"{name.replace(' ', '_')}_0.dcm")
        write_oct(first, voxels[bits], spacing, style, transfer_syntax=syntax, uid_seed=name)
        out[name] = [first]
        for k in range(1, files):  # the same bytes: decode cost per file is what is measured
            out[name].append(first.replace("_0.dcm", f"_{k}.dcm"))
            shutil.copy(first, out[name][-1])
    return out


def bench_data(cfg, quick: bool, workdir: str) -> dict:
    """Volumes/s per core for decode, uncached and cached pipelines per transfer syntax, plus the loader."""
    plan = QUICK if quick else FULL
    torch.set_num_threads(1)
    files = write_bench_files(workdir, plan["shape"], plan["files"])
    cached_cfg = replace(cfg, cache_dir=os.path.join(workdir, "cache"))
    results, all_records = {}, []
    for name, paths in files.items():
        records = [{"paths": [p], "manufacturer": "bench"} for p in paths]
        all_records += records
        keys = [(epoch, i) for epoch in range(3) for i in range(len(records))]
        uncached = OCTDataset(records, cfg, train=True)
        cached = OCTDataset(records, cached_cfg, train=True)
        for r in records:
            load_prepared(r["paths"], cached_cfg)
        decode = rate(lambda p: pydicom.dcmread(p).pixel_array, paths, plan["min_seconds"])
        pipeline = rate(lambda key: uncached[key], keys, plan["min_seconds"])
        from_cache = rate(lambda key: cached[key], keys, plan["min_seconds"])
        results[name] = {"decode_vol_s": decode, "uncached_vol_s": pipeline, "cached_vol_s": from_cache,
                         "uncached_cost_x_decode": decode / pipeline, "file_mb": os.path.getsize(paths[0]) / 1e6}
        print(f"{name:<26} decode {decode:8.1f}  uncached {pipeline:8.1f}  cached {from_cache:8.1f} vol/s  "
              f"(uncached = {decode / pipeline:.1f}x decode)", flush=True)

    dataset = OCTDataset(all_records, cached_cfg, train=True)
    batch = 2
    loader_volumes, start = 0, time.perf_counter()
    for epoch in range(3):
        for b in make_loader(dataset, batch, train=True, workers=cfg.workers, epoch=epoch, seed=cfg.seed):
            loader_volumes += len(b["path"])
    loader = {"workers": cfg.workers, "batch_size": batch, "vol_s": loader_volumes / (time.perf_counter() - start)}
    print(f"DataLoader from the cache, {cfg.workers} workers: {loader['vol_s']:.1f} vol/s (incl. worker start-up)")

    uncompressed = [v for k, v in results.items() if k.startswith("uncompressed")]
    cached_min = min(v["cached_vol_s"] for v in results.values())
    return {
        "volume_shape": list(plan["shape"]), "files_per_syntax": plan["files"], "per_syntax": results,
        "loader": loader, "reference": {"memcpy_GBps_single_core": memcpy_gbps()},
        "targets": {
            "uncached_cost_x_decode_uncompressed": max(v["uncached_cost_x_decode"] for v in uncompressed),
            "uncached_within_1.5x_decode": all(v["uncached_cost_x_decode"] <= 1.5 for v in uncompressed),
            "cached_vol_s_per_core_min": cached_min,
            "cached_at_least_50_vol_s_at_64_384_384": cfg.image_size == [64, 384, 384] and cached_min >= 50,
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="all", choices=("train", "data", "all"))
    parser.add_argument("--json", help="write all figures, config, device, versions and git commit here")
    parser.add_argument("--quick", action="store_true", help="small volumes and short runs (CI)")
    parser.add_argument("--workdir", help="where the benchmark files go (default: a temporary folder)")
    args, rest = parser.parse_known_args(argv)
    plan = QUICK if args.quick else FULL
    try:
        flags = parse_flags(rest)
        given = set(flags) | set(load_yaml(flags["config"]) if "config" in flags else ())
        cfg = load_config(rest, **{k: plan[k] for k in ("image_size", "patch_size") if k not in given})
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    report = {"mode": args.mode, "quick": args.quick, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              **environment(), "config": config_to_dict(cfg)}
    if args.mode in ("data", "all"):
        workdir = args.workdir or tempfile.mkdtemp(prefix="octjepa-bench-")
        try:
            report["data"] = bench_data(cfg, args.quick, workdir)
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.mode in ("train", "all"):
        raise SystemExit("bench.py train: not built yet (the training-step benchmark comes with a later issue); "
                         "run `python bench.py data` for the data pipeline.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
