"""The process-wide knobs of the fast paths, in one room: what a call takes when it was not told. Each has a
default worked out for this machine, a way to set it for the process (tune.tune() does, with what it measured),
and the value in force that the engines read at every call. A knob changes speed, and where it sets the order of
the sums the last bits, never what is computed (the tests hold every value of each to the reference).

    the tile rule       tile sizes, kv heads per tile step and workers of flash_attention and its backward
                        (and flex_attention's, and the sequence-parallel schemes' per rank)
    the decode layout   how a decode step makes a block of scores (flash_decode, the caches' decoding)
    the row block       elements in a block of rows of the elementwise layers (layers.py's layer_norm, gelu, ...)

A block_q, block_k, kv_heads_per_step or workers that a call passes always wins over the tile rule. The rule
sets the order of the sums, so one rule gives the same bits on every run and for any number of workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ._checks import QKVShape, check_bool, check_positive_int
from ._parallel import blas_kernel_set, cpu_cores, cpu_maker, l2_cache_bytes

R = TypeVar("R")

__all__ = [
    "DECODE_LAYOUTS",
    "DEFAULT_LAYOUT",
    "DecodeLayout",
    "KERNEL_LAYOUTS",
    "MOST_ROW_BLOCK",
    "ROW_BLOCK",
    "SCORES_PER_BLOCK",
    "SCORES_PER_STEP",
    "SCORES_PER_WORKER",
    "SMALLEST_SIDE",
    "TILE_SIDE",
    "TileRule",
    "VECTOR_ROWS",
    "backward_heads_per_item",
    "backward_side",
    "call_workers",
    "constant_rule",
    "decode_layout",
    "default_layout",
    "default_row_block",
    "default_tiles",
    "diagonal_side",
    "in_layout",
    "row_block",
    "tile_rule",
    "use_decode_layout",
    "use_row_block",
    "use_tile_rule",
    "workers_for",
]

# ---------------------------------------------------------------------------------------------------
# the tile rule

# The constant rule: square tiles of TILE_SIDE and a tile step of up to SCORES_PER_STEP scores, both doubled
# on more than 8 cores. Measured: docs/results/tiles.md (scripts/tiles.py); tune.py measures this machine.
TILE_SIDE = 256
SCORES_PER_STEP = 2**18


class TileRule(NamedTuple):
    """What flash_attention and its backward take when no size is given: square tiles of `side` and, in each
    tile step, the query heads of as many kv heads as fit in `scores_per_step` scores (the forward); square
    tiles of `backward_side` (the backward); `workers` threads (both)."""

    side: int
    scores_per_step: int
    backward_side: int
    workers: int


def constant_rule(cores: int | None = None) -> TileRule:
    """The constants: tiles of 256 and 2^18 scores a step (512 and 2^19 on more than 8 cores), the backward's
    tiles of 256, a worker per core. Measured: docs/results/tiles.md (docs/flash.md explains them)."""
    cores = cores if cores is not None else cpu_cores()
    if cores <= 8:
        return TileRule(TILE_SIDE, SCORES_PER_STEP, TILE_SIDE, cores)
    return TileRule(2 * TILE_SIDE, 2 * SCORES_PER_STEP, TILE_SIDE, cores)


_rule_in_force: TileRule | None = None  # set by use_tile_rule (tune.py); None: the constants


def use_tile_rule(rule: TileRule | None) -> None:
    """Make rule the defaults of flash_attention and flash_attention_backward in this process, or with None
    go back to the constants. tune.tune() calls it with the rule it measured."""
    global _rule_in_force
    if rule is not None:
        rule = TileRule(*(check_positive_int(value, name) for name, value in rule._asdict().items()))
    _rule_in_force = rule


def tile_rule(cores: int | None = None) -> TileRule:
    """The rule in force: what use_tile_rule() set, else the constants. Given `cores`, the constants for that
    many cores, whatever is in force."""
    rule = _rule_in_force
    return rule if rule is not None and cores is None else constant_rule(cores)


SCORES_PER_WORKER = 2**18  # a worker for each this many scores of a call, at most (call_workers)


def call_workers(dims: QKVShape, workers: Any = None) -> int:
    """The workers of a call: `workers` checked (a positive int) if given, else workers_for the call's L x S
    scores over all its heads."""
    scores = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq * dims.n_q * dims.n_k
    return check_positive_int(workers, "workers", default=workers_for(scores))


def workers_for(scores: int, cores: int | None = None) -> int:
    """The rule's workers (a worker per core, or what tune() measured: tile_rule), but no more than one per
    SCORES_PER_WORKER of a call's `scores`: a small call's items take less time than it takes to wake another
    thread and share the interpreter lock with it (docs/flash.md, "Block sizes and workers"). The workers
    never change the result's bits."""
    return max(1, min(tile_rule(cores).workers, scores // SCORES_PER_WORKER))


def default_tiles(
    n_q: int,
    n_k: int,
    group: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    cores: int | None = None,
    kv_heads: int | None = None,
    diagonal: int | None = None,
) -> tuple[int, int, int]:
    """(block_q, block_k, kv heads per step) for L = n_q, S = n_k and G = group query heads per kv head.

    The rule in one sentence: square tiles of 256 (512 on more than 8 cores), and in each tile step the
    G query heads of as many kv heads as fit in 2^18 scores (2^19 on more than 8 cores), or what tune()
    measured on this machine (tile_rule). Given block sizes are kept and the heads fill the same budget.
    diagonal: the offset of a causal band without a window (query i sees key j <= i + diagonal), whose short
    contexts get smaller tiles (diagonal_side); None: no diagonal.
    kv_heads, the kv heads of the call (batch entries times Hkv): where there are few query blocks, no more
    heads a step than leave an item for each of the workers the call's size gets by default (workers_for: a
    short context's one query block would otherwise be one step on one core). It depends on the shape and
    the rule only, never on the workers a call asks for, so every worker count gives the same bits.
    """
    rule = tile_rule(cores)
    side = diagonal_side(rule.side, n_q, diagonal)
    block_q = side if block_q is None else block_q
    block_k = side if block_k is None else block_k
    # the scores of one kv head's tile: its G query heads' bq x bk
    scores_per_kv_head = max(1, group) * max(1, min(block_q, n_q)) * max(1, min(block_k, n_k))
    heads = max(1, rule.scores_per_step // scores_per_kv_head)
    if kv_heads:  # the steps of one query block that keep every worker busy
        workers = workers_for(kv_heads * max(1, group) * n_q * n_k, cores)
        steps = -(-workers // max(1, -(-n_q // block_q)))
        heads = max(1, min(heads, -(-kv_heads // steps)))
    return block_q, block_k, heads


def backward_side(n_q: int, diagonal: int | None) -> int:
    """The default tile side of flash_attention_backward for L = n_q: the rule's backward side (tile_rule),
    made smaller for a short causal band as the forward's (diagonal_side; diagonal None: no diagonal)."""
    return diagonal_side(tile_rule().backward_side, n_q, diagonal)


SMALLEST_SIDE = 64  # diagonal_side halves a tile's side down to this, no further


def diagonal_side(side: int, n_q: int, diagonal: int | None) -> int:
    """The default tile side for a causal band without a window: `side`, halved while the diagonal's waste
    below is over a quarter of the work, but not below SMALLEST_SIDE; diagonal None (no diagonal): side.

    Why: the tiles the diagonal crosses run whole. Each of the L queries finds about min(b, L) / 2 hidden keys
    in them (b / 2 on average where the tiles of side b are shorter than L; where they are not, the hidden
    keys are one triangle of L²/2), against the diagonal + (i + 1) keys query i sees, L·diagonal + L²/2 in
    all: a share of min(b, L) / (2·diagonal + L), a half where one tile covers L = S. A decode step (L = 1)
    wastes next to nothing and keeps its long key tiles. Measured: docs/results/xeon.md (from T = 1,024 on,
    256 stays)."""
    if diagonal is None:
        return side
    while side > SMALLEST_SIDE and 4 * min(side, n_q) > 2 * max(diagonal, 0) + n_q:
        side //= 2
    return side


def backward_heads_per_item(
    n_heads: int,
    n_q: int,
    n_k: int,
    block_q: int,
    block_k: int,
    workers: int,
) -> int:
    """How many of n_heads query heads that share their tiles (a causal band) flash_attention_backward's work
    item takes at once: the most, a divisor of n_heads, whose tiles of block_q x block_k (L = n_q, S = n_k)
    hold no more scores than one of the forward's tile steps (tile_rule().scores_per_step: 2^18 on up to 8
    cores), while each of `workers` still gets an item. Fewer, larger matmuls: a small tile's NumPy calls
    cost more in Python than in arithmetic (python scripts/tiles.py --profile --tokens 64 --heads 48 shows
    the parts)."""
    tile, key_blocks = min(block_q, n_q) * min(block_k, n_k), -(-n_k // block_k)
    budget = tile_rule().scores_per_step
    most = min(n_heads, budget // tile) if tile else n_heads  # c · tile <= budget: constant time in n_heads
    fits = [c for c in range(1, most + 1) if n_heads % c == 0]
    return max((c for c in fits if (n_heads // c) * key_blocks >= workers), default=1)


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
    product reads them in place (docs/decoding.md). Untuned, a step takes the layout measured fastest on a CPU
    of the same maker under the kernel set NumPy's BLAS runs (KERNEL_LAYOUTS); tune() measures the layouts
    here (DECODE_LAYOUTS) and keeps the fastest."""

    scores_per_block: int
    keys_first: bool


DEFAULT_LAYOUT = DecodeLayout(SCORES_PER_BLOCK, keys_first=True)  # where KERNEL_LAYOUTS names no layout
DECODE_LAYOUTS = tuple(DecodeLayout(2**power, first) for power in (13, 15, 17) for first in (False, True))
# The layout measured fastest under each of OpenBLAS's kernel sets, by the CPU's maker: the same kernels favour
# other layouts on an AMD EPYC and on an Intel Xeon (scripts/decode.py --step --layouts; measured:
# docs/results/decoding.md, docs/results/xeon.md).
KERNEL_LAYOUTS = {
    ("AuthenticAMD", "SkylakeX"): DecodeLayout(2**15, keys_first=True),
    ("AuthenticAMD", "Haswell"): DecodeLayout(2**15, keys_first=True),
    ("GenuineIntel", "SkylakeX"): DecodeLayout(2**13, keys_first=False),
    ("GenuineIntel", "Haswell"): DecodeLayout(2**17, keys_first=False),
}
_layout_in_force: DecodeLayout | None = None  # set by use_decode_layout (tune.py); None: default_layout()


def default_layout() -> DecodeLayout:
    """The layout of an untuned step: KERNEL_LAYOUTS' for this CPU's maker and the kernels NumPy's BLAS runs,
    else DEFAULT_LAYOUT."""
    return KERNEL_LAYOUTS.get((cpu_maker(), blas_kernel_set()), DEFAULT_LAYOUT)


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
# caches allow, but no larger than 2^18 elements (1 MiB of float32): a line reads and writes three or four arrays
# of the block's size at once (GELU's backward: dy, u, t and du), and blocks of 2 MiB each overflowed even a
# 2 MiB L2 (python scripts/train_speed.py --row-blocks times each size; measured: docs/results/zen4.md,
# docs/results/gpt.md). The lines and the results are the same for any block, bit for bit
# (_parallel.by_row_blocks runs them).
MOST_ROW_BLOCK = 1 << 18


def default_row_block(l2_bytes: int | None) -> int:
    """Elements in a block of rows: the power of two up to l2_bytes / 4, a block of float32 the size of the
    core's L2 cache, 2^13 to MOST_ROW_BLOCK (2^18); 2^17 (for an L2 of 512 KiB) where its size is unknown."""
    if not l2_bytes:
        return 1 << 17
    return min(MOST_ROW_BLOCK, 1 << max(13, (l2_bytes // 4).bit_length() - 1))


ROW_BLOCK = default_row_block(l2_cache_bytes())  # this machine's, the block of an untuned call
_row_block_in_force: int | None = None  # set by use_row_block; None: ROW_BLOCK


def use_row_block(elements: int | None) -> None:
    """Make `elements` the row block of the elementwise layers in this process, or with None go back to
    ROW_BLOCK (scripts/train_speed.py --row-blocks sets each size in turn)."""
    global _row_block_in_force
    _row_block_in_force = None if elements is None else check_positive_int(elements, "elements")


def row_block() -> int:
    """The row block in force: what use_row_block() set, else ROW_BLOCK, read at every call of the layers."""
    return ROW_BLOCK if _row_block_in_force is None else _row_block_in_force
