"""The DSA layer (dsa.py): against the dense latent layer where topk covers every key, against its equations
(the indexer written out, SciPy's softmax over the chosen keys), its backward by central differences with the
chosen keys held, the indexer's loss and its gradient, decoding through KVCache and PagedKVCache (all or nothing
under an interrupt, against a dict of token histories), and bad input refused with the argument named."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import gold_attention, tolerance
from scipy.special import log_softmax
from test_backward import EPS, FD_TOL  # central differences, one entry at a time
from test_kvcache import CACHE_CODE, PACKAGE, _all_or_nothing, _lock_is_free
from test_sparse import gold_topk, listed_mask

from tinyattn_np import KVCache, PagedKVCache, PoolExhaustedError, SparseLatentAttention, sparse_attention
from tinyattn_np.blockmask import Band
from tinyattn_np.dsa import SparseHeads
from tinyattn_np.sparse import index_scores

# --- the layer ---------------------------------------------------------------------------------------

SIZES = dict(
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=6,
    q_lora_rank=6,
    index_n_heads=3,
    index_head_dim=8,
)
D_MODEL, HEADS = 24, 3


def make_layer(topk=4, dtype=np.float64, seed=0, **config):
    """A small layer whose norms' gains and bias are not 1 and 0 (so that their gradients count)."""
    layer = SparseLatentAttention(D_MODEL, HEADS, index_topk=topk, rng=seed, dtype=dtype, **SIZES, **config)
    gains = np.random.default_rng(seed + 1)
    for w in layer.parameters.values():
        if w.ndim == 1:
            w[:] = gains.uniform(0.5, 1.5, w.shape)
    return layer


@pytest.mark.parametrize("absorbed", [True, False])
def test_with_topk_past_T_the_layer_is_the_dense_latent_layer(rng, absorbed):
    layer = make_layer(topk=16)
    x, dout = rng.standard_normal((2, 9, D_MODEL)), rng.standard_normal((2, 9, D_MODEL))
    out, saved = layer.forward(x, absorbed=absorbed)
    dense, dense_saved = layer.mla.forward(x, absorbed=absorbed)
    np.testing.assert_allclose(out, dense, rtol=1e-12, atol=1e-12)
    (dx, grads), (dense_dx, dense_grads) = layer.backward(dout, saved), layer.mla.backward(dout, dense_saved)
    np.testing.assert_allclose(dx, dense_dx, rtol=1e-11, atol=1e-11)
    for name, grad in dense_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-11, atol=1e-11, err_msg=name)


