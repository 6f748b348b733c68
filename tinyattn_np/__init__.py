"""tinyattn_np: transformer attention in pure NumPy, written to be read.

The reading order: each file uses only what came before it.

     1  softmax.py       softmax, logsumexp, merge_states: the online-softmax algebra
     2  masks.py         the causal mask in its two alignments, sliding windows
     3  head.py          one head, a line per step: softmax(q kᵀ / √d) v
     4  mods.py          an attention pattern as a function of positions: mask_mod and score_mod (FlexAttention),
                         the ready-made ones (causal, window, prefix-LM, documents, ALiBi, softcap, a bias table)
     5  attention.py     the reference that builds the scores; torch's scaled_dot_product_attention
     6  blockmask.py     which tiles run: full, partial or empty, by arithmetic (Band) or from a mask_mod (BlockMask)
     7  flash.py         the online softmax over those tiles: FlashAttention-2's Algorithm 1 for one head, then
                         flash_attention, which runs many heads a tile step on worker threads (_flash_kernel.py)
     8  flex.py          flex_attention and packed sequences (varlen): flash's loop with a block mask and mods
     9  backward.py      the gradients by hand: the reference's, then Algorithm 2, blockwise, through the mods
    10  mod_grads.py     the derivative of a score_mod: what the backward passes through ALiBi, softcap, a bias
    11  position.py      RoPE: the rotation of each channel pair, its gradient, its frequencies; for long
                         context a config.json's rope_scaling (the methods' formulas: _rope_scaling.py)
    12  multihead.py     one fused qkv matmul, grouped-query heads, a training forward and backward
    13  splitkv.py       one decode step with the keys split over the cores, and the merge of the parts
    14  kvcache.py       decoding with a cache of keys and values, which attends for the layer (KVCache.attend)
    15  paged.py         serving many sequences: a pool of blocks, block tables, fork and copy-on-write, and a
                         layer's step through them
    16  paged_decode.py  one decode step for sequences of different lengths, through their block tables; a
                         prompt they share read once (cascade)
    17  layers.py        the rest of a block, each backward beside its forward: LayerNorm, RMSNorm, GELU, SwiGLU,
                         the MLP, dropout, cross-entropy
    18  latent.py        multi-head latent attention (DeepSeek-V3): the naive and the absorbed forms, a latent
                         cache decoded by flash_decode and paged_decode, the backward by hand
    19  sparse.py        sparse attention, DeepSeek's way: an indexer chooses each query's top-k keys (a running
                         top-k over blocks of keys), attention over only those, its backward, a decode step
    20  dsa.py           DeepSeek Sparse Attention, the layer (DeepSeek-V3.2): latent attention with the indexer in
                         front, the indexer's own loss, decoding through KVCache and PagedKVCache
    21  linear.py        linear attention by the gated delta rule (Gated DeltaNet, Kimi Delta Attention): a state of
                         d_k x d_v per head, a token at a time or in chunks, the gradients by hand
    22  deltanet.py      Qwen3-Next's Gated DeltaNet, the layer: projections, a causal convolution, the rule, a gated
                         RMSNorm, its gradients by hand; its decoding cache, whose bytes never grow
    23  gpt.py           a tiny GPT: embeddings, pre-norm blocks (attention with RoPE, an MLP), a tied head;
                         its gradient by hand, the presets tiny and part3
    24  sampling.py      generation: temperature, top-k, top-p; with the KV cache or by recomputation
    25  optim.py         AdamW (decay on matrices only), warm-up then cosine, clipping, accumulation
    26  shards.py        the sequence split over P processes: which tokens each holds (zigzag, contiguous)
    27  ring.py          ring attention: the sequence split over MPI processes, forward and backward
    28  ulysses.py       Ulysses: an all-to-all turns the split of the tokens into a split of the heads
                         (26 to 28 are not imported here; ring.py and ulysses.py need mpi4py to run)

Then the bills and the tools a script uses to show them:

    29  peaks.py         what our own functions allocate, worked out from their tiles
    30  memory.py        the byte and FLOP formulas true of any implementation: scores, KV cache, FLOPs
    31  model_parts.py   the parts some models add: experts, latent attention, linear attention
    32  models.py        a model's shape, layer by layer: parameters, bytes, FLOPs
    33  bill.py          one model's bill at each context length
    34  presets.py       released models as shapes
        hf_config/       the Hugging Face config.json reader: a shape from any architecture it knows
    35  measure.py       peaks, timings and machine facts, as the scripts measure them
    36  tune.py          the default tile sizes, heads per step and workers, measured on this machine
    37  profiler.py      where flash attention's time goes: its tile loops, copied, timed part by part
    38  sparse_profile.py  where DeepSeek's indexer's time goes: index_topk's engine, copied, timed part by part
    39  linear_profile.py  where the gated delta rule's chunks spend their time: the engine, copied, timed part by part
    40  report.py        the tables the scripts print
    41  text.py          tokens and embeddings for the demos
    42  trainbill.py     the memory of a GPT training step: weights, gradients, Adam's moments, activations
    43  mpi_job.py       a program under mpiexec: a failing process ends the job, Ctrl-C stops every process
                         after the same step (needs mpi4py to run, and is not imported here)

Beside the lessons, internal by name (`_`): the engines that make a lesson fast, each tested equal to its
plain algorithm, and what several modules share. None of them imports a lesson.

    _flash_kernel.py   flash_attention's tiles: many heads a step on worker threads, sums against 0
    _backward_kernel.py  the backward's key blocks, and the wavefront that orders their dq
    _tiles.py          the tile kinds and what a kernel asks of a mask (Band and BlockMask answer)
    _mod_calls.py      calling a mask_mod or score_mod and checking what it returns
    _tuning.py         the process-wide knobs: the tile rule, the decode layout, the row block
    _decode_kernel.py  a decode step's blocks of keys and their merge (flash_decode, the caches)
    _paged_kernel.py   decoding through block tables, from the pools, the tables and the lengths
    _cache_buffers.py  the caches' dtypes, read-only views, pickling without the lock
    _latent_checks.py  latent attention's input checks
    _gpt_checks.py     the GPT's configuration and given weights, checked
    _sparse_kernel.py  the indexer's blockwise top-k and the attention over the chosen keys
    _sparse_decode.py  the sparse layer's decode step through a cache's pages
    _linear_kernel.py  the gated delta rule's chunks over every head, its backward and the decode step
    _linear_checks.py  the gated delta rule's and its layer's input checks
    _rope_scaling.py   a rope_scaling dict's checks and each scaling method's frequencies
    _shape_checks.py   a model shape's fields, checked and filled
    _shape_describe.py a model shape described in lines (the bill's description)
    _mpi.py            the MPI plumbing the ring and Ulysses share: messages, polled waits, agreement, abort
    _parallel.py       the worker engine, the BLAS limit and the elementwise layers' row blocks
    _checks.py  _guard.py  _atomic.py  _bytes.py   input checks; the memory guard (refuse before allocating);
                       a cache's change all or nothing under an interrupt; bytes per dtype and byte units

The names below are the public API; each lives in the module named after its concept.
"""

