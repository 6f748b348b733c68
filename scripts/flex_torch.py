"""torch's side of flex.py (--torch): the same patterns written in torch ops, torch's flex_attention compiled
once and called on each, and torch SDPA with each pattern's dense mask; their peaks measured as the growth of
the resident set (VmHWM), which tracemalloc, seeing NumPy's arrays only, cannot see.
"""

from __future__ import annotations

import argparse
import ctypes
import time
import warnings
from typing import Any

import machine
import numpy as np
import torch_import

import tinyattn_np as ta
from tinyattn_np.measure import median_ms


def torch_patterns(args: argparse.Namespace, torch: Any) -> dict[str, tuple[Any, Any]]:
    """The same patterns written in torch ops, for torch's flex_attention (and its create_mask for SDPA)."""
    T, window = args.tokens, args.window
    n = T // args.documents  # tokens per document
    slopes = torch.from_numpy(ta.alibi_slopes(args.heads).astype(np.float32))

    causal = lambda b, h, q, kv: kv <= q  # noqa: E731
    return {
        "causal": (causal, None),
        f"{args.documents} documents": (lambda b, h, q, kv: (q // n == kv // n) & (kv <= q), None),
        "prefix-LM": (lambda b, h, q, kv: (kv < T // 4) | (kv <= q), None),
        f"window {window}": (lambda b, h, q, kv: (kv <= q) & (q - kv < window), None),
        "alibi": (causal, lambda s, b, h, q, kv: s - slopes[h] * (q - kv)),
        "softcap": (causal, lambda s, b, h, q, kv: 50.0 * torch.tanh(s / 50.0)),
    }


def torch_setup(args: argparse.Namespace, qkv: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """torch on the same threads, the same q, k, v as tensors (no copy), its flex_attention compiled once."""
    torch, F = torch_import.load_torch(args.workers, flag="the torch columns (--torch)")
    from torch.nn.attention import flex_attention as flex

    return {
        "torch": torch,
        "sdpa": F.scaled_dot_product_attention,
        "flex": flex,
        "patterns": torch_patterns(args, torch),
        "qkv": tuple(torch.from_numpy(x) for x in qkv),
        "compiled": torch.compile(flex.flex_attention),
    }


def torch_flex_call(name: str, args: argparse.Namespace, side: dict[str, Any]) -> Any:
    """A call of torch's compiled flex_attention on pattern `name`, with its block mask (tiles of 128)."""
    mask_mod, score_mod = side["patterns"][name]
    block_mask = side["flex"].create_block_mask(
        mask_mod, None, None, args.tokens, args.tokens, device="cpu", BLOCK_SIZE=128
    )

    def call() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return side["compiled"](*side["qkv"], score_mod, block_mask)

    return call


def torch_row(row: dict[str, Any], args: argparse.Namespace, side: dict[str, Any]) -> None:
    """torch SDPA with the dense mask (ALiBi: the dense bias; softcap has no dense form), and the peak of
    torch's compiled flex_attention, for one pattern."""
    mask_mod, score_mod = side["patterns"][row["pattern"]]
    if score_mod is None or row["pattern"] == "alibi":
        allowed = side["flex"].create_mask(mask_mod, 1, 1, args.tokens, args.tokens, device="cpu")  # (1, 1, T, T)
        sdpa_row(row, args, side, allowed, score_mod)
    row["torch flex peak"] = rss_peak_growth(torch_flex_call(row["pattern"], args, side))


def sdpa_row(row: dict[str, Any], args: argparse.Namespace, side: dict[str, Any], allowed: Any, bias_mod: Any) -> None:
    """torch SDPA with allowed (1, 1, T, T) bool as its attn_mask,
    or the bias of bias_mod, -inf where hidden."""
    torch, T, attn_mask = side["torch"], args.tokens, allowed
    if bias_mod is not None:  # a float mask (1, H, T, T): the score_mod applied to zero scores
        h = torch.arange(args.heads)[None, :, None, None]
        bias = bias_mod(torch.zeros(1, args.heads, T, T), 0, h, torch.arange(T)[:, None], torch.arange(T))
        attn_mask = bias.masked_fill(~allowed, float("-inf"))
    sdpa = lambda: side["sdpa"](*side["qkv"], attn_mask=attn_mask)  # noqa: E731
    time.sleep(machine.SETTLE_SECONDS)  # after our reference: let BLAS's spinning threads go to sleep first
    row["sdpa s"], row["sdpa peak"] = median_ms(sdpa, 1) / 1e3, rss_peak_growth(sdpa)


def rss_peak_growth(call: Any) -> int:
    """Bytes by which the resident set's high-water mark rose during call() (Linux), after malloc_trim."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = status_kib("VmRSS")
    call()
    return max(0, status_kib("VmHWM") - before) * 1024


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
