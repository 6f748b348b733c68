"""Qwen3-Next's Gated DeltaNet layer (deltanet.py): its backward by central differences; its cache (prefill then
one-token steps equal the whole sequence, bytes constant and equal to the memory bill, read back after a save and
a pickle, read-only, all or nothing under an interrupt); its weights the parameters the bill counts; bad input
refused with the argument named."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_backward import numerical_grad  # central differences, one entry at a time
from test_kvcache import PACKAGE, _all_or_nothing, _lock_is_free
from test_linear import relative

from tinyattn_np import (
    GatedDeltaCache,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    LinearAttention,
    gated_deltanet,
    gated_deltanet_backward,
    linear_attention_state_bytes,
)

SHAPE = GatedDeltaNetShape(d_model=12, key_heads=2, value_heads=4, key_dim=4, value_dim=3, conv_kernel=3)


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
    """A KeyboardInterrupt raised at each bytecode of a one-token step in turn (in deltanet.py, linear.py and
    _atomic.py): the cache is as it was or as the whole step leaves it; the lock is free and the next step runs."""
    weights, rng = make_weights(), np.random.default_rng(15)
    x = rng.standard_normal((1, 2, SHAPE.d_model))
    past, state = rng.standard_normal((1, 2, SHAPE.conv_channels)), rng.standard_normal((1, 4, 4, 3))
    code = tuple(str(PACKAGE / name) for name in ("deltanet.py", "linear.py", "_atomic.py"))

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
