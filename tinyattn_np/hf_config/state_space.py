"""The readers of the state-space layers and the hybrids that mix them with attention: Mamba, Mamba-2, Bamba,
Granite-4, Jamba, Falcon-H1, Nemotron-H, Zamba and Zamba2, each what its config alone says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model_parts import Experts, Extra, StateSpace
from .fields import OWN_LAYERS, Fields

__all__ = ["STATE_SPACE_READERS"]


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
        names = dict(
            state="mamba_d_state",
            conv="mamba_d_conv",
            rank="mamba_dt_rank",
            proj="mamba_proj_bias",
            bias="mamba_conv_bias",
        )
    rank = fields.get(names["rank"])
    rank = -(-found["hidden"] // 16) if rank == "auto" else fields.integer(names["rank"])  # ceil(C / 16)
    inner = _mamba_inner(fields, found, f"{prefix}expand", None if prefix else "intermediate_size")
    return StateSpace(
        "mamba",
        inner=inner,
        state=fields.integer(names["state"]),
        conv_kernel=fields.integer(names["conv"]),
        dt_rank=rank,
        proj_bias=fields.boolean(names["proj"]),
        conv_bias=fields.boolean(names["bias"]),
        **flags,
    )


def _mamba2(fields: Fields, found: dict[str, Any], names: dict[str, str], inner: int, norm: bool = True) -> StateSpace:
    """Mamba-2 layers, their sizes under the names this family gives them."""
    return StateSpace(
        "mamba2",
        inner=inner,
        state=fields.integer(names["state"]),
        conv_kernel=fields.integer(names["conv"]),
        heads=fields.integer(names["heads"]),
        groups=fields.integer(names["groups"]),
        proj_bias=fields.boolean(names["proj"]),
        conv_bias=fields.boolean(names["bias"]),
        norm=norm,
    )


MAMBA2 = dict(
    state="state_size", conv="conv_kernel", heads="num_heads", groups="n_groups", proj="use_bias", bias="use_conv_bias"
)


HYBRID = dict(
    state="mamba_d_state",
    conv="mamba_d_conv",
    heads="mamba_n_heads",
    groups="mamba_n_groups",
    proj="mamba_proj_bias",
    bias="mamba_conv_bias",
)


def _only_mamba(fields: Fields, found: dict[str, Any], space: StateSpace) -> None:
    """A stack of state-space layers alone: a norm before each, no attention, no MLP."""
    found.update(
        state_space=space,
        layer_types=("mamba",) * found["layers"],
        mlp="none",
        norms_per_layer=1,
        rope_theta=None,
        rope_scaling=None,
        positions="none",
    )


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
    spelled = {
        "mamba": "mamba",
        "linear_attention": "mamba",
        "attention": "full_attention",
        "full_attention": "full_attention",
    }
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
    spelled = {
        "linear_attention": "mamba",
        "mamba": "mamba",
        "full_attention": "full_attention",
        "attention": "full_attention",
        "mlp": "mlp",
        "moe": "mlp",
    }
    given = fields.get("layers_block_type")
    kinds = _kinds(fields, "layers_block_type", found["layers"], spelled)
    if fields.integer("moe_latent_size", none=True) is not None:
        raise fields.refuse("moe_latent_size", "runs the experts in a latent space, which the bill does not read")
    inner = fields.integer("mamba_num_heads") * fields.integer("mamba_head_dim")
    names = dict(
        state="ssm_state_size",
        conv="conv_kernel",
        heads="mamba_num_heads",
        groups="n_groups",
        proj="use_bias",
        bias="use_conv_bias",
    )
    moe = [i for i, kind in enumerate(given) if kind == "moe"]
    mlps = tuple(i for i, kind in enumerate(kinds) if kind == "mlp")
    experts = None
    if moe:
        experts = Experts(
            fields.integer("n_routed_experts"),
            fields.integer("num_experts_per_tok", none=True),
            fields.integer("moe_intermediate_size"),
            tuple(moe),
            shared_intermediate=fields.integer("moe_shared_expert_intermediate_size", zero=True),
            gated=False,
        )
    found.update(
        state_space=_mamba2(fields, found, names, inner),
        layer_types=kinds,
        mlp_layers=mlps,
        experts=experts,
        norms_per_layer=1,
        mlp="plain",
    )


def _zamba_layers(fields: Fields, found: dict[str, Any], default: list[str]) -> tuple[str, ...]:
    """Zamba's layers_block_type (its default where the config gives none): a hybrid layer runs the shared
    attention block and then its Mamba layer, the others their Mamba layer alone."""
    spelled = {"hybrid": "full_attention", "linear_attention": "mamba", "mamba": "mamba"}
    if fields.get("layers_block_type") is None:
        return tuple(spelled[kind] for kind in default)
    return _kinds(fields, "layers_block_type", found["layers"], spelled)


def _shared_block(found: dict[str, Any], mlp_bias: bool) -> int:
    """One of Zamba's shared blocks: attention over the hidden state and the embeddings side by side (2·C), out to C;
    a norm of 2·C and one of C; a gated MLP (its biases where mlp_bias)."""
    c, heads, kv_heads, head_dim, width = (
        found[key] for key in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")
    )
    attention = 2 * c * (heads + 2 * kv_heads) * head_dim + heads * head_dim * c
    return attention + 3 * c + 3 * c * width + (2 * width + c if mlp_bias else 0)


def _zamba_common(fields: Fields, found: dict[str, Any], kinds: tuple[str, ...], space: StateSpace) -> None:
    """What both Zambas have: a Mamba layer (and its norm) in every layer, the shared attention's cache in each
    hybrid layer, no MLP of a layer's own, no positions but where said."""
    fields.agrees("attention_hidden_size", 2 * found["hidden"])
    found.update(
        layer_types=kinds,
        state_space=space,
        mamba_beside_attention=True,
        shared_attention=True,
        mlp_layers=(),
        norms_per_layer=1,
    )
    found["extras"] += (Extra("each hybrid layer's linear", "full_attention", found["hidden"] ** 2),)


