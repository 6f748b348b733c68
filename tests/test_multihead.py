import numpy as np
import pytest

from tinyattn_np import KVCache, MultiHeadAttention, attention, rope
from tinyattn_np.multihead import HeadWeights, multihead_backward, multihead_forward, project_out


def hand_rolled(mha, x, causal=True):
    """Per-head loop with separate slices of w_qkv: the long way that the fused matmul replaces."""
    B, T, C = x.shape
    H, Hkv, dh = mha.n_heads, mha.n_kv_heads, mha.d_head
    w_q = mha.w_qkv[:, : H * dh]
    w_k = mha.w_qkv[:, H * dh : (H + Hkv) * dh]
    w_v = mha.w_qkv[:, (H + Hkv) * dh :]
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        q = x @ w_q[:, h * dh : (h + 1) * dh]
        k = x @ w_k[:, g * dh : (g + 1) * dh]
        v = x @ w_v[:, g * dh : (g + 1) * dh]
        if mha.rope:
            q, k = rope(q), rope(k)
        heads.append(attention(q, k, v, causal=causal))  # (B, T, dh)
    return np.concatenate(heads, axis=-1) @ mha.w_out


def test_article_parameter_count():
    mha = MultiHeadAttention(256, 4)
    assert mha.num_parameters == 262_144 == 4 * 256 * 256
    assert mha.w_qkv.shape == (256, 768) and mha.w_out.shape == (256, 256)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, None), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_unfused_and_hand_rolled_agree(rng, n_heads, n_kv_heads, use_rope, causal):
    mha = MultiHeadAttention(32, n_heads, n_kv_heads, rope=use_rope, rng=rng, dtype=np.float64)
    x = rng.standard_normal((2, 9, 32))
    fused, unfused = mha(x, causal=causal), mha(x, causal=causal, fused=False)
    assert fused.shape == (2, 9, 32)
    np.testing.assert_allclose(fused, unfused, atol=1e-13)
    np.testing.assert_allclose(fused, hand_rolled(mha, x, causal), atol=1e-13)
    kv = n_kv_heads or n_heads
    assert mha.w_qkv.shape == (32, (n_heads + 2 * kv) * 8)


def test_unbatched_input_and_float32(rng):
    mha = MultiHeadAttention(16, 2, rng=rng)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    out = mha(x)
    assert out.shape == (5, 16) and out.dtype == np.float32
    np.testing.assert_allclose(out, mha(x[None])[0], atol=1e-6)


def test_rope_makes_order_visible(rng):
    mha_plain = MultiHeadAttention(16, 2, rng=np.random.default_rng(0), dtype=np.float64)
    mha_rope = MultiHeadAttention(16, 2, rope=True, rng=np.random.default_rng(0), dtype=np.float64)
    x = rng.standard_normal((4, 16))
    swapped = x[[2, 1, 0, 3]]  # same set of tokens before the last one, another order
    assert np.allclose(mha_plain(x)[-1], mha_plain(swapped)[-1])
    assert not np.allclose(mha_rope(x)[-1], mha_rope(swapped)[-1])


def test_bad_configuration():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        MultiHeadAttention(16, 4, 3)
    with pytest.raises(TypeError, match="dtype"):
        MultiHeadAttention(16, 4, dtype=np.int32)
    with pytest.raises(ValueError, match="even head size"):
        MultiHeadAttention(12, 4, rope=True)
    with pytest.raises(ValueError, match="n_heads"):
        MultiHeadAttention(16, 0)
    with pytest.raises(ValueError, match=r"x must be \(B, T, 16\)"):
        MultiHeadAttention(16, 4)(np.zeros((2, 3, 8), np.float32))


