"""Peak memory of this project's own attention functions, before they run: exact integer bytes, each
a model of what one function allocates, checked against tracemalloc in the tests (tests/test_peaks.py,
tests/test_backward.py). memory.py holds the formulas true of any implementation; this file holds ours.

    naive_attention_bytes            attention()                 the L x S score matrix and its masks
    attention_backward_bytes         attention_backward()        two L x S arrays, P and dS
    flash_attention_bytes            flash_attention()           out, lse, and per worker one tile step
    flash_attention_backward_bytes   flash_attention_backward()  dq, dk, dv, and per worker two tiles
    ring_attention_bytes             ring_attention()            per device: its shard and two K/V blocks
    sequence_parallel_bytes          ring.py, ulysses.py         per device: the bytes sent, forward and backward

The memory guard (_guard.py) runs the first two's arithmetic before attention() and attention_backward() allocate.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from ._bytes import attention_sizes, bytes_per_element, float_bytes, nbytes
from ._checks import QKVShape, check_bool, check_count, check_positive_int
from ._flash_kernel import STRIP
from ._guard import reference_backward_bytes, reference_bytes
from ._tuning import backward_heads_per_item, backward_side, call_workers, default_tiles
from .blockmask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = [
    "attention_backward_bytes",
    "default_workers",
    "diagonal_strip_bytes",
    "flash_attention_backward_bytes",
    "flash_attention_bytes",
    "naive_attention_bytes",
    "ring_attention_bytes",
    "sequence_parallel_bytes",
]


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

        q_s       B·Hq·L·E·c    q times the scale, in the compute dtype; freed once the scores exist
        scores    B·Hq·L·S·c    the score matrix, made into the weights in place (softmax_)
        blocked   L·S           bool, causal=True: which keys each query may not see (held to the end)
        edge      L·S           bool, window=W: the keys behind the window, a temporary or-ed into blocked
        ~mask     M             bool, bool_mask=True: a temporary of the mask's M = mask_elements entries
                                (default L·S, an (L, S) mask), freed before the softmax: it overlaps
                                scores but not out. A float mask is added chunk by chunk: no copy.
        out       B·Hq·L·Ev·c   weights @ v
        fp16 only: fp32 copies of k, v (B·Hkv·S·(E + Ev)·4) and the fp16 copy of out

        peak = copies + scores + max(q_s, ~mask, blocked + edge, blocked + out + out_fp16)

    A window changes no other array: the reference still builds all L x S scores (flash_attention is
    the path whose work shrinks to L·W).

    softmax_'s per-row max and sum (B·Hq·L each) are left out: they are gone before out exists.
    """
    return reference_bytes(
        n_q,
        n_k,
        heads=heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        kv_heads=kv_heads,
        batch=batch,
        dtype=dtype,
        causal=causal,
        bool_mask=bool_mask,
        mask_elements=mask_elements,
        window=window,
    )  # the memory guard's arithmetic: _guard.reference_bytes


