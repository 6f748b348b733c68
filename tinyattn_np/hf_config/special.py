"""What one architecture alone has: a reader of its own for what no other config says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model_parts import Experts, Extra, Indexer, KindAttention, LatentAttention, LinearAttention, StateSpace
from .fields import Fields, shown_value

__all__ = ["OWN_LAYERS", "SPECIAL_READERS"]


def _special_latent(fields: Fields, found: dict[str, Any]) -> None:
    """DeepSeek-V2/V3, Kimi K2: multi-head latent attention; head_dim becomes nope + rope (transformers 5
    stores the rotary width in head_dim, and nope + rope in qk_head_dim: both checked)."""
    rope, nope = fields.integer("qk_rope_head_dim"), fields.integer("qk_nope_head_dim")
    v_dim = fields.integer("v_head_dim", none=True) or found["hidden"] // found["heads"]  # MiniCPM3's null
    latent = LatentAttention(
        kv_rank=fields.integer("kv_lora_rank"), rope_dim=rope, nope_dim=nope, v_dim=v_dim,
        q_rank=fields.integer("q_lora_rank", none=True), bias=fields.boolean("attention_bias"),
    )  # fmt: skip
    for field, allowed in (("head_dim", (rope, nope + rope)), ("qk_head_dim", (nope + rope,))):
        value = fields.get(field)
        if value is not None and value not in allowed:
            raise fields.refuse(field, f"does not match qk_nope_head_dim + qk_rope_head_dim = {nope + rope}", value)
    found.update(latent=latent, head_dim=nope + rope, kv_heads=found["heads"])  # every head decompresses its own k, v
    _special_mtp(fields, found)


def _special_mtp(fields: Fields, found: dict[str, Any]) -> None:
    """Multi-token-prediction layers: a note, for transformers does not build them."""
    names = ("num_nextn_predict_layers", "num_mtp_layers")  # one count, by either name
    mtp = fields.integer(*names, zero=True) if fields.get(*names) else 0
    if mtp:
        found["notes"] += (f"{mtp} multi-token-prediction layer(s) (num_nextn_predict_layers) not counted: "
                           "transformers does not build them",)  # fmt: skip


def _special_gated_deltanet(fields: Fields, found: dict[str, Any]) -> None:
    """Qwen3-Next: its linear layers' heads, widths and convolution."""
    found["linear"] = LinearAttention(
        "gated_deltanet",
        key_heads=fields.integer("linear_num_key_heads"), value_heads=fields.integer("linear_num_value_heads"),
        key_dim=fields.integer("linear_key_head_dim"), value_dim=fields.integer("linear_value_head_dim"),
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )  # fmt: skip


def _special_deltanet_olmo(fields: Fields, found: dict[str, Any]) -> None:
    """OLMo-Hybrid: gated DeltaNet layers whose heads default to the attention's, keys 0.75 · C wide in all."""
    key_heads = fields.integer("linear_num_key_heads", none=True) or found["heads"]
    key_dim = fields.integer("linear_key_head_dim", none=True) or int(0.75 * found["hidden"] / key_heads)
    found["linear"] = LinearAttention(
        "gated_deltanet", key_heads=key_heads, value_heads=fields.integer("linear_num_value_heads", none=True)
        or found["heads"], key_dim=key_dim, value_dim=fields.integer("linear_value_head_dim", none=True) or 2 * key_dim,
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )  # fmt: skip


def _special_short_conv(fields: Fields, found: dict[str, Any]) -> None:
    """LFM2: its conv layers, a gated short convolution over the hidden width."""
    hidden = found["hidden"]
    short_conv = LinearAttention("short_conv", 1, 1, hidden, hidden, conv_kernel=fields.integer("conv_L_cache"),
                                 bias=fields.boolean("conv_bias"))  # fmt: skip
    found["linear"] = short_conv if "linear_attention" in (found["layer_types"] or ()) else None


