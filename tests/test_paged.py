"""PagedKVCache: blocks taken only when the last is full, fork with copy-on-write, free with reference counts,
refusals that change nothing (the whole pool compared before and after), every change all or nothing under
an interrupt at any bytecode, atomic appends under threads, a pool that refuses before allocating, and
hypothesis-drawn sequences of appends, batches, forks and frees against a plain dict of arrays."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kvcache import CACHE_CODE, WHOLE_PACKAGE, _all_or_nothing, _lock_is_free, _threads, _under_address_space_limit

from tinyattn_np import (
    MultiHeadAttention,
    PagedKVCache,
    PoolExhaustedError,
    latent_cache_bytes,
    paged_decode,
    paged_kv_cache_bytes,
)
from tinyattn_np._paged_kernel import consecutive_runs

RNG = np.random.default_rng(19)


def _tokens(cache: PagedKVCache, first: int, t_new: int) -> tuple[np.ndarray, np.ndarray]:
    """k and v of t_new tokens whose entries are their ids first, first + 1, ... (v: minus the id), so a slot
    read back says which token it holds and whether its k and v belong together. For a cache whose values are
    its keys' prefix, v is k's first value_prefix numbers."""
    ids = np.arange(first, first + t_new, dtype=cache.dtype)  # (T_new,)
    k = np.broadcast_to(ids[None, :, None], (cache.kv_heads, t_new, cache.head_dim)).copy()
    return k, (-k if cache.value_prefix is None else k[..., : cache.value_prefix])


def _state(cache: PagedKVCache) -> dict:
    """Everything a cache holds: the whole pool, the reference counts, every table and length."""
    return {
        "k_pool": cache.k_pool.copy(),
        "v_pool": cache.v_pool.copy(),
        "refs": cache.ref_counts,
        "tables": {seq: cache.block_table(seq) for seq in cache.sequences},
        "lengths": {seq: cache.length(seq) for seq in cache.sequences},
        "free": cache.blocks_free,
        "wasted": cache.slots_wasted,
    }


def _assert_same_state(before: dict, after: dict) -> None:
    for name in ("k_pool", "v_pool", "refs"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    for name in ("tables", "lengths", "free", "wasted"):
        assert after[name] == before[name], name


def _ids(cache: PagedKVCache, seq: int) -> np.ndarray:
    """The token ids sequence seq holds, in order (read from its keys), checked against its values."""
    keys, values = cache.gather(seq)  # (Hkv, T, E), (Hkv, T, Ev)
    np.testing.assert_array_equal(values, -keys if cache.value_prefix is None else keys[..., : cache.value_prefix])
    assert np.all(keys == keys[:1, :, :1])  # one token per slot, across heads and channels
    return keys[0, :, 0]


# --- the pool and the block tables -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_sizes_and_an_empty_pool(dtype):
    cache = PagedKVCache(10, 4, 2, 8, dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    assert cache.block_bytes == 2 * 2 * 4 * 8 * itemsize and cache.nbytes == 10 * cache.block_bytes
    assert cache.blocks_used == 0 and cache.blocks_free == 10 and cache.slots_wasted == 0 and cache.bytes_used == 0
    assert cache.k_pool.shape == (2, 10, 4, 8) and cache.k_pool.dtype == dtype
    assert "0 sequences, 0 blocks used" in repr(cache)


def test_a_pool_larger_than_memory_is_refused_before_it_is_made():
    message = r"PagedKVCache would allocate 2\.0 TiB .* of memory is available: lower num_blocks"
    with pytest.raises(MemoryError, match=message):
        PagedKVCache(2**20, 256, 8, 128)  # 2 TiB


def test_a_pool_beyond_the_address_space_limit_is_refused_before_anything_is_allocated():
    """Under ulimit -v (RLIMIT_AS) a pool of 8 GiB cannot be mapped, whatever memory the machine has free: the
    guard refuses it (no allocation was tried, or NumPy's own MemoryError would come first)."""
    printed = _under_address_space_limit("", "tinyattn_np.PagedKVCache(2**16, 16, 8, 128)")
    assert printed.startswith("refused: PagedKVCache would allocate 8.0 GiB"), printed
    assert "lower num_blocks" in printed


def test_the_pool_views_cannot_be_made_writable():
    cache = PagedKVCache(4, 2, 1, 2)
    seq = cache.add_sequence()
    cache.append(seq, *_tokens(cache, 1, 3))
    before = _state(cache)
    for view in (cache.k_pool, cache.v_pool, cache.k_pool[:, 1:]):
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0, 0, 0] = 1.0  # a write here would change every sequence holding the block
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            view.flags.writeable = True
        base = view  # no array the view comes from is in reach to write through
        while isinstance(base, np.ndarray):
            assert not base.flags.writeable
            base = base.base
        assert not np.asarray(base).flags.writeable
    _assert_same_state(before, _state(cache))


