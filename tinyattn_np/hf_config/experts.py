"""Experts: how each family of mixtures of experts names them in its config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model_parts import Experts
from .fields import Fields

__all__ = ["MOE_READERS"]


def _moe_every_layer(fields: Fields, sizes: dict[str, Any], **flags: bool) -> Experts:
    """Mixtral's names (MiniMax, Granite-MoE, OLMoE, gpt-oss): every layer routes, experts of intermediate_size."""
    count = fields.integer("num_local_experts", "num_experts")
    per_token = fields.integer("num_experts_per_tok", "experts_per_token", required=False)
    return Experts(count, per_token, sizes["intermediate"], tuple(range(sizes["layers"])), **flags)


def _moe_qwen(fields: Fields, sizes: dict[str, Any]) -> Experts | None:
    """Qwen-MoE: layer i routes unless in mlp_only_layers, every decoder_sparse_step-th; a gated shared expert."""
    count = fields.integer("num_experts", "num_local_experts", zero=True)
    per_token = fields.integer("num_experts_per_tok", required=False)
    step = fields.integer("decoder_sparse_step", required=False, default=1)
    dense = fields.integers("mlp_only_layers") or []
    shared = fields.integer("shared_expert_intermediate_size", required=False, zero=True, default=0)
    layers = tuple(i for i in range(sizes["layers"]) if i not in dense and count > 0 and (i + 1) % step == 0)
    if not layers:
        return None
    width = fields.integer("moe_intermediate_size")
    return Experts(count, per_token, width, layers, shared_intermediate=shared, shared_gate=shared > 0)


def _moe_deepseek(fields: Fields, sizes: dict[str, Any]) -> Experts | None:
    """DeepSeek: layer i routes from first_k_dense_replace on, every moe_layer_freq-th; n_shared_experts
    shared experts of moe_intermediate_size run as one MLP of their summed width."""
    count = fields.integer("n_routed_experts", required=False)
    first = fields.integer("first_k_dense_replace", required=False, zero=True, default=0)
    every = fields.integer("moe_layer_freq", required=False, default=1)
    per_token = fields.integer("num_experts_per_tok", required=False)
    shared = fields.integer("n_shared_experts", required=False, zero=True, default=0)
    layers = tuple(i for i in range(sizes["layers"]) if i >= first and i % every == 0)
    if count is None or not layers:
        return None
    width = fields.integer("moe_intermediate_size")
    return Experts(count, per_token, width, layers, shared_intermediate=shared * width)


def _moe_llama4(fields: Fields, sizes: dict[str, Any]) -> Experts:
    """Llama 4: moe_layers, else every interleave_moe_layer_step-th layer; experts and one shared expert of
    intermediate_size; the dense layers' MLP is intermediate_size_mlp wide."""
    count = fields.integer("num_local_experts")
    per_token = fields.integer("num_experts_per_tok", required=False)
    step = fields.integer("interleave_moe_layer_step", required=False, default=1)
    layers = fields.integers("moe_layers")
    layers = list(range(step - 1, sizes["layers"], step)) if layers is None else layers
    width = sizes["intermediate"]
    sizes["intermediate"] = fields.integer("intermediate_size_mlp", required=False, default=width)
    return Experts(count, per_token, width, tuple(layers), shared_intermediate=width)


def _moe_ernie(fields: Fields, sizes: dict[str, Any]) -> Experts | None:
    """Ernie-4.5: layers start .. end (end -1: the last), every interval-th; a score bias that is a parameter."""
    count = fields.integer("moe_num_experts")
    per_token = fields.integer("moe_k", required=False)
    start = fields.integer("moe_layer_start_index", required=False, zero=True, default=1)
    end = fields.get("moe_layer_end_index", default=-1)
    if isinstance(end, bool) or not isinstance(end, int) or end < -1:
        raise ValueError(f"config field 'moe_layer_end_index' must be a layer index or -1; got {end!r}")
    end = sizes["layers"] - 1 if end == -1 else end
    every = fields.integer("moe_layer_interval", required=False, default=1)
    shared = fields.integer("moe_num_shared_experts", required=False, zero=True, default=2)
    layers = tuple(i for i in range(sizes["layers"]) if (i + 1) % every == 0 and start <= i <= end)
    if not layers:
        return None
    width = fields.integer("moe_intermediate_size")
    return Experts(count, per_token, width, layers, shared_intermediate=shared * width, score_bias=True)


MOE_READERS: dict[str, Callable[[Fields, dict[str, Any]], Experts | None]] = {
    "mixtral": _moe_every_layer,
    "gpt_oss": lambda fields, sizes: _moe_every_layer(fields, sizes, router_bias=True, expert_bias=True),
    "qwen": _moe_qwen,
    "deepseek": _moe_deepseek,
    "llama4": _moe_llama4,
    "ernie": _moe_ernie,
}
