"""The gradients of attention, by hand: the reference from the weights, FlashAttention-2's blockwise
backward that recomputes them tile by tile, and the gradient through RoPE.

The forward, with S the scaled scores and P the weights (attention.py):

    S = Q Kᵀ · scale (+ mask)      P = softmax(S) row by row      O = P V

Given dO = ∂loss/∂O, one line per gradient (the chain rule through each line, last line first):

    dV = Pᵀ dO                               O = P V is linear in V
    dP = dO Vᵀ                               ... and in P
    dS = P ∘ (dP − D),  D = rowsum(dO ∘ O)   softmax's Jacobian: dS_ij = P_ij (dP_ij − Σ_k P_ik dP_ik),
                                             and Σ_k P_ik dP_ik = Σ_k P_ik (dO_i · v_k) = dO_i · O_i
    dQ = scale · dS K                        S = Q Kᵀ · scale is linear in Q
    dK = scale · dSᵀ Q                       ... and in K

A masked entry has P = 0, so it gets dS = 0: a hidden key receives no gradient from that query, and a
row that sees no key (P = 0 everywhere, O = 0) gives dQ = 0, never NaN. With grouped-query heads a kv
head is read by G query heads, so its dK and dV are the sums of those G heads' contributions.

flash_attention_backward (Dao 2023, "FlashAttention-2", Algorithm 2) never builds P: it takes the
forward's per-row logsumexp and recomputes each tile's probabilities as P = exp(S - lse), for the
tiles that run in the forward. Memory O((L + S)·E), time about 2.5x the forward's FLOPs.

Read it in this order: attention_backward and attention_grads (the reference: the five lines above on
whole matrices), flash_attention_backward_one_head (Algorithm 2 for one head on one thread, as the paper
prints it), then flash_attention_backward (the same, with every key block of every head a work item).
"""

from __future__ import annotations

import os
import threading
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    as_float_array,
    check_bool,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
    without_head_axis,
)
from ._guard import attention_backward_bytes, refuse_if_too_big
from ._parallel import Stopped, one_blas_thread, run_items
from .attention import Hidden, attend, check_attention, grouped
from .flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, DIAGONAL, Band, Tile, check_band
from .position import rope, rope_positions

Array = NDArray[np.floating]

__all__ = [
    "attention_backward",
    "flash_attention_backward",
    "flash_attention_backward_one_head",
    "rope_backward",
]


def check_like(x: Any, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """x as a float array of exactly `shape` (what: the shape in symbols, for the message)."""
    x = as_float_array(x, name)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}; got shape {x.shape}")
    return x


# ---------------------------------------------------------------------------------------------------
# the reference: the whole weight matrix P


def attention_backward(
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    *,
    causal: bool = False,
    mask: Any = None,
    scale: float | None = None,
    align: str = "bottom_right",
    window: int | None = None,
    check_memory: bool = True,
) -> tuple[Array, Array, Array]:
    """The gradients of attention(q, k, v, causal=causal, mask=mask, scale=scale, align=align, window=window)
    for ∂loss/∂out = dout.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), dout (..., Hq, L, Ev)
    -> dq, dk, dv shaped and typed like q, k, v. Builds the (..., Hq, L, S) weights, like attention(), and
    check_memory=True refuses (AttentionMemoryError), before anything is converted or built, a call whose
    peak does not fit in the memory available (peaks.attention_backward_bytes).
    """
    check_memory = check_bool(check_memory, "check_memory")
    two_d = without_head_axis(q)
    q, k, v, dims, scale, hidden = check_attention(
        q, k, v, causal=causal, mask=mask, scale=scale, align=align, window=window
    )
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    dout = check_like(dout, "dout", out_shape[1:] if two_d else out_shape, "out's (..., Hq, L, Ev)")
    ct = compute_dtype(q, k, v, dout)
    if check_memory:  # first, on shapes and dtypes alone: the float16 copies below are part of the bill
        check_backward_fits(dims, np.result_type(q, k, v, dout), hidden)
    q_c, k_c, v_c, d_o = (x.astype(ct, copy=False) for x in (q, k, v, dout))
    dq, dk, dv = attention_grads(q_c, k_c, v_c, d_o.reshape(out_shape), dims, scale, hidden)
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    return (grads[0][0], grads[1][0], grads[2][0]) if two_d else grads


