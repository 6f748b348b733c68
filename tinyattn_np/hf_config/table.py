"""Every model_type the reader knows, as transformers' modeling files build it: one row each.

A row says how the block is built where it differs from Llama's (RMSNorm x 2, a gated MLP, RoPE, no
biases): each switch a constant or the config field that turns it on (a Rule), the reader of the experts
and of what one architecture alone has, and the weights only it has, as formulas (formulas.py). A field
config.json leaves out takes the default of the model_type's config class (defaults.py). Each row is checked
to the parameter against transformers' model in torch_crosscheck/test_torch_architectures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import Rule

__all__ = ["ARCHITECTURES", "NO_MODEL_TYPE", "Arch", "Moe", "Part"]


@dataclass(frozen=True)
class Part:
    """Weights one architecture alone has: what, where (model_parts.EXTRA_PLACES or a layer kind), how many
    per such layer (a formula), and the numbers of state a sequence keeps there (a formula)."""

    what: str
    where: str
    parameters: str = "0"
    state: str = "0"


@dataclass(frozen=True)
class Moe:
    """How a config names its experts: each a field (or its spellings), read by experts.py.

    layers: which layers route. "every"; "dense_first" (from the `dense` field's count on, every `every`-th);
    "qwen" (all but mlp_only_layers, every decoder_sparse_step-th); "llama4" (moe_layers, else every
    interleave_moe_layer_step-th); "ernie" (moe_layer_start_index .. moe_layer_end_index, every
    moe_layer_interval-th); "period" (Jamba: every expert_layer_period-th from expert_layer_offset).
    Shared experts: shared_count of them, each shared_width wide (None: the experts' width), or one of
    shared_width where shared_count is None.
    """

    count: tuple[str, ...]
    width: str | None = "moe_intermediate_size"  # None: the model's intermediate_size
    per_token: tuple[str, ...] = ("num_experts_per_tok",)
    layers: str = "every"
    dense: str = "first_k_dense_replace"
    every: str | None = None
    shared_count: str | None = None
    shared_width: str | None = None
    shared_gate: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    score_bias: bool = False  # a per-expert correction of the routing scores that is a parameter
    gated: bool = True
    dense_width: str | None = None  # the dense layers' MLP width, where it is not intermediate_size


@dataclass(frozen=True)
class Arch:
    """How one model_type builds its layers, where it differs from Llama's."""

    mlp: str = "gated"  # "gated" (gate, up, down), "plain" (up, down), "none"
    norm: str = "rms"  # "rms", "layer" (with bias), "layer_weight" (no bias), "none" (no weights)
    norms: int = 2  # norms per layer (one more at the end)
    qkv_bias: Rule = False
    out_bias: Rule = False
    mlp_bias: Rule = False
    lm_head_bias: Rule = False
    qk_norm: tuple[Rule, str] | None = None  # (the rule that switches it, its kind)
    parallel: Rule = False
    sinks: Rule = False
    attention_gate: Rule = False  # q twice as wide: its second half gates the output
    positions: str = "rope"  # "rope", "learned" (a table of max_position_embeddings rows), "alibi", "none"
    windows: str = "none"  # which layers slide when the config has no layer_types (layer_kinds.py)
    moe: Moe | None = None
    special: tuple[str, ...] = ()  # readers of their own, for what no other architecture has (special.py)
    names: tuple[tuple[str, ...], ...] = ()  # (field, its spellings ...): GPT-2's n_layer, Falcon's n_head
    kv_heads: bool = True  # reads num_key_value_heads (GPT-2 and GPT-NeoX have none)
    off: tuple[str, ...] = ()  # fields the class has and builds nothing with: read only when false, 0 or null
    extras: tuple[Part, ...] = ()
    unbilled: tuple[str, ...] = ()  # fields of this class only that change no weight and no cache


QKVO: dict[str, Any] = dict(qkv_bias="attention_bias", out_bias="attention_bias")
ALL_BIAS: dict[str, Any] = dict(qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias")
# (field, how this architecture spells it ...): GPT-2's own names, Falcon's old ones and its ffn_hidden_size
GPT2_NAMES = (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"), ("hidden_size", "n_embd"),
              ("max_position_embeddings", "n_positions"), ("intermediate_size", "n_inner"))  # fmt: skip
FALCON_NAMES = (("num_hidden_layers", "num_hidden_layers", "n_layer"),
                ("num_attention_heads", "num_attention_heads", "n_head"), ("hidden_size", "hidden_size", "n_embed"),
                ("intermediate_size", "ffn_hidden_size"))  # fmt: skip

MIXTRAL = Moe(("num_local_experts", "num_experts"), width=None)
QWEN = Moe(("num_experts", "num_local_experts"), layers="qwen", shared_width="shared_expert_intermediate_size",
           shared_gate=True)  # fmt: skip
DEEPSEEK = Moe(("n_routed_experts",), layers="dense_first", shared_count="n_shared_experts")
GPT_OSS = Moe(("num_local_experts",), width=None, router_bias=True, expert_bias=True)
LLAMA4 = Moe(("num_local_experts",), width=None, layers="llama4", shared_width="intermediate_size",
             dense_width="intermediate_size_mlp")  # fmt: skip
ERNIE = Moe(("moe_num_experts",), per_token=("moe_k",), layers="ernie", shared_count="moe_num_shared_experts",
            score_bias=True)  # fmt: skip

ARCHITECTURES: dict[str, Arch] = {
    "llama":        Arch(**QKVO, mlp_bias="mlp_bias"),
    "granite":      Arch(**QKVO, mlp_bias="mlp_bias"),
    "smollm3":      Arch(**QKVO, mlp_bias="mlp_bias", windows="nope"),
    "mistral":      Arch(windows="every"),
    "mixtral":      Arch(windows="every", moe=MIXTRAL),
    "minimax":      Arch(windows="minimax", moe=MIXTRAL, special=("lightning",)),
    "granitemoe":   Arch(**QKVO, moe=MIXTRAL),
    "olmoe":        Arch(**QKVO, qk_norm=(True, "per_head"), moe=MIXTRAL),
    "gpt_oss":      Arch(**QKVO, sinks=True, windows="alternate", moe=GPT_OSS),
    "qwen2":        Arch(qkv_bias=True, windows="qwen2"),
    "qwen2_moe":    Arch(qkv_bias="qkv_bias", windows="qwen2_moe", moe=QWEN),
    "qwen3":        Arch(**QKVO, qk_norm=(True, "head"), windows="qwen2"),
    "qwen3_moe":    Arch(**QKVO, qk_norm=(True, "head"), windows="switched", moe=QWEN),
    "qwen3_next":   Arch(**QKVO, qk_norm=(True, "head"), attention_gate=True, windows="qwen3_next", moe=QWEN,
                         special=("gated_deltanet",)),
    "gemma":        Arch(**QKVO),
    "gemma2":       Arch(**QKVO, norms=4, windows="alternate"),
    "gemma3_text":  Arch(**QKVO, norms=4, qk_norm=(True, "head"), windows="pattern6"),
    "cohere":       Arch(**QKVO, norm="layer_weight", norms=1, parallel=True, qk_norm=("use_qk_norm", "per_head")),
    "cohere2":      Arch(**QKVO, norm="layer_weight", norms=1, parallel=True, windows="pattern4"),
    "phi":          Arch(mlp="plain", norm="layer", norms=1, qkv_bias=True, out_bias=True, mlp_bias=True,
                         lm_head_bias=True, parallel=True, qk_norm=("qk_layernorm", "head_bias")),
    "phi3":         Arch(windows="every", off=("attention_bias",)),
    "gpt2":         Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned",
                         names=GPT2_NAMES, kv_heads=False),
    "olmo":         Arch(**QKVO, norm="none"),
    "olmo2":        Arch(**QKVO, qk_norm=(True, "per_head")),
    "stablelm":     Arch(norm="layer", qkv_bias="use_qkv_bias", qk_norm=("qk_layernorm", "per_head"),
                         parallel="use_parallel_residual", special=("stablelm",)),
    "glm4":         Arch(qkv_bias="attention_bias", norms=4),
    "exaone4":      Arch(qk_norm=(True, "head"), windows="exaone4"),
    "starcoder2":   Arch(mlp="plain", norm="layer", **ALL_BIAS, windows="every"),
    "gpt_neox":     Arch(mlp="plain", norm="layer", **QKVO, mlp_bias=True, parallel="use_parallel_residual",
                         kv_heads=False),
    "falcon":       Arch(mlp="plain", norm="layer", qkv_bias="bias", out_bias="bias", mlp_bias="bias",
                         names=FALCON_NAMES, special=("falcon",), kv_heads=False),
    "deepseek_v2":  Arch(mlp_bias="mlp_bias", moe=DEEPSEEK, special=("latent",), unbilled=("moe_layer_freq",)),
    "deepseek_v3":  Arch(moe=DEEPSEEK, special=("latent",), unbilled=("moe_layer_freq",)),
    "kimi_k2":      Arch(moe=DEEPSEEK, special=("latent",), unbilled=("moe_layer_freq",)),  # DeepSeek-V3's layers
    "llama4_text":  Arch(**QKVO, qk_norm=("use_qk_norm", "l2"), windows="llama4", moe=LLAMA4),
    "ernie4_5":     Arch(**ALL_BIAS),
    "ernie4_5_moe": Arch(**ALL_BIAS, lm_head_bias="use_bias", moe=ERNIE),
}  # fmt: skip

# a config without model_type: read as Llama, sliding windows and layer_types as written
NO_MODEL_TYPE = Arch(**QKVO, mlp_bias="mlp_bias", windows="every")
