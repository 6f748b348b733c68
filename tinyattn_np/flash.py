"""Blockwise attention with an online softmax ("flash attention"): the same result as attention(),
without ever building the L x S score matrix.

For one block of queries, walk over the key blocks and keep three running quantities per query row:
    m    the largest score seen so far
    l    sum over the keys seen so far of exp(score - m)
    acc  sum over the keys seen so far of exp(score - m) · v      (not yet divided by l)
A new tile of scores s raises the maximum to m' = max(m, max s); everything accumulated so far was
measured against m, so it is rescaled by exp(m - m') before the tile is added:
    l'   = l · exp(m - m') + Σ exp(s - m')
    acc' = acc · exp(m - m') + exp(s - m') @ v_tile
After the last tile, out = acc / l and logsumexp = m + log l. (Milakov & Gimelshein 2018; Dao 2023,
"FlashAttention-2", Algorithm 1.) merge_states() in softmax.py is the same algebra for two finished parts.

Which tiles run is the block mask's to say (blockmask.py): the causal Band by arithmetic, or a BlockMask
made from any mask_mod. The one loop walks the tiles that run, applies a score_mod to every tile and the
mask_mod only to the partial ones (flex.py: FlexAttention). A sink (a learned logit per head that joins
every row's softmax, gpt-oss) is the running state a row starts from: m = sink, l = 1, acc = 0.

Read it in this order:
    flash_attention_one_head           Algorithm 1 for one head on one thread, as the paper prints it:
                                       m = -inf, l = 0, a line per equation (docs/online_softmax.md)
    flash_attention                    the same algorithm, fast: several heads share each tile step
                                       (one batched matmul for the query heads of one or more kv heads),
                                       worker threads take whole (heads, query block) items, and the sums
                                       are measured against 0 rather than the running max (attend_block),
                                       with the running max where exp(s) cannot hold them

Why the fast path batches heads: Python's per-call overhead (a few microseconds, with the interpreter
lock held) is then paid once for all of them, which is what lets worker threads scale with cores
(docs/flash.md). Memory: out, lse, and per worker one step's tile of scores (at most the step budget)
plus per-row vectors: O((L + S)·E + workers·budget), never L x S. The tiles of a query block are made
as it runs, so the plan itself costs no memory either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    as_float_array,
    check_bool,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
    result_dtype,
    without_head_axis,
)
from ._guard import refuse_blockwise
from ._parallel import cpu_cores, one_blas_thread, run_items
from .blockmask import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    FULL,
    Band,
    BlockMask,
    Heads,
    Tile,
    TileMask,
    check_band,
)
from .mods import modded, visible

__all__ = [
    "FlashPlan", "GroupedHeads", "SCORES_PER_STEP", "SCORES_PER_WORKER", "STRIP", "TileMods", "TileRule",
    "apply_mods", "attend_block", "attend_tiles", "backward_heads_per_item", "backward_side", "broadcast_kv",
    "call_workers", "check_flash", "constant_rule", "default_tiles", "diagonal_of", "diagonal_side", "finish_rows",
    "flash_attention", "flash_attention_one_head", "flash_forward", "flash_plan", "forward_items", "forward_results",
    "grouped_heads", "hide_past_diagonal", "item_parts", "kv_entries", "kv_rows", "running_start", "scaled_queries",
    "tile_mods", "tile_rule", "tile_scores", "trusted", "use_tile_rule", "workers_for",
]  # fmt: skip

Array = NDArray[np.floating]

# The constant defaults (constant_rule): square tiles of 256, and a tile step of up to 2^18 scores, both
# doubled on more than 8 cores. Measured in docs/results/tiles.md (scripts/tiles.py); tune.py measures this machine.
SCORES_PER_STEP = 2**18


# ---------------------------------------------------------------------------------------------------
# the mods of one tile


class TileMods(NamedTuple):
    """What rewrites a tile's scores: score_mod (or None) on every tile, the mask's mask_mod on a partial one,
    called with b and h, the batch entry and query head of the tile's rows, shaped to broadcast against it.
    diagonal: the offset of a causal band without a window (mask_mod is then causal_band(diagonal)), whose
    partial tiles are hidden by slices (hide_past_diagonal); None for any other mask."""

    mask_mod: Any
    score_mod: Any
    b: Any
    h: Any
    diagonal: int | None = None


def diagonal_of(tile_mask: TileMask) -> int | None:
    """TileMods.diagonal for a tile mask: a Band's offset when it is causal without a window, else None."""
    if isinstance(tile_mask, Band) and tile_mask.window is None:
        return tile_mask.offset
    return None