def test_a_block_is_taken_only_when_the_last_one_is_full():
    cache = PagedKVCache(10, 4, 1, 2)
    seq = cache.add_sequence()
    assert cache.block_table(seq) == () and cache.length(seq) == 0  # no token, no block
    used = []
    for t in range(1, 10):
        cache.append(seq, *_tokens(cache, t, 1))
        used.append(cache.blocks_used)
    assert used == [1, 1, 1, 1, 2, 2, 2, 2, 3]  # a new block at tokens 1, 5 and 9
    assert cache.slots_wasted == 3 and cache.block_table(seq) == (0, 1, 2)  # one sequence alone: one run
    np.testing.assert_array_equal(_ids(cache, seq), np.arange(1, 10))
    cache.append(seq, *_tokens(cache, 10, 7))  # 3 fill the last block, 4 take exactly one more
    assert cache.blocks_used == 4 and cache.slots_wasted == 0 and cache.length(seq) == 16
    np.testing.assert_array_equal(_ids(cache, seq), np.arange(1, 17))


def test_sequences_that_grow_together_lie_in_runs_of_their_own_and_keep_their_own_tokens():
    cache = PagedKVCache(12, 2, 2, 3, dtype=np.float64)
    a, b = cache.add_sequence(), cache.add_sequence()
    for t in range(5):
        cache.append(a, *_tokens(cache, 100 + t, 1))
        cache.append(b, *_tokens(cache, 200 + t, 1))
    # a starts the empty pool; b lands in the middle of the free run after a, where a is not about to grow
    assert cache.block_table(a) == (0, 1, 2) and cache.block_table(b) == (6, 7, 8)
    np.testing.assert_array_equal(_ids(cache, a), 100 + np.arange(5))
    np.testing.assert_array_equal(_ids(cache, b), 200 + np.arange(5))
    assert cache.blocks_used == 6 and cache.slots_wasted == 2  # each last block half full
    assert cache.bytes_used == paged_kv_cache_bytes(
        [5, 5], block_size=2, layers=1, kv_heads=2, head_dim=3, dtype="fp64"
    )


def test_sequences_decoding_together_stay_in_few_runs_of_blocks():
    """Eight sequences appending one token each in turn (a server's decode steps): each takes the block after
    its own while it is free, so its table breaks into few runs, which paged_decode reads in one matmul each."""
    cache = PagedKVCache(256, 2, 1, 2)
    seqs = [cache.add_sequence() for _ in range(8)]
    for t in range(60):
        for seq in seqs:
            cache.append(seq, *_tokens(cache, t, 1))
    runs = [len(consecutive_runs(cache.block_table(seq))) for seq in seqs]
    assert cache.blocks_used == 8 * 30 and runs == [1] * 8, runs  # 30 blocks each, each in one run (lowest-first
    # allocation would give each 30 runs of one block: the eight would take turns)


def test_a_batch_append_writes_each_sequence_its_own_tokens():
    cache = PagedKVCache(8, 4, 2, 2)
    seqs = [cache.add_sequence() for _ in range(3)]
    cache.append(seqs[1], *_tokens(cache, 50, 3))  # a head start: the batch continues different lengths
    ks, vs = zip(*(_tokens(cache, 10 * (i + 1), 2) for i in range(3)), strict=True)
    cache.append_batch(seqs, np.stack(ks), np.stack(vs))
    assert [cache.length(s) for s in seqs] == [2, 5, 2]
    np.testing.assert_array_equal(_ids(cache, seqs[1]), [50, 51, 52, 20, 21])
    np.testing.assert_array_equal(_ids(cache, seqs[2]), [30, 31])


# --- refusals change nothing -----------------------------------------------------------------------


def test_an_append_the_pool_cannot_hold_is_refused_and_changes_nothing():
    cache = PagedKVCache(4, 4, 2, 2)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, *_tokens(cache, 1, 6))  # 2 blocks
    cache.append(b, *_tokens(cache, 20, 3))  # 1 block: 1 left
    before = _state(cache)
    message = r"for sequence 0: it needs 2 new blocks and 1 of 4 are free; nothing was changed"
    with pytest.raises(PoolExhaustedError, match=message):
        cache.append(a, *_tokens(cache, 7, 7))  # 2 fill the last block, 5 more need 2 blocks
    _assert_same_state(before, _state(cache))
    with pytest.raises(MemoryError):  # PoolExhaustedError is a MemoryError
        cache.append(b, *_tokens(cache, 23, 10))
    _assert_same_state(before, _state(cache))
    cache.append(a, *_tokens(cache, 7, 6))  # what fits still goes in
    assert cache.blocks_free == 0


