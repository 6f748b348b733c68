"""The reference attention: build the whole score matrix, mask it, softmax it, multiply by V.

    attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V,    scale = 1/√E     (Vaswani et al. 2017, eq. 1)

This is the naive path that flash_attention() (flash.py) must agree with. It holds an (..., Hq, L, S)
array, so its memory grows with L·S; flash_attention never builds it.

Two entry points:
- attention(): this project's conventions; causal=True is bottom-right aligned (query i sees key
  j <= i + S - L), the alignment decoding with a KV cache needs.
- scaled_dot_product_attention(): torch.nn.functional.scaled_dot_product_attention's signature and
  semantics, including its top-left is_causal (query i sees key j <= i). Same thing when L == S.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from ._checks import QKVShape, as_float_array, check_bool, check_qkv, check_scale, compute_dtype, result_dtype
from .masks import band_blocked, causal_offset, check_window
from .measure import memory_available
from .memory import naive_attention_bytes
from .report import format_bytes
from .softmax import softmax_

Array = NDArray[np.floating]


def _check_mask(mask: Any, scores_shape: tuple[int, ...]) -> np.ndarray:
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


class AttentionMemoryError(MemoryError):
    """attention() refused to build a score matrix larger than the memory that is available."""


def _check_memory(
    dims: QKVShape, dtype: np.dtype, causal: bool, mask: np.ndarray | None, window: int | None = None
) -> None:
    """Refuse, before allocating, a call whose peak (memory.naive_attention_bytes: the score matrix,
    its masks and the output) does not fit in the memory that is available. It reads shapes and dtypes
    only, so it runs before anything is converted or built."""
    batch = int(np.prod(dims.batch, dtype=np.int64))
    if batch == 0 or dims.hq == 0:
        return  # no query head at all: nothing the size of the scores is made
    inverted = mask.size if mask is not None and mask.dtype == np.bool_ else None  # ~mask: a bool mask's size
    needed = naive_attention_bytes(
        dims.n_q, dims.n_k, heads=dims.hq, kv_heads=dims.hkv, head_dim=dims.e, head_dim_v=dims.ev,
        batch=batch, dtype=dtype, causal=causal, bool_mask=inverted is not None, mask_elements=inverted,
        window=window,
    )  # fmt: skip
    available = memory_available()
    if needed > available:
        scores_shape = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
        raise AttentionMemoryError(
            f"attention() would allocate {format_bytes(needed)} at its peak (score matrix {scores_shape}), but "
            f"only {format_bytes(available)} of memory is available. flash_attention() gives the same "
            "result without building that matrix; pass check_memory=False to try anyway."
        )


def _grouped(x: np.ndarray, dims: QKVShape, n: int, kv: bool) -> np.ndarray:
    """View (..., H, n, d) as (..., Hkv, G, n, d) for queries or (..., Hkv, 1, n, d) for keys/values.

    Query head h = g_kv · G + g reads kv head g_kv, so broadcasting over the size-1 axis shares each
    kv head with its G query heads without copying K or V (torch: repeat_interleave).
    """
    heads = (dims.hkv, 1) if kv else (dims.hkv, dims.group)
    return x.reshape(*dims.batch, *heads, n, x.shape[-1])


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
    check_memory=True refuses (AttentionMemoryError) a score matrix larger than the available memory,
    before anything is converted or built: the check reads shapes and dtypes only.
    float16 is computed in float32; mixed dtypes compute in the widest and return np.result_type of q, k, v.
    """
    causal, return_weights = check_bool(causal, "causal"), check_bool(return_weights, "return_weights")
    check_memory = check_bool(check_memory, "check_memory")
    q = as_float_array(q, "q")  # before np.ndim: a ragged list gets an error that names q
    two_d = q.ndim == 2
    q, k, v, dims = check_qkv(q, k, v)
    scale = check_scale(scale, dims.e)
    offset = causal_offset(dims.n_q, dims.n_k, align)  # checks align even when causal=False
    if window is not None:
        if not causal:
            raise ValueError(f"window={window!r} needs causal=True: a sliding window looks back from the diagonal")
        window = check_window(window, dims.n_q, dims.n_k)
    scores_shape = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
    if mask is not None:
        mask = _check_mask(mask, scores_shape)
    if check_memory:  # first, on shapes alone: the float16 copies below are part of the bill
        _check_memory(dims, result_dtype(q, k, v), causal, mask, window)
    ct = compute_dtype(q, k, v)
    k_c, v_c = (x.astype(ct, copy=False) for x in (k, v))

    # 1) every query against every key: (..., Hkv, G, L, E) @ (..., Hkv, 1, E, S). q is scaled first,
    #    as flash_attention does: q·k itself may overflow where (scale·q)·k does not (q = 1e154, scale = 1e-10)
    q_s = np.multiply(q, scale, dtype=ct)  # (..., Hq, L, E): a new array in the compute dtype; q stays as it was
    scores = _grouped(q_s, dims, dims.n_q, kv=False) @ _grouped(k_c, dims, dims.n_k, kv=True).swapaxes(-1, -2)
    scores = scores.reshape(scores_shape)  # (..., Hq, L, S); the reshape is free, scores is contiguous

    # 2) masks: -inf where a key is hidden, so that exp gives exactly 0 for it
    if mask is not None and mask.dtype == np.bool_:
        np.copyto(scores, -np.inf, where=~mask)  # ~mask: a temporary of the mask's size
    elif mask is not None:
        np.add(scores, mask, out=scores, casting="same_kind")  # cast chunk by chunk: no full-size copy of mask
    if causal:
        blocked = band_blocked(0, dims.n_q, 0, dims.n_k, offset, window)  # (L, S); the window's edge too
        np.copyto(scores, -np.inf, where=blocked)

    # 3) softmax over the keys, in place: the weights take the scores' memory
    weights = softmax_(scores, axis=-1)  # (..., Hq, L, S), rows sum to 1 (or are all 0)

    # 4) weighted sum of the values: (..., Hkv, G, L, S) @ (..., Hkv, 1, S, Ev)
    grouped_weights = weights.reshape(*dims.batch, dims.hkv, dims.group, dims.n_q, dims.n_k)
    out = (grouped_weights @ _grouped(v_c, dims, dims.n_k, kv=True)).reshape(
        *dims.batch, dims.hq, dims.n_q, dims.ev
    )  # (..., Hq, L, Ev)

    out_dtype = result_dtype(q, k, v)
    out = out.astype(out_dtype, copy=False)
    if two_d:
        out, weights = out[0], weights[0]
    if return_weights:
        return out, weights.astype(out_dtype, copy=False)
    return out


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
