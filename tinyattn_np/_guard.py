"""The memory guard: attention() and attention_backward() build (..., L, S) arrays, so before they allocate
anything they estimate their own peak from shapes and dtypes alone and refuse a call the machine cannot
hold (AttentionMemoryError), instead of swapping or being killed. The caches, the decoding steps, the
blockwise doors (flash_attention, flex_attention and their backwards: refuse_blockwise) and create_mask
refuse the same way (refuse_unless_fits). Every door measures against the memory this process can still
take: what the machine has available, and no more than its address-space limit leaves (ulimit -v).

The reference's estimates (reference_bytes, reference_backward_bytes) are exact models of what the two
functions allocate (tests/test_peaks.py and tests/test_backward.py check them against tracemalloc); peaks.py
writes them out term by term, as naive_attention_bytes and attention_backward_bytes, with the other peaks. The
blockwise doors' (blockwise_bytes) is an upper bound (tests/test__guard.py holds it above tracemalloc's).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Any

import numpy as np

from ._bytes import attention_sizes, float_bytes, format_bytes
from ._checks import QKVShape, check_bool, check_count, check_positive_int, check_window_is_causal

__all__ = [
    "AttentionMemoryError",
    "FALLBACK_MEMORY_BYTES",
    "blockwise_bytes",
    "meminfo_bytes",
    "memory_available",
    "memory_total",
    "mods_bytes",
    "reference_backward_bytes",
    "reference_bytes",
    "refuse_attention",
    "refuse_attention_backward",
    "refuse_blockwise",
    "refuse_if_too_big",
    "refuse_unless_fits",
    "sysconf_bytes",
]

try:
    import resource
except ImportError:  # not on Windows: no address-space limit to read there
    resource = None  # type: ignore[assignment]


# When the operating system does not say how much memory there is, assume this little, so that a
# guard built on it refuses too early rather than too late.
FALLBACK_MEMORY_BYTES = 2 * 1024**3
# What a blockwise call holds in Python objects beside its arrays (its items, tile lists, the pool's state).
BOOKKEEPING_BYTES = 2**20


class AttentionMemoryError(MemoryError):
    """A call refused, before allocating, to build arrays larger than the memory available: attention(),
    attention_backward(), a cache too large to preallocate, a decoding step."""


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    """A field of Linux's /proc/meminfo ("MemAvailable", "MemTotal") in bytes, or None elsewhere; with
    path="/proc/self/status", a field of this process ("VmSize": the address space it has mapped)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024  # the file counts in kB = 1024 bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


def sysconf_bytes(pages_name: str) -> int | None:
    """os.sysconf's count of pages (SC_AVPHYS_PAGES, SC_PHYS_PAGES) in bytes, or None where it has none."""
    try:
        pages, page_size = os.sysconf(pages_name), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def memory_available() -> int:
    """Bytes a new allocation can take without swapping: MemAvailable on Linux (free memory plus the
    page cache the kernel can drop), else os.sysconf's free pages, else FALLBACK_MEMORY_BYTES."""
    found = meminfo_bytes("MemAvailable") or sysconf_bytes("SC_AVPHYS_PAGES")
    return found or FALLBACK_MEMORY_BYTES


def memory_total() -> int:
    """The machine's physical memory in bytes (FALLBACK_MEMORY_BYTES where the OS does not say)."""
    found = meminfo_bytes("MemTotal") or sysconf_bytes("SC_PHYS_PAGES")
    return found or FALLBACK_MEMORY_BYTES


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (RLIMIT_AS, set by ulimit -v), or None
    where it has no limit (or the system does not say). An allocation past it fails whatever memory is free."""
    if resource is None:
        return None
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return None
    mapped = meminfo_bytes("VmSize", "/proc/self/status")
    return None if mapped is None else max(0, limit - mapped)


def memory_usable() -> int:
    """Bytes a new allocation of this process can take: memory_available(), or less under an address-space limit."""
    left = address_space_left()
    available = memory_available()
    return available if left is None else min(available, left)


def refuse_unless_fits(needed: int, who: str, what: str, change: str) -> None:
    """Raise AttentionMemoryError, before anything is allocated, when `needed` bytes exceed memory_usable():
    the message says what `who` would allocate (`what`), what is free, and what to `change`."""
    usable = memory_usable()
    if needed > usable:
        raise AttentionMemoryError(
            f"{who} would allocate {format_bytes(needed)} at its peak ({what}), but only {format_bytes(usable)} "
            f"of memory is available: {change}"
        )


def refuse_if_too_big(needed: int, who: str, what: str, instead: str) -> None:
    """Raise AttentionMemoryError when `needed` bytes exceed the memory this process can take now
    (memory_usable); `instead` names the blockwise function that gives the same result without the L x S arrays."""
    available = memory_usable()
    if needed > available:
        raise AttentionMemoryError(
            f"{who} would allocate {format_bytes(needed)} at its peak ({what}), but only "
            f"{format_bytes(available)} of memory is available. {instead} gives the same result without "
            "building that matrix; pass check_memory=False to try anyway."
        )


def reference_bytes(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    kv_heads: int | None = None,
    batch: int = 1,
    dtype: Any = "fp32",
    causal: bool = False,
    bool_mask: bool = False,
    mask_elements: int | None = None,
    window: int | None = None,
) -> int:
    """peaks.naive_attention_bytes, which writes the model out term by term: attention()'s peak."""
    n_q, n_k, heads, kv_heads, e, ev, batch = attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    size, compute = float_bytes(dtype)
    rows = batch * heads * n_q  # query rows over all heads
    q_s = rows * e * compute
    copies = batch * kv_heads * n_k * (e + ev) * compute if size < compute else 0
    scores = rows * n_k * compute
    causal = check_bool(causal, "causal")
    blocked = n_q * n_k if causal else 0
    if window is not None:
        check_positive_int(window, "window")
        check_window_is_causal(window, causal)
    edge = blocked if window is not None else 0
    mask_elements = n_q * n_k if mask_elements is None else check_count(mask_elements, "mask_elements")
    inverted_mask = mask_elements if check_bool(bool_mask, "bool_mask") else 0
    out = rows * ev * (compute + (size if size < compute else 0))
    beside_scores = max(q_s, Fraction(inverted_mask), Fraction(blocked + edge), blocked + out)  # one at a time
    return math.ceil(copies + scores + beside_scores)


