"""The gradients of attention, by hand: the reference from the weights, and FlashAttention-2's blockwise
backward that recomputes them tile by tile.

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

Through flex attention's mods (flex.py), the forward's S' = score_mod(S) takes S's place in those lines,
and three more follow from the chain rule (flex_attention_backward):

    dS = dS' ∘ ∂S'/∂S                         the score_mod's derivative (1 for a bias)
    dθ_h = Σ_ij dS'_ij ∂S'_ij/∂θ_h            a learned parameter of the score_mod (ALiBi's slopes, a bias table)
    dsink_h = −Σ_i exp(sink_h − lse_i) D_i    a sink is a key with a logit and no value

Read it in this order: attention_backward and _attention_flex_grads (the reference: the five lines above
on whole matrices), flash_attention_backward_one_head (Algorithm 2 for one head on one thread, as the paper
prints it), then flash_attention_backward (the same, with every key block of every head a work item), and
flex_attention_backward (the same loop over a block mask's tiles, through the mods).
"""

from __future__ import annotations

import itertools
import threading
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._atomic import holding
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
from ._guard import attention_backward_bytes, refuse_blockwise, refuse_if_too_big
from ._parallel import Stopped, one_blas_thread, run_items
from .attention import _grouped, _mods_bytes, _ScoreRules, attend, check_attention
from .blockmask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, Band, Heads, Tile, TileMask, check_band
from .flash import (
    TileMods,
    _check_one_head,
    apply_mods,
    backward_heads_per_item,
    backward_side,
    broadcast_kv,
    call_workers,
    diagonal_of,
)
from .flex import check_flex
from .mods import check_score_mod, derivative_of, score_indices

Array = NDArray[np.floating]

__all__ = [
    "FlexGrads",
    "attention_backward",
    "flash_attention_backward",
    "flash_attention_backward_one_head",
    "flex_attention_backward",
]


def _check_like(x: Any, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """x as a float array of exactly `shape` (what: the shape in symbols, for the message)."""
    x = as_float_array(x, name)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {what} = {shape}; got shape {x.shape}")
    return x


class FlexGrads(NamedTuple):
    """What flex_attention_backward returns: dq, dk, dv like q, k, v; dscore_mod, the gradient of the
    score_mod's learned parameters (shaped like score_mod.params; None when it has none); dsinks (Hq,)
    (None without sinks)."""

    dq: Array
    dk: Array
    dv: Array
    dscore_mod: Array | None
    dsinks: Array | None


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
    score_mod: Any = None,
    mask_mod: Any = None,
    sinks: Any = None,
) -> tuple[Array, Array, Array]:
    """The gradients of attention(q, k, v, causal=causal, mask=mask, scale=scale, align=align, window=window,
    score_mod=score_mod, mask_mod=mask_mod, sinks=sinks) for ∂loss/∂out = dout.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), dout (..., Hq, L, Ev)
    -> dq, dk, dv shaped and typed like q, k, v. Builds the (..., Hq, L, S) weights, like attention(), and
    check_memory=True refuses (AttentionMemoryError), before anything is converted or built, a call whose
    peak does not fit in the memory available (_guard.attention_backward_bytes; an upper bound with mods).
    A score_mod must give its derivative, as for flex_attention_backward (mods.Differentiable).
    """
    check_memory = check_bool(check_memory, "check_memory")
    two_d = without_head_axis(q)
    q, k, v, dims, scale, rules = check_attention(
        q, k, v, causal=causal, mask=mask, scale=scale, align=align, window=window, mask_mod=mask_mod,
        score_mod=check_score_mod(score_mod, backward=True), sinks=sinks,
    )  # fmt: skip
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    dout = _check_like(dout, "dout", out_shape[1:] if two_d else out_shape, "out's (..., Hq, L, Ev)")
    ct = compute_dtype(q, k, v, dout)
    if check_memory:  # first, on shapes and dtypes alone: the float16 copies below are part of the bill
        check_backward_fits(dims, np.result_type(q, k, v, dout), rules)
    q_c, k_c, v_c, d_o = (x.astype(ct, copy=False) for x in (q, k, v, dout))
    dq, dk, dv, _, _ = _attention_flex_grads(q_c, k_c, v_c, d_o.reshape(out_shape), dims, scale, rules)
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    return (grads[0][0], grads[1][0], grads[2][0]) if two_d else grads


