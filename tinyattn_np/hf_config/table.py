"""Every model_type the reader knows, as transformers' modeling files build them: one row each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import Rule, shown_value

__all__ = ["ARCHITECTURES", "Arch", "NO_MODEL_TYPE", "known", "refuse", "spellings"]


@dataclass(frozen=True)
class Arch:
    """How one model_type builds its layers, each switch a Rule."""

    mlp: str = "gated"
    norm: str = "rms"
    norms_per_layer: int = 2
    tied: bool = False  # the config class's tie_word_embeddings when config.json leaves it out
    qkv_bias: Rule = False
    out_bias: Rule = False
    mlp_bias: Rule = False
    lm_head_bias: Rule = False
    qk_norm: tuple[Rule, str] | None = None  # (the rule that switches it, its kind)
    parallel: Rule = False
    windows: str = "none"  # which layers slide when the config has no layer_types (_default_layer_types)
    moe: str | None = None  # how the config names its experts (MOE_READERS)
    special: str | None = None  # a reader of its own for what no other architecture has (SPECIAL_READERS)
    sinks: bool = False
    attention_gate: bool = False
    names: tuple[tuple[str, ...], ...] = ()  # (field, its spellings ...): GPT-2's and Falcon's names
    kv_heads: bool = True  # reads num_key_value_heads (GPT-2 and GPT-NeoX have none; Falcon has its own)
    off: tuple[str, ...] = ()  # fields the class has but ignores: read only when false, 0 or null


_QKVO: dict[str, Any] = dict(qkv_bias="attention_bias", out_bias="attention_bias")


_USE_BIAS = ("use_bias", True)  # StarCoder2


# (field, how this architecture spells it ...): GPT-2's own names, Falcon's old ones and its ffn_hidden_size
_GPT2_NAMES = (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"), ("hidden_size", "n_embd"),
               ("max_position_embeddings", "n_positions"), ("intermediate_size", "n_inner"))  # fmt: skip


_FALCON_NAMES = (("num_hidden_layers", "num_hidden_layers", "n_layer"),
                 ("num_attention_heads", "num_attention_heads", "n_head"), ("hidden_size", "hidden_size", "n_embed"),
                 ("intermediate_size", "ffn_hidden_size"))  # fmt: skip


# model_type -> its rules; each line checked to the parameter against transformers' model in
# torch_crosscheck/test_torch_models.py (the class defaults, which are released models, and variants)
ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch(**_QKVO, mlp_bias="mlp_bias"),
    "granite": Arch(**_QKVO, mlp_bias="mlp_bias"),
    "smollm3": Arch(**_QKVO, mlp_bias="mlp_bias", tied=True, windows="nope"),
    "mistral": Arch(windows="every"),
    "mixtral": Arch(windows="every", moe="mixtral"),
    "minimax": Arch(windows="minimax", moe="mixtral", special="lightning"),
    "granitemoe": Arch(**_QKVO, moe="mixtral"),
    "olmoe": Arch(**_QKVO, qk_norm=(True, "per_head"), moe="mixtral"),
    "gpt_oss": Arch(qkv_bias=("attention_bias", True), out_bias=("attention_bias", True), sinks=True,
                     windows="alternate", moe="gpt_oss"),
    "qwen2": Arch(qkv_bias=True, windows="qwen2"),
    "qwen2_moe": Arch(qkv_bias=("qkv_bias", True), windows="qwen2_moe", moe="qwen"),
    "qwen3": Arch(**_QKVO, qk_norm=(True, "head"), windows="qwen2"),
    "qwen3_moe": Arch(**_QKVO, qk_norm=(True, "head"), windows="switched", moe="qwen"),
    "qwen3_next": Arch(**_QKVO, qk_norm=(True, "head"), attention_gate=True, windows="qwen3_next", moe="qwen",
                        special="gated_deltanet"),
    "gemma": Arch(**_QKVO, tied=True),
    "gemma2": Arch(**_QKVO, tied=True, norms_per_layer=4, windows="alternate"),
    "gemma3_text": Arch(**_QKVO, tied=True, norms_per_layer=4, qk_norm=(True, "head"), windows="pattern6"),
    "cohere": Arch(**_QKVO, norm="layer_weight", norms_per_layer=1, tied=True, parallel=True,
                    qk_norm=("use_qk_norm", "per_head")),
    "cohere2": Arch(**_QKVO, norm="layer_weight", norms_per_layer=1, tied=True, parallel=True, windows="pattern4"),
    "phi": Arch(mlp="plain", norm="layer", norms_per_layer=1, qkv_bias=True, out_bias=True, mlp_bias=True,
                 lm_head_bias=True, parallel=True, qk_norm=("qk_layernorm", "head_bias")),
    "phi3": Arch(windows="every", off=("attention_bias",)),
    "gpt2": Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, tied=True, names=_GPT2_NAMES,
                  kv_heads=False),
    "olmo": Arch(**_QKVO, norm="none"),
    "olmo2": Arch(**_QKVO, qk_norm=(True, "per_head")),
    "stablelm": Arch(norm="layer", qkv_bias="use_qkv_bias", qk_norm=("qk_layernorm", "per_head"),
                      parallel="use_parallel_residual", special="stablelm"),
    "glm4": Arch(qkv_bias=("attention_bias", True), norms_per_layer=4),
    "exaone4": Arch(qk_norm=(True, "head"), windows="exaone4"),
    "starcoder2": Arch(mlp="plain", norm="layer", qkv_bias=_USE_BIAS, out_bias=_USE_BIAS, mlp_bias=_USE_BIAS,
                        tied=True, windows="every"),
    "gpt_neox": Arch(mlp="plain", norm="layer", qkv_bias=("attention_bias", True), out_bias=("attention_bias", True),
                      mlp_bias=True, parallel=("use_parallel_residual", True), kv_heads=False),
    "falcon": Arch(mlp="plain", norm="layer", qkv_bias="bias", out_bias="bias", mlp_bias="bias", tied=True,
                    names=_FALCON_NAMES, special="falcon", kv_heads=False),
    "deepseek_v2": Arch(mlp_bias="mlp_bias", moe="deepseek", special="latent"),
    "deepseek_v3": Arch(moe="deepseek", special="latent"),
    "kimi_k2": Arch(moe="deepseek", special="latent"),  # Kimi K2: DeepSeek-V3's layers (DeepseekV3ForCausalLM)
    "llama4_text": Arch(**_QKVO, qk_norm=(("use_qk_norm", True), "l2"), windows="llama4", moe="llama4"),
    "ernie4_5": Arch(qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias", tied=True),
    "ernie4_5_moe": Arch(qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias", lm_head_bias="use_bias",
                          tied=True, moe="ernie"),
}  # fmt: skip


# a config without model_type: read as Llama, sliding windows and layer_types as written
NO_MODEL_TYPE = Arch(**_QKVO, mlp_bias="mlp_bias", windows="every")


def known() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def refuse(field: str, value: Any, model_type: str, why: str) -> ValueError:
    return ValueError(
        f"config field {field!r} = {shown_value(value)} {why} for model_type {model_type!r}; the reader knows "
        f"{known()} (and a config without model_type, read as Llama). A bill that guessed could be wrong."
    )


def spellings(arch: Arch, field: str) -> tuple[str, ...]:
    """The spellings of a field in this architecture's config.json (GPT-2's n_layer for num_hidden_layers)."""
    for field_and_spellings in arch.names:
        if field_and_spellings[0] == field:
            return field_and_spellings[1:]
    return (field,)
