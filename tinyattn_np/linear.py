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
    gated_deltanet, gated_deltanet_backward   Qwen3-Next's layer: projections, a short causal convolution,
                                          the rule, a gated RMSNorm; functions of arrays, weights in
    GatedDeltaCache                       decoding: the convolution's last K − 1 inputs and S, nothing per token
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._atomic import holding
from ._checks import as_float_array, check_count, check_positive_int, check_rng
from ._guard import refuse_unless_fits
from ._linear_checks import (
    DeltaInputs,
    check_chunk_size,
    check_delta_inputs,
    check_finite,
    check_flags,
    check_layer,
    check_output_grads,
    check_shape,
)
from ._linear_kernel import (
    Prep,
    chunked_backward,
    chunked_forward,
    prepare_qk,
    prepare_qk_backward,
    recurrent_forward,
)
from .layers import rms_norm, rms_norm_backward

__all__ = [
    "DeltaRuleGrads",
    "GatedDeltaCache",
    "GatedDeltaNetSaved",
    "GatedDeltaNetShape",
    "GatedDeltaNetWeights",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_recurrent_backward",
    "gated_deltanet",
    "gated_deltanet_backward",
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


def gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, *, chunk_size: int | None = 64,
                     initial_state: Array | None = None, return_state: bool = False,
                     l2norm_qk: bool = False) -> Array | tuple[Array, Array]:  # fmt: skip
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


def gated_delta_rule_recurrent_backward(q: Array, k: Array, v: Array, g: Array, beta: Array, dout: Array,
                                        initial_state: Array | None = None,
                                        dstate: Array | None = None) -> DeltaRuleGrads:  # fmt: skip
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


def _grads(dq: Array, dk: Array, dv: Array, dg: Array, dbeta: Array, dstate: Array, per_head: bool, given: bool,
           dtype: np.dtype) -> DeltaRuleGrads:  # fmt: skip
    """DeltaRuleGrads in dtype: dg as g came (per head: its last axis dropped), dinitial_state only if given."""
    dq, dk, dv, dg, dbeta = (a.astype(dtype, copy=False) for a in (dq, dk, dv, dg[..., 0] if per_head else dg, dbeta))
    return DeltaRuleGrads(dq, dk, dv, dg, dbeta, dstate.astype(dtype, copy=False) if given else None)


def gated_delta_rule_backward(q: Array, k: Array, v: Array, g: Array, beta: Array, dout: Array, *,
                              chunk_size: int | None = 64, initial_state: Array | None = None,
                              dstate: Array | None = None, l2norm_qk: bool = False) -> DeltaRuleGrads:  # fmt: skip
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


# ---------------------------------------------------------------------------------------------------
# the layer: Qwen3-Next's Gated DeltaNet


class GatedDeltaNetShape(NamedTuple):
    """One Gated DeltaNet layer's sizes, as Qwen3-Next's config names them: hidden_size (d_model),
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
    linear_conv_kernel_dim and rms_norm_eps (the output norm's ε)."""

    d_model: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: q and k (key_heads · key_dim each), then v (value_heads · value_dim)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def weight_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each of GatedDeltaNetWeights' arrays, in its order."""
        C, ch, hv, values = self.d_model, self.conv_channels, self.value_heads, self.value_heads * self.value_dim
        matrices = (C, ch), (C, values), (C, hv), (C, hv), (ch, self.conv_kernel)  # w_qkv, w_z, w_b, w_a, conv
        return (*matrices, (hv,), (hv,), (self.value_dim,), (values, C))  # dt_bias, a_log, norm, w_out

    def init_weights(self, *, rng: Any = None, dtype: Any = np.float32) -> GatedDeltaNetWeights:
        """Weights as transformers initialises Qwen3-Next's: the projections N(0, 0.02²), the convolution
        U(±1/√K) (torch's Conv1d), dt_bias 1, A = e^A_log ~ U(0.01, 16), the norm's gain 1."""
        rng, C, ch = check_rng(rng), self.d_model, self.conv_channels
        hv, values, K = self.value_heads, self.value_heads * self.value_dim, self.conv_kernel
        normal = lambda *size: (0.02 * rng.standard_normal(size)).astype(dtype)  # noqa: E731
        return GatedDeltaNetWeights(
            normal(C, ch), normal(C, values), normal(C, hv), normal(C, hv),
            rng.uniform(-(K**-0.5), K**-0.5, (ch, K)).astype(dtype), np.ones(hv, dtype),
            np.log(rng.uniform(0.01, 16, hv)).astype(dtype), np.ones(self.value_dim, dtype), normal(values, C),
        )  # fmt: skip


