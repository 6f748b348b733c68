"""The layers of a transformer block around attention, each with its backward beside its forward.

    layer_norm     y = (x - μ) / √(σ² + ε) · g + b              Ba, Kiros & Hinton 2016
    rms_norm       y = x / √(mean(x²) + ε) · g                    Zhang & Sennrich 2019
    gelu           y = ½ u (1 + tanh(√(2/π) (u + 0.044715 u³)))   Hendrycks & Gimpel 2016, the tanh form
    swiglu         y = silu(a_gate) ∘ a_up                        Shazeer 2020
    mlp            y = act(x W_fc + b_fc) W_proj + b_proj          the block's feed-forward half
    dropout        y = x ∘ keep / (1 - p)                         the mask kept for the backward
    cross_entropy  loss = mean_n (logsumexp(z_n) - z_n[target_n])  and its gradient (softmax(z) - onehot) / N,
                   over the rows whose target is not ignore_index (torch's, -100)

API: every forward returns (y, saved); its backward takes (dy, saved) and returns the gradients, the input's
first. Rows are the leading axes (N tokens, or B, T), features the last. A layer returns its input's dtype,
whatever its weights': float32 stays float32, float64 (the gradient checks) stays float64, and a product with
a weight of another dtype is taken in the wider one and rounded where it is stored. A forward's `saved` holds its
weights by reference: update them only after the backward (the optimizer steps after it). layer_norm, gelu,
their backwards and cross_entropy run their lines on blocks of rows that stay in a core's L2 cache, over the
cores (_parallel.by_row_blocks; the block's size is _tuning.py's row block): each line treats each row alone,
so the result is the same bits for any block.

    layer_norm(x, gain, bias=None, eps=1e-5) -> (y, NormSaved)    layer_norm_backward(dy, saved) -> NormGrads
    rms_norm(x, gain, eps=1e-5) -> (y, NormSaved)                 rms_norm_backward(dy, saved) -> NormGrads
    gelu(u) -> (y, GeluSaved)                                     gelu_backward(dy, saved) -> du
    swiglu(a) -> (y, SwigluSaved)  a = [gate | up] (..., 2H)      swiglu_backward(dy, saved) -> da
    mlp(x, w_fc, w_proj, b_fc=None, b_proj=None, kind="gelu") -> (y, MLPSaved)    mlp_backward(dy, saved) -> MLPGrads
    dropout(x, p, rng) -> (y, keep or None)                       dropout_backward(dy, keep, p) -> dx
    cross_entropy(logits, targets, out=None, ignore_index=-100) -> (loss, probs)
    cross_entropy_backward(probs, targets, out=None, ignore_index=-100) -> dlogits

Each backward's docstring derives its lines; tests/test_layers.py holds each against central differences.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._parallel import by_row_blocks
from ._tuning import row_block

Array = NDArray[np.floating]

__all__ = [
    "MLP_KINDS",
    "GeluSaved",
    "MLPGrads",
    "MLPSaved",
    "NormGrads",
    "NormSaved",
    "SwigluSaved",
    "cross_entropy",
    "cross_entropy_backward",
    "dropout",
    "dropout_backward",
    "gelu",
    "gelu_backward",
    "layer_norm",
    "layer_norm_backward",
    "mlp",
    "mlp_backward",
    "rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
]

MLP_KINDS = ("gelu", "swiglu")


# --- the norms ----------------------------------------------------------------------------------------


def layer_norm(x: Array, gain: Array, bias: Array | None = None, eps: float = 1e-5) -> tuple[Array, NormSaved]:
    """y = x̂ · g + b with x̂ = (x - μ) / √(σ² + ε), μ and σ² the mean and (biased) variance of each row.

    x (..., C), gain and bias (C,) -> y (..., C). torch.nn.LayerNorm(C, eps, bias=bias is not None).

        >>> y, _ = layer_norm(np.array([[1.0, 3.0]]), np.ones(2))
        >>> y.round(3)
        array([[-1.,  1.]])
    """
    x_rows = x.reshape(-1, x.shape[-1])  # (N, C)
    y, x_hat, rstd = np.empty_like(x_rows), np.empty_like(x_rows), np.empty((len(x_rows), 1), x_rows.dtype)

    def normalise(x: Array, y: Array, x_hat: Array, rstd: Array) -> None:  # a block of rows x (n, C)
        np.subtract(x, _row_means(x)[:, None], out=x_hat)  # x - μ, normalised below
        var = _row_means(x_hat, x_hat)[:, None]  # (n, 1): σ², the mean of (x - μ)²
        np.divide(1.0, np.sqrt(var + eps), out=rstd)  # (n, 1): 1 / √(σ² + ε)
        x_hat *= rstd  # x̂ = (x - μ) / √(σ² + ε)
        np.multiply(x_hat, gain, out=y)  # y = x̂ · g + b
        if bias is not None:
            y += bias

    by_row_blocks(normalise, row_block(), x_rows, y, x_hat, rstd)  # the lines, block by block
    return y.reshape(x.shape), NormSaved(x_hat.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1), gain, bias is not None)


class NormSaved(NamedTuple):
    """What a norm's backward needs: x̂ (..., C), the normalised input, 1/√(σ² + ε) (..., 1), the gain,
    whether the norm had a bias (its backward gives dbias then), and the forward that made it ("layer_norm"
    or "rms_norm": each backward refuses the other's)."""

    x_hat: Array
    rstd: Array
    gain: Array
    biased: bool = False
    norm: str = "layer_norm"


class NormGrads(NamedTuple):
    """dx (x's shape), dgain (C,), dbias (C,) or None where the norm has no bias."""

    dx: Array
    dgain: Array
    dbias: Array | None


def layer_norm_backward(dy: Array, saved: NormSaved) -> NormGrads:
    """The gradients of layer_norm, from dy = ∂loss/∂y (..., C).

        y = x̂ g + b                 dg = Σ_rows dy ∘ x̂      db = Σ_rows dy      dx̂ = dy ∘ g
        x̂ = (x - μ) r, r = (σ² + ε)^-½
                                    dx = r (dx̂ - mean(dx̂) - x̂ mean(dx̂ ∘ x̂))   (means over the row)
    The last line: ∂x̂_j/∂x_i = r (δ_ij - 1/C - x̂_i x̂_j / C), since ∂μ/∂x_i = 1/C and ∂r/∂x_i = -r³ (x_i - μ) / C.
    """
    _check_saved(saved, NormSaved, "layer_norm")
    x_hat, rstd, gain = saved.x_hat, saved.rstd, saved.gain
    C = x_hat.shape[-1]
    dgain = np.einsum("nc,nc->c", dy.reshape(-1, C), x_hat.reshape(-1, C))  # (C,): summed over every row
    dbias = np.einsum("nc->c", dy.reshape(-1, C)) if saved.biased else None  # (C,): no pass over dy without a bias
    dy_rows, x_hat_rows = dy.reshape(-1, C), x_hat.reshape(-1, C)  # (N, C) each
    rstd_rows, dx = rstd.reshape(-1, 1), np.empty_like(dy_rows)  # (N, 1), (N, C)

    def lines(dy: Array, x_hat: Array, rstd: Array, dx: Array) -> None:  # a block of rows (n, C)
        dx_hat = dy * gain  # (n, C)
        np.subtract(dx_hat, _row_means(dx_hat)[:, None], out=dx)  # dx̂ - mean(dx̂)
        dx -= x_hat * _row_means(dx_hat, x_hat)[:, None]  # - x̂ mean(dx̂ ∘ x̂)
        dx *= rstd  # times r

    by_row_blocks(lines, row_block(), dy_rows, x_hat_rows, rstd_rows, dx)
    return NormGrads(dx.reshape(dy.shape), dgain, dbias)


def _check_saved(saved: object, kind: type, forward: str) -> None:
    """saved must be the `kind` that `forward` returned (for a norm: that norm's); else a TypeError naming it."""
    if not isinstance(saved, kind):
        raise TypeError(f"saved must be the {kind.__name__} that {forward} returned; got {type(saved).__name__}")
    if isinstance(saved, NormSaved) and saved.norm != forward:
        raise TypeError(f"saved must be the NormSaved that {forward} returned; got {saved.norm}'s")


def _row_means(x: Array, y: Array | None = None) -> Array:
    """The mean of each row of x (rows, C), or of x ∘ y -> (rows,). einsum's loop sums a short row three times
    faster than x.mean(axis=-1), and each row alone, in one order: the same bits in any block of rows."""
    sums = np.einsum("rc->r", x) if y is None else np.einsum("rc,rc->r", x, y)
    return sums / x.shape[-1]


def rms_norm(x: Array, gain: Array, eps: float = 1e-5) -> tuple[Array, NormSaved]:
    """y = x̂ · g with x̂ = x / √(mean(x²) + ε): LayerNorm without the centring and without a bias.

    x (..., C), gain (C,) -> y (..., C). torch.nn.RMSNorm(C, eps).

        >>> y, _ = rms_norm(np.array([[3.0, 4.0]]), np.ones(2), eps=0.0)
        >>> y.round(3)
        array([[0.849, 1.131]])
    """
    rstd = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)  # (..., 1)
    x_hat = x * rstd  # (..., C)
    y = np.multiply(x_hat, gain, out=np.empty_like(x_hat))  # (..., C): in x's dtype, whatever the gain's
    return y, NormSaved(x_hat, rstd, gain, norm="rms_norm")


