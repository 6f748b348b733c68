"""The decode engine: one query's online softmax over blocks of keys read where they lie, spread over the
cores, and the bytes it takes. splitkv.py teaches split-KV decoding; flash_decode runs it here, and so do the
caches.

A chunk is walked in blocks of keys, and each block is one step of the online softmax: its scores (rows x
keys) are made, exponentiated and multiplied by its values before the next block is read. A block holds
about the decode layout's scores_per_block scores (and, for a float16 cache, as many elements of keys and
values converted to float32): large enough that the dozen NumPy calls of a step are few next to the bytes
it reads, small enough that it stays in the core's cache. A chunk gets at least MIN_SPLIT_KEYS keys: below
that, starting a thread costs more than the chunk's work. A block is a list of pieces (k, v), each read in
place: one slice of a contiguous cache (attend_chunk), or one per run of consecutive pages of a paged cache
(_paged_kernel.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from ._bytes import format_bytes
from ._checks import QKVShape, compute_dtype, result_dtype
from ._flash_kernel import trusted
from ._guard import refuse_unless_fits
from ._parallel import one_blas_thread, run_items
from ._tuning import VECTOR_ROWS, decode_layout

Array = NDArray[np.floating]

__all__ = [
    "MIN_BLOCK_K",
    "MIN_SPLIT_KEYS",
    "attend_blocks",
    "attend_blocks_bytes",
    "attend_chunk",
    "block_keys",
    "block_scores",
    "decode",
    "decode_bytes",
    "default_kv_splits",
    "merge_parts",
    "merge_parts_bytes",
    "merges_without_copy",
    "refuse_decode_beyond_memory",
]

MIN_BLOCK_K = 256
MIN_SPLIT_KEYS = 1024


def default_kv_splits(n_k: int, workers: int) -> int:
    """One chunk per worker, as long as each gets 1,024 keys or more: a short cache is one chunk."""
    return max(1, min(workers, n_k // MIN_SPLIT_KEYS))


def block_keys(rows: int, converted_per_key: int = 0) -> int:
    """Keys per block of the online softmax: the layout's scores_per_block values for `rows` scores per key
    and, where the cache must be converted (float16), converted_per_key elements of keys and values; at least
    256."""
    per_key = max(rows + converted_per_key, 1)
    return max(MIN_BLOCK_K, decode_layout().scores_per_block // per_key // MIN_BLOCK_K * MIN_BLOCK_K)


def attend_blocks(q_s: Array, blocks: Iterable[list[tuple[Array, Array]]], ev: int) -> tuple[Array, Array]:
    """Attention of (already scaled) queries over blocks of keys, and its logsumexp, by the online softmax
    (flash.py's steps, with the G heads of a kv head stacked), one block per step.

    q_s (N, R, E) -> out (N, R, Ev), lse (N, R). Each block is a list of pieces (k (N, n_i, E), v (N, n_i,
    Ev)), read where they lie; n_i >= 1. k and v may be float16: each piece is converted to q_s's dtype as it
    is read, never more. A query that sees no block gets out 0 and lse -inf.

    As in _flash_kernel.attend_block, the sums are first measured against m = 0 (a "unified max value"): a
    block is two matmuls, one exponential and one row sum. Where the sums say that did not hold (trusted),
    the blocks are read again with the running max.
    """
    blocks = list(blocks)  # views: walked a second time if the sums against 0 cannot be trusted
    acc = np.empty((*q_s.shape[:2], ev), q_s.dtype)  # (N, R, Ev) Σ exp(s - m) v, filled by _sum_blocks
    m, l = _sum_blocks(q_s, blocks, acc, running_max=False)
    if not trusted(l, acc):  # exp(s) overflowed, or a row's terms all underflowed: again with the running max
        m, l = _sum_blocks(q_s, blocks, acc, running_max=True)
    # 4) divide once at the end; a row that saw no key keeps out 0 and lse -inf
    np.divide(acc, l, out=acc, where=l != 0)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]  # (N, R): log Σ_j exp(score_j)
    return acc, lse


def _sum_blocks(
    q_s: Array, blocks: list[list[tuple[Array, Array]]], acc: Array, *, running_max: bool
) -> tuple[Array, Array]:
    """The block loop of attend_blocks: fills acc (N, R, Ev) with Σ exp(s - m) v and returns m and l (N, R,
    1), the reference point and Σ exp(s - m) of each row. running_max=False: m = 0 throughout (steps 2 and 3's
    rescaling skipped); True: m moved to the running max and what was summed rescaled at every block."""
    n, rows = q_s.shape[:2]
    keys_first = decode_layout().keys_first  # read once: a block's layout never changes within a step
    m = np.full((n, rows, 1), -np.inf if running_max else 0.0, q_s.dtype)  # the reference point of the sums
    l = np.zeros((n, rows, 1), q_s.dtype)  # running sum of exp(score - m)
    acc[...] = 0  # running exp(score - m) @ v
    part = np.empty_like(acc)  # one piece's exp(score - m) @ v, before it is added
    with np.errstate(over="ignore", invalid="ignore"):  # against 0, an overflow shows in the sums (trusted)
        for pieces in blocks:
            bounds = np.cumsum([0] + [k.shape[1] for k, _ in pieces])  # piece i: columns bounds[i] .. bounds[i + 1]
            # 1) scores of every query row against the block's keys, piece by piece (block_scores)
            s = block_scores(q_s, [k for k, _ in pieces], bounds, keys_first)  # (N, R, bk)
            # 2) the block's probabilities relative to m, in place (the running max: moved first)
            if running_max:
                m_new = np.maximum(m, s.max(axis=-1, keepdims=True))  # (N, R, 1)
                s -= m_new
            np.exp(s, out=s)
            # 3) rescale what was accumulated against the old max, then add this block, piece by piece
            if running_max:
                alpha = np.exp(m - m_new)  # (N, R, 1); 0 on the first block, where m = -inf
                l *= alpha
                acc *= alpha
                m = m_new
            l += s.sum(axis=-1, keepdims=True)
            for (_, v), start, stop in zip(pieces, bounds, bounds[1:], strict=False):
                v = v.astype(q_s.dtype, copy=False)
                acc += np.matmul(s[:, :, start:stop], v, out=part)  # (N, R, n_i) @ (N, n_i, Ev)
    return m, l


def block_scores(q_s: Array, keys: list[Array], bounds: np.ndarray, keys_first: bool) -> Array:
    """One block's scores s = q_s Kᵀ -> (N, R, bk), K the pieces in turn (piece i: columns bounds[i] ..
    bounds[i + 1]), each read in place by BLAS and converted to q_s's dtype only if it is float16 (one piece
    at a time). keys_first, with R <= VECTOR_ROWS: row r of a piece of MIN_BLOCK_K keys or more made as K q_r,
    a matrix-vector product (DecodeLayout); a shorter piece (a few pages of a paged cache) as one product."""
    n, rows = q_s.shape[:2]
    s = np.empty((n, rows, bounds[-1]), q_s.dtype)  # (N, R, bk)
    q_cols = q_s[..., None]  # (N, R, E, 1)
    for k, start, stop in zip(keys, bounds, bounds[1:], strict=False):
        k = k.astype(q_s.dtype, copy=False)
        if keys_first and rows <= VECTOR_ROWS and stop - start >= MIN_BLOCK_K:
            for r in range(rows):  # (N, n_i, E) @ (N, E, 1): one matrix-vector product per query row
                np.matmul(k, q_cols[:, r], out=s[:, r, start:stop, None])
        else:  # queries first, or a piece of a few pages: one product costs less than R calls
            np.matmul(q_s, k.swapaxes(-1, -2), out=s[:, :, start:stop])  # (N, R, n_i)
    return s


def attend_chunk(q_s: Array, k_chunk: Array, v_chunk: Array) -> tuple[Array, Array]:
    """attend_blocks over a contiguous chunk: q_s (N, R, E), k_chunk (N, Sc, E), v_chunk (N, Sc, Ev) ->
    out (N, R, Ev), lse (N, R), in blocks of block_keys(N·R) keys, each a slice read in place."""
    n, rows = q_s.shape[:2]
    converted = 0 if k_chunk.dtype == q_s.dtype else n * (k_chunk.shape[-1] + v_chunk.shape[-1])  # float16
    step = block_keys(n * rows, converted)
    starts = range(0, k_chunk.shape[1], step)
    blocks = ([(k_chunk[:, s : s + step], v_chunk[:, s : s + step])] for s in starts)
    return attend_blocks(q_s, blocks, v_chunk.shape[-1])


def merge_parts(outs: list[Array], lses: list[Array]) -> tuple[Array, Array]:
    """splitkv.merge_chunks' work: the attention over every part's keys from each part's own, outs[n] (...,
    Ev) and lses[n] (...): one max, each weight rounded once, the sums over the parts in their order and in
    float64; out in the outs' dtype, lse in the lses'; a row no part saw gets out 0 and lse -inf."""
    m = np.max(np.stack(lses), axis=0).astype(np.float64)  # (...,) one max over every chunk's lse
    m_safe = np.where(np.isneginf(m), 0.0, m)  # no chunk saw a key: exp(-inf - 0) = 0, never NaN
    total = np.zeros_like(m)  # (...,) Σ_n w_n
    out = np.zeros(outs[0].shape, np.float64)  # (..., Ev) Σ_n w_n out_n
    with np.errstate(invalid="ignore"):  # inf - inf where an lse is +inf: NaN, and it propagates
        for out_n, lse_n in zip(outs, lses, strict=True):
            w_n = np.exp(lse_n - m_safe)  # (...,) chunk n's weight, before the division by the total
            total += w_n
            out += w_n[..., None] * out_n
        np.divide(out, total[..., None], out=out, where=(total != 0)[..., None])  # a row no chunk saw keeps 0
        with np.errstate(divide="ignore"):
            lse = m_safe + np.log(total)  # (...,) -inf where no chunk saw a key
    return out.astype(outs[0].dtype), lse.astype(lses[0].dtype)


def decode(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, scale: float, kv_splits: int, workers: int
) -> tuple[Array, Array]:
    """flash_decode's work on checked inputs: out (B·Hkv, G·L, Ev) and lse (B·Hkv, G·L) in the compute
    dtype."""
    ct = compute_dtype(q, k, v)
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv  # every (batch, kv head) pair
    rows = dims.group * dims.n_q  # query rows that read one kv head: G heads x L queries
    if dims.n_k == 0 or rows == 0 or n_kv == 0:  # no key (out 0, lse -inf) or nothing to compute
        return np.zeros((n_kv, rows, dims.ev), ct), np.full((n_kv, rows), -np.inf, ct)
    # 1) stack the G query heads of each kv head into one matrix, and fold the scale into q once.
    #    Query head h reads kv head h // G, so heads g·G .. g·G + G - 1 are neighbours: a reshape suffices.
    q_s = np.multiply(q.reshape(n_kv, rows, dims.e), scale, dtype=ct)  # (B·Hkv, G·L, E)
    k_c, v_c = k.reshape(n_kv, dims.n_k, dims.e), v.reshape(n_kv, dims.n_k, dims.ev)  # views, in their own dtype
    # 2) contiguous chunks of keys: bounds[n] .. bounds[n + 1] is chunk n; each task writes its own entry
    bounds = [dims.n_k * n // kv_splits for n in range(kv_splits + 1)]
    parts: list[tuple[Array, Array]] = [(q_s, q_s)] * kv_splits

    def run(n: int) -> None:
        keys = slice(bounds[n], bounds[n + 1])
        parts[n] = attend_chunk(q_s, k_c[:, keys], v_c[:, keys])

    if kv_splits == 1:  # one chunk: BLAS may use its own threads on it, and its out and lse are the result
        run(0)  # (merge_parts of one part gives it back bit for bit: weight exp(0) = 1, sum 1)
        return parts[0]
    with one_blas_thread():  # the chunks are the parallelism: BLAS held to one thread, no cores oversubscribed
        run_items(run, range(kv_splits), min(workers, kv_splits))
    # 3) one merge over every chunk
    return merge_parts([out for out, _ in parts], [lse for _, lse in parts])


# ---------------------------------------------------------------------------------------------------
# the memory a decode step takes, known before it allocates anything


def attend_blocks_bytes(n: int, rows: int, block_k: int, keys: int, ev: int, compute: int, converted: int) -> int:
    """Peak bytes of one attend_blocks call over `keys` keys in blocks of block_k, besides its result (out and
    lse), with c = compute bytes: the scores of a block, n·rows·block_k·c, twice if there is a next block
    (made before the last one's are let go); one piece's product (part) n·rows·Ev·c; the running max and sum
    and their temporaries (max, m_new, alpha, the row sums, log) 7·n·rows·c; and for a float16 cache the
    pieces converted, `converted` elements per key (keys and values), as many blocks' worth as of scores."""
    blocks = 2 if keys > block_k else 1
    return (n * rows * (blocks * block_k + ev + 7) + blocks * n * block_k * converted) * compute


def merge_parts_bytes(chunks: int, rows: int, ev: int, compute: int) -> int:
    """Peak bytes of merge_parts over `chunks` parts of `rows` rows besides the parts: the lses stacked
    (chunks·rows·c), the float64 max, weights, sums and log (6·rows·8), the float64 out and one chunk's
    weighted out (2·rows·Ev·8), and the result cast back (rows·(Ev + 1)·c)."""
    return chunks * rows * compute + rows * (6 + 2 * ev) * 8 + rows * (ev + 1) * compute


def decode_bytes(dims: QKVShape, compute: np.dtype, stored: np.dtype, kv_splits: int, workers: int) -> int:
    """Peak bytes decode() allocates for q, k, v that exist already, an upper bound. With N = B·Hkv query
    matrices of R = G·L rows and c bytes of the compute dtype:

        q_s       N·R·E·c              q times the scale, held to the end
        parts     n·N·R·(Ev + 1)·c     out and lse of each of the n = kv_splits chunks, held until the merge
        workers   min(workers, n) attend_blocks at once (attend_blocks_bytes)
        merge     merge_parts_bytes, once the workers are done
        peak = q_s + parts + max(workers, merge)
    """
    n_kv = math.prod(dims.batch) * dims.hkv
    rows, c = dims.group * dims.n_q, compute.itemsize
    if dims.n_k == 0 or rows == 0 or n_kv == 0:  # out 0 and lse -inf, nothing else
        return n_kv * rows * (dims.ev + 1) * c
    converted = 0 if stored == compute else dims.e + dims.ev  # a float16 cache: keys and values, per key
    chunk = -(-dims.n_k // kv_splits)  # keys of the longest chunk
    block_k = min(block_keys(n_kv * rows, n_kv * converted), chunk)
    working = min(workers, kv_splits) * attend_blocks_bytes(n_kv, rows, block_k, chunk, dims.ev, c, converted)
    merge = merge_parts_bytes(kv_splits, n_kv * rows, dims.ev, c)
    return n_kv * rows * dims.e * c + kv_splits * n_kv * rows * (dims.ev + 1) * c + max(working, merge)


def merges_without_copy(x: np.ndarray) -> bool:
    """Whether x (..., S, E) reshapes to (prod(...), S, E) as a view: its leading axes of more than one entry
    are laid out one inside the next (NumPy copies otherwise)."""
    lead = [(n, stride) for n, stride in zip(x.shape[:-2], x.strides[:-2], strict=True) if n != 1]
    return all(outer == inner * n for (_, outer), (n, inner) in zip(lead, lead[1:], strict=False))


def refuse_decode_beyond_memory(
    who: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, kv_splits: int, workers: int
) -> None:
    """AttentionMemoryError before decode() allocates anything, if its peak (decode_bytes, any copies of k and
    v that the reshape makes, and the result cast to float16) does not fit in the memory available."""
    compute, stored = compute_dtype(q, k, v), np.result_type(k, v)
    needed = decode_bytes(dims, compute, stored, kv_splits, workers)
    needed += sum(x.nbytes for x in (k, v) if x.size and not merges_without_copy(x))
    out_size = result_dtype(q, k, v).itemsize
    needed += q.size // max(dims.e, 1) * dims.ev * out_size * (out_size < compute.itemsize)  # the cast back
    rows = math.prod(dims.batch) * dims.hq * dims.n_q  # query rows in all
    parts = kv_splits * rows * (dims.ev + 1) * compute.itemsize
    refuse_unless_fits(
        needed,
        who,
        f"{rows:,} query rows against {dims.n_k:,} keys in {kv_splits} chunks: {format_bytes(parts)} of parts",
        "pass fewer queries per call (a smaller batch, fewer heads or tokens), or fewer kv_splits",
    )
