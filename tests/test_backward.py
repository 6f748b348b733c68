"""The hand-written gradients, proved by central finite differences in float64, and the blockwise
backward proved equal to the reference one (fixed cases and hypothesis-drawn shapes and blocks)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, bottom_right
from hypothesis import given, settings
from hypothesis import strategies as st
from test_flash import heads

from tinyattn_np import (
    AttentionMemoryError,
    MultiHeadAttention,
    attention,
    attention_backward,
    attention_backward_bytes,
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_bytes,
    flash_attention_backward_one_head,
    flash_attention_one_head,
    rope,
    rope_backward,
)
from tinyattn_np import _guard as guard_module
from tinyattn_np._tuning import constant_rule
from tinyattn_np.blockmask import Band, create_block_mask
from tinyattn_np.measure import traced_peak

# Central differences: error O(eps²·f''') from the formula plus O(u/eps) from rounding; with eps = 1e-6
# in float64 both are around 1e-10 for these O(1) functions, so 1e-7 leaves room and still catches a
# wrong term (which shows up at the size of the gradient itself, ~0.1-1).
EPS = 1e-6
FD_TOL = 1e-7


def numerical_grad(loss, x: np.ndarray) -> np.ndarray:
    """∂loss/∂x by central differences, one element at a time (x is changed in place and restored)."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + EPS
        up = loss()
        x[i] = old - EPS
        down = loss()
        x[i] = old
        grad[i] = (up - down) / (2 * EPS)
    return grad


def assert_grads(loss, pairs, what: str) -> None:
    """Every (input, analytic gradient) pair against finite differences of loss()."""
    for name, x, grad in pairs:
        gold = numerical_grad(loss, x)
        np.testing.assert_allclose(grad, gold, rtol=0, atol=FD_TOL, err_msg=f"{what}: d{name}")


def qkv(rng, batch, hq, hkv, n_q, n_k, e=4, ev=3):
    q = rng.standard_normal((*batch, hq, n_q, e))
    k = rng.standard_normal((*batch, hkv, n_k, e))
    v = rng.standard_normal((*batch, hkv, n_k, ev))
    dout = rng.standard_normal((*batch, hq, n_q, ev))
    return q, k, v, dout


# (batch, Hq, Hkv, L, S, causal): causal and not, L != S both ways, GQA and MQA
SHAPES = [
    ((2,), 2, 2, 5, 5, True),
    ((2,), 2, 2, 5, 5, False),
    ((1,), 4, 2, 3, 7, True),  # L < S: every query sees the S - L earlier keys too
    ((1,), 3, 1, 7, 4, True),  # L > S and MQA: the first 3 queries see no key at all
    ((2,), 4, 1, 6, 3, False),
    ((), 2, 2, 4, 6, False),
]


@pytest.mark.parametrize("batch,hq,hkv,n_q,n_k,causal", SHAPES)
def test_attention_backward_matches_finite_differences(rng, batch, hq, hkv, n_q, n_k, causal):
    q, k, v, dout = qkv(rng, batch, hq, hkv, n_q, n_k)

    def loss():  # Σ out ∘ dout: its gradient with respect to out is dout
        return float(np.sum(attention(q, k, v, causal=causal) * dout))

    dq, dk, dv = attention_backward(q, k, v, dout, causal=causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert_grads(loss, [("q", q, dq), ("k", k, dk), ("v", v, dv)], f"attention {batch} {hq}/{hkv} {n_q}x{n_k}")


@pytest.mark.parametrize("batch,hq,hkv,n_q,n_k,causal", SHAPES)
@pytest.mark.parametrize("block_q,block_k", [(2, 3), (3, 2), (64, 64)])
def test_flash_backward_matches_finite_differences(rng, batch, hq, hkv, n_q, n_k, causal, block_q, block_k):
    q, k, v, dout = qkv(rng, batch, hq, hkv, n_q, n_k)
    blocks = dict(block_q=block_q, block_k=block_k)

    def loss():  # one worker: the same bits as any number, and cheaper for these tiny shapes
        return float(np.sum(flash_attention(q, k, v, causal=causal, workers=1, **blocks) * dout))

    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, **blocks)
    dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, causal=causal, **blocks)
    assert_grads(loss, [("q", q, dq), ("k", k, dk), ("v", v, dv)], f"flash {blocks}")


