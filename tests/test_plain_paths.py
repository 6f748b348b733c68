"""The plain path beside the fast one: each algorithm a learner reads on one screen (FlashAttention-2's
Algorithms 1 and 2 for one head on one thread, the split-KV merge) is held equal to the fast path that
batches heads and runs workers, and to the reference that builds the whole score matrix."""

from __future__ import annotations

import inspect
from pathlib import Path

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


SHAPES = [(17, 17), (9, 23), (23, 9), (1, 6), (6, 1)]  # L > S: under causal the first L - S rows see no key


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("n_q,n_k", SHAPES)
def test_algorithm_1_for_one_head_is_the_fast_path_and_the_reference(rng, dtype, causal, n_q, n_k):
    q, k, v, _ = heads(rng, 4, 2, n_q, n_k, dtype)
    out, lse = flash_attention(q, k, v, causal=causal, block_q=4, block_k=3, return_lse=True, workers=2)
    for h in range(4):  # query head h reads kv head h // 2
        one_out, one_lse = flash_attention_one_head(q[h], k[h // 2], v[h // 2], causal=causal, block_q=4, block_k=3)
        assert one_out.dtype == one_lse.dtype == dtype
        assert_close(one_out, out[h], dtype, f"out of head {h}")
        np.testing.assert_array_equal(np.isneginf(one_lse), np.isneginf(lse[h]))
        np.testing.assert_allclose(one_lse, lse[h], **dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else {})
        assert_close(one_out, attention(q[h], k[h // 2], v[h // 2], causal=causal), dtype, f"head {h} vs reference")


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(13, 13), (7, 19), (19, 7)])
def test_algorithm_2_for_one_head_is_the_fast_path_and_the_reference(rng, causal, n_q, n_k):
    q, k, v, dout = heads(rng, 2, 1, n_q, n_k, np.float64)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    fast = flash_attention_backward(q, k, v, out, dout, lse, causal=causal, block_q=3, block_k=4, workers=2)
    reference = attention_backward(q, k, v, dout, causal=causal)
    dk_sum, dv_sum = np.zeros_like(k), np.zeros_like(v)
    for h in range(2):
        one_out, one_lse = flash_attention_one_head(q[h], k[0], v[0], causal=causal, block_q=3, block_k=4)
        dq, dk, dv = flash_attention_backward_one_head(
            q[h], k[0], v[0], one_out, dout[h], one_lse, causal=causal, block_q=3, block_k=4
        )
        np.testing.assert_allclose(dq, fast[0][h], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dq, reference[0][h], rtol=1e-10, atol=1e-10)
        dk_sum[0] += dk
        dv_sum[0] += dv
    for name, one, fast_g, ref_g in zip("kv", (dk_sum, dv_sum), fast[1:], reference[1:], strict=True):
        np.testing.assert_allclose(one, fast_g, rtol=1e-12, atol=1e-12, err_msg=f"d{name}: one head vs fast")
        np.testing.assert_allclose(one, ref_g, rtol=1e-10, atol=1e-10, err_msg=f"d{name}: one head vs reference")


def test_the_plain_paths_take_the_papers_parameters_only():
    """Nothing FlexAttention adds (mods, block masks, sinks, heads, windows): those are the fast paths'."""
    forward = list(inspect.signature(flash_attention_one_head).parameters)
    backward = list(inspect.signature(flash_attention_backward_one_head).parameters)
    assert forward == ["q", "k", "v", "causal", "scale", "block_q", "block_k"]
    assert backward == ["q", "k", "v", "out", "dout", "lse", "causal", "scale", "block_q", "block_k"]
    assert "running_start" not in inspect.getsource(flash_attention_one_head)


def test_float16_is_computed_in_float32_and_the_scale_is_kept(rng):
    q, k, v, dout = heads(rng, 1, 1, 9, 11, np.float16)
    out, lse = flash_attention_one_head(q[0], k[0], v[0], scale=0.5, block_q=4, block_k=4)
    assert out.dtype == lse.dtype == np.float32
    gold = attention(q[0].astype(np.float32), k[0].astype(np.float32), v[0].astype(np.float32), scale=0.5)
    assert_close(out, gold, np.float32, "float16 in float32")
    grads = flash_attention_backward_one_head(q[0], k[0], v[0], out, dout[0], lse, scale=0.5, block_q=4, block_k=4)
    gold_grads = attention_backward(*(x[0].astype(np.float32) for x in (q, k, v, dout)), scale=0.5)
    for name, mine, gold_g in zip(("dq", "dk", "dv"), grads, gold_grads, strict=True):
        assert mine.dtype == np.float32
        np.testing.assert_allclose(mine, gold_g, rtol=1e-4, atol=1e-5, err_msg=name)


def test_one_head_paths_check_their_arguments(rng):
    q, k, v, dout = heads(rng, 2, 2, 4, 4, np.float64)
    with pytest.raises(ValueError, match="q must be one head"):
        flash_attention_one_head(q, k, v)
    with pytest.raises(ValueError, match="q must be one head"):
        flash_attention_backward_one_head(q, k, v, q, dout, q[..., 0])
    out, lse = flash_attention_one_head(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention_one_head(q[0], k[0], v[0], causal="yes")
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        flash_attention_one_head(q[0], k[0], v[0], block_k=0)
    with pytest.raises(TypeError, match="block_q must be a positive int"):
        flash_attention_backward_one_head(q[0], k[0], v[0], out, dout[0], lse, block_q=2.0)
    with pytest.raises(ValueError, match=r"lse must have shape \(..., Hq, L\)"):
        flash_attention_backward_one_head(q[0], k[0], v[0], out, dout[0], lse[:3])


def test_one_head_rows_that_see_nothing(rng):
    # L > S under a bottom-right causal mask: the first L - S queries see no key: out 0, lse -inf
    q, k, v, dout = heads(rng, 1, 1, 6, 2, np.float64)
    with np.errstate(all="raise"):  # and on the way no -inf - (-inf), no 0 / 0
        out, lse = flash_attention_one_head(q[0], k[0], v[0], causal=True, block_q=2, block_k=2)
        dq, dk, dv = flash_attention_backward_one_head(q[0], k[0], v[0], out, dout[0], lse, causal=True, block_q=3)
    assert np.all(out[:4] == 0) and np.all(np.isneginf(lse[:4])) and np.isfinite(lse[4:]).all()
    assert np.all(dq[:4] == 0) and np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    q_nan = q[0].copy()
    q_nan[5, 0] = np.nan  # a NaN in the inputs stays NaN in its row, never a quiet 0
    out, lse = flash_attention_one_head(q_nan, k[0], v[0], causal=True, block_q=2, block_k=2)
    assert np.isnan(out[5]).all() and np.isnan(lse[5]) and np.isfinite(out[4]).all()


def test_the_online_softmax_page_prints_the_plain_paths_as_they_are():
    """docs/online_softmax.md shows each plain path as print(inspect.getsource(...)) with its output: the
    page's text block is the source itself (tests/test_docs.py compares the two), so it cannot drift."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "online_softmax.md").read_text(encoding="utf-8")
    for function in (flash_attention_one_head, flash_attention_backward_one_head):
        assert f"print(inspect.getsource({function.__name__}))" in page
        assert f"```text\n{inspect.getsource(function)}```" in page, f"the page's copy of {function.__name__}"


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
