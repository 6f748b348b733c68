"""Sparse attention, DeepSeek's way (DSA): a cheap indexer chooses the keys, the attention reads only those.

Basics

DeepSeek-V3.2 (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp", section 2.1) puts an indexer in front of multi-head latent
attention (latent.py). For query t and each earlier token s it scores, with H_I small heads of d_I numbers:

    I[t, s] = Σ_h w[t, h] · ReLU(q_I[t, h] · k_I[s])          (B, T, S): one number a pair, cheap to make
    S_t     = the topk keys s <= t with the largest I[t, s]    (B, T, topk): every key when t has fewer
    o_t     = attention(q_t, k[S_t], v[S_t])                   the expensive attention reads topk keys, not t + 1

The indexer still reads every key, but a key costs it H_I d_I multiply-adds (64 · 128 in DeepSeek-V3.2) where
the attention's latent form costs 128 heads times 576 + 512; at 128k tokens of context the attention reads
2,048 keys of 128k, and the indexer's d_I = 128 numbers a token is the part of the cache a step reads in full.

The top-k is a running quantity, as the softmax is (softmax.merge_states): two top-k lists of disjoint keys
merge into the top-k of their union (merge_topk), and the merge is associative, so the keys can come in
blocks, in any grouping, and the T x S scores are never held: per block of queries, a running top-k over
blocks of keys (index_topk). A tie goes to the earlier key, so the choice is one set, whatever the blocks.
The attention over the chosen keys is flash.py's online softmax over the gathered keys, a block of the list
at a time (sparse_attention_one_head); its backward adds dk and dv back at the chosen keys
(sparse_attention_backward). The choice has no gradient: the indices are held fixed.

The layer built of these two, DeepSeek-V3.2's attention with its indexer's projections, the indexer's own loss
and the decoding through the caches, is dsa.py. A decode step over arrays, sparse_decode, scores every cached
indexer key, then reads the topk latents it chose.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, check_positive_int
from ._guard import refuse_unless_fits
from ._parallel import cpu_cores
from ._sparse_decode import check_decode_arrays
from ._sparse_kernel import (
    QUERY_BLOCK,
    attend_chosen,
    check_backward_inputs,
    check_index_inputs,
    check_sparse_inputs,
    chosen_backward,
    keys_between_merges,
    running_topk,
)

__all__ = [
    "index_scores",
    "index_topk",
    "index_topk_plain",
    "merge_topk",
    "sparse_attention",
    "sparse_attention_backward",
    "sparse_attention_one_head",
    "sparse_decode",
]

Array = NDArray[np.floating]


def index_topk_plain(q_index: Array, k_index: Array, weights: Array, topk: int, *, causal: bool = True) -> NDArray:
    """The indexer's choice, plainly: every score I[t, s] (index_scores), each row sorted, the best topk kept.

    q_index (B, H_I, T, d_I), k_index (B, S, d_I), weights (B, T, H_I) -> indices (B, T, topk) int64: each query's
    topk keys of the highest scores, and of two equal scores the earlier key (a stable sort keeps the order it was
    given), listed in key order; -1 after them where a query sees fewer than topk keys. causal: bottom-right,
    query t sees key s <= t + S - T. Builds the (B, T, S) scores: for small T; index_topk gives the same blockwise.
    """
    scores = index_scores(q_index, k_index, weights, causal=causal)  # (B, T, S), -inf where a key is hidden
    S = scores.shape[-1]
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :topk]  # (B, T, min(topk, S)): highest first
    best = np.where(np.take_along_axis(scores, best, axis=-1) == -np.inf, S, best)  # a hidden key: none (S, last)
    chosen = np.sort(best, axis=-1)  # in key order
    chosen = np.pad(chosen, [(0, 0), (0, 0), (0, topk - chosen.shape[-1])], constant_values=S)  # S < topk
    return np.where(chosen == S, -1, chosen)


def index_scores(q_index: Array, k_index: Array, weights: Array, *, causal: bool = True) -> Array:
    """I[b, t, s] = Σ_h w[b, t, h] ReLU(q_I[b, h, t] · k_I[b, s]) -> (B, T, S), -inf where causal hides s."""
    q_index, k_index, weights, _, causal = check_index_inputs(q_index, k_index, weights, 1, causal)
    (B, H, T, _), S = q_index.shape, k_index.shape[1]
    refuse_unless_fits(
        2 * B * H * T * S * q_index.dtype.itemsize,
        "index_scores",
        f"the dots of {H} heads, {T} x {S}",
        "use index_topk, which never holds them",
    )
    dots = q_index @ k_index[:, None].swapaxes(-1, -2)  # (B, H_I, T, S)
    scores = np.einsum("bth,bhts->bts", weights, np.maximum(dots, 0))  # (B, T, S): the heads weighted, summed
    if causal:
        scores[:, np.arange(S) > np.arange(T)[:, None] + S - T] = -np.inf  # bottom-right
    return scores


def merge_topk(scores_a: Array, keys_a: Array, scores_b: Array, keys_b: Array) -> tuple[Array, Array]:
    """Two top-k lists of disjoint keys -> the top-k of their union: (..., k) scores and keys each, in the order
    that makes the choice one set: the higher score first, of two equal scores the earlier key (an empty slot
    is score -inf, key -1, last). k: the first list's width.

    merge_states' cousin. merge_states combines two softmax states over disjoint keys into the state over the
    union; merge_topk combines two top-k states. Both are associative (merge(merge(a, b), c) = merge(a, merge(b,
    c))) and commutative, because the top-k of a union is the k best of its parts' k best, under one total
    order: (score descending, key ascending) orders any set the same way, whichever parts it came in.
    So the keys may come in blocks, in any grouping, over any number of workers.
    """
    k = scores_a.shape[-1]
    scores = np.concatenate([scores_a, scores_b], axis=-1)  # (..., k + k_b)
    keys = np.concatenate([keys_a, keys_b], axis=-1)
    order = np.lexsort((np.where(keys < 0, np.iinfo(np.int64).max, keys), -scores), axis=-1)[..., :k]  # score first
    return np.take_along_axis(scores, order, axis=-1), np.take_along_axis(keys, order, axis=-1)


def index_topk(
    q_index: Array,
    k_index: Array,
    weights: Array,
    topk: int,
    *,
    causal: bool = True,
    block_q: int = QUERY_BLOCK,
    block_k: int | None = None,
    workers: int | None = None,
) -> NDArray:
    """DeepSeek's indexer, blockwise: index_topk_plain's indices, (B, T, topk) int64, never the (B, T, S) scores.

    q_index (B, H_I, T, d_I), k_index (B, S, d_I), weights (B, T, H_I); the keys of the highest scores, a tie to
    the earlier key, in key order; -1 after them where a query sees fewer than topk keys (causal: bottom-right).
    For each block of block_q queries:
        kept = topk empty slots (score -inf, key -1)
        for each block of block_k keys, none past the block's last diagonal:
            scores = Σ_h w ReLU(q_I k_Iᵀ)               (block_q, block_k), -inf past each row's diagonal
            kept = the topk best of kept and scores      merge_topk's rule (found by a partition, not a sort)
        indices = the keys kept, in key order
    A block whose every query sees at most topk keys chooses them all, unscored. block_k: keys between two merges
    (default max(4 topk, 1024)); workers: threads (default a core each). The engine is _sparse_kernel.running_topk;
    tests/test_sparse.py holds it to index_topk_plain.

        >>> q, k, w = np.ones((1, 1, 3, 1)), np.array([[[1.0], [3.0], [2.0]]]), np.ones((1, 3, 1))
        >>> index_topk(q, k, w, 2)  # query 0 sees key 0; query 2 sees all three and keeps 1 (3.0) and 2 (2.0)
        array([[[ 0, -1],
                [ 0,  1],
                [ 1,  2]]])
    """
    inputs = check_index_inputs(q_index, k_index, weights, topk, causal)
    block_k = check_positive_int(block_k, "block_k", keys_between_merges(inputs.topk))
    workers = check_positive_int(workers, "workers", cpu_cores())
    return running_topk(inputs, block_q=check_positive_int(block_q, "block_q"), block_k=block_k, workers=workers)


def sparse_attention_one_head(
    q: Array, k: Array, v: Array, indices: NDArray, *, scale: float | None = None, block_k: int = 64
) -> tuple[Array, Array]:
    """Attention over the chosen keys, plainly, for one head: q (T, E), k (S, E), v (S, Ev), indices (T, n) ->
    out (T, Ev), lse (T,). Query t attends to the keys indices[t] lists (-1: an empty slot), nothing else:

        for each query t:                        m = -inf, ℓ = 0, o = 0
            for each block of block_k slots:     the listed keys K_j = k[indices[t, slots]], V_j likewise
                s  = scale · K_j q_t             (bk,)
                m' = max(m, max s);  ℓ = exp(m - m') ℓ + Σ exp(s - m');  o = exp(m - m') o + exp(s - m') V_j
        out_t = o / ℓ,  lse_t = m + log ℓ        (a query with no key: 0 and -inf)

    flash_attention_one_head's online softmax, with the keys gathered from the list instead of read in order.
    It equals attention() with a mask that keeps only the listed keys. sparse_attention is the fast form.
    """
    q, k, v = (as_float_array(x, name)[None, None] for x, name in ((q, "q"), (k, "k"), (v, "v")))
    q, k, v, indices, scale = check_sparse_inputs(q, k, v, np.asarray(indices)[None], scale)
    q, k, v, indices = q[0, 0], k[0, 0], v[0, 0], indices[0]  # (T, E), (S, E), (S, Ev), (T, n)
    out, lse = np.zeros((len(q), v.shape[1]), q.dtype), np.zeros(len(q), q.dtype)
    for t in range(len(q)):
        m, l, o = -np.inf, 0.0, np.zeros(v.shape[1], q.dtype)  # noqa: E741 (the paper's ℓ)
        for j0 in range(0, indices.shape[1], block_k):
            chosen = indices[t, j0 : j0 + block_k]
            chosen = chosen[chosen >= 0]  # (bk,): the listed keys of this block
            if len(chosen) == 0:
                continue
            s = scale * (k[chosen] @ q[t])  # (bk,)
            m_new = max(m, s.max())
            p, alpha = np.exp(s - m_new), np.exp(m - m_new)  # (bk,), rescales what was summed against m
            l, o, m = alpha * l + p.sum(), alpha * o + p @ v[chosen], m_new  # noqa: E741
        out[t], lse[t] = (o / l, m + np.log(l)) if l > 0 else (0.0, -np.inf)
    return out, lse


def sparse_attention(
    q: Array,
    k: Array,
    v: Array,
    indices: NDArray,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    workers: int | None = None,
) -> Array | tuple[Array, Array]:
    """Attention of each query over only the keys indices lists: q (B, H, T, E), k (B, Hkv, S, E), v (B, Hkv, S,
    Ev), indices (B, T, n) int, shared by the heads (as DSA chooses), -1 for an empty slot -> out (B, H, T, Ev)
    (and lse (B, H, T) with return_lse). Equal to attention() with a boolean mask that keeps the listed keys;
    never a T x S matrix: a block of each query's keys gathered at a time, the online softmax over the blocks
    (sparse_attention_one_head, many heads a step: _sparse_kernel.attend_chosen). A query head h reads kv head
    h // (H / Hkv). A key listed twice in one row counts twice (index_topk never lists one twice). Where v is a
    view of k's first Ev numbers (MLA's latent), the gathered keys serve as the values. float16 is computed in
    float32, out cast back.
    """
    inputs = check_sparse_inputs(q, k, v, indices, scale)
    out, lse = attend_chosen(inputs, workers=check_positive_int(workers, "workers", cpu_cores()))
    out = out.astype(np.result_type(q, k, v), copy=False)
    return (out, lse) if check_bool(return_lse, "return_lse") else out


def sparse_attention_backward(
    q: Array,
    k: Array,
    v: Array,
    indices: NDArray,
    out: Array,
    dout: Array,
    lse: Array,
    *,
    scale: float | None = None,
    workers: int | None = None,
) -> tuple[Array, Array, Array]:
    """dq (B, H, T, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) of sparse_attention, from its out and lse and
    dout = ∂loss/∂out (B, H, T, Ev). The indices are held fixed (a top-k has no gradient). Per query t and its
    listed keys K_t, V_t (the backward of attention, backward.py, over those keys only):
        p = exp(scale q_t K_tᵀ - lse_t)    dV_t += pᵀ dout_t      dp = dout_t V_tᵀ      D_t = dout_t · out_t
        ds = p ∘ (dp - D_t)                dq_t = scale ds K_t    dK_t += scale dsᵀ q_t
    and dK_t, dV_t are added back at the listed positions of k and v: a key chosen by many queries gathers all
    their terms, a key no query chose gets 0. The query heads of a kv head add into its dk and dv.
    """
    inputs = check_sparse_inputs(q, k, v, indices, scale)
    out, dout, lse = check_backward_inputs(inputs, out, dout, lse)  # in the compute dtype
    grads = chosen_backward(inputs, out, dout, lse, workers=check_positive_int(workers, "workers", cpu_cores()))
    return tuple(g.astype(np.result_type(x), copy=False) for g, x in zip(grads, (q, k, v), strict=True))  # type: ignore


# ---------------------------------------------------------------------------------------------------
# decoding: a step scores every cached indexer key, then reads only the latents it chose


def sparse_decode(
    q_latent: Array,
    q_index: Array,
    weights: Array,
    latents: Array,
    index_keys: Array,
    lengths: Any,
    topk: int,
    *,
    value_dim: int,
    scale: float | None = None,
) -> tuple[Array, NDArray]:
    """The new tokens of each sequence over its cached ones, from arrays: q_latent (B, H, L, r + d_rope), the
    absorbed queries (latent.absorb_query); q_index (B, H_I, L, d_I), weights (B, L, H_I), the indexer's; latents
    (B, max_tokens, r + d_rope) and index_keys (B, max_tokens, d_I), what the cache keeps a token; lengths (B,):
    sequence b holds lengths[b] tokens, its L new ones last (already written). value_dim = r: the value is the
    latent's first r numbers. -> o_latent (B, H, L, r) and the chosen keys (B, L, topk), per sequence:
        chosen = index_topk(q_index, its index_keys, weights, topk)    every cached indexer key scored
        o      = sparse_attention(q_latent, its latents, their first r, chosen)    topk latents read
    """
    latents, index_keys, lengths = check_decode_arrays(q_latent, latents, index_keys, lengths)
    B, H, L, _ = np.shape(q_latent)
    o = np.empty((B, H, L, value_dim), np.result_type(q_latent, latents))
    chosen = np.empty((B, L, topk), np.int64)
    for b, n in enumerate(lengths):
        chosen[b] = index_topk(q_index[b : b + 1], index_keys[b : b + 1, :n], weights[b : b + 1], topk)[0]
        latent = latents[b : b + 1, None, :n]  # (1, 1, n, r + d_rope): the one kv head of the absorbed form
        o[b] = sparse_attention(q_latent[b : b + 1], latent, latent[..., :value_dim], chosen[b : b + 1], scale=scale)[0]
    return o, chosen
