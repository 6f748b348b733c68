"""Model shapes: the sizes a transformer's memory bill depends on, from a preset or a Hugging Face config.json.

A ModelShape holds layers, heads, kv heads, head_dim, hidden, vocab, MLP width and the attention fields
(max positions, sliding window, RoPE's base and long-context scaling); model_bill turns one into bytes and
FLOPs at each context length with the formulas of memory.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._bytes import nbytes
from ._checks import check_bool, check_count, check_positive_int
from .memory import attention_flops, kv_cache_bytes, score_matrix_bytes
from .position import rope_attention_factor, rope_frequencies
from .rope_scaling import check_rope_scaling

# ---------------------------------------------------------------------------------------------------
# model shapes: presets and Hugging Face config.json

ARCHS = ("llama", "gpt2", "attention")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its memory bill depends on.

    arch says how the weights are laid out, for num_parameters:
      "llama"      RMSNorm, gated MLP (gate, up, down), rotary positions, no biases unless qkv_bias
                   (Llama, Mistral, Qwen2, Gemma-2, Phi-3)
      "gpt2"       LayerNorm with bias, 2-matrix MLP, biases everywhere, learned absolute positions
      "attention"  a stack of attention blocks only (w_qkv and w_out, no bias): the article's tiny model
    sliding_window: keys a query may see (None: all). window_layers: how many layers use it (None: all);
    Gemma-2 alternates, so 21 of its 42 layers keep a 4,096-token cache and 21 keep everything.
    rope_theta: RoPE's base (None: no rotary positions, as in gpt2); rope_scaling: the config's
    rope_scaling (or rope_parameters) dict for long context, as position.rope_frequencies takes it.
    """

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    intermediate: int
    max_positions: int | None = None
    sliding_window: int | None = None
    window_layers: int | None = None
    tied_embeddings: bool = False
    arch: str = "llama"
    qkv_bias: bool = False
    norms_per_layer: int = 2
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)  # a dict cannot be hashed

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):  # it heads every table and JSON row
            raise TypeError(f"name must be a str; got {self.name!r} ({type(self.name).__name__})")
        for field in ("layers", "heads", "kv_heads", "head_dim", "hidden"):
            check_positive_int(getattr(self, field), field)
        for field in ("vocab", "intermediate", "norms_per_layer"):
            check_count(getattr(self, field), field)
        for field in ("max_positions", "sliding_window"):
            if getattr(self, field) is not None:
                check_positive_int(getattr(self, field), field)
        if self.window_layers is not None:
            if check_count(self.window_layers, "window_layers") > self.layers:
                raise ValueError(f"window_layers must be between 0 and layers={self.layers}; got {self.window_layers}")
            if self.sliding_window is None:  # the count of layers that slide means nothing without a window
                raise ValueError(
                    f"window_layers counts the layers that use sliding_window, so it needs one; got "
                    f"window_layers={self.window_layers} and sliding_window=None"
                )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads must be a multiple of kv_heads (grouped-query attention); "
                f"got heads={self.heads}, kv_heads={self.kv_heads}"
            )
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
        if self.arch == "gpt2" and self.max_positions is None:
            raise ValueError("a gpt2-style model needs max_positions: its position table has that many rows")
        check_bool(self.tied_embeddings, "tied_embeddings")
        check_bool(self.qkv_bias, "qkv_bias")
        if self.rope_theta is not None:
            theta = self.rope_theta
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
                raise ValueError(f"rope_theta must be a finite number > 1 or None; got {theta!r}")
        if self.rope_scaling is not None:
            if self.rope_theta is None:
                raise ValueError("rope_scaling stretches rotary positions, so it needs rope_theta; got None")
            # every field of the dict, as shape.rope_frequencies() and rope() will read it
            sizes = dict(max_position_embeddings=self.max_positions)
            check_rope_scaling(self.rope_scaling, self.head_dim, base=self.rope_theta, **sizes)
            rope_attention_factor(self.rope_scaling, **sizes)

    def attention_flops(self, tokens: int, batch: int = 1) -> int:
        """QKᵀ and PV of all layers over a causal context of `tokens`: window layers count their band only."""
        windowed = (
            0 if self.sliding_window is None else self.layers if self.window_layers is None else self.window_layers
        )
        full, band = (
            attention_flops(tokens, heads=self.heads, head_dim=self.head_dim, causal=True, batch=batch, window=w)
            for w in (None, self.sliding_window)
        )  # one full layer, one window layer
        return (self.layers - windowed) * full + windowed * band

    def rope_frequencies(self, seq_len: int | None = None) -> Any:
        """θ of this model's RoPE (position.rope_frequencies with its base, scaling and max positions)."""
        if self.rope_theta is None:
            raise ValueError(f"{self.name} has no rotary positions (rope_theta is None)")
        return rope_frequencies(
            self.head_dim,
            self.rope_theta,
            scaling=self.rope_scaling,
            seq_len=seq_len,
            max_position_embeddings=self.max_positions,
        )

    # -- parameters, piece by piece (weights are (in, out) matrices; a bias adds `out`) --------------

    @property
    def attention_parameters(self) -> int:
        """One layer's q, k, v and output projections: C·Hq·E + 2·C·Hkv·E + Hq·E·C, plus biases."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim  # widths of q and of k (= v)
        weights = self.hidden * (q + 2 * kv) + q * self.hidden
        if self.arch == "gpt2":
            return weights + q + 2 * kv + self.hidden  # c_attn and c_proj both carry a bias
        return weights + (q + 2 * kv if self.qkv_bias else 0)  # Qwen2: bias on q, k, v only

    @property
    def mlp_parameters(self) -> int:
        """One layer's MLP: 3·C·F (gate, up, down) for llama; 2·C·F + F + C for gpt2; 0 for attention."""
        c, f = self.hidden, self.intermediate
        if self.arch == "llama":
            return 3 * c * f
        if self.arch == "gpt2":
            return 2 * c * f + f + c
        return 0

    @property
    def norm_parameters(self) -> int:
        """Every norm's weights, the final one included: RMSNorm has C, LayerNorm 2·C (weight, bias)."""
        if self.arch == "attention":
            return 0
        per_norm = 2 * self.hidden if self.arch == "gpt2" else self.hidden
        return (self.layers * self.norms_per_layer + 1) * per_norm

    @property
    def embedding_parameters(self) -> int:
        """Token table V·C, the output head V·C unless tied to it, and gpt2's position table P·C."""
        if self.arch == "attention":
            return 0
        tables = 1 if self.tied_embeddings else 2
        positions = self.max_positions if self.arch == "gpt2" else 0
        return (tables * self.vocab + (positions or 0)) * self.hidden

    @property
    def num_parameters(self) -> int:
        """All weights: embeddings + layers · (attention + MLP) + norms."""
        per_layer = self.attention_parameters + self.mlp_parameters
        return self.embedding_parameters + self.layers * per_layer + self.norm_parameters

    # -- bytes --------------------------------------------------------------------------------------

    def weights_bytes(self, dtype: Any = "bf16") -> int:
        """num_parameters · bytes_per_element."""
        return nbytes(self.num_parameters, dtype)

    def kv_cache_bytes(self, tokens: int, dtype: Any = "bf16", batch: int = 1) -> int:
        """KV cache after `tokens` tokens: window layers keep min(tokens, window), the rest keep all."""
        sizes = dict(kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=dtype, batch=batch)
        if self.sliding_window is None:
            return kv_cache_bytes(tokens, layers=self.layers, **sizes)
        windowed = self.layers if self.window_layers is None else self.window_layers
        full = self.layers - windowed
        total = 0
        if windowed:
            total += kv_cache_bytes(tokens, layers=windowed, window=self.sliding_window, **sizes)
        if full:
            total += kv_cache_bytes(tokens, layers=full, **sizes)
        return total