def attention_backward_bytes(
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
    """Peak bytes that attention_backward() (backward.py) allocates, for q, k, v, dout (and a mask) that exist.

    With c = bytes of the compute dtype, R = B·Hq·L query rows and P = R·S·c one array of the weights'
    size, the steps of backward.attention_grads and what is alive at each:

        1  the forward again     naive_attention_bytes' arrays (without its fp16 parts): P + max(...), and O
        2  dV = Pᵀ dO            P + O + B·Hq·S·Ev·c (each query head's dV, then summed) + dV
        3  dP = dO Vᵀ            P + O + dV + dS (dP, made into dS in place)
        5  dQ, dK                dS + O + dV + dQ (R·E·c) + B·Hq·S·E·c (each query head's dK, then summed) + dK
        fp16 only: fp32 copies of q, k, v and dout, held throughout

        peak = copies + max(step 1, step 2, step 3, step 5)
    """
    return reference_backward_bytes(
        n_q,
        n_k,
        heads=heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        kv_heads=kv_heads,
        batch=batch,
        dtype=dtype,
        causal=causal,
        bool_mask=bool_mask,
        mask_elements=mask_elements,
        window=window,
    )  # the memory guard's arithmetic: _guard.reference_backward_bytes


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
    block sizes and h default as in flash_attention, _tuning.default_tiles):

        out, lse  B·Hq·L·(Ev + 1)·c
        per busy worker, while the tiles run (min(workers, ⌈B·Hkv / h⌉·⌈L / block_q⌉) workers):
                  n·E·c             the step's queries times the scale, transposed
                  n·bk·c            the score tile, reused for every key block
                  2·n·Ev·c          acc, and the tile's exp(s) @ v before it is added to acc
                  8·n·c             per-row vectors: m, l, the tile's max and sum, m', alpha, ...
                  causal=True: s² bool, the mask of one strip of a tile the diagonal crosses (the rest
                  is filled by slices: _flash_kernel.hide_past_diagonal), s = min(bq, bk, STRIP), and
                  the buffers NumPy's copyto passes it through, 2·8·s² B
        fp16 only: fp32 copies of k and v, B·Hkv·S·(E + Ev)·4, and after the tiles (when the
                   workers' buffers are gone) the fp16 copy of out, B·Hq·L·Ev·2 (lse stays fp32)

        peak = out + lse + copies of k, v + max(busy · per worker, fp16 copy of out)

    Nothing is L x S: it grows like (L + S)·E. workers defaults as in flash_attention: a worker per core,
    at most one per 2^18 scores (_tuning.call_workers). The busy workers are counted as if they all held their
    buffers at once, which they do once a call lasts a few milliseconds; a short call may finish before a
    second thread starts, and then it measures less. Python's bookkeeping (one small tuple per work item) is
    left out.
    """
    sizes = attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    group = heads // kv_heads if kv_heads else 1
    if block_q is not None:
        block_q = check_positive_int(block_q, "block_q")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    diagonal = n_k - n_q if check_bool(causal, "causal") else None  # bottom-right, as flash_attention's default
    block_q, block_k, auto_heads = default_tiles(
        n_q, n_k, group, block_q=block_q, block_k=block_k, kv_heads=batch * kv_heads, diagonal=diagonal
    )
    per_step = check_positive_int(kv_heads_per_step, "kv_heads_per_step", default=auto_heads)
    workers = default_workers(sizes, workers)
    size, compute = float_bytes(dtype)
    rows = batch * heads * n_q  # query rows over all heads
    copies = batch * kv_heads * n_k * (e + ev) * compute if size < compute else 0
    held = rows * (ev + 1) * compute  # out, lse
    cast_back = rows * ev * size if size < compute else 0  # fp16 out
    bq, bk = min(block_q, n_q), min(block_k, n_k)
    h = min(per_step, batch * kv_heads)
    n = h * group * bq  # query rows of one tile step
    busy = min(workers, -(-batch * kv_heads // max(h, 1)) * -(-n_q // block_q))  # a worker takes whole items
    per_worker = n * (e + bk + 2 * ev + 8) * compute if n_k else 0
    if check_bool(causal, "causal") and n_k:
        per_worker += diagonal_strip_bytes(bq, bk)
    return math.ceil(copies + held + max(busy * per_worker, cast_back))


def diagonal_strip_bytes(bq: int, bk: int) -> int:
    """What hiding the causal diagonal's keys in one tile allocates (_flash_kernel.hide_past_diagonal): one
    strip's mask, s² bool with s = min(bq, bk, STRIP), and the buffers NumPy's copyto passes it through,
    2 operands x 8 B x s² (at most getbufsize() elements each)."""
    s = min(bq, bk, STRIP)
    return s * s + 2 * 8 * min(s * s, np.getbufsize())


def default_workers(sizes: tuple[int, ...], workers: int | None) -> int:
    """The workers a flash call of these attention_sizes (n_q, n_k, heads, kv_heads, e, ev, batch) runs on:
    `workers` checked, or _tuning.call_workers' default for the call."""
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    return call_workers(QKVShape((batch,), heads, kv_heads, n_q, n_k, e, ev), workers)


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
    block_q: int | None = None,
    block_k: int | None = None,
    workers: int | None = None,
) -> int:
    """Peak bytes that flash_attention_backward() (backward.py) allocates, for q, k, v, out, dout, lse
    that already exist.

    With B = batch, c = bytes of the compute dtype, rows = B·Hq·L, bq = min(block_q, L), bk = min(block_k, S):

        q_lse, dq          rows·(2E + 1)·c          [q times the scale, −lse] (_backward_kernel.query_rows); dq
        do_d               rows·(Ev + 1)·c          [dout, −D]
        dk, dv per head    B·Hq·S·(E + Ev)·c        each query head fills its own (the result when G = 1)
        D, lse, P's sums   3·rows·c                 rowsum(dO ∘ O), lse with -inf made +inf, and the row sums
                                                    of P that check lse against q, k and the mask
        turns              B·Hq·⌈L / block_q⌉·8     how many key blocks have added to each query block's dq
        per busy worker (min(workers, B·Hq·⌈S / block_k⌉ / h): an item is one key block of h heads, h from
        _tuning.backward_heads_per_item: as many as fill a forward tile step, 2^18 scores on up to 8 cores):
                           2·h·bq·bk·c              the tiles of P and of dP (then dS)
                           h·bk·(E + Ev + 2)·c      [K_j, 1]ᵀ and [V_j, 1]ᵀ
                           h·max(bq·E, bk·max(E, Ev))·c  one matmul's product before it is added
                           G > 1: h·bk·(E + Ev)·c   K_j and V_j, gathered for the item's heads
                           causal=True: a strip's mask and copyto's buffers, as in the forward
        G > 1, after the tiles: the group sums dk, dv  B·Hkv·S·(E + Ev)·c
        fp16 only: fp32 copies of k, v (B·Hkv·S·(E + Ev)·4) and of out (rows·Ev·4); after the
                   tiles, fp16 copies of dq, dk, dv (rows·E + B·Hkv·S·(E + Ev))·2

        peak = the arrays held + max(busy · per worker, group sums + fp16 copies)

    Nothing is L x S: O((L + S)·E), about (3L + 2S)·E·c for one head of fp32 with Ev = E (q_lse, do_d, dq,
    dk, dv).
    """
    sizes = attention_sizes(n_q, n_k, heads, kv_heads, head_dim, head_dim_v, batch)
    n_q, n_k, heads, kv_heads, e, ev, batch = sizes
    causal = check_bool(causal, "causal")
    side = backward_side(n_q, n_k - n_q if causal else None)  # the backward's default
    block_q = check_positive_int(block_q, "block_q", default=side)
    block_k = check_positive_int(block_k, "block_k", default=side)
    workers = default_workers(sizes, workers)
    size, compute = float_bytes(dtype)
    low = size < compute
    rows = batch * heads * n_q
    kv_elements = batch * kv_heads * n_k * (e + ev)  # k and v, or dk and dv
    query_side = rows * (2 * e + 1) + rows * (ev + 1) + 3 * rows  # q_lse, dq, do_d; D, lse, P's sums
    held = (query_side + batch * heads * n_k * (e + ev)) * compute + batch * heads * -(-n_q // block_q) * 8
    copies = (kv_elements + rows * ev) * compute if low else 0
    bq, bk = min(block_q, n_q), min(block_k, n_k)
    h = backward_heads_per_item(batch * heads, n_q, n_k, block_q, block_k, workers) if rows else 1  # an item's heads
    busy = min(workers, batch * heads // h * -(-n_k // block_k))  # an item is one key block of h heads
    gathered = bk * (e + ev) if heads > kv_heads else 0
    per_head = 2 * bq * bk + bk * (e + ev + 2) + max(bq * e, bk * max(e, ev)) + gathered
    per_worker = h * per_head * compute if bq and bk else 0
    if causal and bq and bk:
        per_worker += diagonal_strip_bytes(bq, bk)
    group_sums = kv_elements * compute if heads > kv_heads else 0
    cast_back = (rows * e + kv_elements) * size if low else 0
    return math.ceil(held + copies + max(busy * per_worker, group_sums + cast_back))


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
    block = nbytes(batch * kv_heads * per_device * (e + ev), dtype)
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


SCHEMES = ("ring", "ulysses")


def sequence_parallel_bytes(
    tokens: int,
    devices: int,
    *,
    scheme: str,
    heads: int,
    head_dim: int,
    kv_heads: int | None = None,
    head_dim_v: int | None = None,
    layers: int = 1,
    batch: int = 1,
    dtype: Any = "fp32",
    return_lse: bool = True,
) -> dict[str, int]:
    """Bytes one device sends to the others in attention's forward and in its backward, when `tokens` are
    split evenly over `devices` (and as many arrive): what ring.py and ulysses.py send, over all layers.

    With t = T / P tokens per device, b = bytes_per_element(dtype), c = max(b, 4 B) (16-bit inputs are
    computed in fp32), kv = B·Hkv·t·(E + Ev) the elements of one K/V shard, and P > 1:

    ring (ring_attention, ring_attention_backward):
        forward    layers·(P - 1)·kv·b          the K/V block, passed on at every step but the last
        backward   layers·(P - 1)·kv·(b + c)    the K/V blocks again, and their dK/dV accumulators (in c:
                                                sums over every rank), each device's own share kept home

    ulysses (ulysses_attention, ulysses_attention_backward): an all-to-all keeps the 1/P of a buffer that is
    this device's own, so each sends (P - 1)/P of what it moves. With qe = B·Hq·t·E (q or dq), o = B·Hq·t·Ev
    (out or dout) and r = B·Hq·t (lse):
        forward    layers·(P - 1)/P·((qe + kv + o)·b + r·c)     q, k, v to heads; out (and lse) back
        backward   layers·(P - 1)/P·((qe + kv + 2·o)·b + r·c    q, k, v, out, dout, lse to heads
                                     + (qe + kv)·b)             dq, dk, dv back
    return_lse=False: the forward sends no lse back (r = 0); training needs it for the backward.
    Ulysses needs Hq and Hkv to be multiples of P (ValueError otherwise); the ring takes any P.
    A ring's or an all-to-all's stats (RingStats, UlyssesStats) report exactly these bytes per call.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(map(repr, SCHEMES))}; got {scheme!r}")
    return_lse = check_bool(return_lse, "return_lse")
    tokens, _, heads, kv_heads, e, ev, batch = attention_sizes(
        tokens, None, heads, kv_heads, head_dim, head_dim_v, batch
    )
    devices = check_positive_int(devices, "devices")
    layers = check_positive_int(layers, "layers")
    if tokens % devices:
        raise ValueError(f"tokens must split evenly over the devices; got tokens={tokens:,} and devices={devices}")
    b, c = bytes_per_element(dtype), max(bytes_per_element(dtype), Fraction(4))
    t = tokens // devices
    kv, qe, o, r = batch * kv_heads * t * (e + ev), batch * heads * t * e, batch * heads * t * ev, batch * heads * t
    if scheme == "ring":
        forward, backward = (devices - 1) * kv * b, (devices - 1) * kv * (b + c)
    else:
        if heads % devices or kv_heads % devices:
            raise ValueError(
                f"Ulysses splits the heads over the devices: heads={heads} and kv_heads={kv_heads} must both be "
                f"multiples of devices={devices}"
            )
        share = Fraction(devices - 1, devices)  # of each all-to-all's buffer, the part for the other devices
        forward = share * ((qe + kv + o) * b + (r * c if return_lse else 0))
        backward = share * ((qe + kv + 2 * o) * b + r * c + (qe + kv) * b)
    return {"tokens_per_device": t, "forward": math.ceil(layers * forward), "backward": math.ceil(layers * backward)}
