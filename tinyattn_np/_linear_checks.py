"""Input checks of the gated delta rule (linear.py) and its layer (deltanet.py): each failure a ValueError or
TypeError that names the argument, what was expected and what came."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, check_positive_int, compute_dtype, result_dtype

__all__ = [
    "DeltaInputs",
    "check_chunk_size",
    "check_delta_inputs",
    "check_finite",
    "check_flags",
    "check_layer",
    "check_output_grads",
    "check_shape",
]

Array = NDArray[np.floating]

MAX_BETA = 2.0  # β_t ‖k_t‖² > 2 overshoots: the step on ½‖Sᵀk − v‖² then grows the error it corrects


class DeltaInputs(NamedTuple):
    """The rule's inputs checked and in the compute dtype: q, k (..., H, T, d_k), v (..., Hv, T, d_v), g as
    (..., Hv, T, 1) (a decay per head) or (..., Hv, T, d_k) (per key channel), beta (..., Hv, T), state
    (..., Hv, d_k, d_v) (zeros where none was given), and the dtype of the output."""

    q: Array
    k: Array
    v: Array
    g: Array
    beta: Array
    state: Array
    out_dtype: np.dtype


def check_shape(x: np.ndarray, name: str, shape: tuple[int, ...], what: str) -> None:
    """x.shape must be shape; a ValueError naming x, the shape wanted and what its axes are (`what`), otherwise."""
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}); got {x.shape}")


def check_finite(x: np.ndarray, name: str) -> None:
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite; got {np.size(x) - np.count_nonzero(np.isfinite(x))} NaN or inf")


def check_chunk_size(chunk_size: Any) -> int | None:
    """None (the recurrent form) or a positive int."""
    return None if chunk_size is None else check_positive_int(chunk_size, "chunk_size")


def check_delta_inputs(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any, *, grouped: bool) -> DeltaInputs:
    """The rule's inputs checked. grouped=True (gated_delta_rule): q, k (B, H, T, d_k) and v (B, Hv, T, d_v) with
    Hv a multiple of H; grouped=False (the plain loops): q, k, v of the same leading axes (..., T, ·)."""
    q, k, v = (as_float_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if v.ndim != 4 if grouped else v.ndim < 2:
        raise ValueError(f"v must be {'(B, Hv, T, d_v)' if grouped else '(..., T, d_v)'}; got shape {v.shape}")
    if grouped and (q.ndim != 4 or (q.shape[0], q.shape[2]) != (v.shape[0], v.shape[2])):
        raise ValueError(f"q must be (B, H, T, d_k) with v's B={v.shape[0]} and T={v.shape[2]}; got shape {q.shape}")
    if not grouped and q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"q must be (..., T, d_k) with v's leading axes {v.shape[:-1]}; got shape {q.shape}")
    check_shape(k, "k", q.shape, "q's shape")
    if grouped and v.shape[1] % q.shape[1]:
        raise ValueError(f"v's heads Hv={v.shape[1]} must be a multiple of q and k's heads H={q.shape[1]}")
    ct = compute_dtype(q, k, v)
    *lead, T, d_v = v.shape
    g, beta = _check_gates(g, beta, tuple(lead), T, q.shape[-1], ct)
    state = _check_state(initial_state, (*lead, q.shape[-1], d_v), ct)
    out_dtype = result_dtype(q, k, v)
    q, k, v = (x.astype(ct, copy=False) for x in (q, k, v))
    return DeltaInputs(q, k, v, g, beta, state, out_dtype)


def _check_gates(g: Any, beta: Any, lead: tuple[int, ...], T: int, d_k: int, ct: np.dtype) -> tuple[Array, Array]:
    """g (..., Hv, T) or (..., Hv, T, d_k), finite and <= 0 (a decay: e^g <= 1); beta (..., Hv, T) in [0, 2]."""
    g, beta = (as_float_array(x, name).astype(ct, copy=False) for x, name in ((g, "g"), (beta, "beta")))
    if g.shape not in ((*lead, T), (*lead, T, d_k)):
        raise ValueError(
            f"g must have shape {(*lead, T)} (one decay per head) or {(*lead, T, d_k)} (one per key "
            f"channel); got {g.shape}"
        )
    check_finite(g, "g")
    if np.any(g > 0):
        raise ValueError(
            f"g is the log of a decay and must be <= 0 (e^g > 1 would grow the state, not decay it); "
            f"got a largest g of {float(g.max())}"
        )
    check_shape(beta, "beta", (*lead, T), "one step size per value head and token")
    check_finite(beta, "beta")
    if np.any((beta < 0) | (beta > MAX_BETA)):
        raise ValueError(
            f"beta must lie in [0, {MAX_BETA:g}] (the delta rule's step size; sigmoid gives (0, 1)); "
            f"got values from {float(beta.min())} to {float(beta.max())}"
        )
    return (g[..., None] if g.ndim == len(lead) + 1 else g), beta


def _check_state(initial_state: Any, shape: tuple[int, ...], ct: np.dtype) -> Array:
    """The state a rule starts from: zeros, or initial_state checked (shape (..., Hv, d_k, d_v)). Like q, k and v
    it is not searched for NaN (a pass over it, as long as a decode step's own read): NaN in gives NaN out."""
    if initial_state is None:
        return np.zeros(shape, ct)
    state = as_float_array(initial_state, "initial_state")
    check_shape(state, "initial_state", shape, "B, Hv, d_k, d_v")
    return state.astype(ct, copy=False)  # the rule never writes into it


def check_output_grads(
    dout: Any, dstate: Any, out_shape: tuple[int, ...], state_shape: tuple[int, ...], ct: np.dtype
) -> tuple[Array, Array]:
    """dout (the output's shape) and dstate (the state's shape, or None: zeros) checked, in the compute dtype."""
    dout = as_float_array(dout, "dout")
    check_shape(dout, "dout", out_shape, "the output's shape")
    if dstate is None:
        return dout.astype(ct, copy=False), np.zeros(state_shape, ct)
    dstate = as_float_array(dstate, "dstate")
    check_shape(dstate, "dstate", state_shape, "the final state's shape")
    return dout.astype(ct, copy=False), dstate.astype(ct)


def check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        check_bool(value, name)


def check_layer(x: Any, weights: Any, shape: Any, shape_type: Any, weights_type: Any) -> tuple[Array, list[Array]]:
    """A Gated DeltaNet layer's input x (B, T, d_model), float32 or float64, and its weights (a weights_type) of
    the sizes `shape` (a shape_type) gives, cast to x's dtype."""
    if not isinstance(shape, shape_type):
        raise TypeError(f"shape must be a {shape_type.__name__}; got {type(shape).__name__}")
    for name in ("d_model", "key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"):
        check_positive_int(getattr(shape, name), f"shape.{name}")
    if shape.value_heads % shape.key_heads:
        raise ValueError(f"shape.value_heads={shape.value_heads} must be a multiple of key_heads={shape.key_heads}")
    x = as_float_array(x, "x")
    if x.ndim != 3 or x.shape[-1] != shape.d_model or x.dtype == np.float16:
        raise ValueError(f"x must be float32 or float64 (B, T, d_model={shape.d_model}); got {x.dtype} {x.shape}")
    if not isinstance(weights, weights_type):
        raise TypeError(f"weights must be {weights_type.__name__}; got {type(weights).__name__}")
    checked = []
    for name, w, size in zip(weights._fields, weights, shape.weight_shapes(), strict=True):
        w = as_float_array(w, f"weights.{name}")
        check_shape(w, f"weights.{name}", size, f"see {weights_type.__name__}")
        checked.append(w.astype(x.dtype, copy=False))
    return x, checked
