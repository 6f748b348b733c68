"""The gated delta rule and its layer: the plain recurrent loop against an oracle written token by token from the
rule's three lines, recurrent = chunked for every chunk size (the plain chunks and the engine's), the per-channel
decay (Kimi), the gradients against central differences and the chunked backward against the recurrent one; the
Gated DeltaNet layer's backward; its cache (prefill then one-token steps equal the whole sequence, bytes constant
and equal to the memory bill, read back after a save, all or nothing under an interrupt); bad input refused with
the argument named."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_backward import numerical_grad  # central differences, one entry at a time
from test_kvcache import PACKAGE, _all_or_nothing, _lock_is_free

import tinyattn_np._guard as guard_module
import tinyattn_np._linear_kernel as kernel
from tinyattn_np import (
    AttentionMemoryError,
    GatedDeltaCache,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    LinearAttention,
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_recurrent_backward,
    gated_deltanet,
    gated_deltanet_backward,
    linear_attention_state_bytes,
)
from tinyattn_np import linear as linear_module

SHAPE = GatedDeltaNetShape(d_model=12, key_heads=2, value_heads=4, key_dim=4, value_dim=3, conv_kernel=3)
CHUNK_SIZES = [1, 2, 3, 5, 8, 13, 16, 64]  # T = 13: most leave a shorter last chunk


def make_inputs(rng, *, B=2, H=2, Hv=4, T=13, d_k=4, d_v=3, per_channel=False, dtype=np.float64):
    """q, k (B, H, T, d_k), v (B, Hv, T, d_v), g (B, Hv, T) or (B, Hv, T, d_k) in [-1, 0), beta (B, Hv, T) in
    (0, 1), a state (B, Hv, d_k, d_v)."""
    q, k = (rng.standard_normal((B, H, T, d_k)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, Hv, T, d_v)).astype(dtype)
    g = -rng.uniform(0.01, 1, (B, Hv, T, d_k) if per_channel else (B, Hv, T)).astype(dtype)
    beta = rng.uniform(0.05, 1, (B, Hv, T)).astype(dtype)
    return q, k, v, g, beta, rng.standard_normal((B, Hv, d_k, d_v)).astype(dtype)


def prepared(q, k, value_heads, l2norm=False):
    """q and k as gated_delta_rule hands them to the rule: unit length (l2norm), q / √d_k, each head repeated for
    the value heads it serves. Written apart from the package's own _prepare."""
    if l2norm:
        q, k = (x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    groups = value_heads // q.shape[1]
    return np.repeat(q / np.sqrt(q.shape[-1]), groups, axis=1), np.repeat(k, groups, axis=1)


def oracle(q, k, v, g, beta, state):
    """The three lines for each batch entry, head and token, with np.outer and a diagonal matrix: (o, state)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    state = np.array(state, np.float64)
    o = np.zeros(v.shape)
    for b, h in np.ndindex(v.shape[:2]):
        S = state[b, h]
        for t in range(v.shape[2]):
            decay = np.exp(g[b, h, t]) * np.ones(k.shape[-1])  # one per head, or one per key channel
            S = np.diag(decay) @ S
            S = S + beta[b, h, t] * np.outer(k[b, h, t], v[b, h, t] - S.T @ k[b, h, t])
            o[b, h, t] = S.T @ q[b, h, t]
        state[b, h] = S
    return o, state


def relative(mine, gold):
    mine, gold = np.asarray(mine, np.float64), np.asarray(gold, np.float64)
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


# --- the rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
def test_the_recurrent_loop_is_the_three_lines(per_channel):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(0), H=4, per_channel=per_channel)
    o, final = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    gold_o, gold_state = oracle(q, k, v, g, beta, state)
    assert relative(o, gold_o) < 1e-13 and relative(final, gold_state) < 1e-13


def test_one_step_is_gradient_descent_on_the_regression_loss():
    """With no decay, S + β k (v − Sᵀk)ᵀ is S − β ∇_S ½‖Sᵀk − v‖², the gradient taken by central differences."""
    rng = np.random.default_rng(1)
    S, k, v, beta = rng.standard_normal((4, 3)), rng.standard_normal(4), rng.standard_normal(3), 0.3
    loss = lambda: 0.5 * np.sum((S.T @ k - v) ** 2)  # noqa: E731
    step = S - beta * numerical_grad(loss, S)
    _, after = gated_delta_rule_recurrent(k[None], k[None], v[None], np.zeros(1), np.array([beta]), S)
    np.testing.assert_allclose(after, step, atol=1e-8)


def test_orthonormal_keys_and_a_step_of_one_store_each_value_exactly():
    keys, values = np.eye(4)[:3], np.random.default_rng(2).standard_normal((3, 5))  # 3 orthonormal keys
    o, state = gated_delta_rule_recurrent(keys, keys, values, np.zeros(3), np.ones(3))
    np.testing.assert_allclose(keys @ state, values, atol=1e-15)  # Sᵀk_i = v_i: every key reads its own value
    np.testing.assert_allclose(o, values, atol=1e-15)


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunked_equals_recurrent_for_every_chunk_size(chunk_size, per_channel):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(3), per_channel=per_channel)
    q_heads, k_heads = prepared(q, k, v.shape[1], l2norm=True)
    gold_o, gold_state = gated_delta_rule_recurrent(q_heads, k_heads, v, g, beta, state)
    plain = gated_delta_rule_chunked(q_heads, k_heads, v, g, beta, state, chunk_size=chunk_size)
    for form in (None, chunk_size):  # the engine's token loop, and its chunks
        o, final = gated_delta_rule(
            q, k, v, g, beta, chunk_size=form, initial_state=state, return_state=True, l2norm_qk=True
        )
        assert relative(o, gold_o) < 1e-12 and relative(final, gold_state) < 1e-12, form
    assert relative(plain[0], gold_o) < 1e-12 and relative(plain[1], gold_state) < 1e-12


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
def test_float32_stays_in_float32_and_close_to_float64_over_many_chunks(per_channel):
    """300 tokens in chunks of 16 and 64: float32 keeps its dtype and agrees with float64 to float32's precision;
    a strong decay (g down to −8 per token, e^(−512) across a chunk) overflows nothing."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, state = make_inputs(rng, T=300, d_k=32, d_v=16, per_channel=per_channel)
    g = g * rng.choice([1.0, 8.0], g.shape)
    gold = gated_delta_rule(q, k, v, g, beta, initial_state=state, l2norm_qk=True, chunk_size=None)
    for chunk_size in (16, 64):
        o = gated_delta_rule(
            *(x.astype(np.float32) for x in (q, k, v, g, beta)),
            chunk_size=chunk_size,
            initial_state=state.astype(np.float32),
            l2norm_qk=True,
        )
        assert o.dtype == np.float32 and np.all(np.isfinite(o))
        assert relative(o, gold) < 2e-5


def test_float16_is_computed_in_float32_and_cast_back():
    q, k, v, g, beta, _ = make_inputs(np.random.default_rng(5))
    o = gated_delta_rule(*(x.astype(np.float16) for x in (q, k, v)), g, beta, l2norm_qk=True)
    gold = gated_delta_rule(*(x.astype(np.float16).astype(np.float32) for x in (q, k, v)), g, beta, l2norm_qk=True)
    assert o.dtype == np.float16
    np.testing.assert_array_equal(o, gold.astype(np.float16))


@pytest.mark.parametrize("T", [0, 1])
def test_no_token_and_one_token(T):
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(6), T=T)
    for chunk_size in (None, 64):
        o, final = gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True)
        gold = oracle(*prepared(q, k, v.shape[1]), v, g, beta, state)
        assert o.shape == v.shape
        np.testing.assert_allclose(o, gold[0], atol=1e-14)
        np.testing.assert_allclose(final, gold[1], atol=1e-14)


