"""What one architecture alone has: a reader of its own for what no other config says. The readers of linear
and recurrent layers are in recurrent.py, those of state-space layers and their hybrids in state_space.py; this
module's SPECIAL_READERS names them all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..model_parts import Experts, Extra, Indexer, KindAttention, LatentAttention
from .fields import OWN_LAYERS, Fields
from .recurrent import LINEAR_READERS
from .state_space import STATE_SPACE_READERS

__all__ = ["OWN_LAYERS", "SPECIAL_READERS"]


def _special_latent(fields: Fields, found: dict[str, Any]) -> None:
    """DeepSeek-V2/V3, Kimi K2: multi-head latent attention; head_dim becomes nope + rope (transformers 5
    stores the rotary width in head_dim, and nope + rope in qk_head_dim: both checked)."""
    rope, nope = fields.integer("qk_rope_head_dim"), fields.integer("qk_nope_head_dim")
    v_dim = fields.integer("v_head_dim", none=True) or found["hidden"] // found["heads"]  # MiniCPM3's null
    latent = LatentAttention(
        kv_rank=fields.integer("kv_lora_rank"),
        rope_dim=rope,
        nope_dim=nope,
        v_dim=v_dim,
        q_rank=fields.integer("q_lora_rank", none=True),
        bias=fields.boolean("attention_bias"),
    )
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
        found["notes"] += (
            f"{mtp} multi-token-prediction layer(s) (num_nextn_predict_layers) not counted: "
            "transformers does not build them",
        )


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
        heads=fields.integer("index_n_heads"),
        head_dim=fields.integer("index_head_dim"),
        topk=fields.integer("index_topk"),
        q_rank=latent.q_rank,
    )


def _special_dbrx(fields: Fields, found: dict[str, Any]) -> None:
    """DBRX: kv heads in attn_config, experts in ffn_config (gated, ffn_hidden_size wide, moe_top_k a token)."""
    attention = fields.nested("attn_config", {"kv_n_heads": 1})
    ffn = fields.nested("ffn_config", {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1})
    count = fields.nested_size("ffn_config", ffn, "moe_num_experts")
    found["kv_heads"] = fields.nested_size("attn_config", attention, "kv_n_heads")
    per_token = min(fields.nested_size("ffn_config", ffn, "moe_top_k"), count)
    width = fields.nested_size("ffn_config", ffn, "ffn_hidden_size")
    found["experts"] = Experts(count, per_token, width, tuple(range(found["layers"])))
    theta = attention.get("rope_theta", 10000.0)
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        found["rope_theta"] = float(theta)


def _special_modernbert(fields: Fields, found: dict[str, Any]) -> None:
    """ModernBERT's decoder: LayerNorms (with bias where norm_bias) before the MLP and before every attention but the
    first layer's, one on the embeddings; a head of a dense layer and a norm before the output (with its bias)."""
    c = found["hidden"]
    per_norm = 2 * c if fields.boolean("norm_bias") else c
    found.update(
        norm="layer" if fields.boolean("norm_bias") else "layer_weight",
        norms_per_layer=1,
        lm_head_bias=fields.boolean("decoder_bias"),
    )
    head = c * c + (c if fields.boolean("classifier_bias") else 0) + per_norm
    found["extras"] += (
        Extra("norms before attention, from layer 1 on", "model", (found["layers"] - 1) * per_norm),
        Extra("the embeddings' norm", "model", per_norm),
        Extra("the head's dense layer and norm", "model", head),
    )


def _special_jetmoe(fields: Fields, found: dict[str, Any]) -> None:
    """JetMoE: attention experts, each num_key_value_heads heads of kv_channels, of which a token runs the top
    num_experts_per_tok: its query heads; keys and values one projection for all (the table's parts count the
    experts it does not run)."""
    top = fields.integer("num_experts_per_tok")
    found.update(kv_heads=found["heads"], heads=top * found["heads"])


def _special_square_out(fields: Fields, found: dict[str, Any]) -> None:
    """Helium: the output projection is C x C, which is the bill's Hq·E x C only where the heads fill the width."""
    if found["heads"] * found["head_dim"] != found["hidden"]:
        raise fields.refuse(
            "head_dim",
            f"times num_attention_heads ({found['heads']}) must be hidden_size, whose square the output projection is",
            found["head_dim"],
        )


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
    for name, built in (
        ("swa_num_attention_heads", heads),
        ("swa_num_key_value_heads", 2 * kv_heads),
        ("swa_head_dim", head_dim),
        ("swa_v_head_dim", value_dim),
        ("add_swa_attention_sink_bias", True),
        ("add_full_attention_sink_bias", False),
        ("hybrid_layer_pattern", [int(kind != "full_attention") for kind in found["layer_types"]]),
        ("moe_layer_freq", [int(i in routed) for i in range(found["layers"])]),
    ):
        fields.agrees(name, built)


