"""DeepSeek Sparse Attention, the layer (DSA): latent attention whose queries read only the keys an indexer chose.

DeepSeek-V3.2 (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp", section 2.1) is DeepSeek-V3's multi-head latent attention
(latent.py) with sparse.py's indexer in front: index_topk chooses each query's keys, sparse_attention reads only
those. The layer, as transformers' DeepseekV32Attention computes it: the indexer reads the query latent c_Q of
latent.py's projections, and x:
    q_I = RoPE(c_Q W_IQ)                       (B, H_I, T, d_I)   RoPE on the first qk_rope_head_dim channels
    k_I = RoPE(LayerNorm(x W_IK))              (B, T, d_I)        one key a token, for every indexer head
    w   = x W_IW · (H_I · d_I)^-1/2            (B, T, H_I)        DeepSeek's H_I^-1/2 and d_I^-1/2, in one
    S_t = index_topk(q_I, k_I, w)              (B, T, topk)       each query's chosen keys
    o   = sparse_attention over S_t            latent.py's attention, naive or absorbed, over the chosen keys
ReLU(c · a) = c · ReLU(a) for c > 0, so the score scale d_I^-1/2 moves out of the ReLU into w. DeepSeek-V3.2
turns the indexer's RoPE in half-split pairs (i, i + d/2), GLM-5's (glm_moe_dsa) in interleaved pairs.
The indexer trains on its own loss, with its inputs detached (the paper's section 2.1.1): the KL divergence
between p_t, the main attention's weights at the chosen keys summed over the heads and L1-normalized, and
softmax(I[t, S_t]), summed over the tokens (SparseLatentAttention.indexer_loss).
Decoding: a cache keeps a token's latent (576 numbers) and its indexer key (128) side by side, one key of
cache_dim = 704 numbers whose first r = 512 are the value (the latent's c_KV): KVCache(B, 1, max_tokens, 704,
value_prefix=512), or a PagedKVCache of one kv head as wide. A step writes its tokens' keys, scores every cached
indexer key, then reads the topk latents it chose (sparse_decode over arrays; through a cache, SparseHeads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, check_positive_int, check_rng
from ._latent_checks import check_indexer_weights, check_latent_cache, check_tokens
from ._paged_kernel import Pages
from ._parallel import cpu_cores
from ._sparse_decode import decode_chosen_pages
from ._sparse_kernel import check_sparse_inputs, heads_summed_weights, indexer_scores_at, indexer_scores_backward
from .kvcache import KVCache
from .latent import Attended, MultiHeadLatentAttention, absorb_query, decompress, join_ukv, split_ukv
from .layers import layer_norm, layer_norm_backward
from .paged import PagedKVCache
from .position import rope, rope_backward
from .sparse import index_topk, sparse_attention, sparse_attention_backward, sparse_decode

__all__ = ["SparseLatentAttention", "SparseSaved"]

Array = NDArray[np.floating]


# ---------------------------------------------------------------------------------------------------
# the layer: latent attention whose queries read the keys an indexer chose

INDEX_NORM_EPS = 1e-6  # DeepseekV32Indexer's LayerNorm on its key


class SparseLatentAttention:
    """DeepSeek-V3.2's attention (DSA): MultiHeadLatentAttention (`mla`, its weights and both forms) whose queries
    read only the index_topk keys an indexer chooses (the module's docstring has the lines).

    The indexer's weights, from the right (x @ W), named after transformers' DeepseekV32Indexer transposed:
        w_index_q (q_lora_rank, H_I·d_I)  wq_b      w_index_k (C, d_I)  wk      w_index_weights (C, H_I)  weights_proj
        index_k_norm, index_k_norm_bias (d_I,)  k_norm, a LayerNorm with a bias
    q_lora_rank is required: the indexer's queries read c_Q. index_rope_interleave: the indexer's RoPE pairs,
    False (i, i + d/2) as DeepSeek-V3.2, True (2i, 2i + 1) as GLM-5; rope_interleave is the attention's (latent.py).
    The other arguments are MultiHeadLatentAttention's.

        >>> dsa = SparseLatentAttention(32, 4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
        ...                             q_lora_rank=6, index_n_heads=2, index_head_dim=4, index_topk=3, rng=0)
        >>> x = np.random.default_rng(1).standard_normal((5, 32))
        >>> out, saved = dsa.forward(x)
        >>> saved.indices[0, -1], bool(np.allclose(out, dsa(x, absorbed=False), atol=1e-6))  # the last query's 3 keys
        (array([1, 2, 3]), True)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        index_rope_interleave: bool = False,
        rope_theta: float = 10000.0,
        rope_interleave: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        rng: np.random.Generator | int | None = None,
        dtype: Any = np.float32,
    ):
        rng = check_rng(rng)
        self.mla = MultiHeadLatentAttention(
            d_model,
            n_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            q_lora_rank=check_positive_int(q_lora_rank, "q_lora_rank"),
            rope_theta=rope_theta,
            rope_interleave=rope_interleave,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            rng=rng,
            dtype=dtype,
        )
        self.index_n_heads = check_positive_int(index_n_heads, "index_n_heads")
        self.index_head_dim = check_positive_int(index_head_dim, "index_head_dim")
        self.index_topk = check_positive_int(index_topk, "index_topk")
        self.index_rope_interleave = check_bool(index_rope_interleave, "index_rope_interleave")
        if self.index_head_dim < self.mla.d_rope:
            raise ValueError(
                f"index_head_dim must be at least qk_rope_head_dim = {self.mla.d_rope} (RoPE turns that "
                f"many of its channels); got {self.index_head_dim}"
            )
        self.dtype = self.mla.dtype
        self.w_index_q, self.w_index_k, self.w_index_weights = (
            self._linear(rng, n_in, n_out)
            for n_in, n_out in (
                (q_lora_rank, self.index_n_heads * self.index_head_dim),
                (d_model, self.index_head_dim),
                (d_model, self.index_n_heads),
            )
        )
        self.index_k_norm = np.ones(self.index_head_dim, self.dtype)
        self.index_k_norm_bias = np.zeros(self.index_head_dim, self.dtype)

    def _linear(self, rng: np.random.Generator, n_in: int, n_out: int) -> Array:
        """uniform(±1/√in): torch's nn.Linear default, as latent.py's weights."""
        return rng.uniform(-1 / math.sqrt(n_in), 1 / math.sqrt(n_in), (n_in, n_out)).astype(self.dtype)

    INDEXER = ("w_index_q", "w_index_k", "index_k_norm", "index_k_norm_bias", "w_index_weights")

    @property
    def parameters(self) -> dict[str, Array]:
        """Every weight by name, the attention's (mla.parameters) then the indexer's: the arrays themselves."""
        return {**self.mla.parameters, **{name: getattr(self, name) for name in self.INDEXER}}

    @property
    def cache_dim(self) -> int:
        """Numbers a cache keeps a token: its latent and its indexer key, kv_lora_rank + qk_rope_head_dim +
        index_head_dim (512 + 64 + 128 = 704 in DeepSeek-V3.2)."""
        return self.mla.latent_dim + self.index_head_dim

    def checked_weights(self) -> dict[str, Array]:
        """`parameters`, each checked against the layer's sizes and dtype before any math."""
        indexer = check_indexer_weights(self, {name: getattr(self, name) for name in self.INDEXER})
        return {**self.mla.checked_weights(), **indexer}

    # --- the forward ------------------------------------------------------------------------------------

    def index(self, x: Array, c_q: Any, positions: NDArray[np.int64], weights: dict[str, Array]) -> Indexed:
        """The indexer's inputs from x (B, T, C) and the query latent c_Q (B, T, q_lora_rank): the module's lines."""
        B, T, _ = x.shape
        H, d = self.index_n_heads, self.index_head_dim
        q = (c_q @ weights["w_index_q"]).reshape(B, T, H, d).swapaxes(1, 2)  # (B, H_I, T, d_I)
        k, k_norm = layer_norm(
            x @ weights["w_index_k"], weights["index_k_norm"], weights["index_k_norm_bias"], INDEX_NORM_EPS
        )  # (B, T, d_I)
        w = (x @ weights["w_index_weights"]) / math.sqrt(H * d)  # (B, T, H_I): H_I^-1/2 and d_I^-1/2
        return Indexed(self._rotate(q, positions), self._rotate(k, positions), w, k_norm)

    def _rotate(self, x: Array, positions: NDArray[np.int64], backward: bool = False) -> Array:
        """RoPE (or its backward) of the first qk_rope_head_dim channels of x (..., T, d_I), the indexer's pairs."""
        d_rope, mla, turn = self.mla.d_rope, self.mla, rope_backward if backward else rope
        first = turn(
            x[..., :d_rope],
            positions=positions,
            base=mla.rope_theta,
            interleaved=self.index_rope_interleave,
            scaling=mla.rope_scaling,
            max_position_embeddings=mla.max_position_embeddings,
        )
        return np.concatenate([first, x[..., d_rope:]], axis=-1)

    def attend(self, proj: Any, indices: NDArray, weights: dict[str, Array], absorbed: bool) -> tuple[Array, Attended]:
        """o (B, H, T, d_v): latent.attend_latent's two forms, with sparse_attention over the chosen keys."""
        H, d_nope, r = self.mla.n_heads, self.mla.d_nope, self.mla.kv_lora_rank
        w_uk, w_uv = split_ukv(weights["w_ukv"], H, d_nope)  # (H, r, d_nope), (H, r, d_v)
        if absorbed:  # one kv head: the latent, its first r numbers the value
            q, k, v = absorb_query(proj.q_nope, proj.q_rope, w_uk), proj.latent, proj.latent[..., :r]
        else:
            q = np.concatenate([proj.q_nope, proj.q_rope], axis=-1)  # (B, H, T, d_nope + d_rope)
            k, v = decompress(proj.latent, weights["w_ukv"], H, d_nope)
        out, lse = sparse_attention(q, k, v, indices, scale=self.mla.softmax_scale, return_lse=True)
        return (out @ w_uv if absorbed else out), Attended(q, k, v, out, lse)

    def _run(self, x: Array, positions: NDArray[np.int64], weights: dict[str, Array], absorbed: bool) -> tuple:
        """The forward of a checked x (B, T, C): out and the pieces SparseSaved keeps."""
        proj = self.mla.project(x, positions, weights)
        indexed = self.index(x, proj.c_q, positions, weights)
        indices = index_topk(indexed.q, indexed.k, indexed.weights, self.index_topk)  # (B, T, topk)
        o, attended = self.attend(proj, indices, weights, absorbed)
        B, _, T, _ = o.shape
        return o.swapaxes(1, 2).reshape(B, T, -1) @ weights["w_o"], proj, indexed, indices, o, attended

    def __call__(
        self,
        x: Array,
        *,
        absorbed: bool = True,
        positions: Any = None,
        cache: KVCache | PagedKVCache | None = None,
        seq_ids: Sequence[int] | None = None,
    ) -> Array:
        """x (B, T, C) or (T, C) -> out, the same shape: causal attention of the T tokens over the keys the indexer
        chose for each. cache: a KVCache(B, 1, max_tokens, cache_dim, dtype, value_prefix=kv_lora_rank) that x
        continues, or a PagedKVCache(num_blocks, block_size, 1, cache_dim, dtype, value_prefix=kv_lora_rank) and
        seq_ids, as MultiHeadLatentAttention takes them: the tokens' latents and indexer keys appended, all or
        nothing, the step in the absorbed form (SparseHeads). A prefill and then one-token steps give what the
        whole sequence at once gives."""
        absorbed = check_bool(absorbed, "absorbed")
        x_b, unbatched = self._batched(x)
        weights = self.checked_weights()
        if cache is None:
            if seq_ids is not None:
                raise ValueError("seq_ids names sequences of a PagedKVCache: pass cache= as well, or no seq_ids")
            out = self._run(x_b, self._positions(positions, x_b.shape[1]), weights, absorbed)[0]
        elif positions is not None or not absorbed:
            raise ValueError(
                "with cache=, positions come from the cache and the form is the absorbed one: pass "
                "positions=None and absorbed=True"
            )
        elif isinstance(cache, (KVCache, PagedKVCache)):  # the cache decodes, as for latent.py's layer
            o_latent = cache.attend(SparseHeads(self), x_b, seq_ids=seq_ids)  # (B, H, T, r); the tokens' keys kept
            o = o_latent @ split_ukv(weights["w_ukv"], self.mla.n_heads, self.mla.d_nope)[1]  # (B, H, T, d_v)
            out = o.swapaxes(1, 2).reshape(*x_b.shape[:2], -1) @ weights["w_o"]  # (B, T, C)
        else:
            raise TypeError(f"cache must be a KVCache, a PagedKVCache or None; got {type(cache).__name__}")
        return out[0] if unbatched else out

    def _batched(self, x: Any) -> tuple[Array, bool]:
        """x (B, T, C) or (T, C), checked, as (B, T, C) in the layer's dtype, and whether it had no batch axis."""
        return check_tokens(x, self.mla.d_model, self.dtype)

    @staticmethod
    def _positions(positions: Any, T: int) -> NDArray[np.int64]:
        """positions (T,) as int64, default 0 .. T-1."""
        positions = np.arange(T) if positions is None else np.asarray(positions)
        if positions.shape != (T,) or positions.dtype.kind not in "iu":
            raise ValueError(
                f"positions must be ({T},) ints, one per token of x; got {positions.dtype} {positions.shape}"
            )
        return positions.astype(np.int64)

    # --- training: the attention's gradient through the chosen keys, and the indexer's own loss -------------

    def forward(self, x: Array, *, absorbed: bool = True, positions: Any = None) -> tuple[Array, SparseSaved]:
        """out = self(x, absorbed=..., positions=...) and what backward() and indexer_loss() need (copies)."""
        absorbed = check_bool(absorbed, "absorbed")
        x_b, unbatched = self._batched(x)
        positions = self._positions(positions, x_b.shape[1])
        weights = {name: w.copy() for name, w in self.checked_weights().items()}
        out, proj, indexed, indices, o, attended = self._run(x_b, positions, weights, absorbed)
        kept = (proj, indexed, indices, o, attended, absorbed, unbatched)
        return (out[0] if unbatched else out), SparseSaved(self, x_b.copy(), positions, weights, *kept)

    def backward(self, dout: Array, saved: SparseSaved) -> tuple[Array, dict[str, Array]]:
        """(dx, grads) from dout = ∂loss/∂out: grads holds the attention's weights (mla.parameters' names), the
        chosen keys held fixed. latent.py's backward, line for line, with sparse_attention_backward for the
        attention; the indexer gets no gradient from this loss (its inputs are detached): indexer_loss trains it."""
        if not isinstance(saved, SparseSaved) or saved.module is not self:
            raise ValueError(f"saved must come from this layer's own forward(); got {type(saved).__name__}")
        B, T, C = saved.x.shape
        want = (T, C) if saved.unbatched else (B, T, C)
        dout = as_float_array(dout, "dout")
        if dout.shape != want:
            raise ValueError(f"dout must have the forward's output shape {want}; got shape {dout.shape}")
        dout = dout.reshape(B * T, C).astype(self.dtype, copy=False)  # (B·T, C)
        grads: dict[str, Array] = {"w_o": saved.o.swapaxes(1, 2).reshape(B * T, -1).T @ dout}  # out = concat(o) W_O
        do = (dout @ saved.weights["w_o"].T).reshape(B, T, self.mla.n_heads, -1).swapaxes(1, 2)  # (B, H, T, d_v)
        dq_nope, dq_rope, dlatent, grads["w_ukv"] = self._attention_backward(do, saved)
        dx, projection_grads = self.mla.projection_backward(dq_nope, dq_rope, dlatent, saved)  # (B, T, C)
        grads.update(projection_grads)
        return dx.reshape(want), {name: grads[name] for name in self.mla.parameters}

    def _attention_backward(self, do: Array, saved: SparseSaved) -> tuple[Array, Array, Array, Array]:
        """do (B, H, T, d_v) back through the attention in the forward's form: dq_nope, dq_rope (rotated),
        dlatent (B, 1, T, r + d_rope), dW_UKV."""
        a, mla, w = saved.attended, self.mla, saved.weights
        r, d_nope, (B, H, T, _) = mla.kv_lora_rank, mla.d_nope, do.shape
        w_uk, w_uv = split_ukv(w["w_ukv"], H, d_nope)
        if saved.absorbed:  # o = o_lat W_UV,h; o_lat = attention over the latent; q_lat = [q_nope W_UK,hᵀ | q_rope]
            dw_uv = (a.out.swapaxes(-1, -2) @ do).sum(axis=0)  # (H, r, d_v)
            dq_lat, dk, dv = sparse_attention_backward(
                a.q, a.k, a.v, saved.indices, a.out, do @ w_uv.swapaxes(-1, -2), a.lse, scale=mla.softmax_scale
            )
            dk[..., :r] += dv  # the latent is the key, and its first r numbers the value
            dw_uk = (dq_lat[..., :r].swapaxes(-1, -2) @ saved.proj.q_nope).sum(axis=0)  # (H, r, d_nope)
            return dq_lat[..., :r] @ w_uk, dq_lat[..., r:], dk, join_ukv(dw_uk, dw_uv)
        dq, dk, dv = sparse_attention_backward(a.q, a.k, a.v, saved.indices, a.out, do, a.lse, scale=mla.softmax_scale)
        dkv = np.concatenate([dk[..., :d_nope], dv], axis=-1).swapaxes(1, 2).reshape(B * T, -1)  # [k_nope | v] = c W
        dc_kv = (dkv @ w["w_ukv"].T).reshape(B, 1, T, r)
        dk_rope = dk[..., d_nope:].sum(axis=1, keepdims=True)  # (B, 1, T, d_rope): one key every head read
        dw_ukv = saved.proj.latent[:, 0, :, :r].reshape(B * T, r).T @ dkv  # (r, H·(d_nope + d_v))
        return dq[..., :d_nope], dq[..., d_nope:], np.concatenate([dc_kv, dk_rope], axis=-1), dw_ukv

    def indexer_loss(self, saved: SparseSaved) -> tuple[float, dict[str, Array]]:
        """DeepSeek-V3.2's indexer loss for the forward that made saved, and its gradient by hand, for the
        indexer's weights only (its inputs are detached; the paper's section 2.1.1):
            p_t = Σ_h P_h[t, S_t] / H       the attention's weights at the chosen keys, summed over the heads and
                                            L1-normalized (each head's sum to 1): held fixed, the target
            q_t = softmax(I[t, S_t])        the indexer's distribution over the same keys
            L   = Σ_t KL(p_t ‖ q_t) = Σ_t Σ_j p_tj (log p_tj - log q_tj),   ∂L/∂I[t, j] = q_tj - p_tj
        then back through I = Σ_h w ReLU(q_I · k_I), the RoPE, the key's LayerNorm and W_IQ, W_IK, W_IW.
        -> (L, grads by the indexer's names)."""
        if not isinstance(saved, SparseSaved) or saved.module is not self:
            raise ValueError(f"saved must come from this layer's own forward(); got {type(saved).__name__}")
        a, ix, chosen = saved.attended, saved.indexer, saved.indices
        target = heads_summed_weights(check_sparse_inputs(a.q, a.k, a.v, chosen, self.mla.softmax_scale), a.lse)
        target /= self.mla.n_heads  # (B, T, n): p_t
        scores, dots = indexer_scores_at(ix.q, ix.k, ix.weights, chosen)  # (B, T, n), -inf at an empty slot
        log_q = scores - np.max(scores, axis=-1, keepdims=True)
        log_q -= np.log(np.exp(log_q).sum(axis=-1, keepdims=True))  # log softmax over the chosen keys
        listed = chosen >= 0
        loss = float(np.sum(target * (np.log(np.where(target > 0, target, 1)) - np.where(listed, log_q, 0))))
        d_scores = np.where(listed, np.exp(log_q) - target, 0)  # (B, T, n)
        dq, dk, d_weights = indexer_scores_backward(d_scores, dots, ix.q, ix.k, ix.weights, chosen)
        return loss, self._indexer_backward(dq, dk, d_weights, saved)

    def _indexer_backward(self, dq: Array, dk: Array, d_weights: Array, saved: SparseSaved) -> dict[str, Array]:
        """dq_I (B, H_I, T, d_I), dk_I (B, T, d_I), dw (B, T, H_I) back through the indexer's lines to its weights."""
        (B, T, C), H, d = saved.x.shape, self.index_n_heads, self.index_head_dim
        x = saved.x.reshape(B * T, C)
        dq = self._rotate(dq, saved.positions, backward=True).swapaxes(1, 2).reshape(B * T, H * d)  # RoPE(c_Q W_IQ)
        k_norm = layer_norm_backward(self._rotate(dk, saved.positions, backward=True), saved.indexer.k_norm)
        return {
            "w_index_q": saved.proj.c_q.reshape(B * T, -1).T @ dq,
            "w_index_k": x.T @ k_norm.dx.reshape(B * T, d),
            "index_k_norm": k_norm.dgain,
            "index_k_norm_bias": k_norm.dbias,
            "w_index_weights": x.T @ d_weights.reshape(B * T, H) / math.sqrt(H * d),
        }


