"""Which layers slide, chunk, are linear or state-space layers: the config's layer_types, else the rule its
config class builds them by (Arch.windows)."""

from __future__ import annotations

from typing import Any

from .._shape_checks import ATTENTION_TYPES, LAYER_TYPES
from .fields import Fields, shown_value
from .table import NO_MODEL_TYPE, Arch

__all__ = ["read_layer_types"]

FULL, SLIDE = "full_attention", "sliding_attention"
# the config spellings of a layer kind that transformers' classes use beside LAYER_TYPES
SPELLINGS = {
    "attention": FULL,
    "full": FULL,
    "indexed_attention": FULL,
    "sliding": SLIDE,
    "hybrid": FULL,
    "hybrid_sliding": SLIDE,
    "linear": "linear_attention",
    "mamba": "mamba",
    "conv": "linear_attention",
    "mlp": "mlp",
    "moe": "mlp",
}


# the fields each rule of _default_layer_types reads, which layer_types supersedes where a config has it
NOPE = ("no_rope_layers", "no_rope_layer_interval")
PATTERN = ("sliding_window_pattern", "_sliding_window_pattern")
RULE_FIELDS = {
    "qwen2": ("max_window_layers",),
    "qwen2_moe": ("max_window_layers",),
    "nope": NOPE,
    "llama4": NOPE,
    "qwen3_next": ("full_attention_interval",),
    "pattern6": PATTERN,
    "pattern4": PATTERN,
    "exaone4": PATTERN,
    "pattern": PATTERN,
    "afmoe": ("global_attn_every_n_layers",),
    "lfm2": ("full_attn_idxs",),
    "modernbert": ("global_attn_every_n_layers",),
    "max_window": ("max_window_layers",),
    "inkling": ("local_layer_ids",),
}


def _sliding_window(fields: Fields, arch: Arch) -> int | None:
    """The window, or None when off: sliding_window null or 0, or use_sliding_window false (Qwen, SmolLM3)."""
    if arch.windows == "modernbert":  # half of local_attention, as its config class works it out
        fields.value("sliding_window")
        return (fields.integer("local_attention", zero=True, none=True) or 0) // 2 or None
    name = {"gpt_neo": "window_size", "inkling": "sliding_window_size"}.get(arch.windows, "sliding_window")
    window = fields.integer(name, zero=True, none=True) or None
    switched = arch.windows in ("qwen2", "qwen2_moe", "switched", "nope") or arch is NO_MODEL_TYPE
    if switched and not fields.boolean("use_sliding_window"):
        return None  # Qwen2 ships sliding_window 131072 (or 0) with use_sliding_window false
    return window


def _pattern(fields: Fields, rule: str, layers: int, window: bool) -> list[str]:
    """Every sliding_window_pattern-th layer full, the others slide (Gemma-3: 6, Cohere2 and EXAONE 4: 4)."""
    pattern = fields.get("sliding_window_pattern", "_sliding_window_pattern", default=6 if rule == "pattern6" else 4)
    if isinstance(pattern, str) and set(pattern) <= {"L", "G"} and pattern:  # "LLLG": L slides, G is global
        return [SLIDE if window and pattern[i % len(pattern)] == "L" else FULL for i in range(layers)]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"config field 'sliding_window_pattern' must be a positive integer; got {shown_value(pattern)}"
        )
    return [SLIDE if window and (i + 1) % pattern else FULL for i in range(layers)]


def _gpt_neo_layers(fields: Fields, layers: int) -> list[str]:
    """GPT-Neo's attention_types expanded, as its config class expands them (attention_layers is that list)."""
    fields.value("attention_layers")  # transformers recomputes it from attention_types
    types, kinds = fields.get("attention_types"), []
    for entry in types if isinstance(types, list) else [None]:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], list)
            and isinstance(entry[1], int)
            and not isinstance(entry[1], bool)
            and 0 <= entry[1] <= layers
            and set(entry[0]) <= {"global", "local"}
        ):
            raise fields.refuse("attention_types", "must be [[kinds, repeats], ...] of 'global' and 'local'")
        kinds += entry[0] * entry[1]
    if len(kinds) != layers:
        raise fields.refuse("attention_types", f"must name {layers} layers (num_layers); it names {len(kinds)}")
    return kinds


