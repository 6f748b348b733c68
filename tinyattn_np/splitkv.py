"""Split-KV decoding ("flash-decoding"): one query against many cached keys, spread over the cores.

In decoding, a step has L = 1 query per head and S cached keys. flash_attention parallelises over query
blocks, and there is only one: a single core would do all the work. Split the keys instead:

    keys 0 .. S-1  ->  N chunks K_1 .. K_N (and V_1 .. V_N), one per task
    out_n, lse_n   =  attention(q, K_n, V_n) and its logsumexp, for each chunk, in parallel
    m              =  max_n lse_n                                        one max over every chunk
    lse            =  m + log Σ_n exp(lse_n - m)                         one sum
    out            =  Σ_n exp(lse_n - lse) · out_n                       (merge_chunks)

The merge is exact: exp(lse_n) is chunk n's softmax denominator, so reweighting each chunk's output by
its share of the total denominator gives the softmax over all S keys. The result equals attention() for
any N (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"). It is
merge_states (softmax.py) for N parts at once: folding merge_states over the chunks one by one gives the
same value, but rescales the running output at every step, and in float32 those roundings add up as N
grows; one max and one sum round each chunk's weight once.

Grouped-query attention makes decoding cheaper still: the G = Hq / Hkv query heads that share a kv head
are stacked into one (G·L, E) matrix, so each cached key is read from memory once per step, not G times.
Decoding is bound by reading the cache, not by arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    check_bool,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
    result_dtype,
    without_head_axis,
)
from ._decode_kernel import decode, default_kv_splits, merge_parts, refuse_decode_beyond_memory
from ._parallel import cpu_cores
from .softmax import logsumexp

Array = NDArray[np.floating]

__all__ = ["flash_decode", "merge_chunks", "split_kv_attention"]


def split_kv_attention(
    q: Array, k: Array, v: Array, n_chunks: int, *, scale: float | None = None
) -> tuple[Array, Array]:
    """The lines above, plainly: q (..., L, E) against k (..., S, E), v (..., S, Ev) whose keys are split into
    n_chunks contiguous chunks (1 <= n_chunks <= S) -> out (..., L, Ev) and lse (..., L), attention(q, k, v) and
    its logsumexp. One kv head per query head and no threads: flash_decode is the fast path, tested equal to it.

    >>> q, k = np.eye(2), np.eye(2)
    >>> split_kv_attention(q, k, k, 2)[0].round(3)
    array([[0.67, 0.33],
           [0.33, 0.67]])
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for keys in np.array_split(np.arange(k.shape[-2]), n_chunks):  # chunk n: keys K_n and values V_n
        scores = q @ k[..., keys, :].swapaxes(-1, -2) * scale  # (..., L, S_n)
        lse_n = logsumexp(scores, axis=-1)  # (..., L): the log of chunk n's softmax denominator
        outs.append(np.exp(scores - lse_n[..., None]) @ v[..., keys, :])  # (..., L, Ev): chunk n's attention
        lses.append(lse_n)
    m = np.max(lses, axis=0)  # (..., L): one max over every chunk
    lse = m + np.log(sum(np.exp(lse_n - m) for lse_n in lses))  # (..., L): one sum
    out = sum(np.exp(lse_n - lse)[..., None] * out_n for out_n, lse_n in zip(outs, lses, strict=True))
    return out, lse  # out: each chunk reweighted by its share of the whole denominator (..., L, Ev)


def merge_chunks(outs: list[Array], lses: list[Array]) -> tuple[Array, Array]:
    """The attention over every chunk's keys from each chunk's own: outs[n] (..., Ev), lses[n] (...).

        m = max_n lse_n;   w_n = exp(lse_n − m);   lse = m + log Σ_n w_n;   out = Σ_n w_n out_n / Σ_n w_n

    Each weight is rounded once, and the sums run over the chunks in their order (the same bits for any
    number of workers), in float64: a float32 sum of N terms drifts by about √N ulps, which thousands
    of chunks would make visible. out comes back in the outs' dtype, lse in the lses'. A row that no
    chunk saw (every lse -inf) gets out 0 and lse -inf; a NaN propagates, as in merge_states. The merge the
    decode engine runs (_decode_kernel.merge_parts).
    """
    return merge_parts(outs, lses)


def flash_decode(
    q: Array,
    k: Array,
    v: Array,
    *,
    kv_splits: int | None = None,
    scale: float | None = None,
    workers: int | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """attention(q, k, v, scale=scale) with the keys split into kv_splits chunks merged by merge_chunks.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_lse=True also lse (..., Hq, L). Every query sees every key: for a decode step (L = 1) that
    is exactly causal attention with bottom-right alignment, since the one query is the newest token.
    Meant for few queries (decoding, a short continuation): a worker's scores hold about 2^17 values, and
    at least B·Hq·L·256 (block_keys); for long L use flash_attention, whose tiles also bound L.

    kv_splits: number of contiguous key chunks (default: one per worker, 1,024 keys or more each); more than S
    acts as S. workers: threads (default the CPU count), BLAS held to one thread meanwhile. For a given
    kv_splits the result is the same bits for any number of workers (the chunks and the order of the
    merge are fixed); for any kv_splits it equals attention() to float rounding.
    float16 is computed in float32, one block of keys at a time, and out cast back; lse stays float32,
    as flash_attention returns it.
    """
    return_lse = check_bool(return_lse, "return_lse")
    two_d = without_head_axis(q)
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e, compute_dtype(q, k, v))
    workers = check_positive_int(workers, "workers", default=cpu_cores())
    kv_splits = check_positive_int(kv_splits, "kv_splits", default=default_kv_splits(dims.n_k, workers))
    kv_splits = min(kv_splits, max(dims.n_k, 1))
    refuse_decode_beyond_memory("flash_decode", q, k, v, dims, kv_splits, workers)
    out, lse = decode(q, k, v, dims, scale, kv_splits, workers)
    out_full = out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev).astype(result_dtype(q, k, v), copy=False)
    lse_full = lse.reshape(*dims.batch, dims.hq, dims.n_q)  # compute dtype, as flash_attention returns it
    if two_d:
        out_full, lse_full = out_full[0], lse_full[0]
    return (out_full, lse_full) if return_lse else out_full
