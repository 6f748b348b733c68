"""What one architecture alone has: a reader of its own for what no other config says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model_parts import Extra, Indexer, LatentAttention, LinearAttention
from .fields import Fields

__all__ = ["SPECIAL_READERS"]


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
            raise ValueError(
                f"config field {field!r} is {value!r}, but qk_nope_head_dim + qk_rope_head_dim = {nope + rope}"
            )
    found.update(latent=latent, head_dim=nope + rope, kv_heads=found["heads"])  # every head decompresses its own k, v
    _special_mtp(fields, found)


def _special_mtp(fields: Fields, found: dict[str, Any]) -> None:
    """Multi-token-prediction layers: a note, for transformers does not build them."""
    for name in ("num_nextn_predict_layers", "num_mtp_layers"):
        mtp = fields.integer(name, zero=True) if fields.get(name) else 0
        if mtp:
            found["notes"] += (f"{mtp} multi-token-prediction layer(s) ({name}) not counted: transformers does "
                               "not build them",)  # fmt: skip


def _special_gated_deltanet(fields: Fields, found: dict[str, Any]) -> None:
    """Qwen3-Next: its linear layers' heads, widths and convolution."""
    found["linear"] = LinearAttention(
        "gated_deltanet",
        key_heads=fields.integer("linear_num_key_heads"), value_heads=fields.integer("linear_num_value_heads"),
        key_dim=fields.integer("linear_key_head_dim"), value_dim=fields.integer("linear_value_head_dim"),
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )  # fmt: skip


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
}
