"""models.py's bill against transformers' own models: the parameter count of every architecture the reader
knows, to the parameter, and the bytes transformers' cache holds after a forward, to the byte.

Parameters: transformers' config classes default to released models (LlamaConfig is LLaMA-7B, DeepseekV3Config
is DeepSeek-V3, GptOssConfig is gpt-oss-120b, ...). Each is built on the meta device, which allocates nothing,
and sum(p.numel()) compared with shape_from_config(config.to_dict()).num_parameters; then small variants that
switch on what the defaults leave off (biases, q/k norms, Falcon's new decoder, MoE layer patterns, ...).

Cache: a forward of T tokens through a small random model of each kind (full, sliding, chunked, MoE, latent,
linear), below and above its window, and the bytes of every tensor its cache then holds. transformers keeps
W - 1 tokens of a window layer between steps (DynamicSlidingWindowLayer: the next step's own token makes W),
where the bill counts the W a step attends to: one token less per window layer, once the window is full.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tinyattn_np.hf_config import ARCHITECTURES, shape_from_config  # noqa: E402
from tinyattn_np.presets import PRESETS  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)  # the small configs' token ids are outside their vocab

# the model types this file has checked from the start, as transformers names its config (Kimi K2 is
# DeepSeek-V3's class); test_torch_architectures.py walks every one the reader knows
MODEL_TYPES = sorted(
    set(
        """
    cohere cohere2 deepseek_v2 deepseek_v3 ernie4_5 ernie4_5_moe exaone4 falcon gemma gemma2 gemma3_text glm4 gpt2
    gpt_neox gpt_oss granite granitemoe llama llama4_text minimax mistral mixtral olmo olmo2 olmoe phi phi3 qwen2
    qwen2_moe qwen3 qwen3_moe qwen3_next smollm3 stablelm starcoder2
""".split()
    )
    & set(ARCHITECTURES)
)
SMALL = dict(
    num_hidden_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=100,
    pad_token_id=0,
)
NO_KV = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=100)  # GPT-NeoX, Falcon
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("llama", dict(SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    ("qwen2", dict(SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=3)),
    ("qwen2_moe", dict(SMALL, mlp_only_layers=[0, 5], decoder_sparse_step=2, qkv_bias=False)),
    ("qwen3", dict(SMALL, attention_bias=True, head_dim=32)),
    ("qwen3_moe", dict(SMALL, mlp_only_layers=[1], decoder_sparse_step=2, attention_bias=True)),
    ("qwen3_next", dict(SMALL, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=12, linear_conv_kernel_dim=3, mlp_only_layers=[2], attention_bias=True)),
    ("stablelm", dict(SMALL, qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=True)),
    ("cohere", dict(SMALL, use_qk_norm=True, attention_bias=True)),
    ("cohere2", dict(SMALL, attention_bias=True)),
    ("phi", dict(SMALL, qk_layernorm=True, tie_word_embeddings=True)),
    ("falcon", dict(NO_KV, new_decoder_architecture=True, num_kv_heads=2, bias=True, ffn_hidden_size=80)),
    ("falcon", dict(NO_KV, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1)),
    ("falcon", dict(NO_KV, multi_query=False, parallel_attn=False, bias=True, alibi=True)),
    ("gpt_neox", dict(NO_KV, intermediate_size=96, use_parallel_residual=False, attention_bias=False)),
    ("starcoder2", dict(SMALL, use_bias=False)),
    ("llama4_text", dict(SMALL, interleave_moe_layer_step=2, moe_layers=None, use_qk_norm=False, attention_bias=True)),
    ("ernie4_5", dict(SMALL, use_bias=True)),
    ("ernie4_5_moe", dict(SMALL, use_bias=True, moe_layer_interval=2, moe_num_shared_experts=0)),
    ("deepseek_v3", dict(SMALL, q_lora_rank=None, attention_bias=True, first_k_dense_replace=2)),
    ("deepseek_v2", dict(SMALL, mlp_bias=True, first_k_dense_replace=1, attention_bias=True)),
    ("gemma2", dict(SMALL, attention_bias=True, head_dim=16)),
    ("gemma3_text", dict(SMALL, attention_bias=True)),
    ("olmo", dict(SMALL, attention_bias=True)),
    ("olmo2", dict(SMALL, attention_bias=True)),
    ("olmoe", dict(SMALL, attention_bias=True)),
    ("glm4", dict(SMALL, attention_bias=False)),
    ("exaone4", dict(SMALL, sliding_window=16, sliding_window_pattern=2)),
    ("gpt_oss", dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, attention_bias=False)),
    ("mixtral", dict(SMALL, sliding_window=32)),
    ("minimax", dict(SMALL)),
    ("granite", dict(SMALL, attention_bias=True, mlp_bias=True)),
    ("smollm3", dict(SMALL, attention_bias=True, mlp_bias=True, use_sliding_window=True, sliding_window=16)),
    ("gpt2", dict(n_layer=3, n_embd=64, n_head=4, n_inner=100, vocab_size=100, n_positions=50)),
]  # fmt: skip
# the presets transformers' classes default to (or whose parameters they share): same count, to the parameter
PRESET_TYPES = {
    "gpt2": "gpt2",
    "llama-2-7b": "llama",
    "mistral-7b-v0.1": "mistral",
    "phi-3-mini": "phi3",
    "falcon-7b": "falcon",
    "mixtral-8x7b": "mixtral",
    "deepseek-v3": "deepseek_v3",
    "gpt-oss-120b": "gpt_oss",
    "llama-4-scout": "llama4_text",
    "qwen3-next-80b-a3b": "qwen3_next",
}


def transformers_parameters(config: Any) -> int:
    """sum(p.numel()) of transformers' model for config, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def read(config: Any) -> Any:
    """Our shape from the config's dict, through JSON as a config.json would come."""
    return shape_from_config(json.loads(json.dumps(config.to_dict())))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_parameters_of_every_default_config_equal_transformers(model_type: str) -> None:
    config = AutoConfig.for_model(model_type)
    shape = read(config)
    assert shape.architecture == model_type
    assert shape.num_parameters == transformers_parameters(config), shape.describe()


