"""KVCache and MultiHeadAttention(cache=): a prefill and one-token steps equal the whole sequence at once,
token for token; a window is a ring buffer whose order does not change the attention; bad appends are
refused without touching the cache."""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import numpy as np
import pytest

from tinyattn_np import KVCache, MultiHeadAttention, attention, kv_cache_bytes, window_mask

RNG = np.random.default_rng(12)


def _tokens(cache: KVCache, t_new: int, first: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """k and v whose every entry is the token's position (first, first + 1, ...): easy to read back."""
    pos = np.arange(first, first + t_new, dtype=cache.dtype)  # (T_new,)
    k = np.broadcast_to(pos[None, None, :, None], (cache.batch, cache.kv_heads, t_new, cache.head_dim)).copy()
    return k, -k


# --- the cache itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_nbytes_is_the_byte_formula(dtype, window):
    cache = KVCache(2, 3, 10, 8, dtype=dtype, window=window)
    assert cache.nbytes == kv_cache_bytes(10, layers=1, kv_heads=3, head_dim=8, dtype=dtype, batch=2, window=window)
    assert len(cache) == 0 and cache.keys.shape == (2, 3, 0, 8)


def test_append_grows_the_views_and_keeps_every_token():
    cache = KVCache(1, 2, 6, 4)
    for start, t_new in [(0, 3), (3, 1), (4, 2)]:
        k, v = _tokens(cache, t_new, start)
        cache.append(k, v)
    assert len(cache) == 6
    np.testing.assert_array_equal(cache.keys[0, 0, :, 0], np.arange(6))
    np.testing.assert_array_equal(cache.values[0, 1, :, 3], -np.arange(6))
    np.testing.assert_array_equal(cache.positions, np.arange(6))
    assert not cache.keys.flags.writeable  # a view into the cache, not a copy to scribble on
    assert "6 tokens seen" in repr(cache)


def test_window_is_a_ring_that_knows_each_slots_position():
    cache = KVCache(1, 1, 100, 2, window=4)
    for t in range(7):
        cache.append(*_tokens(cache, 1, t))
    # tokens 4, 5, 6 overwrote slots 0, 1, 2; slot 3 still holds token 3
    np.testing.assert_array_equal(cache.keys[0, 0, :, 0], [4, 5, 6, 3])
    np.testing.assert_array_equal(cache.positions, [4, 5, 6, 3])
    k, v = cache.ordered()
    np.testing.assert_array_equal(k[0, 0, :, 0], [3, 4, 5, 6])
    np.testing.assert_array_equal(v[0, 0, :, 0], [-3, -4, -5, -6])
    # a continuation longer than the ring keeps only its own last 4 tokens
    cache.append(*_tokens(cache, 6, 7))
    assert len(cache) == 13
    np.testing.assert_array_equal(np.sort(cache.keys[0, 0, :, 0]), [9, 10, 11, 12])
    np.testing.assert_array_equal(cache.keys[0, 0, :, 0], cache.positions)


def test_attention_over_the_unordered_ring_equals_the_ordered_keys():
    """Keys are stored already rotated, so slot order is only a permutation of the keys, which softmax
    ignores as long as each value stays with its key."""
    cache = KVCache(1, 2, 50, 8, dtype=np.float64, window=5)
    for _ in range(3):
        cache.append(RNG.standard_normal((1, 2, 3, 8)), RNG.standard_normal((1, 2, 3, 8)))
    assert not np.array_equal(cache.positions, np.sort(cache.positions))  # the ring has wrapped
    q = RNG.standard_normal((1, 4, 1, 8))
    k_ordered, v_ordered = cache.ordered()
    np.testing.assert_allclose(attention(q, cache.keys, cache.values), attention(q, k_ordered, v_ordered), atol=1e-14)


def test_refused_appends_change_nothing():
    cache = KVCache(2, 2, 5, 4)
    cache.append(*_tokens(cache, 4))
    before_k, before_v = cache.keys.copy(), cache.values.copy()
    k, v = _tokens(cache, 2, 4)
    with pytest.raises(ValueError, match=r"max_tokens=5: only 1 more fit"):
        cache.append(k, v)
    with pytest.raises(TypeError, match="k must have this cache's dtype float32; got float64"):
        cache.append(k.astype(np.float64), v)
    with pytest.raises(ValueError, match=r"v must have shape \(2, 2, T_new, 4\)"):
        cache.append(k[:, :, :1], v[:1, :, :1])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        cache.append(k[:, :, :1], v)
    with pytest.raises(TypeError, match="k must be a NumPy array; got list"):
        cache.append(k.tolist(), v)
    assert len(cache) == 4
    np.testing.assert_array_equal(cache.keys, before_k)
    np.testing.assert_array_equal(cache.values, before_v)
    cache.append(k[:, :, :1], v[:, :, :1])  # what fits still goes in
    assert len(cache) == 5


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(batch=-1), ValueError, "batch must be a positive int; got -1"),
        (dict(max_tokens=0), ValueError, "max_tokens must be a positive int; got 0"),
        (dict(head_dim=2.5), TypeError, "head_dim must be a positive int"),
        (dict(window=-4), ValueError, "window must be a positive int; got -4"),
        (dict(dtype=np.int32), TypeError, "dtype must be float16, float32 or float64; got int32"),
        (dict(dtype="nonsense"), TypeError, "dtype must be float16, float32 or float64; got 'nonsense'"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs, error, message):
    sizes = dict(batch=1, kv_heads=1, max_tokens=4, head_dim=2)
    with pytest.raises(error, match=message):
        KVCache(**{**sizes, **kwargs})


