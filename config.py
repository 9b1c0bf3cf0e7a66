"""One typed Config for octjepa: defaults, YAML loading, --flag overrides, validation, derived
values.

Precedence: dataclass defaults < YAML file (--config FILE) < command-line flags.
Every field is a flag: `--base_lr 1e-4`, `--base_lr=1e-4`, lists as `--image_size 64,384,384`,
`none`/`null` (any case) for an optional field, a bare `--dry_run` for a bool.
Problems raise ConfigError naming the field and the fix; every script's main (script_main) turns
that into exit 2. The command line that every script shares (ScriptParser, script_main, a stop while
a script imports) is the last section.

Exit codes of every script: EXIT_CODES, the one table (0 done; the ExitError subclasses below, each
with its code).
"""

import argparse
import dataclasses
import difflib
import functools
import math
import os
import re
import shlex
import signal
import sys
import typing
import warnings
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Union

import yaml

# Exit codes of every script: EXIT_CODES (below the error classes) is the one table that docs and
# docstrings point to
EXIT_OK = 0  # done
EXIT_FAILED = 1  # a check of sanity.py failed


class ExitError(Exception):
    """An error that ends a script: config.script_main prints `prefix` and the message on stderr and
    returns exit_code."""

    exit_code = EXIT_FAILED
    prefix = "error: "


class ConfigError(ExitError, ValueError):
    """A configuration problem (a flag, config, checkpoint, export or labels file): the message
    names the field and how to fix it."""

    exit_code = 2
    prefix = "config error: "


class NoUsableData(ExitError):
    """Nothing (or too little) to train on or embed; the message holds the per-reason table."""

    exit_code = 3
    prefix = "no usable data:\n"


class Diverged(ExitError):
    """Training cannot recover from non-finite updates; the message is the diagnosis."""

    exit_code = 4
    prefix = "training diverged beyond recovery:\n"


class StorageFailed(ExitError):
    """Checkpoint storage stayed unwritable (or a checkpoint unreadable) after retrying for
    ckpt_retry_minutes."""

    exit_code = 74  # sysexits EX_IOERR: what job schedulers read as "I/O error"
    prefix = "checkpoint storage failed: "


class Preempted(ExitError):
    """SIGTERM or SIGINT stopped the run at an update boundary, after a checkpoint of that update;
    the same command with --resume auto continues exactly there."""

    # sysexits EX_TEMPFAIL: what job schedulers read as "temporary failure: try again"
    exit_code = 75
    prefix = "preempted: "


# code -> meaning, of every script
EXIT_CODES = {
    EXIT_OK: "done",
    EXIT_FAILED: "a sanity.py check failed",
    **{
        e.exit_code: f"{e.__name__}: {' '.join(e.__doc__.split())}"
        for e in (ConfigError, NoUsableData, Diverged, StorageFailed, Preempted)
    },
}