class GatedDeltaNetWeights(NamedTuple):
    """One layer's weights, x @ W with W (in, out), nn.Linear.weight transposed; named after Qwen3.5's
    Qwen3_5GatedDeltaNet (Qwen3-Next's in_proj_qkvz and in_proj_ba hold the first four, interleaved per key head)."""

    w_qkv: Array  # (C, conv_channels) [q | k | v]: in_proj_qkv
    w_z: Array  # (C, Hv·Dv): in_proj_z, the output gate
    w_b: Array  # (C, Hv): in_proj_b, β = sigmoid(x w_b)
    w_a: Array  # (C, Hv): in_proj_a, g = −e^A_log softplus(x w_a + dt_bias)
    conv: Array  # (conv_channels, K): conv1d.weight[:, 0, :], channel by channel
    dt_bias: Array  # (Hv,)
    a_log: Array  # (Hv,)
    norm: Array  # (Dv,): the gated RMSNorm's gain
    w_out: Array  # (Hv·Dv, C): out_proj


class GatedDeltaNetSaved(NamedTuple):
    """What gated_deltanet_backward needs of a forward: x (B, T, C), the convolution's inputs with the K − 1 before
    them (B, K − 1 + T, ch) and its outputs (B, T, ch); q, k, v (after the SiLU), g, beta, the state the rule
    started from; a = x w_a + dt_bias; the norm's saved, z, and the weights, the shape and the chunk size."""

    x: Array
    conv_inputs: Array
    conv_out: Array
    qkv: tuple[Array, Array, Array]
    g: Array
    beta: Array
    state: Array
    a: Array
    norm: Any
    z: Array
    weights: GatedDeltaNetWeights
    shape: GatedDeltaNetShape
    chunk_size: int | None


def gated_deltanet(x: Array, weights: GatedDeltaNetWeights, shape: GatedDeltaNetShape, *,
                   cache: GatedDeltaCache | None = None,
                   chunk_size: int | None = 64) -> tuple[Array, GatedDeltaNetSaved]:  # fmt: skip
    """x (B, T, C) -> y (B, T, C), as transformers' Qwen3NextGatedDeltaNet computes it:
        qkv = x W_qkv      z = x W_z      β = sigmoid(x W_b)      g = −e^A_log softplus(x W_a + dt_bias)
        q, k, v = split(silu(conv(qkv)))      a depthwise causal convolution over the last K tokens, per channel
        o = gated_delta_rule(q, k, v, g, β, l2norm_qk=True)
        y = (rms_norm(o) ∘ norm ∘ silu(z)) W_out      the norm over each value head's Dv numbers
    Returns y and what the backward needs. cache: a GatedDeltaCache of this shape, whose tokens x continues
    (a prompt, then a token a step); its state moves on by x, all or nothing."""
    x, weights = _check_layer(x, weights, shape)
    chunk_size = check_chunk_size(chunk_size)
    if cache is None:
        past = np.zeros((x.shape[0], shape.conv_kernel - 1, shape.conv_channels), x.dtype)
        state = np.zeros((x.shape[0], shape.value_heads, shape.key_dim, shape.value_dim), x.dtype)
        return _layer(x, weights, shape, past, state, chunk_size)[:2]
    if not isinstance(cache, GatedDeltaCache) or (cache.batch, cache.shape, cache.dtype) != (len(x), shape, x.dtype):
        raise ValueError(
            f"cache must be a GatedDeltaCache(batch={len(x)}, shape, dtype={x.dtype}) of this layer's "
            f"shape {shape}; got {cache!r}"
        )
    return cache.advance(lambda past, state: _layer(x, weights, shape, past, state, chunk_size))