@np.errstate(invalid="ignore")  # an inf input: NaN where it reaches (inf - inf, 0 · inf), as torch; no warning
def _attention_flex_grads(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, dims: QKVShape, scale: float, rules: _ScoreRules
) -> FlexGrads:
    """The five lines of the module doc on whole matrices, for inputs attention_backward() checked, in the
    compute dtype: -> dq (..., Hq, L, E), dk (..., Hkv, S, E), dv (..., Hkv, S, Ev) in FlexGrads; and
    through flex attention's mods (the rules' score_mod and sinks): dS = dS' ∘ ∂S'/∂S
    with the learned parameters' gradient from dS' (score_mod_grads), and dsink_h = -Σ_i P_sink,i D_i, where
    P_sink,i = 1 - Σ_j P_ij is the weight the row's keys did not take."""
    # 1) the forward again, keeping the weights P (..., Hq, L, S) and the output O (..., Hq, L, Ev)
    o, p = attend(q, k, v, dims, scale, rules)
    p, o, d_o = (
        _grouped(p, dims, kv=False),
        _grouped(o, dims, kv=False),
        _grouped(dout, dims, kv=False),
    )  # (.., G, L, .)
    k_g, v_g = _grouped(k, dims, kv=True), _grouped(v, dims, kv=True)  # (..., Hkv, 1, S, E): shared by the G heads
    # 2) dV = Pᵀ dO, summed over the G query heads that read each kv head
    dv = (p.swapaxes(-1, -2) @ d_o).sum(axis=-3)  # (..., Hkv, G, S, Ev) -> (..., Hkv, S, Ev)
    # 3) dP = dO Vᵀ
    ds = d_o @ v_g.swapaxes(-1, -2)  # (..., Hkv, G, L, S): dP, made into dS in place below
    # 4) dS = P ∘ (dP − D), D = rowsum(dO ∘ O): softmax's Jacobian applied to dP
    d = np.einsum("...le,...le->...l", d_o, o)  # (..., Hkv, G, L)
    p_sink = None if rules.sinks is None else 1 - p.sum(axis=-1)  # (..., Hkv, G, L)
    ds -= d[..., None]
    ds *= p  # (..., Hkv, G, L, S); 0 wherever P is 0 (masked keys, rows that see nothing)
    del p  # dS alone is needed from here on
    # 4b) through the score_mod: dS' above is ∂loss/∂S' for S' = score_mod(S)
    dparams = None if rules.score_mod is None else score_mod_grads(ds, q, k, dims, scale, rules.score_mod)
    dsinks = None if p_sink is None else -(p_sink * d).reshape(-1, dims.hq, dims.n_q).sum(axis=(0, 2))  # (Hq,)
    # 5) dQ = scale · dS K and dK = scale · dSᵀ Q (summed over the group, like dV)
    dq = ds @ k_g  # (..., Hkv, G, L, E)
    dq *= scale
    dk = (ds.swapaxes(-1, -2) @ _grouped(q, dims, kv=False)).sum(axis=-3)  # (..., Hkv, S, E)
    dk *= scale
    return FlexGrads(dq.reshape(*dims.batch, dims.hq, dims.n_q, dims.e), dk, dv, dparams, dsinks)


def score_mod_grads(ds: np.ndarray, q: np.ndarray, k: np.ndarray, dims: QKVShape, scale: float, score_mod: Any) -> Any:
    """On whole matrices: the learned parameters' gradient from dS' (param_grad, head by head), then dS' made
    into dS = dS' ∘ ∂S'/∂S in place, the derivative taken at the raw scores S = q kᵀ · scale, made again."""
    ds_heads = ds.reshape(-1, dims.hq, dims.n_q, dims.n_k)  # (B, Hq, L, S) view, B flat over the leading dims
    b, h, q_idx, kv_idx = score_indices(dims.batch, dims.hq, dims.n_q, dims.n_k)
    params, dparams = getattr(score_mod, "params", None), None
    if params is not None:  # one parameter row per head, shared by the batch entries
        dparams = np.zeros(params.shape, ds.dtype)
        for b_i, h_i in np.ndindex(ds_heads.shape[:2]):
            dparams[h_i] += score_mod.param_grad(ds_heads[b_i, h_i], b_i, h_i, q_idx, kv_idx)
    q_s = np.multiply(q, scale, dtype=k.dtype)  # as attend() scales, so the same S
    s = _grouped(q_s, dims, kv=False) @ _grouped(k, dims, kv=True).swapaxes(-1, -2)  # (..., Hkv, G, L, S)
    derivative = derivative_of(score_mod, s.reshape(*dims.batch, dims.hq, dims.n_q, dims.n_k), b, h, q_idx, kv_idx)
    if derivative is not None:
        ds_heads *= np.broadcast_to(derivative, (*dims.batch, dims.hq, dims.n_q, dims.n_k)).reshape(ds_heads.shape)
    return dparams


def check_backward_fits(dims: QKVShape, dtype: np.dtype, rules: _ScoreRules) -> None:
    """Refuse, on shapes and dtypes alone, an attention_backward() whose peak does not fit in memory."""
    batch = int(np.prod(dims.batch, dtype=np.int64))
    if batch == 0 or dims.hq == 0:
        return
    mask = rules.mask
    inverted = mask.size if mask is not None and mask.dtype == np.bool_ else None  # ~mask: a bool mask's size
    needed = attention_backward_bytes(
        dims.n_q, dims.n_k, heads=dims.hq, kv_heads=dims.hkv, head_dim=dims.e, head_dim_v=dims.ev, batch=batch,
        dtype=dtype, causal=rules.offset is not None, bool_mask=inverted is not None, mask_elements=inverted,
        window=rules.window,
    ) + _mods_bytes(dims, dtype, rules, score_arrays=5)  # fmt: skip
    scores = (*dims.batch, dims.hq, dims.n_q, dims.n_k)
    refuse_if_too_big(needed, "attention_backward()", f"two arrays of {scores}", "flash_attention_backward()")


# ---------------------------------------------------------------------------------------------------
# Algorithm 2, one head on one thread


