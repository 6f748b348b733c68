"""flex_attention against the reference attention() with the same mods, and against independent oracles:
the dense mask or bias built with loops (conftest's style), for every ready-made mod, L != S, grouped-query
heads, odd block sizes and rows that see no key. The old keywords (causal, align, window) give the same
bits and the same tiles as the block masks of their mask_mods."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import assert_close, gold_attention
from scipy.special import logsumexp
from test_blockmask import finishes_within

from tinyattn_np import (
    Alibi,
    BlockMask,
    Differentiable,
    RelativeBias,
    Softcap,
    alibi_slopes,
    and_masks,
    attention,
    causal_mod,
    create_block_mask,
    create_mask,
    document_ids,
    document_mod,
    draw_tile_plan,
    flash_attention,
    flash_attention_varlen,
    flex_attention,
    flex_attention_backward,
    noop_mask,
    or_masks,
    prefix_lm_mod,
    sliding_window_mod,
    tile_plan,
    varlen_block_mask,
    varlen_mod,
)
from tinyattn_np._mod_calls import score_indices

B, HQ, HKV, E, EV = 2, 4, 2, 8, 5


def inputs(rng, n_q, n_k, dtype=np.float64):
    q = rng.standard_normal((B, HQ, n_q, E)).astype(dtype)
    k = rng.standard_normal((B, HKV, n_k, E)).astype(dtype)
    v = rng.standard_normal((B, HKV, n_k, EV)).astype(dtype)
    return q, k, v


def loop_mask(n_q, n_k, allowed):
    """An oracle mask written with loops: allowed(b, h, i, j) -> bool, for every (b, h, i, j)."""
    return np.array(
        [[[[bool(allowed(b, h, i, j)) for j in range(n_k)] for i in range(n_q)] for h in range(HQ)] for b in range(B)]
    )


def documents(n, sizes):
    """Document ids for n tokens packed from documents of the given sizes (the last one takes the rest)."""
    return np.searchsorted(np.cumsum(sizes), np.arange(n), side="right")


def mask_cases(n_q, n_k):
    """(name, mask_mod, B of its block mask, H of its block mask, the loop oracle's allowed(b, h, i, j))."""
    off = n_k - n_q
    ids_q, ids_k = documents(n_q, [3, 5]), documents(n_k, [4, 2])
    prefix = np.array([2, 5])
    return [
        ("causal", causal_mod(n_q, n_k), None, None, lambda b, h, i, j: j <= i + off),
        ("top-left", causal_mod(n_q, n_k, align="top_left"), None, None, lambda b, h, i, j: j <= i),
        ("window", sliding_window_mod(3, n_q, n_k), None, None, lambda b, h, i, j: i + off - 3 < j <= i + off),
        ("prefix-LM", prefix_lm_mod(prefix), B, None, lambda b, h, i, j: j < prefix[b] or j <= i),
        ("documents", document_mod(ids_q, ids_k), None, None, lambda b, h, i, j: ids_q[i] == ids_k[j]),
        ("causal documents", and_masks(document_mod(ids_q, ids_k), causal_mod(n_q, n_k)), None, None,
         lambda b, h, i, j: ids_q[i] == ids_k[j] and j <= i + off),
        ("per head", lambda b, h, q_idx, kv_idx: (kv_idx + h) % 3 != 0, None, HQ, lambda b, h, i, j: (j + h) % 3),
        ("per batch and head", lambda b, h, q_idx, kv_idx: kv_idx < q_idx + b - h, B, HQ,
         lambda b, h, i, j: j < i + b - h),
        ("none", noop_mask, None, None, lambda b, h, i, j: True),
    ]  # fmt: skip


def bias_cases(n_q, n_k, rng):
    """(name, score_mod, the loop oracle's new score(score, b, h, i, j))."""
    off, slopes, table = n_k - n_q, alibi_slopes(HQ), rng.standard_normal((HQ, 7))
    batch_slopes = rng.uniform(0.1, 1.0, (B, HQ))
    return [
        ("alibi", Alibi(slopes, n_q, n_k), lambda s, b, h, i, j: s - slopes[h] * abs(i + off - j)),
        ("alibi per batch", Alibi(batch_slopes, n_q, n_k),
         lambda s, b, h, i, j: s - batch_slopes[b, h] * abs(i + off - j)),
        ("softcap", Softcap(0.8), lambda s, b, h, i, j: 0.8 * np.tanh(s / 0.8)),
        ("relative bias", RelativeBias(table, n_q, n_k),
         lambda s, b, h, i, j: s + table[h, min(max(j - i - off, -3), 3) + 3]),
        ("user's bias", lambda score, b, h, q_idx, kv_idx: score + 0.1 * h - 0.01 * (q_idx - kv_idx) ** 2,
         lambda s, b, h, i, j: s + 0.1 * h - 0.01 * (i - j) ** 2),
    ]  # fmt: skip


def loop_scores(q, k, score):
    """Scaled scores (B, HQ, L, S), each rewritten by score(s, b, h, i, j) one at a time."""
    s = np.einsum("bhle,bhse->bhls", q, np.repeat(k, HQ // HKV, axis=1)) / np.sqrt(E)
    return np.array(
        [
            [
                [[score(s[b, h, i, j], b, h, i, j) for j in range(s.shape[3])] for i in range(s.shape[2])]
                for h in range(HQ)
            ]
            for b in range(B)
        ]
    )


SIZES = [(13, 13, 4, 4), (9, 17, 5, 3), (17, 9, 3, 5), (1, 11, 2, 7), (12, 12, 64, 64)]  # (L, S, block_q, block_k)


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", SIZES)
def test_every_mask_mod_equals_the_loop_oracle_and_the_reference(rng, n_q, n_k, block_q, block_k):
    q, k, v = inputs(rng, n_q, n_k)
    for name, mask_mod, b_size, h_size, allowed in mask_cases(n_q, n_k):
        dense = loop_mask(n_q, n_k, allowed)  # (B, HQ, L, S)
        block_mask = create_block_mask(mask_mod, b_size, h_size, n_q, n_k, BLOCK_SIZE=(block_q, block_k))
        out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        gold, gold_lse = gold_attention(q, k, v, dense)
        assert_close(out, gold, np.float64, f"{name} vs the loop oracle")
        np.testing.assert_array_equal(np.isneginf(lse), ~dense.any(axis=-1), err_msg=f"{name}: rows with no key")
        assert_close(lse[np.isfinite(lse)], gold_lse[np.isfinite(lse)], np.float64, f"{name} lse")
        assert_close(attention(q, k, v, mask_mod=mask_mod), gold, np.float64, f"{name}: the reference's mask_mod")
        np.testing.assert_array_equal(
            create_mask(mask_mod, b_size, h_size, n_q, n_k), dense[: b_size or 1, : h_size or 1]
        )


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_score_mod_equals_the_loop_oracle_and_the_reference(rng, n_q, n_k, block_q, block_k, dtype):
    q, k, v = inputs(rng, n_q, n_k, dtype)
    causal = create_block_mask(causal_mod(n_q, n_k), None, None, n_q, n_k, BLOCK_SIZE=(block_q, block_k))
    hidden = ~loop_mask(n_q, n_k, lambda b, h, i, j: j <= i + n_k - n_q)
    for name, score_mod, score in bias_cases(n_q, n_k, rng):
        scores = np.where(hidden, -np.inf, loop_scores(q.astype(np.float64), k.astype(np.float64), score))
        with np.errstate(invalid="ignore"):  # a row with no key: NaN from scipy's softmax, which gold makes 0
            gold = np.nan_to_num(np.exp(scores - scores.max(-1, keepdims=True, initial=-1e300)), nan=0.0)
        gold = (gold / np.maximum(gold.sum(-1, keepdims=True), 1e-300)) @ np.repeat(v, HQ // HKV, axis=1)
        out = flex_attention(q, k, v, score_mod, causal, enable_gqa=True)
        assert out.dtype == dtype
        assert_close(out, gold.astype(dtype), dtype, f"{name} vs the loop oracle")
        reference = attention(q, k, v, causal=True, score_mod=score_mod)
        assert_close(out, reference, dtype, f"{name} vs attention(score_mod=...)")


def test_a_bias_score_mod_is_the_reference_with_a_float_mask(rng):
    """A bias score_mod applied to zero scores is its bias: attention with that float mask is flex_attention
    with the score_mod. create_mask of a score_mod is, as torch's, where it leaves a score finite."""
    q, k, v = inputs(rng, 10, 14)
    alibi = Alibi(alibi_slopes(HQ), 10, 14)
    bias = alibi(np.zeros((1, HQ, 10, 14)), 0, np.arange(HQ)[:, None, None], np.arange(10)[:, None], np.arange(14))
    assert_close(flex_attention(q, k, v, alibi, enable_gqa=True), attention(q, k, v, mask=bias), np.float64)
    np.testing.assert_array_equal(create_mask(alibi, None, HQ, 10, 14), np.ones((1, HQ, 10, 14), bool))

    def hide_odd_keys(score, b, h, q_idx, kv_idx):
        return np.where(kv_idx % 2 == 1, -np.inf, score)

    np.testing.assert_array_equal(create_mask(hide_odd_keys, 2, None, 3, 4)[1, 0, 2], [True, False, True, False])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_q,n_k,block_q,block_k", SIZES)
@pytest.mark.parametrize(
    "band", [dict(), dict(align="top_left"), dict(window=4)], ids=["bottom-right", "top-left", "window"]
)
def test_the_old_keywords_are_mask_mods_on_the_one_path(rng, dtype, n_q, n_k, block_q, block_k, band):
    """flash_attention(causal=True, align=..., window=...) and flex_attention with the block mask of the same
    mask_mod run the same tiles and give the same bits."""
    q, k, v = inputs(rng, n_q, n_k, dtype)
    align = band.get("align", "bottom_right")
    mod = sliding_window_mod(band["window"], n_q, n_k) if "window" in band else causal_mod(n_q, n_k, align=align)
    block_mask = create_block_mask(mod, None, None, n_q, n_k, BLOCK_SIZE=(block_q, block_k))
    old = flash_attention(q, k, v, causal=True, block_q=block_q, block_k=block_k, return_lse=True, **band)
    new = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    for a, b in zip(old, new, strict=True):
        np.testing.assert_array_equal(a, b)
    plan = tile_plan(n_q, n_k, block_q, block_k, causal=True, **band)
    assert [(t.q_start, t.k_start, t.kind != "full") for t in plan] == [
        (t.q_start, t.k_start, t.kind != "full") for t in block_mask.tile_plan()
    ]  # the same tiles, and the same ones need the mask


def test_band_hides_what_the_masks_module_hides():
    """Band's partial tiles hide with the mask_mod exactly what masks.band_blocked hid before."""
    from tinyattn_np.blockmask import Band
    from tinyattn_np.masks import band_blocked

    for offset, window in [(0, None), (3, None), (-2, None), (4, 3), (0, 1)]:
        band = Band(offset, window)
        for tile in band.row_tiles(0, 9, 11, 4):
            expected = band_blocked(tile.q_start, tile.q_stop, tile.k_start, tile.k_stop, offset, window)
            np.testing.assert_array_equal(band.hidden(tile), expected)


def test_rows_that_see_no_key_give_zero_and_minus_inf(rng):
    q, k, v = inputs(rng, 9, 4)
    nothing_for_some = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < q_idx - 4, None, None, 9, 4, BLOCK_SIZE=2)
    with np.errstate(all="raise"):
        out, lse = flex_attention(q, k, v, Softcap(2.0), nothing_for_some, enable_gqa=True, return_lse=True)
    np.testing.assert_array_equal(out[..., :5, :], 0.0)  # queries 0..4 see no key
    np.testing.assert_array_equal(lse[..., :5], -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[..., 5:]).all()
    empty = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx < 0, None, None, 9, 4, BLOCK_SIZE=2)
    assert empty.sparsity() == 100.0
    np.testing.assert_array_equal(flex_attention(q, k, v, block_mask=empty, enable_gqa=True), 0.0)


def test_sinks_are_a_key_with_a_logit_and_no_value(rng):
    """A sink joins the softmax and is dropped: the same as one more key whose score is the sink (any q)
    and whose value is 0, with that key's column removed from the output's weights."""
    q, k, v = inputs(rng, 7, 9)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    out, lse = flex_attention(q, k, v, block_mask=None, enable_gqa=True, return_lse=True, sinks=sinks)
    scores = np.einsum("bhle,bhse->bhls", q, np.repeat(k, 2, axis=1)) / np.sqrt(E)
    with_sink = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (B, HQ, 7, 1))], axis=-1)
    weights = np.exp(with_sink - with_sink.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert_close(out, weights[..., :-1] @ np.repeat(v, 2, axis=1), np.float64, "sinks")
    assert_close(lse, np.log(np.exp(with_sink).sum(-1)), np.float64, "lse with the sink")
    assert_close(attention(q, k, v, sinks=sinks), out, np.float64, "the reference's sinks")
    # a row that sees no key gives all its weight to the sink: out 0, lse = the sink
    nothing = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx < 3, None, None, 7, 9, BLOCK_SIZE=4)
    out, lse = flex_attention(q, k, v, block_mask=nothing, enable_gqa=True, return_lse=True, sinks=sinks)
    np.testing.assert_array_equal(out[..., 3:, :], 0.0)
    np.testing.assert_array_equal(lse[..., 3:], np.broadcast_to(sinks[:, None], (B, HQ, 4)))


