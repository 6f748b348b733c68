"""Multi-head attention with one fused qkv projection, and grouped-query attention (GQA/MQA).

    qkv = x W_qkv                      (B, T, (H + 2·Hkv)·d_head)   one matmul for every head
    q, k, v = split(qkv)               (B, H, T, d_head), (B, Hkv, T, d_head) twice
    y = attention(q, k, v)             (B, H, T, d_head), query head h reads kv head h // (H / Hkv)
    out = concat_heads(y) W_out        (B, T, d_model)

Splitting into heads adds no parameters: it only decides how the d_model channels are grouped.
Training: forward() keeps what backward() needs, and backward() derives every gradient by hand. Decoding
belongs to the caches that come after this file (kvcache.py, paged.py): self(x, cache=c) hands x to
c.attend(self, x), which projects it with split_heads at the positions that continue c and attends through
_attend_heads, the one function here that runs the heads' attention (flash or the reference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from ._backward_kernel import BackwardPlan as _BackwardPlan
from ._backward_kernel import FlexGrads
from ._backward_kernel import flex_backward as _flex_backward
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
from ._guard import refuse_attention as _check_fits
from ._mod_calls import check_score_mod
from ._tiles import TileMask
from .attention import ScoreRules as _ScoreRules
from .attention import attend
from .backward import attention_grads as _attention_flex_grads
from .blockmask import Band, check_band
from .blockmask import check_block_mask as _check_block_mask
from .position import rope as apply_rope
from .position import rope_backward

Array = NDArray[np.floating]

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention:
    """n_heads query heads of d_head = d_model / n_heads, sharing n_kv_heads key/value heads
    (n_kv_heads = n_heads: classic multi-head; 1: multi-query; in between: grouped-query).

    Weights multiply from the right (x @ W, W of shape (in, out): torch's nn.Linear.weight transposed):
        w_qkv (d_model, (n_heads + 2·n_kv_heads)·d_head), columns [q heads | k heads | v heads]
        w_out (d_model, d_model)
    rope=True rotates q and k (never v) by position before the scores.

    Initialisation: every weight uniform in ±1/√d_model, the range torch's nn.Linear draws from.
    rng: a np.random.Generator, or an int seed for np.random.default_rng(seed); None (the default) draws
    fresh weights from a fresh generator, so two modules built without rng differ. Pass rng for repeatable weights.
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
        """(d_model, d_model): the heads' outputs, concatenated, back to the model's width. Checked as w_qkv."""
        return self._w_out

    @w_out.setter
    def w_out(self, w: Any) -> None:
        self._w_out = check_weight(w, "w_out", (self.d_model, self.d_model))

    @property
    def num_parameters(self) -> int:
        """Weights in w_qkv and w_out (no biases)."""
        return int(self.w_qkv.size + self.w_out.size)

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Array, Array, Array]:
        """x (B, T, d_model) -> q (B, H, T, d_head), k and v (B, Hkv, T, d_head), from one matmul.
        positions (T,): the absolute positions RoPE rotates by (default 0 .. T-1)."""
        return self._project(_check_layer_input(self, x), positions, self.w_qkv)

    def _project(self, x: Array, positions: Any, w_qkv: Array) -> tuple[Array, Array, Array]:
        """split_heads on a checked x (B, T, d_model) in the module's dtype, with the weights w_qkv."""
        B, T, _ = x.shape
        qkv = matmul_rows(x, w_qkv)  # (B, T, (H + 2·Hkv)·d_head): all heads' q, k and v at once
        q_end = self.n_heads * self.d_head
        k_end = q_end + self.n_kv_heads * self.d_head
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        # (B, T, heads·d_head) -> (B, T, heads, d_head) -> (B, heads, T, d_head): each head its own problem
        q = q.reshape(B, T, self.n_heads, self.d_head).swapaxes(1, 2)
        k = k.reshape(B, T, self.n_kv_heads, self.d_head).swapaxes(1, 2)
        v = v.reshape(B, T, self.n_kv_heads, self.d_head).swapaxes(1, 2)
        if self.rope:
            # position enters the scores only: v stays as it is
            q, k = apply_rope(q, positions=positions), apply_rope(k, positions=positions)
        return q, k, v

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
        out = matmul_rows(self._merge_heads(y), self.w_out)  # (B, T, d_model)
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

    def _merge_heads(self, y: Array) -> Array:
        """y (B, H, T, d_head) -> (B, T, d_model): glue the heads back, side by side."""
        B, _, T, _ = y.shape
        return y.swapaxes(1, 2).reshape(B, T, self.d_model)

    # --- training: a forward that keeps what its backward needs, and the backward by hand -----------

    def forward(
        self, x: Array, *, causal: bool = True, fused: bool = True, window: int | None = None,
        block_mask: Any = None, score_mod: Any = None,
    ) -> tuple[Array, _Saved]:  # fmt: skip
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
        band = self._mask(x_b.shape[0], x_b.shape[1], causal, window, block_mask)
        score_mod = check_score_mod(score_mod)
        w_qkv, w_out = self.w_qkv.copy(), self.w_out.copy()  # the weights of this forward, whatever comes later
        q, k, v = self._project(x_b, None, w_qkv)  # (B, H, T, d_head), (B, Hkv, T, d_head) twice; rotated if rope
        y, lse = _attend_heads(q, k, v, band, fused, score_mod)  # (B, H, T, d_head), (B, H, T) or None
        out = matmul_rows(self._merge_heads(y), w_out)  # (B, T, d_model)
        saved = _Saved(self, x_b.copy(), w_qkv, w_out, q, k, v, y, lse, band, fused, unbatched, score_mod)
        return (out[0] if unbatched else out), saved

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
        return _check_block_mask(block_mask, QKVShape((batch,), self.n_heads, self.n_kv_heads, T, T, 1, 1))

    def backward(self, dout: Array, saved: _Saved) -> Any:
        """dx, dw_qkv, dw_out from dout = ∂loss/∂out and the `saved` of the forward that made out; with a
        score_mod that holds learned parameters (mods.Alibi(learned=True), RelativeBias), also their
        gradient, a fourth value shaped like score_mod.params.

        The forward's lines, last first, each with its gradient (W multiplies from the right):
            out = Y W_out                 dW_out = Yᵀ dout              dY = dout W_outᵀ
            Y = attention(q, k, v)        dq, dk, dv = (flash_)attention_backward(..., dY)
            q, k = rope(q), rope(k)       dq, dk = rope_backward(dq), rope_backward(dk)
            qkv = x W_qkv                 dW_qkv = xᵀ dqkv              dx = dqkv W_qkvᵀ
        Sums over the batch and tokens are folded into the weight gradients' matmuls.
        dx has x's shape; dw_qkv and dw_out have the weights' shapes and dtype.
        """
        if not isinstance(saved, _Saved) or saved.module is not self:
            raise ValueError(
                "saved must be the second value returned by this module's own forward(); "
                f"got {type(saved).__name__}"
                + (" from another MultiHeadAttention" if isinstance(saved, _Saved) else "")
            )
        x, y = saved.x, saved.y
        B, T, _ = x.shape
        want = (T, self.d_model) if saved.unbatched else (B, T, self.d_model)
        dout = as_float_array(dout, "dout")
        if dout.shape != want:
            raise ValueError(f"dout must have the forward's output shape {want}; got shape {dout.shape}")
        dout = dout.reshape(B, T, self.d_model).astype(self.w_qkv.dtype, copy=False)  # (B, T, d_model)

        # 1) out = Y W_out, with the forward's own W_out
        y_cat = self._merge_heads(y).reshape(B * T, self.d_model)  # (B·T, d_model)
        dw_out = y_cat.T @ dout.reshape(B * T, self.d_model)  # (d_model, d_model)
        dy = matmul_rows(dout, saved.w_out.T)  # (B, T, d_model)
        dy = dy.reshape(B, T, self.n_heads, self.d_head).swapaxes(1, 2)  # (B, H, T, d_head)
        # 2) through the attention, the way the forward went (its band: causal and window, or its block mask)
        dq, dk, dv, dscore_mod, _ = self._attention_grads(saved, dy)
        # 3) through RoPE: the rotation back by -θ
        if self.rope:
            dq, dk = rope_backward(dq), rope_backward(dk)
        # 4) qkv = x W_qkv: the heads' gradients side by side in qkv's column order [q heads | k heads | v heads]
        q_end, k_end = self.n_heads, self.n_heads + self.n_kv_heads
        heads = np.empty((B, T, k_end + self.n_kv_heads, self.d_head), dq.dtype)  # (B, T, H + 2·Hkv, d_head)
        heads[:, :, :q_end], heads[:, :, q_end:k_end], heads[:, :, k_end:] = (g.swapaxes(1, 2) for g in (dq, dk, dv))
        dqkv = heads.reshape(B * T, -1)  # (B·T, (H + 2·Hkv)·d_head)
        dw_qkv = x.reshape(B * T, self.d_model).T @ dqkv  # (d_model, (H + 2·Hkv)·d_head)
        dx = (dqkv @ saved.w_qkv.T).reshape(want)  # x's shape
        return (dx, dw_qkv, dw_out) if dscore_mod is None else (dx, dw_qkv, dw_out, dscore_mod)

    def _attention_grads(self, saved: _Saved, dy: Array) -> FlexGrads:
        """dq, dk, dv (and the score_mod's parameters') of the forward's attention (its kernel, mask, score_mod
        and lse) for dY (B, H, T, d_head)."""
        q, k, v, y, band = saved.q, saved.k, saved.v, saved.y, saved.band
        score_mod = check_score_mod(saved.score_mod, backward=True)
        T = q.shape[2]
        dims = QKVShape(q.shape[:1], self.n_heads, self.n_kv_heads, T, T, self.d_head, self.d_head)
        scale = 1.0 / math.sqrt(self.d_head)
        if saved.fused:
            forward = flash_plan(dims, band, scale)  # its tile sizes and workers, the forward's defaults
            plan = _BackwardPlan(scale, band, forward.block_q, forward.block_k, forward.workers, score_mod)
            return _flex_backward(q, k, v, y, dy, cast(Array, saved.lse), dims, plan)
        ct = np.result_type(q, np.float32)  # float16 is computed in float32
        q_c, k_c, v_c, dy_c = (a.astype(ct, copy=False) for a in (q, k, v, dy))
        grads = _attention_flex_grads(q_c, k_c, v_c, dy_c, dims, scale, reference_rules(band, score_mod))
        return grads._replace(**{name: getattr(grads, name).astype(q.dtype, copy=False) for name in ("dq", "dk", "dv")})


