"""Multi-head attention with one fused qkv projection, and grouped-query attention (GQA/MQA).

    qkv = x W_qkv                      (B, T, (H + 2·Hkv)·d_head)   one matmul for every head
    q, k, v = split(qkv)               (B, H, T, d_head), (B, Hkv, T, d_head) twice
    y = attention(q, k, v)             (B, H, T, d_head), query head h reads kv head h // (H / Hkv)
    out = concat_heads(y) W_out        (B, T, d_model)

Splitting into heads adds no parameters: it only decides how the d_model channels are grouped.

The layer is a pair of functions over arrays: multihead_forward(x, weights) runs those lines with a
HeadWeights (the two matrices and the sizes) and keeps what multihead_backward needs, which derives every
gradient by hand. The GPT (gpt.py) calls them on its own parameters; MultiHeadAttention holds the weights as a
module and calls the same two functions.

Decoding belongs to the caches that come after this file (kvcache.py, paged.py): layer(x, cache=c) hands x to
c.attend(layer, x), which asks the layer for the heads of x at the positions that continue what c holds
(split_heads) and for the heads' attention over the keys and values it holds (attend_heads): DecodingLayer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ._backward_kernel import BackwardPlan, FlexGrads, flex_backward
from ._checks import (
    ACCEPTED_DTYPES,
    QKVShape,
    as_float_array,
    check_bool,
    check_positive_int,
    check_rng,
    check_weight,
)
from ._flash_kernel import flash_forward, flash_plan
from ._guard import refuse_attention
from ._mod_calls import check_score_mod
from ._tiles import TileMask
from .attention import ScoreRules, attend
from .backward import attention_grads as flex_attention_grads
from .blockmask import Band, check_band, check_block_mask
from .position import rope as apply_rope
from .position import rope_table, rope_with_table

Array = NDArray[np.floating]

__all__ = [
    "DecodingCache",
    "DecodingLayer",
    "HeadWeights",
    "MultiHeadAttention",
    "MultiheadSaved",
    "attend_heads",
    "check_decoding_layer",
    "multihead_backward",
    "multihead_forward",
    "project_out",
]


def multihead_forward(
    x: Array,
    weights: HeadWeights,
    *,
    mask: TileMask | None = None,
    fused: bool = True,
    score_mod: Any = None,
    copies: bool = True,
) -> tuple[Array, MultiheadSaved]:
    """out = concat_heads(attention(q, k, v)) W_out, the lines above, and what multihead_backward needs.

    x (B, T, d_model) in the weights' dtype -> out (B, T, d_model). mask: which keys each query sees, a Band
    (causal and window; default causal) or a BlockMask; fused: flash attention, whose lse is kept, or the
    reference that builds the scores; score_mod: flex attention's (mods.py), or None. saved holds copies of x
    and of the weights as they were: a change to either between the forward and the backward cannot change
    the gradients. copies=False keeps x and the weights themselves, for a caller that changes neither before
    the backward (the GPT's loss_and_grads runs both, and the optimizer comes after).
    """
    mask = check_band(True, None, x.shape[1], x.shape[1]) if mask is None else mask
    if copies:
        weights, x = weights.copied(), x.copy()  # this forward's, whatever an optimizer does to them later
    q, k, v = project_heads(x, weights)  # (B, H, T, d_head), (B, Hkv, T, d_head) twice; rotated if rope
    y, lse = attend_heads(q, k, v, mask, fused, score_mod)  # (B, H, T, d_head), (B, H, T) or None
    out = project_out(y, weights.w_out)  # (B, T, d_model)
    return out, MultiheadSaved(x, weights, q, k, v, y, lse, mask, fused, score_mod)


def project_heads(x: Array, weights: HeadWeights, positions: Any = None) -> tuple[Array, Array, Array]:
    """x (B, T, d_model) -> q (B, H, T, d_head), k and v (B, Hkv, T, d_head), from one matmul; q and k turned
    by RoPE at positions (T,) (default 0 .. T-1) if weights.rope."""
    B, T, _ = x.shape
    n_heads, n_kv_heads, d_head = weights.n_heads, weights.n_kv_heads, weights.d_head
    qkv = matmul_rows(x, weights.w_qkv)  # (B, T, (H + 2·Hkv)·d_head): all heads' q, k and v at once
    q_end = n_heads * d_head
    k_end = q_end + n_kv_heads * d_head
    q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    # (B, T, heads·d_head) -> (B, T, heads, d_head) -> (B, heads, T, d_head): each head its own problem
    q = q.reshape(B, T, n_heads, d_head).swapaxes(1, 2)
    k = k.reshape(B, T, n_kv_heads, d_head).swapaxes(1, 2)
    v = v.reshape(B, T, n_kv_heads, d_head).swapaxes(1, 2)
    if weights.rope and positions is None:  # position enters the scores only: v stays as it is
        turns = rope_table(T, d_head, q.dtype)  # (T, d_head/2): positions 0 .. T-1, made once for every call
        q, k = rope_with_table(q, turns), rope_with_table(k, turns)
    elif weights.rope:
        q, k = apply_rope(q, positions=positions), apply_rope(k, positions=positions)
    return q, k, v


def attend_heads(
    q: Array, k: Array, v: Array, mask: TileMask, fused: bool = True, score_mod: Any = None, scale: float | None = None
) -> tuple[Array, Array | None]:
    """The heads' attention, for heads whose shapes need no check: q (B, H, L, E), k (B, Hkv, S, E), v (B,
    Hkv, S, Ev) -> y (B, H, L, Ev) and lse (B, H, L) (fused: flash's kernel) or None (the reference, behind
    its memory guard). mask: a Band or a BlockMask; score_mod: flex attention's, or None; scale: default
    1/√E."""
    dims = QKVShape(q.shape[:1], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    scale = 1.0 / math.sqrt(dims.e) if scale is None else scale
    if fused:
        return flash_forward(q, k, v, dims, flash_plan(dims, mask, scale, score_mod=score_mod))
    rules = reference_rules(mask, score_mod)
    refuse_attention(dims, q.dtype, rules)
    ct = np.result_type(k, np.float32)  # float16 is computed in float32
    y, _ = attend(q, k.astype(ct, copy=False), v.astype(ct, copy=False), dims, scale, rules)
    return y.astype(q.dtype, copy=False), None


def project_out(y: Array, w_out: Array) -> Array:
    """y (B, H, T, d_head) -> concat_heads(y) W_out (B, T, d_model): the heads glued back side by side, then
    the output projection."""
    B, H, T, d_head = y.shape
    return matmul_rows(y.swapaxes(1, 2).reshape(B, T, H * d_head), w_out)


def matmul_rows(x: Array, w: Array) -> Array:
    """x (..., n) @ w (n, m) -> (..., m), as one product of all of x's rows: NumPy multiplies a stack
    (B, T, n) @ (n, m) as B products of T rows each, and one product of B·T rows is faster."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def multihead_backward(dout: Array, saved: MultiheadSaved) -> Any:
    """dx, dw_qkv, dw_out from dout = ∂loss/∂out (B, T, d_model), in the weights' dtype, and the `saved` of
    the forward that made out; with a score_mod that holds learned parameters (mods.Alibi(learned=True),
    RelativeBias), also their gradient, a fourth value shaped like score_mod.params.

    The forward's lines, last first, each with its gradient (W multiplies from the right):
        out = Y W_out                 dW_out = Yᵀ dout              dY = dout W_outᵀ
        Y = attention(q, k, v)        dq, dk, dv = (flash_)attention_backward(..., dY)
        q, k = rope(q), rope(k)       dq, dk = rope_backward(dq), rope_backward(dk)
        qkv = x W_qkv                 dW_qkv = xᵀ dqkv              dx = dqkv W_qkvᵀ
    Sums over the batch and tokens are folded into the weight gradients' matmuls.
    dx has x's shape; dw_qkv and dw_out have the weights' shapes and dtype.
    """
    x, y, w = saved.x, saved.y, saved.weights
    (B, T, d_model), d_head = x.shape, y.shape[3]
    # 1) out = Y W_out, with the forward's own W_out
    y_cat = y.swapaxes(1, 2).reshape(B * T, d_model)  # (B·T, d_model): the heads side by side
    dw_out = y_cat.T @ dout.reshape(B * T, d_model)  # (d_model, d_model)
    dy = matmul_rows(dout, w.w_out.T)  # (B, T, d_model)
    dy = dy.reshape(B, T, w.n_heads, d_head).swapaxes(1, 2)  # (B, H, T, d_head)
    # 2) through the attention, the way the forward went (its band: causal and window, or its block mask)
    dq, dk, dv, dscore_mod, _ = attention_grads(saved, dy)
    # 3) through RoPE: the rotation back by -θ (rope_backward, its turns made once for every call)
    if w.rope:
        turns = rope_table(T, d_head, dq.dtype, backward=True)  # (T, d_head/2)
        dq, dk = rope_with_table(dq, turns), rope_with_table(dk, turns)
    # 4) qkv = x W_qkv: the heads' gradients side by side in qkv's column order [q heads | k heads | v heads]
    q_end, k_end = w.n_heads, w.n_heads + w.n_kv_heads
    heads = np.empty((B, T, k_end + w.n_kv_heads, d_head), dq.dtype)  # (B, T, H + 2·Hkv, d_head)
    heads[:, :, :q_end], heads[:, :, q_end:k_end], heads[:, :, k_end:] = (g.swapaxes(1, 2) for g in (dq, dk, dv))
    dqkv = heads.reshape(B * T, -1)  # (B·T, (H + 2·Hkv)·d_head)
    dw_qkv = x.reshape(B * T, d_model).T @ dqkv  # (d_model, (H + 2·Hkv)·d_head)
    dx = (dqkv @ w.w_qkv.T).reshape(B, T, d_model)  # x's shape
    return (dx, dw_qkv, dw_out) if dscore_mod is None else (dx, dw_qkv, dw_out, dscore_mod)


