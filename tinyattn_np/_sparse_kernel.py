"""The engine of sparse.py: the indexer's running top-k and the attention over the chosen keys, fast (and for
dsa.py's indexer loss, the attention's weights and the indexer's scores at the chosen keys). It imports no
lesson: sparse.py checks the inputs (check_index_inputs, check_sparse_inputs, both here) and passes arrays.

Read sparse.py first: its plain forms (index_topk_plain, merge_topk, sparse_attention_one_head) are what this
computes, and tests/test_sparse.py holds the two equal.

The indexer (running_topk), one block of queries on one worker:
    for each block of keys:   the scores of every indexer head in one matmul, (rows·H_I, d_I) @ (d_I, keys),
                              ReLU in place, the heads weighted and summed by a batched matrix-vector product
                              (rows, 1, H_I) @ (rows, H_I, keys);
                              the block merged into the running top-k (keep_topk)
    at the end:               the k kept in key order, -1 after them (order_topk)
keep_topk finds the k best of the kept and the new with a partition (O(k + n), not a sort), and of the scores
equal to the k-th best the earliest, as merge_topk's order says. A block of keys may come in pieces (topk_of_rows):
one slice of an array here, or the runs of a cache's pages (_sparse_decode.py, the decode step through a cache).

The attention (attend_chosen), one block of queries and one kv head on one worker: each query's chosen keys
gathered (gather_rows), the scores of the kv head's G query heads against them as one batched matmul, keys down as
flash.py's tiles, (bq, bk, E) @ (bq, E, G), and the softmax over blocks of the list, its sums measured against 0
with the running max where exp(s) cannot hold them (flash.py's attend_block). Values that are the keys' first Ev
numbers (MLA's latent: v a view of k) are read from the gathered keys, not gathered again. A block of gathered
keys is half a core's level-2 cache: a step reads it twice (scores, then values).

The backward (chosen_backward): a kv head's query blocks in turn on one worker, which adds their dk and dv at the
chosen keys; the kv heads of the batch on the workers.

Both run their items on worker threads with BLAS held to one thread (_parallel.run_items): each item writes its
own rows, so the bits do not depend on the number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ._checks import as_float_array, check_bool, check_positive_int, check_scale, compute_dtype
from ._guard import refuse_unless_fits
from ._parallel import cpu_cores, l2_cache_bytes, one_blas_thread, run_items

__all__ = [
    "QUERY_BLOCK",
    "SCORES_PER_TILE",
    "IndexInputs",
    "SparseInputs",
    "attend_chosen",
    "check_backward_inputs",
    "check_index_inputs",
    "check_indices",
    "check_sparse_inputs",
    "chosen_backward",
    "heads_summed_weights",
    "indexer_scores_at",
    "indexer_scores_backward",
    "keep_topk",
    "keys_between_merges",
    "order_topk",
    "refuse_topk_beyond_memory",
    "running_topk",
    "topk_by_query_blocks",
    "values_are_key_prefix",
]

Array = np.ndarray
SCORES_PER_TILE = 2**18  # dots of one indexer matmul: (rows·H_I) x keys, 1 MiB of float32
QUERY_BLOCK = 32  # queries a worker's item holds: index_topk's block_q
GATHER_BYTES = 2**20  # gathered keys a step of the attention, when sysfs does not give the level-2 cache


# ---------------------------------------------------------------------------------------------------
# the checks: every input named, before any math


class IndexInputs(NamedTuple):
    q_index: Array  # (B, H_I, T, d_I)
    k_index: Array  # (B, S, d_I)
    weights: Array  # (B, T, H_I)
    topk: int
    causal: bool


def check_index_inputs(q_index: Any, k_index: Any, weights: Any, topk: Any, causal: Any) -> IndexInputs:
    """index_topk's inputs checked against each other, in their compute dtype; each error names the argument."""
    q_index, k_index = as_float_array(q_index, "q_index"), as_float_array(k_index, "k_index")
    weights = as_float_array(weights, "weights")
    topk, causal = check_positive_int(topk, "topk"), check_bool(causal, "causal")
    if q_index.ndim != 4:
        raise ValueError(f"q_index must be (B, H_I, T, d_I); got shape {q_index.shape}")
    B, H, T, d = q_index.shape
    if k_index.ndim != 3 or k_index.shape[0] != B or k_index.shape[2] != d:
        raise ValueError(
            f"k_index must be (B, S, d_I) = ({B}, S, {d}) for q_index {q_index.shape}; got {k_index.shape}"
        )
    if weights.shape != (B, T, H):
        raise ValueError(f"weights must be (B, T, H_I) = {(B, T, H)} for q_index {q_index.shape}; got {weights.shape}")
    for name, x in (("q_index", q_index), ("k_index", k_index), ("weights", weights)):
        if not np.isfinite(x).all():  # a NaN score is neither above nor below the others: no top-k holds it
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
            raise ValueError(f"{name} must be finite; it holds NaN or inf at {where}")
    dtype = compute_dtype(q_index, k_index, weights)
    q_index, k_index, weights = (x.astype(dtype, copy=False) for x in (q_index, k_index, weights))
    return IndexInputs(q_index, k_index, weights, topk, causal)


