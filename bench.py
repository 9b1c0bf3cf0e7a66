"""Throughput benchmarks, with the machine's own peak as reference.

    python bench.py data [--quick] [--json OUT] [--config FILE] [config flags]   # the data pipeline
    python bench.py train [--quick] [--json OUT] [--config FILE] [config flags]  # the training update
    python bench.py all ...                                                      # data, then train
    python bench.py train --sizes demo,learn,production --variants eager,compiled,reduce-overhead   # one table
    python bench.py attention [--config FILE]      # each SDPA kernel at the config's shapes (default: ViT-L's)
    python bench.py train --config configs/pretrain_vitl.yaml --variants eager,linear   # the recipe's cost

`train` times the full training update of train.py (context encoder on the visible tokens, target
encoder, predictor, loss, backward, clipping, AdamW, EMA) on synthetic inputs at the config's size
and device (default: the demo config; --quick: the smoke config), after warm-up, eager and compiled
(compile_parts, in the --variants' modes: compiled = default, reduce-overhead = CUDA graphs; not on
XLA) interleaved, with compile and grad_checkpointing auto decided as train.py does, and compares
their model FLOP/s with the peak of a large matmul measured in the same run and dtype (MFU), with
the card's spec sheet (CARD_PEAKS) and with a plain ViT encoder of the same width; it counts the
torch ops and CUDA launches of one update by phase (count_update_ops), and --sdpa picks the
attention kernel. Memory: CUDA max allocated; CPU peak RSS growth, and per variant the host memory
its update adds at peak (host_peak_bytes). Targets: CPU fp32 demo >= 70% of
the matmul peak; GPU bf16 production >= 40%. With --shard fsdp (under torchrun, or on XLA) the two
interleaved updates are unsharded and sharded instead, each with the weights, EMA target and AdamW
state it holds per device (measured on the tensors) and, on CUDA and the CPU, the peak its update adds
to them:

    torchrun --nproc_per_node=8 bench.py train --config configs/pretrain_vitl.yaml --shard fsdp

`data` writes OCT volumes of a realistic size (Spectralis-like 49x496x512; --quick: 16x128x128) in
each transfer syntax and measures, on one core (torch threads = 1): raw pydicom decode, the full
uncached pipeline (read, resample, clip, crop, normalize, mask), and the pipeline from the
decoded-volume cache; then the DataLoader with cfg.workers processes from the cache. The reference
is this machine's single-core memory copy bandwidth. Targets: uncached costs at most 1.5x decode for
uncompressed data; the cache delivers at least 50 volumes/s per core at image_size [64,384,384].
"""

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from typing import List

import numpy as np
import pydicom
import torch
from pydicom.uid import (
    JPEG2000,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
)

import runtime
import schedules
import train
from config import ConfigError, ScriptParser, given_flags, load_config, script_main
from data import OCTDataset, load_prepared, make_loader
from masks import mask_generator_from_config
from model import VJEPA3D, activation_bytes_per_sample, training_flops_per_sample, transformer_flops
from plan import choose_auto_settings
from runlog import size_text
from phantom import STYLES, quantize, spacing_for, synth_reflectivity, write_oct

SYNTAXES = (
    ("uncompressed 8-bit", ExplicitVRLittleEndian, 8),
    ("uncompressed 16-bit", ExplicitVRLittleEndian, 16),
    ("JPEG 2000 lossless 8-bit", JPEG2000Lossless, 8),
    ("JPEG 2000 lossy 8-bit", JPEG2000, 8),
    ("RLE lossless 8-bit", RLELossless, 8),
    ("JPEG baseline 8-bit", JPEGBaseline8Bit, 8),
)
FULL = {
    "shape": (49, 496, 512),
    "files": 4,
    "min_seconds": 2.0,
    "image_size": [64, 384, 384],
    "patch_size": [4, 16, 16],
}
QUICK = {
    "shape": (16, 128, 128),
    "files": 2,
    "min_seconds": 0.3,
    "image_size": [16, 64, 64],
    "patch_size": [4, 8, 8],
}


