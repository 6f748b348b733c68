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

Read it in this order:
    Band, tile_plan, draw_tile_plan    which tiles run: under a causal mask a tile wholly above the
                                       diagonal is never computed, and only the tiles the diagonal
                                       crosses pay for a mask (the "free 2x" of FlashAttention-2); a
                                       sliding window skips the tiles behind its back edge too
    flash_attention_one_head           Algorithm 1 for one head on one thread, as the paper prints it
    flash_attention                    the same algorithm, fast: several heads share each tile step
                                       (one batched matmul for the query heads of one or more kv heads),
                                       and worker threads take whole (heads, query block) items

Why the fast path batches heads: Python's per-call overhead (a few microseconds, with the interpreter
lock held) is then paid once for all of them, which is what lets worker threads scale with cores
(docs/tiles.md). Memory: out, lse, and per worker one step's tile of scores (at most the step budget)
plus per-row vectors: O((L + S)·E + workers·budget), never L x S. The tiles of a query block are made
as it runs, so the plan itself costs no memory either.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    check_bool,
    check_positive_int,
    check_qkv,
    check_scale,
    check_sizes,
    compute_dtype,
    result_dtype,
    without_head_axis,
)
from ._parallel import one_blas_thread, run_items
from .masks import band_blocked, causal_offset, check_window

Array = NDArray[np.floating]

# The defaults (default_tiles): square tiles of 256, and a tile step of up to 2^18 scores, both doubled
# on more than 8 cores. Measured in docs/tiles.md (scripts/tiles.py).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
SCORES_PER_STEP = 2**18

FULL, DIAGONAL = "full", "diagonal"  # a tile every query sees whole, and one a mask edge crosses


# ---------------------------------------------------------------------------------------------------
# which tiles run


class Tile(NamedTuple):
    """One block of the score matrix that runs: rows q_start:q_stop, columns k_start:k_stop.

    kind is "full" (no entry masked) or "diagonal" (the causal diagonal, or the window's back edge,
    crosses it: needs a mask).
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    kind: str


class Band(NamedTuple):
    """The keys each query may see: every key (offset None), or the causal band, bottom-right aligned:
    query i sees key j when j <= i + offset, and with a window also j > i + offset - window.

    It answers the three questions the kernels ask: the tiles of a row of query blocks (the forward),
    the tiles of a column of key blocks (the backward), and which entries of a tile are hidden.
    """

    offset: int | None
    window: int | None = None

    def visible_keys(self, q_start: int, q_stop: int, n_k: int) -> range:
        """The keys that at least one query of q_start:q_stop may see."""
        if self.offset is None:
            return range(n_k)
        stop = min(n_k, q_stop + self.offset)  # the last query's diagonal, inclusive
        start = 0 if self.window is None else max(0, q_start + self.offset - self.window + 1)  # first's back edge
        return range(start, max(start, stop))

    def visible_queries(self, k_start: int, k_stop: int, n_q: int) -> range:
        """The queries that see at least one key of k_start:k_stop."""
        if self.offset is None:
            return range(n_q)
        start = max(0, k_start - self.offset)  # the first query whose diagonal reaches the first key
        stop = n_q if self.window is None else min(n_q, k_stop - 1 - self.offset + self.window)
        return range(start, max(start, stop))

    def kind(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> str:
        """ "full" when every query of the tile sees every key of it, else "diagonal"."""
        if self.offset is None:
            return FULL
        below_diagonal = k_stop - 1 <= q_start + self.offset  # the first query sees the last key
        inside_window = self.window is None or k_start > q_stop - 1 + self.offset - self.window  # last sees first
        return FULL if below_diagonal and inside_window else DIAGONAL

    def row_tiles(self, q_start: int, q_stop: int, n_k: int, block_k: int) -> Iterator[Tile]:
        """The tiles of query block q_start:q_stop that run, on the key grid 0, block_k, ..., made one at a time."""
        keys = self.visible_keys(q_start, q_stop, n_k)
        for k_start in range(keys.start // block_k * block_k, keys.stop, block_k):
            k_stop = min(k_start + block_k, n_k)
            yield Tile(q_start, q_stop, k_start, k_stop, self.kind(q_start, q_stop, k_start, k_stop))

    def column_tiles(self, k_start: int, k_stop: int, n_q: int, block_q: int) -> Iterator[Tile]:
        """The tiles of key block k_start:k_stop that run, on the query grid 0, block_q, ..., one at a time."""
        queries = self.visible_queries(k_start, k_stop, n_q)
        for q_start in range(queries.start // block_q * block_q, queries.stop, block_q):
            q_stop = min(q_start + block_q, n_q)
            yield Tile(q_start, q_stop, k_start, k_stop, self.kind(q_start, q_stop, k_start, k_stop))

    def row_length(self, q_start: int, q_stop: int, n_k: int, block_k: int) -> int:
        """How many tiles row_tiles makes, without making them."""
        keys = self.visible_keys(q_start, q_stop, n_k)
        return len(range(keys.start // block_k * block_k, keys.stop, block_k))

    def hidden(self, tile: Tile) -> NDArray[np.bool_]:
        """(bq, bk) bool, True where the tile's query may not see its key (only asked of "diagonal" tiles)."""
        return band_blocked(tile.q_start, tile.q_stop, tile.k_start, tile.k_stop, self.offset or 0, self.window)


