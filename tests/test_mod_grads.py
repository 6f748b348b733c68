"""The mods' derivatives (mod_grads.py): the chain rule through a score_mod on one block of scores against
finite differences, for every ready-made mod and a user's Differentiable one; the backward's two paths through
it (the reference's whole matrices, the engine's tiles) equal to it; and flex_attention_backward through every
score_mod, against finite differences of the whole attention."""

from __future__ import annotations

import numpy as np
import pytest
from test_flex_backward import HQ, L, S, check_flex_grads, inputs, mask_mods, score_mods
from test_mods import qkv

from tinyattn_np import (
    Alibi,
    Differentiable,
    RelativeBias,
    Softcap,
    alibi_slopes,
    attention_backward,
    create_block_mask,
    flex_attention,
    flex_attention_backward,
)
from tinyattn_np._backward_kernel import through_score_mod
from tinyattn_np._flash_kernel import TileMods
from tinyattn_np._mod_calls import score_indices
from tinyattn_np.mod_grads import score_mod_grads

EPS = 1e-6  # central differences in float64: error ~1e-10 for these O(1) functions


def block_mods(rng):
    """(name, score_mod) for one block of scores: every ready-made mod, learned where it can be, and a user's."""

    def wobble(score, b, h, q_idx, kv_idx):
        return score + 0.3 * np.sin(score) + 0.05 * h

    return [
        ("softcap", Softcap(0.9)),
        ("alibi, learned", Alibi(rng.uniform(0.1, 1.0, HQ), L, S, learned=True)),
        ("relative bias, learned", RelativeBias(rng.standard_normal((HQ, 5)), L, S)),
        ("user's, Differentiable", Differentiable(wobble, lambda score, b, h, q_idx, kv_idx: 1 + 0.3 * np.cos(score))),
    ]


@pytest.mark.parametrize("index", range(4), ids=[case[0] for case in block_mods(np.random.default_rng(0))])
def test_the_chain_rule_of_one_block_is_the_finite_differences(rng, index):
    """dscore and dparams of score_mod_grads against central differences of Σ dnew ∘ score_mod(score)."""
    name, mod = block_mods(rng)[index]
    b, h, q_idx, kv_idx = 0, 2, np.arange(L)[:, None], np.arange(S)
    score, dnew = rng.standard_normal((L, S)), rng.standard_normal((L, S))
    dscore, dparams = score_mod_grads(dnew, score, mod, b, h, q_idx, kv_idx)

    def loss(s):
        return float(np.sum(dnew * mod(s.copy(), b, h, q_idx, kv_idx)))

    numeric = np.zeros_like(score)
    for i, j in np.ndindex(score.shape):
        step = np.zeros_like(score)
        step[i, j] = EPS
        numeric[i, j] = (loss(score + step) - loss(score - step)) / (2 * EPS)
    np.testing.assert_allclose(dscore, numeric, rtol=1e-6, atol=1e-7, err_msg=f"{name}: dscore")
    if getattr(mod, "params", None) is None:
        assert dparams is None
        return
    numeric_params = np.zeros(mod.params.shape[1:])
    for r in np.ndindex(numeric_params.shape):
        saved = mod.params[(h, *r)]
        mod.params[(h, *r)] = saved + EPS
        up = loss(score)
        mod.params[(h, *r)] = saved - EPS
        down = loss(score)
        mod.params[(h, *r)] = saved
        numeric_params[r] = (up - down) / (2 * EPS)
    np.testing.assert_allclose(dparams, numeric_params, rtol=1e-6, atol=1e-7, err_msg=f"{name}: dparams")


@pytest.mark.parametrize("index", range(4), ids=[case[0] for case in block_mods(np.random.default_rng(0))])
def test_the_engine_goes_through_a_tile_as_the_plain_chain_rule_does(rng, index):
    """_backward_kernel.through_score_mod (in place, on a tile of the backward) gives score_mod_grads' bits."""
    _, mod = block_mods(rng)[index]
    b, h, q_idx, kv_idx = 1, 3, np.arange(2, 6)[:, None], np.arange(1, 8)
    score, dnew = rng.standard_normal((4, 7)), rng.standard_normal((4, 7))
    dscore, dparams = score_mod_grads(dnew, score, mod, b, h, q_idx, kv_idx)
    ds = dnew.copy()
    param_rows = None if dparams is None else np.zeros_like(dparams)
    through_score_mod(ds, score, TileMods(None, mod, b, h), q_idx, kv_idx, param_rows)
    np.testing.assert_array_equal(ds, dscore)
    if dparams is not None:
        np.testing.assert_array_equal(param_rows, dparams)


