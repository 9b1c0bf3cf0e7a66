"""VJEPA3D: a 3D V-JEPA for OCT volumes.

  volume [B,1,D,H,W] --tubelet embedding--> tokens [B,N,E] (+ fixed 3D sin-cos positions)
  context encoder:  only the visible tokens  x[context_idx] -> [B,Nc,E]
  predictor:        context tokens + mask tokens at the target positions -> predictions [B,Nt,E]
  target encoder:   EMA copy of the context encoder over ALL tokens, no gradients,
                    layer-normed features gathered at target_idx -> [B,Nt,E]
  loss:             l1 (or mse) between prediction and target, on target tokens only; optionally (V-JEPA 2.1)
                    + context_loss_weight x the same error of a second head at the context positions, and targets
                    from target_levels encoder depths, each layer-normed on its own and concatenated [.., K*E];
                    and (DINOv3's Gram anchoring) + gram_loss_weight x the squared difference between the context
                    tokens' patch-to-patch cosine similarities and those of a frozen copy of the initial encoder;
                    and + local_loss_weight x a linear head's error on each visible token's own voxel statistics
                    (or those of its local_loss_split sub-blocks)
                    (the losses themselves: objectives.py)

The context encoder never sees the target tokens and the target encoder moves only through
update_target(momentum) (incident 12).

An exported encoder (`python encoder.py export`: config.json + model.safetensors) loads without train.py or the
checkpoint: load_encoder(DIR) -> PretrainedEncoder, volume [B,1,D,H,W] -> tokens [B,N,E] or a pooled embedding.
"""
import copy
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import Config, ConfigError, load_config
from objectives import (LOCAL_FEATURES, LOSSES, context_distance_weights, context_loss, elementwise_error, gram_loss,
                        jepa_loss, token_voxel_statistics)
from storage import exists, read_bytes, write_atomic


@dataclass
class JEPAOutput:
    """What VJEPA3D.forward returns; train.py uses only these fields (incident 7)."""
    loss: torch.Tensor  # scalar, differentiable
    pred: torch.Tensor  # [B*M, Nt, E] predictor output at the target positions (M mask sets per sample, often 1)
    target: torch.Tensor  # [B*M, Nt, E] layer-normed target-encoder features (no grad)
    target_std: torch.Tensor  # scalar, detached: mean over features of the std over target tokens (collapse -> 0)


