"""MultiHeadLatentAttention: the naive and the absorbed forms against each other and against an oracle written
from the equations, the latent cache (KVCache, PagedKVCache) against recomputing every sequence from a dict of
its tokens, the backward against central differences, and bad input refused before anything changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import bottom_right, gold_attention
from test_backward import numerical_grad  # central differences, one entry at a time
from test_kvcache import CACHE_CODE, PACKAGE, _all_or_nothing, _lock_is_free

from tinyattn_np import (
    KVCache,
    MultiHeadLatentAttention,
    PagedKVCache,
    PoolExhaustedError,
    attend_latent,
    latent_softmax_scale,
    rope,
)
from tinyattn_np import kvcache as kvcache_module
from tinyattn_np import latent as latent_module

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
D_MODEL, HEADS = 24, 3
# naive == absorbed: the same scores summed in another order (float64 to 1e-12, float32 to 1e-5, relative)
SAME = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
YARN = {  # DeepSeek-V3's rope_scaling, as its config.json has it
    "type": "yarn",
    "factor": 40,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}


def make_layer(q_lora_rank=6, dtype=np.float64, seed=0, **config):
    """A small layer whose norms' gains are not 1 (so that their gradients and their place in the math count)."""
    layer = MultiHeadLatentAttention(D_MODEL, HEADS, q_lora_rank=q_lora_rank, rng=seed, dtype=dtype, **SIZES, **config)
    gains = np.random.default_rng(seed + 1)
    for w in layer.parameters.values():
        if w.ndim == 1:
            w[:] = gains.uniform(0.5, 1.5, w.shape)
    return layer


def relative(mine, gold):
    mine, gold = np.asarray(mine, np.float64), np.asarray(gold, np.float64)
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


def gold_mla(layer, x, positions):
    """The layer's equations, written out head by head in float64: its own RMSNorm, the decompressed keys and
    values, and scipy's softmax (conftest.gold_attention) under a causal mask built with a loop. RoPE is the
    package's (its own tests hold it to the formula and to transformers)."""
    w = {name: np.asarray(v, np.float64) for name, v in layer.parameters.items()}
    x = np.asarray(x, np.float64)
    r, dn, dr, dv = layer.kv_lora_rank, layer.d_nope, layer.d_rope, layer.d_v

    def norm(v, gain):
        return v / np.sqrt(np.mean(v**2, axis=-1, keepdims=True) + 1e-6) * gain

    def turn(v):
        return rope(
            v, positions=positions, base=layer.rope_theta, interleaved=layer.rope_interleave, scaling=layer.rope_scaling
        )

    q = x @ w["w_q"] if layer.q_lora_rank is None else norm(x @ w["w_dq"], w["q_norm"]) @ w["w_uq"]
    c_kv, k_rope = norm((x @ w["w_dkv"])[..., :r], w["kv_norm"]), turn((x @ w["w_dkv"])[..., r:])
    heads = []
    for h in range(layer.n_heads):
        q_h = q[..., h * (dn + dr) : (h + 1) * (dn + dr)]  # (B, T, dn + dr)
        kv_h = c_kv @ w["w_ukv"][:, h * (dn + dv) : (h + 1) * (dn + dv)]  # (B, T, dn + dv)
        q_h = np.concatenate([q_h[..., :dn], turn(q_h[..., dn:])], axis=-1)
        k_h = np.concatenate([kv_h[..., :dn], k_rope], axis=-1)
        T = x.shape[1]
        heads.append(gold_attention(q_h, k_h, kv_h[..., dn:], bottom_right(T, T), layer.softmax_scale)[0])
    return np.concatenate(heads, axis=-1) @ w["w_o"]


# ---------------------------------------------------------------------------------------------------
# the two forms


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("q_lora_rank", [None, 6])
@pytest.mark.parametrize("interleave", [True, False])
def test_naive_equals_absorbed_and_both_the_equations(rng, dtype, q_lora_rank, interleave):
    layer = make_layer(q_lora_rank, dtype, rope_interleave=interleave)
    x = rng.standard_normal((2, 7, D_MODEL)).astype(dtype)
    positions = rng.integers(0, 5000, 7)  # RoPE at each token's own position, in no order
    absorbed, naive = layer(x, positions=positions), layer(x, positions=positions, absorbed=False)
    assert absorbed.shape == (2, 7, D_MODEL) and absorbed.dtype == dtype
    assert relative(absorbed, naive) <= SAME[np.dtype(dtype)]
    gold = gold_mla(layer, x, positions)
    assert relative(naive, gold) <= SAME[np.dtype(dtype)]
    assert relative(absorbed, gold) <= SAME[np.dtype(dtype)]


