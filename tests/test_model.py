"""VJEPA3D: a real JEPA (incident 12), one output dataclass (incident 7), shape errors before
compute (incident 6)."""

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch

from config import load_config
from data import sample_rng
from masks import MaskGenerator
from model import (
    LOCAL_FEATURES,
    VJEPA3D,
    JEPAOutput,
    gather_tokens,
    sincos_pos_embed_3d,
    training_flops_per_sample,
    tubelet_embedding,
)
from runtime import with_input_gradient

IMAGE, PATCH = [8, 32, 32], [4, 8, 8]


def tiny_model(**kw):
    torch.manual_seed(0)
    args = dict(
        embed_dim=64,
        depth=2,
        num_heads=4,
        pred_embed_dim=48,
        pred_depth=2,
        pred_num_heads=4,
        # the plain V-JEPA unless a test asks for the recipe
        patch_stem="linear",
        local_loss_weight=0.0,
        local_loss_split=(1, 1, 1),
    )
    args.update(kw)
    return VJEPA3D(image_size=IMAGE, patch_size=PATCH, **args)


def masks(model, batch, seed=0, ratio=0.6):
    gen = MaskGenerator(model.grid, ratio)
    ctx, tgt = zip(*[gen(sample_rng(seed, 0, i)) for i in range(batch)])
    return torch.from_numpy(np.stack(ctx)), torch.from_numpy(np.stack(tgt))