def test_the_workers_never_change_the_bits(monkeypatch):
    """The heads split over 1, 2 or 3 worker threads: the same output, state and gradients, bit for bit."""
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(7), B=3, T=20)
    monkeypatch.setattr(kernel, "HEAD_TOKENS_PER_WORKER", 1)
    results = []
    for cores in (1, 2, 3):
        monkeypatch.setattr(kernel, "cpu_cores", lambda cores=cores: cores)
        o, final = gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=state, return_state=True)
        grads = gated_delta_rule_backward(q, k, v, g, beta, o, chunk_size=8, initial_state=state)
        results.append((o, final, *grads))
    for other in results[1:]:
        for mine, gold in zip(other, results[0], strict=True):
            np.testing.assert_array_equal(mine, gold)


# --- the gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_every_gradient_by_central_differences(chunk_size, per_channel):
    """dq, dk, dv, dg, dbeta and the initial state's gradient, through the L2 normalisation, the scale and the
    grouped heads, from a gradient of the output and one of the final state."""
    rng = np.random.default_rng(8)
    inputs = list(make_inputs(rng, B=1, H=1, Hv=2, T=6, d_k=3, d_v=2, per_channel=per_channel))
    dout, dstate = rng.standard_normal(inputs[2].shape), rng.standard_normal(inputs[5].shape)

    def loss():
        q, k, v, g, beta, state = inputs
        o, final = gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, initial_state=state, return_state=True, l2norm_qk=True
        )
        return np.sum(o * dout) + np.sum(final * dstate)

    grads = gated_delta_rule_backward(
        *inputs[:5], dout, chunk_size=chunk_size, initial_state=inputs[5], dstate=dstate, l2norm_qk=True
    )
    for name, x, grad in zip(grads._fields, inputs, grads, strict=True):
        assert relative(grad, numerical_grad(loss, x)) < 1e-8, name


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay per head", "per key channel"])
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_the_chunked_backward_equals_the_recurrent_one(chunk_size, per_channel):
    rng = np.random.default_rng(9)
    q, k, v, g, beta, state = make_inputs(rng, T=37, d_k=8, d_v=5, per_channel=per_channel)
    dout = rng.standard_normal(v.shape)
    gold = gated_delta_rule_backward(q, k, v, g, beta, dout, chunk_size=None, initial_state=state)
    grads = gated_delta_rule_backward(q, k, v, g, beta, dout, chunk_size=chunk_size, initial_state=state)
    for name, mine, ref in zip(grads._fields, grads, gold, strict=True):
        assert mine.shape == ref.shape and relative(mine, ref) < 1e-11, name