def layer_norm_rows(x, gain, bias, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gain + bias


@pytest.mark.parametrize("index_rope_interleave", [False, True])
def test_the_layer_is_its_equations(rng, index_rope_interleave):
    """The indexer written out (its LayerNorm by hand, RoPE on the first channels), gold_topk's choice, and
    SciPy's softmax over the decompressed keys under the mask of the chosen ones."""
    from tinyattn_np import rope, split_ukv

    layer = make_layer(topk=3, index_rope_interleave=index_rope_interleave)
    x, positions = rng.standard_normal((2, 8, D_MODEL)), np.array([0, 1, 2, 5, 6, 9, 10, 14])
    out, saved = layer.forward(x, positions=positions)
    w, m, d_rope = layer.parameters, layer.mla, SIZES["qk_rope_head_dim"]
    proj = m.project(x, positions, w)

    def turn(y):  # RoPE on the first d_rope channels, the others as they are
        first = rope(y[..., :d_rope], positions=positions, interleaved=index_rope_interleave)
        return np.concatenate([first, y[..., d_rope:]], axis=-1)

    q_index = turn((proj.c_q @ w["w_index_q"]).reshape(2, 8, 3, 8).swapaxes(1, 2))
    k_index = turn(layer_norm_rows(x @ w["w_index_k"], w["index_k_norm"], w["index_k_norm_bias"]))
    weights = x @ w["w_index_weights"] * 3**-0.5 * 8**-0.5
    chosen = gold_topk(q_index, k_index, weights, 3)
    np.testing.assert_array_equal(saved.indices, chosen)
    kv = (proj.latent[:, 0, :, :8] @ w["w_ukv"]).reshape(2, 8, HEADS, 10).swapaxes(1, 2)  # (B, H, T, d_nope + d_v)
    k = np.concatenate([kv[..., :4], np.repeat(proj.latent[..., 8:], HEADS, axis=1)], axis=-1)
    o, _ = gold_attention(
        np.concatenate([proj.q_nope, proj.q_rope], -1), k, kv[..., 4:], listed_mask(chosen, 8), scale=m.softmax_scale
    )
    gold = o.swapaxes(1, 2).reshape(2, 8, -1) @ w["w_o"]
    np.testing.assert_allclose(out, gold, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer(x, positions=positions, absorbed=False), gold, rtol=1e-12, atol=1e-12)
    assert split_ukv(w["w_ukv"], HEADS, 4)[0].shape == (HEADS, 8, 4)


def some_entries(rng, w, n=4):
    return [tuple(int(rng.integers(s)) for s in w.shape) for _ in range(n)]


@pytest.mark.parametrize("absorbed", [True, False])
def test_the_layers_backward_is_central_differences_with_the_keys_held(rng, absorbed):
    layer = make_layer(topk=3)
    x, dout = rng.standard_normal((2, 7, D_MODEL)), rng.standard_normal((2, 7, D_MODEL))
    out, saved = layer.forward(x, absorbed=absorbed)
    dx, grads = layer.backward(dout, saved)
    assert set(grads) == set(layer.mla.parameters)

    def loss():
        out, again = layer.forward(x, absorbed=absorbed)
        assert np.array_equal(again.indices, saved.indices), "a step of EPS changed the chosen keys"
        return float(np.sum(out * dout))

    for name, w, grad in [("x", x, dx), *((n, layer.parameters[n], g) for n, g in grads.items())]:
        for i in some_entries(rng, w):
            old = w[i]
            w[i] = old + EPS
            up = loss()
            w[i] = old - EPS
            down = loss()
            w[i] = old
            assert grad[i] == pytest.approx((up - down) / (2 * EPS), abs=FD_TOL), f"d{name}{i}"


def test_the_indexer_loss_and_its_gradient(rng):
    layer = make_layer(topk=4)
    x = rng.standard_normal((2, 9, D_MODEL))
    _, saved = layer.forward(x, absorbed=False)
    loss, grads = layer.indexer_loss(saved)
    # the value: p from SciPy's softmax over the chosen keys, head by head, summed and L1-normalized
    a, chosen = saved.attended, saved.indices
    scores = np.einsum("bhte,bhse->bhts", a.q, a.k) * layer.mla.softmax_scale
    listed = listed_mask(chosen, 9)
    p_heads = np.exp(np.where(listed, scores, -np.inf) - a.lse[..., None])  # (B, H, T, S)
    target = p_heads.sum(axis=1) / HEADS  # (B, T, S)
    ix = saved.indexer
    full = index_scores(ix.q, ix.k, ix.weights)  # (B, T, S)
    log_q = log_softmax(np.where(listed[:, 0], full, -np.inf), axis=-1)
    chosen_keys = listed[:, 0]
    gold = np.sum(target[chosen_keys] * (np.log(target[chosen_keys]) - log_q[chosen_keys]))
    assert loss == pytest.approx(gold, rel=1e-12)
    assert set(grads) == set(layer.INDEXER)
    for name, grad in grads.items():
        w = layer.parameters[name]
        for i in some_entries(rng, w):
            old = w[i]
            w[i] = old + EPS
            up_saved = layer.forward(x, absorbed=False)[1]
            w[i] = old - EPS
            down_saved = layer.forward(x, absorbed=False)[1]
            w[i] = old
            assert np.array_equal(up_saved.indices, chosen) and np.array_equal(down_saved.indices, chosen)
            numeric = (layer.indexer_loss(up_saved)[0] - layer.indexer_loss(down_saved)[0]) / (2 * EPS)
            assert grad[i] == pytest.approx(numeric, abs=FD_TOL), f"d{name}{i}"


# --- decoding through the caches ----------------------------------------------------------------------


def kv_cache(layer, batch, max_tokens):
    """A KVCache for the layer: one kv head of cache_dim numbers a token, the values its first kv_lora_rank."""
    r = layer.mla.kv_lora_rank
    return KVCache(batch, 1, max_tokens, layer.cache_dim, dtype=layer.dtype, value_prefix=r)


def paged_cache(layer, num_blocks, block_size):
    r = layer.mla.kv_lora_rank
    return PagedKVCache(num_blocks, block_size, 1, layer.cache_dim, dtype=layer.dtype, value_prefix=r)


def cached_keys(layer, tokens):
    """What a cache should hold for a sequence of tokens (T, C): each token's latent, then its indexer key."""
    x, positions = tokens[None], np.arange(len(tokens))
    latent = layer.mla.project(x, positions, layer.parameters).latent[0, 0]  # (T, latent_dim)
    c_q = layer.mla.project(x, positions, layer.parameters).c_q
    return np.concatenate([latent, layer.index(x, c_q, positions, layer.parameters).k[0]], axis=-1)  # (T, cache_dim)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_prefill_then_steps_through_a_kv_cache_equal_the_whole_sequence(rng, dtype):
    layer = make_layer(topk=3, dtype=dtype)
    x = rng.standard_normal((2, 11, D_MODEL)).astype(dtype)
    whole = layer(x)
    cache = kv_cache(layer, 2, 11)
    steps = [
        layer(x[:, :5], cache=cache),
        *(layer(x[:, t : t + 1], cache=cache) for t in range(5, 9)),
        layer(x[:, 9:], cache=cache),
    ]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, **tolerance(dtype))
    # each token's latent and indexer key, once: B · max_tokens · (8 + 4 + 8) numbers, the values a view of the keys
    assert len(cache) == 11 and cache.nbytes == 2 * 11 * (8 + 4 + 8) * np.dtype(dtype).itemsize
    assert layer.cache_dim == 20 and np.shares_memory(cache.values, cache.keys)
    for b in range(2):
        np.testing.assert_allclose(cache.keys[b, 0], cached_keys(layer, x[b]), **tolerance(dtype))
    single = kv_cache(layer, 1, 11)
    np.testing.assert_allclose(layer(x[0, :4], cache=single), whole[0, :4], **tolerance(dtype))  # (T, C)