def test_production_config_is_the_29_4m_vjepa3d_plus_the_recipes_hmlp_stem_and_local_loss_head():
    """The old system's 29.4M-parameter V-JEPA3D (linear stem, no local loss); the recipe adds its
    hmlp stem's convolutions (in place of the one linear map) and the local loss's linear head, and
    nothing else."""
    cfg = load_config(["--config", "configs/pretrain_single_domain.yaml"])
    assert cfg.patch_stem == "hmlp" and cfg.local_loss_weight > 0
    with torch.device("meta"):
        model = VJEPA3D.from_config(cfg)
        plain = VJEPA3D.from_config(
            dataclasses.replace(cfg, patch_stem="linear", local_loss_weight=0.0)
        )
    n, n_plain = model.num_trainable_params(), plain.num_trainable_params()
    print(
        f"production VJEPA3D trainable parameters: {n:,} ({n_plain:,} with a linear stem and no"
        " local loss)"
    )
    assert abs(n_plain - 29.4e6) / 29.4e6 < 0.03
    e, voxels, cell = cfg.embed_dim, math.prod(cfg.patch_size), math.prod(cfg.stem_cell)
    c = round(e * cfg.stem_width)  # the stem's inner channels
    # the first cell, 2x2x2 of those, the rest
    hmlp = (cell + 1) * c + (8 * c + 1) * c + (voxels // (8 * cell) * c + 1) * e
    local_head = (e + 1) * LOCAL_FEATURES * math.prod(cfg.local_loss_split)
    assert n - n_plain == hmlp - (voxels + 1) * e + local_head


def test_dry_run_memory_says_a_vit_g_will_not_fit_a_16_gib_device_unless_sharded():
    from plan import describe_memory

    cfg = load_config(["--config", "configs/pretrain_vitg.yaml"])
    with torch.device("meta"):
        model = VJEPA3D.from_config(cfg)
    # ViT-g's blocks
    assert abs(sum(p.numel() for p in model.encoder.blocks.parameters()) - 1.0e9) / 1.0e9 < 0.05
    whole = describe_memory(cfg, model, fsdp=1, batch=1)
    # grad checkpointing (auto: counted on): the hmlp stem's inner maps are recomputed a
    # STEM_CHUNKS-th at a time (from 1x2x2 cells, all at once, they were 7 GiB at 64x384x384)
    assert "will NOT fit TPU v5e (16 GiB); fits L4 (24 GiB)" in whole
    sharded = describe_memory(cfg, model, fsdp=16, batch=1)
    assert "weights sharded over 16 devices" in sharded and "fits every named device" in sharded


def test_sharding_divides_the_weights_and_optimizer_state_but_not_the_activations():
    from model import memory_per_device

    cfg = load_config(["--config", "configs/pretrain_vitl.yaml"])
    with torch.device("meta"):
        model = VJEPA3D.from_config(cfg)
    whole, sharded = (memory_per_device(cfg, model, fsdp, batch=2) for fsdp in (1, 8))
    for part in ("weights", "gradients", "adamw", "ema_target"):
        assert sharded[part] == whole[part] / 8
    assert sharded["activations"] == whole["activations"] > 0
    # a few blocks gathered at a time
    assert whole["gathered"] == 0 < sharded["gathered"] < whole["weights"] / 4
    assert whole["weights"] == 4 * model.num_trainable_params()


def test_forward_returns_the_documented_output_with_loss_on_target_tokens():
    model = tiny_model()
    ctx, tgt = masks(model, 2)
    out = model(torch.randn(2, 1, *IMAGE), ctx, tgt)
    assert isinstance(out, JEPAOutput)
    assert out.pred.shape == out.target.shape == (2, tgt.shape[1], 64)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.target_std.ndim == 0 and not out.target_std.requires_grad and out.target_std > 0
    assert torch.allclose(out.loss, (out.pred - out.target).abs().mean())


def test_gradients_reach_context_encoder_and_predictor_but_never_the_target():
    model = tiny_model()
    ctx, tgt = masks(model, 2)
    model(torch.randn(2, 1, *IMAGE), ctx, tgt).loss.backward()
    for name, p in model.named_parameters():
        if name.startswith("target_encoder."):
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_context_encoder_never_sees_target_tokens():
    model = tiny_model()
    ctx, tgt = masks(model, 1)
    x = torch.randn(1, 1, *IMAGE)
    before = model.encoder(x, keep_idx=ctx)
    # Scramble every target tubelet: the context features must not change.
    grid = model.grid
    y = x.clone().view(1, 1, grid[0], 4, grid[1], 8, grid[2], 8)
    for t in tgt[0].tolist():
        d, rest = divmod(t, grid[1] * grid[2])
        h, w = divmod(rest, grid[2])
        y[0, 0, d, :, h, :, w, :] = torch.randn(4, 8, 8) * 10
    after = model.encoder(y.view_as(x), keep_idx=ctx)
    assert torch.allclose(before, after, atol=1e-5)


def test_update_target_moves_exactly_by_the_given_momentum():
    model = tiny_model()
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.add_(torch.randn_like(p))
    old_target = [p.clone() for p in model.target_encoder.parameters()]
    online = [p.clone() for p in model.encoder.parameters()]
    model.update_target(0.9)
    for new, old, o in zip(model.target_encoder.parameters(), old_target, online):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * o, rtol=1e-6, atol=1e-6)
    model.update_target(torch.tensor(1.0))
    for new, old, o in zip(model.target_encoder.parameters(), old_target, online):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * o, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make_inputs,expected",
    [
        (
            lambda c, t: (torch.randn(2, *IMAGE), c, t),
            r"volume: expected shape \['B', 1, 8, 32, 32\], got \[2, 8, 32, 32\]",
        ),
        (lambda c, t: (torch.randn(2, 1, 8, 32, 16), c, t), r"got \[2, 1, 8, 32, 16\]"),
        (
            lambda c, t: (torch.randn(2, 1, *IMAGE), torch.zeros(*IMAGE, dtype=torch.long), t),
            r"context_idx: expected shape \[B=2, .*got \[8, 32, 32\]",
        ),
        (
            lambda c, t: (torch.randn(2, 1, *IMAGE), c, t.int()),
            r"target_idx: expected dtype torch.int64",
        ),
        (
            lambda c, t: (torch.randn(2, 1, *IMAGE), c, t + 1000),
            r"target_idx: indices must be in \[0, 32\)",
        ),
        (lambda c, t: (torch.randn(2, 1, *IMAGE), c[:1], t), r"context_idx: expected shape \[B=2"),
    ],
)
def test_wrong_inputs_raise_value_error_naming_the_shapes(make_inputs, expected):
    model = tiny_model()
    ctx, tgt = masks(model, 2)
    with pytest.raises(ValueError, match=expected):
        model(*make_inputs(ctx, tgt))


