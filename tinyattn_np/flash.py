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
FlashAttention-2 (Dao 2023).

Memory: out, lse, one scaled copy of q, and per worker one block_q x block_k tile plus per-row
vectors: O((L + S)·E + workers·block_q·block_k), never L x S.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import check_positive_int, check_qkv, check_scale, check_sizes, compute_dtype, result_dtype
from .masks import causal_blocked, causal_offset

Array = NDArray[np.floating]

# Chosen from `scripts/scaling.py --sweep-blocks 4096` on a 2-core machine (README, "Block sizes"):
# 256 x 256 was within noise of the fastest causal runs, and square tiles waste the least work on
# the diagonal (about 53% of the tiles run at T = 4096, against 56% for 256 x 512).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256

FULL, DIAGONAL = "full", "diagonal"


class Tile(NamedTuple):
    """One block of the score matrix that runs: rows q_start:q_stop, columns k_start:k_stop.

    kind is "full" (no entry masked) or "diagonal" (the causal diagonal crosses it: needs a mask).
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    kind: str


def tile_plan(n_q: int, n_k: int, block_q: int, block_k: int, *, causal: bool = False) -> list[Tile]:
    """The tiles of an n_q x n_k score matrix that flash_attention computes, row block by row block.

    Without causal every tile runs, all "full". With causal (bottom-right: query i sees key j when
    j <= i + n_k - n_q) a tile wholly above the diagonal is left out, a tile wholly below it is "full",
    and a tile the diagonal crosses is "diagonal". Rows that see no key at all (n_q > n_k) get no tile.
    """
    n_q, n_k = check_sizes(n_q, n_k)
    block_q = check_positive_int(block_q, "block_q")
    block_k = check_positive_int(block_k, "block_k")
    offset = causal_offset(n_q, n_k)
    tiles = []
    for q_start in range(0, n_q, block_q):
        q_stop = min(q_start + block_q, n_q)
        for k_start in range(0, n_k, block_k):
            k_stop = min(k_start + block_k, n_k)
            if not causal:
                tiles.append(Tile(q_start, q_stop, k_start, k_stop, FULL))
            elif k_start > q_stop - 1 + offset:
                continue  # even the tile's last query may not see its first key: wholly masked, skip
            elif k_stop - 1 <= q_start + offset:
                tiles.append(Tile(q_start, q_stop, k_start, k_stop, FULL))  # first query sees last key
            else:
                tiles.append(Tile(q_start, q_stop, k_start, k_stop, DIAGONAL))
    return tiles


def draw_tile_plan(tiles: list[Tile], n_q: int, n_k: int, block_q: int, block_k: int) -> str:
    """A character map of the tile grid: '#' full tile, '\\' diagonal tile, '.' skipped tile."""
    marks = {FULL: "#", DIAGONAL: "\\"}
    n_rows, n_cols = -(-n_q // block_q), -(-n_k // block_k)
    grid = [["."] * n_cols for _ in range(n_rows)]
    for t in tiles:
        grid[t.q_start // block_q][t.k_start // block_k] = marks[t.kind]
    return "\n".join(" ".join(row) for row in grid)


def _attend_rows(
    q_rows: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    tiles: list[Tile],
    offset: int,
    out_rows: np.ndarray,
    lse_rows: np.ndarray,
) -> None:
    """The online softmax for one block of (already scaled) queries over its tiles, written into
    out_rows (bq, Ev) and lse_rows (bq,). q_rows (bq, E), k (S, E), v (S, Ev)."""
    bq = q_rows.shape[0]
    dtype = q_rows.dtype
    m = np.full(bq, -np.inf, dtype)  # (bq,) running max of the scores
    l = np.zeros(bq, dtype)  # (bq,) running sum of exp(score - m)
    acc = np.zeros((bq, v.shape[-1]), dtype)  # (bq, Ev) running exp(score - m) @ v
    widest = max((t.k_stop - t.k_start for t in tiles), default=0)
    # The score tile is kept transposed, keys down and queries across: (bk, bq). The per-query max and
    # sum then run down the first axis of a C-order array, which NumPy does with whole-row vector ops,
    # twice as fast as along the last axis on a 256 x 256 tile (README, "Block sizes and workers").
    tile_buf = np.empty((widest, bq), dtype)  # the one score tile this block reuses
    for t in tiles:
        s = tile_buf[: t.k_stop - t.k_start]  # (bk, bq): s[j, i] = q_i · k_j
        # 1) scores of this tile; the scale is already folded into q
        np.matmul(k[t.k_start : t.k_stop], q_rows.T, out=s)
        # 2) a diagonal tile hides the keys its queries may not see
        if t.kind == DIAGONAL:
            blocked = causal_blocked(t.q_start, t.q_stop, t.k_start, t.k_stop, offset)  # (bq, bk)
            np.copyto(s, -np.inf, where=blocked.T)
        # 3) the new running max; a row that has seen no key yet keeps -inf, and we subtract 0 instead
        m_new = np.maximum(m, s.max(axis=0))
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new).astype(dtype, copy=False)
        # 4) probabilities of this tile relative to the new max, in place: s <- exp(s - m').
        #    (Not exp2 with log2(e) folded into q, as GPU kernels do: NumPy's exp2 is twice as fast on
        #    moderate inputs but falls to a slow path, over 20x slower here, where results underflow.)
        s -= m_safe  # (bk, bq) - (bq,): each column is one query
        np.exp(s, out=s)
        # 5) rescale what was accumulated against the old max, then add this tile
        alpha = np.exp(m - m_safe)  # (bq,); 0 where m was -inf, and then l and acc are 0 anyway
        l *= alpha
        l += s.sum(axis=0)
        acc *= alpha[:, None]
        acc += s.T @ v[t.k_start : t.k_stop]  # (bq, bk) @ (bk, Ev); BLAS reads s.T without a copy
        m = m_new
    # 6) divide once at the end; a row that saw no key (l = 0) gets out 0 and lse -inf.
    #    (Test l == 0, not l > 0: a NaN in the inputs must stay NaN, not turn into a quiet 0.)
    empty = l == 0
    np.divide(acc, l[:, None], out=out_rows, where=~empty[:, None])
    out_rows[empty] = 0.0
    with np.errstate(divide="ignore"):
        lse_rows[:] = np.where(empty, -np.inf, m + np.log(l))


_blas_controller: Any = None


def _one_blas_thread() -> Any:
    """A context in which BLAS runs single-threaded: the workers are the parallelism, and one thread
    per tile matmul also makes the result the same bits for any number of workers."""
    global _blas_controller
    if _blas_controller is None:
        from threadpoolctl import ThreadpoolController

        _blas_controller = ThreadpoolController()
    return _blas_controller.limit(limits=1, user_api="blas")


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
) -> Array | tuple[Array, Array]:
    """attention(q, k, v, causal=causal, scale=scale), blockwise, never building L x S.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L), the logsumexp of each row's (scaled, masked) scores.
    causal=True is bottom-right aligned (query i sees key j <= i + S - L), like attention().
    block_q, block_k: tile sizes (any positive ints; they need not divide L or S).
    workers: threads, each taking whole query blocks (default: the CPU count); the result is the
    same bits for any number of workers. While it runs, BLAS is held to one thread for the whole
    process (threadpoolctl), so a matmul in another thread of yours runs single-threaded meanwhile.
    """
    two_d = np.ndim(q) == 2
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e)
    block_q = check_positive_int(block_q, "block_q", default=DEFAULT_BLOCK_Q)
    block_k = check_positive_int(block_k, "block_k", default=DEFAULT_BLOCK_K)
    workers = check_positive_int(workers, "workers", default=os.cpu_count() or 1)
    ct = compute_dtype(q, k, v)
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq  # every (batch, query head) pair
    n_kv_heads = n_heads // dims.group

    # 1) fold the scale into q once, instead of into every tile of scores
    q_s = np.multiply(q.reshape(n_heads, dims.n_q, dims.e), scale, dtype=ct)  # (B·Hq, L, E)
    k_c = np.ascontiguousarray(k.reshape(n_kv_heads, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv_heads, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    out = np.empty((n_heads, dims.n_q, dims.ev), ct)
    lse = np.empty((n_heads, dims.n_q), ct)

    # 2) the tiles that run, grouped by query block; every (head, query block) is one work item
    tiles = tile_plan(dims.n_q, dims.n_k, block_q, block_k, causal=causal)
    offset = causal_offset(dims.n_q, dims.n_k) if causal else 0
    by_block: dict[int, list[Tile]] = {q_start: [] for q_start in range(0, dims.n_q, block_q)}
    for t in tiles:
        by_block[t.q_start].append(t)
    items = [(h, q_start) for h in range(n_heads) for q_start in by_block]
    items.sort(key=lambda item: -len(by_block[item[1]]))  # longest first: the workers finish together

    def run(item: tuple[int, int]) -> None:
        h, q_start = item
        rows = slice(q_start, min(q_start + block_q, dims.n_q))
        kv = h // dims.group  # query head h reads kv head h // G (within its batch entry)
        _attend_rows(q_s[h, rows], k_c[kv], v_c[kv], by_block[q_start], offset, out[h, rows], lse[h, rows])

    # 3) run the items; each writes its own rows of out and lse, so threads never share an array slice
    with _one_blas_thread():
        if workers == 1 or len(items) == 1:
            for item in items:
                run(item)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(run, items))

    out_dtype = result_dtype(q, k, v)
    out_full = out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(out_dtype, copy=False)
    lse_full = lse.reshape(*dims.batch, dims.hq, dims.n_q).astype(out_dtype, copy=False)
    if two_d:
        out_full, lse_full = out_full[0], lse_full[0]
    return (out_full, lse_full) if return_lse else out_full
