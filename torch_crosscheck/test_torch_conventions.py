"""The conventions the README fixes, checked against torch directly: the two causal alignments, fully
masked rows, and the argument errors that SDPA raises."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import lower_right_gold, make_inputs, to_numpy  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import tinyattn_np as ta  # noqa: E402

# float64 on both sides: the same sums in another order, a few ulps of max|v| ~ 4 (cases.py, FULL_ULPS)
TOL = 32 * 2.0**-53 * 4


def qkv(name: str, L: int, S: int, device: str):
    return make_inputs(name, [(2, 3, L, 8), (2, 3, S, 8), (2, 3, S, 8)], "float64", device)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize(("L", "S"), [(3, 7), (7, 3)])
def test_the_two_causal_alignments_differ_when_L_is_not_S(device: str, L: int, S: int) -> None:
    """attention(causal=True) is bottom-right (torch's causal_lower_right), scaled_dot_product_attention
    (is_causal=True) is top-left (torch's is_causal). Each matches its torch twin, and for L != S the
    two differ: neither should ever be "fixed" into the other."""
    (q, k, v), (tq, tk, tv) = qkv(f"align {L} {S}", L, S, device)
    bottom_right = ta.attention(q, k, v, causal=True)
    top_left = ta.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(bottom_right, lower_right_gold(tq, tk, tv), rtol=0, atol=TOL)
    np.testing.assert_allclose(
        top_left, to_numpy(F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)), rtol=0, atol=TOL
    )
    differ = np.abs(bottom_right - top_left).max(axis=(0, 1, 3)) > 1e-3  # (L,): which query rows differ
    assert differ.sum() >= min(L, S) - 1, f"the alignments should differ on most rows; differ per row: {differ}"
    print(
        "bottom_right\n",
        ta.causal_mask(L, S).astype(int),
        "\ntop_left\n",
        ta.causal_mask(L, S, align="top_left").astype(int),
    )


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_the_two_causal_alignments_agree_when_L_is_S(device: str) -> None:
    (q, k, v), (tq, tk, tv) = qkv("align equal", 6, 6, device)
    gold = to_numpy(F.scaled_dot_product_attention(tq, tk, tv, is_causal=True))
    for mine in (
        ta.attention(q, k, v, causal=True),
        ta.flash_attention(q, k, v, causal=True, block_q=4, block_k=4),
        ta.scaled_dot_product_attention(q, k, v, is_causal=True),
    ):
        np.testing.assert_allclose(mine, gold, rtol=0, atol=TOL)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_are_exactly_zero_on_both_sides(device: str, dtype: str, kind: str) -> None:
    """A query that may see no key: output exactly 0 in tinyattn_np and in torch's math kernel (since
    2.5), never NaN. Only the math kernel: on CUDA, torch's cuDNN kernel returns non-zero values on such
    a row in float16/bfloat16 (report.py records what each kernel returns there)."""
    (q, k, v), (tq, tk, tv) = make_inputs("fully masked", [(1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)], dtype, device)
    allowed = np.ones((4, 5), bool)
    allowed[2] = False  # query 2 sees nothing
    if kind == "bool":
        mask, t_mask = allowed, torch.from_numpy(allowed).to(device)
    else:
        mask = np.where(allowed, 0.0, -np.inf).astype(q.dtype)
        t_mask = torch.from_numpy(mask).to(device=device, dtype=tq.dtype)  # torch wants the query's dtype
    mine = ta.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(SDPBackend.MATH):
        gold = to_numpy(F.scaled_dot_product_attention(tq, tk, tv, attn_mask=t_mask))
    assert np.all(mine[..., 2, :] == 0.0), mine[..., 2, :]
    assert np.all(gold[..., 2, :] == 0.0), gold[..., 2, :]
    assert np.isfinite(mine).all() and np.isfinite(gold).all()


def test_is_causal_with_attn_mask_is_an_error_as_in_torch_math() -> None:
    """torch documents "an error is thrown if both attn_mask and is_causal are set", and its reference
    (math) backend throws one. (torch 2.13's fused CPU kernel instead accepts the pair silently and
    applies both; we follow the documentation.)"""
    (q,), (tq,) = make_inputs("causal and mask", [(1, 2, 4, 8)], "float32", "cpu")
    mask = np.ones((4, 4), bool)
    with pytest.raises(ValueError, match="is_causal"):
        ta.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError, match="is_causal"):
        F.scaled_dot_product_attention(tq, tq, tq, attn_mask=torch.from_numpy(mask), is_causal=True)


def test_fewer_kv_heads_needs_enable_gqa_as_in_torch() -> None:
    (q, k), (tq, tk) = make_inputs("gqa flag", [(1, 4, 3, 8), (1, 2, 3, 8)], "float32", "cpu")
    with pytest.raises(ValueError, match="enable_gqa"):
        ta.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(tq, tk, tk)


def test_mismatched_dtypes_are_an_error_as_in_torch() -> None:
    """scaled_dot_product_attention promises torch's semantics: a float32 query with float16 keys and
    values is an error there (RuntimeError "Expected query, key, and value to have the same dtype"),
    and a TypeError naming the dtypes here, not a silent promotion to float32."""
    (q, k), (tq, tk) = make_inputs("dtype mismatch", [(1, 2, 4, 8), (1, 2, 4, 8)], "float32", "cpu")
    k16, tk16 = k.astype(np.float16), tk.to(torch.float16)
    with pytest.raises(TypeError, match="float16"):
        ta.scaled_dot_product_attention(q, k16, k16)
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(tq, tk16, tk16)