def test_the_plain_backward_is_the_reference_on_prepared_inputs():
    """gated_delta_rule_recurrent_backward takes what gated_delta_rule_recurrent takes; without an initial state
    its dinitial_state is None."""
    rng = np.random.default_rng(10)
    q, k, v, g, beta, _ = make_inputs(rng, H=4)
    dout = rng.standard_normal(v.shape)
    plain = gated_delta_rule_recurrent_backward(q, k, v, g, beta, dout)
    scaled = gated_delta_rule_backward(q * 2.0, k, v, g, beta, dout, chunk_size=5)  # d_k = 4: the scale is ½
    assert plain.dinitial_state is None and scaled.dinitial_state is None
    for name in ("dk", "dv", "dg", "dbeta"):
        assert relative(getattr(scaled, name), getattr(plain, name)) < 1e-12, name
    assert relative(scaled.dq * 2.0, plain.dq) < 1e-12


# --- the layer ----------------------------------------------------------------------------------------


def make_weights(seed=0, dtype=np.float64):
    """Weights at transformers' initialisation, scaled up so that every part of the layer moves the output."""
    w = SHAPE.init_weights(rng=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    big = {name: rng.standard_normal(x.shape).astype(dtype) * 0.4 for name, x in w._asdict().items() if x.ndim == 2}
    return w._replace(
        **big,
        norm=rng.uniform(0.5, 1.5, SHAPE.value_dim).astype(dtype),
        a_log=np.log(rng.uniform(0.2, 1.0, SHAPE.value_heads)).astype(dtype),
    )


def test_the_layers_backward_by_central_differences():
    """dx and every weight's gradient, on a layer of two value heads sharing one key head, in chunks of 2."""
    shape = GatedDeltaNetShape(d_model=6, key_heads=1, value_heads=2, key_dim=3, value_dim=2, conv_kernel=3)
    rng = np.random.default_rng(11)
    weights = GatedDeltaNetWeights(*(x + 0.3 * rng.standard_normal(x.shape) for x in shape.init_weights(rng=rng)))
    x, dy = rng.standard_normal((2, 5, shape.d_model)), rng.standard_normal((2, 5, shape.d_model))
    loss = lambda: np.sum(gated_deltanet(x, weights, shape, chunk_size=2)[0] * dy)  # noqa: E731
    dx, grads = gated_deltanet_backward(dy, gated_deltanet(x, weights, shape, chunk_size=2)[1])
    assert relative(dx, numerical_grad(loss, x)) < 1e-8
    for name, w, grad in zip(GatedDeltaNetWeights._fields, weights, grads, strict=True):
        assert grad.shape == w.shape and relative(grad, numerical_grad(loss, w)) < 1e-7, name


@pytest.mark.parametrize("prompt", [1, 2, 7])
def test_a_prompt_then_one_token_a_step_equals_the_whole_sequence(prompt):
    rng = np.random.default_rng(12)
    weights = make_weights()
    x = rng.standard_normal((2, 11, SHAPE.d_model))
    whole, _ = gated_deltanet(x, weights, SHAPE, chunk_size=4)
    cache = GatedDeltaCache(2, SHAPE, np.float64)
    pieces = [gated_deltanet(x[:, :prompt], weights, SHAPE, cache=cache, chunk_size=4)[0]]
    pieces += [gated_deltanet(x[:, t : t + 1], weights, SHAPE, cache=cache)[0] for t in range(prompt, 9)]
    pieces.append(gated_deltanet(x[:, 9:], weights, SHAPE, cache=cache)[0])  # two more at once
    assert relative(np.concatenate(pieces, axis=1), whole) < 1e-12
    assert len(cache) == 11


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_caches_bytes_never_grow_and_equal_the_memory_bill(dtype):
    """batch · (conv_channels · (K − 1) + Hv · Dk · Dv) · itemsize, at every length: linear_attention_state_bytes
    with conv_kernel=K − 1 inputs kept. models.LinearAttention bills K of them, as transformers' cache holds K
    (it keeps one input more than the next step reads)."""
    weights, cache = make_weights(dtype=dtype), GatedDeltaCache(3, SHAPE, dtype)
    sizes = dict(heads=SHAPE.value_heads, key_dim=SHAPE.key_dim, value_dim=SHAPE.value_dim, batch=3)
    bill = linear_attention_state_bytes(
        layers=1,
        **sizes,
        conv_channels=SHAPE.conv_channels,
        conv_kernel=SHAPE.conv_kernel - 1,
        dtype=np.dtype(dtype).name,
    )
    x = np.random.default_rng(13).standard_normal((3, 40, SHAPE.d_model)).astype(dtype)
    held = {cache.nbytes}
    for start, stop in ((0, 30), (30, 31), (31, 32), (32, 40)):
        gated_deltanet(x[:, start:stop], weights, SHAPE, cache=cache)
        held.add(cache.nbytes)
    assert held == {bill}
    shape = LinearAttention(
        "gated_deltanet", SHAPE.key_heads, SHAPE.value_heads, SHAPE.key_dim, SHAPE.value_dim, SHAPE.conv_kernel
    )
    itemsize = np.dtype(dtype).itemsize
    assert shape.state_bytes(1, np.dtype(dtype).name, batch=3) == bill + 3 * SHAPE.conv_channels * itemsize


def test_the_weights_are_the_parameters_the_bill_counts():
    shape = LinearAttention(
        "gated_deltanet", SHAPE.key_heads, SHAPE.value_heads, SHAPE.key_dim, SHAPE.value_dim, SHAPE.conv_kernel
    )
    assert sum(w.size for w in SHAPE.init_weights(rng=0)) == shape.parameters(SHAPE.d_model)


def test_a_state_read_back_after_a_save_and_a_pickle_decodes_on_the_same(tmp_path):
    rng = np.random.default_rng(14)
    weights, x = make_weights(), rng.standard_normal((2, 9, SHAPE.d_model))
    cache = GatedDeltaCache(2, SHAPE, np.float64)
    gated_deltanet(x[:, :6], weights, SHAPE, cache=cache)
    np.save(tmp_path / "conv.npy", cache.conv_inputs)
    np.save(tmp_path / "state.npy", cache.state)
    loaded = GatedDeltaCache(2, SHAPE, np.float64)
    loaded.load(np.load(tmp_path / "conv.npy"), np.load(tmp_path / "state.npy"), len(cache))
    pickled = pickle.loads(pickle.dumps(cache))
    ys = [gated_deltanet(x[:, 6:], weights, SHAPE, cache=c)[0] for c in (cache, loaded, pickled)]
    np.testing.assert_array_equal(ys[1], ys[0])
    np.testing.assert_array_equal(ys[2], ys[0])
    assert len(loaded) == len(pickled) == 9


def test_the_cache_hands_out_read_only_arrays():
    cache = GatedDeltaCache(1, SHAPE)
    for array in (cache.conv_inputs, cache.state):
        with pytest.raises(ValueError):
            array[...] = 1.0
        with pytest.raises(ValueError):
            array.flags.writeable = True


def test_an_interrupt_at_any_bytecode_of_a_step_leaves_the_cache_before_or_after():
    """A KeyboardInterrupt raised at each bytecode of a one-token step in turn (in linear.py and _atomic.py):
    the cache is as it was or as the whole step leaves it; the lock is free and the next step runs."""
    weights, rng = make_weights(), np.random.default_rng(15)
    x = rng.standard_normal((1, 2, SHAPE.d_model))
    past, state = rng.standard_normal((1, 2, SHAPE.conv_channels)), rng.standard_normal((1, 4, 4, 3))
    code = tuple(str(PACKAGE / name) for name in ("linear.py", "_atomic.py"))

    def make():
        cache = GatedDeltaCache(1, SHAPE, np.float64)
        cache.load(past, state, 5)
        return cache

    def snapshot(cache):
        return len(cache), cache.conv_inputs.tobytes(), cache.state.tobytes()

    def still_works(cache):
        assert _lock_is_free(cache.lock)
        gated_deltanet(x[:, 1:], weights, SHAPE, cache=cache)

    step = lambda cache: gated_deltanet(x[:, :1], weights, SHAPE, cache=cache)  # noqa: E731
    assert _all_or_nothing(make, step, snapshot, still_works, code) > 50


# --- bad input ----------------------------------------------------------------------------------------

Q, K, V, G, BETA, STATE = make_inputs(np.random.default_rng(16))
BAD_RULE = [  # (keyword arguments that replace good ones, the error, words its message must hold)
    (dict(g=-G), ValueError, "g is the log of a decay and must be <= 0"),
    (dict(g=np.where(G < -0.5, np.nan, G)), ValueError, "g must be finite"),
    (dict(beta=BETA * 3), ValueError, r"beta must lie in \[0, 2\]"),
    (dict(beta=-BETA), ValueError, "beta must lie"),
    (dict(q=Q[:, :, :5]), ValueError, "q must be"),
    (dict(k=K[..., :3]), ValueError, "k must have shape"),
    (dict(v=V[:, :3]), ValueError, "must be a multiple of"),
    (dict(g=G[..., None]), ValueError, "g must have shape"),
    (dict(beta=BETA[:, :, :5]), ValueError, "beta must have shape"),
    (dict(initial_state=STATE[..., :2]), ValueError, "initial_state must have shape"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(chunk_size=True), TypeError, "chunk_size must be a positive int"),
    (dict(return_state="yes"), TypeError, "return_state must be True or False"),
    (dict(l2norm_qk=1), TypeError, "l2norm_qk must be True or False"),
    (dict(q=Q.astype(np.int64)), TypeError, "q must be float16, float32 or float64"),
]


@pytest.mark.parametrize(("change", "error", "words"), BAD_RULE, ids=[str(list(c)) for c, _, _ in BAD_RULE])
def test_bad_input_to_the_rule_names_the_argument(change, error, words):
    given = dict(q=Q, k=K, v=V, g=G, beta=BETA, initial_state=STATE)
    given.update(change)
    q, k, v, g, beta = (given.pop(name) for name in ("q", "k", "v", "g", "beta"))
    with pytest.raises(error, match=words):
        gated_delta_rule(q, k, v, g, beta, **given)


def test_bad_input_to_the_backward_and_the_plain_loops_names_the_argument():
    with pytest.raises(ValueError, match="dout must have shape"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V[:, :, :3])
    with pytest.raises(ValueError, match="dstate must have shape"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V, dstate=STATE[:, :2])
    with pytest.raises(ValueError, match="q must be"):
        gated_delta_rule_recurrent(Q, K, V, G, BETA)  # the plain loops take q and k already repeated to Hv heads
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gated_delta_rule_chunked(*prepared(Q, K, 4), V, G, BETA, chunk_size=-1)


def test_bad_input_to_the_layer_and_the_cache_names_the_argument():
    weights, x = make_weights(), np.zeros((2, 3, SHAPE.d_model))
    with pytest.raises(ValueError, match="weights.w_qkv must have shape"):
        gated_deltanet(x, weights._replace(w_qkv=weights.w_qkv.T), SHAPE)
    with pytest.raises(ValueError, match="x must be float32 or float64"):
        gated_deltanet(x[..., :5], weights, SHAPE)
    with pytest.raises(ValueError, match="shape.value_heads=3 must be a multiple"):
        gated_deltanet(x, weights, SHAPE._replace(value_heads=3))
    with pytest.raises(ValueError, match="cache must be a GatedDeltaCache"):
        gated_deltanet(x, weights, SHAPE, cache=GatedDeltaCache(3, SHAPE, np.float64))
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        GatedDeltaCache(1, SHAPE, np.float16)
    cache = GatedDeltaCache(1, SHAPE, np.float64)
    with pytest.raises(ValueError, match="state must have shape"):
        cache.load(cache.conv_inputs, cache.state[:, :1], 3)
    assert len(cache) == 0


def test_the_memory_guard_refuses_before_the_chunks_run(monkeypatch):
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1000)
    with pytest.raises(AttentionMemoryError, match="gated_delta_rule would allocate"):
        gated_delta_rule(Q, K, V, G, BETA)
    with pytest.raises(AttentionMemoryError, match="gated_delta_rule_recurrent_backward would allocate"):
        gated_delta_rule_backward(Q, K, V, G, BETA, V, chunk_size=None)


