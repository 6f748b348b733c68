"""FlexAttention in NumPy: any attention pattern as a score_mod and a block mask, on flash's one tile loop.

    out = softmax(where(mask_mod, score_mod(Q Kᵀ · scale), -inf)) V        (torch.nn.attention.flex_attention)

A mask_mod says which keys a query may see, a score_mod rewrites a score (mods.py has both, and the
ready-made ones). create_block_mask (blockmask.py) turns a mask_mod into a BlockMask, the kind of every
tile: the kernel (_flash_kernel.attend_block) then walks only the tiles that are not empty, applies
score_mod to every tile and the mask_mod only to the partial ones. That is the whole of it: flash_attention's
causal band and window are the same loop with a Band in place of the BlockMask.

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

from ._checks import (
    QKVShape,
    check_bool,
    check_cu_seqlens,
    check_qkv,
    check_scale,
    check_sinks,
    check_window,
    compute_dtype,
    without_head_axis,
)
from ._flash_kernel import FlashPlan, TileSizes, broadcast_kv, flash_forward, flash_plan
from ._guard import refuse_blockwise
from ._mod_calls import check_score_mod
from ._tiles import EMPTY, FULL, PARTIAL
from .blockmask import CODE, DEFAULT_BLOCK_Q, Band, BlockMask, check_block_mask, check_block_size
from .mods import varlen_mod

__all__ = ["check_flex", "flash_attention_varlen", "flex_attention", "varlen_block_mask"]

Array = NDArray[np.floating]


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
    h // (Hq / Hkv)), as in torch; without it Hq must equal Hkv. key and value of batch 1 serve every batch
    entry of the query, as in torch (key (1, Hkv, S, E) with query (B, Hq, L, E)). kernel_options: torch's
    GPU kernel knobs, none here (must be None). A row that sees no key gives out 0 and lse -inf, as torch.
    sinks (Hq,): a logit per head that joins every row's softmax and is then dropped (gpt-oss; FA4's
    learnable_sink): out = Σ_j exp(s_j - lse) v_j with lse = log(exp(sink_h) + Σ_j exp(s_j)), so a row can
    give weight to nothing (a row that sees no key gets out 0 and lse = sink_h). workers: threads, as in
    flash_attention (the same bits for any number); kv_heads_per_step too.

    >>> from tinyattn_np import causal_mod, create_block_mask
    >>> q = k = v = np.eye(2)[None]
    >>> flex_attention(q, k, v, block_mask=create_block_mask(causal_mod(2, 2), None, None, 2, 2))[0, 0]
    array([1., 0.])
    """
    return_lse = check_bool(return_lse, "return_lse")
    two_d = without_head_axis(query)
    q, k, v, dims, plan = check_flex(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        sinks=sinks,
        workers=workers,
        kernel_options=kernel_options,
        kv_heads_per_step=kv_heads_per_step,
    )
    refuse_blockwise("flex_attention()", q, k, v, dims, plan, heads_per_step=plan.kv_heads_per_step)
    out, lse = flash_forward(q, k, v, dims, plan)
    if two_d:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def check_flex(
    query: Any,
    key: Any,
    value: Any,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: Any,
    enable_gqa: Any,
    sinks: Any,
    workers: Any,
    kernel_options: Any = None,
    kv_heads_per_step: Any = None,
    backward: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, FlashPlan]:
    """flex_attention's inputs checked, once, and its plan: the block mask's tiles (every tile full without
    one), the score_mod (for the backward one that gives its derivative), the sinks in the compute dtype."""
    if kernel_options is not None:
        raise ValueError(
            "kernel_options are torch's GPU kernel settings; here the tiles are the block mask's BLOCK_SIZE and "
            f"the threads workers=: pass kernel_options=None; got {kernel_options!r}"
        )
    key, value = broadcast_kv(query, key, value)
    q, k, v, dims = check_qkv(query, key, value, gqa_allowed=check_bool(enable_gqa, "enable_gqa"))
    ct = compute_dtype(q, k, v)
    mask = Band(None) if block_mask is None else check_block_mask(block_mask, dims)
    sizes = TileSizes(kv_heads_per_step=kv_heads_per_step, workers=workers).checked()
    scale, score_mod = check_scale(scale, dims.e, ct), check_score_mod(score_mod, backward)
    plan = flash_plan(dims, mask, scale, sizes, score_mod=score_mod, sinks=check_sinks(sinks, dims.hq, ct))
    return q, k, v, dims, plan


