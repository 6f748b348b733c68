import importlib
import time
import warnings

import numpy as np
import pytest
from conftest import assert_close, bottom_right, gold_attention

from tinyattn_np import (
    AttentionMemoryError,
    MultiHeadAttention,
    Softcap,
    attention,
    attention_backward,
    causal_mask,
    causal_mod,
    create_block_mask,
    flash_attention,
    flash_decode,
    flex_attention,
    naive_attention_bytes,
    scaled_dot_product_attention,
)
from tinyattn_np.measure import traced_peak


def qkv(rng, batch=(2,), hq=4, hkv=2, n_q=5, n_k=7, e=8, ev=3, dtype=np.float64):
    q = rng.standard_normal((*batch, hq, n_q, e)).astype(dtype)
    k = rng.standard_normal((*batch, hkv, n_k, e)).astype(dtype)
    v = rng.standard_normal((*batch, hkv, n_k, ev)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_matches_gold(rng, dtype, batch, hq, hkv):
    q, k, v = qkv(rng, batch, hq, hkv, dtype=dtype)
    out, weights = attention(q, k, v, return_weights=True)
    assert out.shape == (*batch, hq, 5, 3) and out.dtype == dtype
    assert weights.shape == (*batch, hq, 5, 7)
    assert_close(out, gold_attention(q, k, v)[0], dtype, "no mask")
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("n_q,n_k", [(5, 7), (7, 5), (6, 6), (1, 9)])
def test_causal_is_bottom_right(rng, n_q, n_k):
    q, k, v = qkv(rng, n_q=n_q, n_k=n_k)
    out = attention(q, k, v, causal=True)
    gold, _ = gold_attention(q, k, v, bottom_right(n_q, n_k))
    assert_close(out, gold, np.float64, "causal")


def test_rows_without_a_visible_key_are_zero(rng):
    # 7 queries over 5 keys, bottom-right: queries 0 and 1 see no key at all
    q, k, v = qkv(rng, n_q=7, n_k=5)
    with np.errstate(all="raise"):
        out, weights = attention(q, k, v, causal=True, return_weights=True)
    np.testing.assert_array_equal(out[..., :2, :], 0.0)
    np.testing.assert_array_equal(weights[..., :2, :], 0.0)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_an_inf_or_nan_input_gives_nan_where_it_reaches_and_no_warning(rng, bad, where):
    """As torch: NaN in, NaN out, and an inf reaches its rows through inf - inf or 0 · inf; never a
    RuntimeWarning from the reference forward, its backward, flex_attention or a layer's reference path.
    Entry 3 of head 0 (batch 0) is bad: under the causal mask rows 0-2 never meet key 3; head 1 is apart."""
    clean = dict(zip("qkv", qkv(rng, hq=2, hkv=2, n_q=6, n_k=6), strict=True))
    x = {name: array.copy() for name, array in clean.items()}
    x[where][0, 0, 3, 1] = bad
    dout = rng.standard_normal((2, 2, 6, 3))
    layer = MultiHeadAttention(8, 2, rng=np.random.default_rng(0), dtype=np.float64)
    tokens = rng.standard_normal((2, 6, 8))
    tokens[0, 3, 1] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning from inside the package fails the test
        out = attention(*x.values(), causal=True)
        grads = attention_backward(*x.values(), dout, causal=True)
        modded = attention(*x.values(), causal=True, score_mod=Softcap(5.0), sinks=np.array([0.5, -1.0]))
        attention(*x.values())  # no mask: every row meets the bad entry
        flex_attention(*x.values(), block_mask=create_block_mask(causal_mod(6), None, None, 6, 6))
        y, saved = layer.forward(tokens, causal=True, fused=False)
        layer.backward(np.ones_like(y), saved)
    gold, gold_grads = attention(*clean.values(), causal=True), attention_backward(*clean.values(), dout, causal=True)
    np.testing.assert_allclose(out[1], gold[1], rtol=1e-13)  # the other batch entry, and in batch 0 ...
    np.testing.assert_allclose(out[0, 1], gold[0, 1], rtol=1e-13)  # ... the other head
    for grad, gold_grad in zip(grads, gold_grads, strict=True):
        np.testing.assert_allclose(grad[1], gold_grad[1], rtol=1e-13)
    if where != "v":  # a value reaches every row of its column (0 · bad); a query or key only the rows it meets
        np.testing.assert_allclose(out[0, 0, :3], gold[0, 0, :3], rtol=1e-13)
    if np.isnan(bad):  # NaN in, NaN out: the rows whose scores meet it, the column of a value
        reached = {"q": out[0, 0, 3], "k": out[0, 0, 3:], "v": out[0, 0, :, 1]}[where]
        assert np.isnan(reached).all() and np.isnan(modded[0, 0, 3:]).any()
        assert np.isnan(y[0, 3]).all()


def test_bool_and_float_masks_agree(rng):
    q, k, v = qkv(rng)
    allowed = rng.random((2, 4, 5, 7)) > 0.4
    allowed[..., 0] = True  # every row sees at least one key
    additive = np.where(allowed, 0.0, -np.inf)
    by_bool = attention(q, k, v, mask=allowed)
    by_float = attention(q, k, v, mask=additive)
    gold, _ = gold_attention(q, k, v, allowed)
    assert_close(by_bool, gold, np.float64, "bool mask")
    assert_close(by_float, gold, np.float64, "float mask")


def test_float_mask_is_added_to_scores(rng):
    q, k, v = qkv(rng, batch=(), hq=1, hkv=1)
    bias = rng.standard_normal((5, 7))
    scale = 1 / np.sqrt(8)
    scores = q[0] @ k[0].T * scale + bias
    gold = np.exp(scores - scores.max(-1, keepdims=True))
    gold = gold / gold.sum(-1, keepdims=True) @ v[0]
    np.testing.assert_allclose(attention(q, k, v, mask=bias)[0], gold, atol=1e-14)


def test_mask_broadcasts_and_combines_with_causal(rng):
    q, k, v = qkv(rng, n_q=6, n_k=6)
    key_padding = np.ones((2, 1, 1, 6), bool)
    key_padding[1, ..., 4:] = False  # batch entry 1: last two keys are padding
    out = attention(q, k, v, mask=key_padding, causal=True)
    gold, _ = gold_attention(q, k, v, key_padding & bottom_right(6, 6))
    assert_close(out, gold, np.float64, "padding & causal")


def test_scale_keyword(rng):
    q, k, v = qkv(rng)
    assert_close(attention(q, k, v, scale=0.3), gold_attention(q, k, v, scale=0.3)[0], np.float64, "scale")


def test_two_d_inputs_are_one_head(rng):
    q, k, v = qkv(rng, batch=(), hq=1, hkv=1)
    out, weights = attention(q[0], k[0], v[0], causal=True, return_weights=True)
    assert out.shape == (5, 3) and weights.shape == (5, 7)
    np.testing.assert_array_equal(out, attention(q, k, v, causal=True)[0])


def test_float16_computes_in_float32(rng):
    q, k, v = qkv(rng, dtype=np.float16)
    out = attention(q, k, v, causal=True)
    assert out.dtype == np.float16
    gold, _ = gold_attention(q, k, v, bottom_right(5, 7))
    assert_close(out, gold, np.float16, "float16")


# --- scaled_dot_product_attention: torch's semantics -------------------------------------------


def test_sdpa_is_causal_is_top_left(rng):
    q, k, v = qkv(rng, hq=2, hkv=2, n_q=3, n_k=6)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    gold, _ = gold_attention(q, k, v, np.tril(np.ones((3, 6), bool)))
    assert_close(out, gold, np.float64, "top-left")
    # and it differs from the bottom-right alignment, which is the point of having both
    assert not np.allclose(out, attention(q, k, v, causal=True))


def test_sdpa_and_attention_agree_when_square(rng):
    q, k, v = qkv(rng, hq=2, hkv=2, n_q=6, n_k=6)
    np.testing.assert_array_equal(
        scaled_dot_product_attention(q, k, v, is_causal=True), attention(q, k, v, causal=True)
    )


def test_sdpa_gqa_needs_enable_gqa(rng):
    q, k, v = qkv(rng, hq=4, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v)
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_close(out, gold_attention(q, k, v)[0], np.float64, "gqa")


def test_sdpa_refuses_mask_with_is_causal_and_dropout(rng):
    q, k, v = qkv(rng, hq=2, hkv=2)
    with pytest.raises(ValueError, match="not both"):
        scaled_dot_product_attention(q, k, v, attn_mask=np.ones((5, 7), bool), is_causal=True)
    with pytest.raises(ValueError, match="dropout"):
        scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_sdpa_masks(rng):
    q, k, v = qkv(rng, hq=2, hkv=2)
    allowed = rng.random((5, 7)) > 0.5
    allowed[3] = False  # a fully masked row: zeros, like torch >= 2.5
    out = scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.5)
    gold, _ = gold_attention(q, k, v, allowed, scale=0.5)
    assert_close(out, gold, np.float64, "sdpa bool mask")
    np.testing.assert_array_equal(out[..., 3, :], 0.0)


