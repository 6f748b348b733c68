"""flex_attention_backward by hand, proved by central finite differences in float64 through every mask_mod
(every score_mod: tests/test_mod_grads.py), held equal to the reference's gradients on whole matrices, and
through MultiHeadAttention."""

from __future__ import annotations

import numpy as np
import pytest
from test_backward import assert_grads
from test_blockmask import finishes_within
from test_flex import HKV, HQ, B, documents

from tinyattn_np import (
    Alibi,
    BlockMask,
    Differentiable,
    KVCache,
    MultiHeadAttention,
    RelativeBias,
    Softcap,
    alibi_slopes,
    and_masks,
    attention,
    attention_backward,
    causal_mod,
    create_block_mask,
    document_mod,
    flex_attention,
    flex_attention_backward,
    prefix_lm_mod,
    sliding_window_mod,
)
from tinyattn_np.attention import check_attention
from tinyattn_np.backward import attention_grads

L, S = 7, 9


def inputs(rng, n_q=L, n_k=S, e=3, ev=2):
    q, k = rng.standard_normal((B, HQ, n_q, e)), rng.standard_normal((B, HKV, n_k, e))
    v, dout = rng.standard_normal((B, HKV, n_k, ev)), rng.standard_normal((B, HQ, n_q, ev))
    return q, k, v, dout


def mask_mods(n_q=L, n_k=S):
    """(name, mask_mod, B and H of its block mask)."""
    ids_q, ids_k = documents(n_q, [3]), documents(n_k, [5])
    return [
        ("none", None, None, None),
        ("causal", causal_mod(n_q, n_k), None, None),
        ("top-left", causal_mod(n_q, n_k, align="top_left"), None, None),
        ("window", sliding_window_mod(3, n_q, n_k), None, None),
        ("prefix-LM", prefix_lm_mod(np.array([2, 4])), B, None),
        ("causal documents", and_masks(document_mod(ids_q, ids_k), causal_mod(n_q, n_k)), None, None),
        ("per head", lambda b, h, q_idx, kv_idx: (kv_idx + h) % 3 != 0, None, HQ),
    ]


def score_mods(rng, n_q=L, n_k=S):
    def wobble(score, b, h, q_idx, kv_idx):  # a user's mod, not a bias: its derivative is given by hand
        return score + 0.3 * np.sin(score) + 0.05 * h

    return [
        ("none", None),
        ("alibi, learned", Alibi(rng.uniform(0.1, 1.0, HQ), n_q, n_k, learned=True)),
        ("alibi per batch", Alibi(rng.uniform(0.1, 1.0, (B, HQ)), n_q, n_k)),
        ("softcap", Softcap(0.9)),
        ("relative bias", RelativeBias(rng.standard_normal((HQ, 5)), n_q, n_k)),
        ("user's, Differentiable", Differentiable(wobble, lambda score, b, h, q_idx, kv_idx: 1 + 0.3 * np.cos(score))),
    ]


def check_flex_grads(q, k, v, dout, score_mod, block_mask, sinks, what):
    """flex_attention_backward against finite differences of Σ flex_attention(...) ∘ dout."""
    run = dict(enable_gqa=True, sinks=sinks)
    out, lse = flex_attention(q, k, v, score_mod, block_mask, return_lse=True, **run)
    grads = flex_attention_backward(q, k, v, out, dout, lse, score_mod=score_mod, block_mask=block_mask, **run)

    def loss():  # one worker: the same bits as any number (test_flex), without starting threads 2 · n times
        return float(np.sum(flex_attention(q, k, v, score_mod, block_mask, **run, workers=1) * dout))

    pairs = [("q", q, grads.dq), ("k", k, grads.dk), ("v", v, grads.dv)]
    if getattr(score_mod, "params", None) is not None:
        pairs.append(("score_mod's parameters", score_mod.params, grads.dscore_mod))
    else:
        assert grads.dscore_mod is None
    if sinks is not None:
        pairs.append(("sinks", sinks, grads.dsinks))
    assert_grads(loss, pairs, what)
    return grads