def _special_zero_experts(fields: Fields, found: dict[str, Any]) -> None:
    """LongCat-Flash: zero_expert_num experts that pass a token through unchanged, which the router scores beside
    the others and for which transformers allocates gate and up weights that nothing runs; each of its layers is
    two attentions and two MLPs, with the experts beside the first."""
    zero, moe = fields.integer("zero_expert_num", zero=True, none=True) or 0, found["experts"]
    fields.agrees("zero_expert_type", "identity")
    fields.agrees("attention_method", "MLA")
    if moe is None:
        raise fields.refuse("n_routed_experts", "leaves the router without experts, which transformers does not run")
    found["notes"] += (
        f"each of the {found['layers'] // 2} layers of its config is two layers here (two attentions, "
        "two MLPs); the active parameters count the top-k of the experts that compute",
    )
    if zero:
        idle = zero * 2 * moe.intermediate * found["hidden"]
        found["extras"] += (
            Extra("the router's scores of the zero experts", "moe", zero * (found["hidden"] + int(moe.router_bias))),
            Extra("the zero experts' gate and up weights", "moe", idle, active=False),
        )
        found["notes"] += (
            f"{idle * len(moe.layers):,} of the parameters are gate and up weights that transformers"
            " allocates for the zero experts, which compute nothing (a checkpoint holds none)",
        )


# the sizes per_layer_config may give a kind of layer: Gemma-4's heads, dots.llm3's latent attention
GEMMA4_KEYS = ("head_dim", "num_key_value_heads")
DOTS3_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# dots.llm3's sliding layers where the config gives no per_layer_config (its swa_ fields, these by default)
DOTS3_SLIDING = dict(
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1024,
    kv_lora_rank=1024,
    head_dim=256,
    qk_nope_head_dim=192,
    v_head_dim=128,
)


def _layer_index(key: Any, layers: int) -> int | None:
    """A per_layer_config key (5, "5" or "05") as a layer index below `layers`, else None."""
    if isinstance(key, str) and key.isdigit() and len(key) <= 6:
        key = int(key)
    return key if type(key) is int and 0 <= key < layers else None


def _per_layer_config(
    fields: Fields, found: dict[str, Any], keys: tuple[str, ...] = GEMMA4_KEYS
) -> dict[str, dict[str, int]]:
    """transformers' per_layer_config, {layer: {"head_dim": .., "num_key_value_heads": ..}}, as the sizes of each
    kind of layer: every layer of a kind must have the same (a kind whose sizes vary is refused); keys: the sizes
    it may give."""
    given, types = fields.get("per_layer_config", default={}), found["layer_types"]
    if not isinstance(given, dict) or len(given) > len(types):
        raise fields.refuse("per_layer_config", "must be an object of at most one entry a layer")
    per_layer: dict[int, dict[str, int]] = {}
    for key, sizes in given.items():
        index = _layer_index(key, len(types))
        if index is None or not isinstance(sizes, dict) or not set(sizes) <= set(keys):
            raise fields.refuse("per_layer_config", f"must map layer indices to sizes of {', '.join(keys)}")
        per_layer[index] = {name: fields.nested_size("per_layer_config", sizes, name) for name in sizes}
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
    if types != found["layer_types"]:
        found["notes"] += ("the last layer attends in full whatever layer_types says, as its config class forces it",)
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
        found["extras"] += (
            Extra("the per-layer embeddings, their projection and norm", "model", table),
            Extra("the gate and projection of each layer's own input, and norm", "every layer", 2 * c * width + c),
        )
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


