"""The pretraining objectives as config options (the local loss): it changes the loss and its
gradient as documented, and a loss or mask type nobody wrote is an error, not a silent default."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from config import CHOICES, ConfigError, load_config
from data import sample_rng
from masks import MaskGenerator
from model import LOCAL_BINS, LOSSES, VJEPA3D, gather_tokens, jepa_loss, token_voxel_statistics

IMAGE, PATCH = [8, 32, 32], [4, 8, 8]


def tiny_model(**kw):
    torch.manual_seed(0)
    # the plain JEPA loss unless a test asks for more
    plain = dict(patch_stem="linear", local_loss_weight=0.0, local_loss_split=(1, 1, 1))
    return VJEPA3D(
        image_size=IMAGE,
        patch_size=PATCH,
        embed_dim=32,
        depth=4,
        num_heads=4,
        pred_embed_dim=24,
        pred_depth=2,
        pred_num_heads=4,
        **{**plain, **kw},
    )


def batch(model, n=2):
    gen = MaskGenerator(model.grid, 0.6, "random")
    ctx, tgt = zip(*[gen(sample_rng(0, 0, i)) for i in range(n)])
    torch.manual_seed(1)
    return (
        torch.randn(n, 1, *IMAGE),
        torch.from_numpy(np.stack(ctx)),
        torch.from_numpy(np.stack(tgt)),
    )


def test_the_local_loss_asks_each_visible_token_to_keep_its_own_voxel_statistics():
    model, plain_model = tiny_model(local_loss_weight=0.5), tiny_model()
    plain_state = plain_model.state_dict()
    # same init
    assert all(
        torch.equal(v, plain_state[k]) for k, v in model.state_dict().items() if k in plain_state
    )
    volume, ctx, tgt = batch(model)
    plain, out = plain_model(volume, ctx, tgt), model(volume, ctx, tgt)
    stats = token_voxel_statistics(volume, PATCH)  # [B, N, 2 + bins]
    corner = volume[0, 0, 0:4, 0:8, 8:16]  # token 1: the second along W
    raw = torch.cat(
        [
            corner.mean()[None],
            corner.std()[None],
            torch.histc(corner.clamp(-3, 3), LOCAL_BINS, -3, 3) / corner.numel(),
        ]
    )
    assert torch.allclose(stats[0, 1], F.layer_norm(raw, raw.shape), atol=1e-4)
    visible = model.local_head(model.encoder(volume, keep_idx=ctx))
    expected = plain.loss + 0.5 * (visible - gather_tokens(stats, ctx)).abs().mean()
    assert torch.allclose(out.loss, expected, atol=1e-6)
    out.loss.backward()
    assert model.encoder.blocks[0].mlp.fc2.weight.grad.abs().sum() > 0
    # saved: resumes exactly
    assert plain_model.local_head is None and "local_head.weight" in model.state_dict()


def test_the_local_loss_can_ask_each_token_to_keep_the_statistics_of_its_depth_halves():
    volume = batch(tiny_model())[0]
    halves = token_voxel_statistics(volume, PATCH, split=(1, 2, 1))  # [B, N, 2 * F]
    # [B, 2 * N]: the grid of the halves, 2 x 8 x 4 tokens
    fine = token_voxel_statistics(volume, [4, 4, 8])
    B, N, F = fine.shape[0], halves.shape[1], fine.shape[2]
    # [gd, gh, sh, gw]
    by_token = fine.reshape(B, 2, 4, 2, 4, F).permute(0, 1, 2, 4, 3, 5).reshape(B, N, 2 * F)
    assert torch.allclose(halves, by_token)
    model = tiny_model(local_loss_weight=0.5, local_loss_split=(1, 2, 1))
    assert model.local_head.out_features == 2 * F
    model(volume, *batch(model)[1:]).loss.backward()
    with pytest.raises(ValueError, match="does not split"):
        token_voxel_statistics(volume, PATCH, split=(1, 3, 1))
    with pytest.raises(ConfigError, match="local_loss_split"):
        load_config([], local_loss_split=[1, 3, 1])


def test_without_the_local_loss_the_loss_is_the_plain_jepa_loss():
    model = tiny_model()
    volume, ctx, tgt = batch(model)
    out = model(volume, ctx, tgt)
    assert torch.allclose(out.loss, (out.pred - out.target).abs().mean())


def test_an_unknown_loss_or_mask_type_is_an_error_naming_the_known_ones():
    assert set(LOSSES) == set(CHOICES["loss"])
    with pytest.raises(ValueError, match="l1, mse"):
        jepa_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), "huber")
    with pytest.raises(ValueError, match="l1, mse"):
        tiny_model(loss="huber")
    with pytest.raises(ValueError, match="multiblock, random"):
        MaskGenerator([2, 4, 4], 0.5, "blocks")
    with pytest.raises(ConfigError, match="local_loss_weight"):
        load_config([], local_loss_weight=-0.5)
