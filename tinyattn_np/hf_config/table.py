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

__all__ = ["ARCHITECTURES", "NO_MODEL_TYPE", "TEXT_CONFIG", "Arch", "Moe", "Part"]


@dataclass(frozen=True)
class Part:
    """Weights one architecture alone has: what, where (model_parts.EXTRA_PLACES or a layer kind), how many
    per such layer (a formula), the numbers of state a sequence keeps there (a formula), and the Rule that
    switches it on."""

    what: str
    where: str
    parameters: str = "0"
    state: str = "0"
    when: Rule = True  # a part some configs switch on
    active: bool = True  # False: weights a token does not run


@dataclass(frozen=True)
class Moe:
    """How a config names its experts: each a field (or its spellings), read by experts.py.

    layers: which layers route. "every" (every layer, or every `every`-th from layer 0); "dense_first" (from the
    `dense` field's count on, every `every`-th); "qwen" (all but mlp_only_layers, every decoder_sparse_step-th);
    "llama4" (moe_layers, else every interleave_moe_layer_step-th); "ernie" (moe_layer_start_index ..
    moe_layer_end_index, every moe_layer_interval-th); "period" (Jamba: every expert_layer_period-th from
    expert_layer_offset).
    Shared experts: shared_count of them, each shared_width wide (None: the experts' width), or one of
    shared_width where shared_count is None.
    """

    count: tuple[str, ...]
    width: str | None = "moe_intermediate_size"  # None: the model's intermediate_size
    per_token: tuple[str, ...] = ("num_experts_per_tok",)
    layers: str = "every"
    dense: str = "first_k_dense_replace"
    every: str | int | None = None  # a field, or a constant
    shared_count: str | None = None
    shared_width: str | None = None
    shared_gate: bool = False
    router_bias: Rule = False
    expert_bias: bool = False
    score_bias: Rule = False  # a per-expert correction of the routing scores that is a parameter
    gated: bool = True
    dense_width: str | None = None  # the dense layers' MLP width, where it is not intermediate_size
    dense_first: int | None = None  # "mlp_layer_types": the leading dense layers where the config lists none
    beside_mlp: bool = False  # the layers keep their dense MLP beside the experts


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
    positions: str = "rope"  # "rope", "learned" (a table of max_position_embeddings rows), "alibi", "sinusoidal"
    multi_query: Rule = False  # one kv head for every query head
    intermediate: str | None = None  # the MLP's width, a formula, where the config names it otherwise
    head_dim: str = "C // Hq"  # the heads' width where the config gives no head_dim, a formula
    rotary_dim: bool = False  # RoPE turns rotary_dim channels of each head (GPT-J)
    attention: bool = True  # False: no attention at all (Mamba), so no heads to read
    tied: Rule = "tie_word_embeddings"  # the output head is the token table (False: never, whatever the config)
    layers_from: str | None = None  # a list whose length is the layer count (Nemotron-H: num_hidden_layers ignored)
    sublayers: int = 1  # layers of the bill in each layer of the config (LongCat-Flash: two attentions a layer)
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
GPT2_NAMES = (
    ("num_hidden_layers", "n_layer"),
    ("num_attention_heads", "n_head"),
    ("hidden_size", "n_embd"),
    ("max_position_embeddings", "n_positions"),
    ("intermediate_size", "n_inner"),
)
HF_GPT_NAMES = (
    ("num_hidden_layers", "n_layer"),
    ("num_attention_heads", "n_head"),
    ("hidden_size", "n_embd"),
    ("max_position_embeddings", "n_positions"),
)
FALCON_NAMES = (
    ("num_hidden_layers", "num_hidden_layers", "n_layer"),
    ("num_attention_heads", "num_attention_heads", "n_head"),
    ("hidden_size", "hidden_size", "n_embed"),
    ("intermediate_size", "ffn_hidden_size"),
)