def test_the_lesson_opens_with_the_plain_loop():
    """linear.py's first definition is the recurrent loop, the rule as its three lines (the house's rule 1)."""
    import ast

    tree = ast.parse(open(linear_module.__file__, encoding="utf-8").read())
    first = next(node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef))
    assert first.name == "gated_delta_rule_recurrent"


# --- scripts/linear.py --------------------------------------------------------------------------------


def test_the_script_runs_small_and_prints_every_section(monkeypatch, tmp_path, capsys):
    """scripts/linear.py's smallest run: its three sections and checks, every line within a terminal's 120
    columns, the figures written as JSON (timings aside: the machine is quiet by fiat here)."""
    import json
    import sys

    from test_scripts import ROOT, load

    script = load("linear.py")
    sys.path.insert(0, str(ROOT / "scripts"))
    import machine

    monkeypatch.setattr(machine, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(machine, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)
    flags = "--tokens 64 --heads 2 --head-dim 16 --chunk-sizes 16 32 --contexts 32 256 --repeats 1".split()
    flags += ["--json", str(tmp_path / "linear.json")]
    assert script.main(flags) == 0
    out = capsys.readouterr().out
    for section in ("1) the prefill", "2) the chunk size", "3) one decode step", "all checks passed"):
        assert section in out, out
    assert max(len(line) for line in out.splitlines()) <= 120
    figures = json.loads((tmp_path / "linear.json").read_text())
    assert [row["context"] for row in figures["decode"]] == [32, 256] and len(figures["chunk_sizes"]) == 2
