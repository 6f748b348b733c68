"""Linear attention with the gated delta rule: per head a state S of d_k x d_v numbers, whatever the context.

Softmax attention keeps every key and value it has seen. A gated delta layer keeps one matrix S per value head
and folds each token into it (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks"; Qwen3-Next, Qwen3.5):

    S ← e^(g_t) S                        the decay: forget a little of everything (g_t <= 0)
    S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ       the delta rule: write only what S gets wrong about k_t
    o_t = Sᵀ q_t                         the read

The second line is one step of gradient descent, step size β_t, on ½‖Sᵀk_t − v_t‖²: the gradient in S is
k_t (Sᵀk_t − v_t)ᵀ (Widrow & Hoff 1960; Schlag, Irie & Schmidhuber 2021). Kimi Delta Attention (Kimi Linear)
gives each key channel its own decay: g_t a vector of d_k and S ← diag(e^(g_t)) S. Decoding costs the same at
token 100 and at token 1,000,000: one read and one write of S.

Training runs the same rule in chunks of C tokens (Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length"): inside a chunk the writes u_i = β_i (v_i − Sᵀk_i) depend on each other through
a unit lower-triangular C x C system (the UT transform), solved once for the chunk; across chunks only the state
travels. docs/linear.md derives it step by step.

Read it in this order:
    gated_delta_rule_recurrent            the three lines above, one token at a time, the state written out
    gated_delta_rule_chunked              the same in chunks: a triangular solve inside, the state across
    gated_delta_rule                      the entry: shapes checked, grouped value heads, then the engine
                                          (_linear_kernel.py: every head at once, chunks in groups), which
                                          L2-normalises q and k (l2norm_qk) and scales q by d_k^-½ as
                                          transformers does
    gated_delta_rule_recurrent_backward   the gradients by hand, token by token from the last: the reference
    gated_delta_rule_backward             the same gradients through the chunks (the engine)

The layer built on the rule, Qwen3-Next's Gated DeltaNet and its decoding cache, is deltanet.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import check_positive_int
from ._guard import refuse_unless_fits
from ._linear_checks import (
    DeltaInputs,
    check_chunk_size,
    check_delta_inputs,
    check_flags,
    check_output_grads,
)
from ._linear_kernel import (
    Prep,
    chunked_backward,
    chunked_forward,
    prepare_qk,
    prepare_qk_backward,
    recurrent_forward,
)

__all__ = [
    "DeltaRuleGrads",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_recurrent_backward",
]

Array = NDArray[np.floating]

# ---------------------------------------------------------------------------------------------------
# the rule, one token at a time


def gated_delta_rule_recurrent(
    q: Array,  # (..., T, d_k)
    k: Array,  # (..., T, d_k)
    v: Array,  # (..., T, d_v)
    g: Array,  # (..., T): a log decay per head; or (..., T, d_k): per key channel (Kimi)
    beta: Array,  # (..., T): the step size
    initial_state: Array | None = None,  # (..., d_k, d_v); None: zeros
) -> tuple[Array, Array]:  # o (..., T, d_v), the final state (..., d_k, d_v)
    """The gated delta rule one token at a time, the state S written out: for t = 1 .. T,
        S ← e^(g_t) S      S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ      o_t = Sᵀ q_t
    with q, k, v as given (gated_delta_rule normalises and scales them first). g <= 0 and beta in [0, 2].

    >>> o, S = gated_delta_rule_recurrent(np.eye(2), np.eye(2), np.eye(2), np.zeros(2), np.ones(2))
    >>> S  # β = 1 and orthonormal keys: each token's value is stored exactly, key by key
    array([[1., 0.],
           [0., 1.]])
    """
    x = check_delta_inputs(q, k, v, g, beta, initial_state, grouped=False)
    q, k, v, g, beta, state = x.q, x.k, x.v, x.g, x.beta, x.state  # g (..., T, 1 or d_k)
    o = np.empty(v.shape, v.dtype)  # (..., T, d_v)
    for t in range(v.shape[-2]):
        state = np.exp(g[..., t, :, None]) * state  # (..., d_k, d_v): S ← e^(g_t) S
        error = v[..., t, :] - np.einsum("...k,...kv->...v", k[..., t, :], state)  # (..., d_v): v_t − Sᵀk_t
        state = state + k[..., t, :, None] * (beta[..., t, None, None] * error[..., None, :])  # S += β k errorᵀ
        o[..., t, :] = np.einsum("...k,...kv->...v", q[..., t, :], state)  # (..., d_v): o_t = Sᵀq_t
    return o.astype(x.out_dtype, copy=False), state


# ---------------------------------------------------------------------------------------------------
# the rule in chunks


def gated_delta_rule_chunked(
    q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None = None, *, chunk_size: int = 64
) -> tuple[Array, Array]:
    """gated_delta_rule_recurrent's result, chunk_size tokens at a time (the last chunk may be shorter): inside a
    chunk a triangular solve, across chunks the state (_chunk). Same arguments and shapes."""
    x = check_delta_inputs(q, k, v, g, beta, initial_state, grouped=False)
    C, state = check_positive_int(chunk_size, "chunk_size"), x.state
    o = np.empty(x.v.shape, x.v.dtype)  # (..., T, d_v)
    for start in range(0, x.v.shape[-2], C):
        c = slice(start, start + C)  # the chunk's tokens
        o[..., c, :], state = _chunk(
            x.q[..., c, :], x.k[..., c, :], x.v[..., c, :], x.g[..., c, :], x.beta[..., c], state
        )
    return o.astype(x.out_dtype, copy=False), state


def _chunk(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
    """One chunk of C tokens entering with the state S (..., d_k, d_v) -> its outputs (..., C, d_v) and the state
    leaving it. Token i's write u_i = β_i (v_i − S_{i-1}ᵀ k_i), with S_{i-1} the state entering the chunk decayed
    to i plus the chunk's writes before i, is the row i of (I + A) u = β v − β e^γ k S, A strictly lower."""
    C = q.shape[-2]
    gamma = np.cumsum(g, axis=-2)  # (..., C, 1|d_k): γ_i = g_1 + ... + g_i, the log decay from the start to i
    seen = np.tri(C, dtype=bool)[..., None]  # (C, C, 1): token j is before or at token i
    decay = np.exp(np.where(seen, gamma[..., :, None, :] - gamma[..., None, :, :], -np.inf))  # (..., C, C, 1|d_k)
    k_beta = beta[..., None] * k  # (..., C, d_k)
    # 1) the triangular system: A_ij = β_i e^(γ_i − γ_j) k_iᵀ k_j for j < i, then u = U − W S
    A = np.sum(k_beta[..., :, None, :] * k[..., None, :, :] * decay, axis=-1) * np.tri(C, k=-1)  # (..., C, C)
    U = _forward_substitution(A, beta[..., None] * v)  # (..., C, d_v): (I + A)⁻¹ β v
    W = _forward_substitution(A, k_beta * np.exp(gamma))  # (..., C, d_k): (I + A)⁻¹ β e^γ k
    writes = U - W @ state  # (..., C, d_v): u_i, what each token writes
    # 2) the outputs: S entering, decayed to token i, plus the chunk's writes up to i: P_ij = e^(γ_i − γ_j) q_iᵀk_j
    P = np.sum(q[..., :, None, :] * k[..., None, :, :] * decay, axis=-1)  # (..., C, C), j <= i
    o = (np.exp(gamma) * q) @ state + P @ writes  # (..., C, d_v)
    # 3) the state leaving: S decayed through the chunk, plus every write decayed from its token to the end
    k_to_end = np.exp(gamma[..., -1:, :] - gamma) * k  # (..., C, d_k)
    state = np.exp(gamma[..., -1, :, None]) * state + k_to_end.swapaxes(-1, -2) @ writes  # (..., d_k, d_v)
    return o, state


