"""The caches' buffers: what KVCache (kvcache.py) and PagedKVCache (paged.py) share besides the algorithm.

Their dtype and the values stored apart or as the keys' first numbers (KeysAndValues), the views of the
buffers a caller cannot make writable (read_only_view), the refusal before a cache preallocates more than
the memory available, and copy.deepcopy and pickle without the cache's lock (CopiedWithoutLock).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ._checks import ACCEPTED_DTYPES, check_positive_int
from ._guard import refuse_unless_fits

__all__ = [
    "CopiedWithoutLock",
    "KeysAndValues",
    "ReadOnlyBuffer",
    "check_cache_dtype",
    "check_value_prefix",
    "check_values_are_prefix",
    "read_only_view",
    "refuse_cache_beyond_memory",
]


def check_cache_dtype(dtype: Any) -> np.dtype:
    """A cache's dtype: float16, float32 or float64 (what its k and v must have); anything else is a
    TypeError."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype!r}") from None
    if dtype not in ACCEPTED_DTYPES:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype}")
    return dtype


class ReadOnlyBuffer:
    """What NumPy reads a read-only view from: np.asarray(ReadOnlyBuffer(array)) shares array's memory, and
    its base is this object, which offers NumPy no writable buffer, so the view's WRITEABLE flag cannot be set
    back to True (a plain view's can, while its base is writable)."""

    __slots__ = ("_array",)

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    @property
    def __array_interface__(self) -> dict[str, Any]:
        interface = dict(self._array.__array_interface__)  # a new dict each time: editing one changes nothing
        interface["data"] = (interface["data"][0], True)  # (address, read-only)
        return interface


def read_only_view(array: np.ndarray) -> np.ndarray:
    """A view of array that its holder cannot make writable (see ReadOnlyBuffer)."""
    return np.asarray(ReadOnlyBuffer(array))


def refuse_cache_beyond_memory(
    who: str, shape: tuple[int, ...], dtype: np.dtype, change: str, extra: int = 0, value_prefix: int | None = None
) -> None:
    """AttentionMemoryError before a cache preallocates its keys and values, two arrays of `shape` (with
    value_prefix: the keys alone, the values a view of them), and `extra` bytes of bookkeeping, if they do
    not fit in the memory available."""
    if value_prefix is None:
        arrays, what = 2, f"keys and values, each {shape} of {dtype}"
    else:
        arrays, what = 1, f"keys {shape} of {dtype}, the values a view of their first {value_prefix} numbers"
    refuse_unless_fits(arrays * math.prod(shape) * dtype.itemsize + extra, who, what, change)


def check_value_prefix(value_prefix: Any, head_dim: int) -> int | None:
    """value_prefix: None (values of their own, as wide as the keys) or an int 1 .. head_dim, the keys' first
    numbers that are also the values."""
    if value_prefix is None:
        return None
    value_prefix = check_positive_int(value_prefix, "value_prefix")
    if value_prefix > head_dim:
        raise ValueError(
            f"value_prefix must be at most head_dim={head_dim} (the values are the keys' first value_prefix "
            f"numbers); got {value_prefix}"
        )
    return value_prefix


def check_values_are_prefix(k: np.ndarray, v: np.ndarray, value_prefix: int | None) -> None:
    """With value_prefix, v must equal k's first value_prefix numbers (what a cache that stores keys only
    gives back as values); a ValueError otherwise. v's shape has been checked."""
    if value_prefix is not None and not np.array_equal(v, k[..., :value_prefix], equal_nan=True):
        raise ValueError(
            f"v must be k's first value_prefix={value_prefix} numbers (k[..., :{value_prefix}]): this cache stores "
            "the keys only and reads its values from them; got values that differ"
        )


class CopiedWithoutLock:
    """copy.deepcopy and pickle for a cache that holds `self.lock` (a threading.RLock, which cannot be
    copied): everything but the lock, and the copy gets a lock of its own. Copy a cache while no other thread
    changes it: the buffers are read after __getstate__ returns."""

    lock: threading.RLock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()


class KeysAndValues:
    """The buffers both caches keep: keys `_k`, and values `_v` of their own, or None where the values are the
    keys' first value_prefix numbers (stored once)."""

    head_dim: int
    value_prefix: int | None
    _k: np.ndarray
    _v: np.ndarray | None

    @property
    def value_dim(self) -> int:
        """Numbers in each value: value_prefix, or head_dim where the values are stored apart."""
        return self.head_dim if self.value_prefix is None else self.value_prefix

    @property
    def _values(self) -> np.ndarray:
        """The value buffer (..., Ev), shaped as the keys' buffer: its own array, or a view of the keys' first
        value_prefix numbers. Made on each use, never stored: a copy or a pickle of the cache then keeps
        values that are its keys."""
        return self._k[..., : self.value_prefix] if self._v is None else self._v