def _layer(
    x: Array, w: GatedDeltaNetWeights, shape: GatedDeltaNetShape, past: Array, state: Array, chunk_size: int | None
) -> tuple[Array, GatedDeltaNetSaved, tuple[Array, Array]]:
    """gated_deltanet from the convolution's K − 1 inputs before x (B, K − 1, ch) and the state (B, Hv, Dk, Dv);
    also returns both after x, what a cache keeps."""
    B, T, _ = x.shape
    conv_inputs = np.concatenate([past, x @ w.w_qkv], axis=1)  # (B, K − 1 + T, ch)
    conv_out = sum(w.conv[:, j] * conv_inputs[:, j : j + T] for j in range(shape.conv_kernel))  # (B, T, ch)
    q, k, v = _heads(_silu(conv_out), shape)  # (B, Hk, T, Dk) x2, (B, Hv, T, Dv)
    a = x @ w.w_a + w.dt_bias  # (B, T, Hv)
    g = (-np.exp(w.a_log) * np.logaddexp(0, a)).transpose(0, 2, 1)  # (B, Hv, T): softplus(a) = log(1 + e^a)
    # (torch's F.softplus gives a itself past a = 20, 2e-9 below this)
    beta = _sigmoid(x @ w.w_b).transpose(0, 2, 1)  # (B, Hv, T)
    rule = chunk_size if T > 1 else None  # one token: the recurrent step
    o, new_state = gated_delta_rule(
        q, k, v, g, beta, chunk_size=rule, initial_state=state, return_state=True, l2norm_qk=True
    )
    normed, norm = rms_norm(o.transpose(0, 2, 1, 3), w.norm, shape.eps)  # (B, T, Hv, Dv)
    z = (x @ w.w_z).reshape(normed.shape)  # (B, T, Hv, Dv)
    y = (normed * _silu(z)).reshape(B, T, -1) @ w.w_out  # (B, T, C)
    saved = GatedDeltaNetSaved(x, conv_inputs, conv_out, (q, k, v), g, beta, state, a, norm, z, w, shape, rule)
    return y, saved, (conv_inputs[:, T:].copy(), new_state.astype(x.dtype, copy=False))


def _heads(qkv: Array, shape: GatedDeltaNetShape) -> tuple[Array, Array, Array]:
    """(B, T, ch) -> q, k (B, Hk, T, Dk) and v (B, Hv, T, Dv): the channels are [q | k | v], head by head."""
    B, T, _ = qkv.shape
    keys = shape.key_heads * shape.key_dim
    q, k, v = np.split(qkv, [keys, 2 * keys], axis=-1)
    q, k = (x.reshape(B, T, shape.key_heads, shape.key_dim).transpose(0, 2, 1, 3) for x in (q, k))
    return q, k, v.reshape(B, T, shape.value_heads, shape.value_dim).transpose(0, 2, 1, 3)


