"""The decode step of dsa.py's layer through a cache, its keys read where they lie: the indexer reads each
sequence's indexer keys page by page, and the attention gathers the latents it chose through the block table.
It imports no lesson: dsa.py's SparseHeads.attend_pages hands it the pages a cache gives (a PagedKVCache's
pools, tables and lengths, or a KVCache's rows, one page a row: _paged_kernel.Pages).

A cached token's key is [c_KV | k_rope | k_I]: its latent (latent_dim numbers), then its indexer key (d_I); the
value is the first r numbers. Sequence b holds lengths[b] tokens, its T new ones last, token p in block
tables[b][p // size], slot p % size; for its queries:

    chosen = the running top-k of I[t, s] over its indexer keys, a block of pages at a time      topk_over_pages
    rows   = tables[b][chosen // size] · size + chosen % size        each chosen token's row of the pool
    o_lat  = attention over those rows of the pool's latents, gathered (_sparse_kernel.attend_chosen)

which is sparse.py's sparse_decode over the sequences laid out as arrays (tests/test_sparse.py holds the two
equal), without a copy of any sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._checks import as_float_array
from ._paged_kernel import Pages, consecutive_runs
from ._sparse_kernel import (
    QUERY_BLOCK,
    SparseInputs,
    attend_chosen,
    keys_between_merges,
    refuse_topk_beyond_memory,
    topk_by_query_blocks,
)

__all__ = ["check_decode_arrays", "decode_chosen_pages", "pool_blocks", "pool_rows", "topk_over_pages"]

Array = np.ndarray


def check_decode_arrays(q_latent: Any, latents: Any, index_keys: Any, lengths: Any) -> tuple[Array, Array, Array]:
    """sparse_decode's cache, laid out as arrays: latents (B, max_tokens, ·) and index_keys (B, max_tokens, ·), one
    row a sequence, and lengths (B,) ints from L (the new tokens of q_latent (B, H, L, ·)) to max_tokens."""
    latents, index_keys = as_float_array(latents, "latents"), as_float_array(index_keys, "index_keys")
    lengths = np.asarray(lengths)
    B, _, L, _ = np.shape(q_latent)
    if latents.ndim != 3 or index_keys.ndim != 3 or latents.shape[:2] != index_keys.shape[:2] or len(latents) != B:
        raise ValueError(
            f"latents and index_keys must be (B={B}, max_tokens, ·), one row a sequence; got "
            f"{latents.shape} and {index_keys.shape}"
        )
    most = latents.shape[1]  # max_tokens
    if lengths.shape != (B,) or lengths.dtype.kind not in "iu" or np.any(lengths < L) or np.any(lengths > most):
        raise ValueError(
            f"lengths must be ({B},) ints in [{L}, {most}] (the L = {L} new tokens included, at most "
            f"max_tokens); got {lengths!r}"
        )
    return latents, index_keys, lengths


def decode_chosen_pages(
    q_latent: Array,
    q_index: Array,
    weights: Array,
    pages: Pages,
    topk: int,
    *,
    latent_dim: int,
    value_dim: int,
    scale: float,
    workers: int,
) -> tuple[Array, Array]:
    """The step of each sequence's T newest tokens over every token it holds: q_latent (B, H, T, latent_dim) the
    absorbed queries, q_index (B, H_I, T, d_I) and weights (B, T, H_I) the indexer's; pages of one kv head, its keys
    (1, num_blocks, size, latent_dim + d_I). -> o_lat (B, H, T, value_dim) and the chosen tokens (B, T, topk)."""
    pool = pages.k_pool[0]  # (num_blocks, size, latent_dim + d_I): a view
    block_k = keys_between_merges(topk)  # index_topk's default
    chosen = topk_over_pages(q_index, weights, pool[..., latent_dim:], pages, topk, block_k=block_k, workers=workers)
    latents = pool[..., :latent_dim].reshape(-1, latent_dim)  # (num_blocks · size, latent_dim): a view
    keys = np.broadcast_to(latents, (len(pages.tables), 1, *latents.shape))  # (B, 1, N, ·): every sequence's pool
    rows = pool_rows(chosen, pages.tables, pages.block_size)  # (B, T, topk)
    out, _ = attend_chosen(SparseInputs(q_latent, keys, keys[..., :value_dim], rows, scale), workers=workers)
    return out, chosen


def topk_over_pages(
    q_index: Array, weights: Array, index_pool: Array, pages: Pages, topk: int, *, block_k: int, workers: int
) -> Array:
    """index_topk for each sequence's T newest tokens over the indexer keys it holds, index_pool (num_blocks, size,
    d_I) read through its block table: query t of sequence b sees its tokens up to lengths[b] - T + t (bottom-right).
    -> (B, T, topk) token positions in order, -1 after them."""
    T = q_index.shape[2]
    refuse_topk_beyond_memory(q_index, topk, QUERY_BLOCK, block_k, workers)

    def last_of(b: int, rows: slice) -> Array:  # (R,): the last token each query sees
        return np.arange(rows.start, rows.stop) + pages.lengths[b] - T

    def blocks_of(b: int, seen: int) -> Iterator[tuple[int, list[Array]]]:
        return pool_blocks(index_pool, pages.tables[b], seen, block_k)

    return topk_by_query_blocks(q_index, weights, topk, last_of, blocks_of, block_q=QUERY_BLOCK, workers=workers)


def pool_blocks(pool: Array, table: Sequence[int], seen: int, block_k: int) -> Iterator[tuple[int, list[Array]]]:
    """Keys 0 .. seen - 1 of a sequence whose key p lies in pool[table[p // size], p % size] (pool (num_blocks,
    size, d)), in blocks of block_k keys: (k0, pieces), each piece the block's keys in a run of consecutive blocks
    of the pool (_paged_kernel.consecutive_runs), a view, never a copy."""
    size = pool.shape[1]
    for k0 in range(0, seen, block_k):
        k1 = min(k0 + block_k, seen)
        first = k0 // size  # the page that holds key k0
        pieces, at = [], first * size  # at: the key the run starts at
        for start, count in consecutive_runs(table[first : -(-k1 // size)]):
            run = pool[start : start + count].reshape(count * size, -1)  # (count · size, d): a view
            pieces.append(run[max(k0 - at, 0) : k1 - at])
            at += count * size
        yield k0, pieces


def pool_rows(chosen: Array, tables: Sequence[Sequence[int]], size: int) -> Array:
    """Each sequence's token positions (B, T, n) as rows of the pool laid out (num_blocks · size, ·): token p of
    sequence b is row tables[b][p // size] · size + p % size; -1 (no token) stays -1."""
    rows = np.empty_like(chosen)  # (B, T, n)
    for b, table in enumerate(tables):
        listed = np.maximum(chosen[b], 0)  # (T, n): -1 read as token 0, put back below
        rows[b] = np.where(chosen[b] >= 0, np.asarray(table, np.int64)[listed // size] * size + listed % size, -1)
    return rows
