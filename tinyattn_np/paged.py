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

A decode step reads each sequence's keys and values through its block table, where they lie: a run of
blocks that follow one another in the pool is one matmul operand, and no sequence is ever copied into one
array. Reading order (this file): PagedKVCache, then paged_decode (one decode step for a batch of
sequences of different lengths) and cascade_decode (a prefix that every sequence shares, read once for all
of them), last a layer's step through the pages (PagedKVCache.attend, which MultiHeadAttention(x, cache=,
seq_ids=) calls): the new tokens' attention over the cached pages and over themselves, merged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._atomic import Undo, holding, locked
from ._checks import (
    QKVShape,
    as_float_array,
    check_bool,
    check_count,
    check_positive_int,
    check_scale,
    compute_dtype,
    result_dtype,
)
from ._flash_kernel import flash_forward, flash_plan
from ._guard import refuse_unless_fits
from ._parallel import cpu_cores, one_blas_thread, run_items
from .blockmask import check_band
from .kvcache import (
    _check_cache_dtype,
    _check_value_prefix,
    _check_values_are_prefix,
    _CopiedWithoutLock,
    _KeysAndValues,
    _read_only_view,
    _refuse_cache_beyond_memory,
)
from .multihead import MultiHeadAttention, _attend_heads, _check_layer_input
from .softmax import merge_states
from .splitkv import (
    _attend_blocks,
    _attend_blocks_bytes,
    _block_keys,
    _default_kv_splits,
    _merge_chunks_bytes,
    merge_chunks,
)

Array = NDArray[np.floating]

__all__ = ["PagedKVCache", "PoolExhaustedError", "cascade_decode", "paged_decode"]


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


class PagedKVCache(_CopiedWithoutLock, _KeysAndValues):
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
        self.dtype = _check_cache_dtype(dtype)
        self.value_prefix = _check_value_prefix(value_prefix, self.head_dim)
        shape = (self.kv_heads, self.num_blocks, self.block_size, self.head_dim)
        counts = 2 * self.num_blocks * np.dtype(np.int64).itemsize  # refs and filled
        _refuse_cache_beyond_memory("PagedKVCache", shape, self.dtype, "lower num_blocks", extra=counts,
                                    value_prefix=self.value_prefix)  # fmt: skip
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
        return _read_only_view(self._k)

    @property
    def v_pool(self) -> Array:
        """The values of every block, (kv_heads, num_blocks, block_size, value_dim): a read-only view (with
        value_prefix, of the keys' first value_prefix numbers: the same memory as k_pool)."""
        return _read_only_view(self._values)

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
            len(table) * self.block_bytes, "PagedKVCache.gather", f"sequence {seq}'s {len(table):,} blocks copied",
            "read the sequence through paged_decode, which reads its blocks where they lie",
        )  # fmt: skip
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
        k, v = self._check_kv(k, "k", 4), self._check_kv(v, "v", 4)
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k and v must have the same sequences and tokens; got shapes {k.shape} and {v.shape}")
        t_new = check_count(k.shape[2], "T_new")
        _check_values_are_prefix(k, v, self.value_prefix)
        state = self._state
        seqs = check_once(check_sequences(self, seq_ids, k.shape[0], "k"), seq_ids)
        needed = self._blocks_needed(state, seqs, t_new)
        if sum(needed) > self.num_blocks - state.used:
            raise PoolExhaustedError(self._refusal(seqs, needed, t_new))
        self._commit(*self._plan(state, seqs, k, v))

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

    def _commit(self, new: PoolState, writes: Sequence[PoolWrite] = ()) -> None:
        """Write the pool as `writes` say, each into slots that no table shows yet, saving what was there;
        then make `new` the cache's state with one assignment. An exception before that assignment puts
        every slot back: the pool and the state stay as they were."""
        new.refs.flags.writeable = new.filled.flags.writeable = False  # committed: never changed in place
        undo = Undo()
        try:
            for where, keys, values in writes:
                undo.write(self._k, where, keys)  # (Hkv, n, E)
                if self._v is not None:  # else the values are the keys' prefix, written with them
                    undo.write(self._v, where, values)  # (Hkv, n, Ev)
            self._state = new  # the commit
        except BaseException:
            if self._state is not new:
                undo.undo()
            raise

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

    def attend(self, layer: MultiHeadAttention, x: Array, *, fused: bool = True, seq_ids: Any = None) -> Array:
        """x (B, T, d_model), row b the next T tokens of sequence seq_ids[b], through layer's heads
        -> y (B, H, T, d_head), the heads' attention before layer's output projection; x's k and v appended
        to those sequences, all or nothing (PoolExhaustedError, or an interrupt, changes nothing).

        Each row's tokens sit at its own sequence's positions, length(seq) onwards (RoPE turns them by
        those); the lengths may differ. fused=True reads the cached pages in place (attend_new_and_cached);
        fused=False lays each sequence out contiguously (gather) for the reference attention. The lock is
        held from reading the lengths to the appends, which come last: the one change this call makes.
        """
        x = _check_layer_input(layer, x)  # (B, T, d_model) in layer's dtype
        want = (layer.n_kv_heads, layer.d_head, layer.w_qkv.dtype, None)
        if (self.kv_heads, self.head_dim, self.dtype, self.value_prefix) != want:
            raise ValueError(
                f"cache must be PagedKVCache(..., kv_heads={want[0]}, head_dim={want[1]}, dtype={want[2]}) for this "
                f"module, its values stored apart from the keys (value_prefix=None); got kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, value_prefix={self.value_prefix}"
            )
        fused = check_bool(fused, "fused")
        return holding(self.lock, self._attend, layer, x, seq_ids, fused)

    def _attend(self, layer: MultiHeadAttention, x: Array, seq_ids: Any, fused: bool) -> Array:
        """attend under the lock: the lengths read here are the ones the appends continue."""
        B, T = x.shape[:2]
        seqs = check_once(check_sequences(self, seq_ids, B), seq_ids)
        needed = self._blocks_needed(self._state, seqs, T)
        if sum(needed) > self.blocks_free:  # refused before any work
            raise PoolExhaustedError(self._refusal(seqs, needed, T))
        # 1) q, k, v of each row, turned by RoPE at its own sequence's positions
        starts = [self._state.lengths[seq] for seq in seqs]
        rows = [layer.split_heads(x[b : b + 1], np.arange(s, s + T)) for b, s in enumerate(starts)]
        q, k, v = (np.concatenate(parts, axis=0) for parts in zip(*rows, strict=True))  # (B, H or Hkv, T, d)
        # 2) their attention over the cached keys and their own, then 3) the append: all or nothing
        y = attend_new_and_cached(q, k, v, self, seqs) if fused else attend_gathered(q, k, v, self, seqs)
        self.append_batch(seqs, k, v)
        return y