def attention_grads(saved: MultiheadSaved, dy: Array) -> FlexGrads:
    """dq, dk, dv (and the score_mod's parameters') of the forward's attention (its kernel, mask, score_mod
    and lse) for dY (B, H, T, d_head)."""
    q, k, v, y, mask, w = saved.q, saved.k, saved.v, saved.y, saved.mask, saved.weights
    score_mod = check_score_mod(saved.score_mod, backward=True)
    T, d_head = q.shape[2], q.shape[3]
    dims = QKVShape(q.shape[:1], w.n_heads, w.n_kv_heads, T, T, d_head, d_head)
    scale = 1.0 / math.sqrt(d_head)
    if saved.fused:
        forward = flash_plan(dims, mask, scale)  # its tile sizes and workers, the forward's defaults
        plan = BackwardPlan(scale, mask, forward.block_q, forward.block_k, forward.workers, score_mod)
        return flex_backward(q, k, v, y, dy, cast(Array, saved.lse), dims, plan)
    ct = np.result_type(q, np.float32)  # float16 is computed in float32
    q_c, k_c, v_c, dy_c = (a.astype(ct, copy=False) for a in (q, k, v, dy))
    grads = flex_attention_grads(q_c, k_c, v_c, dy_c, dims, scale, reference_rules(mask, score_mod))
    return grads._replace(**{name: getattr(grads, name).astype(q.dtype, copy=False) for name in ("dq", "dk", "dv")})