# ---------------------------------------------------------------------------------------------------
# what the forward keeps


class Indexed(NamedTuple):
    """The indexer's inputs to index_topk, and its key's LayerNorm (its backward needs it)."""

    q: Array  # (B, H_I, T, d_I), rotated
    k: Array  # (B, T, d_I), normalised and rotated
    weights: Array  # (B, T, H_I), the scales folded in
    k_norm: Any  # layers.layer_norm's saved of the key


class SparseSaved(NamedTuple):
    """What SparseLatentAttention.backward and indexer_loss need from the forward: copies of x (B, T, C) and of
    the weights, the positions, the projections (latent.MultiHeadLatentAttention.project), the indexer's inputs,
    the chosen keys (B, T, topk), the heads' o (B, H, T, d_v), what the attention saw, and the flags."""

    module: SparseLatentAttention
    x: Array
    positions: NDArray[np.int64]
    weights: dict[str, Array]
    proj: Any
    indexer: Indexed
    indices: NDArray[np.int64]
    o: Array
    attended: Any
    absorbed: bool
    unbatched: bool


# ---------------------------------------------------------------------------------------------------
# decoding through a cache: the layer as KVCache.attend and PagedKVCache.attend see it


class SparseQueries(NamedTuple):
    """A step's queries (SparseHeads.split_heads), the batch first: the attention's and the indexer's."""

    latent: Array  # (B, H, T, r + d_rope): the absorbed form's [q_nope W_UK,hᵀ | q_rope]
    q_index: Array  # (B, H_I, T, d_I), rotated
    weights: Array  # (B, T, H_I), the scales folded in