def matmul_rows(x: Array, w: Array) -> Array:
    """x (..., n) @ w (n, m) -> (..., m), as one product of all of x's rows: NumPy multiplies a stack
    (B, T, n) @ (n, m) as B products of T rows each, and one product of B·T rows is faster."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def _attend_heads(
    q: Array, k: Array, v: Array, band: TileMask, fused: bool, score_mod: Any = None
) -> tuple[Array, Array | None]:
    """The attention of the heads a MultiHeadAttention made (their shapes need no check): flash's kernel, which
    also gives lse, or the reference's, behind its memory guard. q (B, H, L, d), k, v (B, Hkv, S, d) ->
    y (B, H, L, d) and lse (B, H, L) (fused) or None. band: a Band or a BlockMask; score_mod: flex attention's,
    or None. The caches attend through it too."""
    dims = QKVShape(q.shape[:1], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    scale = 1.0 / math.sqrt(dims.e)
    if fused:
        return flash_forward(q, k, v, dims, flash_plan(dims, band, scale, score_mod=score_mod))
    rules = reference_rules(band, score_mod)
    _check_fits(dims, q.dtype, rules)
    ct = np.result_type(k, np.float32)  # float16 is computed in float32
    y, _ = attend(q, k.astype(ct, copy=False), v.astype(ct, copy=False), dims, scale, rules)
    return y.astype(q.dtype, copy=False), None


def _check_layer_input(layer: Any, x: Any) -> Array:
    """The door of a layer's projection (MultiHeadAttention.split_heads, a cache's attend): layer a
    MultiHeadAttention, x (B, T, d_model), returned as an array in the layer's dtype."""
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be a MultiHeadAttention; got {type(layer).__name__}")
    x = as_float_array(x, "x")
    if x.ndim != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(f"x must be (B, T, {layer.d_model}); got shape {x.shape}")
    return x.astype(layer.w_qkv.dtype, copy=False)


