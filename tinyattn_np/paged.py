"""The paged KV cache: keys and values in fixed-size blocks from one pool, a block table per sequence.

KVCache keeps one preallocated (batch, kv_heads, max_tokens, head_dim) array: every sequence of the batch
has the same length and reserves max_tokens slots from the start. A server holds many requests of
different and unknown lengths, and reserving each one's maximum wastes most of the memory (60-80% in the
systems the vLLM paper measured). PagedAttention (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention") manages the cache as an operating system manages
memory: one pool of blocks of `block_size` token slots, and for each sequence a block table, the list of
its blocks in token order. Token p of a sequence lives in

    block = table[p // block_size],   slot = p % block_size

A sequence takes a new block only when its last one is full, so at most block_size - 1 slots per sequence
are ever unused. Sequences may share blocks (parallel samples of one prompt, beam search): fork() copies
a block table, not the blocks, and each block counts the tables that hold it. A shared block is never
written: the first append to a shared, partly filled last block copies it first (copy-on-write), and a
block returns to the pool when its count falls to 0.

A decode step reads each sequence's keys and values through its block table, where they lie: the kernels
take what pages(seq_ids) gives, the pools, the tables and the lengths (paged_decode.py, next, teaches them).
Reading order (this file): PagedKVCache and its pool, then a layer's step through the pages
(PagedKVCache.attend, which MultiHeadAttention(x, cache=, seq_ids=) calls): the new tokens' attention over
the cached pages and over themselves, merged. A layer whose queries choose the tokens they read (dsa.py's)
reads the pages itself: the step writes the new tokens, hands the layer the pages, then commits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from ._atomic import Undo, holding, locked
from ._cache_buffers import (
    CopiedWithoutLock,
    KeysAndValues,
    check_cache_dtype,
    check_value_prefix,
    check_values_are_prefix,
    read_only_view,
    refuse_cache_beyond_memory,
)
from ._checks import check_bool, check_count, check_positive_int
from ._guard import refuse_unless_fits
from ._paged_kernel import ChoosingLayer, Pages, decode_pages, pages_bytes
from ._parallel import cpu_cores
from .blockmask import check_band
from .multihead import DecodingLayer, check_decoding_layer
from .splitkv import merge_chunks

Array = NDArray[np.floating]
R = TypeVar("R")

__all__ = ["PagedKVCache", "PoolExhaustedError"]


class PagedKVCache(CopiedWithoutLock, KeysAndValues):
    """A pool of `num_blocks` blocks of `block_size` token slots, each holding keys and values of
    `kv_heads` heads of `head_dim`, and one block table per sequence.

    The pool is preallocated once, keys and values each of shape (kv_heads, num_blocks, block_size,
    head_dim): a kv head's blocks are neighbours in memory, so blocks that follow one another in the pool
    read as one (keys, head_dim) matrix, which a matmul takes in place. (vLLM puts the block first; on a
    CPU, with NumPy, a run of consecutive blocks read in one matmul is what makes a decode step fast.)
    value_prefix=r: each token's value is the first r numbers of its key (multi-head latent attention's
    latent, latent.py), so the pool holds the keys only and v_pool is a view of their first r numbers
    (kv_heads, num_blocks, block_size, r); append takes v equal to k[..., :r], and paged_decode reads the
    latent once and returns r numbers a query.

        seq = cache.add_sequence()        a new, empty sequence; its id
        cache.append(seq, k, v)           k (kv_heads, T_new, head_dim), v (..., value_dim): T_new tokens at its end
        child = cache.fork(seq)           a sequence sharing every block of seq (copy-on-write)
        cache.free(seq)                   its blocks return to the pool when no other sequence holds them

    An append the pool cannot hold raises PoolExhaustedError (a MemoryError) naming the sequence, the
    blocks it needs and the blocks free, and changes nothing, for that sequence or any other.
    A sequence takes the block right after its last one when that block is free, and otherwise one far from
    the others, in the longest run of free blocks: sequences that grow together still lie in long runs of
    consecutive blocks, which paged_decode reads in one matmul each.

    All or nothing: the tables and counts are one PoolState. Every change (add_sequence, append,
    append_batch, fork, free, attend) prepares a new one on a draft, writes the new tokens only into slots
    that no table shows yet, saving what was there, and commits with one assignment; an exception before
    it, a Ctrl-C at any bytecode included, puts the slots back (_atomic.py). k_pool and v_pool are views
    that cannot be made writable.

    Threads: every change is atomic. Each holds `cache.lock` (a re-entrant lock) from its checks to its
    commit, so appends from several threads all land, each token's k and v in the same slot, and one that
    does not fit is refused whole. paged_decode and cascade_decode hold the lock while they read, so no
    change lands under a read. To read several things as one consistent state while other threads change
    the cache, hold the lock.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any = np.float32,
        *,
        value_prefix: int | None = None,
    ):
        self.num_blocks = check_positive_int(num_blocks, "num_blocks")
        self.block_size = check_positive_int(block_size, "block_size")
        self.kv_heads = check_positive_int(kv_heads, "kv_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = check_cache_dtype(dtype)
        self.value_prefix = check_value_prefix(value_prefix, self.head_dim)
        shape = (self.kv_heads, self.num_blocks, self.block_size, self.head_dim)
        counts = 2 * self.num_blocks * np.dtype(np.int64).itemsize  # refs and filled
        refuse_cache_beyond_memory(
            "PagedKVCache", shape, self.dtype, "lower num_blocks", extra=counts, value_prefix=self.value_prefix
        )
        self._k = np.zeros(shape, self.dtype)  # (Hkv, blocks, block_size, E): allocated once, never grown
        # (Hkv, blocks, block_size, Ev), or None: the values are the keys' first value_prefix numbers (_values)
        self._v = np.zeros(shape, self.dtype) if self.value_prefix is None else None
        no_blocks = np.zeros(self.num_blocks, np.int64)  # (num_blocks,)
        self._state = PoolState({}, {}, no_blocks, no_blocks.copy(), used=0, next_id=0)  # changed only by _commit
        self.lock = threading.RLock()

    def __repr__(self) -> str:
        prefix = "" if self.value_prefix is None else f", value_prefix={self.value_prefix}"
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}{prefix}; {len(self._state.tables)} sequences, "
            f"{self.blocks_used} blocks used)"
        )

    # --- what the pool holds -------------------------------------------------------------------------

    @property
    def k_pool(self) -> Array:
        """The keys of every block, (kv_heads, num_blocks, block_size, head_dim): a view of the pool that
        cannot be made writable (a write here would change every sequence holding the block)."""
        return read_only_view(self._k)

    @property
    def v_pool(self) -> Array:
        """The values of every block, (kv_heads, num_blocks, block_size, value_dim): a read-only view (with
        value_prefix, of the keys' first value_prefix numbers: the same memory as k_pool)."""
        return read_only_view(self._values)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of block_size tokens, every kv head (with value_prefix, the
        keys alone: the values are part of them)."""
        stored = self.head_dim + (0 if self._v is None else self.head_dim)  # numbers a token and kv head
        return self.kv_heads * self.block_size * stored * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole preallocated pool (keys and values, or keys alone): num_blocks · block_bytes."""
        return int(self._k.nbytes + (0 if self._v is None else self._v.nbytes))

    @property
    def blocks_used(self) -> int:
        """Blocks that at least one sequence holds (a shared block counts once)."""
        return self._state.used

    @property
    def blocks_free(self) -> int:
        """Blocks in the pool that no sequence holds."""
        return self.num_blocks - self._state.used

    @property
    def bytes_used(self) -> int:
        """Bytes of the blocks in use: blocks_used · block_bytes."""
        return self.blocks_used * self.block_bytes

    @property
    def slots_wasted(self) -> int:
        """Slots of the blocks in use that hold no token: at most block_size - 1 per sequence, and a slot
        of a shared block counts once."""
        state = self._state
        return state.used * self.block_size - int(state.filled.sum())

    @property
    def ref_counts(self) -> NDArray[np.int64]:
        """(num_blocks,) how many block tables hold each block (0: free), a copy."""
        return self._state.refs.copy()

    @property
    def sequences(self) -> tuple[int, ...]:
        """The ids of the sequences in the cache, oldest first."""
        return tuple(self._state.tables)

    def length(self, seq: int) -> int:
        """Tokens in sequence seq."""
        state = self._state
        return state.lengths[self.check_seq(seq, state)]

    def block_table(self, seq: int) -> tuple[int, ...]:
        """Sequence seq's blocks, in token order: token p is in block_table[p // block_size]."""
        state = self._state
        return state.tables[self.check_seq(seq, state)]

    @locked
    def gather(self, seq: int) -> tuple[Array, Array]:
        """Sequence seq's keys (kv_heads, tokens, head_dim) and values (kv_heads, tokens, value_dim) laid out
        contiguously: new arrays (with value_prefix, the values a view of the new keys' first numbers).

        A copy, for checking and for the reference path; paged_decode reads the blocks where they are."""
        state = self._state
        seq = self.check_seq(seq, state)
        table, length = list(state.tables[seq]), state.lengths[seq]
        refuse_unless_fits(
            len(table) * self.block_bytes,
            "PagedKVCache.gather",
            f"sequence {seq}'s {len(table):,} blocks copied",
            "read the sequence through paged_decode, which reads its blocks where they lie",
        )
        slots = len(table) * self.block_size
        keys = self._k[:, table].reshape(self.kv_heads, slots, self.head_dim)[:, :length]  # (Hkv, T, E)
        if self._v is None:
            return keys, keys[..., : self.value_prefix]  # (Hkv, T, Ev): the latent, copied once
        return keys, self._v[:, table].reshape(self.kv_heads, slots, self.head_dim)[:, :length]  # (Hkv, T, Ev)

    def check_seq(self, seq: Any, state: PoolState | None = None) -> int:
        """seq as the int id of a sequence in this cache (in `state`, default the cache's own), else a
        TypeError or ValueError that names it."""
        state = self._state if state is None else state
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise TypeError(f"seq must be a sequence id (an int); got {seq!r} ({type(seq).__name__})")
        if int(seq) not in state.tables:
            raise ValueError(f"sequence {seq} is not in this cache (its sequences: {list(state.tables)})")
        return int(seq)

    def check_sequences(self, seq_ids: Any, n: int, name: str = "x") -> list[int]:
        """seq_ids as a list of n ids of sequences in this cache, one for each row of `name` (its first axis)."""
        if not isinstance(seq_ids, Iterable) or isinstance(seq_ids, (str, bytes)):
            raise TypeError(f"seq_ids must be a sequence of ids, one per row of {name}; got {type(seq_ids).__name__}")
        state = self._state
        seqs = [self.check_seq(seq, state) for seq in seq_ids]
        if len(seqs) != n:
            raise ValueError(f"{name} has {n} sequences (its first axis) but seq_ids names {len(seqs)}")
        return seqs

    def pages(self, seq_ids: Sequence[int]) -> Pages:
        """What a paged kernel reads for sequences seq_ids (checked ids): the pools (k_pool, v_pool, read-only
        views) and each sequence's block table and length, all of one state."""
        return self._pages(self._state, seq_ids)

    def _pages(self, state: PoolState, seq_ids: Sequence[int]) -> Pages:
        """pages(seq_ids) as `state` has them (the cache's own, or one about to be committed)."""
        tables, lengths = [state.tables[seq] for seq in seq_ids], [state.lengths[seq] for seq in seq_ids]
        return Pages(self.k_pool, self.v_pool, tables, lengths)

    # --- changes: each prepares a new PoolState, then commits it with one assignment -------------------

    @locked
    def add_sequence(self) -> int:
        """A new sequence with no tokens and no blocks; its id (ids are never reused)."""
        state = self._state
        seq = state.next_id
        tables, lengths = {**state.tables, seq: ()}, {**state.lengths, seq: 0}
        self._commit(replace(state, tables=tables, lengths=lengths, next_id=seq + 1))
        return seq

    @locked
    def fork(self, seq: int) -> int:
        """A new sequence with seq's tokens, sharing every one of its blocks (no copy); its id.

        Parallel sampling and beam search: n continuations of one prompt hold the prompt's blocks once.
        A shared block is copied only when one of its holders writes to it (the partly filled last block).
        """
        new = self._state.draft()
        seq = self.check_seq(seq, new)
        child, table = new.next_id, new.tables[seq]
        new.tables[child], new.lengths[child], new.next_id = table, new.lengths[seq], child + 1
        new.refs[list(table)] += 1  # a table holds each of its blocks once
        self._commit(new)
        return child

    @locked
    def free(self, seq: int) -> None:
        """Remove sequence seq; each of its blocks returns to the pool if no other sequence holds it."""
        new = self._state.draft()
        seq = self.check_seq(seq, new)
        table = list(new.tables.pop(seq))
        del new.lengths[seq]
        new.refs[table] -= 1
        emptied = [block for block in table if new.refs[block] == 0]
        new.filled[emptied] = 0
        new.used -= len(emptied)
        self._commit(new)  # its blocks return to the pool here, or not at all

    def append(self, seq: int, k: Array, v: Array) -> None:
        """Add T_new tokens at the end of sequence seq: k (kv_heads, T_new, head_dim) and v (kv_heads, T_new,
        value_dim), already rotated by RoPE, of the cache's dtype (with value_prefix, v = k[..., :value_prefix]).
        All or nothing: see append_batch."""
        k, v = self._check_kv(k, "k", 3), self._check_kv(v, "v", 3)
        self.append_batch([seq], k[None], v[None])

    @locked
    def append_batch(self, seq_ids: Sequence[int], k: Array, v: Array) -> None:
        """Add T_new tokens to each of the N sequences seq_ids: k (N, kv_heads, T_new, head_dim) and v (N, kv_heads,
        T_new, value_dim); with value_prefix, v must be k[..., :value_prefix], and only k is written.

        All or nothing, and atomic under threads: the checks, the count of blocks needed and every write
        run under `self.lock`. If the pool has fewer free blocks than the appends need in all (blocks_needed:
        a new block when a last block is full, a copy of a shared last block), PoolExhaustedError names the
        sequences, the blocks each needs and the blocks free, and no sequence changes. An exception while
        it writes (a Ctrl-C) puts back every slot it wrote, and no sequence changes either.
        """
        self._append_batch(seq_ids, k, v)

    def _append_batch(self, seq_ids: Any, k: Any, v: Any, read: Callable[[Pages], R] | None = None) -> R | None:
        """append_batch, under the lock. read(pages), if given, runs on the sequences' pages with the new tokens
        written, before the commit (a ChoosingLayer's attention), and what it returns is returned: an exception
        in it leaves the cache as it was."""
        k, v = self._check_kv(k, "k", 4), self._check_kv(v, "v", 4)
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k and v must have the same sequences and tokens; got shapes {k.shape} and {v.shape}")
        t_new = check_count(k.shape[2], "T_new")
        check_values_are_prefix(k, v, self.value_prefix)
        state = self._state
        seqs = check_once(self.check_sequences(seq_ids, k.shape[0], "k"), seq_ids)
        needed = self._blocks_needed(state, seqs, t_new)
        if sum(needed) > self.num_blocks - state.used:
            raise PoolExhaustedError(self._refusal(seqs, needed, t_new))
        new, writes = self._plan(state, seqs, k, v)
        return self._commit(new, writes, None if read is None else lambda: read(self._pages(new, seqs)))

    def _refusal(self, seqs: list[int], needed: list[int], t_new: int) -> str:
        """What a refused append says: the sequences, the blocks each needs, the blocks free."""
        free = f"{self.blocks_free} of {self.num_blocks} are free; nothing was changed"
        if len(seqs) == 1:
            it_needs = f"for sequence {seqs[0]}: it needs {needed[0]} new blocks"
        else:
            each = ", ".join(f"sequence {seq}: {n}" for seq, n in zip(seqs, needed, strict=True) if n)
            it_needs = f"for each of sequences {seqs}: they need {sum(needed)} new blocks ({each})"
        return (
            f"the pool cannot hold {t_new} more tokens {it_needs} and {free} (free a sequence, or make a larger pool)"
        )

    def _check_kv(self, x: Any, name: str, ndim: int) -> np.ndarray:
        """x must be an ndarray ([N,] kv_heads, T_new, width) of this cache's dtype: k head_dim wide, v value_dim."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array; got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"{name} must have this cache's dtype {self.dtype}; got {x.dtype}")
        lead = "N, " if ndim == 4 else ""
        width, what = (self.head_dim, "head_dim") if name == "k" else (self.value_dim, "value_dim")
        if x.ndim != ndim or (x.shape[-3], x.shape[-1]) != (self.kv_heads, width):
            raise ValueError(
                f"{name} must have shape ({lead}{self.kv_heads}, T_new, {width}) "
                f"({lead}kv_heads, T_new, {what}); got {x.shape}"
            )
        return x

    def blocks_needed(self, seq: int | Sequence[int], t_new: int) -> int:
        """New blocks that t_new more tokens take: for sequence seq, or in all for a list of sequences that
        each get t_new tokens together (append_batch takes exactly this many). A scheduler asks this before
        a step, to admit or hold requests.

        A sequence needs the blocks past its last block's free slots, and one for a copy of its last block
        if that is shared and partly filled (it will be written). Fork siblings appended together that share
        such a block: each but the last copies it, and the last, then its only holder, writes in place."""
        t_new = check_count(t_new, "t_new")
        state = self._state
        if isinstance(seq, Iterable) and not isinstance(seq, (str, bytes)):
            seqs = check_once([self.check_seq(one, state) for one in seq], seq)
        else:
            seqs = [self.check_seq(seq, state)]
        return sum(self._blocks_needed(state, seqs, t_new))

    def _blocks_needed(self, state: PoolState, seqs: list[int], t_new: int) -> list[int]:
        """The new blocks each of seqs takes when they get t_new tokens each, in this order (as _plan
        writes them): a shared last block is copied by its holders while another still holds it."""
        holders: dict[int, int] = {}  # a shared, partly filled last block -> tables holding it, as the batch goes
        needed = []
        for seq in seqs:
            table, length = state.tables[seq], state.lengths[seq]
            room = len(table) * self.block_size - length  # free slots in the last block
            copy = False
            if room > 0 and t_new > 0:
                last = table[-1]
                holders[last] = holders.get(last, int(state.refs[last]))
                copy = holders[last] > 1  # another table still holds it: this one copies it
                holders[last] -= copy
            needed.append(-(-max(0, t_new - room) // self.block_size) + int(copy))
        return needed

    def _plan(self, state: PoolState, seqs: list[int], k: Array, v: Array) -> tuple[PoolState, list[PoolWrite]]:
        """The state once k[i] (kv_heads, T_new, head_dim) and v[i] (..., value_dim) are at the end of sequence
        seqs[i], and the writes into the pool that put them there, in order. Nothing of the cache changes here;
        the pool has the blocks (checked by _blocks_needed)."""
        new, writes, size, t_new = state.draft(), [], self.block_size, k.shape[2]
        for row, seq in enumerate(seqs):
            table, length, written = list(new.tables[seq]), new.lengths[seq], 0
            while written < t_new:
                slot = length % size
                if slot == 0:  # the last block is full (or there is none): take a new one
                    table.append(self._take_block(new, after=table[-1] if table else None))
                elif new.refs[table[-1]] > 1:  # shared: copy it before the first write (copy-on-write)
                    shared = table[-1]
                    table[-1] = self._take_block(new, after=table[-2] if len(table) > 1 else None)
                    index = (slice(None), table[-1], slice(0, slot))  # its filled slots, read when written
                    writes.append(PoolWrite(index, self._k[:, shared, :slot], self._values[:, shared, :slot]))
                    new.refs[shared] -= 1  # still held by the others
                block, n = table[-1], min(size - slot, t_new - written)
                index = (slice(None), block, slice(slot, slot + n))
                writes.append(PoolWrite(index, k[row, :, written : written + n], v[row, :, written : written + n]))
                new.filled[block] = slot + n
                length, written = length + n, written + n
            new.tables[seq], new.lengths[seq] = tuple(table), length
        return new, writes

    def _commit(
        self, new: PoolState, writes: Sequence[PoolWrite] = (), before_commit: Callable[[], R] | None = None
    ) -> R | None:
        """Write the pool as `writes` say, each into slots that no table shows yet, saving what was there;
        run before_commit() (a read of the written slots through new's tables), if given; then make `new` the
        cache's state with one assignment, and return what before_commit returned. An exception before that
        assignment puts every slot back: the pool and the state stay as they were."""
        new.refs.flags.writeable = new.filled.flags.writeable = False  # committed: never changed in place
        undo = Undo()
        try:
            for where, keys, values in writes:
                undo.write(self._k, where, keys)  # (Hkv, n, E)
                if self._v is not None:  # else the values are the keys' prefix, written with them
                    undo.write(self._v, where, values)  # (Hkv, n, Ev)
            result = None if before_commit is None else before_commit()
            self._state = new  # the commit
        except BaseException:
            if self._state is not new:
                undo.undo()
            raise
        return result

    def _take_block(self, state: PoolState, after: int | None) -> int:
        """A free block, held once in the draft `state`: the one right after `after` if it is free; else, from
        the longest run of free blocks, its first block if it starts the pool, or its middle if it follows a
        block in use (that block's sequence may want to grow into it). Runs stay long: a sequence grows into
        the blocks after its own, and sequences that start or move meanwhile land far from each other."""
        if after is not None and after + 1 < self.num_blocks and state.refs[after + 1] == 0:
            block = after + 1
        else:
            free = np.concatenate([[0], state.refs == 0, [0]]).astype(np.int8)  # (num_blocks + 2,)
            edges = np.flatnonzero(np.diff(free))  # each run of free blocks: its start, then its stop
            starts, stops = edges[0::2], edges[1::2]
            longest = int(np.argmax(stops - starts))
            start, stop = int(starts[longest]), int(stops[longest])
            block = start if start == 0 else (start + stop - 1) // 2
        state.refs[block] = 1
        state.used += 1
        return block

    # --- a layer's step through the pages: MultiHeadAttention(x, cache=self, seq_ids=) ----------------

    def attend(self, layer: DecodingLayer, x: Array, *, fused: bool = True, seq_ids: Any = None) -> Array:
        """x (B, T, d_model), row b the next T tokens of sequence seq_ids[b], through layer's heads
        -> y (B, H, T, Ev), the heads' attention before layer's output projection; x's k and v appended
        to those sequences, all or nothing (PoolExhaustedError, or an interrupt, changes nothing).

        layer: a MultiHeadAttention, or any DecodingLayer (multihead.py). Each row's tokens sit at its own
        sequence's positions, length(seq) onwards (RoPE turns them by those); the lengths may differ.
        fused=True reads the cached pages in place (attend_new_and_cached); fused=False lays each sequence out
        contiguously (gather) for the layer's reference attention. A layer that chooses which tokens its queries
        read (_paged_kernel.ChoosingLayer) reads every sequence's pages itself, its new tokens written first, and
        fused does not apply. The lock is held from reading the lengths to the appends, which come last (they
        commit after the choosing layer's read): the one change this call makes.
        """
        check_decoding_layer(layer)
        x = layer.check_cache(self, x)  # (B, T, d_model) in layer's dtype, once this pool fits it
        fused = check_bool(fused, "fused")
        return holding(self.lock, self._attend, layer, x, seq_ids, fused)

    def _attend(self, layer: DecodingLayer, x: Array, seq_ids: Any, fused: bool) -> Array:
        """attend under the lock: the lengths read here are the ones the appends continue."""
        B, T = x.shape[:2]
        seqs = check_once(self.check_sequences(seq_ids, B), seq_ids)
        needed = self._blocks_needed(self._state, seqs, T)
        if sum(needed) > self.blocks_free:  # refused before any work
            raise PoolExhaustedError(self._refusal(seqs, needed, T))
        # 1) q, k, v of each row, turned by RoPE at its own sequence's positions
        starts = [self._state.lengths[seq] for seq in seqs]
        rows = [layer.split_heads(x[b : b + 1], np.arange(s, s + T)) for b, s in enumerate(starts)]
        q, k, v = (join_rows(parts) for parts in zip(*rows, strict=True))  # (B, H or Hkv, T, d)
        if isinstance(layer, ChoosingLayer):  # it reads the sequences itself: the new tokens written, then read
            return cast(Array, self._append_batch(seqs, k, v, read=lambda pages: layer.attend_pages(q, pages)))
        # 2) their attention over the cached keys and their own, then 3) the append: all or nothing
        if fused:
            y = attend_new_and_cached(layer, q, k, v, self.pages(seqs))
        else:
            y = attend_gathered(layer, q, k, v, self, seqs)
        self.append_batch(seqs, k, v)
        return y


class PoolExhaustedError(MemoryError):
    """An append needs more free blocks than the pool has. Nothing was changed, for any sequence."""


@dataclass
class PoolState:
    """What a PagedKVCache knows besides the bytes in its pool. A change prepares a new one on a draft and
    commits it with one assignment; a committed state is never changed in place, so whoever read it holds
    one consistent state."""

    tables: dict[int, tuple[int, ...]]  # sequence id -> its blocks, in token order
    lengths: dict[int, int]  # sequence id -> its tokens
    refs: NDArray[np.int64]  # (num_blocks,) block tables holding each block; 0 = free
    filled: NDArray[np.int64]  # (num_blocks,) slots of each block that hold a token
    used: int  # blocks that some table holds (those with a count above 0)
    next_id: int  # the id the next new sequence gets: ids are never reused

    def draft(self) -> PoolState:
        """A copy to prepare a change on: its dicts and arrays are new, the tuples of blocks shared."""
        return PoolState(
            dict(self.tables), dict(self.lengths), self.refs.copy(), self.filled.copy(), self.used, self.next_id
        )


class PoolWrite(NamedTuple):
    """One write of an append into the pool: keys (kv_heads, n, head_dim) and values (kv_heads, n, value_dim) into
    pool[where], where (all kv heads, a block, n slots); a pool without values of its own writes the keys only."""

    where: tuple[slice, int, slice]
    keys: Array
    values: Array


def join_rows(parts: Sequence[Any]) -> Any:
    """The rows' q (or k, or v), each (1, ...), joined along the batch axis: arrays, or a layer's NamedTuple of
    arrays (dsa.py's queries), field by field."""
    if isinstance(parts[0], tuple):
        return type(parts[0])(*(np.concatenate(field, axis=0) for field in zip(*parts, strict=True)))
    return np.concatenate(parts, axis=0)


def check_once(seqs: list[int], seq_ids: Any) -> list[int]:
    """seqs, if no sequence comes twice (two appends to one sequence in one step would be in no order)."""
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"seq_ids must name each sequence once ({len(seqs)} different sequences); got {seq_ids}")
    return seqs


# ---------------------------------------------------------------------------------------------------
# a layer's step: the new tokens against the cached pages and against themselves


def attend_new_and_cached(layer: DecodingLayer, q: Array, k: Array, v: Array, pages: Pages) -> Array:
    """The fused path of PagedKVCache.attend: q (B, H, T, E) of the new tokens, k, v (B, Hkv, T, E or Ev) ->
    y (B, H, T, Ev), before the new k and v are appended; pages: the B sequences' pages as they are.

    Every cached key is older than every new token, so the new queries see all of them; among themselves
    they are causal. The two parts are over disjoint keys and merge exactly:
        out_c, lse_c = paged attention(q, the cached pages)        read in place (_paged_kernel.decode_pages)
        out_n, lse_n = layer.attend_heads(q, k_new, v_new, causal)  flash attention
        y = merge(out_c, lse_c, out_n, lse_n)                       (merge_chunks: merge_states for N parts)
    A prefill is T tokens into empty sequences (no cached part); a decode step is T = 1.
    """
    B, H, T, _ = q.shape
    workers = cpu_cores()
    refuse_unless_fits(
        pages_bytes(q, pages, None, workers),
        "PagedKVCache.attend",
        f"{B:,} sequences of {H * T:,} query rows against their cached pages",
        "pass fewer sequences or tokens per call",
    )
    out_c, lse_c = decode_pages(q, pages, layer.softmax_scale, None, workers)  # (B, Hkv, G·T, Ev)
    out_n, lse_n = layer.attend_heads(q, k, v, check_band(True, None, T, T), True)  # (B, H, T, Ev), (B, H, T)
    out_c, lse_c = out_c.reshape(out_n.shape), lse_c.reshape(lse_n.shape)  # (B, H, T, Ev): the same row order
    y, _ = merge_chunks([out_c, out_n], [lse_c, lse_n])  # disjoint keys: the attention over both
    return y.astype(q.dtype, copy=False)


def attend_gathered(layer: DecodingLayer, q: Array, k: Array, v: Array, cache: PagedKVCache, seqs: list[int]) -> Array:
    """The reference path of PagedKVCache.attend: each sequence's cached keys laid out contiguously, then the
    new ones, and the layer's reference attention with the causal band (bottom-right: new token i sees
    start + i + 1 keys)."""
    y = []
    for b, seq in enumerate(seqs):
        k_old, v_old = cache.gather(seq)  # (Hkv, start, E), (Hkv, start, Ev): copies
        k_all = np.concatenate([k_old[None], k[b : b + 1]], axis=2)  # (1, Hkv, start + T, E)
        v_all = np.concatenate([v_old[None], v[b : b + 1]], axis=2)  # (1, Hkv, start + T, Ev)
        band = check_band(True, None, q.shape[2], k_all.shape[2])
        y.append(layer.attend_heads(q[b : b + 1], k_all, v_all, band, False)[0])  # (1, H, T, Ev)
    return np.concatenate(y)  # (B, H, T, Ev)
