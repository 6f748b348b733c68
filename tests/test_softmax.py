import numpy as np
import pytest
from scipy.special import logsumexp as scipy_logsumexp
from scipy.special import softmax as scipy_softmax

from tinyattn_np import logsumexp, merge_states, softmax


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_and_logsumexp_match_scipy(rng, axis, dtype):
    x = (5 * rng.standard_normal((4, 6, 7))).astype(dtype)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(softmax(x, axis=axis), scipy_softmax(x.astype(np.float64), axis=axis), atol=tol)
    np.testing.assert_allclose(
        logsumexp(x, axis=axis), scipy_logsumexp(x.astype(np.float64), axis=axis), rtol=tol, atol=tol
    )
    assert softmax(x, axis=axis).dtype == dtype
    assert logsumexp(x, axis=axis, keepdims=True).shape == np.expand_dims(x.sum(axis=axis), axis).shape


def test_large_scores_do_not_overflow():
    # exp(1e4) is inf in float32 and float64; subtracting the row max keeps every exp in [0, 1]
    x = np.array([[1e4, 1e4 - 1.0, 0.0]], np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(x)).any()  # the naive formula would overflow
    np.testing.assert_allclose(softmax(x), [[1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1)), 0.0]], rtol=1e-6)
    np.testing.assert_allclose(logsumexp(x), [1e4 + np.log1p(np.exp(-1.0))], rtol=1e-7)


def test_fully_masked_row_gives_zeros_and_minus_inf():
    x = np.array([[0.0, 1.0], [-np.inf, -np.inf]])
    with np.errstate(all="raise"):  # no warning, no NaN on the way
        w, lse = softmax(x), logsumexp(x)
    np.testing.assert_array_equal(w[1], [0.0, 0.0])
    assert lse[1] == -np.inf
    np.testing.assert_allclose(w[0].sum(), 1.0)


def test_float16_is_computed_in_float32_and_cast_back():
    x = np.array([[10.0, 9.0, -3.0]], np.float16)
    out = softmax(x)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, scipy_softmax(x.astype(np.float64), axis=-1), atol=1e-3)


def _partial(scores, v):
    """(out, lse) of attention over a subset of keys, from scipy."""
    with np.errstate(invalid="ignore"):
        w = np.nan_to_num(scipy_softmax(scores, axis=-1))
    return w @ v, scipy_logsumexp(scores, axis=-1)


@pytest.mark.parametrize("split", [1, 3, 7, 9])
def test_merge_states_of_two_parts_equals_the_whole(rng, split):
    scores, v = rng.standard_normal((2, 5, 10)), rng.standard_normal((2, 10, 3))
    out_a, lse_a = _partial(scores[..., :split], v[:, :split])
    out_b, lse_b = _partial(scores[..., split:], v[:, split:])
    gold_out, gold_lse = _partial(scores, v)
    for first, second in [((out_a, lse_a), (out_b, lse_b)), ((out_b, lse_b), (out_a, lse_a))]:
        out, lse = merge_states(*first, *second)
        np.testing.assert_allclose(out, gold_out, atol=1e-14)
        np.testing.assert_allclose(lse, gold_lse, atol=1e-14)