def flash_attention_backward_one_head(
    q: Array,  # (L, E)
    k: Array,  # (S, E)
    v: Array,  # (S, Ev)
    out: Array,  # (L, Ev)
    dout: Array,  # (L, Ev)
    lse: Array,  # (L,)
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[Array, Array, Array]:  # dq (L, E), dk (S, E), dv (S, Ev)
    """FlashAttention-2's backward (Dao 2023, Algorithm 2) for one head, as the paper prints it: for each key
    block K_j, V_j (B_c = block_k rows), over the query blocks Q_i (B_r = block_q rows) that see it, the
    weights P_ij = exp(S_ij - L_i) made again from the forward's logsumexp, then the five lines of the module
    doc on the tile. A comment's first number is the line of the paper's algorithm.

    out and lse from flash_attention_one_head(q, k, v) with the same causal and scale; dout = ∂loss/∂out
    -> dq, dk, dv in the compute dtype. S = scale · Q Kᵀ, so dQ and dK carry the scale (the paper folds it
    into Q). causal=True is bottom-right, as in the forward, and skips the query blocks that see nothing of
    K_j. flash_attention_backward is the same algorithm with every key block of every head a work item; the
    tests hold the two equal.
    """
    q, k, v, out, dout, lse, scale = check_one_head_backward(q, k, v, out, dout, lse, causal, scale, block_q, block_k)
    n_q, n_k, offset = len(q), len(k), len(k) - len(q)  # L queries, S keys; query i sees key j <= i + offset
    lse = np.where(np.isneginf(lse), np.inf, lse)  # (L,) a row that saw no key: P = exp(S - inf) = 0, not NaN
    d = np.sum(dout * out, axis=1)  # (L,) 4: D = rowsum(dO ∘ O)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)  # (L, E), (S, E), (S, Ev) 3: dQ = 0
    for k_start in range(0, n_k, block_k):  # 5: for each key block j
        cols = np.arange(k_start, min(k_start + block_k, n_k))  # (Bc,) the rows of K_j and V_j
        k_j, v_j = k[cols], v[cols]  # (Bc, E), (Bc, Ev) 6: K_j, V_j
        dk_j, dv_j = np.zeros_like(k_j), np.zeros_like(v_j)  # (Bc, E), (Bc, Ev) 7: dK_j = 0, dV_j = 0
        first = max(0, k_start - offset) // block_q * block_q if causal else 0  # causal: the first block to see K_j
        for q_start in range(first, n_q, block_q):  # 8: for each query block i
            rows = np.arange(q_start, min(q_start + block_q, n_q))  # (Br,) the rows of Q_i, dO_i, L_i, D_i
            s = (q[rows] * scale) @ k_j.T  # (Br, Bc) 10: S_ij = scale · Q_i K_jᵀ, as the forward rounds it
            if causal:  # in a tile the diagonal crosses: exp(-inf) = 0, a hidden key has no weight
                s[cols > rows[:, None] + offset] = -np.inf
            p = np.exp(s - lse[rows, None])  # (Br, Bc) 11: P_ij = exp(S_ij - L_i)
            dv_j += p.T @ dout[rows]  # (Bc, Ev) 12: dV_j += P_ijᵀ dO_i
            dp = dout[rows] @ v_j.T  # (Br, Bc) 13: dP_ij = dO_i V_jᵀ
            ds = p * (dp - d[rows, None])  # (Br, Bc) 14: dS_ij = P_ij ∘ (dP_ij - D_i)
            dq[rows] += scale * (ds @ k_j)  # (Br, E) 15: dQ_i += scale · dS_ij K_j
            dk_j += scale * (ds.T @ q[rows])  # (Bc, E) 16: dK_j += scale · dS_ijᵀ Q_i
        dk[cols], dv[cols] = dk_j, dv_j  # 18: write dK_j, dV_j
    return dq, dk, dv


def check_one_head_backward(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, causal: Any, scale: Any, block_q: Any, block_k: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """One head's forward inputs checked as flash_attention_one_head checks them, out (L, Ev), dout (L, Ev) and
    lse (L,) against their shapes, all six in the compute dtype, with the scale."""
    q_c, k_c, v_c, scale = _check_one_head(q, k, v, causal, scale, block_q, block_k)
    dims = QKVShape((), 1, 1, len(q_c), len(k_c), q_c.shape[1], v_c.shape[1])
    out, dout, lse = check_saved(out, dout, lse, dims, two_d=True)
    ct = compute_dtype(q_c, k_c, v_c, out, dout)
    q_c, k_c, v_c, out, dout, lse = (x.astype(ct, copy=False) for x in (q_c, k_c, v_c, out, dout, lse))
    return q_c, k_c, v_c, out, dout, lse, scale


class _BackwardPlan(NamedTuple):
    """How _flex_backward runs a checked call: the scale, the tile mask (a Band or a BlockMask), the tile
    sizes, the workers, and flex attention's score_mod (one that gives its derivative) and sinks (Hq,)."""

    scale: float
    tile_mask: TileMask
    block_q: int
    block_k: int
    workers: int
    score_mod: Any = None
    sinks: np.ndarray | None = None


def check_flash_backward(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, *, causal: Any, scale: Any, window: Any,
    block_q: Any, block_k: Any, workers: Any, align: Any = "bottom_right",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, QKVShape, _BackwardPlan]:  # noqa: E501  # fmt: skip
    """flash_attention_backward's inputs checked, once (shapes against q's), and its plan."""
    two_d = without_head_axis(q)
    k, v = broadcast_kv(q, k, v)  # k and v of batch 1 against a larger query batch: views over it
    q, k, v, dims = check_qkv(q, k, v)
    out, dout, lse = check_saved(out, dout, lse, dims, two_d)
    band = check_band(causal, window, dims.n_q, dims.n_k, align)
    side = backward_side(dims.n_q, diagonal_of(band))  # smaller for a short causal band
    plan = _BackwardPlan(
        check_scale(scale, dims.e, compute_dtype(q, k, v)),
        band,
        check_positive_int(block_q, "block_q", default=side),
        check_positive_int(block_k, "block_k", default=side),
        call_workers(dims, workers),
    )
    return q, k, v, out, dout, lse, dims, plan


def check_saved(out: Any, dout: Any, lse: Any, dims: QKVShape, two_d: bool) -> tuple[np.ndarray, ...]:
    """The forward's out and lse and the incoming dout, checked against the shapes q, k, v give them."""
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)[1 if two_d else 0 :]
    out = _check_like(out, "out", out_shape, "(..., Hq, L, Ev)")
    dout = _check_like(dout, "dout", out_shape, "out's (..., Hq, L, Ev)")
    return out, dout, _check_like(lse, "lse", out_shape[:-1], "(..., Hq, L)")


# ---------------------------------------------------------------------------------------------------
# the fast path: every key block of every head is a work item


def key_block_grads(
    q_lse: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, do_d: np.ndarray, lse: np.ndarray, mods: TileMods,
    tiles: Any, add_dq: Any, dk_rows: np.ndarray, dv_rows: np.ndarray, param_rows: np.ndarray | None = None,
) -> None:  # fmt: skip
    """Algorithm 2's inner loop for one key block j over the query blocks i that see it (tiles), for c heads
    at once that share those tiles: adds into dk_rows (c, bk, E) and dv_rows (c, bk, Ev), and hands each
    tile's share of dq, dS K_j (c, bq, E), and of P's row sums (c, bq) to add_dq (dq unscaled: the caller
    multiplies dq by the scale once). q_lse (c, L, E + 1) and do_d (c, L, Ev + 1) are _query_rows': q times
    the scale beside −L (0 with a score_mod), dO beside −D = −rowsum(dO ∘ O); k_j (c, bk, E) and v_j
    (c, bk, Ev) the key block's keys and values; lse (c, L) with +inf for rows that see no key. mods: the
    tile's score_mod and mask_mod, as in the forward, with b and h broadcasting against a (c, bq, bk) tile;
    param_rows: where the learned score_mod's parameter gradient of this head and key block adds up (None:
    nothing learned; c is 1 then).

    Why this is fast: a tile's two subtractions ride in its matmuls as one more term of each dot product,
        S − L_i = [Q_i, −L_i] [K_j, 1]ᵀ        dP − D_i = [dO_i, −D_i] [V_j, 1]ᵀ
    (a 65th column costs a 64-column matmul about 2%, a pass over the tile much more), and P's row sums
    are the matrix-vector product P 1. A score_mod needs S itself, so with one, S − L_i comes after it.
    The rows [Q_i, −L_i] and [dO_i, −D_i] are slices of q_lse and do_d, made once for every key block;
    [K_j, 1]ᵀ and [V_j, 1]ᵀ, and the tiles P and dS (and S for a score_mod), once for this block's tiles.
    Heads that share their tiles go c to an item: fewer, larger matmuls, each worth more of the Python
    around it.
    """
    tiles = iter(tiles)
    first = next(tiles, None)
    if first is None:
        return
    (c, bk, _), height, dtype = k_j.shape, first.q_stop - first.q_start, q_lse.dtype  # height: the widest tile
    k_one_t, v_one_t = ones_row_below(k_j), ones_row_below(v_j)  # [K_j, 1]ᵀ (c, E + 1, bk), [V_j, 1]ᵀ (c, Ev + 1, bk)
    p_buf, ds_buf, *raw_buf = np.empty((2 if mods.score_mod is None else 3, c * height * bk), dtype)
    ones = np.ones(bk, dtype)  # (bk,) P 1: P's row sums
    for t in itertools.chain([first], tiles):
        rows, bq = slice(t.q_start, t.q_stop), t.q_stop - t.q_start
        p, ds, *raw = (buffer[: c * bq * bk].reshape(c, bq, bk) for buffer in (p_buf, ds_buf, *raw_buf))
        q_idx, kv_idx = np.arange(t.q_start, t.q_stop)[:, None], np.arange(t.k_start, t.k_stop)
        # 1) scores of this tile less the forward's logsumexp, S − L_i (the scale is folded into q); with a
        #    score_mod, S first (q_lse's column is 0 then), kept raw for its derivative, and L_i taken off after
        np.matmul(q_lse[:, rows], k_one_t, out=p)  # (c, bq, E + 1) @ (c, E + 1, bk)
        if raw:
            np.copyto(raw[0], p)
        # 2) S' = score_mod(S), -inf where the mask_mod hides a key; P = exp(S' − L_i): the forward's
        #    probabilities, exactly normalised, without a row max or sum (a hidden key: exp(-inf) = 0)
        apply_mods(p, t, mods, q_idx, kv_idx, keys_down=False)
        if raw:
            p -= lse[:, rows, None]
        np.exp(p, out=p)  # (c, bq, bk) P
        # 3) dV_j += Pᵀ dO_i
        dv_rows += p.transpose(0, 2, 1) @ do_d[:, rows, :-1]  # (c, bk, bq) @ (c, bq, Ev)
        # 4) dP − D_i = dO_i V_jᵀ − D_i in one matmul, then dS' = P ∘ (dP − D_i), in place; through the
        #    score_mod: dS = dS' ∘ ∂S'/∂S
        np.matmul(do_d[:, rows], v_one_t, out=ds)  # (c, bq, Ev + 1) @ (c, Ev + 1, bk): dP − D_i
        ds *= p  # (c, bq, bk) dS'
        if raw:
            through_score_mod(ds, raw[0], mods, q_idx, kv_idx, param_rows)
        # 5) dQ_i += dS K_j (added in key-block order, with P's row sums: OrderedDq) and dK_j += dSᵀ (scale · Q_i)
        add_dq(t, ds @ k_j, p @ ones)  # (c, bq, bk) @ (c, bk, E), (c, bq, bk) @ (bk,)
        dk_rows += ds.transpose(0, 2, 1) @ q_lse[:, rows, :-1]  # (c, bk, bq) @ (c, bq, E)


def ones_row_below(x: np.ndarray) -> np.ndarray:
    """[x, 1]ᵀ: x (c, n, m) transposed, with a row of ones below -> (c, m + 1, n), stored as it is read. A
    transposed view would do for the matmul, but OpenBLAS multiplies by a right operand stored transposed more
    slowly than by one stored row by row (python scripts/tiles.py --profile shows the backward's matmuls)."""
    c, n, m = x.shape
    out = np.empty((c, m + 1, n), x.dtype)
    out[:, :m] = x.transpose(0, 2, 1)
    out[:, m] = 1.0
    return out


def through_score_mod(ds: np.ndarray, s: np.ndarray, mods: TileMods, q_idx: Any, kv_idx: Any,
                      param_rows: np.ndarray | None) -> None:  # fmt: skip
    """The chain rule through S' = score_mod(S), in place: ds holds dS' = ∂loss/∂S' and becomes
    dS = dS' ∘ ∂S'/∂S (derivative None: 1, a bias). Learned parameters first take their share of dS'
    (param_grad) into param_rows."""
    if param_rows is not None:
        param_rows += mods.score_mod.param_grad(ds, mods.b, mods.h, q_idx, kv_idx)
    derivative = derivative_of(mods.score_mod, s, mods.b, mods.h, q_idx, kv_idx)  # checked: numbers of s's shape
    if derivative is not None:
        ds *= derivative


class OrderedDq:
    """dq (n, c, L, E) and P's row sums (n, c, L), into which the key blocks of each of n groups of c heads (a
    backward item's heads) add their shares in key-block order, whatever the threads' timing: a wavefront.

    Key block j adds its share to the rows of query block i only once every earlier key block that sees
    query block i has added its own. Each row is then the sum over j = 0, 1, ... in that order, on any
    number of workers: the same bits as one thread, with neither an atomic add (a GPU's answer, whose
    order, and so last bits, would depend on the timing) nor a copy of dq per key block. A tile's place
    in that order is how many tiles of its row come before it (the mask's place(): for the causal band,
    its distance from the first key block the row sees): no table of tiles. The bookkeeping is one count
    per (group, query block), and per group how many of its key blocks have finished, from the first on.

    Every wait ends. A tile waits only for tiles of earlier key blocks of its group, and those items were
    taken before it (run_items takes them in order): they add their share, raise (then fail() wakes
    every waiter, which stops), or finish without reaching this tile's turn. In the last case the turn
    can never come (a mask whose column tiles or places disagree with its rows), and the tile raises a
    RuntimeError instead of waiting.
    """

    def __init__(
        self, dq: np.ndarray, p_sums: np.ndarray, tile_mask: TileMask, n_k: int, block_q: int, block_k: int
    ) -> None:
        self.dq, self.p_sums, self.tile_mask, self.n_k = dq, p_sums, tile_mask, n_k
        self.block_q, self.block_k = block_q, block_k
        self.added = np.zeros((dq.shape[0], -(-dq.shape[2] // block_q)), np.int64)  # key blocks added so far
        self.finished = np.zeros((dq.shape[0], -(-n_k // block_k) + 1), bool)  # (groups, key blocks + 1)
        self.done = np.zeros(dq.shape[0], np.int64)  # per group: key blocks 0 .. done - 1 have all finished
        self.turn = threading.Condition()
        self.failed = False

    def add(self, h: int, t: Tile, share: np.ndarray, p_sum: np.ndarray, heads: Heads | None = None) -> None:
        """dq[h, :, t's rows] += share (c, bq, E) and p_sums[h, :, t's rows] += p_sum (c, bq), once it is t's
        turn. heads: group h's heads as (batch entry, query head), for a mask whose tiles differ between
        heads (one head a group then)."""
        place, block = self.tile_mask.place(t, self.n_k, self.block_k, heads), t.q_start // self.block_q
        holding(self.turn, self._add_in_turn, h, t, block, place, share, p_sum)

    def _add_in_turn(self, h: int, t: Tile, block: int, place: int, share: np.ndarray, p_sum: np.ndarray) -> None:
        """add, under the turn's lock (taken through holding: a Ctrl-C at any bytecode never leaves it held,
        which would make every other worker wait for it forever)."""
        key_block = t.k_start // self.block_k
        # its turn, or every earlier key block of the group has finished: then the turn has come or never will
        self.turn.wait_for(lambda: self.failed or self.added[h, block] == place or self.done[h] >= key_block)
        if self.failed:  # another item raised: stop instead of waiting for a turn that never comes
            raise Stopped
        if self.added[h, block] != place:
            raise RuntimeError(
                f"the tiles of query block {block} of head {h} are out of order: key block {key_block} is "
                f"tile {place} of its row, but the key blocks before it, all finished, added "
                f"{self.added[h, block]} tiles; the mask's column tiles and places disagree with its rows"
            )
        self.dq[h, :, t.q_start : t.q_stop] += share
        self.p_sums[h, :, t.q_start : t.q_stop] += p_sum
        self.added[h, block] = place + 1
        self.turn.notify_all()

    def finish(self, h: int, k_start: int) -> None:
        """Key block k_start of group h has added all its tiles: wake the tiles that wait on it."""
        holding(self.turn, self._finish, h, k_start // self.block_k)

    def _finish(self, h: int, key_block: int) -> None:
        self.finished[h, key_block] = True
        while self.finished[h, self.done[h]]:  # the last column stays False: done stops at the key blocks' count
            self.done[h] += 1
        self.turn.notify_all()

    def fail(self) -> None:
        holding(self.turn, self._fail)

    def _fail(self) -> None:
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
    align: str = "bottom_right",
) -> tuple[Array, Array, Array]:
    """The gradients of flash_attention(q, k, v, causal=causal, scale=scale, window=window, align=align),
    blockwise.

    q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev); out (..., Hq, L, Ev) and lse (..., Hq, L)
    from flash_attention(..., return_lse=True); dout (..., Hq, L, Ev) = ∂loss/∂out
    -> dq, dk, dv shaped and typed like q, k, v. causal=True is bottom-right aligned, as in the forward.
    k and v of batch 1 against a larger query batch (as the forward takes them) get dk and dv summed over
    the query's batch entries, as torch gives them.
    Pass the forward's causal, window, align and scale: P = exp(S − lse) is only the forward's weights
    under the forward's mask. The backward checks that P's rows sum to 1 and raises a ValueError where
    they do not (an lse from another mask, scale or input), rather than return the gradients of another
    function.

    FlashAttention-2's backward (Dao 2023, Algorithm 2):
        D = rowsum(dO ∘ O) once; then for each key block j, for each query block i that sees it:
        P = exp(S_ij − lse_i);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − D_i);
        dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
    The tiles are those the forward runs: a tile the forward skips holds only zeros of P.

    Work items and races: one item is one key block, as in Algorithm 2, where the key blocks run in
    parallel, of as many query heads as share their tiles (a causal band) and fill one of the forward's tile
    steps, each matmul one batched call (_heads_per_item). The item owns its rows of dk and dv outright.
    dq rows receive a share from every key block that sees them: on a GPU an atomic add, whose order, and
    so whose last bits, depend on the timing. Here the shares are added in key-block order instead
    (OrderedDq), so the result is the same bits for any `workers` and any heads per item. With grouped-query
    heads, the G query heads of a kv head each fill their own (S, E) copy of dk and dv, summed in head
    order at the end: G - 1 extra copies of k and v, O(S·E).
    Memory: dq, dk, dv, [q·scale, −lse] and [dout, −D] (made once for every tile), and per worker two
    block_q x block_k tiles; the tiles are made as each item runs, so the bookkeeping is one count per
    (item's heads, query block).
    block_q, block_k (default 256; halved, but not below 64, for a causal band without a window over a short
    context, L = S under 1,024: flash.backward_side) and workers (default: one per core, at most one per 2^18
    scores: flash.call_workers), or what tinyattn_np.tune() measured on this machine (flash.tile_rule); BLAS is
    held to one thread meanwhile, as in the forward.
    """
    two_d = without_head_axis(q)
    kv_shapes = np.shape(k), np.shape(v)  # as given: a batch of 1 broadcast over q's gets its gradients summed
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        q, k, v, out, dout, lse, causal=causal, scale=scale, window=window, block_q=block_q, block_k=block_k,
        workers=workers, align=align,
    )  # fmt: skip
    refuse_blockwise("flash_attention_backward()", q, k, v, dims, plan, heads_per_step=_call_heads(dims, plan),
                     backward=True)  # fmt: skip
    dq, dk, dv, _, _ = _flex_backward(q, k, v, out, dout, lse, dims, plan)
    if two_d:
        return dq[0], dk[0], dv[0]
    # k and v of batch 1 served every batch entry: their gradients are the sums over the batch
    return dq, summed_to(dk, kv_shapes[0]), summed_to(dv, kv_shapes[1])


def flex_attention_backward(
    query: Array,
    key: Array,
    value: Array,
    out: Array,
    dout: Array,
    lse: Array,
    *,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: Any = None,
    workers: int | None = None,
) -> FlexGrads:
    """The gradients of flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, sinks=sinks),
    blockwise, by hand (torch's flex_attention has no backward on CPU).

    out and lse from flex_attention(..., return_lse=True); dout = ∂loss/∂out -> FlexGrads(dq, dk, dv,
    dscore_mod, dsinks); key and value of batch 1 (broadcast over the query's batch) get their gradients
    summed over it. The same Algorithm 2 loop as flash_attention_backward over the block mask's
    non-empty tiles, with the forward's S' = score_mod(S) in place of S, and two more lines:

        dS = dS' ∘ ∂S'/∂S                 score_mod.derivative(S, b, h, q_idx, kv_idx); None means 1 (a bias)
        dθ_h = Σ_ij dS'_ij ∂S'_ij/∂θ_h    score_mod.param_grad: learned parameters θ (Alibi's slopes with
                                          learned=True, RelativeBias's table), summed in key-block order
        dsink_h = -Σ_i exp(sink_h − lse_i) D_i    a sink is a key with a score and no value: O_i loses the
                                                  weight it takes, ∂O_i/∂sink_h = −P_sink,i O_i

    A score_mod must give its derivative: a ready-made mod (mods.Alibi, Softcap, RelativeBias), or
    mods.Differentiable(your_score_mod, derivative); anything else is refused with a TypeError that says
    so. P's rows (with the sink's weight) are checked to sum to 1, as in flash_attention_backward.
    """
    two_d = without_head_axis(query)
    q, k, v, dims, fplan = check_flex(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        sinks=sinks, workers=workers, backward=True,
    )  # fmt: skip
    out, dout, lse = check_saved(out, dout, lse, dims, two_d)
    plan = _BackwardPlan(fplan.scale, fplan.tile_mask, fplan.block_q, fplan.block_k, fplan.workers, fplan.score_mod,
                        fplan.sinks)  # fmt: skip
    refuse_blockwise("flex_attention_backward()", q, k, v, dims, plan, heads_per_step=_call_heads(dims, plan),
                     backward=True)  # fmt: skip
    grads = _flex_backward(q, k, v, out, dout, lse, dims, plan)
    if two_d:
        return grads._replace(dq=grads.dq[0], dk=grads.dk[0], dv=grads.dv[0])
    # key and value of batch 1 served every batch entry: their gradients are the sums over the batch
    return grads._replace(dk=summed_to(grads.dk, np.shape(key)), dv=summed_to(grads.dv, np.shape(value)))


def summed_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """grad (*batch, H, S, E) summed over the batch entries when shape's batch dims are all 1 (a broadcast
    input), in at least float32, in batch order; else grad as it is."""
    if grad.shape == shape:
        return grad
    total = grad.reshape(-1, *shape[-3:]).sum(axis=0, dtype=np.result_type(grad.dtype, np.float32))  # (H, S, E)
    return total.reshape(shape).astype(grad.dtype, copy=False)


def _flex_backward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray,
    dims: QKVShape, plan: _BackwardPlan,
) -> FlexGrads:  # fmt: skip
    """The blockwise backward on checked inputs: FlexGrads of the forward that plan describes."""
    ct = compute_dtype(q, k, v, out, dout)
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq  # every (batch, query head) pair
    n_kv_heads, group = n_heads // dims.group, dims.group
    # 1) inputs in the compute dtype, one head per leading index (views when they already are)
    k_c = np.ascontiguousarray(k.reshape(n_kv_heads, dims.n_k, dims.e), dtype=ct)  # (B·Hkv, S, E)
    v_c = np.ascontiguousarray(v.reshape(n_kv_heads, dims.n_k, dims.ev), dtype=ct)  # (B·Hkv, S, Ev)
    # 2) the query side: [q times the scale, −lse] and [dout, −D], D = rowsum(dO ∘ O), once for all tiles
    q_lse, do_d, d, lse_c = _query_rows(q, out, dout, lse, dims, plan.scale, ct, lse_column=plan.score_mod is None)
    # the sums the workers add into, zeroed here by this thread (np.full, not np.zeros): new memory is mapped
    # page by page where it is first written, and pages first written by several threads at once wait on
    # one another in the kernel (on a 2-core machine that made the backward slower on 2 workers than on 1)
    dq, p_sums = np.full((n_heads, dims.n_q, dims.e), 0, ct), np.zeros((n_heads, dims.n_q), ct)  # (B·Hq, L, E), ...
    # dk, dv per query head (summed over the group below when G > 1, else the result itself)
    dk_heads, dv_heads = np.full((n_heads, dims.n_k, dims.e), 0, ct), np.full((n_heads, dims.n_k, dims.ev), 0, ct)
    params = getattr(plan.score_mod, "params", None)  # learned: a gradient per (head, key block), summed in order
    n_k_blocks = -(-dims.n_k // plan.block_k)
    param_grads = None if params is None else np.zeros((n_heads, n_k_blocks, *params.shape[1:]), ct)
    # 3) every key block of every head, a work item
    _run_key_blocks(q_lse, k_c, v_c, do_d, lse_c, dq, p_sums, dk_heads, dv_heads, plan, dims.hq, param_grads)
    dsinks = sink_grads(p_sums, lse_c, d, dims, plan.sinks)  # adds the sink's weight to p_sums first
    _check_weights_sum_to_one(p_sums, lse_c)
    # 4) dQ's scale, once; a kv head's gradient is the sum over its G query heads (in head order)
    dq *= plan.scale
    dk_c = dk_heads.reshape(n_kv_heads, group, dims.n_k, dims.e).sum(axis=1) if group > 1 else dk_heads
    dv_c = dv_heads.reshape(n_kv_heads, group, dims.n_k, dims.ev).sum(axis=1) if group > 1 else dv_heads
    # 5) a learned score_mod's gradient: key blocks in order, then the batch entries (one parameter per head)
    dparams = None if params is None else param_grads.sum(axis=1).reshape(-1, *params.shape).sum(axis=0)  # type: ignore[union-attr]
    return FlexGrads(dq.reshape(q.shape).astype(q.dtype, copy=False), dk_c.reshape(k.shape).astype(k.dtype, copy=False),
                     dv_c.reshape(v.shape).astype(v.dtype, copy=False), dparams, dsinks)  # fmt: skip


def _query_rows(
    q: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray, dims: QKVShape, scale: float, ct: np.dtype,
    *, lse_column: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """What the blockwise backward reads on the query side, in the compute dtype ct, one head per leading index,
    made once for every tile: q_lse = [q · scale, −lse] (B·Hq, L, E + 1), do_d = [dout, −D] (B·Hq, L, Ev + 1)
    with D = rowsum(dO ∘ O), and D and lse (B·Hq, L) themselves, lse a copy with +inf where it was -inf.
    The extra columns are what key_block_grads' matmuls take off (q_lse[..., :-1] is q · scale, a view);
    lse_column=False puts 0 there instead of −lse (a score_mod needs S itself). The ring's backward makes
    its rows with it too."""
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq  # every (batch, query head) pair
    q_lse, do_d = np.empty((n_heads, dims.n_q, dims.e + 1), ct), np.empty((n_heads, dims.n_q, dims.ev + 1), ct)
    np.multiply(q.reshape(n_heads, dims.n_q, dims.e), scale, out=q_lse[..., :-1], dtype=ct)  # the scale folded in
    do_d[..., :-1] = dout.reshape(n_heads, dims.n_q, dims.ev)
    # D once for all tiles (einsum: no (B·Hq, L, Ev) product in memory)
    d = np.einsum("hle,hle->hl", do_d[..., :-1], out.reshape(n_heads, dims.n_q, dims.ev).astype(ct, copy=False))
    # a row that saw no key has lse = -inf; +inf instead makes its P = exp(S − lse) exactly 0, not NaN
    lse_c = lse.reshape(n_heads, dims.n_q).astype(ct)  # (B·Hq, L), a copy we may change
    lse_c[np.isneginf(lse_c)] = np.inf
    if lse_column:
        np.negative(lse_c, out=q_lse[..., -1])
    else:
        q_lse[..., -1] = 0.0
    np.negative(d, out=do_d[..., -1])
    return q_lse, do_d, d, lse_c


def _run_key_blocks(
    q_lse: np.ndarray, k: np.ndarray, v: np.ndarray, do_d: np.ndarray, lse: np.ndarray, dq: np.ndarray,
    p_sums: np.ndarray, dk_heads: np.ndarray, dv_heads: np.ndarray, plan: _BackwardPlan, hq: int,
    param_grads: np.ndarray | None = None,
) -> None:  # fmt: skip
    """Algorithm 2 with every key block of every head a work item (key_block_grads), on plan.workers threads;
    where every head has the same tiles, an item takes c heads at once (_heads_per_item).
    q_lse (B·Hq, L, E + 1), do_d (B·Hq, L, Ev + 1) and lse (B·Hq, L) are _query_rows', k (B·Hkv, S, E) and
    v (B·Hkv, S, Ev) as key_block_grads takes them. Adds into dq (B·Hq, L, E) and p_sums (B·Hq, L), in key-block
    order (OrderedDq), into dk_heads (B·Hq, S, E) and dv_heads (B·Hq, S, Ev), the shares of each query head,
    and into param_grads (B·Hq, key blocks, ...) for a learned score_mod. hq: query heads per batch entry, for
    a mask or mod that differs between heads. The ring's backward runs its pairs of chunks through it too."""
    n_heads, n_q, n_k = q_lse.shape[0], q_lse.shape[1], k.shape[1]
    group = n_heads // k.shape[0]  # query head h reads kv head h // G
    c = _heads_per_item(plan, n_heads, n_q, n_k)
    ordered_dq = OrderedDq(dq.reshape(n_heads // c, c, n_q, dq.shape[2]), p_sums.reshape(n_heads // c, c, n_q),
                           plan.tile_mask, n_k, plan.block_q, plan.block_k)  # fmt: skip

    def run(item: tuple[int, int]) -> None:
        k_start, g = item  # key block k_start of query heads g·c .. g·c + c - 1
        cols, its = slice(k_start, min(k_start + plan.block_k, n_k)), item_heads(g, c, hq, group)
        tiles = plan.tile_mask.column_tiles(cols.start, cols.stop, n_q, plan.block_q, its.heads)
        mods = TileMods(plan.tile_mask.mask_mod, plan.score_mod, its.b, its.h, diagonal_of(plan.tile_mask))
        param_rows = None if param_grads is None else param_grads[g, k_start // plan.block_k, ...]
        hs, kv = its.rows, its.kv
        key_block_grads(q_lse[hs], k[kv, cols], v[kv, cols], do_d[hs], lse[hs], mods, tiles,
                        partial(ordered_dq.add, g, heads=its.heads), dk_heads[hs, cols], dv_heads[hs, cols],
                        param_rows)  # fmt: skip
        ordered_dq.finish(g, k_start)

    # the items, key block by key block: an item only waits (in ordered_dq) for one taken before it
    items = ((k_start, g) for k_start in range(0, n_k, plan.block_k) for g in range(n_heads // c))
    with one_blas_thread():
        run_items(run, items, plan.workers, on_failure=ordered_dq.fail)


class ItemHeads(NamedTuple):
    """The c query heads of backward item group g: their rows of the (B·Hq, ...) arrays, as (batch entry, query
    head) pairs, b and h as a mod takes them (numbers for one head, (c, 1, 1) arrays that broadcast against a
    tile of c heads), and the kv head each reads: a slice when G = 1 (K_j and V_j are views then), else an
    index array (a gather: copies)."""

    rows: slice
    heads: Heads
    b: Any
    h: Any
    kv: Any


def item_heads(g: int, c: int, hq: int, group: int) -> ItemHeads:
    """The ItemHeads of group g of c heads, hq query heads per batch entry, G = group query heads per kv head."""
    rows = slice(g * c, g * c + c)
    flat = np.arange(rows.start, rows.stop)  # (c,) their (batch entry, query head) pairs, flat
    heads = Heads(flat // hq, flat % hq)
    b, h = (heads.b.reshape(c, 1, 1), heads.h.reshape(c, 1, 1)) if c > 1 else (g // hq, g % hq)
    return ItemHeads(rows, heads, b, h, rows if group == 1 else flat // group)


def _call_heads(dims: QKVShape, plan: _BackwardPlan) -> int:
    """_heads_per_item for a checked call's shapes."""
    return _heads_per_item(plan, int(np.prod(dims.batch, dtype=np.int64)) * dims.hq, dims.n_q, dims.n_k)


def _heads_per_item(plan: _BackwardPlan, n_heads: int, n_q: int, n_k: int) -> int:
    """How many query heads a backward item takes at once, c: 1 where the heads' tiles may differ (a block
    mask) or a score_mod runs; for a Band, flash.backward_heads_per_item's rule. Any c gives the same bits
    (each head's sums are the same, in the same order)."""
    if not isinstance(plan.tile_mask, Band) or plan.score_mod is not None:
        return 1
    return backward_heads_per_item(n_heads, n_q, n_k, plan.block_q, plan.block_k, plan.workers)


def sink_grads(p_sums: np.ndarray, lse: np.ndarray, d: np.ndarray, dims: QKVShape, sinks: np.ndarray | None) -> Any:
    """dsink_h = -Σ_i P_sink,i D_i over the rows of head h in every batch entry, P_sink,i = exp(sink_h - lse_i),
    the weight the sink took in row i; that weight is added to P's row sums (B·Hq, L), which then sum to 1."""
    if sinks is None:
        return None
    p_sink = np.exp(np.tile(sinks, len(p_sums) // dims.hq)[:, None] - lse)  # (B·Hq, L)
    p_sums += p_sink
    return -(p_sink * d).reshape(-1, dims.hq, dims.n_q).sum(axis=(0, 2))  # (Hq,)


def _check_weights_sum_to_one(p_sums: np.ndarray, lse: np.ndarray) -> None:
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
            f"to {p_sums[head, row]:.6g}, not 1. Pass the causal, window, align, scale (and block_mask, "
            "score_mod, sinks) the forward used, with its own out and lse (flash_attention(..., return_lse=True))"
        )