def reference_rules(mask: TileMask, score_mod: Any) -> ScoreRules:
    """What the reference path hides and changes for a Band or a BlockMask (its mask_mod), and a score_mod."""
    if isinstance(mask, Band):
        return ScoreRules(None, mask.offset, mask.window, score_mod=score_mod)
    return ScoreRules(None, None, None, mask_mod=mask.mask_mod, score_mod=score_mod)


class HeadWeights(NamedTuple):
    """A multi-head attention as arrays: its two matrices and its sizes, all multihead_forward needs.

    w_qkv (d_model, (n_heads + 2·n_kv_heads)·d_head), columns [q heads | k heads | v heads]; w_out (d_model,
    d_model); rope: q and k turned by RoPE. The GPT makes one of its parameters for each layer (no copies).
    A cache's attend takes it as the layer (DecodingLayer): split_heads, attend_heads, check_cache.
    """

    w_qkv: Array
    w_out: Array
    n_heads: int
    n_kv_heads: int
    rope: bool = False

    @property
    def d_model(self) -> int:
        return int(self.w_out.shape[0])

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def softmax_scale(self) -> float:
        """1/√d_head, the scale of every head's scores."""
        return 1.0 / math.sqrt(self.d_head)

    def copied(self) -> HeadWeights:
        """The same layer with copies of its two matrices."""
        return self._replace(w_qkv=self.w_qkv.copy(), w_out=self.w_out.copy())

    def check_input(self, x: Any) -> Array:
        """x (B, T, d_model), as an array in the weights' dtype."""
        x = as_float_array(x, "x")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, {self.d_model}); got shape {x.shape}")
        return x.astype(self.w_qkv.dtype, copy=False)

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Array, Array, Array]:
        """x (B, T, d_model), checked -> q (B, H, T, d_head), k and v (B, Hkv, T, d_head) (project_heads)."""
        return project_heads(self.check_input(x), self, positions)

    def attend_heads(self, q: Array, k: Array, v: Array, band: TileMask, fused: bool = True) -> tuple[Array, Any]:
        """The heads' attention over the keys and values a cache hands it (attend_heads)."""
        return attend_heads(q, k, v, band, fused)

    def check_cache(self, cache: Any, x: Any) -> Array:
        """x (B, T, d_model) in the weights' dtype, once `cache` is checked to hold this layer's keys and values:
        a KVCache(B, n_kv_heads, ..., d_head) or a PagedKVCache(..., n_kv_heads, d_head, dtype), its values
        stored apart from the keys (value_prefix=None). A KVCache's dtype is checked when the keys are appended."""
        x = self.check_input(x)
        if hasattr(cache, "batch"):  # a KVCache, one sequence per row of x
            want = {"batch": x.shape[0], "kv_heads": self.n_kv_heads, "head_dim": self.d_head}
        else:  # a PagedKVCache, any sequences
            want = {"kv_heads": self.n_kv_heads, "head_dim": self.d_head, "dtype": self.w_qkv.dtype}
        if {name: getattr(cache, name) for name in want} != want or cache.value_prefix is not None:
            sizes = ", ".join(f"{name}={value}" for name, value in want.items())
            got = ", ".join(f"{name}={getattr(cache, name)}" for name in (*want, "value_prefix"))
            raise ValueError(
                f"cache must be {type(cache).__name__}({sizes + ', ...' if 'batch' in want else '..., ' + sizes}) "
                f"for this layer, its values stored apart from the keys (value_prefix=None); got {got}"
            )
        return x