def test_sdpa_refuses_mixed_dtypes(rng):
    q = rng.standard_normal((2, 5, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 5, 4)).astype(np.float16) for _ in range(2))
    with pytest.raises(TypeError, match="query float32, key float16, value float16"):
        scaled_dot_product_attention(q, k, v)
    assert attention(q, k, v).dtype == np.float32  # attention() keeps its documented promotion


def qkv_of_shape(rng, shape=(2, 5, 4), dtype=np.float64):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def test_sdpa_mask_and_is_causal_error_shows_the_way(rng):
    q, k, v = qkv_of_shape(rng, (2, 5, 4))
    padding = np.array([True, True, True, True, False])
    with pytest.raises(ValueError, match=r"torch documents.*causal_mask\(L, S, align='top_left'\).*causal=True"):
        scaled_dot_product_attention(q, k, v, attn_mask=padding, is_causal=True)
    combined = scaled_dot_product_attention(q, k, v, attn_mask=padding & causal_mask(5, 5, align="top_left"))
    np.testing.assert_allclose(combined, attention(q, k, v, causal=True, mask=padding), atol=1e-15)


# --- the memory guard runs first, on shapes and dtypes alone --------------------------------------


def _refused(q, k, v, **kw):
    with pytest.raises(AttentionMemoryError, match="would allocate"):
        attention(q, k, v, **kw)


