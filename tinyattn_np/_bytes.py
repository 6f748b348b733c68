"""Bytes: how many one element of a dtype takes, and how a byte count is written down.

Shared by the reference path's memory guard (_guard.py), the bills (memory.py, peaks.py, models.py) and
every table (report.py). Binary units (KiB, MiB, GiB: powers of 1024) and decimal units (KB, MB, GB:
powers of 1000) are never mixed in one figure.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from ._checks import check_count, check_positive_int, check_sizes

__all__ = [
    "DTYPES",
    "UNITS",
    "attention_sizes",
    "best_unit",
    "bytes_per_element",
    "float_bytes",
    "format_bytes",
    "nbytes",
    "to_unit",
]

# Bytes per element. int4 packs two values per byte, so sizes are Fractions and a total is rounded up
# to whole bytes only once, at the end (an odd count of int4 values still needs its last byte).
DTYPE_BYTES: dict[str, Fraction] = {
    "fp64": Fraction(8),
    "fp32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "int8": Fraction(1),
    "int4": Fraction(1, 2),
}
DTYPE_ALIASES: dict[str, str] = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}
DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)

BINARY_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
DECIMAL_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
UNITS: dict[str, int] = {**BINARY_UNITS, **DECIMAL_UNITS}


def bytes_per_element(dtype: Any) -> Fraction:
    """Bytes one element takes: fp64 8, fp32 4, fp16 2, bf16 2, fp8 1, int8 1, int4 1/2.

    dtype is a name ("bf16", "float32", ...) or a NumPy dtype (np.float16, np.dtype("int8"), or an
    extension type such as ml_dtypes.bfloat16, known by its name). The result is a Fraction so that
    int4 stays exact: Fraction(1, 2) == 0.5.
    """
    if isinstance(dtype, str):
        name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name not in DTYPE_BYTES:
            known = ", ".join([*DTYPES, *DTYPE_ALIASES])
            raise ValueError(f"dtype must be one of {known} or a NumPy dtype; got {dtype!r}")
        return DTYPE_BYTES[name]
    if dtype is None:  # np.dtype(None) would quietly mean float64
        raise TypeError("dtype must be a name such as 'bf16' or a NumPy dtype; got None")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dtype must be a name such as 'bf16' or a NumPy dtype; got {dtype!r} ({type(dtype).__name__})"
        ) from None
    if np_dtype.kind == "V" and np_dtype.name in DTYPE_ALIASES:  # ml_dtypes' bfloat16, float8: known by name
        return Fraction(np_dtype.itemsize)
    if np_dtype.kind not in "biufc":  # numbers only: an object or string array has no fixed size
        raise TypeError(f"dtype must be a numeric dtype; got {np_dtype}")
    return Fraction(np_dtype.itemsize)


def nbytes(elements: int, dtype: Any) -> int:
    """Whole bytes for `elements` values of dtype: ceil(elements · bytes_per_element)."""
    return math.ceil(elements * bytes_per_element(dtype))


def float_bytes(dtype: Any) -> tuple[Fraction, Fraction]:
    """(bytes of a float dtype attention accepts, bytes of the dtype its math runs in): fp16 computes in fp32."""
    size = bytes_per_element(dtype)  # raises for an unknown dtype
    name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) if isinstance(dtype, str) else np.dtype(dtype).name
    if DTYPE_ALIASES.get(name, name) not in ("fp16", "fp32", "fp64"):
        raise ValueError(f"dtype must be fp16, fp32 or fp64 (what attention() accepts); got {dtype!r}")
    return size, max(size, Fraction(4))


def attention_sizes(
    n_q: Any, n_k: Any, heads: Any, kv_heads: Any, head_dim: Any, head_dim_v: Any, batch: Any
) -> tuple[int, int, int, int, int, int, int]:
    """(L, S, Hq, Hkv, E, Ev, B) checked as attention checks its inputs; S defaults to L, Hkv to Hq, Ev to E."""
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    kv_heads = heads if kv_heads is None else check_positive_int(kv_heads, "kv_heads")
    if heads % kv_heads:
        raise ValueError(
            f"heads must be a multiple of kv_heads (query head h reads kv head h // G); got {heads} and {kv_heads}"
        )
    e = check_positive_int(head_dim, "head_dim")
    ev = e if head_dim_v is None else check_count(head_dim_v, "head_dim_v")  # Ev = 0 is empty, not wrong
    return n_q, n_k, heads, kv_heads, e, ev, check_positive_int(batch, "batch")


def to_unit(n_bytes: float, unit: str) -> float:
    """Bytes expressed in `unit` ("MiB", "GB", ...): to_unit(134_217_728, "MiB") == 128.0."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}; got {unit!r}")
    return n_bytes / UNITS[unit]


def best_unit(n_bytes: float, units: str = "binary") -> str:
    """The largest unit of the family ("binary" or "decimal") in which n_bytes is at least 1."""
    if units not in ("binary", "decimal"):
        raise ValueError(f"units must be 'binary' or 'decimal'; got {units!r}")
    family = BINARY_UNITS if units == "binary" else DECIMAL_UNITS
    chosen = "B"
    for name, size in family.items():
        if abs(n_bytes) >= size:
            chosen = name
    return chosen


def format_bytes(n_bytes: float, units: str = "binary", digits: int = 1) -> str:
    """'128.0 MiB' (binary) or '134.2 MB' (decimal); whole bytes print without decimals."""
    unit = best_unit(n_bytes, units)
    if unit == "B":
        return f"{n_bytes:,.0f} B"
    return f"{to_unit(n_bytes, unit):,.{digits}f} {unit}"