def reference_backward_bytes(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    kv_heads: int | None = None,
    batch: int = 1,
    dtype: Any = "fp32",
    causal: bool = False,
    bool_mask: bool = False,
    mask_elements: int | None = None,
    window: int | None = None,
) -> int:
    """peaks.attention_backward_bytes, which writes the model out step by step: attention_backward()'s peak."""
    n_q, n_k, heads, kv_heads, e, ev, batch = attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    size, compute = float_bytes(dtype)
    rows = batch * heads * n_q
    copies = (rows * (e + ev) + batch * kv_heads * n_k * (e + ev)) * compute if size < compute else Fraction(0)
    forward = reference_bytes(
        n_q,
        n_k,
        heads=heads,
        head_dim=e,
        head_dim_v=ev,
        kv_heads=kv_heads,
        batch=batch,
        dtype=f"fp{8 * compute}",
        causal=causal,
        bool_mask=bool_mask,
        mask_elements=mask_elements,
        window=window,
    )
    weights, o = rows * n_k * compute, rows * ev * compute
    dv, dk = batch * kv_heads * n_k * ev * compute, batch * kv_heads * n_k * e * compute
    step_2 = weights + o + batch * heads * n_k * ev * compute + dv
    step_3 = 2 * weights + o + dv
    step_5 = weights + o + dv + rows * e * compute + batch * heads * n_k * e * compute + dk
    return math.ceil(copies + max(Fraction(forward), step_2, step_3, step_5))


def refuse_attention(dims: QKVShape, dtype: np.dtype, rules: Any) -> None:
    """Refuse, before allocating, an attention() whose peak (reference_peak: the score matrix, its masks and
    the output, and the mods') does not fit in the memory that is available. It reads shapes and dtypes only,
    so it runs before anything is converted or built. rules: attention.ScoreRules (masks, band and mods)."""
    if int(np.prod(dims.batch, dtype=np.int64)) == 0 or dims.hq == 0:
        return  # no query head at all: nothing the size of the scores is made
    needed = reference_peak(dims, dtype, rules, backward=False)
    scores = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
    refuse_if_too_big(needed, "attention()", f"score matrix {scores}", instead="flash_attention()")


def refuse_attention_backward(dims: QKVShape, dtype: np.dtype, rules: Any) -> None:
    """Refuse, on shapes and dtypes alone, an attention_backward() whose peak does not fit in memory."""
    if int(np.prod(dims.batch, dtype=np.int64)) == 0 or dims.hq == 0:
        return
    needed = reference_peak(dims, dtype, rules, backward=True)
    scores = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
    refuse_if_too_big(needed, "attention_backward()", f"two arrays of {scores}", "flash_attention_backward()")


def reference_peak(dims: QKVShape, dtype: np.dtype, rules: Any, *, backward: bool) -> int:
    """reference_bytes (backward: reference_backward_bytes) for checked shapes, their dtype and the rules, and
    what the mods add (mods_bytes: two arrays of the scores' size for a score_mod forward, five backward)."""
    mask = rules.mask
    inverted = mask.size if mask is not None and mask.dtype == np.bool_ else None  # ~mask: a bool mask's size
    peak = reference_backward_bytes if backward else reference_bytes
    mods = mods_bytes(dims, dtype, rules, score_arrays=5 if backward else 2)
    return mods + peak(
        dims.n_q,
        dims.n_k,
        heads=dims.hq,
        kv_heads=dims.hkv,
        head_dim=dims.e,
        head_dim_v=dims.ev,
        batch=int(np.prod(dims.batch, dtype=np.int64)),
        dtype=dtype,
        causal=rules.offset is not None,
        bool_mask=inverted is not None,
        mask_elements=inverted,
        window=rules.window,
    )


