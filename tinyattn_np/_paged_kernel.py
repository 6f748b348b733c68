"""The paged decode engine: a decode step of many sequences read through their block tables where the keys
lie, and the bytes it takes. paged_decode.py teaches paged decoding; paged_decode, cascade_decode and a
layer's step through a PagedKVCache (paged.py) run it here.

Like vLLM's forward_decode(query, key_cache, value_cache, block_tables, seq_lens), a kernel here reads Pages:
the pools, the block tables and the lengths, never the cache that manages them. A run of blocks that follow
one another in the pool is one matmul operand (page_blocks), and no sequence is ever copied into one array.
Each sequence is split into chunks of whole pages, every chunk of every sequence a work item for the workers,
and each sequence's chunks merged (the decode engine's attend_blocks and merge_parts, _decode_kernel.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ._checks import compute_dtype
from ._decode_kernel import (
    attend_blocks,
    attend_blocks_bytes,
    block_keys,
    default_kv_splits,
    merge_parts,
    merge_parts_bytes,
)
from ._parallel import one_blas_thread, run_items

Array = NDArray[np.floating]

__all__ = [
    "ChoosingLayer",
    "PageChunk",
    "Pages",
    "attend_page_chunks",
    "consecutive_runs",
    "decode_pages",
    "merge_per_query",
    "pages_bytes",
    "scaled_queries",
    "sequence_chunks",
    "shared_prefix",
]


class Pages(NamedTuple):
    """What a paged decode step reads: the pools of keys (kv_heads, num_blocks, block_size, head_dim) and of
    values (..., value_dim), and for each sequence its block table (its blocks in token order) and its length:
    token p of sequence i lies in block tables[i][p // block_size], slot p % block_size."""

    k_pool: Array
    v_pool: Array
    tables: list[tuple[int, ...]]
    lengths: list[int]

    @property
    def block_size(self) -> int:
        return int(self.k_pool.shape[2])


@runtime_checkable
class ChoosingLayer(Protocol):
    """A decoding layer (multihead.DecodingLayer) whose queries choose which of the held tokens they read (dsa.py's
    DSA layer), so it reads them itself: a cache's attend writes the new tokens first, hands the layer everything
    it holds as Pages (a KVCache's rows as pages of one block each), and commits once attend_pages returns
    y (B, H, T, Ev), the attention of each sequence's T new tokens (its last T) over all of its tokens. q is what
    the layer's split_heads gave (for a PagedKVCache, its rows joined by paged.join_rows); the cache never reads
    it."""

    def attend_pages(self, q: Any, pages: Pages) -> Array: ...


class PageChunk(NamedTuple):
    """One work item of a paged decode step: the query matrix number `query` against the first `keys`
    token slots of `pages` (blocks of the pool, in token order)."""

    query: int
    pages: tuple[int, ...]
    keys: int


def decode_pages(q: np.ndarray, pages: Pages, scale: float, kv_splits: int | None, workers: int) -> tuple[Array, Array]:
    """paged_decode's work on checked inputs: q (N, Hq, L, E), row i against sequence i of pages -> out
    (N, Hkv, G·L, Ev) and lse (N, Hkv, G·L) in the compute dtype. kv_splits None: default_kv_splits of each
    sequence."""
    # 1) each sequence's query matrix: its G·L query rows of each kv head stacked, the scale folded in once
    q_s = scaled_queries(q, pages, scale)  # (N, Hkv, G·L, E)
    if q_s.shape[0] == 0:  # no sequence: nothing to read
        return q_s.copy(), q_s[..., 0].copy()
    # 2) each sequence's pages as chunks, the work items; a sequence with no token has none
    chunks = []
    for i, (table, length) in enumerate(zip(pages.tables, pages.lengths, strict=True)):
        splits = kv_splits or default_kv_splits(length, workers)
        chunks += sequence_chunks(i, table, length, pages.block_size, splits)
    # 3) every chunk against its pages in place, then one merge per sequence
    queries = list(q_s)
    merged = merge_per_query(
        attend_page_chunks(queries, pages, chunks, workers), chunks, queries, pages.v_pool.shape[-1]
    )
    return np.stack([out for out, _ in merged]), np.stack([lse for _, lse in merged])


def scaled_queries(q: np.ndarray, pages: Pages, scale: float) -> Array:
    """q (N, Hq, L, E) as each sequence's query matrix, the G = Hq / Hkv query heads that read a kv head
    stacked (query head h reads kv head h // G: neighbours, so a reshape suffices) and the scale folded in
    once: (N, Hkv, G·L, E) in the compute dtype."""
    n, hq, n_q, e = q.shape
    kv_heads = pages.k_pool.shape[0]
    rows = hq // kv_heads * n_q
    return np.multiply(q.reshape(n, kv_heads, rows, e), scale, dtype=compute_dtype(q, pages.k_pool))


def sequence_chunks(query: int, pages: Sequence[int], keys: int, page_size: int, splits: int) -> list[PageChunk]:
    """A sequence's `keys` keys in `pages` as min(splits, pages) chunks of whole pages, in token order."""
    n_pages = -(-keys // page_size)  # pages that hold a key
    if n_pages == 0:
        return []
    splits = min(splits, n_pages)
    bounds = [n_pages * i // splits for i in range(splits + 1)]  # chunk i: pages bounds[i] .. bounds[i + 1] - 1
    return [
        PageChunk(query, tuple(pages[start:stop]), min(keys, stop * page_size) - start * page_size)
        for start, stop in zip(bounds, bounds[1:], strict=False)
    ]


def attend_page_chunks(
    queries: list[Array], pages: Pages, chunks: list[PageChunk], workers: int
) -> list[tuple[Array, Array]]:
    """(out (Hkv, R, Ev), lse (Hkv, R)) of every chunk, its query matrix queries[chunk.query] (Hkv, R, E)
    already scaled, computed by attend_blocks on the chunks' pages in place, the chunks spread over the
    workers."""
    results: list[tuple[Array, Array]] = [(queries[0], queries[0])] * len(chunks)
    kv_heads, head_dim, value_dim = pages.k_pool.shape[0], pages.k_pool.shape[-1], pages.v_pool.shape[-1]

    def run(i: int) -> None:
        q_s = queries[chunks[i].query]
        converted = 0 if pages.k_pool.dtype == q_s.dtype else kv_heads * (head_dim + value_dim)  # float16
        blocks = page_blocks(pages, chunks[i], block_keys(q_s.shape[0] * q_s.shape[1], converted))
        results[i] = attend_blocks(q_s, blocks, value_dim)

    longest_first = sorted(range(len(chunks)), key=lambda i: -chunks[i].keys)  # the workers finish together
    if len(chunks) <= 1:  # one chunk: BLAS may use its own threads on it
        for i in longest_first:
            run(i)
    else:  # the chunks are the parallelism; chosen without the workers, so any number gives the same bits
        with one_blas_thread():
            run_items(run, longest_first, min(workers, len(chunks)))
    return results


def page_blocks(pages: Pages, chunk: PageChunk, block_k: int) -> Iterator[list[tuple[Array, Array]]]:
    """The keys and values of a chunk as blocks of about block_k keys (whole pages), each a list of pieces
    (k (Hkv, n, E), v (Hkv, n, Ev)): one per run of consecutive pages, a view of the pool, never a copy."""
    k_pool, v_pool = pages.k_pool, pages.v_pool  # (Hkv, blocks, block_size, E or Ev)
    heads, size, dim, dim_v = k_pool.shape[0], pages.block_size, k_pool.shape[-1], v_pool.shape[-1]
    per_block = max(1, block_k // size)  # pages per block: the block structure does not depend on the layout
    for first in range(0, len(chunk.pages), per_block):
        keys_left = chunk.keys - first * size  # the last page of the chunk may be partly filled
        pieces = []
        for start, count in consecutive_runs(chunk.pages[first : first + per_block]):
            n = min(count * size, keys_left)
            k = k_pool[:, start : start + count].reshape(heads, count * size, dim)[:, :n]  # (Hkv, n, E), a view
            v = v_pool[:, start : start + count].reshape(heads, count * size, dim_v)[:, :n]  # (Hkv, n, Ev), a view
            pieces.append((k, v))
            keys_left -= n
        yield pieces


def consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive pages, in order: [7, 8, 9, 3, 4] -> [(7, 3), (3, 2)]."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def merge_per_query(
    parts: list[tuple[Array, Array]], chunks: list[PageChunk], queries: list[Array], ev: int
) -> list[tuple[Array, Array]]:
    """Each query matrix's chunks merged by merge_parts, in chunk order: a list of (out (Hkv, R, Ev), lse
    (Hkv, R)). A query matrix without chunks (a sequence with no token) gets out 0 and lse -inf."""
    mine: dict[int, list[tuple[Array, Array]]] = {}
    for part, chunk in zip(parts, chunks, strict=True):
        mine.setdefault(chunk.query, []).append(part)
    merged = []
    for index, q_s in enumerate(queries):
        if index in mine:
            merged.append(merge_parts([out for out, _ in mine[index]], [lse for _, lse in mine[index]]))
        else:
            merged.append((np.zeros((*q_s.shape[:-1], ev), q_s.dtype), np.full(q_s.shape[:-1], -np.inf, q_s.dtype)))
    return merged


def shared_prefix(tables: Sequence[Sequence[int]], lengths: list[int], page_size: int) -> tuple[int, int]:
    """(pages, keys) that every sequence shares: the leading blocks that all the tables hold at the same
    place. Keys: those pages' slots, or the sequences' common length if the last shared block is partly
    filled (a shared block is never written, so every sequence then ends in it)."""
    pages = 0
    while all(len(table) > pages for table in tables) and len({table[pages] for table in tables}) == 1:
        pages += 1
    return pages, min(min(lengths), pages * page_size)


# ---------------------------------------------------------------------------------------------------
# the memory a step takes, known before it allocates anything


def pages_bytes(q: np.ndarray, pages: Pages, kv_splits: int | None, workers: int, cascade: bool = False) -> int:
    """Peak bytes that decode_pages (cascade=True: paged_decode.decode_cascade) allocates for q (N, Hq, L, E),
    which exists, an upper bound in _decode_kernel.decode_bytes' terms. R = G·L query rows per sequence and kv
    head, Ev the pool's value_dim, c bytes of the compute dtype, C chunks in all (a shared prefix's chunks
    have N·R rows):

        q_s       N·Hkv·R·E·c              the scaled queries, held to the end
        parts     Σ_chunks Hkv·rows·(Ev+1)·c  each chunk's out and lse, held until its sequence's merge
        workers   min(workers, C) attend_blocks at once, each on a block of whole pages
        merged    2·N·Hkv·R·(Ev+1)·c       each sequence's merged result, then all of them stacked
        merge     one merge_parts at a time (the sequence with the most chunks)
        cascade   the queries stacked into one matrix, the prefix's merged result, merge_states' three
                  temporaries of out's size: 5·N·Hkv·R·(Ev+1)·c
        cast      the result cast back to float16, for a float16 q
    """
    size, hkv, ev = pages.block_size, pages.k_pool.shape[0], pages.v_pool.shape[-1]
    n, hq, n_q, e = q.shape
    rows, c = hq // hkv * n_q, compute_dtype(q, pages.k_pool).itemsize
    shared = 0  # keys every sequence shares, read once by cascade_decode
    if cascade and pages.tables:
        _, shared = shared_prefix(pages.tables, pages.lengths, size)
    # (query rows, chunks, pages of the longest chunk) of each query matrix: the sequences', then the prefix's
    queries = [(rows, *page_chunks(length - shared, size, kv_splits, workers)) for length in pages.lengths]
    if cascade:
        queries.append((n * rows, *page_chunks(shared, size, kv_splits, workers)))
    chunk_rows = sum(r * chunks for r, chunks, _ in queries)  # rows of all chunks' results together
    converted = 0 if pages.k_pool.dtype == compute_dtype(q, pages.k_pool) else e + ev  # float16: k and v, per key
    working = 0
    for r, chunks, n_pages in queries:  # the widest chunk, on every worker at once
        block = block_pages(hkv * r, hkv * converted, size, n_pages) * size
        working = max(working, attend_blocks_bytes(hkv, r, block, n_pages * size, ev, c, converted) * (chunks > 0))
    working *= min(workers, sum(chunks for _, chunks, _ in queries))
    merge = max((merge_parts_bytes(chunks, hkv * r, ev, c) for r, chunks, _ in queries if chunks), default=0)
    one = n * hkv * rows  # rows of the whole result
    needed = one * e * c + chunk_rows * hkv * (ev + 1) * c + 2 * one * (ev + 1) * c + max(working, merge)
    needed += 5 * one * (ev + 1) * c if cascade else 0
    return needed + (one * ev * q.dtype.itemsize if q.dtype.itemsize < c else 0)


def page_chunks(keys: int, page_size: int, kv_splits: int | None, workers: int) -> tuple[int, int]:
    """(chunks, pages of the longest) that sequence_chunks makes of `keys` keys."""
    pages = -(-keys // page_size)
    chunks = min(kv_splits or default_kv_splits(keys, workers), pages)
    return chunks, -(-pages // chunks) if chunks else 0


def block_pages(rows: int, converted: int, page_size: int, pages: int) -> int:
    """Pages in each block of a chunk of `pages` pages that page_blocks yields, for `rows` query rows."""
    return min(max(1, block_keys(rows, converted) // page_size), pages)