def rms_norm_backward(dy: Array, saved: NormSaved) -> NormGrads:
    """The gradients of rms_norm, from dy (..., C): layer_norm_backward's lines without the mean's term.

        y = x̂ g                     dg = Σ_rows dy ∘ x̂      dx̂ = dy ∘ g
        x̂ = x r, r = (mean(x²) + ε)^-½
                                    dx = r (dx̂ - x̂ mean(dx̂ ∘ x̂))
    since ∂x̂_j/∂x_i = r (δ_ij - x̂_i x̂_j / C).
    """
    _check_saved(saved, NormSaved, "rms_norm")
    x_hat, rstd, gain = saved.x_hat, saved.rstd, saved.gain
    C = x_hat.shape[-1]
    dgain = np.einsum("nc,nc->c", dy.reshape(-1, C), x_hat.reshape(-1, C))  # (C,): summed over every row
    dx_hat = np.multiply(dy, gain, out=np.empty_like(dy))  # (..., C): in dy's dtype, whatever the gain's
    dx = dx_hat - x_hat * np.mean(dx_hat * x_hat, axis=-1, keepdims=True)  # (..., C)
    dx *= rstd
    return NormGrads(dx, dgain, None)


# --- the activations ----------------------------------------------------------------------------------

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715  # the cubic term of the tanh approximation (Hendrycks & Gimpel 2016, eq. 2)
# Beyond |u| = 10 the inner polynomial is past 43 and t = tanh(...) is ±1 to the last bit in float16, 32 and 64.
GELU_FLAT = 10.0