def test_the_functional_layer_is_the_module(rng):
    """multihead_forward and multihead_backward over a HeadWeights (the arrays and the sizes) are the module's
    forward and backward, to the bit; and a HeadWeights decodes through a cache as the module does."""
    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=rng, dtype=np.float64)
    x, dout = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    weights = HeadWeights(mha.w_qkv, mha.w_out, n_heads=4, n_kv_heads=2, rope=True)
    out, saved = multihead_forward(x, weights)
    module_out, module_saved = mha.forward(x)
    np.testing.assert_array_equal(out, module_out)
    for mine, theirs in zip(multihead_backward(dout, saved), mha.backward(dout, module_saved), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    caches = KVCache(2, 2, 5, 4, dtype=np.float64), KVCache(2, 2, 5, 4, dtype=np.float64)
    for t in range(5):
        step = project_out(caches[0].attend(weights, x[:, t : t + 1]), weights.w_out)  # (2, 1, 16)
        np.testing.assert_array_equal(step, mha(x[:, t : t + 1], cache=caches[1]))


def test_a_cache_passed_in_does_the_decoding(rng):
    """cache= hands x to cache.attend(layer, x): the layer projects out what the cache returns, nothing more."""

    class Recorder:
        def attend(self, layer, x, *, fused=True, seq_ids=None):
            self.call = (layer, x.shape, fused, seq_ids)
            return np.ones((x.shape[0], layer.n_heads, x.shape[1], layer.d_head), layer.w_qkv.dtype)

    mha = MultiHeadAttention(16, 4, 2, rng=rng, dtype=np.float64)
    cache = Recorder()
    out = mha(rng.standard_normal((5, 16)), cache=cache, fused=False, seq_ids=[3])
    assert cache.call == (mha, (1, 5, 16), False, [3])
    np.testing.assert_array_equal(out, np.ones((5, 16)) @ mha.w_out)  # y (B, H, T, d_head) merged, then W_out


def test_multihead_imports_no_cache():
    """The caches come after the layer in the reading order: they import it, never the other way round."""
    import ast
    import pathlib

    import tinyattn_np.multihead as multihead

    tree = ast.parse(pathlib.Path(multihead.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert not imported & {"kvcache", "splitkv", "paged"}, imported


def test_a_weight_ported_from_torch_without_the_transpose_is_named(rng):
    """nn.Linear.weight is (out, in); this layer multiplies from the right, x @ W with W (in, out)."""
    mha = MultiHeadAttention(16, 4, 2, rng=rng)  # w_qkv (16, 32): 4 query heads and 2 + 2 kv heads of 4
    torch_weight = mha.w_qkv.T.copy()  # (32, 16): what nn.Linear(16, 32).weight holds
    with pytest.raises(ValueError, match=r"w_qkv must have shape \(16, 32\); got \(32, 16\): W is \(in, out\), "
                                         r"the transpose of nn.Linear.weight \(pass weight.T\)"):  # fmt: skip
        mha.w_qkv = torch_weight
    with pytest.raises(ValueError, match=r"w_out must have shape \(16, 16\); got \(16, 8\)$"):
        mha.w_out = np.zeros((16, 8), np.float32)
    with pytest.raises(TypeError, match="w_out must be a float16, float32 or float64 ndarray; got <class 'list'>"):
        mha.w_out = np.zeros((16, 16)).tolist()
    mha.w_qkv = w = torch_weight.T  # the transpose: accepted as it is, not copied (an optimizer may update it)
    assert mha.w_qkv is w


# --- arguments, seeds and dtypes ------------------------------------------------------------------


def test_multihead_flags_must_be_bools():
    with pytest.raises(TypeError, match="rope must be True or False"):
        MultiHeadAttention(8, 2, rope="yes", rng=0)
    mha = MultiHeadAttention(8, 2, rng=0)
    x = np.zeros((3, 8), np.float32)
    for flag in ("causal", "fused"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False; got 0"):
            mha(x, **{flag: 0})


def test_multihead_rng_seed_fresh_default_and_repr():
    seeded = MultiHeadAttention(8, 2, rng=42)
    np.testing.assert_array_equal(seeded.w_qkv, MultiHeadAttention(8, 2, rng=np.random.default_rng(42)).w_qkv)
    assert not np.array_equal(MultiHeadAttention(8, 2).w_qkv, MultiHeadAttention(8, 2).w_qkv)  # fresh draws
    bound = 1 / np.sqrt(8)
    assert np.abs(seeded.w_qkv).max() <= bound and np.abs(seeded.w_out).max() <= bound
    for bad in ("42", 4.2, True):
        with pytest.raises(TypeError, match="rng must be a np.random.Generator, an int seed or None"):
            MultiHeadAttention(8, 2, rng=bad)
    assert repr(seeded) == (
        "MultiHeadAttention(d_model=8, n_heads=2, n_kv_heads=2, rope=False, dtype=float32, parameters=256)"
    )


def test_multihead_computes_in_its_own_dtype():
    mha = MultiHeadAttention(8, 2, rng=0)  # float32 weights
    x = np.random.default_rng(0).standard_normal((3, 8))  # float64
    out = mha(x)
    assert out.dtype == np.float32  # as its docstring says: the module's dtype, not x's
    np.testing.assert_array_equal(out, mha(x.astype(np.float32)))


def test_split_heads_checks_its_input():
    mha = MultiHeadAttention(8, 2, rng=0)
    with pytest.raises(ValueError, match=r"x must be \(B, T, 8\)"):
        mha.split_heads(np.ones((3, 8)))
    with pytest.raises(TypeError, match="x must be float16, float32 or float64"):
        mha.split_heads(np.ones((1, 3, 8), np.int64))


# --- the backward of the forward that ran ---------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_multihead_forward_and_backward_take_the_window(rng, fused):
    mha = MultiHeadAttention(8, 2, rng=1, dtype=np.float64, rope=True)
    x, dout = rng.standard_normal((2, 9, 8)), rng.standard_normal((2, 9, 8))
    out, saved = mha.forward(x, window=3, fused=fused)
    dx, _, _ = mha.backward(dout, saved)
    i, step = (1, 5, 2), 1e-6
    losses = []
    for shift in (step, -step):  # central difference of sum(out · dout) in one entry of x
        x_shifted = x.copy()
        x_shifted[i] += shift
        losses.append(float(np.sum(mha.forward(x_shifted, window=3, fused=fused)[0] * dout)))
    assert abs(dx[i] - (losses[0] - losses[1]) / (2 * step)) < 1e-7
    with pytest.raises(ValueError, match="window=3 needs causal=True"):
        mha.forward(x, causal=False, window=3, fused=fused)


def test_multihead_backward_uses_the_forwards_input_and_weights(rng):
    mha = MultiHeadAttention(8, 2, rng=3, dtype=np.float64)
    x, dout = rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
    for fused in (True, False):
        _, saved = mha.forward(x, fused=fused)
        before = mha.backward(dout, saved)
        x_kept, w_qkv, w_out = x.copy(), mha.w_qkv.copy(), mha.w_out.copy()
        x += 1.0  # the caller changes its input in place ...
        mha.w_qkv -= 0.1  # ... and an optimizer steps the weights
        mha.w_out *= 2.0
        after = mha.backward(dout, saved)
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)
        x[...], mha.w_qkv[...], mha.w_out[...] = x_kept, w_qkv, w_out


def test_without_copies_the_forward_keeps_its_arrays_and_gives_the_same_bits(rng):
    """copies=False (the GPT's step, which changes nothing before its backward) keeps x and the weights
    themselves, and gives the output and every gradient of copies=True to the bit."""
    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=rng)
    x, dout = rng.standard_normal((2, 5, 16)).astype(np.float32), rng.standard_normal((2, 5, 16)).astype(np.float32)
    out, saved = multihead_forward(x, mha.weights)
    kept_out, kept = multihead_forward(x, mha.weights, copies=False)
    assert kept.x is x and kept.weights.w_qkv is mha.w_qkv and kept.weights.w_out is mha.w_out
    assert saved.x is not x and saved.weights.w_qkv is not mha.w_qkv
    np.testing.assert_array_equal(kept_out, out)
    for mine, gold in zip(multihead_backward(dout, kept), multihead_backward(dout, saved), strict=True):
        np.testing.assert_array_equal(mine, gold)


def test_the_layers_tile_plan_is_worked_out_once_per_shape_and_follows_the_rule(rng):
    """Every layer of a model asks flash_plan the same at every step: its sizes are worked out once for a shape,
    mask and tile rule (plan_sizes), and a new rule in force (use_tile_rule) gives new ones."""
    from tinyattn_np._checks import QKVShape
    from tinyattn_np._flash_kernel import flash_plan, plan_sizes
    from tinyattn_np.blockmask import Band
    from tinyattn_np.tune import constant_rule, use_tile_rule

    dims = QKVShape((3,), 4, 4, 64, 64, 8, 8)
    first = flash_plan(dims, Band(0), 0.5)
    hits = plan_sizes.cache_info().hits
    again = flash_plan(dims, Band(0), 0.5)
    assert again == first and plan_sizes.cache_info().hits == hits + 1
    try:
        use_tile_rule(constant_rule()._replace(side=16, backward_side=16))
        smaller = flash_plan(dims, Band(0), 0.5)
    finally:
        use_tile_rule(None)
    assert (smaller.block_q, smaller.block_k) == (16, 16) != (first.block_q, first.block_k)
    assert flash_plan(dims, Band(0), 0.5) == first