def test_the_reference_goes_through_whole_matrices_as_the_plain_chain_rule_does(rng):
    """backward.score_mod_backward on every head's whole matrix: score_mod_grads head by head."""
    from tinyattn_np._checks import QKVShape
    from tinyattn_np.backward import score_mod_backward

    batch, hq, e = (2,), HQ, 3
    q, k = rng.standard_normal((*batch, hq, L, e)), rng.standard_normal((*batch, hq, S, e))
    dims, scale = QKVShape(batch, hq, hq, L, S, e, e), 0.7
    mod = Alibi(rng.uniform(0.1, 1.0, hq), L, S, learned=True)
    ds = rng.standard_normal((*batch, hq, 1, L, S))  # (..., Hkv, G, L, S) with G = 1
    want, want_params = ds.copy(), np.zeros_like(mod.params)
    b, h, q_idx, kv_idx = score_indices(batch, hq, L, S)
    for b_i, h_i in np.ndindex(batch[0], hq):
        score = (q[b_i, h_i] * scale) @ k[b_i, h_i].T
        want[b_i, h_i, 0], dparams = score_mod_grads(ds[b_i, h_i, 0], score, mod, b_i, h_i, q_idx, kv_idx)
        want_params[h_i] += dparams
    dparams = score_mod_backward(ds, q, k, dims, scale, mod)
    np.testing.assert_allclose(ds, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dparams, want_params, rtol=1e-12, atol=1e-12)


# --- through the whole attention --------------------------------------------------------------------


@pytest.mark.parametrize("index", range(6), ids=[case[0] for case in score_mods(np.random.default_rng(0))])
@pytest.mark.parametrize("sinks", [False, True])
def test_flex_backward_through_every_score_mod(rng, index, sinks):
    """Every ready-made score_mod and a user's Differentiable one, under causal documents, with and without
    sinks: dq, dk, dv, the learned parameters and the sinks against finite differences."""
    q, k, v, dout = inputs(rng)
    name, score_mod = score_mods(rng)[index]
    mask_mod = mask_mods()[5][1]
    block_mask = create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=(3, 2))
    check_flex_grads(q, k, v, dout, score_mod, block_mask, rng.standard_normal(HQ) if sinks else None, name)


def test_a_score_mod_without_its_derivative_is_refused_with_what_to_pass(rng):
    q, k, v, dout = inputs(rng)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + 1.0

    out, lse = flex_attention(q, k, v, shifted, enable_gqa=True, return_lse=True)  # the forward takes any mod
    with pytest.raises(TypeError, match=r"does not give its derivative.*Differentiable\(score_mod, derivative\)"):
        flex_attention_backward(q, k, v, out, dout, lse, score_mod=shifted, enable_gqa=True)
    with pytest.raises(TypeError, match="Differentiable"):
        attention_backward(q, k, v, dout, score_mod=shifted)
    grads = flex_attention_backward(
        q, k, v, out, dout, lse, score_mod=Differentiable(shifted, lambda *_: 1.0), enable_gqa=True
    )
    plain_out, plain_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)  # softmax ignores the shift
    np.testing.assert_allclose(plain_lse + 1.0, lse, atol=1e-12)
    plain = flex_attention_backward(q, k, v, plain_out, dout, plain_lse, enable_gqa=True)
    for a, b in zip(grads[:3], plain[:3], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_float32_gradients_of_the_mods(rng):
    """In float32 the mods' gradients come back in float32, close to the float64 ones."""
    q, k, v, dout = inputs(rng)
    alibi, sinks = Alibi(alibi_slopes(HQ), L, S, learned=True), np.zeros(HQ)
    grads = {}
    for dtype in (np.float32, np.float64):
        args = [x.astype(dtype) for x in (q, k, v)]
        out, lse = flex_attention(*args, alibi, enable_gqa=True, return_lse=True, sinks=sinks)
        grads[dtype] = flex_attention_backward(
            *args, out, dout.astype(dtype), lse, score_mod=alibi, enable_gqa=True, sinks=sinks
        )
    for a, b in zip(grads[np.float32], grads[np.float64], strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "derivative,message",
    [
        (lambda score, b, h, q_idx, kv_idx: np.ones(3), r"derivative must return numbers of the scores' shape"),
        (lambda score, b, h, q_idx, kv_idx: "one", r"derivative must return numbers .* gave <U3"),
        (lambda score, b, h, q_idx, kv_idx: score > 0, "derivative must return numbers; .* gave bools"),
    ],
)
def test_a_derivative_of_the_wrong_shape_or_type_is_refused(rng, derivative, message):
    q, k, v = qkv(rng)
    dout = rng.standard_normal(q.shape)
    mod = Differentiable(lambda score, b, h, q_idx, kv_idx: 2 * score, derivative)
    out, lse = flex_attention(q, k, v, mod, return_lse=True)
    with pytest.raises(TypeError, match=message):
        flex_attention_backward(q, k, v, out, dout, lse, score_mod=mod)
    with pytest.raises(TypeError, match=message):
        attention_backward(q, k, v, dout, score_mod=mod)