class GeluSaved(NamedTuple):
    """gelu's input u (..., H), all its backward needs: t = tanh(√(2/π) (u + 0.044715 u³)) is made again there,
    a block of rows at a time, rather than kept as a second array of u's size (torch's GELU keeps only u too)."""

    u: Array


def gelu(u: Array) -> tuple[Array, GeluSaved]:
    """y = ½ u (1 + t), t = tanh(√(2/π) (u + 0.044715 u³)): GPT-2's GELU, torch's GELU(approximate="tanh").

    u (..., H) -> y (..., H). The inner polynomial is written u (a + b u²), a = √(2/π), b = 0.044715 a.

        >>> gelu(np.array([-1.0, 0.0, 1.0]))[0].round(4)
        array([-0.1588,  0.    ,  0.8412])
    """
    u_rows = u.reshape(-1, u.shape[-1])  # (N, H)
    y = np.empty_like(u_rows)  # (N, H)

    def lines(u: Array, y: Array) -> None:  # a block of rows (n, H)
        np.add(_gelu_tanh(u), 1.0, out=y)  # 1 + t
        y *= u
        y *= 0.5  # ½ u (1 + t)

    by_row_blocks(lines, row_block(), u_rows, y)
    return y.reshape(u.shape), GeluSaved(u)


def _gelu_tanh(u: Array) -> Array:
    """t = tanh(u (a + b u²)) for one block of rows u, a new array of the block's size."""
    t = np.square(u)  # u², then the inner polynomial, then its tanh, in t's memory
    t *= GELU_CUBIC * SQRT_2_OVER_PI
    t += SQRT_2_OVER_PI
    t *= u
    return np.tanh(t, out=t)