def test_a_batch_is_all_or_nothing():
    cache = PagedKVCache(3, 2, 1, 2)
    seqs = [cache.add_sequence() for _ in range(3)]
    cache.append(seqs[0], *_tokens(cache, 1, 1))  # block 0 has room for 1 more
    before = _state(cache)
    ks, vs = zip(*(_tokens(cache, 10 * i, 2) for i in range(3)), strict=True)
    with pytest.raises(
        PoolExhaustedError, match=r"they need 3 new blocks \(sequence 0: 1, sequence 1: 1, sequence 2: 1\)"
    ):
        cache.append_batch(seqs, np.stack(ks), np.stack(vs))  # 3 needed, 2 free: the first two would fit
    _assert_same_state(before, _state(cache))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c, s: c.append(s, np.zeros((2, 1, 4), np.float64), np.zeros((2, 1, 4))), TypeError, "dtype float32"),
        (
            lambda c, s: c.append(s, np.zeros((3, 1, 4), np.float32), np.zeros((3, 1, 4), np.float32)),
            ValueError,
            r"shape \(2, T_new, 4\)",
        ),
        (
            lambda c, s: c.append(s, np.zeros((2, 1, 4), np.float32), np.zeros((2, 2, 4), np.float32)),
            ValueError,
            "the same sequences and tokens",
        ),
        (lambda c, s: c.append(s, [[[0.0]]], [[[0.0]]]), TypeError, "must be a NumPy array"),
        (lambda c, s: c.append(7, *_tokens(c, 0, 1)), ValueError, r"sequence 7 is not in this cache"),
        (lambda c, s: c.append(True, *_tokens(c, 0, 1)), TypeError, "seq must be a sequence id"),
        (lambda c, s: c.append_batch([s, s], *(np.stack([x, x]) for x in _tokens(c, 0, 1))), ValueError, "once"),
        (
            lambda c, s: c.append_batch([s], *(np.stack([x, x]) for x in _tokens(c, 0, 1))),
            ValueError,
            "k has 2 sequences",
        ),
        (lambda c, s: c.append_batch(s, *(x[None] for x in _tokens(c, 0, 1))), TypeError, "sequence of ids"),
        (lambda c, s: c.free(99), ValueError, "sequence 99 is not in this cache"),
        (lambda c, s: c.fork(-1), ValueError, "sequence -1 is not in this cache"),
    ],
)
def test_bad_calls_are_named_and_change_nothing(call, error, message):
    cache = PagedKVCache(6, 2, 2, 4)
    seq = cache.add_sequence()
    cache.append(seq, *_tokens(cache, 1, 3))
    before = _state(cache)
    with pytest.raises(error, match=message):
        call(cache, seq)
    _assert_same_state(before, _state(cache))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 4, 1, 2), ValueError, "num_blocks must be a positive int; got 0"),
        ((4, 2.0, 1, 2), TypeError, "block_size must be a positive int"),
        ((4, 4, 1, 2, np.int32), TypeError, "dtype must be float16, float32 or float64; got int32"),
        ((4, 4, 1, 2, "nonsense"), TypeError, "dtype must be float16, float32 or float64"),
    ],
)
def test_bad_construction_is_named(args, error, message):
    with pytest.raises(error, match=message):
        PagedKVCache(*args)


# --- fork, copy-on-write, free, reference counts ---------------------------------------------------


def test_fork_shares_every_block_and_copies_the_shared_last_one_on_first_write():
    cache = PagedKVCache(8, 4, 2, 2)
    parent = cache.add_sequence()
    cache.append(parent, *_tokens(cache, 1, 6))  # blocks 0 (full) and 1 (2 of 4)
    child = cache.fork(parent)
    assert cache.block_table(child) == cache.block_table(parent) == (0, 1)
    assert list(cache.ref_counts[:2]) == [2, 2] and cache.blocks_used == 2  # shared, held once
    # the child writes into the shared, partly filled block 1: it gets its own copy first
    cache.append(child, *_tokens(cache, 100, 1))
    copy_of_1 = cache.block_table(child)[1]
    assert cache.block_table(child) == (0, copy_of_1) and cache.block_table(parent) == (0, 1) and copy_of_1 > 1
    assert cache.ref_counts[[0, 1, copy_of_1]].tolist() == [2, 1, 1]
    np.testing.assert_array_equal(_ids(cache, parent), [1, 2, 3, 4, 5, 6])  # untouched
    np.testing.assert_array_equal(_ids(cache, child), [1, 2, 3, 4, 5, 6, 100])
    # the parent now holds block 1 alone: it writes in place, no copy
    cache.append(parent, *_tokens(cache, 7, 2))
    assert cache.block_table(parent) == (0, 1) and cache.blocks_used == 3
    np.testing.assert_array_equal(_ids(cache, parent), [1, 2, 3, 4, 5, 6, 7, 8])