def test_document_ids_and_varlen_equal_each_sequence_alone(rng):
    """flash_attention_varlen: every sequence attends to its own keys only, bottom-right causal within it,
    as if each ran alone; grouped-query heads; sequences shorter and longer than a tile."""
    cu_q, cu_k = np.array([0, 3, 3, 12, 20]), np.array([0, 5, 7, 14, 30])  # an empty query sequence too
    np.testing.assert_array_equal(document_ids([0, 2, 5]), [0, 0, 1, 1, 1])
    q, k, v = rng.standard_normal((4, 20, 6)), rng.standard_normal((2, 30, 6)), rng.standard_normal((2, 30, 3))
    for causal, window in [(False, None), (True, None), (True, 3)]:
        out, lse = flash_attention_varlen(
            q, k, v, cu_q, cu_k, causal=causal, window=window, block_size=4, return_lse=True
        )
        for d in range(4):
            rows, keys = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
            alone = flash_attention(q[:, rows], k[:, keys], v[:, keys], causal=causal, window=window)
            assert_close(out[:, rows], alone, np.float64, f"sequence {d}, causal={causal}, window={window}")
        assert out.shape == (4, 20, 3) and lse.shape == (4, 20)
    # the mask_mod itself against a loop: same sequence, and j - end_k <= i - end_q within it
    ends_q, ends_k, ids_q, ids_k = cu_q[1:], cu_k[1:], document_ids(cu_q), document_ids(cu_k)
    mask = create_mask(varlen_mod(cu_q, cu_k, causal=True), None, None, 20, 30)[0, 0]
    gold = [
        [ids_q[i] == ids_k[j] and j - ends_k[ids_q[i]] <= i - ends_q[ids_q[i]] for j in range(30)] for i in range(20)
    ]
    np.testing.assert_array_equal(mask, gold)