def test_guard_refuses_float16_before_converting(monkeypatch):
    # 2^19 tokens of float16: the float32 copies alone would be 4 MiB; the guard must refuse before any
    q = np.zeros((1, 2**19, 2), np.float16)
    _, peak = traced_peak(_refused, q, q, q)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def test_guard_refuses_mixed_dtypes_before_converting():
    q, kv = np.zeros((1, 2**19, 2), np.float32), np.zeros((1, 2**19, 2), np.float64)
    _, peak = traced_peak(_refused, q, kv, kv)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def _refused_sdpa(q):
    with pytest.raises(AttentionMemoryError):
        scaled_dot_product_attention(q, q, q, is_causal=True)


def test_sdpa_is_causal_refuses_before_building_the_mask():
    # 2^20 tokens: the top-left L x S mask alone would be 1 TiB; the guard must come first, and fast
    q = np.zeros((1, 2**20, 2), np.float32)
    start = time.perf_counter()
    _, peak = traced_peak(_refused_sdpa, q)
    assert time.perf_counter() - start < 5.0
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def test_sdpa_is_causal_still_top_left(rng):
    q, k, v = qkv_of_shape(rng, (2, 3, 4))
    k, v = qkv_of_shape(rng, (2, 6, 4))[:2]
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, gold_attention(q, k, v, np.tril(np.ones((3, 6), bool)))[0], np.float64, "top-left")