class PoolWrite(NamedTuple):
    """One write of an append into the pool: keys (kv_heads, n, head_dim) and values (kv_heads, n, value_dim) into
    pool[where], where (all kv heads, a block, n slots); a pool without values of its own writes the keys only."""

    where: tuple[slice, int, slice]
    keys: Array
    values: Array


def check_once(seqs: list[int], seq_ids: Any) -> list[int]:
    """seqs, if no sequence comes twice (two appends to one sequence in one step would be in no order)."""
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"seq_ids must name each sequence once; got {seq_ids}")
    return seqs


# ---------------------------------------------------------------------------------------------------
# one decode step through the block tables


class PageChunk(NamedTuple):
    """One work item of a paged decode step: the query matrix number `query` against the first `keys`
    token slots of `pages` (blocks of the pool, in token order)."""

    query: int
    pages: tuple[int, ...]
    keys: int


def consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive pages, in order: [7, 8, 9, 3, 4] -> [(7, 3), (3, 2)]."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def page_blocks(cache: PagedKVCache, chunk: PageChunk, block_k: int) -> Iterator[list[tuple[Array, Array]]]:
    """The keys and values of a chunk as blocks of about block_k keys (whole pages), each a list of pieces
    (k (Hkv, n, E), v (Hkv, n, Ev)): one per run of consecutive pages, a view of the pool, never a copy."""
    size, heads, dim, dim_v = cache.block_size, cache.kv_heads, cache.head_dim, cache.value_dim
    k_pool, v_pool = cache.k_pool, cache.v_pool  # (Hkv, blocks, block_size, E or Ev), read-only views
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
    queries: list[Array], cache: PagedKVCache, chunks: list[PageChunk], workers: int
) -> list[tuple[Array, Array]]:
    """(out (Hkv, R, Ev), lse (Hkv, R)) of every chunk, its query matrix queries[chunk.query] (Hkv, R, E) already
    scaled, computed by _attend_blocks on the chunks' pages in place, the chunks spread over the workers."""
    results: list[tuple[Array, Array]] = [(queries[0], queries[0])] * len(chunks)

    def run(i: int) -> None:
        q_s = queries[chunks[i].query]
        converted = 0 if cache.dtype == q_s.dtype else cache.kv_heads * (cache.head_dim + cache.value_dim)  # float16
        blocks = page_blocks(cache, chunks[i], _block_keys(q_s.shape[0] * q_s.shape[1], converted))
        results[i] = _attend_blocks(q_s, blocks, cache.value_dim)

    longest_first = sorted(range(len(chunks)), key=lambda i: -chunks[i].keys)  # the workers finish together
    if len(chunks) <= 1:  # one chunk: BLAS may use its own threads on it
        for i in longest_first:
            run(i)
    else:  # the chunks are the parallelism; chosen without the workers, so any number gives the same bits
        with one_blas_thread():
            run_items(run, longest_first, min(workers, len(chunks)))
    return results


