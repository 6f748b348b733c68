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
forward's per-row logsumexp and recomputes each tile's probabilities as P = exp(S - lse), for the same
tiles tile_plan() runs in the forward. Memory O((L + S)·E), time about 2.5x the forward's FLOPs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_positive_int, check_qkv, check_scale, compute_dtype
from .attention import attention
from .flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, DIAGONAL, Tile, _one_blas_thread, tile_plan
from .masks import causal_blocked, causal_offset
from .position import rope, rope_positions

Array = NDArray[np.floating]

__all__ = ["attention_backward", "flash_attention_backward", "rope_backward"]


def _check_like(x: Any, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """x as a float array of exactly `shape` (what: the shape in symbols, for the message)."""
    x = as_float_array(x, name)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}; got shape {x.shape}")
    return x


def attention_backward(
    q: Array,
    k: Array,
    v: Array,
    dout: Array,
    *,
    causal: bool = False,
    mask: Any = None,
    scale: float | None = None,
) -> tuple[Array, Array, Array]:
    """The gradients of attention(q, k, v, causal=causal, mask=mask, scale=scale) for ∂loss/∂out = dout.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), dout (..., Hq, L, Ev)
    -> dq, dk, dv shaped and typed like q, k, v. Builds the (..., Hq, L, S) weights, like attention().
    Every mask attention() takes, with the same (bottom-right) causal alignment. See the module doc
    for the equations; the steps below use the same symbols.
    """
    two_d = np.ndim(q) == 2
    q, k, v, dims = check_qkv(q, k, v)
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    dout = _check_like(dout, "dout", out_shape[1:] if two_d else out_shape, "out's (..., Hq, L, Ev)")
    ct = compute_dtype(q, k, v, dout)
    q_c, k_c, v_c = (x.astype(ct, copy=False) for x in (q, k, v))
    d_o = dout.astype(ct, copy=False).reshape(*dims.batch, dims.hkv, dims.group, dims.n_q, dims.ev)
    scale = check_scale(scale, dims.e)

    # 1) the forward again, keeping the weights P (..., Hq, L, S) and the output O (..., Hq, L, Ev)
    o, p = cast(tuple[Array, Array], attention(q_c, k_c, v_c, causal=causal, mask=mask, scale=scale,
                                               return_weights=True))  # fmt: skip
    p = p.reshape(*dims.batch, dims.hkv, dims.group, dims.n_q, dims.n_k)  # (..., Hkv, G, L, S)
    o = o.reshape(d_o.shape)  # (..., Hkv, G, L, Ev)
    k_g, v_g = k_c[..., None, :, :], v_c[..., None, :, :]  # (..., Hkv, 1, S, E): shared by the G heads

    # 2) dV = Pᵀ dO, summed over the G query heads that read each kv head
    dv = (p.swapaxes(-1, -2) @ d_o).sum(axis=-3)  # (..., Hkv, G, S, Ev) -> (..., Hkv, S, Ev)
    # 3) dP = dO Vᵀ
    dp = d_o @ v_g.swapaxes(-1, -2)  # (..., Hkv, G, L, S)
    # 4) dS = P ∘ (dP − D), D = rowsum(dO ∘ O): softmax's Jacobian applied to dP
    d = np.sum(d_o * o, axis=-1, keepdims=True)  # (..., Hkv, G, L, 1)
    ds = p * (dp - d)  # (..., Hkv, G, L, S); 0 wherever P is 0 (masked keys, rows that see nothing)
    # 5) dQ = scale · dS K and dK = scale · dSᵀ Q (summed over the group, like dV)
    dq = scale * (ds @ k_g)  # (..., Hkv, G, L, E)
    q_g = q_c.reshape(*dims.batch, dims.hkv, dims.group, dims.n_q, dims.e)
    dk = scale * (ds.swapaxes(-1, -2) @ q_g).sum(axis=-3)  # (..., Hkv, S, E)

    dq = dq.reshape(q.shape)  # (..., Hq, L, E)
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    if two_d:
        return grads[0][0], grads[1][0], grads[2][0]
    return grads


