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

Through flex attention's mods (flex.py) the same lines hold with the forward's S' = score_mod(S) in S's place;
the chain rule through the mod and the sinks' gradient are the next lesson's (mod_grads.py).

Read it in this order: attention_backward and attention_grads (the reference: the five lines above on whole
matrices), flash_attention_backward_one_head (Algorithm 2 for one head on one thread, as the paper prints it),
then flash_attention_backward (the same, with every key block of every head a work item: the engine,
_backward_kernel.py) and flex_attention_backward (the same loop over a block mask's tiles, through the mods).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._backward_kernel import BackwardPlan, FlexGrads, call_heads, flex_backward
from ._checks import (
    QKVShape,
    check_bool,
    check_like,
    check_one_head,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
    without_head_axis,
)
from ._flash_kernel import broadcast_kv
from ._guard import refuse_attention_backward, refuse_blockwise
from ._mod_calls import check_score_mod, derivative_of, score_indices
from ._tuning import backward_side, call_workers
from .attention import ScoreRules, attend, check_attention, grouped
from .blockmask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, check_band
from .flex import check_flex

Array = NDArray[np.floating]

__all__ = [
    "attention_backward",
    "attention_grads",
    "check_flash_backward",
    "flash_attention_backward",
    "flash_attention_backward_one_head",
    "flex_attention_backward",
]


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
    peak does not fit in the memory available (peaks.attention_backward_bytes; an upper bound with mods).
    A score_mod must give its derivative, as for flex_attention_backward (mod_grads.Differentiable).
    """
    check_memory = check_bool(check_memory, "check_memory")
    two_d = without_head_axis(q)
    q, k, v, dims, scale, rules = check_attention(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        scale=scale,
        align=align,
        window=window,
        mask_mod=mask_mod,
        score_mod=check_score_mod(score_mod, backward=True),
        sinks=sinks,
    )
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    dout = check_like(dout, "dout", out_shape[1:] if two_d else out_shape, "out's (..., Hq, L, Ev)")
    ct = compute_dtype(q, k, v, dout)
    if check_memory:  # first, on shapes and dtypes alone: the float16 copies below are part of the bill
        refuse_attention_backward(dims, np.result_type(q, k, v, dout), rules)
    q_c, k_c, v_c, d_o = (x.astype(ct, copy=False) for x in (q, k, v, dout))
    dq, dk, dv, _, _ = attention_grads(q_c, k_c, v_c, d_o.reshape(out_shape), dims, scale, rules)
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    return (grads[0][0], grads[1][0], grads[2][0]) if two_d else grads


@np.errstate(invalid="ignore")  # an inf input: NaN where it reaches (inf - inf, 0 · inf), as torch; no warning
def attention_grads(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, dims: QKVShape, scale: float, rules: ScoreRules
) -> FlexGrads:
    """The five lines of the module doc on whole matrices, for inputs attention_backward() checked, in the
    compute dtype: -> dq (..., Hq, L, E), dk (..., Hkv, S, E), dv (..., Hkv, S, Ev) in FlexGrads; and
    through flex attention's mods (the rules' score_mod and sinks; mod_grads.py derives both):
    dS = dS' ∘ ∂S'/∂S with the learned parameters' gradient from dS' (score_mod_backward), and
    dsink_h = -Σ_i P_sink,i D_i, where P_sink,i = 1 - Σ_j P_ij is the weight the row's keys did not take."""
    # 1) the forward again, keeping the weights P (..., Hq, L, S) and the output O (..., Hq, L, Ev)
    o, p = attend(q, k, v, dims, scale, rules)
    p, o, d_o = (grouped(p, dims, kv=False), grouped(o, dims, kv=False), grouped(dout, dims, kv=False))  # (.., G, L, .)
    k_g, v_g = grouped(k, dims, kv=True), grouped(v, dims, kv=True)  # (..., Hkv, 1, S, E): shared by the G heads
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
    dparams = None if rules.score_mod is None else score_mod_backward(ds, q, k, dims, scale, rules.score_mod)
    dsinks = None if p_sink is None else -(p_sink * d).reshape(-1, dims.hq, dims.n_q).sum(axis=(0, 2))  # (Hq,)
    # 5) dQ = scale · dS K and dK = scale · dSᵀ Q (summed over the group, like dV)
    dq = ds @ k_g  # (..., Hkv, G, L, E)
    dq *= scale
    dk = (ds.swapaxes(-1, -2) @ grouped(q, dims, kv=False)).sum(axis=-3)  # (..., Hkv, S, E)
    dk *= scale
    return FlexGrads(dq.reshape(*dims.batch, dims.hq, dims.n_q, dims.e), dk, dv, dparams, dsinks)