def test_a_full_shared_last_block_is_not_copied():
    cache = PagedKVCache(8, 4, 1, 2)
    parent = cache.add_sequence()
    cache.append(parent, *_tokens(cache, 1, 8))  # two full blocks
    child = cache.fork(parent)
    cache.append(child, *_tokens(cache, 9, 1))  # a new block, no copy
    assert cache.block_table(child) == (0, 1, 2) and cache.blocks_used == 3
    assert list(cache.ref_counts[:3]) == [2, 2, 1]


def test_the_copy_on_write_block_counts_in_the_refusal():
    cache = PagedKVCache(2, 4, 1, 2)
    parent = cache.add_sequence()
    cache.append(parent, *_tokens(cache, 1, 2))  # block 0, half full
    child = cache.fork(parent)
    other = cache.add_sequence()
    cache.append(other, *_tokens(cache, 50, 1))  # block 1: the pool is now full
    before = _state(cache)
    with pytest.raises(PoolExhaustedError, match=r"sequence 1: it needs 1 new blocks and 0 of 2 are free"):
        cache.append(child, *_tokens(cache, 9, 1))  # one token, with room in block 0, but block 0 is shared
    _assert_same_state(before, _state(cache))
    cache.free(other)
    cache.append(child, *_tokens(cache, 9, 1))  # now the copy has a block to go to
    assert cache.block_table(child) == (1,) and cache.block_table(parent) == (0,)
    np.testing.assert_array_equal(_ids(cache, child), [1, 2, 9])


def test_fork_siblings_appended_together_copy_their_shared_block_once():
    """Two holders of a partly filled block appended in one batch: the first copies it, the second then holds
    it alone and writes in place, as one append after the other would. One free block is enough."""
    cache = PagedKVCache(3, 4, 1, 2)
    parent = cache.add_sequence()
    cache.append(parent, *_tokens(cache, 1, 2))  # block 0, half full
    child = cache.fork(parent)
    other = cache.add_sequence()
    cache.append(other, *_tokens(cache, 50, 4))  # block 1: one block is left
    assert cache.blocks_needed(parent, 1) == cache.blocks_needed(child, 1) == 1  # either one alone copies
    assert cache.blocks_needed([parent, child], 1) == 1 and cache.blocks_needed([parent, child, other], 1) == 2
    (k_parent, _), (k_child, _) = _tokens(cache, 3, 1), _tokens(cache, 9, 1)
    cache.append_batch([parent, child], np.stack([k_parent, k_child]), -np.stack([k_parent, k_child]))
    assert cache.blocks_free == 0 and cache.block_table(child) == (0,) and cache.block_table(parent) == (2,)
    np.testing.assert_array_equal(_ids(cache, parent), [1, 2, 3])
    np.testing.assert_array_equal(_ids(cache, child), [1, 2, 9])
    _assert_counts_match_the_tables(cache)


def test_three_siblings_need_two_copies_and_a_refusal_counts_exactly():
    cache = PagedKVCache(4, 4, 1, 2)
    first = cache.add_sequence()
    cache.append(first, *_tokens(cache, 1, 3))  # block 0, 3 of 4 slots
    family = [first, cache.fork(first), cache.fork(first)]
    assert cache.blocks_needed(family, 1) == 2  # two copies; the last holder writes in place
    assert cache.blocks_needed(family, 2) == 2 + 3  # the 2nd token of each goes past the block: 3 new blocks
    before = _state(cache)
    with pytest.raises(
        PoolExhaustedError, match=r"they need 5 new blocks \(sequence 0: 2, sequence 1: 2, sequence 2: 1\)"
    ):
        cache.append_batch(family, *(np.stack([x] * 3) for x in _tokens(cache, 10, 2)))
    _assert_same_state(before, _state(cache))
    cache.append_batch(family, *(np.stack([x] * 3) for x in _tokens(cache, 10, 1)))
    assert cache.blocks_free == 1 and cache.block_table(family[2]) == (0,)
    for seq in family:
        np.testing.assert_array_equal(_ids(cache, seq), [1, 2, 3, 10])
    with pytest.raises(ValueError, match="each sequence once"):
        cache.blocks_needed([first, first], 1)