def test_the_varlen_block_mask_is_the_mask_mods_tiles_made_by_arithmetic():
    """varlen_block_mask's tiles, from the boundaries alone, equal create_block_mask's calls of varlen_mod on
    every tile: random packings (empty sequences, sequences without keys), every band, tiles down to 1."""
    rng = np.random.default_rng(5)
    for _ in range(60):  # 60 packings of up to 4 sequences of 0-5 tokens: empty ones and keyless ones among them
        n = rng.integers(1, 5)
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(rng.integers(0, 6, n))]) for _ in range(2))
        if not (cu_q[-1] and cu_k[-1]):
            continue
        for causal, window in [(False, None), (True, None), (True, 1), (True, 3)]:
            for block_size in [1, (2, 3), (3, 2), (7, 5)]:
                mine = varlen_block_mask(cu_q, cu_k, causal=causal, window=window, BLOCK_SIZE=block_size)
                mod = varlen_mod(cu_q, cu_k, causal=causal, window=window)
                gold = create_block_mask(mod, None, None, int(cu_q[-1]), int(cu_k[-1]), BLOCK_SIZE=block_size)
                np.testing.assert_array_equal(mine.kinds, gold.kinds, err_msg=f"{cu_q} {cu_k} {causal} {window}")


def test_varlen_checks_the_lengths_before_it_builds_anything(rng):
    """A last cu_seqlens entry far past q's tokens is refused at once: no mask of that size is made first."""
    q = k = v = rng.standard_normal((1, 5, 4))
    with pytest.raises(ValueError, match=r"q must be packed heads \(H, 100000000000, E\)"):
        finishes_within(10, flash_attention_varlen, q, k, v, [0, 5, 10**11], [0, 5, 10**11])
    with pytest.raises(ValueError, match=r"k must be packed heads \(H, 7, E\)"):
        flash_attention_varlen(q, k, v, [0, 5], [0, 7])