def _special_lfm_mlp(fields: Fields, found: dict[str, Any]) -> None:
    """LFM2: the MLP's width from intermediate_size, two thirds of it, times block_ffn_dim_multiplier, rounded up
    to block_multiple_of (block_auto_adjust_ff_dim), as its modeling file works it out."""
    width = found["intermediate"]
    if fields.boolean("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        multiplier = fields.number("block_ffn_dim_multiplier")
        if multiplier is not None:
            multiple = fields.integer("block_multiple_of")
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    else:
        fields.value("block_ffn_dim_multiplier", "block_multiple_of")
    found["intermediate"] = width


def _special_lightning(fields: Fields, found: dict[str, Any]) -> None:
    """MiniMax: its linear layers have the attention's heads and head_dim."""
    heads, head_dim = found["heads"], found["head_dim"]
    found["linear"] = LinearAttention("lightning", heads, heads, head_dim, head_dim)


def _special_stablelm(fields: Fields, found: dict[str, Any]) -> None:
    """StableLM: a parallel block has one norm per layer."""
    found["norms_per_layer"] = 1 if found["parallel_block"] else 2


def _special_falcon(fields: Fields, found: dict[str, Any]) -> None:
    """Falcon: kv heads from new_decoder_architecture (num_kv_heads) or multi_query (1); one or two norms
    per parallel block (num_ln_in_parallel_attn); ALiBi instead of RoPE (alibi)."""
    new = fields.boolean("new_decoder_architecture")
    multi_query, parallel = fields.boolean("multi_query"), fields.boolean("parallel_attn")
    kv_heads = fields.integer("num_kv_heads", none=True) or found["heads"]
    found["kv_heads"] = kv_heads if new else 1 if multi_query else found["heads"]
    norms_in_parallel = fields.integer("num_ln_in_parallel_attn", none=True) or (2 if new else 1)
    found["parallel_block"] = parallel
    found["norms_per_layer"] = 2 if not parallel or norms_in_parallel == 2 else 1
    if fields.boolean("alibi"):
        found.update(positions="alibi", rope_theta=None, rope_scaling=None)


def _special_opt(fields: Fields, found: dict[str, Any]) -> None:
    """OPT: a position table of 2 more rows; a token table of word_embed_proj_dim, projected to and from hidden
    where they differ; biases where enable_bias; norms after the layer (do_layer_norm_before false: no final
    norm); LayerNorms without weights where layer_norm_elementwise_affine is false."""
    found["extras"] += (Extra("2 more rows of the position table", "model", 2 * found["hidden"]),)
    width = fields.integer("word_embed_proj_dim", none=True)
    found["embedding_dim"] = width if width is not None and width != found["hidden"] else None
    bias = fields.boolean("enable_bias")
    found.update(qkv_bias=bias, out_bias=bias, mlp_bias=bias)
    found["final_norm"] = fields.boolean("do_layer_norm_before") and not fields.boolean("_remove_final_layer_norm")
    if not fields.boolean("layer_norm_elementwise_affine"):
        found["norm"] = "none"


def _special_heads_per_layer(fields: Fields, found: dict[str, Any]) -> None:
    """Laguna: num_attention_heads_per_layer, which the bill reads where every layer has the same heads."""
    per_layer = fields.integers("num_attention_heads_per_layer", found["layers"])
    if per_layer is not None and set(per_layer) != {found["heads"]}:
        raise fields.refuse(
            "num_attention_heads_per_layer", "varies the heads from layer to layer, which the bill does not"
        )


def _special_indexer(fields: Fields, found: dict[str, Any]) -> None:
    """DeepSeek Sparse Attention: the indexer on every layer (GLM-5's "shared" layers, which reuse the one
    before, are refused), reading the query latent of latent attention."""
    kinds = fields.get("indexer_types")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) != {"full"}):
        raise fields.refuse("indexer_types", "shares indexers between layers, which the bill does not read")
    latent = found["latent"]
    if latent is None or latent.q_rank is None:
        raise ValueError("config: DeepSeek's indexer reads the query latent, so it needs q_lora_rank; got null")
    found["indexer"] = Indexer(
        heads=fields.integer("index_n_heads"), head_dim=fields.integer("index_head_dim"),
        topk=fields.integer("index_topk"), q_rank=latent.q_rank,
    )  # fmt: skip


def _mamba_inner(fields: Fields, found: dict[str, Any], expand: str, given: str | None = None) -> int:
    """The state-space layers' width: `given` where the config sets it, else int(expand · hidden)."""
    width = fields.integer(given, none=True) if given else None
    fields.value(expand)  # read: where the width is given, expand says nothing more
    if width is not None:
        return width
    value = fields.get(expand)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 2**20:
        raise fields.refuse(expand, "must be a positive number")
    return int(value * found["hidden"])