def test_the_cache_reads_the_layer_over_arrays_as_over_pages(rng):
    """SparseHeads' two readings of one cache, its keys as arrays (attend_heads: sparse_decode) and as pages
    (attend_pages: the step the caches run), give the same step."""
    layer = make_layer(topk=4)
    heads = SparseHeads(layer)
    x = rng.standard_normal((2, 9, D_MODEL))
    cache = kv_cache(layer, 2, 12)
    layer(x[:, :6], cache=cache)
    q, k, v = heads.split_heads(x[:, 6:], np.arange(6, 9))
    cache.append(k, v)
    by_pages = heads.attend_pages(q, cache._pages(9))
    by_arrays, _ = heads.attend_heads(q, cache.keys, cache.values, Band(6))  # bottom-right
    np.testing.assert_allclose(by_pages, by_arrays, rtol=1e-13, atol=1e-14)


def test_paged_decoding_against_a_dict_of_token_histories():
    """Random prefills, decode steps of several sequences at once (their lengths differ), chunks, forks and frees
    on a PagedKVCache, beside a dict that holds each sequence's tokens: every output equals the layer run on that
    sequence's whole history, and every sequence's cached keys equal its history's latents and indexer keys."""
    rng = np.random.default_rng(7)
    layer = make_layer(topk=3)
    cache = paged_cache(layer, 64, 3)
    assert cache.nbytes == 64 * 3 * (8 + 4 + 8) * 8 and np.shares_memory(cache.v_pool, cache.k_pool)
    history: dict[int, np.ndarray] = {}  # sequence id -> its tokens (n, C)
    for step in range(24):
        action = rng.choice(["prefill", "decode", "decode", "chunk", "fork", "free"]) if history else "prefill"
        if action == "prefill" or (action == "free" and len(history) < 2):
            seq, tokens = cache.add_sequence(), rng.standard_normal((1, int(rng.integers(1, 7)), D_MODEL))
            out = layer(tokens, cache=cache, seq_ids=[seq])
            history[seq] = tokens[0]
            np.testing.assert_allclose(out[0], layer(history[seq]), rtol=1e-12, atol=1e-13, err_msg=f"step {step}")
        elif action in ("decode", "chunk"):
            seqs = [int(s) for s in rng.permutation(list(history))[: int(rng.integers(1, len(history) + 1))]]
            tokens = rng.standard_normal((len(seqs), 1 if action == "decode" else 3, D_MODEL))
            out = layer(tokens, cache=cache, seq_ids=seqs)
            for b, seq in enumerate(seqs):
                history[seq] = np.concatenate([history[seq], tokens[b]])
                gold = layer(history[seq])[-tokens.shape[1] :]
                np.testing.assert_allclose(out[b], gold, rtol=1e-12, atol=1e-13, err_msg=f"step {step}")
        elif action == "fork":
            parent = int(rng.choice(list(history)))
            history[cache.fork(parent)] = history[parent].copy()
        else:
            seq = int(rng.choice(list(history)))
            cache.free(seq)
            del history[seq]
        assert set(cache.sequences) == set(history)
        for seq, tokens in history.items():
            np.testing.assert_allclose(cache.gather(seq)[0][0], cached_keys(layer, tokens), rtol=1e-13, atol=1e-14)