def test_key_and_value_of_batch_one_serve_every_batch_entry_as_in_torch(rng):
    """k, v (1, Hkv, S, E) against q (B, Hq, L, E): the result of k, v repeated over the batch, forward and
    backward (the gradients of the shared k and v summed over the batch)."""
    q, k, v = inputs(rng, 7, 9)
    k1, v1, dout = k[:1], v[:1], rng.standard_normal((B, HQ, 7, EV))
    block_mask = create_block_mask(causal_mod(7, 9), None, None, 7, 9, BLOCK_SIZE=3)
    run = dict(block_mask=block_mask, enable_gqa=True, sinks=np.ones(HQ))
    out, lse = flex_attention(q, k1, v1, return_lse=True, **run)
    gold_out, gold_lse = flex_attention(q, np.repeat(k1, B, 0), np.repeat(v1, B, 0), return_lse=True, **run)
    np.testing.assert_array_equal(out, gold_out)
    grads = flex_attention_backward(q, k1, v1, out, dout, lse, **run)
    gold = flex_attention_backward(q, np.repeat(k1, B, 0), np.repeat(v1, B, 0), out, dout, lse, **run)
    assert grads.dk.shape == k1.shape and grads.dv.shape == v1.shape
    np.testing.assert_array_equal(grads.dq, gold.dq)
    assert_close(grads.dk, gold.dk.sum(axis=0, keepdims=True), np.float64, "dk")
    assert_close(grads.dv, gold.dv.sum(axis=0, keepdims=True), np.float64, "dv")
    with pytest.raises(ValueError, match="same batch dims"):
        flex_attention(q, k[:1].repeat(3, 0), v[:1].repeat(3, 0), enable_gqa=True)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_a_nan_or_inf_in_the_inputs_gives_a_defined_result_and_no_warning(rng, bad, where):
    """As in torch: a NaN (or an inf, through inf - inf) reaches the rows whose tiles meet it and no others,
    and the package raises no RuntimeWarning, forward or backward. Here entry 9 of head 0 is bad: the query
    blocks 0 and 1 (rows 0-7, tiles of 4) never meet key 9 under the causal mask, and head 1 is apart."""
    clean = dict(zip("qkv", (rng.standard_normal((1, 2, 16, 4)) for _ in range(3)), strict=True))
    x = {name: array.copy() for name, array in clean.items()}
    x[where][0, 0, 9, 1] = bad
    block_mask = create_block_mask(causal_mod(16), None, None, 16, 16, BLOCK_SIZE=4)
    dout = rng.standard_normal((1, 2, 16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning from any thread of the package fails the test
        out, lse = flex_attention(x["q"], x["k"], x["v"], block_mask=block_mask, return_lse=True, workers=3)
        grads = flex_attention_backward(x["q"], x["k"], x["v"], out, dout, lse, block_mask=block_mask, workers=3)
        flash = flash_attention(x["q"], x["k"], x["v"], causal=True, block_q=4, block_k=4, workers=3)
        flash_attention_varlen(x["q"][0], x["k"][0], x["v"][0], [0, 16], [0, 16], causal=True, block_size=4)
    gold = flex_attention(clean["q"], clean["k"], clean["v"], block_mask=block_mask)
    # a block that met a NaN is summed again with the running max: equal to the last bits of float64
    np.testing.assert_allclose(out, flash, rtol=1e-13, atol=1e-15, equal_nan=True)
    np.testing.assert_allclose(out[0, 0, :8], gold[0, 0, :8], rtol=1e-13, atol=1e-15)  # rows that never meet key 9
    np.testing.assert_allclose(out[0, 1], gold[0, 1], rtol=1e-13, atol=1e-15)  # the other head
    if np.isnan(bad):  # NaN in, NaN out: the whole row through a score, one column through a value
        assert np.isnan(out[0, 0, 9]).all() if where in "qk" else np.isnan(out[0, 0, 9, 1])
        assert np.isnan(grads.dq[0, 0, 9]).all()


def test_a_block_mask_a_score_mod_and_sinks_in_odd_tiles_are_the_reference(rng):
    """flex_attention with a block mask in tiles that divide neither L nor S, ALiBi and a sink per head equals
    the reference with the same mods; lse is the logsumexp of the modded, masked scores and the sink."""
    q, k, v = inputs(rng, 11, 14)
    mask_mod = prefix_lm_mod(3)
    block_mask = create_block_mask(mask_mod, None, HQ, 11, 14, BLOCK_SIZE=(4, 3))
    alibi, sinks = Alibi(alibi_slopes(HQ), 11, 14), np.array([0.3, 0.1, -0.2, 1.0])
    out, lse = flex_attention(q, k, v, alibi, block_mask, enable_gqa=True, return_lse=True, sinks=sinks)
    assert_close(out, attention(q, k, v, score_mod=alibi, mask_mod=mask_mod, sinks=sinks), np.float64, "out")
    scores = np.einsum("bhle,bhse->bhls", q, np.repeat(k, 2, axis=1)) / np.sqrt(E)  # (B, Hq, L, S)
    scores = np.where(create_mask(mask_mod, B, HQ, 11, 14), alibi(scores, *score_indices((B,), HQ, 11, 14)), -np.inf)
    with_sink = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (B, HQ, 11, 1))], axis=-1)
    assert_close(lse, logsumexp(with_sink, axis=-1), np.float64, "lse with the sink")


