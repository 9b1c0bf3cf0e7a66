"""The pretraining losses VJEPA3D.forward adds up (model.py): the JEPA loss on the masked tokens and
the local loss's targets (each token's own voxel statistics); feature_std, the collapse figure
logged beside them. Objectives measured and not kept are patches: experiments/patches/."""

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

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
