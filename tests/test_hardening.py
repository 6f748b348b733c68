"""Hostile and odd inputs: each is refused with a message that says what to pass, or handled on purpose."""

import importlib
import time

import numpy as np
import pytest
from conftest import assert_close, gold_attention
from scipy.special import logsumexp as scipy_logsumexp

from tinyattn_np import (
    AttentionMemoryError,
    LearnedPositions,
    MultiHeadAttention,
    attention,
    causal_mask,
    flash_attention,
    logsumexp,
    merge_states,
    naive_attention_bytes,
    one_head,
    rope,
    scaled_dot_product_attention,
    to_half_split,
    to_interleaved,
)
from tinyattn_np.measure import traced_peak

guard_module = importlib.import_module("tinyattn_np._guard")  # the memory guard reads the memory here


def qkv(rng, shape=(2, 5, 4), dtype=np.float64):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# --- the memory guard runs first, on shapes and dtypes alone ----------------------------------------


def test_guard_refuses_float16_before_converting(monkeypatch):
    # 2^19 tokens of float16: the float32 copies alone would be 4 MiB; the guard must refuse before any
    q = np.zeros((1, 2**19, 2), np.float16)
    _, peak = traced_peak(_refused, q, q, q)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def test_guard_refuses_mixed_dtypes_before_converting():
    q, kv = np.zeros((1, 2**19, 2), np.float32), np.zeros((1, 2**19, 2), np.float64)
    _, peak = traced_peak(_refused, q, kv, kv)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def _refused(q, k, v, **kw):
    with pytest.raises(AttentionMemoryError, match="would allocate"):
        attention(q, k, v, **kw)


def test_sdpa_is_causal_refuses_before_building_the_mask():
    # 2^20 tokens: the top-left L x S mask alone would be 1 TiB; the guard must come first, and fast
    q = np.zeros((1, 2**20, 2), np.float32)
    start = time.perf_counter()
    _, peak = traced_peak(_refused_sdpa, q)
    assert time.perf_counter() - start < 5.0
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def _refused_sdpa(q):
    with pytest.raises(AttentionMemoryError):
        scaled_dot_product_attention(q, q, q, is_causal=True)


def test_sdpa_is_causal_still_top_left(rng):
    q, k, v = qkv(rng, (2, 3, 4))
    k, v = qkv(rng, (2, 6, 4))[:2]
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, gold_attention(q, k, v, np.tril(np.ones((3, 6), bool)))[0], np.float64, "top-left")


def test_float64_mask_on_float32_inputs_is_not_copied(rng):
    # a full-shape float64 mask was converted to a float32 copy as big as the scores (1.9x the estimate)
    heads, n, e = 4, 256, 16
    q, k, v = qkv(rng, (heads, n, e), np.float32)
    mask = rng.standard_normal((heads, n, n))  # float64, (Hq, L, S)
    out, peak = traced_peak(attention, q, k, v, mask=mask)
    estimate = naive_attention_bytes(n, heads=heads, head_dim=e, dtype="fp32")
    assert peak <= 1.15 * estimate, f"measured {peak:,} B, estimated {estimate:,} B"
    assert_close(out, _gold_float_mask(q, k, v, mask), np.float32, "float64 mask")


def _gold_float_mask(q, k, v, mask):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ v


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


# --- flags are real bools ------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["causal", "return_weights", "check_memory"])
def test_attention_flags_must_be_bools(rng, flag):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=f"{flag} must be True or False; got 'False'"):
        attention(q, k, v, **{flag: "False"})
    attention(q, k, v, **{flag: np.bool_(False)})  # a NumPy bool is a bool


@pytest.mark.parametrize("flag", ["is_causal", "enable_gqa"])
def test_sdpa_flags_must_be_bools(rng, flag):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        scaled_dot_product_attention(q, k, v, **{flag: "False"})


def test_attention_align_is_checked(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="align must be one of"):
        attention(q, k, v, causal=True, align="top-left")


# --- numbers at the edge -------------------------------------------------------------------------


def test_attention_scales_q_before_the_product():
    # q·k = 4 · 1e154 · 1e154 = 4e308 overflows float64 (max 1.8e308); (q · 1e-160)·k = 4e148 does not
    q = np.full((1, 2, 4), 1e154)
    k = np.full((1, 3, 4), 1e154)
    v = np.arange(12.0).reshape(1, 3, 4)
    with np.errstate(over="raise", invalid="raise"):
        out = attention(q, k, v, scale=1e-160)
    np.testing.assert_allclose(out, flash_attention(q, k, v, scale=1e-160))
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape))  # equal scores


def test_logsumexp_with_inf_matches_scipy():
    for row in ([np.inf, 0.0], [np.inf, np.inf], [-np.inf, -np.inf], [np.nan, 1.0], [-np.inf, 2.0]):
        x = np.array(row)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(logsumexp(x), scipy_logsumexp(x), err_msg=str(row))


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


def test_scale_too_large_for_a_float(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="scale must be a finite number; got an int too large"):
        attention(q, k, v, scale=10**400)
    with pytest.raises(ValueError, match="scale must be a finite number; got inf"):
        attention(q, k, v, scale=float("inf"))


# --- empty but valid shapes ----------------------------------------------------------------------


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


# --- array types NumPy has but attention should not guess about ----------------------------------