@dataclass
class Config:
    # --- data ---
    # folder, glob or gs:// prefix of DICOM files; None = built-in phantoms
    data_root: Optional[str] = None
    manifest_path: Optional[str] = None  # TSV/CSV with a `filepath` column (relative to data_root)
    # JSONL index written by `python data.py scan` (reused if given)
    index_path: Optional[str] = None
    # where the built-in demo phantoms are written when data_root is None
    phantom_dir: str = "data/phantoms"
    phantom_count: int = 48  # volumes in the built-in phantom set
    # varied eyes as the verdict's (position, tilt, brightness...: phantom.draw_eye); false: plain
    phantom_varied: bool = True
    sop_classes: str = "oct"  # oct | any
    # [D, H, W] voxels fed to the model
    image_size: List[int] = field(default_factory=lambda: [16, 64, 64])
    patch_size: List[int] = field(default_factory=lambda: [4, 8, 8])  # tubelet [pd, ph, pw]
    # [dz, dy, dx] mm to resample to; None = resize to image_size
    target_spacing: Optional[List[float]] = None
    # resize | skip: what to do with a volume whose spacing is missing/garbled
    missing_spacing: str = "resize"
    # robust intensity clip
    clip_percentiles: List[float] = field(default_factory=lambda: [0.5, 99.5])
    flip_prob: float = 0.5  # random flip across the lateral axis (train only)
    # random intensity scale/shift amplitude after normalization (train only)
    intensity_jitter: float = 0.1
    val_fraction: float = 0.1  # share of patients held out for validation
    # decoded-volume cache (data.py prepare); None: decode each time (phantoms: in
    # phantom_dir-cache)
    cache_dir: Optional[str] = None
    workers: int = 2  # DataLoader worker processes
    max_bad_fraction: float = 0.2  # stop (exit 3) when more than this share of files is unusable
    # --- masking ---
    mask_type: str = "random"  # multiblock (blocks clipped at the borders) | random
    mask_ratio: float = 0.6  # share of tokens that are prediction targets (in each mask set)
    # block size as share of tokens: [min, max] per mask set; more pairs = more mask sets per sample
    # (V-JEPA short/long range)
    mask_block_scale: List[float] = field(default_factory=lambda: [0.1, 0.3])
    mask_block_aspect: float = 1.5  # max aspect ratio distortion of a block per axis pair
    # --- model ---
    # linear (ViT's: one linear map of each tubelet) | hmlp (three non-overlapping convolutions with
    # GELU: a nonlinear map of the tubelet's own voxels)
    patch_stem: str = "hmlp"
    # the hmlp stem's first cell [cd, ch, cw] in voxels: cells -> stem_width x E channels, 2x2x2
    # cells -> stem_width x E, the rest of the tubelet -> E (patch_size a multiple of 2x the cell on
    # each axis); its cost falls with the cell's size (docs/performance.md)
    stem_cell: List[int] = field(default_factory=lambda: [1, 2, 2])
    # the hmlp stem's channels before its last layer, a share of embed_dim (a whole number of
    # channels); Touvron's 2D stem: 0.25. Its cost falls with it, about as its square
    stem_width: float = 0.5
    embed_dim: int = 96  # context/target encoder width
    depth: int = 4  # encoder blocks
    num_heads: int = 4  # encoder attention heads (embed_dim must divide by it)
    pred_embed_dim: int = 64  # predictor width (narrower than the encoder)
    pred_depth: int = 4  # predictor blocks
    pred_num_heads: int = 4  # predictor attention heads
    mlp_ratio: float = 4.0  # MLP hidden width / block width
    loss: str = "l1"  # l1 | mse
    # 0: none. MaskFeat-style: + this x the error of a linear head reading each visible token's own
    # voxel statistics (mean, std, histogram) from the context encoder
    local_loss_weight: float = 0.5
    # the local loss's statistics per sub-block: each token cut into this many per axis (1,4,1: its
    # four depth quarters; patch_size[1] must divide by it)
    local_loss_split: List[int] = field(default_factory=lambda: [1, 4, 1])
    # recompute block activations in backward: less memory, ~1/3 more compute; auto = only where the
    # memory estimate does not fit the device without it
    grad_checkpointing: Union[bool, str] = "auto"
    # --- optimization ---
    # volumes per optimizer update, over all devices and micro-batches
    global_batch_size: Optional[int] = 8
    per_core_batch_size: Optional[int] = 8  # volumes per device per micro-batch
    # derived from the two batch sizes and the world size when None
    grad_accum_steps: Optional[int] = None
    # passes over the training split (sets the run length unless max_steps); the demo: 900 updates
    epochs: int = 180
    max_steps: Optional[int] = None  # optimizer updates; overrides epochs when set
    # peak LR, reached after warmup (sanity.py --lr_sweep measures a stable one)
    base_lr: float = 5e-4
    min_lr: float = 1e-5  # LR at the end of the cosine schedule (held after it)
    # linear warmup from base_lr / warmup_steps; None = use warmup_epochs
    warmup_steps: Optional[int] = None
    warmup_epochs: Optional[float] = 2.0  # used when warmup_steps is None
    schedule: str = "cosine"  # cosine | constant
    # AdamW decoupled decay on weight matrices (not biases, norms, mask token)
    weight_decay: float = 0.04
    # cosine-ramped to this value; None = constant weight_decay
    weight_decay_end: Optional[float] = None
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW [beta1, beta2]
    ema_base: float = 0.998  # EMA momentum at step 0, ramped to ema_end
    # EMA momentum at the end of the run (below 1: the target encoder keeps moving)
    ema_end: float = 1.0
    ema_schedule: str = "cosine"  # cosine | linear: the ramp from ema_base to ema_end
    # max total grad norm; None = no clipping (the norm is still logged)
    grad_clip: Optional[float] = 1.0
    # bf16 autocast (CUDA, XLA; CPU with AMX); weights and optimizer stay fp32
    use_bf16: bool = False
    # torch.compile the encoders, predictor and loss (CPU, CUDA); auto = on CUDA only; XLA compiles
    # the update anyway
    compile: Union[bool, str] = "auto"
    # torch.compile mode: default | reduce-overhead (CUDA graphs of the compiled parts: small
    # models) | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    max_consecutive_nonfinite: int = 3  # skipped updates in a row before a rollback
    max_rollbacks: int = 3  # rollbacks before giving up with exit 4
    rollback_lr_factor: float = 0.5  # LR multiplier applied at each rollback
    # --- logging, validation, checkpoints ---
    # metrics line every N updates (on XLA also how often the host reads the device)
    log_every_steps: int = 10
    # validation (loss, target_std, RankMe) every N updates and at the end
    val_every_steps: int = 100
    # validation uses the first val_batches x global_batch_size val volumes (fixed crops and masks,
    # the same on any number of processes)
    val_batches: int = 4
    # linear probes of the target encoder every N updates (runprobe.py); None = off
    probe_every_steps: Optional[int] = None
    # labels.csv (path,label) of the run's probes; None = the suite's lesion task on labelled
    # phantoms
    probe_labels: Optional[str] = None
    # end of run: the verdict: does the encoder beat a random init and hand-made features (the
    # attentive read-out)?
    summary_probe: bool = True
    # warn (events.jsonl, console) when target_std falls under this
    collapse_min_target_std: float = 0.05
    collapse_min_rankme: float = 2.0  # warn when val RankMe falls under this
    # warn when either falls under half its best of this many updates (probe AUROC: half its gain
    # over 0.5)
    collapse_window_steps: int = 1000
    ckpt_dir: Optional[str] = "auto"  # auto = out_dir/run_name/checkpoints; None = no checkpoints
    ckpt_every_steps: int = 100  # checkpoint every N updates and at the end
    # also checkpoint when this long passed since the last one (process 0's clock); None = off
    ckpt_every_minutes: Optional[float] = None
    # a failing checkpoint write is retried with backoff this long, then skipped; a second failure
    # in a row stops with exit 74
    ckpt_retry_minutes: float = 5.0
    keep_last: int = 2  # step checkpoints kept (best.pt is kept besides)
    # None | auto (latest in ckpt_dir, if any) | restart (start over: the run folder's earlier
    # history is moved into restarted-<time>/, never deleted) | path to a checkpoint; a start from
    # scratch on a run folder's history is refused without restart
    resume: Optional[str] = None
    # with resume: allow more updates than the checkpoint's plan; schedules continue smoothly
    extend: bool = False
    # stretch (the rest of the schedules spread over the longer run) | rewarm (a new warmup to
    # base_lr and cosine, EMA from ema_base, over the added updates)
    extend_schedule: str = "stretch"
    # multi-node DDP with a local ckpt_dir: every node sees it (NFS); checked at start
    ckpt_dir_shared: bool = False
    wandb: str = "disabled"  # auto | online | offline | disabled
    wandb_project: str = "octjepa"  # W&B project
    wandb_entity: Optional[str] = None  # W&B entity (team); None = your default
    # --- run ---
    device: str = "auto"  # auto | cpu | cuda | xla
    # None | fsdp: shard weights, gradients, AdamW state and the EMA target over the devices (FSDP2
    # under torchrun; SPMD on XLA)
    shard: Optional[str] = None
    # with shard fsdp: devices one copy of the weights is sharded over; None = all; fewer = a data x
    # fsdp mesh
    fsdp_size: Optional[int] = None
    seed: int = 0  # weights, data order, crops and masks all follow from it
    out_dir: str = "runs"  # run folders go here: out_dir/run_name/
    run_name: Optional[str] = None  # None = a timestamped name
    # print the preflight report and save schedules.png/mask.png, train nothing
    dry_run: bool = False

    def grid_size(self) -> List[int]:
        """Tokens per axis [gd, gh, gw]."""
        return [s // p for s, p in zip(self.image_size, self.patch_size)]

    def num_tokens(self) -> int:
        return math.prod(self.grid_size())

    def token_counts(self):
        """(n_context, n_target): the same for every sample, so batches have static shapes."""
        n = self.num_tokens()
        n_target = round(self.mask_ratio * n)
        return n - n_target, n_target


CHOICES = {
    "sop_classes": ("oct", "any"),
    "missing_spacing": ("resize", "skip"),
    "mask_type": ("multiblock", "random"),
    "loss": ("l1", "mse"),
    "patch_stem": ("linear", "hmlp"),
    "schedule": ("cosine", "constant"),
    "ema_schedule": ("cosine", "linear"),
    "wandb": ("auto", "online", "offline", "disabled"),
    "device": ("auto", "cpu", "cuda", "xla"),
    "extend_schedule": ("stretch", "rewarm"),
    "compile_mode": ("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
}
# true | false | auto: auto is decided where the run starts, from its device (train.py,
# plan.choose_auto_settings)
AUTO_FIELDS = ("grad_checkpointing", "compile")
LIST_LENGTHS = {
    "image_size": 3,
    "patch_size": 3,
    "target_spacing": 3,
    "clip_percentiles": 2,
    "adam_betas": 2,
    "local_loss_split": 3,
    "stem_cell": 3,
}
# Fields naming a file, folder or URL: the string "None" there is a YAML/shell slip, never a path
# (incident 8).
PATH_FIELDS = (
    "data_root",
    "manifest_path",
    "index_path",
    "phantom_dir",
    "cache_dir",
    "ckpt_dir",
    "probe_labels",
    "out_dir",
    "resume",
)
NULL_WORDS = ("none", "null", "~")
# `python train.py` with no arguments, the demo: one run folder, out_dir/demo. Run again, it
# continues an interrupted demo or reprints the summary of a finished one (docs/encoder.md's
# commands use its paths).
DEMO_FLAGS = ["--run_name", "demo", "--resume", "auto"]


# labelled phantom sets by kind
PHANTOM_SET_SUFFIXES = {"plain": "_probe", "varied": "_suite", "inner": "_inner"}


def phantom_set_labels_path(cfg: "Config", kind: str) -> str:
    """The labels.csv of the built-in labelled phantom set of a kind (labels.phantom_set_labels
    writes it): beside cfg.phantom_dir with the kind's suffix (PHANTOM_SET_SUFFIXES)."""
    return os.path.join(cfg.phantom_dir.rstrip("/") + PHANTOM_SET_SUFFIXES[kind], "labels.csv")


def phantom_labels_path(cfg: "Config", varied: bool = False) -> str:
    """The labels.csv of a built-in labelled phantom set (labels.phantom_labels writes it): the
    plain set beside cfg.phantom_dir with '_probe', the varied one with '_suite'."""
    return phantom_set_labels_path(cfg, "varied" if varied else "plain")


FIELD_TYPES = typing.get_type_hints(Config)
FIELD_NAMES = [f.name for f in dataclasses.fields(Config)]

# Fields that left for a patch of experiments/patches/ (objectives and options measured and not
# kept), each with its default then. A saved config (a checkpoint's, a run's config.yaml, an
# export's training config) holds them at that default: dropped, it reads as before. Any other
# value, or the field as a flag, is a ConfigError naming the patch.
REMOVED_FIELDS = {  # name: (its default, the patch that brings it back)
    "context_loss_weight": (0.0, "vjepa21_objectives.diff"),
    "context_loss_distance": (False, "vjepa21_objectives.diff"),
    "target_levels": (1, "vjepa21_objectives.diff"),
    "gram_loss_weight": (0.0, "gram_anchoring.diff"),
    "mask_tube_axis": (None, "mask_options.diff"),
}


def without_removed_fields(values: dict, where: str = "") -> dict:
    """values less the REMOVED_FIELDS that hold their old default; a ConfigError naming the patch
    for one that does not (`where` starts the message: whose values they are)."""
    for name in sorted(set(values) & set(REMOVED_FIELDS)):
        default, patch = REMOVED_FIELDS[name]
        if values[name] != default:
            raise ConfigError(
                f"{where}{name}: {values[name]!r} is an option measured and not kept: it moved to "
                f"experiments/patches/{patch} (git apply it to train with it or read this)."
            )
    return {k: v for k, v in values.items() if k not in REMOVED_FIELDS}


def _unwrap_optional(tp):
    """(inner type, is_optional) for Optional[X] / X."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _unknown_key_error(key: str, where: str, script_options: Iterable[str] = ()) -> ConfigError:
    if key in REMOVED_FIELDS:
        return ConfigError(
            f"{key}: an option measured and not kept: it moved to "
            f"experiments/patches/{REMOVED_FIELDS[key][1]} (git apply it to use it)."
        )
    close = difflib.get_close_matches(key, FIELD_NAMES + list(script_options), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else " See docs/config.md for the fields."
    return ConfigError(f"unknown {where} '{key}'.{hint}")


def _convert_scalar(name: str, tp, value):
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
        raise ConfigError(f"{name}: expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{name}: expected a string, got {value!r}.")
        return str(value)
    raise TypeError(f"unsupported config type {tp} for {name}")


def convert_value(name: str, value, from_cli: bool):
    """Convert a YAML value or a command-line string to the type of field `name`."""
    if name in AUTO_FIELDS:  # true, false or the string auto
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if not isinstance(value, (bool, str)):
            raise ConfigError(f"{name}: expected true, false or auto, got {value!r}.")
        try:
            return _convert_scalar(name, bool, value)
        except ConfigError:
            raise ConfigError(f"{name}: expected true, false or auto, got {value!r}.") from None
    tp, optional = _unwrap_optional(FIELD_TYPES[name])
    if value is None or (
        from_cli and isinstance(value, str) and value.strip().lower() in NULL_WORDS
    ):
        if not optional:
            raise ConfigError(
                f"{name}: this field cannot be null; give a value "
                f"(default {getattr(Config(), name)!r})."
            )
        return None
    if typing.get_origin(tp) in (list, List):
        (item_tp,) = typing.get_args(tp)
        items = value
        if isinstance(value, str):
            items = [v for v in value.strip("[]() ").split(",") if v.strip()]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}: expected a list like 1,2,3, got {value!r}.")
        out = [
            _convert_scalar(name, item_tp, v.strip() if isinstance(v, str) else v) for v in items
        ]
        want = LIST_LENGTHS.get(name)
        if want is not None and len(out) != want:
            raise ConfigError(f"{name}: expected {want} values, got {len(out)} ({value!r}).")
        return out
    return _convert_scalar(name, tp, value)


def parse_flags(argv: List[str], script_options: Iterable[str] = ()) -> dict:
    """Parse `--flag value`, `--flag=value` and bare bool `--flag` into {field: raw string or True};
    an unknown flag names the closest field or script option."""
    flags, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: flags look like --name value or --name=value."
            )
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name != "config" and name not in FIELD_TYPES:
            raise _unknown_key_error(name, "flag --", script_options)
        if not eq:
            is_bool = name != "config" and _unwrap_optional(FIELD_TYPES[name])[0] is bool
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if next_is_value:
                value, i = argv[i + 1], i + 1
            elif is_bool:
                value = "true"
            else:
                raise ConfigError(f"--{name} needs a value.")
        flags[name] = value
        i += 1
    return flags


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a key twice (PyYAML would keep the later value
    without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.MarkedYAMLError(
                    problem=f"the key {key!r} is given twice, on lines {seen[key]} and {line}",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def yaml_fix(error: yaml.YAMLError) -> str:
    """What to do about a YAML error, in words."""
    text = str(error)
    if "'\\t'" in text or "\\t(TAB)" in text:
        return "indent with spaces: YAML does not allow tabs"
    if "tag:yaml.org,2002:python/" in text or "could not determine a constructor" in text:
        return (
            "write plain values (numbers, strings, lists): a config does not run Python, so YAML"
            " tags like !!python/... are refused"
        )
    if "given twice" in text:
        return "delete the line you do not mean"
    return "fix the YAML at that line (the values of each field are in docs/config.md)"


def load_yaml(path: str) -> dict:
    """Read a YAML config file into a dict of raw values. ConfigError naming the file, the line and
    the fix for a file that is not there, not UTF-8, not YAML, runs Python tags, or gives a key
    twice; unknown keys are errors."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config: file {path!r} not found.") from None
    except OSError as e:
        raise ConfigError(
            f"config: cannot read {path} ({e.strerror or e}); give a readable YAML file."
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config: {path}, line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text (Latin-1?);"
            f" save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {shlex.quote(path)} >"
            " fixed.yaml`, and give --config fixed.yaml."
        ) from None
    try:
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config: {path}{where}: {problem}; {yaml_fix(e)}.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must be a mapping of field: value.")
    # a run's config.yaml of an older octjepa holds them
    raw = without_removed_fields(raw, f"config: {path}: ")
    for key in raw:
        if key not in FIELD_TYPES:
            raise _unknown_key_error(str(key), f"key in {path}:")
    return raw


def load_config(
    argv: Optional[List[str]] = None, defaults: Optional[dict] = None, **overrides
) -> "Config":
    """Build a validated Config. Precedence: dataclass defaults < `defaults` (a script's own) < the
    YAML file of `--config FILE` < the other flags in argv (default sys.argv[1:]) < keyword
    overrides. REMOVED_FIELDS at their old default, in the YAML file or the overrides (a saved
    config), are dropped."""
    flags = parse_flags(sys.argv[1:] if argv is None else list(argv))
    from_yaml = load_yaml(flags.pop("config")) if "config" in flags else {}
    values = {}
    # a checkpoint's or an export's config of an older octjepa holds them
    saved = without_removed_fields(overrides)
    for layer, from_cli in (
        (defaults or {}, False),
        (from_yaml, False),
        (flags, True),
        (saved, False),
    ):
        for key, value in layer.items():
            if key not in FIELD_TYPES:
                raise _unknown_key_error(key, "field")
            values[key] = convert_value(key, value, from_cli)
    cfg = Config(**values)
    validate(cfg)
    return cfg


def hmlp_stem_problem(
    patch_size: Sequence[int], embed_dim: int, cell: Sequence[int], width: float
) -> Optional[str]:
    """Why the hmlp stem cannot embed tubelets of patch_size at width embed_dim from first cells of
    `cell` voxels with `width` x embed_dim channels in between, or None when it can: it cuts each
    tubelet into cells, then 2x2x2 of those, then the rest (the one rule of config.validate and
    model.tubelet_embedding)."""
    if any(c < 1 or p % (2 * c) for p, c in zip(patch_size, cell)):
        return (
            f"hmlp cuts each tubelet into cells of stem_cell {list(cell)} voxels, then 2x2x2 of"
            " those, then the rest: it needs each axis of patch_size a multiple of twice the"
            f" cell's, got patch_size {list(patch_size)}"
        )
    channels = embed_dim * width
    if not channels >= 1 or channels % 1:  # NaN and inf too
        return (
            f"hmlp's inner maps have stem_width x embed_dim channels: {width} x {embed_dim} ="
            f" {channels:g} is not a whole number of channels"
        )
    return None


def validate(cfg: Config) -> None:
    """Check every rule that does not need the data or the world size; raise ConfigError on the
    first."""
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"{name}: {getattr(cfg, name)!r} is not one of {', '.join(choices)}.")
    for name in AUTO_FIELDS:
        if not isinstance(getattr(cfg, name), bool) and getattr(cfg, name) != "auto":
            raise ConfigError(f"{name}: expected true, false or auto, got {getattr(cfg, name)!r}.")
    for name in PATH_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, str) and value.strip().lower() in NULL_WORDS:
            raise ConfigError(
                f"{name}: the string {value!r} is not a path. Write `{name}: null` (unquoted) in"
                f" YAML or --{name} none to leave it unset."
            )
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{name}: empty path; use null to leave it unset.")
    for axis, (s, p) in enumerate(zip(cfg.image_size, cfg.patch_size)):
        if p <= 0 or s <= 0:
            raise ConfigError(
                f"image_size/patch_size: sizes must be positive, got {cfg.image_size} /"
                f" {cfg.patch_size}."
            )
        if s % p:
            raise ConfigError(
                f"image_size: axis {axis} ({s}) is not divisible by patch_size ({p}); "
                f"use a multiple of {p}, e.g. {s - s % p or p}."
            )
    if not 0.0 < cfg.mask_ratio < 1.0:
        raise ConfigError(
            f"mask_ratio: {cfg.mask_ratio} must be strictly between 0 and 1 (e.g. 0.6)."
        )
    n_context, n_target = cfg.token_counts()
    if n_context < 1 or n_target < 1:
        raise ConfigError(
            f"mask_ratio: {cfg.mask_ratio} of {cfg.num_tokens()} tokens leaves {n_context} context"
            f" and {n_target} target tokens; both must be at least 1."
        )
    scales = cfg.mask_block_scale
    if not scales or len(scales) % 2:
        raise ConfigError(
            f"mask_block_scale: {scales} must hold [min, max] pairs, one per mask set, e.g. 0.1,0.3"
            " or 0.02,0.05,0.3,0.5 for a short-range and a long-range set."
        )
    for lo, hi in zip(scales[::2], scales[1::2]):
        if not 0.0 < lo <= hi <= 1.0:
            raise ConfigError(
                f"mask_block_scale: the pair [{lo}, {hi}] of {scales} must satisfy 0 < min <= max"
                " <= 1."
            )
    if cfg.mask_block_aspect < 1.0:
        raise ConfigError(f"mask_block_aspect: {cfg.mask_block_aspect} must be >= 1.")
    p_lo, p_hi = cfg.clip_percentiles
    if not 0.0 <= p_lo < p_hi <= 100.0:
        raise ConfigError(
            f"clip_percentiles: {cfg.clip_percentiles} must satisfy 0 <= low < high <= 100."
        )
    if cfg.target_spacing is not None and any(s <= 0 for s in cfg.target_spacing):
        raise ConfigError(
            f"target_spacing: {cfg.target_spacing} must be positive mm values [dz, dy, dx]."
        )
    if cfg.local_loss_weight < 0:
        raise ConfigError(
            f"local_loss_weight: {cfg.local_loss_weight} must be >= 0 (0: no local loss)."
        )
    if any(n < 1 or p % n for n, p in zip(cfg.local_loss_split, cfg.patch_size)):
        raise ConfigError(
            f"local_loss_split: {cfg.local_loss_split} must cut the tubelet {cfg.patch_size} into"
            " whole sub-blocks: each a positive divisor of patch_size on its axis, e.g. 1,2,1."
        )
    stem_problem = (
        hmlp_stem_problem(cfg.patch_size, cfg.embed_dim, cfg.stem_cell, cfg.stem_width)
        if cfg.patch_stem == "hmlp"
        else None
    )
    if stem_problem:
        raise ConfigError(
            f"patch_stem: {stem_problem}; use e.g. patch_size 4,8,8 with stem_cell 1,2,2 (4,16,16"
            " with 1,4,4) and stem_width 0.5 or 0.25, or patch_stem linear."
        )
    if cfg.embed_dim % cfg.num_heads or cfg.pred_embed_dim % cfg.pred_num_heads:
        raise ConfigError(
            "embed_dim/pred_embed_dim: must be divisible by num_heads/pred_num_heads."
        )
    for name in (
        "embed_dim",
        "depth",
        "num_heads",
        "pred_embed_dim",
        "pred_depth",
        "pred_num_heads",
        "epochs",
        "log_every_steps",
        "val_every_steps",
        "ckpt_every_steps",
        "keep_last",
        "max_consecutive_nonfinite",
        "phantom_count",
        "val_batches",
    ):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}: must be at least 1, got {getattr(cfg, name)}.")
    if cfg.workers < 0 or cfg.max_rollbacks < 0:
        raise ConfigError("workers/max_rollbacks: must be >= 0.")
    for name in (
        "global_batch_size",
        "per_core_batch_size",
        "grad_accum_steps",
        "max_steps",
        "warmup_steps",
    ):
        value = getattr(cfg, name)
        if value is not None and value < (0 if name == "warmup_steps" else 1):
            raise ConfigError(f"{name}: must be positive, got {value}.")
    if cfg.base_lr <= 0 or not math.isfinite(cfg.base_lr):
        # incident 3: an LR of 0 trains nothing and reports nothing.
        raise ConfigError(
            f"base_lr: {cfg.base_lr} would not train; use a positive value such as 1e-4 "
            "(`python sanity.py --lr_sweep` measures a good one)."
        )
    if cfg.min_lr > cfg.base_lr:
        raise ConfigError(f"min_lr: {cfg.min_lr} must not exceed base_lr ({cfg.base_lr}).")
    if cfg.min_lr <= 0 and cfg.schedule == "cosine":
        # incident 3: the last updates of the run would silently learn nothing.
        raise ConfigError(
            f"min_lr: {cfg.min_lr} makes the end of the cosine schedule an LR of 0; use a small "
            f"positive value such as base_lr / 100 = {cfg.base_lr / 100:g}."
        )
    if cfg.warmup_epochs is not None and cfg.warmup_epochs < 0:
        raise ConfigError(f"warmup_epochs: must be >= 0, got {cfg.warmup_epochs}.")
    if not 0.0 <= cfg.ema_base <= cfg.ema_end <= 1.0:
        raise ConfigError(
            f"ema_base/ema_end: need 0 <= ema_base ({cfg.ema_base}) <= ema_end ({cfg.ema_end})"
            " <= 1."
        )
    if cfg.weight_decay < 0 or (cfg.weight_decay_end is not None and cfg.weight_decay_end < 0):
        raise ConfigError("weight_decay: must be >= 0.")
    if not all(0.0 <= b < 1.0 for b in cfg.adam_betas):
        raise ConfigError(f"adam_betas: {cfg.adam_betas} must be in [0, 1).")
    if cfg.compile is True and cfg.device == "xla":
        raise ConfigError(
            "compile: XLA already compiles the whole update; use --compile false (or auto) with"
            " --device xla (with --device auto, compile is ignored when the device turns out to be"
            " XLA)."
        )
    if cfg.probe_every_steps is not None and cfg.probe_every_steps < 1:
        raise ConfigError(
            f"probe_every_steps: {cfg.probe_every_steps} must be >= 1, or none to turn probing off."
        )
    if (
        min(cfg.collapse_min_target_std, cfg.collapse_min_rankme) < 0
        or cfg.collapse_window_steps < 1
    ):
        raise ConfigError(
            "collapse_min_target_std/collapse_min_rankme: must be >= 0; collapse_window_steps:"
            " >= 1."
        )
    if not 0.0 < cfg.rollback_lr_factor <= 1.0:
        raise ConfigError(f"rollback_lr_factor: {cfg.rollback_lr_factor} must be in (0, 1].")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"val_fraction: {cfg.val_fraction} must be in [0, 1).")
    if not 0.0 < cfg.max_bad_fraction <= 1.0:
        raise ConfigError(f"max_bad_fraction: {cfg.max_bad_fraction} must be in (0, 1].")
    if cfg.grad_clip is not None:
        if cfg.grad_clip <= 0:
            raise ConfigError(
                f"grad_clip: {cfg.grad_clip} must be positive; use null to disable clipping."
            )
        if cfg.grad_clip < 0.05:
            # incident 4: a tiny clip turns AdamW into a sign-like update and hides a bad LR.
            warnings.warn(
                f"grad_clip={cfg.grad_clip} is tiny: almost every update is clipped, which makes"
                " AdamW a sign-like update. Use 1.0 and tune base_lr with `python sanity.py"
                " --lr_sweep`.",
                stacklevel=2,
            )
    if (
        cfg.max_steps is None
        and cfg.warmup_epochs is not None
        and cfg.warmup_steps is None
        and cfg.warmup_epochs >= cfg.epochs
    ):
        raise ConfigError(
            f"warmup_epochs: {cfg.warmup_epochs} is not shorter than the run ({cfg.epochs} epochs);"
            " lower warmup_epochs or raise epochs."
        )
    if (
        cfg.max_steps is not None
        and cfg.warmup_steps is not None
        and cfg.warmup_steps >= cfg.max_steps
    ):
        raise ConfigError(
            f"warmup_steps: {cfg.warmup_steps} is not shorter than the run (max_steps "
            f"{cfg.max_steps}); lower warmup_steps or raise max_steps."
        )
    if cfg.schedule == "constant" and (cfg.warmup_steps or 0) > 0:
        raise ConfigError(
            "warmup_steps: schedule 'constant' uses base_lr from the first update; "
            "set warmup_steps to 0 or use schedule cosine."
        )
    if cfg.shard not in (None, "fsdp"):
        raise ConfigError(
            f"shard: {cfg.shard!r} is not fsdp or none (none: every device holds the whole model)."
        )
    if cfg.fsdp_size is not None and (cfg.shard != "fsdp" or cfg.fsdp_size < 1):
        raise ConfigError(
            f"fsdp_size: {cfg.fsdp_size} needs shard fsdp and a value of at least 1 (the devices"
            " one copy of the weights is sharded over); add --shard fsdp, or use --fsdp_size none."
        )
    if cfg.extend and cfg.resume in (None, "restart"):
        raise ConfigError(
            "extend: lengthens a run that is resumed; add --resume auto (or a checkpoint path), "
            "or drop --extend to start a new run."
        )
    if cfg.run_name is not None and (
        not cfg.run_name.strip()
        or cfg.run_name.strip(".") == ""
        or any(c in cfg.run_name for c in "/\\")
    ):
        raise ConfigError(
            f"run_name: {cfg.run_name!r} is not a folder name inside out_dir ({cfg.out_dir}); use a"
            " plain name without '/', '\\' or '..' (e.g. pod1), and --out_dir to choose the"
            " folder."
        )
    if cfg.ckpt_every_minutes is not None and not cfg.ckpt_every_minutes > 0:
        raise ConfigError(
            f"ckpt_every_minutes: {cfg.ckpt_every_minutes} must be positive, or none to checkpoint"
            " by update count only."
        )
    if not cfg.ckpt_retry_minutes >= 0:
        raise ConfigError(
            f"ckpt_retry_minutes: {cfg.ckpt_retry_minutes} must be >= 0 (0: one try, no retry)."
        )