def _special_inkling(fields: Fields, found: dict[str, Any]) -> None:
    """Inkling: its sliding layers' heads of their own (swa_); in every attention layer a relative bias mixed from
    d_rel states a head (C·H·d_rel, and a bank of d_rel profiles over rel_extent tokens, the window's in the sliding
    layers), short convolutions over k and v; a short convolution after the attention and after the MLP; a router
    that scores the shared experts too; with dense_intermediate_size, intermediate_size is the experts' width."""
    c, conv, d_rel = found["hidden"], fields.integer("sconv_kernel_size", "conv_kernel_size"), fields.integer("d_rel")
    sliding = KindAttention(
        "sliding_attention",
        fields.integer("swa_num_attention_heads"),
        fields.integer("swa_num_key_value_heads"),
        fields.integer("swa_head_dim"),
    )
    dense = fields.integer("dense_intermediate_size", none=True)
    moe, shared = found["experts"], fields.integer("n_shared_experts", zero=True)
    if dense is not None and moe is not None:  # the experts take intermediate_size, the dense MLP this
        moe = dataclasses.replace(
            moe, intermediate=found["intermediate"], shared_intermediate=shared * found["intermediate"]
        )
    found.update(kind_attention=(sliding,), experts=moe, intermediate=dense or found["intermediate"])
    extents = {"full_attention": fields.integer("rel_extent"), "sliding_attention": found["sliding_window"] or 1}
    full = KindAttention("full_attention", found["heads"], found["kv_heads"], found["head_dim"])
    for kind, extent in extents.items():
        own = sliding if kind == "sliding_attention" else full
        convolved = 2 * own.kv_heads * own.head_dim * conv  # k and v, conv_kernel_size inputs kept each
        what = f"{kind.split('_')[0]} layers' relative bias and k, v convolutions"
        found["extras"] += (Extra(what, kind, c * own.heads * d_rel + d_rel * extent + convolved, state=convolved),)
    found["extras"] += (
        Extra("the convolutions after attention and MLP", "every layer", 2 * c * conv, state=2 * c * conv),
        Extra("the dense MLPs' scale", "dense", 1),
        Extra("the embeddings' norm", "model", c),
        Extra("the router's rows of the shared experts, and its scale", "moe", shared * c + 1),
    )


def _dots3_layers(fields: Fields, layers: int) -> list[str]:
    """dots.llm3's layer kinds as its config class builds them: layer_types, else full layers 0, 1 and every 4th
    from 1 (all with use_sliding_window false), indexed (DeepSeek's indexer) unless use_dsa is false; use_dsa
    given turns the full layers into indexed ones, or back."""
    fields.value("use_dsa")  # read: its default is null where the config gives per_layer_config, else true
    dsa = fields.config.get("use_dsa", None if "per_layer_config" in fields.config else True)
    if dsa is not None and not isinstance(dsa, bool):
        raise fields.refuse("use_dsa", "must be true, false or null")
    full, window = "full_attention" if dsa is False else "indexed_attention", fields.boolean("use_sliding_window")
    given = fields.get("layer_types")
    kinds = {"full_attention", "indexed_attention", "sliding_attention"}
    if given is not None and (not isinstance(given, list) or len(given) != layers or not set(given) <= kinds):
        raise fields.refuse("layer_types", f"must list {layers} layer kinds, each one of {', '.join(sorted(kinds))}")
    types = given or [full if not window or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(layers)]
    if dsa is not None:
        old, new = ("full_attention", "indexed_attention") if dsa else ("indexed_attention", "full_attention")
        types = [new if kind == old else kind for kind in types]
    if {"full_attention", "indexed_attention"} <= set(types):
        raise fields.refuse("layer_types", "mixes full and indexed layers, whose indexers the bill does not tell apart")
    return types


def _dots3_latent(fields: Fields, sizes: dict[str, int]) -> LatentAttention:
    """One kind's latent attention out of its sizes (q_lora_rank required: its q always goes through the rank)."""
    return LatentAttention(
        kv_rank=sizes["kv_lora_rank"],
        rope_dim=sizes["qk_rope_head_dim"],
        nope_dim=sizes["qk_nope_head_dim"],
        v_dim=sizes["v_head_dim"],
        q_rank=sizes["q_lora_rank"],
        bias=fields.boolean("attention_bias"),
    )


