"""Qwen3-Next's Gated DeltaNet, the layer: linear.py's gated delta rule between projections, a short causal
convolution and a gated RMSNorm; and its decoding cache, whose bytes never grow.

Qwen3-Next and Qwen3.5 put three of these layers before each softmax attention layer. gated_deltanet, first
below, is transformers' Qwen3NextGatedDeltaNet line for line, its lines in its docstring.

Read it in this order:
    gated_deltanet, gated_deltanet_backward   the layer and its gradients by hand, functions of arrays, weights
                                              in (the rule's own gradients: linear.py)
    GatedDeltaNetShape, GatedDeltaNetWeights  its sizes, as Qwen3-Next's config names them, and its weights
    GatedDeltaCache                           decoding: the convolution's last K − 1 inputs and S, nothing per token
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._atomic import holding
from ._checks import as_float_array, check_count, check_positive_int, check_rng
from ._linear_checks import check_chunk_size, check_finite, check_layer, check_shape
from .layers import rms_norm, rms_norm_backward
from .linear import gated_delta_rule, gated_delta_rule_backward

__all__ = [
    "GatedDeltaCache",
    "GatedDeltaNetSaved",
    "GatedDeltaNetShape",
    "GatedDeltaNetWeights",
    "gated_deltanet",
    "gated_deltanet_backward",
]

Array = NDArray[np.floating]


# ---------------------------------------------------------------------------------------------------
# the layer: Qwen3-Next's Gated DeltaNet


def gated_deltanet(
    x: Array,
    weights: GatedDeltaNetWeights,
    shape: GatedDeltaNetShape,
    *,
    cache: GatedDeltaCache | None = None,
    chunk_size: int | None = 64,
) -> tuple[Array, GatedDeltaNetSaved]:
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
# its sizes, its weights, and what its forward keeps


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
            normal(C, ch),
            normal(C, values),
            normal(C, hv),
            normal(C, hv),
            rng.uniform(-(K**-0.5), K**-0.5, (ch, K)).astype(dtype),
            np.ones(hv, dtype),
            np.log(rng.uniform(0.01, 16, hv)).astype(dtype),
            np.ones(self.value_dim, dtype),
            normal(values, C),
        )


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
