"""OCT data for octjepa: patch masks (this section), DICOM reading, preprocessing, datasets, cache, scan CLI.

Masks are index tensors of a fixed length per sample (incident 6): every sample of a config has exactly
`n_target = round(mask_ratio * N)` target tokens and `N - n_target` context tokens, disjoint and covering
all N tokens, so batches have static shapes and no token is thrown away.
"""
import math
from typing import Sequence, Tuple

import numpy as np


# ----------------------------------------------------------------------------------------------------------
# Patch masks
# ----------------------------------------------------------------------------------------------------------

class MaskGenerator:
    """Samples (context_idx [Nc], target_idx [Nt]) int64 arrays over a (gd, gh, gw) token grid.

    multiblock: 3D blocks of random scale (share of all tokens) and aspect ratio are added one by one
    until the union holds exactly n_target tokens; the last block is added from its center outwards
    and stops at the exact count. Block starts range over [-(extent-1), grid-1] and are clipped, so every
    position is covered equally often (no border bias).
    random: n_target tokens drawn uniformly without replacement.
    """

    def __init__(self, grid: Sequence[int], mask_ratio: float, mask_type: str = "multiblock",
                 block_scale: Tuple[float, float] = (0.1, 0.3), block_aspect: float = 1.5):
        self.grid = tuple(int(g) for g in grid)
        self.num_tokens = math.prod(self.grid)
        self.n_target = round(mask_ratio * self.num_tokens)
        self.n_context = self.num_tokens - self.n_target
        if self.n_target < 1 or self.n_context < 1:
            raise ValueError(f"mask_ratio {mask_ratio} of {self.num_tokens} tokens leaves no context or no target")
        if mask_type not in ("multiblock", "random"):
            raise ValueError(f"mask_type must be 'multiblock' or 'random', got {mask_type!r}")
        self.mask_type = mask_type
        self.block_scale = block_scale
        self.block_aspect = block_aspect
        self._coords = np.stack(np.meshgrid(*[np.arange(g) for g in self.grid], indexing="ij"), -1)  # [gd,gh,gw,3]

    def __call__(self, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        if self.mask_type == "random":
            is_target = np.zeros(self.num_tokens, dtype=bool)
            is_target[rng.choice(self.num_tokens, self.n_target, replace=False)] = True
        else:
            is_target = self._multiblock(rng)
        return np.flatnonzero(~is_target).astype(np.int64), np.flatnonzero(is_target).astype(np.int64)

    def _block_extent(self, rng: np.random.Generator) -> np.ndarray:
        """Extent per axis of one block: its volume is scale*N tokens, shape distorted by random aspect."""
        scale = rng.uniform(*self.block_scale)
        log_aspect = rng.uniform(-math.log(self.block_aspect), math.log(self.block_aspect), size=3)
        log_aspect -= log_aspect.mean()  # product of the factors is 1: the volume is kept
        extent = np.array(self.grid) * scale ** (1 / 3) * np.exp(log_aspect)
        return np.clip(np.round(extent), 1, self.grid).astype(int)

    def _multiblock(self, rng: np.random.Generator) -> np.ndarray:
        is_target = np.zeros(self.grid, dtype=bool)
        count = 0
        while count < self.n_target:
            extent = self._block_extent(rng)
            start = np.array([rng.integers(-(e - 1), g) for e, g in zip(extent, self.grid)])
            lo, hi = np.maximum(start, 0), np.minimum(start + extent, self.grid)
            block = tuple(slice(a, b) for a, b in zip(lo, hi))
            new = ~is_target[block]
            n_new = int(new.sum())
            if count + n_new <= self.n_target:
                is_target[block] = True
                count += n_new
                continue
            # Last block: take its new tokens nearest to the block center first, stop at the exact count.
            center = (start + (extent - 1) / 2.0)
            coords = self._coords[block][new]  # [n_new, 3]
            order = np.argsort(((coords - center) ** 2).sum(-1), kind="stable")[: self.n_target - count]
            chosen = coords[order]
            is_target[chosen[:, 0], chosen[:, 1], chosen[:, 2]] = True
            count = self.n_target
        return is_target.reshape(-1)


def mask_generator_from_config(cfg) -> MaskGenerator:
    """The MaskGenerator described by a Config."""
    return MaskGenerator(cfg.grid_size(), cfg.mask_ratio, cfg.mask_type, tuple(cfg.mask_block_scale),
                         cfg.mask_block_aspect)


def sample_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on (seed, keys): the same sample gets the same mask after a resume."""
    return np.random.default_rng([seed, *keys])