def _mamba(fields: Fields, found: dict[str, Any], prefix: str = "", **flags: Any) -> StateSpace:
    """Mamba-1 layers, their sizes under these names (Mamba's own, or Jamba's mamba_ ones)."""
    names = dict(state="state_size", conv="conv_kernel", rank="time_step_rank", proj="use_bias", bias="use_conv_bias")
    if prefix:
        names = dict(state="mamba_d_state", conv="mamba_d_conv", rank="mamba_dt_rank", proj="mamba_proj_bias",
                     bias="mamba_conv_bias")  # fmt: skip
    rank = fields.get(names["rank"])
    rank = -(-found["hidden"] // 16) if rank == "auto" else fields.integer(names["rank"])  # ceil(C / 16)
    inner = _mamba_inner(fields, found, f"{prefix}expand", None if prefix else "intermediate_size")
    return StateSpace(
        "mamba", inner=inner, state=fields.integer(names["state"]),
        conv_kernel=fields.integer(names["conv"]), dt_rank=rank, proj_bias=fields.boolean(names["proj"]),
        conv_bias=fields.boolean(names["bias"]), **flags,
    )  # fmt: skip


def _mamba2(fields: Fields, found: dict[str, Any], names: dict[str, str], inner: int, norm: bool = True) -> StateSpace:
    """Mamba-2 layers, their sizes under the names this family gives them."""
    return StateSpace(
        "mamba2", inner=inner, state=fields.integer(names["state"]), conv_kernel=fields.integer(names["conv"]),
        heads=fields.integer(names["heads"]), groups=fields.integer(names["groups"]),
        proj_bias=fields.boolean(names["proj"]), conv_bias=fields.boolean(names["bias"]), norm=norm,
    )  # fmt: skip


MAMBA2 = dict(state="state_size", conv="conv_kernel", heads="num_heads", groups="n_groups", proj="use_bias",
              bias="use_conv_bias")  # fmt: skip
HYBRID = dict(state="mamba_d_state", conv="mamba_d_conv", heads="mamba_n_heads", groups="mamba_n_groups",
              proj="mamba_proj_bias", bias="mamba_conv_bias")  # fmt: skip


def _only_mamba(fields: Fields, found: dict[str, Any], space: StateSpace) -> None:
    """A stack of state-space layers alone: a norm before each, no attention, no MLP."""
    found.update(state_space=space, layer_types=("mamba",) * found["layers"], mlp="none", norms_per_layer=1,
                 rope_theta=None, rope_scaling=None, positions="none")  # fmt: skip


def _special_mamba(fields: Fields, found: dict[str, Any]) -> None:
    """Mamba (and Falcon-Mamba): Mamba-1 layers alone."""
    _only_mamba(fields, found, _mamba(fields, found))


def _special_mamba2(fields: Fields, found: dict[str, Any]) -> None:
    """Mamba-2: Mamba-2 layers alone."""
    _only_mamba(fields, found, _mamba2(fields, found, MAMBA2, _mamba_inner(fields, found, "expand")))


def _kinds(fields: Fields, name: str, layers: int, spelled: dict[str, str]) -> tuple[str, ...]:
    """A config's list of layer kinds, each in the reader's spelling."""
    given = fields.get(name)
    if not isinstance(given, list) or len(given) != layers or not set(given) <= set(spelled):
        raise fields.refuse(name, f"must list {layers} layer kinds, each one of {', '.join(spelled)}")
    return tuple(spelled[kind] for kind in given)


def _special_bamba(fields: Fields, found: dict[str, Any]) -> None:
    """Bamba: attention on attn_layer_indices, Mamba-2 on the other layers, an MLP on every layer."""
    indices = set(fields.integers("attn_layer_indices") or [])
    kinds = tuple("full_attention" if i in indices else "mamba" for i in range(found["layers"]))
    space = _mamba2(fields, found, HYBRID, _mamba_inner(fields, found, "mamba_expand"))
    found.update(state_space=space, layer_types=kinds)


def _special_granite_hybrid(fields: Fields, found: dict[str, Any]) -> None:
    """Granite-4 (GraniteMoeHybrid): layer_types of Mamba-2 and attention; experts and a shared MLP on every layer
    (the shared MLP alone where there are no experts)."""
    spelled = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
               "full_attention": "full_attention"}  # fmt: skip
    kinds = _kinds(fields, "layer_types", found["layers"], spelled)
    space = _mamba2(fields, found, HYBRID, _mamba_inner(fields, found, "mamba_expand"))
    found.update(state_space=space, layer_types=kinds)
    if found["experts"] is None:  # the shared MLP is the layer's MLP
        found["intermediate"] = fields.integer("shared_intermediate_size")


def _special_jamba(fields: Fields, found: dict[str, Any]) -> None:
    """Jamba: attention every attn_layer_period-th layer from attn_layer_offset, Mamba-1 (with norms on Δ, B
    and C) on the others."""
    period, offset = fields.integer("attn_layer_period"), fields.integer("attn_layer_offset", zero=True)
    kinds = tuple("full_attention" if i % period == offset else "mamba" for i in range(found["layers"]))
    found.update(state_space=_mamba(fields, found, "mamba_", dt_norms=True), layer_types=kinds)