def test_positions_are_distinct_for_anisotropic_grids():
    emb = sincos_pos_embed_3d(96, (3, 5, 7))
    assert emb.shape == (105, 96)
    assert torch.cdist(emb, emb).add(torch.eye(105) * 1e3).min() > 1e-3


def test_weight_decay_skips_biases_norms_and_mask_token():
    model = tiny_model()
    decay, no_decay = model.param_groups()
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert any("mask_token" in names[id(p)] for p in no_decay["params"])
    assert all("target_encoder" not in names[id(p)] for p in decay["params"] + no_decay["params"])


def test_encode_and_exported_encoder_give_the_same_features():
    model = tiny_model()
    x = torch.randn(2, 1, *IMAGE)
    feats = model.encode(x)
    assert feats.shape == (2, model.num_tokens, 64) and not feats.requires_grad
    fresh = tiny_model(depth=2).target_encoder
    fresh.load_state_dict(model.encoder_state_dict())
    torch.testing.assert_close(fresh(x), feats)


def test_each_hmlp_token_is_a_nonlinear_function_of_its_own_tubelets_voxels_only():
    torch.manual_seed(0)
    stem = tubelet_embedding(PATCH, 64, "hmlp")
    x = torch.randn(1, 1, *IMAGE)
    changed = x.clone()
    # the voxels of token (1, 1, 2) alone
    changed[..., 4:8, 8:16, 16:24] += torch.randn(1, 1, 4, 8, 8)
    moved = (stem(changed) - stem(x)).abs().amax(dim=1)[0] > 0  # [gd, gh, gw]
    assert moved[1, 1, 2] and moved.sum() == 1  # no voxel of one tubelet reaches another token
    zero = stem(torch.zeros_like(x))
    # linear maps would give 0
    assert (stem(2 * x) - zero - 2 * (stem(x) - zero)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "patch, cell, width, shape",
    [
        (PATCH, [1, 2, 2], 0.5, [2, 1, 8, 32, 32]),
        ([4, 16, 16], [1, 2, 2], 0.5, [1, 1, 9, 35, 50]),
        ([4, 16, 16], [1, 4, 4], 0.5, [1, 1, 9, 35, 50]),
        ([4, 16, 16], [1, 4, 4], 0.25, [1, 1, 9, 35, 50]),
        ([4, 16, 16], [2, 4, 4], 0.5, [1, 1, 9, 35, 50]),
        ([4, 16, 8], [2, 2, 1], 0.75, [2, 1, 8, 32, 17]),
        ([2, 4, 4], [1, 2, 2], 0.5, [3, 1, 2, 4, 4]),
    ],
)
def test_the_hmlp_stem_computes_its_three_convolutions_and_their_gradients(
    patch, cell, width, shape
):
    """Its matmuls on each tubelet's cells are the three Conv3d's its weights belong to (exported
    and loaded as such), at any first cell and width, voxels past the last whole tubelet dropped as
    a convolution drops them."""
    torch.manual_seed(0)
    stem = tubelet_embedding(patch, 32, "hmlp", cell, width)
    assert stem[0].kernel_size == tuple(cell) and stem[0].out_channels == 32 * width
    x = torch.randn(shape)

    def convolutions(volume):
        for layer in stem:
            volume = (
                layer._conv_forward(volume, layer.weight, layer.bias)
                if isinstance(layer, torch.nn.Conv3d)
                else layer(volume)
            )
        return volume

    ours, theirs = stem(x), convolutions(x)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(ours)
    grads = [
        torch.autograd.grad((f(x) * weight).sum(), list(stem.parameters()))
        for f in (stem, convolutions)
    ]
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_hmlp_stem_is_refused_for_a_tubelet_it_cannot_cut_naming_the_sizes_by_the_configs_one_rule():
    from config import ConfigError

    # config and model once disagreed on the odd width
    for patch, dim, width, problem in (
        ([4, 6, 8], 64, 0.5, r"cuts each tubelet .* got patch_size \[4, 6, 8\]"),
        ([4, 8, 8], 63, 0.5, r"0.5 x 63 = 31.5 is not a whole number of channels"),
        ([4, 8, 8], 64, 0.001, r"0.001 x 64 = 0.064 is not a whole number of channels"),
    ):
        with pytest.raises(ValueError, match=problem):
            tubelet_embedding(patch, dim, "hmlp", (1, 2, 2), width)
        with pytest.raises(ConfigError, match="patch_stem: hmlp.*" + problem):
            load_config(
                [
                    "--patch_size",
                    ",".join(map(str, patch)),
                    "--image_size",
                    "16,48,64",
                    "--embed_dim",
                    str(dim),
                    "--num_heads",
                    "1",
                    "--local_loss_split",
                    "1,1,1",
                    "--patch_stem",
                    "hmlp",
                    "--stem_width",
                    str(width),
                ]
            )
    with pytest.raises(ValueError, match="'conv'"):
        tubelet_embedding(PATCH, 64, "conv")
    with pytest.raises(ConfigError, match=r"stem_cell \[1, 4, 4\] voxels.*patch_size \[4, 8, 12\]"):
        load_config(["--patch_size", "4,8,12", "--image_size", "16,64,48", "--stem_cell", "1,4,4"])