def _key_block_grads(
    q_s: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_o: np.ndarray,
    lse: np.ndarray,
    d: np.ndarray,
    tiles: list[Tile],
    offset: int,
    add_dq: Callable[[Tile, np.ndarray], None],
    dk_rows: np.ndarray,
    dv_rows: np.ndarray,
    tile_buf: np.ndarray,
    dp_buf: np.ndarray,
) -> None:
    """FlashAttention-2's inner loop for one key block j over the query blocks i that see it (tiles):
    adds into dk_rows (bk, E) and dv_rows (bk, Ev) of this block, and hands each tile's share of dq,
    dS K_j (bq, E), to add_dq (unscaled: the caller multiplies dq by the scale once). q_s (L, E) is q
    times the scale; k (S, E), v (S, Ev); d_o (L, Ev), lse (L,) with +inf for rows that see no key,
    d (L,) = rowsum(dO ∘ O)."""
    for t in tiles:
        rows, cols = slice(t.q_start, t.q_stop), slice(t.k_start, t.k_stop)
        s = tile_buf[: t.q_stop - t.q_start, : t.k_stop - t.k_start]  # (bq, bk)
        dp = dp_buf[: t.q_stop - t.q_start, : t.k_stop - t.k_start]  # (bq, bk)
        # 1) scores of this tile, as in the forward (the scale is folded into q)
        np.matmul(q_s[rows], k[cols].T, out=s)
        # 2) P = exp(S − lse): the forward's probabilities, exactly normalised, without a row max or sum
        s -= lse[rows, None]
        np.exp(s, out=s)  # s now holds P (bq, bk)
        # 3) a diagonal tile hides the keys its queries may not see: P = 0 there
        if t.kind == DIAGONAL:
            np.copyto(s, 0.0, where=causal_blocked(t.q_start, t.q_stop, t.k_start, t.k_stop, offset))
        # 4) dV_j += Pᵀ dO_i
        dv_rows += s.T @ d_o[rows]  # (bk, bq) @ (bq, Ev)
        # 5) dP = dO_i V_jᵀ, then dS = P ∘ (dP − D_i), in place in dp
        np.matmul(d_o[rows], v[cols].T, out=dp)  # (bq, Ev) @ (Ev, bk)
        dp -= d[rows, None]
        dp *= s  # dp now holds dS (bq, bk)
        # 6) dQ_i += dS K_j (added in key-block order: _OrderedDq) and dK_j += dSᵀ (scale · Q_i):
        #    q_s carries dK's scale, dQ's comes at the end
        add_dq(t, dp @ k[cols])  # (bq, bk) @ (bk, E)
        dk_rows += dp.T @ q_s[rows]  # (bk, bq) @ (bq, E)


