"""Where the training update runs: devices, processes, SPMD/DDP setup, sharding (FSDP2 and XLA
SPMD), the signals that stop a run, the collectives every process (DDP rank or XLA host) decides
with, host<->device transfers and XLA counters. Checkpoints and the run folder are checkpoint.py's.

train.py runs the loop on these; probe.py and bench.py use them without importing the loop. Nothing
here knows the model or the loss (sharding asks the model for its shard_units()).
"""

import atexit
import contextlib
import ctypes
import functools
import gc
import math
import os
import signal
import threading
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

# Imported here, before any process group exists: imported after init_process_group (as
# torch._dynamo would, at the first optimizer), it keeps gloo's worker threads alive past
# leave_process_group (tests/test_resume.py, exit_report).
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from config import Config, ConfigError, ExitError

# --------------------------------------------------------------------------------------------------
# Devices and processes
# --------------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """The devices and processes of this run, as setup_runtime found them."""

    device: torch.device
    kind: str  # cpu | cuda | xla
    world_size: int  # data-parallel replicas (DDP processes, or the XLA devices of every host)
    process_index: int  # DDP rank, or XLA host
    process_count: int  # DDP processes, or XLA hosts (one process each)
    local_replicas: int  # replicas fed by this process (XLA SPMD: its devices; DDP: 1)
    # XLA SPMD: device mesh ('data', 'fsdp'); FSDP2: torch DeviceMesh of the sharded processes
    mesh: object = None
    multi_host: bool = False  # processes on more than one machine (they share no local disk)
    # devices one copy of the weights is sharded over (1: every device holds all of it)
    fsdp_size: int = 1
    # the gloo process group of the collectives below; None: the default group (or none)
    group: object = None

    @property
    def is_master(self) -> bool:
        """The process that writes logs and checkpoints."""
        return self.process_index == 0

    @property
    def ddp(self) -> bool:
        """Several torch.distributed processes (DDP, or FSDP2 when sharded): a process group joins
        them."""
        return self.kind != "xla" and self.world_size > 1

    @property
    def sharded(self) -> bool:
        """Weights, gradients, AdamW state and the EMA target are split over devices (shard:
        fsdp)."""
        return self.fsdp_size > 1

    # What the update does differently on each device, decided here once: train.py asks these and
    # branches on no device kind. XLA traces the whole update into one compiled graph, so nothing in
    # it may read the host or bake a changing Python number in as a constant.
    def autocast(self, bf16: bool):
        """The autocast context of a forward pass on this device: bfloat16 where `bf16`, else
        off."""
        return torch.autocast(self.kind, dtype=torch.bfloat16, enabled=bf16)

    @property
    def adamw_options(self) -> dict:
        """torch.optim.AdamW's implementation here: fused on CPU and CUDA (one pass over every
        parameter, and it can skip itself: found_inf); capturable on XLA (lr and the step count stay
        on the device)."""
        xla = self.kind == "xla"
        return {
            "capturable": xla,
            "foreach": False if xla else None,
            "fused": None if xla else True,
        }

    def update_scalars(self, *values: float) -> tuple:
        """The hyperparameters of one update as the update takes them: floats, or on XLA one 1-d
        device tensor's elements (a float or a 0-d tensor would be a graph constant there: a new
        graph per value)."""
        if self.kind != "xla":
            return values
        return torch.tensor(values, dtype=torch.float32).to(self.device).unbind()

    @property
    def replicas_per_forward(self) -> int:
        """Replicas that take part in every forward pass: all of them on XLA (one SPMD program),
        else 1."""
        return self.world_size if self.kind == "xla" else 1

    def compiler_counters(self) -> dict:
        """XLA's cumulative graph compiles and device-to-host transfers (xla_counters); nothing
        elsewhere."""
        return xla_counters() if self.kind == "xla" else {}


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
    device = (
        torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    )
    # torchrun: processes on this machine
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Runtime(device, kind, world, rank, world, 1, mesh, local_world < world, fsdp, group)