def merge_per_query(
    parts: list[tuple[Array, Array]], chunks: list[PageChunk], queries: list[Array], ev: int
) -> list[tuple[Array, Array]]:
    """Each query matrix's chunks merged by merge_chunks, in chunk order: a list of (out (Hkv, R, Ev), lse (Hkv, R)).
    A query matrix without chunks (a sequence with no token) gets out 0 and lse -inf."""
    mine: dict[int, list[tuple[Array, Array]]] = {}
    for part, chunk in zip(parts, chunks, strict=True):
        mine.setdefault(chunk.query, []).append(part)
    merged = []
    for index, q_s in enumerate(queries):
        if index in mine:
            merged.append(merge_chunks([out for out, _ in mine[index]], [lse for _, lse in mine[index]]))
        else:
            merged.append((np.zeros((*q_s.shape[:-1], ev), q_s.dtype), np.full(q_s.shape[:-1], -np.inf, q_s.dtype)))
    return merged


def decode_pages(
    q: np.ndarray, cache: PagedKVCache, seqs: list[int], scale: float, kv_splits: int | None, workers: int
) -> tuple[Array, Array]:
    """paged_decode's work on checked inputs, under the cache's lock: q (N, Hq, L, E) -> out (N, Hkv, G·L, Ev)
    and lse (N, Hkv, G·L) in the compute dtype. kv_splits None: _default_kv_splits of each sequence."""
    # 1) each sequence's query matrix: its G·L query rows of each kv head stacked, the scale folded in once
    q_s = scaled_queries(q, cache, scale)  # (N, Hkv, G·L, E)
    if q_s.shape[0] == 0:  # no sequence: nothing to read
        return q_s.copy(), q_s[..., 0].copy()
    # 2) each sequence's pages as chunks, the work items; a sequence with no token has none
    chunks, state = [], cache._state
    for i, seq in enumerate(seqs):
        length = state.lengths[seq]
        splits = kv_splits or _default_kv_splits(length, workers)
        chunks += sequence_chunks(i, state.tables[seq], length, cache.block_size, splits)
    # 3) every chunk against its pages in place, then one merge per sequence
    queries = list(q_s)
    merged = merge_per_query(attend_page_chunks(queries, cache, chunks, workers), chunks, queries, cache.value_dim)
    return np.stack([out for out, _ in merged]), np.stack([lse for _, lse in merged])


def scaled_queries(q: np.ndarray, cache: PagedKVCache, scale: float) -> Array:
    """q (N, Hq, L, E) as each sequence's query matrix, the G = Hq / Hkv query heads that read a kv head stacked
    (query head h reads kv head h // G: neighbours, so a reshape suffices) and the scale folded in once:
    (N, Hkv, G·L, E) in the compute dtype."""
    n, hq, n_q, e = q.shape
    rows = hq // cache.kv_heads * n_q
    return np.multiply(q.reshape(n, cache.kv_heads, rows, e), scale, dtype=compute_dtype(q, cache.k_pool))


def shared_prefix(tables: Sequence[Sequence[int]], lengths: list[int], page_size: int) -> tuple[int, int]:
    """(pages, keys) that every sequence shares: the leading blocks that all the tables hold at the same
    place. Keys: those pages' slots, or the sequences' common length if the last shared block is partly
    filled (a shared block is never written, so every sequence then ends in it)."""
    pages = 0
    while all(len(table) > pages for table in tables) and len({table[pages] for table in tables}) == 1:
        pages += 1
    return pages, min(min(lengths), pages * page_size)


