"""The memory and compute bill of attention, before anything runs: exact integer bytes and FLOPs.

Everything here is a pure function of sizes, and true of any implementation: what the score matrix and
the KV cache hold, how many scores a causal mask or a window keeps, and what the matmuls cost. Nothing is
formatted: report.py turns bytes into "128.0 MiB" or "134.2 MB". The numbers the two source articles
quote come out of these functions:

    score matrix, one head, one layer, n = 8,192, fp16:   8,192² · 2 B = 134,217,728 B (134.2 MB, 128 MiB)
    ... times 32 heads and 32 layers (Llama-3-8B):          137,438,953,472 B (137.4 GB, 128 GiB)
    KV cache per token, Llama-3-8B in bf16:                 2 · 32 · 8 · 128 · 2 B = 131,072 B
    latent cache per token, DeepSeek-V3 in bf16:            61 · (512 + 64) · 2 B = 70,272 B

The three bills, told apart:
    memory.py   formulas: what attention costs in any implementation (this file)
    peaks.py    what this project's own functions allocate at their peak, checked against tracemalloc
                (naive_attention_bytes, flash_attention_bytes, ...: import them from peaks or tinyattn_np)
    models.py   a model's shape, layer by layer (presets.py: released models; hf_config/: a config.json),
                and bill.py a whole model's bill at each context length
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._bytes import nbytes
from ._checks import check_bool, check_count, check_positive_int, check_sizes, check_window_is_causal

__all__ = [
    "attention_backward_flops",
    "attention_flops",
    "causal_entries",
    "kv_cache_bytes",
    "latent_cache_bytes",
    "linear_attention_state_bytes",
    "paged_kv_cache_bytes",
    "score_matrix_bytes",
]


def score_matrix_bytes(
    n_q: int, n_k: int | None = None, *, heads: int = 1, layers: int = 1, batch: int = 1, dtype: Any = "fp16"
) -> int:
    """Bytes of the attention score matrices if all were materialised at once.

        bytes = batch · layers · heads · L · S · bytes_per_element

    One head, one layer, L = S = 8,192 in fp16: 67,108,864 entries, 134,217,728 B.
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    layers = check_positive_int(layers, "layers")
    batch = check_positive_int(batch, "batch")
    return nbytes(batch * layers * heads * n_q * n_k, dtype)


