"""The memory and compute bill of attention, before anything runs: exact integer bytes and FLOPs.

Everything here is a pure function of sizes. Nothing is formatted: report.py turns bytes into
"128.0 MiB" or "134.2 MB". The numbers the two source articles quote come out of these functions:

    score matrix, one head, one layer, n = 8,192, fp16:   8,192² · 2 B = 134,217,728 B (134.2 MB, 128 MiB)
    ... times 32 heads and 32 layers (Llama-3-8B):          137,438,953,472 B (137.4 GB, 128 GiB)
    KV cache per token, Llama-3-8B in bf16:                 2 · 32 · 8 · 128 · 2 B = 131,072 B

Model shapes (presets, config.json) and a model's whole bill live in models.py.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Any

import numpy as np

from ._checks import check_count, check_positive_int, check_sizes
from .flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, default_tiles

# Bytes per element. int4 packs two values per byte, so sizes are Fractions and a total is rounded up
# to whole bytes only once, at the end (an odd count of int4 values still needs its last byte).
_DTYPE_BYTES: dict[str, Fraction] = {
    "fp64": Fraction(8),
    "fp32": Fraction(4),
    "fp16": Fraction(2),
    "bf16": Fraction(2),
    "fp8": Fraction(1),
    "int8": Fraction(1),
    "int4": Fraction(1, 2),
}
_DTYPE_ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "e4m3": "fp8", "e5m2": "fp8",
}  # fmt: skip
DTYPES: tuple[str, ...] = tuple(_DTYPE_BYTES)


# ---------------------------------------------------------------------------------------------------
# argument checks (each error names the argument, what it wanted and what came)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")
    return bool(value)


def _nbytes(elements: int, dtype: Any) -> int:
    """Whole bytes for `elements` values of dtype: ceil(elements · bytes_per_element)."""
    return math.ceil(elements * bytes_per_element(dtype))


# ---------------------------------------------------------------------------------------------------
# the basic estimates


def bytes_per_element(dtype: Any) -> Fraction:
    """Bytes one element takes: fp64 8, fp32 4, fp16 2, bf16 2, fp8 1, int8 1, int4 1/2.

    dtype is a name ("bf16", "float32", ...) or a NumPy dtype (np.float16, np.dtype("int8"), ...).
    The result is a Fraction so that int4 stays exact: Fraction(1, 2) == 0.5.
    """
    if isinstance(dtype, str):
        name = dtype.lower()
        name = _DTYPE_ALIASES.get(name, name)
        if name not in _DTYPE_BYTES:
            known = ", ".join([*DTYPES, *_DTYPE_ALIASES])
            raise ValueError(f"dtype must be one of {known} or a NumPy dtype; got {dtype!r}")
        return _DTYPE_BYTES[name]
    if dtype is None:  # np.dtype(None) would quietly mean float64
        raise TypeError("dtype must be a name such as 'bf16' or a NumPy dtype; got None")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dtype must be a name such as 'bf16' or a NumPy dtype; got {dtype!r} ({type(dtype).__name__})"
        ) from None
    if np_dtype.kind not in "biufc":  # numbers only: an object or string array has no fixed size
        raise TypeError(f"dtype must be a numeric dtype; got {np_dtype}")
    return Fraction(np_dtype.itemsize)


def score_matrix_bytes(
    n_q: int, n_k: int | None = None, *, heads: int = 1, layers: int = 1, batch: int = 1, dtype: Any = "fp16"
) -> int:
    """Bytes of the attention score matrices if all were materialised at once.

        bytes = batch · layers · heads · L · S · bytes_per_element

    One head, one layer, L = S = 8,192 in fp16: 67,108,864 entries, 134,217,728 B.
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    layers = check_positive_int(layers, "layers")
    batch = check_positive_int(batch, "batch")
    return _nbytes(batch * layers * heads * n_q * n_k, dtype)


