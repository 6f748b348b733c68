"""Input checks shared by the public functions: each failure names the argument, what was expected
and what came, as a ValueError or TypeError (never an assert: user input deserves a clear message)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ACCEPTED_DTYPES",
    "COMPUTE_DTYPES",
    "QKVShape",
    "SHARD_LAYOUTS",
    "as_float_array",
    "check_bool",
    "check_count",
    "check_cu_seqlens",
    "check_layout",
    "check_like",
    "check_ndim",
    "check_one_head",
    "check_positive_int",
    "check_qkv",
    "check_rng",
    "check_scale",
    "check_sinks",
    "check_sizes",
    "check_weight",
    "check_window",
    "check_window_is_causal",
    "compute_dtype",
    "plain_array",
    "result_dtype",
    "transposed_note",
    "without_head_axis",
]

# float16 is computed in float32 and cast back; these are the dtypes that compute in their own precision.
COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
ACCEPTED_DTYPES = (np.dtype(np.float16), *COMPUTE_DTYPES)


def as_float_array(x: Any, name: str) -> np.ndarray:
    """x as an ndarray of float16/32/64 in the machine's byte order; anything else is a TypeError that names
    the dtype and what to pass.

    Refused as plain_array refuses them: a masked array, np.matrix, a tensor NumPy cannot read. A ragged
    list, which NumPy cannot make into one array, is a ValueError naming the argument. A big-endian float32
    (">f4", as read from some files) is float32: it is accepted and computed in the native order.
    """
    x = plain_array(x, name)
    if x.dtype.kind == "f" and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))  # ">f4" is float32 too: compute in the native order
    if x.dtype not in ACCEPTED_DTYPES:
        exact = " (float32 holds every bfloat16 value exactly)" if x.dtype.name == "bfloat16" else ""
        raise TypeError(
            f"{name} must be float16, float32 or float64; got dtype {x.dtype}: pass {name}.astype(np.float32){exact}"
        )
    return x


def check_weight(w: Any, name: str, shape: tuple[int, int]) -> np.ndarray:
    """w itself (no copy: the caller may keep updating it in place) when it is a float16/32/64 ndarray of
    `shape`, (in, out); else a TypeError or ValueError naming it, which says so when w is the transpose."""
    if not isinstance(w, np.ndarray) or w.dtype not in ACCEPTED_DTYPES:
        raise TypeError(f"{name} must be a float16, float32 or float64 ndarray; got {getattr(w, 'dtype', type(w))}")
    if w.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {w.shape}{transposed_note(w.shape, shape)}")
    return w


def transposed_note(got: tuple[Any, ...], shape: tuple[Any, ...]) -> str:
    """What to add to a weight's shape error when it came transposed: a weight ported from torch as is."""
    if len(got) == len(shape) == 2 and got == shape[::-1]:
        return ": W is (in, out), the transpose of nn.Linear.weight (pass weight.T)"
    return ""


def plain_array(x: Any, name: str) -> np.ndarray:
    """x as a plain ndarray (np.asarray), refusing with a TypeError that says what to pass instead: a masked
    array (its mask would be silently ignored), np.matrix (its * and ** mean matrix products, and it stays
    2-D), and a tensor that NumPy cannot read (torch's bfloat16, one on a GPU or one that requires grad).
    A ragged list, which NumPy cannot make into one array, is a ValueError naming the argument."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array, whose mask attention would ignore: pass {name}.filled(value) to choose "
            f"what the masked entries hold, or np.asarray({name}) to drop the mask deliberately "
            "(to hide keys, use the attention mask argument)"
        )
    if isinstance(x, np.matrix):
        raise TypeError(f"{name} is an np.matrix: pass np.asarray({name}), a plain ndarray")
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except ValueError as err:  # a ragged nested list: "inhomogeneous shape after 1 dimensions"
        raise ValueError(f"{name} must be an array of numbers with one shape; could not make one: {err}") from None
    except (TypeError, RuntimeError) as err:  # torch: "unsupported ScalarType BFloat16", "requires grad", cuda
        dtype = getattr(x, "dtype", "?")
        convert = ".float()" if "bfloat16" in str(dtype) else ""
        raise TypeError(
            f"{name} is a {type(x).__name__} of dtype {dtype} that NumPy cannot read ({err}): pass a NumPy array, "
            f"such as {name}.detach(){convert}.cpu().numpy()"
        ) from None


def compute_dtype(*arrays: np.ndarray) -> np.dtype:
    """The dtype the math runs in: float64 if any input is float64, else float32 (float16 included)."""
    if any(a.dtype == np.float64 for a in arrays):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """The dtype of the output: the inputs' common type (float16 inputs give a float16 result)."""
    return np.result_type(*arrays)