def sincos_pos_embed_3d(dim: int, grid: Sequence[int]) -> torch.Tensor:
    """Fixed sin-cos positions [N, dim] for a (gd, gh, gw) grid; each axis gets its own band of dims."""
    per_axis = (dim // 6) * 2  # an even number of dims per axis; the remainder stays zero
    if per_axis == 0:
        raise ValueError(f"embed dim {dim} is too small for 3D sin-cos positions (need >= 6)")
    omega = 1.0 / 10000 ** (torch.arange(per_axis // 2, dtype=torch.float64) / (per_axis // 2))
    coords = torch.meshgrid(*[torch.arange(g, dtype=torch.float64) for g in grid], indexing="ij")
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
        x = F.scaled_dot_product_attention(q, k, v)  # fused kernel: no N x N matrix kept for backward
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
    """Raise ValueError naming the expected and actual shape unless volume is a float [B,1,*image_size] (incident 6)."""
    if volume.dim() != 5 or volume.shape[1] != 1 or list(volume.shape[2:]) != list(image_size):
        raise ValueError(f"volume: expected shape {['B', 1, *image_size]}, got {list(volume.shape)}")
    if not volume.is_floating_point():
        raise ValueError(f"volume: expected a floating dtype, got {volume.dtype}")


def check_encoder_input(volume: torch.Tensor, patch_size: Sequence[int], trained_size: Sequence[int]) -> None:
    """Raise ValueError naming the shapes unless volume is a float [B,1,D,H,W] whose D, H, W are positive multiples of
    patch_size (any such size gets its own positions; trained_size is named in the message)."""
    size = list(volume.shape[2:])
    if volume.dim() != 5 or volume.shape[1] != 1 or any(s < p or s % p for s, p in zip(size, patch_size)):
        raise ValueError(f"volume: expected shape [B, 1, D, H, W] with D, H, W multiples of the patch size "
                         f"{list(patch_size)} (trained on {list(trained_size)}), got {list(volume.shape)}")
    if not volume.is_floating_point():
        raise ValueError(f"volume: expected a floating dtype, got {volume.dtype}")


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpoint_fn: Optional[Callable]) -> torch.Tensor:
    """x through the blocks; with a checkpoint_fn(block, x) (grad checkpointing) each block's activations are
    recomputed in backward instead of kept."""
    for block in blocks:
        x = checkpoint_fn(block, x) if checkpoint_fn is not None and x.requires_grad else block(x)
    return x


def recompute_in_backward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's activation checkpointing of one block (the default checkpoint_fn)."""
    return checkpoint(block, x, use_reentrant=False)


def tubelet_embedding(patch_size: Sequence[int], dim: int, stem: str = "linear") -> nn.Module:
    """The tubelet embedding, volume [B,1,D,H,W] -> [B,E,gd,gh,gw]: each token a function of its own tubelet's voxels
    only, so no masked voxel reaches a context token. 'linear': one Conv3d whose kernel is its stride (ViT's).
    'hmlp' (hierarchical MLP stem, Touvron et al., ECCV 2022): 1x2x2 cells -> E/2 channels, 2x2x2 of those -> E/2,
    the rest -> E, with GELU between, each again a Conv3d whose kernel is its stride: a nonlinear map of the same
    voxels. ValueError for another stem, or a tubelet hmlp cannot cut (pd even, ph and pw multiples of 4)."""
    pd, ph, pw = patch_size
    if stem == "linear":
        return nn.Conv3d(1, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
    if stem != "hmlp" or pd % 2 or ph % 4 or pw % 4:
        raise ValueError(f"patch_stem {stem!r} with patch_size {list(patch_size)}: expected 'linear', or 'hmlp' with "
                         f"an even pd and ph, pw multiples of 4")
    rest = (pd // 2, ph // 4, pw // 4)
    return nn.Sequential(nn.Conv3d(1, dim // 2, kernel_size=(1, 2, 2), stride=(1, 2, 2)), nn.GELU(),
                         nn.Conv3d(dim // 2, dim // 2, kernel_size=(2, 2, 2), stride=(2, 2, 2)), nn.GELU(),
                         nn.Conv3d(dim // 2, dim, kernel_size=rest, stride=rest))


class Encoder(nn.Module):
    """Tubelet embedding + ViT. Key layout (export): patch_embed.weight/bias (the hmlp stem: patch_embed.{0,2,4}.*),
    blocks.{i}.*, norm.*"""

    def __init__(self, image_size, patch_size, dim, depth, num_heads, mlp_ratio, patch_stem: str = "linear"):
        super().__init__()
        self.grid = [s // p for s, p in zip(image_size, patch_size)]
        self.patch_embed = tubelet_embedding(patch_size, dim, patch_stem)
        self.register_buffer("pos_embed", sincos_pos_embed_3d(dim, self.grid), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.checkpoint_fn: Optional[Callable] = None  # set_grad_checkpointing

    def positions(self, grid: Sequence[int]) -> torch.Tensor:
        """The sin-cos positions [N, E] of a (gd, gh, gw) token grid: the buffer for the grid it was built for, built
        anew for any other (the positions are a fixed function of the grid, so any input size gets its own)."""
        if list(grid) == self.grid:
            return self.pos_embed
        return sincos_pos_embed_3d(self.pos_embed.shape[1], grid).to(self.pos_embed)

    def forward(self, volume: torch.Tensor, keep_idx: Optional[torch.Tensor] = None,
                levels: Sequence[int] = ()) -> torch.Tensor:
        """volume [B,1,D,H,W] -> features [B,N,E], or [B*M,K,E] for only the tokens in keep_idx [B*M,K]
        (M mask sets per volume, volume-major). levels (block indices, the last one the last block): the outputs of
        those blocks concatenated [.., L*E], the last one through the final norm (deep self-supervision)."""
        x = self.patch_embed(volume)  # [B, E, gd, gh, gw]
        x = x.flatten(2).transpose(1, 2) + self.positions(x.shape[2:])  # [B, N, E]
        if keep_idx is not None:
            x = gather_tokens(x.repeat_interleave(keep_idx.shape[0] // x.shape[0], dim=0), keep_idx)
        if not levels:
            return self.norm(run_blocks(self.blocks, x, self.checkpoint_fn))
        outputs = []
        for i, block in enumerate(self.blocks):
            x = run_blocks(self.blocks[i:i + 1], x, self.checkpoint_fn)
            if i in levels:
                outputs.append(x)
        return torch.cat([*outputs[:-1], self.norm(outputs[-1])], dim=-1)  # [.., L*E]


def target_level_blocks(depth: int, levels: int) -> List[int]:
    """The encoder blocks whose outputs are the targets with `levels` levels: evenly spaced, ending at the last block
    (V-JEPA 2.1 takes blocks 2, 5, 8, 11 of 12)."""
    return [round((i + 1) * depth / levels) - 1 for i in range(levels)]


def layer_norm_levels(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Each of the `levels` equal feature groups of x [.., L*E] layer-normed on its own (no affine)."""
    x = x.unflatten(-1, (levels, x.shape[-1] // levels))  # [.., L, E]
    return F.layer_norm(x, x.shape[-1:]).flatten(-2)


class Predictor(nn.Module):
    """Narrow transformer: context features + mask tokens at target positions -> target predictions. With
    `levels` > 1 it reads and predicts the concatenated levels [.., L*E]; with `context_head` it also predicts the
    targets at the context positions from its own outputs there (a second head, V-JEPA 2.1)."""

    def __init__(self, grid, enc_dim, dim, depth, num_heads, mlp_ratio, levels: int = 1, context_head: bool = False):
        super().__init__()
        self.levels = levels
        self.embed = nn.Linear(enc_dim, dim) if levels == 1 else nn.Sequential(
            nn.Linear(levels * enc_dim, enc_dim), nn.GELU(), nn.Linear(enc_dim, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed_3d(dim, grid), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, levels * enc_dim)
        self.proj_context = nn.Linear(dim, levels * enc_dim) if context_head else None
        self.checkpoint_fn: Optional[Callable] = None  # set_grad_checkpointing

    def forward(self, context: torch.Tensor, context_idx: torch.Tensor,
                target_idx: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """context [B,Nc,L*E], context_idx [B,Nc], target_idx [B,Nt] -> (predictions [B,Nt,L*E], the context head's
        predictions [B,Nc,L*E] or None without it)."""
        B, n_target = target_idx.shape
        if self.levels > 1:
            context = layer_norm_levels(context, self.levels)
        pos = self.pos_embed.unsqueeze(0).expand(B, -1, -1)  # [B, N, P]
        x = self.embed(context) + gather_tokens(pos, context_idx)  # [B, Nc, P]
        masks = self.mask_token.expand(B, n_target, -1) + gather_tokens(pos, target_idx)  # [B, Nt, P]
        x = self.norm(run_blocks(self.blocks, torch.cat([x, masks], dim=1), self.checkpoint_fn))
        context_pred = self.proj_context(x[:, :-n_target]) if self.proj_context is not None else None
        return self.proj(x[:, -n_target:]), context_pred


class VJEPA3D(nn.Module):
    def __init__(self, image_size: List[int], patch_size: List[int], embed_dim: int = 384, depth: int = 12,
                 num_heads: int = 6, pred_embed_dim: int = 192, pred_depth: int = 6, pred_num_heads: int = 6,
                 mlp_ratio: float = 4.0, loss: str = "l1", context_loss_weight: float = 0.0,
                 context_loss_distance: bool = False, target_levels: int = 1, gram_loss_weight: float = 0.0,
                 local_loss_weight: float = 0.0, local_loss_split: Sequence[int] = (1, 1, 1),
                 patch_stem: str = "linear"):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        if not 1 <= target_levels <= depth:
            raise ValueError(f"target_levels must be between 1 and depth ({depth}), got {target_levels}")
        self.image_size = list(image_size)
        self.grid = [s // p for s, p in zip(image_size, patch_size)]
        self.num_tokens = math.prod(self.grid)
        self.loss_type = loss
        self.context_loss_weight, self.context_loss_distance = context_loss_weight, context_loss_distance
        self.levels = target_level_blocks(depth, target_levels) if target_levels > 1 else []
        self.encoder = Encoder(image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, patch_stem)
        self.predictor = Predictor(self.grid, embed_dim, pred_embed_dim, pred_depth, pred_num_heads, mlp_ratio,
                                   target_levels, context_head=context_loss_weight > 0)
        self.apply(_init_weights)
        for blocks in (self.encoder.blocks, self.predictor.blocks):
            for i, block in enumerate(blocks):  # residual projections scaled down with depth (as in I-JEPA)
                block.attn.proj.weight.data.div_(math.sqrt(2.0 * (i + 1)))
                block.mlp.fc2.weight.data.div_(math.sqrt(2.0 * (i + 1)))
        for conv in [m for m in self.encoder.patch_embed.modules() if isinstance(m, nn.Conv3d)][:-1]:
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")  # the hmlp stem's inner convolutions feed a GELU
        self.target_encoder = copy.deepcopy(self.encoder)
        self.target_encoder.requires_grad_(False)
        self.gram_loss_weight = gram_loss_weight
        self.gram_teacher = copy.deepcopy(self.encoder).requires_grad_(False) if gram_loss_weight > 0 else None
        self.patch_size, self.local_loss_weight = list(patch_size), local_loss_weight
        self.local_loss_split = list(local_loss_split)
        with torch.random.fork_rng(devices=[]):  # the rest of the model starts as it would without the local head
            self.local_head = (nn.Linear(embed_dim, LOCAL_FEATURES * math.prod(local_loss_split))
                               if local_loss_weight > 0 else None)
        self.loss_fn = jepa_loss  # compile_parts() swaps in a compiled version

    @classmethod
    def from_config(cls, cfg) -> "VJEPA3D":
        model = cls(cfg.image_size, cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.pred_embed_dim,
                    cfg.pred_depth, cfg.pred_num_heads, cfg.mlp_ratio, cfg.loss, cfg.context_loss_weight,
                    cfg.context_loss_distance, cfg.target_levels, cfg.gram_loss_weight, cfg.local_loss_weight,
                    cfg.local_loss_split, cfg.patch_stem)
        model.set_grad_checkpointing(cfg.grad_checkpointing)
        return model

    def set_grad_checkpointing(self, enabled: bool, checkpoint_fn: Callable = recompute_in_backward) -> None:
        """Recompute block activations in backward: less memory, about a third more compute. checkpoint_fn(block, x)
        does it (XLA needs torch_xla's: runtime.place_model sets it there)."""
        self.encoder.checkpoint_fn = self.predictor.checkpoint_fn = checkpoint_fn if enabled else None

    @property
    def grad_checkpointing(self) -> bool:
        """Whether block activations are recomputed in backward (set_grad_checkpointing)."""
        return self.encoder.checkpoint_fn is not None

    def compile_parts(self) -> None:
        """torch.compile the encoders, the predictor and the loss in place. forward() itself stays eager, so its
        input checks (which read the host) run outside the compiled code, and state_dict keys do not change.
        Shapes are static (dynamic=False): one graph per part for the training update's shapes."""
        for part in (self.encoder, self.target_encoder, self.predictor, self.gram_teacher):
            if part is not None:
                part.compile(dynamic=False)
        self.loss_fn = torch.compile(jepa_loss, dynamic=False)

    def num_trainable_params(self) -> int:
        """Parameters of the context encoder and predictor (the EMA target is not trained)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def check_inputs(self, volume: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor) -> None:
        """Raise ValueError naming expected and actual shapes before any compute (incident 6)."""
        check_volume(volume, self.image_size)
        B = volume.shape[0]
        for name, idx in (("context_idx", context_idx), ("target_idx", target_idx)):
            if idx.dim() not in (2, 3) or idx.shape[0] != B:
                raise ValueError(f"{name}: expected shape [B={B}, num_{name[:-4]}_tokens] of token indices (or "
                                 f"[B={B}, mask_sets, num_{name[:-4]}_tokens]), got {list(idx.shape)} "
                                 f"(volume {list(volume.shape)})")
            if idx.dtype != torch.long:
                raise ValueError(f"{name}: expected dtype torch.int64 (long), got {idx.dtype}")
        if context_idx.shape[:-1] != target_idx.shape[:-1]:
            raise ValueError(f"context_idx {list(context_idx.shape)} and target_idx {list(target_idx.shape)}: "
                             f"expected the same batch and mask-set dimensions")
        if context_idx.shape[-1] + target_idx.shape[-1] > self.num_tokens:
            raise ValueError(f"context_idx {list(context_idx.shape)} + target_idx {list(target_idx.shape)}: "
                             f"more tokens than the volume has ({self.num_tokens})")
        if context_idx.device.type == "cpu":  # a range check elsewhere would force a device->host sync
            for name, idx in (("context_idx", context_idx), ("target_idx", target_idx)):
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_tokens):
                    raise ValueError(f"{name}: indices must be in [0, {self.num_tokens}), got range "
                                     f"[{int(idx.min())}, {int(idx.max())}]")

    @torch.no_grad()
    def all_target_features(self, volume: torch.Tensor, rows: int) -> torch.Tensor:
        """The layer-normed EMA-encoder features of every token, repeated to `rows` = B*M rows (M mask sets per
        volume): [B*M, N, E], or [B*M, N, L*E] with L target levels (each level layer-normed on its own)."""
        h = layer_norm_levels(self.target_encoder(volume, levels=self.levels), max(1, len(self.levels)))
        return h.repeat_interleave(rows // h.shape[0], dim=0)

    def forward(self, volume: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor) -> JEPAOutput:
        """Predict target-encoder features at target_idx from the context tokens at context_idx: [B, Nc] and
        [B, Nt], or [B, M, Nc] and [B, M, Nt] for M mask sets per volume, each predicted on its own (pred and
        target are then [B*M, Nt, E]; the loss is their mean)."""
        self.check_inputs(volume, context_idx, target_idx)
        context_idx = context_idx.reshape(-1, context_idx.shape[-1])  # [B*M, Nc]
        target_idx = target_idx.reshape(-1, target_idx.shape[-1])  # [B*M, Nt]
        h = self.all_target_features(volume, target_idx.shape[0])  # [B*M, N, L*E]
        target = gather_tokens(h, target_idx)
        context = self.encoder(volume, keep_idx=context_idx, levels=self.levels)  # [B*M, Nc, L*E]: targets unseen
        pred, context_pred = self.predictor(context, context_idx, target_idx)  # [B*M, Nt, L*E], [B*M, Nc, L*E]
        loss, target_std = self.loss_fn(pred, target, self.loss_type)
        if context_pred is not None:
            weights = (context_distance_weights(context_idx, target_idx, self.grid) if self.context_loss_distance
                       else None)
            loss = loss + self.context_loss_weight * context_loss(context_pred, gather_tokens(h, context_idx),
                                                                  self.loss_type, weights)
        if self.gram_teacher is not None:
            with torch.no_grad():
                teacher = self.gram_teacher(volume).repeat_interleave(context_idx.shape[0] // volume.shape[0], dim=0)
            student = context[..., -teacher.shape[-1]:]  # the last level: the encoder's output [B*M, Nc, E]
            loss = loss + self.gram_loss_weight * gram_loss(student, gather_tokens(teacher, context_idx))
        if self.local_head is not None:
            stats = token_voxel_statistics(volume, self.patch_size, self.local_loss_split)  # [B, N, S * LOCAL_FEATURES]
            stats = gather_tokens(stats.repeat_interleave(context_idx.shape[0] // volume.shape[0], dim=0), context_idx)
            visible = self.local_head(context[..., -self.local_head.in_features:])  # from the last level
            loss = loss + self.local_loss_weight * elementwise_error(visible, stats, self.loss_type).mean()
        return JEPAOutput(loss=loss, pred=pred, target=target, target_std=target_std)

    @torch.no_grad()
    def update_target(self, momentum) -> None:
        """EMA: target <- momentum * target + (1 - momentum) * context encoder. momentum: float or 0-d tensor."""
        target_params = list(self.target_encoder.parameters())
        online_params = list(self.encoder.parameters())
        weight = 1.0 - momentum
        if isinstance(weight, torch.Tensor):  # the Scalar overload would read a 0-d tensor on the host every update
            weight = [weight] * len(target_params)
        torch._foreach_lerp_(target_params, online_params, weight)

    @torch.no_grad()
    def encode(self, volume: torch.Tensor) -> torch.Tensor:
        """Frozen target-encoder features of whole volumes: [B,1,D,H,W] -> [B, N, E]."""
        # Eager: any batch size, no recompiles, after compile_parts() too. A context, not a decorator: importing
        # model.py then does not import torch._dynamo (seconds of every script's --help).
        with torch.compiler.set_stance("force_eager"):
            return self.target_encoder(volume)

    def encoder_state_dict(self) -> dict:
        """The target (EMA) encoder alone, for downstream use. Keys: patch_embed.{weight,bias} (Conv3d; the hmlp
        stem: patch_embed.{0,2,4}.*), blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}.{weight,bias},
        norm.{weight,bias}."""
        return {k: v.detach().cpu().clone() for k, v in self.target_encoder.state_dict().items()}

    def shard_units(self) -> List[nn.Module]:
        """The modules that sharding (FSDP) gathers as one unit each, innermost first: every block of the context
        encoder, predictor and target encoder (only one block's weights are whole at a time), then the target
        encoder (its patch embedding and norm; as a unit of its own it is resharded after its no-grad forward, so
        the EMA update meets shards on both sides). The rest (the context encoder's patch embedding and norm, the
        predictor's embedding, mask token, norm and projection) is gathered with the model itself."""
        teacher = [*self.gram_teacher.blocks, self.gram_teacher] if self.gram_teacher is not None else []
        return [*self.encoder.blocks, *self.predictor.blocks, *self.target_encoder.blocks, self.target_encoder, *teacher]

    def param_groups(self) -> List[dict]:
        """AdamW groups of the trained parameters, `apply_wd` marking those weight decay applies to (weight
        matrices and kernels; not biases, norms, positions, mask tokens). train.optimizer_step applies it."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 or "mask_token" in name or "pos_embed" in name else decay).append(p)
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
    """Forward FLOPs of `depth` blocks over `tokens` tokens: matmuls (qkv, proj, mlp) and attention (QK^T, AV)."""
    linear = 2 * tokens * dim * dim * (4 + 2 * mlp_ratio)
    attention = 2 * 2 * tokens * tokens * dim
    return depth * (linear + attention)


def training_flops_per_sample(cfg) -> dict:
    """Model FLOPs of one training sample, counted from the architecture (multiply-add = 2 FLOPs).

    Trained parts cost forward + backward (3x forward); the target encoder (and the Gram teacher, with Gram
    anchoring) runs forward only; the first convolution of the tubelet embedding needs no input gradient (2x
    forward). The embedding reads every token's voxels, masked or not."""
    n_context, n_target = cfg.token_counts()
    n = n_context + n_target
    patch_voxels = math.prod(cfg.patch_size)
    hmlp = cfg.patch_stem == "hmlp"
    first = 2 * n * patch_voxels * (cfg.embed_dim // 2 if hmlp else cfg.embed_dim)  # hmlp: 4 voxels -> E/2 per cell
    embed = first + (n * patch_voxels * cfg.embed_dim ** 2 * 5 / 32 if hmlp else 0)  # its 2x2x2 and last convolutions
    context = transformer_flops(n_context, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
    predictor = (transformer_flops(n, cfg.pred_embed_dim, cfg.pred_depth, cfg.mlp_ratio)
                 + 2 * n_context * cfg.embed_dim * cfg.pred_embed_dim + 2 * n_target * cfg.pred_embed_dim * cfg.embed_dim)
    target = embed + transformer_flops(n, cfg.embed_dim, cfg.depth, cfg.mlp_ratio)
    teacher = target if cfg.gram_loss_weight > 0 else 0
    total = 3 * embed - first + 3 * (context + predictor) + target + teacher
    return {"context_encoder": 3 * embed - first + 3 * context, "predictor": 3 * predictor, "target_encoder": target,
            "gram_teacher": teacher, "total": total}


def activation_bytes_per_sample(cfg) -> float:
    """Estimate of the activations kept for backward per sample (fused attention: no N x N term).

    Per pre-norm block and token: norm in/out (2), qkv (3), attention out, residual, norm2 in/out (2) and the
    MLP hidden before and after GELU (2 x mlp_ratio) values of the width, in the compute dtype; with
    grad_checkpointing only the block inputs are kept, plus all of one block's while backward recomputes it. The hmlp
    stem keeps its two inner maps before and after GELU for every token: 9/32 x E values per voxel."""
    n_context, n_target = cfg.token_counts()
    bytes_per_value = 2 if cfg.use_bf16 else 4
    full_block = 9 + 2 * cfg.mlp_ratio  # values per token and width
    widths = n_context * cfg.embed_dim, (n_context + n_target) * cfg.pred_embed_dim  # per block: encoder, predictor
    values = widths[0] * cfg.depth + widths[1] * cfg.pred_depth
    values = values + max(widths) * full_block if cfg.grad_checkpointing else values * full_block
    if cfg.patch_stem == "hmlp":
        values += math.prod(cfg.image_size) * cfg.embed_dim * 9 / 32
    return values * bytes_per_value + math.prod(cfg.image_size) * 4


def memory_per_device(cfg, model: VJEPA3D, fsdp: int, batch: int) -> dict:
    """Estimated bytes per device during an update with the weights sharded over `fsdp` devices (1: not sharded),
    at `batch` volumes per device: fp32 weights, gradients and AdamW moments of the trained parts, the EMA target,
    what a sharded run holds whole while it computes (the unit of shard_units() in use, the next one being gathered
    and one unit's gradients, plus the model's other weights and their gradients, whole for the update), and the
    activations kept for backward (activation_bytes_per_sample)."""
    trained = model.num_trainable_params()
    target = sum(p.numel() for p in model.target_encoder.parameters())
    seen, units = set(), []
    for unit in model.shard_units():  # innermost first: each unit's own parameters
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        units.append(sum(p.numel() for p in own))
    rest = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return {"weights": 4 * trained / fsdp, "gradients": 4 * trained / fsdp, "adamw": 8 * trained / fsdp,
            "ema_target": 4 * target / fsdp, "gathered": 0 if fsdp == 1 else 4 * (3 * max(units) + 2 * rest),
            "activations": activation_bytes_per_sample(cfg) * batch}


# ----------------------------------------------------------------------------------------------------------
# The exported encoder: config.json (architecture, preprocessing contract, provenance) + model.safetensors
# ----------------------------------------------------------------------------------------------------------

EXPORT_FORMAT = "octjepa-encoder"
EXPORT_VERSION = 3  # bump when config.json or the weights' layout changes meaning; newer exports are refused
# (2: architecture.patch_stem; 3: the weights bind all of config.json, provenance and code files' sha256 included)
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"  # the names Hugging Face's hub tools read
EARLIER_WEIGHTS_FILE = "encoder.safetensors"  # what exports before 2026-11-25 named their weights
ARCHITECTURE_FIELDS = ("image_size", "patch_size", "patch_stem", "embed_dim", "depth", "num_heads", "mlp_ratio")
VERSION_1_ARCHITECTURE = {"patch_stem": "linear"}  # the fields format_version 1 did not write, as they were then
PREPROCESSING_FIELDS = ("image_size", "target_spacing", "missing_spacing", "clip_percentiles", "sop_classes")
AUGMENTATION_FIELDS = ("flip_prob", "intensity_jitter")  # training-time only: fine-tuning uses them
PREPROCESSING_STEPS = (  # what data.load_val_sample does with the fields above; documentation in config.json
    "read the DICOM volume [D,H,W] (frames, rows = depth, columns)",
    "resample to target_spacing mm (none: resize to image_size), anti-aliased",
    "clip to the volume's own clip_percentiles and map onto the full range of its storage type",
    "crop or zero-pad to image_size: centred, and axially centred on the retina (intensity-weighted mean row)",
    "normalize: zero mean and unit standard deviation over the cropped volume",
)
POOLS = ("mean_pool", "depth_rows")  # pool_tokens: export's embed, encoder.py embed --pool and probe.py's read-outs
POOL_ALIASES = {"mean": "mean_pool", "axial": "depth_rows"}  # the names embed --pool took before; still accepted


class ExportError(ConfigError):
    """An encoder export that cannot be loaded as it is: the message names the file, key or field."""
    prefix = "encoder export error: "


def export_config(cfg: Config, source: dict) -> dict:
    """The config.json of an export of an encoder trained with cfg (save_encoder adds the weights' checksum):
    architecture, the preprocessing contract, training-time augmentation and `source` (where the weights came from:
    checkpoint, update, the run's plan and config)."""
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION,
            "architecture": {k: getattr(cfg, k) for k in ARCHITECTURE_FIELDS},
            "preprocessing": {**{k: getattr(cfg, k) for k in PREPROCESSING_FIELDS}, "steps": list(PREPROCESSING_STEPS)},
            "augmentation": {k: getattr(cfg, k) for k in AUGMENTATION_FIELDS},
            "input_sizes": {"trained": [list(cfg.image_size)], "accepted": "any [D, H, W] that is a multiple of "
                            "patch_size: the sin-cos positions are built for its token grid"},
            "source": source}


def export_settings(config: dict, where: str = CONFIG_FILE) -> Config:
    """A Config holding an export's architecture, preprocessing and augmentation (the rest at defaults), for
    data.load_val_sample and fine-tuning. Raises ExportError naming the field that is missing or wrong."""
    if config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{where}: format is {config.get('format')!r}, expected {EXPORT_FORMAT!r}; export a "
                          f"checkpoint with `python encoder.py export --ckpt CKPT --out DIR`.")
    version = config.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= EXPORT_VERSION:
        raise ExportError(f"{where}: format_version {version!r} is not one this octjepa reads (1 to {EXPORT_VERSION});"
                          f" load it with the octjepa version that wrote it.")
    fields = {}
    for section, names in (("architecture", ARCHITECTURE_FIELDS), ("preprocessing", PREPROCESSING_FIELDS),
                           ("augmentation", AUGMENTATION_FIELDS)):
        values = config.get(section)
        if not isinstance(values, dict):
            raise ExportError(f"{where}: no '{section}' section.")
        if section == "architecture" and version == 1:
            values = {**VERSION_1_ARCHITECTURE, **values}
        extra = set(values) - set(names) - ({"steps"} if section == "preprocessing" else set())
        missing = [n for n in names if n not in values]
        if missing or extra:
            raise ExportError(f"{where}: {section}." + (f"{missing[0]} is missing" if missing else
                                                        f"{sorted(extra)[0]} is not a field of this format"))
        if "image_size" in names and "image_size" in fields and values["image_size"] != fields["image_size"]:
            raise ExportError(f"{where}: {section}.image_size {values['image_size']} differs from "
                              f"architecture.image_size {fields['image_size']}.")
        fields.update({n: values[n] for n in names})
    try:
        return load_config([], **fields)
    except ConfigError as e:
        raise ExportError(f"{where}: {e}") from None


def pool_name(pool: str) -> str:
    """The POOLS name of a pool given by that name or an old one (POOL_ALIASES); ValueError for any other."""
    name = POOL_ALIASES.get(pool, pool)
    if name not in POOLS:
        raise ValueError(f"pool: expected one of {', '.join(POOLS)} (or {', '.join(POOL_ALIASES)}), got {pool!r}")
    return name


def pool_tokens(tokens: torch.Tensor, grid: Sequence[int], pool: str = "mean_pool") -> torch.Tensor:
    """A volume embedding of tokens [B,N,E] on a (gd,gh,gw) grid (pool: a POOLS name, or an old one). 'mean_pool': the
    mean token [B,E]. 'depth_rows': the mean of each axial (depth) row of tokens over B-scans and lateral positions,
    concatenated [B, gh*E]: what lies at which depth survives the pooling."""
    if pool_name(pool) == "mean_pool":
        return tokens.mean(1)
    return tokens.unflatten(1, tuple(grid)).mean(dim=(1, 3)).flatten(1)  # [B,gd,gh,gw,E] -> [B,gh,E] -> [B,gh*E]


class ExportedEncoder(Encoder):
    """An encoder built from an export's config.json (a dict; nothing else of octjepa needed). forward: volume
    [B,1,D,H,W] with D, H, W multiples of patch_size (the trained image_size, or any other: positions are built for
    its grid) -> tokens [B,N,E]; embed: -> [B,E] (pool 'mean_pool') or [B, gh*E] ('depth_rows'). Its state_dict keys are those
    of the export's weights file."""

    def __init__(self, config: dict):
        a = {**VERSION_1_ARCHITECTURE, **config["architecture"]}
        super().__init__(a["image_size"], a["patch_size"], a["embed_dim"], a["depth"], a["num_heads"], a["mlp_ratio"],
                         a["patch_stem"])
        self.architecture = a  # config.json's, with the fields its format_version did not write
        self.config = config
        self.image_size, self.patch_size, self.embed_dim = list(a["image_size"]), list(a["patch_size"]), a["embed_dim"]

    def forward(self, volume: torch.Tensor, keep_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """volume [B,1,D,H,W] -> tokens [B,N,E] (or [B*M,K,E] for keep_idx, as Encoder.forward); the shape is
        checked."""
        check_encoder_input(volume, self.patch_size, self.image_size)
        return super().forward(volume, keep_idx)

    def token_grid(self, volume: torch.Tensor) -> List[int]:
        """The (gd, gh, gw) token grid of a volume [B,1,D,H,W]."""
        return [s // p for s, p in zip(volume.shape[2:], self.patch_size)]

    def embed(self, volume: torch.Tensor, pool: str = "mean_pool") -> torch.Tensor:
        """The pooled embedding of a volume [B,1,D,H,W] (pool_tokens)."""
        return pool_tokens(self(volume), self.token_grid(volume), pool)

    def embedding_size(self, pool: str = "mean_pool") -> int:
        """The width of embed(volume, pool) at the trained image_size: E for 'mean_pool', gh*E for 'depth_rows'."""
        return self.embed_dim * (self.grid[1] if pool_name(pool) == "depth_rows" else 1)

    @torch.no_grad()
    def encode(self, volume: torch.Tensor) -> torch.Tensor:
        """Frozen tokens [B,N,E] without gradients, as VJEPA3D.encode gives them (labels.encode_volumes uses either)."""
        return self(volume)


MONAI_VIT_KEYS = (("patch_embed.", "patch_embedding.patch_embeddings."), (".attn.proj.", ".attn.out_proj."),
                  (".mlp.fc1.", ".mlp.linear1."), (".mlp.fc2.", ".mlp.linear2."))  # Encoder key -> monai ViT key


def monai_vit(encoder: ExportedEncoder, img_size: Optional[Sequence[int]] = None) -> nn.Module:
    """The encoder as MONAI's 3D ViT (monai.networks.nets.ViT, the backbone of its UNETR) for inputs of img_size
    (default: the trained size; any multiple of patch_size): the same weights, and the encoder's sin-cos positions
    copied in (MONAI builds its own in another axis order). vit(volume)[0] equals encoder(volume). Needs monai.
    ValueError for the hmlp stem: MONAI's ViT embeds each tubelet with one linear map."""
    a = encoder.architecture
    if a["patch_stem"] != "linear":
        raise ValueError(f"monai_vit: this encoder's patch_stem is {a['patch_stem']!r}; MONAI's ViT embeds each "
                         f"tubelet with one linear map (patch_stem 'linear'), so it cannot hold these weights. Use "
                         f"the encoder itself as the backbone (tokens [B,N,E] = encoder(volume)).")
    from monai.networks.nets import ViT
    size = list(img_size or encoder.image_size)
    vit = ViT(in_channels=1, img_size=size, patch_size=encoder.patch_size, hidden_size=a["embed_dim"],
              mlp_dim=int(a["embed_dim"] * a["mlp_ratio"]), num_layers=a["depth"], num_heads=a["num_heads"],
              proj_type="conv", pos_embed_type="sincos", classification=False, dropout_rate=0.0, spatial_dims=3,
              qkv_bias=True)
    state = vit.state_dict()  # its norm_cross_attn (unused without cross-attention) stays as built
    for key, value in encoder.state_dict().items():
        for ours, theirs in MONAI_VIT_KEYS:
            key = key.replace(ours, theirs)
        state[key] = value
    grid = [s // p for s, p in zip(size, encoder.patch_size)]
    state["patch_embedding.position_embeddings"] = encoder.positions(grid)[None].detach().clone()  # [1, N, E]
    vit.load_state_dict(state, strict=True)
    return vit.eval()


class PretrainedEncoder(ExportedEncoder):
    """An exported encoder with its export's settings checked: `settings` is a Config of its architecture,
    preprocessing and augmentation (data.load_val_sample(path, encoder.settings) preprocesses a DICOM file)."""

    def __init__(self, config: dict, where: str = CONFIG_FILE):
        settings = export_settings(config, where)  # validated before anything is built from it
        super().__init__(config)
        self.settings = settings


def random_encoder(config: dict, seed: int) -> PretrainedEncoder:
    """A random init of an export's architecture: the target encoder of a VJEPA3D built after torch.manual_seed(seed),
    as pretraining starts and as probe.load_model('random') builds it (the same weights, given the export's training
    config: the predictor's size moves the random stream). The floor to beat; the global RNG is left as it was."""
    source = config.get("source") or {}
    config = {**{k: v for k, v in config.items() if k != "weights"}, "source": {"encoder": "random init", "seed": seed}}
    encoder = PretrainedEncoder(config)
    try:
        cfg = load_config([], **source["training_config"])
    except (KeyError, TypeError, ConfigError):  # no training config (e.g. a fine-tuned export): the predictor's default
        cfg = encoder.settings
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        encoder.load_state_dict(VJEPA3D.from_config(cfg).encoder_state_dict())
    return encoder.eval()


def _sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
CONTRACT_SECTIONS = ("architecture", "preprocessing", "augmentation")  # config.json's parts bound to the weights


def export_contract(config: dict) -> str:
    """What the weights are bound to, as canonical JSON (save_encoder stores it in their metadata): from format 3 on
    all of config.json but their own sha256 (provenance and the code files' sha256 too), before CONTRACT_SECTIONS."""
    sections = CONTRACT_SECTIONS if config.get("format_version", 1) < 3 else sorted(set(config) - {"weights"})
    return json.dumps({k: config.get(k) for k in sections}, sort_keys=True)


def save_encoder(state: dict, config: dict, directory: str) -> None:
    """Write an export to a local or gs:// folder: model.safetensors (the Encoder state `state`, with the export's
    contract in its metadata), then config.json with the weights' sha256, each atomically (config.json last: an
    export without it is incomplete)."""
    weights = safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()},
                                     metadata={"format": EXPORT_FORMAT, "format_version": str(EXPORT_VERSION),
                                               "contract": export_contract(config)})
    config = {**config, "weights": {"file": WEIGHTS_FILE, "sha256": _sha256(weights)}}
    write_atomic(f"{directory.rstrip('/')}/{WEIGHTS_FILE}", weights)
    write_atomic(f"{directory.rstrip('/')}/{CONFIG_FILE}", (json.dumps(config, indent=2) + "\n").encode())


def read_export_config(directory: str) -> dict:
    """The config.json of an export; ExportError when it is missing or not JSON."""
    path = f"{directory.rstrip('/')}/{CONFIG_FILE}"
    try:
        config = json.loads(read_bytes(path))
    except FileNotFoundError:
        raise ExportError(f"{path} not found; export a checkpoint with `python encoder.py export --ckpt CKPT --out "
                          f"{directory}`.") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ExportError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path} holds a JSON {type(config).__name__}, not the object an export writes; export the "
                          f"checkpoint again.")
    return config


def weights_header(payload: bytes, path: str) -> dict:
    """The header of a safetensors payload ({key: {dtype, shape, data_offsets}, '__metadata__': {...}}), read
    without loading a tensor; ExportError when the file is cut short or not safetensors."""
    try:
        size = int.from_bytes(payload[:8], "little")
        header = json.loads(payload[8:8 + size])
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ExportError(f"{path} is not a safetensors file ({e!r}); export the checkpoint again.") from None
    if len(payload) != 8 + size + end:
        raise ExportError(f"{path} is {len(payload)} bytes, its header says {8 + size + end}: cut short or padded; "
                          f"copy the whole export again.")
    return header


def check_bound(config: dict, header: dict, directory: str) -> None:
    """That config.json is what the weights were exported with (export_contract, in their metadata since format 2):
    ExportError naming each field that differs, or for weights that carry none (saved again without it)."""
    bound, where = (header.get("__metadata__") or {}).get("contract"), f"{directory.rstrip('/')}/{CONFIG_FILE}"
    if bound is None and config.get("format_version", 1) >= 2:
        raise ExportError(f"{directory.rstrip('/')}/{WEIGHTS_FILE} carries no export contract in its metadata (saved "
                          f"again without it, or by another tool) while {where} says format 2 or later; export the "
                          f"checkpoint again.")
    if bound is not None and bound != export_contract(config):
        signed, given = ({f"{s}.{k}".rstrip("."): x for s, v in json.loads(c).items()
                          for k, x in (v.items() if isinstance(v, dict) else [("", v)])}
                         for c in (bound, export_contract(config)))
        changed = [f"{k}: {str(signed.get(k))[:80]} -> {str(given.get(k))[:80]}" for k in sorted({*signed, *given})
                   if signed.get(k) != given.get(k)]
        raise ExportError(f"{where} differs from what its weights were exported with ({'; '.join(changed)}): it was "
                          f"edited, or the weights belong to another export; export the checkpoint again.")


def load_encoder(directory: str) -> PretrainedEncoder:
    """The encoder exported to `directory` (local or gs://), in eval mode on the CPU, running no code of the folder.
    The weights must match config.json exactly (sha256, check_bound, every key, shape and dtype: all checked before
    the architecture is built), and so must the code files. Raises ExportError naming the file, key or field."""
    config = read_export_config(directory)
    settings = export_settings(config, f"{directory.rstrip('/')}/{CONFIG_FILE}")  # every field, before any weight
    for code, digest in (config.get("code") or {}).items():  # what torch.hub and `import octjepa_encoder` would run
        code = f"{directory.rstrip('/')}/{str(code).rsplit('/', 1)[-1]}"  # a file left out runs nothing
        if exists(code) and _sha256(read_bytes(code)) != digest:
            raise ExportError(f"{code} is not the file that was exported (its sha256 differs from {CONFIG_FILE} "
                              f"code): torch.hub.load and `import octjepa_encoder` would run it; export it again.")
    weights = config.get("weights") if isinstance(config.get("weights"), dict) else {}
    name = weights.get("file") if weights.get("file") in (WEIGHTS_FILE, EARLIER_WEIGHTS_FILE) else WEIGHTS_FILE
    path = f"{directory.rstrip('/')}/{name}"
    try:
        payload = read_bytes(path)
    except FileNotFoundError:
        raise ExportError(f"{path} not found (config.json without its weights: copy the whole export folder).") \
            from None
    if _sha256(payload) != weights.get("sha256"):
        raise ExportError(f"{path}: its sha256 {_sha256(payload)[:16]}... differs from {CONFIG_FILE} "
                          f"weights.sha256 {str(weights.get('sha256'))[:16]}...: the weights were changed or belong to "
                          f"another export.")
    header = weights_header(payload, path)
    check_bound(config, header, directory)
    with torch.device("meta"):  # the architecture's shapes without its memory: checked before it is built
        expected = {k: (v.shape, v.dtype) for k, v in
                    PretrainedEncoder(config, f"{directory.rstrip('/')}/{CONFIG_FILE}").state_dict().items()}
    found = {k: (torch.Size(t["shape"]), t["dtype"]) for k, t in header.items() if k != "__metadata__"}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        problem = f"key {missing[0]} is missing" if missing else f"unexpected key {unexpected[0]}"
        raise ExportError(f"{path}: {problem} for the architecture in {CONFIG_FILE} ({settings.depth} blocks "
                          f"of width {settings.embed_dim}).")
    for key, (shape, dtype) in found.items():
        if shape != expected[key][0] or SAFETENSORS_DTYPES.get(dtype) != expected[key][1]:
            raise ExportError(f"{path}: key {key} is {SAFETENSORS_DTYPES.get(dtype, dtype)} {list(shape)}, the "
                              f"architecture in {CONFIG_FILE} needs {expected[key][1]} {list(expected[key][0])}.")
    encoder = PretrainedEncoder(config, f"{directory.rstrip('/')}/{CONFIG_FILE}")
    encoder.load_state_dict(safetensors.torch.load(payload), strict=True)
    return encoder.eval()
