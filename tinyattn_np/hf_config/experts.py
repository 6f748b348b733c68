"""Experts: which layers route and how wide the experts are, read by the names a row's Moe gives."""

from __future__ import annotations

from typing import Any

from ..model_parts import Experts
from .fields import Fields, shown_value, switch
from .table import Moe

__all__ = ["read_experts"]


def _every(fields: Fields, moe: Moe) -> int:
    """Every how many layers route: 1, a constant, or a field."""
    return 1 if moe.every is None else moe.every if isinstance(moe.every, int) else fields.integer(moe.every)


def _layers(fields: Fields, moe: Moe, layers: int) -> list[int]:
    """The indices of the layers that route, by the row's rule (Moe's docstring)."""
    if moe.layers == "dense_first":
        first = fields.integer(moe.dense, zero=True, none=True) or 0
        every = _every(fields, moe)
        return [i for i in range(first, layers) if i % every == 0]
    if moe.layers == "qwen":
        listed = fields.integers("mlp_only_layers")  # null: none, or the class's first dense_first layers
        dense = set(range(moe.dense_first or 0) if listed is None else listed)
        step = fields.integer("decoder_sparse_step")
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if moe.layers == "llama4":
        step = fields.integer("interleave_moe_layer_step")
        given = fields.integers("moe_layers")
        return list(range(step - 1, layers, step)) if given is None else sorted(set(given))
    if moe.layers == "ernie":
        start = fields.integer("moe_layer_start_index", zero=True)
        end = fields.get("moe_layer_end_index")
        if isinstance(end, bool) or not isinstance(end, int) or end < -1:
            raise ValueError(f"config field 'moe_layer_end_index' must be a layer index or -1; got {shown_value(end)}")
        end = layers - 1 if end == -1 else end
        every = fields.integer("moe_layer_interval")
        return [i for i in range(layers) if (i + 1) % every == 0 and start <= i <= end]
    if moe.layers == "mlp_layer_types":  # "dense" or "sparse" per layer, else the first `dense` layers dense
        kinds = fields.get("mlp_layer_types")
        if moe.dense_first is None:
            fields.value(moe.dense)  # read: where the config lists the kinds, the list wins
        if kinds is None:
            first = moe.dense_first if moe.dense_first is not None else fields.integer(moe.dense, zero=True, none=True)
            every = _every(fields, moe)
            return [i for i in range(min(first or 0, layers), layers) if i % every == 0]
        if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
            raise fields.refuse("mlp_layer_types", f"must be {layers} of 'dense' and 'sparse'")
        return [i for i, kind in enumerate(kinds) if kind == "sparse"]
    if moe.layers == "period":  # Jamba
        period, offset = fields.integer("expert_layer_period"), fields.integer("expert_layer_offset", zero=True)
        return [i for i in range(layers) if i % period == offset]
    return list(range(0, layers, _every(fields, moe)))


def read_experts(fields: Fields, moe: Moe, sizes: dict[str, Any]) -> Experts | None:
    """The experts a row's Moe names (None where the config routes no layer), and the dense layers' width."""
    count = fields.integer(*moe.count, zero=True, none=True)
    layers = [i for i in _layers(fields, moe, sizes["layers"]) if i < sizes["layers"]]
    if moe.dense_width is not None:  # None: the dense layers' MLP is intermediate_size wide
        sizes["dense_intermediate"] = fields.integer(moe.dense_width, none=True) or sizes["intermediate"]
    if not count or not layers:
        return None
    per_token = fields.integer(*moe.per_token, none=True)
    width = sizes["intermediate"] if moe.width is None else fields.integer(moe.width)
    shared_count = 1 if moe.shared_count is None else fields.integer(moe.shared_count, zero=True, none=True) or 0
    shared_width = width if moe.shared_width is None else fields.integer(moe.shared_width, zero=True, none=True) or 0
    if moe.shared_count is None and moe.shared_width is None:
        shared_count = 0
    shared = shared_count * shared_width
    return Experts(
        count,
        per_token,
        width,
        tuple(layers),
        shared_intermediate=shared,
        shared_gate=moe.shared_gate and shared > 0,
        router_bias=switch(fields, moe.router_bias),
        expert_bias=moe.expert_bias,
        score_bias=switch(fields, moe.score_bias),
        gated=moe.gated,
        beside_mlp=moe.beside_mlp,
    )
