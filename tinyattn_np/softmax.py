"""softmax, logsumexp and merge_states: the algebra behind the online ("flash") softmax.

softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m) for any m; we take m = max_k x_k so that no exp
overflows (exp(89) is already inf in float32). A row that is -inf everywhere (every key masked) has
no maximum to subtract; we define its softmax as all zeros and its logsumexp as -inf, like torch.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, compute_dtype

__all__ = ["logsumexp", "merge_states", "softmax", "softmax_"]

Array = NDArray[np.floating]


def softmax(x: Array, axis: int = -1) -> Array:
    """exp(x - max) / sum(exp(x - max)) along axis; a row of all -inf gives all zeros (not NaN), a row holding
    +inf or NaN gives all NaN (as torch), without a warning.

    float16 is computed in float32 and cast back.
    """
    x = as_float_array(x, "x")
    if x.ndim == 0:
        raise ValueError(f"x must have at least 1 dim; got shape {x.shape}")
    work = x.astype(compute_dtype(x), copy=True)
    return softmax_(work, axis).astype(x.dtype, copy=False)


def softmax_(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax written into x itself (no second array of x's size); x must be a writable float array.

    attention() uses this on its score matrix so that the weights reuse the scores' memory.
    A row holding +inf or NaN becomes all NaN (torch's answer): +inf - max is inf - inf = NaN, and the row's
    total is then NaN; NumPy's warning for that is the answer itself, so it is silenced here.
    """
    with np.errstate(invalid="ignore"):  # inf - inf in a row holding +inf: NaN, the answer
        x -= _safe_max(x, axis)  # every entry now <= 0 (or NaN): exp cannot overflow
    np.exp(x, out=x)
    total = np.sum(x, axis=axis, keepdims=True)  # 0 only for an all -inf row, which is all 0 already
    np.divide(x, total, out=x, where=total != 0)  # a NaN total makes the whole row NaN
    return x


def _safe_max(x: np.ndarray, axis: int) -> np.ndarray:
    """Max along axis with keepdims, where a row of all -inf gives 0 instead of -inf.

    Subtracting 0 from such a row leaves it -inf, exp gives 0 everywhere: no -inf - (-inf) = NaN.
    """
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # initial: an empty row (no keys) is -inf too
    return np.where(np.isneginf(m), 0.0, m).astype(x.dtype, copy=False)


def logsumexp(x: Array, axis: int = -1, keepdims: bool = False) -> Array:
    """log(sum(exp(x))) along axis, computed as m + log(sum(exp(x - m))); an all -inf row gives -inf,
    a row holding +inf gives +inf and a row holding NaN gives NaN (SciPy's answers)."""
    keepdims = check_bool(keepdims, "keepdims")
    x = as_float_array(x, "x")
    if x.ndim == 0:
        raise ValueError(f"x must have at least 1 dim; got shape {x.shape}")
    x_c = x.astype(compute_dtype(x), copy=False)
    m = np.max(x_c, axis=axis, keepdims=True, initial=-np.inf)
    # a max of ±inf (or NaN) has nothing finite to subtract: use 0, so that inf - inf = NaN cannot appear
    # and exp(+inf) = inf gives lse = +inf, exp(-inf) = 0 gives lse = -inf
    m = np.where(np.isfinite(m), m, 0.0).astype(x_c.dtype, copy=False)
    total = np.sum(np.exp(x_c - m), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for an all -inf row
        out = m + np.log(total)
    out = out.astype(x.dtype, copy=False)
    return out if keepdims else np.squeeze(out, axis=axis)


def merge_states(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Combine two partial attentions over disjoint key sets A and B into the attention over A ∪ B.

    out_x (..., L, Ev) is softmax over keys X applied to V_X, lse_x (..., L) its logsumexp of scores.
    Because exp(lse) is each part's softmax denominator:
        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b
    A part with no visible key (lse = -inf) gets weight 0; if both have none, out = 0 and lse = -inf.
    A NaN or +inf lse is not a part that saw nothing: it propagates (NaN in out, lse NaN or +inf), never a
    quiet 0. float16 is computed in float32: out comes back in the outs' dtype, lse as float32.
    (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022.)
    """
    out_a, out_b = as_float_array(out_a, "out_a"), as_float_array(out_b, "out_b")
    lse_a, lse_b = as_float_array(lse_a, "lse_a"), as_float_array(lse_b, "lse_b")
    out_dtype = np.result_type(out_a, out_b)
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape; got {out_a.shape} and {out_b.shape}")
    if lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            f"lse_a and lse_b must have shape {out_a.shape[:-1]} (out without its last dim); "
            f"got {lse_a.shape} and {lse_b.shape}"
        )
    ct = compute_dtype(out_a, out_b, lse_a, lse_b)  # float16 in float32, as everywhere: a float16 lse rounds to 2^-11
    lse_a, lse_b = lse_a.astype(ct, copy=False), lse_b.astype(ct, copy=False)
    with np.errstate(invalid="ignore"):  # -inf - (-inf) where neither part saw a key (masked below), inf - inf
        lse = np.logaddexp(lse_a, lse_b)  # (..., L); -inf only where both are -inf, NaN or +inf if either is
        seen = ~np.isneginf(lse)  # only "no key on either side" means weight 0; NaN and +inf go on
        w_a = np.where(seen, np.exp(lse_a - lse), 0.0)[..., None]  # (..., L, 1)
        w_b = np.where(seen, np.exp(lse_b - lse), 0.0)[..., None]
        out = w_a * out_a.astype(ct, copy=False) + w_b * out_b.astype(ct, copy=False)  # (..., L, Ev)
    return out.astype(out_dtype, copy=False), lse