def check_ndim(x: np.ndarray, name: str, min_ndim: int, what: str) -> None:
    if x.ndim < min_ndim:
        dims = "dim" if min_ndim == 1 else "dims"
        raise ValueError(f"{name} must have at least {min_ndim} {dims} {what}; got shape {x.shape}")


def check_positive_int(value: Any, name: str, default: int | None = None) -> int:
    """value as a positive int (None gives default, where one is given); bool, float and str are
    TypeErrors, 0 and negatives ValueErrors."""
    if value is None and default is not None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int; got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int; got {value}")
    return int(value)


def check_bool(value: Any, name: str) -> bool:
    """A flag as a Python bool: True/False or a NumPy bool. Anything else (the string "False", 0, None) is a
    TypeError, because `if "False":` is true and would silently mean the opposite of what was written."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")
    return bool(value)


def check_window_is_causal(window: Any, causal: bool) -> None:
    """A sliding window counts back from the diagonal, so window= needs causal=True: the one place that says so
    (attention, flash_attention, tile_plan, varlen_mod and the bills all ask it)."""
    if window is not None and not causal:
        raise ValueError(f"window={window!r} needs causal=True: a sliding window looks back from the diagonal")


def check_window(window: object, n_q: int, n_k: int) -> int:
    """window as a positive int, clipped to n_q + n_k: a window that long already reaches back past the
    first key from every query (so it is plain causal), and the clip keeps huge ints such as 2**63 out
    of NumPy's int64 arithmetic."""
    return min(check_positive_int(window, "window"), n_q + n_k + 1)


def check_rng(rng: Any, name: str = "rng") -> np.random.Generator:
    """A random generator from what a constructor was given: a np.random.Generator as it is, an int >= 0 as
    the seed of np.random.default_rng, None as a fresh generator (new weights every time)."""
    if rng is None or isinstance(rng, np.random.Generator):
        return np.random.default_rng(rng)  # default_rng(generator) returns that same generator
    if isinstance(rng, (bool, np.bool_)) or not isinstance(rng, (int, np.integer)):
        raise TypeError(
            f"{name} must be a np.random.Generator, an int seed or None; got {rng!r} ({type(rng).__name__})"
        )
    if rng < 0:
        raise ValueError(f"{name} as a seed must be an int >= 0; got {rng}")
    return np.random.default_rng(int(rng))


def check_count(value: Any, name: str) -> int:
    """A size that may be 0 (tokens, queries, keys) as an int >= 0; non-ints are TypeErrors."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 0; got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value}")
    return int(value)


def check_sizes(n_q: Any, n_k: Any) -> tuple[int, int]:
    """(L, S) as ints >= 0; the key count defaults to the query count (self-attention)."""
    n_q = check_count(n_q, "n_q")
    return n_q, n_q if n_k is None else check_count(n_k, "n_k")


def check_scale(scale: Any, head_dim: int, dtype: Any = np.float64) -> float:
    """The softmax scale: 1/sqrt(E) by default (Vaswani et al. 2017, eq. 1), else the given finite number,
    which must also be finite in the compute dtype (1e40 is inf in float32, and every score with it)."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a number or None; got {scale!r} ({type(scale).__name__})")
    try:
        value = float(scale)
    except OverflowError:  # an int such as 10**400 has no float: past float64's largest, about 1.8e308
        raise ValueError("scale must be a finite number; got an int too large for a float (past 1.8e308)") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite number; got {scale}")
    largest = float(np.finfo(dtype).max)
    if abs(value) > largest:
        raise ValueError(
            f"scale={value:g} overflows {np.dtype(dtype)}, the dtype the scores are computed in (largest "
            f"{largest:.3g}): every score would be ±inf; pass a smaller scale or float64 inputs"
        )
    return value


class QKVShape(NamedTuple):
    """The sizes read off q (..., Hq, L, E), k (..., Hkv, S, E) and v (..., Hkv, S, Ev).

    2-D inputs (L, E) have no head axis: they count as one head, and the caller adds the axis back.
    """

    batch: tuple[int, ...]
    hq: int
    hkv: int
    n_q: int
    n_k: int
    e: int
    ev: int

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head h // group (0 heads on both sides: 1)."""
        return self.hq // self.hkv if self.hkv else 1