def apply_mods(s: np.ndarray, tile: Tile, mods: TileMods, q_idx: np.ndarray, kv_idx: np.ndarray, *,
               keys_down: bool) -> None:  # fmt: skip
    """In place: s = score_mod(s, b, h, q_idx, kv_idx) for every score of the tile, then -inf where the
    mask_mod hides a key, in a tile a mask edge crosses. exp(-inf - m) = 0: a hidden key gets no weight.
    keys_down: s is laid out (c, bk, G, bq) (the forward's tiles), else (c, bq, bk) (the backward's)."""
    if mods.score_mod is not None:
        np.copyto(s, modded(mods.score_mod, s, mods.b, mods.h, q_idx, kv_idx), casting="same_kind")
    if tile.kind == FULL:
        return
    if mods.diagonal is not None:
        hide_past_diagonal(s, tile, mods.diagonal, keys_down=keys_down)
    else:
        np.copyto(s, -np.inf, where=~visible(mods.mask_mod, mods.b, mods.h, q_idx, kv_idx))


STRIP = 32  # rows of a tile that hide_past_diagonal masks at once


def hide_past_diagonal(s: np.ndarray, tile: Tile, offset: int, *, keys_down: bool) -> None:
    """In place, -inf where key j > query i + offset: what causal_band(offset) hides, by slices. Query row r
    of the tile sees its key column k when k <= r + e, e = q_start + offset - k_start. STRIP rows at a time,
    the columns that every row of the strip hides are one slice, filled, and only the staircase beside them
    goes through a mask (np.copyto with where= costs several fills per element).
    s: keys down (c, bk, G, bq), key row r hiding query columns q < r - e; or queries down (c, bq, bk)."""
    e = tile.q_start + offset - tile.k_start
    n_rows, n_cols = s.shape[1], s.shape[-1]
    for r0 in range(0, n_rows, STRIP):
        r1 = min(r0 + STRIP, n_rows)
        rows = np.arange(r0, r1).reshape(-1, *(1,) * (s.ndim - 2))  # (strip, 1) or (strip, 1, 1): one per row
        if keys_down:  # every row hides the columns before r0 - e; the staircase is r0 - e .. r1 - 1 - e
            full, stair = min(max(r0 - e, 0), n_cols), min(max(r1 - 1 - e, 0), n_cols)
            s[:, r0:r1, ..., :full] = -np.inf
            np.copyto(s[:, r0:r1, ..., full:stair], -np.inf, where=np.arange(full, stair) < rows - e)
        else:  # every row hides the columns from r1 + e; the staircase is r0 + e + 1 .. r1 + e
            stair, full = min(max(r0 + e + 1, 0), n_cols), min(max(r1 + e, 0), n_cols)
            s[:, r0:r1, full:] = -np.inf
            np.copyto(s[:, r0:r1, stair:full], -np.inf, where=np.arange(stair, full) > rows + e)