def _special_dots3(fields: Fields, found: dict[str, Any]) -> None:
    """dots.llm3: latent attention in every layer, its full layers with DeepSeek's indexer (indexed_attention), its
    sliding layers with latent sizes of their own (per_layer_config, else the swa_ fields); in every layer a
    gate a head (g_proj) and a norm of the rotary key. head_dim is the width RoPE's partial factor is of."""
    raw = _dots3_layers(fields, found["layers"])
    found["layer_types"] = types = tuple(
        "sliding_attention" if k == "sliding_attention" else "full_attention" for k in raw
    )
    base = {
        name: fields.integer(name) for name in DOTS3_KEYS if name not in ("num_attention_heads", "num_key_value_heads")
    }
    base.update(num_attention_heads=found["heads"], num_key_value_heads=found["kv_heads"])
    if "per_layer_config" in fields.config:
        by_kind = _per_layer_config(fields, found, DOTS3_KEYS)
        if set(by_kind) - {"sliding_attention"}:
            raise fields.refuse("per_layer_config", "changes the sizes of the full layers, which the bill reads as one")
        sliding = {**base, **by_kind.get("sliding_attention", {})}
    else:
        sliding = {name: fields.integer(f"swa_{name}") for name in DOTS3_SLIDING}
        sliding["qk_rope_head_dim"] = fields.integer("swa_qk_rope_head_dim", none=True) or (
            sliding["head_dim"] - sliding["qk_nope_head_dim"]
        )
    kinds = []
    for kind, sizes in (("full_attention", base), ("sliding_attention", sliding)):
        if sizes["num_key_value_heads"] != sizes["num_attention_heads"]:
            raise fields.refuse("num_key_value_heads", "must be num_attention_heads (every head decompresses its own)")
        latent, heads = _dots3_latent(fields, sizes), sizes["num_attention_heads"]
        head_dim = latent.nope_dim + latent.rope_dim
        kinds.append(KindAttention(kind, heads, heads, head_dim, latent=latent, indexer=kind == "full_attention"))
        what = f"{kind.split('_')[0]} layers' gate a head and norm of the rotary key"
        found["extras"] += (Extra(what, kind, found["hidden"] * heads + latent.rope_dim),)
    window = fields.integer("sliding_window", none=True) or fields.integer("sliding_window_size")
    found.update(
        latent=kinds[0].latent,
        kind_attention=tuple(kinds),
        head_dim=kinds[0].head_dim,
        kv_heads=found["heads"],
        sliding_window=window if "sliding_attention" in types else None,
    )
    if "indexed_attention" in raw:
        found["indexer"] = Indexer(
            heads=fields.integer("index_n_heads"),
            head_dim=fields.integer("index_head_dim"),
            topk=fields.integer("index_topk"),
            q_rank=base["q_lora_rank"],
        )
    else:
        fields.value("index_n_heads", "index_head_dim", "index_topk")  # read: no layer builds an indexer
    width = fields.integer("moe_shared_expert_intermediate_size", "shared_experts_intermediate_size")
    if found["experts"] is not None:
        shared = found["experts"].shared_intermediate and fields.integer("n_shared_experts", zero=True) * width
        found["experts"] = dataclasses.replace(found["experts"], shared_intermediate=shared)
    rope = found["rope_scaling"] or {}  # its partial factor is of head_dim: RoPE turns the whole rotary key
    scaling = {key: value for key, value in rope.items() if key != "partial_rotary_factor"}
    found["rope_scaling"] = None if scaling in ({}, {"rope_type": "default"}) else scaling
    fields.agrees("mlp_bias", False)


# name -> (the reader, which fills in the ModelShape fields found so far; the kinds of layer it brings
# besides softmax attention)
SPECIAL_READERS: dict[str, tuple[Callable[[Fields, dict[str, Any]], None], tuple[str, ...]]] = {
    "latent": (_special_latent, ()),
    "stablelm": (_special_stablelm, ()),
    "falcon": (_special_falcon, ()),
    "opt": (_special_opt, ()),
    "mtp": (_special_mtp, ()),
    "heads_per_layer": (_special_heads_per_layer, ()),
    "indexer": (_special_indexer, ()),
    "lfm_mlp": (_special_lfm_mlp, ()),
    "dbrx": (_special_dbrx, ()),
    "jetmoe": (_special_jetmoe, ()),
    "square_out": (_special_square_out, ()),
    "modernbert": (_special_modernbert, ()),
    "mimo": (_special_mimo, ()),
    "zero_experts": (_special_zero_experts, ()),
    "gemma4": (_special_gemma4, ()),
    "gemma4_text": (_special_gemma4_text, ()),
    "gemma3n": (_special_gemma3n, ()),
    "inkling": (_special_inkling, ()),
    "dots3": (_special_dots3, OWN_LAYERS),
    **LINEAR_READERS,
    **STATE_SPACE_READERS,
}