MIXTRAL = Moe(("num_local_experts", "num_experts"), width=None)
QWEN = Moe(
    ("num_experts", "num_local_experts"),
    layers="qwen",
    shared_width="shared_expert_intermediate_size",
    shared_gate=True,
)
DEEPSEEK = Moe(("n_routed_experts",), layers="dense_first", shared_count="n_shared_experts")
MLA_MOE = Moe(("n_routed_experts",), layers="mlp_layer_types", shared_count="n_shared_experts")
GRANITE_MOE = Moe(("num_local_experts",), width=None, shared_width="shared_intermediate_size")
GPT_OSS = Moe(("num_local_experts",), width=None, router_bias=True, expert_bias=True)
LLAMA4 = Moe(
    ("num_local_experts",),
    width=None,
    layers="llama4",
    shared_width="intermediate_size",
    dense_width="intermediate_size_mlp",
)
ERNIE = Moe(
    ("moe_num_experts",), per_token=("moe_k",), layers="ernie", shared_count="moe_num_shared_experts", score_bias=True
)

XIELU = Part("xIELU's α_p and α_n", "every layer", "2")
# Gemma-3n: per-layer embeddings (P channels a layer and token), AltUp's n streams, Laurel's low-rank residual
PLE, ALTUP = "hidden_size_per_layer_input", "altup_num_inputs"
GEMMA3N_PARTS = (
    Part(
        "the per-layer embeddings, their projection and norm",
        "model",
        f"vocab_size_per_layer_input·L·{PLE} + C·L·{PLE} + {PLE}",
    ),
    Part("the gate and projection of each layer's own input, and norm", "every layer", f"2·C·{PLE} + C"),
    Part("AltUp's projections to and from its streams", "model", f"2·({ALTUP} - 1)·C·C"),
    Part(
        "AltUp's coefficients, router, scale and norm",
        "every layer",
        f"{ALTUP}·{ALTUP}·(1 + {ALTUP}) + C·{ALTUP} + 2·C",
    ),
    Part("Laurel's low-rank residual and norm", "every layer", "2·C·laurel_rank + C"),
)

