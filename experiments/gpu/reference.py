"""octjepa's training update against facebookresearch/jepa's model code (V-JEPA, `src/models`) at
equal config.

What it measures (the method of shared/gpu-figures.md): one process builds both models at the same
architecture, feeds them the same volume and the same context/target token indices (octjepa's mask
generator), and times their training updates alternately (A, B, A, B ... for --rounds rounds after
warm-up; the median per arm). An update is, in each arm's own code:

  target encoder (no grad) on all tokens -> layer norm -> the target tokens
  context encoder on the visible tokens -> predictor (mask tokens at the target positions) -> L1
  loss backward -> AdamW step (fused, both arms) -> EMA update of the target encoder

  octjepa:    VJEPA3D.forward (model.py), weight decay as train.optimizer_step applies it (a foreach
  multiply, then
              AdamW with weight_decay 0), VJEPA3D.update_target (a foreach lerp). No NaN guard, no
              grad clipping (--clip adds both arms' clipping). Activation checkpointing off.
  reference:  jepa's MultiMaskWrapper(VisionTransformer) and
  PredictorMultiMaskWrapper(VisionTransformerPredictor)
              with use_mask_tokens (as its V-JEPA configs), its app/vjepa/train.py train_step
              without GradScaler, loggers, schedulers and the variance regulariser (reg_coeff 0 in
              its configs); its AdamW parameter groups (weight decay inside AdamW), its
              per-parameter EMA loop. in_chans=1, num_frames = the volume's depth, tubelet_size =
              the patch depth, img_size/patch_size square (the reference needs H == W). Its
              attention's `with torch.backends.cuda.sdp_kernel():` (deprecated; all SDPA backends
              enabled, so the same kernels as without it) is a null context unless --ref_sdp_kernel
              as_is: as it is, dynamo breaks the compiled graph before and after every attention.

Both in bf16 autocast when the octjepa config has use_bf16 (weights, gradients, AdamW and EMA state
fp32 in both), batch --batch (2). Reported per arm: median update time (min-max), peak CUDA memory
of an update (max_memory_allocated after a reset, less what was allocated before it that is not this
arm's own weights, EMA target and AdamW state: the other arm shares the process; the shared input
volume is left out too), the model FLOPs per update (octjepa's training_flops_per_sample, the same
architecture for both), TFLOP/s and their share of a bf16 (fp32 for fp32 sizes) 8192^3 matmul timed
with CUDA events in the same run. Eager, then (--compile both) compiled: octjepa with
VJEPA3D.compile_parts() (train.py's compile_model), the reference with .compile(dynamic=False) on
its encoder, target encoder and predictor modules (or, --compile_style blocks, each transformer
block of both on its own: a shorter compile); the first compiled update less a median one is the
compile time.

    python experiments/gpu/reference.py --ref_dir .ref/jepa                       # ViT-L (pretrain_vitl.yaml), eager
    python experiments/gpu/reference.py --ref_dir .ref/jepa --compile both --sizes vitl,demo
    python experiments/gpu/reference.py --smoke                                   # CPU, demo size, 2 rounds
    python experiments/gpu/reference.py ... -- --patch_stem hmlp                  # after --: octjepa config flags

The reference's code is not part of this repository (CC BY-NC 4.0): extract its src/ into .ref/jepa
(ignored):
    git --git-dir=<jepa clone>/.git archive HEAD src | tar -x -C .ref/jepa
Writes $OUT/reference.json (or --json FILE) after every phase, so a run cut short keeps what it
measured.
"""

import abc
import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# the octjepa checkout
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SIZES = {"vitl": "configs/pretrain_vitl.yaml", "demo": "configs/demo.yaml"}


def import_first(name: str, modules):
    """`name` from the first of `modules` that has it (octjepa is being refactored: things move
    between files); (object, module name), or (None, the errors) when none has it."""
    errors = []
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name), module
        except (ImportError, AttributeError) as e:
            errors.append(f"{module}: {e!r}")
    return None, "; ".join(errors)


