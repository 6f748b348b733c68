"""one_head, the attention a learner reads first: equal to the reference, its dtype kept,
its arguments checked."""

import numpy as np
import pytest

from tinyattn_np import attention, causal_mask, one_head


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


def test_one_head_causal_must_be_a_bool(rng):
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    with pytest.raises(TypeError, match="causal must be True or False; got 'False'"):
        one_head(x, w, w, w, causal="False")


def test_one_head_refuses_an_empty_head():
    x = np.ones((3, 4))
    with pytest.raises(ValueError, match="d_head of at least 1"):
        one_head(x, np.ones((4, 0)), np.ones((4, 0)), np.ones((4, 2)))