def test_yarn_scales_the_softmax_by_mscale_squared(rng):
    mscale = 0.1 * np.log(40) + 1  # 0.1 · mscale_all_dim · ln(factor) + 1
    assert latent_softmax_scale(192, YARN) == pytest.approx(mscale**2 / np.sqrt(192), rel=1e-15)
    plain = 1 / np.sqrt(192)
    assert latent_softmax_scale(192, None) == latent_softmax_scale(192, {"rope_type": "default"}) == plain
    without = {key: value for key, value in YARN.items() if key != "mscale_all_dim"}
    assert latent_softmax_scale(192, without) == plain  # no mscale_all_dim: only RoPE's own factor
    no_factor = {key: value for key, value in YARN.items() if key != "factor"}
    assert latent_softmax_scale(192, no_factor, 163840) == latent_softmax_scale(192, YARN)  # 163,840 / 4,096 = 40
    layer = make_layer(rope_scaling=YARN)
    assert layer.softmax_scale == latent_softmax_scale(SIZES["qk_nope_head_dim"] + SIZES["qk_rope_head_dim"], YARN)
    x, positions = rng.standard_normal((2, 6, D_MODEL)), rng.integers(0, 100_000, 6)
    absorbed, naive = layer(x, positions=positions), layer(x, positions=positions, absorbed=False)
    assert relative(absorbed, naive) <= 1e-12
    assert relative(absorbed, gold_mla(layer, x, positions)) <= 1e-12
    assert relative(absorbed, make_layer()(x, positions=positions)) > 1e-3  # the scale and θ did change the result


def test_unbatched_input_is_one_row_of_a_batch(rng):
    layer = make_layer()
    x = rng.standard_normal((5, D_MODEL))
    assert layer(x).shape == (5, D_MODEL)
    np.testing.assert_array_equal(layer(x), layer(x[None])[0])


def test_attend_latent_reads_the_values_as_a_view_of_the_keys(rng, monkeypatch):
    seen = {}

    def spy(q, k, v, **kwargs):
        seen.update(k=k, v=v)
        return flash_decode(q, k, v, **kwargs)

    flash_decode = kvcache_module.flash_decode  # the cache's decode step reads its keys and values
    monkeypatch.setattr(kvcache_module, "flash_decode", spy)
    layer = make_layer()
    cache = KVCache(2, 1, 9, layer.latent_dim, dtype=np.float64, value_prefix=layer.kv_lora_rank)
    layer(rng.standard_normal((2, 8, D_MODEL)), cache=cache)
    layer(rng.standard_normal((2, 1, D_MODEL)), cache=cache)  # a decode step: flash_decode
    r = layer.kv_lora_rank
    assert seen["k"].shape == (2, 1, 9, r + layer.d_rope) and seen["v"].shape == (2, 1, 9, r)
    assert np.shares_memory(seen["v"], seen["k"]) and np.shares_memory(seen["k"], cache.keys)  # views, no copy
    np.testing.assert_array_equal(seen["v"], cache.keys[..., :r])
    np.testing.assert_array_equal(cache.values, cache.keys[..., :r])