def decode_cascade(
    q: np.ndarray, cache: PagedKVCache, seqs: list[int], scale: float, kv_splits: int | None, workers: int
) -> tuple[Array, Array]:
    """cascade_decode's work on checked inputs, under the cache's lock: as decode_pages, but the pages that
    every sequence shares are read once, by the queries of all N sequences stacked into one matrix."""
    q_s = scaled_queries(q, cache, scale)  # (N, Hkv, R, E): R = G·L query rows per sequence and kv head
    n, hkv, rows, e = q_s.shape
    size, ev = cache.block_size, cache.value_dim
    if n == 0:  # no sequence: nothing to read
        return q_s.copy(), q_s[..., 0].copy()
    state = cache._state
    tables, lengths = [state.tables[seq] for seq in seqs], [state.lengths[seq] for seq in seqs]
    pages, keys = shared_prefix(tables, lengths, size)
    # 1) the shared prefix, once: all N·R query rows of a kv head against it, as one matrix (query number N)
    q_all = q_s.transpose(1, 0, 2, 3).reshape(hkv, n * rows, e)  # (Hkv, N·R, E)
    chunks = sequence_chunks(n, tables[0][:pages], keys, size, kv_splits or _default_kv_splits(keys, workers))
    # 2) each sequence's own pages, after the prefix (none if it ends in the prefix)
    for i, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        splits = kv_splits or _default_kv_splits(length - keys, workers)
        chunks += sequence_chunks(i, table[pages:], length - keys, size, splits)
    queries = [*q_s, q_all]
    merged = merge_per_query(attend_page_chunks(queries, cache, chunks, workers), chunks, queries, ev)
    # 3) the two parts of each sequence, over disjoint keys, combined: merge_states
    out_shared = merged[n][0].reshape(hkv, n, rows, ev).transpose(1, 0, 2, 3)  # (N, Hkv, R, Ev)
    lse_shared = merged[n][1].reshape(hkv, n, rows).transpose(1, 0, 2)  # (N, Hkv, R)
    out_own, lse_own = np.stack([out for out, _ in merged[:n]]), np.stack([lse for _, lse in merged[:n]])
    return merge_states(out_shared, lse_shared, out_own, lse_own)


def check_sequences(cache: PagedKVCache, seq_ids: Any, n: int, name: str = "x") -> list[int]:
    """seq_ids as a list of n ids of sequences in cache, one for each row of `name` (its first axis)."""
    if not isinstance(seq_ids, Iterable) or isinstance(seq_ids, (str, bytes)):
        raise TypeError(f"seq_ids must be a sequence of ids, one per row of {name}; got {type(seq_ids).__name__}")
    seqs = [cache.check_seq(seq) for seq in seq_ids]
    if len(seqs) != n:
        raise ValueError(f"{name} has {n} sequences (its first axis) but seq_ids names {len(seqs)}")
    return seqs


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
    seqs = check_sequences(cache, seq_ids, q.shape[0], "q")
    scale = check_scale(scale, cache.head_dim, compute_dtype(q, cache.k_pool))
    kv_splits = None if kv_splits is None else check_positive_int(kv_splits, "kv_splits")
    workers = check_positive_int(workers, "workers", default=cpu_cores())
    return q, seqs, scale, kv_splits, workers


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
    """One decode step for N sequences of different lengths: attention of q[i] over sequence seq_ids[i]'s keys.

    q (N, Hq, L, E) -> out (N, Hq, L, Ev), and with return_lse=True also lse (N, Hq, L); Ev is the cache's
    value_dim (head_dim, or value_prefix: the keys' first numbers, read once with them). Every query sees
    every key of its sequence (for L = 1 that is causal attention: the query is the newest token), so out[i]
    equals attention(q[i], K_i, V_i) with K_i, V_i = cache.gather(seq_ids[i]), the keys laid out
    contiguously. Query head h reads kv head h // (Hq / kv_heads).

    The keys are read through the block tables where they lie: each run of consecutive blocks is one
    matmul operand, never copied. A sequence is split into kv_splits chunks of whole blocks (default
    _default_kv_splits: one per worker, 1,024 keys or more each), every chunk of every sequence is a work
    item for `workers` threads (default the CPU count), and each sequence's chunks are merged by
    merge_chunks, as flash_decode does. For a given kv_splits the result is the same bits for any number
    of workers. The cache's lock is held while it reads. float16 is computed in float32.

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


def run_decode(
    kernel: Any, q: Any, cache: Any, seq_ids: Any, scale: Any, kv_splits: Any, workers: Any, return_lse: Any
) -> Array | tuple[Array, Array]:
    """The door of paged_decode and cascade_decode: check once, run the kernel under the cache's lock, shape."""
    return_lse = check_bool(return_lse, "return_lse")
    q, seqs, scale, kv_splits, workers = check_paged(q, cache, seq_ids, scale, kv_splits, workers)
    out, lse = holding(cache.lock, decode_within_memory, kernel, q, cache, seqs, scale, kv_splits, workers)
    out = out.reshape(*q.shape[:-1], cache.value_dim)  # (N, Hq, L, Ev)
    out = out.astype(result_dtype(q, cache.k_pool), copy=False)
    lse = lse.reshape(q.shape[:-1])  # (N, Hq, L), in the compute dtype
    return (out, lse) if return_lse else out


