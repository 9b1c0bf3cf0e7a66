"""Where the training update runs and what survives it: devices, processes, SPMD/DDP setup, sharding (FSDP2 and
XLA SPMD), the signals that stop a run, the collectives every process (DDP rank or XLA host) decides with,
host<->device transfers, XLA counters, and checkpoints (files on local disk or gs:// through storage.py, their
content, the timeline a resume continues, restore).

train.py runs the loop on these; probe.py and bench.py use them without importing the loop. Nothing here knows
the model or the loss (sharding asks the model for its shard_units()).
"""
import atexit
import contextlib
import gc
import hashlib
import io
import json
import math
import os
import random
import re
import signal
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from config import Config, ConfigError, ExitError, RunPlan, StorageFailed, plan_run
from storage import (copy_atomic, exists, glob_paths, is_transient, open_atomic, read_bytes, remove, remove_stale_tmp,
                     rename, retry, storage_errors, write_atomic)


# ----------------------------------------------------------------------------------------------------------
# Devices and processes
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Runtime:
    """The devices and processes of this run, as setup_runtime found them."""
    device: torch.device
    kind: str  # cpu | cuda | xla
    world_size: int  # data-parallel replicas (DDP processes, or the XLA devices of every host)
    process_index: int  # DDP rank, or XLA host
    process_count: int  # DDP processes, or XLA hosts (one process each)
    local_replicas: int  # replicas fed by this process (XLA SPMD: its devices; DDP: 1)
    mesh: object = None  # XLA SPMD: device mesh ('data', 'fsdp'); FSDP2: torch DeviceMesh of the sharded processes
    multi_host: bool = False  # processes on more than one machine (they share no local disk)
    fsdp_size: int = 1  # devices one copy of the weights is sharded over (1: every device holds all of it)
    group: object = None  # the gloo process group of the collectives below; None: the default group (or none)

    @property
    def is_master(self) -> bool:
        """The process that writes logs and checkpoints."""
        return self.process_index == 0

    @property
    def ddp(self) -> bool:
        """Several torch.distributed processes (DDP, or FSDP2 when sharded): a process group joins them."""
        return self.kind != "xla" and self.world_size > 1

    @property
    def sharded(self) -> bool:
        """Weights, gradients, AdamW state and the EMA target are split over devices (shard: fsdp)."""
        return self.fsdp_size > 1