class MultiheadSaved(NamedTuple):
    """What multihead_backward needs from its forward: copies of the input x (B, T, d_model) and of the
    weights as they were (with copies=False, x and the weights themselves), the heads' q, k, v (after RoPE)
    and attention output y (B, H, T, d_head), flash's lse (fused) or None, the mask (a Band of causal and
    window, or a BlockMask), the kernel, and the score_mod or None; MultiHeadAttention.forward adds itself and
    whether x came without a batch axis."""

    x: Array
    weights: HeadWeights
    q: Array
    k: Array
    v: Array
    y: Array
    lse: Array | None
    mask: TileMask
    fused: bool
    score_mod: Any = None
    module: Any = None
    unbatched: bool = False

    @property
    def causal(self) -> bool:
        """Whether the forward was causal (a band with a diagonal; a block mask says it in its mask_mod)."""
        return isinstance(self.mask, Band) and self.mask.offset is not None


class MultiHeadAttention:
    """n_heads query heads of d_head = d_model / n_heads, sharing n_kv_heads key/value heads
    (n_kv_heads = n_heads: classic multi-head; 1: multi-query; in between: grouped-query).

    Weights multiply from the right (x @ W, W of shape (in, out): torch's nn.Linear.weight transposed):
        w_qkv (d_model, (n_heads + 2·n_kv_heads)·d_head), columns [q heads | k heads | v heads]
        w_out (d_model, d_model)
    rope=True rotates q and k (never v) by position before the scores.

    Initialisation: every weight uniform in ±1/√d_model, the range torch's nn.Linear draws from. rng: a
    np.random.Generator, or an int seed for np.random.default_rng(seed); None (the default) draws fresh
    weights from a fresh generator, so two modules built without rng differ. Pass rng for repeatable weights.
    dtype: float16, float32 (default) or float64, the dtype of the weights. The module computes in that dtype:
    an input x of another dtype (a float64 x for the default float32 module) is converted first, and the
    output comes back in the module's dtype, not x's.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        rope: bool = False,
        rng: np.random.Generator | int | None = None,
        dtype: Any = np.float32,
    ):
        self.d_model = check_positive_int(d_model, "d_model")
        self.n_heads = check_positive_int(n_heads, "n_heads")
        self.n_kv_heads = check_positive_int(n_kv_heads, "n_kv_heads", default=self.n_heads)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if np.dtype(dtype) not in ACCEPTED_DTYPES:
            raise TypeError(f"dtype must be float16, float32 or float64; got {np.dtype(dtype)}")
        self.d_head = self.d_model // self.n_heads
        if rope and self.d_head % 2:
            raise ValueError(f"rope=True needs an even head size; got d_head={self.d_head}")
        self.rope = check_bool(rope, "rope")
        rng = check_rng(rng)  # None: fresh weights; an int: that seed
        n_qkv = (self.n_heads + 2 * self.n_kv_heads) * self.d_head
        # uniform(-1/√in, 1/√in): the range torch's nn.Linear draws its default weights from
        bound = 1.0 / np.sqrt(self.d_model)
        self.w_qkv = rng.uniform(-bound, bound, (self.d_model, n_qkv)).astype(dtype)
        self.w_out = rng.uniform(-bound, bound, (self.d_model, self.d_model)).astype(dtype)

    def __repr__(self) -> str:
        return (
            f"MultiHeadAttention(d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"rope={self.rope}, dtype={self.w_qkv.dtype.name}, parameters={self.num_parameters:,})"
        )

    @property
    def w_qkv(self) -> Array:
        """(d_model, (n_heads + 2·n_kv_heads)·d_head): every head's q, k and v columns, one matmul. Assigning
        it checks the shape (a torch weight must come transposed) and keeps the array itself, not a copy."""
        return self._w_qkv

    @w_qkv.setter
    def w_qkv(self, w: Any) -> None:
        self._w_qkv = check_weight(w, "w_qkv", (self.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.d_head))

    @property
    def w_out(self) -> Array:
        """(d_model, d_model): the heads' outputs, concatenated, back to the model's width. Checked as
        w_qkv."""
        return self._w_out

    @w_out.setter
    def w_out(self, w: Any) -> None:
        self._w_out = check_weight(w, "w_out", (self.d_model, self.d_model))

    @property
    def num_parameters(self) -> int:
        """Weights in w_qkv and w_out (no biases)."""
        return int(self.w_qkv.size + self.w_out.size)

    @property
    def weights(self) -> HeadWeights:
        """The layer as arrays, what multihead_forward takes: the weights themselves (no copies) and the
        sizes."""
        return HeadWeights(self.w_qkv, self.w_out, self.n_heads, self.n_kv_heads, self.rope)

    def __call__(
        self,
        x: Array,
        *,
        causal: bool = True,
        fused: bool = True,
        cache: DecodingCache | None = None,
        seq_ids: Sequence[int] | None = None,
        block_mask: Any = None,
        score_mod: Any = None,
    ) -> Array:
        """x (B, T, d_model) or (T, d_model) -> same shape. fused=True runs flash attention,
        fused=False the reference attention that builds the (B, H, T, T) scores.
        block_mask, score_mod: flex attention's, as in forward() (not with cache=).

        cache: x continues what the cache holds, and the cache does the decoding (its attend(self, x)):
        a KVCache(B, n_kv_heads, max_tokens, d_head, dtype) turns x's tokens by RoPE at absolute positions
        len(cache) .. len(cache) + T - 1, appends their k and v, and lets them attend causally to everything
        it holds (bottom-right: a one-token decode step sees all S cached keys). A prefill (T tokens into an
        empty cache) and then T' one-token steps give the same outputs as the whole T + T' tokens at once.
        A PagedKVCache(num_blocks, block_size, n_kv_heads, d_head, dtype) with seq_ids, the B sequences that
        the rows of x continue, does the same for each row at its own sequence's positions, length(seq)
        onwards; the lengths may differ, and the B appends are all or nothing (PoolExhaustedError changes
        nothing). Either holds its lock from reading its length to the append.
        """
        if cache is None:  # the forward pass, without keeping anything for a backward
            if seq_ids is not None:
                raise ValueError("seq_ids names sequences of a PagedKVCache: pass cache= as well, or no seq_ids")
            return self.forward(x, causal=causal, fused=fused, block_mask=block_mask, score_mod=score_mod)[0]
        if block_mask is not None or score_mod is not None:
            raise ValueError("cache= decodes with the causal band: pass block_mask=None and score_mod=None with it")
        causal, fused = check_bool(causal, "causal"), check_bool(fused, "fused")
        x_b, unbatched = self._batched(x)  # (B, T, d_model)
        if not isinstance(cache, DecodingCache):
            raise TypeError(
                f"cache must be a KVCache or None; got {type(cache).__name__} (or, for sequences of different "
                "lengths, a PagedKVCache with seq_ids=)"
            )
        if not causal:
            raise ValueError("cache= continues a sequence token by token: it needs causal=True; got causal=False")
        y = cache.attend(self, x_b, fused=fused, seq_ids=seq_ids)  # (B, H, T, d_head); x's k and v appended
        out = project_out(y, self.w_out)  # (B, T, d_model)
        return out[0] if unbatched else out

    def _batched(self, x: Array) -> tuple[Array, bool]:
        """x (B, T, d_model) or (T, d_model), checked, as (B, T, d_model) in the module's dtype, and
        whether it came without a batch axis."""
        x = as_float_array(x, "x")
        if x.ndim not in (2, 3) or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, {self.d_model}) or (T, {self.d_model}); got shape {x.shape}")
        unbatched = x.ndim == 2
        x_b = x[None] if unbatched else x  # (B, T, d_model)
        return x_b.astype(self.w_qkv.dtype, copy=False), unbatched

    # --- what a cache's attend asks of the layer (DecodingLayer): the weights' own -------------------

    @property
    def softmax_scale(self) -> float:
        """1/√d_head, the scale of every head's scores."""
        return self.weights.softmax_scale

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Array, Array, Array]:
        """x (B, T, d_model) -> q (B, H, T, d_head), k and v (B, Hkv, T, d_head), from one matmul.
        positions (T,): the absolute positions RoPE rotates by (default 0 .. T-1)."""
        return self.weights.split_heads(x, positions)

    def attend_heads(self, q: Array, k: Array, v: Array, band: TileMask, fused: bool = True) -> tuple[Array, Any]:
        """The heads' attention over the keys and values a cache hands it: y (B, H, T, d_head) and lse or
        None."""
        return attend_heads(q, k, v, band, fused)

    def check_cache(self, cache: Any, x: Any) -> Array:
        """x (B, T, d_model) in the module's dtype, once cache is checked to fit this layer (HeadWeights')."""
        return self.weights.check_cache(cache, x)

    # --- training: a forward that keeps what its backward needs, and the backward by hand -----------

    def forward(
        self,
        x: Array,
        *,
        causal: bool = True,
        fused: bool = True,
        window: int | None = None,
        block_mask: Any = None,
        score_mod: Any = None,
    ) -> tuple[Array, MultiheadSaved]:
        """out = self(x, causal=causal, fused=fused), and `saved`: what backward() needs, held by the caller.

        window (needs causal=True): a sliding window of that many keys, as in flash_attention.
        block_mask: a BlockMask for (B or 1, n_heads or 1, T, T) that says which keys each query sees, in
        place of causal and window (pass causal=False with it; put causality in its mask_mod).
        score_mod: flex attention's score_mod (mods.py); for backward() one that gives its derivative.
        Nothing is kept on the module, so two forwards and then two backwards give each its own gradients.
        saved holds its own copies of x and of the weights as they were, so changing either between the
        forward and the backward cannot change the gradients: they are always those of this forward.
        fused=True keeps flash attention's lse and backward() runs its blockwise backward; fused=False
        backward() runs the reference's, which builds the (B, H, T, T) weights again.
        """
        fused = check_bool(fused, "fused")
        x_b, unbatched = self._batched(x)  # (B, T, d_model)
        mask = self._mask(x_b.shape[0], x_b.shape[1], causal, window, block_mask)
        out, saved = multihead_forward(x_b, self.weights, mask=mask, fused=fused, score_mod=check_score_mod(score_mod))
        return (out[0] if unbatched else out), saved._replace(module=self, unbatched=unbatched)

    def _mask(self, batch: int, T: int, causal: Any, window: Any, block_mask: Any) -> TileMask:
        """Which keys each of the T queries sees: the band of causal and window, or a block mask for them."""
        band = check_band(causal, window, T, T)
        if block_mask is None:
            return band
        if band.offset is not None:
            raise ValueError(
                "pass block_mask with causal=False: the block mask says which keys are seen; for causal "
                "documents, make it from and_masks(causal_mod(T), your mask_mod)"
            )
        return check_block_mask(block_mask, QKVShape((batch,), self.n_heads, self.n_kv_heads, T, T, 1, 1))

    def backward(self, dout: Array, saved: MultiheadSaved) -> Any:
        """dx, dw_qkv, dw_out from dout = ∂loss/∂out and the `saved` of the forward that made out; with a
        score_mod that holds learned parameters (mods.Alibi(learned=True), RelativeBias), also their
        gradient, a fourth value shaped like score_mod.params. multihead_backward derives them.
        dx has x's shape; dw_qkv and dw_out have the weights' shapes and dtype.
        """
        if not isinstance(saved, MultiheadSaved) or saved.module is not self:
            raise ValueError(
                "saved must be the second value returned by this module's own forward(); "
                f"got {type(saved).__name__}"
                + (" from another MultiHeadAttention" if isinstance(saved, MultiheadSaved) else "")
            )
        B, T, _ = saved.x.shape
        want = (T, self.d_model) if saved.unbatched else (B, T, self.d_model)
        dout = as_float_array(dout, "dout")
        if dout.shape != want:
            raise ValueError(f"dout must have the forward's output shape {want}; got shape {dout.shape}")
        dout = dout.reshape(B, T, self.d_model).astype(self.w_qkv.dtype, copy=False)  # (B, T, d_model)
        dx, *grads = multihead_backward(dout, saved)
        return (dx.reshape(want), *grads)