def test_free_returns_blocks_when_no_sequence_holds_them_and_they_are_reused():
    cache = PagedKVCache(6, 2, 1, 2)
    parent = cache.add_sequence()
    cache.append(parent, *_tokens(cache, 1, 4))  # blocks 0, 1
    child = cache.fork(parent)
    cache.append(child, *_tokens(cache, 5, 2))  # block 2
    cache.free(parent)
    assert cache.blocks_used == 3 and list(cache.ref_counts[:3]) == [1, 1, 1]  # the child still holds 0 and 1
    np.testing.assert_array_equal(_ids(cache, child), [1, 2, 3, 4, 5, 6])
    cache.free(child)
    assert cache.blocks_used == 0 and not cache.ref_counts.any() and cache.slots_wasted == 0
    with pytest.raises(ValueError, match="sequence 1 is not in this cache"):
        cache.free(child)  # twice
    again = cache.add_sequence()
    cache.append(again, *_tokens(cache, 50, 5))
    assert cache.block_table(again) == (0, 1, 2)  # the lowest free blocks first
    np.testing.assert_array_equal(_ids(cache, again), 50 + np.arange(5))  # nothing of the old tokens shows


def test_copies_and_pickles_with_their_own_lock():
    cache = PagedKVCache(4, 2, 1, 2)
    seq = cache.add_sequence()
    cache.append(seq, *_tokens(cache, 1, 3))
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert twin.lock is not cache.lock and twin.block_table(seq) == cache.block_table(seq)
        twin.append(seq, *_tokens(twin, 4, 1))
        assert twin.length(seq) == 4 and cache.length(seq) == 3  # they part ways


# --- values that are the keys' prefix: the latent of multi-head latent attention, stored once ---------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_values_as_the_keys_prefix_are_stored_once(dtype):
    """A latent of 8 + 4 numbers a token: the pool holds the keys alone (a full pool's bytes are
    memory.latent_cache_bytes of its slots), and v_pool is a view of the keys' first 8 numbers."""
    cache = PagedKVCache(10, 4, 1, 12, dtype=dtype, value_prefix=8)
    itemsize = np.dtype(dtype).itemsize
    assert cache.block_bytes == 4 * 12 * itemsize and cache.nbytes == 10 * cache.block_bytes
    assert cache.nbytes == latent_cache_bytes(40, layers=1, kv_rank=8, rope_dim=4, dtype=dtype)
    assert cache.v_pool.shape == (1, 10, 4, 8) and cache.value_dim == 8 and "value_prefix=8" in repr(cache)
    assert np.shares_memory(cache.v_pool, cache.k_pool) and not cache.v_pool.flags.writeable
    seq = cache.add_sequence()
    k = RNG.standard_normal((1, 6, 12)).astype(dtype)
    cache.append(seq, k, k[..., :8])
    keys, values = cache.gather(seq)
    np.testing.assert_array_equal(keys, k)
    np.testing.assert_array_equal(values, k[..., :8])
    assert np.shares_memory(values, keys)  # the gathered latent, copied once
    np.testing.assert_array_equal(cache.v_pool, cache.k_pool[..., :8])
    assert cache.bytes_used == 2 * cache.block_bytes


def test_a_bad_value_prefix_is_named():
    with pytest.raises(ValueError, match=r"value_prefix must be at most head_dim=4 .*; got 5"):
        PagedKVCache(4, 2, 1, 4, value_prefix=5)
    with pytest.raises(TypeError, match="value_prefix must be a positive int"):
        PagedKVCache(4, 2, 1, 4, value_prefix="3")


def test_values_that_are_not_the_keys_prefix_are_refused_and_change_nothing():
    cache = PagedKVCache(6, 2, 2, 4, value_prefix=3)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    cache.append(seqs[0], *_tokens(cache, 1, 3))
    before = _state(cache)
    k, v = _tokens(cache, 4, 2)
    with pytest.raises(ValueError, match=r"v must be k's first value_prefix=3 numbers \(k\[\.\.\., :3\]\)"):
        cache.append(seqs[0], k, v + 1)
    with pytest.raises(ValueError, match=r"v must have shape \(2, T_new, 3\) \(kv_heads, T_new, value_dim\)"):
        cache.append(seqs[0], k, k)  # the whole key as the value: this pool keeps values 3 wide
    v_batch = np.stack([v, v + 1])  # the second sequence's values are not its keys' prefix
    with pytest.raises(ValueError, match="v must be k's first value_prefix=3"):
        cache.append_batch(seqs, np.stack([k, k]), v_batch)  # all or nothing: the first does not go in either
    _assert_same_state(before, _state(cache))
    cache.append_batch(seqs, np.stack([k, k]), np.stack([v, v]))
    np.testing.assert_array_equal(_ids(cache, seqs[1]), [4, 5])