def test_merge_states_any_grouping_of_many_parts(rng):
    scores, v = rng.standard_normal((4, 12)), rng.standard_normal((12, 2))
    cuts = [0, 2, 5, 6, 12]
    parts = [_partial(scores[:, a:b], v[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    left = parts[0]
    for p in parts[1:]:  # ((p0 p1) p2) p3
        left = merge_states(*left, *p)
    right = parts[-1]
    for p in reversed(parts[:-1]):  # p0 (p1 (p2 p3))
        right = merge_states(*p, *right)
    gold = _partial(scores, v)
    for got in (left, right):
        np.testing.assert_allclose(got[0], gold[0], atol=1e-14)
        np.testing.assert_allclose(got[1], gold[1], atol=1e-14)


def test_merge_states_with_empty_parts():
    out = np.array([[1.0, 2.0], [3.0, 4.0]])
    lse = np.array([0.5, -np.inf])  # row 1 of part a saw no key
    empty_out, empty_lse = np.zeros((2, 2)), np.full(2, -np.inf)
    with np.errstate(all="raise"):
        merged, merged_lse = merge_states(out, lse, empty_out, empty_lse)
    np.testing.assert_array_equal(merged, [[1.0, 2.0], [0.0, 0.0]])
    np.testing.assert_array_equal(merged_lse, lse)


def test_merge_states_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="out_a and out_b"):
        merge_states(np.zeros((2, 3)), np.zeros(2), np.zeros((3, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="lse_a and lse_b"):
        merge_states(np.zeros((2, 3)), np.zeros(3), np.zeros((2, 3)), np.zeros(3))


@pytest.mark.parametrize("fn", [softmax, logsumexp])
def test_softmax_family_rejects_ints_and_scalars(fn):
    with pytest.raises(TypeError, match="int64"):
        fn(np.arange(4))
    with pytest.raises(ValueError, match="at least 1 dim"):
        fn(np.float64(1.0))


def test_logsumexp_keepdims_must_be_a_bool():
    with pytest.raises(TypeError, match="keepdims must be True or False"):
        logsumexp(np.ones((2, 3)), keepdims="False")
    assert logsumexp(np.zeros((2, 3)), keepdims=np.True_).shape == (2, 1)


# --- numbers at the edge --------------------------------------------------------------------------


def test_logsumexp_with_inf_matches_scipy():
    for row in ([np.inf, 0.0], [np.inf, np.inf], [-np.inf, -np.inf], [np.nan, 1.0], [-np.inf, 2.0]):
        x = np.array(row)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(logsumexp(x), scipy_logsumexp(x), err_msg=str(row))


def test_a_row_holding_inf_or_nan_gives_nan_as_torch_and_no_warning():
    x = np.array([[np.inf, 0.0], [np.nan, 1.0], [-np.inf, 2.0], [np.inf, np.inf], [-np.inf, -np.inf]], np.float32)
    with np.errstate(all="raise"):  # neither a warning nor an error inside softmax
        w = softmax(x)
    assert np.isnan(w[:2]).all() and np.isnan(w[3]).all()  # inf - inf: the whole row NaN (torch.softmax too)
    np.testing.assert_array_equal(w[2], [0.0, 1.0])  # -inf is a hidden key, not a bad one
    np.testing.assert_array_equal(w[4], [0.0, 0.0])  # no key at all: zeros


def test_merge_states_propagates_nan_and_inf():
    out = np.ones((3, 2))
    lse_a = np.array([np.nan, np.inf, -np.inf])
    lse_b = np.array([0.0, 0.0, -np.inf])
    merged, lse = merge_states(out, lse_a, out, lse_b)
    assert np.isnan(lse[0]) and lse[1] == np.inf and lse[2] == -np.inf
    assert np.isnan(merged[:2]).all()  # not a quiet 0
    np.testing.assert_array_equal(merged[2], 0.0)  # no key on either side: 0


def test_merge_states_float16_computes_in_float32(rng):
    out_a, out_b = (rng.standard_normal((4, 3)).astype(np.float16) for _ in range(2))
    lse_a = np.array([1.0, 20.0, 60000.0, -5.0], np.float16)
    lse_b = np.array([1.5, 20.0, 60000.0, -np.inf], np.float16)
    merged, lse = merge_states(out_a, lse_a, out_b, lse_b)
    assert merged.dtype == np.float16 and lse.dtype == np.float32
    gold_lse = np.logaddexp(lse_a.astype(np.float64), lse_b.astype(np.float64))
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-6)  # float32 keeps 60000 + log 2 to 1e-6 (float16: 2^-11)
    w_a = np.exp(lse_a.astype(np.float64) - gold_lse)[:, None]
    gold = w_a * out_a + (1 - w_a) * out_b
    np.testing.assert_allclose(merged, gold, atol=2e-3)