# Llama 3.1's rope_scaling, as its config.json has it (every Llama 3.1 size shares it)
LLAMA31_ROPE_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# Each preset is the model's Hugging Face config.json, read the way load_model_shape reads it.
# The test suite checks num_parameters against the published size given in each comment.
PRESETS: dict[str, ModelShape] = {
    # "Train a Tiny GPT at Home, Part 2": d_model 256, 4 heads of 64; its one attention block has
    # 4 · 256 · 256 = 262,144 weights (qkv 196,608 + out 65,536). No vocab or MLP in that part.
    "tiny": ModelShape(
        "tiny (article)", layers=1, heads=4, kv_heads=4, head_dim=64, hidden=256, vocab=0,
        intermediate=0, arch="attention",
    ),
    # huggingface.co/openai-community/gpt2/blob/main/config.json: n_layer 12, n_head 12, n_embd 768,
    # n_positions 1024, vocab_size 50257, n_inner null (4 · 768); tied. 124,439,808 parameters.
    "gpt2": ModelShape(
        "GPT-2 small", layers=12, heads=12, kv_heads=12, head_dim=64, hidden=768, vocab=50257,
        intermediate=3072, max_positions=1024, tied_embeddings=True, arch="gpt2",
    ),
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 128256, max_position_embeddings 8192. 8,030,261,248.
    "llama-3-8b": ModelShape(
        "Llama-3-8B", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=128256,
        intermediate=14336, max_positions=8192, rope_theta=500000.0,
    ),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 80 layers, 64 heads, 8 kv heads,
    # hidden 8192, intermediate 28672, vocab 128256, max_position_embeddings 131072, rope_theta 500000,
    # rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, from 8,192). 70,553,706,496.
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B", layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192, vocab=128256,
        intermediate=28672, max_positions=131072, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 32000, max_position_embeddings 32768, sliding_window 4096
    # on every layer. 7,241,732,096.
    "mistral-7b-v0.1": ModelShape(
        "Mistral-7B-v0.1", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=32000,
        intermediate=14336, max_positions=32768, sliding_window=4096, rope_theta=10000.0,
    ),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json: 28 layers, 28 heads, 4 kv heads, hidden 3584,
    # intermediate 18944, vocab 152064, max_position_embeddings 131072, use_sliding_window false, untied;
    # Qwen2 puts a bias on q, k and v. 7,615,616,512.
    "qwen2.5-7b": ModelShape(
        "Qwen2.5-7B", layers=28, heads=28, kv_heads=4, head_dim=128, hidden=3584, vocab=152064,
        intermediate=18944, max_positions=131072, qkv_bias=True, rope_theta=1000000.0,
    ),
    # huggingface.co/google/gemma-2-9b/blob/main/config.json: 42 layers, 16 heads, 8 kv heads,
    # head_dim 256 (not 3584 / 16 = 224), hidden 3584, intermediate 14336, vocab 256000,
    # max_position_embeddings 8192, sliding_window 4096 on every other layer, tied, 4 norms per layer.
    # 9,241,705,984.
    "gemma-2-9b": ModelShape(
        "Gemma-2-9B", layers=42, heads=16, kv_heads=8, head_dim=256, hidden=3584, vocab=256000,
        intermediate=14336, max_positions=8192, sliding_window=4096, window_layers=21,
        tied_embeddings=True, norms_per_layer=4, rope_theta=10000.0,
    ),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json: 32 layers, 32 heads and
    # 32 kv heads of 96, hidden 3072, intermediate 8192, vocab 32064, max_position_embeddings 4096,
    # sliding_window 2047, untied. 3,821,079,552.
    "phi-3-mini": ModelShape(
        "Phi-3-mini", layers=32, heads=32, kv_heads=32, head_dim=96, hidden=3072, vocab=32064,
        intermediate=8192, max_positions=4096, sliding_window=2047, rope_theta=10000.0,
    ),
}  # fmt: skip

