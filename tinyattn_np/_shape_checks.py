"""A ModelShape's fields checked and its defaults filled, in the order its __post_init__ runs them.

The shape is read duck-typed (models.py defines it); a filled default is set with object.__setattr__ (the
dataclass is frozen), so that two shapes that mean the same model compare equal.
"""

from __future__ import annotations

import math
from typing import Any

from ._checks import check_bool, check_count, check_positive_int
from ._rope_scaling import attention_factor, check_rope_scaling

__all__ = [
    "ARCHS",
    "ATTENTION_TYPES",
    "LAYER_TYPES",
    "check_block",
    "check_choice",
    "check_rope",
    "check_sizes",
    "fill_from_arch",
    "fill_layer_types",
    "set_field",
]

# the kinds of layer: softmax attention (full, a sliding window, chunks), linear attention, a state-space
# layer (Mamba), or no token mixing at all (an MLP or experts alone: Nemotron-H)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LAYER_TYPES = (*ATTENTION_TYPES, "linear_attention", "mamba", "mlp")
ARCHS = ("llama", "gpt2", "attention")
# what arch sets where a field is left as None: (mlp, norm, positions without rope_theta, bias on qkv, out, MLP)
ARCH_DEFAULTS: dict[str, tuple[str, str, str, bool]] = {
    "llama": ("gated", "rms", "none", False),
    "gpt2": ("plain", "layer", "learned", True),
    "attention": ("none", "none", "none", False),
}
MLPS = ("gated", "plain", "none")
NORMS = ("rms", "layer", "layer_weight", "none")
QK_NORMS = ("head", "head_bias", "per_head", "l2")
POSITIONS = ("rope", "learned", "alibi", "sinusoidal", "none")
FLAGS = (
    "tied_embeddings",
    "qkv_bias",
    "out_bias",
    "mlp_bias",
    "lm_head_bias",
    "sinks",
    "attention_gate",
    "parallel_block",
    "mamba_beside_attention",
    "final_norm",
    "shared_attention",
)


def set_field(shape: Any, field: str, value: Any) -> None:
    object.__setattr__(shape, field, value)


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_sizes(shape: Any) -> None:
    """The sizes: positive ints, a window that means something, heads in groups."""
    if not isinstance(shape.name, str):  # it heads every table and JSON row
        raise TypeError(f"name must be a str; got {shape.name!r} ({type(shape.name).__name__})")
    for field in ("layers", "heads", "kv_heads", "head_dim", "hidden"):
        check_positive_int(getattr(shape, field), field)
    for field in ("vocab", "intermediate", "norms_per_layer", "kv_shared_layers"):
        check_count(getattr(shape, field), field)
    for field in ("max_positions", "sliding_window", "attention_chunk", "embedding_dim"):
        if getattr(shape, field) is not None:
            check_positive_int(getattr(shape, field), field)
    if shape.window_layers is not None:
        if check_count(shape.window_layers, "window_layers") > shape.layers:
            raise ValueError(f"window_layers must be between 0 and layers={shape.layers}; got {shape.window_layers}")
        if shape.sliding_window is None:  # the count of layers that slide means nothing without a window
            raise ValueError(
                f"window_layers counts the layers that use sliding_window, so it needs one; got "
                f"window_layers={shape.window_layers} and sliding_window=None"
            )
    if shape.kv_shared_layers >= shape.layers:
        raise ValueError(f"kv_shared_layers must be below layers={shape.layers}; got {shape.kv_shared_layers}")
    if shape.heads % shape.kv_heads:
        raise ValueError(
            f"heads must be a multiple of kv_heads (grouped-query attention); "
            f"got heads={shape.heads}, kv_heads={shape.kv_heads}"
        )
    check_choice(shape.arch, "arch", ARCHS)


