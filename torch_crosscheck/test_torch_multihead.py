"""The torch reference module of cases.py (TorchMultiHeadAttention) checked against torch's own
nn.MultiheadAttention, so that the MultiHeadAttention cases compare with something torch vouches for.

With n_kv_heads == n_heads our w_qkv.T is exactly nn.MultiheadAttention's in_proj_weight (rows
[q; k; v], each split into heads of d_head consecutive rows) and w_out.T its out_proj.weight.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import TorchMultiHeadAttention, make_inputs, to_numpy  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402

import tinyattn_np as ta  # noqa: E402

# float64 throughout: the same sums in another order, 32 ulps of an output of size ~1 (cases.py, FULL_ULPS)
TOL = 32 * 2.0**-53


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_module_matches_nn_multiheadattention(device: str, causal: bool) -> None:
    mha = ta.MultiHeadAttention(32, 4, rng=np.random.default_rng(7), dtype=np.float64)
    ours = TorchMultiHeadAttention.from_numpy(mha, torch.float64, device)
    theirs = torch.nn.MultiheadAttention(32, 4, bias=False, batch_first=True, device=device, dtype=torch.float64)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.from_numpy(mha.w_qkv.T.copy()))
        theirs.out_proj.weight.copy_(torch.from_numpy(mha.w_out.T.copy()))
    (_,), (x,) = make_inputs("nn.MultiheadAttention", [(2, 9, 32)], "float64", device)
    # nn.MultiheadAttention's bool mask is the other way round: True means "may NOT attend"
    hidden = torch.ones(9, 9, dtype=torch.bool, device=device).triu(1) if causal else None
    with torch.no_grad():
        gold, _ = theirs(x, x, x, attn_mask=hidden, need_weights=False)
        mine = ours(x, causal=causal)
    np.testing.assert_allclose(to_numpy(mine), to_numpy(gold), rtol=0, atol=TOL)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_reference_module_gqa_is_enable_gqa(device: str) -> None:
    """repeat_interleave in the reference module is what SDPA's enable_gqa does: query head h reads
    kv head h // (H / Hkv)."""
    (_, _, _), (q, k, v) = make_inputs("gqa reference", [(2, 6, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)], "float64", device)
    spelled_out = F.scaled_dot_product_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))
    built_in = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    np.testing.assert_allclose(to_numpy(spelled_out), to_numpy(built_in), rtol=0, atol=TOL * 4)