# fields a state-space config carries that its class recomputes or never builds anything from
MAMBA_SIZES = ("num_attention_heads", "head_dim", "max_position_embeddings")
NEMOTRON_H_UNBILLED = (
    "expand",
    "mamba_proj_bias",
    "n_shared_experts",
    "moe_shared_expert_overlap",
    "mtp_layers_block_type",
    "sliding_window",
    "tie_word_embeddings",
)

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
    "qwen3_moe":    Arch(**QKVO, qk_norm=(True, "head"), windows="switched",
                         moe=Moe(("num_experts", "num_local_experts"), layers="qwen"),
                         unbilled=("shared_expert_intermediate_size",)),  # transformers builds no shared expert
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
    "apertus":      Arch(**QKVO, mlp="plain", qk_norm=(True, "head"), extras=(XIELU,)),
    "apertus1p5_text": Arch(**QKVO, mlp="plain", qk_norm=(True, "head"), extras=(XIELU,)),
    "arcee":        Arch(**QKVO, mlp="plain", mlp_bias="mlp_bias"),
    "bitnet":       Arch(**QKVO, extras=(Part("sub-norm of attention", "attention", "C"),
                                          Part("sub-norm of the MLP", "dense", "F"))),
    "cwm":          Arch(**QKVO, mlp_bias="mlp_bias", windows="every4_from0"),
    "diffllama":    Arch(**QKVO, extras=(Part("λ_q1, λ_k1, λ_q2, λ_k2", "attention", "4·E"),)),
    "exaone":       Arch(**QKVO, mlp_bias="mlp_bias"),
    "glm":          Arch(qkv_bias="attention_bias"),
    "helium":       Arch(**QKVO, mlp_bias="mlp_bias", special=("square_out",)),
    "hyperclovax":  Arch(**QKVO, mlp_bias="mlp_bias",
                         extras=(Part("norms after attention and MLP", "every layer", "2·C", when="use_post_norm"),)),
    "internlm3":    Arch(**QKVO, mlp_bias="mlp_bias"),
    "iquestcoder":  Arch(**QKVO, mlp_bias="mlp_bias"),
    "jais2":        Arch(**QKVO, mlp="plain", mlp_bias="mlp_bias", norm="layer"),
    "ministral":    Arch(windows="every"),
    "ministral3":   Arch(windows="every"),
    "nanochat":     Arch(**QKVO, mlp="plain", norm="none"),
    "olmo3":        Arch(**QKVO, qk_norm=(True, "per_head"), windows="pattern4"),
    "seed_oss":     Arch(qkv_bias="attention_bias", out_bias="attention_out_bias", mlp_bias="mlp_bias"),
    "vaultgemma":   Arch(**QKVO, windows="alternate"),
    "youtu":        Arch(special=("latent",)),
    "gpt-sw3":      Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned",
                         names=GPT2_NAMES, kv_heads=False),
    "gpt_bigcode":  Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned",
                         multi_query="multi_query", names=GPT2_NAMES, kv_heads=False,
                         unbilled=("num_key_value_heads",)),  # transformers reads multi_query
    "gpt_neo":      Arch(mlp="plain", norm="layer", out_bias=True, mlp_bias=True, positions="learned",
                         windows="gpt_neo", kv_heads=False,
                         names=(("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"))),
    "gpt_neox_japanese": Arch(mlp="plain", norm="layer", kv_heads=False, intermediate="C·intermediate_multiple_size",
                              extras=(Part("the last layer's output bias", "model", "C"),)),
    "gptj":         Arch(mlp="plain", norm="layer", norms=1, mlp_bias=True, lm_head_bias=True, parallel=True,
                         names=GPT2_NAMES, kv_heads=False, rotary_dim=True),
    "codegen":      Arch(mlp="plain", norm="layer", norms=1, mlp_bias=True, lm_head_bias=True, parallel=True,
                         names=GPT2_NAMES, kv_heads=False, rotary_dim=True),
    "openai-gpt":   Arch(mlp="plain", norm="none", qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned",
                         intermediate="4·C", names=HF_GPT_NAMES, kv_heads=False,
                         extras=(Part("LayerNorms after attention and MLP", "every layer", "4·C"),)),
    "opt":          Arch(mlp="plain", norm="layer", positions="learned", special=("opt",), kv_heads=False,
                         names=(("intermediate_size", "ffn_dim"),)),
    "bloom":        Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="alibi",
                         intermediate="4·C", kv_heads=False,
                         names=(("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head")),
                         extras=(Part("LayerNorm of the embeddings", "model", "2·C"),)),
    "mpt":          Arch(mlp="plain", norm="layer_weight", positions="alibi", intermediate="4·C", kv_heads=False,
                         names=(("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                                ("hidden_size", "d_model"), ("max_position_embeddings", "max_seq_len")),
                         unbilled=("expansion_ratio", "attn_config", "no_bias", "learned_pos_emb", "norm_type",
                                   "embedding_fraction", "init_device")),
    "xglm":         Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="sinusoidal",
                         kv_heads=False, names=(("num_hidden_layers", "num_layers"), ("num_attention_heads",
                         "attention_heads"), ("hidden_size", "d_model"), ("intermediate_size", "ffn_dim")),
                         unbilled=("scale_embedding",)),
    "biogpt":       Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, positions="learned",
                         kv_heads=False, extras=(Part("2 more rows of the position table", "model", "2·C"),),
                         unbilled=("scale_embedding",)),
    "ctrl":         Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, lm_head_bias=True,
                         positions="sinusoidal", kv_heads=False,
                         names=(*HF_GPT_NAMES, ("intermediate_size", "dff"))),
    "persimmon":    Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True,
                         qk_norm=("qk_layernorm", "head_bias"), kv_heads=False),
    "afmoe":        Arch(**QKVO, norms=4, qk_norm=(True, "head"), attention_gate=True, windows="afmoe",
                         moe=Moe(("num_experts",), layers="dense_first", dense="num_dense_layers",
                                 shared_count="num_shared_experts", score_bias=True)),
    "aria_text":    Arch(**QKVO, mlp_bias="mlp_bias", moe=Moe(("moe_num_experts",), width=None, per_token=("moe_topk",),
                                                             shared_count="moe_num_shared_experts")),
    "cohere2_moe":  Arch(**QKVO, norm="layer_weight", norms=1, parallel=True, windows="given",
                         moe=Moe(("num_experts",), width=None, layers="mlp_layer_types",
                                 shared_count="num_shared_experts", dense_width="prefix_dense_intermediate_size"),
                         unbilled=("prefix_dense_sliding_window_pattern", "sliding_window_pattern")),
    "dots1":        Arch(**QKVO, qk_norm=(True, "head"), windows="max_window", moe=DEEPSEEK),
    "exaone_moe":   Arch(qk_norm=(True, "head"), windows="pattern", moe=Moe(("num_experts",), layers="mlp_layer_types",
                                                                            shared_count="num_shared_experts")),
    "flex_olmo":    Arch(**QKVO, qk_norm=(True, "per_head"), moe=Moe(("num_experts",), width=None)),
    "flint":        Arch(sinks=True, qk_norm=(True, "head"), **QKVO, windows="given",
                         moe=Moe(("num_experts",), layers="qwen", shared_width="shared_expert_intermediate_size",
                                 dense_first=2)),
    "glm4_moe":     Arch(qkv_bias="attention_bias", qk_norm=("use_qk_norm", "head"), moe=DEEPSEEK, special=("mtp",)),
    "granite_swa":  Arch(**QKVO, mlp_bias="mlp_bias", sinks=True, windows="every4_from0",
                         unbilled=("layer_rope_theta",)),
    "granitemoe_swa": Arch(**QKVO, sinks=True, windows="every4_from0", unbilled=("layer_rope_theta",),
                           moe=GRANITE_MOE),
    "granitemoeshared": Arch(**QKVO, moe=GRANITE_MOE),
    "hunyuan_v1_dense": Arch(**QKVO, qk_norm=(True, "head")),
    "hunyuan_v1_moe": Arch(**QKVO, qk_norm=(True, "head"),
                           moe=Moe(("num_experts",), width=None, per_token=("moe_topk",),
                                   shared_width="intermediate_size")),
    "hy_v3":        Arch(**QKVO, mlp_bias="mlp_bias", qk_norm=(True, "head"),
                         moe=Moe(("num_experts",), layers="mlp_layer_types", dense_first=1,
                                 shared_count="num_shared_experts")),
    "kolibri1":     Arch(qk_norm=(True, "head"), norms=4, windows="pattern5",
                         moe=Moe(("num_local_experts", "num_experts"), shared_width="shared_expert_intermediate_size")),
    "laguna":       Arch(**QKVO, qk_norm=(True, "head"), windows="listed", special=("heads_per_layer",),
                         extras=(Part("a gate per head", "attention", "C·Hq", when="gating"),),
                         moe=Moe(("num_experts",), layers="mlp_layer_types", dense_first=1, score_bias=True,
                                 shared_width="shared_expert_intermediate_size")),
    "mellum":       Arch(**QKVO, qk_norm=(True, "head"), windows="listed", special=("mtp",),
                         moe=Moe(("num_local_experts", "num_experts"), layers="mlp_layer_types", dense_first=0),
                         unbilled=("mtp_layer_types", "mtp_mlp_layer_types")),
    "minimax_m2":   Arch(qk_norm=(True, "per_head"), moe=MIXTRAL),
    "phimoe":       Arch(**QKVO, norm="layer", lm_head_bias="lm_head_bias", windows="every", moe=MIXTRAL),
    "sarvam_moe":   Arch(**QKVO, qk_norm=("use_qk_norm", "head"), moe=DEEPSEEK, special=("mtp",)),
    "solar_open":   Arch(**QKVO, moe=DEEPSEEK),
    "beam":         Arch(**QKVO, norms=4, qk_norm=(True, "head"), attention_gate=True, windows="pattern6",
                         extras=(Part("a gate bias per head", "attention", "Hq"),),
                         moe=Moe(("num_experts",), layers="mlp_layer_types", dense_first=3)),
    "nemotron":     Arch(**QKVO, mlp="plain", norm="layer", mlp_bias="mlp_bias"),
    "minicpm3":     Arch(mlp_bias="mlp_bias", special=("latent",)),
    "sarvam_mla":   Arch(moe=DEEPSEEK, special=("latent", "mtp")),
    "glm4_moe_lite": Arch(moe=Moe(("n_routed_experts",), layers="mlp_layer_types", dense_first=1,
                                  shared_count="n_shared_experts"), special=("latent",)),
    "axk1":         Arch(moe=Moe(("n_routed_experts",), layers="mlp_layer_types", every="moe_layer_freq",
                                 shared_count="n_shared_experts"),
                         special=("latent",), extras=(Part("a norm after the experts", "moe", "C"),)),
    "deepseek_v32": Arch(mlp_bias="mlp_bias", windows="listed", moe=MLA_MOE, special=("latent", "indexer")),
    "glm_moe_dsa":  Arch(mlp_bias="mlp_bias", windows="listed", moe=MLA_MOE, special=("latent", "indexer")),
    "mamba":        Arch(attention=False, special=("mamba",), unbilled=MAMBA_SIZES),
    "falcon_mamba": Arch(attention=False, special=("mamba",), unbilled=MAMBA_SIZES),
    "mamba2":       Arch(attention=False, special=("mamba2",),
                         unbilled=(*MAMBA_SIZES, "intermediate_size", "time_step_rank")),
    "bamba":        Arch(**QKVO, mlp_bias="mlp_bias", special=("bamba",), unbilled=("mamba_d_head",)),
    "granitemoehybrid": Arch(**QKVO, moe=GRANITE_MOE, special=("granite_hybrid",),
                             unbilled=("mamba_d_head", "position_embedding_type")),
    "jamba":        Arch(positions="none", special=("jamba",),
                         moe=Moe(("num_experts",), width=None, layers="period")),
    "falcon_h1":    Arch(**QKVO, mlp_bias="mlp_bias", special=("falcon_h1",), unbilled=("mamba_d_head",)),
    "nemotron_h":   Arch(**QKVO, mlp_bias="mlp_bias", special=("nemotron_h", "mtp"), unbilled=NEMOTRON_H_UNBILLED,
                         tied=False, layers_from="layers_block_type"),
    "qwen3_5_text": Arch(**QKVO, qk_norm=(True, "head"), attention_gate=True, windows="qwen3_5",
                         special=("gated_deltanet",)),
    "qwen3_5_moe_text": Arch(**QKVO, qk_norm=(True, "head"), attention_gate=True, windows="qwen3_5",
                             moe=Moe(("num_experts",), shared_width="shared_expert_intermediate_size",
                                     shared_gate=True), special=("gated_deltanet",)),
    "lara_mini":    Arch(**QKVO, qk_norm=(True, "head"), windows="given", special=("gated_deltanet",),
                         moe=Moe(("num_experts",), shared_width="shared_expert_intermediate_size")),
    "olmo_hybrid":  Arch(**QKVO, qk_norm=(True, "per_head"), windows="olmo_hybrid", special=("deltanet_olmo",),
                         unbilled=("linear_allow_neg_eigval",)),
    "lfm2":         Arch(qk_norm=(True, "head"), windows="lfm2", special=("short_conv", "lfm_mlp"),
                         unbilled=("block_multiple_of", "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim")),
    "lfm2_moe":     Arch(qk_norm=(True, "head"), windows="required", special=("short_conv",),
                         moe=Moe(("num_experts",), layers="dense_first", dense="num_dense_layers"),
                         unbilled=("use_expert_bias",)),  # a buffer, not a parameter
    "lfm3":         Arch(**QKVO, qk_norm=(True, "head"), windows="lfm3", special=("short_conv",),
                         extras=(Part("a gate per head", "attention", "C·Hq", when="use_attention_gate"),
                                 Part("norms after the mixer and the MLP", "every layer", "2·C",
                                      when="use_sandwich_norm"))),
    "dbrx":         Arch(norm="layer_weight", mlp="none", special=("dbrx",), kv_heads=False,
                         unbilled=("num_key_value_heads",),
                         names=(("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                                ("hidden_size", "d_model"), ("max_position_embeddings", "max_seq_len"))),
    "modernbert-decoder": Arch(**QKVO, mlp_bias="mlp_bias", windows="modernbert", special=("modernbert",),
                               kv_heads=False, unbilled=("norm_bias", "classifier_bias", "decoder_bias")),
    "cohere_compass_text": Arch(**QKVO, norm="layer_weight", norms=1, parallel=True, windows="listed",
                                unbilled=("pooling",)),
    "minimax_m3_vl_text": Arch(qk_norm=(True, "head"), rotary_dim=True, windows="listed",
                               moe=Moe(("num_local_experts",), width=None, layers="mlp_layer_types", dense_first=0,
                                       shared_width="shared_intermediate_size", dense_width="dense_intermediate_size"),
                               unbilled=("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
                                         "index_local_blocks")),
    "doge":         Arch(**QKVO, mlp_bias="mlp_bias", qk_norm=(True, "head"), off=("is_moe",), windows="every",
                         extras=(Part("the dynamic mask's A and Δ projection", "attention", "Hkv + Hkv·E·Hkv"),
                                 Part("the Δ projection's bias", "attention", "Hkv", when="attention_bias"),
                                 Part("the residual scales", "every layer", "2·C")),
                         unbilled=("keep_window_size", "num_experts", "num_experts_per_tok", "norm_topk_prob")),
    "jetmoe":       Arch(special=("jetmoe",), moe=Moe(("num_local_experts",), width=None),
                         unbilled=("num_attention_heads",),
                         names=(("num_attention_heads", "num_key_value_heads"), ("head_dim", "kv_channels")),
                         extras=(Part("the attention experts a token does not run", "attention",
                                      "2·(num_local_experts - num_experts_per_tok)·C·Hkv·E", active=False),
                                 Part("the attention experts' bias and router", "attention", "C + num_local_experts·C"),
                                 Part("the MLP experts' bias", "every layer", "C"))),
    "emu3_text_model": Arch(),  # Emu3's language model (its causal-LM class is this model alone)
    "kimi_linear":  Arch(positions="none", windows="kimi", special=("latent", "kda"), tied=False,
                         moe=Moe(("num_experts", "num_local_experts"), layers="mlp_layer_types",
                                 per_token=("num_experts_per_token", "num_experts_per_tok"),
                                 shared_count="num_shared_experts"),
                         names=(("max_position_embeddings", "model_max_length", "max_position_embeddings"),),
                         unbilled=("num_expert_group", "moe_renormalize", "moe_router_activation_func",
                                   "use_grouped_topk", "tie_word_embeddings")),  # its head is never tied
    "recurrent_gemma": Arch(qkv_bias="attention_bias", out_bias=True, mlp_bias=True, special=("rglru",),
                            intermediate="intermediate_size // 2",
                            unbilled=("final_w_init_variance_scale", "embeddings_scale_by_sqrt_dim")),
    "rwkv":         Arch(attention=False, mlp="plain", norm="layer", positions="none", special=("rwkv",),
                         names=(("max_position_embeddings", "context_length"),), unbilled=("rescale_every",),
                         extras=(Part("the channel mixing's receptance, the token shifts", "every layer", "C·C + 2·C"),
                                 Part("the first layer's LayerNorm of the embeddings", "model", "2·C"))),
    "xlstm":        Arch(attention=False, positions="none", mlp_bias="use_bias", intermediate="C", special=("mlstm",),
                         tied=False,  # intermediate: its reader works the MLP's width out of ffn_proj_factor
                         extras=(Part("the block norms' biases", "every layer", "2·C", when="use_bias"),),
                         unbilled=("tie_word_embeddings", "add_out_norm", "mode", "return_last_states", "weight_mode")),
    "longcat_flash": Arch(special=("latent", "zero_experts"), sublayers=2,
                          names=(("num_hidden_layers", "num_layers"), ("intermediate_size", "ffn_hidden_size")),
                          moe=Moe(("n_routed_experts",), width="expert_ffn_hidden_size", per_token=("moe_topk",),
                                  every=2, router_bias="router_bias", beside_mlp=True),
                          unbilled=("mla_scale_q_lora", "mla_scale_kv_lora")),
    "gemma4_text":  Arch(**QKVO, norms=4, qk_norm=(True, "head"), windows="pattern6",
                         special=("gemma4", "gemma4_text")),
    "gemma4_unified_text": Arch(**QKVO, norms=4, qk_norm=(True, "head"), windows="pattern6", special=("gemma4",)),
    "gemma3n_text": Arch(**QKVO, norms=4, qk_norm=(True, "head"), windows="pattern5", intermediate="C",
                         special=("gemma3n",), extras=GEMMA3N_PARTS,  # its reader reads intermediate_size, a list
                         unbilled=("altup_active_idx", "altup_coef_clip", "altup_correct_scale",
                                   "activation_sparsity_pattern")),
    "zamba":        Arch(positions="none", head_dim="2·C // Hq", special=("zamba",),
                         names=(("head_dim", "attention_head_dim", "head_dim"),)),
    "zamba2":       Arch(head_dim="2·C // Hq", special=("zamba2",),
                         names=(("head_dim", "attention_head_dim", "head_dim"),),
                         unbilled=("kv_channels", "num_query_groups")),  # recomputed, never built from
    "inkling_text": Arch(qk_norm=(True, "head"), windows="inkling", special=("inkling", "mtp"), tied=False,
                         moe=Moe(("n_routed_experts",), layers="mlp_layer_types", dense="dense_mlp_idx",
                                 shared_count="n_shared_experts"),
                         names=(("max_position_embeddings", "max_position_embeddings", "model_max_length"),),
                         unbilled=("unpadded_vocab_size", "tie_word_embeddings", "shared_expert_sink",
                                   "number_of_conv_states", "chain_hidden_post_norm", "mtp_hidden_states_first",
                                   "mtp_local_layer_ids")),
    "dots3_note_text": Arch(special=("dots3",), moe=Moe(("n_routed_experts",), layers="mlp_layer_types",
                                                      every="moe_layer_freq", shared_count="n_shared_experts",
                                                      shared_width="shared_experts_intermediate_size")),
    "mimo_v2_flash": Arch(qkv_bias="attention_bias", windows="mimo", special=("mimo",),
                          moe=Moe(("n_routed_experts",), layers="mlp_layer_types", dense_first=1),
                          unbilled=("swa_rope_theta", "attention_value_scale")),
}  # fmt: skip

# model types whose config keeps the language model in text_config, and its model type there: their causal-LM
# class is that language model alone, and the reader bills it
TEXT_CONFIG = {
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen4_exp": "qwen4_exp_text",
    "dots3_note": "dots3_note_text",
    "emu3": "emu3_text_model",
}

# a config without model_type: read as Llama, sliding windows and layer_types as written
NO_MODEL_TYPE = Arch(**QKVO, mlp_bias="mlp_bias", windows="every")
