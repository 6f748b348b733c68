"""What a tile kernel reads of a block mask (blockmask.py teaches the masks): the three kinds of tile, the
query heads of a kernel step, and the TileMask protocol that blockmask.Band and blockmask.BlockMask answer.

The kernels (_flash_kernel.py, _backward_kernel.py) take a mask through this protocol alone, never through
the lesson's classes: what they ask of it is which tiles run (row_tiles, column_tiles, row_length, place),
the mask_mod that hides keys in a partial tile, and three facts that choose a path (diagonal, per_head,
BLOCK_SIZE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

__all__ = ["EMPTY", "FULL", "PARTIAL", "Heads", "TileLike", "TileMask"]

EMPTY, PARTIAL, FULL = "empty", "partial", "full"  # the three kinds of tile (blockmask.py); Tile.kind is one


class Heads(NamedTuple):
    """The query heads a kernel step runs: batch entry b[n] and query head h[n] of each, (n,) ints."""

    b: np.ndarray
    h: np.ndarray


class TileLike(Protocol):
    """What a kernel reads of a tile (blockmask.Tile): its rows q_start:q_stop, its columns k_start:k_stop,
    and its kind, FULL or PARTIAL."""

    @property
    def q_start(self) -> int: ...

    @property
    def q_stop(self) -> int: ...

    @property
    def k_start(self) -> int: ...

    @property
    def k_stop(self) -> int: ...

    @property
    def kind(self) -> str: ...


class TileMask(Protocol):
    """What the kernels ask of a mask; blockmask.Band and blockmask.BlockMask both answer. heads: the query
    heads of the step (a Band's answers are the same for every head). place: how many tiles of its row come
    before a tile.

    diagonal: the offset of a causal band without a window (query i sees key j <= i + diagonal), whose partial
    tiles a kernel hides by slices; None for any other mask. per_head: whether the tiles may differ between
    heads (then a backward item takes one head). BLOCK_SIZE: the (block_q, block_k) the mask was made for, or
    None where any tile size will do."""

    @property
    def mask_mod(self) -> Callable[..., Any]: ...

    @property
    def diagonal(self) -> int | None: ...

    @property
    def per_head(self) -> bool: ...

    @property
    def BLOCK_SIZE(self) -> tuple[int, int] | None: ...

    def row_tiles(
        self, q_start: int, q_stop: int, n_k: int, block_k: int, heads: Heads | None = None
    ) -> Iterator[TileLike]: ...

    def column_tiles(
        self, k_start: int, k_stop: int, n_q: int, block_q: int, heads: Heads | None = None
    ) -> Iterator[TileLike]: ...

    def row_length(
        self,
        q_start: int,
        q_stop: int,
        n_k: int,
        block_k: int,
        heads: Heads | None = None,
    ) -> int: ...

    def place(self, tile: TileLike, n_k: int, block_k: int, heads: Heads | None = None) -> int: ...
