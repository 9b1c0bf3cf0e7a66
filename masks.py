"""Patch masks: which tokens of a sample the context encoder sees and which it predicts (as V-JEPA's
src/masks).

Masks are index tensors of a fixed length per sample (incident 6): every sample of a config has
exactly `n_target = round(mask_ratio * N)` target tokens and `N - n_target` context tokens, disjoint
and covering all N tokens, so batches have static shapes and no token is thrown away. MaskGenerator
draws them (data.OCTDataset calls it with each sample's own generator, so a resumed run draws the
same masks); mask_stats and describe_masks say what a design realises (the dry run prints it).
"""

import math
from typing import List, Sequence, Tuple

import numpy as np

from config import CHOICES

MASK_TYPES = CHOICES["mask_type"]  # the mask designs: multiblock, random (MaskGenerator)


class MaskGenerator:
    """Samples (context_idx, target_idx) int64 arrays over a (gd, gh, gw) token grid: [Nc] and [Nt]
    for one mask set, [M, Nc] and [M, Nt] for M mask sets per sample (V-JEPA: each set is predicted
    on its own).

    block_scale holds one (min, max) pair per mask set, e.g. (0.02, 0.05, 0.3, 0.5): a short-range
    set of many small blocks and a long-range set of a few large ones. Every set has exactly
    n_target target tokens. multiblock: 3D blocks of random scale (share of all tokens) and aspect
    ratio are added one by one until the union holds exactly n_target tokens; the last block is
    added from its center outwards and stops at the exact count. Block starts range over
    [-(extent-1), grid-1] and are clipped, so every position is covered equally often (no border
    bias), but a block near a border is smaller than its nominal scale. random: n_target tokens
    drawn uniformly without replacement. The arguments are a Config's (mask_generator_from_config):
    config.validate checks their rules.
    """

    def __init__(
        self,
        grid: Sequence[int],
        mask_ratio: float,
        mask_type: str = "multiblock",
        block_scale: Sequence[float] = (0.1, 0.3),
        block_aspect: float = 1.5,
    ):
        self.grid = tuple(int(g) for g in grid)
        self.num_tokens = math.prod(self.grid)
        self.n_target = round(mask_ratio * self.num_tokens)
        self.n_context = self.num_tokens - self.n_target
        if mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type: {mask_type!r} is not one of {', '.join(MASK_TYPES)}")
        self.mask_type = mask_type
        self.set_scales = [tuple(block_scale[i : i + 2]) for i in range(0, len(block_scale), 2)]
        self.block_aspect = block_aspect
        # [gd,gh,gw,3]
        self._coords = np.stack(np.meshgrid(*[np.arange(g) for g in self.grid], indexing="ij"), -1)

    @property
    def num_sets(self) -> int:
        return len(self.set_scales)

    def __call__(self, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        masks = [self.sample_set(rng, scale)[0] for scale in self.set_scales]
        context = np.stack([np.flatnonzero(~m) for m in masks]).astype(np.int64)  # [M, Nc]
        target = np.stack([np.flatnonzero(m) for m in masks]).astype(np.int64)  # [M, Nt]
        return (context[0], target[0]) if self.num_sets == 1 else (context, target)

    def sample_set(
        self, rng: np.random.Generator, scale: Tuple[float, float]
    ) -> Tuple[np.ndarray, List[tuple]]:
        """(is_target [N] bool, [(nominal tokens, tokens inside the grid, extent inside the grid)
        per block]) of one mask set (no blocks for random masks)."""
        if self.mask_type == "random":
            is_target = np.zeros(self.num_tokens, dtype=bool)
            is_target[rng.choice(self.num_tokens, self.n_target, replace=False)] = True
            return is_target, []
        return self._multiblock(rng, scale)

    def _block_extent(
        self, rng: np.random.Generator, scale: Tuple[float, float]
    ) -> Tuple[float, np.ndarray]:
        """(nominal tokens, extent per axis) of one block: scale * N tokens, shape distorted by a
        random aspect."""
        nominal = rng.uniform(*scale) * self.num_tokens
        grid = np.array(self.grid, dtype=float)
        log_aspect = rng.uniform(-math.log(self.block_aspect), math.log(self.block_aspect), size=3)
        log_aspect -= log_aspect.mean()  # product of the factors is 1: the volume is kept
        share = nominal / grid.prod()
        extent = np.clip(np.round(grid * share ** (1 / 3) * np.exp(log_aspect)), 1, grid)
        # The longest axis absorbs the rounding of the others, so the block volume stays near
        # nominal.
        last = max(range(3), key=lambda a: extent[a])
        rest = np.prod([extent[a] for a in range(3) if a != last])
        extent[last] = np.clip(round(nominal / rest), 1, grid[last])
        return nominal, extent.astype(int)

    def _multiblock(
        self, rng: np.random.Generator, scale: Tuple[float, float]
    ) -> Tuple[np.ndarray, List[tuple]]:
        is_target = np.zeros(self.grid, dtype=bool)
        blocks = []
        count = 0
        while count < self.n_target:
            nominal, extent = self._block_extent(rng, scale)
            start = np.array([rng.integers(-(e - 1), g) for e, g in zip(extent, self.grid)])
            lo, hi = np.maximum(start, 0), np.minimum(start + extent, self.grid)
            blocks.append((nominal, int(np.prod(hi - lo)), tuple(hi - lo)))
            block = tuple(slice(a, b) for a, b in zip(lo, hi))
            new = ~is_target[block]
            n_new = int(new.sum())
            if count + n_new <= self.n_target:
                is_target[block] = True
                count += n_new
                continue
            # Last block: take its new tokens nearest to the block center first, stop at the exact
            # count.
            center = start + (extent - 1) / 2.0
            coords = self._coords[block][new]  # [n_new, 3]
            order = np.argsort(((coords - center) ** 2).sum(-1), kind="stable")[
                : self.n_target - count
            ]
            chosen = coords[order]
            is_target[chosen[:, 0], chosen[:, 1], chosen[:, 2]] = True
            count = self.n_target
        return is_target.reshape(-1), blocks


def mask_generator_from_config(cfg) -> MaskGenerator:
    """The MaskGenerator described by a Config."""
    return MaskGenerator(
        cfg.grid_size(),
        cfg.mask_ratio,
        cfg.mask_type,
        tuple(cfg.mask_block_scale),
        cfg.mask_block_aspect,
    )


def context_neighbour_share(is_target: np.ndarray) -> List[float]:
    """Per axis, the share of target tokens with a context token directly before or after them along
    it: is_target [gd, gh, gw] bool. Such a target can be copied from its neighbour rather than
    predicted."""
    shares = []
    for axis in range(3):
        near = np.zeros_like(is_target)
        for shift in (1, -1):
            context = ~np.roll(is_target, shift, axis=axis)
            edge = [slice(None)] * 3
            edge[axis] = slice(0, 1) if shift == 1 else slice(-1, None)
            # np.roll wraps around: the wrapped neighbour does not exist
            context[tuple(edge)] = False
            near |= context
        shares.append(float((near & is_target).sum() / max(1, is_target.sum())))
    return shares


def mask_stats(gen: MaskGenerator, samples: int = 100, seed: int = 0) -> dict:
    """What a mask design does, measured over `samples` masks per set: realised block size as a
    share of nominal (mean), share of blocks at most 2 tokens thick on some axis, and the per-axis
    context-neighbour share of target tokens (context_neighbour_share)."""
    rng = np.random.default_rng(seed)
    ratios, thin, near = [], [], []
    for _ in range(samples):
        for scale in gen.set_scales:
            is_target, blocks = gen.sample_set(rng, scale)
            ratios += [inside / nominal for nominal, inside, _ in blocks]
            thin += [min(extent) <= 2 for _, _, extent in blocks]
            near.append(context_neighbour_share(is_target.reshape(gen.grid)))
    return {
        "block_size_ratio": float(np.mean(ratios)) if ratios else None,
        "thin_block_share": float(np.mean(thin)) if thin else None,
        "context_neighbour_share": [float(x) for x in np.mean(near, axis=0)],
    }


def describe_masks(gen: MaskGenerator) -> str:
    """Lines for the dry run: the mask design and what it realises (mask_stats)."""
    stats = mask_stats(gen)
    sets = ", ".join(f"[{lo:g}, {hi:g}]" for lo, hi in gen.set_scales)
    lines = [
        f"masks             {gen.mask_type}, {gen.num_sets} set(s) per sample, block scale {sets}: "
        f"{gen.n_target} target / {gen.n_context} context tokens per set"
    ]
    if stats["block_size_ratio"] is not None:
        lines.append(
            f"                  realised block size {stats['block_size_ratio']:.2f} x nominal; "
            f"{stats['thin_block_share']:.0%} of blocks are at most 2 tokens thick on some axis"
        )
    near = stats["context_neighbour_share"]
    lines.append(
        "                  target tokens with a context neighbour along axis 0 (B-scans)"
        f" {near[0]:.0%}, 1 (depth) {near[1]:.0%}, 2 (lateral) {near[2]:.0%}"
    )
    return "\n".join(lines)
