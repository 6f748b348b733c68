"""Paged decoding: one decode step for many sequences of different lengths, read through their block tables.

A PagedKVCache (paged.py) keeps sequence i's token p in block tables[i][p // block_size], slot p % block_size,
of one pool of blocks. A decode step of N sequences is the attention of each one's queries over its own keys:

    keys_i   = k_pool[:, tables[i]] laid out in token order, its first lengths[i] slots     (Hkv, S_i, E)
    out_i    = attention(q_i, keys_i, values_i)                                            (Hq, L, Ev)

which paged_attention computes plainly, gathering each sequence into one array. The kernels take what vLLM's
forward_decode(query, key_cache, value_cache, block_tables, seq_lens) takes, the pools, the tables and the
lengths (cache.pages(seq_ids)), never the cache's own state. paged_decode reads the keys where they lie: a run
of blocks that follow one another in the pool is one matmul operand, and each sequence is split into chunks of
whole blocks merged as flash_decode merges its chunks (_paged_kernel.py). cascade_decode reads a prefix that
every sequence shares (a prompt, after fork) once for all of them (FlashInfer's cascade attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._atomic import holding
from ._checks import as_float_array, check_bool, check_positive_int, check_scale, compute_dtype, result_dtype
from ._decode_kernel import default_kv_splits
from ._guard import refuse_unless_fits
from ._paged_kernel import (
    Pages,
    attend_page_chunks,
    decode_pages,
    merge_per_query,
    pages_bytes,
    scaled_queries,
    sequence_chunks,
    shared_prefix,
)
from ._parallel import cpu_cores
from .attention import attention
from .paged import PagedKVCache
from .softmax import merge_states

Array = NDArray[np.floating]

__all__ = ["cascade_decode", "paged_attention", "paged_decode", "paged_decode_bytes"]


def paged_attention(
    q: Array,
    k_pool: Array,
    v_pool: Array,
    block_tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    *,
    scale: float | None = None,
) -> Array:
    """The lines above, plainly: q (N, Hq, L, E), k_pool (Hkv, num_blocks, block_size, E), v_pool (..., Ev),
    block_tables[i] the blocks of sequence i in token order, lengths[i] its tokens -> out (N, Hq, L, Ev):
    every query of sequence i sees every key of it. paged_decode is the fast path, tested equal to it.

    >>> pool = np.eye(4)[None, :, None]   # 1 kv head, 4 blocks of 1 slot: block b holds the key e_b
    >>> paged_attention(np.ones((1, 1, 1, 4)), pool, pool, [[2, 0]], [2]).round(2)   # keys e_2 and e_0
    array([[[[0.5, 0. , 0.5, 0. ]]]])
    """
    kv_heads, _, _, head_dim = k_pool.shape
    out = []
    for q_i, table, length in zip(q, block_tables, lengths, strict=True):
        blocks = list(table)
        k_i = k_pool[:, blocks].reshape(kv_heads, -1, head_dim)[:, :length]  # (Hkv, S_i, E): gathered, in order
        v_i = v_pool[:, blocks].reshape(kv_heads, -1, v_pool.shape[-1])[:, :length]  # (Hkv, S_i, Ev)
        out.append(attention(q_i, k_i, v_i, scale=scale))  # (Hq, L, Ev)
    return np.stack(out)  # (N, Hq, L, Ev)


def paged_decode(
    q: Array,
    cache: PagedKVCache,
    seq_ids: Sequence[int],
    *,
    scale: float | None = None,
    kv_splits: int | None = None,
    workers: int | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """One decode step for N sequences of different lengths: attention of q[i] over sequence seq_ids[i]'s
    keys.

    q (N, Hq, L, E) -> out (N, Hq, L, Ev), and with return_lse=True also lse (N, Hq, L); Ev is the cache's
    value_dim (head_dim, or value_prefix: the keys' first numbers, read once with them). Every query sees
    every key of its sequence (for L = 1 that is causal attention: the query is the newest token), so out[i]
    equals attention(q[i], K_i, V_i) with K_i, V_i = cache.gather(seq_ids[i]), the keys laid out
    contiguously (paged_attention). Query head h reads kv head h // (Hq / kv_heads).

    The keys are read through the block tables where they lie: each run of consecutive blocks is one
    matmul operand, never copied. A sequence is split into kv_splits chunks of whole blocks (default: one
    per worker, 1,024 keys or more each), every chunk of every sequence is a work item for `workers`
    threads (default the CPU count), and each sequence's chunks are merged as merge_chunks merges, as
    flash_decode does. For a given kv_splits the result is the same bits for any number of workers. The
    cache's lock is held while it reads. float16 is computed in float32.

    >>> cache = PagedKVCache(num_blocks=4, block_size=2, kv_heads=1, head_dim=2)
    >>> seq = cache.add_sequence()
    >>> cache.append(seq, np.eye(2, dtype=np.float32)[None], np.eye(2, dtype=np.float32)[None])
    >>> paged_decode(np.array([[[[9.0, 0.0]]]], np.float32), cache, [seq]).round(3)   # sees key 0 far more
    array([[[[0.998, 0.002]]]], dtype=float32)
    """
    return run_decode(decode_pages, q, cache, seq_ids, scale, kv_splits, workers, return_lse)


def cascade_decode(
    q: Array,
    cache: PagedKVCache,
    seq_ids: Sequence[int],
    *,
    scale: float | None = None,
    kv_splits: int | None = None,
    workers: int | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """paged_decode's result, computed as cascade attention (FlashInfer): the blocks that every sequence
    shares (a common prompt, after fork) are read once for all of them, the rest of each sequence on its own.

    With a prefix P shared by all N sequences and each one's own keys O_i after it:
        out_P, lse_P = attention(all N sequences' queries stacked, P)     one pass over P, N·Hq·L rows
        out_i, lse_i = attention(q_i, O_i)                                  each sequence alone
        out = merge_states(out_P, lse_P, out_i, lse_i)                      disjoint keys: exact
    Decoding N samples of one long prompt then reads the prompt once per step, not N times, in matmuls of
    N times the rows. The shared prefix is the leading blocks that every table holds at the same place
    (none: this is paged_decode). Arguments and result as in paged_decode.
    """
    return run_decode(decode_cascade, q, cache, seq_ids, scale, kv_splits, workers, return_lse)


def decode_cascade(
    q: np.ndarray, pages: Pages, scale: float, kv_splits: int | None, workers: int
) -> tuple[Array, Array]:
    """cascade_decode's work on checked inputs: as decode_pages, but the pages that every sequence shares are
    read once, by the queries of all N sequences stacked into one matrix."""
    q_s = scaled_queries(q, pages, scale)  # (N, Hkv, R, E): R = G·L query rows per sequence and kv head
    n, hkv, rows, e = q_s.shape
    size, ev, tables, lengths = pages.block_size, pages.v_pool.shape[-1], pages.tables, pages.lengths
    if n == 0:  # no sequence: nothing to read
        return q_s.copy(), q_s[..., 0].copy()
    shared, keys = shared_prefix(tables, lengths, size)
    # 1) the shared prefix, once: all N·R query rows of a kv head against it, as one matrix (query number N)
    q_all = q_s.transpose(1, 0, 2, 3).reshape(hkv, n * rows, e)  # (Hkv, N·R, E)
    chunks = sequence_chunks(n, tables[0][:shared], keys, size, kv_splits or default_kv_splits(keys, workers))
    # 2) each sequence's own pages, after the prefix (none if it ends in the prefix)
    for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        splits = kv_splits or default_kv_splits(length - keys, workers)
        chunks += sequence_chunks(i, table[shared:], length - keys, size, splits)
    queries = [*q_s, q_all]
    merged = merge_per_query(attend_page_chunks(queries, pages, chunks, workers), chunks, queries, ev)
    # 3) the two parts of each sequence, over disjoint keys, combined: merge_states
    out_shared = merged[n][0].reshape(hkv, n, rows, ev).transpose(1, 0, 2, 3)  # (N, Hkv, R, Ev)
    lse_shared = merged[n][1].reshape(hkv, n, rows).transpose(1, 0, 2)  # (N, Hkv, R)
    out_own, lse_own = np.stack([out for out, _ in merged[:n]]), np.stack([lse for _, lse in merged[:n]])
    return merge_states(out_shared, lse_shared, out_own, lse_own)


def run_decode(
    kernel: Any, q: Any, cache: Any, seq_ids: Any, scale: Any, kv_splits: Any, workers: Any, return_lse: Any
) -> Array | tuple[Array, Array]:
    """The door of paged_decode and cascade_decode: check once, run the kernel under the cache's lock,
    shape."""
    return_lse = check_bool(return_lse, "return_lse")
    q, seqs, scale, kv_splits, workers = check_paged(q, cache, seq_ids, scale, kv_splits, workers)
    out, lse = holding(cache.lock, decode_within_memory, kernel, q, cache, seqs, scale, kv_splits, workers)
    out = out.reshape(*q.shape[:-1], cache.value_dim)  # (N, Hq, L, Ev)
    out = out.astype(result_dtype(q, cache.k_pool), copy=False)
    lse = lse.reshape(q.shape[:-1])  # (N, Hq, L), in the compute dtype
    return (out, lse) if return_lse else out


def check_paged(
    q: Any, cache: Any, seq_ids: Any, scale: Any, kv_splits: Any, workers: Any
) -> tuple[np.ndarray, list[int], float, int | None, int]:
    """paged_decode's inputs checked, once: q (N, Hq, L, E) for the N sequences seq_ids of cache."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache; got {type(cache).__name__}")
    q = as_float_array(q, "q")
    if q.ndim != 4 or q.shape[-1] != cache.head_dim or q.shape[1] % cache.kv_heads:
        raise ValueError(
            f"q must be (N, Hq, L, {cache.head_dim}) (sequences, query heads, queries, head_dim) with Hq a multiple "
            f"of the cache's kv_heads={cache.kv_heads}; got shape {q.shape}"
        )
    seqs = cache.check_sequences(seq_ids, q.shape[0], "q")
    scale = check_scale(scale, cache.head_dim, compute_dtype(q, cache.k_pool))
    kv_splits = None if kv_splits is None else check_positive_int(kv_splits, "kv_splits")
    workers = check_positive_int(workers, "workers", default=cpu_cores())
    return q, seqs, scale, kv_splits, workers


def decode_within_memory(
    kernel: Any, q: np.ndarray, cache: PagedKVCache, seqs: list[int], scale: float, kv_splits: int | None, workers: int
) -> tuple[Array, Array]:
    """kernel(q, the pages of seqs, ...), run under the cache's lock, refused first (AttentionMemoryError,
    nothing allocated) if its peak does not fit in the memory available."""
    pages = cache.pages(seqs)  # the pools, the tables and the lengths, read once under the lock
    cascade = kernel is decode_cascade
    refuse_unless_fits(
        pages_bytes(q, pages, kv_splits, workers, cascade),
        "cascade_decode" if cascade else "paged_decode",
        f"{q.shape[0]:,} sequences of {q.shape[1] * q.shape[2]:,} query rows",
        "pass fewer sequences per call (the batch in parts), or fewer kv_splits",
    )
    return kernel(q, pages, scale, kv_splits, workers)


def paged_decode_bytes(
    q: np.ndarray, cache: PagedKVCache, seqs: list[int], kv_splits: int | None, workers: int, cascade: bool = False
) -> int:
    """Peak bytes that paged_decode (cascade=True: cascade_decode) allocates for q (N, Hq, L, E), which
    exists, for the sequences seqs of cache as they are now, an upper bound (_paged_kernel.pages_bytes says
    how)."""
    return pages_bytes(q, cache.pages(seqs), kv_splits, workers, cascade)