# --------------------------------------------------------------------------------------------------
# Config, masks, FLOPs (octjepa's, imported defensively)
# --------------------------------------------------------------------------------------------------


def octjepa_config(size: str, extra_flags):
    """octjepa's Config of a size: its YAML, activation checkpointing off, unsharded, not compiled
    (this script compiles), plus the extra octjepa flags (ViT-L only)."""
    from config import load_config

    return load_config(
        ["--config", os.path.join(ROOT, SIZES[size]), *extra_flags],
        grad_checkpointing=False,
        shard=None,
        fsdp_size=None,
        compile=False,
    )


def make_masks(cfg, batch: int, seed: int = 0):
    """(context [B, Nc] or [B, M, Nc], target likewise, int64, where they came from): octjepa's mask
    generator for the config, one draw per sample; without it (an import failure), random indices of
    the same counts."""
    gen_from_config, where = import_first("mask_generator_from_config", ("masks", "data"))
    rng = np.random.default_rng(seed)
    if gen_from_config is not None:
        gen = gen_from_config(cfg)
        draws = [gen(rng) for _ in range(batch)]
        source = f"{where}.mask_generator_from_config ({cfg.mask_type}, ratio {cfg.mask_ratio})"
    else:
        print(
            f"WARNING: octjepa's mask generator did not import ({where}); random indices of the"
            " same counts"
        )
        n_context, n_target = cfg.token_counts()
        perms = [rng.permutation(cfg.num_tokens()) for _ in range(batch)]
        draws = [(np.sort(p[n_target:]), np.sort(p[:n_target])) for p in perms]
        source = "random permutation (octjepa's mask generator did not import)"
    context = torch.from_numpy(np.stack([d[0] for d in draws]).astype(np.int64))
    target = torch.from_numpy(np.stack([d[1] for d in draws]).astype(np.int64))
    return context, target, source


def transformer_flops(tokens, dim, depth, mlp_ratio):
    """Forward FLOPs of `depth` pre-norm blocks (model.transformer_flops' formula)."""
    return depth * (2 * tokens * dim * dim * (4 + 2 * mlp_ratio) + 4 * tokens * tokens * dim)


