"""VJEPA3D: a 3D V-JEPA for OCT volumes.

  volume [B,1,D,H,W] --tubelet embedding--> tokens [B,N,E] (+ fixed 3D sin-cos positions)
  context encoder:  only the visible tokens  x[context_idx] -> [B,Nc,E]
  predictor:        context tokens + mask tokens at the target positions -> predictions [B,Nt,E]
  target encoder:   EMA copy of the context encoder over ALL tokens, no gradients,
                    layer-normed features gathered at target_idx -> [B,Nt,E]
  loss:             l1 (or mse) between prediction and target, on target tokens only; optionally
                    + local_loss_weight x a linear head's error on each visible token's own voxel
                      statistics
                    (or those of its local_loss_split sub-blocks)
                    (the losses: the last section of this file; those measured and not
                    kept: experiments/patches/)

The context encoder never sees the target tokens and the target encoder moves only through
update_target(momentum) (incident 12). pool_tokens turns tokens into a volume embedding (probes,
exports). The exported encoder (its format, loader and the MONAI adapter) is pretrained.py's.
"""

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import Config, hmlp_stem_problem

RECIPE = Config()  # VJEPA3D's defaults: the recipe, written once as config.py's Config defaults


@dataclass
class JEPAOutput:
    """What VJEPA3D.forward returns; train.py uses only these fields (incident 7)."""

    loss: torch.Tensor  # scalar, differentiable
    # [B*M, Nt, E] predictor output at the target positions (M mask sets per sample, often 1)
    pred: torch.Tensor
    target: torch.Tensor  # [B*M, Nt, E] layer-normed target-encoder features (no grad)
    # scalar, detached: mean over features of the std over target tokens (collapse -> 0)
    target_std: torch.Tensor


def sincos_pos_embed_3d(dim: int, grid: Sequence[int]) -> torch.Tensor:
    """Fixed sin-cos positions [N, dim] for a (gd, gh, gw) grid; each axis gets its own band of
    dims."""
    per_axis = (dim // 6) * 2  # an even number of dims per axis; the remainder stays zero
    if per_axis == 0:
        raise ValueError(f"embed dim {dim} is too small for 3D sin-cos positions (need >= 6)")
    # On the CPU even in a torch.device("meta") context (an export's shapes checked before it is
    # loaded): a meta arange imports torch._dynamo for its decomposition, a second of each start of
    # a script that loads one.
    omega = 1.0 / 10000 ** (
        torch.arange(per_axis // 2, dtype=torch.float64, device="cpu") / (per_axis // 2)
    )
    coords = torch.meshgrid(
        *[torch.arange(g, dtype=torch.float64, device="cpu") for g in grid], indexing="ij"
    )
    bands = []
    for c in coords:
        angles = c.reshape(-1, 1) * omega.reshape(1, -1)  # [N, per_axis/2]
        bands += [torch.sin(angles), torch.cos(angles)]
    emb = torch.cat(bands, dim=1)  # [N, 3*per_axis]
    return F.pad(emb, (0, dim - emb.shape[1])).float()


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B,N,E], idx [B,K] -> [B,K,E]."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, E = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, E // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, heads, N, E/heads]
        # fused kernel: no N x N matrix kept for backward
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, E))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def check_volume(volume: torch.Tensor, image_size: Sequence[int]) -> None:
    """Raise ValueError naming the expected and actual shape unless volume is a float
    [B,1,*image_size] (incident 6)."""
    if volume.dim() != 5 or volume.shape[1] != 1 or list(volume.shape[2:]) != list(image_size):
        raise ValueError(
            f"volume: expected shape {['B', 1, *image_size]}, got {list(volume.shape)}"
        )
    if not volume.is_floating_point():
        raise ValueError(f"volume: expected a floating dtype, got {volume.dtype}")


def check_encoder_input(
    volume: torch.Tensor, patch_size: Sequence[int], trained_size: Sequence[int]
) -> None:
    """Raise ValueError naming the shapes unless volume is a float [B,1,D,H,W] whose D, H, W are
    positive multiples of patch_size (any such size gets its own positions; trained_size is named in
    the message)."""
    size = list(volume.shape[2:])
    if (
        volume.dim() != 5
        or volume.shape[1] != 1
        or any(s < p or s % p for s, p in zip(size, patch_size))
    ):
        raise ValueError(
            "volume: expected shape [B, 1, D, H, W] with D, H, W multiples of the patch size "
            f"{list(patch_size)} (trained on {list(trained_size)}), got {list(volume.shape)}"
        )
    if not volume.is_floating_point():
        raise ValueError(f"volume: expected a floating dtype, got {volume.dtype}")