def rate(fn, items, min_seconds: float) -> float:
    """Items per second of fn over `items`, repeated for at least min_seconds after one warm-up
    pass."""
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
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    seconds = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / seconds / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def environment() -> dict:
    """Machine, versions and git commit, so that figures can be compared."""
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if os.path.exists("/proc/cpuinfo")
        else platform.processor()
    )
    versions = {"python": platform.python_version()}
    for package in (
        "torch",
        "numpy",
        "pydicom",
        "pylibjpeg",
        "pylibjpeg-openjpeg",
        "pylibjpeg-libjpeg",
        "pylibjpeg-rle",
        "gcsfs",
    ):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=here, capture_output=True, text=True
        ).stdout.strip()

    return {
        "device": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": versions,
        "git_commit": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def write_bench_files(workdir: str, shape, files: int) -> dict:
    """{syntax name: [paths]}: one synthetic volume per bit depth, written in each transfer
    syntax."""
    voxels = {
        bits: quantize(synth_reflectivity(shape, np.random.default_rng(0)), bits)
        for bits in (8, 16)
    }
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
    """Volumes/s per core for decode, uncached and cached pipelines per transfer syntax, plus the
    loader."""
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
        results[name] = {
            "decode_vol_s": decode,
            "uncached_vol_s": pipeline,
            "cached_vol_s": from_cache,
            "uncached_cost_x_decode": decode / pipeline,
            "file_mb": os.path.getsize(paths[0]) / 1e6,
        }
        print(
            f"{name:<26} decode {decode:8.1f}  uncached {pipeline:8.1f}  cached {from_cache:8.1f}"
            f" vol/s  (uncached = {decode / pipeline:.1f}x decode)",
            flush=True,
        )

    dataset = OCTDataset(all_records, cached_cfg, train=True)
    batch = 2
    loader_volumes, start = 0, time.perf_counter()
    for epoch in range(3):
        for b in make_loader(
            dataset, batch, train=True, workers=cfg.workers, epoch=epoch, seed=cfg.seed
        ):
            loader_volumes += len(b["path"])
    loader = {
        "workers": cfg.workers,
        "batch_size": batch,
        "vol_s": loader_volumes / (time.perf_counter() - start),
    }
    print(
        f"DataLoader from the cache, {cfg.workers} workers: {loader['vol_s']:.1f} vol/s (incl."
        " worker start-up)"
    )

    uncompressed = [v for k, v in results.items() if k.startswith("uncompressed")]
    cached_min = min(v["cached_vol_s"] for v in results.values())
    return {
        "torch_threads": 1,
        "volume_shape": list(plan["shape"]),
        "files_per_syntax": plan["files"],
        "per_syntax": results,
        "loader": loader,
        "reference": {"memcpy_GBps_single_core": memcpy_gbps()},
        "targets": {
            "uncached_cost_x_decode_uncompressed": max(
                v["uncached_cost_x_decode"] for v in uncompressed
            ),
            "uncached_within_1.5x_decode": all(
                v["uncached_cost_x_decode"] <= 1.5 for v in uncompressed
            ),
            "cached_vol_s_per_core_min": cached_min,
            "cached_at_least_50_vol_s_at_64_384_384": (
                cfg.image_size == [64, 384, 384] and cached_min >= 50
            ),
        },
    }


def synchronize(rt: runtime.Runtime) -> None:
    """Wait until the device has finished the queued work (timing needs it)."""
    if rt.kind == "cuda":
        torch.cuda.synchronize()
    elif rt.kind == "xla":
        runtime.xla_modules().torch_xla.sync(wait=True)


def matmul_peak_flops(rt: runtime.Runtime, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of a large square matmul in `dtype` on this device: the reference the model is
    measured against."""
    n = 4096 if rt.kind != "cpu" else 2048 if dtype == torch.float32 else 1024
    a = torch.randn(n, n, device=rt.device).to(dtype)
    b = torch.randn(n, n, device=rt.device).to(dtype)
    c = a @ b
    synchronize(rt)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        c = a @ b
        if rt.kind == "xla":
            runtime.mark_step(rt)
        done += 1
    synchronize(rt)
    del c
    return 2 * n**3 * done / (time.perf_counter() - start)


# Dense (not sparse) peaks of a card's spec sheet, TFLOP/s: (a part of torch.cuda.get_device_name,
# bf16, fp32 without tensor cores); the first that matches names the card. torch's fp32 matmuls do
# not use TF32 unless asked to.
CARD_PEAKS = (
    ("H100 PCIe", 756, 51),
    ("H100 NVL", 835, 60),
    ("H100", 989, 67),
    ("H200", 989, 67),
    ("A100", 312, 19.5),
    ("L40S", 362, 91.6),
    ("L4", 121, 30.3),
)


def card_peak_flops(rt: runtime.Runtime, dtype: torch.dtype):
    """(FLOP/s of this device's spec sheet in `dtype`, or None where CARD_PEAKS does not know it;
    the device's name)."""
    if rt.kind != "cuda":
        return None, rt.kind
    name = torch.cuda.get_device_name(rt.device)
    for part, bf16, fp32 in CARD_PEAKS:
        if part in name:
            return (bf16 if dtype == torch.bfloat16 else fp32) * 1e12, name
    return None, name


# SDPA's kernels by name (bench.py train --sdpa, bench.py attention); auto: torch's own choice
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


@contextlib.contextmanager
def denormals_flushed(device_kind: str):
    """A context in which the CPU (device_kind "cpu") flushes denormal floats to zero; elsewhere
    nothing changes. At random init attention's softmax underflows into denormals, whose slow path
    made one stem's update look 1.6% slower than another's over the same attention shapes
    (experiments/NOTES.md 33): a CPU bench timed the values, not the work."""
    flush = device_kind == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flush:
            torch.set_flush_denormal(False)


def sdpa_backend(name: str):
    """A context in which scaled_dot_product_attention runs only SDPA_BACKENDS[name] (auto: a null
    context)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return (
        contextlib.nullcontext()
        if name == "auto"
        else sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])])
    )


# train.py's functions that make up an update (count_update_ops's phases), innermost first
UPDATE_PHASES = (
    "guarded_step",
    "optimizer_step",
    "update_target",
    "clip_and_measure",
    "forward_backward",
)
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)


def host_peak_bytes(prof: torch.profiler.profile) -> int:
    """The most host (CPU) memory the profiled code held at once beyond what was held when it
    began: the running sum of its allocations and frees, in order (the CPU allocator keeps no peak
    of its own, and RSS only rises, so this is the figure per update that CUDA's
    max_memory_allocated gives)."""
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    held = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            held += e.nbytes()
            peak = max(peak, held)
    return peak


def count_update_ops(update, rt: runtime.Runtime) -> dict:
    """What one call of `update` (a train_update) asks of the device, by the UPDATE_PHASES function
    it is in: torch operators called from Python or autograd (aten ops not inside another), and on
    CUDA the kernel and CUDA-graph launches; and the host memory it adds at peak (host_peak_bytes).
    Ops with no Python frame run in autograd's device thread: backward, counted in
    forward_backward."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if rt.kind == "cuda" else []
    )
    try:
        with torch.profiler.profile(
            activities=activities, with_stack=True, profile_memory=True
        ) as prof:
            update()
            synchronize(rt)
    except RuntimeError as e:  # a profiler that cannot start here must not cost the benchmark
        return {"error": repr(e)}
    ops, launches = Counter(), Counter()
    for e in prof.events():
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        frames = [name for name in chain if ".py(" in name]
        phase = next(
            (p for p in UPDATE_PHASES if any(f.endswith(f": {p}") for f in frames)),
            "forward_backward" if not frames else "rest",
        )
        if e.name.startswith("aten::") and not any(name.startswith("aten::") for name in chain):
            ops[phase] += 1
        elif e.name in LAUNCHES:
            launches["graphs" if e.name == "cudaGraphLaunch" else phase] += 1
    return {
        "aten_ops": dict(ops),
        "launches": dict(launches),
        "total_aten_ops": sum(ops.values()),
        "total_launches": sum(launches.values()),
        "host_peak_bytes": host_peak_bytes(prof),
    }


def ops_text(ops: dict) -> str:
    """count_update_ops's figures in a line."""
    if "error" in ops:
        return f"not counted ({ops['error']})"
    text = (
        f"{ops['total_aten_ops']} torch ops ("
        + ", ".join(f"{k} {v}" for k, v in ops["aten_ops"].items())
        + ")"
    )
    if ops["total_launches"]:
        text += (
            f", {ops['total_launches']} launches ("
            + ", ".join(f"{k} {v}" for k, v in ops["launches"].items())
            + ")"
        )
    return text


def synthetic_batch(cfg, size: int, seed: int = 0) -> dict:
    """A batch of normalized-noise volumes with real masks from the config's mask generator."""
    rng = np.random.default_rng(seed)
    masks = [mask_generator_from_config(cfg)(rng) for _ in range(size)]
    return {
        "volume": torch.from_numpy(
            rng.standard_normal((size, 1, *cfg.image_size), dtype=np.float32)
        ),
        "context_idx": torch.from_numpy(np.stack([m[0] for m in masks])),
        "target_idx": torch.from_numpy(np.stack([m[1] for m in masks])),
        "path": ["synthetic"] * size,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plain_vit_flops(
    model: VJEPA3D, volume: torch.Tensor, cfg, rt: runtime.Runtime, warmup: int, repeats: int
) -> float:
    """FLOP/s of the context encoder alone over all tokens, forward and backward: what a plain ViT
    of the model's width reaches on this device (the ceiling for the JEPA update's extras to be
    measured against)."""

    def step():
        with rt.autocast(cfg.use_bf16):
            model.encoder(volume).float().pow(2).mean().backward()
        runtime.mark_step(rt)

    for _ in range(warmup):
        step()
    synchronize(rt)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize(rt)
    model.zero_grad(set_to_none=True)
    flops = (
        3
        * transformer_flops(cfg.num_tokens(), cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
        * len(volume)
    )
    return flops * repeats / (time.perf_counter() - start)


# bench's variants of the update: their compile mode (None: eager)
VARIANTS = {
    "eager": None,
    "compiled": "default",
    "reduce-overhead": "reduce-overhead",
    "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
}
# Eager updates of another recipe at the config's size, timed beside the config's own: what the
# hmlp stem and the local loss cost where a config trains them. The config fields each one sets.
RECIPES = {
    "linear": {"patch_stem": "linear", "local_loss_weight": 0.0},
    "linear_local": {"patch_stem": "linear"},
    "hmlp": {"patch_stem": "hmlp"},
    # the larger first cell, with E/2 and E/4 channels inside the stem; the first cell two slices deep
    "hmlp_1x4x4": {"patch_stem": "hmlp", "stem_cell": [1, 4, 4], "stem_width": 0.5},
    "hmlp_1x4x4_narrow": {"patch_stem": "hmlp", "stem_cell": [1, 4, 4], "stem_width": 0.25},
    "hmlp_2x4x4": {"patch_stem": "hmlp", "stem_cell": [2, 4, 4], "stem_width": 0.5},
}


def variant_config(cfg, name: str):
    """The config a variant of time_updates trains: cfg itself, or cfg with RECIPES[name]."""
    return replace(cfg, **RECIPES.get(name, {}))


def time_updates(
    cfg, rt: runtime.Runtime, batch: dict, warmup: int, repeats: int, names: List[str]
) -> dict:
    """{variant: its model, first update time (compiled: compilation included), peak memory, step
    and CPU times of `repeats` updates, the ops and launches of one more (count_update_ops) and the
    last loss} for the `names` of VARIANTS (compiled ones with compile_parts in their mode), or for
    unsharded and sharded updates when rt is sharded (with the state each holds per device), timed
    interleaved so that a change in the machine's load hits all alike; plus the load averages around
    the timing."""
    rss_before = peak_rss_bytes()
    names = ["unsharded", "sharded"] if rt.sharded else ["eager"] if rt.kind == "xla" else names
    variants = {name: {} for name in names}
    hp = schedules.Hyperparameters(cfg.base_lr, cfg.weight_decay, cfg.ema_base)
    for name, v in variants.items():
        torch.manual_seed(cfg.seed)
        variant_rt = replace(rt, fsdp_size=1) if name == "unsharded" else rt
        variant_cfg = variant_config(cfg, name)
        model = runtime.place_model(VJEPA3D.from_config(variant_cfg), variant_rt)
        if VARIANTS.get(name) is not None:
            model.compile_parts(VARIANTS[name])
        optimizer = train.make_optimizer(model, variant_cfg, variant_rt)
        wrapped = runtime.wrap_ddp(model, variant_rt)

        def update(model=wrapped, optimizer=optimizer, variant_rt=variant_rt, vcfg=variant_cfg):
            if rt.kind == "cuda":
                torch.cuda.reset_peak_memory_stats()
                v["resident"] = torch.cuda.memory_allocated()
            result = train.train_update(model, optimizer, [batch], hp, vcfg, variant_rt)
            runtime.mark_step(rt)
            return result

        v.update(model=model, update=update, times=[], cpu_times=[])
        # XLA: the first update compiles the graph of them all
        runtime.materialize_state(model, variant_rt)
        if rt.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        update()
        synchronize(rt)
        v["first_update_s"] = time.perf_counter() - start
        for _ in range(warmup - 1):
            update()
        synchronize(rt)
        # CPU: the process's RSS high-water mark, so only the variant built first has its own
        # figure.
        v["memory"] = (
            torch.cuda.max_memory_allocated()
            if rt.kind == "cuda"
            else peak_rss_bytes() - rss_before
            if name == names[0]
            else None
        )
        runtime.mark_step(rt)  # XLA: the state is materialised before it is measured
        v["state_bytes"] = runtime.state_bytes_per_device(model, optimizer, variant_rt)
    load_before = os.getloadavg()
    for _ in range(repeats):
        for v in variants.values():
            start, cpu_start = time.perf_counter(), time.process_time()
            v["last"] = v["update"]()
            synchronize(rt)
            v["times"].append(time.perf_counter() - start)
            v["cpu_times"].append(time.process_time() - cpu_start)
    load_after = os.getloadavg()
    for v in variants.values():
        v["loss"] = float(runtime.fetch_to_host([v["last"].stats], rt)[0][0])
        if rt.kind == "cuda":  # the last update alone: what it added to the memory already held
            v["update_peak_bytes"] = torch.cuda.max_memory_allocated() - v["resident"]
        v["ops"] = count_update_ops(v["update"], rt) if rt.kind != "xla" else None
        if rt.kind == "cpu" and v["ops"] and "error" not in v["ops"]:
            v["update_peak_bytes"] = v["ops"]["host_peak_bytes"]
    return {"variants": variants, "load_average_1min": [load_before[0], load_after[0]]}


def bench_train(
    cfg, warmup: int, repeats: int, names: List[str] = ("eager", "compiled"), sdpa: str = "auto"
) -> dict:
    """Step time, samples/s, tokens/s, model FLOP/s and MFU (of the same-run matmul peak and of the
    card's spec), peak memory and the ops of one update of train.py's training update, for the
    `names` of VARIANTS (XLA: eager, it compiles anyway), or unsharded and sharded (cfg.shard fsdp),
    with compile and grad_checkpointing auto decided for this device as train.py does and SDPA's
    kernel `sdpa` (SDPA_BACKENDS). Top-level figures are the first one's (eager, unsharded); each
    other variant's name holds the same figures and NAME_over_FIRST the ratios."""
    rt = runtime.setup_runtime(cfg)
    cfg, notes = choose_auto_settings(cfg, rt, cfg.per_core_batch_size)
    if rt.is_master:
        print("\n".join(notes), flush=True)
    dtype = torch.bfloat16 if cfg.use_bf16 else torch.float32
    batch = runtime.to_device(synthetic_batch(cfg, cfg.per_core_batch_size * rt.local_replicas), rt)
    batch_size = len(batch["path"])
    with sdpa_backend(sdpa), denormals_flushed(rt.kind):
        timed = time_updates(cfg, rt, batch, warmup, repeats, list(names))
    variants = timed["variants"]
    first, *second = variants  # eager or unsharded; compiled or sharded (none on XLA unsharded)
    step = {name: float(np.median(v["times"])) for name, v in variants.items()}
    peak = matmul_peak_flops(rt, dtype, seconds=max(1.0, 3 * step[first]) if repeats > 3 else 0.5)
    card_peak, card = card_peak_flops(rt, dtype)
    eager = variants[first]
    with sdpa_backend(sdpa), denormals_flushed(rt.kind):
        plain = plain_vit_flops(eager["model"], batch["volume"], cfg, rt, warmup, repeats)
    n_context, n_target = cfg.token_counts()
    tokens = n_context + n_target

    def figures(name: str) -> dict:
        v, t = variants[name], variants[name]["times"]
        variant_cfg = variant_config(cfg, name)
        model_flops = training_flops_per_sample(variant_cfg)["total"]
        achieved = model_flops * batch_size / step[name]
        return {
            "model_flops_per_sample": model_flops,
            "activation_bytes_per_sample_estimate": activation_bytes_per_sample(variant_cfg),
            "step_time_s_median": step[name],
            "step_time_s_min": min(t),
            "step_time_s_max": max(t),
            "step_time_spread": (max(t) - min(t)) / step[name],
            "cpu_time_s_median": float(np.median(v["cpu_times"])),
            "first_update_s": v["first_update_s"],
            "samples_per_s": batch_size / step[name],
            "tokens_per_s": batch_size * tokens / step[name],
            "achieved_flops": achieved,
            "mfu": achieved / peak,
            "mfu_card": achieved / card_peak if card_peak else None,
            "ops": v["ops"],
            "share_of_plain_vit_flops": achieved / plain,
            "peak_memory_bytes": v["memory"],
            "loss": v["loss"],
            "state_bytes_per_device": v["state_bytes"],
            "update_peak_bytes": v.get("update_peak_bytes"),
            "compile_time_s": v["first_update_s"] - step[name] if VARIANTS.get(name) else None,
        }

    out = {
        "device": rt.kind,
        "dtype": str(dtype).replace("torch.", ""),
        "batch_size": batch_size,
        "parameters": eager["model"].num_trainable_params(),
        "tokens_per_sample": tokens,
        "context_tokens": n_context,
        "target_tokens": n_target,
        "repeats": repeats,
        "warmup": warmup,
        "matmul_peak_flops": peak,
        "plain_vit_flops": plain,
        "card": card,
        "card_peak_flops": card_peak,
        "sdpa": sdpa,
        "denormals_flushed": rt.kind == "cpu",
        "auto_notes": notes,
        "plain_vit_mfu": plain / peak,
        "shard": cfg.shard,
        "fsdp_size": rt.fsdp_size,
        "variants": list(variants),
        **figures(first),
        "peak_memory_bytes_per_sample": eager["memory"] / batch_size,
        "memory_measure": "cuda max_memory_allocated" if rt.kind == "cuda" else "peak RSS growth",
        "one_layer_attention_matrix_bytes": tokens**2 * cfg.num_heads * (2 if cfg.use_bf16 else 4),
        "grad_checkpointing": cfg.grad_checkpointing,
        "load_average_1min": timed["load_average_1min"],
    }
    for name in second:
        out[name] = figures(name)
        out[f"{name}_over_{first}"] = ratios(out[name], out, variants[name], eager)
    if rt.is_master:
        print(format_train_report(out), flush=True)
    return out


def peak_bytes_per_device(figures: dict):
    """The state a variant holds per device plus the most its update adds to it (bench_train's
    figures): its peak memory in an update, or None where the update's peak was not measured."""
    if figures["update_peak_bytes"] is None:
        return None
    return sum(figures["state_bytes_per_device"].values()) + figures["update_peak_bytes"]


def ratios(figures: dict, first: dict, timed: dict, first_timed: dict) -> dict:
    """A variant's figures over the first variant's (bench_train): time, state, peak memory, FLOPs,
    activations."""
    times, first_times = np.array(timed["times"]), np.array(first_timed["times"])
    peaks = peak_bytes_per_device(figures), peak_bytes_per_device(first)
    return {
        "step_time_median": figures["step_time_s_median"] / first["step_time_s_median"],
        "step_time_paired_median": float(np.median(times / first_times)),
        "step_time_min": times.min() / first_times.min(),
        "cpu_time_median": figures["cpu_time_s_median"] / first["cpu_time_s_median"],
        "state_bytes_per_device": (
            sum(figures["state_bytes_per_device"].values())
            / sum(first["state_bytes_per_device"].values())
        ),
        "peak_memory": peaks[0] / peaks[1] if None not in peaks else None,
        "model_flops": figures["model_flops_per_sample"] / first["model_flops_per_sample"],
        "activation_bytes_estimate": (
            figures["activation_bytes_per_sample_estimate"]
            / first["activation_bytes_per_sample_estimate"]
        ),
    }


def format_train_report(out: dict) -> str:
    """The console report of bench_train's figures."""
    load_before, load_after = out["load_average_1min"]
    lines = [
        f"train update on {out['device']} ({out['dtype']}, batch {out['batch_size']},"
        f" {out['tokens_per_sample']} tokens/sample, {out['parameters']:,} params,"
        f" {out['model_flops_per_sample'] / 1e9:.2f} GFLOP/sample, grad_checkpointing"
        f" {out['grad_checkpointing']}, SDPA {out['sdpa']}"
        f"{', denormals flushed' if out['denormals_flushed'] else ''}),"
        f" {out['repeats']} interleaved repeats,"
        f" load average {load_before:.1f} -> {load_after:.1f}:"
    ]
    first, *second = out["variants"]
    for name, f in [(first, out)] + [(name, out[name]) for name in second]:
        card = f"{100 * f['mfu_card']:.1f}%" if f["mfu_card"] is not None else "unknown"
        lines.append(
            f"  {name:<13}{f['step_time_s_median'] * 1e3:9.1f} ms median"
            f" ({f['step_time_s_min'] * 1e3:.1f}-{f['step_time_s_max'] * 1e3:.1f}), CPU time"
            f" {f['cpu_time_s_median'] * 1e3:.1f} ms, {f['samples_per_s']:.2f} samples/s,"
            f" {f['achieved_flops'] / 1e9:.1f} GFLOP/s = {100 * f['mfu']:.1f}% MFU ({card} of the"
            f" card's spec), {100 * f['share_of_plain_vit_flops']:.0f}% of the plain ViT's FLOP/s,"
            f" loss {f['loss']:.5f}"
        )
        held = f["state_bytes_per_device"]
        lines.append(
            f"{'':15}per device: weights {size_text(held['weights'])}, EMA target "
            f"{size_text(held['ema_target'])}, AdamW {size_text(held['adamw'])}"
            + (
                f", its update adds {size_text(f['update_peak_bytes'])} at peak"
                if f["update_peak_bytes"] is not None
                else ""
            )
        )
        if f["ops"]:
            lines.append(f"{'':15}one update: {ops_text(f['ops'])}")
    for name in second:
        ratio = out[f"{name}_over_{first}"]
        over = f" over {out['fsdp_size']} devices" if name == "sharded" else ""
        lines.append(
            f"  {name} / {first}{over}: {ratio['step_time_median']:.3f}x median time (paired "
            f"{ratio['step_time_paired_median']:.3f}x, min {ratio['step_time_min']:.3f}x, CPU time "
            f"{ratio['cpu_time_median']:.3f}x), "
            f"{ratio['state_bytes_per_device']:.3f}x the state per device, "
            + (
                f"{ratio['peak_memory']:.3f}x the peak memory (state and update), "
                if ratio["peak_memory"] is not None
                else ""
            )
            + f"{ratio['model_flops']:.3f}x the FLOPs and {ratio['activation_bytes_estimate']:.3f}x"
            " the estimated activations"
            + (
                f"; compile time {out[name]['compile_time_s']:.1f} s (first update less a median"
                " one)"
                if out[name]["compile_time_s"] is not None
                else ""
            )
        )
    memory = out["peak_memory_bytes"]
    card = (
        f"{out['card']} spec {out['card_peak_flops'] / 1e12:.0f} TFLOP/s"
        if out["card_peak_flops"]
        else f"{out['card']}: spec unknown"
    )
    lines.append(
        f"reference: {out['matmul_peak_flops'] / 1e9:.1f} GFLOP/s {out['dtype']} matmul peak"
        f" ({card}); a plain ViT encoder of this width {out['plain_vit_flops'] / 1e9:.1f} GFLOP/s ="
        f" {100 * out['plain_vit_mfu']:.1f}% MFU\npeak memory ({first}) {memory / 2**30:.2f} GiB"
        f" ({out['memory_measure']}), {out['peak_memory_bytes_per_sample'] / 2**30:.2f}"
        " GiB/sample (estimated activations"
        f" {out['activation_bytes_per_sample_estimate'] / 2**30:.2f} GiB/sample); one"
        " materialised attention matrix would be"
        f" {out['one_layer_attention_matrix_bytes'] / 2**30:.2f} GiB per layer"
    )
    return "\n".join(lines)


# bench.py train --sizes: the config flags of each size (production: ViT-L at batch 2, unsharded, on
# one device)
SIZES = {
    "smoke": ["--config", "configs/smoke.yaml"],
    "demo": ["--config", "configs/demo.yaml"],
    "learn": ["--config", "configs/learn.yaml"],
    "production": [
        "--config",
        "configs/pretrain_vitl.yaml",
        "--shard",
        "none",
        "--per_core_batch_size",
        "2",
        "--global_batch_size",
        "2",
        "--grad_accum_steps",
        "none",
    ],
}


def bench_sizes(
    sizes: List[str], flags: List[str], warmup: int, repeats: int, names: List[str], sdpa: str
) -> dict:
    """bench_train at each of `sizes` (SIZES, then `flags`) in this process; prints one table of
    them all."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = {}
    for size in sizes:
        args = [os.path.join(here, a) if a.startswith("configs/") else a for a in SIZES[size]]
        print(f"== {size}: {' '.join(SIZES[size] + flags)}", flush=True)
        out[size] = {
            "config": asdict(load_config(args + flags)),
            **bench_train(load_config(args + flags), warmup, repeats, names, sdpa),
        }
    print(format_sizes_table(out), flush=True)
    return out


def format_sizes_table(out: dict) -> str:
    """One markdown table of bench_sizes' figures: a row per size and variant."""
    rows = [
        (
            "| size | variant | ms/update (min-max) | samples/s | MFU: run peak / card | peak"
            " memory | checkpointing | compile s | torch ops / launches | loss |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, o in out.items():
        for name in o["variants"]:
            f = o if name == o["variants"][0] else o[name]
            card = f"{100 * f['mfu_card']:.1f}%" if f["mfu_card"] is not None else "unknown"
            ops = f["ops"] or {}
            rows.append(
                f"| {size} | {name} | {f['step_time_s_median'] * 1e3:.1f}"
                f" ({f['step_time_s_min'] * 1e3:.1f}-{f['step_time_s_max'] * 1e3:.1f}) |"
                f" {f['samples_per_s']:.1f} | {100 * f['mfu']:.1f}% / {card} |"
                f" {size_text(f['peak_memory_bytes']) if f['peak_memory_bytes'] else '-'} |"
                f" {'on' if o['grad_checkpointing'] else 'off'} |"
                f" {'-' if f['compile_time_s'] is None else format(f['compile_time_s'], '.0f')} |"
                f" {ops.get('total_aten_ops', '-')} / {ops.get('total_launches', '-')} |"
                f" {f['loss']:.5f} |"
            )
    return "\n".join(rows)


def bench_attention(cfg, repeats: int) -> dict:
    """Each SDPA kernel (SDPA_BACKENDS, and auto: torch's choice, named) at the config's attention
    shapes and dtype: the context encoder's and the predictor's forward and backward, the target
    encoder's forward; median time and TFLOP/s (4 B H N^2 D a forward, twice that a backward), or
    why it does not run."""
    rt = runtime.setup_runtime(cfg)
    dtype = torch.bfloat16 if cfg.use_bf16 else torch.float32
    n_context, n_target = cfg.token_counts()
    batch, n = cfg.per_core_batch_size, n_context + n_target
    shapes = {
        "context encoder": (cfg.num_heads, n_context, cfg.embed_dim // cfg.num_heads, True),
        "target encoder": (cfg.num_heads, n, cfg.embed_dim // cfg.num_heads, False),
        "predictor": (cfg.pred_num_heads, n, cfg.pred_embed_dim // cfg.pred_num_heads, True),
    }
    out = {"dtype": str(dtype).replace("torch.", ""), "batch": batch, "shapes": {}}
    for where, (heads, tokens, dim, backward) in shapes.items():
        q, k, v = (
            torch.randn(
                batch, heads, tokens, dim, device=rt.device, dtype=dtype, requires_grad=backward
            )
            for _ in range(3)
        )
        grad = torch.randn_like(q)
        flops = 4 * batch * heads * tokens**2 * dim * (3 if backward else 1)
        row = out["shapes"][where] = {"shape": [batch, heads, tokens, dim], "backward": backward}

        def step(name):
            with sdpa_backend(name), torch.set_grad_enabled(backward):
                result = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            if backward:
                result.backward(grad)

        for name in ("auto", *SDPA_BACKENDS):
            try:
                step(name)
                times = []
                for _ in range(repeats):
                    synchronize(rt)
                    start = time.perf_counter()
                    step(name)
                    synchronize(rt)
                    times.append(time.perf_counter() - start)
                row[name] = {
                    "ms": 1e3 * float(np.median(times)),
                    "tflops": flops / float(np.median(times)) / 1e12,
                }
            except RuntimeError as e:  # a kernel that does not take these shapes, dtype or device
                row[name] = {"unsupported": str(e).splitlines()[0][:200]}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step("auto")
        row["auto"]["kernel"] = next(
            (e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot")), None
        )
        print(
            f"SDPA {where} {row['shape']} {'fwd+bwd' if backward else 'fwd'} {out['dtype']}: "
            + ", ".join(
                (
                    f"{name} {r['ms']:.2f} ms ({r['tflops']:.1f} TFLOP/s)"
                    if "ms" in r
                    else f"{name} unsupported"
                )
                for name, r in row.items()
                if isinstance(r, dict)
            )
            + f"; auto runs {row['auto'].get('kernel')}",
            flush=True,
        )
    return out


@script_main
def main(argv: List[str]) -> int:
    parser = ScriptParser(__doc__, prog="bench.py")
    parser.add_argument(
        "mode", nargs="?", default="all", choices=("train", "data", "all", "attention")
    )
    parser.add_argument(
        "--json", help="write all figures, config, device, versions and git commit here"
    )
    parser.add_argument("--quick", action="store_true", help="small volumes and short runs (CI)")
    parser.add_argument(
        "--workdir", help="where the benchmark files go (default: a temporary folder)"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed training updates (default 10; --quick 3)"
    )
    parser.add_argument(
        "--warmup", type=int, help="untimed training updates first (default 3; --quick 1)"
    )
    parser.add_argument(
        "--variants",
        default="eager,compiled",
        help=(
            f"train: the updates timed side by side, of {', '.join(VARIANTS)} and the eager"
            f" updates of other recipes at the same size, {', '.join(RECIPES)} (RECIPES; default"
            " eager,compiled)"
        ),
    )
    parser.add_argument(
        "--sizes",
        help=(
            f"train: these sizes in one process, one table ({', '.join(SIZES)}; the "
            "config flags given apply to each), instead of one config"
        ),
    )
    parser.add_argument(
        "--sdpa",
        default="auto",
        choices=("auto", *SDPA_BACKENDS),
        help="train: the attention kernel (default auto: torch's choice)",
    )
    args, rest = parser.parse(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    sizes = [v.strip() for v in (args.sizes or "").split(",") if v.strip()]
    if set(names) - set(VARIANTS) - set(RECIPES) or set(sizes) - set(SIZES):
        raise ConfigError(
            f"--variants {args.variants} / --sizes {args.sizes}: expected variants of "
            f"{', '.join([*VARIANTS, *RECIPES])} and sizes of {', '.join(SIZES)}."
        )
    plan = QUICK if args.quick else FULL
    cfg = load_config(rest, defaults={k: plan[k] for k in ("image_size", "patch_size")})
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    default = (
        "smoke.yaml" if args.quick else "pretrain_vitl.yaml" if args.mode == "attention" else None
    )
    train_cfg = load_config(
        (
            ["--config", os.path.join(configs, default)]
            if default and "config" not in given_flags(rest)
            else []
        )
        + rest
    )
    report = {
        "mode": args.mode,
        "quick": args.quick,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **environment(),
    }
    warmup, repeats = (
        args.warmup or (1 if args.quick else 3),
        args.repeats or (3 if args.quick else 10),
    )
    if args.mode in ("train", "all") and sizes:
        report["train"] = bench_sizes(sizes, rest, warmup, repeats, names, args.sdpa)
    elif args.mode in ("train", "all"):
        report["train_config"] = asdict(train_cfg)
        report["train"] = bench_train(train_cfg, warmup, repeats, names, args.sdpa)
    if args.mode == "attention":
        report["attention_config"] = asdict(train_cfg)
        report["attention"] = bench_attention(train_cfg, repeats)
    if args.mode in ("data", "all"):
        report["data_config"] = asdict(cfg)
        workdir = args.workdir or tempfile.mkdtemp(prefix="octjepa-bench-")
        try:
            report["data"] = bench_data(cfg, args.quick, workdir)
        finally:
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    if args.json and os.environ.get("RANK", "0") == "0":  # torchrun: the first process writes it
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
