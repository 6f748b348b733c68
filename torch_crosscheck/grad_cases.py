"""The hand-written gradients against torch autograd: GRAD_CASES, in the format of cases.py (Case, Outcome),
read by test_torch_backward.py and by report.py.

Each case draws q, k, v (or x and a module's weights) and dout, runs our backward, and asks torch for the
same gradients with autograd through F.scaled_dot_product_attention (or through cases.py's reference
module, TorchMultiHeadAttention, with the same weights). Both causal alignments: torch's is_causal=True
is top-left, so our reference gets the top-left mask; our causal=True (bottom-right) is torch's
causal_lower_right bias. GQA through enable_gqa=True.

The error is measured per gradient relative to its largest entry: mine and gold are dq / max|dq_gold|,
dk / max|dk_gold|, dv / max|dv_gold| side by side, so one tolerance in ulps fits all three. Float64 and
float32 only: a gradient in float16 would measure torch's rounding of the backward, not our math.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from cases import FULL, NUMPY_DTYPES, TORCH_DTYPES, UNIT_ROUNDOFF, Case, Outcome, TorchMultiHeadAttention, make_inputs
from torch.nn.attention.bias import causal_lower_right

import tinyattn_np as ta

# The backward rounds more steps than the forward (S, P = exp, dP, dP - D, dS, then dS K and dSᵀ Q summed
# over up to 13 keys or queries), and dP - D cancels: its rounding is u·|dP|, not u·|dS|. Relative to the
# largest entry of each gradient, both sides agreed within 7 u on CPU (float64 and float32, math and flash
# kernels); 64 u leaves room for another BLAS or GPU, and a wrong term is off by far more than that.
GRAD_ULPS = 64


def normalised(grads: list[np.ndarray], golds: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(mine, gold): every gradient divided by its gold's largest entry, flattened and concatenated."""
    mine, gold = [], []
    for g, t in zip(grads, golds, strict=True):
        t_np = t.detach().to("cpu", torch.float64).numpy()
        size = float(np.abs(t_np).max()) or 1.0
        mine.append(np.asarray(g, np.float64).ravel() / size)
        gold.append(t_np.ravel() / size)
    return np.concatenate(mine), np.concatenate(gold)


def grad_outcome(grads: list[np.ndarray], golds: list[torch.Tensor], dtype: str) -> Outcome:
    mine, gold = normalised(grads, golds)
    return Outcome(mine, gold, GRAD_ULPS * UNIT_ROUNDOFF[dtype])


def attention_grad_case(
    hq: int, hkv: int, L: int, S: int, alignment: str | None, flash: bool, **blocks: int
) -> Callable[[str, str], Outcome]:
    """alignment: None (no mask), "top_left" (torch's is_causal) or "bottom_right" (causal_lower_right)."""

    def run(device: str, dtype: str) -> Outcome:
        E, Ev = 8, 8  # Ev == E: torch's flash kernel takes only that
        shapes = [(2, hq, L, E), (2, hkv, S, E), (2, hkv, S, Ev), (2, hq, L, Ev)]
        (q, k, v, dout), (tq, tk, tv, tdout) = make_inputs(
            f"grad {hq} {hkv} {L} {S} {alignment}", shapes, dtype, device
        )
        tq, tk, tv = (t.clone().requires_grad_() for t in (tq, tk, tv))
        gqa = dict(enable_gqa=True) if hq != hkv else {}
        if alignment == "top_left":
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, **gqa)
        elif alignment == "bottom_right":
            out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=causal_lower_right(L, S), **gqa)
        else:
            out = F.scaled_dot_product_attention(tq, tk, tv, **gqa)
        out.backward(tdout)
        if flash:  # flash's causal is bottom-right; top-left has no flash form here
            ours_out, lse = ta.flash_attention(q, k, v, causal=alignment == "bottom_right", return_lse=True, **blocks)
            grads = ta.flash_attention_backward(
                q, k, v, ours_out, dout, lse, causal=alignment == "bottom_right", **blocks
            )
        elif alignment == "top_left":
            grads = ta.attention_backward(q, k, v, dout, mask=ta.causal_mask(L, S, align="top_left"))
        else:
            grads = ta.attention_backward(q, k, v, dout, causal=alignment == "bottom_right")
        return grad_outcome(list(grads), [tq.grad, tk.grad, tv.grad], dtype)

    return run


def multihead_grad_case(n_kv_heads: int, fused: bool, rope: bool) -> Callable[[str, str], Outcome]:
    """MultiHeadAttention.backward against autograd through TorchMultiHeadAttention with the same weights:
    dx, dw_qkv (the transpose of torch's qkv.weight.grad) and dw_out (of out.weight.grad)."""

    def run(device: str, dtype: str) -> Outcome:
        B, T, d_model, n_heads = 2, 10, 48, 6
        mha = ta.MultiHeadAttention(
            d_model, n_heads, n_kv_heads, rope=rope, rng=np.random.default_rng(n_kv_heads), dtype=NUMPY_DTYPES[dtype]
        )
        (x, dout), (tx, tdout) = make_inputs(
            f"mha grad {n_kv_heads} {fused} {rope}", [(B, T, d_model)] * 2, dtype, device
        )
        module = TorchMultiHeadAttention.from_numpy(mha, TORCH_DTYPES[dtype], device)
        tx = tx.clone().requires_grad_()
        module(tx, causal=True).backward(tdout)
        _, saved = mha.forward(x, causal=True, fused=fused)
        dx, dw_qkv, dw_out = mha.backward(dout, saved)
        golds = [tx.grad, module.qkv.weight.grad.T, module.out.weight.grad.T]
        return grad_outcome([dx, dw_qkv, dw_out], golds, dtype)

    return run


GRAD_CASES: list[Case] = [
    Case("grad: attention_backward, no mask, L=5 S=9", attention_grad_case(4, 4, 5, 9, None, False), FULL),
    Case(
        "grad: attention_backward, top-left causal (is_causal), L=5 S=9",
        attention_grad_case(4, 4, 5, 9, "top_left", False),
        FULL,
    ),
    Case(
        "grad: attention_backward, bottom-right causal (causal_lower_right), GQA 6/2, L=6 S=11",
        attention_grad_case(6, 2, 6, 11, "bottom_right", False),
        FULL,
    ),
    Case(
        "grad: flash_attention_backward, bottom-right causal, L=7 S=13, blocks 4 x 5",
        attention_grad_case(4, 4, 7, 13, "bottom_right", True, block_q=4, block_k=5),
        FULL,
    ),
    Case(
        "grad: flash_attention_backward, GQA 6/2 (enable_gqa), no mask, L=9 S=11, blocks 3 x 4",
        attention_grad_case(6, 2, 9, 11, None, True, block_q=3, block_k=4),
        FULL,
    ),
    Case(
        "grad: flash_attention_backward, MQA 4/1, causal L=S=12, blocks 5 x 5",
        attention_grad_case(4, 1, 12, 12, "bottom_right", True, block_q=5, block_k=5),
        FULL,
    ),
    Case(
        "grad: MultiHeadAttention.backward (flash), GQA 6/2, RoPE vs torch module",
        multihead_grad_case(2, True, True),
        FULL,
    ),
    Case(
        "grad: MultiHeadAttention.backward (reference), 6 heads vs torch module",
        multihead_grad_case(6, False, False),
        FULL,
    ),
]