# ---------------------------------------------------------------------------------------------------
# the latent cache


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_every_decode_step_naive_equals_absorbed_equals_recomputing(rng, dtype, q_lora_rank):
    layer = make_layer(q_lora_rank, dtype)
    x = rng.standard_normal((2, 12, D_MODEL)).astype(dtype)
    r = layer.kv_lora_rank
    caches = {form: KVCache(2, 1, 12, layer.latent_dim, dtype=dtype, value_prefix=r) for form in ("absorbed", "naive")}
    chunks = [(0, 5), (5, 6), (6, 9), *((t, t + 1) for t in range(9, 12))]  # a prefill, steps, a chunk, steps
    for start, stop in chunks:
        absorbed = layer(x[:, start:stop], cache=caches["absorbed"])
        naive = layer(x[:, start:stop], cache=caches["naive"], absorbed=False)
        recomputed = layer(x[:, :stop])[:, start:stop]  # the whole prefix again, no cache
        assert relative(absorbed, naive) <= SAME[np.dtype(dtype)], (start, stop)
        assert relative(absorbed, recomputed) <= SAME[np.dtype(dtype)], (start, stop)
    # the cache holds each token's latent once, as its key, the values a view of the key's first r numbers: it
    # allocates B · S · (kv_lora_rank + qk_rope_head_dim) numbers in all
    cache = caches["absorbed"]
    latent = layer.project(x, np.arange(12), layer.parameters).latent  # (2, 1, 12, r + d_rope)
    np.testing.assert_allclose(cache.keys, latent, rtol=SAME[np.dtype(dtype)])
    assert cache.nbytes == cache.keys.nbytes == 2 * 12 * (8 + 4) * np.dtype(dtype).itemsize
    assert np.shares_memory(cache.values, cache.keys) and cache.values.shape == (2, 1, 12, r)


