"""Blockwise attention with an online softmax ("flash attention"): the same result as attention(),
without ever building the L x S score matrix.

For one block of queries, walk over the key blocks and keep three running quantities per query row:
    m    the largest score seen so far
    l    sum over the keys seen so far of exp(score - m)
    acc  sum over the keys seen so far of exp(score - m) · v      (not yet divided by l)
A new tile of scores s raises the maximum to m' = max(m, max s); everything accumulated so far was
measured against m, so it is rescaled by exp(m - m') before the tile is added:
    l'   = l · exp(m - m') + Σ exp(s - m')
    acc' = acc · exp(m - m') + exp(s - m') @ v_tile
After the last tile, out = acc / l and logsumexp = m + log l. (Milakov & Gimelshein 2018; Dao 2023,
"FlashAttention-2", Algorithm 1.) merge_states() in softmax.py is the same algebra for two finished parts.

Which tiles run is the block mask's to say (blockmask.py): the causal Band by arithmetic, or a BlockMask
made from any mask_mod. The one loop walks the tiles that run, applies a score_mod to every tile and the
mask_mod only to the partial ones (flex.py: FlexAttention).

Read it in this order:
    flash_attention_one_head           Algorithm 1 for one head on one thread, as the paper prints it:
                                       m = -inf, l = 0, a line per equation (docs/online_softmax.md)
    flash_attention                    the same algorithm, fast: its inputs checked, then the tile kernel
                                       (_flash_kernel.py), where several heads share each tile step, worker
                                       threads take whole (heads, query block) items, and the sums are
                                       measured against 0 rather than the running max, with the running max
                                       where exp(s) cannot hold them; the tile sizes and workers come from
                                       the tile rule (_tuning.py) unless the call gives them

Memory: out, lse, and per worker one step's tile of scores (at most the step budget) plus per-row vectors:
O((L + S)·E + workers·budget), never L x S (docs/flash.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import QKVShape, check_bool, check_one_head, check_qkv, check_scale, compute_dtype, without_head_axis
from ._flash_kernel import FlashPlan, TileSizes, broadcast_kv, flash_forward, flash_plan
from ._guard import refuse_blockwise
from .blockmask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, check_band

__all__ = ["check_flash", "flash_attention", "flash_attention_one_head"]

Array = NDArray[np.floating]


def flash_attention_one_head(
    q: Array,  # (L, E)
    k: Array,  # (S, E)
    v: Array,  # (S, Ev)
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[Array, Array]:  # out (L, Ev), lse (L,)
    """FlashAttention-2's forward (Dao 2023, Algorithm 1) for one head, as the paper prints it: query blocks
    Q_i of B_r = block_q rows, key blocks K_j, V_j of B_c = block_k rows, a running max m_i, sum ℓ_i and
    output O_i per row, never more than a B_r x B_c tile of scores. A comment's first number is the line of
    the paper's algorithm, whose names the code keeps (m_i' is the paper's m_i^(j), m_i its m_i^(j-1)).

    q (L, E), k (S, E), v (S, Ev) -> out = softmax(scale · q kᵀ) v (L, Ev) and lse (L,), the logsumexp of
    each row's scaled scores, in the compute dtype (float32 for float16 inputs). causal=True is bottom-right:
    query i sees key j <= i + S - L; key blocks wholly past the diagonal are skipped (the paper's section 3.1.1).
    A row that sees no key gets out 0 and lse -inf. flash_attention is the same algorithm with many heads per
    step, worker threads and windows; the tests hold the two equal. Derived on docs/online_softmax.md.

    >>> out, lse = flash_attention_one_head(np.eye(2), np.eye(2), np.eye(2), causal=True, block_k=1)
    >>> out.round(2)  # query 0 sees key 0; query 1 sees both, its own a little more
    array([[1.  , 0.  ],
           [0.33, 0.67]])
    """
    q, k, v, scale = check_one_head(q, k, v, causal, scale, block_q, block_k)
    n_q, n_k, offset = len(q), len(k), len(k) - len(q)  # L queries, S keys; query i sees key j <= i + offset
    out, lse = np.zeros((n_q, v.shape[1]), v.dtype), np.zeros(n_q, v.dtype)  # O (L, Ev) and the paper's L (L,)
    for q_start in range(0, n_q, block_q):  # 3: for each query block i
        rows = np.arange(q_start, min(q_start + block_q, n_q))  # (Br,) the rows of Q_i
        q_i = q[rows] * scale  # (Br, E) 4: Q_i, the scale folded in once
        o_i = np.zeros((len(rows), v.shape[1]), v.dtype)  # (Br, Ev) 5: O_i = 0
        l_i = np.zeros(len(rows), v.dtype)  # (Br,) 5: ℓ_i = 0
        m_i = np.full(len(rows), -np.inf, v.dtype)  # (Br,) 5: m_i = -∞
        n_seen = min(n_k, rows[-1] + 1 + offset) if causal else n_k  # causal: no key block past the last row's
        for k_start in range(0, n_seen, block_k):  # 6: for each key block j
            cols = np.arange(k_start, min(k_start + block_k, n_k))  # (Bc,) the rows of K_j and V_j
            s = q_i @ k[cols].T  # (Br, Bc) 8: S_ij = Q_i K_jᵀ
            if causal:  # in a tile the diagonal crosses: exp(-inf) = 0 gives a hidden key no weight
                s[cols > rows[:, None] + offset] = -np.inf
            m_new = np.maximum(m_i, s.max(axis=1))  # (Br,) 9: m_i' = max(m_i, rowmax(S_ij))
            m_sub = np.where(m_new == -np.inf, 0, m_new)  # (Br,) a row with no key yet: -inf - 0, not -inf + inf
            p = np.exp(s - m_sub[:, None])  # (Br, Bc) 9: P̃_ij = exp(S_ij - m_i')
            alpha = np.exp(m_i - m_sub)  # (Br,) exp(m_i - m_i'): rescales what was summed against the old max
            l_i = alpha * l_i + p.sum(axis=1)  # (Br,) 9: ℓ_i' = exp(m_i - m_i') ℓ_i + rowsum(P̃_ij)
            o_i = alpha[:, None] * o_i + p @ v[cols]  # (Br, Ev) 10: O_i' = diag(exp(m_i - m_i')) O_i + P̃_ij V_j
            m_i = m_new
        l_i[l_i == 0] = 1  # a row that saw no key: O_i = 0 / 1 = 0 and L_i = -inf + log 1 = -inf
        out[rows] = o_i / l_i[:, None]  # (Br, Ev) 12: O_i = diag(ℓ_i)⁻¹ O_i
        lse[rows] = m_i + np.log(l_i)  # (Br,) 13: L_i = m_i + log(ℓ_i)
    return out, lse


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    workers: int | None = None,
    window: int | None = None,
    kv_heads_per_step: int | None = None,
    align: str = "bottom_right",
) -> Array | tuple[Array, Array]:
    """attention(q, k, v, causal=causal, scale=scale), blockwise, never building L x S.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L), the logsumexp of each row's (scaled, masked) scores, in the
    compute dtype: float32 for float16 inputs (float16 overflows past 65504; torch and flash-attn also
    return a float32 lse for half inputs), else the inputs' float32 or float64.
    causal=True is bottom-right aligned (query i sees key j <= i + S - L), like attention();
    align="top_left" moves the diagonal to j <= i, torch's is_causal (the same when L == S).
    The band is a mask_mod on flex attention's one path (mods.causal_band): flex_attention with
    create_block_mask(causal_mod(L, S)) of the same tile size runs the same tiles and gives the same bits.
    window (needs causal=True): query i sees only the last `window` keys, itself included:
    i + S - L - window < j <= i + S - L (with L = S, Hugging Face's Mistral mask). FlashAttention's
    window_size=(w, 0) is window = w + 1. Tiles wholly outside the band are skipped: time ∝ L·window.
    k and v whose batch dims are all 1 against a larger query batch (torch's SDPA broadcasts them so) are
    read by every batch entry where they lie, never copied per entry.
    block_q, block_k: tile sizes (any positive ints; they need not divide L or S).
    kv_heads_per_step: kv heads (each with its Hq / Hkv query heads) that share one batched matmul
    per tile step. The defaults (the tile rule, _tuning.default_tiles): square tiles of 256 (512 on more than
    8 cores; halved, but not below 64, for a causal band without a window over a short context, L = S under
    1,024, so that the diagonal's half-hidden tiles are at most a quarter of the work: _tuning.diagonal_side),
    and in each step the query heads of as many kv heads as fit in 2^18 scores (2^19 on more than 8 cores),
    or what tinyattn_np.tune() measured on this machine (docs/flash.md, "Tiles chosen by measuring").
    workers: threads, each taking whole (heads, query block) items (default: one per core, or tune()'s, at
    most one per 2^18 scores: _tuning.call_workers); the result is the same bits for any number of workers.
    While it runs, BLAS is held to one thread for the whole process (threadpoolctl; overlapping calls share
    the limit, the last one out restores it), so a matmul in another thread of yours runs single-threaded
    meanwhile. Ctrl-C stops it between two tiles.

    >>> q = k = v = np.eye(2)
    >>> flash_attention(q, k, v, causal=True)[0]
    array([1., 0.])
    """
    return_lse, two_d = check_bool(return_lse, "return_lse"), without_head_axis(q)
    q, k, v, dims, plan = check_flash(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        window=window,
        block_q=block_q,
        block_k=block_k,
        kv_heads_per_step=kv_heads_per_step,
        workers=workers,
        align=align,
    )
    refuse_blockwise("flash_attention()", q, k, v, dims, plan, heads_per_step=plan.kv_heads_per_step)
    out, lse = flash_forward(q, k, v, dims, plan)  # the tile kernel: _flash_kernel.py
    if two_d:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def check_flash(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: Any,
    scale: Any,
    window: Any,
    block_q: Any,
    block_k: Any,
    kv_heads_per_step: Any,
    workers: Any,
    align: Any = "bottom_right",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, FlashPlan]:
    """flash_attention's inputs checked, once, and its plan: the defaults filled in
    (_flash_kernel.flash_plan). k and v of batch 1 against a larger query batch come back as broadcast views
    (_flash_kernel.broadcast_kv)."""
    k, v = broadcast_kv(q, k, v)
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e, compute_dtype(q, k, v))
    band = check_band(causal, window, dims.n_q, dims.n_k, align)
    sizes = TileSizes(block_q, block_k, kv_heads_per_step, workers).checked()
    return q, k, v, dims, flash_plan(dims, band, scale, sizes)