class SparseInputs(NamedTuple):
    q: Array  # (B, H, T, E)
    k: Array  # (B, Hkv, S, E)
    v: Array  # (B, Hkv, S, Ev)
    indices: Array  # (B, T, topk) int64, -1 for an empty slot
    scale: float


def check_sparse_inputs(q: Any, k: Any, v: Any, indices: Any, scale: Any) -> SparseInputs:
    """sparse_attention's inputs checked against each other; q, k, v in their compute dtype (float16 in float32)."""
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k and v must be (B, H, T, E), (B, Hkv, S, E), (B, Hkv, S, Ev); got {q.shape}, {k.shape}, {v.shape}"
        )
    B, H, T, E = q.shape
    if k.shape[0] != B or k.shape[3] != E or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k must be (B={B}, Hkv, S, E={E}) and v (B, Hkv, S, Ev) with k's Hkv and S; got k {k.shape}, v {v.shape}"
        )
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"the query heads H must be a multiple of the kv heads Hkv; got H={H}, Hkv={k.shape[1]}")
    indices = check_indices(indices, B, T, k.shape[2])
    dtype = compute_dtype(q, k, v)
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    return SparseInputs(q, k, v, indices, check_scale(scale, E, dtype))


def check_backward_inputs(inputs: SparseInputs, out: Any, dout: Any, lse: Any) -> tuple[Array, Array, Array]:
    """sparse_attention_backward's out and dout (B, H, T, Ev) and lse (B, H, T), checked against the inputs, in
    their compute dtype."""
    B, H, T, _ = inputs.q.shape
    out, dout, lse = as_float_array(out, "out"), as_float_array(dout, "dout"), as_float_array(lse, "lse")
    want = (B, H, T, inputs.v.shape[-1])
    if out.shape != want or dout.shape != want or lse.shape != want[:3]:
        raise ValueError(f"out and dout must be {want} and lse {want[:3]}; got {out.shape}, {dout.shape}, {lse.shape}")
    return (
        out.astype(inputs.q.dtype, copy=False),
        dout.astype(inputs.q.dtype, copy=False),
        lse.astype(inputs.q.dtype, copy=False),
    )


def check_indices(indices: Any, batch: int, queries: int, keys: int) -> Array:
    """indices as an int64 (B, T, topk) array of keys in [0, S), or -1 for an empty slot; else a TypeError or a
    ValueError that names indices, the first bad entry and where it is."""
    if not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
        got = getattr(indices, "dtype", type(indices).__name__)
        raise TypeError(f"indices must be an integer ndarray (B, T, topk); got {got}")
    if indices.ndim != 3 or indices.shape[:2] != (batch, queries) or indices.shape[2] < 1:
        raise ValueError(f"indices must be (B, T, topk) = ({batch}, {queries}, topk >= 1); got {indices.shape}")
    bad = (indices < -1) | (indices >= keys)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"indices must lie in [0, {keys}) (S = {keys} keys), or be -1 for an empty slot; got "
            f"{indices[where]} at {where}"
        )
    return indices.astype(np.int64, copy=False)