def decode_within_memory(
    kernel: Any, q: np.ndarray, cache: PagedKVCache, seqs: list[int], scale: float, kv_splits: int | None, workers: int
) -> tuple[Array, Array]:
    """kernel(q, cache, seqs, ...), run under the cache's lock, refused first (AttentionMemoryError, nothing
    allocated) if its peak does not fit in the memory available."""
    cascade = kernel is decode_cascade
    who = "cascade_decode" if cascade else "paged_decode"
    refuse_unless_fits(
        paged_decode_bytes(q, cache, seqs, kv_splits, workers, cascade),
        who, f"{q.shape[0]:,} sequences of {q.shape[1] * q.shape[2]:,} query rows",
        "pass fewer sequences per call (the batch in parts), or fewer kv_splits",
    )  # fmt: skip
    return kernel(q, cache, seqs, scale, kv_splits, workers)


def paged_decode_bytes(
    q: np.ndarray, cache: PagedKVCache, seqs: list[int], kv_splits: int | None, workers: int, cascade: bool = False
) -> int:
    """Peak bytes that paged_decode (cascade=True: cascade_decode) allocates for q (N, Hq, L, E), which exists,
    an upper bound in splitkv.decode_bytes' terms. R = G·L query rows per sequence and kv head, Ev the cache's
    value_dim, c bytes of the compute dtype, C chunks in all (a shared prefix's chunks have N·R rows):

        q_s       N·Hkv·R·E·c              the scaled queries, held to the end
        parts     Σ_chunks Hkv·rows·(Ev+1)·c  each chunk's out and lse, held until its sequence's merge
        workers   min(workers, C) _attend_blocks at once, each on a block of whole pages
        merged    2·N·Hkv·R·(Ev+1)·c       each sequence's merged result, then all of them stacked
        merge     one merge_chunks at a time (the sequence with the most chunks)
        cascade   the queries stacked into one matrix, the prefix's merged result, merge_states' three
                  temporaries of out's size: 5·N·Hkv·R·(Ev+1)·c
        cast      the result cast back to float16, for a float16 q
    """
    state, size, hkv, ev = cache._state, cache.block_size, cache.kv_heads, cache.value_dim
    n, hq, n_q, e = q.shape
    rows, c = hq // hkv * n_q, compute_dtype(q, cache.k_pool).itemsize
    lengths = [state.lengths[seq] for seq in seqs]
    shared = 0  # keys every sequence shares, read once by cascade_decode
    if cascade and seqs:
        _, shared = shared_prefix([state.tables[seq] for seq in seqs], lengths, size)
    # (query rows, chunks, pages of the longest chunk) of each query matrix: the sequences', then the prefix's
    queries = [(rows, *page_chunks(length - shared, size, kv_splits, workers)) for length in lengths]
    if cascade:
        queries.append((n * rows, *page_chunks(shared, size, kv_splits, workers)))
    chunk_rows = sum(r * chunks for r, chunks, _ in queries)  # rows of all chunks' results together
    converted = 0 if cache.dtype == compute_dtype(q, cache.k_pool) else e + ev  # a float16 pool: k and v, per key
    working = 0
    for r, chunks, pages in queries:  # the widest chunk, on every worker at once
        block = block_pages(hkv * r, hkv * converted, size, pages) * size
        working = max(working, _attend_blocks_bytes(hkv, r, block, pages * size, ev, c, converted) * (chunks > 0))
    working *= min(workers, sum(chunks for _, chunks, _ in queries))
    merge = max((_merge_chunks_bytes(chunks, hkv * r, ev, c) for r, chunks, _ in queries if chunks), default=0)
    one = n * hkv * rows  # rows of the whole result
    needed = one * e * c + chunk_rows * hkv * (ev + 1) * c + 2 * one * (ev + 1) * c + max(working, merge)
    needed += 5 * one * (ev + 1) * c if cascade else 0
    return needed + (one * ev * q.dtype.itemsize if q.dtype.itemsize < c else 0)


