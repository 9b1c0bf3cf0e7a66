"""A reentrant checkpoint gives the weights inside no gradient when no input asks for one
(torch_xla's checkpoint is reentrant; torch's default on CPU/CUDA is not). The hmlp stem's input is
the volume, so on XLA with grad checkpointing it never trained until runtime.with_input_gradient
made the input ask (experiments/NOTES.md 25).

    python experiments/xla/reentrant_checkpoint.py      # plain torch, no XLA needed
"""

import torch
from torch.utils.checkpoint import checkpoint

stem = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
volume = torch.randn(16, 4)  # like a volume: no gradient of its own
for reentrant in (False, True):
    for asks in (False, True):
        stem.zero_grad(set_to_none=True)
        x = volume.detach().requires_grad_(asks)
        out = checkpoint(stem, x, use_reentrant=reentrant)
        if out.requires_grad:
            out.sum().backward()
        grad = stem[0].weight.grad
        print(
            f"reentrant={reentrant!s:<5} input asks for a gradient={asks!s:<5} first weight's"
            f" gradient: {'none' if grad is None else f'norm {grad.norm():.3f}'}"
        )