@pytest.mark.parametrize("kind", ["padding", "float", "padding+causal"])
def test_attention_backward_with_masks(rng, kind):
    """A padding mask (the last two keys of batch entry 1 hidden), a float mask, and one with causal."""
    q, k, v, dout = qkv(rng, (2,), 2, 1, 4, 6)
    if kind == "float":
        mask = 0.5 * rng.standard_normal((4, 6))  # added to the scores
    else:
        mask = np.ones((2, 1, 1, 6), bool)
        mask[1, ..., 4:] = False
    causal = kind == "padding+causal"

    def loss():
        return float(np.sum(attention(q, k, v, mask=mask, causal=causal) * dout))

    dq, dk, dv = attention_backward(q, k, v, dout, mask=mask, causal=causal)
    assert_grads(loss, [("q", q, dq), ("k", k, dk), ("v", v, dv)], kind)
    if kind != "float":  # a hidden key gets no gradient at all
        assert not dk[1, :, 4:].any() and not dv[1, :, 4:].any()


def test_scale_and_two_d_inputs(rng):
    q, k, v, dout = (x[0, 0] for x in qkv(rng, (1,), 1, 1, 5, 4))  # (L, E) each: one head

    def loss():
        return float(np.sum(attention(q, k, v, scale=0.7) * dout))

    dq, dk, dv = attention_backward(q, k, v, dout, scale=0.7)
    assert dq.shape == (5, 4) and dv.shape == (4, 3)
    assert_grads(loss, [("q", q, dq), ("k", k, dk), ("v", v, dv)], "2-D, scale 0.7")
    out, lse = flash_attention(q, k, v, scale=0.7, return_lse=True)
    for mine, gold in zip(flash_attention_backward(q, k, v, out, dout, lse, scale=0.7), (dq, dk, dv), strict=True):
        np.testing.assert_allclose(mine, gold, atol=1e-13)


def test_rows_that_see_no_key_get_zero_not_nan(rng):
    """causal with L > S: the first L - S queries see nothing (out 0, lse -inf); S = 0 and L = 0 too."""
    q, k, v, dout = qkv(rng, (1,), 2, 2, 6, 2)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, block_q=2, block_k=2)
    assert np.isneginf(lse[..., :4]).all()
    for dq, dk, dv in (
        attention_backward(q, k, v, dout, causal=True),
        flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=2, block_k=2),
    ):
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert not dq[..., :4, :].any()  # the blind rows
    empty_k, empty_v = k[..., :0, :], v[..., :0, :]
    out0, lse0 = flash_attention(q, empty_k, empty_v, return_lse=True)
    for dq, dk, dv in (
        attention_backward(q, empty_k, empty_v, dout),
        flash_attention_backward(q, empty_k, empty_v, out0, dout, lse0),
    ):
        assert not dq.any() and dk.shape == (1, 2, 0, 4) and dv.shape == (1, 2, 0, 3)
    no_q, no_dout = q[..., :0, :], dout[..., :0, :]
    out_e, lse_e = flash_attention(no_q, k, v, return_lse=True)
    dq, dk, dv = flash_attention_backward(no_q, k, v, out_e, no_dout, lse_e)
    assert dq.shape == (1, 2, 0, 4) and not dk.any() and not dv.any()