@dataclass
class RunPlan:
    """Values derived from the config, the world size and the dataset size."""

    world_size: int
    per_core_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    # [at_step, old_total, new_total] of each --extend, oldest first, + "rewarm" for
    # --extend_schedule rewarm (schedules.schedule_segment: the schedules stretch what was left of
    # them, or start a new segment at at_step)
    extensions: List[list] = field(default_factory=list)

    @property
    def planned_steps(self) -> int:
        """The run length the schedules were first planned for (total_steps before any
        extension)."""
        return self.extensions[0][1] if self.extensions else self.total_steps


def plan_run(cfg: Config, world_size: int, train_volumes: int) -> RunPlan:
    """Derive batch sizes, accumulation and the step counts of the schedules; ConfigError when
    inconsistent."""
    per_core, accum, global_batch = (
        cfg.per_core_batch_size,
        cfg.grad_accum_steps,
        cfg.global_batch_size,
    )
    known = sum(v is not None for v in (per_core, accum, global_batch))
    if known < 2 and not (per_core is not None and known == 1):
        raise ConfigError(
            "global_batch_size/per_core_batch_size/grad_accum_steps: give at least "
            "per_core_batch_size and one of the other two."
        )
    if accum is None:
        accum = 1 if global_batch is None else global_batch // (per_core * world_size)
        if global_batch is not None and (
            accum < 1 or per_core * world_size * accum != global_batch
        ):
            raise ConfigError(
                f"global_batch_size: {global_batch} is not a multiple of per_core_batch_size "
                f"({per_core}) x world size ({world_size}); use "
                f"{max(1, round(global_batch / (per_core * world_size))) * per_core * world_size}."
            )
    elif per_core is None:
        per_core = global_batch // (accum * world_size)
        if per_core < 1 or per_core * world_size * accum != global_batch:
            raise ConfigError(
                f"global_batch_size: {global_batch} is not divisible by grad_accum_steps ({accum}) "
                f"x world size ({world_size})."
            )
    if global_batch is None:
        global_batch = per_core * world_size * accum
    if global_batch != per_core * world_size * accum:
        raise ConfigError(
            f"global_batch_size: {global_batch} != per_core_batch_size ({per_core}) x world size "
            f"({world_size}) x grad_accum_steps ({accum}) = {per_core * world_size * accum}; "
            "set one of them to null to derive it."
        )
    steps_per_epoch = train_volumes // global_batch
    if steps_per_epoch < 1:
        raise ConfigError(
            f"global_batch_size: {global_batch} is larger than the {train_volumes} training"
            " volumes; lower the batch size or add data."
        )
    total = cfg.max_steps if cfg.max_steps is not None else steps_per_epoch * cfg.epochs
    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
    elif cfg.schedule == "constant":
        warmup = 0
    else:
        warmup = round((cfg.warmup_epochs or 0.0) * max(steps_per_epoch, 1))
        # max_steps runs: never let an epoch-based warmup eat the run
        warmup = min(warmup, total // 2)
    if cfg.schedule == "cosine" and warmup >= total:
        raise ConfigError(
            f"warmup_steps: warmup ({warmup} updates) is not shorter than the run ({total}"
            " updates)."
        )
    return RunPlan(world_size, per_core, accum, global_batch, steps_per_epoch, total, warmup)


def reference_table() -> str:
    """The config reference table: every field, its default and its comment here."""
    import inspect

    defaults = dataclasses.asdict(Config())
    rows, above = ["| field | default | meaning |", "|---|---|---|"], []
    for line in inspect.getsource(Config).splitlines():
        section = re.match(r"\s+# --- (.+) ---$", line)
        comment_line = re.match(r"\s+# (.*)$", line)
        field_line = re.match(r"\s+(\w+): [^=]+=.*?(?:  # (.*))?$", line)
        if section:
            rows.append(f"| **{section.group(1)}** | | |")
        elif comment_line:  # a field's comment too long to follow it stands above it
            above.append(comment_line.group(1))
            continue
        elif field_line:
            name, comment = (
                field_line.group(1),
                " ".join([*above, field_line.group(2) or ""]).strip(),
            )
            default = (
                yaml.safe_dump(defaults[name], default_flow_style=True)
                .strip()
                .removesuffix("...")
                .strip()
            )
            rows.append(f"| `{name}` | `{default}` | {comment.replace('|', '&#124;')} |")
        above = []
    return "\n".join(rows)


REFERENCE_INTRO = """# Config reference

Generated from the `Config` dataclass in `config.py` (each field's default and comment): after changing a field,
run `python config.py > docs/config.md`; tests/test_config.py fails while this page and the code differ.

Every field is a flag (`--base_lr 1e-4`, `--base_lr=1e-4`, lists `--image_size 64,384,384`, `none` for an
optional field, a bare `--dry_run` for a bool) and a YAML key (`--config file.yaml`; flags win). An
unknown name is an error that suggests the closest one. In YAML, `null` (unquoted) leaves a path unset;
the string `"None"` is an error, never a path. `runs/<run>/config.yaml` is a run's resolved config.
"""


def reference_page() -> str:
    """docs/config.md: the config reference page (a test keeps it equal to this)."""
    return f"{REFERENCE_INTRO}\n{reference_table()}\n"


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML that load_config reads back to the same Config."""
    with open(path, "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)


if __name__ == "__main__":  # python config.py > docs/config.md
    print(reference_page(), end="")


# --------------------------------------------------------------------------------------------------
# The command line that every script shares: its parser (ScriptParser: the script's own options,
# the Config flags left over for load_config), its main (script_main: an ExitError ends it with its
# message and exit code), and a stop signal while it still imports (preempt_at_once_on_stop_signals).
# --------------------------------------------------------------------------------------------------


def preempt_at_once_on_stop_signals(script: str) -> None:
    """From now on, until a run installs its own handlers (runtime.StopSignals), SIGTERM and Ctrl-C
    end the process at once with config.Preempted's exit code and a line on stderr saying to run the
    same command again: a stop while a script imports and starts is a preemption, not a kill (exit
    143) nor a traceback."""

    def stopped(signum, frame):
        os.write(
            2,
            f"preempted: {signal.Signals(signum).name} while {script} was starting: run the same"
            " command again\n".encode(),
        )
        # at once: an exception raised inside torch's import could crash it
        os._exit(Preempted.exit_code)

    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, stopped)


CONFIG_FLAGS_HELP = (
    "Every Config field is also a flag: --base_lr 1e-4, --image_size 64,384,384, none for an\n"
    "optional field; --config FILE reads fields from YAML (see docs/config.md)."
)


class ScriptParser(argparse.ArgumentParser):
    """argparse for a script's own options (sub-commands where it has several verbs); parse() leaves
    the `--field value` config flags over for load_config. A bad option raises ConfigError (exit 2),
    not SystemExit."""

    def __init__(self, description: Optional[str] = None, config_flags: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        # --seed is a config flag, not short for a script's --seeds
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("epilog", CONFIG_FLAGS_HELP if config_flags else None)
        super().__init__(description=description, **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help).")

    def option_names(self) -> List[str]:
        """The names of the script's own options, its sub-commands' included."""
        names = []
        for action in self._actions:
            if action.option_strings and action.dest != "help":
                names.append(action.dest)
            if isinstance(action.choices, dict):  # the sub-commands: {name: parser}
                names += [n for sub in action.choices.values() for n in sub.option_names()]
        return names

    def parse(self, argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
        """(the script's options, the config flags left over); ConfigError for an argument that is
        neither, naming the closest config field or script option."""
        args, rest = self.parse_known_args(argv)
        parse_flags(rest, self.option_names())
        return args, rest


def given_flags(argv: List[str]) -> Set[str]:
    """The names of the flags in argv: Config fields, and 'config' for --config FILE."""
    return set(parse_flags(argv))


def script_main(main):
    """Decorate a script's main(argv) -> exit code: argv defaults to sys.argv[1:], and an ExitError
    ends it with its message on stderr and its exit code."""

    @functools.wraps(main)
    def run(argv: Optional[List[str]] = None) -> int:
        try:
            return main(sys.argv[1:] if argv is None else list(argv))
        except ExitError as e:
            print(f"{e.prefix}{e}", file=sys.stderr)
            return e.exit_code

    return run