def test_same_bits_for_any_number_of_workers_and_heads_per_step(rng):
    q, k, v = (x.astype(np.float32) for x in inputs(rng, 200, 230))
    block_mask = create_block_mask(
        lambda b, h, q_idx, kv_idx: (kv_idx - q_idx) % (h + 2) != 0, B, HQ, 200, 230, BLOCK_SIZE=(32, 48)
    )
    run = dict(score_mod=Softcap(3.0), block_mask=block_mask, enable_gqa=True, return_lse=True)
    one = flex_attention(q, k, v, **run, workers=1, kv_heads_per_step=1)
    for workers, per_step in [(2, 1), (3, 2), (4, 4)]:
        for a, b in zip(one, flex_attention(q, k, v, **run, workers=workers, kv_heads_per_step=per_step), strict=True):
            np.testing.assert_array_equal(a, b)


def test_block_mask_tables_and_drawing():
    block_mask = create_block_mask(
        and_masks(causal_mod(8), lambda b, h, q_idx, kv_idx: kv_idx >= 2), None, None, 8, 8, BLOCK_SIZE=2
    )
    assert isinstance(block_mask, BlockMask) and block_mask.shape == (1, 1, 8, 8) and block_mask.BLOCK_SIZE == (2, 2)
    drawn = draw_tile_plan(block_mask)
    assert drawn == ". . . .\n. \\ . .\n. # \\ .\n. # # \\", drawn
    assert str(block_mask) == drawn and "sparsity=62.50%" in repr(block_mask) and block_mask.sparsity() == 62.5
    np.testing.assert_array_equal(block_mask.to_dense()[0, 0], [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]])
    # torch's tables: partial tiles per query block and their key blocks first; full ones the same way
    np.testing.assert_array_equal(block_mask.kv_num_blocks[0, 0], [0, 1, 1, 1])
    np.testing.assert_array_equal(block_mask.full_kv_num_blocks[0, 0], [0, 0, 1, 2])
    assert block_mask.kv_indices[0, 0, 3, 0] == 3 and list(block_mask.full_kv_indices[0, 0, 3, :2]) == [1, 2]
    per_head = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= h, None, 2, 4, 4, BLOCK_SIZE=2)
    assert draw_tile_plan(per_head.tile_plan(0, 1)) == "# .\n# ." and draw_tile_plan(per_head) == "\\ .\n\\ ."