def values_are_key_prefix(k: Array, v: Array) -> bool:
    """Whether v[..., s, :] is k[..., s, :Ev] for every s: v a view of the keys' first Ev numbers (MLA's latent
    and its c_KV), so that gathering the keys gathers the values too."""
    return bool(
        v.dtype == k.dtype
        and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1]
        and v.strides == k.strides
        and v.__array_interface__["data"][0] == k.__array_interface__["data"][0]
    )


# ---------------------------------------------------------------------------------------------------
# the indexer: a running top-k over blocks of keys


def keys_between_merges(topk: int) -> int:
    """index_topk's block_k: the keys scored between two merges into the running top-k, 4 topk (at least 1,024),
    so that a merge's partition reads the topk kept beside at least 4 topk new scores: a quarter more at most."""
    return max(4 * topk, 1024)


def keep_topk(kept: Array, kept_keys: Array, scores: Array, keys: Array) -> tuple[Array, Array]:
    """The k best of the kept and the new: kept, kept_keys (R, k) in key order (an empty slot, score -inf and key
    -1, first), scores (R, n) of the keys (n,), in order, each later than every kept key. The best: the higher
    score, and of two equal ones the earlier key (merge_topk's order). -> (R, k) scores and keys, in key order.

    No sort: a partition finds the k-th largest score of each row, every score above it is kept, and of those
    equal to it the earliest, as many as make k. Kept and new side by side are in key order, so the earliest
    are the first found, and what is kept stays in key order."""
    k = kept.shape[1]
    every = np.concatenate([kept, scores], axis=1)  # (R, k + n), in key order
    every_keys = np.concatenate([kept_keys, np.broadcast_to(keys, scores.shape)], axis=1)  # (R, k + n)
    n = every.shape[1]
    kth = np.partition(every, n - k, axis=1)[:, n - k, None]  # (R, 1): the k-th largest score
    keep = every >= kth  # (R, k + n): k a row, unless scores tie at the k-th place
    tied = np.flatnonzero(np.count_nonzero(keep, axis=1) > k)
    if len(tied):  # of the ties at the k-th place, the earliest, as many as make k
        above, at = every[tied] > kth[tied], every[tied] == kth[tied]
        wanted = k - np.count_nonzero(above, axis=1, keepdims=True)  # (rows, 1)
        keep[tied] = above | (at & (np.cumsum(at, axis=1) <= wanted))
    return every[keep].reshape(-1, k), every_keys[keep].reshape(-1, k)


def order_topk(scores: Array, keys: Array) -> Array:
    """The chosen keys (R, k) in key order, -1 (no key: score -inf) after the last."""
    past = np.iinfo(np.int64).max
    ordered = np.sort(np.where(scores == -np.inf, past, keys), axis=1)  # (R, k): no key sorts last
    return np.where(ordered == past, -1, ordered)


