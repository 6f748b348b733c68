"""One attention head, every step on its own line.

q = x Wq,  k = x Wk,  v = x Wv                      (T, d_head) each
weights = softmax(q kᵀ / √d_head  with the future hidden)   (T, T), rows sum to 1
out = weights v                                     (T, d_head)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, compute_dtype, result_dtype
from .masks import causal_mask
from .softmax import softmax

__all__ = ["one_head"]

Array = NDArray[np.floating]


def one_head(x: Array, wq: Array, wk: Array, wv: Array, *, causal: bool = True) -> tuple[Array, Array]:
    """x (T, d_model), wq/wk (d_model, d_head), wv (d_model, d_v) -> (out (T, d_v), weights (T, T)).

    float16 is computed in float32 and both results cast back; mixed dtypes compute in the widest.

    >>> x, w = np.ones((3, 4)), np.ones((4, 2))  # three equal tokens: every score is the same
    >>> out, weights = one_head(x, w, w, w)
    >>> weights  # causal: token i spreads its attention evenly over tokens 0 .. i
    array([[1.        , 0.        , 0.        ],
           [0.5       , 0.5       , 0.        ],
           [0.33333333, 0.33333333, 0.33333333]])
    """
    x, wq, wk, wv, out_dtype = check_head(x, wq, wk, wv, causal)

    q = x @ wq  # (T, d_head): what each token looks for
    k = x @ wk  # (T, d_head): what each token offers
    v = x @ wv  # (T, d_v):    what each token hands over
    # (T, T): without √d the spread grows with d_head. math.sqrt gives a Python float, which keeps
    # float32 scores float32 (a NumPy float64 scalar would promote them under NumPy 2)
    scores = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        # token i may not look at j > i: -inf there makes its softmax weight exactly 0
        scores = np.where(causal_mask(len(x)), scores, -np.inf)  # (T, T)
    weights = softmax(scores, axis=-1)  # (T, T), each row sums to 1
    out = weights @ v  # (T, d_v)
    return out.astype(out_dtype, copy=False), weights.astype(out_dtype, copy=False)


def check_head(
    x: Any, wq: Any, wk: Any, wv: Any, causal: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.dtype]:
    """one_head's inputs checked, in the dtype the math runs in, and the dtype of its results."""
    check_bool(causal, "causal")
    x = as_float_array(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (T, d_model); got shape {x.shape}")
    wq, wk, wv = (as_float_array(w, name) for w, name in ((wq, "wq"), (wk, "wk"), (wv, "wv")))
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.ndim != 2 or w.shape[0] != x.shape[1]:
            raise ValueError(f"{name} must be 2-D (d_model={x.shape[1]}, d_head); got shape {w.shape}")
    if wq.shape != wk.shape:
        raise ValueError(f"wq and wk must have the same shape; got {wq.shape} and {wk.shape}")
    if wq.shape[1] == 0:
        raise ValueError(
            f"wq and wk must have a head size d_head of at least 1 (the scores divide by √d_head); got shape {wq.shape}"
        )
    dtype, out_dtype = compute_dtype(x, wq, wk, wv), result_dtype(x, wq, wk, wv)  # float16: computed in float32
    x, wq, wk, wv = (a.astype(dtype, copy=False) for a in (x, wq, wk, wv))
    return x, wq, wk, wv, out_dtype
