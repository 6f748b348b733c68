"""The reference attention: build the whole score matrix, mask it, softmax it, multiply by V.

    attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V,    scale = 1/√E     (Vaswani et al. 2017, eq. 1)

This is the naive path that flash_attention() (flash.py) and flex_attention() (flex.py) must agree with.
It holds an (..., Hq, L, S) array, so its memory grows with L·S; flash_attention never builds it. It takes
the same mods as flex_attention (mods.py): a score_mod on every score, a mask_mod that hides keys, sinks.

Two entry points:
- attention(): this project's conventions; causal=True is bottom-right aligned (query i sees key
  j <= i + S - L), the alignment decoding with a KV cache needs.
- scaled_dot_product_attention(): torch.nn.functional.scaled_dot_product_attention's signature and
  semantics, including its top-left is_causal (query i sees key j <= i). Same thing when L == S.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    check_bool,
    check_qkv,
    check_scale,
    check_sinks,
    check_window,
    check_window_is_causal,
    compute_dtype,
    result_dtype,
    without_head_axis,
)
from ._guard import refuse_attention
from ._mod_calls import check_score_mod, modded, score_indices, visible
from .masks import band_blocked, causal_offset
from .softmax import softmax_

Array = NDArray[np.floating]

__all__ = ["ScoreRules", "attend", "attention", "check_attention", "grouped", "scaled_dot_product_attention"]


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    mask: Any = None,
    scale: float | None = None,
    return_weights: bool = False,
    check_memory: bool = True,
    align: str = "bottom_right",
    window: int | None = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    sinks: Any = None,
) -> Array | tuple[Array, Array]:
    """softmax(q kᵀ · scale + mask) v, building the (..., Hq, L, S) score matrix.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), and with
    return_weights=True also the weights (..., Hq, L, S). 2-D inputs (L, E) are one head.
    mask: bool (True = may attend) or float (added to the scores), broadcastable to (..., Hq, L, S).
    causal=True hides key j from query i when j > i + S - L (bottom-right); it combines with mask.
    align="top_left" moves that diagonal to j > i, torch's is_causal (the same when L == S).
    window (needs causal=True): a sliding window, query i sees only the last `window` keys, itself
    included (bottom-right: j > i + S - L - window; masks.window_mask draws it).
    A query that may see no key gets output 0 (and weights 0), never NaN; S = 0 gives zeros.
    A NaN in q or k reaches only the output rows whose scores touch it. A NaN in v reaches every row:
    weights @ v multiplies it by each row's weight, and 0 · NaN is NaN (the same in torch's math path).
    An inf acts alike (a score of +inf makes its row NaN, 0 · inf is NaN), with no RuntimeWarning.
    check_memory=True refuses (AttentionMemoryError) a score matrix larger than the available memory,
    before anything is converted or built: the check reads shapes and dtypes only.
    score_mod, mask_mod, sinks: flex_attention's mods, on the whole matrix (mods.py): the score_mod on
    every scaled score q·k·scale first, then the masks (mask_mod's False hides a key, as mask's False);
    sinks (Hq,) join every row's softmax, their weight dropped. b counts the leading dims' entries in order.
    float16 is computed in float32; mixed dtypes compute in the widest and return np.result_type of q, k, v.

    >>> q = k = v = np.eye(2)
    >>> attention(q, k, v, causal=True)[0]
    array([1., 0.])
    """
    return_weights, check_memory = (
        check_bool(return_weights, "return_weights"),
        check_bool(check_memory, "check_memory"),
    )
    two_d = without_head_axis(q)
    q, k, v, dims, scale, rules = check_attention(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        scale=scale,
        align=align,
        window=window,
        mask_mod=mask_mod,
        score_mod=score_mod,
        sinks=sinks,
    )
    if check_memory:  # first, on shapes alone: the float16 copies below are part of the bill
        refuse_attention(dims, result_dtype(q, k, v), rules)
    ct = compute_dtype(q, k, v)
    out, weights = attend(q, k.astype(ct, copy=False), v.astype(ct, copy=False), dims, scale, rules)

    out_dtype = result_dtype(q, k, v)
    out = out.astype(out_dtype, copy=False)
    if two_d:
        out, weights = out[0], weights[0]
    if return_weights:
        return out, weights.astype(out_dtype, copy=False)
    return out


@np.errstate(invalid="ignore")  # inf - inf and 0 · inf from an inf input: NaN is the answer, as in torch
def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, scale: float, rules: ScoreRules
) -> tuple[np.ndarray, np.ndarray]:
    """The reference attention's math on inputs check_attention() accepted, k and v in the compute dtype:
    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> out (..., Hq, L, Ev), weights (..., Hq, L, S).
    An inf or NaN input gives NaN where it reaches (inf - inf, 0 · inf), as torch does, and no warning."""
    # 1) every query against every key: (..., Hkv, G, L, E) @ (..., Hkv, 1, E, S). q is scaled first, as
    #    flash_attention does: q·k itself may overflow where (scale·q)·k does not (q = 1e154, scale = 1e-10)
    q_s = np.multiply(q, scale, dtype=k.dtype)  # (..., Hq, L, E) in the compute dtype; q stays as it was
    scores = grouped(q_s, dims, kv=False) @ grouped(k, dims, kv=True).swapaxes(-1, -2)  # (..., Hkv, G, L, S)
    scores = scores.reshape(*dims.batch, dims.hq, dims.n_q, dims.n_k)  # (..., Hq, L, S): free, it is contiguous
    del q_s  # the scores are made: free q_s before the masks and the softmax need their memory

    # 2) flex attention's mods: score_mod rewrites every score, mask_mod hides keys (mods.py)
    apply_mods(scores, dims, rules)
    # 3) masks: -inf where a key is hidden, so that exp gives exactly 0 for it
    if rules.mask is not None and rules.mask.dtype == np.bool_:
        np.copyto(scores, -np.inf, where=~rules.mask)  # ~mask: a temporary of the mask's size
    elif rules.mask is not None:
        np.add(scores, rules.mask, out=scores, casting="same_kind")  # cast chunk by chunk: no full-size copy
    if rules.offset is not None:
        blocked = band_blocked(0, dims.n_q, 0, dims.n_k, rules.offset, rules.window)  # (L, S); the window too
        np.copyto(scores, -np.inf, where=blocked)

    # 4) softmax over the keys (and each head's sink, when there are sinks), in place: the weights take the
    #    scores' memory
    if rules.sinks is None:
        weights = softmax_(scores, axis=-1)  # (..., Hq, L, S), rows sum to 1 (or are all 0)
    else:
        weights = softmax_with_sinks_(scores, rules.sinks[:, None, None])  # rows sum to 1 - the sink's weight

    # 5) weighted sum of the values: (..., Hkv, G, L, S) @ (..., Hkv, 1, S, Ev)
    out = grouped(weights, dims, kv=False) @ grouped(v, dims, kv=True)  # (..., Hkv, G, L, Ev)
    return out.reshape(*dims.batch, dims.hq, dims.n_q, dims.ev), weights


def apply_mods(scores: np.ndarray, dims: QKVShape, rules: ScoreRules) -> None:
    """In place on the scores (..., Hq, L, S): score_mod(scores, b, h, q_idx, kv_idx) on every score, then
    -inf where mask_mod(b, h, q_idx, kv_idx) is False; b, h, q_idx, kv_idx broadcast against the scores."""
    indices = score_indices(dims.batch, dims.hq, dims.n_q, dims.n_k)  # (..., 1, 1, 1), (Hq, 1, 1), (L, 1), (S,)
    if rules.score_mod is not None:
        np.copyto(scores, modded(rules.score_mod, scores, *indices), casting="same_kind")
    if rules.mask_mod is not None:
        np.copyto(scores, -np.inf, where=~visible(rules.mask_mod, *indices))


def softmax_with_sinks_(scores: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """softmax over each row's keys and its head's sink logit (sinks (Hq, 1, 1)), written into the scores;
    the sink's own weight is dropped (gpt-oss: concatenate the sink as a last column, softmax, drop it):
        P_ij = exp(s_ij - m_i) / (Σ_k exp(s_ik - m_i) + exp(sink - m_i)),  m_i = max(max_k s_ik, sink)."""
    m = np.maximum(np.max(scores, axis=-1, keepdims=True, initial=-np.inf), sinks)  # (..., Hq, L, 1), finite
    scores -= m
    np.exp(scores, out=scores)
    scores /= np.sum(scores, axis=-1, keepdims=True) + np.exp(sinks - m)  # never 0: the sink's term is > 0
    return scores


def grouped(x: np.ndarray, dims: QKVShape, kv: bool) -> np.ndarray:
    """View (..., H, n, d) as (..., Hkv, G, n, d) for queries or (..., Hkv, 1, n, d) for keys/values.

    Query head h = g_kv · G + g reads kv head g_kv, so broadcasting over the size-1 axis shares each
    kv head with its G query heads without copying K or V (torch: repeat_interleave).
    """
    heads = (dims.hkv, 1) if kv else (dims.hkv, dims.group)
    return x.reshape(*dims.batch, *heads, x.shape[-2], x.shape[-1])


def scaled_dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Array:
    """torch.nn.functional.scaled_dot_product_attention, argument for argument, in NumPy.

    Differences from this project's attention(), copied from torch on purpose:
    - is_causal=True is top-left aligned: query i sees key j <= i, whatever L and S are.
    - is_causal together with attn_mask is an error: torch's documentation says so (its fused CPU
      kernel happens to accept the pair, but that is not the documented contract).
    - Hq != Hkv is an error unless enable_gqa=True.
    - query, key and value must share one dtype (torch raises for float32 with float16); attention()
      instead promotes mixed dtypes.
    There is no dropout here: dropout_p must be 0.0.
    """
    is_causal, enable_gqa = check_bool(is_causal, "is_causal"), check_bool(enable_gqa, "enable_gqa")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: tinyattn_np has no dropout; got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError(
            "pass attn_mask or is_causal=True, not both (torch documents setting both as an error). For padding "
            "plus causal, pass one bool mask, attn_mask=padding & causal_mask(L, S, align='top_left'), or use "
            "attention(q, k, v, causal=True, mask=padding)"
        )
    q, k, v, _ = check_qkv(query, key, value, gqa_allowed=enable_gqa)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            "query, key and value must have the same dtype, as in torch; got "
            f"query {q.dtype}, key {k.dtype}, value {v.dtype} (attention() promotes mixed dtypes)"
        )
    # the causal mask is never built here: attention() checks the memory first, then hides j > i itself
    return cast(Array, attention(query, key, value, causal=is_causal, align="top_left", mask=attn_mask, scale=scale))


class ScoreRules(NamedTuple):
    """What a call does to the scores before the softmax: a bool (True = may attend) or float (added) mask,
    the causal band, and flex attention's mods: a mask_mod, a score_mod and sinks (Hq,) (mods.py).

    offset is None without causal; else query i sees key j when j <= i + offset, and with a window
    only when j > i + offset - window as well (masks.band_blocked).
    """

    mask: np.ndarray | None
    offset: int | None
    window: int | None
    mask_mod: Any = None
    score_mod: Any = None
    sinks: np.ndarray | None = None


def check_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: Any,
    mask: Any,
    scale: Any,
    align: Any,
    window: Any,
    mask_mod: Any = None,
    score_mod: Any = None,
    sinks: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, float, ScoreRules]:
    """attention()'s inputs checked, once: q, k, v with a head axis, their sizes, the scale, the rules on the scores."""
    causal = check_bool(causal, "causal")
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e, compute_dtype(q, k, v))
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) or None; got {mask_mod!r}")
    mods = (mask_mod, check_score_mod(score_mod), check_sinks(sinks, dims.hq, compute_dtype(q, k, v)))
    offset = causal_offset(dims.n_q, dims.n_k, align)  # checks align even when causal=False
    check_window_is_causal(window, causal)
    if window is not None:
        window = check_window(window, dims.n_q, dims.n_k)
    if mask is not None:
        mask = check_mask(mask, (*dims.batch, dims.hq, dims.n_q, dims.n_k))
    return q, k, v, dims, scale, ScoreRules(mask, offset if causal else None, window, *mods)


def check_mask(mask: Any, scores_shape: tuple[int, ...]) -> np.ndarray:
    """mask as a bool or float array that broadcasts to the scores' shape without enlarging it."""
    if isinstance(mask, (np.ma.MaskedArray, np.matrix)):
        raise TypeError(f"mask must be a plain ndarray; got {type(mask).__name__}: pass np.asarray(mask)")
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and mask.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"mask must be bool (True = may attend) or float (added to the scores); got dtype {mask.dtype}")
    try:
        fits = np.broadcast_shapes(mask.shape, scores_shape) == scores_shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask must broadcast to the scores' shape (..., Hq, L, S) = {scores_shape}; got shape {mask.shape}"
        )
    return mask