@pytest.mark.parametrize("index", range(7), ids=[case[0] for case in mask_mods()])
def test_flex_backward_through_every_mask_mod(rng, index):
    """Every mask_mod, with a nonlinear score_mod (softcap) and sinks on top, odd tiles, L != S, GQA."""
    q, k, v, dout = inputs(rng)
    name, mask_mod, b_size, h_size = mask_mods()[index]
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, b_size, h_size, L, S, BLOCK_SIZE=(2, 4))
    check_flex_grads(q, k, v, dout, Softcap(1.5), block_mask, rng.standard_normal(HQ), name)


@pytest.mark.parametrize("block_size", [(1, 1), (2, 3), (5, 4), (64, 64)])
def test_flex_backward_equals_the_reference_for_every_pair_of_mods(rng, block_size):
    """The blockwise backward and the reference's on whole matrices (attention_grads), every mask_mod
    with every score_mod, with sinks: the same gradients to rounding."""
    q, k, v, dout = inputs(rng)
    sinks = rng.standard_normal(HQ)
    for mask_name, mask_mod, b_size, h_size in mask_mods():
        block_mask = (
            None if mask_mod is None else create_block_mask(mask_mod, b_size, h_size, L, S, BLOCK_SIZE=block_size)
        )
        for score_name, score_mod in score_mods(rng):
            out, lse = flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True, sinks=sinks)
            mine = flex_attention_backward(
                q, k, v, out, dout, lse, score_mod=score_mod, block_mask=block_mask, enable_gqa=True, sinks=sinks
            )
            checked = check_attention(
                q,
                k,
                v,
                causal=False,
                mask=None,
                scale=None,
                align="bottom_right",
                window=None,
                mask_mod=mask_mod,
                score_mod=score_mod,
                sinks=sinks,
            )
            gold = attention_grads(*checked[:3], dout, *checked[3:])
            for field, a, b in zip(mine._fields, mine, gold, strict=True):
                if a is None or b is None:
                    assert a is b, f"{field}: {mask_name} x {score_name}"
                    continue
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"{field}: {mask_name} x {score_name}")


def test_the_reference_backward_takes_the_mods(rng):
    q, k, v, dout = inputs(rng)
    score_mod, mask_mod, sinks = Softcap(0.7), mask_mods()[4][1], rng.standard_normal(HQ)

    def loss():
        return float(np.sum(attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks) * dout))

    dq, dk, dv = attention_backward(q, k, v, dout, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    assert_grads(loss, [("q", q, dq), ("k", k, dk), ("v", v, dv)], "reference with mods")


def test_the_backward_refuses_another_forwards_state(rng):
    """P's rows, with the sink's weight, must sum to 1: an lse from other sinks or another mod is refused."""
    q, k, v, dout = inputs(rng)
    sinks = np.array([0.5, 1.0, -0.5, 2.0])
    out, lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True, sinks=sinks)
    with pytest.raises(ValueError, match="sum to .*, not 1.*sinks"):
        flex_attention_backward(q, k, v, out, dout, lse, enable_gqa=True)  # the sinks left out
    with pytest.raises(ValueError, match="sum to"):
        flex_attention_backward(q, k, v, out, dout, lse, score_mod=Softcap(0.5), enable_gqa=True, sinks=sinks)