def test_and_or_noop_masks():
    i, j = np.arange(5)[:, None], np.arange(5)
    even, causal = (lambda b, h, q, kv: kv % 2 == 0), causal_mod(5)
    np.testing.assert_array_equal(and_masks(even, causal)(0, 0, i, j), (j % 2 == 0) & (j <= i))
    np.testing.assert_array_equal(or_masks(even, causal)(0, 0, i, j), (j % 2 == 0) | (j <= i))
    np.testing.assert_array_equal(noop_mask(0, 0, i, j), np.ones((5, 5), bool))
    np.testing.assert_array_equal(or_masks()(0, 0, i, j), np.zeros((5, 5), bool))  # nothing lets a key through
    assert "and_masks(" in and_masks(even, causal).__name__


def test_the_reference_and_flex_agree_on_grouped_heads_with_every_mod_at_once(rng):
    q, k, v = inputs(rng, 16, 16)
    ids = documents(16, [5, 6])
    mask_mod = or_masks(and_masks(document_mod(ids), causal_mod(16)), lambda b, h, q_idx, kv_idx: kv_idx == 0)
    block_mask = create_block_mask(mask_mod, None, None, 16, 16, BLOCK_SIZE=(5, 3))
    bias, sinks = RelativeBias(rng.standard_normal((HQ, 5)), 16), rng.standard_normal(HQ)
    out = flex_attention(q, k, v, bias, block_mask, enable_gqa=True, sinks=sinks)
    assert_close(out, attention(q, k, v, score_mod=bias, mask_mod=mask_mod, sinks=sinks), np.float64, "all at once")