def test_masked_arrays_are_refused(rng):
    q, k, v = qkv(rng)
    masked = np.ma.masked_array(q, mask=q > 1)
    with pytest.raises(TypeError, match=r"q is a masked array.*q\.filled\(value\).*np\.asarray\(q\)"):
        attention(masked, k, v)
    with pytest.raises(TypeError, match="mask must be a plain ndarray; got MaskedArray"):
        attention(q, k, v, mask=np.ma.masked_array(np.ones((5, 5), bool)))


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_is_refused(rng):
    q, k, v = qkv(rng, (5, 4))
    with pytest.raises(TypeError, match=r"k is an np\.matrix: pass np\.asarray\(k\)"):
        attention(q, np.asmatrix(k), v)
    with pytest.raises(TypeError, match="mask must be a plain ndarray; got matrix"):
        attention(q, k, v, mask=np.asmatrix(np.ones((5, 5), bool)))


def test_ragged_list_names_the_argument():
    with pytest.raises(ValueError, match="q must be an array of numbers with one shape"):
        attention([[1.0, 2.0], [3.0]], np.ones((2, 2)), np.ones((2, 2)))


def test_big_endian_float32_is_float32(rng):
    q, k, v = qkv(rng, dtype=np.float32)
    out = attention(q.astype(">f4"), k, v.astype(">f4"), causal=True)
    assert out.dtype == np.float32 and out.dtype.isnative
    np.testing.assert_array_equal(out, attention(q, k, v, causal=True))
    np.testing.assert_array_equal(flash_attention(q.astype(">f4"), k, v), flash_attention(q, k, v))


# --- scaled_dot_product_attention follows torch ----------------------------------------------------


def test_sdpa_refuses_mixed_dtypes(rng):
    q = rng.standard_normal((2, 5, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 5, 4)).astype(np.float16) for _ in range(2))
    with pytest.raises(TypeError, match="query float32, key float16, value float16"):
        scaled_dot_product_attention(q, k, v)
    assert attention(q, k, v).dtype == np.float32  # attention() keeps its documented promotion


def test_sdpa_mask_and_is_causal_error_shows_the_way(rng):
    q, k, v = qkv(rng, (2, 5, 4))
    padding = np.array([True, True, True, True, False])
    with pytest.raises(ValueError, match=r"torch documents.*causal_mask\(L, S, align='top_left'\).*causal=True"):
        scaled_dot_product_attention(q, k, v, attn_mask=padding, is_causal=True)
    combined = scaled_dot_product_attention(q, k, v, attn_mask=padding & causal_mask(5, 5, align="top_left"))
    np.testing.assert_allclose(combined, attention(q, k, v, causal=True, mask=padding), atol=1e-15)


# --- one_head, MultiHeadAttention and the position helpers -------------------------------------------


def test_one_head_causal_must_be_a_bool(rng):
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    with pytest.raises(TypeError, match="causal must be True or False; got 'False'"):
        one_head(x, w, w, w, causal="False")


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


def test_rope_refuses_bad_base_and_flags():
    x = np.ones((3, 4))
    for base in (float("inf"), float("nan"), 0.0, -2.0, 1.0):
        with pytest.raises(ValueError, match="base must be a finite number > 1"):
            rope(x, base=base)
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        rope(x, interleaved="False")


def test_layout_helpers_need_an_axis():
    for convert in (to_half_split, to_interleaved):
        with pytest.raises(ValueError, match=r"x must have at least 1 dim \(\.\.\., d\), d even; got shape \(\)"):
            convert(1.0)


def test_learned_positions_refuse_int_tables():
    with pytest.raises(TypeError, match="dtype must be float16, float32 or float64; got int32"):
        LearnedPositions(8, 4, dtype=np.int32)
    assert LearnedPositions(8, 4, dtype=np.float16).table.dtype == np.float16


def test_learned_positions_take_a_seed_or_draw_fresh():
    np.testing.assert_array_equal(LearnedPositions(8, 4, rng=3).table, LearnedPositions(8, 4, rng=3).table)
    assert not np.array_equal(LearnedPositions(8, 4).table, LearnedPositions(8, 4).table)
    with pytest.raises(ValueError, match="rng as a seed must be an int >= 0; got -1"):
        LearnedPositions(8, 4, rng=-1)
    with pytest.raises(TypeError, match="rng must be a np.random.Generator, an int seed or None"):
        LearnedPositions(8, 4, rng="3")


def test_logsumexp_keepdims_must_be_a_bool():
    with pytest.raises(TypeError, match="keepdims must be True or False"):
        logsumexp(np.ones((2, 3)), keepdims="False")
    assert logsumexp(np.zeros((2, 3)), keepdims=np.True_).shape == (2, 1)


def test_bad_masks_and_scales_are_named(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="mask must be bool .* got dtype int64"):
        attention(q, k, v, mask=np.ones((5, 5), np.int64))
    with pytest.raises(ValueError, match=r"mask must broadcast to the scores' shape .* got shape \(3, 2, 5, 5\)"):
        attention(q, k, v, mask=np.ones((3, 2, 5, 5), bool))  # would enlarge the scores
    with pytest.raises(TypeError, match="scale must be a number or None; got '0.5'"):
        attention(q, k, v, scale="0.5")