# --- MultiHeadAttention(cache=) --------------------------------------------------------------------


def _model(rope: bool = True, dtype=np.float64) -> MultiHeadAttention:
    return MultiHeadAttention(32, 4, 2, rope=rope, rng=np.random.default_rng(3), dtype=dtype)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_prefill_then_decode_equals_the_whole_sequence(fused, prefill):
    """Token t's output, computed with t cached tokens and one new query (L = 1 against S = t + 1 keys,
    bottom-right), equals row t of causal attention over all tokens at once."""
    mha = _model()
    x = RNG.standard_normal((2, 10, 32))
    whole = mha(x)  # (2, 10, 32)
    cache = KVCache(2, 2, 10, 8, dtype=np.float64)
    steps = [mha(x[:, :prefill], cache=cache, fused=fused)]
    steps += [mha(x[:, t : t + 1], cache=cache, fused=fused) for t in range(prefill, 10)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, atol=1e-13)
    assert len(cache) == 10


def test_unbatched_input_and_chunks_of_any_size():
    mha = _model()
    x = RNG.standard_normal((9, 32))
    cache = KVCache(1, 2, 9, 8, dtype=np.float64)
    chunks = [mha(x[a:b], cache=cache) for a, b in [(0, 2), (2, 7), (7, 9)]]
    np.testing.assert_allclose(np.concatenate(chunks), mha(x), atol=1e-13)


def _windowed_reference(mha: MultiHeadAttention, x: np.ndarray, window: int) -> np.ndarray:
    """The whole sequence at once under an explicit band mask: query i sees keys i - window < j <= i."""
    q, k, v = mha.split_heads(x)
    y = attention(q, k, v, mask=window_mask(x.shape[1], window=window))  # (B, H, T, d_head)
    return y.swapaxes(1, 2).reshape(x.shape) @ mha.w_out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prefill", [1, 2, 6])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_window_cache_equals_the_band_mask(prefill, step, fused):
    mha = _model()
    x = RNG.standard_normal((2, 13, 32))
    cache = KVCache(2, 2, 13, 8, dtype=np.float64, window=3)
    outs = [mha(x[:, :prefill], cache=cache, fused=fused)]
    outs += [mha(x[:, t : t + step], cache=cache, fused=fused) for t in range(prefill, 13, step)]
    np.testing.assert_allclose(np.concatenate(outs, axis=1), _windowed_reference(mha, x, 3), atol=1e-13)
    assert cache.nbytes == kv_cache_bytes(13, layers=1, kv_heads=2, head_dim=8, dtype="fp64", batch=2, window=3)


def test_float32_model_and_cache_without_rope():
    mha = _model(rope=False, dtype=np.float32)
    x = RNG.standard_normal((1, 6, 32)).astype(np.float32)
    cache = KVCache(1, 2, 6, 8)
    steps = [mha(x[:, t : t + 1], cache=cache) for t in range(6)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), mha(x), atol=2e-6)


def test_cache_errors():
    mha = _model()
    x = RNG.standard_normal((2, 3, 32))
    with pytest.raises(TypeError, match="cache must be a KVCache or None; got dict"):
        mha(x, cache={})
    with pytest.raises(ValueError, match=r"cache must be KVCache\(batch=2, kv_heads=2, head_dim=8"):
        mha(x, cache=KVCache(2, 4, 8, 8, dtype=np.float64))
    with pytest.raises(ValueError, match="needs causal=True"):
        mha(x, cache=KVCache(2, 2, 8, 8, dtype=np.float64), causal=False)
    full = KVCache(2, 2, 4, 8, dtype=np.float64)
    mha(x, cache=full)
    with pytest.raises(ValueError, match="max_tokens=4: only 1 more fit"):
        mha(x, cache=full)
    assert len(full) == 3  # the refused call left the cache as it was
    with pytest.raises(TypeError, match="k must have this cache's dtype float32; got float64"):
        mha(x, cache=KVCache(2, 2, 8, 8))


def test_the_cache_attends_for_the_layer():
    """MultiHeadAttention(x, cache=c) is c.attend(layer, x), the heads merged and projected by W_out."""
    mha = _model()
    x = RNG.standard_normal((2, 5, 32))
    through_layer, direct = KVCache(2, 2, 8, 8, dtype=np.float64), KVCache(2, 2, 8, 8, dtype=np.float64)
    mha(x[:, :4], cache=through_layer)
    direct.attend(mha, x[:, :4])
    y = direct.attend(mha, x[:, 4:])  # (B, H, 1, d_head): a decode step at position 4
    assert y.shape == (2, 4, 1, 8) and len(direct) == 5
    np.testing.assert_array_equal(y.swapaxes(1, 2).reshape(2, 1, 32) @ mha.w_out, mha(x[:, 4:], cache=through_layer))