def check_band(causal: Any, window: Any, n_q: int, n_k: int) -> Band:
    """causal and window checked, as the Band they describe (bottom-right alignment)."""
    causal = check_bool(causal, "causal")
    if window is not None:
        if not causal:
            raise ValueError(f"window={window!r} needs causal=True: a sliding window looks back from the diagonal")
        window = check_window(window, n_q, n_k)
    return Band(causal_offset(n_q, n_k) if causal else None, window)


class TilePlan(list[Tile]):
    """The tiles that run, as a list, with the sizes they were planned for (draw_tile_plan reads them)."""

    def __init__(self, tiles: list[Tile], n_q: int, n_k: int, block_q: int, block_k: int):
        super().__init__(tiles)
        self.n_q, self.n_k, self.block_q, self.block_k = n_q, n_k, block_q, block_k


def tile_plan(
    n_q: int, n_k: int, block_q: int, block_k: int, *, causal: bool = False, window: int | None = None
) -> TilePlan:
    """The tiles of an n_q x n_k score matrix that flash_attention computes, row block by row block.

    Without causal every tile runs, all "full". With causal (bottom-right: query i sees key j when
    j <= i + n_k - n_q) a tile wholly above the diagonal is left out, a tile wholly below it is "full",
    and a tile the diagonal crosses is "diagonal". Rows that see no key at all (n_q > n_k) get no tile.
    window (needs causal=True): each query sees only the last `window` keys, itself included; tiles
    wholly behind that band are left out too, and those its back edge crosses are "diagonal".
    flash_attention makes the same tiles one query block at a time; this list is for counting and drawing.

    >>> print(draw_tile_plan(tile_plan(4, 4, 2, 2, causal=True)))
    \\ .
    # \\
    """
    n_q, n_k = check_sizes(n_q, n_k)
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    band = check_band(causal, window, n_q, n_k)
    rows = range(0, n_q, block_q)
    tiles = [tile for q_start in rows for tile in band.row_tiles(q_start, min(q_start + block_q, n_q), n_k, block_k)]
    return TilePlan(tiles, n_q, n_k, block_q, block_k)