def mods_bytes(dims: QKVShape, dtype: np.dtype, rules: Any, score_arrays: int) -> int:
    """What the mods add beside the scores, at most, for the ready-made mods (mods.py): `score_arrays` arrays
    of the scores' size for a score_mod (what it makes: a distance and a bias, or the new scores; in the
    backward the raw scores again and the derivative), and for a mask_mod its bools and their inverse, counted
    at the scores' shape (smaller when the mask_mod does not depend on b or h). A mod of your own may make
    more: the guard then refuses too late."""
    elements = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq * dims.n_q * dims.n_k  # the scores'
    compute = max(np.dtype(dtype).itemsize, 4)  # float16 is computed in float32
    score_mod = score_arrays * elements * compute if rules.score_mod is not None else 0
    return score_mod + (2 * elements if rules.mask_mod is not None else 0)


def blockwise_bytes(
    dims: QKVShape, stored: Any, compute: Any, plan: Any, *, heads_per_step: int = 1, backward: bool = False
) -> int:
    """An upper bound on the bytes that flash_attention and flex_attention (backward=False) or their backwards
    allocate for inputs that exist, from shapes, dtypes and the plan's tiles and workers alone. With R = B·Hq·L
    query rows, K = B·Hkv·S key rows, c the compute dtype's bytes and s the stored dtype's:

        forward   k, v in the compute dtype K·(E + Ev)·c; out and lse R·(Ev + 1)·c, out cast back R·Ev·s;
                  per worker one item: the G·bq queries of heads_per_step kv heads (q, the sums, m, l:
                  E + Ev + 2 each) and three score tiles of G·bq x bk (the tile and a mod's temporaries)
        backward  k, v as above; q·scale, dout, out in c and D, lse, the row sums: R·(E + 2·Ev + 3)·c; dq R·E·c;
                  each query head's dk, dv B·Hq·S·(E + Ev)·c and their sums over the group K·(E + Ev)·c;
                  the results cast back (R·E + K·(E + Ev))·s; per worker a key block's column of tiles for
                  heads_per_step heads: L rows of five bk-wide tiles and of E + Ev each
    and BOOKKEEPING_BYTES for the Python objects of the plan (its items, tile lists, the thread pool's state).
    The casts are counted whether or not they copy: a bound, never short of the peak (a mod of your own that
    makes more than two arrays of a tile's size excepted)."""
    c, s = np.dtype(compute).itemsize, np.dtype(stored).itemsize
    rows = math.prod(dims.batch) * dims.hq * dims.n_q
    key_rows = math.prod(dims.batch) * dims.hkv * dims.n_k
    e, ev, bk = dims.e, dims.ev, min(plan.block_k, max(dims.n_k, 1))
    kv = key_rows * (e + ev) * c
    if not backward:
        queries = heads_per_step * dims.group * min(plan.block_q, max(dims.n_q, 1))  # one item's query columns
        item = queries * (e + ev + 2 + 3 * bk) * c
        return kv + rows * (ev + 1) * c + rows * ev * s + plan.workers * item + BOOKKEEPING_BYTES
    per_head_grads = math.prod(dims.batch) * dims.hq * dims.n_k * (e + ev) * c
    column = dims.n_q * (5 * bk + e + ev) * c
    query_side = rows * (e + 2 * ev + 3) * c + rows * e * c
    casts = (rows * e + key_rows * (e + ev)) * s
    return 2 * kv + query_side + per_head_grads + casts + plan.workers * heads_per_step * column + BOOKKEEPING_BYTES


def refuse_blockwise(
    who: str, q: Any, k: Any, v: Any, dims: QKVShape, plan: Any, *, heads_per_step: int = 1, backward: bool = False
) -> None:
    """AttentionMemoryError before a blockwise door (flash_attention, flex_attention, their backwards)
    allocates anything, when blockwise_bytes does not fit in the memory this process can take."""
    compute = np.result_type(q, k, v, np.float32)  # float16 is computed in float32
    needed = blockwise_bytes(
        dims, np.result_type(q, k, v), compute, plan, heads_per_step=heads_per_step, backward=backward
    )
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape} of {np.result_type(q, k, v)}"
    what = ("the gradients, their per-head sums" if backward else "out, lse") + f" and {plan.workers} workers' tiles"
    refuse_unless_fits(needed, who, f"{what}, for {shapes}", "lower the batch, the heads or the tokens, or workers=")
