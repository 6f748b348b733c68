"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention, whose cache holds one small latent a token.

Basics

Multi-head attention caches every head's key and value. MLA (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1;
DeepSeek-V3 keeps it) caches one compressed vector c_KV of r = kv_lora_rank numbers and one RoPE key of
d_rope numbers that every head shares, and rebuilds the heads' keys and values from c_KV. With x (B, T, C),
H heads, and weights from the right (x @ W, W of shape (in, out)), as DeepSeek-V3 computes it:

    c_Q               = RMSNorm(x W_DQ)             (B, T, q_lora_rank)       q_lora_rank None: q = x W_Q
    [q_nope | q_rope] = c_Q W_UQ                    (B, H, T, d_nope), (B, H, T, d_rope)   per head
    [c_KV | k_rope]   = x W_DKV                     (B, T, r), (B, T, d_rope)
    c_KV              = RMSNorm(c_KV)               (B, T, r)                 the cache keeps c_KV and k_rope
    q_rope, k_rope    = RoPE(q_rope), RoPE(k_rope)  k_rope (B, 1, T, d_rope): one key for every head
    [k_nope | v]      = c_KV W_UKV                  (B, H, T, d_nope), (B, H, T, d_v)      per head
    o                 = attention([q_nope | q_rope], [k_nope | k_rope], v)  causal, scale 1/√(d_nope + d_rope)
    out               = concat_heads(o) W_O         (B, T, C)

The RoPE part is decoupled: position rides on d_rope channels of its own, because a rotation between q_nope
and W_UK would depend on the token's position and W_UK could no longer be moved, as it is next.

The naive form computes those lines. The absorbed form never builds k_nope or v. Per head h, W_UK,h (r, d_nope)
and W_UV,h (r, d_v) are its columns of W_UKV; for a query t and a key s, a line per step:

    q_nope,t · k_nope,s = q_nope,t · (c_s W_UK,h)                    k_nope,s = c_s W_UK,h
                        = (q_nope,t W_UK,hᵀ) · c_s                   a · (c W) = (a Wᵀ) · c: W moves to the query
    score(t, s) / scale = [q_nope,t W_UK,hᵀ | q_rope,t] · [c_s | k_rope,s]       one dot product of r + d_rope
    o_h,t = Σ_s p_ts v_s = Σ_s p_ts (c_s W_UV,h)                     v_s = c_s W_UV,h
                         = (Σ_s p_ts c_s) W_UV,h                     a sum of products is the product of the sum

The scores, so the weights p_ts, are the same numbers, and the scale stays 1/√(d_nope + d_rope). So the absorbed
form is multi-query attention: the queries q_lat = [q_nope W_UKᵀ | q_rope] (B, H, T, r + d_rope), one kv head
whose key is the cached [c_KV | k_rope] and whose value is c_KV, the key's first r numbers (a view of it: stored
once); then o = o_lat W_UV, head by head.