def kv_cache_bytes(
    tokens: int,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any = "bf16",
    batch: int = 1,
    window: int | None = None,
) -> int:
    """Bytes of the key/value cache after `tokens` tokens.

        bytes = 2 (k and v) · layers · kv_heads · head_dim · min(tokens, window) · batch · bytes_per_element

    A sliding window of W tokens means only the last W keys and values are ever read again, so a
    rolling cache keeps at most W of them. Grouped-query attention shows up as kv_heads < heads.
    """
    tokens = check_count(tokens, "tokens")
    layers = check_positive_int(layers, "layers")
    kv_heads = check_positive_int(kv_heads, "kv_heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    batch = check_positive_int(batch, "batch")
    window = None if window is None else check_positive_int(window, "window")
    kept = tokens if window is None else min(tokens, window)
    return _nbytes(2 * layers * kv_heads * head_dim * kept * batch, dtype)


def causal_entries(n_q: int, n_k: int | None = None, *, window: int | None = None) -> int:
    """How many of the L x S scores a causal mask keeps, with bottom-right alignment (masks.py).

    Query i sees key j when j <= i + (S - L), so row i keeps clip(i + S - L + 1, 0, S) keys:

        L <= S:  L · (S - L) + L (L + 1) / 2     (every row sees the S - L cached keys, then a triangle)
        L >  S:  S (S + 1) / 2                   (the first L - S rows see nothing)

    For L == S that is L (L + 1) / 2: a little more than half. A sliding window of W also hides the keys
    j <= i + S - L - W, max(i + S - L + 1 - W, 0) of them in row i, so each row keeps at most W:
    about L · W entries in all, linear in L, where the plain causal count grows like L².
    """
    n_q, n_k = check_sizes(n_q, n_k)
    if n_q <= n_k:
        kept = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2
    else:
        kept = n_k * (n_k + 1) // 2
    if window is None:
        return kept
    window = check_positive_int(window, "window")
    # row i hides a_i = i + S - L + 1 - W keys when a_i > 0; a_i runs from S - L + 1 - W to S - W
    first, last = max(n_k - n_q + 1 - window, 1), n_k - window
    hidden = (first + last) * (last - first + 1) // 2 if last >= first else 0
    return kept - hidden


def attention_flops(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    causal: bool = False,
    batch: int = 1,
    head_dim_v: int | None = None,
    window: int | None = None,
) -> int:
    """FLOPs of the two matmuls of attention, QKᵀ and PV, counting a multiply-add as 2 FLOPs.

        flops = batch · heads · entries · 2 (E + Ev)       entries = L · S, or causal_entries(L, S, window=W)

    window (needs causal=True): a sliding window of W keys, counted as a band-aware kernel skips the rest.

    Each kept score costs E multiply-adds in QKᵀ and Ev in PV. causal=True counts exactly the unmasked
    entries (what a mask-aware kernel computes), not L · S / 2. Softmax's few FLOPs per entry are left
    out, as in the usual 4·L·S·E estimate (FlashAttention-2 paper, section 4.1).
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    batch = check_positive_int(batch, "batch")
    causal = _check_bool(causal, "causal")
    if window is not None and not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window looks back from each query)")
    entries = causal_entries(n_q, n_k, window=window) if causal else n_q * n_k
    return batch * heads * entries * 2 * (head_dim + head_dim_v)


# ---------------------------------------------------------------------------------------------------
# peak memory of this project's two attention paths (tests/test_memory.py checks them with tracemalloc)


def _compute_dtype(dtype: Any) -> tuple[Fraction, Fraction]:
    """(bytes of the input dtype, bytes of the dtype the math runs in): fp16 is computed in fp32."""
    size = bytes_per_element(dtype)  # raises for an unknown dtype
    if isinstance(dtype, str):
        floating = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) in ("fp16", "fp32", "fp64")
    else:
        floating = np.dtype(dtype) in (np.float16, np.float32, np.float64)
    if not floating:
        raise ValueError(f"dtype must be fp16, fp32 or fp64 (what attention() accepts); got {dtype!r}")
    return size, max(size, Fraction(4))


def _attention_sizes(
    n_q: Any, n_k: Any, heads: Any, kv_heads: Any, head_dim: Any, head_dim_v: Any, batch: Any
) -> tuple[int, int, int, int, int, int, int]:
    """(L, S, Hq, Hkv, E, Ev, B) checked; S defaults to L, Hkv to Hq, Ev to E."""
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    kv_heads = heads if kv_heads is None else check_positive_int(kv_heads, "kv_heads")
    e = check_positive_int(head_dim, "head_dim")
    ev = e if head_dim_v is None else check_count(head_dim_v, "head_dim_v")  # Ev = 0 is empty, not wrong
    return n_q, n_k, heads, kv_heads, e, ev, check_positive_int(batch, "batch")


def naive_attention_bytes(
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
    """Peak bytes that attention() (attention.py) allocates, for q, k, v (and a mask) that already exist.

    With B = batch, c = bytes of the compute dtype (fp32 for fp16 inputs), the arrays alive at once:

        q_s       B·Hq·L·E·c    q times the scale, in the compute dtype
        scores    B·Hq·L·S·c    the score matrix, made into the weights in place (softmax_)
        blocked   L·S           bool, causal=True: which keys each query may not see (held to the end)
        edge      L·S           bool, window=W: the keys behind the window, a temporary or-ed into blocked
        ~mask     M             bool, bool_mask=True: a temporary of the mask's M = mask_elements entries
                                (default L·S, an (L, S) mask), freed before the softmax: it overlaps
                                scores but not out. A float mask is added chunk by chunk: no copy.
        out       B·Hq·L·Ev·c   weights @ v
        fp16 only: fp32 copies of k, v (B·Hkv·S·(E + Ev)·4) and the fp16 copy of out

        peak = q_s + copies + scores + max(~mask, blocked + edge, blocked + out + out_fp16)

    A window changes no other array: the reference still builds all L x S scores (flash_attention is
    the path whose work shrinks to L·W).

    softmax_'s per-row max and sum (B·Hq·L each) are left out: they are gone before out exists.
    """
    sizes = _attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    size, compute = _compute_dtype(dtype)
    rows = batch * heads * n_q  # query rows over all heads
    q_s = rows * e * compute
    copies = batch * kv_heads * n_k * (e + ev) * compute if size < compute else 0
    scores = rows * n_k * compute
    causal = _check_bool(causal, "causal")
    blocked = n_q * n_k if causal else 0
    if window is not None:
        check_positive_int(window, "window")
        if not causal:
            raise ValueError(f"window={window!r} needs causal=True, as in attention()")
    edge = blocked if window is not None else 0
    mask_elements = n_q * n_k if mask_elements is None else check_count(mask_elements, "mask_elements")
    inverted_mask = mask_elements if _check_bool(bool_mask, "bool_mask") else 0
    out = rows * ev * (compute + (size if size < compute else 0))
    after_scores = max(Fraction(inverted_mask), Fraction(blocked + edge), blocked + out)  # temporaries die before out
    return math.ceil(q_s + copies + scores + after_scores)


def flash_attention_bytes(
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
    block_q: int | None = None,
    block_k: int | None = None,
    workers: int | None = None,
    kv_heads_per_step: int | None = None,
) -> int:
    """Peak bytes that flash_attention() (flash.py) allocates, for q, k, v that already exist.

    With B = batch, c = bytes of the compute dtype, G = Hq / Hkv, bq = min(block_q, L),
    bk = min(block_k, S), and n = h·G·bq the query rows of one tile step (h kv heads per step;
    block sizes and h default as in flash_attention, flash.default_tiles):

        out, lse  B·Hq·L·(Ev + 1)·c
        per busy worker, while the tiles run (min(workers, ⌈B·Hkv / h⌉·⌈L / block_q⌉) workers):
                  n·E·c             the step's queries times the scale, transposed
                  n·bk·c            the score tile, reused for every key block
                  2·n·Ev·c          acc, and the tile's exp(s) @ v before it is added to acc
                  8·n·c             per-row vectors: m, l, the tile's max and sum, m', alpha, ...
                  causal=True: bq·bk bool, the mask of a tile the diagonal crosses, and the buffers
                  NumPy's ufunc uses to build it from two broadcast int64 ranges (2·8·8,192 B)
        fp16 only: fp32 copies of k and v, B·Hkv·S·(E + Ev)·4, and after the tiles (when the
                   workers' buffers are gone) the fp16 copy of out, B·Hq·L·Ev·2 (lse stays fp32)

        peak = out + lse + copies of k, v + max(busy · per worker, fp16 copy of out)

    Nothing is L x S: it grows like (L + S)·E. workers defaults to the CPU count, as in
    flash_attention. The busy workers are counted as if they all held their buffers at once, which
    they do once a call lasts a few milliseconds; a tiny call may finish before a second thread
    starts, and then it measures less. Python's bookkeeping (one small tuple per work item) is left out.
    """
    sizes = _attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    group = heads // kv_heads if kv_heads else 1
    if block_q is not None:
        block_q = check_positive_int(block_q, "block_q")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    block_q, block_k, auto_heads = default_tiles(n_q, n_k, group, block_q=block_q, block_k=block_k)
    per_step = check_positive_int(kv_heads_per_step, "kv_heads_per_step", default=auto_heads)
    workers = check_positive_int(workers, "workers", default=os.cpu_count() or 1)
    size, compute = _compute_dtype(dtype)
    rows = batch * heads * n_q  # query rows over all heads
    copies = batch * kv_heads * n_k * (e + ev) * compute if size < compute else 0
    held = rows * (ev + 1) * compute  # out, lse
    cast_back = rows * ev * size if size < compute else 0  # fp16 out
    bq, bk = min(block_q, n_q), min(block_k, n_k)
    h = min(per_step, batch * kv_heads)
    n = h * group * bq  # query rows of one tile step
    busy = min(workers, -(-batch * kv_heads // max(h, 1)) * -(-n_q // block_q))  # a worker takes whole items
    per_worker = n * (e + bk + 2 * ev + 8) * compute if n_k else 0
    if _check_bool(causal, "causal") and n_k:
        # the ufunc buffers: 2 operands x 8 B, at most getbufsize() elements each (NumPy's default 8,192)
        per_worker += bq * bk + 2 * 8 * min(bq * bk, np.getbufsize())
    return math.ceil(copies + held + max(busy * per_worker, cast_back))


# ---------------------------------------------------------------------------------------------------
# the backward (backward.py): FLOPs and the blockwise backward's peak


def attention_backward_flops(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    causal: bool = False,
    batch: int = 1,
    head_dim_v: int | None = None,
) -> int:
    """FLOPs of the five matmuls of attention's backward, counting a multiply-add as 2 FLOPs.

        flops = batch · heads · entries · 2 (3E + 2Ev)      entries as in attention_flops

    Per kept score: S = Q Kᵀ again (E), dV += Pᵀ dO (Ev), dP = dO Vᵀ (Ev), dQ += dS K (E),
    dK += dSᵀ Q (E). With Ev = E that is 2.5x the forward's 2 (E + Ev) (FlashAttention-2 paper, section 4.1).
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    batch = check_positive_int(batch, "batch")
    entries = causal_entries(n_q, n_k) if _check_bool(causal, "causal") else n_q * n_k
    return batch * heads * entries * 2 * (3 * head_dim + 2 * head_dim_v)


def flash_attention_backward_bytes(
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
    block_q: int | None = DEFAULT_BLOCK_Q,
    block_k: int | None = DEFAULT_BLOCK_K,
    workers: int | None = None,
) -> int:
    """Peak bytes that flash_attention_backward() (backward.py) allocates, for q, k, v, out, dout, lse
    that already exist.

    With B = batch, c = bytes of the compute dtype, rows = B·Hq·L, bq = min(block_q, L), bk = min(block_k, S):

        q_s, dq            2·rows·E·c               q times the scale, and dq
        dk, dv per head    B·Hq·S·(E + Ev)·c        each query head fills its own (the result when G = 1)
        D, lse             2·rows·c                 rowsum(dO ∘ O), and lse with -inf made +inf
        per busy worker (min(workers, B·Hq·⌈S / block_k⌉): an item is one key block of one head):
                           2·bq·bk·c                the tile of P and the tile of dP (then dS)
                           max(bq·E, bk·max(E, Ev))·c  one matmul's product before it is added
                           causal=True: bq·bk bool and NumPy's ufunc buffers, as in the forward
        G > 1, after the tiles: the group sums dk, dv  B·Hkv·S·(E + Ev)·c
        fp16 only: fp32 copies of k, v (B·Hkv·S·(E + Ev)·4) and of dout, out (2·rows·Ev·4); after the
                   tiles, fp16 copies of dq, dk, dv (rows·E + B·Hkv·S·(E + Ev))·2

        peak = the arrays held + max(busy · per worker, group sums + fp16 copies)

    Nothing is L x S: O((L + S)·E), about 4 (L + S)·E·c for one head of fp32 (q_s, dq, dk, dv).
    """
    sizes = _attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    block_q = check_positive_int(block_q, "block_q", default=DEFAULT_BLOCK_Q)  # None: the backward's default
    block_k = check_positive_int(block_k, "block_k", default=DEFAULT_BLOCK_K)
    workers = check_positive_int(workers, "workers", default=os.cpu_count() or 1)
    size, compute = _compute_dtype(dtype)
    low = size < compute
    rows = batch * heads * n_q
    kv_elements = batch * kv_heads * n_k * (e + ev)  # k and v, or dk and dv
    held = (2 * rows * e + batch * heads * n_k * (e + ev) + 2 * rows) * compute
    copies = (kv_elements + 2 * rows * ev) * compute if low else 0
    bq, bk = min(block_q, n_q), min(block_k, n_k)
    busy = min(workers, batch * heads * -(-n_k // block_k))  # an item is one key block of one head
    per_worker = (2 * bq * bk + max(bq * e, bk * max(e, ev))) * compute if bq and bk else 0
    if _check_bool(causal, "causal") and bq and bk:
        per_worker += bq * bk + 2 * 8 * min(bq * bk, np.getbufsize())
    group_sums = kv_elements * compute if heads > kv_heads else 0
    cast_back = (rows * e + kv_elements) * size if low else 0
    return math.ceil(held + copies + max(busy * per_worker, group_sums + cast_back))


# ---------------------------------------------------------------------------------------------------
# ring attention (ring.py): what each of P devices holds and sends


def ring_attention_bytes(
    tokens: int,
    devices: int,
    *,
    kv_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
    layers: int = 1,
    batch: int = 1,
    dtype: Any = "fp32",
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    workers: int = 1,
) -> dict[str, int]:
    """Bytes per device when `tokens` are split evenly over `devices` and the K/V blocks go round a ring.

    With t = T / P tokens per device and b = bytes_per_element(dtype) (K/V travel in their own dtype):

        block         B·Hkv·t·(E + Ev)·b      one layer's K/V shard: what one ring step sends and receives
        kv_shards     layers · block          the K/V a device keeps for every layer
        in_flight     2 · block               send_buf (the block in hand, also being sent) and recv_buf
        score_tile    workers · bq · bk · c   flash's score tile, bq = min(block_q, t); c = max(b, 4 B):
                                              16-bit inputs are computed in fp32
        steps         P - 1                   per layer: the last block needs no passing on
        sent_total    layers · (P - 1) · block, and as much received

    ring_attention's RingStats report exactly block per step and (P - 1) · block per layer.
    """
    tokens = check_count(tokens, "tokens")
    devices = check_positive_int(devices, "devices")
    if tokens % devices:
        raise ValueError(f"tokens must split evenly over the devices; got tokens={tokens:,} and devices={devices}")
    kv_heads = check_positive_int(kv_heads, "kv_heads")
    e = check_positive_int(head_dim, "head_dim")
    ev = e if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    layers = check_positive_int(layers, "layers")
    batch = check_positive_int(batch, "batch")
    block_q = check_positive_int(block_q, "block_q")
    block_k = check_positive_int(block_k, "block_k")
    workers = check_positive_int(workers, "workers")
    size = bytes_per_element(dtype)
    per_device = tokens // devices
    block = _nbytes(batch * kv_heads * per_device * (e + ev), dtype)
    tile = workers * min(block_q, per_device) * min(block_k, per_device) * max(size, Fraction(4))
    return {
        "tokens_per_device": per_device,
        "block": block,
        "kv_shards": layers * block,
        "in_flight": 2 * block,
        "score_tile": math.ceil(tile),
        "steps": devices - 1,
        "sent_per_step": block,
        "sent_total": layers * (devices - 1) * block,
    }