def _decoded(kind, layer):
    """A cache holding two sequences of 5 tokens (a KVCache of two rows; or, in a pool of blocks of 2, a sequence
    and its fork, which share a half-filled block that the next step copies), and the arguments a step takes."""
    x = np.linspace(-1, 1, 10 * D_MODEL).reshape(2, 5, D_MODEL)
    if kind == "kv":
        cache, kwargs = kv_cache(layer, 2, 7), {}
        layer(x, cache=cache)
    else:
        cache = paged_cache(layer, 8, 2)
        seq = cache.add_sequence()
        layer(x[:1], cache=cache, seq_ids=[seq])
        kwargs = {"seq_ids": [seq, cache.fork(seq)]}
    return cache, kwargs


def _cache_state(cache):
    if isinstance(cache, KVCache):
        return len(cache), cache.keys.tobytes()
    return tuple((seq, cache.gather(seq)[0].tobytes()) for seq in cache.sequences), cache.blocks_used


@pytest.mark.parametrize("kind", ["kv", "paged"])
def test_an_interrupt_at_any_bytecode_of_a_step_leaves_the_cache_before_or_after(kind):
    """A KeyboardInterrupt raised at each bytecode of a decode step in turn (in dsa.py and sparse.py, the decode
    engine and the caches' code): the keys are both attended to and kept, or neither; the lock is free and the
    next step gives what the whole sequence gives."""
    layer = make_layer(topk=3)
    x = np.linspace(-1, 1, 2 * D_MODEL).reshape(2, 1, D_MODEL)
    code = (*CACHE_CODE, *(str(PACKAGE / name) for name in ("dsa.py", "sparse.py", "_sparse_decode.py")))

    def step(made):
        cache, kwargs = made
        return layer(x, cache=cache, **kwargs)

    def still_works(made):  # the next step: the interrupted one again, or the one after it
        cache, kwargs = made
        assert _lock_is_free(cache.lock)
        held = len(cache) if kind == "kv" else cache.length(kwargs["seq_ids"][0])
        np.testing.assert_allclose(step(made), gold[held], rtol=1e-12, atol=1e-13)

    prefilled = _decoded(kind, layer)
    make = lambda: copy.deepcopy(prefilled)  # noqa: E731
    made = make()
    gold = {5: step(made), 6: step(made)}  # the step at position 5, then at 6
    snapshot = lambda made: _cache_state(made[0])  # noqa: E731
    assert _all_or_nothing(make, step, snapshot, still_works, code) > 50