def block_scores(q_rows: Array, pieces: list[Array], weights: Array) -> Array:
    """I = Σ_h w[t, h] ReLU(q[t, h] · k[s]) for one block of keys: q_rows (R·H_I, d_I), row t·H_I + h; pieces, the
    block's keys in order, each (n_i, d_I) (one array, or a run of pages each); weights (R, H_I) -> (R, Σ n_i).
    The dots in tiles of about SCORES_PER_TILE."""
    R, H = weights.shape
    out = np.empty((R, sum(len(keys) for keys in pieces)), q_rows.dtype)
    step, at = max(1, SCORES_PER_TILE // (R * H)), 0
    for keys in pieces:
        for s0 in range(0, len(keys), step):
            dots = q_rows @ keys[s0 : s0 + step].T  # (R·H_I, keys)
            np.maximum(dots, 0, out=dots)  # ReLU
            summed = weights[:, None, :] @ dots.reshape(R, H, -1)  # (R, 1, H_I) @ (R, H_I, keys)
            out[:, at + s0 : at + s0 + dots.shape[1]] = summed[:, 0]
        at += len(keys)
    return out


def topk_of_rows(
    q_block: Array, weights: Array, blocks: Iterable[tuple[int, list[Array]]], last: Array, topk: int
) -> Array:
    """The running top-k of R queries: q_block (H_I, R, d_I), weights (R, H_I), the keys in blocks (k0, pieces)
    in order, block_scores' pieces holding keys k0, k0 + 1, ...; last (R,) the last key each query sees,
    ascending. -> (R, topk) keys in key order, -1 after them. Where the last query sees at most topk keys, every
    query chooses every key it sees, unscored (the blocks are never read)."""
    R, topk_range = len(last), np.arange(topk)
    if last[-1] + 1 <= topk:
        return np.where(topk_range <= last[:, None], topk_range, -1)  # (R, k)
    q_rows = q_block.swapaxes(0, 1).reshape(R * q_block.shape[0], -1)  # (R·H_I, d_I): row t·H_I + h
    kept = np.full((R, topk), -np.inf, q_block.dtype)  # (R, k): no key yet
    kept_keys = np.full((R, topk), -1, np.int64)
    for k0, pieces in blocks:
        scores = block_scores(q_rows, pieces, weights)  # (R, n)
        k1 = k0 + scores.shape[1]
        if k1 - 1 > last[0]:  # a block the diagonal crosses: no key past a row's own
            for row in range(R):
                scores[row, max(last[row] + 1 - k0, 0) :] = -np.inf
        kept, kept_keys = keep_topk(kept, kept_keys, scores, np.arange(k0, k1))
    return order_topk(kept, kept_keys)


def running_topk(inputs: IndexInputs, *, block_q: int, block_k: int, workers: int) -> Array:
    """index_topk, blockwise: per block of block_q queries, the running top-k over blocks of block_k keys (causal:
    bottom-right, the blocks past the last row's diagonal never scored). -> indices (B, T, topk) int64."""
    q_index, k_index, weights, topk, causal = inputs
    T, S = q_index.shape[2], k_index.shape[1]
    refuse_topk_beyond_memory(q_index, topk, block_q, block_k, workers)

    def last_of(b: int, rows: slice) -> Array:  # (R,): causal, query t sees key s <= t + S - T
        return np.arange(rows.start, rows.stop) + S - T if causal else np.full(rows.stop - rows.start, S - 1)

    def blocks_of(b: int, seen: int) -> Iterator[tuple[int, list[Array]]]:
        return ((k0, [k_index[b, k0 : min(k0 + block_k, seen)]]) for k0 in range(0, seen, block_k))

    return topk_by_query_blocks(q_index, weights, topk, last_of, blocks_of, block_q=block_q, workers=workers)


def topk_by_query_blocks(
    q_index: Array,
    weights: Array,
    topk: int,
    last_of: Callable[[int, slice], Array],
    blocks_of: Callable[[int, int], Iterable[tuple[int, list[Array]]]],
    *,
    block_q: int,
    workers: int,
) -> Array:
    """The running top-k of every block of block_q queries (topk_of_rows), a block of one sequence an item for the
    workers: q_index (B, H_I, T, d_I), weights (B, T, H_I); last_of(b, rows) the last key each of the rows of
    sequence b sees, blocks_of(b, seen) its first `seen` keys in blocks. -> (B, T, topk) int64."""
    B, _, T, _ = q_index.shape
    indices = np.empty((B, T, topk), np.int64)

    def run(item: tuple[int, int]) -> None:
        b, q0 = item
        rows = slice(q0, min(q0 + block_q, T))
        last = last_of(b, rows)  # (R,), ascending
        blocks = blocks_of(b, int(last[-1]) + 1)  # the keys the block's last row sees
        indices[b, rows] = topk_of_rows(q_index[b, :, rows], weights[b, rows], blocks, last, topk)

    with one_blas_thread():
        run_items(run, [(b, q0) for b in range(B) for q0 in range(0, T, block_q)], workers)
    return indices


def refuse_topk_beyond_memory(q_index: Array, topk: int, block_q: int, block_k: int, workers: int) -> None:
    """AttentionMemoryError before a running top-k of q_index (B, H_I, T, d_I) allocates, if its indices and a block
    of scores a worker do not fit."""
    B, _, T, _ = q_index.shape
    itemsize = q_index.dtype.itemsize
    per_worker = block_q * (topk + block_k) * (2 * itemsize + 16) + 2 * SCORES_PER_TILE * itemsize
    refuse_unless_fits(
        B * T * topk * 8 + workers * per_worker,
        "index_topk",
        f"the indices of {B}·{T} queries, and a block of scores a worker",
        "lower topk or the batch",
    )


# ---------------------------------------------------------------------------------------------------
# the attention over the chosen keys


def gather_block(gathered_bytes: int | None, queries: int, width: int, listed: int, itemsize: int) -> tuple[int, int]:
    """(queries, slots) a step of the attention: whole lists where a few queries' gathered keys fit the budget
    (half a core's level-2 cache: the scores and BLAS's packed copies sit beside them), else a query's list in
    equal blocks that fit it (at least 16 slots). Measured: docs/results/sparse.md."""
    l2 = l2_cache_bytes()
    budget = (gathered_bytes or (l2 // 2 if l2 else GATHER_BYTES)) // (width * itemsize)  # keys the budget holds
    if budget >= listed:
        return max(1, min(queries, budget // listed)), listed
    blocks = -(-listed // max(16, budget))
    return 1, -(-listed // blocks)


def attend_chosen(
    inputs: SparseInputs, *, workers: int | None = None, gathered_bytes: int | None = None
) -> tuple[Array, Array]:
    """sparse_attention's forward: out (B, H, T, Ev) and lse (B, H, T) in the compute dtype."""
    q, k, v, indices, scale = inputs
    B, H, T, E = q.shape
    Hkv, Ev, listed = k.shape[1], v.shape[-1], indices.shape[-1]
    G, prefix = H // Hkv, values_are_key_prefix(k, v)
    block_q, block_k = gather_block(gathered_bytes, T, E + (0 if prefix else Ev), listed, q.dtype.itemsize)
    workers = min(workers or cpu_cores(), B * Hkv * -(-T // block_q))
    step = block_q * block_k * (E + Ev + 3 * G) + block_q * G * (E + Ev)
    refuse_unless_fits(
        (B * H * T * (Ev + 1) + workers * step) * q.dtype.itemsize,
        "sparse_attention",
        "out, lse, and a block of gathered keys a worker",
        "lower the batch or T",
    )
    out, lse = np.empty((B, H, T, Ev), q.dtype), np.empty((B, H, T), q.dtype)

    def run(item: tuple[int, int, int]) -> None:
        b, g, q0 = item
        rows, heads = slice(q0, min(q0 + block_q, T)), slice(g * G, (g + 1) * G)
        q_t = q[b, heads, rows].transpose(1, 2, 0) * scale  # (bq, E, G): transposed, the scale folded in once
        chosen = Chosen(k[b, g], None if prefix else v[b, g], Ev, indices[b, rows], block_k)
        acc, m, l = sums_over_chosen(q_t, chosen, running_max=False)  # noqa: E741 (the paper's ℓ)
        if not trusted(l, acc):  # exp(s) overflowed or a row's terms all underflowed: again with the running max
            acc, m, l = sums_over_chosen(q_t, chosen, running_max=True)  # noqa: E741
        out[b, heads, rows], lse[b, heads, rows] = finish(acc, m, l)

    items = [(b, g, q0) for b in range(B) for g in range(Hkv) for q0 in range(0, T, block_q)]
    with one_blas_thread():
        run_items(run, items, workers)
    return out, lse


def gather_rows(source: Array, slots: Array) -> Array:
    """The rows of source (S, ·) that slots (..., n) name, -1 read as row 0 (its caller hides them) -> (..., n, ·).
    By indexing, which reads a strided source in place (the latent, a slice of a cache's keys), where np.take
    would first copy the whole of a source that is not contiguous."""
    return source[np.maximum(slots, 0)]


class Chosen(NamedTuple):
    """One kv head's keys (S, E) and values (S, Ev) (None: the keys' first Ev), and a block of queries' chosen
    keys (bq, n) (-1: none), read block_k slots at a time."""

    keys: Array
    values: Array | None
    Ev: int
    slots: Array
    block_k: int


def sums_over_chosen(q_t: Array, chosen: Chosen, *, running_max: bool) -> tuple[Array, Array, Array]:
    """acc = Σ exp(s - m) v (bq, G, Ev), m and l = Σ exp(s - m) (bq, G) of the scaled queries q_t (bq, E, G) over
    their chosen keys, a block of the list at a time. Keys down, as flash.py's tiles: s = K_chosen q_t (bq, bk, G).

    running_max=False: m = 0 throughout, so a block is a gather, two matmuls, an exponential and a sum (flash.py's
    attend_block says why the reference point may be any number); True: the online softmax's running max,
    what was summed rescaled by exp(m - m') at every block."""
    bq, _, G = q_t.shape
    m = np.full((bq, 1, G), -np.inf if running_max else 0.0, q_t.dtype)
    l = np.zeros((bq, 1, G), q_t.dtype)  # noqa: E741
    acc = np.zeros((bq, G, chosen.Ev), q_t.dtype)
    for j0 in range(0, chosen.slots.shape[1], chosen.block_k):
        slots = chosen.slots[:, j0 : j0 + chosen.block_k]  # (bq, bk)
        k_chosen = gather_rows(chosen.keys, slots)  # (bq, bk, E): -1 reads key 0, hidden below
        s = k_chosen @ q_t  # (bq, bk, G)
        empty = slots < 0
        if empty.any():
            np.copyto(s, -np.inf, where=empty[..., None])
        if running_max:
            m_new = np.maximum(m, s.max(axis=1, keepdims=True))  # (bq, 1, G)
            m_sub = np.where(m_new == -np.inf, 0, m_new)  # a row with no key yet: no -inf - -inf
            alpha = np.exp(m - m_sub)  # (bq, 1, G): rescales what was summed against the old max
            l *= alpha
            acc *= alpha.swapaxes(1, 2)
            s -= m_sub
            m = m_new
        np.exp(s, out=s)  # p (bq, bk, G)
        values = k_chosen[..., : chosen.Ev] if chosen.values is None else gather_rows(chosen.values, slots)
        l += s.sum(axis=1, keepdims=True)
        acc += s.swapaxes(1, 2) @ values  # (bq, G, bk) @ (bq, bk, Ev)
    return acc, m[:, 0], l[:, 0]


def trusted(l: Array, acc: Array) -> bool:  # noqa: E741
    """Whether sums against 0 hold every row (flash.py's rule): nothing overflowed, and l >= √tiny, far above
    the underflow. A row with no key (l = 0) fails too: the running max tells it from one that underflowed."""
    return bool((l >= np.sqrt(np.finfo(l.dtype).tiny)).all() and np.isfinite(l).all() and np.isfinite(acc).all())


def finish(acc: Array, m: Array, l: Array) -> tuple[Array, Array]:  # noqa: E741
    """out = acc / l (G, bq, Ev) and lse = m + log l (G, bq), heads first; a row with no key (l = 0) gets 0 and
    -inf (l == 0, not l > 0: a NaN from the inputs stays NaN)."""
    empty = l == 0  # (bq, G)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(empty[..., None], 0.0, acc / np.where(empty, 1, l)[..., None])  # (bq, G, Ev)
        lse = np.where(empty, -np.inf, m + np.log(l))  # (bq, G)
    return out.swapaxes(0, 1), lse.T


# ---------------------------------------------------------------------------------------------------
# the backward: dq a query's own, dk and dv added back at the keys it chose


def chosen_backward(
    inputs: SparseInputs, out: Array, dout: Array, lse: Array, *, workers: int | None = None
) -> tuple[Array, Array, Array]:
    """dq (B, H, T, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) in the compute dtype. A kv head is one item (its dk
    and dv are added to in query order, by one worker), its query blocks one after the other."""
    q, k, v, indices, scale = inputs
    B, H, T, E = q.shape
    Hkv, Ev, listed = k.shape[1], v.shape[-1], indices.shape[-1]
    G = H // Hkv
    block_q, _ = gather_block(None, T, E + Ev, listed, q.dtype.itemsize)
    workers = min(workers or cpu_cores(), B * Hkv)
    step = block_q * listed * (3 * (E + Ev) + 4 * G)
    refuse_unless_fits(
        (2 * q.size + k.size + v.size + B * H * T + workers * step) * q.dtype.itemsize,
        "sparse_attention_backward",
        "dq, dk, dv, and a block of gathered keys a worker",
        "lower the batch or T",
    )
    delta = np.einsum("bhte,bhte->bht", dout, out)  # (B, H, T): D_t = dout_t · out_t
    dq, dk, dv = np.empty_like(q), np.zeros_like(k), np.zeros_like(v)

    def run(item: tuple[int, int]) -> None:
        b, g = item
        heads = slice(g * G, (g + 1) * G)
        for q0 in range(0, T, block_q):
            rows = slice(q0, min(q0 + block_q, T))
            q_rows, dout_rows = (x[b, heads, rows].swapaxes(0, 1) for x in (q, dout))  # (bq, G, E), (bq, G, Ev)
            lse_rows, delta_rows = lse[b, heads, rows].T, delta[b, heads, rows].T  # (bq, G) each
            dq_block = block_backward(
                q_rows, dout_rows, lse_rows, delta_rows, k[b, g], v[b, g], indices[b, rows], scale, dk[b, g], dv[b, g]
            )
            dq[b, heads, rows] = dq_block.swapaxes(0, 1)

    with one_blas_thread():
        run_items(run, [(b, g) for b in range(B) for g in range(Hkv)], workers)
    return dq, dk, dv


def block_backward(
    q_block: Array,
    dout_block: Array,
    lse: Array,
    delta: Array,
    keys: Array,
    values: Array,
    chosen: Array,
    scale: float,
    dk: Array,
    dv: Array,
) -> Array:
    """One block of queries (bq, G, ·) of one kv head: returns dq (bq, G, E); adds dk (S, E) and dv (S, Ev) at
    the chosen keys (chosen (bq, n), -1 for none). The five lines of the backward, over the chosen keys:
        p = exp(scale q kᵀ - lse)   dv += pᵀ dout   dp = dout vᵀ   ds = p (dp - D)   dq = scale ds k,  dk += scale dsᵀ q
    """
    k_chosen = gather_rows(keys, chosen)  # (bq, n, E)
    v_chosen = gather_rows(values, chosen)  # (bq, n, Ev)
    s = (q_block * scale) @ k_chosen.swapaxes(-1, -2)  # (bq, G, n)
    with np.errstate(invalid="ignore"):  # a row with no key: lse = -inf, and its p is 0 below
        p = np.exp(s - lse[..., None])  # (bq, G, n)
    np.copyto(p, 0, where=(chosen < 0)[:, None, :] | np.isneginf(lse)[..., None])
    dp = dout_block @ v_chosen.swapaxes(-1, -2)  # (bq, G, n)
    ds = p * (dp - delta[..., None])  # (bq, G, n)
    dk_chosen = scale * (ds.swapaxes(-1, -2) @ q_block)  # (bq, n, E): every query head of the group summed
    dv_chosen = p.swapaxes(-1, -2) @ dout_block  # (bq, n, Ev)
    add_at_chosen(dk, chosen, dk_chosen)
    add_at_chosen(dv, chosen, dv_chosen)
    return scale * (ds @ k_chosen)  # (bq, G, E)


def add_at_chosen(grad: Array, chosen: Array, rows: Array) -> None:
    """grad[chosen[i, j]] += rows[i, j] for every listed slot, in query order: (S, ·), (bq, n), (bq, n, ·). A
    query's list without a repeated key adds in one step; a key listed twice in one list is added twice."""
    for i in range(len(chosen)):
        listed = chosen[i] >= 0
        keys, add = (chosen[i], rows[i]) if listed.all() else (chosen[i][listed], rows[i][listed])
        if len(np.unique(keys)) == len(keys):
            grad[keys] += add  # (n, ·): distinct keys, so the gather-add-scatter loses nothing
        else:
            np.add.at(grad, keys, add)


def heads_summed_weights(inputs: SparseInputs, lse: Array) -> Array:
    """Σ_h p_h[t, j]: the attention weights of every query head at each chosen key, summed over the heads ->
    (B, T, n), 0 at an empty slot. lse (B, H, T): the forward's. A block of queries of one kv head at a time."""
    q, k, _, indices, scale = inputs
    B, H, T, _ = q.shape
    Hkv, listed = k.shape[1], indices.shape[-1]
    G = H // Hkv
    block_q, _ = gather_block(None, T, q.shape[-1], listed, q.dtype.itemsize)
    summed = np.zeros((B, T, listed), q.dtype)
    for b in range(B):
        for g in range(Hkv):
            heads = slice(g * G, (g + 1) * G)
            for q0 in range(0, T, block_q):
                rows = slice(q0, min(q0 + block_q, T))
                k_chosen = gather_rows(k[b, g], indices[b, rows])  # (bq, n, E)
                s = (q[b, heads, rows].swapaxes(0, 1) * scale) @ k_chosen.swapaxes(-1, -2)  # (bq, G, n)
                with np.errstate(invalid="ignore", over="ignore"):  # a row with no key (lse -inf) lists none
                    p = np.exp(s - lse[b, heads, rows].T[..., None])  # (bq, G, n)
                np.copyto(p, 0, where=(indices[b, rows] < 0)[:, None, :])
                summed[b, rows] += p.sum(axis=1)  # (bq, n)
    return summed


# ---------------------------------------------------------------------------------------------------
# the indexer's scores at the chosen keys, and their backward (its training loss)


def indexer_scores_at(q_index: Array, k_index: Array, weights: Array, indices: Array) -> tuple[Array, Array]:
    """I[t, j] = Σ_h w[t, h] ReLU(q_I[t, h] · k_I[indices[t, j]]) at each chosen key: q_index (B, H_I, T, d_I),
    k_index (B, S, d_I), weights (B, T, H_I), indices (B, T, n) -> scores (B, T, n), -inf at an empty slot, and
    the dots (B, H_I, T, n) before the ReLU (0 at an empty slot)."""
    B, H, T, d = q_index.shape
    n = indices.shape[-1]
    refuse_unless_fits(
        (B * T * n * (d + 2 * H + 1)) * q_index.dtype.itemsize,
        "the indexer's loss",
        f"the chosen indexer keys of {B}·{T} queries and their dots",
        "lower T or topk",
    )
    k_chosen = np.stack([gather_rows(k_index[b], indices[b]) for b in range(B)])  # (B, T, n, d_I)
    dots = np.einsum("bhtd,btnd->bhtn", q_index, k_chosen)  # (B, H_I, T, n)
    dots[np.broadcast_to((indices < 0)[:, None], dots.shape)] = 0
    scores = np.einsum("bth,bhtn->btn", weights, np.maximum(dots, 0))  # (B, T, n)
    scores[indices < 0] = -np.inf
    return scores, dots


def indexer_scores_backward(
    d_scores: Array, dots: Array, q_index: Array, k_index: Array, weights: Array, indices: Array
) -> tuple[Array, Array, Array]:
    """From ∂L/∂I at the chosen keys (B, T, n) (0 at an empty slot): dq_I (B, H_I, T, d_I), dk_I (B, S, d_I), each
    key's terms added at its position, and dweights (B, T, H_I).
        ∂I/∂w[t, h] = ReLU(dot)    ∂I/∂dot = w[t, h] · [dot > 0]    dot = q_I[t, h] · k_I[s]"""
    B, H, T, d = q_index.shape
    d_weights = np.einsum("btn,bhtn->bth", d_scores, np.maximum(dots, 0))  # (B, T, H_I)
    d_dots = d_scores[:, None] * weights.transpose(0, 2, 1)[..., None] * (dots > 0)  # (B, H_I, T, n)
    dq, dk = np.empty_like(q_index), np.zeros_like(k_index)
    for b in range(B):
        k_chosen = gather_rows(k_index[b], indices[b])  # (T, n, d_I)
        dq[b] = np.einsum("htn,tnd->htd", d_dots[b], k_chosen)  # (H_I, T, d_I)
        dk_chosen = np.einsum("htn,htd->tnd", d_dots[b], q_index[b])  # (T, n, d_I): every indexer head summed
        listed = indices[b] >= 0
        np.add.at(dk[b], indices[b][listed], dk_chosen[listed])  # a key chosen by many queries gathers every term
    return dq, dk, d_weights
