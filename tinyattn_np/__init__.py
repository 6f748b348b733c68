"""tinyattn_np: transformer attention in pure NumPy, written to be read.

The names below are the public API (README: file map and conventions); each lives in the module named after its concept.
"""

from .attention import AttentionMemoryError, attention, scaled_dot_product_attention
from .backward import attention_backward, flash_attention_backward, rope_backward
from .flash import Tile, draw_tile_plan, flash_attention, tile_plan
from .head import one_head
from .kvcache import KVCache
from .masks import causal_mask, window_mask
from .memory import (
    DTYPES,
    attention_backward_flops,
    attention_flops,
    bytes_per_element,
    causal_entries,
    flash_attention_backward_bytes,
    flash_attention_bytes,
    kv_cache_bytes,
    naive_attention_bytes,
    ring_attention_bytes,
    score_matrix_bytes,
)
from .models import PRESETS, ModelShape, load_model_shape, model_bill, shape_from_config
from .multihead import MultiHeadAttention
from .position import (
    LearnedPositions,
    half_split_permutation,
    permute_qk_weight,
    rope,
    rope_attention_factor,
    rope_frequencies,
    to_half_split,
    to_interleaved,
)
from .softmax import logsumexp, merge_states, softmax
from .splitkv import flash_decode
from .text import embed, token_vector, tokenize

__version__ = "0.1.0"

__all__ = [
    "AttentionMemoryError",
    "DTYPES",
    "KVCache",
    "LearnedPositions",
    "ModelShape",
    "MultiHeadAttention",
    "PRESETS",
    "Tile",
    "attention",
    "attention_backward",
    "attention_backward_flops",
    "attention_flops",
    "bytes_per_element",
    "causal_entries",
    "causal_mask",
    "draw_tile_plan",
    "embed",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_bytes",
    "flash_attention_bytes",
    "flash_decode",
    "half_split_permutation",
    "kv_cache_bytes",
    "load_model_shape",
    "logsumexp",
    "merge_states",
    "model_bill",
    "naive_attention_bytes",
    "one_head",
    "permute_qk_weight",
    "ring_attention_bytes",
    "rope",
    "rope_attention_factor",
    "rope_backward",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "score_matrix_bytes",
    "shape_from_config",
    "softmax",
    "tile_plan",
    "to_half_split",
    "to_interleaved",
    "token_vector",
    "tokenize",
    "window_mask",
]