def page_chunks(keys: int, page_size: int, kv_splits: int | None, workers: int) -> tuple[int, int]:
    """(chunks, pages of the longest) that sequence_chunks makes of `keys` keys."""
    pages = -(-keys // page_size)
    chunks = min(kv_splits or _default_kv_splits(keys, workers), pages)
    return chunks, -(-pages // chunks) if chunks else 0


def block_pages(rows: int, converted: int, page_size: int, pages: int) -> int:
    """Pages in each block of a chunk of `pages` pages that page_blocks yields, for `rows` query rows."""
    return min(max(1, _block_keys(rows, converted) // page_size), pages)


# ---------------------------------------------------------------------------------------------------
# a layer's step: the new tokens against the cached pages and against themselves


def attend_new_and_cached(q: Array, k: Array, v: Array, cache: PagedKVCache, seqs: list[int]) -> Array:
    """The fused path of PagedKVCache.attend: q (B, H, T, d) of the new tokens, k, v (B, Hkv, T, d) ->
    y (B, H, T, d), before the new k and v are appended.

    Every cached key is older than every new token, so the new queries see all of them; among themselves
    they are causal. The two parts are over disjoint keys and merge exactly:
        out_c, lse_c = paged attention(q, the cached pages)        read in place (decode_pages)
        out_n, lse_n = flash_attention(q, k_new, v_new, causal)
        y = merge(out_c, lse_c, out_n, lse_n)                       (merge_chunks: merge_states for N parts)
    A prefill is T tokens into empty sequences (no cached part); a decode step is T = 1.
    """
    B, H, T, d = q.shape
    scale, workers = 1.0 / math.sqrt(d), cpu_cores()
    refuse_unless_fits(
        paged_decode_bytes(q, cache, seqs, None, workers), "PagedKVCache.attend",
        f"{B:,} sequences of {H * T:,} query rows against their cached pages",
        "pass fewer sequences or tokens per call",
    )  # fmt: skip
    out_c, lse_c = decode_pages(q, cache, seqs, scale, None, workers)  # (B, Hkv, G·T, d)
    dims = QKVShape((B,), H, k.shape[1], T, T, d, d)
    band = check_band(True, None, T, T)
    out_n, lse_n = flash_forward(q, k, v, dims, flash_plan(dims, band, scale))  # (B, H, T, d), (B, H, T)
    out_c, lse_c = out_c.reshape(out_n.shape), lse_c.reshape(lse_n.shape)  # (B, H, T, d): the same row order
    y, _ = merge_chunks([out_c, out_n], [lse_c, lse_n])  # disjoint keys: the attention over both
    return y.astype(q.dtype, copy=False)


def attend_gathered(q: Array, k: Array, v: Array, cache: PagedKVCache, seqs: list[int]) -> Array:
    """The reference path of PagedKVCache.attend: each sequence's cached keys laid out contiguously, then the
    new ones, and attention with the causal band (bottom-right: new token i sees start + i + 1 keys)."""
    y = np.empty_like(q)  # (B, H, T, d_head)
    for b, seq in enumerate(seqs):
        k_old, v_old = cache.gather(seq)  # (Hkv, start, d_head) each: copies
        k_all = np.concatenate([k_old[None], k[b : b + 1]], axis=2)  # (1, Hkv, start + T, d_head)
        v_all = np.concatenate([v_old[None], v[b : b + 1]], axis=2)
        band = check_band(True, None, q.shape[2], k_all.shape[2])
        y[b] = _attend_heads(q[b : b + 1], k_all, v_all, band, False)[0][0]
    return y
