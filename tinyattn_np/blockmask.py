"""Which tiles of the score matrix run: the block mask, read by every blockwise kernel.

Cut the L x S scores into tiles of block_q x block_k. Under a mask each tile is one of three kinds:

    full      every query of the tile sees every key of it: run it, no mask needed
    partial   a mask edge crosses it: run it, then hide the keys its queries may not see
    empty     no query sees any key of it: never computed

Two things answer the kernels' questions about them (row_tiles for the forward, column_tiles for the
backward, and the mask_mod that hides keys in a partial tile):

    Band        the causal band (and a sliding window) by arithmetic, O(1) per tile: what
                flash_attention(causal=True, window=...) runs; its partial tiles are where the diagonal
                or the window's back edge crosses
    BlockMask   any mask_mod, from a table of tile kinds that create_block_mask fills tile by tile,
                calling the mask_mod on one tile at a time, never on all L x S (torch's FlexAttention)

For the causal mask they give the same tiles: create_block_mask(causal_mod(L, S), ...) is Band's plan.
tile_plan lists the tiles of a band, draw_tile_plan draws any plan ('#' full, '\\' partial, '.' empty).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    check_bool,
    check_count,
    check_positive_int,
    check_sizes,
    check_window,
    check_window_is_causal,
)
from ._mod_calls import name_of, visible
from ._tiles import EMPTY, FULL, PARTIAL, Heads, TileLike
from ._tuning import TILE_SIDE
from .masks import causal_offset
from .mods import causal_band, noop_mask

__all__ = [
    "CODE",
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "KINDS",
    "Band",
    "BlockMask",
    "Tile",
    "TilePlan",
    "check_band",
    "check_block_mask",
    "check_block_size",
    "create_block_mask",
    "draw_tile_plan",
    "square_tiles",
    "tile_plan",
]

# create_block_mask's tile, and the one-head algorithms': the tile rule's constant side
# (_tuning.constant_rule; measured: docs/results/tiles.md). torch's is 128, sized for a GPU's shared memory.
DEFAULT_BLOCK_Q = DEFAULT_BLOCK_K = TILE_SIDE

KINDS = (EMPTY, PARTIAL, FULL)  # a BlockMask's table holds each tile's kind (module doc) as its index here
CODE = {kind: code for code, kind in enumerate(KINDS)}  # kind -> its code in the table: empty 0, partial 1, full 2
AXES = ("batch", "head")  # the axes a BlockMask is indexed by


# ---------------------------------------------------------------------------------------------------
# the causal band, by arithmetic


class Band(NamedTuple):
    """The keys each query may see: every key (offset None), or the causal band: query i sees key j when
    j <= i + offset (offset = S - L bottom-right, 0 top-left), and with a window also j > i + offset - window.

    It answers the kernels' questions by arithmetic: the tiles of a row of query blocks (the forward), the
    tiles of a column of key blocks (the backward), and, through its mask_mod (mods.causal_band), which
    entries of a partial tile are hidden. The heads argument is accepted and ignored: every head sees
    the same band.
    """

    offset: int | None
    window: int | None = None

    @property
    def diagonal(self) -> int | None:
        """The offset of a causal band without a window, whose partial tiles the kernels hide by slices; None
        without causal or with a window (the kernels then ask the mask_mod)."""
        return self.offset if self.window is None else None

    @property
    def per_head(self) -> bool:
        """False: every head sees the same band, so the kernels may run several heads' tiles as one."""
        return False

    @property
    def BLOCK_SIZE(self) -> None:
        """None: the band's arithmetic holds for any tile size."""
        return None

    @property
    def mask_mod(self) -> Callable[..., Any]:
        """The band as a mask_mod: noop_mask without causal, else mods.causal_band(offset, window)."""
        return noop_mask if self.offset is None else causal_band(self.offset, self.window)

    def visible_keys(self, q_start: int, q_stop: int, n_k: int) -> range:
        """The keys that at least one query of q_start:q_stop may see."""
        if self.offset is None:
            return range(n_k)
        stop = min(n_k, q_stop + self.offset)  # the last query's diagonal, inclusive
        start = 0 if self.window is None else max(0, q_start + self.offset - self.window + 1)  # first's back edge
        return range(start, stop) if start < stop else range(0)  # rows past the keys' end see none (L > S + w)

    def visible_queries(self, k_start: int, k_stop: int, n_q: int) -> range:
        """The queries that see at least one key of k_start:k_stop."""
        if self.offset is None:
            return range(n_q)
        start = max(0, k_start - self.offset)  # the first query whose diagonal reaches the first key
        stop = n_q if self.window is None else min(n_q, k_stop - 1 - self.offset + self.window)
        return range(start, stop) if start < stop else range(0)  # keys no query reaches: no query

    def kind(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> str:
        """FULL when every query of the tile sees every key of it, else PARTIAL."""
        if self.offset is None:
            return FULL
        below_diagonal = k_stop - 1 <= q_start + self.offset  # the first query sees the last key
        inside_window = self.window is None or k_start > q_stop - 1 + self.offset - self.window  # last sees first
        return FULL if below_diagonal and inside_window else PARTIAL

    def row_tiles(
        self, q_start: int, q_stop: int, n_k: int, block_k: int, heads: Heads | None = None
    ) -> Iterator[Tile]:
        """The tiles of query block q_start:q_stop that run, on the key grid 0, block_k, ..., made one at a time."""
        keys = self.visible_keys(q_start, q_stop, n_k)
        for k_start in range(keys.start // block_k * block_k, keys.stop, block_k):
            k_stop = min(k_start + block_k, n_k)
            yield Tile(q_start, q_stop, k_start, k_stop, self.kind(q_start, q_stop, k_start, k_stop))

    def column_tiles(
        self, k_start: int, k_stop: int, n_q: int, block_q: int, heads: Heads | None = None
    ) -> Iterator[Tile]:
        """The tiles of key block k_start:k_stop that run, on the query grid 0, block_q, ..., one at a time."""
        queries = self.visible_queries(k_start, k_stop, n_q)
        for q_start in range(queries.start // block_q * block_q, queries.stop, block_q):
            q_stop = min(q_start + block_q, n_q)
            yield Tile(q_start, q_stop, k_start, k_stop, self.kind(q_start, q_stop, k_start, k_stop))

    def row_length(self, q_start: int, q_stop: int, n_k: int, block_k: int, heads: Heads | None = None) -> int:
        """How many tiles row_tiles makes, without making them."""
        keys = self.visible_keys(q_start, q_stop, n_k)
        return len(range(keys.start // block_k * block_k, keys.stop, block_k))

    def place(self, tile: TileLike, n_k: int, block_k: int, heads: Heads | None = None) -> int:
        """How many tiles of its row come before tile: the keys a row sees are contiguous."""
        return tile.k_start // block_k - self.visible_keys(tile.q_start, tile.q_stop, n_k).start // block_k

    def hidden(self, tile: Tile) -> NDArray[np.bool_]:
        """(bq, bk) bool, True where the tile's query may not see its key (only asked of partial tiles)."""
        rows, cols = np.arange(tile.q_start, tile.q_stop)[:, None], np.arange(tile.k_start, tile.k_stop)[None, :]
        return ~visible(self.mask_mod, 0, 0, rows, cols)  # (bq, bk)


def check_band(causal: Any, window: Any, n_q: int, n_k: int, align: Any = "bottom_right") -> Band:
    """causal, window and align checked, as the Band they describe."""
    causal = check_bool(causal, "causal")
    offset = causal_offset(n_q, n_k, align)  # checks align even when causal=False
    check_window_is_causal(window, causal)
    if window is not None:
        window = check_window(window, n_q, n_k)
    return Band(offset if causal else None, window)


def check_block_mask(block_mask: Any, dims: QKVShape) -> BlockMask:
    """block_mask as a BlockMask made for these inputs' sizes: batch entries, query heads, L and S."""
    if not isinstance(block_mask, BlockMask):
        got = type(block_mask).__name__
        raise TypeError(f"block_mask must be a BlockMask (create_block_mask) or None; got {got}")
    block_mask.check_for(int(np.prod(dims.batch, dtype=np.int64)), dims.hq, dims.n_q, dims.n_k)
    return block_mask


class Tile(NamedTuple):
    """One block of the score matrix that runs: rows q_start:q_stop, columns k_start:k_stop.

    kind is FULL (no entry masked) or PARTIAL (a mask edge crosses it: needs a mask); an EMPTY tile never runs.
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    kind: str


# ---------------------------------------------------------------------------------------------------
# any mask_mod, from a table of tile kinds


class BlockMask:
    """The kind of every tile, for each batch entry and query head (torch's BlockMask, in NumPy).

    Basics: make one with create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN); print it to see its tiles.

    Details. kinds: int8 (B, H, ⌈Q_LEN / block_q⌉, ⌈KV_LEN / block_k⌉), 0 empty, 1 partial, 2 full; B or H
    of 1 is shared by every batch entry or head (then the mask_mod must not depend on b or h). mask_mod
    hides the keys of the partial tiles. torch's names read the same table: kv_num_blocks and kv_indices
    list each query block's partial tiles, full_kv_num_blocks and full_kv_indices its full ones;
    to_dense() is the tile map, sparsity() the percent of tiles skipped. block_mask[b], block_mask[:, h]:
    the mask of some batch entries and heads (as torch indexes one). A BlockMask does not change once
    made: its tables are read-only (the backward's order of tiles is computed from them), and so are
    its attributes; to change the tiles, make another.
    """

    def __init__(
        self, kinds: Any, seq_lengths: tuple[int, int], BLOCK_SIZE: int | tuple[int, int], mask_mod: Callable[..., Any]
    ):
        self._kinds, self._seq_lengths, self._block_size = check_tiles(kinds, seq_lengths, BLOCK_SIZE)
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx); got {mask_mod!r}")
        self._mask_mod = mask_mod
        seen = self._kinds != CODE[EMPTY]
        self._before = read_only((np.cumsum(seen, axis=-1) - seen).astype(np.int32))  # tiles left of each in its row

    kinds = property(lambda self: self._kinds.view(), doc="(B, H, n_q blocks, n_k blocks) int8, read-only")
    diagonal = property(lambda self: None, doc="None: a kernel hides a partial tile's keys with the mask_mod")
    per_head = property(lambda self: True, doc="True: the tiles may differ between heads (a step takes one)")
    seq_lengths = property(lambda self: self._seq_lengths, doc="(Q_LEN, KV_LEN)")
    BLOCK_SIZE = property(lambda self: self._block_size, doc="(block_q, block_k): the tiles' size")
    mask_mod = property(lambda self: self._mask_mod, doc="the mask_mod that hides the keys of partial tiles")

    def __getitem__(self, index: Any) -> BlockMask:
        """block_mask[b], block_mask[:, h], block_mask[b, h] (ints, slices or int arrays): the mask of those
        batch entries and heads, as torch indexes a BlockMask; an int keeps its axis (of size 1, shared).
        Its mask_mod is the original one, called with the original b and h."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 2:
            raise IndexError(f"a BlockMask is indexed by batch entry and head, [b] or [b, h]; got {len(index)} indices")
        index = (*index, slice(None))[:2]
        b_pick, h_pick = (picked(i, n, axis) for i, n, axis in zip(index, self._kinds.shape[:2], AXES, strict=True))
        kinds = self._kinds[b_pick[:, None], h_pick[None, :]]  # (len(b_pick), len(h_pick), n_q blocks, n_k blocks)
        return BlockMask(kinds, self._seq_lengths, self._block_size, picked_mod(self._mask_mod, b_pick, h_pick))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN), as torch's BlockMask.shape."""
        b_size, h_size = self._kinds.shape[:2]
        return b_size, h_size, *self.seq_lengths

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
            f"mask_mod={name_of(self.mask_mod)})"
        )

    def __str__(self) -> str:
        return draw_tile_plan(self)

    def sparsity(self) -> float:
        """The percent of tiles that never run (torch's BlockMask.sparsity)."""
        return 100.0 * float(np.mean(self._kinds == CODE[EMPTY])) if self._kinds.size else 0.0

    def to_dense(self) -> np.ndarray:
        """(B, H, n_q blocks, n_k blocks) int32, 1 where a tile runs (torch's BlockMask.to_dense)."""
        return (self._kinds != CODE[EMPTY]).astype(np.int32)

    def indices(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """How many tiles of `kind` (PARTIAL or FULL) each query block has (B, H, n_q blocks), and their key
        blocks, first."""
        chosen = self._kinds == CODE[kind]
        order = np.argsort(~chosen, axis=-1, kind="stable")  # the chosen key blocks first, each in order
        return chosen.sum(axis=-1, dtype=np.int32), order.astype(np.int32)

    kv_num_blocks = property(lambda self: self.indices(PARTIAL)[0], doc="partial tiles per query block")
    kv_indices = property(lambda self: self.indices(PARTIAL)[1], doc="their key blocks, first in each row")
    full_kv_num_blocks = property(lambda self: self.indices(FULL)[0], doc="full tiles per query block")
    full_kv_indices = property(lambda self: self.indices(FULL)[1], doc="their key blocks, first in each row")

    def kinds_of(self, heads: Heads | None, q_block: Any = slice(None), k_block: Any = slice(None)) -> np.ndarray:
        """The kinds of the tiles [q_block, k_block] that one step over these heads (None: every head) sees:
        full where full for every head, empty where empty for every head, else partial (the mask_mod then
        hides what each head may not see)."""
        b_size, h_size = self._kinds.shape[:2]
        if (b_size, h_size) == (1, 1):
            return self._kinds[0, 0, q_block, k_block]
        if heads is None:
            each = self._kinds[:, :, q_block, k_block].reshape(b_size * h_size, -1)  # (B·H, tiles)
        else:  # a mask of B or H = 1 is shared: entry 0 for every batch entry or head
            each = self._kinds[heads.b % b_size, heads.h % h_size, q_block, k_block].reshape(len(heads.b), -1)
        full, empty = (each == CODE[FULL]).all(axis=0), (each == CODE[EMPTY]).all(axis=0)
        kinds = np.where(full, CODE[FULL], np.where(empty, CODE[EMPTY], CODE[PARTIAL])).astype(np.int8)
        return kinds.reshape(self._kinds[0, 0, q_block, k_block].shape)

    def row_tiles(
        self, q_start: int, q_stop: int, n_k: int, block_k: int, heads: Heads | None = None
    ) -> Iterator[Tile]:
        """The tiles of query block q_start:q_stop that run, in key order (block_k is BLOCK_SIZE[1])."""
        row = self.kinds_of(heads, q_block=q_start // self.BLOCK_SIZE[0])  # (n_k blocks,)
        for k_block in np.flatnonzero(row).tolist():
            k_start = k_block * self.BLOCK_SIZE[1]
            yield Tile(q_start, q_stop, k_start, min(k_start + self.BLOCK_SIZE[1], n_k), KINDS[row[k_block]])

    def column_tiles(
        self, k_start: int, k_stop: int, n_q: int, block_q: int, heads: Heads | None = None
    ) -> Iterator[Tile]:
        """The tiles of key block k_start:k_stop that run, in query order (block_q is BLOCK_SIZE[0])."""
        column = self.kinds_of(heads, k_block=k_start // self.BLOCK_SIZE[1])  # (n_q blocks,)
        for q_block in np.flatnonzero(column).tolist():
            q_start = q_block * self.BLOCK_SIZE[0]
            yield Tile(q_start, min(q_start + self.BLOCK_SIZE[0], n_q), k_start, k_stop, KINDS[column[q_block]])

    def row_length(self, q_start: int, q_stop: int, n_k: int, block_k: int, heads: Heads | None = None) -> int:
        """How many tiles row_tiles makes."""
        return int(np.count_nonzero(self.kinds_of(heads, q_block=q_start // self.BLOCK_SIZE[0])))

    def place(self, tile: TileLike, n_k: int, block_k: int, heads: Heads | None = None) -> int:
        """How many tiles of its row come before tile, for the one head of heads (the backward's items)."""
        b, h = (0, 0) if heads is None else (int(heads.b[0]), int(heads.h[0]))
        table = self._before[b % self._before.shape[0], h % self._before.shape[1]]  # (n_q blocks, n_k blocks)
        return int(table[tile.q_start // self.BLOCK_SIZE[0], tile.k_start // self.BLOCK_SIZE[1]])

    def hidden(self, tile: Tile) -> NDArray[np.bool_]:
        """(bq, bk) bool, True where the mask_mod hides the key from the query (batch entry 0, head 0)."""
        rows, cols = np.arange(tile.q_start, tile.q_stop)[:, None], np.arange(tile.k_start, tile.k_stop)[None, :]
        return ~np.broadcast_to(visible(self.mask_mod, 0, 0, rows, cols), (len(rows), cols.shape[1]))

    def check_for(self, batch: int, hq: int, n_q: int, n_k: int) -> None:
        """Refuse a block mask made for other inputs: B and H must be 1 or the inputs', the lengths theirs."""
        b_size, h_size = self._kinds.shape[:2]
        if self.seq_lengths != (n_q, n_k) or b_size not in (1, batch) or h_size not in (1, hq):
            raise ValueError(
                f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {self.shape}; the inputs have B = {batch}, "
                f"Hq = {hq}, L = {n_q}, S = {n_k} (B and H of the mask must be 1 or the inputs')"
            )

    def tile_plan(self, b: int = 0, h: int = 0) -> TilePlan:
        """The tiles that run for batch entry b and head h, as tile_plan lists them (to draw or count):
        b one of the mask's B entries (0 .. B - 1), h one of its H heads."""
        for value, name, size in ((b, "b", self._kinds.shape[0]), (h, "h", self._kinds.shape[1])):
            if check_count(value, name) >= size:
                raise ValueError(
                    f"{name}={value} is not one of the block mask's {size} (0 .. {size - 1}); "
                    f"its shape (B, H, Q_LEN, KV_LEN) is {self.shape}"
                )
        (n_q, n_k), (block_q, block_k) = self.seq_lengths, self.BLOCK_SIZE
        heads = Heads(np.array([b]), np.array([h]))
        rows = range(0, n_q, block_q)
        tiles = [
            t for q_start in rows for t in self.row_tiles(q_start, min(q_start + block_q, n_q), n_k, block_k, heads)
        ]
        return TilePlan(tiles, n_q, n_k, block_q, block_k)


def check_block_size(BLOCK_SIZE: Any) -> tuple[int, int]:
    """BLOCK_SIZE as (block_q, block_k): an int for both, or a pair of positive ints."""
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"BLOCK_SIZE must be an int or a pair (block_q, block_k); got {BLOCK_SIZE!r}")
        return check_positive_int(BLOCK_SIZE[0], "BLOCK_SIZE"), check_positive_int(BLOCK_SIZE[1], "BLOCK_SIZE")
    size = check_positive_int(BLOCK_SIZE, "BLOCK_SIZE")
    return size, size


def check_tiles(kinds: Any, seq_lengths: Any, BLOCK_SIZE: Any) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """A BlockMask's table, lengths and tile size checked against each other; the table as a read-only
    int8 copy, so that nothing the caller holds can change it."""
    if not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2:
        raise ValueError(f"seq_lengths must be a pair (Q_LEN, KV_LEN); got {seq_lengths!r}")
    lengths = check_count(seq_lengths[0], "Q_LEN"), check_count(seq_lengths[1], "KV_LEN")
    block_q, block_k = check_block_size(BLOCK_SIZE)
    table = np.asarray(kinds)
    grid = (-(-lengths[0] // block_q), -(-lengths[1] // block_k))  # the tiles that lengths and BLOCK_SIZE make
    if table.ndim != 4 or table.shape[2:] != grid or min(table.shape[:2]) < 1:
        raise ValueError(
            f"kinds must have shape (B, H, {grid[0]}, {grid[1]}) for lengths {lengths} in tiles of "
            f"{(block_q, block_k)}, B and H at least 1; got shape {table.shape}"
        )
    if table.dtype.kind not in "iu" or not np.isin(table, list(CODE.values())).all():
        raise ValueError(f"kinds must hold the ints 0 (empty), 1 (partial) and 2 (full) only; got {table.dtype}")
    return read_only(table.astype(np.int8)), lengths, (block_q, block_k)


def read_only(table: np.ndarray) -> np.ndarray:
    """table, which the caller must own (a new array), made read-only in place."""
    table.flags.writeable = False
    return table


def picked(index: Any, size: int, axis: str) -> np.ndarray:
    """The entries 0 .. size - 1 of one axis that index picks, as a 1-D int array (an int keeps its axis)."""
    try:
        chosen = np.atleast_1d(np.arange(size)[index])  # (n,)
    except IndexError as err:
        raise IndexError(f"{axis} index {index!r} of a BlockMask with {size} {axis} entries: {err}") from None
    if chosen.ndim != 1 or chosen.size == 0:
        raise IndexError(f"{axis} index {index!r} must pick at least one of a BlockMask's {size} {axis} entries")
    return chosen


def picked_mod(mask_mod: Callable[..., Any], b_pick: np.ndarray, h_pick: np.ndarray) -> Callable[..., Any]:
    """mask_mod for the batch entries b_pick and heads h_pick of a bigger mask: entry b of the picked mask is
    entry b_pick[b] of the original (every b, when one entry is picked and so shared)."""

    def picked_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b_pick[np.asarray(b) % b_pick.size], h_pick[np.asarray(h) % h_pick.size], q_idx, kv_idx)

    picked_mask.__name__ = f"{name_of(mask_mod)}[b in {b_pick.tolist()}, h in {h_pick.tolist()}]"
    return picked_mask


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_Q,
) -> BlockMask:
    """The BlockMask of mask_mod(b, h, q_idx, kv_idx) (torch's create_block_mask): one call per tile, for
    every batch entry and head at once, so nothing of L x S is ever held. B or H = None: one entry shared
    by all (the mask_mod must not depend on b or h then). BLOCK_SIZE: an int or (block_q, block_k); the
    kernels run tiles of that size. Time O(L·S) comparisons, once per mask, however many layers use it.

    >>> from tinyattn_np.mods import causal_mod
    >>> print(create_block_mask(causal_mod(6, 6), None, None, 6, 6, BLOCK_SIZE=2))
    \\ . .
    # \\ .
    # # \\
    """
    if device not in (None, "cpu"):
        raise ValueError(f"device must be None or 'cpu': NumPy runs on the CPU; got {device!r}")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx); got {mask_mod!r}")
    b_size, h_size = (1 if n is None else check_positive_int(n, name) for n, name in ((B, "B"), (H, "H")))
    n_q, n_k = check_count(Q_LEN, "Q_LEN"), check_count(KV_LEN, "KV_LEN")
    block_q, block_k = check_block_size(BLOCK_SIZE)
    b, h = np.arange(b_size)[:, None, None, None], np.arange(h_size)[None, :, None, None]  # (B, 1, 1, 1), (1, H, 1, 1)
    kinds = np.empty((b_size, h_size, -(-n_q // block_q), -(-n_k // block_k)), np.int8)
    for i, q_start in enumerate(range(0, n_q, block_q)):
        q_idx = np.arange(q_start, min(q_start + block_q, n_q))[:, None]  # (bq, 1)
        for j, k_start in enumerate(range(0, n_k, block_k)):
            kv_idx = np.arange(k_start, min(k_start + block_k, n_k))[None, :]  # (1, bk)
            tile = np.broadcast_to(visible(mask_mod, b, h, q_idx, kv_idx), (b_size, h_size, q_idx.size, kv_idx.size))
            seen = np.count_nonzero(tile, axis=(2, 3))  # (B, H): how many (query, key) pairs of the tile may attend
            kinds[:, :, i, j] = np.where(seen == tile[0, 0].size, CODE[FULL], np.minimum(seen, CODE[PARTIAL]))
    return BlockMask(kinds, (n_q, n_k), (block_q, block_k), mask_mod)


# ---------------------------------------------------------------------------------------------------
# listing and drawing the tiles


class TilePlan(list[Tile]):
    """The tiles that run, as a list, with the sizes they were planned for (draw_tile_plan reads them)."""

    def __init__(self, tiles: list[Tile], n_q: int, n_k: int, block_q: int, block_k: int):
        super().__init__(tiles)
        self.n_q, self.n_k, self.block_q, self.block_k = n_q, n_k, block_q, block_k


def tile_plan(
    n_q: int,
    n_k: int,
    block_q: int,
    block_k: int,
    *,
    causal: bool = False,
    window: int | None = None,
    align: str = "bottom_right",
) -> TilePlan:
    """The tiles of an n_q x n_k score matrix that flash_attention computes, row block by row block.

    Without causal every tile runs, all "full". With causal (bottom-right: query i sees key j when
    j <= i + n_k - n_q; align="top_left": j <= i) a tile wholly above the diagonal is left out, a tile
    wholly below it is "full", and a tile the diagonal crosses is "partial". Rows that see no key at all
    (n_q > n_k) get no tile. window (needs causal=True): each query sees only the last `window` keys,
    itself included; tiles wholly behind that band are left out too, and those its back edge crosses are
    "partial". flash_attention makes the same tiles one query block at a time; this list is for counting
    and drawing. BlockMask.tile_plan() lists a block mask's tiles the same way.

    >>> print(draw_tile_plan(tile_plan(4, 4, 2, 2, causal=True)))
    \\ .
    # \\
    """
    n_q, n_k = check_sizes(n_q, n_k)
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    band = check_band(causal, window, n_q, n_k, align)
    rows = range(0, n_q, block_q)
    tiles = [tile for q_start in rows for tile in band.row_tiles(q_start, min(q_start + block_q, n_q), n_k, block_k)]
    return TilePlan(tiles, n_q, n_k, block_q, block_k)


@functools.lru_cache(maxsize=64)
def square_tiles(tokens: int, block_q: int, block_k: int, causal: bool) -> int:
    """len(tile_plan(tokens, tokens, block_q, block_k, causal=causal)), counted row block by row block
    without making the tiles, and remembered: the sequence-parallel schemes ask for the same few sizes at
    every step."""
    band = Band(0 if causal else None)
    return sum(band.row_length(q, min(q + block_q, tokens), tokens, block_k) for q in range(0, tokens, block_q))


def draw_tile_plan(
    tiles: TilePlan | BlockMask,
    n_q: int | None = None,
    n_k: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> str:
    """A character map of the tile grid: '#' full tile, '\\' a tile a mask edge crosses, '.' skipped.

    tiles: what tile_plan() returns, or a BlockMask (its batch entry 0 and head 0; block_mask.tile_plan(b, h)
    for another). The plan carries its own sizes: draw_tile_plan(tile_plan(...)) is enough. Sizes passed as
    well must be the plan's (a grid of other sizes would draw a wrong picture), else ValueError.
    """
    if isinstance(tiles, BlockMask):
        tiles = tiles.tile_plan()
    if not isinstance(tiles, TilePlan):
        raise TypeError(
            f"tiles must be what tile_plan() returns (a TilePlan) or a BlockMask; got {type(tiles).__name__}"
        )
    given = {"n_q": n_q, "n_k": n_k, "block_q": block_q, "block_k": block_k}
    for name, value in given.items():
        if value is not None and value != getattr(tiles, name):
            raise ValueError(f"{name}={value!r} does not match the plan, which has {name}={getattr(tiles, name)}")
    marks = {FULL: "#", PARTIAL: "\\"}
    n_rows, n_cols = -(-tiles.n_q // tiles.block_q), -(-tiles.n_k // tiles.block_k)
    grid = [["."] * n_cols for _ in range(n_rows)]
    for t in tiles:
        grid[t.q_start // tiles.block_q][t.k_start // tiles.block_k] = marks[t.kind]
    return "\n".join(" ".join(row) for row in grid)