def test_nan_stays_nan(rng):
    q, k, v, dout = qkv(rng, (1,), 1, 1, 4, 4)
    q[0, 0, 2, 1] = np.nan  # row 2's scores are NaN: its gradients, and every key's, are NaN
    out, lse = flash_attention(q, k, v, return_lse=True)
    for dq, dk, dv in (attention_backward(q, k, v, dout), flash_attention_backward(q, k, v, out, dout, lse)):
        assert np.isnan(dq[0, 0, 2]).all() and np.isnan(dk).any() and np.isnan(dv).any()
        assert np.isfinite(dq[0, 0, [0, 1, 3]]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_follows_float64(rng, dtype):
    """float32 computes in float32, float16 in float32 and casts back; both close to float64's answer."""
    q, k, v, dout = qkv(rng, (1,), 4, 2, 40, 40, e=16, ev=16)
    gold = attention_backward(q, k, v, dout, causal=True)
    low = [x.astype(dtype) for x in (q, k, v, dout)]
    out, lse = flash_attention(*low[:3], causal=True, return_lse=True, block_q=16, block_k=8)
    tol = 2e-4 if dtype == np.float32 else 3e-2
    for grads in (
        attention_backward(*low, causal=True),
        flash_attention_backward(*low[:3], out, low[3], lse, causal=True, block_q=16, block_k=8),
    ):
        for mine, want in zip(grads, gold, strict=True):
            assert mine.dtype == dtype
            np.testing.assert_allclose(mine.astype(np.float64), want, rtol=0, atol=tol)


def test_same_bits_for_any_worker_count(rng):
    q, k, v, dout = (x.astype(np.float32) for x in qkv(rng, (2,), 4, 2, 70, 90, e=8, ev=8))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    runs = [
        flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=16, block_k=32, workers=w)
        for w in (1, 2, 3, 8)
    ]
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_items_of_many_heads_give_the_bits_of_one_head_items(rng, monkeypatch, causal):
    """Small tiles put several heads in one backward item (_backward_kernel.heads_per_item): any number of heads
    an item, on any number of workers, with GQA, gives the same bits as items of one head, and the reference's
    values."""
    import tinyattn_np._backward_kernel as backward
    import tinyattn_np._tuning as flash_module

    q, k, v, dout = (x.astype(np.float32) for x in qkv(rng, (3,), 4, 2, 40, 56, e=8, ev=6))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    tile = 16 * 16
    plan = backward.BackwardPlan(1.0, Band(16 if causal else None), 16, 16, 2)
    runs, heads = [], []
    for budget in (tile, 2 * tile, 4 * tile, 12 * tile):  # 1, 2, 4 and 12 of the 12 heads an item
        monkeypatch.setattr(
            flash_module, "tile_rule", lambda budget=budget: constant_rule()._replace(scores_per_step=budget)
        )
        heads.append(backward.heads_per_item(plan, 12, 40, 56))
        runs += [
            flash_attention_backward(q, k, v, out, dout, lse, causal=causal, block_q=16, block_k=16, workers=w)
            for w in (1, 2, 3)
        ]
    assert heads == [1, 2, 4, 12]
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads, strict=True):
            np.testing.assert_array_equal(a, b)
    gold = attention_backward(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=causal)
    for mine, want in zip(runs[0], gold, strict=True):
        np.testing.assert_allclose(mine, want, rtol=0, atol=2e-5)


def test_heads_per_item_fill_a_forward_step_and_keep_every_worker_busy(monkeypatch):
    """The most heads, a divisor of them, whose tiles hold no more scores than a forward tile step and still
    leave an item for each worker; one head an item for a block mask or a score_mod."""
    import tinyattn_np._tuning as flash_module
    from tinyattn_np import mods
    from tinyattn_np._backward_kernel import BackwardPlan as _BackwardPlan
    from tinyattn_np._backward_kernel import heads_per_item as _heads_per_item

    monkeypatch.setattr(flash_module, "tile_rule", lambda: constant_rule(cores=2))  # 2^18 scores a step
    band = Band(0)
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 2), 48, 4096, 4096) == 4  # 4 x 256 x 256 = 2^18
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 2), 48, 64, 64) == 24  # two items for two workers
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 16), 48, 64, 64) == 3  # 16 items for 16 workers
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 1), 7, 64, 64) == 7  # a prime: all or one
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 2), 7, 64, 64) == 1
    assert _heads_per_item(_BackwardPlan(1.0, band, 256, 256, 2, mods.Softcap(5.0)), 48, 64, 64) == 1
    blocks = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, 64, 64, BLOCK_SIZE=16)
    assert _heads_per_item(_BackwardPlan(1.0, blocks, 16, 16, 2), 48, 64, 64) == 1