@pytest.mark.parametrize(
    ("make_cache", "error", "message"),
    [
        (
            lambda layer: KVCache(2, 1, 8, layer.mla.latent_dim, dtype=np.float64, value_prefix=8),
            ValueError,
            r"head_dim=20, dtype=float64, value_prefix=8\): one latent and one indexer key, .* = 8 \+ 4 \+ 8",
        ),
        (lambda layer: KVCache(2, 1, 8, 20, dtype=np.float32, value_prefix=8), ValueError, "got .*dtype=float32"),
        (lambda layer: KVCache(2, 1, 8, 20, dtype=np.float64), ValueError, "got .*value_prefix=None"),
        (lambda layer: KVCache(3, 1, 8, 20, dtype=np.float64, value_prefix=8), ValueError, "batch=2"),
        (lambda layer: KVCache(2, 1, 8, 20, dtype=np.float64, value_prefix=8, window=4), ValueError, "window=None"),
        (lambda layer: KVCache(2, 1, 3, 20, dtype=np.float64, value_prefix=8), ValueError, "only 3 more fit"),
        (lambda layer: PagedKVCache(8, 2, 1, 12, dtype=np.float64, value_prefix=8), ValueError, "head_dim=20"),
        (
            lambda layer: PagedKVCache(1, 2, 1, 20, dtype=np.float64, value_prefix=8),
            PoolExhaustedError,
            "cannot hold 4 more tokens",
        ),
        (lambda layer: np.zeros((2, 1, 8, 20)), TypeError, "cache must be a KVCache, a PagedKVCache or None"),
    ],
)
def test_a_cache_that_does_not_fit_the_layer_is_refused_before_anything_changes(rng, make_cache, error, message):
    layer = make_layer(topk=3)
    cache = make_cache(layer)
    seq_ids = [cache.add_sequence(), cache.add_sequence()] if isinstance(cache, PagedKVCache) else None
    with pytest.raises(error, match=message):
        layer(rng.standard_normal((2, 4, D_MODEL)), cache=cache, seq_ids=seq_ids)
    if isinstance(cache, KVCache):
        assert len(cache) == 0 and not cache._k.any()
    elif isinstance(cache, PagedKVCache):
        assert cache.blocks_used == 0 and not cache.k_pool.any()


def test_misused_arguments_with_a_cache_are_refused(rng):
    layer, x = make_layer(topk=3), rng.standard_normal((2, 4, D_MODEL))
    cache = kv_cache(layer, 2, 9)
    with pytest.raises(ValueError, match="positions=None and absorbed=True"):
        layer(x, cache=cache, absorbed=False)
    with pytest.raises(ValueError, match="positions=None and absorbed=True"):
        layer(x, cache=cache, positions=np.arange(4))
    with pytest.raises(ValueError, match="seq_ids names sequences of a PagedKVCache"):
        layer(x, seq_ids=[0, 1])
    with pytest.raises(ValueError, match="seq_ids is for a PagedKVCache"):
        layer(x, cache=cache, seq_ids=[0, 1])
    assert len(cache) == 0


def test_the_layer_refuses_bad_input_with_the_argument_named(rng):
    layer, other = make_layer(), make_layer()
    x = rng.standard_normal((2, 5, D_MODEL))
    _, saved = other.forward(x)
    cases = [
        (lambda: layer(x[..., :10]), ValueError, r"x must be \(B, T, 24\) or \(T, 24\)"),
        (lambda: layer(x, positions=np.arange(4)), ValueError, r"positions must be \(5,\) ints"),
        (lambda: layer.backward(x, saved), ValueError, "saved must come from this layer's own forward"),
        (lambda: layer.indexer_loss(saved), ValueError, "saved must come from this layer's own forward"),
        (lambda: other.backward(x[:, :4], saved), ValueError, r"dout must have the forward's output shape"),
        (
            lambda: SparseLatentAttention(D_MODEL, HEADS, index_topk=2, **{**SIZES, "index_head_dim": 2}),
            ValueError,
            "index_head_dim must be at least qk_rope_head_dim = 4",
        ),
        (lambda: sparse_attention(x, x, x, np.zeros((2, 5, 1), int)), ValueError, r"q, k and v must be \(B, H, T, E\)"),
        (
            lambda: sparse_attention(x[None], x[None, :1], x[None], np.zeros((1, 2, 5, 1), int)),
            ValueError,
            r"k must be \(B=1, Hkv, S, E=24\)",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    layer.w_index_k = layer.w_index_k.T  # a weight replaced by one of another shape: refused before any math
    with pytest.raises(ValueError, match=r"w_index_k must be a float64 ndarray of shape \(24, 8\)"):
        layer(x)
