"""Shard layouts: which tokens of a sequence each of P processes holds, and the way back.

A sequence-parallel scheme (ring.py, ulysses.py) gives rank r of P a shard of T/P tokens of every head,
cut along the token axis -2. Which tokens is the layout's choice:

    contiguous   P equal chunks; rank r holds chunk r
    zigzag       2P equal chunks; rank r holds chunks r and 2P-1-r, one early and one late

    T = 8 tokens, P = 2:   contiguous  rank 0: 0 1 2 3   rank 1: 4 5 6 7
                           zigzag      rank 0: 0 1 6 7   rank 1: 2 3 4 5

Without a causal mask the layout changes nothing but the order of the rows. Under one it decides the
balance: a ring's contiguous rank P-1 attends to every chunk and rank 0 to its own triangle only, while
zigzag gives every rank the same work (ring.py's module doc counts it). Zigzag is the layout of Llama 3's
context parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models").

shard(x, rank, size) cuts one rank's part from the whole sequence; unshard(parts) puts every rank's part
back in order. Plain NumPy: nothing here needs MPI.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import SHARD_LAYOUTS, check_count, check_layout, check_positive_int

__all__ = ["LAYOUTS", "chunks_of", "n_chunks", "shard", "unshard"]

LAYOUTS = SHARD_LAYOUTS  # the two ways a sequence is cut: zigzag (2·P chunks) and contiguous (P chunks)


def shard(x: Any, rank: int, size: int, *, layout: str = "zigzag") -> np.ndarray:
    """The part of x (..., T, E) that rank holds, along the token axis -2: (..., T/size, E), a new array.

    zigzag: chunks r and 2·size-1-r of 2·size equal chunks, in that order (T must divide by 2·size);
    contiguous: chunk r of size equal chunks (T must divide by size).

    >>> shard(np.arange(8)[:, None], 1, 2)[:, 0]  # tokens 0..7, rank 1 of 2: chunks 1 and 2 of 4
    array([2, 3, 4, 5])
    """
    held = chunks_of(rank, size, layout)
    pieces = n_chunks(size, layout)
    x = _split_tokens(x, "x", pieces, f"layout={layout!r} with size={size}")
    c = x.shape[-2] // pieces  # tokens per chunk
    return np.concatenate([x[..., i * c : (i + 1) * c, :] for i in held], axis=-2)  # (..., T/size, E)


def unshard(parts: Any, *, layout: str = "zigzag") -> np.ndarray:
    """The inverse of shard: every rank's part, in rank order, put back into (..., T, E)."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts must be a non-empty list of every rank's array, in rank order; got {parts!r:.80}")
    size = len(parts)
    per_rank = n_chunks(size, layout) // size  # chunks each rank holds: 2 (zigzag) or 1
    arrays = [_split_tokens(p, f"parts[{r}]", per_rank, f"layout={layout!r}") for r, p in enumerate(parts)]
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"parts must all have one shape (equal shards); got {[a.shape for a in arrays]}")
    c = arrays[0].shape[-2] // per_rank  # tokens per chunk
    chunks: dict[int, np.ndarray] = {}
    for rank, part in enumerate(arrays):
        for i, chunk in enumerate(chunks_of(rank, size, layout)):
            chunks[chunk] = part[..., i * c : (i + 1) * c, :]  # (..., c, E)
    return np.concatenate([chunks[i] for i in sorted(chunks)], axis=-2)  # (..., T, E)


def chunks_of(rank: int, size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunk numbers rank holds, in the order it stores them: (r, 2·size-1-r) for zigzag, (r,) for
    contiguous.

    >>> chunks_of(1, 4)  # rank 1 of 4 holds chunks 1 and 6 of 0..7
    (1, 6)
    """
    size = check_positive_int(size, "size")
    rank = check_count(rank, "rank")
    if rank >= size:
        raise ValueError(f"rank must lie in [0, size) = [0, {size}); got {rank}")
    return (rank, 2 * size - 1 - rank) if check_layout(layout) == "zigzag" else (rank,)


def n_chunks(size: int, layout: str = "zigzag") -> int:
    """How many equal chunks the layout cuts the sequence into: 2·size for zigzag, size for contiguous."""
    size = check_positive_int(size, "size")
    return 2 * size if check_layout(layout) == "zigzag" else size


def _split_tokens(x: Any, name: str, pieces: int, what: str) -> np.ndarray:
    """x as an array of at least 2 dims whose token axis -2 splits into `pieces` equal chunks."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., tokens, E); got shape {x.shape}")
    if x.shape[-2] % pieces:
        raise ValueError(
            f"{name} has {x.shape[-2]} tokens (shape {x.shape}), which {what} cannot split into {pieces} "
            f"equal chunks; use a multiple of {pieces} tokens"
        )
    return x