def varlen_block_mask(
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    causal: bool = False,
    window: int | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_Q,
) -> BlockMask:
    """The block mask of packed sequences: mods.varlen_mod (each sequence sees only its own keys; causal
    bottom-right within each), over all cu_seqlens_q[-1] queries and cu_seqlens_k[-1] keys. Its tiles
    follow from the boundaries alone (document_kinds, by arithmetic): the mask_mod is called only inside
    the partial tiles, as the kernels run them."""
    causal = check_bool(causal, "causal")
    mask_mod = varlen_mod(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q"), check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    width = None if window is None else check_window(window, total_q, total_k)
    block_q, block_k = check_block_size(BLOCK_SIZE)
    kinds = document_kinds(cu_q, cu_k, causal, width, block_q, block_k)  # (n_q blocks, n_k blocks)
    return BlockMask(kinds[None, None], (total_q, total_k), (block_q, block_k), mask_mod)


def document_tiles(cu_q: np.ndarray, cu_k: np.ndarray, block_q: int, block_k: int) -> tuple[np.ndarray, ...]:
    """(document, query block, key block) of every tile that holds some of a document's queries and some of
    its keys, one entry per pair (a tile two documents share appears twice), as three (P,) int arrays."""
    q0, q1, k0, k1 = cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]  # (n,) each document's queries and keys
    n_qb = np.where(q1 > q0, -(-q1 // block_q) - q0 // block_q, 0)  # (n,) query blocks each document meets
    n_kb = np.where(k1 > k0, -(-k1 // block_k) - k0 // block_k, 0)  # (n,) key blocks
    pairs = n_qb * n_kb  # (n,) tiles per document (0 without queries or keys)
    document = np.repeat(np.arange(pairs.size), pairs)  # (P,)
    within = np.arange(document.size) - np.repeat(np.cumsum(pairs) - pairs, pairs)  # (P,) 0, 1, ... per document
    q_block = q0[document] // block_q + within // n_kb[document]  # (P,) row by row within the document
    k_block = k0[document] // block_k + within % n_kb[document]  # (P,)
    return document, q_block, k_block


def document_kinds(
    cu_q: np.ndarray, cu_k: np.ndarray, causal: bool, window: int | None, block_q: int, block_k: int
) -> np.ndarray:
    """The kind of every tile of packed documents (n_q blocks, n_k blocks) int8, from the boundaries alone.

    A tile is full when it lies inside one document and each of its queries sees each of its keys, empty
    when no document has a query in it that sees a key in it, else partial. Within document d (queries
    q0 .. q1, keys k0 .. k1) query i sees key j when j <= i + offset and j > i + offset - window, counted
    from the document's start, with offset = (k1 - k0) - (q1 - q0) (bottom-right); without causal, all of
    its keys. The rows r0 .. r1 - 1 of a tile together see the keys r0 + offset - window + 1 .. r1 - 1 + offset.
    """
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    document, q_block, k_block = document_tiles(cu_q, cu_k, block_q, block_k)  # (P,) each
    q0, k0 = cu_q[document], cu_k[document]  # (P,) the document's first query and key
    # 1) the tile's rows [r0, r1) and columns [c0, c1) inside the document, counted from its start
    r0, r1 = np.maximum(q_block * block_q, q0) - q0, np.minimum((q_block + 1) * block_q, cu_q[document + 1]) - q0
    c0, c1 = np.maximum(k_block * block_k, k0) - k0, np.minimum((k_block + 1) * block_k, cu_k[document + 1]) - k0
    # 2) the whole tile inside the document
    whole = (r0 == q_block * block_q - q0) & (r1 == np.minimum((q_block + 1) * block_q, total_q) - q0)
    whole &= (c0 == k_block * block_k - k0) & (c1 == np.minimum((k_block + 1) * block_k, total_k) - k0)
    # 3) the band: the keys the tile's rows see meet its columns (seen), and hold them all (all_seen)
    seen, all_seen = np.ones(document.size, bool), np.ones(document.size, bool)
    if causal:
        offset = (cu_k[document + 1] - k0) - (cu_q[document + 1] - q0)  # (P,) bottom-right within the document
        seen &= c0 <= r1 - 1 + offset  # the last row's diagonal reaches the first column
        all_seen &= c1 - 1 <= r0 + offset  # the first row's diagonal reaches the last column
        if window is not None:
            seen &= c1 - 1 > r0 + offset - window  # the first row's window reaches the last column
            all_seen &= c0 > r1 - 1 + offset - window  # the last row's window reaches the first column
    kinds = np.zeros((-(-total_q // block_q), -(-total_k // block_k)), np.int8)
    kind = np.where(whole & all_seen, CODE[FULL], np.where(seen, CODE[PARTIAL], CODE[EMPTY])).astype(np.int8)
    np.maximum.at(kinds, (q_block, k_block), kind)  # a tile two documents share: partial if either sees in it
    return kinds


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
    for name, x, cu_seqlens in (("q", q, cu_seqlens_q), ("k", k, cu_seqlens_k)):  # first: the mask costs time
        total = int(check_cu_seqlens(cu_seqlens, f"cu_seqlens_{name}")[-1])
        if np.ndim(x) != 3 or np.shape(x)[1] != total:
            raise ValueError(
                f"{name} must be packed heads (H, {total}, E): cu_seqlens_{name} ends at {total}; "
                f"got shape {np.shape(x)}"
            )
    mask = varlen_block_mask(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window, BLOCK_SIZE=block_size)
    return flex_attention(q, k, v, score_mod, mask, scale, enable_gqa=True, return_lse=return_lse, workers=workers)