def attention_grads(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, dims: QKVShape, scale: float, hidden: Hidden
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The five lines of the module doc on whole matrices, for inputs attention_backward() checked, in the
    compute dtype: -> dq (..., Hq, L, E), dk (..., Hkv, S, E), dv (..., Hkv, S, Ev)."""
    # 1) the forward again, keeping the weights P (..., Hq, L, S) and the output O (..., Hq, L, Ev)
    o, p = attend(q, k, v, dims, scale, hidden)
    p, o, d_o = grouped(p, dims, kv=False), grouped(o, dims, kv=False), grouped(dout, dims, kv=False)  # (.., G, L, .)
    k_g, v_g = grouped(k, dims, kv=True), grouped(v, dims, kv=True)  # (..., Hkv, 1, S, E): shared by the G heads
    # 2) dV = Pᵀ dO, summed over the G query heads that read each kv head
    dv = (p.swapaxes(-1, -2) @ d_o).sum(axis=-3)  # (..., Hkv, G, S, Ev) -> (..., Hkv, S, Ev)
    # 3) dP = dO Vᵀ
    ds = d_o @ v_g.swapaxes(-1, -2)  # (..., Hkv, G, L, S): dP, made into dS in place below
    # 4) dS = P ∘ (dP − D), D = rowsum(dO ∘ O): softmax's Jacobian applied to dP
    d = np.einsum("...le,...le->...l", d_o, o)  # (..., Hkv, G, L)
    ds -= d[..., None]
    ds *= p  # (..., Hkv, G, L, S); 0 wherever P is 0 (masked keys, rows that see nothing)
    del p  # dS alone is needed from here on
    # 5) dQ = scale · dS K and dK = scale · dSᵀ Q (summed over the group, like dV)
    dq = ds @ k_g  # (..., Hkv, G, L, E)
    dq *= scale
    dk = (ds.swapaxes(-1, -2) @ grouped(q, dims, kv=False)).sum(axis=-3)  # (..., Hkv, S, E)
    dk *= scale
    return dq.reshape(*dims.batch, dims.hq, dims.n_q, dims.e), dk, dv


def check_backward_fits(dims: QKVShape, dtype: np.dtype, hidden: Hidden) -> None:
    """Refuse, on shapes and dtypes alone, an attention_backward() whose peak does not fit in memory."""
    batch = int(np.prod(dims.batch, dtype=np.int64))
    if batch == 0 or dims.hq == 0:
        return
    mask = hidden.mask
    inverted = mask.size if mask is not None and mask.dtype == np.bool_ else None  # ~mask: a bool mask's size
    needed = attention_backward_bytes(
        dims.n_q, dims.n_k, heads=dims.hq, kv_heads=dims.hkv, head_dim=dims.e, head_dim_v=dims.ev, batch=batch,
        dtype=dtype, causal=hidden.offset is not None, bool_mask=inverted is not None, mask_elements=inverted,
        window=hidden.window,
    )  # fmt: skip
    scores = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
    refuse_if_too_big(needed, "attention_backward()", f"two arrays of {scores}", "flash_attention_backward()")


# ---------------------------------------------------------------------------------------------------
# Algorithm 2, one head on one thread


def flash_attention_backward_one_head(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    dout: Array,
    lse: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    window: int | None = None,
) -> tuple[Array, Array, Array]:
    """FlashAttention-2's backward (Dao 2023, Algorithm 2) for one head: q (L, E), k (S, E), v (S, Ev),
    out (L, Ev), dout (L, Ev), lse (L,) from flash_attention_one_head -> dq, dk, dv in the compute dtype.

    flash_attention_backward() is the same algorithm with every key block of every head a work item;
    the tests hold the two equal.
    """
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        q, k, v, out, dout, lse, causal=causal, scale=scale, window=window, block_q=block_q, block_k=block_k,
        workers=1, one_head=True,
    )  # fmt: skip
    d = np.sum(dout * out, axis=1)  # (L,) D = rowsum(dO ∘ O), once
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k_start in range(0, dims.n_k, plan.block_k):  # the outer loop walks the key blocks j
        cols = slice(k_start, min(k_start + plan.block_k, dims.n_k))
        for tile in plan.band.column_tiles(cols.start, cols.stop, dims.n_q, plan.block_q):  # the query blocks i
            rows = slice(tile.q_start, tile.q_stop)
            s = (q[rows] * plan.scale) @ k[cols].T  # (bq, bk) S_ij = scale · Q_i K_jᵀ
            p = np.exp(s - lse[rows, None])  # (bq, bk) P_ij = exp(S_ij − L_i): the forward's weights, exactly
            if tile.kind == DIAGONAL:
                p[plan.band.hidden(tile)] = 0.0  # (bq, bk) hidden keys got no weight in the forward
            dv[cols] += p.T @ dout[rows]  # (bk, Ev) dV_j += P_ijᵀ dO_i
            dp = dout[rows] @ v[cols].T  # (bq, bk) dP_ij = dO_i V_jᵀ
            ds = p * (dp - d[rows, None])  # (bq, bk) dS_ij = P_ij ∘ (dP_ij − D_i)
            dq[rows] += plan.scale * (ds @ k[cols])  # (bq, E) dQ_i += scale · dS_ij K_j
            dk[cols] += plan.scale * (ds.T @ q[rows])  # (bk, E) dK_j += scale · dS_ijᵀ Q_i
    return dq, dk, dv


class BackwardPlan(NamedTuple):
    """How flash_backward runs a checked call: the scale, the band, the tile sizes, the workers."""

    scale: float
    band: Band
    block_q: int
    block_k: int
    workers: int


def check_flash_backward(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, *, causal: Any, scale: Any, window: Any,
    block_q: Any, block_k: Any, workers: Any, one_head: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, QKVShape, BackwardPlan]:  # fmt: skip
    """The backward's inputs checked, once (shapes against q's), and its plan. With one_head=True the
    arrays must be one head's 2-D ones and come back 2-D in the compute dtype, lse with +inf for -inf."""
    if one_head and not without_head_axis(q):
        raise ValueError(f"q must be one head (L, E); got shape {np.shape(q)}: use flash_attention_backward")
    two_d = without_head_axis(q)
    q, k, v, dims = check_qkv(q, k, v)
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)[1 if two_d else 0 :]
    out = check_like(out, "out", out_shape, "(..., Hq, L, Ev)")
    dout = check_like(dout, "dout", out_shape, "out's (..., Hq, L, Ev)")
    lse = check_like(lse, "lse", out_shape[:-1], "(..., Hq, L)")
    band = check_band(causal, window, dims.n_q, dims.n_k)
    plan = BackwardPlan(
        check_scale(scale, dims.e, compute_dtype(q, k, v)),
        band,
        check_positive_int(block_q, "block_q", default=DEFAULT_BLOCK_Q),
        check_positive_int(block_k, "block_k", default=DEFAULT_BLOCK_K),
        check_positive_int(workers, "workers", default=os.cpu_count() or 1),
    )
    if one_head:
        ct = compute_dtype(q, k, v, out, dout)
        q, k, v, out, dout = (x[0].astype(ct) if x.ndim == 3 else x.astype(ct) for x in (q, k, v, out, dout))
        lse = np.where(np.isneginf(lse), np.inf, lse).astype(ct)  # a row that saw no key: P = exp(S − inf) = 0
    return q, k, v, out, dout, lse, dims, plan


