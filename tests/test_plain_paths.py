"""The plain path beside the fast one: each algorithm a learner reads on one screen (FlashAttention-2's
Algorithms 1 and 2 for one head on one thread, the split-KV merge) is held equal to the fast path that
batches heads and runs workers, and to the reference that builds the whole score matrix."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

from tinyattn_np import (
    attention,
    attention_backward,
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_one_head,
    flash_attention_one_head,
    merge_chunks,
    merge_states,
)


def heads(rng, hq, hkv, n_q, n_k, dtype, e=8, ev=5):
    q = rng.standard_normal((hq, n_q, e)).astype(dtype)
    k = rng.standard_normal((hkv, n_k, e)).astype(dtype)
    v = rng.standard_normal((hkv, n_k, ev)).astype(dtype)
    dout = rng.standard_normal((hq, n_q, ev)).astype(dtype)
    return q, k, v, dout


BANDS = [dict(causal=False), dict(causal=True), dict(causal=True, window=5)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", BANDS, ids=["none", "causal", "window"])
@pytest.mark.parametrize("n_q,n_k", [(17, 17), (9, 23), (23, 9)])
def test_algorithm_1_for_one_head_is_the_fast_path(rng, dtype, band, n_q, n_k):
    q, k, v, _ = heads(rng, 4, 2, n_q, n_k, dtype)
    out, lse = flash_attention(q, k, v, block_q=4, block_k=3, return_lse=True, workers=2, **band)
    for h in range(4):  # query head h reads kv head h // 2
        one_out, one_lse = flash_attention_one_head(q[h], k[h // 2], v[h // 2], block_q=4, block_k=3, **band)
        assert_close(one_out, out[h], dtype, f"out of head {h}")
        np.testing.assert_allclose(one_lse, lse[h], **dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else {})
    assert_close(out, attention(q, k, v, **band), dtype, "against the reference")


@pytest.mark.parametrize("band", BANDS, ids=["none", "causal", "window"])
@pytest.mark.parametrize("n_q,n_k", [(13, 13), (7, 19), (19, 7)])
def test_algorithm_2_for_one_head_is_the_fast_path(rng, band, n_q, n_k):
    q, k, v, dout = heads(rng, 2, 1, n_q, n_k, np.float64)
    out, lse = flash_attention(q, k, v, return_lse=True, **band)
    fast = flash_attention_backward(q, k, v, out, dout, lse, block_q=3, block_k=4, workers=2, **band)
    reference = attention_backward(q, k, v, dout, **band)
    dk_sum, dv_sum = np.zeros_like(k), np.zeros_like(v)
    for h in range(2):
        dq, dk, dv = flash_attention_backward_one_head(
            q[h], k[0], v[0], out[h], dout[h], lse[h], block_q=3, block_k=4, **band
        )
        np.testing.assert_allclose(dq, fast[0][h], rtol=1e-12, atol=1e-12)
        dk_sum[0] += dk
        dv_sum[0] += dv
    for name, one, fast_g, ref_g in zip("kv", (dk_sum, dv_sum), fast[1:], reference[1:], strict=True):
        np.testing.assert_allclose(one, fast_g, rtol=1e-12, atol=1e-12, err_msg=f"d{name}: one head vs fast")
        np.testing.assert_allclose(one, ref_g, rtol=1e-10, atol=1e-10, err_msg=f"d{name}: one head vs reference")


def test_one_head_paths_refuse_many_heads(rng):
    q, k, v, dout = heads(rng, 2, 2, 4, 4, np.float64)
    with pytest.raises(ValueError, match="q must be one head"):
        flash_attention_one_head(q, k, v)
    with pytest.raises(ValueError, match="q must be one head"):
        flash_attention_backward_one_head(q, k, v, q, dout, q[..., 0])


def test_one_head_rows_that_see_nothing(rng):
    # L > S under a bottom-right causal mask: the first L - S queries see no key: out 0, lse -inf
    q, k, v, dout = heads(rng, 1, 1, 6, 2, np.float64)
    out, lse = flash_attention_one_head(q[0], k[0], v[0], causal=True, block_q=2, block_k=2)
    assert np.all(out[:4] == 0) and np.all(np.isneginf(lse[:4])) and np.isfinite(lse[4:]).all()
    dq, dk, dv = flash_attention_backward_one_head(q[0], k[0], v[0], out, dout[0], lse, causal=True)
    assert np.all(dq[:4] == 0) and np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


@given(
    n_chunks=st.integers(1, 6),
    rows=st.integers(1, 4),
    seen=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_chunks_is_merge_states_folded(n_chunks, rows, seen, seed):
    rng = np.random.default_rng(seed)
    outs = [rng.standard_normal((rows, 3)) for _ in range(n_chunks)]
    lses = [rng.standard_normal(rows) * 5 if seen[n] else np.full(rows, -np.inf) for n in range(n_chunks)]
    out, lse = merge_chunks(outs, lses)
    fold_out, fold_lse = outs[0] * np.isfinite(lses[0])[:, None], lses[0]
    for out_n, lse_n in zip(outs[1:], lses[1:], strict=True):
        fold_out, fold_lse = merge_states(fold_out, fold_lse, out_n, lse_n)
    np.testing.assert_allclose(out, fold_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(fold_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], fold_lse[np.isfinite(fold_lse)], rtol=1e-12)