def running_start(sinks: np.ndarray | None, h: np.ndarray, rows: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """m and l before the first tile, for the query heads h (n,) with `rows` queries each -> (n·rows,) each:
    no key seen (m = -inf, l = 0), or the head's sink already in the sum (m = sink, l = exp(sink - sink) = 1)."""
    if sinks is None:
        return np.full(h.size * rows, -np.inf, dtype), np.zeros(h.size * rows, dtype)
    return np.repeat(sinks[h], rows).astype(dtype), np.ones(h.size * rows, dtype)


# ---------------------------------------------------------------------------------------------------
# Algorithm 1, one head on one thread


def flash_attention_one_head(
    q: Array,  # (L, E)
    k: Array,  # (S, E)
    v: Array,  # (S, Ev)
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[Array, Array]:  # out (L, Ev), lse (L,)
    """FlashAttention-2's forward (Dao 2023, Algorithm 1) for one head, as the paper prints it: query blocks
    Q_i of B_r = block_q rows, key blocks K_j, V_j of B_c = block_k rows, a running max m_i, sum ℓ_i and
    output O_i per row, never more than a B_r x B_c tile of scores. A comment's first number is the line of
    the paper's algorithm, whose names the code keeps (m_i' is the paper's m_i^(j), m_i its m_i^(j-1)).

    q (L, E), k (S, E), v (S, Ev) -> out = softmax(scale · q kᵀ) v (L, Ev) and lse (L,), the logsumexp of
    each row's scaled scores, in the compute dtype (float32 for float16 inputs). causal=True is bottom-right:
    query i sees key j <= i + S - L; key blocks wholly past the diagonal are skipped (the paper's section 3.1.1).
    A row that sees no key gets out 0 and lse -inf. flash_attention is the same algorithm with many heads per
    step, worker threads and windows; the tests hold the two equal. Derived on docs/online_softmax.md.

    >>> out, lse = flash_attention_one_head(np.eye(2), np.eye(2), np.eye(2), causal=True, block_k=1)
    >>> out.round(2)  # query 0 sees key 0; query 1 sees both, its own a little more
    array([[1.  , 0.  ],
           [0.33, 0.67]])
    """
    q, k, v, scale = _check_one_head(q, k, v, causal, scale, block_q, block_k)
    n_q, n_k, offset = len(q), len(k), len(k) - len(q)  # L queries, S keys; query i sees key j <= i + offset
    out, lse = np.zeros((n_q, v.shape[1]), v.dtype), np.zeros(n_q, v.dtype)  # O (L, Ev) and the paper's L (L,)
    for q_start in range(0, n_q, block_q):  # 3: for each query block i
        rows = np.arange(q_start, min(q_start + block_q, n_q))  # (Br,) the rows of Q_i
        q_i = q[rows] * scale  # (Br, E) 4: Q_i, the scale folded in once
        o_i = np.zeros((len(rows), v.shape[1]), v.dtype)  # (Br, Ev) 5: O_i = 0
        l_i = np.zeros(len(rows), v.dtype)  # (Br,) 5: ℓ_i = 0
        m_i = np.full(len(rows), -np.inf, v.dtype)  # (Br,) 5: m_i = -∞
        n_seen = min(n_k, rows[-1] + 1 + offset) if causal else n_k  # causal: no key block past the last row's
        for k_start in range(0, n_seen, block_k):  # 6: for each key block j
            cols = np.arange(k_start, min(k_start + block_k, n_k))  # (Bc,) the rows of K_j and V_j
            s = q_i @ k[cols].T  # (Br, Bc) 8: S_ij = Q_i K_jᵀ
            if causal:  # in a tile the diagonal crosses: exp(-inf) = 0 gives a hidden key no weight
                s[cols > rows[:, None] + offset] = -np.inf
            m_new = np.maximum(m_i, s.max(axis=1))  # (Br,) 9: m_i' = max(m_i, rowmax(S_ij))
            m_sub = np.where(m_new == -np.inf, 0, m_new)  # (Br,) a row with no key yet: -inf - 0, not -inf + inf
            p = np.exp(s - m_sub[:, None])  # (Br, Bc) 9: P̃_ij = exp(S_ij - m_i')
            alpha = np.exp(m_i - m_sub)  # (Br,) exp(m_i - m_i'): rescales what was summed against the old max
            l_i = alpha * l_i + p.sum(axis=1)  # (Br,) 9: ℓ_i' = exp(m_i - m_i') ℓ_i + rowsum(P̃_ij)
            o_i = alpha[:, None] * o_i + p @ v[cols]  # (Br, Ev) 10: O_i' = diag(exp(m_i - m_i')) O_i + P̃_ij V_j
            m_i = m_new
        l_i[l_i == 0] = 1  # a row that saw no key: O_i = 0 / 1 = 0 and L_i = -inf + log 1 = -inf
        out[rows] = o_i / l_i[:, None]  # (Br, Ev) 12: O_i = diag(ℓ_i)⁻¹ O_i
        lse[rows] = m_i + np.log(l_i)  # (Br,) 13: L_i = m_i + log(ℓ_i)
    return out, lse


def _check_one_head(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, block_q: Any, block_k: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """One head's q (L, E), k (S, E), v (S, Ev) checked and in the compute dtype, with the scale; causal must
    be a bool and the block sizes positive ints."""
    if not without_head_axis(q):
        raise ValueError(f"q must be one head (L, E); got shape {np.shape(q)}: use flash_attention for more heads")
    check_bool(causal, "causal")
    check_positive_int(block_q, "block_q")
    check_positive_int(block_k, "block_k")
    q, k, v, dims = check_qkv(q, k, v)
    ct = compute_dtype(q, k, v)
    return q[0].astype(ct), k[0].astype(ct), v[0].astype(ct), check_scale(scale, dims.e, ct)


def _check_block_mask(block_mask: Any, dims: QKVShape) -> BlockMask:
    """block_mask as a BlockMask made for these inputs' sizes: batch entries, query heads, L and S."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (create_block_mask) or None; got {type(block_mask).__name__}")
    block_mask.check_for(int(np.prod(dims.batch, dtype=np.int64)), dims.hq, dims.n_q, dims.n_k)
    return block_mask


# ---------------------------------------------------------------------------------------------------
# the fast path: many heads per tile step, worker threads


def attend_block(q_t: np.ndarray, k: np.ndarray, v: np.ndarray, plan: FlashPlan, heads: Heads, rows: slice,
                 out_rows: np.ndarray, lse_rows: np.ndarray) -> None:  # fmt: skip
    """The softmax of one query block (rows) of c kv heads, each with its G query heads, over the tiles that
    plan.tile_mask says run for those heads.

    q_t (c, E, G·bq): the scaled queries, transposed; column g·bq + i is query i of head g of the group.
    k (c, S, E), v (c, S, Ev): the c kv heads; heads: the c·G query heads, kv head by kv head. Writes
    out_rows (c, G, bq, Ev) and lse_rows (c, G, bq).

    Why this is fast: the sums are first measured against 0, not against the running max (attend_tiles with
    running_max=False). The reference point cancels in acc / l, so any m gives the softmax; with m = 0 for
    every row and every tile (FlashDecoding++, Hong et al. 2023, section 3: a "unified max value"), nothing is
    found, subtracted or rescaled, and a tile is two matmuls, one exponential and one row sum:
        l   += Σ_keys exp(s)          acc += exp(s) @ v_tile          out = acc / l,  lse = log l
    m = 0 holds as long as exp(s) neither overflows nor leaves a row with nothing but underflowed terms;
    the sums say when it did not (trusted), and then the block is done again with the running max, so the
    result is the online softmax's either way.
    """
    c, _, n = q_t.shape
    acc = np.empty((c, n, v.shape[-1]), q_t.dtype)  # (c, n, Ev) Σ exp(s - m) v, filled by attend_tiles
    m, l = attend_tiles(q_t, k, v, plan, heads, rows, acc, running_max=False)
    if not trusted(l, acc):  # exp(s) overflowed, or a row's terms all underflowed: again with the running max
        m, l = attend_tiles(q_t, k, v, plan, heads, rows, acc, running_max=True)
    finish_rows(acc, m, l, out_rows, lse_rows)


def attend_tiles(
    q_t: np.ndarray, k: np.ndarray, v: np.ndarray, plan: FlashPlan, heads: Heads, rows: slice, acc: np.ndarray,
    *, running_max: bool,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The tile loop of attend_block: fills acc (c, n, Ev) with Σ exp(s - m) v and returns m and l (c, n), the
    reference point and Σ exp(s - m) of each row. running_max=False: m = 0 throughout (steps 3 and 5 skipped);
    True: the module doc's running max, m moved and what was summed rescaled at every tile.
    The score tile is kept transposed, keys down and queries across: (c, bk, n); BLAS sums its columns
    (ones @ s) faster than NumPy sums an axis.
    """
    c, _, n = q_t.shape
    dtype = q_t.dtype
    mods, q_idx = tile_mods(plan, heads, rows, c)
    m, l = (x.reshape(c, n) for x in running_start(plan.sinks, heads.h, rows.stop - rows.start, dtype))  # (c, n)
    if not running_max:  # a sink's term exp(sink) measured against 0 (no sink: 0), and m = 0 from here on
        l *= np.exp(m)
        m = np.zeros_like(m)
    written = False  # acc holds a tile's sum: the first tile's matmul writes it, nothing is zeroed to add to
    tile_buf = np.empty(c * min(plan.block_k, k.shape[1]) * n, dtype)  # the one score tile, reused
    ones = np.ones(min(plan.block_k, k.shape[1]), dtype)  # (bk,) sums the keys of a tile in one matmul
    with np.errstate(over="ignore", invalid="ignore"):  # against 0, an overflow shows in the sums (trusted)
        for t in plan.tile_mask.row_tiles(rows.start, rows.stop, k.shape[1], plan.block_k, heads):
            # 1) scores of this tile for every head of the step, 2) the mods (tile_scores)
            s = tile_scores(k, q_t, t, tile_buf, mods, q_idx)  # (c, bk, n): s[h, j, g·bq + i] = q_{g,i} · k_j
            if running_max:
                # 3) the new running max. A row that has seen no key yet keeps m' = -inf; it subtracts the
                #    lowest finite number instead, so that exp(-inf - lowest) = 0 and not exp(-inf + inf) = NaN.
                m_new = np.maximum(m, s.max(axis=1))  # (c, n)
                m_safe = np.maximum(m_new, np.finfo(dtype).min)  # (c, n)
                s -= m_safe[:, None, :]  # (c, bk, n) - (c, 1, n): each column is one query
            # 4) P̃ = exp(s - m) in place. (Not exp2 with log2(e) folded into q, as GPU kernels do: NumPy's exp2
            #    is twice as fast on moderate inputs but falls to a slow path, over 20x slower, where results
            #    underflow.)
            np.exp(s, out=s)
            if running_max:
                # 5) rescale what was accumulated against the old max; 0 where m was -inf, and l, acc are 0 then
                alpha = np.exp(m - m_safe)  # (c, n)
                l *= alpha
                if written:
                    acc *= alpha[:, :, None]
                m = m_new
            # 6) add the tile's row sums and its weighted values
            l += ones[: t.k_stop - t.k_start] @ s  # (bk,) @ (c, bk, n) -> (c, n)
            if written:  # (c, n, bk) @ (c, bk, Ev); BLAS reads sᵀ
                acc += s.transpose(0, 2, 1) @ v[:, t.k_start : t.k_stop]
            else:
                np.matmul(s.transpose(0, 2, 1), v[:, t.k_start : t.k_stop], out=acc)
                written = True
    if not written:  # no tile ran: every row saw no key
        acc[...] = 0
    return m, l


def trusted(l: np.ndarray, acc: np.ndarray) -> bool:
    """Whether sums against 0 hold every row's softmax: nothing overflowed (l and acc finite; a NaN from the
    inputs fails too) and l ≥ √tiny (1.1e-19 in float32), far above the underflow. Underflow costs out at most
    S·(smallest subnormal) / l absolute, below √tiny·S then. A row that saw no key (l = 0) fails: the
    running max sorts it out from one whose terms all underflowed."""
    return bool((l >= np.sqrt(np.finfo(l.dtype).tiny)).all() and np.isfinite(l).all() and np.isfinite(acc).all())


def tile_mods(plan: FlashPlan, heads: Heads, rows: slice, c: int) -> tuple[TileMods, np.ndarray]:
    """The mods of a block's tiles, with b and h shaped (c, 1, G, 1) to broadcast against a tile's (c, bk, G, bq)
    view, and the block's query positions q_idx (1, 1, 1, bq)."""
    b, h = heads.b.reshape(c, 1, -1, 1), heads.h.reshape(c, 1, -1, 1)
    mods = TileMods(plan.tile_mask.mask_mod, plan.score_mod, b, h, diagonal_of(plan.tile_mask))
    return mods, np.arange(rows.start, rows.stop).reshape(1, 1, 1, -1)


def tile_scores(k: np.ndarray, q_t: np.ndarray, t: Tile, tile_buf: np.ndarray, mods: TileMods,
                q_idx: np.ndarray) -> np.ndarray:  # fmt: skip
    """Tile t's scores in tile_buf: 1) s = k_tile q_t for the c heads of the step (the scale already in q),
    2) the score_mod, and -inf where the mask_mod hides a key (apply_mods) -> s (c, bk, n)."""
    c, _, n = q_t.shape
    bk = t.k_stop - t.k_start
    s = tile_buf[: c * bk * n].reshape(c, bk, n)  # (c, bk, n)
    np.matmul(k[:, t.k_start : t.k_stop], q_t, out=s)  # (c, bk, E) @ (c, E, n)
    kv_idx = np.arange(t.k_start, t.k_stop).reshape(1, bk, 1, 1)
    apply_mods(s.reshape(c, bk, -1, q_idx.shape[-1]), t, mods, q_idx, kv_idx, keys_down=True)  # (c, bk, G, bq)
    return s


def finish_rows(acc: np.ndarray, m: np.ndarray, l: np.ndarray, out_rows: np.ndarray, lse_rows: np.ndarray) -> None:
    """7) Divide once at the end: out = acc / l, lse = m + log l; a row that saw no key (l = 0) gets out 0
    and lse -inf. (Test l == 0, not l > 0: a NaN in the inputs must stay NaN, not turn into a quiet 0.)"""
    acc, m, l = acc.reshape(out_rows.shape), m.reshape(lse_rows.shape), l.reshape(lse_rows.shape)  # (c, G, bq, ...)
    empty = l == 0  # (c, G, bq)
    if not empty.any():  # every row saw a key (the usual case): no row to leave out
        np.divide(acc, l[..., None], out=out_rows)
        np.add(m, np.log(l), out=lse_rows)
        return
    np.divide(acc, l[..., None], out=out_rows, where=~empty[..., None])
    out_rows[empty] = 0.0
    with np.errstate(divide="ignore"):
        lse_rows[...] = np.where(empty, -np.inf, m + np.log(l))


class TileRule(NamedTuple):
    """What flash_attention and its backward take when no size is given: square tiles of `side` and, in each
    tile step, the query heads of as many kv heads as fit in `scores_per_step` scores (the forward); square
    tiles of `backward_side` (the backward); `workers` threads (both)."""

    side: int
    scores_per_step: int
    backward_side: int
    workers: int


def constant_rule(cores: int | None = None) -> TileRule:
    """The constants, measured on a 2-core machine and a 16-core one (docs/flash.md): tiles of 256 and 2^18
    scores a step (512 and 2^19 on more than 8 cores), the backward's tiles of 256, a worker per core."""
    cores = cores if cores is not None else cpu_cores()
    if cores <= 8:
        return TileRule(DEFAULT_BLOCK_Q, SCORES_PER_STEP, DEFAULT_BLOCK_Q, cores)
    return TileRule(2 * DEFAULT_BLOCK_Q, 2 * SCORES_PER_STEP, DEFAULT_BLOCK_Q, cores)


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
    SCORES_PER_WORKER of a call's `scores`. A small call's items take less time than it takes to wake another
    thread and share the interpreter lock with it: on the 2-core Xeon, a causal T = 64 of 48 heads (under
    2^18 scores) ran slower on 2 workers than on 1, forward and backward, and T = 128 of 48 heads faster. The
    workers never change the result's bits."""
    return max(1, min(tile_rule(cores).workers, scores // SCORES_PER_WORKER))


def default_tiles(
    n_q: int, n_k: int, group: int, *, block_q: int | None = None, block_k: int | None = None,
    cores: int | None = None, kv_heads: int | None = None, diagonal: int | None = None,
) -> tuple[int, int, int]:  # fmt: skip
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
    scores_per_kv_head = max(1, group) * max(1, min(block_q, n_q)) * max(1, min(block_k, n_k))  # one kv head's tile
    heads = max(1, rule.scores_per_step // scores_per_kv_head)
    if kv_heads:  # the steps of one query block that keep every worker busy
        workers = workers_for(kv_heads * max(1, group) * n_q * n_k, cores)
        steps = -(-workers // max(1, -(-n_q // block_q)))
        heads = max(1, min(heads, -(-kv_heads // steps)))
    return block_q, block_k, heads


def backward_side(n_q: int, diagonal: int | None) -> int:
    """The default tile side of flash_attention_backward for L = n_q: the rule's backward side (tile_rule), made
    smaller for a short causal band as the forward's (diagonal_side; diagonal None: no diagonal)."""
    return diagonal_side(tile_rule().backward_side, n_q, diagonal)


SMALLEST_SIDE = 64  # diagonal_side halves a tile's side down to this, no further


def diagonal_side(side: int, n_q: int, diagonal: int | None) -> int:
    """The default tile side for a causal band without a window: `side`, halved while the diagonal's waste
    below is over a quarter of the work, but not below SMALLEST_SIDE; diagonal None (no diagonal): side.

    Why: the tiles the diagonal crosses run whole. Each of the L queries finds about min(b, L) / 2 hidden keys
    in them (b / 2 on average where the tiles of side b are shorter than L; where they are not, the hidden
    keys are one triangle of L²/2), against the diagonal + (i + 1) keys query i sees, L·diagonal + L²/2 in all:
    a share of min(b, L) / (2·diagonal + L), a half where one tile covers L = S. A decode step (L = 1) wastes
    next to nothing and keeps its long key tiles. On the 2-core Xeon at T = 256, 64 heads of 64, tiles of 64
    in place of 256 took flash from 2.03 times torch's SDPA to 1.02 forward and from 1.47 to 1.30 backward
    (docs/results/xeon.md); from T = 1,024 on, 256 stays."""
    if diagonal is None:
        return side
    while side > SMALLEST_SIDE and 4 * min(side, n_q) > 2 * max(diagonal, 0) + n_q:
        side //= 2
    return side


def backward_heads_per_item(n_heads: int, n_q: int, n_k: int, block_q: int, block_k: int, workers: int) -> int:
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


class FlashPlan(NamedTuple):
    """How flash_forward runs a checked call: the scale, the tile mask (a Band or a BlockMask: which tiles
    run), the tile sizes, heads per step, workers, and flex attention's score_mod and sinks (Hq,) (None: none)."""

    scale: float
    tile_mask: TileMask
    block_q: int
    block_k: int
    kv_heads_per_step: int
    workers: int
    score_mod: Any = None
    sinks: np.ndarray | None = None


def check_flash(
    q: Any, k: Any, v: Any, *, causal: Any, scale: Any, window: Any, block_q: Any, block_k: Any,
    kv_heads_per_step: Any, workers: Any, align: Any = "bottom_right",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, FlashPlan]:  # fmt: skip
    """flash_attention's inputs checked, once, and its plan: the defaults filled in (default_tiles). k and v of
    batch 1 against a larger query batch come back as broadcast views (broadcast_kv)."""
    k, v = broadcast_kv(q, k, v)
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e, compute_dtype(q, k, v))
    band = check_band(causal, window, dims.n_q, dims.n_k, align)
    sizes = {"block_q": block_q, "block_k": block_k, "kv_heads_per_step": kv_heads_per_step, "workers": workers}
    sizes = {name: None if value is None else check_positive_int(value, name) for name, value in sizes.items()}
    return q, k, v, dims, flash_plan(dims, band, scale, **sizes)


def broadcast_kv(query: Any, key: Any, value: Any) -> tuple[Any, Any]:
    """key and value whose batch dims are all 1 against a larger query batch (torch's SDPA and flex_attention
    allow it): as views broadcast to the query's batch dims, every batch entry reading the same keys and values
    (grouped_heads then holds them once). Anything else is left as it is, for check_qkv to judge."""
    q, k, v = as_float_array(query, "q"), as_float_array(key, "k"), as_float_array(value, "v")
    batch, kv_batch = q.shape[:-3], k.shape[:-3]
    if q.ndim == k.ndim == v.ndim >= 4 and kv_batch == v.shape[:-3] != batch and set(kv_batch) == {1}:
        return np.broadcast_to(k, (*batch, *k.shape[-3:])), np.broadcast_to(v, (*batch, *v.shape[-3:]))
    return key, value


def flash_plan(
    dims: QKVShape, tile_mask: TileMask, scale: float, *, block_q: int | None = None, block_k: int | None = None,
    kv_heads_per_step: int | None = None, workers: int | None = None, score_mod: Any = None,
    sinks: np.ndarray | None = None,
) -> FlashPlan:  # fmt: skip
    """The plan for checked sizes, the defaults filled in: default_tiles (a BlockMask's BLOCK_SIZE is its
    tile size), and call_workers for workers."""
    if isinstance(tile_mask, BlockMask):
        block_q, block_k = tile_mask.BLOCK_SIZE
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv
    block_q, block_k, auto_heads = default_tiles(dims.n_q, dims.n_k, dims.group, block_q=block_q, block_k=block_k,
                                                 kv_heads=n_kv, diagonal=diagonal_of(tile_mask))  # fmt: skip
    heads = auto_heads if kv_heads_per_step is None else kv_heads_per_step
    return FlashPlan(scale, tile_mask, block_q, block_k, heads, call_workers(dims, workers), score_mod, sinks)


class GroupedHeads(NamedTuple):
    """flash_forward's arrays, one leading index per (batch entry, kv head), query head h reading kv head h // G:
    q (B·Hkv, G, L, E) a view of the input, k (B·Hkv, S, E) and v (B·Hkv, S, Ev) in the compute dtype (views
    where they already are), and out (B·Hkv, G, L, Ev) and lse (B·Hkv, G, L) for the items to fill. k and v
    broadcast over the batch (broadcast_kv) are held once, (Hkv, S, E): entry b·Hkv + h reads their entry h."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    lse: np.ndarray


def grouped_heads(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, ct: np.dtype) -> GroupedHeads:
    n_kv, g = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv, dims.group  # every (batch, kv head) pair
    return GroupedHeads(
        q.reshape(n_kv, g, dims.n_q, dims.e),  # (B·Hkv, G, L, E)
        kv_entries(k, len(dims.batch), ct),  # (B·Hkv, S, E), or (Hkv, S, E) broadcast over the batch
        kv_entries(v, len(dims.batch), ct),  # (B·Hkv, S, Ev), or (Hkv, S, Ev)
        np.empty((n_kv, g, dims.n_q, dims.ev), ct),  # (B·Hkv, G, L, Ev)
        np.empty((n_kv, g, dims.n_q), ct),  # (B·Hkv, G, L)
    )


def kv_entries(x: np.ndarray, batch_dims: int, ct: np.dtype) -> np.ndarray:
    """x (..., Hkv, S, E) as (B·Hkv, S, E) in the compute dtype, a view where it already is one; x broadcast
    over its batch dims (stride 0: every entry the same array) as its one entry (Hkv, S, E), never B copies."""
    batch = x.shape[:batch_dims]  # (an empty x has no strides to go by: it stays as it is)
    if x.size and all(stride == 0 or n == 1 for n, stride in zip(batch, x.strides, strict=False)):
        x = x[(0,) * batch_dims]  # (Hkv, S, E): one batch entry, or the one every entry reads
    return np.ascontiguousarray(x.reshape(int(np.prod(x.shape[:-2])), *x.shape[-2:]), dtype=ct)


def kv_rows(heads: slice, arrays: GroupedHeads) -> slice:
    """The entries of arrays.k and arrays.v that the kv heads `heads` read: the same, or where k and v are held
    once for the batch (kv_entries), their place in it (an item never spans two batch entries then)."""
    start = heads.start % len(arrays.k)
    return slice(start, start + heads.stop - heads.start)


def item_parts(item: tuple[int, int], arrays: GroupedHeads, plan: FlashPlan, hq: int) -> tuple[slice, slice, Heads]:
    """One work item (first kv head, query block start) as slices: its kv heads (within one batch entry where k
    and v are held once for the batch) and its query rows, and its c·G query heads as (batch entry, query head)
    pairs, kv head by kv head."""
    n_kv, g, n_q = arrays.q.shape[:3]
    entry_end = (item[0] // len(arrays.k) + 1) * len(arrays.k)  # n_kv, unless k and v are held once
    heads = slice(item[0], min(item[0] + plan.kv_heads_per_step, n_kv, entry_end))
    rows = slice(item[1], min(item[1] + plan.block_q, n_q))
    query_heads = np.arange(heads.start * g, heads.stop * g)  # (c·G,) their (batch, query head) pairs, flat
    return heads, rows, Heads(query_heads // hq, query_heads % hq)


def scaled_queries(q_heads: np.ndarray, heads: slice, rows: slice, scale: float, ct: np.dtype) -> np.ndarray:
    """The queries of one item, times the scale, transposed (queries across) -> q_t (c, E, G·bq)."""
    c, g, bq, e = heads.stop - heads.start, q_heads.shape[1], rows.stop - rows.start, q_heads.shape[3]
    q_t = np.empty((c, e, g, bq), ct)  # (c, E, G, bq): column g·bq + i is query i of head g
    np.multiply(q_heads[heads, :, rows].transpose(0, 3, 1, 2), scale, out=q_t, dtype=ct)
    return q_t.reshape(c, e, g * bq)


def flash_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, plan: FlashPlan) -> tuple[Array, Array]:
    """flash_attention's work on inputs check_flash() accepted: out (..., Hq, L, Ev) in the inputs' result
    dtype, lse (..., Hq, L) in the compute dtype."""
    ct = compute_dtype(q, k, v)
    # 1) one view of the heads, grouped by the kv head they read: query head h reads kv head h // G
    arrays = grouped_heads(q, k, v, dims, ct)

    def run(item: tuple[int, int]) -> None:
        # 2) one item: the query heads of c kv heads, one query block; the scale folded into q once, transposed
        heads, rows, query_heads = item_parts(item, arrays, plan, dims.hq)
        q_t = scaled_queries(arrays.q, heads, rows, plan.scale, ct)  # (c, E, G·bq)
        kv = kv_rows(heads, arrays)  # heads, or their place in k and v held once for the batch
        attend_block(q_t, arrays.k[kv], arrays.v[kv], plan, query_heads, rows,
                     arrays.out[heads, :, rows], arrays.lse[heads, :, rows])  # fmt: skip

    # 3) the items, longest first so that the workers finish together; each writes its own rows of out and lse
    with one_blas_thread():
        run_items(run, forward_items(dims, plan, len(arrays.q), len(arrays.k)), plan.workers)
    return forward_results(arrays, dims, result_dtype(q, k, v))


def forward_results(arrays: GroupedHeads, dims: QKVShape, dtype: Any) -> tuple[Array, Array]:
    """out (..., Hq, L, Ev) in the result dtype and lse (..., Hq, L), from the grouped arrays the items filled."""
    out = arrays.out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(dtype, copy=False)
    return out, arrays.lse.reshape(*dims.batch, dims.hq, dims.n_q)


def forward_items(dims: QKVShape, plan: FlashPlan, n_kv: int, kv_held: int | None = None) -> list[tuple[int, int]]:
    """(first kv head, query block start) for every item of n_kv kv heads; the query blocks with the most tiles
    come first. kv_held: the entries of k and v (kv_entries; default n_kv): an item's heads stay in one of them."""
    q_starts = range(0, dims.n_q, plan.block_q)
    rows = plan.tile_mask.row_length
    length = {q: rows(q, min(q + plan.block_q, dims.n_q), dims.n_k, plan.block_k) for q in q_starts}
    ordered = sorted(q_starts, key=lambda q_start: -length[q_start])
    held = max(1, kv_held or n_kv)
    firsts = [entry + h for entry in range(0, n_kv, held) for h in range(0, held, plan.kv_heads_per_step)]
    return [(h, q_start) for q_start in ordered for h in firsts]


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    workers: int | None = None,
    window: int | None = None,
    kv_heads_per_step: int | None = None,
    align: str = "bottom_right",
) -> Array | tuple[Array, Array]:
    """attention(q, k, v, causal=causal, scale=scale), blockwise, never building L x S.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L), the logsumexp of each row's (scaled, masked) scores, in the
    compute dtype: float32 for float16 inputs (float16 overflows past 65504; torch and flash-attn also
    return a float32 lse for half inputs), else the inputs' float32 or float64.
    causal=True is bottom-right aligned (query i sees key j <= i + S - L), like attention();
    align="top_left" moves the diagonal to j <= i, torch's is_causal (the same when L == S).
    The band is a mask_mod on flex attention's one path (mods.causal_band): flex_attention with
    create_block_mask(causal_mod(L, S)) of the same tile size runs the same tiles and gives the same bits.
    window (needs causal=True): query i sees only the last `window` keys, itself included:
    i + S - L - window < j <= i + S - L (with L = S, Hugging Face's Mistral mask). FlashAttention's
    window_size=(w, 0) is window = w + 1. Tiles wholly outside the band are skipped: time ∝ L·window.
    k and v whose batch dims are all 1 against a larger query batch (torch's SDPA broadcasts them so) are
    read by every batch entry where they lie, never copied per entry.
    block_q, block_k: tile sizes (any positive ints; they need not divide L or S).
    kv_heads_per_step: kv heads (each with its Hq / Hkv query heads) that share one batched matmul
    per tile step. The defaults (default_tiles): square tiles of 256 (512 on more than 8 cores; halved, but
    not below 64, for a causal band without a window over a short context, L = S under 1,024, so that the
    diagonal's half-hidden tiles are at most a quarter of the work: diagonal_side), and
    in each step the query heads of as many kv heads as fit in 2^18 scores (2^19 on more than 8 cores),
    or what tinyattn_np.tune() measured on this machine (docs/flash.md, "Tiles chosen by measuring").
    workers: threads, each taking whole (heads, query block) items (default: one per core, or tune()'s, at
    most one per 2^18 scores: call_workers); the result is the same bits for any number of workers. While
    it runs, BLAS is held to one thread for the whole process (threadpoolctl; overlapping calls share the
    limit, the last one out restores it), so a matmul in another thread of yours runs single-threaded
    meanwhile. Ctrl-C stops it between two tiles.

    >>> q = k = v = np.eye(2)
    >>> flash_attention(q, k, v, causal=True)[0]
    array([1., 0.])
    """
    return_lse = check_bool(return_lse, "return_lse")
    two_d = without_head_axis(q)
    sizes = {"block_q": block_q, "block_k": block_k, "kv_heads_per_step": kv_heads_per_step, "workers": workers}
    q, k, v, dims, plan = check_flash(q, k, v, causal=causal, scale=scale, window=window, align=align, **sizes)
    refuse_blockwise("flash_attention()", q, k, v, dims, plan, heads_per_step=plan.kv_heads_per_step)
    out, lse = flash_forward(q, k, v, dims, plan)
    if two_d:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