def fill_from_arch(shape: Any) -> None:
    """Every field left as None takes arch's default (see ModelShape's docstring)."""
    mlp, norm, positions, biases = ARCH_DEFAULTS[shape.arch]
    defaults = {"mlp": mlp, "norm": norm, "qkv_bias": biases, "out_bias": biases, "mlp_bias": biases}
    for field, default in defaults.items():
        if getattr(shape, field) is None:
            set_field(shape, field, default)
    if shape.positions is None:
        set_field(shape, "positions", "rope" if shape.rope_theta is not None else positions)


def check_block(shape: Any) -> None:
    """The block's fields: known names, booleans, and positions that agree with rope_theta."""
    check_choice(shape.mlp, "mlp", MLPS)
    check_choice(shape.norm, "norm", NORMS)
    check_choice(shape.positions, "positions", POSITIONS)
    if shape.qk_norm is not None:
        check_choice(shape.qk_norm, "qk_norm", QK_NORMS)
    for field in FLAGS:
        check_bool(getattr(shape, field), field)
    if not isinstance(shape.architecture, str):
        raise TypeError(f"architecture must be a str; got {shape.architecture!r}")
    if shape.positions == "learned" and shape.max_positions is None:
        raise ValueError("a gpt2-style model needs max_positions: its learned position table has that many rows")
    if (shape.positions == "rope") != (shape.rope_theta is not None):
        raise ValueError(
            f"positions={shape.positions!r} and rope_theta={shape.rope_theta!r}: RoPE, and only RoPE, has a base"
        )
    if not isinstance(shape.notes, tuple) or not all(isinstance(note, str) for note in shape.notes):
        raise TypeError(f"notes must be a tuple of str; got {shape.notes!r}")


def fill_layer_types(shape: Any) -> None:
    """layer_types from sliding_window and window_layers when not given; window_layers from layer_types."""
    types = shape.layer_types
    if types is None:
        sliding = (
            0 if shape.sliding_window is None else shape.layers if shape.window_layers is None else shape.window_layers
        )
        types = ("sliding_attention",) * sliding + ("full_attention",) * (shape.layers - sliding)
    if not isinstance(types, tuple) or len(types) != shape.layers:
        raise ValueError(f"layer_types must be a tuple of {shape.layers} layer kinds (one per layer); got {types!r}")
    for kind in types:
        check_choice(kind, "layer_types[i]", LAYER_TYPES)
    sliding = types.count("sliding_attention")
    if shape.window_layers is not None and shape.window_layers != sliding:
        raise ValueError(f"window_layers={shape.window_layers} but layer_types has {sliding} sliding_attention layers")
    needs = {
        "sliding_attention": "sliding_window",
        "chunked_attention": "attention_chunk",
        "linear_attention": "linear",
        "mamba": "state_space",
    }
    for kind, field in needs.items():
        if kind in types and getattr(shape, field) is None:
            raise ValueError(f"layer_types has {types.count(kind)} {kind} layers, which need {field}; got None")
    for field, kind in (("linear", "linear_attention"), ("state_space", "mamba")):
        beside = field == "state_space" and shape.mamba_beside_attention
        if getattr(shape, field) is not None and kind not in types and not beside:
            raise ValueError(f"{field} describes {kind} layers, but layer_types has none")
    set_field(shape, "layer_types", types)
    set_field(shape, "window_layers", None if shape.sliding_window is None or sliding == shape.layers else sliding)


def check_rope(shape: Any) -> None:
    """rope_theta a base > 1; every field of rope_scaling, as rope_frequencies and rope will read it."""
    if shape.rope_theta is not None:
        theta = shape.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
            raise ValueError(f"rope_theta must be a finite number > 1 or None; got {theta!r}")
    if shape.rope_scaling is not None:
        if shape.rope_theta is None:
            raise ValueError("rope_scaling stretches rotary positions, so it needs rope_theta; got None")
        sizes = dict(max_position_embeddings=shape.max_positions)
        check_rope_scaling(shape.rope_scaling, shape.rotary_dim, base=shape.rope_theta, **sizes)
        attention_factor(check_rope_scaling(shape.rope_scaling, **sizes))