@pytest.mark.parametrize(
    "stem, cell, width",
    [
        ("linear", [1, 2, 2], 0.5),
        ("hmlp", [1, 2, 2], 0.5),
        ("hmlp", [1, 4, 4], 0.5),
        ("hmlp", [1, 4, 4], 0.25),
        ("hmlp", [2, 4, 4], 0.5),
    ],
)
def test_the_counted_flops_of_the_target_encoder_are_what_torch_counts_besides_attention(
    stem, cell, width
):
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(
        [],
        image_size=IMAGE,
        patch_size=PATCH,
        embed_dim=64,
        depth=2,
        num_heads=4,
        patch_stem=stem,
        stem_cell=cell,
        stem_width=width,
    )
    model = VJEPA3D.from_config(cfg)
    with FlopCounterMode(display=False) as counter:
        model.encode(torch.randn(1, 1, *IMAGE))
    attention = 2 * 2 * model.num_tokens**2 * 64 * 2  # QK^T and AV of 2 blocks
    counted = sum(
        flops
        for op, flops in counter.get_flop_counts()["Global"].items()
        # torch counts some attention kernels, not CPU's fused one
        if "scaled_dot_product" not in str(op)
    )
    assert training_flops_per_sample(cfg)["target_encoder"] - attention == counted > 0


