"""Which layers slide, chunk or are linear: the config's layer_types, else its config class's rule."""

from __future__ import annotations

from typing import Any

from ..models import LAYER_TYPES
from .fields import Fields, shown_value
from .table import NO_MODEL_TYPE, Arch, refuse

__all__ = ["read_layer_types"]


def _sliding_window(fields: Fields, arch: Arch) -> int | None:
    """The window, or None when off: sliding_window null or 0, or use_sliding_window false (Qwen, SmolLM3)."""
    window = fields.integer("sliding_window", "sliding_window_size", required=False, zero=True) or None
    switched = arch.windows in ("qwen2", "qwen2_moe", "switched", "nope") or arch is NO_MODEL_TYPE
    if switched and not fields.boolean("use_sliding_window", arch is NO_MODEL_TYPE):
        return None  # Qwen2 ships sliding_window 131072 (or 0) with use_sliding_window false
    return window


def _default_layer_types(fields: Fields, arch: Arch, layers: int, window: bool, chunk: bool) -> list[str]:
    """The layer kinds transformers' config class builds when config.json has no layer_types."""
    rule, full, slide = arch.windows, "full_attention", "sliding_attention"
    if rule == "qwen2":  # the layers from max_window_layers on slide
        first = fields.integer("max_window_layers", required=False, zero=True, default=28)
        return [slide if window and i >= first else full for i in range(layers)]
    if rule == "qwen2_moe":  # every other layer below max_window_layers
        below = fields.integer("max_window_layers", required=False, zero=True, default=28)
        return [slide if window and i % 2 == 0 and i < below else full for i in range(layers)]
    if rule in ("pattern6", "pattern4", "exaone4"):  # every n-th layer full, the others slide
        pattern = fields.get(
            "sliding_window_pattern", "_sliding_window_pattern", default=6 if rule == "pattern6" else 4
        )
        if isinstance(pattern, str) and set(pattern) <= {"L", "G"} and pattern:  # "LLLG": L slides, G is global
            return [slide if window and pattern[i % len(pattern)] == "L" else full for i in range(layers)]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"config field 'sliding_window_pattern' must be a positive integer; got {pattern!r}")
        return [slide if window and (i + 1) % pattern else full for i in range(layers)]
    if rule in ("nope", "llama4"):  # flags: 1 = the layer has RoPE (no_rope_layers' own meaning)
        every = fields.integer("no_rope_layer_interval", required=False, default=4)
        flags = fields.integers("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
        if len(flags) != layers:
            raise ValueError(f"config field 'no_rope_layers' must have {layers} entries; got {len(flags)}")
        if rule == "nope":  # SmolLM3: the NoPE layers slide
            return [slide if window and not flags[i] else full for i in range(layers)]
        return ["chunked_attention" if chunk and flags[i] else full for i in range(layers)]  # Llama 4
    if rule == "qwen3_next":  # every full_attention_interval-th layer full, the others linear
        every = fields.integer("full_attention_interval", required=False, default=4)
        return ["linear_attention" if (i + 1) % every else full for i in range(layers)]
    if rule == "minimax":
        return [full if i % 2 == 0 else "linear_attention" for i in range(layers)]
    alternate = rule == "alternate"  # Gemma-2, gpt-oss: layers 0, 2, 4, ... slide
    return [slide if window and (i % 2 == 0 or not alternate) else full for i in range(layers)]


def read_layer_types(fields: Fields, arch: Arch, layers: int) -> dict[str, Any]:
    """layer_types, sliding_window and attention_chunk: the config's layer_types, else its class's rule."""
    if arch.windows == "none":
        return dict(layer_types=None, sliding_window=None, attention_chunk=None)
    window = _sliding_window(fields, arch)
    chunk = fields.integer("attention_chunk_size", required=False) if arch.windows == "llama4" else None
    derived = _default_layer_types(fields, arch, layers, window is not None, chunk is not None)
    given = fields.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ValueError(
                f"config field 'layer_types' must be a list of {layers} layer kinds; got {shown_value(given)}"
            )
        unknown = sorted({kind for kind in given if kind not in LAYER_TYPES}, key=str)
        if unknown:
            why = f"names layer kinds the reader does not know (it knows {', '.join(LAYER_TYPES)})"
            raise refuse("layer_types", unknown, fields.config.get("model_type", ""), why)
    types = tuple(given if given is not None else derived)
    if "sliding_attention" in types and window is None:
        raise ValueError(
            "config field 'layer_types' has sliding_attention layers, but the sliding window is off "
            f"(sliding_window {fields.config.get('sliding_window')!r}, use_sliding_window "
            f"{fields.config.get('use_sliding_window')!r})"
        )
    if "linear_attention" in types and arch.special not in ("gated_deltanet", "lightning"):
        raise refuse("layer_types", "linear_attention", fields.config.get("model_type", ""), "has no linear layers")
    return dict(layer_types=types, sliding_window=window, attention_chunk=chunk)
