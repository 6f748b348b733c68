"""The checks of latent.py's inputs, before any math: attend_latent's arrays against each other, a
MultiHeadLatentAttention's weights against its sizes, and a cache against the layer. Each error names what
disagrees. The layer is read for its sizes and dtype (d_model, n_heads, kv_lora_rank, q_lora_rank, d_nope,
d_rope, d_v, dtype, latent_dim), whatever its class.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_scale, compute_dtype, transposed_note

Array = NDArray[np.floating]

__all__ = ["check_indexer_weights", "check_latent", "check_latent_cache", "check_latent_weights", "check_tokens"]


def check_tokens(x: Any, d_model: int, dtype: np.dtype, name: str = "x") -> tuple[Array, bool]:
    """x (B, T, d_model) or (T, d_model), checked, as (B, T, d_model) in dtype, and whether it had no batch axis."""
    x = as_float_array(x, name)
    if x.ndim not in (2, 3) or x.shape[-1] != d_model:
        raise ValueError(f"{name} must be (B, T, {d_model}) or (T, {d_model}); got shape {x.shape}")
    return (x[None] if x.ndim == 2 else x).astype(dtype, copy=False), x.ndim == 2


def check_latent(
    q_nope: Any, q_rope: Any, latent: Any, w_ukv: Any, scale: Any
) -> tuple[Array, Array, Array, Array, float]:
    """attend_latent's inputs, checked against each other before any math; each error names what disagrees."""
    q_nope, q_rope = as_float_array(q_nope, "q_nope"), as_float_array(q_rope, "q_rope")
    latent, w_ukv = as_float_array(latent, "latent"), as_float_array(w_ukv, "w_ukv")
    if q_nope.ndim != 4 or q_rope.ndim != 4 or q_nope.shape[:3] != q_rope.shape[:3]:
        raise ValueError(
            f"q_nope and q_rope must be (B, H, L, ·) with the same B, H, L; got {q_nope.shape}, {q_rope.shape}"
        )
    B, H, _, d_nope = q_nope.shape
    if w_ukv.ndim != 2 or w_ukv.shape[1] % H or w_ukv.shape[1] // H <= d_nope:
        raise ValueError(
            f"w_ukv must be (kv_lora_rank, H·(d_nope + d_v)) for H={H} heads with d_nope={d_nope} (q_nope's) and "
            f"d_v >= 1; got shape {w_ukv.shape}"
        )
    r, d_rope = w_ukv.shape[0], q_rope.shape[-1]
    if latent.ndim != 4 or latent.shape[:2] != (B, 1) or latent.shape[-1] != r + d_rope:
        raise ValueError(
            f"latent must be (B={B}, 1, S, kv_lora_rank + d_rope = {r} + {d_rope}): w_ukv has kv_lora_rank={r} rows "
            f"and q_rope d_rope={d_rope} channels; got shape {latent.shape}"
        )
    return q_nope, q_rope, latent, w_ukv, check_scale(scale, d_nope + d_rope, compute_dtype(q_nope, latent))


def check_latent_weights(layer: Any, weights: dict[str, Array]) -> dict[str, Array]:
    """weights (the layer's `parameters`), each checked against the layer's sizes and dtype: a weight replaced
    by an array of another shape (a latent rank that does not match the others) or dtype is refused."""
    C, H, r, q, qk = layer.d_model, layer.n_heads, layer.kv_lora_rank, layer.q_lora_rank, layer.d_nope + layer.d_rope
    shapes = {
        "w_q": (C, H * qk),
        "w_dq": (C, q),
        "q_norm": (q,),
        "w_uq": (q, H * qk),
        "w_dkv": (C, r + layer.d_rope),
        "kv_norm": (r,),
        "w_ukv": (r, H * (layer.d_nope + layer.d_v)),
        "w_o": (H * layer.d_v, C),
    }
    for name, w in weights.items():
        if not isinstance(w, np.ndarray) or w.dtype != layer.dtype:
            raise TypeError(
                f"{name} must be a {layer.dtype} ndarray, the layer's dtype; got {getattr(w, 'dtype', w)!r}"
            )
        if w.shape != shapes[name]:
            raise ValueError(
                f"{name} must have shape {shapes[name]} for this layer (d_model={C}, n_heads={H}, "
                f"kv_lora_rank={r}, q_lora_rank={q}, qk_nope_head_dim={layer.d_nope}, qk_rope_head_dim="
                f"{layer.d_rope}, v_head_dim={layer.d_v}); got {w.shape}{transposed_note(w.shape, shapes[name])}"
            )
    return weights


def check_indexer_weights(layer: Any, weights: dict[str, Any]) -> dict[str, Array]:
    """A sparse layer's indexer weights (dsa.py), each checked against its sizes (layer.mla's d_model and
    q_lora_rank, index_n_heads, index_head_dim) and dtype."""
    C, q, H, d = layer.mla.d_model, layer.mla.q_lora_rank, layer.index_n_heads, layer.index_head_dim
    shapes = {
        "w_index_q": (q, H * d),
        "w_index_k": (C, d),
        "index_k_norm": (d,),
        "index_k_norm_bias": (d,),
        "w_index_weights": (C, H),
    }
    for name, w in weights.items():
        if not isinstance(w, np.ndarray) or w.dtype != layer.dtype or w.shape != shapes[name]:
            raise ValueError(
                f"{name} must be a {layer.dtype} ndarray of shape {shapes[name]}; got "
                f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}"
            )
    return weights


def check_latent_cache(layer: Any, cache: Any, batch: int, index_head_dim: int = 0) -> None:
    """A cache for the layer holds one "head" of latent_dim numbers in the layer's dtype, its values the first
    kv_lora_rank of them (the latent stored once); a KVCache (it has a batch) holds `batch` rows and no
    window. index_head_dim: a sparse layer's cache keeps each token's indexer key after its latent (dsa.py)."""
    kv = hasattr(cache, "batch")
    kind, rows = ("KVCache", f"batch={batch}, ..., ") if kv else ("PagedKVCache", "..., ")
    width, r = layer.latent_dim + index_head_dim, layer.kv_lora_rank
    if (cache.kv_heads, cache.head_dim, cache.dtype, cache.value_prefix) != (1, width, layer.dtype, r):
        what = f"one latent of kv_lora_rank + qk_rope_head_dim = {r} + {layer.d_rope}"
        if index_head_dim:  # a sparse layer's
            what = (
                f"one latent and one indexer key, kv_lora_rank + qk_rope_head_dim + index_head_dim = {r} + "
                f"{layer.d_rope} + {index_head_dim}"
            )
        raise ValueError(
            f"cache must be {kind}({rows}kv_heads=1, head_dim={width}, dtype={layer.dtype}, value_prefix={r}): {what} "
            f"numbers a token, the value its first kv_lora_rank; got kv_heads={cache.kv_heads}, "
            f"head_dim={cache.head_dim}, dtype={cache.dtype}, value_prefix={cache.value_prefix}"
        )
    if kv and (cache.batch != batch or cache.window is not None):
        raise ValueError(
            f"cache must be KVCache(batch={batch}, ..., window=None) for this input: a latent cache keeps "
            f"every token, one row of x per row of the cache; got batch={cache.batch}, window={cache.window}"
        )