from ._backward_kernel import FlexGrads
from ._bytes import DTYPES, best_unit, bytes_per_element, format_bytes, to_unit
from ._guard import AttentionMemoryError
from .attention import attention, scaled_dot_product_attention
from .backward import (
    attention_backward,
    flash_attention_backward,
    flash_attention_backward_one_head,
    flex_attention_backward,
)
from .bill import model_bill
from .blockmask import BlockMask, Tile, create_block_mask, draw_tile_plan, tile_plan
from .deltanet import (
    GatedDeltaCache,
    GatedDeltaNetSaved,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    gated_deltanet,
    gated_deltanet_backward,
)
from .dsa import SparseLatentAttention
from .flash import flash_attention, flash_attention_one_head
from .flex import flash_attention_varlen, flex_attention, varlen_block_mask
from .gpt import GPT, GPT_PRESETS, GPTConfig
from .head import one_head
from .hf_config import load_model_shape, shape_from_config
from .kvcache import KVCache
from .latent import (
    RMS_EPS,
    Attended,
    LatentSaved,
    MultiHeadLatentAttention,
    absorb_query,
    attend_latent,
    decompress,
    join_ukv,
    latent_softmax_scale,
    split_ukv,
)
from .layers import (
    cross_entropy,
    cross_entropy_backward,
    dropout,
    dropout_backward,
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    mlp,
    mlp_backward,
    rms_norm,
    rms_norm_backward,
    swiglu,
    swiglu_backward,
)
from .linear import (
    DeltaRuleGrads,
    gated_delta_rule,
    gated_delta_rule_backward,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_recurrent_backward,
)
from .masks import causal_mask, window_mask
from .memory import (
    attention_backward_flops,
    attention_flops,
    causal_entries,
    kv_cache_bytes,
    latent_cache_bytes,
    linear_attention_state_bytes,
    paged_kv_cache_bytes,
    score_matrix_bytes,
)
from .mod_grads import Differentiable
from .model_parts import Experts, LatentAttention, LinearAttention
from .models import ModelShape
from .mods import (
    Alibi,
    RelativeBias,
    Softcap,
    alibi_slopes,
    and_masks,
    causal_mod,
    create_mask,
    document_ids,
    document_mod,
    noop_mask,
    or_masks,
    prefix_lm_mod,
    sliding_window_mod,
    varlen_mod,
)
from .multihead import MultiHeadAttention
from .optim import AdamW, accumulate_grads, accumulated_grads, clip_grad_norm, global_norm, warmup_cosine_lr
from .paged import PagedKVCache, PoolExhaustedError
from .paged_decode import cascade_decode, paged_decode
from .peaks import (
    attention_backward_bytes,
    flash_attention_backward_bytes,
    flash_attention_bytes,
    naive_attention_bytes,
    ring_attention_bytes,
)
from .position import (
    LearnedPositions,
    half_split_permutation,
    permute_qk_weight,
    rope,
    rope_attention_factor,
    rope_backward,
    rope_frequencies,
    to_half_split,
    to_interleaved,
)
from .presets import PRESETS
from .sampling import generate, sample_next
from .softmax import logsumexp, merge_states, softmax
from .sparse import index_topk, sparse_attention, sparse_attention_backward
from .splitkv import flash_decode, merge_chunks
from .text import embed, token_vector, tokenize
from .trainbill import TrainingMemory, training_memory
from .tune import tune, untune

