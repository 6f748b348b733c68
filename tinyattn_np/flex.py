"""FlexAttention in NumPy: any attention pattern as a score_mod and a block mask, on flash's one tile loop.

    out = softmax(where(mask_mod, score_mod(Q Kᵀ · scale), -inf)) V        (torch.nn.attention.flex_attention)

A mask_mod says which keys a query may see, a score_mod rewrites a score (mods.py has both, and the
ready-made ones). create_block_mask (blockmask.py) turns a mask_mod into a BlockMask, the kind of every
tile: the kernel (flash.attend_block) then walks only the tiles that are not empty, applies score_mod to
every tile and the mask_mod only to the partial ones. That is the whole of it: flash_attention's causal
band and window are the same loop with a Band in place of the BlockMask.

    flex_attention            torch's flex_attention, argument for argument, plus sinks= (gpt-oss)
    flash_attention_varlen    packed sequences of different lengths, no padding (FlashAttention's varlen API)
    varlen_block_mask         its block mask, for flex_attention_backward (backward.py)

The block mask is made once and read by every layer and head that shares it; making it costs O(L·S)
comparisons (the mask_mod on every tile) but never holds more than one tile of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import QKVShape, check_bool, check_positive_int, check_qkv, check_scale, compute_dtype, without_head_axis
from .blockmask import DEFAULT_BLOCK_Q, Band, BlockMask, create_block_mask
from .flash import FlashPlan, check_block_mask, flash_forward, flash_plan
from .mods import check_score_mod, check_sinks, varlen_mod

Array = NDArray[np.floating]


def check_flex(
    query: Any, key: Any, value: Any, *, score_mod: Any, block_mask: Any, scale: Any, enable_gqa: Any, sinks: Any,
    workers: Any, kernel_options: Any = None, kv_heads_per_step: Any = None, backward: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, FlashPlan]:  # fmt: skip
    """flex_attention's inputs checked, once, and its plan: the block mask's tiles (every tile full without
    one), the score_mod (for the backward one that gives its derivative), the sinks in the compute dtype."""
    if kernel_options is not None:
        raise ValueError(
            "kernel_options are torch's GPU kernel settings; here the tiles are the block mask's BLOCK_SIZE and "
            f"the threads workers=: pass kernel_options=None; got {kernel_options!r}"
        )
    q, k, v, dims = check_qkv(query, key, value, gqa_allowed=check_bool(enable_gqa, "enable_gqa"))
    ct = compute_dtype(q, k, v)
    mask = Band(None) if block_mask is None else check_block_mask(block_mask, dims)
    sizes = {"kv_heads_per_step": kv_heads_per_step, "workers": workers}
    sizes = {name: None if value is None else check_positive_int(value, name) for name, value in sizes.items()}
    plan = flash_plan(dims, mask, check_scale(scale, dims.e, ct), score_mod=check_score_mod(score_mod, backward),
                      sinks=check_sinks(sinks, dims.hq, ct), **sizes)  # fmt: skip
    return q, k, v, dims, plan


def flex_attention(
    query: Array,
    key: Array,
    value: Array,
    score_mod: Any = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    sinks: Any = None,
    workers: int | None = None,
    kv_heads_per_step: int | None = None,
) -> Array | tuple[Array, Array]:
    """torch.nn.attention.flex_attention.flex_attention, in NumPy, blockwise (never L x S):

        out = softmax(where(mask_mod, score_mod(query keyᵀ · scale), -inf)) value

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L), the natural log of each row's softmax denominator, in the compute
    dtype. score_mod(score, b, h, q_idx, kv_idx): called on every tile that runs, b the batch entry (flat
    over the leading dims), h the query head. block_mask: create_block_mask(mask_mod, B, H, L, S); None
    means every key. scale: default 1/√E. enable_gqa: Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv)), as in torch; without it Hq must equal Hkv. kernel_options: torch's GPU kernel knobs,
    none here (must be None). A row that sees no key gives out 0 and lse -inf, as torch.
    sinks (Hq,): a logit per head that joins every row's softmax and is then dropped (gpt-oss; FA4's
    learnable_sink): out = Σ_j exp(s_j - lse) v_j with lse = log(exp(sink_h) + Σ_j exp(s_j)), so a row can
    give weight to nothing (a row that sees no key gets out 0 and lse = sink_h). workers: threads, as in
    flash_attention (the same bits for any number); kv_heads_per_step too.

    >>> from tinyattn_np.mods import causal_mod
    >>> q = k = v = np.eye(2)[None]
    >>> flex_attention(q, k, v, block_mask=create_block_mask(causal_mod(2, 2), None, None, 2, 2))[0, 0]
    array([1., 0.])
    """
    return_lse = check_bool(return_lse, "return_lse")
    two_d = without_head_axis(query)
    q, k, v, dims, plan = check_flex(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        sinks=sinks, workers=workers, kernel_options=kernel_options, kv_heads_per_step=kv_heads_per_step,
    )  # fmt: skip
    out, lse = flash_forward(q, k, v, dims, plan)
    if two_d:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def varlen_block_mask(
    cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False, window: int | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_Q,
) -> BlockMask:  # fmt: skip
    """The block mask of packed sequences: mods.varlen_mod (each sequence sees only its own keys; causal
    bottom-right within each), over all cu_seqlens_q[-1] queries and cu_seqlens_k[-1] keys."""
    mask_mod = varlen_mod(cu_seqlens_q, cu_seqlens_k, causal=check_bool(causal, "causal"), window=window)
    total_q, total_k = int(np.asarray(cu_seqlens_q)[-1]), int(np.asarray(cu_seqlens_k)[-1])
    return create_block_mask(mask_mod, None, None, total_q, total_k, BLOCK_SIZE=BLOCK_SIZE)


def flash_attention_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    score_mod: Any = None,
    return_lse: bool = False,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_Q,
    workers: int | None = None,
) -> Array | tuple[Array, Array]:
    """Packed sequences of different lengths in one array, without padding (FlashAttention's
    flash_attn_varlen_func): sequence d holds queries cu_seqlens_q[d]:cu_seqlens_q[d + 1] and keys
    cu_seqlens_k[d]:cu_seqlens_k[d + 1], and attends only to its own keys.

    q (Hq, total_q, E), k (Hkv, total_k, E), v (Hkv, total_k, Ev) -> out (Hq, total_q, Ev) (and lse
    (Hq, total_q)): heads first, as everywhere here (FlashAttention's own layout is (total, H, E): pass
    q.swapaxes(0, 1)). cu_seqlens_*: (n + 1,) ints, 0 first and the total last. causal: bottom-right
    within each sequence (query i of L_d sees key j <= i + S_d - L_d), as FlashAttention 2.1+; window
    as in flash_attention; score_mod as in flex_attention, with q_idx and kv_idx the packed positions.
    Grouped-query heads as everywhere. It is flex_attention on varlen_block_mask: only the tiles inside
    a sequence run, so the time is that of the sequences run one by one.

    >>> q = k = np.zeros((1, 3, 2))  # equal scores: each query averages the values it sees
    >>> v = np.array([[[1.0], [2.0], [4.0]]])  # a sequence of 1 token, then one of 2
    >>> flash_attention_varlen(q, k, v, [0, 1, 3], [0, 1, 3], causal=True)[0, :, 0]
    array([1., 2., 3.])
    """
    mask = varlen_block_mask(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window, BLOCK_SIZE=block_size)
    for name, x, total in (("q", q, mask.seq_lengths[0]), ("k", k, mask.seq_lengths[1])):
        if np.ndim(x) != 3 or np.shape(x)[1] != total:
            raise ValueError(f"{name} must be packed heads (H, {total}, E): cu_seqlens_{name} ends at {total}; "
                             f"got shape {np.shape(x)}")  # fmt: skip
    return flex_attention(q, k, v, score_mod, mask, scale, enable_gqa=True, return_lse=return_lse, workers=workers)
