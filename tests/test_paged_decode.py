"""paged_decode and cascade_decode equal attention() over each sequence laid out contiguously, for any block
size, splits and workers (the same bits for any workers), and refuse before allocating a step that does not
fit; MultiHeadAttention decodes against a paged cache as it does against the whole sequence, each row at its
own positions."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import assert_close
from test_kvcache import _under_address_space_limit

from tinyattn_np import (
    AttentionMemoryError,
    KVCache,
    MultiHeadAttention,
    PagedKVCache,
    PoolExhaustedError,
    attention,
    cascade_decode,
    flash_attention,
    paged_decode,
)
from tinyattn_np._paged_kernel import consecutive_runs, sequence_chunks, shared_prefix
from tinyattn_np.measure import traced_peak
from tinyattn_np.paged_decode import paged_attention, paged_decode_bytes

RNG = np.random.default_rng(190)
guard_module = importlib.import_module("tinyattn_np._guard")  # the memory guard reads the memory here


def _filled(lengths, block_size, *, kv_heads=2, head_dim=8, dtype=np.float64, interleave=True, spare=2):
    """A cache holding sequences of these lengths, grown a few tokens at a time in turn (so that their
    blocks interleave in the pool), or one after the other (each in one run of blocks); `spare` free blocks."""
    blocks = sum(-(-n // block_size) for n in lengths) + spare
    cache = PagedKVCache(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    seqs = [cache.add_sequence() for _ in lengths]
    steps = range(0, max(lengths, default=0), 3) if interleave else [0]
    for start in steps:
        for seq, n in zip(seqs, lengths, strict=True):
            t_new = min(3, n - start) if interleave else n
            if t_new > 0:
                shape = (kv_heads, t_new, head_dim)
                cache.append(seq, RNG.standard_normal(shape).astype(dtype), RNG.standard_normal(shape).astype(dtype))
    return cache, seqs


def _gold(q, cache, seqs, scale=None):
    """attention() over each sequence laid out contiguously: the definition paged_decode must meet."""
    return np.stack([attention(q[i], *cache.gather(seq), scale=scale) for i, seq in enumerate(seqs)])


# --- paged_decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("interleave", [True, False])
def test_equals_attention_over_each_sequence_for_any_block_size(block_size, interleave):
    cache, seqs = _filled([37, 5, 80, 1], block_size, interleave=interleave)
    q = RNG.standard_normal((4, 6, 1, 8))
    out, lse = paged_decode(q, cache, seqs, return_lse=True)
    assert_close(out, _gold(q, cache, seqs), np.float64)
    for i, seq in enumerate(seqs):  # the logsumexp too, as flash_attention gives it
        _, lse_gold = flash_attention(q[i], *cache.gather(seq), return_lse=True)
        assert_close(lse[i], lse_gold, np.float64)


@pytest.mark.parametrize("interleave", [True, False])
def test_the_plain_paged_attention_is_what_paged_decode_computes(interleave):
    """paged_attention, each sequence gathered through its block table and attended, from the pools, the tables
    and the lengths alone; paged_decode reads the same pages in place."""
    cache, seqs = _filled([37, 1, 20, 0], 4, interleave=interleave)
    q = RNG.standard_normal((4, 6, 2, 8))
    pages = cache.pages(seqs)
    plain = paged_attention(q, pages.k_pool, pages.v_pool, pages.tables, pages.lengths)
    np.testing.assert_allclose(plain, _gold(q, cache, seqs), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(paged_decode(q, cache, seqs, kv_splits=2), plain, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kv_splits", [None, 1, 2, 5, 1000])
def test_any_number_of_splits_and_the_same_bits_for_any_workers(kv_splits):
    cache, seqs = _filled([300, 41, 129], 4)
    q = RNG.standard_normal((3, 4, 2, 8))  # two queries per sequence: each sees every key
    one = paged_decode(q, cache, seqs, kv_splits=kv_splits, workers=1)
    assert_close(one, _gold(q, cache, seqs), np.float64)
    for workers in (2, 3, 8):
        np.testing.assert_array_equal(paged_decode(q, cache, seqs, kv_splits=kv_splits, workers=workers), one)


def test_blocks_of_many_pages_and_float32_stay_within_float32_rounding():
    cache, seqs = _filled([3000, 700], 16, dtype=np.float32)  # blocks of 256 keys cross many pages
    q = RNG.standard_normal((2, 8, 1, 8)).astype(np.float32)
    out = paged_decode(q, cache, seqs, kv_splits=3)
    assert out.dtype == np.float32
    gold = np.stack(
        [
            attention(q[i].astype(np.float64), *(x.astype(np.float64) for x in cache.gather(s)))
            for i, s in enumerate(seqs)
        ]
    )
    assert_close(out, gold, np.float32)


def test_float16_cache_is_computed_in_float32():
    cache, seqs = _filled([50, 20], 8, dtype=np.float16)
    q = RNG.standard_normal((2, 4, 1, 8)).astype(np.float16)
    out, lse = paged_decode(q, cache, seqs, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    gold = np.stack([attention(*(x.astype(np.float32) for x in (q[i], *cache.gather(s)))) for i, s in enumerate(seqs)])
    assert_close(out.astype(np.float32), gold, np.float16)


def test_sequence_order_repeats_and_an_empty_sequence():
    cache, seqs = _filled([10, 20], 4)
    empty = cache.add_sequence()
    order = [seqs[1], empty, seqs[0], seqs[1]]
    q = RNG.standard_normal((4, 2, 1, 8))
    out, lse = paged_decode(q, cache, order, scale=0.3, return_lse=True)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))  # no key: out 0, lse -inf, never NaN
    for i in (0, 2, 3):
        assert_close(out[i], attention(q[i], *cache.gather(order[i]), scale=0.3), np.float64)


@pytest.mark.parametrize("decode", [paged_decode, cascade_decode])
@pytest.mark.parametrize("q_shape", [(0, 2, 1, 8), (1, 2, 0, 8), (1, 0, 1, 8)])
def test_no_sequence_no_query_no_head(decode, q_shape):
    cache, seqs = _filled([5], 2)
    out, lse = decode(np.zeros(q_shape), cache, seqs[: q_shape[0]], return_lse=True)
    assert out.shape == q_shape and lse.shape == q_shape[:-1]


def test_a_shared_block_is_read_by_every_sequence_that_holds_it():
    cache, (parent,) = _filled([13], 4, spare=4)
    child = cache.fork(parent)
    cache.append(child, RNG.standard_normal((2, 9, 8)), RNG.standard_normal((2, 9, 8)))
    q = RNG.standard_normal((2, 2, 1, 8))
    assert_close(paged_decode(q, cache, [parent, child]), _gold(q, cache, [parent, child]), np.float64)


@pytest.mark.parametrize(
    ("q_shape", "seq_ids", "kwargs", "error", "message"),
    [
        ((1, 2, 1, 8), [0], {"kv_splits": 0}, ValueError, "kv_splits must be a positive int; got 0"),
        ((1, 2, 1, 8), [0], {"workers": 1.5}, TypeError, "workers must be a positive int"),
        ((1, 2, 1, 8), [0], {"scale": float("inf")}, ValueError, "scale must be a finite number"),
        ((1, 2, 1, 8), [0], {"return_lse": "yes"}, TypeError, "return_lse must be True or False"),
        ((1, 3, 1, 8), [0], {}, ValueError, r"q must be \(N, Hq, L, 8\)"),
        ((1, 2, 8), [0], {}, ValueError, r"q must be \(N, Hq, L, 8\)"),
        ((2, 2, 1, 8), [0], {}, ValueError, "q has 2 sequences"),
        ((1, 2, 1, 8), [5], {}, ValueError, "sequence 5 is not in this cache"),
        ((1, 2, 1, 8), 0, {}, TypeError, "seq_ids must be a sequence of ids"),
    ],
)
def test_bad_arguments_are_named(q_shape, seq_ids, kwargs, error, message):
    cache, _ = _filled([5], 2)
    with pytest.raises(error, match=message):
        paged_decode(RNG.standard_normal(q_shape), cache, seq_ids, **kwargs)


def test_a_cache_of_another_kind_is_named():
    with pytest.raises(TypeError, match="cache must be a PagedKVCache; got KVCache"):
        paged_decode(np.zeros((1, 2, 1, 8)), KVCache(1, 2, 4, 8), [0])


def test_the_chunks_and_runs_that_paged_decode_reads():
    assert consecutive_runs([7, 8, 9, 3, 4, 6]) == [(7, 3), (3, 2), (6, 1)]
    assert consecutive_runs([]) == []
    chunks = sequence_chunks(0, [5, 6, 2, 9], 14, 4, 3)  # 14 keys in 4 pages of 4: chunks of whole pages
    assert [(c.pages, c.keys) for c in chunks] == [((5,), 4), ((6,), 4), ((2, 9), 6)]
    assert sequence_chunks(0, [5, 6], 0, 4, 3) == []  # no key, no chunk
    assert [c.keys for c in sequence_chunks(1, [1, 2], 5, 4, 9)] == [4, 1]  # more splits than pages: the pages


# --- a pool whose values are the keys' prefix: the latent of multi-head latent attention, read once --


def _prefix_pool(
    lengths: list[int], dtype=np.float64, head_dim: int = 12, prefix: int = 8, step: int = 2, block: int = 3
) -> tuple[PagedKVCache, list[int]]:
    """A pool of blocks of `block` tokens whose values are the keys' first `prefix` of head_dim numbers:
    sequences of these lengths grown `step` tokens at a time in turn (their blocks interleave), then a fork of
    the first grown by 4 (a shared prefix, copy-on-write)."""
    blocks = sum(-(-n // block) for n in lengths) + 3
    cache = PagedKVCache(blocks, block, 2, head_dim, dtype=dtype, value_prefix=prefix)
    seqs = [cache.add_sequence() for _ in lengths]
    for start in range(0, max(lengths), step):
        for seq, n in zip(seqs, lengths, strict=True):
            if start < n:
                k = RNG.standard_normal((2, min(step, n - start), head_dim)).astype(dtype)
                cache.append(seq, k, k[..., :prefix])
    seqs.append(cache.fork(seqs[0]))
    k = RNG.standard_normal((2, 4, head_dim)).astype(dtype)
    cache.append(seqs[-1], k, k[..., :prefix])
    return cache, seqs


@pytest.mark.parametrize("decode", [paged_decode, cascade_decode])
@pytest.mark.parametrize("kv_splits", [None, 2])
def test_decoding_a_prefix_pool_reads_the_values_from_the_keys(decode, kv_splits):
    """paged_decode and cascade_decode over a pool whose values are its keys' prefix give attention(q, K,
    K[..., :8]) for every sequence: out 8 numbers a query."""
    cache, seqs = _prefix_pool([17, 5, 1])
    q = RNG.standard_normal((len(seqs), 4, 2, 12))
    out = decode(q, cache, seqs, kv_splits=kv_splits)
    assert out.shape == (4, 4, 2, 8)
    for i, seq in enumerate(seqs):
        keys, values = cache.gather(seq)  # (Hkv, T, 12), (Hkv, T, 8)
        np.testing.assert_array_equal(values, keys[..., :8])
        gold = attention(q[i], keys, keys[..., :8])  # (4, 2, 8)
        np.testing.assert_allclose(out[i], gold, rtol=1e-12, atol=1e-14, err_msg=f"sequence {seq}")
    one_pool = decode(q, cache, seqs, kv_splits=kv_splits, workers=1)
    np.testing.assert_array_equal(decode(q, cache, seqs, kv_splits=kv_splits, workers=3), one_pool)


@pytest.mark.parametrize(("dtype", "cascade"), [(np.float32, False), (np.float16, False), (np.float64, True)])
def test_the_peak_estimate_of_a_prefix_pool_bounds_what_tracemalloc_sees(dtype, cascade):
    """paged_decode_bytes, with values value_prefix wide, is an upper bound of the peak (Python's own objects
    add a few tens of KiB, a list entry per page among them: the sizes and pages of 16 tokens are those of
    test_paged_decode's bound, where they are small beside the arrays) and within twice the peak of one worker."""
    cache, seqs = _prefix_pool([3000, 500, 2000], dtype, head_dim=64, prefix=48, step=100, block=16)
    q = RNG.standard_normal((len(seqs), 32, 1, 64)).astype(dtype)  # 16 query heads a kv head: arrays beside objects
    decode = cascade_decode if cascade else paged_decode
    decode(q, cache, seqs, workers=2)  # the first call's one-time allocations
    for workers in (1, 2):
        _, peak = traced_peak(decode, q, cache, seqs, workers=workers)
        estimate = paged_decode_bytes(q, cache, seqs, None, workers, cascade)
        assert peak - 64 * 1024 <= estimate, (workers, peak, estimate)
        assert estimate <= 2 * peak or workers > 1, (workers, peak, estimate)


# --- cascade_decode --------------------------------------------------------------------------------


def _samples(n, prompt, block_size, own):
    """n sequences forked from one prompt, each then grown by its own tokens: the parallel-sampling layout."""
    cache, (parent,) = _filled([prompt], block_size, spare=sum(-(-t // block_size) + 1 for t in own))
    seqs = [parent] + [cache.fork(parent) for _ in range(n - 1)]
    for seq, t_new in zip(seqs, own, strict=True):
        if t_new:
            cache.append(seq, RNG.standard_normal((2, t_new, 8)), RNG.standard_normal((2, t_new, 8)))
    return cache, seqs


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("own", [[5, 0, 17, 3], [0, 0, 0, 0], [40, 41, 1, 2]])
def test_cascade_equals_attending_to_the_whole_of_each(block_size, own):
    cache, seqs = _samples(4, 50, block_size, own)
    pages, keys = shared_prefix([list(cache.block_table(s)) for s in seqs], [cache.length(s) for s in seqs], block_size)
    assert keys == (50 if not any(own) else 50 // block_size * block_size)  # the prompt's shared blocks
    q = RNG.standard_normal((4, 6, 1, 8))
    out, lse = cascade_decode(q, cache, seqs, return_lse=True)
    assert_close(out, _gold(q, cache, seqs), np.float64)
    _, lse_paged = paged_decode(q, cache, seqs, return_lse=True)
    assert_close(lse, lse_paged, np.float64)
    for workers in (1, 3):
        np.testing.assert_array_equal(
            cascade_decode(q, cache, seqs, kv_splits=2, workers=workers),
            cascade_decode(q, cache, seqs, kv_splits=2, workers=2),
        )


def test_cascade_without_a_shared_prefix_is_paged_decode():
    cache, seqs = _filled([30, 12], 4)
    q = RNG.standard_normal((2, 2, 1, 8))
    assert shared_prefix([list(cache.block_table(s)) for s in seqs], [30, 12], 4) == (0, 0)
    np.testing.assert_array_equal(cascade_decode(q, cache, seqs), paged_decode(q, cache, seqs))


# --- MultiHeadAttention against a paged cache ------------------------------------------------------


def _decoded(mha, xs, prompts, cache, fused=True):
    """Prefill each sequence's prompt, then decode the rest one token per step for all at once: the outputs."""
    seqs = [cache.add_sequence() for _ in xs]
    outs = [
        [mha(x[None, :p], cache=cache, seq_ids=[s], fused=fused)[0]] for x, p, s in zip(xs, prompts, seqs, strict=True)
    ]
    for step in range(xs[0].shape[0] - max(prompts)):
        rows = np.stack([x[p + step] for x, p in zip(xs, prompts, strict=True)])[:, None]  # (B, 1, C)
        for i, y in enumerate(mha(rows, cache=cache, seq_ids=seqs, fused=fused)):
            outs[i].append(y)
    return [np.concatenate(o) for o in outs], seqs


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_prefill_and_decoding_of_different_lengths_equal_the_whole_sequence(fused, block_size):
    mha = MultiHeadAttention(32, 4, 2, rope=True, rng=3, dtype=np.float64)
    prompts = [5, 9, 2]
    xs = [RNG.standard_normal((p + 6, 32)) for p in prompts]
    cache = PagedKVCache(64, block_size, 2, 8, dtype=np.float64)
    outs, seqs = _decoded(mha, xs, prompts, cache, fused)
    for x, out, seq in zip(xs, outs, seqs, strict=True):
        n = out.shape[0]
        assert_close(out, mha(x[None, :n])[0], np.float64)  # each row at its own positions
        assert cache.length(seq) == n


def test_a_continuation_of_several_tokens_is_a_chunked_prefill():
    mha = MultiHeadAttention(16, 2, 1, rope=True, rng=4, dtype=np.float64)
    x = RNG.standard_normal((1, 11, 16))
    cache = PagedKVCache(8, 2, 1, 8, dtype=np.float64)
    seq = cache.add_sequence()
    parts = [mha(x[:, a:b], cache=cache, seq_ids=[seq]) for a, b in [(0, 4), (4, 5), (5, 11)]]
    assert_close(np.concatenate(parts, axis=1), mha(x), np.float64)


def test_float32_paged_decoding_equals_the_kv_cache():
    mha = MultiHeadAttention(64, 8, 2, rope=True, rng=5)
    x = RNG.standard_normal((2, 40, 64)).astype(np.float32)
    contiguous = KVCache(2, 2, 40, 8)
    paged = PagedKVCache(20, 16, 2, 8)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    for t in range(40):
        assert_close(
            mha(x[:, t : t + 1], cache=paged, seq_ids=seqs), mha(x[:, t : t + 1], cache=contiguous), np.float32
        )


def test_a_refused_step_changes_no_sequence():
    mha = MultiHeadAttention(16, 2, 2, rope=True, rng=6)
    cache = PagedKVCache(3, 2, 2, 8)
    seqs = [cache.add_sequence() for _ in range(3)]
    mha(RNG.standard_normal((3, 1, 16)), cache=cache, seq_ids=seqs)  # one block each: the pool is full
    mha(RNG.standard_normal((3, 1, 16)), cache=cache, seq_ids=seqs)
    before = cache.k_pool.copy(), [cache.length(s) for s in seqs]
    with pytest.raises(PoolExhaustedError, match="need 3 new blocks"):
        mha(RNG.standard_normal((3, 1, 16)), cache=cache, seq_ids=seqs)
    np.testing.assert_array_equal(cache.k_pool, before[0])
    assert [cache.length(s) for s in seqs] == before[1] == [2, 2, 2]


@pytest.mark.parametrize(
    ("cache_args", "kwargs", "error", "message"),
    [
        ((4, 2, 1, 8), {"seq_ids": [0]}, ValueError, r"PagedKVCache\(\.\.\., kv_heads=2, head_dim=8, dtype=float32\)"),
        ((4, 2, 2, 8, np.float64), {"seq_ids": [0]}, ValueError, "dtype=float64"),
        ((4, 2, 2, 8), {"seq_ids": None}, TypeError, "seq_ids must be a sequence of ids"),
        ((4, 2, 2, 8), {"seq_ids": [0, 0]}, ValueError, "x has 1 sequences"),
        ((4, 2, 2, 8), {"seq_ids": [0], "causal": False}, ValueError, "needs causal=True"),
    ],
)
def test_bad_paged_calls_are_named(cache_args, kwargs, error, message):
    mha = MultiHeadAttention(16, 2, 2, rng=7)
    cache = PagedKVCache(*cache_args)
    cache.add_sequence()
    with pytest.raises(error, match=message):
        mha(np.zeros((1, 1, 16), np.float32), cache=cache, **kwargs)


def test_seq_ids_without_a_paged_cache_is_refused():
    mha = MultiHeadAttention(16, 2, 2, rng=8)
    with pytest.raises(ValueError, match="seq_ids names sequences of a PagedKVCache"):
        mha(np.zeros((1, 1, 16), np.float32), seq_ids=[0])
    with pytest.raises(ValueError, match="seq_ids is for a PagedKVCache"):
        mha(np.zeros((1, 1, 16), np.float32), cache=KVCache(1, 2, 4, 8), seq_ids=[0])


def test_the_paged_cache_attends_for_the_layer():
    """MultiHeadAttention(x, cache=c, seq_ids=) is c.attend(layer, x, seq_ids=), merged and projected by W_out."""
    mha = MultiHeadAttention(16, 2, 2, rope=True, rng=9, dtype=np.float64)
    x = RNG.standard_normal((2, 3, 16))
    caches = [PagedKVCache(8, 2, 2, 8, dtype=np.float64) for _ in range(2)]
    seqs = [[cache.add_sequence(), cache.add_sequence()] for cache in caches]
    mha(x[:, :2], cache=caches[0], seq_ids=seqs[0])
    caches[1].attend(mha, x[:, :2], seq_ids=seqs[1])
    y = caches[1].attend(mha, x[:, 2:], seq_ids=seqs[1])  # (B, H, 1, d_head)
    assert y.shape == (2, 2, 1, 8) and [caches[1].length(s) for s in seqs[1]] == [3, 3]
    out = (y.swapaxes(1, 2).reshape(2, 16) @ mha.w_out).reshape(2, 1, 16)  # one row a token: the heads side by side
    np.testing.assert_array_equal(out, mha(x[:, 2:], cache=caches[0], seq_ids=seqs[0]))
    with pytest.raises(TypeError, match="layer must be a MultiHeadAttention; got NoneType"):
        caches[1].attend(None, x, seq_ids=seqs[1])


# --- the memory a step takes, refused before it is allocated ----------------------------------------


@pytest.mark.parametrize(
    ("lengths", "n_q", "dtype", "kv_splits", "cascade"),
    [
        ([3000, 500, 2000, 1], 1, np.float32, None, False),
        ([3000, 500, 2000, 1], 1, np.float32, 3, False),
        ([300] * 200, 1, np.float32, None, False),  # a large batch of short sequences
        ([300] * 200, 4, np.float16, 2, False),  # a float16 pool, read page by page
        ([3000, 500, 2000, 1], 2, np.float64, None, True),
    ],
)
def test_the_peak_estimate_bounds_what_tracemalloc_sees(lengths, n_q, dtype, kv_splits, cascade):
    """paged_decode_bytes is an upper bound of the peak (the arrays; Python's own objects add a few tens of
    KiB), and within twice the peak of one worker (with two, the peak depends on how their work overlaps)."""
    cache, seqs = _filled(lengths, 16, head_dim=64, dtype=dtype, interleave=False)
    q = RNG.standard_normal((len(seqs), 8, n_q, 64)).astype(dtype)
    decode = cascade_decode if cascade else paged_decode
    decode(q, cache, seqs, kv_splits=kv_splits, workers=2)  # the first call's one-time allocations
    for workers in (1, 2):
        _, peak = traced_peak(decode, q, cache, seqs, kv_splits=kv_splits, workers=workers)
        estimate = paged_decode_bytes(q, cache, seqs, kv_splits, workers, cascade)
        assert peak - 64 * 1024 <= estimate, (workers, peak, estimate)
        assert estimate <= 2 * peak or workers > 1, (workers, peak, estimate)


@pytest.mark.parametrize("decode", [paged_decode, cascade_decode])
def test_a_step_that_does_not_fit_is_refused_before_it_is_made(decode, monkeypatch):
    cache, seqs = _filled([40, 7], 4)
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1024)
    message = rf"{decode.__name__} would allocate .* \(2 sequences of 6 query rows\), but only 1\.0 KiB"
    with pytest.raises(AttentionMemoryError, match=message):
        decode(RNG.standard_normal((2, 6, 1, 8)), cache, seqs)
    mha = MultiHeadAttention(16, 2, 2, rope=True, rng=6, dtype=np.float64)
    with pytest.raises(AttentionMemoryError, match="PagedKVCache.attend would allocate"):
        mha(RNG.standard_normal((2, 1, 16)), cache=cache, seq_ids=seqs)
    assert [cache.length(seq) for seq in seqs] == [40, 7]


def test_a_large_batch_beyond_the_address_space_limit_is_refused_before_anything_is_allocated():
    """q of 32 MiB for 1,024 sequences exists; the step's scaled copy alone would not fit in the 16 MiB left."""
    setup = "; ".join(
        [
            "cache = tinyattn_np.PagedKVCache(1024, 16, 8, 128)",
            "seqs = [cache.add_sequence() for _ in range(1024)]",
            "k = np.ones((1024, 8, 3, 128), np.float32)",
            "cache.append_batch(seqs, k, k)",
            "q = np.ones((1024, 64, 1, 128), np.float32)",
        ]
    )
    printed = _under_address_space_limit(setup, "tinyattn_np.paged_decode(q, cache, seqs)", headroom=16 * 2**20)
    assert printed.startswith("refused: paged_decode would allocate"), printed
    assert "pass fewer sequences per call" in printed