def _sigmoid(x: Array) -> Array:
    """σ(x) = 1 / (1 + e^-x), as ½ (1 + tanh(x / 2)): no overflow for large |x|."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _silu(x: Array) -> Array:
    """silu(x) = x σ(x)."""
    return x * _sigmoid(x)


def _silu_backward(dy: Array, x: Array) -> Array:
    """d silu(x) / dx = σ(x) (1 + x (1 − σ(x)))."""
    s = _sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


def gated_deltanet_backward(dy: Array, saved: GatedDeltaNetSaved) -> tuple[Array, GatedDeltaNetWeights]:
    """dx (B, T, C) and the weights' gradients from dy = ∂loss/∂y (B, T, C): gated_deltanet's lines backward, the
    rule's through gated_delta_rule_backward; softplus' = σ, sigmoid' = σ (1 − σ), silu' = σ (1 + x (1 − σ))."""
    s, w, shape = saved, saved.weights, saved.shape
    B, T, _ = s.x.shape
    x_rows = s.x.reshape(-1, s.x.shape[-1])  # (B·T, C)
    normed = s.norm.x_hat * w.norm  # (B, T, Hv, Dv)
    gate = _silu(s.z)  # (B, T, Hv, Dv)
    dw_out = (normed * gate).reshape(B * T, -1).T @ dy.reshape(B * T, -1)  # (Hv·Dv, C)
    dgated = (dy @ w.w_out.T).reshape(normed.shape)  # (B, T, Hv, Dv)
    dz = _silu_backward(dgated * normed, s.z).reshape(B * T, -1)  # (B·T, Hv·Dv)
    do, dnorm, _ = rms_norm_backward(dgated * gate, s.norm)  # (B, T, Hv, Dv), (Dv,)
    rule = gated_delta_rule_backward(
        *s.qkv, s.g, s.beta, do.transpose(0, 2, 1, 3), chunk_size=s.chunk_size, initial_state=s.state, l2norm_qk=True
    )
    softplus = np.logaddexp(0, s.a)  # (B, T, Hv)
    dg = rule.dg.transpose(0, 2, 1)  # (B, T, Hv)
    da_log = np.sum(dg * -np.exp(w.a_log) * softplus, axis=(0, 1))  # (Hv,): g = −e^A_log softplus(a)
    da = (dg * -np.exp(w.a_log) * _sigmoid(s.a)).reshape(B * T, -1)  # (B·T, Hv)
    beta = s.beta.transpose(0, 2, 1)  # (B, T, Hv)
    db = (rule.dbeta.transpose(0, 2, 1) * beta * (1.0 - beta)).reshape(B * T, -1)  # (B·T, Hv)
    dact = np.concatenate([d.transpose(0, 2, 1, 3).reshape(B, T, -1) for d in (rule.dq, rule.dk, rule.dv)], -1)
    dconv_out = _silu_backward(dact, s.conv_out)  # (B, T, ch)
    dconv = np.stack(
        [np.sum(dconv_out * s.conv_inputs[:, j : j + T], axis=(0, 1)) for j in range(shape.conv_kernel)], axis=-1
    )  # (ch, K)
    dinputs = np.zeros_like(s.conv_inputs)  # (B, K − 1 + T, ch)
    for j in range(shape.conv_kernel):
        dinputs[:, j : j + T] += w.conv[:, j] * dconv_out
    dqkv = dinputs[:, shape.conv_kernel - 1 :].reshape(B * T, -1)  # (B·T, ch): the inputs before x take none
    dx = dqkv @ w.w_qkv.T + dz @ w.w_z.T + db @ w.w_b.T + da @ w.w_a.T  # (B·T, C)
    grads = GatedDeltaNetWeights(
        x_rows.T @ dqkv, x_rows.T @ dz, x_rows.T @ db, x_rows.T @ da, dconv, da.sum(axis=0), da_log, dnorm, dw_out
    )
    return dx.reshape(s.x.shape), grads


def _check_layer(x: Any, weights: Any, shape: Any) -> tuple[Array, GatedDeltaNetWeights]:
    """x (B, T, d_model) of float32 or float64, and weights of the shapes `shape` gives, cast to x's dtype."""
    x, arrays = check_layer(x, weights, shape, GatedDeltaNetShape, GatedDeltaNetWeights)
    return x, GatedDeltaNetWeights(*arrays)


# ---------------------------------------------------------------------------------------------------
# decoding: a state that never grows