def _special_falcon_h1(fields: Fields, found: dict[str, Any]) -> None:
    """Falcon-H1: every layer runs attention and Mamba-2 side by side, then an MLP."""
    inner = _mamba_inner(fields, found, "mamba_expand", "mamba_d_ssm")
    space = _mamba2(fields, found, HYBRID, inner, norm=fields.boolean("mamba_rms_norm"))
    out_bias = fields.boolean("projectors_bias")
    space = StateSpace(**{**space.__dict__, "proj_bias": False}) if not out_bias else space
    found.update(state_space=space, mamba_beside_attention=True)


def _special_nemotron_h(fields: Fields, found: dict[str, Any]) -> None:
    """Nemotron-H: a list of blocks, each one thing: Mamba-2, attention, an MLP or experts, with a norm before it."""
    spelled = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention",
               "attention": "full_attention", "mlp": "mlp", "moe": "mlp"}  # fmt: skip
    given = fields.get("layers_block_type")
    kinds = _kinds(fields, "layers_block_type", found["layers"], spelled)
    if fields.integer("moe_latent_size", none=True) is not None:
        raise fields.refuse("moe_latent_size", "runs the experts in a latent space, which the bill does not read")
    inner = fields.integer("mamba_num_heads") * fields.integer("mamba_head_dim")
    names = dict(state="ssm_state_size", conv="conv_kernel", heads="mamba_num_heads", groups="n_groups",
                 proj="use_bias", bias="use_conv_bias")  # fmt: skip
    moe = [i for i, kind in enumerate(given) if kind == "moe"]
    mlps = tuple(i for i, kind in enumerate(kinds) if kind == "mlp")
    experts = None
    if moe:
        experts = Experts(
            fields.integer("n_routed_experts"), fields.integer("num_experts_per_tok", none=True),
            fields.integer("moe_intermediate_size"), tuple(moe),
            shared_intermediate=fields.integer("moe_shared_expert_intermediate_size", zero=True), gated=False,
        )  # fmt: skip
    found.update(state_space=_mamba2(fields, found, names, inner), layer_types=kinds, mlp_layers=mlps,
                 experts=experts, norms_per_layer=1, mlp="plain")  # fmt: skip


