"""Patch masks: exact static counts, disjoint, complete, unbiased, reproducible (incident 6)."""
import numpy as np
import pytest

from config import load_config
from data import MaskGenerator, mask_generator_from_config, sample_rng

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
    if mask_type == "multiblock" and grid == (4, 8, 8):  # no border bias: corners about as often as the center
        assert times_target.min() > 0.8 * times_target.mean() and times_target.max() < 1.2 * times_target.mean()


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