def _gold_float_mask(q, k, v, mask):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ v


def test_float64_mask_on_float32_inputs_is_not_copied(rng):
    # a full-shape float64 mask, converted, is a float32 copy as big as the scores (1.9x the estimate)
    heads, n, e = 4, 256, 16
    q, k, v = qkv_of_shape(rng, (heads, n, e), np.float32)
    mask = rng.standard_normal((heads, n, n))  # float64, (Hq, L, S)
    out, peak = traced_peak(attention, q, k, v, mask=mask)
    estimate = naive_attention_bytes(n, heads=heads, head_dim=e, dtype="fp32")
    assert peak <= 1.15 * estimate, f"measured {peak:,} B, estimated {estimate:,} B"
    assert_close(out, _gold_float_mask(q, k, v, mask), np.float32, "float64 mask")


guard_module = importlib.import_module("tinyattn_np._guard")  # the memory guard reads the memory here


def test_full_shape_bool_mask_is_counted(rng, monkeypatch):
    # the ~mask temporary has the mask's size: a (B, Hq, L, S) bool mask costs B·Hq·L·S bytes, not L·S
    q = np.zeros((8, 64, 4), np.float32)
    small = naive_attention_bytes(64, heads=8, head_dim=4, bool_mask=True)
    full = naive_attention_bytes(64, heads=8, head_dim=4, bool_mask=True, mask_elements=8 * 64 * 64)
    assert full > small
    monkeypatch.setattr(guard_module, "memory_available", lambda: (small + full) // 2)
    attention(q, q, q, mask=np.ones((64, 64), bool))  # fits
    with pytest.raises(AttentionMemoryError):
        attention(q, q, q, mask=np.ones((8, 64, 64), bool))


# --- flags are real bools -------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["causal", "return_weights", "check_memory"])
def test_attention_flags_must_be_bools(rng, flag):
    q, k, v = qkv_of_shape(rng)
    with pytest.raises(TypeError, match=f"{flag} must be True or False; got 'False'"):
        attention(q, k, v, **{flag: "False"})
    attention(q, k, v, **{flag: np.bool_(False)})  # a NumPy bool is a bool


@pytest.mark.parametrize("flag", ["is_causal", "enable_gqa"])
def test_sdpa_flags_must_be_bools(rng, flag):
    q, k, v = qkv_of_shape(rng)
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        scaled_dot_product_attention(q, k, v, **{flag: "False"})


def test_attention_align_is_checked(rng):
    q, k, v = qkv_of_shape(rng)
    with pytest.raises(ValueError, match="align must be one of"):
        attention(q, k, v, causal=True, align="top-left")


# --- numbers at the edge --------------------------------------------------------------------------


def test_attention_scales_q_before_the_product():
    # q·k = 4 · 1e154 · 1e154 = 4e308 overflows float64 (max 1.8e308); (q · 1e-160)·k = 4e148 does not
    q = np.full((1, 2, 4), 1e154)
    k = np.full((1, 3, 4), 1e154)
    v = np.arange(12.0).reshape(1, 3, 4)
    with np.errstate(over="raise", invalid="raise"):
        out = attention(q, k, v, scale=1e-160)
    np.testing.assert_allclose(out, flash_attention(q, k, v, scale=1e-160))
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape))  # equal scores


def test_scale_too_large_for_a_float(rng):
    q, k, v = qkv_of_shape(rng)
    with pytest.raises(ValueError, match="scale must be a finite number; got an int too large"):
        attention(q, k, v, scale=10**400)
    with pytest.raises(ValueError, match="scale must be a finite number; got inf"):
        attention(q, k, v, scale=float("inf"))