def test_the_cache_door_checks_the_layer_and_x():
    cache = KVCache(2, 2, 8, 8, dtype=np.float64)
    with pytest.raises(TypeError, match="layer must be a MultiHeadAttention; got str"):
        cache.attend("mha", RNG.standard_normal((2, 1, 32)))
    with pytest.raises(ValueError, match=r"x must be \(B, T, 32\); got shape \(1, 32\)"):
        cache.attend(_model(), RNG.standard_normal((1, 32)))
    with pytest.raises(TypeError, match="fused must be True or False"):
        cache.attend(_model(), RNG.standard_normal((2, 1, 32)), fused="yes")
    assert len(cache) == 0


# --- appends from several threads ------------------------------------------------------------------


def _threads(target, n_threads: int, *args) -> None:
    """Run target(thread_index, *args) in n_threads threads started together, with the GIL handed over
    every microsecond so that the threads interleave inside append (the default 5 ms hides races)."""
    barrier, errors = threading.Barrier(n_threads), []

    def run(index):
        try:
            target(index, barrier, *args)
        except BaseException as err:  # a thread's exception would otherwise only be printed
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]


def _token(cache: KVCache, token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One token whose k entries all equal its id and whose v entries equal -id: a slot read back says
    which token it holds, and whether its k and v came from the same one."""
    k = np.full((cache.batch, cache.kv_heads, 1, cache.head_dim), token_id, cache.dtype)
    return k, -k


@pytest.mark.parametrize("window", [None, 64])
def test_appends_from_many_threads_keep_every_token_with_its_value(window):
    n_threads, per_thread = 8, 200
    cache = KVCache(2, 2, n_threads * per_thread, 16, dtype=np.float64, window=window)

    def append_many(index, barrier):
        barrier.wait()
        for step in range(per_thread):
            cache.append(*_token(cache, 1 + index * per_thread + step))  # ids 1 .. 1,600, each once

    _threads(append_many, n_threads)
    assert len(cache) == n_threads * per_thread  # nothing lost, nothing counted twice
    keys, values = cache.keys, cache.values  # (2, 2, kept, 16)
    np.testing.assert_array_equal(values, -keys)  # every slot: k and v of the same token
    ids = keys[0, 0, :, 0]  # (kept,)
    assert np.all(keys == ids[None, None, :, None])  # no slot mixes two tokens across heads or channels
    if window is None:
        np.testing.assert_array_equal(np.sort(ids), np.arange(1, n_threads * per_thread + 1))  # each token once
    else:
        assert len(set(ids.tolist())) == window  # the ring holds `window` distinct tokens


def test_appends_past_the_end_from_many_threads_are_refused_exactly():
    n_threads, per_thread, max_tokens = 8, 250, 1600
    cache = KVCache(1, 1, max_tokens, 4, dtype=np.float64)
    accepted, refused = [0] * n_threads, [0] * n_threads

    def append_many(index, barrier):
        barrier.wait()
        for step in range(per_thread):
            try:
                cache.append(*_token(cache, 1 + index * per_thread + step))
                accepted[index] += 1
            except ValueError:
                refused[index] += 1

    _threads(append_many, n_threads)
    assert len(cache) == sum(accepted) == max_tokens
    assert sum(refused) == n_threads * per_thread - max_tokens
    assert len(set(cache.keys[0, 0, :, 0].tolist())) == max_tokens  # 1,600 distinct tokens, none overwritten


def test_a_reader_holding_the_lock_sees_keys_and_values_that_match():
    n_threads, per_thread = 4, 300
    cache = KVCache(1, 2, n_threads * per_thread, 8, dtype=np.float64, window=16)
    mismatched = []

    def append_or_read(index, barrier):
        barrier.wait()
        for step in range(per_thread):
            if index == 0:  # the reader: one consistent pair of copies under the lock
                with cache.lock:
                    keys, values = cache.keys.copy(), cache.values.copy()
                if not np.array_equal(values, -keys):
                    mismatched.append(step)
            else:
                cache.append(*_token(cache, 1 + index * per_thread + step))

    _threads(append_or_read, n_threads)
    assert not mismatched
    assert len(cache) == (n_threads - 1) * per_thread


def test_a_cache_with_its_lock_still_copies_and_pickles():
    """The lock cannot be copied; the copy gets its own and the same tokens, and the two then part ways."""
    cache = KVCache(1, 2, 8, 4, window=3)
    for t in range(5):
        cache.append(*_tokens(cache, 1, t))
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert len(twin) == 5 and twin.lock is not cache.lock
        np.testing.assert_array_equal(twin.keys, cache.keys)
        np.testing.assert_array_equal(twin.positions, cache.positions)
        twin.append(*_tokens(twin, 1, 5))
        assert len(twin) == 6 and len(cache) == 5