@runtime_checkable
class DecodingCache(Protocol):
    """What MultiHeadAttention's cache= takes: a cache that does its own decoding, KVCache (kvcache.py) or
    PagedKVCache (paged.py). attend(layer, x) takes x (B, T, d_model), projects it with layer.split_heads at
    the positions that continue what the cache holds, appends its k and v, and returns the heads' attention
    y (B, H, T, d_head) over everything held."""

    def attend(self, layer: Any, x: Array, *, fused: bool = True, seq_ids: Any = None) -> Array: ...


@runtime_checkable
class DecodingLayer(Protocol):
    """What a cache's attend(layer, x) asks of the layer (MultiHeadAttention, HeadWeights, latent.py's
    LatentHeads and dsa.py's SparseHeads): check_cache(cache, x), x (B, T, d_model) checked and in the layer's
    dtype, once the cache is checked to hold the layer's keys and values; split_heads(x, positions), the
    queries q (B, H, T, E) and the new tokens' k (B, Hkv, T, E) and v (B, Hkv, T, Ev) at those positions;
    attend_heads(q, k, v, band, fused), the heads' attention over the keys and values the cache hands it,
    y (B, H, T, Ev) and lse (B, H, T) or None; softmax_scale, the scale the cache's own kernels (split-KV, the
    pages) use for the scores."""

    @property
    def softmax_scale(self) -> float: ...

    def check_cache(self, cache: Any, x: Any) -> Array: ...

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Array, Array, Array]: ...

    def attend_heads(self, q: Array, k: Array, v: Array, band: TileMask, fused: bool = True) -> tuple[Array, Any]: ...


def check_decoding_layer(layer: Any) -> None:
    """A TypeError unless a cache can decode through layer (a DecodingLayer: check_cache, split_heads,
    attend_heads, softmax_scale)."""
    if not isinstance(layer, DecodingLayer):
        raise TypeError(
            f"layer must be a MultiHeadAttention; got {type(layer).__name__} (a cache decodes through a layer's "
            "check_cache, split_heads and attend_heads: multihead.DecodingLayer)"
        )