# --- empty but valid shapes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_shape,kv_shape,ev",
    [
        ((0, 5, 4), (0, 7, 4), 3),  # zero heads
        ((0, 2, 5, 4), (0, 2, 7, 4), 3),  # empty batch
        ((2, 5, 4), (2, 7, 4), 0),  # Ev = 0
        ((0, 5, 4), (2, 7, 4), 3),  # zero query heads over two kv heads
    ],
)
def test_empty_shapes(rng, q_shape, kv_shape, ev):
    q = rng.standard_normal(q_shape)
    k = rng.standard_normal(kv_shape)
    v = rng.standard_normal((*kv_shape[:-1], ev))
    out_shape = (*q_shape[:-1], ev)
    assert attention(q, k, v, causal=True).shape == out_shape
    out, weights = attention(q, k, v, return_weights=True)
    assert out.shape == out_shape and weights.shape == (*q_shape[:-1], kv_shape[-2])
    if q_shape[-3] == kv_shape[-3]:
        assert scaled_dot_product_attention(q, k, v, is_causal=True).shape == out_shape


def test_query_heads_need_kv_heads(rng):
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        attention(np.ones((2, 3, 4)), np.ones((0, 3, 4)), np.ones((0, 3, 4)))


# --- array types NumPy has but attention should not guess about -----------------------------------


def test_masked_arrays_are_refused(rng):
    q, k, v = qkv_of_shape(rng)
    masked = np.ma.masked_array(q, mask=q > 1)
    with pytest.raises(TypeError, match=r"q is a masked array.*q\.filled\(value\).*np\.asarray\(q\)"):
        attention(masked, k, v)
    with pytest.raises(TypeError, match="mask must be a plain ndarray; got MaskedArray"):
        attention(q, k, v, mask=np.ma.masked_array(np.ones((5, 5), bool)))


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_is_refused(rng):
    q, k, v = qkv_of_shape(rng, (5, 4))
    with pytest.raises(TypeError, match=r"k is an np\.matrix: pass np\.asarray\(k\)"):
        attention(q, np.asmatrix(k), v)
    with pytest.raises(TypeError, match="mask must be a plain ndarray; got matrix"):
        attention(q, k, v, mask=np.asmatrix(np.ones((5, 5), bool)))


def test_ragged_list_names_the_argument():
    with pytest.raises(ValueError, match="q must be an array of numbers with one shape"):
        attention([[1.0, 2.0], [3.0]], np.ones((2, 2)), np.ones((2, 2)))


def test_big_endian_float32_is_float32(rng):
    q, k, v = qkv_of_shape(rng, dtype=np.float32)
    out = attention(q.astype(">f4"), k, v.astype(">f4"), causal=True)
    assert out.dtype == np.float32 and out.dtype.isnative
    np.testing.assert_array_equal(out, attention(q, k, v, causal=True))
    np.testing.assert_array_equal(flash_attention(q.astype(">f4"), k, v), flash_attention(q, k, v))


# --- masks and scales of the wrong kind are named -------------------------------------------------


def test_bad_masks_and_scales_are_named(rng):
    q, k, v = qkv_of_shape(rng)
    with pytest.raises(TypeError, match="mask must be bool .* got dtype int64"):
        attention(q, k, v, mask=np.ones((5, 5), np.int64))
    with pytest.raises(ValueError, match=r"mask must broadcast to the scores' shape .* got shape \(3, 2, 5, 5\)"):
        attention(q, k, v, mask=np.ones((3, 2, 5, 5), bool))  # would enlarge the scores
    with pytest.raises(TypeError, match="scale must be a number or None; got '0.5'"):
        attention(q, k, v, scale="0.5")


@pytest.mark.parametrize("fn", [attention, flash_attention, flash_decode])
def test_a_scale_that_overflows_float32_is_refused(fn):
    q = np.ones((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="overflows float32"):
        fn(q, q, q, scale=1e40)
    assert np.isfinite(fn(q.astype(np.float64), q, q, scale=1e40)).all()  # float64 holds it