def _forward_substitution(A: Array, rhs: Array) -> Array:
    """x with (I + A) x = rhs, A (..., C, C) strictly lower: x_i = rhs_i − Σ_{j<i} A_ij x_j, row by row. It is the
    delta rule's own recurrence inside the chunk, without the state."""
    x = rhs.copy()  # (..., C, d)
    for i in range(1, x.shape[-2]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", A[..., i, :i], x[..., :i, :])
    return x


# ---------------------------------------------------------------------------------------------------
# the entry


def gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    chunk_size: int | None = 64,
    initial_state: Array | None = None,
    return_state: bool = False,
    l2norm_qk: bool = False,
) -> Array | tuple[Array, Array]:
    """The gated delta rule as transformers' torch_chunk_gated_delta_rule computes it, in our layout:
    q, k (B, H, T, d_k), v (B, Hv, T, d_v), g and beta (B, Hv, T) -> o (B, Hv, T, d_v), and with return_state
    the final state (B, Hv, d_k, d_v) in the compute dtype. Each q/k head serves Hv / H consecutive value heads;
    l2norm_qk=True normalises q and k to unit length first; q is scaled by d_k^-½. g (B, Hv, T, d_k): a decay
    per key channel (Kimi Delta Attention). chunk_size=None: the recurrent form, a token at a time; else chunks.
    g <= 0 (a decay), beta in [0, 2]; initial_state (B, Hv, d_k, d_v) or None (zeros).

    >>> o = gated_delta_rule(*np.ones((3, 1, 1, 2, 4)), np.zeros((1, 1, 2)), np.ones((1, 1, 2)), l2norm_qk=True)
    >>> o.round(3)  # token 2 finds token 1's value already stored: nothing more to write
    array([[[[0.5, 0.5, 0.5, 0.5],
             [0.5, 0.5, 0.5, 0.5]]]])
    """
    x = check_delta_inputs(q, k, v, g, beta, initial_state, grouped=True)
    chunk_size = check_chunk_size(chunk_size)
    check_flags(return_state=return_state, l2norm_qk=l2norm_qk)
    q_heads, k_heads = _value_heads(x.q, x.k, x.v.shape[1])  # (B, Hv, T, d_k) each
    prep = Prep(x.q.shape[-1] ** -0.5, l2norm_qk)  # unit length (l2norm_qk), then q scaled by d_k^-½
    if chunk_size is None:
        o, state = recurrent_forward(*prepare_qk(q_heads, k_heads, prep), x.v, x.g, x.beta, x.state)
    else:  # the engine prepares each group of chunks as it reads it
        o, state = chunked_forward(q_heads, k_heads, x.v, x.g, x.beta, x.state, chunk_size, prep)
    o = o.astype(x.out_dtype, copy=False)
    return (o, state) if return_state else o