def gelu_backward(dy: Array, saved: GeluSaved) -> Array:
    """du from dy (..., H): the product rule on y = ½ u (1 + t) with t = tanh(u (a + b u²)):

    dy/du = ½ (1 + t) + ½ u (1 - t²) (a + 3 b u²)        tanh' = 1 - tanh², (u (a + b u²))' = a + 3 b u²
          = (1 + t) (½ + u (a/2 + 3b/2 u²) (1 - t))      1 - t² = (1 - t) (1 + t); the ½ inside
    (Halving is exact in binary: the ½ taken inside gives the same bits as ½ (1 + t) (1 + u (a + 3 b u²) (1 - t))
    and saves a pass.) Far from 0, t = ±1 and one factor, 1 - t or 1 + t, is 0 (dy/du = 1 or 0), while
    u (a + 3 b u²) overflows (float32 past |u| = 1.4e13): inf times 0 would be NaN. So the polynomial takes u
    clipped to ±10 (GELU_FLAT), where t is already ±1: the same bits inside, a finite number times 0 outside.
    """
    _check_saved(saved, GeluSaved, "gelu")
    u_rows = saved.u.reshape(-1, saved.u.shape[-1])  # (N, H)
    dy_rows = dy.reshape(u_rows.shape)  # (N, H)
    du = np.empty_like(dy_rows)  # (N, H)
    by_row_blocks(_gelu_backward_lines, row_block(), dy_rows, u_rows, du)
    return du.reshape(dy.shape)


def _gelu_backward_lines(dy: Array, u: Array, du: Array) -> None:
    """gelu_backward's lines on one block of rows (n, H), written into du."""
    t = _gelu_tanh(u)  # the forward's t, made again in the cache
    if u.min() < -GELU_FLAT or u.max() > GELU_FLAT:  # the clip's pass only where it changes something
        u = np.clip(u, -GELU_FLAT, GELU_FLAT)  # u itself wherever t is not ±1 (the docstring)
    np.square(u, out=du)  # a/2 + 3b/2 u², then the whole derivative, in du's memory
    du *= 1.5 * GELU_CUBIC * SQRT_2_OVER_PI
    du += 0.5 * SQRT_2_OVER_PI
    du *= u
    np.subtract(1.0, t, out=t)  # 1 - t
    du *= t
    du += 0.5
    np.subtract(2.0, t, out=t)  # 1 + t = 2 - (1 - t)
    du *= t
    du *= dy


class SwigluSaved(NamedTuple):
    """swiglu's two halves, gate and up (..., H) (views of its input), and σ(gate)."""

    gate: Array
    up: Array
    sigmoid: Array


def swiglu(a: Array) -> tuple[Array, SwigluSaved]:
    """y = silu(gate) ∘ up with [gate | up] = a, silu(g) = g σ(g): a (..., 2H) -> y (..., H).

    The two halves come from one matmul (the MLP's w_fc holds [W_gate | W_up] side by side).
    σ(g) is computed as ½ (1 + tanh(g / 2)): the same function, without exp's overflow for large -g.

        >>> swiglu(np.array([[0.0, 1.0, 2.0, 3.0]]))[0].round(4)   # gate (0, 1), up (2, 3)
        array([[0.    , 2.1932]])
    """
    H = a.shape[-1] // 2
    gate, up = a[..., :H], a[..., H:]  # (..., H) each, views
    sigmoid = np.tanh(0.5 * gate)  # (..., H): σ(gate), in one buffer
    sigmoid += 1.0
    sigmoid *= 0.5
    y = gate * sigmoid  # (..., H): silu(gate)
    y *= up
    return y, SwigluSaved(gate, up, sigmoid)


def swiglu_backward(dy: Array, saved: SwigluSaved) -> Array:
    """da = [dgate | dup] (..., 2H) from dy (..., H):

    y = s(g) u, s(g) = g σ(g)       du = dy s(g)        dg = dy u s'(g),  s'(g) = σ(g) (1 + g (1 - σ(g)))
    """
    _check_saved(saved, SwigluSaved, "swiglu")
    gate, up, sigmoid = saved
    H = gate.shape[-1]
    da = np.empty((*dy.shape[:-1], 2 * H), dtype=dy.dtype)  # (..., 2H)
    dgate, dup = da[..., :H], da[..., H:]
    np.multiply(gate, sigmoid, out=dup)  # silu(gate)
    dup *= dy
    np.subtract(1.0, sigmoid, out=dgate)  # s'(g) = σ (1 + g (1 - σ)), built in place
    dgate *= gate
    dgate += 1.0
    dgate *= sigmoid
    dgate *= up
    dgate *= dy
    return da


# --- the MLP: one matmul in, the activation, one matmul out -------------------------------------------


class MLPSaved(NamedTuple):
    """What mlp_backward needs: the input x (N, C), the activation's output h and what its backward keeps,
    the two matrices (references, not copies), whether there were biases, and the kind."""

    x: Array
    h: Array
    activation: GeluSaved | SwigluSaved
    w_fc: Array
    w_proj: Array
    biased: bool
    kind: str