def test_a_layer_with_values_of_its_own_refuses_a_prefix_pool():
    cache = PagedKVCache(6, 2, 2, 2, dtype=np.float64, value_prefix=1)
    seq = cache.add_sequence()
    with pytest.raises(ValueError, match=r"apart from the keys \(value_prefix=None\); got .*value_prefix=1"):
        ATTEND_LAYER(ONE_TOKEN, cache=cache, seq_ids=[seq])
    assert cache.length(seq) == 0 and cache.blocks_used == 0


def test_a_prefix_pool_copies_and_pickles_with_values_that_stay_its_keys():
    cache = PagedKVCache(4, 2, 1, 2, value_prefix=1)
    seq = cache.add_sequence()
    cache.append(seq, *_tokens(cache, 1, 3))
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        twin.append(seq, *_tokens(twin, 4, 1))
        assert np.shares_memory(twin.v_pool, twin.k_pool) and not np.shares_memory(twin.k_pool, cache.k_pool)
        np.testing.assert_array_equal(_ids(twin, seq), [1, 2, 3, 4])
        assert cache.length(seq) == 3 and twin.nbytes == cache.nbytes == 4 * 2 * 2 * 4


# --- against a plain model: a dict of arrays --------------------------------------------------------

OPERATIONS = st.lists(  # (operation, which live sequence, tokens); appends and forks drawn most often
    st.tuples(
        st.sampled_from(["add", "append", "append", "append", "batch", "batch", "fork", "fork", "free"]),
        st.integers(0, 255),
        st.integers(0, 9),
    ),
    min_size=10,
    max_size=50,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPERATIONS, st.sampled_from([1, 2, 3, 5]), st.integers(4, 16), st.sampled_from([None, 1]))
def test_any_sequence_of_operations_agrees_with_a_dict_of_arrays(operations, block_size, num_blocks, value_prefix):
    """The model: each sequence is the array of its token ids. The cache must hold exactly those tokens;
    a refused append must change nothing; the blocks in use are the union of the tables, each counted by
    how many tables hold it; and without sharing, each sequence holds ceil(length / block_size) blocks.
    A batch (the live sequences that `pick`'s bits choose) takes what the same appends one after the other
    take on a copy of the cache, and is refused exactly when they do not all fit. The same for a pool whose
    values are its keys' prefix (value_prefix=1)."""
    cache = PagedKVCache(num_blocks, block_size, 1, 2, dtype=np.float64, value_prefix=value_prefix)
    model: dict[int, np.ndarray] = {}
    next_token = 1
    for name, pick, t_new in operations:
        live = sorted(model)
        seq = live[pick % len(live)] if live else None
        if name == "add" or seq is None:
            model[cache.add_sequence()] = np.zeros(0)
        elif name == "fork":
            model[cache.fork(seq)] = model[seq].copy()
        elif name == "free":
            cache.free(seq)
            del model[seq]
        elif name == "batch":
            chosen = [s for i, s in enumerate(live) if pick >> i & 1]
            _check_batch(cache, model, chosen, next_token, t_new)
            next_token += t_new * len(chosen)
        else:
            before = _state(cache)
            needed = _blocks_needed(before, seq, t_new, block_size)
            try:
                cache.append(seq, *_tokens(cache, next_token, t_new))
            except PoolExhaustedError:
                assert needed > before["free"]  # refused only when it does not fit
                _assert_same_state(before, _state(cache))
            else:
                assert cache.blocks_free == before["free"] - needed  # exactly the blocks it needed
                model[seq] = np.concatenate([model[seq], next_token + np.arange(t_new)])
                next_token += t_new
        _check_against(cache, model, block_size)


def _check_batch(cache: PagedKVCache, model: dict[int, np.ndarray], seqs: list[int], first: int, t_new: int) -> None:
    """append_batch against the same appends one after the other on a copy: the same tokens and blocks, or
    refused (nothing changed) exactly when the appends one by one run out of blocks."""
    before, one_by_one = _state(cache), copy.deepcopy(cache)
    tokens = [_tokens(cache, first + i * t_new, t_new) for i in range(len(seqs))]
    try:
        for seq, (k, v) in zip(seqs, tokens, strict=True):
            one_by_one.append(seq, k, v)
        fits = True
    except PoolExhaustedError:
        fits = False
    k_batch = np.stack([k for k, _ in tokens]) if seqs else np.zeros((0, 1, t_new, 2))
    v_batch = np.stack([v for _, v in tokens]) if seqs else np.zeros((0, 1, t_new, cache.value_dim))
    needed = cache.blocks_needed(seqs, t_new)
    try:
        cache.append_batch(seqs, k_batch, v_batch)
    except PoolExhaustedError:
        assert not fits and needed > before["free"]
        _assert_same_state(before, _state(cache))
        return
    assert fits and cache.blocks_free == before["free"] - needed == one_by_one.blocks_free
    _assert_same_state(_state(one_by_one), _state(cache))
    for seq, (k, _) in zip(seqs, tokens, strict=True):
        model[seq] = np.concatenate([model[seq], k[0, :, 0]])


