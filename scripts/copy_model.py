"""The copy task's data and model, which train.py --task copy (copy_task.py) and train_parallel.py train:
sequences of random tokens repeated once, and a tiny model of token embeddings, residual attention layers with
RoPE and an output projection, its gradient by hand, and Adam. The gradient check compares every gradient of a
tiny float64 model with central finite differences.

    h = E[tokens]                                  (B, T, C)  token embeddings, no position table
    h = h + MultiHeadAttention(h)  (--layers times) (B, T, C)  causal, RoPE on q and k, a residual
    logits = h W_head                              (B, T, V)
    loss = cross-entropy of logits against the next token, over the second copy's positions
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinyattn_np import MultiHeadAttention, attention

SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # one character per token


# ---------------------------------------------------------------------------------------------------
# the data


def make_batch(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """(batch, 2·length) int tokens: length random tokens, then the same tokens again."""
    first = rng.integers(0, vocab, (batch, length))  # (B, n)
    return np.concatenate([first, first], axis=1)  # (B, 2n)


def scored_positions(length: int) -> np.ndarray:
    """The positions whose next token can be known: the second copy's, up to the last but one.
    Position p in length .. 2·length - 2 predicts token p + 1, which is token p + 1 - length."""
    return np.arange(length, 2 * length - 1)


# ---------------------------------------------------------------------------------------------------
# the model


class TinyModel:
    """Token embeddings, --layers residual MultiHeadAttention layers with RoPE, an output projection."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        heads: int,
        kv_heads: int,
        layers: int,
        rng: np.random.Generator,
        dtype: Any,
    ):
        self.embed = rng.standard_normal((vocab, d_model)).astype(dtype)  # (V, C)
        self.layers = [
            MultiHeadAttention(d_model, heads, kv_heads, rope=True, rng=rng, dtype=dtype) for _ in range(layers)
        ]
        bound = 1 / np.sqrt(d_model)  # nn.Linear's default range, as MultiHeadAttention uses
        self.w_head = rng.uniform(-bound, bound, (d_model, vocab)).astype(dtype)  # (C, V)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every weight, by name; the optimiser and the gradient check walk this."""
        params = {"embed": self.embed, "w_head": self.w_head}
        for i, layer in enumerate(self.layers):
            params[f"layer{i}.w_qkv"], params[f"layer{i}.w_out"] = layer.w_qkv, layer.w_out
        return params

    def loss_and_grads(self, tokens: np.ndarray, length: int, fused: bool) -> tuple[float, dict[str, np.ndarray]]:
        """Cross-entropy over the scored positions, and its gradient for every parameter."""
        B, T = tokens.shape
        rows = scored_positions(length)  # (P,)
        # forward: 1) embed  2) attention layers with residuals  3) logits  4) cross-entropy (cross_entropy)
        h = self.embed[tokens]  # (B, T, C)
        saved = []
        for layer in self.layers:
            out, s = layer.forward(h, causal=True, fused=fused)  # (B, T, C)
            saved.append(s)
            h = h + out
        loss, dh_rows, dw_head = cross_entropy(h[:, rows], self.w_head, tokens[:, rows + 1], B * len(rows))
        # backward, the same lines in reverse (4 and 3 in cross_entropy)
        grads = {"w_head": dw_head}
        dh = np.zeros_like(h)  # (B, T, C)
        dh[:, rows] = dh_rows
        # 2) h + layer(h): the residual passes dh straight through and adds the layer's dx
        for i in reversed(range(len(self.layers))):
            dx, grads[f"layer{i}.w_qkv"], grads[f"layer{i}.w_out"] = self.layers[i].backward(dh, saved[i])
            dh = dh + dx
        # 1) embed[tokens]: a row's gradient is the sum over the places its token sits
        grads["embed"] = np.zeros_like(self.embed)
        np.add.at(grads["embed"], tokens, dh)
        return loss, grads

    def evaluate(self, tokens: np.ndarray, length: int) -> tuple[float, float]:
        """(loss, accuracy of the most likely next token) over the scored positions, no gradients."""
        rows = scored_positions(length)
        h = self.embed[tokens]
        for layer in self.layers:
            h = h + layer(h, causal=True)
        logits = h[:, rows] @ self.w_head  # (B, P, V)
        logits = logits - logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        targets = tokens[:, rows + 1]
        loss = float(-np.take_along_axis(log_probs, targets[..., None], axis=-1).mean())
        return loss, float((log_probs.argmax(axis=-1) == targets).mean())

    def attention_weights(self, tokens: np.ndarray, layer: int) -> np.ndarray:
        """(H, T, T) attention weights of one sequence (T,) in the given layer."""
        h = self.embed[tokens[None]]  # (1, T, C)
        for i in range(layer):
            h = h + self.layers[i](h, causal=True)
        q, k, v = self.layers[layer].split_heads(h)  # rotated by RoPE, as the layer sees them
        _, weights = attention(q, k, v, causal=True, return_weights=True)  # (1, H, T, T)
        return np.asarray(weights[0])