class SparseHeads(NamedTuple):
    """A SparseLatentAttention as a cache's attend sees it: a multihead.DecodingLayer whose queries choose the keys
    they read (_paged_kernel.ChoosingLayer). A token's key is its latent and its indexer key side by side,
    [c_KV | k_rope | k_I] (cache_dim numbers), and its value the first kv_lora_rank: a KVCache or a PagedKVCache
    of one kv head stores each once. The cache writes the new tokens' keys, then asks attend_pages to read it."""

    layer: SparseLatentAttention

    @property
    def softmax_scale(self) -> float:
        return self.layer.mla.softmax_scale

    def check_cache(self, cache: Any, x: Any) -> Array:
        """x (B, T, C) in the layer's dtype, once the cache is checked to hold this layer's keys: one kv head of
        cache_dim numbers, the values their first kv_lora_rank (a KVCache of B rows, no window)."""
        x, _ = self.layer._batched(x)
        check_latent_cache(self.layer.mla, cache, len(x), index_head_dim=self.layer.index_head_dim)
        return x

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Any, Array, Array]:
        """x (B, T, C) at positions (T,) -> the queries, the keys [latent | k_I] (B, 1, T, cache_dim), and the
        values, the keys' first kv_lora_rank numbers (a view)."""
        layer, mla, weights = self.layer, self.layer.mla, self.layer.checked_weights()
        positions = layer._positions(positions, x.shape[1])
        proj = mla.project(x, positions, weights)
        indexed = layer.index(x, proj.c_q, positions, weights)
        q = absorb_query(proj.q_nope, proj.q_rope, split_ukv(weights["w_ukv"], mla.n_heads, mla.d_nope)[0])
        keys = np.concatenate([proj.latent, indexed.k[:, None]], axis=-1)  # (B, 1, T, latent_dim + d_I)
        return SparseQueries(q, indexed.q, indexed.weights), keys, keys[..., : mla.kv_lora_rank]

    def attend_pages(self, q: Any, pages: Pages) -> Array:
        """Each sequence's T new tokens (its last T, already written) over every token it holds, where they lie:
            chosen = index_topk(q_I, its indexer keys, w)          every cached k_I scored, a block of pages at a time
            o_lat  = sparse_attention(q_lat, its latents, chosen)  the chosen latents gathered through its table
        -> o_lat (B, H, T, kv_lora_rank): sparse_decode's step, no sequence copied (_sparse_decode.py)."""
        mla = self.layer.mla
        o_latent, _ = decode_chosen_pages(
            q.latent,
            q.q_index,
            q.weights,
            pages,
            self.layer.index_topk,
            latent_dim=mla.latent_dim,
            value_dim=mla.kv_lora_rank,
            scale=mla.softmax_scale,
            workers=cpu_cores(),
        )
        return o_latent

    def attend_heads(self, q: Any, k: Array, v: Array, band: Any, fused: bool = True) -> tuple[Array, Any]:
        """The step over keys laid out as arrays: k (B, 1, S, cache_dim), the T new tokens the last T (band: causal,
        bottom-right), through sparse_decode -> o_lat (B, H, T, kv_lora_rank), and no lse."""
        mla, S = self.layer.mla, k.shape[2]
        o_latent, _ = sparse_decode(
            q.latent,
            q.q_index,
            q.weights,
            k[:, 0, :, : mla.latent_dim],
            k[:, 0, :, mla.latent_dim :],
            np.full(len(k), S),
            self.layer.index_topk,
            value_dim=mla.kv_lora_rank,
            scale=mla.softmax_scale,
        )
        return o_latent, None