class MLPGrads(NamedTuple):
    """dx (N, C), dw_fc, dw_proj (the matrices' shapes), db_fc and db_proj (or None without biases)."""

    dx: Array
    dw_fc: Array
    dw_proj: Array
    db_fc: Array | None
    db_proj: Array | None


def mlp(
    x: Array, w_fc: Array, w_proj: Array, b_fc: Array | None = None, b_proj: Array | None = None, *, kind: str = "gelu"
) -> tuple[Array, MLPSaved]:
    """y = act(x W_fc + b_fc) W_proj + b_proj: x (N, C) -> y (N, C).

    kind="gelu": W_fc (C, H), W_proj (H, C), act = gelu (GPT-2's MLP, H = 4C).
    kind="swiglu": W_fc (C, 2H) = [W_gate | W_up], W_proj (H, C), act = swiglu (Llama's MLP).
    b_fc and b_proj: both or neither.
    """
    if kind not in MLP_KINDS:
        raise ValueError(f"kind must be one of {MLP_KINDS}; got {kind!r}")
    a = _matmul(x, w_fc)  # (N, H) or (N, 2H)
    if b_fc is not None:
        a += b_fc
    h, activation = gelu(a) if kind == "gelu" else swiglu(a)  # (N, H)
    y = _matmul(h, w_proj)  # (N, C)
    if b_proj is not None:
        y += b_proj
    return y, MLPSaved(x, h, activation, w_fc, w_proj, b_fc is not None, kind)


def mlp_backward(dy: Array, saved: MLPSaved) -> MLPGrads:
    """The gradients of mlp from dy (N, C), its lines last first (W multiplies from the right):

    y = h W_proj + b_proj       dW_proj = hᵀ dy      db_proj = Σ_rows dy      dh = dy W_projᵀ
    h = act(a)                  da = act_backward(dh)
    a = x W_fc + b_fc           dW_fc = xᵀ da        db_fc = Σ_rows da        dx = da W_fcᵀ
    """
    _check_saved(saved, MLPSaved, "mlp")
    x, h, activation, w_fc, w_proj, biased, kind = saved
    dw_proj = h.T @ dy  # (H, C)
    dh = _matmul(dy, w_proj.T)  # (N, H)
    if kind == "gelu":
        da = gelu_backward(dh, activation)  # type: ignore[arg-type]  # (N, H)
    else:
        da = swiglu_backward(dh, activation)  # type: ignore[arg-type]  # (N, 2H)
    dw_fc = x.T @ da  # (C, H) or (C, 2H)
    dx = _matmul(da, w_fc.T)  # (N, C)
    db_fc, db_proj = (da.sum(axis=0), dy.sum(axis=0)) if biased else (None, None)
    return MLPGrads(dx, dw_fc, dw_proj, db_fc, db_proj)


def _matmul(a: Array, b: Array) -> Array:
    """a @ b in a's dtype (the module's rule): with b of another dtype, the product is taken in the wider one
    and rounded to a's where it is stored."""
    if b.dtype == a.dtype:
        return a @ b
    return np.matmul(a, b, out=np.empty((*a.shape[:-1], b.shape[-1]), a.dtype))


# --- dropout and the loss -----------------------------------------------------------------------------


def dropout(x: Array, p: float, rng: np.random.Generator | None) -> tuple[Array, NDArray[np.bool_] | None]:
    """Inverted dropout: y = x ∘ keep / (1 - p), keep[i] true with probability 1 - p, so E[y] = x.

    p = 0 returns x itself and no mask (no draw from rng). The mask is returned for dropout_backward;
    at evaluation, do not call dropout at all.
    """
    if p == 0.0:
        return x, None
    if rng is None:
        raise ValueError(f"dropout with p={p} draws its mask: pass rng, a np.random.Generator")
    keep = rng.random(x.shape, dtype=np.float32) >= p  # (..., C) bool: one byte per element
    y = x * keep  # (..., C)
    y *= 1.0 / (1.0 - p)
    return y, keep


def dropout_backward(dy: Array, keep: NDArray[np.bool_] | None, p: float) -> Array:
    """dx = dy ∘ keep / (1 - p): the same mask and scale as the forward (dy itself when p = 0)."""
    if keep is None:
        return dy
    dx = dy * keep
    dx *= 1.0 / (1.0 - p)
    return dx