class GatedDeltaCache:
    """What one Gated DeltaNet layer keeps between decode steps, for `batch` sequences: the convolution's last
    K − 1 inputs (batch, K − 1, conv_channels), what its next output reads besides the new token, and the rule's
    state S (batch, Hv, Dk, Dv). Nothing per token: its bytes are the same at token 10 and at token 10,000,000.

    gated_deltanet(x, weights, shape, cache=c) continues the sequences by x's tokens: the step computes the new
    inputs and state apart and commits them in one assignment, so an exception anywhere (a Ctrl-C) leaves the
    cache as it was, and the lock makes a step of each thread whole. `load` sets a state read back (np.save of
    conv_inputs and state); copy and pickle keep everything but the lock."""

    def __init__(self, batch: int, shape: GatedDeltaNetShape, dtype: Any = np.float32) -> None:
        self.batch = check_positive_int(batch, "batch")
        if not isinstance(shape, GatedDeltaNetShape):
            raise TypeError(f"shape must be a GatedDeltaNetShape; got {type(shape).__name__}")
        self.shape, self.dtype = shape, np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64; got {self.dtype}")
        past = np.zeros((self.batch, shape.conv_kernel - 1, shape.conv_channels), self.dtype)
        state = np.zeros((self.batch, shape.value_heads, shape.key_dim, shape.value_dim), self.dtype)
        self._held = (_frozen(past), _frozen(state), 0)  # (inputs, S, tokens seen): one assignment commits all
        self.lock = threading.RLock()

    def __len__(self) -> int:
        """Tokens seen."""
        return self._held[2]

    def __repr__(self) -> str:
        return f"GatedDeltaCache(batch={self.batch}, shape={self.shape}, dtype={self.dtype}; {len(self)} tokens seen)"

    @property
    def nbytes(self) -> int:
        """Bytes held: batch · (conv_channels · (K − 1) + Hv · Dk · Dv) · itemsize, whatever the context."""
        return int(self._held[0].nbytes + self._held[1].nbytes)

    @property
    def conv_inputs(self) -> Array:
        """Read-only (batch, K − 1, conv_channels): the convolution's last inputs, oldest first (zeros before any)."""
        return self._held[0].view()

    @property
    def state(self) -> Array:
        """Read-only (batch, Hv, Dk, Dv): the rule's state S."""
        return self._held[1].view()

    def advance(self, step: Any) -> Any:
        """step(conv_inputs, state) -> (y, saved, (conv_inputs', state')): run under the lock, then committed."""
        return holding(self.lock, self._advance, step)

    def _advance(self, step: Any) -> Any:
        past, state, seen = self._held
        y, saved, (new_past, new_state) = step(past, state)
        self._held = (_frozen(new_past), _frozen(new_state), seen + saved.x.shape[1])  # the commit
        return y, saved

    def load(self, conv_inputs: Array, state: Array, tokens: int) -> None:
        """Set the cache to a state read back: conv_inputs and state of this cache's shapes, after `tokens`."""
        past = self._checked(conv_inputs, "conv_inputs", self._held[0])
        state = self._checked(state, "state", self._held[1])
        holding(self.lock, setattr, self, "_held", (past, state, check_count(tokens, "tokens")))

    def _checked(self, x: Any, name: str, now: Array) -> Array:
        """x as a read-only copy in this cache's dtype, after checking it has now's shape and is finite."""
        x = as_float_array(x, name)
        check_shape(x, name, now.shape, f"this cache's {name}")
        check_finite(x, name)
        return _frozen(x.astype(self.dtype))

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "lock"}

    def __setstate__(self, held: dict[str, Any]) -> None:
        self.__dict__.update(held)
        past, state, seen = self._held
        self._held = (_frozen(past.copy()), _frozen(state.copy()), seen)  # arrays of their own, read-only again
        self.lock = threading.RLock()


def _frozen(x: Array) -> Array:
    """x made read-only: the cache replaces its arrays and never writes into them, and no view of them can be
    made writable again (their base is not)."""
    x = x if x.base is None else x.copy()  # an array that owns its memory
    x.flags.writeable = False
    return x