def score_mod_backward(
    ds: np.ndarray, q: np.ndarray, k: np.ndarray, dims: QKVShape, scale: float, score_mod: Any
) -> Any:
    """Step 4b on whole matrices (mod_grads.score_mod_grads is the same for one block): the learned
    parameters' gradient from dS' (param_grad, head by head), then dS' made into dS = dS' ∘ ∂S'/∂S in place,
    the derivative taken at the raw scores S = q kᵀ · scale, made again."""
    ds_heads = ds.reshape(-1, dims.hq, dims.n_q, dims.n_k)  # (B, Hq, L, S) view, B flat over the leading dims
    b, h, q_idx, kv_idx = score_indices(dims.batch, dims.hq, dims.n_q, dims.n_k)
    params, dparams = getattr(score_mod, "params", None), None
    if params is not None:  # one parameter row per head, shared by the batch entries
        dparams = np.zeros(params.shape, ds.dtype)
        for b_i, h_i in np.ndindex(ds_heads.shape[:2]):
            dparams[h_i] += score_mod.param_grad(ds_heads[b_i, h_i], b_i, h_i, q_idx, kv_idx)
    q_s = np.multiply(q, scale, dtype=k.dtype)  # as attend() scales, so the same S
    s = grouped(q_s, dims, kv=False) @ grouped(k, dims, kv=True).swapaxes(-1, -2)  # (..., Hkv, G, L, S)
    derivative = derivative_of(score_mod, s.reshape(*dims.batch, dims.hq, dims.n_q, dims.n_k), b, h, q_idx, kv_idx)
    if derivative is not None:
        ds_heads *= np.broadcast_to(derivative, (*dims.batch, dims.hq, dims.n_q, dims.n_k)).reshape(ds_heads.shape)
    return dparams


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


