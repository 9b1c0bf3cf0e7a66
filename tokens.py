"""Frozen tokens: labelled volumes through an encoder into tokens [M, N, E], kept in memory or in a
file (TokenFile), and read back a chunk at a time. The read-outs (readouts.py), the probes and
fine-tuning take their tokens from here; nothing here reads a DICOM file."""

import math
import os
from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn

from runtime import release_freed_memory

# the probes read frozen tokens this many bytes at a time (token_chunks)
TOKEN_CHUNK_BYTES = 64 * 2**20


class TokenFile:
    """Frozen tokens [M, N, E] (float32) in a file, appended batch by batch and read back by rows
    with explicit reads (a memory map's pages would count as resident memory), so that memory stays
    flat in M. Like a tensor [M, N, E] it has a shape and a length, and tokens[idx] (row indices)
    gives a tensor [len(idx), N, E]."""

    def __init__(self, path: str):
        self.path, self.count, self.row_shape = path, 0, None
        open(path, "wb").close()

    def append(self, tokens: torch.Tensor) -> None:
        """Add the tokens [B, N, E] of B more volumes."""
        rows = tokens.detach().float().contiguous().numpy()
        if self.row_shape is not None and rows.shape[1:] != self.row_shape:
            raise ValueError(
                f"tokens of shape {tuple(rows.shape)} appended to rows of shape {self.row_shape}"
            )
        self.row_shape = rows.shape[1:]
        with open(self.path, "ab") as f:
            rows.tofile(f)
        self.count += len(rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.count, *self.row_shape))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, idx) -> torch.Tensor:
        rows = np.asarray(idx, dtype=np.int64).reshape(-1)
        out = torch.empty(len(rows), *self.row_shape)
        with open(self.path, "rb") as f:
            for row, i in zip(out.numpy(), rows):
                f.seek(int(i) * row.nbytes)
                if f.readinto(row) != row.nbytes:
                    raise IndexError(f"row {i} of {self.path}, which holds {self.count} rows")
        return out


# frozen tokens [M, N, E]: in memory, or in a file (finetune.py)
Tokens = Union[torch.Tensor, TokenFile]


def chunk_rows(tokens: Tokens) -> int:
    """Volumes per chunk of token_chunks: all of them when they are in memory already, else as many
    float32 tokens [N, E] as TOKEN_CHUNK_BYTES holds, at least one."""
    if isinstance(tokens, torch.Tensor):
        return max(1, len(tokens))
    return max(1, TOKEN_CHUNK_BYTES // (4 * math.prod(tokens.shape[1:])))


def token_chunks(tokens: Tokens, idx: Sequence[int]) -> Iterator[Tuple[np.ndarray, torch.Tensor]]:
    """(part of idx, its tokens [len(part), N, E]) in order, chunk_rows volumes at a time: what the
    read-outs hold of the tokens at once."""
    idx = np.asarray(idx, dtype=np.int64)
    rows = chunk_rows(tokens)
    for start in range(0, len(idx), rows):
        part = idx[start : start + rows]
        yield part, tokens[part]


def padded_batches(
    volumes: Iterable[torch.Tensor], batch_size: int
) -> Iterator[Tuple[torch.Tensor, int]]:
    """(batch [batch_size, 1, D, H, W], how many of it are volumes) of volumes [1, D, H, W] given
    one by one; the last batch is padded with its last volume, so that every batch has one shape."""
    batch = []
    for volume in volumes:
        batch.append(volume)
        if len(batch) == batch_size:
            yield torch.stack(batch), batch_size
            batch = []
    if batch:
        yield torch.stack(batch + batch[-1:] * (batch_size - len(batch))), len(batch)


@torch.no_grad()
def encode_volumes(
    encoders: Dict[str, nn.Module],
    volumes: Iterable[torch.Tensor],
    device,
    batch_size: int = 8,
    folder: Optional[str] = None,
) -> Dict[str, Tokens]:
    """The one way labelled volumes become frozen tokens: {name: tokens [M, N, E] (float32)} of each
    encoder's `encode` (VJEPA3D's target encoder, or an export) on the volumes [1, D, H, W] given
    one by one (or a tensor [M, 1, D, H, W]), a padded batch at a time (one shape for a compiled
    device). In memory, or with a folder in a TokenFile NAME.tokens there each, so that memory stays
    flat in M; the volumes may come from a generator that reads them one at a time."""
    out = {
        name: TokenFile(os.path.join(folder, f"{name}.tokens")) if folder else []
        for name in encoders
    }
    for batch, n in padded_batches(volumes, batch_size):
        for name, encoder in encoders.items():
            out[name].append(encoder.encode(batch.to(device).float()).float().cpu()[:n])
        release_freed_memory()
    return {name: tokens if folder else torch.cat(tokens) for name, tokens in out.items()}