def test_same_bits_for_any_number_of_workers(rng):
    q, k, v, dout = (x.astype(np.float32) for x in inputs(rng, 90, 110, e=8, ev=8))
    block_mask = create_block_mask(mask_mods(90, 110)[6][1], None, HQ, 90, 110, BLOCK_SIZE=(16, 8))
    run = dict(
        score_mod=RelativeBias(rng.standard_normal((HQ, 9)), 90, 110),
        block_mask=block_mask,
        enable_gqa=True,
        sinks=np.ones(HQ),
    )
    out, lse = flex_attention(q, k, v, return_lse=True, **run)
    one = flex_attention_backward(q, k, v, out, dout, lse, workers=1, **run)
    for workers in (2, 3):
        for a, b in zip(one, flex_attention_backward(q, k, v, out, dout, lse, workers=workers, **run), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_block_mask_and_a_score_mod_in_odd_tiles_are_the_reference(rng):
    """The backward through a block mask in tiles that divide neither L nor S and a softcap equals the
    reference's gradients with the same mods."""
    q, k, v, dout = inputs(rng, 11, 13)
    mask_mod, softcap = prefix_lm_mod(3), Softcap(1.1)
    block_mask = create_block_mask(mask_mod, None, HQ, 11, 13, BLOCK_SIZE=(4, 3))
    out, lse = flex_attention(q, k, v, softcap, block_mask, enable_gqa=True, return_lse=True)
    fast = flex_attention_backward(q, k, v, out, dout, lse, score_mod=softcap, block_mask=block_mask, enable_gqa=True)
    gold = attention_backward(q, k, v, dout, score_mod=softcap, mask_mod=mask_mod)
    for name, mine, ref in zip(("dq", "dk", "dv"), fast[:3], gold, strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("fused", [True, False])
def test_multihead_attention_with_a_block_mask_and_a_learned_score_mod(rng, fused):
    """The module's forward and backward through a block mask (causal documents) and a learned bias table:
    the fourth gradient is the table's, and all four match finite differences."""
    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=rng, dtype=np.float64)
    x, dout = rng.standard_normal((2, 6, 16)), rng.standard_normal((2, 6, 16))
    ids = documents(6, [2])
    block_mask = create_block_mask(and_masks(document_mod(ids), causal_mod(6)), None, None, 6, 6, BLOCK_SIZE=(4, 2))
    bias = RelativeBias(rng.standard_normal((4, 5)), 6)
    run = dict(causal=False, fused=fused, block_mask=block_mask, score_mod=bias)
    out, saved = mha.forward(x, **run)
    np.testing.assert_allclose(out, mha(x, **run), atol=1e-14)
    dx, dw_qkv, dw_out, dtable = mha.backward(dout, saved)

    def loss():
        return float(np.sum(mha(x, **run) * dout))

    pairs = [("x", x, dx), ("w_qkv", mha.w_qkv, dw_qkv), ("w_out", mha.w_out, dw_out), ("table", bias.table, dtable)]
    assert_grads(loss, pairs, f"mha fused={fused}")


def test_multihead_attention_mods_errors(rng):
    mha = MultiHeadAttention(16, 4, rng=rng, dtype=np.float64)
    x = rng.standard_normal((1, 6, 16))
    block_mask = create_block_mask(causal_mod(6), None, None, 6, 6)
    with pytest.raises(ValueError, match="pass block_mask with causal=False"):
        mha.forward(x, block_mask=block_mask)
    with pytest.raises(ValueError, match=r"block_mask was made for .* \(1, 1, 6, 6\)"):
        mha.forward(x[:, :5], causal=False, block_mask=block_mask)
    with pytest.raises(ValueError, match="cache= decodes with the causal band"):
        mha(x, cache=KVCache(1, 4, 8, 4, dtype=np.float64), score_mod=Softcap(1.0))
    out, saved = mha.forward(x, score_mod=lambda score, b, h, q_idx, kv_idx: score * 2)
    with pytest.raises(TypeError, match="does not give its derivative"):
        mha.backward(out, saved)
    assert saved.causal and not mha.forward(x, causal=False, block_mask=block_mask)[1].causal


def test_alibi_slopes_are_the_papers():
    """Press et al. 2022: 8 heads 1/2 ... 1/256; 12 heads: the 8 of 8 heads, then every other of 16 heads."""
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    sixteen = 2.0 ** (-0.5 * np.arange(1, 17))
    np.testing.assert_array_equal(alibi_slopes(12), np.concatenate([alibi_slopes(8), sixteen[0::2][:4]]))
    np.testing.assert_allclose(alibi_slopes(1), [2.0**-8])


@pytest.mark.parametrize("heads", [1, 4])
def test_the_reference_guard_bounds_what_the_ready_made_mods_allocate(rng, heads):
    """attention() and attention_backward() with mods refuse by an upper bound of their peak: the plain
    path's model plus what the ready-made mods make (attention.mods_bytes); tracemalloc stays under it."""
    from tinyattn_np._guard import mods_bytes
    from tinyattn_np.measure import traced_peak
    from tinyattn_np.peaks import attention_backward_bytes, naive_attention_bytes

    T = 512
    q, k, v, dout = (rng.standard_normal((1, heads, T, 32)).astype(np.float32) for _ in range(4))
    mods = [
        (Alibi(alibi_slopes(heads), T, learned=True), causal_mod(T)),
        (Softcap(5.0), None),
        (RelativeBias(rng.standard_normal((heads, 9)), T), prefix_lm_mod(10)),
    ]
    for score_mod, mask_mod in mods:
        checked = check_attention(
            q,
            k,
            v,
            causal=False,
            mask=None,
            scale=None,
            align="bottom_right",
            window=None,
            mask_mod=mask_mod,
            score_mod=score_mod,
        )
        dims, rules = checked[3], checked[5]
        _, forward = traced_peak(attention, q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        bound = naive_attention_bytes(T, heads=heads, head_dim=32) + mods_bytes(dims, q.dtype, rules, 2)
        assert forward <= bound, f"{score_mod}: forward {forward:,} B > {bound:,} B"
        _, backward = traced_peak(attention_backward, q, k, v, dout, score_mod=score_mod, mask_mod=mask_mod)
        bound = attention_backward_bytes(T, heads=heads, head_dim=32) + mods_bytes(dims, q.dtype, rules, 5)
        assert backward <= bound, f"{score_mod}: backward {backward:,} B > {bound:,} B"


# --- no wait without an end ------------------------------------------------------------------------


def test_a_block_mask_cannot_be_edited_behind_the_backwards_back(rng):
    """The forward and the backward read one table of tiles, which nobody can change after create_block_mask:
    an edited table would make the backward wait for a tile that the forward no longer runs."""
    q, k, v, dout = inputs(rng, 64, 64)
    block_mask = create_block_mask(causal_mod(64), None, None, 64, 64, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="read-only"):
        block_mask.kinds[0, 0, 3, 0] = 0
    with pytest.raises(ValueError, match="cannot set WRITEABLE"):
        block_mask.kinds.flags.writeable = True
    with pytest.raises(AttributeError):
        block_mask.kinds = np.zeros_like(block_mask.kinds)
    out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    grads = finishes_within(
        60, flex_attention_backward, q, k, v, out, dout, lse, block_mask=block_mask, enable_gqa=True, workers=3
    )
    reference = attention_backward(q, k, v, dout, causal=True)
    for mine, gold in zip(grads[:3], reference, strict=True):
        np.testing.assert_allclose(mine, gold, atol=1e-12)


class PlacesOutOfOrder(BlockMask):
    """A mask whose places disagree with its rows: each row's second tile claims the first place too."""

    def place(self, tile, n_k, block_k, heads=None):
        return max(0, super().place(tile, n_k, block_k, heads) - 1)


class ColumnsMissingATile(BlockMask):
    """A mask whose columns leave out a tile that its rows have: the last of the first column, which is the
    first of its row, so that the rest of that row waits for it."""

    def column_tiles(self, k_start, k_stop, n_q, block_q, heads=None):
        tiles = list(super().column_tiles(k_start, k_stop, n_q, block_q, heads))
        return tiles[:-1] if k_start == 0 else tiles


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("kind", [PlacesOutOfOrder, ColumnsMissingATile])
def test_a_tile_whose_turn_cannot_come_raises_instead_of_waiting(rng, kind, workers):
    q, k, v, dout = inputs(rng, 32, 32)
    made = create_block_mask(causal_mod(32), None, None, 32, 32, BLOCK_SIZE=8)
    block_mask = kind(made.kinds, made.seq_lengths, made.BLOCK_SIZE, made.mask_mod)
    out, lse = flex_attention(q, k, v, block_mask=made, enable_gqa=True, return_lse=True)
    with pytest.raises(RuntimeError, match="out of order"):
        finishes_within(
            60,
            flex_attention_backward,
            q,
            k,
            v,
            out,
            dout,
            lse,
            block_mask=block_mask,
            enable_gqa=True,
            workers=workers,
        )
