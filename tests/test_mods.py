"""The mods as a learner meets them: what each one refuses, with the message that says what to pass; what the
ready-made ones keep of the caller's arrays (their own copies); and the limits of parameters that would
overflow the compute dtype (a softcap that tends to the identity, sinks that do not fit)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np import (
    Alibi,
    RelativeBias,
    Softcap,
    attention,
    causal_mod,
    create_block_mask,
    document_mod,
    flash_attention_varlen,
    flex_attention,
    prefix_lm_mod,
    varlen_mod,
)

L = 6


def qkv(rng, batch=2, heads=2, n=L, dtype=np.float64):
    return tuple(rng.standard_normal((batch, heads, n, 4)).astype(dtype) for _ in range(3))


# --- a mod that returns the wrong thing ----------------------------------------------------------------


def test_a_mask_mod_of_the_wrong_shape_is_refused_with_the_shape_it_should_have():
    def transposed_rows(b, h, q_idx, kv_idx):  # one bool per query only: does not broadcast over the keys
        return np.ones(np.shape(q_idx)[0] + 1, bool)

    with pytest.raises(ValueError, match=r"mask_mod must return one bool per .* shape \(1, 1, 3, 3\); .* shape \(4,\)"):
        create_block_mask(transposed_rows, None, None, L, L, BLOCK_SIZE=3)
    with pytest.raises(ValueError, match="broadcasts to the indices' shape"):
        attention(*qkv(np.random.default_rng(0)), mask_mod=lambda b, h, q_idx, kv_idx: np.ones((2, 2, 2, L, L), bool))


def test_a_mask_function_passed_as_the_score_mod_is_refused_with_what_to_do(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=r"takes 4 arguments, as a mask_mod.*block_mask=create_block_mask"):
        flex_attention(q, k, v, causal_mod(L))
    with pytest.raises(TypeError, match=r"takes 4 arguments, as a mask_mod"):
        attention(q, k, v, score_mod=causal_mod(L))
    with pytest.raises(TypeError, match="gave bools, as a mask_mod does"):
        flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: kv_idx <= q_idx)


# --- parameters that overflow the compute dtype --------------------------------------------------------


@pytest.mark.parametrize("cap", [float("inf"), float("nan"), 10**400, -1.0])
def test_softcap_refuses_a_cap_that_is_not_a_positive_finite_number(cap):
    with pytest.raises(ValueError, match="cap must be a positive finite number"):
        Softcap(cap)
    with pytest.raises(TypeError, match="cap must be a positive number"):
        Softcap("50")


def test_softcap_tends_to_the_identity_as_the_cap_grows(rng):
    """cap · tanh(s / cap) = s - s³ / (3 cap²) + ...: within that bound of s for every cap, up to caps past the
    compute dtype's range (1e39 in float32, computed in float64), never NaN; its derivative tends to 1."""
    scores = rng.standard_normal((4, 5)) * 30
    for dtype in (np.float32, np.float64):
        s = scores.astype(dtype)
        for cap in (1e2, 1e4, 1e20, 3.5e38, 1e39, 1e300):
            mod = Softcap(cap)
            new, slope = mod(s, 0, 0, 0, 0), mod.derivative(s, 0, 0, 0, 0)
            assert new.dtype == slope.dtype == dtype and np.isfinite(new).all()
            ratio = np.abs(s.astype(np.float64)) / cap  # |s / cap|
            bound = np.abs(s) * (ratio**2 / 3 + 4 * np.finfo(dtype).eps)  # s³ / (3 cap²), and rounding
            assert (np.abs(new.astype(np.float64) - s) <= bound).all(), (dtype, cap)
            assert (np.abs(slope - 1) <= ratio**2 + 4 * np.finfo(dtype).eps).all()
    q, k, v = qkv(rng, dtype=np.float32)
    capped = flex_attention(q, k, v, Softcap(1e39))
    np.testing.assert_allclose(capped, flex_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_sinks_that_overflow_the_compute_dtype_are_refused(rng):
    q, k, v = qkv(rng, dtype=np.float32)
    with pytest.raises(ValueError, match=r"sinks overflow float32.*largest 3.4e\+38.*got 1e\+39"):
        flex_attention(q, k, v, sinks=[1e39, 0.0])
    out = flex_attention(*(x.astype(np.float64) for x in (q, k, v)), sinks=[1e39, 0.0])  # fits in float64
    np.testing.assert_array_equal(out[:, 0], 0.0)  # the sink takes all the weight
    assert np.isfinite(out).all()


# --- packed sequences ------------------------------------------------------------------------------------


def test_cu_seqlens_are_checked_in_a_signed_type(rng):
    """uint16 [0, 3, 2, 5] falls from 3 to 2: the unsigned difference would wrap to 65535 and pass."""
    q = k = v = rng.standard_normal((1, 5, 4))
    for cu in [np.array([0, 3, 2, 5], np.uint16), np.array([0, 3, 2, 5], np.uint32)]:
        with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D ints rising from 0"):
            flash_attention_varlen(q, k, v, cu, [0, 5])
    with pytest.raises(ValueError, match="must be ints that fit in int64"):
        varlen_mod(np.array([0, 2**63 + 5], np.uint64), [0, 5])
    unsigned = flash_attention_varlen(q, k, v, np.array([0, 2, 5], np.uint64), np.array([0, 2, 5], np.uint8))
    np.testing.assert_array_equal(unsigned, flash_attention_varlen(q, k, v, [0, 2, 5], [0, 2, 5]))


def test_document_ids_too_short_or_for_too_few_batch_entries_are_refused_by_name(rng):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="q_documents has 4 ids, but the mask is asked about query 5"):
        create_block_mask(document_mod(np.zeros(4, int)), None, None, L, L)
    with pytest.raises(ValueError, match="kv_documents has 3 ids, but the mask is asked about key 5"):
        create_block_mask(document_mod(np.zeros(L, int), np.zeros(3, int)), None, None, L, L)
    with pytest.raises(ValueError, match="q_documents has 1 rows, one per batch entry, but .* batch entry 1"):
        create_block_mask(document_mod(np.zeros((1, L), int)), 2, None, L, L)
    with pytest.raises(ValueError, match="prefix has 1 rows, one per batch entry"):
        create_block_mask(prefix_lm_mod([2]), 2, None, L, L)
    with pytest.raises(
        ValueError, match="slopes has 1 rows, one per query head, but the mod is asked about query head 1"
    ):
        flex_attention(q, k, v, Alibi([0.5], L))
    with pytest.raises(ValueError, match="table has 1 rows, one per query head"):
        flex_attention(q, k, v, RelativeBias(np.zeros((1, 3)), L))