def run_blocks(
    blocks: nn.ModuleList, x: torch.Tensor, checkpoint_fn: Optional[Callable]
) -> torch.Tensor:
    """x through the blocks; with a checkpoint_fn(block, x) (grad checkpointing) each block's
    activations are recomputed in backward instead of kept."""
    for block in blocks:
        x = checkpoint_fn(block, x) if checkpoint_fn is not None and x.requires_grad else block(x)
    return x


def recompute_in_backward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's activation checkpointing of one block (the default checkpoint_fn)."""
    return checkpoint(block, x, use_reentrant=False)


def cells_last(weight: torch.Tensor) -> torch.Tensor:
    """A Conv3d weight [out, in, kd, kh, kw] as a matrix [out, kd*kh*kw*in] for inputs laid out cell
    by cell, each cell's channels together (the layout a matmul leaves, so no activation is
    transposed)."""
    return weight.permute(0, 2, 3, 4, 1).flatten(1)


class HMLPStem(nn.Sequential):
    """The hierarchical MLP stem (Touvron et al., ECCV 2022): cells of `cell` voxels (1x2x2 by
    default; Touvron's 2D stem cuts 4x4) -> C = width x E channels (E/2 by default; Touvron's:
    E/4), 2x2x2 of those -> C, the rest of the tubelet -> E, with GELU between. Its layers are
    Conv3d's whose kernel is their stride (keys {0,2,4}.weight/bias), computed as three matmuls on
    each tubelet's cells (equal to the convolutions to rounding; a demo update 0.875x as long on
    one CPU thread: experiments/speed/stem_ab.py)."""

    def __init__(self, patch_size: Sequence[int], dim: int, cell: Sequence[int], width: float):
        cell, channels = tuple(cell), round(dim * width)
        rest = tuple(p // (2 * c) for p, c in zip(patch_size, cell))
        super().__init__(
            nn.Conv3d(1, channels, kernel_size=cell, stride=cell),
            nn.GELU(),
            nn.Conv3d(channels, channels, kernel_size=(2, 2, 2), stride=(2, 2, 2)),
            nn.GELU(),
            nn.Conv3d(channels, dim, kernel_size=rest, stride=rest),
        )

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        """volume [B,1,D,H,W] -> [B,E,gd,gh,gw] (as the convolutions: voxels past the last whole
        tubelet dropped)."""
        (B, _, D, H, W), (rd, rh, rw) = volume.shape, self[4].kernel_size
        cd, ch, cw = self[0].kernel_size
        gd, gh, gw = D // (2 * rd * cd), H // (2 * rh * ch), W // (2 * rw * cw)
        x = volume[:, 0, : gd * 2 * rd * cd, : gh * 2 * rh * ch, : gw * 2 * rw * cw]
        # a voxel's depth is (gd, rd, 2, cd), its height (gh, rh, 2, ch) and width (gw, rw, 2, cw):
        # tubelet, rest, 2x2x2 of cells, cell
        x = x.reshape(B, gd, rd, 2, cd, gh, rh, 2, ch, gw, rw, 2, cw).permute(
            0, 1, 5, 9, 2, 6, 10, 3, 7, 11, 4, 8, 12
        )
        # [B, gd, gh, gw, rest, 2x2x2 cells, cell voxels]
        x = x.reshape(B, gd, gh, gw, rd * rh * rw, 8, cd * ch * cw)
        x = self[1](F.linear(x, self[0].weight.flatten(1), self[0].bias))  # [..., rest, 8, C]
        # [..., rest, C]
        x = self[3](F.linear(x.flatten(-2), cells_last(self[2].weight), self[2].bias))
        x = F.linear(x.flatten(-2), cells_last(self[4].weight), self[4].bias)  # [B, gd, gh, gw, E]
        return x.permute(0, 4, 1, 2, 3)


# In training the hmlp stem is recomputed in backward in this many parts, with or without grad
# checkpointing: its inner maps are the largest activations a context token has (9/4 C values a
# first cell) and its FLOPs a few percent of an update (experiments/NOTES.md 30)
STEM_CHUNKS = 4


def tubelet_embedding(
    patch_size: Sequence[int],
    dim: int,
    stem: str,
    cell: Sequence[int] = (1, 2, 2),
    width: float = 0.5,
) -> nn.Module:
    """The tubelet embedding, volume [B,1,D,H,W] -> [B,E,gd,gh,gw]: each token a function of its own
    tubelet's voxels only, so no masked voxel reaches a context token. 'linear': one Conv3d whose
    kernel is its stride (ViT's). 'hmlp': HMLPStem from first cells of `cell` voxels through width
    x dim channels, a nonlinear map of the same voxels. ValueError for another stem, or a tubelet
    or width hmlp cannot take (config.hmlp_stem_problem)."""
    if stem == "linear":
        return nn.Conv3d(1, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
    problem = (
        hmlp_stem_problem(patch_size, dim, cell, width)
        if stem == "hmlp"
        else f"patch_stem {stem!r}: expected linear or hmlp"
    )
    if problem:
        raise ValueError(problem)
    return HMLPStem(patch_size, dim, cell, width)


class Encoder(nn.Module):
    """Tubelet embedding + ViT. Key layout (export): patch_embed.weight/bias (the hmlp stem:
    patch_embed.{0,2,4}.*), blocks.{i}.*, norm.*"""

    def __init__(
        self,
        *,
        image_size,
        patch_size,
        dim,
        depth,
        num_heads,
        mlp_ratio,
        patch_stem: str,
        stem_cell: Sequence[int] = (1, 2, 2),
        stem_width: float = 0.5,
    ):
        super().__init__()
        self.grid, self.patch_size = (
            [s // p for s, p in zip(image_size, patch_size)],
            list(patch_size),
        )
        self.patch_embed = tubelet_embedding(patch_size, dim, patch_stem, stem_cell, stem_width)
        self.register_buffer("pos_embed", sincos_pos_embed_3d(dim, self.grid), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.checkpoint_fn: Optional[Callable] = None  # set_grad_checkpointing
        # the hmlp stem's, always (XLA: torch_xla's, runtime.use_xla_checkpoint)
        self.stem_checkpoint_fn: Callable = recompute_in_backward

    def positions(self, grid: Sequence[int]) -> torch.Tensor:
        """The sin-cos positions [N, E] of a (gd, gh, gw) token grid: the buffer for the grid it was
        built for, built anew for any other (the positions are a fixed function of the grid, so any
        input size gets its own)."""
        if list(grid) == self.grid:
            return self.pos_embed
        return sincos_pos_embed_3d(self.pos_embed.shape[1], grid).to(self.pos_embed)

    def forward(
        self, volume: torch.Tensor, keep_idx: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """volume [B,1,D,H,W] -> features [B,N,E], or [B*M,K,E] for only the tokens in keep_idx
        [B*M,K] (M mask sets per volume, volume-major)."""
        if keep_idx is None:
            x = self.embed_tubelets(volume)  # [B, E, gd, gh, gw]
            x = x.flatten(2).transpose(1, 2) + self.positions(x.shape[2:])  # [B, N, E]
        else:
            x = self.embed_kept(volume, keep_idx)  # [B*M, K, E]
        return self.norm(run_blocks(self.blocks, x, self.checkpoint_fn))

    def embed_tubelets(self, volume: torch.Tensor) -> torch.Tensor:
        """The tubelet embedding of volume [B,1,D,H,W] -> [B,E,gd,gh,gw]. Where it trains, the
        hmlp stem keeps none of its inner maps for backward but recomputes them there, a
        STEM_CHUNKS-th of the volumes (embed_kept: of the tubelets) at a time."""
        stem = self.patch_embed
        if isinstance(stem, HMLPStem) and torch.is_grad_enabled() and stem[0].weight.requires_grad:
            # [B, E, gd, gh, gw], from the chunks of B
            return torch.cat(
                [self.stem_checkpoint_fn(stem, part) for part in volume.chunk(STEM_CHUNKS)]
            )
        return stem(volume)

    def embed_kept(self, volume: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
        """The embedded tokens in keep_idx [B*M,K] with their positions, [B*M,K,E]: only their
        tubelets go through the stem. A token is a function of its own tubelet only, so this equals
        embedding every token and gathering (the context encoder sees 40% of them: the stem's cost
        falls with it)."""
        (B, _, D, H, W), (pd, ph, pw) = volume.shape, self.patch_size
        grid = (D // pd, H // ph, W // pw)
        x = volume[..., : grid[0] * pd, : grid[1] * ph, : grid[2] * pw]
        # [B,gd,gh,gw,pd,ph,pw]
        x = x.reshape(B, grid[0], pd, grid[1], ph, grid[2], pw).permute(0, 1, 3, 5, 2, 4, 6)
        tubelets = x.reshape(B, -1, pd * ph * pw)  # [B, N, V]
        # [B*M, K, V]
        kept = gather_tokens(tubelets.repeat_interleave(keep_idx.shape[0] // B, dim=0), keep_idx)
        x = self.embed_tubelets(kept.reshape(-1, 1, pd, ph, pw))  # [B*M*K, E, 1, 1, 1]
        x = x.reshape(*keep_idx.shape, -1)  # [B*M, K, E]
        return x + self.positions(grid)[keep_idx]


# pool_tokens: export's embed, encoder.py embed --pool and probe.py's read-outs
POOLS = ("mean_pool", "depth_rows")


def pool_name(pool: str) -> str:
    """pool, checked: ValueError naming the POOLS for any other name."""
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {', '.join(POOLS)}, got {pool!r}")
    return pool


def pool_tokens(tokens: torch.Tensor, grid: Sequence[int], pool: str = "mean_pool") -> torch.Tensor:
    """A volume embedding of tokens [B,N,E] on a (gd,gh,gw) grid (pool: a POOLS name). 'mean_pool':
    the mean token [B,E]. 'depth_rows': the mean of each axial (depth) row of tokens over B-scans
    and lateral positions, concatenated [B, gh*E]: what lies at which depth survives the pooling."""
    if pool_name(pool) == "mean_pool":
        return tokens.mean(1)
    # [B,gd,gh,gw,E] -> [B,gh,E] -> [B,gh*E]
    return tokens.unflatten(1, tuple(grid)).mean(dim=(1, 3)).flatten(1)


class Predictor(nn.Module):
    """Narrow transformer: context features + mask tokens at target positions -> target
    predictions."""

    def __init__(self, grid, enc_dim, dim, depth, num_heads, mlp_ratio):
        super().__init__()
        self.embed = nn.Linear(enc_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed_3d(dim, grid), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, enc_dim)
        self.checkpoint_fn: Optional[Callable] = None  # set_grad_checkpointing

    def forward(
        self, context: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> torch.Tensor:
        """context [B,Nc,E], context_idx [B,Nc], target_idx [B,Nt] -> predictions [B,Nt,E]."""
        B, n_target = target_idx.shape
        pos = self.pos_embed.unsqueeze(0).expand(B, -1, -1)  # [B, N, P]
        x = self.embed(context) + gather_tokens(pos, context_idx)  # [B, Nc, P]
        # [B, Nt, P]
        masks = self.mask_token.expand(B, n_target, -1) + gather_tokens(pos, target_idx)
        x = self.norm(run_blocks(self.blocks, torch.cat([x, masks], dim=1), self.checkpoint_fn))
        return self.proj(x[:, -n_target:])


# The Config fields VJEPA3D is built from, each a keyword argument of the same name (from_config
# passes them by name)
MODEL_FIELDS = (
    "image_size",
    "patch_size",
    "patch_stem",
    "stem_cell",
    "stem_width",
    "embed_dim",
    "depth",
    "num_heads",
    "pred_embed_dim",
    "pred_depth",
    "pred_num_heads",
    "mlp_ratio",
    "loss",
    "local_loss_weight",
    "local_loss_split",
)


class VJEPA3D(nn.Module):
    """The model trained: context encoder, predictor, EMA target encoder and the losses' heads. Its
    arguments are keyword-only and named as the Config fields of MODEL_FIELDS (from_config); their
    defaults are the recipe's, the Config defaults (RECIPE), so that VJEPA3D() is the model that the
    demo and learn.yaml train."""

    def __init__(
        self,
        *,
        image_size: Sequence[int] = RECIPE.image_size,
        patch_size: Sequence[int] = RECIPE.patch_size,
        patch_stem: str = RECIPE.patch_stem,
        stem_cell: Sequence[int] = RECIPE.stem_cell,
        stem_width: float = RECIPE.stem_width,
        embed_dim: int = RECIPE.embed_dim,
        depth: int = RECIPE.depth,
        num_heads: int = RECIPE.num_heads,
        pred_embed_dim: int = RECIPE.pred_embed_dim,
        pred_depth: int = RECIPE.pred_depth,
        pred_num_heads: int = RECIPE.pred_num_heads,
        mlp_ratio: float = RECIPE.mlp_ratio,
        loss: str = RECIPE.loss,
        local_loss_weight: float = RECIPE.local_loss_weight,
        local_loss_split: Sequence[int] = RECIPE.local_loss_split,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        self.image_size = list(image_size)
        self.grid = [s // p for s, p in zip(image_size, patch_size)]
        self.num_tokens = math.prod(self.grid)
        self.loss_type = loss
        self.encoder = Encoder(
            image_size=image_size,
            patch_size=patch_size,
            dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            patch_stem=patch_stem,
            stem_cell=stem_cell,
            stem_width=stem_width,
        )
        self.predictor = Predictor(
            grid=self.grid,
            enc_dim=embed_dim,
            dim=pred_embed_dim,
            depth=pred_depth,
            num_heads=pred_num_heads,
            mlp_ratio=mlp_ratio,
        )
        self.apply(_init_weights)
        for blocks in (self.encoder.blocks, self.predictor.blocks):
            # residual projections scaled down with depth (as in I-JEPA)
            for i, block in enumerate(blocks):
                block.attn.proj.weight.data.div_(math.sqrt(2.0 * (i + 1)))
                block.mlp.fc2.weight.data.div_(math.sqrt(2.0 * (i + 1)))
        for conv in [m for m in self.encoder.patch_embed.modules() if isinstance(m, nn.Conv3d)][
            :-1
        ]:
            # the hmlp stem's inner convolutions feed a GELU
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
        self.target_encoder = copy.deepcopy(self.encoder)
        self.target_encoder.requires_grad_(False)
        self.patch_size, self.local_loss_weight = list(patch_size), local_loss_weight
        self.local_loss_split = list(local_loss_split)
        # the rest of the model starts as it would without the local head
        with torch.random.fork_rng(devices=[]):
            self.local_head = (
                nn.Linear(embed_dim, LOCAL_FEATURES * math.prod(local_loss_split))
                if local_loss_weight > 0
                else None
            )
        self.loss_fn = jepa_loss  # compile_parts() swaps in a compiled version
        self.compiled = False  # compile_parts
        # compiled in mode reduce-overhead: train.train_update marks each update's CUDA graphs
        self.cudagraphs = False

    @classmethod
    def from_config(cls, cfg) -> "VJEPA3D":
        """The model a Config describes (its MODEL_FIELDS), with its grad_checkpointing (auto, not
        yet decided for a device: off; train.py and bench.py decide it first:
        plan.choose_auto_settings)."""
        model = cls(**{name: getattr(cfg, name) for name in MODEL_FIELDS})
        model.set_grad_checkpointing(cfg.grad_checkpointing is True)
        return model

    def set_grad_checkpointing(
        self, enabled: bool, checkpoint_fn: Callable = recompute_in_backward
    ) -> None:
        """Recompute block activations in backward: less memory, about a third more compute.
        checkpoint_fn(block, x) does it (XLA needs torch_xla's: runtime.place_model sets it
        there)."""
        self.encoder.checkpoint_fn = self.predictor.checkpoint_fn = (
            checkpoint_fn if enabled else None
        )

    @property
    def grad_checkpointing(self) -> bool:
        """Whether block activations are recomputed in backward (set_grad_checkpointing)."""
        return self.encoder.checkpoint_fn is not None

    def compile_parts(self, mode: str = "default") -> None:
        """torch.compile the encoders, the predictor and the loss in place, in torch.compile's
        `mode`. forward() itself stays eager, so its input checks (which read the host) run outside
        the compiled code, and state_dict keys do not change. Shapes are static (dynamic=False): one
        graph per part for the training update's shapes. mode "reduce-overhead" on CUDA replays each
        part's forward and backward as CUDA graphs (one launch each instead of hundreds: small
        models are bound by launches); on CPU it is the default mode."""
        for part in (self.encoder, self.target_encoder, self.predictor):
            part.compile(dynamic=False, mode=mode)
        self.loss_fn = torch.compile(jepa_loss, dynamic=False, mode=mode)
        self.compiled, self.cudagraphs = True, mode == "reduce-overhead"

    def eager(self) -> contextlib.AbstractContextManager:
        """A context in which the compiled parts run eagerly (any batch size, no recompiles:
        evaluation); for a model never compiled, nothing: a script that builds no optimizer (--help,
        a bad config, the encoder scripts) then never imports torch._dynamo, a second of its
        start."""
        return (
            torch.compiler.set_stance("force_eager") if self.compiled else contextlib.nullcontext()
        )

    def num_trainable_params(self) -> int:
        """Parameters of the context encoder and predictor (the EMA target is not trained)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def check_inputs(
        self, volume: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> None:
        """Raise ValueError naming expected and actual shapes before any compute (incident 6)."""
        check_volume(volume, self.image_size)
        B = volume.shape[0]
        for name, idx in (("context_idx", context_idx), ("target_idx", target_idx)):
            if idx.dim() not in (2, 3) or idx.shape[0] != B:
                raise ValueError(
                    f"{name}: expected shape [B={B}, num_{name[:-4]}_tokens] of token indices (or "
                    f"[B={B}, mask_sets, num_{name[:-4]}_tokens]), got {list(idx.shape)} "
                    f"(volume {list(volume.shape)})"
                )
            if idx.dtype != torch.long:
                raise ValueError(f"{name}: expected dtype torch.int64 (long), got {idx.dtype}")
        if context_idx.shape[:-1] != target_idx.shape[:-1]:
            raise ValueError(
                f"context_idx {list(context_idx.shape)} and target_idx {list(target_idx.shape)}: "
                "expected the same batch and mask-set dimensions"
            )
        if context_idx.shape[-1] + target_idx.shape[-1] > self.num_tokens:
            raise ValueError(
                f"context_idx {list(context_idx.shape)} + target_idx {list(target_idx.shape)}: "
                f"more tokens than the volume has ({self.num_tokens})"
            )
        # a range check elsewhere would force a device->host sync
        if context_idx.device.type == "cpu":
            for name, idx in (("context_idx", context_idx), ("target_idx", target_idx)):
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_tokens):
                    raise ValueError(
                        f"{name}: indices must be in [0, {self.num_tokens}), got range "
                        f"[{int(idx.min())}, {int(idx.max())}]"
                    )

    @torch.no_grad()
    def all_target_features(self, volume: torch.Tensor, rows: int) -> torch.Tensor:
        """The layer-normed EMA-encoder features of every token, repeated to `rows` = B*M rows (M
        mask sets per volume): [B*M, N, E]."""
        h = self.target_encoder(volume)
        h = F.layer_norm(h, h.shape[-1:])
        return h.repeat_interleave(rows // h.shape[0], dim=0)

    def forward(
        self, volume: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> JEPAOutput:
        """Predict target-encoder features at target_idx from the context tokens at context_idx: [B,
        Nc] and [B, Nt], or [B, M, Nc] and [B, M, Nt] for M mask sets per volume, each predicted on
        its own (pred and target are then [B*M, Nt, E]; the loss is their mean)."""
        self.check_inputs(volume, context_idx, target_idx)
        context_idx = context_idx.reshape(-1, context_idx.shape[-1])  # [B*M, Nc]
        target_idx = target_idx.reshape(-1, target_idx.shape[-1])  # [B*M, Nt]
        # [B*M, Nt, E]
        target = gather_tokens(self.all_target_features(volume, target_idx.shape[0]), target_idx)
        # [B*M, Nc, E]: the target tokens unseen
        context = self.encoder(volume, keep_idx=context_idx)
        pred = self.predictor(context, context_idx, target_idx)  # [B*M, Nt, E]
        loss, target_std = self.loss_fn(pred, target, self.loss_type)
        if self.local_head is not None:
            # [B, N, S * LOCAL_FEATURES]
            stats = token_voxel_statistics(volume, self.patch_size, self.local_loss_split)
            stats = gather_tokens(
                stats.repeat_interleave(context_idx.shape[0] // volume.shape[0], dim=0), context_idx
            )
            # from each visible token
            error = elementwise_error(self.local_head(context), stats, self.loss_type)
            loss = loss + self.local_loss_weight * error.mean()
        return JEPAOutput(loss=loss, pred=pred, target=target, target_std=target_std)

    @torch.no_grad()
    def update_target(self, momentum) -> None:
        """EMA: target <- momentum * target + (1 - momentum) * context encoder. momentum: float, or
        a 0-d device tensor (1 leaves the target exactly as it is: the NaN guard's skip)."""
        target_params = list(self.target_encoder.parameters())
        online_params = list(self.encoder.parameters())
        if not isinstance(momentum, torch.Tensor):
            torch._foreach_lerp_(target_params, online_params, 1.0 - momentum)
            return
        # target += (1 - momentum) * (online - target) in three multi-tensor ops, each a few kernels
        # on CUDA: the lerp of a tensor weight runs one per parameter there, and its Scalar weight
        # would be read on the host
        delta = torch._foreach_sub(online_params, target_params)
        torch._foreach_mul_(delta, 1.0 - momentum)
        torch._foreach_add_(target_params, delta)

    @torch.no_grad()
    def encode(self, volume: torch.Tensor) -> torch.Tensor:
        """Frozen target-encoder features of whole volumes: [B,1,D,H,W] -> [B, N, E] (eager, after
        compile_parts too)."""
        with self.eager():
            return self.target_encoder(volume)

    def encoder_state_dict(self) -> dict:
        """The target (EMA) encoder alone, for downstream use. Keys: patch_embed.{weight,bias}
        (Conv3d; the hmlp stem: patch_embed.{0,2,4}.*),
        blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}.{weight,bias},
        norm.{weight,bias}."""
        return {k: v.detach().cpu().clone() for k, v in self.target_encoder.state_dict().items()}

    def shard_units(self) -> List[nn.Module]:
        """The modules that sharding (FSDP) gathers as one unit each, innermost first: every block
        of the context encoder, predictor and target encoder (only one block's weights are whole at
        a time), both patch embeddings (the hmlp stem of a ViT-L holds 1.5 blocks' weights), then
        the target encoder (its norm; as a unit of its own it is resharded after its no-grad
        forward, so the EMA update meets shards on both sides). The rest (the context encoder's
        norm, the predictor's embedding, mask token, norm and projection, the local loss's head) is
        gathered with the model itself."""
        return [
            *self.encoder.blocks,
            *self.predictor.blocks,
            *self.target_encoder.blocks,
            self.encoder.patch_embed,
            self.target_encoder.patch_embed,
            self.target_encoder,
        ]

    def param_groups(self) -> List[dict]:
        """AdamW groups of the trained parameters, `apply_wd` marking those weight decay applies to
        (weight matrices and kernels; not biases, norms, positions, mask tokens).
        train.optimizer_step applies it."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (
                no_decay if p.ndim < 2 or "mask_token" in name or "pos_embed" in name else decay
            ).append(p)
        return [{"params": decay, "apply_wd": True}, {"params": no_decay, "apply_wd": False}]


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Conv3d)):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def transformer_flops(tokens: int, dim: int, depth: int, mlp_ratio: float) -> float:
    """Forward FLOPs of `depth` blocks over `tokens` tokens: matmuls (qkv, proj, mlp) and attention
    (QK^T, AV)."""
    linear = 2 * tokens * dim * dim * (4 + 2 * mlp_ratio)
    attention = 2 * 2 * tokens * tokens * dim
    return depth * (linear + attention)


def training_flops_per_sample(cfg) -> dict:
    """Model FLOPs of one training sample, counted from the architecture (multiply-add = 2 FLOPs).

    Trained parts cost forward + backward (3x forward); the target encoder runs forward only; the
    first convolution of the tubelet embedding needs no input gradient (2x forward). The context
    encoder embeds its own tokens only (Encoder.embed_kept), the target encoder every token; the
    local loss's head reads the visible tokens (its voxel statistics are a few passes over the
    volume)."""
    n_context, n_target = cfg.token_counts()
    n = n_context + n_target
    patch_voxels = math.prod(cfg.patch_size)
    hmlp = cfg.patch_stem == "hmlp"
    # hmlp: a cell's voxels -> C = stem_width x E, as many FLOPs a voxel at any cell size
    channels = cfg.embed_dim * cfg.stem_width if hmlp else cfg.embed_dim
    first_per_token = 2 * patch_voxels * channels
    cells = patch_voxels / math.prod(cfg.stem_cell)  # per token
    # + 2x2x2 cells -> C (2 x cells / 8 x 8C x C), last (2 x cells / 8 x C x E)
    second_and_last = 2 * cells * channels * (channels + cfg.embed_dim / 8)
    embed_per_token = first_per_token + (second_and_last if hmlp else 0)
    # the context encoder embeds its tokens only
    first, embed = n_context * first_per_token, n * embed_per_token
    context = (
        transformer_flops(n_context, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
        + n_context * embed_per_token
    )
    if cfg.local_loss_weight > 0:  # its linear head on the visible tokens
        context += 2 * n_context * cfg.embed_dim * LOCAL_FEATURES * math.prod(cfg.local_loss_split)
    predictor = (
        transformer_flops(n, cfg.pred_embed_dim, cfg.pred_depth, cfg.mlp_ratio)
        # its embedding (of Nc) and projection (to Nt tokens)
        + 2 * n * cfg.embed_dim * cfg.pred_embed_dim
    )
    target = embed + transformer_flops(n, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
    total = 3 * (context + predictor) - first + target
    return {
        "context_encoder": 3 * context - first,
        "predictor": 3 * predictor,
        "target_encoder": target,
        "total": total,
    }


def activation_bytes_per_sample(cfg) -> float:
    """Estimate of the activations kept for backward per sample (fused attention: no N x N term).

    Per pre-norm block and token: norm in/out (2), qkv (3), attention out, residual, norm2 in/out
    (2) and the MLP hidden before and after GELU (2 x mlp_ratio) values of the width, in the compute
    dtype; with grad_checkpointing only the block inputs are kept, plus all of one block's while
    backward recomputes it. The hmlp stem's two inner maps before and after GELU, 9/4 x C values per
    first cell of every context token (C = stem_width x E), are recomputed at the end of backward,
    when the blocks' are freed, a STEM_CHUNKS-th of them at a time (Encoder.embed_tubelets)."""
    n_context, n_target = cfg.token_counts()
    bytes_per_value = 2 if cfg.use_bf16 else 4
    full_block = 9 + 2 * cfg.mlp_ratio  # values per token and width
    # per block: encoder, predictor
    widths = n_context * cfg.embed_dim, (n_context + n_target) * cfg.pred_embed_dim
    values = widths[0] * cfg.depth + widths[1] * cfg.pred_depth
    values = values + max(widths) * full_block if cfg.grad_checkpointing else values * full_block
    if cfg.patch_stem == "hmlp":
        cells = math.prod(cfg.patch_size) / math.prod(cfg.stem_cell)
        # the context tokens' tubelets
        stem = n_context * cells * cfg.embed_dim * cfg.stem_width * 9 / 4
        values = max(values, stem / STEM_CHUNKS)
    return values * bytes_per_value + math.prod(cfg.image_size) * 4


def memory_per_device(cfg, model: VJEPA3D, fsdp: int, batch: int) -> dict:
    """Estimated bytes per device during an update with the weights sharded over `fsdp` devices (1:
    not sharded), at `batch` volumes per device: fp32 weights, gradients and AdamW moments of the
    trained parts, the EMA target, what a sharded run holds whole while it computes (the unit of
    shard_units() in use, the next one being gathered and one unit's gradients, plus the model's
    other weights and their gradients, whole for the update), and the activations kept for backward
    (activation_bytes_per_sample)."""
    trained = model.num_trainable_params()
    target = sum(p.numel() for p in model.target_encoder.parameters())
    seen, units = set(), []
    for unit in model.shard_units():  # innermost first: each unit's own parameters
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        units.append(sum(p.numel() for p in own))
    rest = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return {
        "weights": 4 * trained / fsdp,
        "gradients": 4 * trained / fsdp,
        "adamw": 8 * trained / fsdp,
        "ema_target": 4 * target / fsdp,
        "gathered": 0 if fsdp == 1 else 4 * (3 * max(units) + 2 * rest),
        "activations": activation_bytes_per_sample(cfg) * batch,
    }


# --------------------------------------------------------------------------------------------------
# The losses VJEPA3D.forward adds up: the JEPA loss on the masked tokens, the local loss's targets
# (each token's own voxel statistics), and feature_std, the collapse figure logged beside them.
# Objectives measured and not kept are patches: experiments/patches/.
# --------------------------------------------------------------------------------------------------


# the loss types: the per-element error of pred - target
LOSSES = {"l1": torch.abs, "mse": torch.square}


def elementwise_error(pred: torch.Tensor, target: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The per-element error of LOSSES[loss_type], in fp32; ValueError naming the known types for
    any other."""
    if loss_type not in LOSSES:
        raise ValueError(f"loss: {loss_type!r} is not one of {', '.join(LOSSES)}")
    # In fp32: XLA reduces a bf16 tensor in bf16, and a mean over thousands of terms then loses a
    # third of it.
    return LOSSES[loss_type](pred.float() - target.float())


def jepa_loss(
    pred: torch.Tensor, target: torch.Tensor, loss_type: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss, target_std) of predictions and targets [B, Nt, E]: mean l1 or mse error, and
    feature_std(target)."""
    return elementwise_error(pred, target, loss_type).mean(), feature_std(target)


# the local loss's histogram: bins over [-3, 3] standard deviations of the normalized volume
LOCAL_BINS = 16
LOCAL_FEATURES = 2 + LOCAL_BINS


@torch.no_grad()
def token_voxel_statistics(
    volume: torch.Tensor, patch_size: Sequence[int], split: Sequence[int] = (1, 1, 1)
) -> torch.Tensor:
    """The local loss's targets, in the encoder's token order: volume [B,1,D,H,W] -> [B, N, S *
    LOCAL_FEATURES]. Each token is cut into S = prod(split) sub-blocks (`split` per axis, in order),
    and each sub-block's voxels give their mean, std and LOCAL_BINS-bin histogram, layer-normed per
    sub-block (as MaskFeat's HOG)."""
    (B, _, D, H, W), (pd, ph, pw), (sd, sh, sw) = volume.shape, patch_size, split
    if pd % sd or ph % sh or pw % sw:
        raise ValueError(
            f"a tubelet of {list(patch_size)} voxels does not split into {list(split)} sub-blocks"
        )
    x = volume.float().reshape(
        B, D // pd, sd, pd // sd, H // ph, sh, ph // sh, W // pw, sw, pw // sw
    )
    # [B, gd, gh, gw, sd, sh, sw, voxels of a sub-block by axis]
    x = x.permute(0, 1, 4, 7, 2, 5, 8, 3, 6, 9)
    # [B, N, S, v voxels per sub-block]
    x = x.reshape(B, (D // pd) * (H // ph) * (W // pw), sd * sh * sw, -1)
    edges = torch.linspace(-3, 3, LOCAL_BINS + 1, device=volume.device)[1:-1]
    # each bin's share as the difference of the shares at or above its edges, one edge at a time: a
    # one-hot of every voxel would hold LOCAL_BINS x 8 bytes per voxel (1.2 GB per sample at
    # 64x384x384) [B, N, S, LOCAL_BINS - 1]
    above = torch.stack([(x >= edge).float().mean(3) for edge in edges], dim=-1)
    ones, zeros = torch.ones_like(above[..., :1]), torch.zeros_like(above[..., :1])
    # [B, N, S, LOCAL_BINS]
    histogram = torch.cat([ones, above], -1) - torch.cat([above, zeros], -1)
    stats = torch.cat([x.mean(-1, keepdim=True), x.std(-1, keepdim=True), histogram], dim=-1)
    return F.layer_norm(stats, stats.shape[-1:]).flatten(2)


def feature_std(features: torch.Tensor) -> torch.Tensor:
    """Mean over feature dims of the std over all tokens of the batch: [B,N,E] -> scalar (0 =
    collapsed)."""
    flat = features.detach().float().reshape(-1, features.shape[-1])  # [B*N, E]
    return flat.std(dim=0).mean()
