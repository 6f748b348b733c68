"""The presets: released models as ModelShapes, each written from its Hugging Face config.json the way the
config reader reads it. tests/test_presets.py checks num_parameters against the size in each comment, and
torch_crosscheck/test_torch_models.py against transformers' own model.
"""

from __future__ import annotations

from typing import Any

from .model_parts import Experts, LatentAttention, LinearAttention
from .models import ModelShape

__all__ = ["DEEPSEEK_V3_ROPE_SCALING", "LLAMA31_ROPE_SCALING", "PRESETS"]

# Llama 3.1's rope_scaling, as its config.json has it (every Llama 3.1 size shares it)
LLAMA31_ROPE_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# DeepSeek-V3's rope_scaling (config.json): YaRN from 4,096 to 163,840 positions, on the 64-wide rotary key
DEEPSEEK_V3_ROPE_SCALING: dict[str, Any] = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_ALTERNATING = ("sliding_attention", "full_attention")  # Gemma-2, gpt-oss: layers 0, 2, 4, ... slide

PRESETS: dict[str, ModelShape] = {
    # "Train a Tiny GPT at Home, Part 2": d_model 256, 4 heads of 64; its one attention block has
    # 4 · 256 · 256 = 262,144 weights (qkv 196,608 + out 65,536). No vocab or MLP in that part.
    "tiny": ModelShape(
        "tiny (article)",
        layers=1,
        heads=4,
        kv_heads=4,
        head_dim=64,
        hidden=256,
        vocab=0,
        intermediate=0,
        arch="attention",
    ),
    # huggingface.co/openai-community/gpt2/blob/main/config.json: n_layer 12, n_head 12, n_embd 768,
    # n_positions 1024, vocab_size 50257, n_inner null (4 · 768); tied. 124,439,808 parameters.
    "gpt2": ModelShape(
        "GPT-2 small",
        layers=12,
        heads=12,
        kv_heads=12,
        head_dim=64,
        hidden=768,
        vocab=50257,
        intermediate=3072,
        max_positions=1024,
        tied_embeddings=True,
        arch="gpt2",
        architecture="gpt2",
    ),
    # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json: 32 layers, 32 heads and 32 kv heads
    # (multi-head attention), hidden 4096, intermediate 11008, vocab 32000, max_position_embeddings 4096.
    # 6,738,415,616.
    "llama-2-7b": ModelShape(
        "Llama-2-7B",
        layers=32,
        heads=32,
        kv_heads=32,
        head_dim=128,
        hidden=4096,
        vocab=32000,
        intermediate=11008,
        max_positions=4096,
        rope_theta=10000.0,
        architecture="llama",
    ),
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 128256, max_position_embeddings 8192. 8,030,261,248.
    "llama-3-8b": ModelShape(
        "Llama-3-8B",
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        vocab=128256,
        intermediate=14336,
        max_positions=8192,
        rope_theta=500000.0,
        architecture="llama",
    ),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 80 layers, 64 heads, 8 kv heads,
    # hidden 8192, intermediate 28672, vocab 128256, max_position_embeddings 131072, rope_theta 500000,
    # rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, from 8,192). 70,553,706,496.
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B",
        layers=80,
        heads=64,
        kv_heads=8,
        head_dim=128,
        hidden=8192,
        vocab=128256,
        intermediate=28672,
        max_positions=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE_SCALING,
        architecture="llama",
    ),
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 32000, max_position_embeddings 32768, sliding_window 4096
    # on every layer. 7,241,732,096.
    "mistral-7b-v0.1": ModelShape(
        "Mistral-7B-v0.1",
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        vocab=32000,
        intermediate=14336,
        max_positions=32768,
        sliding_window=4096,
        rope_theta=10000.0,
        architecture="mistral",
    ),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json: 28 layers, 28 heads, 4 kv heads, hidden 3584,
    # intermediate 18944, vocab 152064, max_position_embeddings 131072, use_sliding_window false, untied;
    # Qwen2 puts a bias on q, k and v. 7,615,616,512.
    "qwen2.5-7b": ModelShape(
        "Qwen2.5-7B",
        layers=28,
        heads=28,
        kv_heads=4,
        head_dim=128,
        hidden=3584,
        vocab=152064,
        intermediate=18944,
        max_positions=131072,
        qkv_bias=True,
        rope_theta=1000000.0,
        architecture="qwen2",
    ),
    # huggingface.co/google/gemma-2-9b/blob/main/config.json: 42 layers, 16 heads, 8 kv heads,
    # head_dim 256 (not 3584 / 16 = 224), hidden 3584, intermediate 14336, vocab 256000,
    # max_position_embeddings 8192, sliding_window 4096 on every other layer, tied, 4 norms per layer.
    # 9,241,705,984.
    "gemma-2-9b": ModelShape(
        "Gemma-2-9B",
        layers=42,
        heads=16,
        kv_heads=8,
        head_dim=256,
        hidden=3584,
        vocab=256000,
        intermediate=14336,
        max_positions=8192,
        sliding_window=4096,
        layer_types=_ALTERNATING * 21,
        tied_embeddings=True,
        norms_per_layer=4,
        rope_theta=10000.0,
        architecture="gemma2",
    ),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json: 32 layers, 32 heads and
    # 32 kv heads of 96, hidden 3072, intermediate 8192, vocab 32064, max_position_embeddings 4096,
    # sliding_window 2047, untied. 3,821,079,552.
    "phi-3-mini": ModelShape(
        "Phi-3-mini",
        layers=32,
        heads=32,
        kv_heads=32,
        head_dim=96,
        hidden=3072,
        vocab=32064,
        intermediate=8192,
        max_positions=4096,
        sliding_window=2047,
        rope_theta=10000.0,
        architecture="phi3",
    ),
    # huggingface.co/tiiuae/falcon-7b/blob/main/config.json: 32 layers, 71 heads of 64 over one kv head
    # (multi_query), hidden 4544, a 2-matrix MLP of 4 · 4544, attention and MLP in parallel from one
    # LayerNorm, no biases, tied, vocab 65024; 2,048 positions (FalconConfig's default). 6,921,720,704.
    "falcon-7b": ModelShape(
        "Falcon-7B",
        layers=32,
        heads=71,
        kv_heads=1,
        head_dim=64,
        hidden=4544,
        vocab=65024,
        intermediate=18176,
        max_positions=2048,
        tied_embeddings=True,
        mlp="plain",
        norm="layer",
        norms_per_layer=1,
        parallel_block=True,
        rope_theta=10000.0,
        architecture="falcon",
    ),
    # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: Mistral-7B's attention, 8 experts
    # of 14336 on every layer, 2 per token, max_position_embeddings 32768, rope_theta 1e6, no window.
    # 46,702,792,704 in all, 12,879,925,248 active.
    "mixtral-8x7b": ModelShape(
        "Mixtral-8x7B",
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        hidden=4096,
        vocab=32000,
        intermediate=14336,
        max_positions=32768,
        rope_theta=1000000.0,
        architecture="mixtral",
        layer_types=("full_attention",) * 32,
        experts=Experts(8, 2, 14336, tuple(range(32))),
    ),
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers, 128 heads of latent
    # attention (kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, qk_nope_head_dim 128,
    # v_head_dim 128), hidden 7168, vocab 129280; the first 3 layers dense (intermediate 18432), then
    # 256 routed experts of 2048, 8 per token, and 1 shared; max_position_embeddings 163840 (YaRN);
    # fp8 weights; one MTP layer. 671,026,404,352 in all (the "671B"), 37,552,282,624 active ("37B").
    "deepseek-v3": ModelShape(
        "DeepSeek-V3",
        layers=61,
        heads=128,
        kv_heads=128,
        head_dim=192,
        hidden=7168,
        vocab=129280,
        intermediate=18432,
        max_positions=163840,
        rope_theta=10000.0,
        rope_scaling=DEEPSEEK_V3_ROPE_SCALING,
        architecture="deepseek_v3",
        latent=LatentAttention(512, 64, 128, 128, q_rank=1536),
        experts=Experts(256, 8, 2048, tuple(range(3, 61)), shared_intermediate=2048),
        quantization="fp8",
        notes=(
            "1 multi-token-prediction layer(s) (num_nextn_predict_layers) not counted: transformers does not "
            "build them",
            "the checkpoint stores its weights quantized (fp8): the bill's bytes are for the dtype asked",
        ),
    ),
    # transformers' GptOssConfig defaults, which are gpt-oss-120b: 36 layers, 64 heads of 64 over 8 kv
    # heads with sinks and biases, windows of 128 on every other layer, 128 experts of 2880 with biases,
    # 4 per token; YaRN to 131072 positions. 116,829,156,672 in all, 5,711,982,912 active.
    "gpt-oss-120b": ModelShape(
        "gpt-oss-120b",
        layers=36,
        heads=64,
        kv_heads=8,
        head_dim=64,
        hidden=2880,
        vocab=201088,
        intermediate=2880,
        max_positions=131072,
        sliding_window=128,
        layer_types=_ALTERNATING * 18,
        qkv_bias=True,
        out_bias=True,
        sinks=True,
        rope_theta=150000.0,
        architecture="gpt_oss",
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        experts=Experts(128, 4, 2880, tuple(range(36)), router_bias=True, expert_bias=True),
    ),
    # transformers' Llama4TextConfig defaults, which are Llama-4-Scout-17B-16E's text model: 48 layers,
    # 40 heads over 8 kv heads of 128, 3 of every 4 layers chunked attention of 8192, 16 experts of 8192
    # and one shared, 1 per token, on every layer. 107,769,861,120 in all, 17,172,894,720 active.
    "llama-4-scout": ModelShape(
        "Llama-4-Scout",
        layers=48,
        heads=40,
        kv_heads=8,
        head_dim=128,
        hidden=5120,
        vocab=202048,
        intermediate=16384,
        max_positions=131072,
        rope_theta=500000.0,
        architecture="llama4_text",
        qk_norm="l2",
        attention_chunk=8192,
        layer_types=(("chunked_attention",) * 3 + ("full_attention",)) * 12,
        experts=Experts(16, 1, 8192, tuple(range(48)), shared_intermediate=8192),
        notes=("the language model only (text_config): the other towers are not counted",),
    ),
    # transformers' Qwen3NextConfig defaults, which are Qwen3-Next-80B-A3B: 48 layers, 3 of every 4 gated
    # DeltaNet (16 key heads, 32 value heads of 128, convolution of 4), every 4th full attention (16
    # heads over 2 kv heads of 256, with an output gate), 512 experts of 512, 10 per token, one shared.
    # 79,674,391,296 in all.
    "qwen3-next-80b-a3b": ModelShape(
        "Qwen3-Next-80B-A3B",
        layers=48,
        heads=16,
        kv_heads=2,
        head_dim=256,
        hidden=2048,
        vocab=151936,
        intermediate=5632,
        max_positions=32768,
        rope_theta=10000.0,
        rope_scaling={"partial_rotary_factor": 0.25, "rope_type": "default"},
        architecture="qwen3_next",
        qk_norm="head",
        attention_gate=True,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 12,
        linear=LinearAttention("gated_deltanet", 16, 32, 128, 128, conv_kernel=4),
        experts=Experts(512, 10, 512, tuple(range(48)), shared_intermediate=512, shared_gate=True),
    ),
}
