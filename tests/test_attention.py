import numpy as np
import pytest
from conftest import assert_close, bottom_right, gold_attention

from tinyattn_np import attention, causal_mask, one_head, scaled_dot_product_attention


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


# --- one_head ---------------------------------------------------------------------------------


def test_one_head_equals_attention(rng):
    x = rng.standard_normal((5, 16))
    wq, wk, wv = (rng.standard_normal((16, 4)) for _ in range(3))
    out, weights = one_head(x, wq, wk, wv)
    gold_out, gold_w = attention(x @ wq, x @ wk, x @ wv, causal=True, return_weights=True)
    np.testing.assert_allclose(out, gold_out, atol=1e-14)
    np.testing.assert_allclose(weights, gold_w, atol=1e-15)
    np.testing.assert_array_equal(np.triu(weights, 1), 0.0)
    assert weights[0, 0] == 1.0
    np.testing.assert_allclose(weights.sum(-1), 1.0)
    no_mask, w_all = one_head(x, wq, wk, wv, causal=False)
    assert (w_all > 0).all()
    np.testing.assert_allclose(no_mask, attention(x @ wq, x @ wk, x @ wv), atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_one_head_keeps_the_dtype(rng, dtype):
    x = rng.standard_normal((5, 16)).astype(dtype)
    w = rng.standard_normal((16, 4)).astype(dtype)
    out, weights = one_head(x, w, w, w)
    assert out.dtype == dtype and weights.dtype == dtype  # float16: computed in float32, cast back


def test_one_head_bad_shapes(rng):
    x = rng.standard_normal((5, 16))
    w = rng.standard_normal((16, 4))
    with pytest.raises(ValueError, match="x must be 2-D"):
        one_head(x[None], w, w, w)
    with pytest.raises(ValueError, match="wk must be 2-D"):
        one_head(x, w, w[:8], w)
    with pytest.raises(ValueError, match="same shape"):
        one_head(x, w, w[:, :3], w)


def test_causal_mask_used_by_one_head_is_lower_triangle():
    np.testing.assert_array_equal(causal_mask(4), np.tril(np.ones((4, 4), bool)))