def check_qkv(q: Any, k: Any, v: Any, gqa_allowed: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape]:
    """Validate q, k, v against torch SDPA's shape contract (README, Conventions); return them with a head axis."""
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_ndim(x, name, 2, "(..., L or S, E)")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k and v must have the same number of dims; got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.ndim == 2:  # (L, E): one head without a head axis
        q, k, v = q[None], k[None], v[None]
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        raise ValueError(
            f"q, k and v must have the same batch dims (no broadcasting); got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dim E; got shapes {q.shape} and {k.shape}")
    if q.shape[-1] < 1:
        raise ValueError(f"q and k must have a head dim E of at least 1; got shape {q.shape}")
    if k.shape[-3:-1] != v.shape[-3:-1]:
        raise ValueError(f"k and v must have the same heads and keys (Hkv, S); got shapes {k.shape} and {v.shape}")
    hq, hkv = q.shape[-3], k.shape[-3]
    if (hkv == 0 and hq > 0) or (hkv > 0 and hq % hkv != 0):  # zero heads on both sides is empty, not wrong
        raise ValueError(
            f"the query heads Hq must be a multiple of the kv heads Hkv; got Hq={hq} (q {q.shape}) "
            f"and Hkv={hkv} (k {k.shape})"
        )
    if hq != hkv and not gqa_allowed:
        raise ValueError(f"q has {hq} heads and k, v have {hkv}: pass enable_gqa=True for grouped-query attention")
    dims = QKVShape(q.shape[:-3], hq, hkv, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
    return q, k, v, dims


def without_head_axis(q: Any) -> bool:
    """Whether q is one head without a head axis, (L, E); a ragged list gets the error that names q."""
    return bool(as_float_array(q, "q").ndim == 2)


def check_like(x: Any, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """x as a float array of exactly `shape` (what: the shape in symbols, for the message)."""
    x = as_float_array(x, name)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}; got shape {x.shape}")
    return x


def check_one_head(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, block_q: Any, block_k: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """One head's q (L, E), k (S, E), v (S, Ev) checked and in the compute dtype, with the scale; causal must
    be a bool and the block sizes positive ints (flash_attention_one_head and its backward)."""
    if not without_head_axis(q):
        raise ValueError(f"q must be one head (L, E); got shape {np.shape(q)}: use flash_attention for more heads")
    check_bool(causal, "causal")
    check_positive_int(block_q, "block_q")
    check_positive_int(block_k, "block_k")
    q, k, v, dims = check_qkv(q, k, v)
    ct = compute_dtype(q, k, v)
    return q[0].astype(ct), k[0].astype(ct), v[0].astype(ct), check_scale(scale, dims.e, ct)


def check_sinks(sinks: Any, hq: int, dtype: Any) -> np.ndarray | None:
    """The sink logits, one per query head (Hq,), finite in the compute dtype too (1e39 is inf in float32,
    and so would be every row's softmax); None stays None."""
    if sinks is None:
        return None
    sinks_array = plain_array(sinks, "sinks")
    if sinks_array.dtype.kind not in "fiu" or sinks_array.shape != (hq,) or not np.isfinite(sinks_array).all():
        raise ValueError(f"sinks must be {hq} finite numbers, one per query head (Hq,); got {sinks!r}")
    largest = float(np.finfo(dtype).max)
    if sinks_array.size and float(np.abs(sinks_array).max()) > largest:
        raise ValueError(
            f"sinks overflow {np.dtype(dtype)}, the dtype the scores are computed in (largest {largest:.3g}); "
            f"got {float(np.abs(sinks_array).max()):g}: pass smaller sinks or float64 inputs"
        )
    return sinks_array.astype(dtype)


def check_cu_seqlens(cu_seqlens: Any, name: str = "cu_seqlens") -> np.ndarray:
    """cu_seqlens as int64 (n + 1,), 0 first and never falling. Checked in a signed type: the differences
    of unsigned ints wrap around (uint16 [0, 3, 2] would rise by 3, then by 65535)."""
    cu = plain_array(cu_seqlens, name)
    if cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must be 1-D ints rising from 0 (0, n_0, n_0 + n_1, ...); got {cu_seqlens!r}")
    if cu.dtype.kind == "u" and int(cu.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must be ints that fit in int64; got {int(cu.max())}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"{name} must be 1-D ints rising from 0 (0, n_0, n_0 + n_1, ...); got {cu_seqlens!r}")
    return cu


SHARD_LAYOUTS = ("zigzag", "contiguous")  # how a sequence is cut over P processes (shards.py)


def check_layout(layout: Any) -> str:
    """layout, one of SHARD_LAYOUTS; anything else is a ValueError that lists them."""
    if layout not in SHARD_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(name) for name in SHARD_LAYOUTS)}; got {layout!r}")
    return str(layout)
