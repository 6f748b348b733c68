"""The GPT's checks (gpt.py): a GPTConfig's fields, and the weights handed to a GPT against the shapes its config
makes. Each failure a ValueError or TypeError that names the field or the weight, what was expected and what
came. The kinds a field may take come from the caller (gpt.py's and layers.py's tuples)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import check_bool, check_positive_int

__all__ = ["check_config", "checked_params"]


def check_config(config: Any, kinds: Mapping[str, tuple[str, ...]], layer_kinds: Any) -> None:
    """config's fields: the sizes positive ints, each field of `kinds` one of its kinds (positions first), the
    width split into heads (of an even size for RoPE, which turns pairs), bias a bool, dropout in [0, 1), and
    layer_pattern None or a string of layer_kinds' letters at most as long as the layers."""
    for name in ("vocab", "context", "layers", "heads", "width"):
        check_positive_int(getattr(config, name), name)
    if config.mlp_hidden is not None:
        check_positive_int(config.mlp_hidden, "mlp_hidden")
    for name, allowed in kinds.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {getattr(config, name)!r}")
    rope = config.positions == "rope"
    if config.width % config.heads or (rope and (config.width // config.heads) % 2):
        even = " of an even size (RoPE turns pairs)" if rope else ""
        raise ValueError(f"width ({config.width}) must split into {config.heads} heads{even}")
    check_bool(config.bias, "bias")
    dropout = config.dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a number in [0, 1); got {dropout!r}")
    pattern = config.layer_pattern
    if pattern is not None and (
        not isinstance(pattern, str) or not 0 < len(pattern) <= config.layers or set(pattern) - set(layer_kinds)
    ):
        raise ValueError(
            f"layer_pattern must be None or a string of A (softmax attention) and L (a gated delta layer), one "
            f"letter a layer, repeated over the layers, at most {config.layers} long; got {pattern!r}"
        )


def checked_params(shapes: dict[str, tuple[int, ...]], params: Any, dtype: str) -> dict[str, NDArray[Any]]:
    """params checked against shapes, every name there and no other, each of its shape and a float array,
    copied into a new array of `dtype` in shapes' order."""
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict name -> array; got {type(params).__name__}")
    missing, unexpected = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"params do not fit this config: missing {missing}, unexpected {unexpected}")
    checked = {}
    for name, shape in shapes.items():
        value = np.asarray(params[name])
        if value.shape != shape:
            raise ValueError(f"params[{name!r}] must have shape {shape} for this config; got {value.shape}")
        if value.dtype.kind != "f":
            raise TypeError(f"params[{name!r}] must be a float array; got dtype {value.dtype}")
        checked[name] = np.array(value, dtype=dtype)  # our own copy: the optimizer changes it in place
    return checked
