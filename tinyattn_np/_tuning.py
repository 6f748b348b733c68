"""The process-wide knobs of the fast paths, in one room: each has a default worked out for this machine, a
way to set it for the process (tune.tune() does, with what it measured), and the value in force that the
engines read at every call. A knob changes speed, and where it sets the order of the sums the last bits, never
what is computed (the tests hold every value of each to the reference).

    the decode layout   how a decode step makes a block of scores (flash_decode, the caches' decoding)
    the row block       elements in a block of rows of the elementwise layers (layers.py's layer_norm, gelu, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from ._checks import check_bool, check_positive_int
from ._parallel import blas_kernel_set, l2_cache_bytes

R = TypeVar("R")

__all__ = [
    "DECODE_LAYOUTS",
    "DEFAULT_LAYOUT",
    "KERNEL_LAYOUTS",
    "ROW_BLOCK",
    "SCORES_PER_BLOCK",
    "VECTOR_ROWS",
    "DecodeLayout",
    "decode_layout",
    "default_layout",
    "default_row_block",
    "in_layout",
    "row_block",
    "use_decode_layout",
]


# ---------------------------------------------------------------------------------------------------
# the decode layout

# A block of a decode step holds about scores_per_block scores: large enough that the dozen NumPy calls of a
# step are few next to the bytes it reads, small enough that it stays in the core's cache (_decode_kernel.py).
SCORES_PER_BLOCK = 2**15
VECTOR_ROWS = 8  # keys_first: a matrix-vector product a query row, up to this many rows a kv head
# (measured: docs/results/decoding.md)


class DecodeLayout(NamedTuple):
    """How a decode step makes a block of scores s (N, R, bk): about `scores_per_block` of them a block, as
    one matrix product a kv head, queries first (keys_first=False: s = q Kᵀ), or keys first (keys_first=True:
    each query row's scores K q_r, a matrix-vector product, where a kv head has at most VECTOR_ROWS query
    rows; more rows make q Kᵀ). The two are the same sums; which BLAS makes faster depends on its kernels and
    the machine: a product of a few rows is one whose keys OpenBLAS first copies (packs), and a matrix-vector
    product reads them in place (docs/decoding.md). Untuned, a step takes the layout measured fastest under
    the kernel set NumPy's BLAS runs (KERNEL_LAYOUTS); tune() measures the layouts here (DECODE_LAYOUTS) and
    keeps the fastest."""

    scores_per_block: int
    keys_first: bool


DEFAULT_LAYOUT = DecodeLayout(SCORES_PER_BLOCK, keys_first=True)  # under kernels KERNEL_LAYOUTS does not name
DECODE_LAYOUTS = tuple(DecodeLayout(2**power, first) for power in (13, 15, 17) for first in (False, True))
# The layout measured fastest under each of OpenBLAS's kernel sets (scripts/decode.py --step --layouts;
# measured: docs/results/decoding.md).
KERNEL_LAYOUTS = {"SkylakeX": DecodeLayout(2**15, keys_first=True), "Haswell": DecodeLayout(2**15, keys_first=True)}
_layout_in_force: DecodeLayout | None = None  # set by use_decode_layout (tune.py); None: default_layout()


def default_layout() -> DecodeLayout:
    """The layout of an untuned step: KERNEL_LAYOUTS' for the kernels NumPy's BLAS runs, else
    DEFAULT_LAYOUT."""
    return KERNEL_LAYOUTS.get(blas_kernel_set(), DEFAULT_LAYOUT)


def use_decode_layout(layout: DecodeLayout | None) -> None:
    """Make layout the one flash_decode (and the caches' decoding) uses in this process, or with None go back
    to default_layout(). tune.tune() calls it with the layout it measured fastest."""
    global _layout_in_force
    if layout is not None:
        layout = DecodeLayout(check_positive_int(layout[0], "scores_per_block"), check_bool(layout[1], "keys_first"))
    _layout_in_force = layout


def in_layout(layout: DecodeLayout, fn: Callable[..., R], *args: Any) -> R:
    """fn(*args) with `layout` in force (use_decode_layout), and the layout in force before it again after."""
    before = _layout_in_force
    use_decode_layout(layout)
    try:
        return fn(*args)
    finally:
        use_decode_layout(before)


def decode_layout() -> DecodeLayout:
    """The layout in force: what use_decode_layout() set, else default_layout()."""
    return default_layout() if _layout_in_force is None else _layout_in_force


# ---------------------------------------------------------------------------------------------------
# the row block
#
# layer_norm, gelu, their backwards and cross_entropy are a few lines of NumPy, each line one pass over its
# arrays. Over a whole (N, H) array of many MiB every pass reads and writes main memory; over a block of rows
# of ROW_BLOCK elements, as many float32 as a core's L2 cache holds, the block's arrays stay in the CPU's
# caches from one line to the next. Each block costs each line a NumPy call, so the blocks are as large as the
# caches allow (python scripts/train_speed.py --row-blocks times each size; measured: docs/results/zen4.md).
# The lines and the results are the same for any block, bit for bit (_parallel.by_row_blocks runs them).


def default_row_block(l2_bytes: int | None) -> int:
    """Elements in a block of rows: the power of two up to l2_bytes / 4, a block of float32 the size of the
    core's L2 cache, 2^13 to 2^19; 2^17 (for an L2 of 512 KiB) where its size is unknown."""
    if not l2_bytes:
        return 1 << 17
    return 1 << min(19, max(13, (l2_bytes // 4).bit_length() - 1))


ROW_BLOCK = default_row_block(l2_cache_bytes())  # read at every call (row_block): set it to try another size


def row_block() -> int:
    """The row block in force: ROW_BLOCK, read now (a script that times the sizes sets it in turn)."""
    return ROW_BLOCK