def _kimi_layers(fields: Fields, layers: int) -> list[str]:
    """Kimi Linear's full_attn_layers and kda_layers, each layer numbered from 1 and in one list."""
    config = fields.get("linear_attn_config", default={})
    if not isinstance(config, dict):
        raise fields.refuse("linear_attn_config", "must be an object")
    full, kda = config.get("full_attn_layers"), config.get("kda_layers")
    if full is None or kda is None:  # the class's rule
        return [FULL if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    numbers = [*full, *kda] if isinstance(full, list) and isinstance(kda, list) else []
    if len(numbers) != layers or sorted(n for n in numbers if type(n) is int) != list(range(1, layers + 1)):
        why = f"must number each of the {layers} layers once, from 1, in full_attn_layers or kda_layers"
        raise fields.refuse("linear_attn_config", why, config)
    return [FULL if i + 1 in full else "linear_attention" for i in range(layers)]


def _default_layer_types(fields: Fields, arch: Arch, layers: int, window: bool, chunk: bool) -> list[str]:
    """The layer kinds transformers' config class builds when config.json has no layer_types."""
    rule = arch.windows
    if rule == "qwen2":  # the layers from max_window_layers on slide
        first = fields.integer("max_window_layers", zero=True)
        return [SLIDE if window and i >= first else FULL for i in range(layers)]
    if rule == "qwen2_moe":  # every other layer below max_window_layers
        below = fields.integer("max_window_layers", zero=True)
        return [SLIDE if window and i % 2 == 0 and i < below else FULL for i in range(layers)]
    if rule in ("pattern6", "pattern4", "exaone4", "pattern"):
        return _pattern(fields, rule, layers, window)
    if rule in ("nope", "llama4"):  # flags: 1 = the layer has RoPE (no_rope_layers' own meaning)
        every = fields.integer("no_rope_layer_interval")
        flags = fields.integers("no_rope_layers", layers) or [int((i + 1) % every != 0) for i in range(layers)]
        if rule == "nope":  # SmolLM3: the NoPE layers slide
            return [SLIDE if window and not flags[i] else FULL for i in range(layers)]
        return ["chunked_attention" if chunk and flags[i] else FULL for i in range(layers)]  # Llama 4
    if rule == "qwen3_next":  # every full_attention_interval-th layer full, the others linear
        every = fields.integer("full_attention_interval")
        return ["linear_attention" if (i + 1) % every else FULL for i in range(layers)]
    if rule == "every4_from0":  # every 4th layer full, from layer 0 (CWM, Granite's sliding variants)
        return [FULL if i % 4 == 0 or not window else SLIDE for i in range(layers)]
    if rule == "afmoe":  # every global_attn_every_n_layers-th layer full, the others slide
        every = fields.integer("global_attn_every_n_layers")
        return [SLIDE if window and (i + 1) % every else FULL for i in range(layers)]
    if rule == "max_window":  # the layers from max_window_layers on slide (dots.llm1: no switch)
        first = fields.integer("max_window_layers", zero=True)
        return [SLIDE if window and i >= first else FULL for i in range(layers)]
    if rule == "required":  # the class builds nothing without layer_types (LFM2-MoE)
        raise fields.missing("layer_types")
    if rule == "lfm2":  # full_attn_idxs attend, the others convolve
        listed = fields.integers("full_attn_idxs")
        attending = set(range(layers) if listed is None else listed)
        return [FULL if i in attending else "linear_attention" for i in range(layers)]
    if rule == "lfm3":  # layers 2, 6, 10, ... full, 4, 8, 12, ... slide, the others convolve
        fourth = SLIDE if window else FULL  # layers 4, 8, 12, ...
        return [FULL if i % 4 == 2 else fourth if i % 4 == 0 and i else "linear_attention" for i in range(layers)]
    if rule == "qwen3_5":  # every 4th layer full, the others gated DeltaNet
        return ["linear_attention" if (i + 1) % 4 else FULL for i in range(layers)]
    if rule == "olmo_hybrid":  # every 4th layer full, from layer 3
        return [FULL if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if rule == "modernbert":  # every global_attn_every_n_layers-th layer full, from layer 0, the others slide
        every = fields.integer("global_attn_every_n_layers")
        return [SLIDE if window and i % every else FULL for i in range(layers)]
    if rule == "pattern5":  # every 5th layer full, the others slide (Kolibri)
        return [SLIDE if window and (i + 1) % 5 else FULL for i in range(layers)]
    if rule == "listed":  # the class lists every layer full where the config lists none
        return [FULL] * layers
    if rule == "given":  # the class derives layer_types its own way: a config with a window must give them
        if window:
            raise fields.missing("layer_types")
        return [FULL] * layers
    if rule == "gpt_neo":  # attention_types: [[kinds, repeats], ...], each kind "global" or "local" (a window)
        return [SLIDE if kind == "local" and window else FULL for kind in _gpt_neo_layers(fields, layers)]
    if rule == "kimi":  # linear_attn_config's layers (numbered from 1), else every 4th layer full from layer 4
        return _kimi_layers(fields, layers)
    if rule == "inkling":  # local_layer_ids slide, else every layer but every 6th
        listed = fields.integers("local_layer_ids")
        local = set(listed) if listed is not None else {i for i in range(layers) if (i + 1) % 6}
        return [SLIDE if i in local and window else FULL for i in range(layers)]
    if rule == "mimo":  # layer 0 and every 6th layer full, the others slide (MiMo-V2-Flash)
        return [FULL if i == 0 or (i + 1) % 6 == 0 or not window else SLIDE for i in range(layers)]
    if rule == "minimax":
        return [FULL if i % 2 == 0 else "linear_attention" for i in range(layers)]
    alternate = rule == "alternate"  # Gemma-2, gpt-oss: layers 0, 2, 4, ... slide
    return [SLIDE if window and (i % 2 == 0 or not alternate) else FULL for i in range(layers)]


def _given_layer_types(fields: Fields, arch: Arch, layers: int, kinds: tuple[str, ...]) -> list[str] | None:
    """config.json's layer_types, in LAYER_TYPES' spelling, each a kind this architecture builds."""
    given = fields.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != layers:
        raise fields.refuse("layer_types", f"must be a list of {layers} layer kinds (one a layer)")
    spelled = [SPELLINGS.get(kind, kind) if isinstance(kind, str) else kind for kind in given]
    unknown = sorted({str(kind) for kind, ours in zip(given, spelled, strict=True) if ours not in kinds}, key=str)
    if unknown:
        why = f"names layer kinds the reader does not know (it knows {', '.join(kinds)})"
        raise fields.refuse("layer_types", why, unknown)
    return spelled


def read_layer_types(fields: Fields, arch: Arch, layers: int, mixers: tuple[str, ...] = ()) -> dict[str, Any]:
    """layer_types, sliding_window and attention_chunk: the config's layer_types, else its class's rule.
    mixers: the kinds besides softmax attention that this architecture builds (linear_attention, mamba, mlp)."""
    if arch.windows == "none" and not mixers:
        if fields.get("layer_types") is not None:  # read: a list that says what the class builds anyway
            _given_layer_types(fields, arch, layers, (FULL,))
        return dict(layer_types=None, sliding_window=None, attention_chunk=None)
    window = _sliding_window(fields, arch)
    chunk = fields.integer("attention_chunk_size", none=True) if arch.windows == "llama4" else None
    kinds = tuple(kind for kind in LAYER_TYPES if kind in ATTENTION_TYPES or kind in mixers)
    given = _given_layer_types(fields, arch, layers, kinds)
    if given is not None:  # layer_types wins: the fields of the class's rule are read, and change nothing
        fields.value(*RULE_FIELDS.get(arch.windows, ()))
    types = tuple(given or _default_layer_types(fields, arch, layers, window is not None, chunk is not None))
    if "sliding_attention" in types and window is None:
        raise ValueError(
            "config field 'layer_types' has sliding_attention layers, but the sliding window is off "
            f"(sliding_window {shown_value(fields.config.get('sliding_window'))}, use_sliding_window "
            f"{shown_value(fields.config.get('use_sliding_window'))})"
        )
    return dict(layer_types=types, sliding_window=window, attention_chunk=chunk)
