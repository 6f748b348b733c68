"""KVCache and MultiHeadAttention(cache=): a prefill and one-token steps equal the whole sequence at once,
token for token; a window is a ring buffer whose order does not change the attention; bad appends are
refused without touching the cache."""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import tinyattn_np
from tinyattn_np import (
    KVCache,
    MultiHeadAttention,
    attention,
    flash_decode,
    kv_cache_bytes,
    latent_cache_bytes,
    window_mask,
)

RNG = np.random.default_rng(12)
ROOT = Path(__file__).resolve().parents[1]


def _tokens(cache: KVCache, t_new: int, first: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """k and v whose every entry is the token's position (first, first + 1, ...): easy to read back. v is -k,
    or, for a cache whose values are its keys' prefix, k's first value_prefix numbers."""
    pos = np.arange(first, first + t_new, dtype=cache.dtype)  # (T_new,)
    k = np.broadcast_to(pos[None, None, :, None], (cache.batch, cache.kv_heads, t_new, cache.head_dim)).copy()
    return k, (-k if cache.value_prefix is None else k[..., : cache.value_prefix])


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
    with pytest.raises(ValueError, match="k and v must have the same number of tokens"):
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


def test_a_cache_larger_than_memory_is_refused_before_it_is_made():
    message = r"KVCache would allocate 8\.0 TiB .* of memory is available: lower max_tokens or batch, or keep a window="
    with pytest.raises(MemoryError, match=message):
        KVCache(2**10, 8, 2**20, 128)  # 8 TiB: np.zeros could even succeed (the OS maps pages only when written)
    assert KVCache(2**10, 8, 2**20, 128, window=4).nbytes == 2**10 * 8 * 4 * 128 * 4 * 2  # a window keeps 4 slots


def _under_address_space_limit(setup: str, call: str, headroom: int = 32 * 2**20) -> str:
    """What a fresh Python prints that runs `setup`, then caps its address space (RLIMIT_AS, what ulimit -v
    sets) at what it has mapped plus `headroom` bytes, then runs `call`: "refused: <message>" for the guard's
    AttentionMemoryError, "<type>: <message>" for any other MemoryError (an allocation was tried), "ran"."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    script = "\n".join(
        [
            "import resource, numpy as np, tinyattn_np",
            setup,
            'status = open("/proc/self/status").read().splitlines()',
            'mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))',
            f"resource.setrlimit(resource.RLIMIT_AS, (mapped + {headroom}, resource.getrlimit(resource.RLIMIT_AS)[1]))",
            "try:",
            f"    {call}",
            "except tinyattn_np.AttentionMemoryError as error:",
            '    print("refused:", error)',
            "except MemoryError as error:",
            '    print(type(error).__name__ + ":", error)',
            "else:",
            '    print("ran")',
        ]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_cache_beyond_the_address_space_limit_is_refused_before_anything_is_allocated():
    """8 GiB fit in this machine's memory but not under the limit: the guard says so; without it NumPy would
    try, and fail with its own MemoryError (or, without a limit, map pages that the OS cannot back later)."""
    printed = _under_address_space_limit("", "tinyattn_np.KVCache(1, 8, 2**20, 128)")
    assert printed.startswith("refused: KVCache would allocate 8.0 GiB"), printed
    assert "lower max_tokens" in printed


def test_the_views_cannot_be_made_writable():
    cache = KVCache(1, 2, 6, 4, window=4)
    cache.append(*_tokens(cache, 3))
    for view in (cache.keys, cache.values, *cache.ordered()):
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0, 0, 0] = 1.0
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            view.flags.writeable = True
        assert not np.asarray(view.base).flags.writeable  # its base gives no writable array either
    np.testing.assert_array_equal(cache.keys[0, 0, :, 0], [0, 1, 2])


# --- values that are the keys' prefix: the latent of multi-head latent attention, stored once ---------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("window", [None, 3])
def test_values_as_the_keys_prefix_are_stored_once(dtype, window):
    """A latent of 8 + 4 numbers a token: the cache allocates the keys alone, memory.latent_cache_bytes of one
    kv head, and its values are a view of the keys' first 8 numbers (the same memory), before and after the
    ring wraps."""
    cache = KVCache(2, 1, 10, 12, dtype=dtype, window=window, value_prefix=8)
    assert cache.nbytes == latent_cache_bytes(10, layers=1, kv_rank=8, rope_dim=4, dtype=dtype, batch=2, window=window)
    assert cache.nbytes == 2 * cache.slots * 12 * np.dtype(dtype).itemsize and cache.value_dim == 8
    assert cache.values.shape == (2, 1, 0, 8) and "value_prefix=8" in repr(cache)
    k = RNG.standard_normal((2, 1, 5, 12)).astype(dtype)
    for start in range(0, 5, 2):
        cache.append(k[:, :, start : start + 2], k[:, :, start : start + 2, :8])
    assert np.shares_memory(cache.values, cache.keys) and not cache.values.flags.writeable
    np.testing.assert_array_equal(cache.values, cache.keys[..., :8])
    keys, values = cache.ordered()
    np.testing.assert_array_equal(keys, k[:, :, -cache.slots :])
    np.testing.assert_array_equal(values, k[:, :, -cache.slots :, :8])
    assert np.shares_memory(values, keys)


def test_decoding_over_a_prefix_cache_reads_the_values_from_the_keys():
    cache = KVCache(2, 1, 40, 12, dtype=np.float64, value_prefix=8)
    k = RNG.standard_normal((2, 1, 40, 12))
    cache.append(k, k[..., :8])
    q = RNG.standard_normal((2, 4, 1, 12))
    gold = attention(q, k, k[..., :8])  # (2, 4, 1, 8)
    np.testing.assert_allclose(flash_decode(q, cache.keys, cache.values, kv_splits=3), gold, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(value_prefix=13), ValueError, r"value_prefix must be at most head_dim=12 .*; got 13"),
        (dict(value_prefix=0), ValueError, "value_prefix must be a positive int; got 0"),
        (dict(value_prefix=8.0), TypeError, "value_prefix must be a positive int"),
    ],
)
def test_a_bad_value_prefix_is_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        KVCache(1, 1, 4, 12, **kwargs)


def test_values_that_are_not_the_keys_prefix_are_refused_and_change_nothing():
    cache = KVCache(1, 2, 6, 4, value_prefix=3)
    cache.append(*_tokens(cache, 2))
    before = _kv_snapshot(cache)
    k, v = _tokens(cache, 2, 2.0)
    with pytest.raises(ValueError, match=r"v must be k's first value_prefix=3 numbers \(k\[\.\.\., :3\]\)"):
        cache.append(k, v + 1)
    with pytest.raises(ValueError, match=r"v must have shape \(1, 2, T_new, 3\) \(batch, kv_heads, T_new, value_"):
        cache.append(k, k)  # the whole key as the value: this cache keeps values 3 wide
    with pytest.raises(ValueError, match="k and v must have the same number of tokens"):
        cache.append(k, v[:, :, :1])
    assert _kv_snapshot(cache) == before
    cache.append(k, v)  # the keys' prefix goes in
    assert len(cache) == 4


def test_a_layer_with_values_of_its_own_refuses_a_prefix_cache():
    cache = KVCache(2, 2, 8, 8, dtype=np.float64, value_prefix=4)
    with pytest.raises(ValueError, match=r"apart from the keys \(value_prefix=None\); got .*value_prefix=4"):
        _model()(RNG.standard_normal((2, 1, 32)), cache=cache)
    assert len(cache) == 0


def test_a_prefix_cache_larger_than_memory_is_refused_for_its_keys_alone():
    message = r"KVCache would allocate 4\.0 TiB .*keys \(1024, 8, 1048576, 128\) of float32, the values a view of"
    with pytest.raises(MemoryError, match=message):
        KVCache(2**10, 8, 2**20, 128, value_prefix=64)


def test_a_prefix_cache_copies_and_pickles_with_values_that_stay_its_keys():
    cache = KVCache(1, 1, 8, 4, value_prefix=2)
    cache.append(*_tokens(cache, 3))
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        twin.append(*_tokens(twin, 1, 3.0))
        assert np.shares_memory(twin.values, twin.keys) and not np.shares_memory(twin.keys, cache.keys)
        np.testing.assert_array_equal(twin.values[0, 0, :, 0], [0, 1, 2, 3])
        assert len(cache) == 3 and twin.nbytes == cache.nbytes == 8 * 4 * 4


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
    merged = y.swapaxes(1, 2).reshape(2, 32)  # (B·T, d_model): the heads side by side, one row a token
    np.testing.assert_array_equal((merged @ mha.w_out).reshape(2, 1, 32), mha(x[:, 4:], cache=through_layer))


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


def test_multihead_decoding_into_one_kv_cache_from_threads_keeps_every_token(rng):
    # the length read, the rotation at it and the append are one step under the cache's lock: no token lost,
    # no two tokens at one position
    from concurrent.futures import ThreadPoolExecutor

    from tinyattn_np import KVCache

    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=0)
    cache = KVCache(1, 2, 400, 4)
    x = rng.standard_normal((1, 1, 16)).astype(np.float32)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: mha(x, cache=cache), range(200)))
    assert len(cache) == 200
    keys = cache.keys[0, 0]  # the same token at 200 positions: RoPE turned each by its own, so all differ
    assert len({tuple(np.round(key, 5)) for key in keys}) == 200


# --- a Ctrl-C between any two bytecodes: all or nothing ----------------------------------------------

PACKAGE = Path(tinyattn_np.__file__).resolve().parent
# The caches' own code. A layer's step through a cache (attend) also runs the attention kernels, which only
# read the cache (splitkv.py, flash.py) and the worker engine (_parallel.py): an interrupt inside them reaches
# the cache as an exception out of that call, which the sweep raises at the call's own bytecodes in the
# cache's code; the kernels' own locks and counts are theirs to keep.
CACHE_CODE = tuple(str(PACKAGE / name) for name in ("kvcache.py", "paged.py", "_atomic.py"))


def _interrupted_at(n: int, call, code: tuple[str, ...]) -> bool:
    """Run call() with a KeyboardInterrupt raised at the n-th bytecode it runs in the files under `code` (the
    package; a tracer with f_trace_opcodes: a real Ctrl-C can land between any two). True if it came, False
    if call() finished first."""
    count = 0

    def each_bytecode(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
            if count == n:
                raise KeyboardInterrupt(f"at bytecode {n}")  # the tracer is then switched off by Python
        return each_bytecode

    def on_call(frame, event, arg):
        if not frame.f_code.co_filename.startswith(code):
            return None  # NumPy's and the standard library's frames: not counted
        frame.f_trace_lines, frame.f_trace_opcodes = False, True
        return each_bytecode

    tracer = sys.gettrace()  # a coverage tool's, if one runs: put back afterwards
    sys.settrace(on_call)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(tracer)
    return False


def _all_or_nothing(make, change, snapshot, still_works, code: tuple[str, ...]) -> int:
    """Interrupt change(make()) at its 1st, 2nd, ... bytecode (in `code`) until a call finishes. After each
    interrupt the snapshot must equal the one before the call or the one after a whole call, never a third
    state, and still_works(obj) must pass. Returns the number of bytecodes interrupted."""
    whole = make()
    change(whole)
    after = snapshot(whole)
    for n in itertools.count(1):
        obj = make()
        before = snapshot(obj)
        if not _interrupted_at(n, lambda obj=obj: change(obj), code):
            assert snapshot(obj) == after
            return n - 1
        assert snapshot(obj) in (before, after), f"interrupted at bytecode {n}: half a change"
        still_works(obj)
    raise AssertionError("unreachable")


def _lock_is_free(lock) -> bool:
    """Whether the lock is free after an interrupted call: this thread, the only one that ran the call, does not
    hold it (an interrupt must not leave it held: every other thread would then wait for it forever)."""
    return not lock._is_owned()


def _kv_snapshot(cache: KVCache) -> tuple:
    keys, values = cache.ordered()
    return len(cache), keys.tobytes(), values.tobytes(), cache.positions.tobytes(), cache.keys.tobytes()


def _kv_still_works(cache: KVCache) -> None:
    assert _lock_is_free(cache.lock)
    keys, values = (x.copy() for x in cache.ordered())  # (B, Hkv, kept, E) oldest first
    seen = len(cache)
    cache.append(*_tokens(cache, 1, 1000.0))
    assert len(cache) == seen + 1
    new_keys, new_values = cache.ordered()
    np.testing.assert_array_equal(
        new_keys, np.concatenate([keys, _tokens(cache, 1, 1000.0)[0]], 2)[:, :, -cache.slots :]
    )
    np.testing.assert_array_equal(
        new_values, np.concatenate([values, _tokens(cache, 1, 1000.0)[1]], 2)[:, :, -cache.slots :]
    )
    np.testing.assert_array_equal(cache.positions[np.argsort(cache.positions)], np.arange(seen + 1)[-cache.slots :])


def _kv_filled(window: int | None, value_prefix: int | None = None) -> KVCache:
    cache = KVCache(1, 2, 16, 2, dtype=np.float64, window=window, value_prefix=value_prefix)
    cache.append(*_tokens(cache, 6))  # tokens 0 .. 5: a ring of 4 has wrapped
    return cache


ATTEND_LAYER = MultiHeadAttention(8, 4, 2, rope=True, rng=np.random.default_rng(0), dtype=np.float64)


WHOLE_PACKAGE = (str(PACKAGE),)


@pytest.mark.parametrize(
    ("window", "value_prefix", "change", "code"),
    [
        (None, None, lambda c: c.append(*_tokens(c, 1, 6.0)), WHOLE_PACKAGE),
        (4, None, lambda c: c.append(*_tokens(c, 1, 6.0)), WHOLE_PACKAGE),  # into a ring slot a kept token holds
        (None, None, lambda c: c.append(*_tokens(c, 3, 6.0)), WHOLE_PACKAGE),
        (4, None, lambda c: c.append(*_tokens(c, 5, 6.0)), WHOLE_PACKAGE),  # longer than the ring: its last 4 written
        (None, None, lambda c: c.attend(ATTEND_LAYER, np.linspace(-1, 1, 8).reshape(1, 1, 8)), CACHE_CODE),
        (4, None, lambda c: c.attend(ATTEND_LAYER, np.linspace(-1, 1, 24).reshape(1, 3, 8)), CACHE_CODE),
        (None, 1, lambda c: c.append(*_tokens(c, 3, 6.0)), WHOLE_PACKAGE),  # the keys alone, the values their prefix
        (4, 1, lambda c: c.append(*_tokens(c, 5, 6.0)), WHOLE_PACKAGE),
    ],
    ids=[
        "append one",
        "append one, ring",
        "append three",
        "append five, ring",
        "attend one",
        "attend three, ring",
        "append three, values the keys' prefix",
        "append five, ring, values the keys' prefix",
    ],
)
def test_an_interrupt_at_any_bytecode_leaves_the_cache_before_or_after(window, value_prefix, change, code):
    """A KeyboardInterrupt raised at each bytecode of the call in turn (a few hundred for append, about 1,000
    for attend in the cache's own code): the cache is then as before the call or as after the whole call, its
    lock free, and it takes the next token. attend writes the new tokens first (no window), or appends last
    (a ring and several tokens); a cache whose values are its keys' prefix writes the keys alone."""
    make = lambda: _kv_filled(window, value_prefix)  # noqa: E731
    interrupted = _all_or_nothing(make, change, _kv_snapshot, _kv_still_works, code)
    assert interrupted > 20  # the tracer did reach the code