# --- what the mods keep ----------------------------------------------------------------------------------


def test_the_ready_made_mods_keep_their_own_copies_of_the_callers_arrays(rng):
    q, k, v = qkv(rng)
    ids, prefix, slopes, table = np.array([0, 0, 0, 1, 1, 1]), np.array([2, 3]), np.array([0.5, 0.25]), np.ones((2, 3))
    mods = [
        ("documents", document_mod(ids), None),
        ("prefix", prefix_lm_mod(prefix), None),
        ("alibi", None, Alibi(slopes, L, learned=True)),
        ("bias", None, RelativeBias(table, L)),
    ]

    def run(mask_mod, score_mod):
        return flex_attention(q, k, v, score_mod, mask_mod and create_block_mask(mask_mod, 2, None, L, L))

    before = [run(mask_mod, score_mod) for _, mask_mod, score_mod in mods]
    for array in (ids, prefix, slopes, table):
        array[...] = 0  # the caller changes its arrays afterwards
    for (name, mask_mod, score_mod), old in zip(mods, before, strict=True):
        np.testing.assert_array_equal(run(mask_mod, score_mod), old, err_msg=name)
    assert mods[2][2].params is mods[2][2].slopes and mods[2][2].params is not slopes


# --- arrays that would be read wrongly --------------------------------------------------------------------


def test_masked_arrays_are_refused_wherever_an_array_goes_in(rng):
    q, k, v = qkv(rng)
    masked = np.ma.masked_array(q, mask=q > 1)
    with pytest.raises(TypeError, match="q is a masked array"):
        flex_attention(masked, k, v)
    with pytest.raises(TypeError, match="sinks is a masked array"):
        flex_attention(q, k, v, sinks=np.ma.masked_array([0.0, 1.0], mask=[0, 1]))
    with pytest.raises(TypeError, match="cu_seqlens_q is a masked array"):
        flash_attention_varlen(q[0], k[0], v[0], np.ma.masked_array([0, 6]), [0, 6])
    with pytest.raises(TypeError, match="q_documents is a masked array"):
        document_mod(np.ma.masked_array([0, 0, 1]))
    with pytest.raises(TypeError, match="slopes is a masked array"):
        Alibi(np.ma.masked_array([0.5, 0.25]), L)


def test_a_dtype_that_does_not_compute_says_what_to_pass(rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=r"q must be float16, float32 or float64; got dtype int64: pass q.astype"):
        flex_attention(q.astype(np.int64), k, v)