What a decode step costs per cached token, in reads and FLOPs, form by form (DeepSeek-V3's sizes): the absorbed
step reads 71x fewer bytes and does 3.4x the FLOPs, so it is bound by arithmetic where the naive one is bound by
reading its cache (docs/latent.md works it out; scripts/mla.py measures both). Prefill, where the queries are
many, is where the naive form belongs.

Details

The caches: a KVCache(B, 1, max_tokens, r + d_rope, value_prefix=r) or a PagedKVCache(num_blocks, block_size,
1, r + d_rope, value_prefix=r) holds the latent as one "head" of r + d_rope numbers whose values are its first
r: the cache stores the latent once (r + d_rope numbers a token, 576 in DeepSeek-V3), and a decode step reads
it once, the values a view of the keys. The layer decodes through the cache as MultiHeadAttention does
(cache.attend): LatentHeads is the layer as the cache sees it, multi-query attention over the latent (absorbed)
or the heads decompressed from it (naive).
The softmax scale is 1/√(d_nope + d_rope), times mscale² when the config scales RoPE with mscale_all_dim
(mscale = 0.1 · mscale_all_dim · ln(factor) + 1, DeepSeek's YaRN, as transformers' DeepseekV3Attention).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_bool, check_positive_int, check_rng
from ._latent_checks import check_latent, check_latent_cache, check_latent_weights, check_tokens
from ._tiles import TileMask
from .backward import flash_attention_backward
from .flash import flash_attention
from .kvcache import KVCache
from .layers import rms_norm, rms_norm_backward
from .paged import PagedKVCache
from .position import rope, rope_backward, rope_frequencies
from .splitkv import flash_decode

__all__ = [
    "RMS_EPS",
    "Attended",
    "LatentSaved",
    "MultiHeadLatentAttention",
    "absorb_query",
    "attend_latent",
    "decompress",
    "join_ukv",
    "latent_softmax_scale",
    "split_ukv",
]

Array = NDArray[np.floating]

RMS_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its attention's two norms use


# ---------------------------------------------------------------------------------------------------
# the two forms, then their pieces: the up-projection's two halves, the two norms


def attend_latent(
    q_nope: Array, q_rope: Array, latent: Array, w_ukv: Array, *, scale: float | None = None, absorbed: bool = True
) -> tuple[Array, Attended]:
    """Causal attention (bottom-right: the L queries are the last L of the S tokens) of the heads' queries over
    the latent cache, in either form; o (B, H, L, d_v) and what the attention saw.

    q_nope (B, H, L, d_nope), q_rope (B, H, L, d_rope) rotated; latent (B, 1, S, r + d_rope) = [c_KV | k_rope]
    rotated; W_UKV (r, H·(d_nope + d_v)). scale: default 1/√(d_nope + d_rope). absorbed=True: multi-query
    attention of q_lat over the latent, the values a view of its first r numbers, then W_UV; absorbed=False:
    the heads' k and v decompressed. One query (L = 1) is a decode step: flash_decode, the keys split over the
    cores; more: flash_attention.
    """
    q_nope, q_rope, latent, w_ukv, scale = check_latent(q_nope, q_rope, latent, w_ukv, scale)
    n_heads, d_nope, r = q_nope.shape[1], q_nope.shape[-1], w_ukv.shape[0]
    w_uk, w_uv = split_ukv(w_ukv, n_heads, d_nope)  # (H, r, d_nope), (H, r, d_v)
    if check_bool(absorbed, "absorbed"):
        q = absorb_query(q_nope, q_rope, w_uk)  # (B, H, L, r + d_rope)
        k, v = latent, latent[..., :r]  # (B, 1, S, r + d_rope), (B, 1, S, r): the value is the key's first r
    else:
        q = np.concatenate([q_nope, q_rope], axis=-1)  # (B, H, L, d_nope + d_rope)
        k, v = decompress(latent, w_ukv, n_heads, d_nope)  # (B, H, S, d_nope + d_rope), (B, H, S, d_v)
    out, lse = causal_attention(q, k, v, scale)  # (B, H, L, r or d_v), (B, H, L)
    o = out @ w_uv if absorbed else out  # (B, H, L, r) @ (H, r, d_v) -> (B, H, L, d_v)
    return o, Attended(q, k, v, out, lse)


def causal_attention(q: Array, k: Array, v: Array, scale: float) -> tuple[Array, Array]:
    """The attention of either form and its lse, causal (bottom-right: the L queries are the last L of the S
    keys): one query (L = 1) is a decode step, flash_decode, the keys split over the cores; more: flash_attention."""
    if q.shape[2] == 1:  # the newest token sees every key: split-KV decoding
        return cast(tuple[Array, Array], flash_decode(q, k, v, scale=scale, return_lse=True))
    return cast(tuple[Array, Array], flash_attention(q, k, v, causal=True, scale=scale, return_lse=True))


class Attended(NamedTuple):
    """What the attention of attend_latent saw and gave: its q, k, v, out and lse (its backward needs them)."""

    q: Array
    k: Array
    v: Array
    out: Array
    lse: Array


def _norm(x: Array, gain: Array) -> Array:
    """The attention's two RMSNorms (layers.rms_norm) at DeepSeek-V3's eps. x (..., n), gain (n,)."""
    return rms_norm(x, gain, RMS_EPS)[0]


def _norm_backward(dy: Array, x: Array, gain: Array) -> tuple[Array, Array]:
    """(dx, dgain) of _norm(x, gain) for dy (x's shape): layers.rms_norm_backward on the forward's saved x̂."""
    grads = rms_norm_backward(dy, rms_norm(x, gain, RMS_EPS)[1])
    return grads.dx, grads.dgain


def split_ukv(w_ukv: Array, n_heads: int, d_nope: int) -> tuple[Array, Array]:
    """W_UKV (r, H·(d_nope + d_v)), each head's columns [k_nope | v], as W_UK (H, r, d_nope) and W_UV (H, r, d_v):
    views, no copy."""
    r = w_ukv.shape[0]
    per_head = w_ukv.reshape(r, n_heads, -1).transpose(1, 0, 2)  # (H, r, d_nope + d_v)
    return per_head[..., :d_nope], per_head[..., d_nope:]


def decompress(latent: Array, w_ukv: Array, n_heads: int, d_nope: int) -> tuple[Array, Array]:
    """The naive form's keys and values: latent (B, 1, S, r + d_rope) -> k (B, H, S, d_nope + d_rope), v (B, H, S, d_v).

    [k_nope | v] = c_KV W_UKV per head; every head's key ends with the one shared k_rope."""
    B, _, S, _ = latent.shape
    r = w_ukv.shape[0]
    kv = (latent[:, 0, :, :r] @ w_ukv).reshape(B, S, n_heads, -1).swapaxes(1, 2)  # (B, H, S, d_nope + d_v)
    k_rope = np.broadcast_to(latent[..., r:], (B, n_heads, S, latent.shape[-1] - r))  # (B, H, S, d_rope)
    return np.concatenate([kv[..., :d_nope], k_rope], axis=-1), kv[..., d_nope:]


def absorb_query(q_nope: Array, q_rope: Array, w_uk: Array) -> Array:
    """The absorbed form's queries: q_lat = [q_nope W_UK,hᵀ | q_rope] per head h.
    q_nope (B, H, L, d_nope), q_rope (B, H, L, d_rope), W_UK (H, r, d_nope) -> (B, H, L, r + d_rope)."""
    q_latent = q_nope @ w_uk.swapaxes(-1, -2)  # (B, H, L, d_nope) @ (H, d_nope, r) -> (B, H, L, r)
    return np.concatenate([q_latent, q_rope.astype(q_latent.dtype, copy=False)], axis=-1)


def latent_softmax_scale(
    qk_head_dim: int, rope_scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None
) -> float:
    """1/√(d_nope + d_rope), times mscale² where the config scales RoPE and gives mscale_all_dim:

        mscale = 0.1 · mscale_all_dim · ln(factor) + 1      (1 where factor <= 1)

    (DeepSeek-V2's YaRN; transformers' yarn_apply_mscale). factor: the dict's, else max_position_embeddings /
    original_max_position_embeddings. RoPE's own attention factor (rope_attention_factor) multiplies q_rope and
    k_rope apart from this; with mscale = mscale_all_dim, as DeepSeek's configs have it, that factor is 1.
    """
    scale = 1.0 / math.sqrt(qk_head_dim)
    if rope_scaling is None or rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        return scale
    mscale_all_dim = rope_scaling.get("mscale_all_dim")
    if not mscale_all_dim:
        return scale
    factor = rope_scaling.get("factor")
    if factor is None:  # rope_frequencies has checked that the config gives what stands in for it
        factor = (max_position_embeddings or 0) / rope_scaling["original_max_position_embeddings"]
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


# ---------------------------------------------------------------------------------------------------
# the layer


class Projected(NamedTuple):
    """The projections of x: what the attention takes, and what the backward needs on the way back."""

    c_q_raw: Array | None  # (B, T, q_lora_rank) before its norm; None without a query latent
    c_q: Array | None  # (B, T, q_lora_rank) after it
    q_nope: Array  # (B, H, T, d_nope)
    q_rope: Array  # (B, H, T, d_rope), rotated
    c_kv_raw: Array  # (B, T, r) before its norm
    latent: Array  # (B, 1, T, r + d_rope): [RMSNorm(c_KV) | RoPE(k_rope)], what the cache keeps


class MultiHeadLatentAttention:
    """DeepSeek-V3's attention layer, n_heads heads over a latent of kv_lora_rank numbers (see the module's
    docstring for the lines it computes and the two forms).

    Weights multiply from the right (x @ W; torch's nn.Linear.weight transposed), named after the paper:
        w_dq (C, q_lora_rank), q_norm (q_lora_rank,), w_uq (q_lora_rank, H·(d_nope + d_rope)),
            or, with q_lora_rank=None, w_q (C, H·(d_nope + d_rope)); each head's columns [q_nope | q_rope]
        w_dkv (C, r + d_rope), columns [c_KV | k_rope];  kv_norm (r,)
        w_ukv (r, H·(d_nope + d_v)), each head's columns [k_nope | v];  w_o (H·d_v, C)
    which are transformers' q_a_proj, q_a_layernorm, q_b_proj (q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj and o_proj. No biases (DeepSeek-V3 has none). The norms' gains start at 1, the matrices uniform
    in ±1/√in (torch's nn.Linear). rope_theta, rope_interleave (pairs (2i, 2i+1), DeepSeek's; False: (i, i +
    d/2)), rope_scaling and max_position_embeddings are the config's, as rope() takes them. dtype: float32 or
    float64, the weights' and the computation's.

        >>> mla = MultiHeadLatentAttention(32, 4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
        ...                                v_head_dim=4, rng=0)
        >>> x = np.random.default_rng(1).standard_normal((5, 32))
        >>> bool(np.allclose(mla(x), mla(x, absorbed=False), atol=1e-6)), mla.latent_dim
        (True, 10)
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
        q_lora_rank: int | None = None,
        rope_theta: float = 10000.0,
        rope_interleave: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        rng: np.random.Generator | int | None = None,
        dtype: Any = np.float32,
    ):
        self.d_model, self.n_heads = check_positive_int(d_model, "d_model"), check_positive_int(n_heads, "n_heads")
        self.kv_lora_rank = check_positive_int(kv_lora_rank, "kv_lora_rank")
        self.q_lora_rank = None if q_lora_rank is None else check_positive_int(q_lora_rank, "q_lora_rank")
        self.d_nope = check_positive_int(qk_nope_head_dim, "qk_nope_head_dim")
        self.d_rope = check_positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        self.d_v = check_positive_int(v_head_dim, "v_head_dim")
        self.rope_interleave = check_bool(rope_interleave, "rope_interleave")
        # every field of rope_scaling checked now, against the rotated width: rope_frequencies raises what is wrong
        rope_frequencies(self.d_rope, rope_theta, scaling=rope_scaling, max_position_embeddings=max_position_embeddings)
        self.rope_theta, self.rope_scaling, self.max_position_embeddings = (
            rope_theta,
            rope_scaling,
            max_position_embeddings,
        )
        self.softmax_scale = latent_softmax_scale(self.d_nope + self.d_rope, rope_scaling, max_position_embeddings)
        if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype must be float32 or float64; got {np.dtype(dtype)}")
        self.dtype = np.dtype(dtype)
        self._init_weights(check_rng(rng))

    def _init_weights(self, rng: np.random.Generator) -> None:
        def linear(n_in: int, n_out: int) -> Array:  # uniform(±1/√in): torch's nn.Linear default
            return rng.uniform(-1 / math.sqrt(n_in), 1 / math.sqrt(n_in), (n_in, n_out)).astype(self.dtype)

        C, H, r, qk = self.d_model, self.n_heads, self.kv_lora_rank, self.d_nope + self.d_rope
        if self.q_lora_rank is None:
            self.w_q = linear(C, H * qk)
        else:
            self.w_dq = linear(C, self.q_lora_rank)
            self.q_norm = np.ones(self.q_lora_rank, self.dtype)
            self.w_uq = linear(self.q_lora_rank, H * qk)
        self.w_dkv = linear(C, r + self.d_rope)
        self.kv_norm = np.ones(r, self.dtype)
        self.w_ukv = linear(r, H * (self.d_nope + self.d_v))
        self.w_o = linear(H * self.d_v, C)

    @property
    def parameters(self) -> dict[str, Array]:
        """Every weight by name, in the order of the forward: the arrays themselves (no copies)."""
        names = ["w_q"] if self.q_lora_rank is None else ["w_dq", "q_norm", "w_uq"]
        return {name: getattr(self, name) for name in [*names, "w_dkv", "kv_norm", "w_ukv", "w_o"]}

    @property
    def num_parameters(self) -> int:
        return sum(int(w.size) for w in self.parameters.values())

    @property
    def latent_dim(self) -> int:
        """Numbers the cache keeps a token: kv_lora_rank + qk_rope_head_dim (576 in DeepSeek-V3)."""
        return self.kv_lora_rank + self.d_rope

    def checked_weights(self) -> dict[str, Array]:
        """`parameters`, each checked against the layer's sizes first: a weight replaced by an array of another
        shape (a latent rank that does not match the others) or dtype is refused before any math."""
        return check_latent_weights(self, self.parameters)

    def __repr__(self) -> str:
        return (
            f"MultiHeadLatentAttention(d_model={self.d_model}, n_heads={self.n_heads}, kv_lora_rank="
            f"{self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}, qk_nope_head_dim={self.d_nope}, qk_rope_head_dim="
            f"{self.d_rope}, v_head_dim={self.d_v}, dtype={self.dtype.name}, parameters={self.num_parameters:,})"
        )

    # --- the forward ------------------------------------------------------------------------------------

    def _rope(self, x: Array, positions: NDArray[np.int64], backward: bool = False) -> Array:
        """RoPE (or its backward) of x (..., T, d_rope) at positions (T,), with the config's base, layout, scaling."""
        turn = rope_backward if backward else rope
        return turn(
            x,
            positions=positions,
            base=self.rope_theta,
            interleaved=self.rope_interleave,
            scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def project(self, x: Array, positions: NDArray[np.int64], weights: dict[str, Array]) -> Projected:
        """The projections of a checked x (B, T, C), its tokens at positions (T,): the first five lines of the
        module's docstring, with these weights."""
        B, T, _ = x.shape
        c_q_raw = c_q = None
        if self.q_lora_rank is None:
            q = x @ weights["w_q"]  # (B, T, H·(d_nope + d_rope))
        else:
            c_q_raw = x @ weights["w_dq"]  # (B, T, q_lora_rank)
            c_q = _norm(c_q_raw, weights["q_norm"])
            q = c_q @ weights["w_uq"]  # (B, T, H·(d_nope + d_rope))
        q = q.reshape(B, T, self.n_heads, -1).swapaxes(1, 2)  # (B, H, T, d_nope + d_rope)
        q_rope = self._rope(q[..., self.d_nope :], positions)  # (B, H, T, d_rope)
        c_kv_raw, k_rope = np.split(x @ weights["w_dkv"], [self.kv_lora_rank], axis=-1)  # (B, T, r), (B, T, d_rope)
        c_kv = _norm(c_kv_raw, weights["kv_norm"])  # (B, T, r)
        latent = np.concatenate([c_kv, self._rope(k_rope, positions)], axis=-1)[:, None]  # (B, 1, T, r + d_rope)
        return Projected(c_q_raw, c_q, q[..., : self.d_nope], q_rope, c_kv_raw, latent)

    def _batched(self, x: Any, name: str = "x") -> tuple[Array, bool]:
        """x (B, T, C) or (T, C), checked, as (B, T, C) in the layer's dtype, and whether it had no batch axis."""
        return check_tokens(x, self.d_model, self.dtype, name)

    def _positions(self, positions: Any, T: int) -> NDArray[np.int64]:
        """positions (T,) as int64, default 0 .. T-1: each token's own position, which RoPE turns it by."""
        if positions is None:
            return np.arange(T)
        positions = np.asarray(positions)
        if not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"positions must be ints, one per token; got dtype {positions.dtype}")
        if positions.shape != (T,):
            raise ValueError(f"positions must be ({T},), one per token of x; got shape {positions.shape}")
        return positions.astype(np.int64)

    def _output(self, o: Array, w_o: Array) -> Array:
        """o (B, H, T, d_v) -> concat_heads(o) W_O (B, T, C)."""
        B, _, T, _ = o.shape
        return o.swapaxes(1, 2).reshape(B, T, -1) @ w_o

    def __call__(
        self,
        x: Array,
        *,
        absorbed: bool = True,
        positions: Any = None,
        cache: KVCache | PagedKVCache | None = None,
        seq_ids: Sequence[int] | None = None,
    ) -> Array:
        """x (B, T, C) or (T, C) -> out of the same shape: causal attention of the T tokens.

        absorbed: the absorbed form (True) or the naive one; the same numbers to rounding.
        positions: (T,) ints, the tokens' positions for RoPE (default 0 .. T-1); not with a cache.
        cache: a KVCache(B, 1, max_tokens, latent_dim, dtype, value_prefix=kv_lora_rank) that x continues: its
        tokens sit at positions len(cache) onwards, their latents are appended, and they attend to everything
        the cache holds. Or a PagedKVCache(num_blocks, block_size, 1, latent_dim, dtype, value_prefix=kv_lora_rank)
        and seq_ids, the B sequences that the rows of x continue, each at its own length (the B appends are all
        or nothing). A prefill and then one-token steps give what the whole sequence at once gives. A cache of
        another width, value_prefix or dtype, or a full one, is refused before anything changes.
        """
        absorbed = check_bool(absorbed, "absorbed")
        x_b, unbatched = self._batched(x)  # (B, T, C)
        self.checked_weights()
        if cache is None:
            if seq_ids is not None:
                raise ValueError("seq_ids names sequences of a PagedKVCache: pass cache= as well, or no seq_ids")
            proj = self.project(x_b, self._positions(positions, x_b.shape[1]), self.parameters)
            scale = self.softmax_scale
            o, _ = attend_latent(proj.q_nope, proj.q_rope, proj.latent, self.w_ukv, scale=scale, absorbed=absorbed)
        elif positions is not None:
            raise ValueError("positions come from the cache (its length onwards): pass positions=None with cache=")
        elif isinstance(cache, (KVCache, PagedKVCache)):  # the cache decodes, as for MultiHeadAttention
            y = cache.attend(LatentHeads(self, absorbed), x_b, fused=absorbed, seq_ids=seq_ids)  # latents appended
            o = y @ split_ukv(self.w_ukv, self.n_heads, self.d_nope)[1] if absorbed else y  # (B, H, T, d_v)
        else:
            raise TypeError(f"cache must be a KVCache, a PagedKVCache or None; got {type(cache).__name__}")
        out = self._output(o, self.w_o)  # (B, T, C)
        return out[0] if unbatched else out

    # --- training: a forward that keeps what its backward needs, and the backward by hand -------------------

    def forward(self, x: Array, *, absorbed: bool = True, positions: Any = None) -> tuple[Array, LatentSaved]:
        """out = self(x, absorbed=absorbed, positions=positions), and `saved`: what backward() needs, held by the
        caller (copies of x and of the weights as they were: changing either later cannot change the gradients)."""
        absorbed = check_bool(absorbed, "absorbed")
        x_b, unbatched = self._batched(x)  # (B, T, C)
        positions = self._positions(positions, x_b.shape[1])
        weights = {name: w.copy() for name, w in self.checked_weights().items()}  # this forward's, whatever comes later
        proj = self.project(x_b, positions, weights)
        o, attended = attend_latent(
            proj.q_nope, proj.q_rope, proj.latent, weights["w_ukv"], scale=self.softmax_scale, absorbed=absorbed
        )
        out = self._output(o, weights["w_o"])  # (B, T, C)
        saved = LatentSaved(self, x_b.copy(), positions, weights, proj, o, attended, absorbed, unbatched)
        return (out[0] if unbatched else out), saved

    def backward(self, dout: Array, saved: LatentSaved) -> tuple[Array, dict[str, Array]]:
        """(dx, grads) from dout = ∂loss/∂out and the `saved` of the forward that made out: dx shaped like x,
        grads a dict of every weight's gradient by name (as `parameters`), in the weights' shapes and dtype.

        The forward's lines, last first, each with its gradient (W from the right; sums over the batch and
        the tokens folded into the weights' matmuls):
            out = concat_heads(o) W_O      dW_O = oᵀ dout                do = dout W_Oᵀ
            absorbed: o = o_lat W_UV,h     dW_UV,h = o_latᵀ do           do_lat = do W_UV,hᵀ
                o_lat = attention(q_lat, [c | k_rope], c)                flash_attention_backward, one kv head:
                                           dlatent = dK, and dV added to its first r numbers (the value is c)
                q_lat = [q_nope W_UK,hᵀ | q_rope]    dW_UK,h = dq_latᵀ q_nope      dq_nope = dq_lat W_UK,h
            naive: o = attention([q_nope | q_rope], [k_nope | k_rope], v)   flash_attention_backward, H heads;
                k_rope is every head's: dk_rope = Σ_h dk_rope,h;  [k_nope | v] = c W_UKV: dW_UKV = cᵀ d[k_nope | v]
            q_rope, k_rope = RoPE(·)       the rotation back by −θ (rope_backward)
            c_KV = RMSNorm(c_KV_raw), c_Q = RMSNorm(c_Q_raw)             rms_norm_backward
            [c_KV_raw | k_rope] = x W_DKV, q = c_Q W_UQ, c_Q_raw = x W_DQ
                                           each y = u W: dW = uᵀ dy, du = dy Wᵀ
        dx sums what reaches x through the query path and through the latent path.
        """
        if not isinstance(saved, LatentSaved) or saved.module is not self:
            raise ValueError(
                "saved must be the second value returned by this layer's own forward(); got "
                f"{type(saved).__name__}" + (" from another layer" if isinstance(saved, LatentSaved) else "")
            )
        B, T, C = saved.x.shape
        want = (T, C) if saved.unbatched else (B, T, C)
        dout = as_float_array(dout, "dout")
        if dout.shape != want:
            raise ValueError(f"dout must have the forward's output shape {want}; got shape {dout.shape}")
        dout = dout.reshape(B * T, C).astype(self.dtype, copy=False)  # (B·T, C)
        # 1) out = concat_heads(o) W_O
        grads: dict[str, Array] = {"w_o": saved.o.swapaxes(1, 2).reshape(B * T, -1).T @ dout}  # (H·d_v, C)
        do = (dout @ saved.weights["w_o"].T).reshape(B, T, self.n_heads, self.d_v).swapaxes(1, 2)  # (B, H, T, d_v)
        # 2) through the attention in the forward's form, to q_nope, q_rope and the latent
        attention_backward = self._absorbed_backward if saved.absorbed else self._naive_backward
        dq_nope, dq_rope, dlatent, grads["w_ukv"] = attention_backward(do, saved)
        # 3) through RoPE, the norms and the down- and up-projections, to x
        dx, projection_grads = self.projection_backward(dq_nope, dq_rope, dlatent, saved)
        grads.update(projection_grads)
        return dx.reshape(want), {name: grads[name] for name in self.parameters}

    def _absorbed_backward(self, do: Array, saved: LatentSaved) -> tuple[Array, Array, Array, Array]:
        """do (B, H, T, d_v) back through W_UV, the multi-query attention over the latent and the absorbed query:
        dq_nope, dq_rope (rotated), dlatent (B, 1, T, r + d_rope), dW_UKV."""
        a, r = saved.attended, self.kv_lora_rank
        w_uk, w_uv = split_ukv(saved.weights["w_ukv"], self.n_heads, self.d_nope)  # (H, r, d_nope), (H, r, d_v)
        # o = o_lat W_UV,h, head by head
        dw_uv = (a.out.swapaxes(-1, -2) @ do).sum(axis=0)  # (H, r, d_v): summed over the batch
        do_lat = do @ w_uv.swapaxes(-1, -2)  # (B, H, T, r)
        # o_lat = attention(q_lat, K = latent, V = its first r numbers): one kv head, E = r + d_rope, Ev = r
        scale = self.softmax_scale
        dq_lat, dk, dv = flash_attention_backward(a.q, a.k, a.v, a.out, do_lat, a.lse, causal=True, scale=scale)
        dlatent = dk.copy()  # (B, 1, T, r + d_rope): the latent is the key ...
        dlatent[..., :r] += dv  # ... and its first r numbers the value too
        # q_lat = [q_nope W_UK,hᵀ | q_rope]
        dw_uk = (dq_lat[..., :r].swapaxes(-1, -2) @ saved.proj.q_nope).sum(axis=0)  # (H, r, d_nope)
        dq_nope = dq_lat[..., :r] @ w_uk  # (B, H, T, r) @ (H, r, d_nope) -> (B, H, T, d_nope)
        return dq_nope, dq_lat[..., r:], dlatent, join_ukv(dw_uk, dw_uv)

    def _naive_backward(self, do: Array, saved: LatentSaved) -> tuple[Array, Array, Array, Array]:
        """do (B, H, T, d_v) back through the heads' attention and the decompression: dq_nope, dq_rope (rotated),
        dlatent (B, 1, T, r + d_rope), dW_UKV."""
        a, r, d_nope = saved.attended, self.kv_lora_rank, self.d_nope
        B, H, T, _ = do.shape
        dq, dk, dv = flash_attention_backward(a.q, a.k, a.v, a.out, do, a.lse, causal=True, scale=self.softmax_scale)
        dk_rope = dk[..., d_nope:].sum(axis=1, keepdims=True)  # (B, 1, T, d_rope): one key that every head read
        # [k_nope | v] = c_KV W_UKV, each head's columns side by side
        dkv = np.concatenate([dk[..., :d_nope], dv], axis=-1).swapaxes(1, 2).reshape(B * T, -1)  # (B·T, H·(dn + dv))
        c_kv = saved.proj.latent[:, 0, :, :r].reshape(B * T, r)  # (B·T, r)
        dw_ukv = c_kv.T @ dkv  # (r, H·(d_nope + d_v))
        dc_kv = (dkv @ saved.weights["w_ukv"].T).reshape(B, 1, T, r)  # (B, 1, T, r)
        return dq[..., :d_nope], dq[..., d_nope:], np.concatenate([dc_kv, dk_rope], axis=-1), dw_ukv

    def projection_backward(
        self, dq_nope: Array, dq_rope: Array, dlatent: Array, saved: Any
    ) -> tuple[Array, dict[str, Array]]:
        """The first lines of the forward, backward: dq_nope (B, H, T, d_nope), dq_rope (B, H, T, d_rope) (the
        rotated queries' gradients) and dlatent (B, 1, T, r + d_rope) back through RoPE, the two norms and the
        projections -> dx (B, T, C) and the gradients of the projections' weights by name (w_q, or w_dq, q_norm
        and w_uq; w_dkv and kv_norm). saved: this forward's LatentSaved, or anything with its x, positions,
        weights and proj (dsa.py's layer, whose attention reads the same projections)."""
        x, proj, w, r = saved.x, saved.proj, saved.weights, self.kv_lora_rank
        B, T, C = x.shape
        x_flat = x.reshape(B * T, C)
        grads: dict[str, Array] = {}
        # the latent path: k_rope = RoPE(·), c_KV = RMSNorm(c_KV_raw), [c_KV_raw | k_rope] = x W_DKV
        dk_rope = self._rope(dlatent[:, 0, :, r:], saved.positions, backward=True)  # (B, T, d_rope)
        dc_kv_raw, grads["kv_norm"] = _norm_backward(dlatent[:, 0, :, :r], proj.c_kv_raw, w["kv_norm"])
        d_dkv = np.concatenate([dc_kv_raw, dk_rope], axis=-1).reshape(B * T, -1)  # (B·T, r + d_rope)
        grads["w_dkv"] = x_flat.T @ d_dkv  # (C, r + d_rope)
        dx = d_dkv @ w["w_dkv"].T  # (B·T, C)
        # the query path: q_rope = RoPE(·); q = c_Q W_UQ (or x W_Q), each head's columns [q_nope | q_rope]
        dq_rope = self._rope(dq_rope, saved.positions, backward=True)  # (B, H, T, d_rope)
        dq = np.concatenate([dq_nope, dq_rope], axis=-1).swapaxes(1, 2).reshape(B * T, -1)  # (B·T, H·(dn + dr))
        if proj.c_q is None or proj.c_q_raw is None:
            grads["w_q"] = x_flat.T @ dq  # (C, H·(d_nope + d_rope))
            return (dx + dq @ w["w_q"].T).reshape(B, T, C), grads
        grads["w_uq"] = proj.c_q.reshape(B * T, -1).T @ dq  # (q_lora_rank, H·(d_nope + d_rope))
        dc_q = dq @ w["w_uq"].T  # (B·T, q_lora_rank)
        dc_q_raw, grads["q_norm"] = _norm_backward(dc_q, proj.c_q_raw.reshape(B * T, -1), w["q_norm"])
        grads["w_dq"] = x_flat.T @ dc_q_raw  # (C, q_lora_rank)
        return (dx + dc_q_raw @ w["w_dq"].T).reshape(B, T, C), grads


class LatentHeads(NamedTuple):
    """A MultiHeadLatentAttention as a cache's attend sees the layer (multihead.DecodingLayer): the new tokens'
    latents are the keys it keeps (their first kv_lora_rank numbers the values), and the queries are the
    absorbed form's q_lat (multi-query attention over the latent, which the cache's own kernels read in place)
    or the naive form's [q_nope | q_rope] (attend_heads decompresses the heads' keys and values first)."""

    layer: MultiHeadLatentAttention
    absorbed: bool

    @property
    def softmax_scale(self) -> float:
        return self.layer.softmax_scale

    def check_cache(self, cache: Any, x: Any) -> Array:
        """x (B, T, C) in the layer's dtype, once the cache is checked to hold this layer's latents (one kv head
        of latent_dim numbers, the values its first kv_lora_rank; a KVCache of B rows and no window)."""
        x, _ = self.layer._batched(x)
        check_latent_cache(self.layer, cache, x.shape[0])
        return x

    def split_heads(self, x: Array, positions: Any = None) -> tuple[Array, Array, Array]:
        """x (B, T, C) at positions (T,) -> q (B, H, T, ·) of the form, the latents (B, 1, T, r + d_rope) and
        their first r numbers (the values: a view)."""
        layer = self.layer
        proj = layer.project(x, layer._positions(positions, x.shape[1]), layer.parameters)
        if self.absorbed:
            q = absorb_query(proj.q_nope, proj.q_rope, split_ukv(layer.w_ukv, layer.n_heads, layer.d_nope)[0])
        else:
            q = np.concatenate([proj.q_nope, proj.q_rope], axis=-1)  # (B, H, T, d_nope + d_rope)
        return q, proj.latent, proj.latent[..., : layer.kv_lora_rank]

    def attend_heads(self, q: Array, k: Array, v: Array, band: TileMask, fused: bool = True) -> tuple[Array, Any]:
        """The heads' attention over latents k (B, 1, S, r + d_rope) with values v, causal (band: the cache's
        causal band; a latent cache has no window): o_lat (B, H, T, r) absorbed, o (B, H, T, d_v) naive."""
        layer = self.layer
        if not self.absorbed:  # the heads' own keys and values, from every latent
            k, v = decompress(k, layer.w_ukv, layer.n_heads, layer.d_nope)  # (B, H, S, d_nope + d_rope), (.., d_v)
        return causal_attention(q, k, v, layer.softmax_scale)


def join_ukv(w_uk: Array, w_uv: Array) -> Array:
    """split_ukv's inverse: W_UK (H, r, d_nope) and W_UV (H, r, d_v) as W_UKV (r, H·(d_nope + d_v))."""
    per_head = np.concatenate([w_uk, w_uv], axis=-1)  # (H, r, d_nope + d_v)
    return per_head.transpose(1, 0, 2).reshape(per_head.shape[1], -1)


class LatentSaved(NamedTuple):
    """What MultiHeadLatentAttention.backward needs from its forward: copies of x (B, T, C) and of the weights,
    the positions, the projections, the heads' output o (B, H, T, d_v), what the attention saw, and the flags."""

    module: MultiHeadLatentAttention
    x: Array
    positions: NDArray[np.int64]
    weights: dict[str, Array]
    proj: Projected
    o: Array
    attended: Attended
    absorbed: bool
    unbatched: bool