@settings(max_examples=100, deadline=None)
@given(
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    n_q=st.integers(1, 12),
    n_k=st.integers(1, 12),
    block_q=st.integers(1, 13),
    block_k=st.integers(1, 13),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_flash_backward_equals_reference(hkv, group, n_q, n_k, block_q, block_k, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v, dout = qkv(rng, (1,), hkv * group, hkv, n_q, n_k, e=3, ev=2)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, block_q=block_q, block_k=block_k)
    mine = flash_attention_backward(q, k, v, out, dout, lse, causal=causal, block_q=block_q, block_k=block_k)
    gold = attention_backward(q, k, v, dout, causal=causal)
    for name, a, b in zip("qkv", mine, gold, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


def test_causal_flash_backward_against_an_explicit_mask(rng):
    """flash's causal=True is the same bottom-right alignment as a mask built with a loop (conftest)."""
    q, k, v, dout = qkv(rng, (1,), 2, 2, 5, 8)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, block_q=2, block_k=3)
    mine = flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=2, block_k=3)
    gold = attention_backward(q, k, v, dout, mask=bottom_right(5, 8))
    for a, b in zip(mine, gold, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-13)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("positions", [None, [3, 1, 4, 1, 5], np.array([0.5, 2.0, 7.25, 9.0, 11.0])])
def test_rope_backward_matches_finite_differences(rng, interleaved, positions):
    x = rng.standard_normal((2, 5, 6))
    grad_out = rng.standard_normal((2, 5, 6))

    def loss():
        return float(np.sum(rope(x, positions=positions, interleaved=interleaved) * grad_out))

    grad = rope_backward(grad_out, positions=positions, interleaved=interleaved)
    assert_grads(loss, [("x", x, grad)], f"rope interleaved={interleaved}")
    # a rotation by -θ undoes the one by +θ
    np.testing.assert_allclose(rope_backward(rope(x, positions=positions), positions=positions), x, atol=1e-13)


def hand_loss(mha, x, dout, causal, fused):
    return float(np.sum(mha(x, causal=causal, fused=fused) * dout))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, None), (4, 2), (4, 1)])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_multihead_backward_matches_finite_differences(rng, n_heads, n_kv_heads, use_rope, fused):
    mha = MultiHeadAttention(16, n_heads, n_kv_heads, rope=use_rope, rng=rng, dtype=np.float64)
    x = rng.standard_normal((2, 5, 16))
    dout = rng.standard_normal((2, 5, 16))
    out, saved = mha.forward(x, fused=fused)
    np.testing.assert_allclose(out, mha(x, fused=fused), atol=1e-14)
    dx, dw_qkv, dw_out = mha.backward(dout, saved)
    assert (dx.shape, dw_qkv.shape, dw_out.shape) == (x.shape, mha.w_qkv.shape, mha.w_out.shape)

    def loss():
        return hand_loss(mha, x, dout, True, fused)

    assert_grads(loss, [("x", x, dx), ("w_qkv", mha.w_qkv, dw_qkv), ("w_out", mha.w_out, dw_out)], "mha")


def test_multihead_no_hidden_state_fused_equals_reference(rng):
    """Two forwards, then two backwards in the other order: each its own gradients; fused == reference."""
    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=rng, dtype=np.float64)
    x1, x2 = rng.standard_normal((2, 7, 16)), rng.standard_normal((7, 16))  # batched and unbatched
    d1, d2 = rng.standard_normal((2, 7, 16)), rng.standard_normal((7, 16))
    _, s1 = mha.forward(x1, causal=False)
    _, s2 = mha.forward(x2, causal=False)
    g2 = mha.backward(d2, s2)
    g1 = mha.backward(d1, s1)
    assert g2[0].shape == (7, 16)
    for x, d, grads in ((x1, d1, g1), (x2, d2, g2)):
        _, s = mha.forward(x, causal=False, fused=False)
        for a, b in zip(grads, mha.backward(d, s), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-12)
    assert not np.allclose(g1[1], g2[1])


