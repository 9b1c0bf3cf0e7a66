"""Patch masks: exact static counts, disjoint, complete, unbiased, reproducible (incident 6); the
options a researcher compares (block or random masks, several mask sets per sample) do what they
say."""

import numpy as np
import pytest
import torch

from config import ConfigError, load_config
from data import sample_rng
from masks import MaskGenerator, context_neighbour_share, mask_generator_from_config, mask_stats
from model import VJEPA3D

GRIDS = [(16, 24, 24), (3, 5, 7), (1, 1, 9), (5, 4, 3)]


@pytest.mark.parametrize("mask_type", ["multiblock", "random"])
@pytest.mark.parametrize("grid", GRIDS)
def test_every_sample_has_exact_disjoint_complete_masks(grid, mask_type):
    gen = MaskGenerator(grid, 0.6, mask_type)
    n = int(np.prod(grid))
    for i in range(50):
        context, target = gen(sample_rng(0, 0, i))
        assert len(target) == round(0.6 * n) and len(context) == n - len(target)
        assert context.dtype == np.int64 and target.dtype == np.int64
        assert np.intersect1d(context, target).size == 0
        assert np.array_equal(np.sort(np.concatenate([context, target])), np.arange(n))


def test_production_grid_from_config_has_static_counts():
    cfg = load_config([], image_size=[64, 384, 384], patch_size=[4, 16, 16], mask_ratio=0.6)
    gen = mask_generator_from_config(cfg)
    assert (gen.n_context, gen.n_target) == cfg.token_counts() == (3686, 5530)
    counts = {tuple(len(a) for a in gen(sample_rng(1, 0, i))) for i in range(20)}
    assert counts == {(3686, 5530)}


@pytest.mark.parametrize("mask_type", ["multiblock", "random"])
@pytest.mark.parametrize("grid", [(4, 8, 8), (3, 5, 7)])
def test_every_position_is_sometimes_target_and_sometimes_context(grid, mask_type):
    gen = MaskGenerator(grid, 0.6, mask_type)
    times_target = np.zeros(int(np.prod(grid)))
    for i in range(1000):
        times_target[gen(sample_rng(3, 0, i))[1]] += 1
    assert times_target.min() > 0 and times_target.max() < 1000
    # no border bias: corners about as often as the center
    if mask_type == "multiblock" and grid == (4, 8, 8):
        assert (
            times_target.min() > 0.8 * times_target.mean()
            and times_target.max() < 1.2 * times_target.mean()
        )


def test_multiblock_targets_are_blocks_not_noise():
    gen = MaskGenerator((8, 16, 16), 0.6, "multiblock")
    rnd = MaskGenerator((8, 16, 16), 0.6, "random")

    def same_neighbor_share(target):
        is_t = np.zeros(8 * 16 * 16, bool)
        is_t[target] = True
        is_t = is_t.reshape(8, 16, 16)
        return (is_t[:, :, 1:] == is_t[:, :, :-1]).mean()

    block = np.mean([same_neighbor_share(gen(sample_rng(0, 0, i))[1]) for i in range(20)])
    noise = np.mean([same_neighbor_share(rnd(sample_rng(0, 0, i))[1]) for i in range(20)])
    assert block > noise + 0.2


def test_masks_are_deterministic_given_the_seed():
    gen = MaskGenerator((4, 8, 8), 0.6)
    a, b, c = gen(sample_rng(7, 2, 5)), gen(sample_rng(7, 2, 5)), gen(sample_rng(8, 2, 5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


OPTIONS = {  # name: (mask_type, block_scale)
    "multiblock": ("multiblock", (0.1, 0.3)),
    "vjepa_short_and_long_range": ("multiblock", (0.02, 0.05, 0.3, 0.5)),
    "random_two_sets": ("random", (0.1, 0.3, 0.1, 0.3)),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("grid", [(16, 24, 24), (4, 8, 8), (3, 5, 7)])
def test_each_mask_option_gives_exact_disjoint_complete_sets_of_static_shape(grid, option):
    mask_type, scale = OPTIONS[option]
    gen = MaskGenerator(grid, 0.6, mask_type, scale, 1.5)
    n, sets = int(np.prod(grid)), len(scale) // 2
    shape = (lambda k: (k,)) if sets == 1 else (lambda k: (sets, k))
    for i in range(20):
        context, target = gen(sample_rng(0, 0, i))
        assert context.shape == shape(gen.n_context) and target.shape == shape(gen.n_target)
        assert gen.n_target == round(0.6 * n) and context.dtype == target.dtype == np.int64
        for c, t in zip(context.reshape(sets, -1), target.reshape(sets, -1)):
            assert np.array_equal(np.sort(np.concatenate([c, t])), np.arange(n))


def test_context_neighbour_share_counts_targets_next_to_context_along_each_axis():
    is_target = np.zeros((4, 5, 6), bool)
    is_target[1:3, 2, 0:6] = True  # a bar across the lateral axis, two B-scans thick
    # no wrap-around at the lateral borders
    assert context_neighbour_share(is_target) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("grid", [(16, 24, 24), (4, 8, 8)])
def test_mask_stats_say_that_blocks_clipped_at_the_borders_are_smaller_than_their_nominal_scale(
    grid,
):
    stats = mask_stats(MaskGenerator(grid, 0.6, "multiblock", (0.1, 0.3), 1.5), samples=30)
    assert stats["block_size_ratio"] < 0.6 and 0 < stats["thin_block_share"] <= 1


def test_several_mask_sets_per_sample_train_like_one_set_each():
    cfg = load_config(
        [
            "--image_size",
            "8,32,32",
            "--patch_size",
            "4,8,8",
            "--embed_dim",
            "24",
            "--depth",
            "1",
            "--num_heads",
            "2",
            "--pred_embed_dim",
            "12",
            "--pred_depth",
            "1",
            "--pred_num_heads",
            "2",
            "--mask_type",
            "multiblock",
            "--mask_block_scale",
            "0.05,0.1,0.3,0.5",
        ]
    )
    torch.manual_seed(0)
    model = VJEPA3D.from_config(cfg)
    gen = mask_generator_from_config(cfg)
    masks = [gen(sample_rng(0, 0, i)) for i in range(3)]
    context = torch.from_numpy(np.stack([c for c, _ in masks]))  # [B=3, M=2, Nc]
    target = torch.from_numpy(np.stack([t for _, t in masks]))  # [B=3, M=2, Nt]
    volume = torch.randn(3, 1, 8, 32, 32)
    with torch.no_grad():
        out = model(volume, context, target)
        assert out.pred.shape == (6, gen.n_target, 24)
        per_set = [model(volume, context[:, m], target[:, m]).loss for m in range(2)]
        assert float(out.loss) == pytest.approx(float(sum(per_set) / 2), rel=1e-5)
        with pytest.raises(ValueError, match=r"same batch and mask-set dimensions"):
            model(volume, context, target[:, 0])


def test_mask_options_are_config_fields_with_clear_errors():
    cfg = load_config(["--mask_type", "multiblock", "--mask_block_scale", "0.02,0.05,0.3,0.5"])
    assert mask_generator_from_config(cfg).set_scales == [(0.02, 0.05), (0.3, 0.5)]
    with pytest.raises(ConfigError, match=r"mask_block_scale.*pairs"):
        load_config(["--mask_block_scale", "0.1,0.2,0.3"])
    with pytest.raises(ConfigError, match=r"mask_type: 'blocks' is not one of multiblock, random"):
        load_config(["--mask_type", "blocks"])
