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
After the last tile, out = acc / l and logsumexp = m + log l. (Milakov & Gimelshein 2018; Dao et al.
2022, "FlashAttention", Algorithm 1.) merge_states() in softmax.py is the same algebra for two
finished parts.

Under a causal mask, a tile wholly above the diagonal is never computed, and only the tiles that the
diagonal crosses pay for a mask: tile_plan() lists exactly the tiles that run. That is the "free 2x" of
FlashAttention-2 (Dao 2023). A sliding window adds a second diagonal edge, and the tiles wholly behind
it are skipped too, so the work grows as L·window instead of L·S.

Several heads share each tile step: the query heads that read one kv head, and as many kv heads as
fit in the step's budget of scores, go through one batched matmul and one pass of each ufunc. Python's
per-call overhead (a few microseconds, with the interpreter lock held) is then paid once for all of
them, which is what lets worker threads scale with cores (README, "Block sizes and workers").

Memory: out, lse, and per worker one step's tile of scores (at most the step budget) plus per-row
vectors: O((L + S)·E + workers·budget), never L x S. The tiles of a query block are made lazily, as
it runs, so the plan itself costs no memory either.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import check_bool, check_positive_int, check_qkv, check_scale, check_sizes, compute_dtype, result_dtype
from .masks import band_blocked, causal_offset, check_window

Array = NDArray[np.floating]

# The defaults (default_tiles): square tiles of 256, and a tile step of up to 2^18 scores, both doubled
# on more than 8 cores. Measured in README, "Block sizes and workers" (scripts/scaling.py --sweep-blocks).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
SCORES_PER_STEP = 2**18

FULL, DIAGONAL = "full", "diagonal"


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


def _visible_keys(q_start: int, q_stop: int, n_k: int, offset: int, causal: bool, window: int | None) -> range:
    """The key positions that at least one query of q_start:q_stop may see (bottom-right alignment).

    Query i sees key j when j <= i + offset (causal) and j > i + offset - window (window).
    """
    stop = min(n_k, q_stop + offset) if causal else n_k  # the last query's diagonal, inclusive
    start = max(0, q_start + offset - window + 1) if window is not None else 0  # the first query's back edge
    return range(start, max(start, stop))