def test_float32_module_gives_float32_gradients(rng):
    mha = MultiHeadAttention(16, 2, rng=rng)
    out, saved = mha.forward(rng.standard_normal((3, 16)).astype(np.float32))
    grads = mha.backward(np.ones_like(out), saved)
    assert all(g.dtype == np.float32 for g in grads)


def test_bad_input(rng):
    q, k, v, dout = qkv(rng, (1,), 2, 2, 4, 5)
    out, lse = flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have shape out's \(\.\.\., Hq, L, Ev\) = \(1, 2, 4, 3\)"):
        attention_backward(q, k, v, dout[..., :2])
    with pytest.raises(TypeError, match="dout must be float16, float32 or float64; got dtype int64"):
        attention_backward(q, k, v, dout.astype(np.int64))
    with pytest.raises(ValueError, match=r"out must have shape \(\.\.\., Hq, L, Ev\) = \(1, 2, 4, 3\)"):
        flash_attention_backward(q, k, v, out[:, :1], dout, lse)
    with pytest.raises(ValueError, match=r"dout must have shape"):
        flash_attention_backward(q, k, v, out, dout[..., :3, :], lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(\.\.\., Hq, L\) = \(1, 2, 4\)"):
        flash_attention_backward(q, k, v, out, dout, lse[..., None])
    with pytest.raises(TypeError, match="lse must be float16"):
        flash_attention_backward(q, k, v, out, dout, lse.astype(np.int32))
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        flash_attention_backward(q, k, v, out, dout, lse, block_q=0)
    with pytest.raises(TypeError, match="workers must be a positive int"):
        flash_attention_backward(q, k, v, out, dout, lse, workers=1.5)
    with pytest.raises(ValueError, match="grad must have at least 2 dims"):
        rope_backward(np.zeros(4))
    with pytest.raises(TypeError, match="positions must be ints or floats"):
        rope_backward(np.zeros((2, 4)), positions=np.array([True, False]))


def test_multihead_backward_bad_input(rng):
    mha, other = MultiHeadAttention(16, 2, rng=rng), MultiHeadAttention(16, 2, rng=rng)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    out, saved = mha.forward(x)
    with pytest.raises(ValueError, match="saved must be the second value returned by this module's own forward"):
        other.backward(out, saved)
    with pytest.raises(ValueError, match="got tuple"):
        mha.backward(out, tuple(saved))
    with pytest.raises(
        ValueError, match=r"dout must have the forward's output shape \(2, 3, 16\); got shape \(3, 16\)"
    ):
        mha.backward(out[0], saved)
    with pytest.raises(ValueError, match=r"x must be \(B, T, 16\)"):
        mha.forward(x[..., :8])
    with pytest.raises(TypeError, match="fused must be True or False"):
        mha.forward(x, fused="False")


def test_backward_flops_are_five_matmuls():
    from tinyattn_np.memory import attention_backward_flops, attention_flops, causal_entries

    assert attention_backward_flops(8, heads=2, head_dim=4) == 2 * 64 * 2 * (3 * 4 + 2 * 4)
    assert attention_backward_flops(8, heads=2, head_dim=4, causal=True) == 2 * causal_entries(8) * 2 * 20
    assert attention_backward_flops(6, 9, heads=1, head_dim=4, head_dim_v=2, batch=3) == 3 * 54 * 2 * (12 + 4)
    # with Ev = E the backward is 2.5x the forward
    assert attention_backward_flops(64, heads=4, head_dim=64) * 2 == 5 * attention_flops(64, heads=4, head_dim=64)
    with pytest.raises(TypeError, match="causal must be True or False"):
        attention_backward_flops(8, heads=1, head_dim=4, causal="yes")


@pytest.mark.parametrize(
    "n,heads,kv_heads,dtype,causal",
    [(600, 2, 2, np.float32, True), (500, 4, 2, np.float32, False), (400, 2, 1, np.float16, True)],
)
def test_backward_bytes_estimate_matches_tracemalloc(rng, n, heads, kv_heads, dtype, causal):
    """peaks.flash_attention_backward_bytes within 15% of what tracemalloc sees (one worker: no timing)."""
    from tinyattn_np.measure import traced_peak
    from tinyattn_np.peaks import flash_attention_backward_bytes

    q = rng.standard_normal((1, heads, n, 32)).astype(dtype)
    k, v = (rng.standard_normal((1, kv_heads, n, 32)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    blocks = dict(block_q=128, block_k=64, workers=1)
    _, peak = traced_peak(flash_attention_backward, q, k, v, out, dout, lse, causal=causal, **blocks)
    estimate = flash_attention_backward_bytes(
        n, heads=heads, kv_heads=kv_heads, head_dim=32, dtype=np.dtype(dtype), causal=causal, **blocks
    )
    assert 0.85 < peak / estimate < 1.15, (peak, estimate)
    longer = flash_attention_backward_bytes(
        8 * n, heads=heads, kv_heads=kv_heads, head_dim=32, dtype=np.dtype(dtype), causal=causal, **blocks
    )
    assert longer <= 8 * estimate  # O(T), nothing of L x S: 8x the tokens, at most 8x the bytes


def test_blas_threads_restored_after_concurrent_forward_and_backward(rng):
    """The backward shares flash_attention's BLAS limit: run both at once in two threads, and BLAS has its
    threads back afterwards (two separate limits could leave it stuck at one thread)."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    def blas_threads():
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    before = blas_threads()
    q, k, v, dout = (x.astype(np.float32) for x in qkv(rng, (1,), 4, 4, 300, 300, e=16, ev=16))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(flash_attention, q, k, v, causal=True, block_q=16, block_k=16) for _ in range(3)]
        jobs += [pool.submit(flash_attention_backward, q, k, v, out, dout, lse, causal=True) for _ in range(3)]
        for job in jobs:
            job.result()
    assert blas_threads() == before


def test_one_head_splits_over_key_blocks_with_the_same_bits(rng):
    """Items are (key block, head): one head still runs on several workers, and dq, added in key-block
    order whatever the timing, comes out the same bits as on one worker."""
    q, k, v, dout = (x.astype(np.float32) for x in qkv(rng, (), 1, 1, 200, 230, e=8, ev=8))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    one, *many = (
        flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=16, block_k=8, workers=w)
        for w in (1, 2, 4)
    )
    for grads in many:
        for a, b in zip(one, grads, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_failing_item_stops_the_others_instead_of_hanging(rng, monkeypatch):
    """If the first key block's item fails, the items waiting for its turn to add into dq stop too."""
    import tinyattn_np._backward_kernel as backward

    real = backward.key_block_grads

    def first_block_fails(q_lse, k, v, do_d, lse, mods, tiles, *rest):
        tiles = list(tiles)
        if tiles[0].k_start == 0:  # tiles of key block 0
            raise MemoryError("no memory for this tile")
        return real(q_lse, k, v, do_d, lse, mods, tiles, *rest)

    monkeypatch.setattr(backward, "key_block_grads", first_block_fails)
    q, k, v, dout = qkv(rng, (), 2, 2, 40, 40)
    out, lse = flash_attention(q, k, v, return_lse=True)
    for _ in range(20):  # the real exception, every time: never a waiting item's complaint in its place
        with pytest.raises(MemoryError, match="no memory for this tile"):
            flash_attention_backward(q, k, v, out, dout, lse, block_q=8, block_k=8, workers=2)


@pytest.mark.parametrize(
    "scaling,max_positions",
    [
        ({"rope_type": "linear", "factor": 4.0}, None),
        ({"rope_type": "dynamic", "factor": 2.0}, 8),  # past 8 positions θ depends on the longest one
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, None),  # cos, sin scaled
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, None),  # half the channels do not turn
    ],
)
def test_rope_backward_with_scaling(rng, scaling, max_positions):
    x = rng.standard_normal((2, 5, 8))
    grad_out = rng.standard_normal((2, 5, 8))
    positions = [2, 7, 11, 12, 30]
    kw = dict(positions=positions, scaling=scaling, max_position_embeddings=max_positions)

    def loss():
        return float(np.sum(rope(x, **kw) * grad_out))

    assert_grads(loss, [("x", x, rope_backward(grad_out, **kw))], f"rope {scaling}")


def test_backward_bytes_defaults_and_errors():
    from tinyattn_np.peaks import flash_attention_backward_bytes

    default = flash_attention_backward_bytes(1000, heads=2, head_dim=64)
    assert flash_attention_backward_bytes(1000, heads=2, head_dim=64, block_q=None, block_k=None) == default
    assert flash_attention_backward_bytes(1000, heads=2, head_dim=64, block_q=256, block_k=256) == default
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        flash_attention_backward_bytes(1000, heads=2, head_dim=64, block_k=0)
    with pytest.raises(ValueError, match="dtype"):
        flash_attention_backward_bytes(1000, heads=2, head_dim=64, dtype="int8")


# --- the backward of the forward that ran ---------------------------------------------------------


def qkv_dout(rng, shape, dtype=np.float64, n=4):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(n))