@runtime_checkable
class DecodingCache(Protocol):
    """What MultiHeadAttention's cache= takes: a cache that does its own decoding, KVCache (kvcache.py) or
    PagedKVCache (paged.py). attend(layer, x) takes x (B, T, d_model), projects it with layer.split_heads at
    the positions that continue what the cache holds, appends its k and v, and returns the heads' attention
    y (B, H, T, d_head) over everything held."""

    def attend(self, layer: MultiHeadAttention, x: Array, *, fused: bool = True, seq_ids: Any = None) -> Array: ...


def reference_rules(band: TileMask, score_mod: Any) -> _ScoreRules:
    """What the reference path hides and changes for a Band or a BlockMask (its mask_mod), and a score_mod."""
    if isinstance(band, Band):
        return _ScoreRules(None, band.offset, band.window, score_mod=score_mod)
    return _ScoreRules(None, None, None, mask_mod=band.mask_mod, score_mod=score_mod)


class _Saved(NamedTuple):
    """What MultiHeadAttention.backward needs from its forward: copies of the input and of the weights as
    they were, the heads' q, k, v (after RoPE) and attention output y (B, H, T, d_head), flash's lse (fused)
    or None, the mask (a Band of causal and window, or a BlockMask), the flags, and the score_mod or None."""

    module: MultiHeadAttention
    x: Array
    w_qkv: Array
    w_out: Array
    q: Array
    k: Array
    v: Array
    y: Array
    lse: Array | None
    band: TileMask
    fused: bool
    unbatched: bool
    score_mod: Any = None

    @property
    def causal(self) -> bool:
        """Whether the forward was causal (a band with a diagonal; a block mask says it in its mask_mod)."""
        return isinstance(self.band, Band) and self.band.offset is not None