def device_kind(cfg: Config, xla: bool = True) -> str:
    """cpu | cuda | xla: cfg.device, where auto is xla if configured (and `xla` allows it), else
    cuda if torch sees a GPU, else cpu. ConfigError for cuda without a CUDA device."""
    kind = cfg.device
    if kind == "auto":
        kind = (
            "xla" if xla and _xla_configured() else "cuda" if torch.cuda.is_available() else "cpu"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device: cuda was asked for but torch sees no CUDA device; use --device cpu or auto."
        )
    return kind


def probe_device(cfg: Config) -> torch.device:
    """Where the commands that use a trained encoder run (probe.py, encoder.py, finetune.py): cuda
    when cfg.device is auto or cuda and a GPU is there, else cpu (device_kind without xla);
    ConfigError for xla."""
    if cfg.device == "xla":
        raise ConfigError(
            "device: probe.py, encoder.py and finetune.py run on cpu or cuda; use --device cpu or"
            " auto."
        )
    return torch.device(device_kind(cfg, xla=False))


def leave_process_group(mesh) -> None:
    """Leave the DDP or FSDP2 process group while the interpreter is still whole (setup_runtime
    registers this to run at exit, with FSDP2's device mesh or None). Gloo's worker threads free a
    finished collective's tensors, which needs the GIL: left to interpreter teardown, a thread still
    doing so aborts the process (SIGABRT, "terminate called without an active exception"), and
    torchrun reports that signal instead of the exit code the run chose. The collection first frees
    the DDP wrapper, so the process group's last owner is torch's own, which waits for those threads
    without the GIL."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()
        # DTensor's caches keep the mesh alive to the end, and the mesh its process groups
        if mesh is not None:
            mesh._pg_registry.clear()


@functools.cache
def xla_modules() -> SimpleNamespace:
    """torch_xla and the parts of it used here, imported on first use, the one place that imports
    it: torch_xla, xm (core.xla_model), xs (distributed.spmd), xr (runtime), metrics
    (debug.metrics), checkpoint (utils.checkpoint's). ImportError without torch_xla: a CPU or CUDA
    machine imports this module without it."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as metrics
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// rendezvous)
    import torch_xla.runtime as xr
    import torch_xla.utils.checkpoint

    return SimpleNamespace(
        torch_xla=torch_xla,
        xm=xm,
        xs=xs,
        xr=xr,
        metrics=metrics,
        checkpoint=torch_xla.utils.checkpoint.checkpoint,
    )


def _xla_configured() -> bool:
    if not os.environ.get("PJRT_DEVICE"):
        return False
    try:
        xla_modules()
    except ImportError:
        return False
    return True


def _setup_xla(cfg: Config) -> Runtime:
    """SPMD: this process drives all of its host's devices; one ('data', 'fsdp') mesh spans every
    device of every host (one CPU device, CPU_NUM_DEVICES CPU devices, a TPU VM or all hosts of a
    pod). The batch is split over both axes; the weights over 'fsdp' (shard: fsdp, of size
    fsdp_size) or not at all ('fsdp' of size 1). With several hosts a gloo process group joins them
    (one process each) for the collectives below: host 0's address comes from the TPU metadata
    (torch_xla's xla:// rendezvous), or from MASTER_ADDR/MASTER_PORT.

    The host index and count are PJRT's (xr.process_index(), xr.process_count()). PJRT's CPU client
    spans one process, so hosts simulated on one machine (tests/test_xla.py: one process per host,
    each with its own CPU device) are named as torchrun names processes: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT."""
    try:
        xs, xr, torch_xla = xla_modules().xs, xla_modules().xr, xla_modules().torch_xla
    except ImportError as e:
        raise ConfigError(
            f"device: xla needs torch_xla ({e}); install requirements-xla.txt or use --device cpu."
        )
    xr.use_spmd()  # before any XLA tensor exists
    host, hosts, rendezvous = xr.process_index(), xr.process_count(), "xla://"
    if hosts == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        host, hosts, rendezvous = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    devices, local = xr.global_runtime_device_count(), xr.addressable_runtime_device_count()
    fsdp = sharding_size(cfg, devices)
    if hosts > 1 and local % fsdp:
        raise ConfigError(
            f"fsdp_size: {fsdp} spans several hosts; host 0 writes checkpoints from the shards on"
            " its own devices, so one copy of the weights must lie within a host: use an fsdp_size"
            f" that divides the {local} devices of a host (e.g. --fsdp_size {local})."
        )
    if hosts > 1:
        torch.distributed.init_process_group("gloo", init_method=rendezvous)
        atexit.register(leave_process_group, None)
    mesh = xs.Mesh(np.arange(devices), (devices // fsdp, fsdp), ("data", "fsdp"))
    return Runtime(
        torch_xla.device(), "xla", local * hosts, host, hosts, local, mesh, hosts > 1, fsdp
    )


def wrap_ddp(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model in DistributedDataParallel when several processes each hold all of it; as it is
    otherwise (one process, XLA SPMD, or sharded: FSDP2 averages the gradients over the processes
    itself)."""
    return (
        DistributedDataParallel(model, broadcast_buffers=False)
        if rt.ddp and not rt.sharded
        else model
    )


class StopSignals:
    """SIGTERM (a preemption: Kubernetes, a spot or preemptible VM, torchrun passing its own on) and
    SIGINT (Ctrl-C) turned into a request to stop at the next update boundary, while the `with`
    block runs; the handlers before it come back after it. The first signal prints a line and sets
    `received`; a second one stops the process at once (the default action), losing the updates
    since the last checkpoint."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: Optional[str] = None
        self.previous = {}
        self.interrupting = False

    @contextlib.contextmanager
    def at_once(self):
        """Within it, a stop signal (or one received before) raises StopRequested out of the code
        running, for work that has no update boundary to wait for (the end-of-run summary probe: the
        checkpoint is written). C code that calls back into Python and ignores an exception there
        crashes when the handler raises inside it (openjpeg's JPEG 2000 encoder: SIGSEGV): such code
        runs with the signals held (phantom.stop_signals_held)."""
        if self.received is not None:
            raise StopRequested(self.received)
        self.interrupting = True
        try:
            yield
        finally:
            self.interrupting = False

    def __enter__(self) -> "StopSignals":
        # Python delivers signals to the main thread only
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if self.interrupting:
            raise StopRequested(self.received)
        os.write(
            2,
            f"\n{self.received}: the run stops after this update with a checkpoint; send it again"
            " to stop at once (losing the updates since the last checkpoint)\n".encode(),
        )


class StopRequested(BaseException):
    """A stop signal inside StopSignals.at_once(): the work in progress is abandoned. A
    BaseException, like KeyboardInterrupt: raised from the signal handler wherever the code is, it
    must pass through the `except Exception` that turns any failure to read a file into an unusable
    file (dicom.py), not end up counted as one."""


# --------------------------------------------------------------------------------------------------
# Collectives across processes, the same for DDP ranks and XLA hosts (host-side values, over a gloo
# group): what one process saw (a signal, a file it could not read, a failed read) every process
# acts on, and none is left waiting in a collective for one that stopped. XLA SPMD device arrays are
# global already.
# --------------------------------------------------------------------------------------------------


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
    """Mean of a device tensor over DDP processes, on the device (XLA SPMD arrays are global
    already: returned as they are)."""
    if rt.ddp:
        value = value.clone()
        torch.distributed.all_reduce(value)
        value /= rt.world_size
    return value


def master_decides(rt: Runtime, fn, *args):
    """fn(*args), run by the master only; every process returns its result, or raises the ExitError
    it raised (so that no process can decide differently, and none waits for one that stopped)."""
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
    """Whether this process computes the probe during pretraining: the master; on XLA every host,
    since an SPMD graph that only one host runs would leave it waiting for the others; sharded,
    every process (each forward gathers the weights from all of them)."""
    return rt.is_master or rt.kind == "xla" or rt.sharded


def check_ranks_agree(value, what: str, rt: Runtime) -> None:
    """Stop every process when they hold different `value`s (they would train on different data or
    weights)."""
    values = gather_objects(value, rt)
    if any(v != values[0] for v in values):
        raise RuntimeError(
            f"the {len(values)} processes disagree about {what}: "
            + ", ".join(f"process {r}: {v}" for r, v in enumerate(values))
        )


# --------------------------------------------------------------------------------------------------
# Host <-> device
# --------------------------------------------------------------------------------------------------


def to_device(batch: dict, rt: Runtime) -> dict:
    """Tensors of a batch on the device. XLA: each host's local batch becomes its part of the global
    batch, sharded over every device of the mesh on the batch dimension (SPMD data parallel)."""
    if rt.kind != "xla":
        return {
            k: v.to(rt.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            spec = xla_modules().xs.ShardingSpec(rt.mesh, batch_spec(value), minibatch=True)
            (out[key],) = xla_modules().xm.send_cpu_data_to_device([value], rt.device, spec)
    return out


@functools.cache
def _libc():
    """glibc, when this process runs on it (None elsewhere: musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Give the heap memory freed so far back to the system. glibc keeps freed blocks of volumes and
    batches of varying sizes in its heap, so a tool that reads volume after volume grows by
    fragmentation alone (measured: embed of 256 small volumes held 777 MB at its end without it, 478
    MB with it after each batch); a no-op without glibc."""
    if _libc() is not None:
        _libc().malloc_trim(0)


def fetch_to_host(obj, rt: Runtime):
    """A nested list/dict of device tensors as new CPU tensors (XLA: one batched transfer for all of
    them)."""
    if rt.kind == "xla":
        return xla_modules().xm._maybe_convert_to_cpu(obj)
    return to_cpu(obj)


def xla_counters() -> dict:
    """Cumulative XLA graph compiles and device-to-host transfers (a growing compile count after
    warm-up means something in the step changes shape or is baked in as a constant)."""
    compiles = xla_modules().metrics.metric_data("CompileTime")
    transfers = xla_modules().metrics.metric_data("TransferFromDeviceTime")
    return {
        "xla_compiles": compiles[0] if compiles else 0,
        "xla_transfers": transfers[0] if transfers else 0,
    }


class PendingDeviceStats:
    """Per-update statistics still on the device, with host-side notes, until the host reads them.
    CPU/CUDA read them after every update (`read_every_update`); XLA only where the loop needs them
    anyway (log, validation, probe, checkpoint), all in one transfer: a read inside the step would
    cut the XLA graph, and the NaN guard decides there without the host."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.unread: List[Tuple[dict, torch.Tensor]] = []

    @property
    def read_every_update(self) -> bool:
        """Whether the host reads after every update (CPU/CUDA)."""
        return self.rt.kind != "xla"

    def add(self, stats: torch.Tensor, **notes) -> None:
        """Keep one update's 1-d stats tensor and its notes (step, LR, files...) until the next
        read."""
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
        xla_modules().torch_xla.sync()


def materialize_state(model: torch.nn.Module, rt: Runtime) -> None:
    """XLA: the weights, the EMA target and the optimizer state computed now, as every update will
    find them, so that update 1 compiles the graph that the later updates reuse (a no-op elsewhere).
    `model`: VJEPA3D."""
    if rt.kind != "xla":
        return
    # The EMA writes the target's weights in place at every update. Never written, they made update
    # 1 trace a graph of its own, and update 2 compiled the whole update a second time (the smoke
    # config on CPU PJRT: 3 compiles by update 2, not 2). Any in-place write before this sync avoids
    # it; an EMA step of momentum 1 changes nothing.
    model.update_target(torch.ones((), device=rt.device))
    mark_step(rt)


def to_cpu(obj):
    """A (nested) state as CPU tensors, so a checkpoint from CUDA or XLA loads anywhere. CPU tensors
    are not copied: a checkpoint is written before the next update changes them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# --------------------------------------------------------------------------------------------------
# Sharding (shard: fsdp): weights, gradients, AdamW state and the EMA target split over the devices
# of the mesh's 'fsdp' axis; each device still computes on its own part of the batch. CPU/CUDA:
# FSDP2 (fully_shard; each process holds a DTensor shard of every parameter and gathers one of
# model.shard_units() at a time). XLA: SPMD annotations (each parameter's largest dimension split
# over 'fsdp', as torch_xla's FSDPv2 does; the compiler places the gathers). The update, the EMA
# (local, on matching shards), clipping (torch's norm over all shards), weight decay, the NaN guard
# and the checkpoint format are the same as unsharded.
# --------------------------------------------------------------------------------------------------


def sharding_size(cfg: Config, world: int) -> int:
    """Devices one copy of the weights is sharded over: 1 unless shard fsdp; then fsdp_size (None:
    all `world` devices). ConfigError when it does not divide the world size; a dry run, which
    shards nothing, may plan for more devices than it has (its report uses cfg.fsdp_size)."""
    if cfg.shard != "fsdp":
        return 1
    fsdp = cfg.fsdp_size or world
    if world % fsdp:
        if cfg.dry_run:
            return 1
        raise ConfigError(
            f"fsdp_size: {fsdp} does not divide the {world} devices of this run; use a divisor of "
            f"{world} (the devices form a data x fsdp mesh), or none to shard over all of them."
        )
    return fsdp


def fsdp_mesh(kind: str, world: int, fsdp: int):
    """FSDP2's device mesh: ('fsdp',) over all processes, or ('data', 'fsdp') holding world / fsdp
    copies of the weights, each sharded over fsdp processes (gradients are averaged over both axes);
    None when not sharded."""
    if fsdp == 1:
        return None
    if fsdp == world:
        return init_device_mesh(kind, (fsdp,), mesh_dim_names=("fsdp",))
    return init_device_mesh(kind, (world // fsdp, fsdp), mesh_dim_names=("data", "fsdp"))


def place_model(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model (built on the CPU) on this process's device: whole, or sharded without a whole copy
    of it on any device. FSDP2 moves the parameters of each unit of model.shard_units(), then of the
    model, and keeps its shard of each; XLA sends every device only its shards (place_xla_shards).
    On XLA, what backward recomputes (the hmlp stem; the blocks with grad checkpointing) it
    recomputes with torch_xla's checkpoint (use_xla_checkpoint)."""
    if rt.kind == "xla":
        use_xla_checkpoint(model)
    if not rt.sharded:
        return model.to(rt.device)
    if rt.kind == "xla":
        return place_xla_shards(model, rt)
    for unit in model.shard_units():
        fully_shard(unit, mesh=rt.mesh)
    # JEPAOutput.pred is a view, which FSDP2 warns about in case it is changed in place; nothing
    # changes it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return fully_shard(model, mesh=rt.mesh)


def place_model_state(saved: dict, model: torch.nn.Module, rt: Runtime) -> dict:
    """A checkpoint's model state (whole CPU tensors, from any run) laid out as this run holds the
    model: sharded, each process or device gets only its shards (model.load_state_dict then copies
    them in place); unsharded, as it is (load_state_dict moves it to the device)."""
    if not rt.sharded:
        return saved
    live = model.state_dict()
    return {k: place_like(v, live[k], rt) if k in live else v for k, v in saved.items()}


def place_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, rt: Runtime) -> dict:
    """A checkpoint's AdamW state laid out like this run's parameters (place_model_state for the
    moments; a step count stays whole)."""
    if not rt.sharded:
        return saved
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    state = {
        i: {
            k: place_like(v, p, rt) if v.shape == p.shape else v
            for k, v in saved["state"][i].items()
        }
        for i, p in zip(ids, params)
        if i in saved["state"]
    }
    return {**saved, "state": state}


def place_like(value: torch.Tensor, like: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """A whole CPU tensor sharded as `like`, the live tensor it will replace: this process's DTensor
    shard (FSDP2) or an XLA array of which every device receives only its own shard."""
    if isinstance(like, DTensor):
        return distribute_tensor(
            value.to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
    return xla_sharded(value, rt)


def state_to_host(obj, rt: Runtime):
    """A (nested) model or optimizer state as whole CPU tensors, for a checkpoint, put together from
    the shards one tensor at a time: FSDP2 gathers each (every process takes part) and only the
    master, which writes, keeps it (elsewhere the tensors are None); XLA copies each device's shard
    to the host (xla_whole), with no compile and no whole copy on a device. Not sharded:
    fetch_to_host."""
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
    """A replicated DTensor (FSDP2's total grad norm) as a plain tensor; any other tensor as it
    is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def device_memory_bytes(rt: Runtime) -> Tuple[Optional[int], str]:
    """(the memory of one device of this run in bytes, or None when it cannot be asked; what it is):
    a GPU's total memory, the host's physical RAM for the CPU, an XLA device's bytes_limit."""
    if rt.kind == "cuda":
        return torch.cuda.get_device_properties(rt.device).total_memory, torch.cuda.get_device_name(
            rt.device
        )
    if rt.kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's RAM"
    try:
        return int(xla_modules().xm.get_memory_info(rt.device)["bytes_limit"]), "the XLA device"
    except Exception:  # torch_xla versions and PJRT devices differ in what they tell
        return None, "an XLA device that does not tell its memory"


def state_bytes_per_device(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime
) -> dict:
    """Measured bytes of the trained weights, the EMA target and AdamW's moments on the fullest
    device (over every process and device): what sharding divides by fsdp_size."""
    trained = [p for p in model.parameters() if p.requires_grad]
    parts = {
        "weights": trained,
        "ema_target": [p for p in model.parameters() if not p.requires_grad],
        "adamw": [v for p in trained for v in optimizer.state[p].values() if v.shape == p.shape],
    }
    per_device = {
        name: sum(np.asarray(device_bytes(t, rt)) for t in tensors)
        for name, tensors in parts.items()
    }
    fullest = int(np.argmax(sum(per_device.values())))
    local = {name: int(np.asarray(b).reshape(-1)[fullest]) for name, b in per_device.items()}
    every = gather_objects(local, rt)
    return max(every, key=lambda b: sum(b.values()))


def device_bytes(t: torch.Tensor, rt: Runtime) -> List[int]:
    """Bytes of `t` on each device of this process: its FSDP2 shard, its XLA shard on each local
    device, or all of it."""
    if isinstance(t, DTensor):
        return [t.to_local().numel() * t.element_size()]
    if rt.kind == "xla" and rt.sharded:
        return xla_shard_bytes(t)
    return [t.numel() * t.element_size()]


# --- XLA: the torch_xla code of sharding and grad checkpointing ---


def fsdp_spec(t: torch.Tensor) -> tuple:
    """XLA partition spec of a sharded weight or AdamW moment: its largest dimension split over
    'fsdp'."""
    spec = [None] * t.dim()
    if spec:
        spec[int(np.argmax(t.shape))] = "fsdp"
    return tuple(spec)


def batch_spec(t: torch.Tensor) -> tuple:
    """XLA partition spec of a batch-first tensor: the batch split over every device (both mesh
    axes)."""
    return (("data", "fsdp"),) + (None,) * (t.dim() - 1)


def xla_sharded(value: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """A CPU tensor as an XLA array split as fsdp_spec says (whole on the devices only until it is
    split, one tensor at a time; xm.send_cpu_data_to_device with a ShardingSpec fails on 1-d tensors
    in torch_xla 2.9)."""
    out = value.to(rt.device)
    xla_modules().xs.mark_sharding(out, rt.mesh, fsdp_spec(out))
    return out


def place_xla_shards(model: torch.nn.Module, rt: Runtime) -> torch.nn.Module:
    """The model on the XLA devices with every parameter sharded (xla_sharded) and each unit of
    model.shard_units() handing on activations split over the batch, as FSDP does (without it the
    compiler may choose to split them over the width instead)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(
                module,
                name,
                torch.nn.Parameter(xla_sharded(param.detach(), rt), param.requires_grad),
            )
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(rt.device))

    def split_over_batch(unit, args, out) -> None:
        xla_modules().xs.mark_sharding(out, rt.mesh, batch_spec(out))

    for unit in model.shard_units():
        unit.register_forward_hook(split_over_batch)
    return model


def use_xla_checkpoint(model: torch.nn.Module) -> None:
    """Recompute the hmlp stem (always) and with grad checkpointing the blocks with torch_xla's
    checkpoint: torch's non-reentrant one fails on XLA (it looks for a torch.xla device module),
    and torch_xla's keeps the recomputation in the compiled graph."""
    checkpoint = with_input_gradient(xla_modules().checkpoint)
    model.encoder.stem_checkpoint_fn = checkpoint
    if model.grad_checkpointing:
        model.set_grad_checkpointing(True, checkpoint)


def with_input_gradient(checkpoint: Callable) -> Callable:
    """checkpoint(module, x) of a reentrant checkpoint (torch_xla's), its input asking for a
    gradient: a reentrant checkpoint gives the weights inside none when no input asks for one, so
    the hmlp stem, whose input is the volume, never trained on XLA with grad checkpointing
    (experiments/NOTES.md 25)."""

    def run(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(module, x if x.requires_grad else x.detach().requires_grad_())

    return run


def adamw_state(p: torch.Tensor, rt: Runtime) -> dict:
    """AdamW's state of parameter p before its first update: step 0 and both moments zero, on p's
    devices and split over them like p. XLA sharded: the moments split as fsdp_spec says (zeros_like
    alone is whole on every device, and the first update would compile for that layout); FSDP2:
    zeros_like of a DTensor has p's shards."""
    state = {
        "step": torch.zeros((), dtype=torch.float32, device=p.device),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }
    if rt.sharded and rt.kind == "xla":
        for moment in (state["exp_avg"], state["exp_avg_sq"]):
            xla_modules().xs.mark_sharding(moment, rt.mesh, fsdp_spec(moment))
    return state


def xla_shard_bytes(t: torch.Tensor) -> List[int]:
    """Bytes of a sharded XLA array on each local device (from its shards' index ranges: nothing is
    transferred)."""
    xla_modules().xm.wait_device_ops()  # its data must not be in flight
    # [(replica, [slice per dim])]
    pieces = xla_modules().torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    return [math.prod(s.stop - s.start for s in index) * t.element_size() for _, index in pieces]


def xla_whole(t: torch.Tensor) -> torch.Tensor:
    """A (sharded) XLA array as a whole CPU tensor, assembled on the host from its local devices'
    shards (a transfer of the whole array would compile a gathering graph for every array, at every
    checkpoint). RuntimeError when this host's devices do not hold all of it."""
    xlac = xla_modules().torch_xla._XLAC
    if xlac._get_xla_sharding_type(t) in (None, 0):  # not sharded, or replicated
        return to_cpu(t)
    whole = torch.empty(t.shape, dtype=t.dtype)
    shards = xlac._get_local_shards([t])[0]  # [(CPU tensor, device)], padded at uneven ends
    filled = set()
    for (data, _), (_, index) in zip(shards, xlac._get_local_shard_replica_and_indices([t])[0]):
        whole[tuple(index)] = data[tuple(slice(0, s.stop - s.start) for s in index)]
        filled.add(tuple((s.start, s.stop) for s in index))
    if sum(math.prod(stop - start for start, stop in index) for index in filled) != t.numel():
        raise RuntimeError(f"an array of shape {list(t.shape)} is not all on this host's devices")
    return whole