# ---------------------------------------------------------------------------------------------------
# the fast path: every key block of every head is a work item


def key_block_grads(
    q_s: np.ndarray, k: np.ndarray, v: np.ndarray, d_o: np.ndarray, lse: np.ndarray, d: np.ndarray, band: Band,
    tiles: Any, add_dq: Any, dk_rows: np.ndarray, dv_rows: np.ndarray,
) -> None:  # fmt: skip
    """Algorithm 2's inner loop for one key block j over the query blocks i that see it (tiles), one head:
    adds into dk_rows (bk, E) and dv_rows (bk, Ev), and hands each tile's share of dq, dS K_j (bq, E), and
    of P's row sums (bq,) to add_dq (dq unscaled: the caller multiplies dq by the scale once). q_s (L, E)
    is q times the scale; k (S, E), v (S, Ev); d_o (L, Ev), lse (L,) with +inf for rows that see no key,
    d (L,) = rowsum(dO ∘ O). Two tile buffers serve every tile of the block (made at the first, the widest)."""
    p_buf = ds_buf = np.empty(0, q_s.dtype)
    for t in tiles:
        rows, cols = slice(t.q_start, t.q_stop), slice(t.k_start, t.k_stop)
        bq, bk = t.q_stop - t.q_start, t.k_stop - t.k_start
        if p_buf.size < bq * bk:
            p_buf, ds_buf = np.empty(bq * bk, q_s.dtype), np.empty(bq * bk, q_s.dtype)
        p, ds = p_buf[: bq * bk].reshape(bq, bk), ds_buf[: bq * bk].reshape(bq, bk)
        # 1) scores of this tile, as in the forward (the scale is folded into q)
        np.matmul(q_s[rows], k[cols].T, out=p)  # (bq, bk)
        # 2) P = exp(S − lse): the forward's probabilities, exactly normalised, without a row max or sum
        p -= lse[rows, None]
        np.exp(p, out=p)  # (bq, bk) P
        # 3) a tile that a mask edge crosses hides the keys its queries may not see: P = 0 there
        if t.kind == DIAGONAL:
            np.copyto(p, 0.0, where=band.hidden(t))
        # 4) dV_j += Pᵀ dO_i
        dv_rows += p.T @ d_o[rows]  # (bk, bq) @ (bq, Ev)
        # 5) dP = dO_i V_jᵀ, then dS = P ∘ (dP − D_i), in place
        np.matmul(d_o[rows], v[cols].T, out=ds)  # (bq, Ev) @ (Ev, bk): dP
        ds -= d[rows, None]
        ds *= p  # (bq, bk) dS
        # 6) dQ_i += dS K_j (added in key-block order, with P's row sums: OrderedDq) and dK_j += dSᵀ (scale · Q_i)
        add_dq(t, ds @ k[cols], p.sum(axis=1))  # (bq, bk) @ (bk, E), (bq,)
        dk_rows += ds.T @ q_s[rows]  # (bk, bq) @ (bq, E)