@pytest.mark.parametrize("n_q,n_k,window", [(12, 12, 3), (7, 15, 4), (15, 7, 2)])
def test_a_windowed_forward_has_its_backward(rng, n_q, n_k, window):
    q, k, v, dout = qkv_dout(rng, (2, n_q, 4))
    k, v = k[:, :1].repeat(n_k, 1), v[:, :1].repeat(n_k, 1)
    k, v = k + rng.standard_normal(k.shape), v + rng.standard_normal(v.shape)
    out, lse = flash_attention(q, k, v, causal=True, window=window, return_lse=True, block_q=4, block_k=4)
    mine = flash_attention_backward(q, k, v, out, dout, lse, causal=True, window=window, block_q=3, block_k=5)
    gold = attention_backward(q, k, v, dout, causal=True, window=window)
    for name, a, b in zip("qkv", mine, gold, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize(
    "forward,backward",
    [
        (dict(causal=True, window=3), dict(causal=True)),  # a window the backward is not told of
        (dict(causal=True), dict(causal=False)),
        (dict(causal=False), dict(causal=True)),
        (dict(causal=True, scale=0.5), dict(causal=True)),
    ],
)
def test_a_backward_handed_another_forwards_state_refuses(rng, forward, backward):
    q, k, v, dout = qkv_dout(rng, (2, 32, 8))
    out, lse = flash_attention(q, k, v, return_lse=True, **forward)
    with pytest.raises(ValueError, match="lse does not match"):
        flash_attention_backward(q, k, v, out, dout, lse, **backward)


# --- the reference backward's guard ---------------------------------------------------------------


@pytest.mark.parametrize("n,causal,hkv", [(256, False, 4), (1024, True, 4), (512, True, 2), (768, False, 1)])
def test_attention_backward_estimate_matches_tracemalloc(rng, n, causal, hkv):
    q, dout = (rng.standard_normal((4, n, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((hkv, n, 64)).astype(np.float32) for _ in range(2))
    attention_backward(q[:, :8], k[:, :8], v[:, :8], dout[:, :8], causal=causal)  # one-off first-use buffers
    _, measured = traced_peak(attention_backward, q, k, v, dout, causal=causal)
    estimate = attention_backward_bytes(n, heads=4, kv_heads=hkv, head_dim=64, dtype="fp32", causal=causal)
    assert 1 / 1.15 <= measured / estimate <= 1.15, f"measured {measured:,} B, estimated {estimate:,} B"


def test_attention_backward_refuses_before_converting_float16(monkeypatch):
    q = np.zeros((1, 2**16, 2), np.float16)  # float32 copies alone: 1 MiB; the L x S arrays: 32 GiB
    monkeypatch.setattr(guard_module, "memory_available", lambda: 2**30)

    def refused():
        with pytest.raises(AttentionMemoryError, match=r"attention_backward\(\) would allocate .*check_memory=False"):
            attention_backward(q, q, q, q)

    _, peak = traced_peak(refused)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def test_attention_backward_check_memory_false_runs(monkeypatch, rng):
    q, k, v, dout = qkv_dout(rng, (2, 16, 4))
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1000)
    with pytest.raises(AttentionMemoryError):
        attention_backward(q, k, v, dout)
    grads = attention_backward(q, k, v, dout, check_memory=False)
    assert all(np.isfinite(g).all() for g in grads)


# --- the blockwise backward's bookkeeping ---------------------------------------------------------


def test_flash_backward_makes_its_tiles_lazily(rng):
    q, k, v, dout = qkv_dout(rng, (1, 128, 4), np.float32)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    flash_attention_backward(
        q[:, :4], k[:, :4], v[:, :4], out[:, :4], dout[:, :4], lse[:, :4], causal=True, block_q=1, block_k=1
    )  # one-off first-use buffers
    _, peak = traced_peak(
        flash_attention_backward, q, k, v, out, dout, lse, causal=True, block_q=1, block_k=1, workers=1
    )  # 8,256 tiles: a list of them and a dict of the same size: 1 MiB
    estimate = flash_attention_backward_bytes(128, heads=1, head_dim=4, causal=True, block_q=1, block_k=1, workers=1)
    assert peak < 1.15 * estimate + 64 * 1024, f"{peak:,} B traced, {estimate:,} B estimated"


# --- the plain path beside the fast one -----------------------------------------------------------


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


@pytest.mark.parametrize(("q_batch", "kv_batch"), [((3,), (1,)), ((2, 2), (1, 1))])
def test_kv_of_batch_one_gets_its_gradients_summed_over_the_query_batch(rng, q_batch, kv_batch):
    """As torch gives them: dk and dv of k and v broadcast over the query's batch are the sums of the gradients
    of the broadcast spelled out; dq is the same."""
    q = rng.standard_normal((*q_batch, 4, 40, 8))
    k, v = (rng.standard_normal((*kv_batch, 2, 50, 8)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    k_all, v_all = (np.broadcast_to(x, (*q_batch, *x.shape[-3:])).copy() for x in (k, v))
    dq_gold, dk_all, dv_all = attention_backward(q, k_all, v_all, dout, causal=True)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=16, block_k=16)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dq, dq_gold, np.float64, "dq")
    batch_axes = tuple(range(len(q_batch)))
    assert_close(dk, dk_all.sum(axis=batch_axes, keepdims=True), np.float64, "dk")
    assert_close(dv, dv_all.sum(axis=batch_axes, keepdims=True), np.float64, "dv")


# --- a Ctrl-C at any bytecode never leaves the dq turn's lock held ------------------------------------


@pytest.mark.parametrize("step", ["add", "finish", "fail"])
def test_an_interrupt_at_any_bytecode_of_the_ordered_dq_leaves_its_lock_free(step):
    """A KeyboardInterrupt (which lands in the main thread, one of the workers) raised at each bytecode of
    OrderedDq's add, finish and fail in turn, threading's Condition included: the turn's lock is free
    afterwards. Held, every other worker would wait for it forever, and the call would never end."""
    import threading

    from test_kvcache import PACKAGE, _interrupted_at

    from tinyattn_np._backward_kernel import OrderedDq
    from tinyattn_np._tiles import FULL
    from tinyattn_np.blockmask import Tile

    code = (str(PACKAGE / "_backward_kernel.py"), str(PACKAGE / "_atomic.py"), threading.__file__)
    tile = Tile(0, 4, 0, 4, FULL)
    for n in range(1, 10_000):
        dq = OrderedDq(np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4)), Band(None), 4, 4, 4)  # one group of one head
        call = {
            "add": lambda dq=dq: dq.add(0, tile, np.ones((1, 4, 2)), np.ones((1, 4))),
            "finish": lambda dq=dq: dq.finish(0, 0),
            "fail": lambda dq=dq: dq.fail(),
        }[step]
        if not _interrupted_at(n, call, code):
            break
        assert not dq.turn._is_owned(), f"{step}: the lock is held after an interrupt at bytecode {n}"
    assert n > 5  # the tracer did reach the code
