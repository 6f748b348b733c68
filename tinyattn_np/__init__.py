"""tinyattn_np: transformer attention in pure NumPy, written to be read.

The reading order: each file uses only what came before it.

     1  softmax.py     softmax, logsumexp, merge_states: the online-softmax algebra
     2  masks.py       the causal mask in its two alignments, sliding windows
     3  head.py        one head, a line per step: softmax(q kᵀ / √d) v
     4  attention.py   the reference that builds the scores; torch's scaled_dot_product_attention
     5  flash.py       tiles and the online softmax: FlashAttention-2's Algorithm 1 for one head, then the
                       fast path that batches heads over worker threads
     6  backward.py    the gradients by hand: the reference's, then Algorithm 2, blockwise
     7  position.py    RoPE in both pair layouts, and its scaling for long context
     8  multihead.py   one fused qkv matmul, grouped-query heads, a training forward and backward
     9  kvcache.py     decoding with a cache of keys and values
    10  splitkv.py     one decode step with the keys split over the cores, and the merge of the parts
    11  paged.py       serving many sequences: a pool of blocks, block tables, decoding through them
    12  ring.py        ring attention: the sequence split over MPI processes (not imported here)

Then the bills: memory.py (formulas true of any implementation), peaks.py (what our own functions
allocate), models.py (model shapes, presets, config.json). Helpers: _checks.py (input checks),
_parallel.py (the worker engine), _guard.py (the reference path's memory guard), _bytes.py (bytes per
dtype, byte units), measure.py, report.py, text.py.

The names below are the public API; each lives in the module named after its concept.
"""

from .attention import AttentionMemoryError, attention, scaled_dot_product_attention
from .backward import (
    attention_backward,
    flash_attention_backward,
    flash_attention_backward_one_head,
    rope_backward,
)
from .flash import Tile, draw_tile_plan, flash_attention, flash_attention_one_head, tile_plan
from .head import one_head
from .kvcache import KVCache
from .masks import causal_mask, window_mask
from .memory import (
    DTYPES,
    attention_backward_bytes,
    attention_backward_flops,
    attention_flops,
    bytes_per_element,
    causal_entries,
    flash_attention_backward_bytes,
    flash_attention_bytes,
    kv_cache_bytes,
    naive_attention_bytes,
    paged_kv_cache_bytes,
    ring_attention_bytes,
    score_matrix_bytes,
)
from .models import PRESETS, ModelShape, load_model_shape, model_bill, shape_from_config
from .multihead import MultiHeadAttention
from .paged import PagedKVCache, PoolExhaustedError, cascade_decode, paged_decode
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
from .splitkv import flash_decode, merge_chunks
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
    "PagedKVCache",
    "PoolExhaustedError",
    "Tile",
    "attention",
    "attention_backward",
    "attention_backward_bytes",
    "attention_backward_flops",
    "attention_flops",
    "bytes_per_element",
    "cascade_decode",
    "causal_entries",
    "causal_mask",
    "draw_tile_plan",
    "embed",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_bytes",
    "flash_attention_backward_one_head",
    "flash_attention_bytes",
    "flash_attention_one_head",
    "flash_decode",
    "half_split_permutation",
    "kv_cache_bytes",
    "load_model_shape",
    "logsumexp",
    "merge_chunks",
    "merge_states",
    "model_bill",
    "naive_attention_bytes",
    "one_head",
    "paged_decode",
    "paged_kv_cache_bytes",
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