class OrderedDq:
    """dq (B·Hq, L, E) and P's row sums (B·Hq, L), into which the key blocks of each head add their shares
    in key-block order, whatever the threads' timing: a wavefront.

    Key block j adds its share to the rows of query block i only once every earlier key block that sees
    query block i has added its own. Each row is then the sum over j = 0, 1, ... in that order, on any
    number of workers: the same bits as one thread, with neither an atomic add (a GPU's answer, whose
    order, and so last bits, would depend on the timing) nor a copy of dq per key block. The keys each
    query block sees are contiguous, so a key block's place in that order is its distance from the first
    one (Band.visible_keys): no table of tiles. The bookkeeping is one count per (head, query block).
    """

    def __init__(self, dq: np.ndarray, p_sums: np.ndarray, band: Band, n_k: int, block_q: int, block_k: int):
        self.dq, self.p_sums, self.band, self.n_k = dq, p_sums, band, n_k
        self.block_q, self.block_k = block_q, block_k
        self.added = np.zeros((dq.shape[0], -(-dq.shape[1] // block_q)), np.int64)  # key blocks added so far
        self.turn = threading.Condition()
        self.failed = False

    def add(self, h: int, t: Tile, share: np.ndarray, p_sum: np.ndarray) -> None:
        """dq[h, t's rows] += share (bq, E) and p_sums[h, t's rows] += p_sum (bq,), once it is t's turn."""
        first = self.band.visible_keys(t.q_start, t.q_stop, self.n_k).start // self.block_k
        place, block = t.k_start // self.block_k - first, t.q_start // self.block_q
        with self.turn:
            self.turn.wait_for(lambda: self.failed or self.added[h, block] == place)
            if self.failed:  # another item raised: stop instead of waiting for a turn that never comes
                raise Stopped
            self.dq[h, t.q_start : t.q_stop] += share
            self.p_sums[h, t.q_start : t.q_stop] += p_sum
            self.added[h, block] = place + 1
            self.turn.notify_all()

    def fail(self) -> None:
        with self.turn:
            self.failed = True
            self.turn.notify_all()


def flash_attention_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    dout: Array,
    lse: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    workers: int | None = None,
    window: int | None = None,
) -> tuple[Array, Array, Array]:
    """The gradients of flash_attention(q, k, v, causal=causal, scale=scale, window=window), blockwise.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev); out (..., Hq, L, Ev) and lse (..., Hq, L)
    from flash_attention(..., return_lse=True); dout (..., Hq, L, Ev) = ∂loss/∂out
    -> dq, dk, dv shaped and typed like q, k, v. causal=True is bottom-right aligned, as in the forward.
    Pass the forward's causal, window and scale: P = exp(S − lse) is only the forward's weights under the
    forward's mask. The backward checks that P's rows sum to 1 and raises a ValueError where they do not
    (an lse from another mask, scale or input), rather than return the gradients of another function.

    FlashAttention-2's backward (Dao 2023, Algorithm 2):
        D = rowsum(dO ∘ O) once; then for each key block j, for each query block i that sees it:
        P = exp(S_ij − lse_i);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − D_i);
        dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
    The tiles are those the forward runs: a tile the forward skips holds only zeros of P.

    Work items and races: one item is one key block of one query head, as in Algorithm 2, where the key
    blocks run in parallel. The item owns its rows of dk and dv outright. dq rows receive a share from
    every key block that sees them: on a GPU an atomic add, whose order, and so whose last bits, depend on
    the timing. Here the shares are added in key-block order instead (OrderedDq), so the result is the
    same bits for any `workers`. With grouped-query heads, the G query heads of a kv head each fill their
    own (S, E) copy of dk and dv, summed in head order at the end: G - 1 extra copies of k and v, O(S·E).
    Memory: dq, dk, dv, one scaled copy of q, D, and per worker two block_q x block_k tiles; the tiles
    are made as each item runs, so the bookkeeping is one count per (head, query block).
    workers: threads (default: the CPU count); BLAS is held to one thread meanwhile, as in the forward.
    """
    two_d = without_head_axis(q)
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        q, k, v, out, dout, lse, causal=causal, scale=scale, window=window, block_q=block_q, block_k=block_k,
        workers=workers,
    )  # fmt: skip
    dq, dk, dv = flash_backward(q, k, v, out, dout, lse, dims, plan)
    return (dq[0], dk[0], dv[0]) if two_d else (dq, dk, dv)


def flash_backward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray,
    dims: QKVShape, plan: BackwardPlan,
) -> tuple[Array, Array, Array]:  # fmt: skip
    """flash_attention_backward's work on inputs check_flash_backward() accepted: dq, dk, dv like q, k, v."""
    ct = compute_dtype(q, k, v, out, dout)
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq  # every (batch, query head) pair
    n_kv_heads, group = n_heads // dims.group, dims.group
    # 1) inputs in the compute dtype, one head per leading index (views when they already are)
    q_s = np.multiply(q.reshape(n_heads, dims.n_q, dims.e), plan.scale, dtype=ct)  # (B·Hq, L, E): scale folded in
    k_c = np.ascontiguousarray(k.reshape(n_kv_heads, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv_heads, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    d_o = np.ascontiguousarray(dout.reshape(n_heads, dims.n_q, dims.ev), dtype=ct)  # (B·Hq, L, Ev)
    # 2) D = rowsum(dO ∘ O), once for all tiles (einsum: no (B·Hq, L, Ev) product in memory)
    d = np.einsum("hle,hle->hl", d_o, out.reshape(n_heads, dims.n_q, dims.ev).astype(ct, copy=False))  # (B·Hq, L)
    # a row that saw no key has lse = -inf; +inf instead makes its P = exp(S − lse) exactly 0, not NaN
    lse_c = lse.reshape(n_heads, dims.n_q).astype(ct)  # (B·Hq, L), a copy we may change
    lse_c[np.isneginf(lse_c)] = np.inf
    dq, p_sums = np.zeros((n_heads, dims.n_q, dims.e), ct), np.zeros((n_heads, dims.n_q), ct)  # (B·Hq, L, E), (B·Hq, L)
    # dk, dv per query head (summed over the group below when G > 1, else the result itself)
    dk_heads, dv_heads = np.zeros((n_heads, dims.n_k, dims.e), ct), np.zeros((n_heads, dims.n_k, dims.ev), ct)
    ordered_dq = OrderedDq(dq, p_sums, plan.band, dims.n_k, plan.block_q, plan.block_k)

    def run(item: tuple[int, int]) -> None:
        k_start, h = item  # query head h reads kv head h // G
        cols = slice(k_start, min(k_start + plan.block_k, dims.n_k))
        tiles = plan.band.column_tiles(cols.start, cols.stop, dims.n_q, plan.block_q)
        key_block_grads(q_s[h], k_c[h // group], v_c[h // group], d_o[h], lse_c[h], d[h], plan.band, tiles,
                        partial(ordered_dq.add, h), dk_heads[h, cols], dv_heads[h, cols])  # fmt: skip

    # 3) the items, key block by key block: an item only waits (in ordered_dq) for one taken before it
    items = ((k_start, h) for k_start in range(0, dims.n_k, plan.block_k) for h in range(n_heads))
    with one_blas_thread():
        run_items(run, items, plan.workers, on_failure=ordered_dq.fail)
    check_weights_sum_to_one(p_sums, lse_c)
    # 4) dQ's scale, once; a kv head's gradient is the sum over its G query heads (in head order)
    dq *= plan.scale
    dk_c = dk_heads.reshape(n_kv_heads, group, dims.n_k, dims.e).sum(axis=1) if group > 1 else dk_heads
    dv_c = dv_heads.reshape(n_kv_heads, group, dims.n_k, dims.ev).sum(axis=1) if group > 1 else dv_heads
    return (dq.reshape(q.shape).astype(q.dtype, copy=False), dk_c.reshape(k.shape).astype(k.dtype, copy=False),
            dv_c.reshape(v.shape).astype(v.dtype, copy=False))  # fmt: skip


def check_weights_sum_to_one(p_sums: np.ndarray, lse: np.ndarray) -> None:
    """Each row of P = exp(S − lse) sums to 1 when lse is the forward's, for the same q, k, mask and scale.
    Refuse a backward handed another forward's state (a window or mask it did not get, another scale)
    instead of returning the gradients of some other function. Not checked: rows that saw no key (lse +inf
    here, P 0), NaN rows (they stay NaN in the gradients), and rows whose scores are so large that the
    forward and the backward, summing S's products in another order, may round S apart by more than the
    tolerance (|S|·10·eps: |lse| past 2,900 in float32, 6.7e7 in float64)."""
    eps = float(np.finfo(p_sums.dtype).eps)
    tolerance = 10 * np.sqrt(eps)  # 3.5e-3 in float32, 1.5e-7 in float64
    checkable = np.isfinite(p_sums) & (np.abs(lse) < tolerance / (10 * eps))  # (B·Hq, L); lse +inf fails too
    wrong = checkable & (np.abs(p_sums - 1) > tolerance)
    if wrong.any():
        head, row = np.argwhere(wrong)[0]
        raise ValueError(
            f"lse does not match q, k and the mask: the weights P = exp(S − lse) of row {row} of head {head} sum "
            f"to {p_sums[head, row]:.6g}, not 1. Pass the causal, window and scale the forward used, with its own "
            "out and lse (flash_attention(..., return_lse=True))"
        )


def rope_backward(
    grad: Array,
    *,
    positions: Any = None,
    base: float = 10000.0,
    interleaved: bool = True,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> Array:
    """∂loss/∂x from ∂loss/∂rope(x) = grad (..., T, d): rope with the angles negated.

    rope multiplies each channel pair at position m by a · R(mθ_i), a rotation (times scaling's attention
    factor a, 1 without scaling), so the gradient goes back through a · R(mθ_i)ᵀ = a · R(−mθ_i): the
    rotation by −θ. Pass what the forward got (position.rope): positions, base, pair layout, scaling,
    seq_len and max_position_embeddings. Channels that partial rotary leaves alone pass the gradient as is.
    """
    grad = as_float_array(grad, "grad")
    if grad.ndim < 2:
        raise ValueError(f"grad must have at least 2 dims (..., T, d); got shape {grad.shape}")
    # the forward's positions (T,), checked as rope checks them, as float64: negating an unsigned int would wrap
    forward = rope_positions(positions, grad.shape[-2])
    if seq_len is None and scaling is not None and forward.size:
        # the forward's θ came from its largest position (dynamic scaling): take it from there, not from -θ's
        seq_len = max(int(forward.max()) + 1, 1)
    return rope(grad, positions=-forward, base=base, interleaved=interleaved, scaling=scaling, seq_len=seq_len,
                max_position_embeddings=max_position_embeddings)  # fmt: skip