@pytest.mark.parametrize("stem", ["linear", "hmlp"])
def test_the_context_encoder_embeds_only_its_tokens_and_gets_what_embedding_all_would_give(stem):
    model = tiny_model(patch_stem=stem)
    x = torch.randn(2, 1, *IMAGE)
    # [B*M, K]: 2 mask sets a volume
    keep = torch.stack([torch.randperm(model.num_tokens)[:12] for _ in range(4)])
    every = model.encoder.embed_tubelets(x).flatten(2).transpose(1, 2)  # [B, N, E]
    every = every + model.encoder.positions(model.encoder.grid)
    gathered = gather_tokens(every.repeat_interleave(2, dim=0), keep)
    torch.testing.assert_close(model.encoder.embed_kept(x, keep), gathered, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stem", ["linear", "hmlp"])  # hmlp: its inner maps recomputed too
def test_grad_checkpointing_gives_the_same_gradients(stem):
    x = torch.randn(2, 1, *IMAGE)
    grads = []
    for enabled in (False, True):
        model = tiny_model(patch_stem=stem, local_loss_weight=0.5, local_loss_split=[1, 4, 1])
        model.set_grad_checkpointing(enabled)
        ctx, tgt = masks(model, 2)
        model(x, ctx, tgt).loss.backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(grads[0], grads[1])


def bytes_kept_for_backward(model, x, ctx, tgt) -> int:
    """The bytes of the tensors autograd keeps for backward in one training forward of model."""
    kept = 0

    def keep(t):
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(x, ctx, tgt).loss
    return kept, loss


def test_the_hmlp_stem_keeps_no_inner_map_for_backward_even_without_grad_checkpointing():
    """Its inner maps (9/8 E values a first cell of each context token) are recomputed in backward:
    the same gradients, and none of them kept."""
    x = torch.randn(2, 1, *IMAGE)
    kept, grads = [], []
    for recompute in (True, False):
        model = tiny_model(patch_stem="hmlp", local_loss_weight=0.5)
        assert not model.grad_checkpointing
        if not recompute:
            model.encoder.stem_checkpoint_fn = lambda stem, part: stem(part)
        ctx, tgt = masks(model, 2)
        nbytes, loss = bytes_kept_for_backward(model, x, ctx, tgt)
        loss.backward()
        kept.append(nbytes)
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(grads[0], grads[1])
    cells = math.prod(PATCH) // math.prod((1, 2, 2))
    inner_maps = ctx.numel() * cells * 64 * 9 // 8 * 4  # context tokens x cells x 9/8 E, fp32
    assert kept[1] - kept[0] >= 0.95 * inner_maps


@pytest.mark.slow
def test_frozen_target_overfits_one_batch():
    model = tiny_model()
    ctx, tgt = masks(model, 2)
    x = torch.randn(2, 1, *IMAGE)
    opt = torch.optim.AdamW(model.param_groups(), lr=3e-3)
    first = None
    for _ in range(400):
        out = model(x, ctx, tgt)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        model.update_target(1.0)  # momentum 1.0: the target stays frozen
        first = first if first is not None else out.loss.item()
    assert out.loss.item() < 0.1 * first


def test_a_model_built_without_arguments_is_the_recipe_that_the_configs_train():
    """The model's defaults live in one place, config.py's Config: VJEPA3D() is the demo's and
    learn.yaml's model."""
    for config in ([], ["--config", "configs/demo.yaml"], ["--config", "configs/learn.yaml"]):
        torch.manual_seed(0)
        built = VJEPA3D()
        torch.manual_seed(0)
        configured = VJEPA3D.from_config(load_config(config))
        assert (
            built.encoder.patch_embed.__class__.__name__ == "HMLPStem"
            and built.local_head is not None
        )
        assert {k: v.shape for k, v in built.state_dict().items()} == {
            k: v.shape for k, v in configured.state_dict().items()
        }, config
        assert all(
            torch.equal(v, configured.state_dict()[k]) for k, v in built.state_dict().items()
        ), config


@pytest.mark.parametrize(
    "reentrant", [False, True], ids=["torch's checkpoint", "a reentrant one, as torch_xla's"]
)
def test_recomputation_gives_every_weight_the_gradient_it_has_without_it_the_hmlp_stem_included(
    reentrant,
):
    """A reentrant checkpoint gives the weights inside no gradient when no input asks for one: the
    hmlp stem, whose input is the volume, never trained on XLA with grad checkpointing (FSDP over 4
    XLA devices then parted from one device: tests/test_xla.py) until runtime.use_xla_checkpoint
    wrapped torch_xla's in with_input_gradient. Compared: nothing recomputed, the stem recomputed
    (always, in training), and the blocks too (grad checkpointing)."""
    model = tiny_model(patch_stem="hmlp", local_loss_weight=0.5, local_loss_split=(1, 4, 1))
    volume = torch.randn(2, 1, *IMAGE)
    ctx, tgt = masks(model, 2)
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)
    checkpoint = with_input_gradient(checkpoint) if reentrant else checkpoint
    grads = []
    for stem, blocks in ((False, False), (True, False), (True, True)):
        model.encoder.stem_checkpoint_fn = checkpoint if stem else lambda m, part: m(part)
        model.set_grad_checkpointing(blocks, checkpoint)
        model.zero_grad(set_to_none=True)
        model(volume, ctx, tgt).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for recomputed in grads[1:]:
        assert set(recomputed) == set(grads[0])
        for name, grad in grads[0].items():
            assert recomputed[name] is not None, f"{name}: no gradient when recomputed"
            torch.testing.assert_close(recomputed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