def setup_runtime(cfg: Config) -> Runtime:
    """Pick the device (device_kind) and join the process group if any."""
    kind = device_kind(cfg)
    if kind == "xla":
        return _setup_xla(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    fsdp, mesh, group = sharding_size(cfg, world), None, None
    if world > 1:
        torch.distributed.init_process_group("nccl" if kind == "cuda" else "gloo")
        mesh = fsdp_mesh(kind, world, fsdp)
        atexit.register(leave_process_group, mesh)
        if kind == "cuda":  # NCCL carries the gradients; the host-side collectives need no GPU
            group = torch.distributed.new_group(backend="gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: processes on this machine
    return Runtime(device, kind, world, rank, world, 1, mesh, local_world < world, fsdp, group)


def device_kind(cfg: Config, xla: bool = True) -> str:
    """cpu | cuda | xla: cfg.device, where auto is xla if configured (and `xla` allows it), else cuda if torch sees
    a GPU, else cpu. ConfigError for cuda without a CUDA device."""
    kind = cfg.device
    if kind == "auto":
        kind = "xla" if xla and _xla_configured() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but torch sees no CUDA device; use --device cpu or auto.")
    return kind


def leave_process_group(mesh) -> None:
    """Leave the DDP or FSDP2 process group while the interpreter is still whole (setup_runtime registers this to
    run at exit, with FSDP2's device mesh or None). Gloo's worker threads free a finished collective's tensors,
    which needs the GIL: left to interpreter teardown, a thread still doing so aborts the process (SIGABRT,
    "terminate called without an active exception"), and torchrun reports that signal instead of the exit code the
    run chose. The collection first frees the DDP wrapper, so the process group's last owner is torch's own, which
    waits for those threads without the GIL."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()
        if mesh is not None:  # DTensor's caches keep the mesh alive to the end, and the mesh its process groups
            mesh._pg_registry.clear()


def _xla_configured() -> bool:
    if not os.environ.get("PJRT_DEVICE"):
        return False
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def _setup_xla(cfg: Config) -> Runtime:
    """SPMD: this process drives all of its host's devices; one ('data', 'fsdp') mesh spans every device of every
    host (one CPU device, CPU_NUM_DEVICES CPU devices, a TPU VM or all hosts of a pod). The batch is split over both
    axes; the weights over 'fsdp' (shard: fsdp, of size fsdp_size) or not at all ('fsdp' of size 1). With several hosts
    a gloo process group joins them (one process each) for the collectives below: host 0's address comes from the
    TPU metadata (torch_xla's xla:// rendezvous), or from MASTER_ADDR/MASTER_PORT.

    The host index and count are PJRT's (xr.process_index(), xr.process_count()). PJRT's CPU client spans one
    process, so hosts simulated on one machine (tests/test_xla.py: one process per host, each with its own CPU
    device) are named as torchrun names processes: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// rendezvous)
        import torch_xla.runtime as xr
    except ImportError as e:
        raise ConfigError(f"device: xla needs torch_xla ({e}); install requirements-xla.txt or use --device cpu.")
    xr.use_spmd()  # before any XLA tensor exists
    host, hosts, rendezvous = xr.process_index(), xr.process_count(), "xla://"
    if hosts == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        host, hosts, rendezvous = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    devices, local = xr.global_runtime_device_count(), xr.addressable_runtime_device_count()
    fsdp = sharding_size(cfg, devices)
    if hosts > 1 and local % fsdp:
        raise ConfigError(f"fsdp_size: {fsdp} spans several hosts; host 0 writes checkpoints from the shards on its "
                          f"own devices, so one copy of the weights must lie within a host: use an fsdp_size that "
                          f"divides the {local} devices of a host (e.g. --fsdp_size {local}).")
    if hosts > 1:
        torch.distributed.init_process_group("gloo", init_method=rendezvous)
        atexit.register(leave_process_group, None)
    mesh = xs.Mesh(np.arange(devices), (devices // fsdp, fsdp), ("data", "fsdp"))
    return Runtime(torch_xla.device(), "xla", local * hosts, host, hosts, local, mesh, hosts > 1, fsdp)


def wrap_ddp(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model in DistributedDataParallel when several processes each hold all of it; as it is otherwise (one
    process, XLA SPMD, or sharded: FSDP2 averages the gradients over the processes itself)."""
    return DistributedDataParallel(model, broadcast_buffers=False) if rt.ddp and not rt.sharded else model


class StopSignals:
    """SIGTERM (a preemption: Kubernetes, a spot or preemptible VM, torchrun passing its own on) and SIGINT (Ctrl-C)
    turned into a request to stop at the next update boundary, while the `with` block runs; the handlers before it
    come back after it. The first signal prints a line and sets `received`; a second one stops the process at once
    (the default action), losing the updates since the last checkpoint."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: Optional[str] = None
        self.previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.write(2, f"\n{self.received}: the run stops after this update with a checkpoint; send it again to stop "
                    f"at once (losing the updates since the last checkpoint)\n".encode())


# ----------------------------------------------------------------------------------------------------------
# Collectives across processes, the same for DDP ranks and XLA hosts (host-side values, over a gloo group): what
# one process saw (a signal, a file it could not read, a failed read) every process acts on, and none is left
# waiting in a collective for one that stopped. XLA SPMD device arrays are global already.
# ----------------------------------------------------------------------------------------------------------

def gather_objects(obj, rt: Runtime) -> list:
    """[obj of process 0, obj of process 1, ...] in every process."""
    if rt.process_count == 1:
        return [obj]
    out = [None] * rt.process_count
    torch.distributed.all_gather_object(out, obj, group=rt.group)
    return out


def broadcast_from_master(obj, rt: Runtime):
    """The master's obj, in every process."""
    if rt.process_count == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=rt.group)
    return box[0]


def any_process(flags: List[bool], rt: Runtime) -> List[bool]:
    """Each flag OR-ed over every process, in one small all-reduce."""
    if rt.process_count == 1:
        return list(flags)
    values = torch.tensor(flags, dtype=torch.int32)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=rt.group)
    return [bool(v) for v in values.tolist()]


def reduce_mean(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Mean of a device tensor over DDP processes, on the device (XLA SPMD arrays are global already: returned as
    they are)."""
    if rt.ddp:
        value = value.clone()
        torch.distributed.all_reduce(value)
        value /= rt.world_size
    return value


def master_decides(rt: Runtime, fn, *args):
    """fn(*args), run by the master only; every process returns its result, or raises the ExitError it raised (so
    that no process can decide differently, and none waits for one that stopped)."""
    result = error = None
    if rt.is_master:
        try:
            result = fn(*args)
        except ExitError as e:
            error = e
    result, error = broadcast_from_master((result, error), rt)
    if error is not None:
        raise error
    return result


def probes_in_this_process(rt: Runtime) -> bool:
    """Whether this process computes the probe during pretraining: the master; on XLA every host, since an SPMD
    graph that only one host runs would leave it waiting for the others; sharded, every process (each forward
    gathers the weights from all of them)."""
    return rt.is_master or rt.kind == "xla" or rt.sharded


def check_ranks_agree(value, what: str, rt: Runtime) -> None:
    """Stop every process when they hold different `value`s (they would train on different data or weights)."""
    values = gather_objects(value, rt)
    if any(v != values[0] for v in values):
        raise RuntimeError(f"the {len(values)} processes disagree about {what}: "
                           + ", ".join(f"process {r}: {v}" for r, v in enumerate(values)))


# ----------------------------------------------------------------------------------------------------------
# Host <-> device
# ----------------------------------------------------------------------------------------------------------

def to_device(batch: dict, rt: Runtime) -> dict:
    """Tensors of a batch on the device. XLA: each host's local batch becomes its part of the global batch,
    sharded over every device of the mesh on the batch dimension (SPMD data parallel)."""
    if rt.kind != "xla":
        return {k: (v.to(rt.device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            spec = xs.ShardingSpec(rt.mesh, batch_spec(value), minibatch=True)
            (out[key],) = xm.send_cpu_data_to_device([value], rt.device, spec)
    return out


def fetch_to_host(obj, rt: Runtime):
    """A nested list/dict of device tensors as new CPU tensors (XLA: one batched transfer for all of them)."""
    if rt.kind == "xla":
        import torch_xla.core.xla_model as xm
        return xm._maybe_convert_to_cpu(obj)
    return to_cpu(obj)


def xla_counters() -> dict:
    """Cumulative XLA graph compiles and device-to-host transfers (a growing compile count after warm-up means
    something in the step changes shape or is baked in as a constant)."""
    import torch_xla.debug.metrics as met
    compiles, transfers = met.metric_data("CompileTime"), met.metric_data("TransferFromDeviceTime")
    return {"xla_compiles": compiles[0] if compiles else 0, "xla_transfers": transfers[0] if transfers else 0}


class PendingDeviceStats:
    """Per-update statistics still on the device, with host-side notes, until the host reads them. CPU/CUDA read
    them after every update (`read_every_update`); XLA only where the loop needs them anyway (log, validation,
    probe, checkpoint), all in one transfer: a read inside the step would cut the XLA graph, and the NaN guard
    decides there without the host."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.unread: List[Tuple[dict, torch.Tensor]] = []

    @property
    def read_every_update(self) -> bool:
        """Whether the host reads after every update (CPU/CUDA)."""
        return self.rt.kind != "xla"

    def add(self, stats: torch.Tensor, **notes) -> None:
        """Keep one update's 1-d stats tensor and its notes (step, LR, files...) until the next read."""
        self.unread.append((notes, stats))

    def read(self) -> List[Tuple[dict, List[float]]]:
        """(notes, stats as floats) of every update added since the last read, oldest first."""
        values = fetch_to_host([stats for _, stats in self.unread], self.rt)
        read = [(notes, v.tolist()) for (notes, _), v in zip(self.unread, values)]
        self.unread = []
        return read


def mark_step(rt: Runtime) -> None:
    """XLA: cut the traced graph here and launch it (a no-op elsewhere)."""
    if rt.kind == "xla":
        import torch_xla
        torch_xla.sync()


def to_cpu(obj):
    """A (nested) state as CPU tensors, so a checkpoint from CUDA or XLA loads anywhere. CPU tensors are not copied:
    a checkpoint is written before the next update changes them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ----------------------------------------------------------------------------------------------------------
# Sharding (shard: fsdp): weights, gradients, AdamW state and the EMA target split over the devices of the mesh's
# 'fsdp' axis; each device still computes on its own part of the batch. CPU/CUDA: FSDP2 (fully_shard; each process
# holds a DTensor shard of every parameter and gathers one of model.shard_units() at a time). XLA: SPMD annotations
# (each parameter's largest dimension split over 'fsdp', as torch_xla's FSDPv2 does; the compiler places the
# gathers). The update, the EMA (local, on matching shards), clipping (torch's norm over all shards), weight decay,
# the NaN guard and the checkpoint format are the same as unsharded.
# ----------------------------------------------------------------------------------------------------------

def sharding_size(cfg: Config, world: int) -> int:
    """Devices one copy of the weights is sharded over: 1 unless shard fsdp; then fsdp_size (None: all `world`
    devices). ConfigError when it does not divide the world size; a dry run, which shards nothing, may plan for
    more devices than it has (its report uses cfg.fsdp_size)."""
    if cfg.shard != "fsdp":
        return 1
    fsdp = cfg.fsdp_size or world
    if world % fsdp:
        if cfg.dry_run:
            return 1
        raise ConfigError(f"fsdp_size: {fsdp} does not divide the {world} devices of this run; use a divisor of "
                          f"{world} (the devices form a data x fsdp mesh), or none to shard over all of them.")
    return fsdp


def fsdp_mesh(kind: str, world: int, fsdp: int):
    """FSDP2's device mesh: ('fsdp',) over all processes, or ('data', 'fsdp') holding world / fsdp copies of the
    weights, each sharded over fsdp processes (gradients are averaged over both axes); None when not sharded."""
    if fsdp == 1:
        return None
    if fsdp == world:
        return init_device_mesh(kind, (fsdp,), mesh_dim_names=("fsdp",))
    return init_device_mesh(kind, (world // fsdp, fsdp), mesh_dim_names=("data", "fsdp"))


def place_model(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model (built on the CPU) on this process's device: whole, or sharded without a whole copy of it on any
    device. FSDP2 moves the parameters of each unit of model.shard_units(), then of the model, and keeps its shard
    of each; XLA sends every device only its shards (place_xla_shards). On XLA, grad checkpointing recomputes
    with torch_xla's checkpoint (use_xla_checkpoint)."""
    if rt.kind == "xla":
        use_xla_checkpoint(model)
    if not rt.sharded:
        return model.to(rt.device)
    if rt.kind == "xla":
        return place_xla_shards(model, rt)
    for unit in model.shard_units():
        fully_shard(unit, mesh=rt.mesh)
    # JEPAOutput.pred is a view, which FSDP2 warns about in case it is changed in place; nothing changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return fully_shard(model, mesh=rt.mesh)


def place_model_state(saved: dict, model: torch.nn.Module, rt: Runtime) -> dict:
    """A checkpoint's model state (whole CPU tensors, from any run) laid out as this run holds the model: sharded,
    each process or device gets only its shards (model.load_state_dict then copies them in place); unsharded, as
    it is (load_state_dict moves it to the device)."""
    if not rt.sharded:
        return saved
    live = model.state_dict()
    return {k: place_like(v, live[k], rt) if k in live else v for k, v in saved.items()}


def place_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, rt: Runtime) -> dict:
    """A checkpoint's AdamW state laid out like this run's parameters (place_model_state for the moments; a step
    count stays whole)."""
    if not rt.sharded:
        return saved
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    state = {i: {k: place_like(v, p, rt) if v.shape == p.shape else v for k, v in saved["state"][i].items()}
             for i, p in zip(ids, params) if i in saved["state"]}
    return {**saved, "state": state}


def place_like(value: torch.Tensor, like: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """A whole CPU tensor sharded as `like`, the live tensor it will replace: this process's DTensor shard (FSDP2)
    or an XLA array of which every device receives only its own shard."""
    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return xla_sharded(value, rt)


def state_to_host(obj, rt: Runtime):
    """A (nested) model or optimizer state as whole CPU tensors, for a checkpoint, put together from the shards one
    tensor at a time: FSDP2 gathers each (every process takes part) and only the master, which writes, keeps it
    (elsewhere the tensors are None); XLA copies each device's shard to the host (xla_whole), with no compile and
    no whole copy on a device. Not sharded: fetch_to_host."""
    if not rt.sharded:
        return fetch_to_host(obj, rt)
    if isinstance(obj, DTensor):
        whole = obj.full_tensor()
        return whole.cpu() if rt.is_master else None
    if isinstance(obj, torch.Tensor):
        return xla_whole(obj) if rt.kind == "xla" else to_cpu(obj) if rt.is_master else None
    if isinstance(obj, dict):
        return {k: state_to_host(v, rt) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_to_host(v, rt) for v in obj)
    return obj


def global_value(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (FSDP2's total grad norm) as a plain tensor; any other tensor as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def state_bytes_per_device(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime) -> dict:
    """Measured bytes of the trained weights, the EMA target and AdamW's moments on the fullest device (over every
    process and device): what sharding divides by fsdp_size."""
    trained = [p for p in model.parameters() if p.requires_grad]
    parts = {"weights": trained, "ema_target": [p for p in model.parameters() if not p.requires_grad],
             "adamw": [v for p in trained for v in optimizer.state[p].values() if v.shape == p.shape]}
    per_device = {name: sum(np.asarray(device_bytes(t, rt)) for t in tensors) for name, tensors in parts.items()}
    fullest = int(np.argmax(sum(per_device.values())))
    local = {name: int(np.asarray(b).reshape(-1)[fullest]) for name, b in per_device.items()}
    every = gather_objects(local, rt)
    return max(every, key=lambda b: sum(b.values()))


def device_bytes(t: torch.Tensor, rt: Runtime) -> List[int]:
    """Bytes of `t` on each device of this process: its FSDP2 shard, its XLA shard on each local device, or all
    of it."""
    if isinstance(t, DTensor):
        return [t.to_local().numel() * t.element_size()]
    if rt.kind == "xla" and rt.sharded:
        return xla_shard_bytes(t)
    return [t.numel() * t.element_size()]


# --- XLA: the torch_xla code of sharding and grad checkpointing ---

def fsdp_spec(t: torch.Tensor) -> tuple:
    """XLA partition spec of a sharded weight or AdamW moment: its largest dimension split over 'fsdp'."""
    spec = [None] * t.dim()
    if spec:
        spec[int(np.argmax(t.shape))] = "fsdp"
    return tuple(spec)


def batch_spec(t: torch.Tensor) -> tuple:
    """XLA partition spec of a batch-first tensor: the batch split over every device (both mesh axes)."""
    return (("data", "fsdp"),) + (None,) * (t.dim() - 1)


def xla_sharded(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """A CPU tensor as an XLA array split as fsdp_spec says (whole on the devices only until it is split, one
    tensor at a time; xm.send_cpu_data_to_device with a ShardingSpec fails on 1-d tensors in torch_xla 2.9)."""
    import torch_xla.distributed.spmd as xs
    out = value.to(rt.device)
    xs.mark_sharding(out, rt.mesh, fsdp_spec(out))
    return out


def place_xla_shards(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model on the XLA devices with every parameter sharded (xla_sharded) and each unit of model.shard_units()
    handing on activations split over the batch, as FSDP does (without it the compiler may choose to split them
    over the width instead)."""
    import torch_xla.distributed.spmd as xs
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(xla_sharded(param.detach(), rt), param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(rt.device))

    def split_over_batch(unit, args, out) -> None:
        xs.mark_sharding(out, rt.mesh, batch_spec(out))

    for unit in model.shard_units():
        unit.register_forward_hook(split_over_batch)
    return model


def use_xla_checkpoint(model: torch.nn.Module) -> None:
    """With grad checkpointing, recompute the blocks with torch_xla's checkpoint: torch's non-reentrant one fails on
    XLA (it looks for a torch.xla device module), and torch_xla's keeps the recomputation in the compiled graph."""
    import torch_xla.utils.checkpoint
    if model.grad_checkpointing:
        model.set_grad_checkpointing(True, torch_xla.utils.checkpoint.checkpoint)


def adamw_state(p: torch.Tensor, rt: Runtime) -> dict:
    """AdamW's state of parameter p before its first update: step 0 and both moments zero, on p's devices and split
    over them like p. XLA sharded: the moments split as fsdp_spec says (zeros_like alone is whole on every device,
    and the first update would compile for that layout); FSDP2: zeros_like of a DTensor has p's shards."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": torch.zeros_like(p),
             "exp_avg_sq": torch.zeros_like(p)}
    if rt.sharded and rt.kind == "xla":
        import torch_xla.distributed.spmd as xs
        for moment in (state["exp_avg"], state["exp_avg_sq"]):
            xs.mark_sharding(moment, rt.mesh, fsdp_spec(moment))
    return state


def xla_shard_bytes(t: torch.Tensor) -> List[int]:
    """Bytes of a sharded XLA array on each local device (from its shards' index ranges: nothing is transferred)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    xm.wait_device_ops()  # its data must not be in flight
    pieces = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]  # [(replica, [slice per dim])]
    return [math.prod(s.stop - s.start for s in index) * t.element_size() for _, index in pieces]


def xla_whole(t: torch.Tensor) -> torch.Tensor:
    """A (sharded) XLA array as a whole CPU tensor, assembled on the host from its local devices' shards (a transfer
    of the whole array would compile a gathering graph for every array, at every checkpoint). RuntimeError when
    this host's devices do not hold all of it."""
    import torch_xla
    if torch_xla._XLAC._get_xla_sharding_type(t) in (None, 0):  # not sharded, or replicated
        return to_cpu(t)
    whole = torch.empty(t.shape, dtype=t.dtype)
    shards = torch_xla._XLAC._get_local_shards([t])[0]  # [(CPU tensor, device)], padded at uneven ends
    filled = set()
    for (data, _), (_, index) in zip(shards, torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]):
        whole[tuple(index)] = data[tuple(slice(0, s.stop - s.start) for s in index)]
        filled.add(tuple((s.start, s.stop) for s in index))
    if sum(math.prod(stop - start for start, stop in index) for index in filled) != t.numel():
        raise RuntimeError(f"an array of shape {list(t.shape)} is not all on this host's devices")
    return whole


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: files, content, the plan a resume continues, the run folder
# ----------------------------------------------------------------------------------------------------------

def step_of(path: str) -> int:
    """The update number in a step checkpoint's name (step_0000050.pt -> 50)."""
    return int(re.search(r"step_(\d+)\.pt$", path).group(1))


def list_checkpoints(ckpt_dir: str) -> List[str]:
    """Step checkpoints in ckpt_dir, newest first (temp files of interrupted writes and set-aside files ignored)."""
    paths = [p for p in glob_paths(ckpt_dir.rstrip("/") + "/step_*.pt") if re.search(r"step_\d+\.pt$", p)]
    return sorted(paths, key=step_of, reverse=True)


class UnreadableCheckpoint(Exception):
    """A checkpoint whose content does not load: cut short, damaged, or not an octjepa checkpoint."""


def read_checkpoint(path: str, retry_seconds: float = 0.0) -> dict:
    """Load a checkpoint (local or gs://) to CPU tensors (weights_only: no code runs on load). A transient storage
    error is retried for retry_seconds, then raised; content that does not load raises UnreadableCheckpoint."""
    payload = retry(read_bytes, path, seconds=retry_seconds)
    try:
        ckpt = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise UnreadableCheckpoint(f"{path}: {e!r}"[:500]) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UnreadableCheckpoint(f"{path}: not an octjepa checkpoint (no 'model')")
    return ckpt


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    """The step checkpoint of update `step` in ckpt_dir."""
    return f"{ckpt_dir.rstrip('/')}/step_{step:07d}.pt"


def save_checkpoint(path: str, state: dict, keep_last: int, best: bool, retry_seconds: float = 0.0,
                    on_error: Optional[Callable[[Exception, float], None]] = None) -> None:
    """Stream the checkpoint into its file or object atomically (and copy it to best.pt beside it), retrying a
    transient storage error for retry_seconds (on_error is told of each); then delete the step checkpoints older than
    it beyond keep_last. Never it, nor a newer one: the newest checkpoint is always the one just written."""
    ckpt_dir = path.rsplit("/", 1)[0]
    retry(_write_checkpoint, path, state, seconds=retry_seconds, on_error=on_error)
    if best:
        retry(copy_atomic, path, f"{ckpt_dir}/best.pt", seconds=retry_seconds, on_error=on_error)
    older = [p for p in list_checkpoints(ckpt_dir) if step_of(p) < step_of(path)]
    with contextlib.suppress(*storage_errors()):  # a file left over is deleted by the next checkpoint's pass
        for old in older[keep_last - 1:]:
            remove(old)


def checkpoint_everywhere(path: str, model: torch.nn.Module, optimizer, state, plan: dict, cfg: Config, rt: Runtime,
                          best: bool, on_error: Optional[Callable[[Exception, float], None]] = None) -> Optional[str]:
    """Checkpoint the current update (`state`: train.TrainState; `plan`: the plan record) to `path`, with
    save_checkpoint's retries for ckpt_retry_minutes. The master builds the state and writes it (on XLA every host
    takes part in fetching it, and every FSDP2 process in gathering it: a sharded array needs them all); then every
    process learns how that went, so none rolls back to a file not written yet. Returns the write's last error
    (repr) or None, the same in every process."""
    error = None
    if rt.is_master or rt.kind == "xla" or rt.sharded:
        ckpt = {**checkpoint_state(model, optimizer, state, cfg, rt), "plan": plan}
    if rt.is_master:
        try:
            save_checkpoint(path, ckpt, cfg.keep_last, best, 60 * cfg.ckpt_retry_minutes, on_error)
        except storage_errors() as e:
            error = repr(e)
    return broadcast_from_master(error, rt)


def _write_checkpoint(path: str, state: dict) -> None:
    with open_atomic(path) as f:
        try:
            torch.save(state, f)
        except RuntimeError as e:  # torch's zip writer, closed after a failed write, hides the storage's error
            if isinstance(e.__context__, storage_errors()):
                raise e.__context__ from None
            raise


def rng_state() -> dict:
    """torch, numpy and python RNG states as tensors and plain types (loadable with weights_only)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
            "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss}}


def set_rng_state(state: dict) -> None:
    """Set the torch, numpy and python RNGs to a state of rng_state()."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def checkpoint_state(model: torch.nn.Module, optimizer, state, cfg: Config, rt: Runtime) -> dict:
    """Everything a resume needs (`state`: train.TrainState), as CPU tensors and plain types
    (torch.load(weights_only=True) reads it, on a machine with or without torch_xla)."""
    model_state, optimizer_state = state_to_host([model.state_dict(), optimizer.state_dict()], rt)
    for group in optimizer_state["param_groups"]:
        group["lr"] = float(group["lr"])  # a device tensor on XLA
    return {"model": model_state, "optimizer": optimizer_state, "train_state": dict(vars(state)),
            "rng": rng_state(), "config": asdict(cfg), "version": 2}


def restore(ckpt: dict, model: torch.nn.Module, optimizer, state, rt: Runtime) -> None:
    """Load weights, optimizer, schedule position, data position and RNG states from a checkpoint (written on any
    device, sharded or not: make_optimizer's load hook keeps this device's AdamW implementation flags, and a
    sharded run takes only its shards)."""
    model.load_state_dict(place_model_state(ckpt["model"], model, rt))
    optimizer.load_state_dict(place_optimizer_state(ckpt["optimizer"], optimizer, rt))
    for key, value in ckpt["train_state"].items():
        setattr(state, key, value)
    set_rng_state(ckpt["rng"])


# What a resume must find unchanged (incident 2: a changed plan restarts or jumps the schedules).
# The number of processes is not part of it: each update's global batch is the same set of volumes on any number.
PLAN_FIELDS = ("total_steps", "warmup_steps", "steps_per_epoch", "global_batch_size")
SCHEDULE_FIELDS = ("schedule", "base_lr", "min_lr", "weight_decay", "weight_decay_end", "ema_base", "ema_end",
                   "ema_schedule", "seed")


def split_fingerprint(train_ds, val_ds) -> str:
    """A short hash of which volumes are in the train split and which in the val split."""
    split = [sorted(r["paths"] for r in train_ds.records), sorted(r["paths"] for r in val_ds.records)]
    return hashlib.sha256(json.dumps(split).encode()).hexdigest()[:16]


def plan_record(cfg: Config, plan: RunPlan, train_ds, val_ds) -> dict:
    """The run's plan, schedule settings, data-order seed and train/val split, as stored in its checkpoints."""
    return {**{k: getattr(plan, k) for k in PLAN_FIELDS}, **{k: getattr(cfg, k) for k in SCHEDULE_FIELDS},
            "train_volumes": len(train_ds), "val_volumes": len(val_ds), "split": split_fingerprint(train_ds, val_ds),
            "extensions": plan.extensions}


def resumed_plan(saved: dict, cfg: Config, plan: RunPlan, train_ds, val_ds, step: int, ckpt_path: str) -> RunPlan:
    """The plan a resumed run continues: the checkpoint's, or with cfg.extend the same plan made longer from update
    `step` on. Any other difference is a ConfigError that says what changed and how to proceed."""
    reference = plan_run(replace(cfg, max_steps=saved["total_steps"]), plan.world_size, len(train_ds))
    now = plan_record(cfg, reference, train_ds, val_ds)
    changes = [f"{k}: {saved[k]} -> {now[k]}" for k in now if k != "extensions" and now[k] != saved.get(k)]
    longer = plan.total_steps > saved["total_steps"]
    if plan.total_steps != saved["total_steps"] and not (longer and cfg.extend):
        changes.insert(0, f"total_steps: {saved['total_steps']} -> {plan.total_steps}")
    if changes:
        run_dir = os.path.join(cfg.out_dir, cfg.run_name)
        raise ConfigError(
            f"resume: {ckpt_path} was written for another plan:\n    " + "\n    ".join(changes) +
            "\nA resume continues the plan it was started with (a changed plan would restart or jump the LR, EMA and "
            f"data order). To continue this run: use its settings (--config {run_dir}/config.yaml --resume auto)."
            + (" To train longer on purpose: add --extend true (the LR, weight decay and EMA continue from their "
               "last values, never back up)." if longer and not cfg.extend and len(changes) == 1 else "")
            + " To train with the new settings: start a new run (another --run_name).")
    extensions = list(saved["extensions"])
    if longer:
        rewarm = ["rewarm"] if cfg.extend_schedule == "rewarm" else []
        extensions.append([step, saved["total_steps"], plan.total_steps] + rewarm)
    return replace(reference, total_steps=plan.total_steps, extensions=extensions)


def set_aside(path: str, reason: str, why: str) -> dict:
    """Rename a step checkpoint out of the run's timeline (list_checkpoints no longer sees it; nothing is deleted):
    step_0000060.pt -> step_0000060.pt.<reason>-<time>. Returns what was done, for the console and events.jsonl."""
    moved_to = f"{path}.{reason}-{time.strftime('%Y%m%d-%H%M%S')}"
    rename(path, moved_to)
    return {"event": f"{reason}_checkpoint", "path": path, "moved_to": moved_to,
            "why": f"{why}; set aside as {moved_to}"}


def choose_resume_checkpoint(cfg: Config) -> Tuple[Optional[str], Optional[dict], List[dict]]:
    """The master's choice of what the run resumes from: (path, checkpoint), or (None, None) to start from scratch;
    plus what it did to the run's files on the way ({event, path, why}). First the tmp files of writers stopped
    mid-write go. resume auto: the newest step checkpoint that loads; each newer one whose content does not load is
    set aside ('unreadable'). Then every step checkpoint past the resumed update is set aside ('abandoned': a
    timeline left by resuming an earlier file), so neither a later `--resume auto` nor keep_last sees it. A storage
    error that outlasts ckpt_retry_minutes is StorageFailed, with nothing set aside."""
    retry_seconds = cfg.ckpt_retry_minutes * 60
    path, ckpt = None, None
    moved = [{"event": "stale_tmp_removed", "path": tmp, "why": "left by a writer stopped mid-write: removed"}
             for folder in {os.path.join(cfg.out_dir, cfg.run_name), cfg.ckpt_dir} - {None}
             for tmp in remove_stale_tmp(folder)]
    try:
        if cfg.resume == "auto":
            for candidate in list_checkpoints(cfg.ckpt_dir):
                try:
                    ckpt = read_checkpoint(candidate, retry_seconds)
                except UnreadableCheckpoint as e:
                    moved.append(set_aside(candidate, "unreadable", str(e)))
                    continue
                path = candidate
                break
        elif cfg.resume is not None:
            path = cfg.resume
            ckpt = read_checkpoint(path, retry_seconds)
        step = ckpt["train_state"]["step"] if ckpt is not None else 0
        for later in list_checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir is not None else []:
            if step_of(later) > step and later != path:
                moved.append(set_aside(later, "abandoned", f"past update {step}, where this run resumes"))
    except FileNotFoundError as e:
        raise ConfigError(f"resume: {cfg.resume} is not a checkpoint file ({e}); give the path of a step_*.pt or "
                          f"best.pt, or auto.") from None
    except UnreadableCheckpoint as e:
        raise ConfigError(f"resume: {e}; choose another checkpoint (or auto: the newest that loads).") from None
    except storage_errors() as e:
        raise StorageFailed(f"resume: the checkpoints in {cfg.ckpt_dir or cfg.resume} could not be read for "
                            f"{cfg.ckpt_retry_minutes:g} min ({e!r}); nothing was changed: run the same command "
                            f"again when the storage is back.") from None
    return path, ckpt, moved


def load_resume_checkpoint(cfg: Config, rt: Runtime) -> Tuple[Optional[str], Optional[dict], List[dict]]:
    """(path, checkpoint) that this run resumes from, or (None, None); plus what the master did to the run's files
    (choose_resume_checkpoint). The master chooses
    (choose_resume_checkpoint); every process loads that same file, retrying transient read errors for
    ckpt_retry_minutes, or every process stops with StorageFailed."""
    path = ckpt = error = None
    moved = []
    if rt.is_master:
        try:
            path, ckpt, moved = choose_resume_checkpoint(cfg)
        except ExitError as e:
            error = e
    path, moved, error = broadcast_from_master((path, moved, error), rt)
    if error is not None:
        raise error
    if path is not None and ckpt is None:
        try:
            ckpt = read_checkpoint(path, cfg.ckpt_retry_minutes * 60)
        except (UnreadableCheckpoint, *storage_errors()) as e:
            error = repr(e)
    failed = [f"process {rank}: {e}" for rank, e in enumerate(gather_objects(error, rt)) if e is not None]
    if failed:
        raise StorageFailed(f"resume: {path} could not be read ({'; '.join(failed)}). Every process must start from "
                            f"the same checkpoint, so none trains; run the same command again when the storage is "
                            f"back.")
    return path, ckpt, moved


def resolve_run_dir(cfg: Config) -> Config:
    """Fill run_name and ckpt_dir 'auto'; refuse to overwrite checkpoints of an earlier run by accident."""
    if cfg.resume == "auto" and cfg.run_name is None:
        raise ConfigError("resume: 'auto' continues the run named by --run_name; give --run_name.")
    run_name = cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    ckpt_dir = os.path.join(cfg.out_dir, run_name, "checkpoints") if cfg.ckpt_dir == "auto" else cfg.ckpt_dir
    cfg = replace(cfg, run_name=run_name, ckpt_dir=ckpt_dir)
    if cfg.resume == "auto" and ckpt_dir is None:
        raise ConfigError("resume: 'auto' needs checkpoints, but ckpt_dir is null.")
    if cfg.resume is None and ckpt_dir is not None and not cfg.dry_run and list_checkpoints(ckpt_dir):
        raise ConfigError(f"run_name: {ckpt_dir} already holds checkpoints of an earlier run; pass --resume auto "
                          f"to continue it or choose another --run_name.")
    return cfg


def check_checkpoint_folder(cfg: Config, rt: Runtime) -> None:
    """Before anything trains: the master writes a small file into ckpt_dir and deletes it again. A folder that
    cannot take it (read-only, no permission, a wrong path) is a ConfigError naming it; a storage error that outlasts
    ckpt_retry_minutes is StorageFailed. Every process of a multi-machine run must resume from the same files:
    ckpt_dir on gs://, or a local path declared shared with ckpt_dir_shared, where every process must see that file."""
    if cfg.ckpt_dir is None or cfg.dry_run:  # a dry run writes nothing
        return
    shared = rt.multi_host and not cfg.ckpt_dir.startswith("gs://")
    if shared and not cfg.ckpt_dir_shared:
        raise ConfigError(f"ckpt_dir: {cfg.ckpt_dir} is local to each machine, but the processes of this run are on "
                          f"several machines and must all resume from the same checkpoint; use a gs:// ckpt_dir, or "
                          f"add --ckpt_dir_shared true if every machine mounts it.")
    probe = master_decides(rt, write_probe, cfg)
    blind = [rank for rank, seen in enumerate(gather_objects(exists(probe), rt)) if not seen] if shared else []
    if rt.is_master:
        retry(remove, probe, seconds=cfg.ckpt_retry_minutes * 60)
    if blind:
        raise ConfigError(f"ckpt_dir_shared: processes {blind} cannot see {probe}, written by process 0: "
                          f"{cfg.ckpt_dir} is not shared by every machine; use a gs:// ckpt_dir or a filesystem that "
                          f"all of them mount.")


def write_probe(cfg: Config) -> str:
    """A small file with a unique name in ckpt_dir (created if missing); its path. ConfigError when the folder
    cannot take it, StorageFailed when the storage stayed unreachable for ckpt_retry_minutes."""
    probe = f"{cfg.ckpt_dir.rstrip('/')}/.write-probe-{uuid.uuid4().hex}"
    try:
        retry(write_atomic, probe, b"octjepa", seconds=cfg.ckpt_retry_minutes * 60)
    except storage_errors() as e:
        if is_transient(e):
            raise StorageFailed(f"ckpt_dir: {cfg.ckpt_dir} could not be written for {cfg.ckpt_retry_minutes:g} "
                                f"min ({e!r}); run the same command again when the storage is back.") from None
        raise ConfigError(f"ckpt_dir: cannot write checkpoints to {cfg.ckpt_dir} ({e!r}); make it writable, or "
                          f"choose another --ckpt_dir (none: no checkpoints).") from None
    return probe