def cross_entropy(
    h: np.ndarray, w_head: np.ndarray, targets: np.ndarray, n: int
) -> tuple[float, np.ndarray, np.ndarray]:
    """Steps 3 and 4 of TinyModel.loss_and_grads and their gradients, for scored rows h (B, P, C) whose next
    tokens are targets (B, P): (the loss summed over the rows and divided by n, dloss/dh (B, P, C), dloss/dW_head)."""
    logits = h @ w_head  # (B, P, V)
    logits = logits - logits.max(axis=-1, keepdims=True)  # log-softmax without overflow
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))  # (B, P, V)
    picked = np.take_along_axis(log_probs, targets[..., None], axis=-1)  # (B, P, 1)
    # 4) d loss / d logits = (softmax - one_hot) / n
    dlogits = np.exp(log_probs)  # (B, P, V)
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
    dlogits /= n
    # 3) logits = h W_head
    dw_head = h.reshape(-1, h.shape[-1]).T @ dlogits.reshape(-1, dlogits.shape[-1])  # (C, V)
    return float(-picked.sum() / n), dlogits @ w_head.T, dw_head


class Adam:
    """m ← β1·m + (1 − β1)·g,  v ← β2·v + (1 − β2)·g²,  w ← w − lr · m̂ / (√v̂ + ε)  (Kingma & Ba 2015),
    with m̂ = m / (1 − β1^t) and v̂ = v / (1 − β2^t) correcting the zero start."""

    def __init__(self, params: dict[str, np.ndarray], lr: float, beta1: float = 0.9, beta2: float = 0.999):
        self.params, self.lr, self.beta1, self.beta2, self.eps = params, lr, beta1, beta2, 1e-8
        self.m = {name: np.zeros_like(w) for name, w in params.items()}
        self.v = {name: np.zeros_like(w) for name, w in params.items()}
        self.t = 0

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        for name, w in self.params.items():
            g = grads[name]
            self.m[name] = self.beta1 * self.m[name] + (1 - self.beta1) * g
            self.v[name] = self.beta2 * self.v[name] + (1 - self.beta2) * g * g
            m_hat = self.m[name] / (1 - self.beta1**self.t)
            v_hat = self.v[name] / (1 - self.beta2**self.t)
            # in place: the model's arrays
            w -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(w.dtype)


# ---------------------------------------------------------------------------------------------------
# the gradient check


def gradient_check(layers: int, fused: bool, seed: int) -> float:
    """max |analytic − central difference| over every parameter of a tiny float64 model (vocab 5,
    3 + 3 tokens, d_model 8, 2 query heads sharing 1 kv head, --layers layers)."""
    rng = np.random.default_rng(seed)
    model = TinyModel(vocab=5, d_model=8, heads=2, kv_heads=1, layers=layers, rng=rng, dtype=np.float64)
    tokens = make_batch(rng, 2, 3, 5)
    _, grads = model.loss_and_grads(tokens, 3, fused)
    worst, eps = 0.0, 1e-6
    for name, w in model.parameters().items():
        for i in np.ndindex(w.shape):
            old = w[i]
            w[i] = old + eps
            up = model.loss_and_grads(tokens, 3, fused)[0]
            w[i] = old - eps
            down = model.loss_and_grads(tokens, 3, fused)[0]
            w[i] = old
            worst = max(worst, abs((up - down) / (2 * eps) - grads[name][i]))
    return worst