class _OrderedDq:
    """dq (B·Hq, L, E), into which the key blocks of each head add their shares in key-block order,
    whatever the threads' timing: a wavefront.

    Key block j adds its share to the rows of query block i only once every earlier key block that sees
    query block i has added its own. Each dq row is then the sum over j = 0, 1, ... in that order, on any
    number of workers: the same bits as one thread, with neither an atomic add (a GPU's answer, whose
    order, and so last bits, would depend on the timing) nor a copy of dq per key block (O(L·S/block_k)).
    A waiting worker holds one (bq, E) share. The items start key block by key block, so the one it waits
    for is already running, usually a tile ahead: the waits are short.
    """

    def __init__(self, dq: np.ndarray, tiles: list[Tile]):
        self.dq = dq
        adders: dict[int, list[int]] = {}  # query block -> the key blocks that add to its rows
        for t in tiles:
            adders.setdefault(t.q_start, []).append(t.k_start)
        # (query block, key block) -> its place in the order of adds to that query block's rows
        self.place = {(q_start, k_start): n for q_start, ks in adders.items() for n, k_start in enumerate(sorted(ks))}
        self.added: dict[tuple[int, int], int] = {}  # (head, query block) -> how many key blocks have added
        self.turn = threading.Condition()
        self.failed = False

    def add(self, h: int, t: Tile, share: np.ndarray) -> None:
        """dq[h, t's rows] += share (bq, E), once it is t's key block's turn for those rows."""
        place = self.place[t.q_start, t.k_start]
        with self.turn:
            self.turn.wait_for(lambda: self.failed or self.added.get((h, t.q_start), 0) == place)
            if self.failed:  # another item raised: stop instead of waiting for a turn that never comes
                raise RuntimeError("flash_attention_backward: another work item failed")
            self.dq[h, t.q_start : t.q_stop] += share
            self.added[h, t.q_start] = place + 1
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
) -> tuple[Array, Array, Array]:
    """The gradients of flash_attention(q, k, v, causal=causal, scale=scale), blockwise, never L x S.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev); out (..., Hq, L, Ev) and lse (..., Hq, L)
    from flash_attention(..., return_lse=True); dout (..., Hq, L, Ev) = ∂loss/∂out
    -> dq, dk, dv shaped and typed like q, k, v. causal=True is bottom-right aligned, as in the forward.

    FlashAttention-2's backward (Dao 2023, Algorithm 2):
        D = rowsum(dO ∘ O) once; then for each key block j, for each query block i that sees it:
        P = exp(S_ij − lse_i);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − D_i);
        dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
    The tiles are tile_plan()'s, the same ones the forward runs: a tile the forward skips holds only
    zeros of P, so it adds nothing here either.

    Work items and races: one item is one key block of one query head, as in Algorithm 2, where the key
    blocks run in parallel. The item owns its rows of dk and dv outright. dq rows receive a share from
    every key block that sees them: on a GPU an atomic add, whose order, and so whose last bits, depend on
    the timing. Here the shares are added in key-block order instead (_OrderedDq: key block j adds to a
    query block's rows after key block j - 1 has), so the result is the same bits for any `workers`.
    With grouped-query heads, the G query heads of a kv head each fill their own (S, E) copy of dk and
    dv, summed in head order at the end: G - 1 extra copies of k and v, still O(S·E).
    Memory: dq, dk, dv, one scaled copy of q, D, and per worker two block_q x block_k tiles.
    workers: threads (default: the CPU count); BLAS is held to one thread meanwhile, as in the forward.
    """
    two_d = np.ndim(q) == 2
    q, k, v, dims = check_qkv(q, k, v)
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    lse_shape = out_shape[:-1]
    if two_d:
        out_shape, lse_shape = out_shape[1:], lse_shape[1:]
    out = _check_like(out, "out", out_shape, "(..., Hq, L, Ev)")
    dout = _check_like(dout, "dout", out_shape, "out's (..., Hq, L, Ev)")
    lse = _check_like(lse, "lse", lse_shape, "(..., Hq, L)")
    scale = check_scale(scale, dims.e)
    block_q = check_positive_int(block_q, "block_q", default=DEFAULT_BLOCK_Q)
    block_k = check_positive_int(block_k, "block_k", default=DEFAULT_BLOCK_K)
    workers = check_positive_int(workers, "workers", default=os.cpu_count() or 1)
    ct = compute_dtype(q, k, v, out, dout)
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq  # every (batch, query head) pair
    n_kv_heads, group = n_heads // dims.group, dims.group

    # 1) inputs in the compute dtype, one head per leading index (views when they already are)
    q_s = np.multiply(q.reshape(n_heads, dims.n_q, dims.e), scale, dtype=ct)  # (B·Hq, L, E): scale folded in
    k_c = np.ascontiguousarray(k.reshape(n_kv_heads, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv_heads, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    d_o = np.ascontiguousarray(dout.reshape(n_heads, dims.n_q, dims.ev), dtype=ct)  # (B·Hq, L, Ev)
    o = out.reshape(n_heads, dims.n_q, dims.ev).astype(ct, copy=False)  # (B·Hq, L, Ev)
    # 2) D = rowsum(dO ∘ O), once for all tiles (einsum: no (B·Hq, L, Ev) product in memory)
    d = np.einsum("hle,hle->hl", d_o, o)  # (B·Hq, L)
    # a row that saw no key has lse = -inf; +inf instead makes its P = exp(S − lse) exactly 0, not NaN
    lse_c = lse.reshape(n_heads, dims.n_q).astype(ct)  # (B·Hq, L), a copy we may change
    lse_c[np.isneginf(lse_c)] = np.inf

    dq = np.zeros((n_heads, dims.n_q, dims.e), ct)  # (B·Hq, L, E)
    # dk, dv per query head when G > 1 (summed over the group below), else straight into the result
    dk_heads = np.zeros((n_heads, dims.n_k, dims.e), ct)  # (B·Hq, S, E)
    dv_heads = np.zeros((n_heads, dims.n_k, dims.ev), ct)  # (B·Hq, S, Ev)

    # 3) the forward's tiles, grouped by key block: Algorithm 2 walks key blocks outside
    tiles = tile_plan(dims.n_q, dims.n_k, block_q, block_k, causal=causal)
    offset = causal_offset(dims.n_q, dims.n_k) if causal else 0
    by_key_block: dict[int, list[Tile]] = {}
    for t in tiles:
        by_key_block.setdefault(t.k_start, []).append(t)
    bq, bk = min(block_q, dims.n_q), min(block_k, dims.n_k)
    ordered_dq = _OrderedDq(dq, tiles)

    def run(item: tuple[int, int]) -> None:
        k_start, h = item
        kv = h // group  # query head h reads kv head h // G (within its batch entry)
        cols = slice(k_start, min(k_start + block_k, dims.n_k))
        tile_buf, dp_buf = np.empty((bq, bk), ct), np.empty((bq, bk), ct)  # this item's two tiles

        def add_dq(t: Tile, share: np.ndarray) -> None:
            ordered_dq.add(h, t, share)

        try:
            _key_block_grads(q_s[h], k_c[kv], v_c[kv], d_o[h], lse_c[h], d[h], by_key_block[k_start], offset,
                             add_dq, dk_heads[h, cols], dv_heads[h, cols], tile_buf, dp_buf)  # fmt: skip
        except BaseException:
            ordered_dq.fail()  # wake the items that wait for this one's turn
            raise

    # 4) the items, key block by key block (the longest first under a causal mask). The pool takes them
    #    in this order, so an item only ever waits (in ordered_dq) for an earlier one, which is running
    #    or done: no deadlock. Each item writes only its own rows of dk_heads[h] and dv_heads[h].
    #    BLAS on one thread: the workers are the parallelism, and a one-thread matmul sums in one fixed order.
    #    It is flash_attention's own limit, shared on purpose: a forward and a backward running at once in two
    #    threads hold one limit between them, where two separate limits would each restore BLAS's threads
    #    when they end, under the other's feet.
    with _one_blas_thread():
        items = [(k_start, h) for k_start in sorted(by_key_block) for h in range(n_heads)]
        if workers == 1 or len(items) <= 1:
            for item in items:
                run(item)
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(run, items))

    # 5) dQ's scale, once; a kv head's gradient is the sum over its G query heads (in head order)
    dq *= scale
    if group > 1:
        dk_c = dk_heads.reshape(n_kv_heads, group, dims.n_k, dims.e).sum(axis=1)  # (B·Hkv, S, E)
        dv_c = dv_heads.reshape(n_kv_heads, group, dims.n_k, dims.ev).sum(axis=1)  # (B·Hkv, S, Ev)
    else:
        dk_c, dv_c = dk_heads, dv_heads

    grads = (
        dq.reshape(q.shape).astype(q.dtype, copy=False),
        dk_c.reshape(k.shape).astype(k.dtype, copy=False),
        dv_c.reshape(v.shape).astype(v.dtype, copy=False),
    )
    if two_d:
        return grads[0][0], grads[1][0], grads[2][0]
    return grads


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