# model_type values whose config class ties the output head to the token table when the config.json
# leaves tie_word_embeddings out (PretrainedConfig's default is True; LlamaConfig and others say False).
_TIED_BY_DEFAULT = ("gpt2", "gemma", "gemma2")
# model_type values with 4 norms per layer (pre- and post-norm around both attention and MLP).
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")


def _field(config: dict[str, Any], *names: str, required: bool = True, default: Any = None) -> Any:
    """The first of names present (and not null) in config; a missing required field names them all."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if required:
        wanted = " or ".join(repr(name) for name in names)
        raise ValueError(f"config is missing {wanted}; got keys {sorted(config)}")
    return default


def _config_int(config: dict[str, Any], *names: str, required: bool = True, default: Any = None) -> Any:
    value = _field(config, *names, required=required, default=default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {names[0]!r} must be a positive integer; got {value!r}")
    return value


def _config_bool(config: dict[str, Any], name: str, default: bool) -> bool:
    """A true/false field; JSON's true and false only (the string "false" is truthy in Python)."""
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {name!r} must be true or false; got {value!r} ({type(value).__name__})")
    return value


def _rope_fields(config: dict[str, Any], rotary: bool) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config: rope_theta at the top (default 10,000, every rotary
    config class's default) or inside rope_parameters (transformers 5); rope_scaling or
    rope_parameters as the scaling dict, with a top-level partial_rotary_factor and (Phi-3's)
    original_max_position_embeddings moved into it, so that it is all rope_frequencies needs. Not for
    dynamic: its L0 is max_position_embeddings whatever else the config says, as in transformers."""
    if not rotary:
        return None, None
    parameters = _field(config, "rope_scaling", "rope_parameters", required=False, default={})
    if not isinstance(parameters, dict):
        raise ValueError(f"config field 'rope_scaling' must be an object or null; got {parameters!r}")
    theta = _field(config, "rope_theta", required=False, default=parameters.get("rope_theta", 10000.0))
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    moved = ["partial_rotary_factor"]
    if parameters.get("rope_type", parameters.get("type")) != "dynamic":  # dynamic's L0: max_position_embeddings
        moved.append("original_max_position_embeddings")
    for key in moved:
        if config.get(key) is not None and key not in scaling:
            scaling[key] = config[key]
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        scaling["rope_type"] = "default"
    if scaling.get("rope_type", scaling.get("type")) == "default" and set(scaling) <= {"rope_type", "type"}:
        scaling = {}  # plain RoPE: nothing to carry
    return theta, scaling or None


def _window_layers(config: dict[str, Any], layers: int) -> int | None:
    """How many layers slide: from layer_types when given, else every other layer for Gemma-2."""
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return sum(kind == "sliding_attention" for kind in layer_types)
    if config.get("model_type") == "gemma2":
        return (layers + 1) // 2  # layers 0, 2, 4, ... use the window (modeling_gemma2.py)
    return None


def shape_from_config(config: dict[str, Any], default_name: str | None = None) -> ModelShape:
    """A ModelShape from the dict of a Hugging Face config.json (Llama-style or GPT-2 names).

    head_dim, when the config gives one, wins over hidden_size / num_attention_heads: Gemma-2-9B has
    hidden 3584 and 16 heads, but heads of 256, not 224. Dense models only: a mixture-of-experts
    config (num_local_experts) would be counted as one expert. A multimodal config (LLaVA, Gemma-3,
    Llama-3.2-Vision) keeps its language model in text_config: that is the one read, under the outer
    config's name (the vision tower is not counted).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict; got {type(config).__name__}")
    text = config.get("text_config")
    if isinstance(text, dict) and _field(config, "num_hidden_layers", "n_layer", required=False) is None:
        name = config.get("_name_or_path") or default_name or config.get("model_type")
        outer = {key: config[key] for key in ("tie_word_embeddings",) if key in config}  # set outside, at times
        return shape_from_config({**outer, **text, "_name_or_path": name}, default_name=name)
    model_type = config.get("model_type", "")
    gpt2 = model_type == "gpt2" or "n_layer" in config
    layers = _config_int(config, "num_hidden_layers", "n_layer")
    heads = _config_int(config, "num_attention_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "n_embd")
    vocab = _config_int(config, "vocab_size")
    kv_heads = _config_int(config, "num_key_value_heads", required=False, default=heads)
    head_dim = _config_int(config, "head_dim", required=False)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if gpt2:
        intermediate = _config_int(config, "n_inner", "intermediate_size", required=False, default=4 * hidden)
    else:
        intermediate = _config_int(config, "intermediate_size")
    window = _config_int(config, "sliding_window", required=False)
    if not _config_bool(config, "use_sliding_window", True):  # Qwen2 ships sliding_window 131072 but off
        window = None
    tied = _config_bool(config, "tie_word_embeddings", model_type in _TIED_BY_DEFAULT or gpt2)
    rope_theta, rope_scaling = _rope_fields(config, rotary=not gpt2)
    return ModelShape(
        name=config.get("_name_or_path") or default_name or model_type or "config",
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=vocab,
        intermediate=intermediate,
        max_positions=_config_int(config, "max_position_embeddings", "n_positions", required=False),
        sliding_window=window,
        window_layers=_window_layers(config, layers) if window else None,
        tied_embeddings=tied,
        arch="gpt2" if gpt2 else "llama",
        qkv_bias=_config_bool(config, "attention_bias", False) or model_type == "qwen2",
        norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def load_model_shape(source: str | Path | dict[str, Any] | ModelShape) -> ModelShape:
    """A ModelShape from a preset name (see PRESETS), a path to a config.json (or its folder), or a dict.

    The model's name is the config's own "_name_or_path"; without one, the file's: a/x.json is "x", and
    a/config.json (the Hugging Face layout) is "a", its folder's.

    Every problem with a file is a ValueError (or, for a field of the wrong type, a TypeError) that names
    the file: one that cannot be found or read, is not UTF-8 JSON, nests too deeply, or holds a bad field.
    """
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return shape_from_config(source)
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be a preset name, a path to a config.json or a dict; got {type(source).__name__}")
    if isinstance(source, str) and source.lower() in PRESETS:
        return PRESETS[source.lower()]
    path = _config_path(source)
    config = _read_json(path)
    # a config without a name of its own is named by its file: a/x.json is "x", a/config.json is "a"
    name = path.parent.name if path.name == "config.json" else path.stem
    try:
        return shape_from_config(config, default_name=name or None)
    except (TypeError, ValueError) as err:  # say which file the bad field is in
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"{path}: {err}") from None


# a config.json is a few KiB (Phi-3's with its longrope lists: about 10 KiB); a bigger file is something else
MAX_CONFIG_BYTES = 16 * 2**20


def _config_path(source: str | Path) -> Path:
    """The config.json that source names (itself, or config.json in the folder), checked to be a file."""
    path = Path(source)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except OSError as err:  # a name longer than the file system allows (ENAMETOOLONG), and the like
        raise ValueError(f"source {_shown(source)} cannot be opened as a config.json: {err.strerror}") from None
    if not found:
        raise ValueError(
            f"source must be a preset ({', '.join(PRESETS)}) or a path to a config.json; got {_shown(source)}"
        )
    return path


def _read_json(path: Path) -> Any:
    """The JSON in path, every failure a ValueError that names the file."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path} has {size:,} bytes, more than a config.json (at most {MAX_CONFIG_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        byte = f"byte {err.object[err.start]:#04x} at offset {err.start}"
        raise ValueError(f"{path} is not UTF-8 text, as a config.json is: {byte}") from None
    except OSError as err:
        raise ValueError(f"{path} could not be read: {err.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:  # Python's decoder recurses once per level: thousands of [ or { exhaust the stack
        raise ValueError(f"{path} nests its JSON too deeply to read (a config.json is a few levels deep)") from None
    except ValueError as err:  # an integer longer than Python converts (4,300 digits)
        raise ValueError(f"{path} holds a value that cannot be read: {err}") from None


def _shown(source: str | Path) -> str:
    """source for a message: whole when short, else its ends and its length (a 5,000-character path)."""
    text = str(source)
    return repr(text) if len(text) <= 200 else f"{text[:80]!r} ... {text[-40:]!r} ({len(text):,} characters)"


# ---------------------------------------------------------------------------------------------------
# one model's bill


def model_bill(
    model: ModelShape, tokens: int | list[int], *, dtype: Any = "bf16", kv_dtype: Any = None, batch: int = 1
) -> dict[str, Any]:
    """Weights, KV cache, naive score matrices and attention FLOPs of a model at each context length.

    dtype is for the weights and the scores, kv_dtype for the cache (default: dtype). Per context T:
        kv_cache_bytes        model.kv_cache_bytes(T): sliding-window layers keep at most W tokens
        score_matrix_bytes    every layer's and head's T x T scores at once (the article's worst case)
        attention_flops       QKᵀ and PV over all layers, causal (decoder); sliding-window layers
                              count only their band (about T·W entries, not T²/2)
        beyond_max_positions  T > max_position_embeddings: the model was not trained that long
    Plain ints and bools only, so the result is also JSON.
    """
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape (see load_model_shape); got {type(model).__name__}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        tokens = [int(tokens)]  # one context length
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be an int or a list of ints; got {type(tokens).__name__}")
    contexts = []
    for n in tokens:
        n = check_count(n, "tokens")
        flops = model.attention_flops(n, batch)
        contexts.append(
            {
                "tokens": n,
                "kv_cache_bytes": model.kv_cache_bytes(n, kv_dtype, batch),
                "score_matrix_bytes": score_matrix_bytes(
                    n, heads=model.heads, layers=model.layers, batch=batch, dtype=dtype
                ),
                "attention_flops": flops,
                "beyond_max_positions": model.max_positions is not None and n > model.max_positions,
            }
        )
    return {
        "model": model.name,
        "parameters": model.num_parameters,
        "weights_bytes": model.weights_bytes(dtype),
        "kv_bytes_per_token": model.kv_cache_bytes(1, kv_dtype, batch),
        "max_positions": model.max_positions,
        "sliding_window": model.sliding_window,
        "contexts": contexts,
    }
