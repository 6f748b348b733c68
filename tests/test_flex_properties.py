"""Hypothesis draws mask_mods at random (tables of bools per head, and and/or trees of the ready-made mods
with random parameters), shapes and tile sizes: flex_attention and its backward must equal the reference on
whole matrices, tile kinds must be what the dense mask says, and no row may give NaN."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyattn_np import (
    Softcap,
    and_masks,
    attention,
    causal_mod,
    create_block_mask,
    create_mask,
    document_mod,
    flex_attention,
    flex_attention_backward,
    or_masks,
    prefix_lm_mod,
    sliding_window_mod,
)
from tinyattn_np.attention import check_attention
from tinyattn_np.backward import attention_grads


def random_mask_mod(draw, rng, n_q, n_k, heads):
    """A mask_mod drawn from a small grammar: a leaf, or and/or of two drawn mask_mods. Its attribute
    per_head says whether it depends on h (then its block mask needs H = Hq)."""
    mask_mod = draw_mask_mod(draw, rng, n_q, n_k, heads)
    mask_mod.per_head = getattr(mask_mod, "per_head", False)
    return mask_mod


def draw_mask_mod(draw, rng, n_q, n_k, heads):
    kind = draw(st.sampled_from(["table", "head table", "causal", "window", "prefix", "documents", "and", "or"]))
    if kind == "table":  # any pattern at all, at a drawn density (0: nothing seen, 1: everything)
        table = rng.random((n_q, n_k)) < draw(st.sampled_from([0.0, 0.2, 0.7, 1.0]))
        return lambda b, h, q_idx, kv_idx: table[q_idx, kv_idx]
    if kind == "head table":
        table = rng.random((heads, n_q, n_k)) < 0.5

        def head_table(b, h, q_idx, kv_idx):
            return table[h, q_idx, kv_idx]

        head_table.per_head = True
        return head_table
    if kind == "causal":
        return causal_mod(n_q, n_k, align=draw(st.sampled_from(["bottom_right", "top_left"])))
    if kind == "window":
        return sliding_window_mod(draw(st.integers(1, n_q + n_k + 2)), n_q, n_k)
    if kind == "prefix":
        return prefix_lm_mod(draw(st.integers(0, n_k)))
    if kind == "documents":
        return document_mod(np.sort(rng.integers(0, 3, n_q)), np.sort(rng.integers(0, 3, n_k)))
    combine = and_masks if kind == "and" else or_masks
    parts = random_mask_mod(draw, rng, n_q, n_k, heads), random_mask_mod(draw, rng, n_q, n_k, heads)
    combined = combine(*parts)
    combined.per_head = any(part.per_head for part in parts)
    return combined


@st.composite
def cases(draw):
    n_q, n_k = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask_mod = random_mask_mod(draw, rng, n_q, n_k, hkv * group)
    block = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    per_head = mask_mod.per_head or draw(st.booleans())
    return n_q, n_k, hkv, group, rng, mask_mod, block, per_head


@settings(max_examples=200)
@given(cases(), st.booleans(), st.booleans())
def test_random_mask_mods_equal_the_reference(case, softcap, sinks):
    n_q, n_k, hkv, group, rng, mask_mod, block, per_head = case
    hq = hkv * group
    q, k = rng.standard_normal((2, hq, n_q, 3)), rng.standard_normal((2, hkv, n_k, 3))
    v, dout = rng.standard_normal((2, hkv, n_k, 2)), rng.standard_normal((2, hq, n_q, 2))
    block_mask = create_block_mask(mask_mod, None, hq if per_head else None, n_q, n_k, BLOCK_SIZE=block)
    # every tile's kind is what the dense mask says of it
    dense = create_mask(mask_mod, None, hq, n_q, n_k)[0]  # (Hq, L, S)
    kinds = block_mask.kinds[0, :, :, :]
    for i, j in np.ndindex(kinds.shape[1:]):
        tile = dense[: kinds.shape[0], i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
        expected = np.where(tile.all(axis=(1, 2)), 2, np.where(tile.any(axis=(1, 2)), 1, 0))
        np.testing.assert_array_equal(kinds[:, i, j], expected if per_head else expected[:1])
    score_mod = Softcap(2.0) if softcap else None
    run = dict(enable_gqa=True, sinks=rng.standard_normal(hq) if sinks else None)
    with np.errstate(invalid="raise"):  # no NaN made anywhere, rows that see no key included
        out, lse = flex_attention(q, k, v, score_mod, block_mask, return_lse=True, **run)
        grads = flex_attention_backward(q, k, v, out, dout, lse, score_mod=score_mod, block_mask=block_mask, **run)
    reference = attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=run["sinks"])
    np.testing.assert_allclose(out, reference, rtol=1e-12, atol=1e-12)
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
        sinks=run["sinks"],
    )
    gold = attention_grads(*checked[:3], dout, *checked[3:])
    for name in ("dq", "dk", "dv", "dsinks"):
        if getattr(gold, name) is not None:
            np.testing.assert_allclose(getattr(grads, name), getattr(gold, name), rtol=1e-9, atol=1e-11, err_msg=name)