def draw_tile_plan(
    tiles: TilePlan,
    n_q: int | None = None,
    n_k: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> str:
    """A character map of the tile grid: '#' full tile, '\\' a tile a mask edge crosses, '.' skipped.

    The plan carries its own sizes: draw_tile_plan(tile_plan(...)) is enough. Sizes passed as well must
    be the plan's (a grid of other sizes would draw a wrong picture), else ValueError.
    """
    if not isinstance(tiles, TilePlan):
        raise TypeError(f"tiles must be what tile_plan() returns (a TilePlan); got {type(tiles).__name__}")
    given = {"n_q": n_q, "n_k": n_k, "block_q": block_q, "block_k": block_k}
    for name, value in given.items():
        if value is not None and value != getattr(tiles, name):
            raise ValueError(f"{name}={value!r} does not match the plan, which has {name}={getattr(tiles, name)}")
    marks = {FULL: "#", DIAGONAL: "\\"}
    n_rows, n_cols = -(-tiles.n_q // tiles.block_q), -(-tiles.n_k // tiles.block_k)
    grid = [["."] * n_cols for _ in range(n_rows)]
    for t in tiles:
        grid[t.q_start // tiles.block_q][t.k_start // tiles.block_k] = marks[t.kind]
    return "\n".join(" ".join(row) for row in grid)


# ---------------------------------------------------------------------------------------------------
# Algorithm 1, one head on one thread


def flash_attention_one_head(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    window: int | None = None,
) -> tuple[Array, Array]:
    """FlashAttention-2's forward (Dao 2023, Algorithm 1) for one head, one query block at a time:
    q (L, E), k (S, E), v (S, Ev) -> out (L, Ev) and lse (L,), in the compute dtype.

    flash_attention() is the same algorithm with many heads per step and worker threads; the tests hold
    the two equal. Mask and dtype conventions as in flash_attention.
    """
    q, k, v, dims, scale, band = check_one_head(q, k, v, causal, scale, window)
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    out, lse = np.zeros((dims.n_q, dims.ev), k.dtype), np.full(dims.n_q, -np.inf, k.dtype)
    lowest = np.finfo(k.dtype).min  # subtracted instead of a max of -inf: exp(-inf - lowest) = 0, not NaN
    for q_start in range(0, dims.n_q, block_q):
        rows = slice(q_start, min(q_start + block_q, dims.n_q))
        q_i = q[rows] * scale  # (bq, E): Q_i, the scale folded in once
        m = np.full(q_i.shape[0], -np.inf, k.dtype)  # (bq,) m_i: the running row max
        l = np.zeros(q_i.shape[0], k.dtype)  # (bq,) l_i: the running sum of exp(s - m)
        acc = np.zeros((q_i.shape[0], dims.ev), k.dtype)  # (bq, Ev) O_i before the division by l_i
        for tile in band.row_tiles(rows.start, rows.stop, dims.n_k, block_k):
            keys = slice(tile.k_start, tile.k_stop)
            s = q_i @ k[keys].T  # (bq, bk) S_ij = Q_i K_jᵀ
            if tile.kind == DIAGONAL:
                s[band.hidden(tile)] = -np.inf  # (bq, bk) keys this query may not see
            m_new = np.maximum(m, s.max(axis=1))  # (bq,) m_i' = max(m_i, rowmax(S_ij))
            p = np.exp(s - np.maximum(m_new, lowest)[:, None])  # (bq, bk) P_ij = exp(S_ij - m_i')
            alpha = np.exp(m - np.maximum(m_new, lowest))  # (bq,) exp(m_i - m_i'): rescales the old sums
            l = alpha * l + p.sum(axis=1)  # (bq,) l_i' = exp(m_i - m_i') l_i + rowsum(P_ij)
            acc = alpha[:, None] * acc + p @ v[keys]  # (bq, Ev) O_i' = diag(exp(m_i - m_i')) O_i + P_ij V_j
            m = m_new
        seen = l > 0  # a row that saw no key keeps out 0 and lse -inf
        out[rows][seen] = acc[seen] / l[seen, None]  # (bq, Ev) O_i = diag(l_i)⁻¹ O_i
        lse[rows][seen] = m[seen] + np.log(l[seen])  # (bq,) L_i = m_i + log(l_i)
    return out, lse


def check_one_head(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, window: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, float, Band]:
    """One head's q (L, E), k (S, E), v (S, Ev) checked, in the compute dtype, with the scale and the band."""
    if not without_head_axis(q):
        raise ValueError(f"q must be one head (L, E); got shape {np.shape(q)}: use flash_attention for more heads")
    q, k, v, dims = check_qkv(q, k, v)
    ct = compute_dtype(q, k, v)
    band = check_band(causal, window, dims.n_q, dims.n_k)
    return q[0].astype(ct), k[0].astype(ct), v[0].astype(ct), dims, check_scale(scale, dims.e, ct), band


# ---------------------------------------------------------------------------------------------------
# the fast path: many heads per tile step, worker threads


def attend_block(q_t: np.ndarray, k: np.ndarray, v: np.ndarray, band: Band, tiles: Iterator[Tile],
                 out_rows: np.ndarray, lse_rows: np.ndarray) -> None:  # fmt: skip
    """The online softmax for one query block of c kv heads, each with its G query heads, over its tiles.

    q_t (c, E, G·bq): the scaled queries, transposed; column g·bq + i is query i of head g of the group.
    k (c, S, E), v (c, S, Ev): the c kv heads. Writes out_rows (c, G, bq, Ev) and lse_rows (c, G, bq).
    The score tile is kept transposed, keys down and queries across: (c, bk, n). The per-query max and
    sum then run down an axis that is not the last of a C-order array, which NumPy does with whole-row
    vector ops, about twice as fast as along the last axis on a 256 x 256 tile.
    """
    c, _, n = q_t.shape
    dtype = q_t.dtype
    m = np.full((c, n), -np.inf, dtype)  # (c, n) running max of the scores
    l = np.zeros((c, n), dtype)  # (c, n) running sum of exp(score - m)
    acc = np.zeros((c, n, v.shape[-1]), dtype)  # (c, n, Ev) running exp(score - m) @ v
    tile_buf = np.empty(0, dtype)  # the one score tile this block reuses, made at its first (widest) tile
    for t in tiles:
        bk = t.k_stop - t.k_start
        if tile_buf.size < c * bk * n:
            tile_buf = np.empty(c * bk * n, dtype)
        s = tile_buf[: c * bk * n].reshape(c, bk, n)  # (c, bk, n): s[h, j, g·bq + i] = q_{g,i} · k_j
        # 1) scores of this tile for every head of the step; the scale is already folded into q
        np.matmul(k[:, t.k_start : t.k_stop], q_t, out=s)  # (c, bk, E) @ (c, E, n)
        # 2) a tile that a mask edge crosses hides the keys its queries may not see (the same for each head)
        if t.kind == DIAGONAL:
            bq = t.q_stop - t.q_start
            np.copyto(s.reshape(c, bk, n // bq, bq), -np.inf, where=band.hidden(t).T[:, None, :])  # (c, bk, G, bq)
        # 3) the new running max. A row that has seen no key yet keeps m' = -inf; it subtracts the lowest
        #    finite number instead, so that exp(-inf - lowest) = 0 and not exp(-inf + inf) = NaN.
        m_new = np.maximum(m, s.max(axis=1))  # (c, n)
        m_safe = np.maximum(m_new, np.finfo(dtype).min)  # (c, n)
        # 4) probabilities of this tile relative to the new max, in place: s <- exp(s - m').
        #    (Not exp2 with log2(e) folded into q, as GPU kernels do: NumPy's exp2 is twice as fast on
        #    moderate inputs but falls to a slow path, over 20x slower here, where results underflow.)
        s -= m_safe[:, None, :]  # (c, bk, n) - (c, 1, n): each column is one query
        np.exp(s, out=s)
        # 5) rescale what was accumulated against the old max, then add this tile
        alpha = np.exp(m - m_safe)  # (c, n); 0 where m was -inf, and then l and acc are 0 anyway
        l *= alpha
        l += s.sum(axis=1)
        acc *= alpha[:, :, None]
        acc += s.transpose(0, 2, 1) @ v[:, t.k_start : t.k_stop]  # (c, n, bk) @ (c, bk, Ev); BLAS reads sᵀ
        m = m_new
    finish_rows(acc, m, l, out_rows, lse_rows)


def finish_rows(acc: np.ndarray, m: np.ndarray, l: np.ndarray, out_rows: np.ndarray, lse_rows: np.ndarray) -> None:
    """6) Divide once at the end: out = acc / l, lse = m + log l; a row that saw no key (l = 0) gets out 0
    and lse -inf. (Test l == 0, not l > 0: a NaN in the inputs must stay NaN, not turn into a quiet 0.)"""
    acc, m, l = acc.reshape(out_rows.shape), m.reshape(lse_rows.shape), l.reshape(lse_rows.shape)  # (c, G, bq, ...)
    empty = l == 0  # (c, G, bq)
    np.divide(acc, l[..., None], out=out_rows, where=~empty[..., None])
    out_rows[empty] = 0.0
    with np.errstate(divide="ignore"):
        lse_rows[...] = np.where(empty, -np.inf, m + np.log(l))


def default_tiles(
    n_q: int, n_k: int, group: int, *, block_q: int | None = None, block_k: int | None = None, cores: int | None = None
) -> tuple[int, int, int]:
    """(block_q, block_k, kv heads per step) for L = n_q, S = n_k and G = group query heads per kv head.

    The rule in one sentence: square tiles of 256 (512 on more than 8 cores), and in each tile step the
    G query heads of as many kv heads as fit in 2^18 scores (2^19 on more than 8 cores).
    Given block sizes are kept and the heads fill the same budget. It depends on the shape and
    os.cpu_count() only, never on the number of workers, so every worker count gives the same bits.
    """
    cores = cores if cores is not None else os.cpu_count() or 1
    side, budget = (DEFAULT_BLOCK_Q, SCORES_PER_STEP) if cores <= 8 else (2 * DEFAULT_BLOCK_Q, 2 * SCORES_PER_STEP)
    block_q = side if block_q is None else block_q
    block_k = side if block_k is None else block_k
    scores_per_kv_head = max(1, group) * max(1, min(block_q, n_q)) * max(1, min(block_k, n_k))  # one kv head's tile
    return block_q, block_k, max(1, budget // scores_per_kv_head)


class FlashPlan(NamedTuple):
    """How flash_forward runs a checked call: the scale, the band, the tile sizes, heads per step, workers."""

    scale: float
    band: Band
    block_q: int
    block_k: int
    kv_heads_per_step: int
    workers: int


def check_flash(
    q: Any, k: Any, v: Any, *, causal: Any, scale: Any, window: Any, block_q: Any, block_k: Any,
    kv_heads_per_step: Any, workers: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, FlashPlan]:  # fmt: skip
    """flash_attention's inputs checked, once, and its plan: the defaults filled in (default_tiles)."""
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e, compute_dtype(q, k, v))
    band = check_band(causal, window, dims.n_q, dims.n_k)
    sizes = {"block_q": block_q, "block_k": block_k, "kv_heads_per_step": kv_heads_per_step, "workers": workers}
    sizes = {name: None if value is None else check_positive_int(value, name) for name, value in sizes.items()}
    return q, k, v, dims, flash_plan(dims, band, scale, **sizes)


def flash_plan(
    dims: QKVShape, band: Band, scale: float, *, block_q: int | None = None, block_k: int | None = None,
    kv_heads_per_step: int | None = None, workers: int | None = None,
) -> FlashPlan:  # fmt: skip
    """The plan for checked sizes, the defaults filled in: default_tiles, and the CPU count for workers."""
    block_q, block_k, auto_heads = default_tiles(dims.n_q, dims.n_k, dims.group, block_q=block_q, block_k=block_k)
    heads = auto_heads if kv_heads_per_step is None else kv_heads_per_step
    return FlashPlan(scale, band, block_q, block_k, heads, workers or os.cpu_count() or 1)


def flash_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, plan: FlashPlan) -> tuple[Array, Array]:
    """flash_attention's work on inputs check_flash() accepted: out (..., Hq, L, Ev) in the inputs' result
    dtype, lse (..., Hq, L) in the compute dtype."""
    ct = compute_dtype(q, k, v)
    n_kv, g = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv, dims.group  # every (batch, kv head) pair
    # 1) one view of the heads, grouped by the kv head they read: query head h reads kv head h // G
    q_heads = q.reshape(n_kv, g, dims.n_q, dims.e)  # (B·Hkv, G, L, E)
    k_c = np.ascontiguousarray(k.reshape(n_kv, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    out = np.empty((n_kv, g, dims.n_q, dims.ev), ct)  # (B·Hkv, G, L, Ev)
    lse = np.empty((n_kv, g, dims.n_q), ct)  # (B·Hkv, G, L)

    def run(item: tuple[int, int]) -> None:
        # 2) one item: the query heads of c kv heads, one query block; the scale folded into q once, transposed
        heads = slice(item[0], min(item[0] + plan.kv_heads_per_step, n_kv))
        rows = slice(item[1], min(item[1] + plan.block_q, dims.n_q))
        c, bq = heads.stop - heads.start, rows.stop - rows.start
        q_t = np.empty((c, dims.e, g, bq), ct)  # (c, E, G, bq): queries across
        np.multiply(q_heads[heads, :, rows].transpose(0, 3, 1, 2), plan.scale, out=q_t, dtype=ct)
        tiles = plan.band.row_tiles(rows.start, rows.stop, dims.n_k, plan.block_k)
        attend_block(q_t.reshape(c, dims.e, g * bq), k_c[heads], v_c[heads], plan.band, tiles,
                     out[heads, :, rows], lse[heads, :, rows])  # fmt: skip

    # 3) the items, longest first so that the workers finish together; each writes its own rows of out and lse
    with one_blas_thread():
        run_items(run, forward_items(dims, plan, n_kv), plan.workers)
    out_full = out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(result_dtype(q, k, v), copy=False)
    return out_full, lse.reshape(*dims.batch, dims.hq, dims.n_q)


def forward_items(dims: QKVShape, plan: FlashPlan, n_kv: int) -> list[tuple[int, int]]:
    """(first kv head, query block start) for every item; the query blocks with the most tiles come first."""
    q_starts = range(0, dims.n_q, plan.block_q)
    length = {q: plan.band.row_length(q, min(q + plan.block_q, dims.n_q), dims.n_k, plan.block_k) for q in q_starts}
    ordered = sorted(q_starts, key=lambda q_start: -length[q_start])
    return [(h, q_start) for q_start in ordered for h in range(0, n_kv, plan.kv_heads_per_step)]


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
) -> Array | tuple[Array, Array]:
    """attention(q, k, v, causal=causal, scale=scale), blockwise, never building L x S.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L), the logsumexp of each row's (scaled, masked) scores, in the
    compute dtype: float32 for float16 inputs (float16 overflows past 65504; torch and flash-attn also
    return a float32 lse for half inputs), else the inputs' float32 or float64.
    causal=True is bottom-right aligned (query i sees key j <= i + S - L), like attention().
    window (needs causal=True): query i sees only the last `window` keys, itself included:
    i + S - L - window < j <= i + S - L (with L = S, Hugging Face's Mistral mask). FlashAttention's
    window_size=(w, 0) is window = w + 1. Tiles wholly outside the band are skipped: time ∝ L·window.
    block_q, block_k: tile sizes (any positive ints; they need not divide L or S).
    kv_heads_per_step: kv heads (each with its Hq / Hkv query heads) that share one batched matmul
    per tile step. The defaults (default_tiles): square tiles of 256 (512 on more than 8 cores), and
    in each step the query heads of as many kv heads as fit in 2^18 scores (2^19 on more than 8 cores).
    workers: threads, each taking whole (heads, query block) items (default: the CPU count); the result
    is the same bits for any number of workers. While it runs, BLAS is held to one thread for the whole
    process (threadpoolctl; overlapping calls share the limit, the last one out restores it), so a
    matmul in another thread of yours runs single-threaded meanwhile. Ctrl-C stops it between two tiles.

    >>> q = k = v = np.eye(2)
    >>> flash_attention(q, k, v, causal=True)[0]
    array([1., 0.])
    """
    return_lse = check_bool(return_lse, "return_lse")
    two_d = without_head_axis(q)
    sizes = {"block_q": block_q, "block_k": block_k, "kv_heads_per_step": kv_heads_per_step, "workers": workers}
    q, k, v, dims, plan = check_flash(q, k, v, causal=causal, scale=scale, window=window, **sizes)
    out, lse = flash_forward(q, k, v, dims, plan)
    if two_d:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
