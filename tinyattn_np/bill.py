"""The bill of one model: parameters (total and active), weights, cache, naive scores and attention FLOPs at
each context length, as plain numbers (JSON too). The figures are ModelShape's (models.py) and memory.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import check_count
from ._shape_checks import ATTENTION_TYPES
from .memory import score_matrix_bytes
from .models import ModelShape

__all__ = ["model_bill"]


def _contexts(model: ModelShape, tokens: list[int], dtype: Any, kv_dtype: Any, batch: int) -> list[dict[str, Any]]:
    """model_bill's figures at each context length."""
    contexts = []
    state = model.state_bytes(kv_dtype, batch)
    for n in tokens:
        n = check_count(n, "tokens")
        kv = model.kv_cache_bytes(n, kv_dtype, batch)
        decompressed = None if model.latent is None else model.kv_cache_bytes(n, kv_dtype, batch, decompressed=True)
        scores = sum(  # the softmax layers, each kind with its heads: linear ones have no score matrix
            score_matrix_bytes(
                n, heads=model.attention_sizes(kind).heads, layers=model.count(kind), batch=batch, dtype=dtype
            )
            for kind in ATTENTION_TYPES
            if model.count(kind)
        )
        contexts.append(
            {
                "tokens": n,
                "kv_cache_bytes": kv,
                "kv_cache_bytes_decompressed": decompressed,
                "cache_bytes": kv + state,
                "score_matrix_bytes": scores,
                "attention_flops": model.attention_flops(n, batch),
                "beyond_max_positions": model.max_positions is not None and n > model.max_positions,
            }
        )
    return contexts


def model_bill(
    model: ModelShape, tokens: int | list[int], *, dtype: Any = "bf16", kv_dtype: Any = None, batch: int = 1
) -> dict[str, Any]:
    """Parameters, weights, cache, naive score matrices and attention FLOPs of a model at each context length.

    dtype is for the weights and the scores, kv_dtype for the cache and the linear layers' state (default:
    dtype). The model: architecture (the model_type recognized), description (its lines), parameters and
    active_parameters (all the weights, and those one token runs: they differ with experts; None where the
    config does not say how many experts a token runs), weights_bytes (every parameter), kv_bytes_per_token
    (all attention layers; by_kind splits it; the latent cache for latent attention, and
    kv_bytes_per_token_decompressed the per-head keys and values a naive implementation keeps), state_bytes
    (the fixed state of linear layers). Per context T:
        kv_cache_bytes        sliding layers keep at most W tokens, chunked layers at most their chunk
        cache_bytes           kv_cache_bytes + state_bytes: everything decoding keeps per sequence
        score_matrix_bytes    every softmax layer's and head's T x T scores at once (the article's worst case)
        attention_flops       QKᵀ and PV over the softmax layers, causal (decoder): windows count their band,
                              chunked layers their blocks; linear layers have no scores and are not counted
        beyond_max_positions  T > max_position_embeddings: the model was not trained that long
    Plain ints, strs and bools only, so the result is also JSON.
    """
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape (see load_model_shape); got {type(model).__name__}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        tokens = [int(tokens)]  # one context length
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be an int or a list of ints; got {type(tokens).__name__}")
    by_kind = model.kv_bytes_per_token(kv_dtype)
    return {
        "model": model.name,
        "architecture": model.architecture or model.arch,
        "description": model.describe(),
        "parameters": model.num_parameters,
        "active_parameters": model.active_parameters,
        "weights_bytes": model.weights_bytes(dtype),
        "kv_bytes_per_token": model.kv_cache_bytes(1, kv_dtype, batch),
        "kv_bytes_per_token_by_kind": {kind: batch * per_token for kind, per_token in by_kind.items()},
        "kv_bytes_per_token_decompressed": (
            None if model.latent is None else model.kv_cache_bytes(1, kv_dtype, batch, decompressed=True)
        ),
        "state_bytes": model.state_bytes(kv_dtype, batch),
        "max_positions": model.max_positions,
        "sliding_window": model.sliding_window,
        "attention_chunk": model.attention_chunk,
        "contexts": _contexts(model, list(tokens), dtype, kv_dtype, batch),
    }
