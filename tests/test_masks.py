import numpy as np
import pytest
from conftest import bottom_right

from tinyattn_np import causal_mask, window_mask
from tinyattn_np.masks import band_blocked, causal_offset


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (4, 4), (2, 5), (5, 2), (1, 9), (3, 0), (0, 3)])
def test_bottom_right_matches_loop_oracle(n_q, n_k):
    np.testing.assert_array_equal(causal_mask(n_q, n_k), bottom_right(n_q, n_k))


def test_top_left_is_torch_is_causal():
    # torch: is_causal=True uses tril(ones(L, S)), i.e. j <= i
    np.testing.assert_array_equal(causal_mask(2, 5, align="top_left"), np.tril(np.ones((2, 5), bool)))
    np.testing.assert_array_equal(causal_mask(5, 2, align="top_left"), np.tril(np.ones((5, 2), bool)))


def test_two_alignments_for_two_queries_over_five_keys():
    # the picture in masks.py's docstring, checked
    assert causal_mask(2, 5, align="top_left").astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert causal_mask(2, 5).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_alignments_agree_when_square(n):
    np.testing.assert_array_equal(causal_mask(n), causal_mask(n, n, align="top_left"))
    assert causal_mask(n).dtype == np.bool_


def test_decode_row_sees_everything():
    assert causal_mask(1, 7).all()


def test_window_mask():
    w = window_mask(5, window=2)
    for i in range(5):
        assert w[i].nonzero()[0].tolist() == [j for j in (i - 1, i) if j >= 0]
    np.testing.assert_array_equal(window_mask(3, 6, window=100), causal_mask(3, 6))


@pytest.mark.parametrize("window", [2**31, 2**63, 10**30])
def test_huge_window_is_plain_causal(window):
    # past int64 too: the window is clipped to n_q + n_k before NumPy sees it
    np.testing.assert_array_equal(window_mask(3, window=window), causal_mask(3))
    np.testing.assert_array_equal(
        window_mask(2, 5, window=window, align="top_left"), causal_mask(2, 5, align="top_left")
    )


@pytest.mark.parametrize("n_q,n_k,window", [(5, 5, 2), (2, 5, 3), (5, 2, 1), (4, 9, 4)])
def test_band_blocked_is_the_window_mask_inverted(n_q, n_k, window):
    offset = causal_offset(n_q, n_k)
    np.testing.assert_array_equal(band_blocked(0, n_q, 0, n_k, offset, window), ~window_mask(n_q, n_k, window=window))
    np.testing.assert_array_equal(band_blocked(0, n_q, 0, n_k, offset, None), ~causal_mask(n_q, n_k))
    # a tile of the matrix is the same piece of the band
    np.testing.assert_array_equal(
        band_blocked(1, n_q, 1, n_k, offset, window), ~window_mask(n_q, n_k, window=window)[1:, 1:]
    )


def test_window_mask_loop_oracle():
    # Mistral's sliding window with L = S: query i sees i - window < j <= i
    n, window = 7, 3
    gold = np.array([[i - window < j <= i for j in range(n)] for i in range(n)])
    np.testing.assert_array_equal(window_mask(n, window=window), gold)


def test_bad_arguments():
    with pytest.raises(ValueError, match="align"):
        causal_mask(3, align="left")
    with pytest.raises(ValueError, match="n_q"):
        causal_mask(-1)
    with pytest.raises(TypeError, match="n_k must be an int >= 0; got 2.5"):
        causal_mask(2, 2.5)
    with pytest.raises(ValueError, match="window"):
        window_mask(3, window=0)
    with pytest.raises(TypeError, match="window"):
        window_mask(3, window=1.5)
