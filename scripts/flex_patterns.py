"""The attention patterns flex.py times, each a mask_mod and a score_mod of tinyattn_np's ready-made mods (torch's
the same in torch ops: flex_torch.py), and the checks made before anything is timed: every pattern through
flex_attention equals the reference, and with --baseline DIR, the causal band and the window as mask_mods give
the bits of the flash_attention of another version of tinyattn_np (DIR/tinyattn_np), forward and backward.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

import tinyattn_np as ta
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q


def patterns(args: argparse.Namespace) -> dict[str, tuple[Any, Any]]:
    """name -> (mask_mod, score_mod) with tinyattn_np's ready-made mods."""
    T, causal = args.tokens, ta.causal_mod(args.tokens)
    documents = ta.and_masks(ta.document_mod(np.repeat(np.arange(args.documents), T // args.documents)), causal)
    return {
        "causal": (causal, None),
        f"{args.documents} documents": (documents, None),
        "prefix-LM": (ta.prefix_lm_mod(T // 4), None),
        f"window {args.window}": (ta.sliding_window_mod(args.window, T), None),
        "alibi": (causal, ta.Alibi(ta.alibi_slopes(args.heads), T)),
        "softcap": (causal, ta.Softcap(50.0)),
    }


def check_agreement(args: argparse.Namespace, baseline: Any) -> str:
    """Every pattern through flex_attention against the reference on the first 512 tokens' worth of the same
    patterns, and with --baseline, the causal one against the baseline's flash bit for bit; exit 1 if not."""
    step = math.lcm(16, args.documents)  # T must split into the documents and into 16 map cells
    small = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, max(step, 512 // step * step))})
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((1, args.heads, small.tokens, args.head_dim), dtype=np.float32) for _ in range(3))
    worst = 0.0
    for name, (mask_mod, score_mod) in patterns(small).items():
        block_mask = ta.create_block_mask(mask_mod, None, None, small.tokens, small.tokens)
        mine = ta.flex_attention(q, k, v, score_mod, block_mask, workers=args.workers)
        worst = max(worst, float(np.max(np.abs(mine - ta.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)))))
        if not worst <= 1e-5:
            sys.exit(f"error: flex_attention and the reference disagree on {name}: max |diff| = {worst:.3g}")
    text = f"check: flex_attention equals the reference on every pattern at T = {small.tokens} (max |diff| {worst:.1e})"
    if baseline is not None:
        text += "; " + check_baseline(q, k, v, baseline, args.workers)
    return text


def check_baseline(q: np.ndarray, k: np.ndarray, v: np.ndarray, baseline: Any, workers: int | None) -> str:
    """The causal band and the window as mask_mods give the baseline's bits: flex_attention with their block
    masks against the baseline's flash_attention and flash_attention_backward, all on the block masks' tiles."""
    T, dout = q.shape[-2], np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)
    tiles = {"block_q": DEFAULT_BLOCK_Q, "block_k": DEFAULT_BLOCK_Q}
    for band, mod in [({}, ta.causal_mod(T)), ({"window": 100}, ta.sliding_window_mod(100, T))]:
        old = baseline.flash_attention(q, k, v, causal=True, return_lse=True, workers=workers, **band, **tiles)
        new = ta.flex_attention(q, k, v, block_mask=ta.create_block_mask(mod, None, None, T, T), return_lse=True)
        old_grads = baseline.flash_attention_backward(q, k, v, *old[:1], dout, old[1], causal=True, **band, **tiles)
        new_grads = ta.flash_attention_backward(q, k, v, *new[:1], dout, new[1], causal=True, **band, **tiles)
        if not all(np.array_equal(a, b) for a, b in zip((*old, *old_grads), (*new, *new_grads), strict=True)):
            sys.exit(f"error: causal {band or ''} is not the baseline's bit for bit (forward or backward)")
    return "causal and window as mask_mods give the baseline's bits, forward and backward"


def load_baseline(folder: str) -> Any:
    """The tinyattn_np package in folder, imported as another module (tinyattn_baseline)."""
    package = Path(folder) / "tinyattn_np"
    spec = importlib.util.spec_from_file_location(
        "tinyattn_baseline", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None  # a file that exists, checked in parse_args
    module = importlib.util.module_from_spec(spec)
    sys.modules["tinyattn_baseline"] = module
    spec.loader.exec_module(module)
    return module
