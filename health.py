"""Health figures of an encoder's features, logged while it trains and reported after: does it still
say something, and does it say what is there or only where it is?

    rankme(embeddings [M, E])         the effective rank of embeddings: 1 = collapsed (RankMe,
    Garrido et al. 2023) position_share(tokens [V, N, E])  the share of token variance explained by
    grid position: near 1, the tokens say
                                      where they are and little of what is there

target_std (collapse of the targets) is measured by the loss itself: objectives.feature_std.
"""

import torch


def rankme(embeddings: torch.Tensor, eps: float = 1e-7) -> float:
    """RankMe: exp of the entropy of the normalized singular values of [M, E] embeddings (1 =
    collapsed)."""
    s = torch.linalg.svdvals(embeddings.float())
    p = s / (s.sum() + eps) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def position_sums(tokens: torch.Tensor) -> torch.Tensor:
    """Per grid position, the sum and the sum of squares over volumes of tokens [V, N, E]: [2, N, E]
    (float64), what position_share_of_sums needs; the sums of several batches of volumes add up."""
    t = tokens.detach().cpu().double()
    return torch.stack([t.sum(0), t.pow(2).sum(0)])


def position_share_of_sums(sums: torch.Tensor, volumes: int) -> float:
    """position_share of the tokens of `volumes` volumes whose position_sums (added over batches)
    are sums [2, N, E]."""
    s1, s2 = sums / volumes  # [N, E] each: per-position means of x and x^2
    # mean over positions of the variance over volumes
    within = (s2 - s1**2).clamp_min(0).sum(-1).mean()
    # variance over all tokens of all volumes
    total = (s2.mean(0) - s1.mean(0) ** 2).clamp_min(0).sum()
    return float(1.0 - within / total) if total > 0 else 0.0


def position_share(tokens: torch.Tensor) -> float:
    """The share of token variance explained by grid position, for tokens [V, N, E] of V volumes: 1
    - (mean over the N positions of the variance over volumes) / (variance over all V*N tokens),
      variances summed over the E features.
    1: every token is where it is, nothing of its volume (a position code); 0: position tells
    nothing."""
    return position_share_of_sums(position_sums(tokens), tokens.shape[0])