def cross_entropy(
    logits: Array, targets: NDArray[np.integer], *, out: Array | None = None, ignore_index: int = -100
) -> tuple[float, Array]:
    """loss = (1/N) Σ_n (logsumexp(z_n) - z_n[t_n]), the mean negative log-likelihood of the targets.

    logits z (N, V), targets t (N,) ints in [0, V) -> (loss as a Python float, probs = softmax(z) (N, V)).
    torch.nn.functional.cross_entropy(z, t, ignore_index=ignore_index): a row whose target is ignore_index is
    left out, and N counts the other rows (every row ignored is refused: torch's mean is then 0/0, nan). The
    row max is subtracted first: exp of a logit of 100 overflows float32, exp of 0 does not. out: where the
    probabilities go (out=logits overwrites the logits when nothing needs them after; default a new array).
    """
    targets, kept = _check_targets(targets, logits.shape, ignore_index, "logits")
    probs = np.empty_like(logits) if out is None else out  # (N, V)
    nll = np.empty(logits.shape[0], dtype=logits.dtype)  # (N,): each row's -log p(target)

    def lines(logits: Array, targets: NDArray[np.integer], probs: Array, nll: Array) -> None:  # a block of rows
        nll[...] = _softmax_lines(logits, targets, probs)

    by_row_blocks(lines, row_block(), logits, targets, probs, nll)
    return float(np.mean(nll if kept is None else nll[kept])), probs


def _check_targets(
    targets: Any, shape: tuple[int, ...], ignore_index: Any, name: str
) -> tuple[NDArray[np.integer], NDArray[np.bool_] | None]:
    """targets as ints (N,) in [0, V) for `name` (N, V), and which rows count: None where every row does, else
    a bool (N,) false where the target is ignore_index (read as class 0 there, so the lines can index with it)."""
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an int (torch's default: -100); got {ignore_index!r}")
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"targets must be integer class ids; got dtype {targets.dtype}")
    if len(shape) != 2:
        raise ValueError(f"{name} must be (N, V), a row of V classes per target; got shape {shape}")
    if targets.shape != shape[:1]:
        raise ValueError(f"targets must be (N,) = ({shape[0]},) class ids, one per row; got shape {targets.shape}")
    ignored = targets == ignore_index  # (N,)
    outside = ((targets < 0) | (targets >= shape[1])) & ~ignored  # (N,)
    if outside.any():
        row, more = int(np.argmax(outside)), int(outside.sum()) - 1
        raise ValueError(
            f"targets hold {targets[row]} at row {row}{f' (and {more} more)' if more else ''}, outside the classes "
            f"[0, {shape[1]}) and not ignore_index ({ignore_index})"
        )
    if not ignored.any():
        return targets, None
    if ignored.all():
        raise ValueError(f"every target is ignore_index ({ignore_index}): the mean over no rows is 0/0 (torch's nan)")
    return np.where(ignored, 0, targets), ~ignored


def _softmax_lines(logits: Array, targets: NDArray[np.integer], probs: Array) -> Array:
    """cross_entropy's lines on one block of rows: softmax(logits) into probs (which may be logits itself);
    returns each row's logsumexp(z) - z[t] (rows,)."""
    shifted = np.subtract(logits, logits.max(axis=-1, keepdims=True), out=probs)  # (rows, V): each row's largest is 0
    target_logit = shifted[np.arange(shifted.shape[0]), targets]  # (rows,)
    np.exp(shifted, out=shifted)  # (rows, V): the exponentials, normalised below
    total = shifted.sum(axis=-1, keepdims=True)  # (rows, 1)
    shifted /= total
    return np.log(total[:, 0]) - target_logit


def cross_entropy_backward(
    probs: Array, targets: NDArray[np.integer], *, out: Array | None = None, ignore_index: int = -100
) -> Array:
    """dlogits (N, V) = (softmax(z) - onehot(t)) / N: for one row, ∂(logsumexp(z) - z_t)/∂z_j = p_j - [j = t],
    and the mean over N rows divides by N; a row whose target is ignore_index is not in the mean: its gradient
    is 0 and N counts the others. out: where to write it (out=probs reuses the forward's probabilities when
    nothing needs them after; default a new array)."""
    targets, kept = _check_targets(targets, probs.shape, ignore_index, "probs")
    N = probs.shape[0] if kept is None else int(kept.sum())
    dlogits = probs.copy() if out is None else out  # (N, V)
    if out is not None and out is not probs:
        out[...] = probs
    dlogits[np.arange(probs.shape[0]), targets] -= 1.0
    if kept is not None:
        dlogits[~kept] = 0.0
    dlogits *= 1.0 / N
    return dlogits
