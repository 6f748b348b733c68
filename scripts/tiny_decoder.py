"""The little model the decoding scripts run (decode.py, serve.py): a token table E (V, C), `layers` residual
attention blocks with RoPE, and logits = x Eᵀ (a tied head). Each block is a MultiHeadAttention, which decodes
through the cache it is given: a KVCache per layer, or a PagedKVCache per layer and the sequences' ids.

    x_0 = E[tokens]        x_{l+1} = x_l + MHA_l(x_l)        logits = x_L Eᵀ
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from tinyattn_np import KVCache, MultiHeadAttention, PagedKVCache


class TinyDecoder:
    """The model of the module docstring, its sizes from --vocab, --d-model, --heads, --kv-heads, --layers and
    --dtype."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator):
        self.dtype = np.dtype(args.dtype)
        self.table = rng.standard_normal((args.vocab, args.d_model)).astype(self.dtype)  # (V, C)
        self.blocks = [
            MultiHeadAttention(args.d_model, args.heads, args.kv_heads, rope=True, rng=rng, dtype=self.dtype)
            for _ in range(args.layers)
        ]

    def caches(self, max_tokens: int, window: int | None = None) -> list[KVCache]:
        """One KVCache of one sequence per layer (window: a ring buffer of that many tokens)."""
        mha = self.blocks[0]
        return [
            KVCache(1, mha.n_kv_heads, max_tokens, mha.d_head, dtype=self.dtype, window=window) for _ in self.blocks
        ]

    def paged_caches(self, num_blocks: int, block_size: int) -> list[PagedKVCache]:
        """One PagedKVCache per layer; every layer gets the same appends, so their block tables match."""
        mha = self.blocks[0]
        return [PagedKVCache(num_blocks, block_size, mha.n_kv_heads, mha.d_head, self.dtype) for _ in self.blocks]

    def logits(self, tokens: Any, caches: list[Any] | None = None, seq_ids: list[int] | None = None) -> np.ndarray:
        """Logits (B, V) of the next token of each row of tokens (B, T). With caches (one per layer; with
        paged caches, the B sequences seq_ids), the rows continue what the caches hold; without, each row is
        the whole sequence, recomputed."""
        x = self.table[tokens]  # (B, T, C)
        for mha, cache in zip(self.blocks, caches or [None] * len(self.blocks), strict=True):
            x = x + mha(x, cache=cache, seq_ids=seq_ids)  # (B, T, C)
        return x[:, -1] @ self.table.T  # (B, V)