def flops_per_sample(cfg):
    """(model FLOPs of one training sample, where the figure came from): octjepa's
    training_flops_per_sample when it imports, else the same count for the linear stem done here."""
    fn, where = import_first(
        "training_flops_per_sample", ("model", "flops", "costs", "sizes", "bench")
    )
    if fn is not None:
        return float(fn(cfg)["total"]), f"{where}.training_flops_per_sample"
    n_context, n_target = cfg.token_counts()
    n = n_context + n_target
    embed = 2 * n * math.prod(cfg.patch_size) * cfg.embed_dim
    context = transformer_flops(n_context, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
    predictor = (
        transformer_flops(n, cfg.pred_embed_dim, cfg.pred_depth, cfg.mlp_ratio)
        + 2 * n * cfg.embed_dim * cfg.pred_embed_dim
    )
    target = embed + transformer_flops(n, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
    return (
        float(2 * embed + 3 * (context + predictor) + target),
        "this script's formula (linear stem)",
    )


def reference_flops_config(cfg):
    """cfg with what the reference lacks turned off (the linear stem, no extra losses): its FLOPs
    are these."""
    changes = {
        "patch_stem": "linear",
        "context_loss_weight": 0.0,
        "gram_loss_weight": 0.0,
        "local_loss_weight": 0.0,
        "target_levels": 1,
    }
    return dataclasses.replace(cfg, **{k: v for k, v in changes.items() if hasattr(cfg, k)})


def equal_architecture(cfg) -> bool:
    """Whether octjepa's model has the reference's architecture (no extras the reference lacks)."""
    return all(
        getattr(cfg, k, default) == default
        for k, default in (
            ("patch_stem", "linear"),
            ("context_loss_weight", 0.0),
            ("gram_loss_weight", 0.0),
            ("local_loss_weight", 0.0),
            ("target_levels", 1),
        )
    )


# --------------------------------------------------------------------------------------------------
# The two arms
# --------------------------------------------------------------------------------------------------


def state_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors`."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class Arm(abc.ABC):
    """One implementation's model, optimizer and update() (OctjepaArm, ReferenceArm)."""

    name = ""

    @abc.abstractmethod
    def modules(self):
        """The arm's trained and EMA modules."""

    @abc.abstractmethod
    def update(self):
        """One training update."""

    @abc.abstractmethod
    def compile(self, style="parts"):
        """torch.compile the arm in `style` (parts or blocks)."""

    def resident_bytes(self) -> int:
        """What this arm holds between updates on the GPU: weights, buffers, gradients (none), AdamW
        state."""
        tensors = [t for m in self.modules() for t in (*m.parameters(), *m.buffers())]
        tensors += [p.grad for m in self.modules() for p in m.parameters() if p.grad is not None]
        tensors += [
            v
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        return state_bytes(tensors)

    def trainable(self) -> int:
        seen = {}
        for m in self.modules():
            for p in m.parameters():
                if p.requires_grad:
                    seen[id(p)] = p.numel()
        return sum(seen.values())


class OctjepaArm(Arm):
    name = "octjepa"

    def __init__(self, cfg, batch, amp, lr, wd, ema, clip):
        from model import VJEPA3D

        self.cfg, self.amp, self.lr, self.wd, self.ema, self.clip = cfg, amp, lr, wd, ema, clip
        self.volume, self.context, self.target = batch
        self.model = VJEPA3D.from_config(cfg).to(self.volume.device)
        self.model.set_grad_checkpointing(False)
        fused = {"fused": True} if self.volume.device.type in ("cuda", "cpu") else {}
        self.optimizer = torch.optim.AdamW(
            self.model.param_groups(), lr=lr, weight_decay=0.0, betas=tuple(cfg.adam_betas), **fused
        )
        self.decay = [p for g in self.optimizer.param_groups if g["apply_wd"] for p in g["params"]]
        self.last_loss = None

    def modules(self):
        return [self.model]

    def update(self):
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        with self.amp():
            out = self.model(self.volume, self.context, self.target)
        out.loss.backward()
        if self.clip:  # train.clip_and_measure: one norm over all trained parameters
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.grad is not None],
                self.cfg.grad_clip if self.cfg.grad_clip is not None else math.inf,
            )
        with torch.no_grad():  # train.optimizer_step
            torch._foreach_mul_(self.decay, 1 - self.lr * self.wd)
            self.optimizer.step()
        self.model.update_target(self.ema)
        self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = out.loss.detach()

    def compile(self, style="parts"):
        if style == "parts":
            self.model.compile_parts()  # train.py's compile_model
        # regional: each transformer block on its own (identical blocks share one graph per shape)
        else:
            for part in (self.model.encoder, self.model.target_encoder, self.model.predictor):
                for block in part.blocks:
                    block.compile(dynamic=False)


class ReferenceArm(Arm):
    name = "reference"

    def __init__(self, cfg, batch, amp, lr, wd, ema, clip, ref):
        D, H, W = cfg.image_size
        pd, ph, pw = cfg.patch_size
        if H != W or ph != pw:
            raise SystemExit(
                "the reference takes square frames and patches (img_size, patch_size ints); this"
                f" config has image_size {cfg.image_size}, patch_size {cfg.patch_size}"
            )
        self.amp, self.lr, self.wd, self.ema, self.clip = amp, lr, wd, ema, clip
        self.volume, context, target = batch
        self.apply_masks = ref["apply_masks"]
        m = 1 if context.dim() == 2 else context.shape[1]  # mask sets per sample
        # its format: a list (one entry per mask set) of index tensors [B, K]
        self.masks_enc = (
            [context] if context.dim() == 2 else [context[:, i].contiguous() for i in range(m)]
        )
        self.masks_pred = (
            [target] if target.dim() == 2 else [target[:, i].contiguous() for i in range(m)]
        )
        common = dict(
            img_size=H,
            patch_size=ph,
            num_frames=D,
            tubelet_size=pd,
            mlp_ratio=cfg.mlp_ratio,
            qkv_bias=True,
            norm_layer=partial(nn.LayerNorm, eps=1e-6),
            uniform_power=True,
        )
        # = src.models.vision_transformer.vit_large(...) for ViT-L's width, depth and heads, with
        # one input channel
        backbone = ref["VisionTransformer"](
            in_chans=1, embed_dim=cfg.embed_dim, depth=cfg.depth, num_heads=cfg.num_heads, **common
        )
        # = src.models.predictor.vit_predictor(...); its heads set to octjepa's pred_num_heads
        # (V-JEPA's own init_video_model passes the encoder's head count)
        predictor = ref["VisionTransformerPredictor"](
            embed_dim=cfg.embed_dim,
            predictor_embed_dim=cfg.pred_embed_dim,
            depth=cfg.pred_depth,
            num_heads=cfg.pred_num_heads,
            use_mask_tokens=True,
            num_mask_tokens=m,
            zero_init_mask_tokens=True,
            **common,
        )
        device = self.volume.device
        self.encoder = ref["MultiMaskWrapper"](backbone).to(device)
        self.predictor = ref["PredictorMultiMaskWrapper"](predictor).to(device)
        self.target_encoder = copy.deepcopy(self.encoder)  # as app/vjepa/train.py
        for p in self.target_encoder.parameters():
            p.requires_grad = False
        groups = [  # app/vjepa/utils.py init_opt
            {
                "params": [
                    p
                    for n, p in self.encoder.named_parameters()
                    if "bias" not in n and len(p.shape) != 1
                ]
            },
            {
                "params": [
                    p
                    for n, p in self.predictor.named_parameters()
                    if "bias" not in n and len(p.shape) != 1
                ]
            },
            {
                "params": [
                    p
                    for n, p in self.encoder.named_parameters()
                    if "bias" in n or len(p.shape) == 1
                ],
                "WD_exclude": True,
                "weight_decay": 0,
            },
            {
                "params": [
                    p
                    for n, p in self.predictor.named_parameters()
                    if "bias" in n or len(p.shape) == 1
                ],
                "WD_exclude": True,
                "weight_decay": 0,
            },
        ]
        fused = {"fused": True} if device.type in ("cuda", "cpu") else {}
        self.optimizer = torch.optim.AdamW(
            groups, lr=lr, weight_decay=wd, betas=tuple(cfg.adam_betas), eps=1e-8, **fused
        )
        self.last_loss = None

    def modules(self):
        return [self.encoder, self.predictor, self.target_encoder]

    def update(self):
        """app/vjepa/train.py train_step, loss_exp 1, without the scaler, loggers, schedulers,
        regulariser."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
            if not group.get("WD_exclude"):
                group["weight_decay"] = self.wd
        clips, masks_enc, masks_pred = self.volume, self.masks_enc, self.masks_pred

        def forward_target(c):
            with torch.no_grad():
                h = self.target_encoder(c)
                h = F.layer_norm(h, (h.size(-1),))
                return self.apply_masks(h, masks_pred, concat=False)

        def forward_context(c, h):
            z = self.encoder(c, masks_enc)
            return self.predictor(z, h, masks_enc, masks_pred)

        def loss_fn(z, h, loss_exp=1.0):
            loss = 0.0
            for zi, hi in zip(z, h):
                loss += torch.mean(torch.abs(zi - hi) ** loss_exp) / loss_exp
            return loss / len(masks_pred)

        with self.amp():
            h = forward_target(clips)
            z = forward_context(clips, h)
            loss = loss_fn(z, h)
        loss.backward()
        if self.clip:  # its clip_grad (10.0 in its configs), encoder and predictor apart
            torch.nn.utils.clip_grad_norm_(self.encoder.parameters(), 10.0)
            torch.nn.utils.clip_grad_norm_(self.predictor.parameters(), 10.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        m = self.ema
        with torch.no_grad():
            for param_q, param_k in zip(
                self.encoder.parameters(), self.target_encoder.parameters()
            ):
                param_k.data.mul_(m).add_((1.0 - m) * param_q.detach().data)
        self.last_loss = loss.detach()

    def compile(self, style="parts"):
        if style == "parts":
            for module in (self.encoder, self.target_encoder, self.predictor):
                module.compile(dynamic=False)
        else:
            for blocks in (
                self.encoder.backbone.blocks,
                self.target_encoder.backbone.blocks,
                self.predictor.backbone.predictor_blocks,
            ):
                for block in blocks:
                    block.compile(dynamic=False)


def load_reference(ref_dir: str, patch_sdp_kernel: bool) -> dict:
    """jepa's model classes from ref_dir/src (its imports: torch and numpy only)."""
    path = (
        ref_dir
        if os.path.isabs(ref_dir)
        else next(
            (
                p
                for p in (os.path.abspath(ref_dir), os.path.join(ROOT, ref_dir))
                if os.path.isdir(p)
            ),
            ref_dir,
        )
    )
    if not os.path.isdir(os.path.join(path, "src", "models")):
        raise SystemExit(
            f"--ref_dir {ref_dir}: no src/models there; extract facebookresearch/jepa's src/"
            " into it"
        )
    sys.path.insert(0, path)
    from src.masks.utils import apply_masks
    from src.models.predictor import VisionTransformerPredictor
    from src.models.utils.multimask import MultiMaskWrapper, PredictorMultiMaskWrapper
    from src.models.vision_transformer import VisionTransformer

    if patch_sdp_kernel:
        # its Attention wraps SDPA in the deprecated torch.backends.cuda.sdp_kernel() with every
        # backend enabled, which selects as no context would: a null context changes no kernel, only
        # the Python around it
        import src.models.utils.modules as modules

        modules.torch = _TorchWithoutSdpKernel()
    commit_file = os.path.join(path, "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    return {
        "VisionTransformer": VisionTransformer,
        "VisionTransformerPredictor": VisionTransformerPredictor,
        "MultiMaskWrapper": MultiMaskWrapper,
        "PredictorMultiMaskWrapper": PredictorMultiMaskWrapper,
        "apply_masks": apply_masks,
        "dir": path,
        "commit": commit,
    }


class _TorchWithoutSdpKernel:
    """torch, seen from the reference's modules.py, with backends.cuda.sdp_kernel a null context."""

    class _Backends:
        class _Cuda:
            @staticmethod
            def sdp_kernel(*args, **kwargs):
                return contextlib.nullcontext()

        cuda = _Cuda()

    backends = _Backends()

    def __getattr__(self, name):
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, dtype, n=None, iters=10, trials=5) -> dict:
    """FLOP/s of an n^3 matmul in dtype (8192 on CUDA, timed with CUDA events; 1024 on CPU): the
    best of `trials` batches of `iters`."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        c = a @ b
    sync(device)
    rates = []
    for _ in range(trials):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                c = a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(iters):
                c = a @ b
            seconds = time.perf_counter() - t
        rates.append(2 * n**3 * iters / seconds)
    del a, b, c
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "flops": max(rates), "trials": rates}


def timed_update(arm, device, own_resident: int = 0) -> dict:
    """One update of arm, synchronized: wall seconds, and on CUDA its peak: max_memory_allocated
    after a reset, less what was allocated before the update that is not this arm's resident state
    (the other arm's, the inputs)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    arm.update()
    sync(device)
    out = {"s": time.perf_counter() - start}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        out.update(
            peak_bytes=peak - before + own_resident,
            peak_bytes_process=peak,
            update_adds_bytes=peak - before,
        )
    return out


def run_phase(
    arms, device, warmup: int, rounds: int, per_round: int, compiled: bool, style: str = "parts"
) -> dict:
    """Warm each arm up (compiled: the first update compiles), then `rounds` rounds of `per_round`
    updates of each arm in turn (A, B, A, B ...). Per arm: median, min, max time, the first update,
    peak memory, the last loss."""
    results = {}
    # the compiler's one-time start (imports, worker pool) charged to neither arm's compile time
    if compiled:
        torch.compile(lambda x: torch.sin(x) + 1, dynamic=False)(torch.randn(64, device=device))
        sync(device)
    for arm in arms:
        if compiled:
            arm.compile(style)
        first = timed_update(arm, device)
        for _ in range(warmup - 1):
            timed_update(arm, device)
        results[arm.name] = {"first_update_s": first["s"], "times_s": [], "peaks": []}
        print(
            f"  {arm.name}: first update {first['s']:.2f} s{' (compiles)' if compiled else ''}",
            flush=True,
        )
    resident = {arm.name: arm.resident_bytes() for arm in arms} if device.type == "cuda" else {}
    for _ in range(rounds):
        for arm in arms:
            for _ in range(per_round):
                t = timed_update(arm, device, resident.get(arm.name, 0))
                results[arm.name]["times_s"].append(t["s"])
                results[arm.name]["peaks"].append(t)
    for arm in arms:
        r = results[arm.name]
        times, peaks = r.pop("times_s"), r.pop("peaks")
        median = statistics.median(times)
        r.update(
            median_s=median,
            min_s=min(times),
            max_s=max(times),
            times_s=times,
            loss=float(arm.last_loss.float().cpu()),
            resident_bytes=resident.get(arm.name),
        )
        if compiled:
            r["compile_s"] = r["first_update_s"] - median
        if device.type == "cuda":
            r["peak_bytes"] = max(p["peak_bytes"] for p in peaks)
            r["peak_bytes_process"] = max(p["peak_bytes_process"] for p in peaks)
            r["update_adds_bytes"] = max(p["update_adds_bytes"] for p in peaks)
    return results


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def environment(device, ref) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "octjepa_commit": git("rev-parse", "HEAD") or None,
        "octjepa_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "reference_dir": ref["dir"],
        "reference_commit": ref["commit"],
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def run_size(size, args, extra_flags, device, ref, report, write):
    cfg = octjepa_config(size, extra_flags if size == "vitl" else [])
    bf16 = cfg.use_bf16 and not args.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    amp = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16)
    context, target, mask_source = make_masks(cfg, args.batch, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    volume = torch.randn(args.batch, 1, *cfg.image_size, generator=gen)
    batch = tuple(t.to(device) for t in (volume, context, target))
    hp = dict(lr=cfg.base_lr, wd=cfg.weight_decay, ema=cfg.ema_base, clip=args.clip)
    start = time.perf_counter()
    # weights initialised where they live: seconds on a GPU, a minute for ViT-L on a CPU
    with torch.device(device):
        torch.manual_seed(args.seed)
        arms = [OctjepaArm(cfg, batch, amp, **hp)]
        torch.manual_seed(args.seed)
        arms.append(ReferenceArm(cfg, batch, amp, ref=ref, **hp))
    print(f"built both models in {time.perf_counter() - start:.1f} s", flush=True)
    flops, flops_source = flops_per_sample(cfg)
    ref_flops, _ = flops_per_sample(reference_flops_config(cfg))
    n_context, n_target = cfg.token_counts()
    entry = {
        "config": SIZES[size],
        "extra_flags": extra_flags if size == "vitl" else [],
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "tokens": cfg.num_tokens(),
        "context_tokens": int(context.shape[-1]),
        "target_tokens": int(target.shape[-1]),
        "config_token_counts": [n_context, n_target],
        "mask_sets": 1 if context.dim() == 2 else context.shape[1],
        "mask_source": mask_source,
        "batch": args.batch,
        "autocast": "bf16" if bf16 else "off (fp32)",
        "equal_architecture": equal_architecture(cfg),
        "trainable_params": {a.name: a.trainable() for a in arms},
        "model_flops_per_sample": {"octjepa": flops, "reference": ref_flops},
        "flops_source": flops_source,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "phases": {},
    }
    report["sizes"][size] = entry
    print(
        f"\n== {size}: {SIZES[size]} {' '.join(entry['extra_flags'])}, volume {cfg.image_size},"
        f" tubelet {cfg.patch_size}, {cfg.num_tokens()} tokens ({entry['context_tokens']} context,"
        f" {entry['target_tokens']} target), batch {args.batch}, autocast {entry['autocast']};"
        f" trainable params {entry['trainable_params']}",
        flush=True,
    )
    compiled = "compiled" if args.compile_style == "parts" else "compiled_blocks"
    phases = ["eager"] + (
        [compiled] if args.compile == "both" and (size == "vitl" or args.compile_all_sizes) else []
    )
    for phase in phases:
        print(f"-- {phase}", flush=True)
        results = run_phase(
            arms,
            device,
            args.warmup,
            args.rounds,
            args.per_round,
            phase != "eager",
            args.compile_style,
        )
        for name, r in results.items():
            f = entry["model_flops_per_sample"][name] * args.batch
            r["achieved_flops"] = f / r["median_s"]
        entry["phases"][phase] = results
        o, r = results["octjepa"], results["reference"]
        print(
            f"  octjepa {o['median_s'] * 1e3:.1f} ms, reference {r['median_s'] * 1e3:.1f} ms, "
            f"ratio {o['median_s'] / r['median_s']:.3f}",
            flush=True,
        )
        write()
    del arms, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib(b):
    return "-" if b is None else f"{b / 2**30:.2f}"


def table(report) -> str:
    peaks = report["matmul_peak"]
    lines = [
        "",
        (
            "octjepa vs facebookresearch/jepa"
            f" ({report['environment'].get('gpu', report['environment']['device'])}, torch"
            f" {report['environment']['torch']}; medians of {report['rounds']} rounds x"
            f" {report['per_round']})"
        ),
        (
            "| size | phase | octjepa ms | reference ms | octjepa / reference | peak GiB octjepa /"
            " reference | TFLOP/s octjepa / reference | share of matmul peak | compile s |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size, e in report["sizes"].items():
        peak = peaks.get(e.get("matmul_dtype", "bfloat16"), {}).get("flops")
        for phase, res in e["phases"].items():
            o, r = res["octjepa"], res["reference"]
            share = (
                f"{100 * o['achieved_flops'] / peak:.1f}% / {100 * r['achieved_flops'] / peak:.1f}%"
                if peak
                else "-"
            )
            comp = f"{o['compile_s']:.0f} / {r['compile_s']:.0f}" if "compile_s" in o else ""
            lines.append(
                f"| {size}{'' if e['equal_architecture'] else ' (NOT equal arch.)'} | {phase} | "
                f"{o['median_s'] * 1e3:.1f} ({o['min_s'] * 1e3:.1f}-{o['max_s'] * 1e3:.1f}) | "
                f"{r['median_s'] * 1e3:.1f} ({r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}) | "
                f"{o['median_s'] / r['median_s']:.3f} | {gib(o.get('peak_bytes'))} / "
                f"{gib(r.get('peak_bytes'))} | {o['achieved_flops'] / 1e12:.3g} / "
                f"{r['achieved_flops'] / 1e12:.3g} | {share} | {comp} |"
            )
    for dtype, p in peaks.items():
        lines.append(
            f"matmul peak {dtype} {p['n']}^3: {p['flops'] / 1e12:.3g} TFLOP/s (best of the runs at"
            " start and end)"
        )
    for size, e in report["sizes"].items():
        lines.append(
            f"{size}: model FLOPs/sample {e['model_flops_per_sample']['octjepa'] / 1e12:.3f} T"
            f" ({e['flops_source']}), trainable params octjepa {e['trainable_params']['octjepa']:,}"
            f" / reference {e['trainable_params']['reference']:,}, masks: {e['mask_source']}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:  # octjepa config flags for the ViT-L size
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ref_dir",
        default=".ref/jepa",
        help="holds facebookresearch/jepa's src/ (default .ref/jepa)",
    )
    p.add_argument(
        "--sizes",
        default="vitl",
        help="comma list of vitl (pretrain_vitl.yaml), demo (demo.yaml: fp32, eager); default vitl",
    )
    p.add_argument(
        "--compile",
        choices=("none", "both"),
        default="none",
        help=(
            "both: after eager, compile both arms and time them again (ViT-L only unless "
            "--compile_all_sizes); about 2 x 2 min on an H100 at ViT-L"
        ),
    )
    p.add_argument("--compile_all_sizes", action="store_true", help="compile the demo size too")
    p.add_argument(
        "--compile_style",
        choices=("parts", "blocks"),
        default="parts",
        help=(
            "parts (default): octjepa's compile_parts() and the reference's three modules whole;"
            " blocks: every transformer block compiled on its own in both arms (regional"
            " compilation: one graph per block shape, a fraction of the compile time; octjepa's"
            " loss stays eager)"
        ),
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 8; --smoke 2)"
    )
    p.add_argument(
        "--per_round", type=int, default=1, help="updates of each arm per round (default 1)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed updates per arm and phase (default 3; smoke 1)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clip",
        action="store_true",
        help=(
            "add each arm's grad clipping (octjepa: grad_clip over all; "
            "reference: 10.0, encoder and predictor apart)"
        ),
    )
    p.add_argument(
        "--fp32", action="store_true", help="no bf16 autocast even where the config has use_bf16"
    )
    p.add_argument(
        "--ref_sdp_kernel",
        choices=("as_is", "null"),
        default="null",
        help=(
            "null (default): the reference's deprecated torch.backends.cuda.sdp_kernel() context"
            " (every backend enabled: the same kernels as without it) becomes a null context; as_is"
            " keeps it, and torch.compile then breaks the reference's graphs at every attention (2"
            " per block)"
        ),
    )
    p.add_argument(
        "--cudnn_benchmark",
        action="store_true",
        help=(
            "torch.backends.cudnn.benchmark = True for both arms (jepa's train.py sets it; octjepa"
            " not)"
        ),
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, demo size, 2 rounds, 1 warm-up: an end-to-end check",
    )
    p.add_argument("--json", default=None, help="default: $OUT/reference.json when OUT is set")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.sizes = args.device or "cpu", "demo"
    args.rounds = args.rounds or (2 if args.smoke else 8)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"--sizes: {bad} not among {list(SIZES)}")
    ref = load_reference(args.ref_dir, args.ref_sdp_kernel == "null")
    json_path = args.json or (
        os.path.join(os.environ["OUT"], "reference.json") if os.environ.get("OUT") else None
    )
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(device, ref),
        "args": vars(args),
        "octjepa_flags": extra,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "matmul_peak": {},
        "sizes": {},
    }

    def write():
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)

    def measure_peak(dtype):
        key = str(dtype).replace("torch.", "")
        m = matmul_peak(device, dtype)
        old = report["matmul_peak"].get(key)
        if old is None or m["flops"] > old["flops"]:
            report["matmul_peak"][key] = {**m, "runs": (old or {}).get("runs", []) + [m["flops"]]}
        else:
            old["runs"].append(m["flops"])

    dtypes = sorted(
        {
            (
                torch.bfloat16
                if octjepa_config(s, extra if s == "vitl" else []).use_bf16 and not args.fp32
                else torch.float32
            )
            for s in sizes
        },
        key=str,
    )
    print(
        f"device {device} {report['environment'].get('gpu', '')}, torch {torch.__version__},"
        f" reference {ref['dir']} ({ref['commit'] or 'commit unknown'})",
        flush=True,
    )
    start = time.perf_counter()
    for dtype in dtypes:
        measure_peak(dtype)
    for size in sizes:
        run_size(size, args, extra, device, ref, report, write)
    for dtype in dtypes:
        measure_peak(dtype)
    report["wall_s"] = time.perf_counter() - start
    write()
    print(table(report))
    print(f"wall {report['wall_s']:.0f} s" + (f"; wrote {json_path}" if json_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