def block_tiles(
    q_start: int, q_stop: int, n_k: int, block_k: int, *, offset: int, causal: bool, window: int | None
) -> Iterator[Tile]:
    """The tiles of one query block that run, made one at a time (nothing is stored).

    Key tiles sit on the grid k_start = 0, block_k, 2·block_k, ...; those that no query of the block
    may see are never made. A tile is "full" when every query sees every key of it.
    """
    keys = _visible_keys(q_start, q_stop, n_k, offset, causal, window)
    for k_start in range(keys.start // block_k * block_k, keys.stop, block_k):
        k_stop = min(k_start + block_k, n_k)
        below_diagonal = not causal or k_stop - 1 <= q_start + offset  # the first query sees the last key
        inside_window = window is None or k_start > q_stop - 1 + offset - window  # the last query sees the first
        yield Tile(q_start, q_stop, k_start, k_stop, FULL if below_diagonal and inside_window else DIAGONAL)


def _tiles_in_block(
    q_start: int, q_stop: int, n_k: int, block_k: int, offset: int, causal: bool, window: int | None
) -> int:
    """How many tiles block_tiles makes, without making them."""
    keys = _visible_keys(q_start, q_stop, n_k, offset, causal, window)
    return len(range(keys.start // block_k * block_k, keys.stop, block_k))


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
    """
    n_q, n_k = check_sizes(n_q, n_k)
    block_q = check_positive_int(block_q, "block_q")
    block_k = check_positive_int(block_k, "block_k")
    causal, window = _check_causal_window(causal, window, n_q, n_k)
    offset = causal_offset(n_q, n_k)
    tiles = [
        tile
        for q_start in range(0, n_q, block_q)
        for tile in block_tiles(
            q_start, min(q_start + block_q, n_q), n_k, block_k, offset=offset, causal=causal, window=window
        )
    ]
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


def _check_causal_window(causal: Any, window: Any, n_q: int, n_k: int) -> tuple[bool, int | None]:
    causal = check_bool(causal, "causal")
    if window is None:
        return causal, None
    if not causal:
        raise ValueError(f"window={window!r} needs causal=True: a sliding window looks back from each query's diagonal")
    return causal, check_window(window, n_q, n_k)


def _attend_block(
    q_t: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tiles: Iterator[Tile],
    widest: int,
    offset: int,
    window: int | None,
    out_rows: np.ndarray,
    lse_rows: np.ndarray,
) -> None:
    """The online softmax for one query block of c kv heads, each with its G query heads, over its tiles.

    q_t (c, E, G·bq): the scaled queries, transposed; column g·bq + i is query i of head g of the group.
    k (c, S, E), v (c, S, Ev): the c kv heads. Writes out_rows (c, G, bq, Ev) and lse_rows (c, G, bq).
    """
    c, _, n = q_t.shape
    dtype = q_t.dtype
    m = np.full((c, n), -np.inf, dtype)  # (c, n) running max of the scores
    l = np.zeros((c, n), dtype)  # (c, n) running sum of exp(score - m)
    acc = np.zeros((c, n, v.shape[-1]), dtype)  # (c, n, Ev) running exp(score - m) @ v
    # The score tile is kept transposed, keys down and queries across: (c, bk, n). The per-query max and
    # sum then run down an axis that is not the last of a C-order array, which NumPy does with whole-row
    # vector ops, about twice as fast as along the last axis on a 256 x 256 tile.
    tile_buf = np.empty(c * widest * n, dtype)  # the one score tile this block reuses
    for t in tiles:
        bk = t.k_stop - t.k_start
        s = tile_buf[: c * bk * n].reshape(c, bk, n)  # (c, bk, n): s[h, j, g·bq + i] = q_{g,i} · k_j
        # 1) scores of this tile for every head of the step; the scale is already folded into q
        np.matmul(k[:, t.k_start : t.k_stop], q_t, out=s)  # (c, bk, E) @ (c, E, n)
        # 2) a tile that a mask edge crosses hides the keys its queries may not see (the same for each head)
        if t.kind == DIAGONAL:
            blocked = band_blocked(t.q_start, t.q_stop, t.k_start, t.k_stop, offset, window)  # (bq, bk)
            bq = t.q_stop - t.q_start
            np.copyto(s.reshape(c, bk, n // bq, bq), -np.inf, where=blocked.T[:, None, :])  # (c, bk, G, bq)
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
    # 6) divide once at the end; a row that saw no key (l = 0) gets out 0 and lse -inf.
    #    (Test l == 0, not l > 0: a NaN in the inputs must stay NaN, not turn into a quiet 0.)
    acc, m, l = acc.reshape(out_rows.shape), m.reshape(lse_rows.shape), l.reshape(lse_rows.shape)  # (c, G, bq, ...)
    empty = l == 0  # (c, G, bq)
    np.divide(acc, l[..., None], out=out_rows, where=~empty[..., None])
    out_rows[empty] = 0.0
    with np.errstate(divide="ignore"):
        lse_rows[...] = np.where(empty, -np.inf, m + np.log(l))


# BLAS is held to one thread while any flash_attention runs: the workers are the parallelism, and one
# thread per matmul makes the result the same bits for any number of workers. Calls may overlap (threads)
# or nest, so the first one in sets the limit and the last one out restores what it found.
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter: Any = None
_blas_controller: Any = None


@contextmanager
def _one_blas_thread() -> Iterator[None]:
    """A context in which BLAS runs single-threaded, safe for overlapping and nested use."""
    global _blas_users, _blas_limiter, _blas_controller
    with _blas_lock:
        if _blas_users == 0:
            if _blas_controller is None:
                from threadpoolctl import ThreadpoolController

                _blas_controller = ThreadpoolController()
            _blas_limiter = _blas_controller.limit(limits=1, user_api="blas")
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


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
    matmul in another thread of yours runs single-threaded meanwhile.
    """
    two_d = np.ndim(q) == 2
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e)
    causal, window = _check_causal_window(causal, window, dims.n_q, dims.n_k)
    return_lse = check_bool(return_lse, "return_lse")
    if block_q is not None:
        block_q = check_positive_int(block_q, "block_q")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    block_q, block_k, auto_heads = default_tiles(dims.n_q, dims.n_k, dims.group, block_q=block_q, block_k=block_k)
    kv_heads_per_step = check_positive_int(kv_heads_per_step, "kv_heads_per_step", default=auto_heads)
    workers = check_positive_int(workers, "workers", default=os.cpu_count() or 1)
    ct = compute_dtype(q, k, v)
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv  # every (batch, kv head) pair
    g = dims.group

    # 1) one view of the heads, grouped by the kv head they read: query head h reads kv head h // G
    q4 = q.reshape(n_kv, g, dims.n_q, dims.e)  # (B·Hkv, G, L, E)
    k_c = np.ascontiguousarray(k.reshape(n_kv, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    out = np.empty((n_kv, g, dims.n_q, dims.ev), ct)  # (B·Hkv, G, L, Ev)
    lse = np.empty((n_kv, g, dims.n_q), ct)  # (B·Hkv, G, L)

    # 2) the work items: (first kv head, query block); longest first, so that the workers finish together
    offset = causal_offset(dims.n_q, dims.n_k) if causal else 0
    widest = min(block_k, dims.n_k)

    def tiles_in(q_start: int) -> int:
        q_stop = min(q_start + block_q, dims.n_q)
        return _tiles_in_block(q_start, q_stop, dims.n_k, block_k, offset, causal, window)

    q_starts = sorted(range(0, dims.n_q, block_q), key=lambda q_start: -tiles_in(q_start))
    items = [(h, q_start) for q_start in q_starts for h in range(0, n_kv, kv_heads_per_step)]

    def run(item: tuple[int, int]) -> None:
        h, q_start = item
        heads, rows = slice(h, min(h + kv_heads_per_step, n_kv)), slice(q_start, min(q_start + block_q, dims.n_q))
        c, bq = heads.stop - heads.start, rows.stop - rows.start
        # fold the scale into q once per item, not into every tile of scores; transposed, queries across
        q_t = np.empty((c, dims.e, g, bq), ct)  # (c, E, G, bq)
        np.multiply(q4[heads, :, rows].transpose(0, 3, 1, 2), scale, out=q_t, dtype=ct)
        tiles = block_tiles(q_start, rows.stop, dims.n_k, block_k, offset=offset, causal=causal, window=window)
        _attend_block(
            q_t.reshape(c, dims.e, g * bq), k_c[heads], v_c[heads], tiles, widest, offset, window,
            out[heads, :, rows], lse[heads, :, rows],
        )  # fmt: skip

    # 3) run the items; each writes its own rows of out and lse, so threads never share an array slice.
    #    Each worker takes the next item when it is free (one future per worker, not one per item).
    pending, take = iter(items), threading.Lock()

    def work() -> None:
        while True:
            with take:
                item = next(pending, None)
            if item is None:
                return
            run(item)

    with _one_blas_thread():
        if workers == 1 or len(items) <= 1:
            work()
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for done in [pool.submit(work) for _ in range(min(workers, len(items)))]:
                    done.result()  # re-raises a worker's exception here

    out_full = out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(result_dtype(q, k, v), copy=False)
    lse_full = lse.reshape(*dims.batch, dims.hq, dims.n_q)
    if two_d:
        out_full, lse_full = out_full[0], lse_full[0]
    return (out_full, lse_full) if return_lse else out_full