# ---------------------------------------------------------------------------------------------------
# the public entries: checks, then the engine (_backward_kernel.py)


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
    steps, each matmul one batched call (_backward_kernel.heads_per_item). The item owns its rows of dk and dv
    outright. dq rows receive a share from every key block that sees them: on a GPU an atomic add, whose
    order, and so whose last bits, depend on the timing. Here the shares are added in key-block order instead
    (_backward_kernel.OrderedDq), so the result is the same bits for any `workers` and any heads per item.
    With grouped-query heads, the G query heads of a kv head each fill their own (S, E) copy of dk and dv,
    summed in head order at the end: G - 1 extra copies of k and v, O(S·E).
    Memory: dq, dk, dv, [q·scale, −lse] and [dout, −D] (made once for every tile), and per worker two
    block_q x block_k tiles; the tiles are made as each item runs, so the bookkeeping is one count per
    (item's heads, query block).
    block_q, block_k (default 256; halved, but not below 64, for a causal band without a window over a short
    context, L = S under 1,024: _tuning.backward_side) and workers (default: one per core, at most one per
    2^18 scores: _tuning.call_workers), or what tinyattn_np.tune() measured on this machine
    (_tuning.tile_rule); BLAS is held to one thread meanwhile, as in the forward.
    """
    two_d = without_head_axis(q)
    kv_shapes = np.shape(k), np.shape(v)  # as given: a batch of 1 broadcast over q's gets its gradients summed
    q, k, v, out, dout, lse, dims, plan = check_flash_backward(
        q,
        k,
        v,
        out,
        dout,
        lse,
        causal=causal,
        scale=scale,
        window=window,
        block_q=block_q,
        block_k=block_k,
        workers=workers,
        align=align,
    )
    heads = call_heads(dims, plan)
    refuse_blockwise("flash_attention_backward()", q, k, v, dims, plan, heads_per_step=heads, backward=True)
    dq, dk, dv, _, _ = flex_backward(q, k, v, out, dout, lse, dims, plan)
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
    non-empty tiles, with the forward's S' = score_mod(S) in place of S, and two more lines (mod_grads.py):

        dS = dS' ∘ ∂S'/∂S                 score_mod.derivative(S, b, h, q_idx, kv_idx); None means 1 (a bias)
        dθ_h = Σ_ij dS'_ij ∂S'_ij/∂θ_h    score_mod.param_grad: learned parameters θ (Alibi's slopes with
                                          learned=True, RelativeBias's table), summed in key-block order
        dsink_h = -Σ_i exp(sink_h − lse_i) D_i    a sink is a key with a score and no value: O_i loses the
                                                  weight it takes, ∂O_i/∂sink_h = −P_sink,i O_i

    A score_mod must give its derivative: a ready-made mod (mods.Alibi, Softcap, RelativeBias), or
    mod_grads.Differentiable(your_score_mod, derivative); anything else is refused with a TypeError that says
    so. P's rows (with the sink's weight) are checked to sum to 1, as in flash_attention_backward.
    """
    two_d = without_head_axis(query)
    q, k, v, dims, fplan = check_flex(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        sinks=sinks,
        workers=workers,
        backward=True,
    )
    out, dout, lse = check_saved(out, dout, lse, dims, two_d)
    mods = fplan.score_mod, fplan.sinks
    plan = BackwardPlan(fplan.scale, fplan.tile_mask, fplan.block_q, fplan.block_k, fplan.workers, *mods)
    heads = call_heads(dims, plan)
    refuse_blockwise("flex_attention_backward()", q, k, v, dims, plan, heads_per_step=heads, backward=True)
    grads = flex_backward(q, k, v, out, dout, lse, dims, plan)
    if two_d:
        return grads._replace(dq=grads.dq[0], dk=grads.dk[0], dv=grads.dv[0])
    # key and value of batch 1 served every batch entry: their gradients are the sums over the batch
    return grads._replace(dk=summed_to(grads.dk, np.shape(key)), dv=summed_to(grads.dv, np.shape(value)))


# ---------------------------------------------------------------------------------------------------
# the checks, and the sums over a broadcast batch


def check_one_head_backward(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, causal: Any, scale: Any, block_q: Any, block_k: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """One head's forward inputs checked as flash_attention_one_head checks them, out (L, Ev), dout (L, Ev) and
    lse (L,) against their shapes, all six in the compute dtype, with the scale."""
    q_c, k_c, v_c, scale = check_one_head(q, k, v, causal, scale, block_q, block_k)
    dims = QKVShape((), 1, 1, len(q_c), len(k_c), q_c.shape[1], v_c.shape[1])
    out, dout, lse = check_saved(out, dout, lse, dims, two_d=True)
    ct = compute_dtype(q_c, k_c, v_c, out, dout)
    q_c, k_c, v_c, out, dout, lse = (x.astype(ct, copy=False) for x in (q_c, k_c, v_c, out, dout, lse))
    return q_c, k_c, v_c, out, dout, lse, scale


def check_flash_backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    dout: Any,
    lse: Any,
    *,
    causal: Any,
    scale: Any,
    window: Any,
    block_q: Any,
    block_k: Any,
    workers: Any,
    align: Any = "bottom_right",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, QKVShape, BackwardPlan]:
    """flash_attention_backward's inputs checked, once (shapes against q's), and its plan."""
    two_d = without_head_axis(q)
    k, v = broadcast_kv(q, k, v)  # k and v of batch 1 against a larger query batch: views over it
    q, k, v, dims = check_qkv(q, k, v)
    out, dout, lse = check_saved(out, dout, lse, dims, two_d)
    band = check_band(causal, window, dims.n_q, dims.n_k, align)
    side = backward_side(dims.n_q, band.diagonal)  # smaller for a short causal band
    plan = BackwardPlan(
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
    out = check_like(out, "out", out_shape, "(..., Hq, L, Ev)")
    dout = check_like(dout, "dout", out_shape, "out's (..., Hq, L, Ev)")
    return out, dout, check_like(lse, "lse", out_shape[:-1], "(..., Hq, L)")


def summed_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """grad (*batch, H, S, E) summed over the batch entries when shape's batch dims are all 1 (a broadcast
    input), in at least float32, in batch order; else grad as it is."""
    if grad.shape == shape:
        return grad
    total = grad.reshape(-1, *shape[-3:]).sum(axis=0, dtype=np.result_type(grad.dtype, np.float32))  # (H, S, E)
    return total.reshape(shape).astype(grad.dtype, copy=False)
