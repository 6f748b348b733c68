"""Sliding-window attention and split-KV decode steps against torch's scaled_dot_product_attention.

torch has no window argument, so the gold is SDPA with an explicit band mask (True = may attend):
query i of L sees key j of S when i + S - L - window < j <= i + S - L (bottom-right, itself included),
Hugging Face's Mistral mask for L == S. FlashAttention's window_size=(w, 0) is our window = w + 1.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import make_inputs, to_numpy, tolerance  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402

import tinyattn_np as ta  # noqa: E402


def band(n_q: int, n_k: int, window: int, device: str) -> torch.Tensor:
    """(L, S) bool built in torch, independently of tinyattn_np.masks: True where query i may see key j."""
    i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)  # the key each query lines up with
    j = torch.arange(n_k, device=device)[None, :]
    return (j <= i) & (j > i - window)


SHAPES = [(16, 16, 4, 4), (5, 21, 4, 2), (1, 40, 6, 2), (33, 33, 8, 1)]  # (L, S, Hq, Hkv)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("n_q", "n_k", "hq", "hkv"), SHAPES)
@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_window_matches_sdpa_with_a_band_mask(device, dtype, n_q, n_k, hq, hkv, window):
    name = f"window {n_q} {n_k} {hq} {hkv} {window}"
    shapes = [(2, hq, n_q, 16), (2, hkv, n_k, 16), (2, hkv, n_k, 16)]
    (q, k, v), (tq, tk, tv) = make_inputs(name, shapes, dtype, device)
    gold = to_numpy(
        F.scaled_dot_product_attention(tq, tk, tv, attn_mask=band(n_q, n_k, window, device), enable_gqa=True)
    )
    tol = tolerance(dtype, float(np.max(np.abs(v))))
    flash = ta.flash_attention(q, k, v, causal=True, window=window, block_q=4, block_k=8)
    np.testing.assert_allclose(flash, gold, rtol=0, atol=tol)
    reference = ta.attention(q, k, v, causal=True, window=window)
    np.testing.assert_allclose(reference, gold, rtol=0, atol=tol)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("window", [2, 7])
def test_ring_buffer_decoding_matches_sdpa(device, window):
    """A windowed KVCache after 20 one-token steps holds the last `window` keys in ring order; one
    decode step over it equals SDPA over the same keys in token order."""
    (keys, values, q), _ = make_inputs("ring", [(1, 2, 20, 8), (1, 2, 20, 8), (1, 4, 1, 8)], "float64", device)
    cache = ta.KVCache(1, 2, 20, 8, dtype=np.float64, window=window)
    for t in range(20):
        cache.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    tk, tv, tq = (torch.from_numpy(x).to(device) for x in (keys[:, :, -window:], values[:, :, -window:], q))
    gold = to_numpy(F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))
    mine = ta.flash_decode(q, cache.keys, cache.values, kv_splits=2)
    np.testing.assert_allclose(mine, gold, rtol=0, atol=tolerance("float64", float(np.max(np.abs(values)))))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kv_splits", [1, 3, 8])
def test_flash_decode_matches_sdpa(device, dtype, kv_splits):
    """One decode step (L = 1 against S keys) with grouped-query attention, as enable_gqa does it."""
    shapes = [(2, 8, 1, 32), (2, 2, 700, 32), (2, 2, 700, 24)]
    (q, k, v), (tq, tk, tv) = make_inputs(f"decode {kv_splits}", shapes, dtype, device)
    gold = to_numpy(F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))
    mine = ta.flash_decode(q, k, v, kv_splits=kv_splits)
    np.testing.assert_allclose(mine, gold, rtol=0, atol=tolerance(dtype, float(np.max(np.abs(v)))))