def _value_heads(q: Array, k: Array, value_heads: int) -> tuple[Array, Array]:
    """Each q/k head repeated for the Hv / H value heads it serves: (B, H, T, d_k) -> (B, Hv, T, d_k)."""
    groups = value_heads // q.shape[1]
    return (q, k) if groups == 1 else (np.repeat(q, groups, axis=1), np.repeat(k, groups, axis=1))


# ---------------------------------------------------------------------------------------------------
# the gradients


class DeltaRuleGrads(NamedTuple):
    """The gradients of the rule's output (and final state): each the shape of its input; dinitial_state is None
    where the rule started from zeros (no initial_state given)."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dbeta: Array
    dinitial_state: Array | None


def gated_delta_rule_recurrent_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    dout: Array,
    initial_state: Array | None = None,
    dstate: Array | None = None,
) -> DeltaRuleGrads:
    """The gradients of gated_delta_rule_recurrent (same arguments) from dout = ∂loss/∂o (..., T, d_v) and dstate
    = ∂loss/∂(final state) (None: 0), token by token from the last. Its forward, with S̃_t = e^(g_t) S_{t−1}:
        e_t = v_t − S̃_tᵀ k_t        S_t = S̃_t + β_t k_t e_tᵀ        o_t = S_tᵀ q_t
    and backward, dS = ∂loss/∂S_t starting at dstate:
        dS += q_t do_tᵀ             dq_t = S_t do_t
        de = β_t dSᵀ k_t            dβ_t = e_tᵀ dSᵀ k_t     dk_t = β_t dS e_t − S̃_t de     dv_t = de
        dS̃ = dS − k_t deᵀ           dg_t = Σ dS̃ ∘ S̃_t (over d_v; over d_k too for one decay a head)
        dS ← e^(g_t) dS̃"""
    x = check_delta_inputs(q, k, v, g, beta, initial_state, grouped=False)
    dout, dstate = check_output_grads(dout, dstate, x.v.shape, x.state.shape, x.state.dtype)
    dq, dk, dv, dg, dbeta, dstate = _recurrent_backward(x, dout, dstate)
    return _grads(dq, dk, dv, dg, dbeta, dstate, np.ndim(g) < x.v.ndim, initial_state is not None, x.out_dtype)


def _recurrent_backward(x: DeltaInputs, dout: Array, dstate: Array) -> tuple[Array, Array, Array, Array, Array, Array]:
    """gated_delta_rule_recurrent_backward's lines on checked inputs (g as (..., T, 1|d_k)): dq, dk, dv, dg, dbeta
    and the gradient of the state the rule started from."""
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    refuse_unless_fits(
        v.shape[-2] * x.state.nbytes,
        "gated_delta_rule_recurrent_backward",
        "the state after every token's decay",
        "pass fewer tokens, or use gated_delta_rule_backward",
    )
    decayed, state = [], x.state  # S̃_t for every t: the forward again
    for t in range(v.shape[-2]):
        decayed.append(np.exp(g[..., t, :, None]) * state)  # (..., d_k, d_v)
        error = v[..., t, :] - np.einsum("...k,...kv->...v", k[..., t, :], decayed[t])  # (..., d_v)
        state = decayed[t] + k[..., t, :, None] * (beta[..., t, None, None] * error[..., None, :])
    dq, dk, dv, dg, dbeta = (np.zeros_like(a) for a in (q, k, v, g, beta))
    for t in reversed(range(v.shape[-2])):
        error = v[..., t, :] - np.einsum("...k,...kv->...v", k[..., t, :], decayed[t])  # (..., d_v): e_t
        state = decayed[t] + k[..., t, :, None] * (beta[..., t, None, None] * error[..., None, :])  # S_t
        dq[..., t, :] = np.einsum("...kv,...v->...k", state, dout[..., t, :])  # dq_t = S_t do_t
        dstate = dstate + q[..., t, :, None] * dout[..., t, None, :]  # (..., d_k, d_v): dS += q_t do_tᵀ
        dsk = np.einsum("...kv,...k->...v", dstate, k[..., t, :])  # (..., d_v): dSᵀ k_t
        derror = beta[..., t, None] * dsk  # (..., d_v): de
        dbeta[..., t] = np.sum(error * dsk, axis=-1)
        dstate_error = np.einsum("...kv,...v->...k", dstate, error)  # (..., d_k): dS e_t
        dk[..., t, :] = beta[..., t, None] * dstate_error - np.einsum("...kv,...v->...k", decayed[t], derror)
        dv[..., t, :] = derror
        dstate = dstate - k[..., t, :, None] * derror[..., None, :]  # (..., d_k, d_v): dS̃
        dg_t = np.sum(dstate * decayed[t], axis=-1)  # (..., d_k): one per key channel
        dg[..., t, :] = dg_t.sum(axis=-1, keepdims=True) if g.shape[-1] == 1 else dg_t
        dstate = np.exp(g[..., t, :, None]) * dstate  # dS for S_{t−1}
    return dq, dk, dv, dg, dbeta, dstate


def _grads(
    dq: Array,
    dk: Array,
    dv: Array,
    dg: Array,
    dbeta: Array,
    dstate: Array,
    per_head: bool,
    given: bool,
    dtype: np.dtype,
) -> DeltaRuleGrads:
    """DeltaRuleGrads in dtype: dg as g came (per head: its last axis dropped), dinitial_state only if given."""
    dq, dk, dv, dg, dbeta = (a.astype(dtype, copy=False) for a in (dq, dk, dv, dg[..., 0] if per_head else dg, dbeta))
    return DeltaRuleGrads(dq, dk, dv, dg, dbeta, dstate.astype(dtype, copy=False) if given else None)


def gated_delta_rule_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    dout: Array,
    *,
    chunk_size: int | None = 64,
    initial_state: Array | None = None,
    dstate: Array | None = None,
    l2norm_qk: bool = False,
) -> DeltaRuleGrads:
    """The gradients of gated_delta_rule (the same arguments) from dout = ∂loss/∂o (B, Hv, T, d_v) and dstate =
    ∂loss/∂(final state) (B, Hv, d_k, d_v) or None (0). chunk_size: the engine's chunks (the forward runs again,
    keeping the state entering each chunk), or None: the recurrent reference. Through the preparation: the
    Hv / H value heads of a q/k head summed, q's scale, and the L2 normalisation (l2norm_qk)."""
    x = check_delta_inputs(q, k, v, g, beta, initial_state, grouped=True)
    chunk_size = check_chunk_size(chunk_size)
    check_flags(l2norm_qk=l2norm_qk)
    dout, dstate = check_output_grads(dout, dstate, x.v.shape, x.state.shape, x.state.dtype)
    q_heads, k_heads = _value_heads(x.q, x.k, x.v.shape[1])
    prep, per_head = Prep(x.q.shape[-1] ** -0.5, l2norm_qk), np.ndim(g) < x.v.ndim  # g (B, Hv, T): x.g (B, Hv, T, 1)
    if chunk_size is None:
        q_prepared, k_prepared = prepare_qk(q_heads, k_heads, prep)
        dq, dk, dv, dg, dbeta, dstate = _recurrent_backward(x._replace(q=q_prepared, k=k_prepared), dout, dstate)
        dq, dk = prepare_qk_backward(dq, dk, q_heads, k_heads, prep)
    else:
        dq, dk, dv, dg, dbeta, dstate = chunked_backward(
            q_heads, k_heads, x.v, x.g, x.beta, x.state, dout, dstate, chunk_size, prep
        )
    B, H, T, d_k = x.q.shape
    dq, dk = (d.reshape(B, H, -1, T, d_k).sum(axis=2) for d in (dq, dk))  # the value heads of each q/k head
    return _grads(dq, dk, dv, dg, dbeta, dstate, per_head, initial_state is not None, x.out_dtype)
