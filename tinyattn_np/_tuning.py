"""The process-wide knobs, in one room: what a call takes when it was not told.

The tile rule: the tile sizes, kv heads per tile step and workers of flash_attention and
flash_attention_backward (and flex_attention's, and the sequence-parallel schemes' per rank). The constants
(constant_rule), or the rule tune() measured on this machine (tune.py calls use_tile_rule); tile_rule() is the
rule in force. A block_q, block_k, kv_heads_per_step or workers that a call passes always wins over it. The
rule sets the order of the sums, so one rule gives the same bits on every run and for any number of workers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._checks import QKVShape, check_positive_int
from ._parallel import cpu_cores

__all__ = [
    "SCORES_PER_STEP",
    "SCORES_PER_WORKER",
    "SMALLEST_SIDE",
    "TILE_SIDE",
    "TileRule",
    "backward_heads_per_item",
    "backward_side",
    "call_workers",
    "constant_rule",
    "default_tiles",
    "diagonal_side",
    "tile_rule",
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
    fits = [c for c in range(1, n_heads + 1) if n_heads % c == 0 and c * tile <= budget]
    return max((c for c in fits if (n_heads // c) * key_blocks >= workers), default=1)