def _blocks(found: dict[str, Any], shared: int) -> list[int]:
    """The uses (hybrid layers, in order) whose attention block has weights of its own: transformers ties the uses to
    the first `shared` blocks only where it ties the embeddings (tie_word_embeddings); else every use has a copy."""
    uses = found["layer_types"].count("full_attention")
    return list(range(min(shared, uses) if found["tied_embeddings"] else uses))


def _special_zamba(fields: Fields, found: dict[str, Any]) -> None:
    """Zamba: Mamba layers of n_mamba_heads heads (Mamba-1's weights, split), and one attention block that every
    hybrid layer runs (from layer 2, every attn_layer_period-th from attn_layer_offset), its weights counted once."""
    period, offset = fields.integer("attn_layer_period"), fields.integer("attn_layer_offset", zero=True)
    default = (
        ["linear_attention"] * 2
        + ["hybrid"]
        + ["hybrid" if i % period == offset else "linear_attention" for i in range(max(found["layers"] - 3, 0))]
    )
    space = _mamba(fields, found, "mamba_")
    if space.inner % fields.integer("n_mamba_heads"):
        raise fields.refuse("n_mamba_heads", f"must divide the Mamba layers' {space.inner} channels")
    _zamba_common(fields, found, _zamba_layers(fields, found, default[: found["layers"]]), space)
    blocks = len(_blocks(found, 1)) * _shared_block(found, False)
    found["extras"] += (Extra("the shared attention block", "model", blocks),)


def _special_zamba2(fields: Fields, found: dict[str, Any]) -> None:
    """Zamba2: Mamba-2 layers; num_mem_blocks attention blocks that the hybrid layers take in turn, the i-th use
    with low-rank adapters (adapter_rank) on the MLP's gate and up projections, and on q, k and v where
    use_shared_attention_adapter, held by block i mod num_mem_blocks; heads of 2·C / num_attention_heads whatever the
    config says, as its class sets them."""
    c, heads = found["hidden"], found["heads"]
    default = ["linear_attention"] + (["linear_attention"] * 5 + ["hybrid"]) * 7 + ["linear_attention"] * 4
    default += ["hybrid"] + ["linear_attention"] * 3 + ["hybrid"] + ["linear_attention"] * 2
    if fields.get("layers_block_type") is None and found["layers"] != len(default):
        raise fields.missing("layers_block_type")  # the class's pattern is of 54 layers
    kinds = _zamba_layers(fields, found, default)
    inner = _mamba_inner(fields, found, "mamba_expand")
    names = dict(HYBRID, heads="n_mamba_heads", groups="mamba_ngroups", proj="add_bias_linear", bias="add_bias_linear")
    space = StateSpace(**{**_mamba2(fields, found, names, inner).__dict__, "conv_bias": True})
    hybrid = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    for name, built in (
        ("attention_head_dim", 2 * c // heads),
        ("mamba_headdim", inner // space.heads),
        ("use_conv_bias", True),
        ("hybrid_layer_ids", hybrid),
    ):
        fields.agrees(name, built)
    found["head_dim"] = 2 * c // heads
    _zamba_common(fields, found, kinds, space)
    shared, rank = fields.integer("num_mem_blocks"), fields.integer("adapter_rank")
    adapter = rank * (c + 2 * found["intermediate"])  # gate and up: C -> rank -> 2·F
    if fields.boolean("use_shared_attention_adapter"):
        adapter += 3 * 2 * (2 * c * rank)  # q, k and v: 2·C -> rank -> 2·C
    blocks = _blocks(found, shared)
    held = sum(len(range(use % shared, len(hybrid), shared)) for use in blocks)  # the uses i ≡ use (mod shared)
    weights = len(blocks) * _shared_block(found, space.proj_bias)
    found["extras"] += (
        Extra("the shared attention blocks", "model", weights),
        Extra("the adapters each block holds", "model", held * adapter),
    )
    if fields.boolean("use_long_context"):
        found["max_positions"] = 16384
    if not fields.boolean("use_mem_rope"):
        found.update(positions="none", rope_theta=None, rope_scaling=None)


# name -> (the reader, the kinds of layer it brings besides softmax attention), as special.SPECIAL_READERS
STATE_SPACE_READERS: dict[str, tuple[Callable[[Fields, dict[str, Any]], None], tuple[str, ...]]] = {
    "mamba": (_special_mamba, OWN_LAYERS),
    "mamba2": (_special_mamba2, OWN_LAYERS),
    "bamba": (_special_bamba, OWN_LAYERS),
    "granite_hybrid": (_special_granite_hybrid, OWN_LAYERS),
    "jamba": (_special_jamba, OWN_LAYERS),
    "falcon_h1": (_special_falcon_h1, ()),
    "nemotron_h": (_special_nemotron_h, OWN_LAYERS),
    "zamba": (_special_zamba, OWN_LAYERS),
    "zamba2": (_special_zamba2, OWN_LAYERS),
}