# --- bad input -----------------------------------------------------------------------------------


def test_errors_name_what_to_pass(rng):
    q, k, v = inputs(rng, 6, 6)
    mask = create_block_mask(causal_mod(6), None, None, 6, 6, BLOCK_SIZE=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex_attention(q, k, v, block_mask=mask)
    k7, v7 = np.concatenate([k, k[..., :1, :]], -2), np.concatenate([v, v[..., :1, :]], -2)  # one key more
    with pytest.raises(ValueError, match=r"block_mask was made for .* \(1, 1, 6, 6\).*S = 7"):
        flex_attention(q, k7, v7, block_mask=mask, enable_gqa=True)
    with pytest.raises(ValueError, match="B and H of the mask must be 1 or the inputs'"):
        flex_attention(q, k, v, block_mask=create_block_mask(noop_mask, 3, None, 6, 6), enable_gqa=True)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        flex_attention(q, k, v, block_mask=np.ones((6, 6), bool), enable_gqa=True)
    with pytest.raises(TypeError, match="mask_mod must return bools"):
        create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx - q_idx, None, None, 6, 6)
    with pytest.raises(TypeError, match="score_mod must return numbers of the scores' shape"):
        flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: np.ones(3), enable_gqa=True)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        flex_attention(q, k, v, "alibi", enable_gqa=True)
    with pytest.raises(ValueError, match="kernel_options"):
        flex_attention(q, k, v, enable_gqa=True, kernel_options={"BLOCK_M": 64})
    with pytest.raises(ValueError, match="sinks must be 4 finite numbers"):
        flex_attention(q, k, v, enable_gqa=True, sinks=[0.0, 1.0])
    with pytest.raises(ValueError, match="device must be None or 'cpu'"):
        create_block_mask(noop_mask, None, None, 6, 6, device="cuda")
    with pytest.raises(ValueError, match=r"q must be packed heads \(H, 6, E\)"):
        flash_attention_varlen(q, k, v, [0, 6], [0, 6])
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D ints rising from 0"):
        flash_attention_varlen(q[0], k[0], v[0], [0, 4, 2], [0, 6])


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Alibi(np.ones((2, 3, 4)), 4), "slopes must be finite"),
        (lambda: Alibi(np.ones((2, 4)), 4, learned=True), r"learned slopes must have shape \(Hq,\)"),
        (lambda: Softcap(0), "cap must be a positive finite number; got 0$"),
        (lambda: RelativeBias(np.ones((4, 6)), 4), "R must be odd"),
        (lambda: RelativeBias(np.ones(4), 4), r"shape \(Hq, R\)"),
        (lambda: prefix_lm_mod(-1), "prefix must be an int >= 0"),
        (lambda: document_mod(np.ones(3)), "q_documents must be ints"),
        (lambda: varlen_mod([0, 2], [0, 1, 2]), "must count the same sequences"),
        (lambda: varlen_mod([0, 2], [0, 2], window=2), "window=2 needs causal=True"),
    ],
)
def test_ready_made_mods_check_their_arguments(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_a_bucket_outside_the_table_is_refused(rng):
    q, k, v = inputs(rng, 4, 4)
    far = RelativeBias(np.ones((HQ, 3)), 4, bucket=lambda distance: distance + 10)
    with pytest.raises(ValueError, match="bucket must give table columns 0 .. 2"):
        flex_attention(q, k, v, far, enable_gqa=True)


def test_one_head_inputs_reprs_and_the_remaining_errors(rng):
    """2-D inputs (one head) through flex_attention, BlockMask.hidden, the mods' reprs, and the errors that
    name what to pass."""
    q, k, v = (rng.standard_normal((7, 4)) for _ in range(3))
    block_mask = create_block_mask(causal_mod(7), None, None, 7, 7, BLOCK_SIZE=3)
    out, lse = flex_attention(q, k, v, Softcap(2.0), block_mask, return_lse=True)
    assert out.shape == (7, 4) and lse.shape == (7,)
    assert_close(out, attention(q, k, v, causal=True, score_mod=Softcap(2.0)), np.float64, "2-D")
    tile = next(t for t in block_mask.tile_plan() if t.kind == "partial")
    np.testing.assert_array_equal(block_mask.hidden(tile), np.triu(np.ones((3, 3), bool), 1))
    for mod, text in [
        (Alibi(alibi_slopes(2), 4), "Alibi(slopes of shape (2,)"),
        (Softcap(50), "Softcap(50)"),
        (RelativeBias(np.zeros((2, 3)), 4), "RelativeBias(table of shape (2, 3)"),
        (Differentiable(noop_score, noop_score), "Differentiable(noop_score)"),
    ]:
        assert repr(mod).startswith(text)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        create_block_mask("causal", None, None, 7, 7)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        attention(q, k, v, mask_mod=np.ones((7, 7), bool))
    with pytest.raises(TypeError, match="score_mod and derivative must be functions"):
        Differentiable(noop_score, 1.0)
    with pytest.raises(ValueError, match="device must be None or 'cpu'"):
        create_mask(causal_mod(7), None, None, 7, 7, device="cuda")


def noop_score(score, b, h, q_idx, kv_idx):
    return score