__version__ = "0.1.0"

__all__ = [
    "DeltaRuleGrads",
    "GatedDeltaCache",
    "GatedDeltaNetSaved",
    "GatedDeltaNetShape",
    "GatedDeltaNetWeights",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_recurrent_backward",
    "gated_deltanet",
    "gated_deltanet_backward",
    "AdamW",
    "Alibi",
    "Attended",
    "AttentionMemoryError",
    "BlockMask",
    "DTYPES",
    "Differentiable",
    "Experts",
    "FlexGrads",
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "KVCache",
    "LatentSaved",
    "LatentAttention",
    "LearnedPositions",
    "LinearAttention",
    "ModelShape",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PRESETS",
    "PagedKVCache",
    "PoolExhaustedError",
    "RMS_EPS",
    "RelativeBias",
    "Softcap",
    "SparseLatentAttention",
    "Tile",
    "absorb_query",
    "TrainingMemory",
    "accumulate_grads",
    "accumulated_grads",
    "alibi_slopes",
    "best_unit",
    "and_masks",
    "attend_latent",
    "attention",
    "attention_backward",
    "attention_backward_bytes",
    "attention_backward_flops",
    "attention_flops",
    "bytes_per_element",
    "cascade_decode",
    "causal_entries",
    "causal_mask",
    "causal_mod",
    "clip_grad_norm",
    "create_block_mask",
    "create_mask",
    "decompress",
    "cross_entropy",
    "cross_entropy_backward",
    "document_ids",
    "document_mod",
    "draw_tile_plan",
    "dropout",
    "dropout_backward",
    "embed",
    "format_bytes",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_bytes",
    "flash_attention_backward_one_head",
    "flash_attention_bytes",
    "flash_attention_one_head",
    "flash_attention_varlen",
    "flash_decode",
    "flex_attention",
    "flex_attention_backward",
    "gelu",
    "gelu_backward",
    "generate",
    "global_norm",
    "half_split_permutation",
    "index_topk",
    "join_ukv",
    "kv_cache_bytes",
    "latent_softmax_scale",
    "layer_norm",
    "layer_norm_backward",
    "latent_cache_bytes",
    "linear_attention_state_bytes",
    "load_model_shape",
    "logsumexp",
    "merge_chunks",
    "merge_states",
    "mlp",
    "mlp_backward",
    "model_bill",
    "naive_attention_bytes",
    "noop_mask",
    "one_head",
    "or_masks",
    "paged_decode",
    "paged_kv_cache_bytes",
    "permute_qk_weight",
    "prefix_lm_mod",
    "ring_attention_bytes",
    "rms_norm",
    "rms_norm_backward",
    "rope",
    "rope_attention_factor",
    "rope_backward",
    "rope_frequencies",
    "sample_next",
    "scaled_dot_product_attention",
    "score_matrix_bytes",
    "shape_from_config",
    "sliding_window_mod",
    "softmax",
    "sparse_attention",
    "sparse_attention_backward",
    "split_ukv",
    "swiglu",
    "swiglu_backward",
    "tile_plan",
    "to_half_split",
    "to_interleaved",
    "to_unit",
    "token_vector",
    "tokenize",
    "training_memory",
    "tune",
    "untune",
    "varlen_block_mask",
    "varlen_mod",
    "warmup_cosine_lr",
    "window_mask",
]