def kv_cache_bytes(
    tokens: int,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any = "bf16",
    batch: int = 1,
    window: int | None = None,
    head_dim_v: int | None = None,
) -> int:
    """Bytes of the key/value cache after `tokens` tokens.

        bytes = layers · kv_heads · (E + Ev) · min(tokens, window) · batch · bytes_per_element

    E + Ev is 2 · head_dim (k and v) unless head_dim_v says the values are narrower (the decompressed
    keys of latent attention are 192 wide, its values 128). A sliding window of W tokens means only the
    last W keys and values are ever read again, so a rolling cache keeps at most W of them; a chunked
    layer (Llama 4) keeps at most its chunk, the same bound. Grouped-query attention shows up as
    kv_heads < heads, multi-query attention as kv_heads = 1.
    """
    kept = _kept(tokens, batch, window)
    layers = check_positive_int(layers, "layers")
    kv_heads = check_positive_int(kv_heads, "kv_heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    return nbytes(layers * kv_heads * (head_dim + head_dim_v) * kept, dtype)


def _kept(tokens: int, batch: int, window: int | None) -> int:
    """min(tokens, window) · batch: the tokens a cache holds for every sequence of the batch."""
    tokens = check_count(tokens, "tokens")
    batch = check_positive_int(batch, "batch")
    window = None if window is None else check_positive_int(window, "window")
    return (tokens if window is None else min(tokens, window)) * batch


def latent_cache_bytes(
    tokens: int,
    *,
    layers: int,
    kv_rank: int,
    rope_dim: int,
    dtype: Any = "bf16",
    batch: int = 1,
    window: int | None = None,
) -> int:
    """Bytes of multi-head latent attention's cache (DeepSeek-V2 paper, section 2.1).

        bytes = layers · (kv_rank + rope_dim) · min(tokens, window) · batch · bytes_per_element

    Each token keeps its compressed latent c_KV (kv_rank numbers, from which every head's key and value
    are decompressed) and one rotary key k_R (rope_dim) that all heads share: the head count is gone from
    the formula. DeepSeek-V3, 61 layers of 512 + 64 in bf16: 70,272 B a token, where its 128 heads would
    keep 128 · (192 + 128) · 61 · 2 B = 4,997,120 B decompressed (kv_cache_bytes with head_dim_v).

    >>> latent_cache_bytes(1, layers=61, kv_rank=512, rope_dim=64)
    70272
    """
    kept = _kept(tokens, batch, window)
    layers = check_positive_int(layers, "layers")
    kv_rank = check_positive_int(kv_rank, "kv_rank")
    rope_dim = check_positive_int(rope_dim, "rope_dim")
    return nbytes(layers * (kv_rank + rope_dim) * kept, dtype)


def linear_attention_state_bytes(
    *,
    layers: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    conv_channels: int = 0,
    conv_kernel: int = 0,
    dtype: Any = "bf16",
    batch: int = 1,
) -> int:
    """Bytes of the state that linear-attention layers keep in place of a KV cache: fixed, whatever the context.

        bytes = layers · batch · (heads · key_dim · value_dim + conv_channels · conv_kernel) · bytes_per_element

    Each head folds every token into one key_dim x value_dim matrix, S_t = decay_t · S_{t-1} + k_t v_tᵀ
    (with a delta-rule correction in gated DeltaNet), and reads it as q_t S_t. Where a short causal
    convolution runs over q, k and v first (Qwen3-Next), its last conv_kernel inputs of conv_channels
    are kept too, as transformers and Mamba keep them.
    """
    layers = check_positive_int(layers, "layers")
    heads = check_positive_int(heads, "heads")
    key_dim = check_positive_int(key_dim, "key_dim")
    value_dim = check_positive_int(value_dim, "value_dim")
    conv_channels = check_count(conv_channels, "conv_channels")
    conv_kernel = check_count(conv_kernel, "conv_kernel")
    batch = check_positive_int(batch, "batch")
    return nbytes(layers * batch * (heads * key_dim * value_dim + conv_channels * conv_kernel), dtype)


def paged_kv_cache_bytes(
    lengths: Sequence[int],
    *,
    block_size: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any = "bf16",
    shared_prefix: int = 0,
) -> int:
    """Bytes of the blocks a paged KV cache (paged.PagedKVCache) holds for sequences of these lengths.

        blocks = Σ_i ceil(T_i / block_size)          each sequence takes a block only when its last is full
        bytes  = blocks · block_size · 2 (k and v) · layers · kv_heads · head_dim · bytes_per_element

    At most block_size - 1 slots per sequence hold no token. Contiguous preallocation reserves each
    sequence's maximum instead: kv_cache_bytes(max_tokens, batch=N, ...), whatever the lengths turn out to be.
    shared_prefix: tokens at the start of every sequence that they share (one prompt, n samples forked from
    it): its full blocks are held once, and each sequence, once it has written past the prompt, its own
    copy of the prompt's partly filled last block (copy-on-write).

    >>> paged_kv_cache_bytes([100, 20], block_size=16, layers=1, kv_heads=1, head_dim=1, dtype="fp32")  # 7 + 2 blocks
    1152
    >>> kv_cache_bytes(128, layers=1, kv_heads=1, head_dim=1, dtype="fp32", batch=2)  # both reserve 128 tokens
    2048
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"lengths must be a sequence of token counts; got {type(lengths).__name__}")
    lengths = [check_count(t, "lengths[i]") for t in lengths]
    block_size = check_positive_int(block_size, "block_size")
    layers = check_positive_int(layers, "layers")
    kv_heads = check_positive_int(kv_heads, "kv_heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    shared_prefix = check_count(shared_prefix, "shared_prefix")
    if lengths and shared_prefix > min(lengths):
        raise ValueError(f"shared_prefix ({shared_prefix}) must be at most the shortest length ({min(lengths)})")
    shared = shared_prefix // block_size if lengths else 0  # full blocks of the prefix: held once
    blocks = shared + sum(-(-t // block_size) - shared for t in lengths)
    return nbytes(2 * layers * kv_heads * head_dim * blocks * block_size, dtype)


def causal_entries(n_q: int, n_k: int | None = None, *, window: int | None = None, chunk: int | None = None) -> int:
    """How many of the L x S scores a causal mask keeps, with bottom-right alignment (masks.py).

    Query i sees key j when j <= i + (S - L), so row i keeps clip(i + S - L + 1, 0, S) keys:

        L <= S:  L · (S - L) + L (L + 1) / 2     (every row sees the S - L cached keys, then a triangle)
        L >  S:  S (S + 1) / 2                   (the first L - S rows see nothing)

    For L == S that is L (L + 1) / 2: a little more than half. A sliding window of W also hides the keys
    j <= i + S - L - W, max(i + S - L + 1 - W, 0) of them in row i, so each row keeps at most W:
    about L · W entries in all, linear in L, where the plain causal count grows like L².

    A chunk of C (Llama 4's chunked attention) instead cuts the sequence into blocks of C positions, and
    the query at position p sees only keys from the start of its own block, floor(p / C) · C, to p:
    p mod C + 1 of them. Summed over positions 0 .. n - 1 that is f(n) = q · C (C + 1) / 2 + r (r + 1) / 2
    with n = q · C + r, and the L queries at positions S - L .. S - 1 keep f(S) - f(max(S - L, 0)).
    """
    n_q, n_k = check_sizes(n_q, n_k)
    if window is not None and chunk is not None:
        raise ValueError(f"window={window} and chunk={chunk}: a layer slides or is chunked, not both")
    if chunk is not None:
        chunk = check_positive_int(chunk, "chunk")

        def upto(n: int) -> int:  # f(n): the keys positions 0 .. n - 1 see
            blocks, rest = divmod(n, chunk)
            return blocks * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2

        return upto(n_k) - upto(max(n_k - n_q, 0))
    if n_q <= n_k:
        kept = n_q * (n_k - n_q) + n_q * (n_q + 1) // 2
    else:
        kept = n_k * (n_k + 1) // 2
    if window is None:
        return kept
    window = check_positive_int(window, "window")
    # row i hides a_i = i + S - L + 1 - W keys when a_i > 0; a_i runs from S - L + 1 - W to S - W
    first, last = max(n_k - n_q + 1 - window, 1), n_k - window
    hidden = (first + last) * (last - first + 1) // 2 if last >= first else 0
    return kept - hidden


def attention_flops(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    causal: bool = False,
    batch: int = 1,
    head_dim_v: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> int:
    """FLOPs of the two matmuls of attention, QKᵀ and PV, counting a multiply-add as 2 FLOPs.

        flops = batch · heads · entries · 2 (E + Ev)       entries = L · S, or causal_entries(L, S, window=W)

    window (needs causal=True): a sliding window of W keys, counted as a band-aware kernel skips the rest;
    chunk (needs causal=True): chunked attention, each query within its block of C positions.

    Each kept score costs E multiply-adds in QKᵀ and Ev in PV. causal=True counts exactly the unmasked
    entries (what a mask-aware kernel computes), not L · S / 2. Softmax's few FLOPs per entry are left
    out, as in the usual 4·L·S·E estimate (FlashAttention-2 paper, section 4.1).
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    batch = check_positive_int(batch, "batch")
    causal = check_bool(causal, "causal")
    check_window_is_causal(window, causal)
    if chunk is not None and not causal:
        raise ValueError(f"chunk={chunk} needs causal=True (a chunked layer looks back to its block's start)")
    entries = causal_entries(n_q, n_k, window=window, chunk=chunk) if causal else n_q * n_k
    return batch * heads * entries * 2 * (head_dim + head_dim_v)


def attention_backward_flops(
    n_q: int,
    n_k: int | None = None,
    *,
    heads: int,
    head_dim: int,
    causal: bool = False,
    batch: int = 1,
    head_dim_v: int | None = None,
) -> int:
    """FLOPs of the five matmuls of attention's backward, counting a multiply-add as 2 FLOPs.

        flops = batch · heads · entries · 2 (3E + 2Ev)      entries as in attention_flops

    Per kept score: S = Q Kᵀ again (E), dV += Pᵀ dO (Ev), dP = dO Vᵀ (Ev), dQ += dS K (E),
    dK += dSᵀ Q (E). With Ev = E that is 2.5x the forward's 2 (E + Ev) (FlashAttention-2 paper, section 4.1).
    """
    n_q, n_k = check_sizes(n_q, n_k)
    heads = check_positive_int(heads, "heads")
    head_dim = check_positive_int(head_dim, "head_dim")
    head_dim_v = head_dim if head_dim_v is None else check_positive_int(head_dim_v, "head_dim_v")
    batch = check_positive_int(batch, "batch")
    entries = causal_entries(n_q, n_k) if check_bool(causal, "causal") else n_q * n_k
    return batch * heads * entries * 2 * (3 * head_dim + 2 * head_dim_v)