def test_at_least_25_architectures() -> None:
    assert len(MODEL_TYPES) >= 25


@pytest.mark.parametrize(("model_type", "sizes"), VARIANTS, ids=[f"{t}-{i}" for i, (t, _) in enumerate(VARIANTS)])
def test_parameters_of_variants_equal_transformers(model_type: str, sizes: dict[str, Any]) -> None:
    config = AutoConfig.for_model(model_type, **sizes)
    assert read(config).num_parameters == transformers_parameters(config)


@pytest.mark.parametrize("preset", sorted(PRESET_TYPES))
def test_presets_equal_transformers(preset: str) -> None:
    assert PRESETS[preset].num_parameters == transformers_parameters(AutoConfig.for_model(PRESET_TYPES[preset]))


# --- the cache -------------------------------------------------------------------------------------------

WINDOW = 8
CACHE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("llama", dict(SMALL, num_hidden_layers=3)),
    "sliding": ("mistral", dict(SMALL, num_hidden_layers=3, sliding_window=WINDOW)),
    "alternating": ("gemma2", dict(SMALL, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW)),
    "chunked": ("llama4_text", dict(SMALL, num_hidden_layers=4, head_dim=16, attention_chunk_size=WINDOW,
                                    num_local_experts=4, intermediate_size_mlp=64)),
    "moe": ("qwen3_moe", dict(SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32)),
    "latent": ("deepseek_v3", dict(SMALL, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16,
                                   q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
                                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   first_k_dense_replace=1, n_group=1, topk_group=1)),
    "linear": ("qwen3_next", dict(SMALL, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16)),
    "lightning": ("minimax", dict(SMALL, num_hidden_layers=4, num_local_experts=4)),
}  # fmt: skip


def held_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds: keys, values, conv and recurrent states, MiniMax's."""
    tensors = []
    for layer in cache.layers:
        tensors += [getattr(layer, name, None) for name in ("keys", "values")]
        for name in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, name, None) or {}).values())
    tensors += list(getattr(cache, "linear_cache", []))
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def forward(model_type: str, sizes: dict[str, Any], tokens: int, batch: int) -> tuple[Any, Any, Any]:
    """(config, model, the cache after a forward of `tokens` random tokens): float32, eval mode."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **sizes)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, config.vocab_size, (batch, tokens))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return config, model, out.past_key_values if getattr(out, "cache", None) is None else out.cache


@pytest.mark.parametrize("tokens", [WINDOW - 3, WINDOW, 2 * WINDOW + 3])
@pytest.mark.parametrize("kind", sorted(CACHE_CASES))
def test_cache_bytes_equal_what_transformers_holds(kind: str, tokens: int) -> None:
    model_type, sizes = CACHE_CASES[kind]
    config, _, cache = forward(model_type, sizes, tokens, batch=2)
    shape = read(config)
    # transformers keeps W - 1 tokens of a full window: one token less than the bill, per window layer
    per_token = shape.kv_bytes_per_token("fp32")
    windows = {"sliding_attention": shape.sliding_window, "chunked_attention": shape.attention_chunk}
    fewer = sum(2 * per_token.get(kind, 0) for kind, window in windows.items() if window and tokens >= window)
    assert held_bytes(cache) == shape.cache_bytes(tokens, "fp32", batch=2) - fewer, shape.describe()


@pytest.mark.parametrize("tokens", [5, 13])
def test_latent_cache_and_its_decompressed_heads(tokens: int) -> None:
    """transformers caches the latent (c_KV and k_R); the keys and values its expand_kv builds from it are
    what a naive implementation would cache: kv_cache_bytes(decompressed=True)."""
    config, model, cache = forward(*CACHE_CASES["latent"], tokens=tokens, batch=2)
    shape = read(config)
    assert held_bytes(cache) == shape.kv_cache_bytes(tokens, "fp32", batch=2)
    heads = 0
    for layer, block in zip(cache.layers, model.model.layers, strict=True):
        keys, values = block.self_attn.expand_kv(layer.keys, layer.values)
        heads += sum(t.numel() * t.element_size() for t in (keys, values))
    assert heads == shape.kv_cache_bytes(tokens, "fp32", batch=2, decompressed=True)
    # 4 heads of keys 8 + 4 and values 6 against one latent of 16 + 4: 72 numbers a token and layer for 20
    assert heads * (16 + 4) == held_bytes(cache) * 4 * (8 + 4 + 6)


# --- what the reader does not know ------------------------------------------------------------------------


def test_a_field_the_architecture_does_not_have_is_refused() -> None:
    """Experts in a Llama config: transformers' Llama would build no experts, and a bill that counted them, or
    not, could be wrong either way."""
    config = {**AutoConfig.for_model("llama", **SMALL).to_dict(), "num_local_experts": 8}
    with pytest.raises(
        ValueError,
        match=r"'num_local_experts' = 8 would change the bill and is not understood for "
        r"model_type 'llama'; a bill that guessed could be wrong",
    ):
        shape_from_config(json.loads(json.dumps(config)))
