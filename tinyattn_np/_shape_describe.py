"""ModelShape.describe: the architecture in a few short lines, as the bill prints them (the shape read duck-typed:
models.py defines it)."""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]


def describe(shape: Any) -> list[str]:
    """ModelShape.describe: attention, the block, the layer kinds, the experts, each in a line."""
    if shape.latent is not None:
        lat = shape.latent
        q = "a full q projection" if lat.q_rank is None else f"q through a rank of {lat.q_rank:,}"
        attention = (
            f"MLA: {shape.heads} heads; the cache keeps a latent of {lat.kv_rank} + a rotary key of "
            f"{lat.rope_dim} per token and layer; {q}"
        )
    else:
        kv = f"{shape.kv_heads} kv head{'s' if shape.kv_heads > 1 else ''}"
        attention = f"{shape.attention_kind}: {shape.heads} query heads over {kv} of {shape.head_dim}"
        named = {
            f"{shape.qk_norm} q/k norm": shape.qk_norm,
            "sinks": shape.sinks,
            "an output gate": shape.attention_gate,
        }
        extras = [text for text, flag in named.items() if flag]
        attention += f" ({', '.join(extras)})" if extras else ""
        attention += f"; values of {shape.head_dim_v}" if shape.head_dim_v is not None else ""
    mlp = {"gated": "gated MLP (3 matrices)", "plain": "2-matrix MLP", "none": "no MLP"}[shape.mlp or "none"]
    norm = {"rms": "RMSNorm", "layer": "LayerNorm", "layer_weight": "LayerNorm without bias", "none": "no norm weights"}
    norms = norm["none"] if shape.norm in (None, "none") else f"{norm[shape.norm]} x {shape.norms_per_layer} per layer"
    block = [mlp, norms, f"positions: {shape.positions}"]
    block += ["parallel attention and MLP"] if shape.parallel_block else []
    block += ["tied embeddings" if shape.tied_embeddings else "untied embeddings"] if shape.arch != "attention" else []
    lines = [attention] if shape.attention_layers else []
    lines += [_describe_kind(sizes) for sizes in shape.kind_attention if shape.count(sizes.kind)]
    lines += [", ".join(block), _describe_layers(shape)]
    if shape.indexer is not None:
        lines.append(
            f"an indexer of {shape.indexer.heads} heads of {shape.indexer.head_dim} picks "
            f"{shape.indexer.topk:,} keys a query; its key is cached beside the latent"
        )
    if shape.state_space is not None:
        space = shape.state_space
        beside = ", beside every attention layer" if shape.mamba_beside_attention else ""
        lines.append(f"{space.kind} layers of {space.inner:,} channels, a state of {space.state} each{beside}")
    if shape.experts is not None:
        lines.append(_describe_experts(shape))
    if shape.extras:
        lines.append("also: " + ", ".join(extra.what for extra in shape.extras))
    return lines + list(shape.notes)


def _describe_layers(shape: Any) -> str:
    """'48 layers: 12 full + 36 linear (a state of fixed size)'."""
    state = " (a state of fixed size)" if shape.linear is not None or shape.state_space is not None else ""
    return f"{shape.layers} layer{'s' if shape.layers > 1 else ''}: {shape.layer_summary()}{state}"


def _describe_experts(shape: Any) -> str:
    assert shape.experts is not None
    moe = shape.experts
    per_token = "k unknown" if moe.per_token is None else f"{moe.per_token} per token"
    shared = f", shared width {moe.shared_intermediate:,}" if moe.shared_intermediate else ""
    dense = shape.mlp_layer_count - (0 if moe.beside_mlp else len(moe.layers))
    dense_text = f"; {dense} dense layers of width {shape.intermediate:,}" if dense else ""
    beside = ", beside the layer's MLP" if moe.beside_mlp else ""
    experts = f"{moe.count} experts of width {moe.intermediate:,}, {per_token}{shared}{beside}"
    return f"MoE on {len(moe.layers)} layers: {experts}{dense_text}"


def _describe_kind(sizes: Any) -> str:
    """'sliding layers: 64 query heads over 8 kv heads of 192, values of 128, sinks'; a latent kind's latent."""
    kind = sizes.kind.split("_")[0]
    if sizes.latent is not None:
        lat = sizes.latent
        indexer = "" if sizes.indexer else ", no indexer"
        latent = f"a latent of {lat.kv_rank} + a rotary key of {lat.rope_dim}"
        return f"{kind} layers: MLA of {sizes.heads} heads, {latent}{indexer}"
    kv = f"{sizes.kv_heads} kv head{'s' if sizes.kv_heads > 1 else ''}"
    parts = [f"{kind} layers: {sizes.heads} query heads over {kv} of {sizes.head_dim}"]
    parts += [f"values of {sizes.value_dim}"] if sizes.value_dim is not None else []
    parts += ["sinks"] if sizes.sinks else []
    parts += ["the keys are the values"] if not sizes.values else []
    return ", ".join(parts)