def _nested(fields: Fields, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """A config nested in a field (DBRX's attn_config, ffn_config): a dict, null as its class's defaults."""
    value = fields.get(name, default={})
    if not isinstance(value, dict):
        raise fields.refuse(name, "must be an object")
    return {**defaults, **{key: item for key, item in value.items() if item is not None}}


def _nested_size(fields: Fields, name: str, nested: dict[str, Any], key: str) -> int:
    value = nested.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**40:
        raise fields.refuse(name, f"must give {key} as a positive integer; got {shown_value(value)}", nested)
    return value


def _special_dbrx(fields: Fields, found: dict[str, Any]) -> None:
    """DBRX: kv heads in attn_config, experts in ffn_config (gated, ffn_hidden_size wide, moe_top_k a token)."""
    attention = _nested(fields, "attn_config", {"kv_n_heads": 1})
    ffn = _nested(fields, "ffn_config", {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1})
    count = _nested_size(fields, "ffn_config", ffn, "moe_num_experts")
    found["kv_heads"] = _nested_size(fields, "attn_config", attention, "kv_n_heads")
    per_token = min(_nested_size(fields, "ffn_config", ffn, "moe_top_k"), count)
    width = _nested_size(fields, "ffn_config", ffn, "ffn_hidden_size")
    found["experts"] = Experts(count, per_token, width, tuple(range(found["layers"])))
    theta = attention.get("rope_theta", 10000.0)
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        found["rope_theta"] = float(theta)


def _special_modernbert(fields: Fields, found: dict[str, Any]) -> None:
    """ModernBERT's decoder: LayerNorms (with bias where norm_bias) before the MLP and before every attention but the
    first layer's, one on the embeddings; a head of a dense layer and a norm before the output (with its bias)."""
    c = found["hidden"]
    per_norm = 2 * c if fields.boolean("norm_bias") else c
    found.update(norm="layer" if fields.boolean("norm_bias") else "layer_weight", norms_per_layer=1,
                 lm_head_bias=fields.boolean("decoder_bias"))  # fmt: skip
    head = c * c + (c if fields.boolean("classifier_bias") else 0) + per_norm
    found["extras"] += (Extra("norms before attention, from layer 1 on", "model", (found["layers"] - 1) * per_norm),
                        Extra("the embeddings' norm", "model", per_norm), Extra("the head's dense layer and norm",
                        "model", head))  # fmt: skip


def _special_jetmoe(fields: Fields, found: dict[str, Any]) -> None:
    """JetMoE: attention experts, each num_key_value_heads heads of kv_channels, of which a token runs the top
    num_experts_per_tok: its query heads; keys and values one projection for all (the table's parts count the
    experts it does not run)."""
    top = fields.integer("num_experts_per_tok")
    found.update(kv_heads=found["heads"], heads=top * found["heads"])


def _special_square_out(fields: Fields, found: dict[str, Any]) -> None:
    """Helium: the output projection is C x C, which is the bill's Hq·E x C only where the heads fill the width."""
    if found["heads"] * found["head_dim"] != found["hidden"]:
        raise fields.refuse("head_dim", f"times num_attention_heads ({found['heads']}) must be hidden_size, "
                            "whose square the output projection is", found["head_dim"])  # fmt: skip


def _agrees(fields: Fields, name: str, built: Any) -> None:
    """A field of the released config.json that transformers' class ignores: read where it says what transformers
    builds anyway (or is null), refused where it says otherwise."""
    value = fields.get(name)
    if value is not None and value != built:
        raise fields.refuse(name, f"is not what transformers builds ({shown_value(built)}), which ignores the field")


def _special_mimo(fields: Fields, found: dict[str, Any]) -> None:
    """MiMo-V2-Flash: values of v_head_dim; the sliding layers have twice the kv heads of the full ones, and sinks;
    the released config's swa_ fields and layer patterns, which transformers does not read, must agree."""
    heads, kv_heads, head_dim = found["heads"], found["kv_heads"], found["head_dim"]
    value_dim = fields.integer("v_head_dim")
    if heads % (2 * kv_heads):
        raise fields.refuse("num_key_value_heads", f"doubled in the sliding layers does not divide {heads} heads")
    sliding = KindAttention("sliding_attention", heads, 2 * kv_heads, head_dim, value_dim, sinks=True)
    found.update(head_dim_v=value_dim, kind_attention=(sliding,))
    window = fields.integer("sliding_window_size", none=True)  # the released config's: the window less the query
    if window is not None and found["sliding_window"] is not None:
        found["sliding_window"] = window + 1
    routed = set(() if found["experts"] is None else found["experts"].layers)
    for name, built in (("swa_num_attention_heads", heads), ("swa_num_key_value_heads", 2 * kv_heads),
                        ("swa_head_dim", head_dim), ("swa_v_head_dim", value_dim),
                        ("add_swa_attention_sink_bias", True), ("add_full_attention_sink_bias", False),
                        ("hybrid_layer_pattern", [int(kind != "full_attention") for kind in found["layer_types"]]),
                        ("moe_layer_freq", [int(i in routed) for i in range(found["layers"])])):  # fmt: skip
        _agrees(fields, name, built)


# what linear_attn_config may hold (Kimi Linear): what transformers reads from it, and the gate's floor
KIMI_LINEAR_KEYS = ("head_dim", "num_heads", "short_conv_kernel_size", "full_attn_layers", "kda_layers",
                    "gate_lower_bound", "use_full_rank_gate")  # fmt: skip


def _special_kda(fields: Fields, found: dict[str, Any]) -> None:
    """Kimi Linear: Kimi Delta Attention layers, their heads and convolution from linear_attn_config where it
    gives them (as transformers reads it), else linear_num_heads, linear_head_dim, linear_conv_kernel_dim;
    its latent attention has no RoPE (mla_use_nope), and moe_layer_freq, which transformers ignores, says 1."""
    nested = _nested(fields, "linear_attn_config", {})
    unknown = sorted(set(nested) - set(KIMI_LINEAR_KEYS))
    if unknown or nested.get("use_full_rank_gate"):  # a full-rank forget gate: weights transformers does not build
        raise fields.refuse("linear_attn_config", f"holds {', '.join(unknown) or 'use_full_rank_gate'}, which "
                            "transformers does not build", nested)  # fmt: skip
    sizes = {}
    for name, key in (("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim"),
                      ("linear_conv_kernel_dim", "short_conv_kernel_size")):  # fmt: skip
        own = fields.integer(name)
        sizes[name] = _nested_size(fields, "linear_attn_config", nested, key) if key in nested else own
    heads, width = sizes["linear_num_heads"], sizes["linear_head_dim"]
    conv_kernel = sizes["linear_conv_kernel_dim"]
    found["linear"] = LinearAttention("kda", heads, heads, width, width, conv_kernel=conv_kernel)
    for name, built in (("mla_use_nope", True), ("moe_layer_freq", 1), ("mla_use_output_gate", False)):
        _agrees(fields, name, built)


def _special_rglru(fields: Fields, found: dict[str, Any]) -> None:
    """RecurrentGemma (Griffin): block_types repeated over the layers, each recurrent block an RG-LRU of lru_width
    (heads of lru_width / num_attention_heads), each attention block a window of attention_window_size; heads of
    hidden_size / num_attention_heads, whatever head_dim says, as its config class sets them."""
    heads, layers, hidden = found["heads"], found["layers"], found["hidden"]
    if found["head_dim"] != hidden // heads:
        raise fields.refuse("head_dim", f"is not hidden_size // num_attention_heads = {hidden // heads}, which "
                            "transformers builds", found["head_dim"])  # fmt: skip
    blocks = fields.get("block_types")
    if not isinstance(blocks, (list, tuple)) or not blocks or not set(blocks) <= {"recurrent", "attention"}:
        raise fields.refuse("block_types", "must be a list of 'recurrent' and 'attention'")
    kinds = tuple("linear_attention" if blocks[i % len(blocks)] == "recurrent" else "sliding_attention"
                  for i in range(layers))  # fmt: skip
    width = fields.integer("lru_width", none=True) or hidden
    if width % heads:
        raise fields.refuse("lru_width", f"must split into {heads} blocks (num_attention_heads)", width)
    linear = LinearAttention("rglru", heads, heads, 1, width // heads, conv_kernel=fields.integer("conv1d_width"))
    window = fields.integer("attention_window_size", "sliding_window")
    found.update(layer_types=kinds, sliding_window=window, linear=linear if "linear_attention" in kinds else None)


def _special_rwkv(fields: Fields, found: dict[str, Any]) -> None:
    """RWKV-4: time mixing in every layer (its channel mixing is the MLP and a part of the table); transformers
    keeps its state hidden_size wide, so attention_hidden_size must be hidden_size."""
    width = fields.integer("attention_hidden_size", none=True) or found["hidden"]
    if width != found["hidden"]:
        raise fields.refuse("attention_hidden_size", "is not hidden_size, the width of transformers' RWKV state", width)
    found.update(linear=LinearAttention("rwkv", 1, 1, 1, width), layer_types=("linear_attention",) * found["layers"])


def _round_up(fields: Fields, name: str, size: int, multiple: int) -> int:
    """size · the factor `name`, rounded up to a multiple, as xLSTM's config rounds its widths."""
    factor = fields.number(name)
    if factor is None or not 0 < factor <= 2**10:
        raise fields.refuse(name, "must be a positive number")
    return int(((size * factor + multiple - 1) // multiple) * multiple)


def _special_mlstm(fields: Fields, found: dict[str, Any]) -> None:
    """xLSTM: an mLSTM layer and a gated MLP in every block. transformers builds the q, k and v widths as
    int(hidden_size · factor) and sizes its cache by the same rounded up to 64: they must agree (a multiple of 64,
    split into num_heads); the MLP is hidden_size · ffn_proj_factor rounded up to ffn_round_up_to_multiple_of."""
    hidden, heads = found["hidden"], fields.integer("num_heads")
    for name, other in (("num_blocks", found["layers"]), ("embedding_dim", hidden)):
        _agrees(fields, name, other)  # transformers builds the blocks, the table by these, the rest by the others
    widths = []
    for name in ("qk_dim_factor", "v_dim_factor"):
        width = _round_up(fields, name, hidden, 64)
        if width != int(hidden * fields.get(name)) or width % heads:
            raise fields.refuse(name, f"times hidden_size must be a multiple of 64 that {heads} heads split")
        widths.append(width // heads)
    found["intermediate"] = _round_up(fields, "ffn_proj_factor", hidden, fields.integer("ffn_round_up_to_multiple_of"))
    mlstm = LinearAttention("mlstm", heads, heads, widths[0], widths[1], bias=fields.boolean("use_bias"))
    found.update(linear=mlstm, layer_types=("linear_attention",) * found["layers"])


def _special_zero_experts(fields: Fields, found: dict[str, Any]) -> None:
    """LongCat-Flash: zero_expert_num experts that pass a token through unchanged, which the router scores beside
    the others and for which transformers allocates gate and up weights that nothing runs; each of its layers is
    two attentions and two MLPs, with the experts beside the first."""
    zero, moe = fields.integer("zero_expert_num", zero=True, none=True) or 0, found["experts"]
    _agrees(fields, "zero_expert_type", "identity")
    _agrees(fields, "attention_method", "MLA")
    if moe is None:
        raise fields.refuse("n_routed_experts", "leaves the router without experts, which transformers does not run")
    found["notes"] += (f"each of the {found['layers'] // 2} layers of its config is two layers here (two attentions, "
                       "two MLPs); the active parameters count the top-k of the experts that compute",)  # fmt: skip
    if zero:
        found["extras"] += (
            Extra("the router's scores of the zero experts", "moe", zero * (found["hidden"] + int(moe.router_bias))),
            Extra("the zero experts' gate and up weights", "moe", zero * 2 * moe.intermediate * found["hidden"],
                  active=False),
        )  # fmt: skip


def _layer_index(key: Any, layers: int) -> int | None:
    """A per_layer_config key (5, "5" or "05") as a layer index below `layers`, else None."""
    if isinstance(key, str) and key.isdigit() and len(key) <= 6:
        key = int(key)
    return key if type(key) is int and 0 <= key < layers else None


def _per_layer_config(fields: Fields, found: dict[str, Any]) -> dict[str, dict[str, int]]:
    """transformers' per_layer_config, {layer: {"head_dim": .., "num_key_value_heads": ..}}, as the sizes of each
    kind of layer: every layer of a kind must have the same (a kind whose sizes vary is refused)."""
    given, types = fields.get("per_layer_config", default={}), found["layer_types"]
    if not isinstance(given, dict) or len(given) > len(types):
        raise fields.refuse("per_layer_config", "must be an object of at most one entry a layer")
    per_layer: dict[int, dict[str, int]] = {}
    for key, sizes in given.items():
        index = _layer_index(key, len(types))
        if index is None or not isinstance(sizes, dict) or not set(sizes) <= {"head_dim", "num_key_value_heads"}:
            raise fields.refuse("per_layer_config", "must map layer indices to head_dim and num_key_value_heads")
        per_layer[index] = {name: _nested_size(fields, "per_layer_config", sizes, name) for name in sizes}
    by_kind: dict[str, dict[str, int]] = {}
    for index, kind in enumerate(types):
        if by_kind.setdefault(kind, per_layer.get(index, {})) != per_layer.get(index, {}):
            raise fields.refuse("per_layer_config", f"varies the sizes of the {kind} layers, which the bill does not")
    return {kind: sizes for kind, sizes in by_kind.items() if sizes}


def _special_gemma4(fields: Fields, found: dict[str, Any]) -> None:
    """Gemma-4 (text, unified): the full layers' heads of global_head_dim, with num_global_key_value_heads where their
    keys are the values (attention_k_eq_v: no v projection), unless per_layer_config gives each layer's; the last
    num_kv_shared_layers layers read an earlier layer's keys and values (no k, v or k norm, nothing cached), their
    MLPs twice as wide with use_double_wide_mlp; the last layer attends in full whatever layer_types says."""
    if fields.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": text tokens stay causal
        raise fields.refuse("use_bidirectional_attention", "lets every token see every other: not a decoder")
    types = found["layer_types"][:-1] + ("full_attention",)
    k_eq_v = fields.boolean("attention_k_eq_v")
    own = {"head_dim": fields.integer("global_head_dim")}
    global_kv = fields.integer("num_global_key_value_heads", none=True)
    if k_eq_v and global_kv is not None:
        own["num_key_value_heads"] = global_kv
    found["layer_types"] = types
    by_kind = _per_layer_config(fields, found) if "per_layer_config" in fields.config else {"full_attention": own}
    kinds = []
    for kind in dict.fromkeys(types):  # each kind once, in order
        sizes = by_kind.get(kind, {})
        head_dim, kv_heads = (
            sizes.get("head_dim", found["head_dim"]),
            sizes.get("num_key_value_heads", found["kv_heads"]),
        )
        if found["heads"] % kv_heads:
            raise fields.refuse("num_key_value_heads", f"of the {kind} layers does not divide the heads", kv_heads)
        if sizes or (k_eq_v and kind != "sliding_attention"):
            kinds.append(
                KindAttention(
                    kind, found["heads"], kv_heads, head_dim, values=not k_eq_v or kind == "sliding_attention"
                )
            )
    shared = fields.integer("num_kv_shared_layers", zero=True)
    found.update(kind_attention=tuple(kinds), kv_shared_layers=shared)
    if fields.boolean("use_double_wide_mlp") and shared:
        wider = shared * 3 * found["hidden"] * found["intermediate"]
        found["extras"] += (Extra("the kv-shared layers' MLPs, twice as wide", "model", wider),)


def _special_gemma4_text(fields: Fields, found: dict[str, Any]) -> None:
    """Gemma-4's per-layer embeddings (PLE: a table of hidden_size_per_layer_input a layer and token, projected from
    the embeddings too, fed to each layer through a gate and a projection) and its experts beside every layer's MLP
    (enable_moe_block: a router with a scale per channel and per expert, three more norms a layer)."""
    c, layers = found["hidden"], found["layers"]
    width = fields.integer("hidden_size_per_layer_input", zero=True, none=True)
    vocab = fields.integer("vocab_size_per_layer_input", none=True)
    if width:
        table = (vocab or found["vocab"]) * layers * width + c * layers * width + width
        found["extras"] += (Extra("the per-layer embeddings, their projection and norm", "model", table),
                            Extra("the gate and projection of each layer's own input, and norm", "every layer",
                                  2 * c * width + c))  # fmt: skip
    count = fields.integer("num_experts", none=True)
    per_token, width = fields.integer("top_k_experts", none=True), fields.integer("moe_intermediate_size", none=True)
    if fields.boolean("enable_moe_block"):
        if count is None or width is None:
            raise fields.missing("num_experts", "moe_intermediate_size")
        found["experts"] = Experts(count, per_token, width, tuple(range(layers)), beside_mlp=True)
        found["extras"] += (Extra("the router's scales and three more norms", "moe", c + count + 3 * c),)


def _special_gemma3n(fields: Fields, found: dict[str, Any]) -> None:
    """Gemma-3n: intermediate_size one width, or one a layer (the MLPs wider than the narrowest a part of their own);
    the last num_kv_shared_layers layers read an earlier layer's keys and values (no k, v or k norm, nothing
    cached)."""
    layers, widths = found["layers"], fields.get("intermediate_size")
    widths = widths if isinstance(widths, list) else [widths] * layers
    if len(widths) != layers or any(type(width) is not int or not 0 < width <= 2**40 for width in widths):
        raise fields.refuse("intermediate_size", f"must be a positive integer, or a list of {layers} (one a layer)")
    wider = sum(widths) - layers * min(widths)
    found.update(intermediate=min(widths), kv_shared_layers=fields.integer("num_kv_shared_layers", zero=True))
    if wider:
        found["extras"] += (Extra("the MLPs wider than the narrowest", "model", 3 * found["hidden"] * wider),)


# a special reader that says which kind each layer is, from the config's own fields
OWN_LAYERS = ("own layers",)

# name -> (the reader, which fills in the ModelShape fields found so far; the kinds of layer it brings
# besides softmax attention)
SPECIAL_READERS: dict[str, tuple[Callable[[Fields, dict[str, Any]], None], tuple[str, ...]]] = {
    "latent": (_special_latent, ()),
    "gated_deltanet": (_special_gated_deltanet, ("linear_attention",)),
    "lightning": (_special_lightning, ("linear_attention",)),
    "stablelm": (_special_stablelm, ()),
    "falcon": (_special_falcon, ()),
    "opt": (_special_opt, ()),
    "mtp": (_special_mtp, ()),
    "heads_per_layer": (_special_heads_per_layer, ()),
    "indexer": (_special_indexer, ()),
    "deltanet_olmo": (_special_deltanet_olmo, ("linear_attention",)),
    "short_conv": (_special_short_conv, ("linear_attention",)),
    "lfm_mlp": (_special_lfm_mlp, ()),
    "dbrx": (_special_dbrx, ()),
    "jetmoe": (_special_jetmoe, ()),
    "square_out": (_special_square_out, ()),
    "modernbert": (_special_modernbert, ()),
    "mamba": (_special_mamba, OWN_LAYERS),
    "mamba2": (_special_mamba2, OWN_LAYERS),
    "bamba": (_special_bamba, OWN_LAYERS),
    "granite_hybrid": (_special_granite_hybrid, OWN_LAYERS),
    "jamba": (_special_jamba, OWN_LAYERS),
    "falcon_h1": (_special_falcon_h1, ()),
    "nemotron_h": (_special_nemotron_h, OWN_LAYERS),
    "mimo": (_special_mimo, ()),
    "kda": (_special_kda, ("linear_attention",)),
    "rglru": (_special_rglru, OWN_LAYERS),
    "rwkv": (_special_rwkv, OWN_LAYERS),
    "mlstm": (_special_mlstm, OWN_LAYERS),
    "zero_experts": (_special_zero_experts, ()),
    "gemma4": (_special_gemma4, ()),
    "gemma4_text": (_special_gemma4_text, ()),
    "gemma3n": (_special_gemma3n, ()),
}