@pytest.mark.parametrize("absorbed", [True, False])
def test_paged_latent_cache_against_a_dict_of_token_histories(absorbed):
    """Random prefills, decode steps of several sequences at once (their lengths differ), forks and frees on a
    PagedKVCache, beside a dict that holds each sequence's tokens: every output equals the layer run on that
    sequence's whole history, and every sequence's cached latents equal its history's."""
    rng = np.random.default_rng(7)
    layer = make_layer()
    cache = PagedKVCache(64, 3, 1, layer.latent_dim, dtype=np.float64, value_prefix=layer.kv_lora_rank)
    # the pool holds each token's latent once: 64 blocks of 3 slots of kv_lora_rank + qk_rope_head_dim numbers
    assert cache.nbytes == 64 * 3 * (8 + 4) * 8 and np.shares_memory(cache.v_pool, cache.k_pool)
    history: dict[int, np.ndarray] = {}  # the dict model: sequence id -> its tokens (n, C)
    for step in range(24):
        action = rng.choice(["prefill", "decode", "decode", "fork", "free"]) if history else "prefill"
        if action == "prefill" or (action == "free" and len(history) < 2):
            seq, tokens = cache.add_sequence(), rng.standard_normal((1, int(rng.integers(1, 7)), D_MODEL))
            out = layer(tokens, cache=cache, seq_ids=[seq], absorbed=absorbed)
            history[seq] = tokens[0]
            np.testing.assert_allclose(out[0], layer(history[seq]), rtol=1e-12, atol=1e-13, err_msg=f"step {step}")
        elif action == "decode":
            seqs = [int(s) for s in rng.permutation(list(history))[: int(rng.integers(1, len(history) + 1))]]
            tokens = rng.standard_normal((len(seqs), 1, D_MODEL))
            out = layer(tokens, cache=cache, seq_ids=seqs, absorbed=absorbed)
            for b, seq in enumerate(seqs):
                history[seq] = np.concatenate([history[seq], tokens[b]])
                np.testing.assert_allclose(out[b, 0], layer(history[seq])[-1], rtol=1e-12, atol=1e-13)
        elif action == "fork":
            parent = int(rng.choice(list(history)))
            history[cache.fork(parent)] = history[parent].copy()
        else:
            seq = int(rng.choice(list(history)))
            cache.free(seq)
            del history[seq]
        assert set(cache.sequences) == set(history)
        for seq, tokens in history.items():
            latent = layer.project(tokens[None], np.arange(len(tokens)), layer.parameters).latent[0]
            np.testing.assert_allclose(cache.gather(seq)[0], latent, rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------------------------------------------
# the backward


@pytest.mark.parametrize(
    ("absorbed", "q_lora_rank", "interleave"), [(True, 3, True), (True, None, False), (False, 3, False)]
)
def test_backward_equals_numerical_grad(absorbed, q_lora_rank, interleave):
    rng = np.random.default_rng(3)
    sizes = dict(kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, q_lora_rank=q_lora_rank)
    layer = MultiHeadLatentAttention(6, 2, **sizes, rope_interleave=interleave, rng=1, dtype=np.float64)
    for w in layer.parameters.values():
        if w.ndim == 1:
            w[:] = rng.uniform(0.5, 1.5, w.shape)
    x, positions = rng.standard_normal((2, 4, 6)), rng.integers(0, 50, 4)
    out, saved = layer.forward(x, absorbed=absorbed, positions=positions)
    dout = rng.standard_normal(out.shape)
    dx, grads = layer.backward(dout, saved)
    assert list(grads) == list(layer.parameters)

    def loss():
        return float(np.sum(layer.forward(x, absorbed=absorbed, positions=positions)[0] * dout))

    for name, array, grad in [("x", x, dx), *((n, w, grads[n]) for n, w in layer.parameters.items())]:
        assert grad.shape == array.shape and grad.dtype == np.float64, name
        np.testing.assert_allclose(grad, numerical_grad(loss, array), rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_the_two_forms_give_the_same_gradients(rng, q_lora_rank):
    layer = make_layer(q_lora_rank, rope_scaling=YARN)
    x, positions = rng.standard_normal((2, 6, D_MODEL)), rng.integers(0, 9000, 6)
    dout = rng.standard_normal((2, 6, D_MODEL))
    dx_a, grads_a = layer.backward(dout, layer.forward(x, positions=positions)[1])
    dx_n, grads_n = layer.backward(dout, layer.forward(x, absorbed=False, positions=positions)[1])
    assert relative(dx_a, dx_n) <= 1e-12
    for name in grads_a:
        assert relative(grads_a[name], grads_n[name]) <= 1e-12, name


def test_backward_uses_the_weights_of_its_forward(rng):
    layer = make_layer()
    x, dout = rng.standard_normal((4, D_MODEL)), rng.standard_normal((4, D_MODEL))
    out, saved = layer.forward(x)
    np.testing.assert_array_equal(out, layer(x))
    before = layer.backward(dout, saved)
    layer.w_ukv *= 2  # a step of an optimizer between the forward and the backward
    after = layer.backward(dout, saved)
    np.testing.assert_array_equal(before[0], after[0])


def test_the_two_norms_and_their_backward(rng):
    norm, norm_backward = latent_module._norm, latent_module._norm_backward  # layers.rms_norm at eps 1e-6
    x, gain, dy = rng.standard_normal((3, 5)), rng.uniform(0.5, 1.5, 5), rng.standard_normal((3, 5))
    expected = x / np.sqrt((x**2).mean(axis=1, keepdims=True) + 1e-6) * gain
    np.testing.assert_allclose(norm(x, gain), expected, rtol=1e-14)
    dx, dgain = norm_backward(dy, x, gain)
    np.testing.assert_allclose(dx, numerical_grad(lambda: np.sum(norm(x, gain) * dy), x), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dgain, numerical_grad(lambda: np.sum(norm(x, gain) * dy), gain), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------
# bad input: a clear error, and nothing changed


def cache_state(cache):
    if isinstance(cache, KVCache):
        return len(cache), cache.keys.copy()
    return {seq: cache.gather(seq)[0].copy() for seq in cache.sequences}, cache.blocks_used


def assert_same_state(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(np.array_equal(a[s], b[s]) for s in a)
        else:
            np.testing.assert_array_equal(a, b)


def prefilled(kind, layer, rng):
    if kind == "kv":
        cache = KVCache(2, 1, 6, layer.latent_dim, dtype=np.float64, value_prefix=layer.kv_lora_rank)
        layer(rng.standard_normal((2, 4, D_MODEL)), cache=cache)
        return cache, {}
    cache = PagedKVCache(6, 2, 1, layer.latent_dim, dtype=np.float64, value_prefix=layer.kv_lora_rank)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    layer(rng.standard_normal((2, 4, D_MODEL)), cache=cache, seq_ids=seqs)
    return cache, {"seq_ids": seqs}


@pytest.mark.parametrize("kind", ["kv", "paged"])
def test_a_weight_of_another_latent_rank_is_refused_and_the_cache_is_untouched(rng, kind):
    layer = make_layer()
    cache, kwargs = prefilled(kind, layer, rng)
    before = cache_state(cache)
    layer.w_ukv = np.zeros((layer.kv_lora_rank + 1, layer.w_ukv.shape[1]))  # a latent of 9 numbers for a rank of 8
    with pytest.raises(ValueError, match=r"w_ukv must have shape \(8, 30\) .*kv_lora_rank=8.*got \(9, 30\)"):
        layer(rng.standard_normal((2, 1, D_MODEL)), cache=cache, **kwargs)
    assert_same_state(before, cache_state(cache))
    layer.w_ukv = np.zeros((8, 30), np.float32)
    with pytest.raises(TypeError, match="w_ukv must be a float64 ndarray"):
        layer.forward(rng.standard_normal((2, 1, D_MODEL)))


def test_a_weight_ported_from_torch_without_the_transpose_is_named():
    layer = make_layer()
    layer.w_o = layer.w_o.T.copy()  # nn.Linear.weight's (out, in), where the layer multiplies x @ W, W (in, out)
    transposed = r"got \(24, 18\): W is \(in, out\), the transpose of nn.Linear.weight \(pass weight.T\)"
    with pytest.raises(ValueError, match=r"w_o must have shape \(18, 24\) .* " + transposed):
        layer(np.zeros((1, 3, D_MODEL)))


def test_attend_latent_refuses_a_latent_that_does_not_match_the_weights(rng):
    q_nope, q_rope = rng.standard_normal((1, 3, 2, 4)), rng.standard_normal((1, 3, 2, 4))
    w_ukv = rng.standard_normal((8, 3 * 10))
    with pytest.raises(ValueError, match=r"latent must be .*8 \+ 4.*kv_lora_rank=8 rows.*got shape \(1, 1, 5, 13\)"):
        attend_latent(q_nope, q_rope, rng.standard_normal((1, 1, 5, 13)), w_ukv)
    with pytest.raises(ValueError, match="w_ukv must be"):
        attend_latent(q_nope, q_rope, rng.standard_normal((1, 1, 5, 12)), w_ukv[:, :29])
    with pytest.raises(ValueError, match="q_nope and q_rope must be"):
        attend_latent(q_nope, q_rope[:, :2], rng.standard_normal((1, 1, 5, 12)), w_ukv)
    o, attended = attend_latent(q_nope, q_rope, rng.standard_normal((1, 1, 5, 12)), w_ukv)
    assert o.shape == (1, 3, 2, 6) and attended.q.shape == (1, 3, 2, 12)


@pytest.mark.parametrize(
    ("make_cache", "error", "message"),
    [
        (
            lambda d: KVCache(2, 1, 8, d + 1, dtype=np.float64, value_prefix=8),
            ValueError,
            r"head_dim=12, dtype=float64, value_prefix=8\): one latent",
        ),
        (lambda d: KVCache(2, 2, 8, d, dtype=np.float64, value_prefix=8), ValueError, "kv_heads=1"),
        (
            lambda d: KVCache(2, 1, 8, d, dtype=np.float32, value_prefix=8),
            ValueError,
            "got kv_heads=1, head_dim=12, dtype=float32",
        ),
        (lambda d: KVCache(3, 1, 8, d, dtype=np.float64, value_prefix=8), ValueError, "batch=2"),
        (lambda d: KVCache(2, 1, 8, d, dtype=np.float64, value_prefix=8, window=4), ValueError, "window=None"),
        # a cache that would store the latent twice, or whose values are not the latent's c_KV
        (lambda d: KVCache(2, 1, 8, d, dtype=np.float64), ValueError, "value_prefix=8.*got .*value_prefix=None"),
        (lambda d: KVCache(2, 1, 8, d, dtype=np.float64, value_prefix=4), ValueError, "got .*value_prefix=4"),
        (lambda d: PagedKVCache(8, 2, 1, d - 1, dtype=np.float64, value_prefix=8), ValueError, "head_dim=12"),
        (lambda d: PagedKVCache(8, 2, 1, d, dtype=np.float64), ValueError, "value_prefix=8.*got .*value_prefix=None"),
        (lambda d: np.zeros((2, 1, 8, d)), TypeError, "cache must be a KVCache, a PagedKVCache or None"),
    ],
)
def test_a_cache_of_the_wrong_width_or_kind_is_refused(rng, make_cache, error, message):
    layer = make_layer()
    cache = make_cache(layer.latent_dim)
    seq_ids = [cache.add_sequence(), cache.add_sequence()] if isinstance(cache, PagedKVCache) else None
    with pytest.raises(error, match=message):
        layer(rng.standard_normal((2, 1, D_MODEL)), cache=cache, seq_ids=seq_ids)
    if isinstance(cache, KVCache):
        assert len(cache) == 0 and not cache.keys.size
    elif isinstance(cache, PagedKVCache):
        assert cache.blocks_used == 0


@pytest.mark.parametrize("kind", ["kv", "paged"])
def test_a_full_cache_and_misused_arguments_change_nothing(rng, kind):
    layer = make_layer()
    cache, kwargs = prefilled(kind, layer, rng)
    before = cache_state(cache)
    too_many = rng.standard_normal((2, 3, D_MODEL))  # KVCache: 4 + 3 > 6 tokens; the pool: 2 x 4 more blocks > 2
    with pytest.raises(PoolExhaustedError if kind == "paged" else ValueError, match="only 2 more fit|cannot hold"):
        layer(too_many, cache=cache, **kwargs)
    with pytest.raises(ValueError, match="positions come from the cache"):
        layer(too_many[:, :1], cache=cache, positions=[4], **kwargs)
    if kind == "paged":
        with pytest.raises(TypeError, match="seq_ids must be a sequence of ids"):
            layer(too_many[:, :1], cache=cache)
        with pytest.raises(ValueError, match="2 different sequences"):
            layer(too_many[:, :1], cache=cache, seq_ids=[kwargs["seq_ids"][0]] * 2)
    else:
        with pytest.raises(ValueError, match="seq_ids is for a PagedKVCache"):
            layer(too_many[:, :1], cache=cache, seq_ids=[0, 1])
    assert_same_state(before, cache_state(cache))


# The bytecodes swept: latent.py's and the lock's, and a KVCache's own (its append_and_read runs the step's
# attention before the commit). A PagedKVCache's append_batch, the step's last call, is swept in test_paged.
LATENT_STEP_CODE = {
    "kv": (*CACHE_CODE, str(PACKAGE / "latent.py")),
    "paged": (str(PACKAGE / "latent.py"), str(PACKAGE / "_atomic.py")),
}


def _latent_snapshot(cache):
    if isinstance(cache, KVCache):
        return len(cache), cache.keys.tobytes()
    return tuple((seq, cache.gather(seq)[0].tobytes()) for seq in cache.sequences), cache.blocks_used


@pytest.mark.parametrize("kind", ["kv", "paged"])
def test_an_interrupt_at_any_bytecode_of_a_step_leaves_the_cache_before_or_after(kind):
    """A KeyboardInterrupt raised at each bytecode of a decode step in turn (in latent.py and the caches'
    code): the latents are both attended to and kept, or neither; the lock is free and the next step runs.
    (The naive form differs only in what the step computes before the append commits.)"""
    absorbed = True
    layer = make_layer()
    x = np.linspace(-1, 1, 2 * D_MODEL).reshape(2, 1, D_MODEL)

    def make():
        return prefilled(kind, layer, np.random.default_rng(1))

    def step(made):
        cache, kwargs = made
        layer(x, cache=cache, absorbed=absorbed, **kwargs)

    def still_works(made):
        cache, kwargs = made
        assert _lock_is_free(cache.lock)
        layer(x, cache=cache, absorbed=absorbed, **kwargs)

    snapshot = lambda made: _latent_snapshot(made[0])  # noqa: E731
    assert _all_or_nothing(make, step, snapshot, still_works, LATENT_STEP_CODE[kind]) > 50


def test_other_bad_input_names_the_argument(rng):
    layer = make_layer()
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        MultiHeadLatentAttention(8, 2, **SIZES, dtype=np.float16)
    with pytest.raises(ValueError, match="beta_fast"):
        MultiHeadLatentAttention(8, 2, **SIZES, rope_scaling={**YARN, "beta_fast": 0.5})
    with pytest.raises(ValueError, match=r"x must be \(B, T, 24\)"):
        layer(rng.standard_normal((2, 3, 23)))
    with pytest.raises(ValueError, match=r"positions must be \(3,\)"):
        layer(rng.standard_normal((3, D_MODEL)), positions=[0, 1])
    with pytest.raises(TypeError, match="positions must be ints"):
        layer(rng.standard_normal((3, D_MODEL)), positions=[0.5, 1, 2])
    with pytest.raises(ValueError, match="seq_ids names sequences of a PagedKVCache"):
        layer(rng.standard_normal((3, D_MODEL)), seq_ids=[0])
    out, saved = layer.forward(rng.standard_normal((3, D_MODEL)))
    with pytest.raises(ValueError, match=r"dout must have the forward's output shape \(3, 24\)"):
        layer.backward(np.zeros((1, 3, D_MODEL)), saved)
    with pytest.raises(ValueError, match="from another layer"):
        make_layer().backward(out, saved)


# ---------------------------------------------------------------------------------------------------
# scripts/mla.py at tiny sizes (the benchmark itself is never timed here)


@pytest.fixture
def mla_script(monkeypatch):
    """scripts/mla.py as a module, its machine.py patched: no idle waits, fixed ceilings, a quiet machine."""
    from test_scripts import load

    script = load("mla.py")
    monkeypatch.setattr(script.machine, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(script.machine, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)
    monkeypatch.setattr(script, "read_bandwidth", lambda n_bytes=2**30, repeats=5: 10.0)
    monkeypatch.setattr(script.machine, "load_average", lambda: 0.0)
    return script


def test_mla_script_prints_the_cache_table_and_every_step(mla_script, tmp_path, capsys):
    figures = tmp_path / "mla.json"
    flags = ["--heads", "2", "--contexts", "64", "200", "--repeats", "1", "--json", str(figures)]
    assert mla_script.main(flags) == 0
    out = capsys.readouterr().out
    assert re.search(r"^latent \(MLA\): c_KV and k_rope\s+-\s+576\s+1,152\s+2,304\s+1\.0x$", out, re.M)
    assert re.search(r"^multi-head \(MHA\): every head's k and v\s+2\s+640\s+", out, re.M)
    assert "a step is compute-bound above 10.0 FLOPs per byte read" in out
    assert re.search(r"^200\s+absorbed\s+[0-9.]+\s+0\.00\s+1\.[0-9]\s+", out, re.M)
    assert "S = 200: absorbed " in out and "naive " in out and out.rstrip().endswith("all checks passed")
    saved = json.loads(figures.read_text())
    assert [row["context"] for row in saved["rows"]] == [64, 200]
    assert {"naive", "absorbed", "products"} <= set(saved["rows"][0]) and saved["interrupted"] is False
    flops, read = saved["rows"][1]["absorbed"]["flops"], saved["rows"][1]["absorbed"]["bytes"]
    assert flops == 2 * 2 * 128 * 512 + 2 * 2 * 200 * (576 + 512) + 2 * 2 * 512 * 128  # absorb, two products, W_UV
    assert read == (512 * 2 * 256 + 200 * 576) * 4  # W_UKV once, the latents once


def test_mla_script_runs_the_absorbed_form_alone_where_the_naive_cache_does_not_fit(mla_script, monkeypatch, capsys):
    problem = mla_script.limits.memory_problem
    monkeypatch.setattr(
        mla_script.limits,
        "memory_problem",
        lambda needed, what, lower, detail="": "too large" if "naive" in what else problem(needed, what, lower, detail),
    )
    assert mla_script.main(["--heads", "2", "--contexts", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "S = 64: absorbed" in out and "naive not run: too large" in out
    assert not re.search(r"^64\s+naive", out, re.M)


def test_mla_script_keeps_the_rows_measured_on_ctrl_c(mla_script, monkeypatch, capsys):
    measure, calls = mla_script.measure_context, []

    def twice(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args)

    monkeypatch.setattr(mla_script, "measure_context", twice)
    assert mla_script.main(["--heads", "2", "--contexts", "64", "128", "--repeats", "1"]) == 130
    out = capsys.readouterr().out
    assert re.search(r"^64\s+absorbed", out, re.M) and "interrupted (Ctrl-C) after 1 of 2 rows" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--contexts", "0"], "--contexts: must be a positive int; got 0"),
        (["--contexts", "100000000000"], "--contexts: must be a positive int at most 4,194,304"),
        (["--contexts", "4194304", "--heads", "1024"], "S=4,194,304 needs about"),
        (["--heads", "-2"], "--heads: must be a positive int"),
        (["--json", "/no/such/folder/mla.json"], "the folder /no/such/folder does not exist"),
    ],
)
def test_mla_script_refuses_bad_flags_up_front(mla_script, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        mla_script.parse_args(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_mla_script_help():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mla.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0 and "--torch" in result.stdout and "--json PATH" in result.stdout