def _blocks_needed(state: dict, seq: int, t_new: int, block_size: int) -> int:
    """The blocks an append should take, from what the cache showed before it: the ones past the last block's
    free slots, and a copy of the last block if other tables hold it too and it is about to be written."""
    table, length = state["tables"][seq], state["lengths"][seq]
    room = len(table) * block_size - length
    copy = room > 0 and t_new > 0 and state["refs"][table[-1]] > 1
    return -(-max(0, t_new - room) // block_size) + int(copy)


def _check_against(cache: PagedKVCache, model: dict[int, np.ndarray], block_size: int) -> None:
    assert set(cache.sequences) == set(model)
    for seq, ids in model.items():
        np.testing.assert_array_equal(_ids(cache, seq), ids)
        assert len(cache.block_table(seq)) == -(-len(ids) // block_size)  # a block only when the last is full
    _assert_counts_match_the_tables(cache)


def _assert_counts_match_the_tables(cache: PagedKVCache) -> None:
    """The reference counts, the blocks used and free and the slots wasted, counted afresh from the tables and
    lengths: no block leaked, none counted twice."""
    size, counts = cache.block_size, np.zeros(cache.num_blocks, np.int64)
    filled: dict[int, set[int]] = {}  # block -> the tokens each table holding it has in it
    for seq in cache.sequences:
        table = cache.block_table(seq)
        counts[list(table)] += 1
        for i, block in enumerate(table):
            filled.setdefault(block, set()).add(min(size, cache.length(seq) - i * size))
    np.testing.assert_array_equal(cache.ref_counts, counts)
    assert cache.blocks_used == np.count_nonzero(counts) == cache.num_blocks - cache.blocks_free
    assert all(len(tokens) == 1 for tokens in filled.values())  # a shared block is never written
    assert cache.slots_wasted == len(filled) * size - sum(min(tokens) for tokens in filled.values())


# --- threads ---------------------------------------------------------------------------------------


def test_appends_from_many_threads_keep_every_token_with_its_value():
    n_threads, per_thread = 8, 150
    cache = PagedKVCache(n_threads * per_thread // 4 + 8, 4, 2, 8, dtype=np.float64)
    shared, own = cache.add_sequence(), [cache.add_sequence() for _ in range(n_threads)]

    def append_many(index, barrier):
        barrier.wait()
        for step in range(per_thread):
            token = 1 + index * per_thread + step
            target = shared if step % 2 else own[index]  # every thread also appends to one common sequence
            cache.append(target, *_tokens(cache, token, 1))

    _threads(append_many, n_threads)
    ids = np.concatenate([_ids(cache, seq) for seq in [shared, *own]])
    np.testing.assert_array_equal(np.sort(ids), np.arange(1, n_threads * per_thread + 1))  # each token once
    for index, seq in enumerate(own):  # a thread's own sequence in its order
        np.testing.assert_array_equal(_ids(cache, seq), 1 + index * per_thread + np.arange(0, per_thread, 2))


def test_appends_past_the_pool_from_many_threads_are_refused_exactly():
    n_threads, per_thread, num_blocks = 8, 100, 50
    cache = PagedKVCache(num_blocks, 4, 1, 2)
    seqs = [cache.add_sequence() for _ in range(n_threads)]
    accepted = [0] * n_threads

    def append_many(index, barrier):
        barrier.wait()
        for step in range(per_thread):
            try:
                cache.append(seqs[index], *_tokens(cache, 1 + index * per_thread + step, 1))
                accepted[index] += 1
            except PoolExhaustedError:
                pass

    _threads(append_many, n_threads)
    assert [cache.length(s) for s in seqs] == accepted
    assert cache.blocks_used == num_blocks == sum(-(-a // 4) for a in accepted)  # the pool, filled
    for seq in seqs:
        assert len(_ids(cache, seq)) == cache.length(seq)


# --- a Ctrl-C between any two bytecodes: all or nothing ----------------------------------------------


def _family(value_prefix: int | None = None) -> PagedKVCache:
    """Sequences 0 and its fork 1 share a full block and a half-filled one (tokens 1, 2, 3); 2 holds one full
    block (10, 11); 3 is empty. 9 of the 12 blocks are free."""
    cache = PagedKVCache(12, 2, 2, 2, dtype=np.float64, value_prefix=value_prefix)
    cache.append(cache.add_sequence(), *_tokens(cache, 1, 3))
    cache.fork(0)
    cache.append(cache.add_sequence(), *_tokens(cache, 10, 2))
    cache.add_sequence()
    return cache


def _snapshot(cache: PagedKVCache) -> tuple:
    """The whole pool, the counts, every table and length, as values that compare with ==."""
    state = _state(cache)
    arrays = tuple(state.pop(name).tobytes() for name in ("k_pool", "v_pool", "refs"))
    return arrays + tuple(sorted(state.items())) + (cache.sequences,)


def _still_works(cache: PagedKVCache) -> None:
    """The lock is free, the counts match the tables afresh (no block leaked), and one more token for every
    sequence lands after what each held, where gather and paged_decode read it, as in a dict of arrays."""
    assert _lock_is_free(cache.lock)
    _assert_counts_match_the_tables(cache)
    seqs = cache.sequences
    model = {seq: cache.gather(seq) for seq in seqs}  # (Hkv, T, E) each
    new = [_tokens(cache, 1000 + seq, 1) for seq in seqs]
    cache.append_batch(seqs, np.stack([k for k, _ in new]), np.stack([v for _, v in new]))
    q = RNG.standard_normal((len(seqs), 4, 1, 2))
    out = paged_decode(q, cache, seqs, workers=1)  # (N, 4, 1, E)
    for i, seq in enumerate(seqs):
        keys = np.concatenate([model[seq][0], new[i][0]], axis=1)  # (Hkv, T + 1, E)
        values = np.concatenate([model[seq][1], new[i][1]], axis=1)
        gathered = cache.gather(seq)
        np.testing.assert_array_equal(gathered[0], keys)
        np.testing.assert_array_equal(gathered[1], values)
        group = q.shape[1] // cache.kv_heads  # query heads per kv head
        scores = q[i] @ np.repeat(keys, group, axis=0).swapaxes(-1, -2) / np.sqrt(cache.head_dim)  # (4, 1, T + 1)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        gold = weights / weights.sum(axis=-1, keepdims=True) @ np.repeat(values, group, axis=0)  # (4, 1, E)
        np.testing.assert_allclose(out[i], gold)


def _batch_of_one_token(cache: PagedKVCache, seqs: list[int]) -> None:
    tokens = [_tokens(cache, 30 + 10 * seq, 1) for seq in seqs]
    cache.append_batch(seqs, np.stack([k for k, _ in tokens]), np.stack([v for _, v in tokens]))  # (N, Hkv, 1, ·)


ATTEND_LAYER = MultiHeadAttention(8, 4, 2, rope=True, rng=np.random.default_rng(0), dtype=np.float64)
ONE_TOKEN = np.linspace(-1, 1, 8).reshape(1, 1, 8)  # (B, T, d_model)

CHANGES = {  # each with the code whose bytecodes are interrupted: the package, or the caches' own for attend
    "append: a copy, then a new block": (lambda c: c.append(1, *_tokens(c, 20, 4)), WHOLE_PACKAGE),
    # a copy (0), then its sibling writing in place (1), a new block after a full one (2), a first block (3)
    "append_batch: every kind of write": (lambda c: _batch_of_one_token(c, [0, 1, 2, 3]), WHOLE_PACKAGE),
    "fork": (lambda c: c.fork(0), WHOLE_PACKAGE),
    "free a sequence whose blocks another holds": (lambda c: c.free(0), WHOLE_PACKAGE),
    "free a sequence's own blocks": (lambda c: c.free(2), WHOLE_PACKAGE),
    "add_sequence": (lambda c: c.add_sequence(), WHOLE_PACKAGE),
    "attend (copy-on-write)": (lambda c: c.attend(ATTEND_LAYER, ONE_TOKEN, seq_ids=[1]), CACHE_CODE),
}
PREFIX_CHANGES = [  # the same changes to a pool whose values are its keys' prefix
    "append: a copy, then a new block",
    "append_batch: every kind of write",
    "fork",
    "free a sequence's own blocks",
]


@pytest.mark.parametrize(
    ("change", "code", "value_prefix"),
    [(*change, None) for change in CHANGES.values()] + [(*CHANGES[name], 1) for name in PREFIX_CHANGES],
    ids=[*CHANGES, *(f"{name}, values the keys' prefix" for name in PREFIX_CHANGES)],
)
def test_an_interrupt_at_any_bytecode_leaves_the_cache_before_or_after(change, code, value_prefix):
    """A KeyboardInterrupt raised at each bytecode of the call in turn (sys.settrace with f_trace_opcodes):
    the whole pool, the counts and the tables are then as before the call or as after the whole call, never
    in between, the lock is free, no block leaked, and the cache takes the next tokens and decodes them. A
    pool whose values are its keys' prefix (value_prefix) writes and copies the keys alone."""
    interrupted = _all_or_nothing(lambda: _family(value_prefix), change, _snapshot, _still_works, code)
    assert interrupted > 20  # the tracer did reach the code
