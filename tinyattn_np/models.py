"""Model shapes: the sizes a transformer's memory bill depends on, and the bill.

A ModelShape holds layers, heads, kv heads, head_dim, hidden, vocab, MLP width, the kind of each layer
(full, sliding-window, chunked or linear attention), how its blocks are built (gated or plain MLP, which
norms, which biases) and the parts some models add (model_parts.py): a mixture of experts, multi-head
latent attention, linear-attention layers with a state of fixed size. Its methods count parameters (total
and active), bytes and FLOPs with the formulas of memory.py; bill.py's model_bill gathers them at each
context length.

Where shapes come from: presets.py (released models), or a Hugging Face config.json through the config
reader (tinyattn_np.hf_config: load_model_shape, shape_from_config), which refuses what it does not
understand. The rules, one line each, are on docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ._bytes import nbytes
from ._checks import check_bool, check_count, check_positive_int
from ._rope_scaling import check_rope_scaling
from .memory import attention_flops, kv_cache_bytes, latent_cache_bytes
from .model_parts import Experts, LatentAttention, LinearAttention
from .position import rope_attention_factor, rope_frequencies

__all__ = ["LAYER_TYPES", "ModelShape"]

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")

# ---------------------------------------------------------------------------------------------------
# the shape of a model

ARCHS = ("llama", "gpt2", "attention")
# what arch sets where a field is left as None: (mlp, norm, positions without rope_theta, bias on qkv, out, MLP)
_ARCH_DEFAULTS: dict[str, tuple[str, str, str, bool]] = {
    "llama": ("gated", "rms", "none", False),
    "gpt2": ("plain", "layer", "learned", True),
    "attention": ("none", "none", "none", False),
}
MLPS = ("gated", "plain", "none")
NORMS = ("rms", "layer", "layer_weight", "none")
QK_NORMS = ("head", "head_bias", "per_head", "l2")
POSITIONS = ("rope", "learned", "alibi", "none")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its memory bill depends on.

    Basics. layers, heads (query heads), kv_heads, head_dim, hidden (C), vocab and intermediate (the MLP's
    width F) are the sizes; arch sets the block's defaults:
      "llama"      RMSNorm, gated MLP (gate, up, down), no biases (Llama, Mistral, Qwen, Gemma, Phi-3)
      "gpt2"       LayerNorm with bias, 2-matrix MLP, biases everywhere, learned absolute positions
      "attention"  a stack of attention blocks only (w_qkv and w_out, no bias): the article's tiny model
    sliding_window: keys a query may see (None: all); window_layers: how many layers use it (None: all
    of them). rope_theta: RoPE's base (None: no rotary positions); rope_scaling: the config's rope_scaling
    (or rope_parameters) dict for long context, as position.rope_frequencies takes it.

    Details: what a field left as None takes from arch, and what other models need.
      architecture   the config's model_type that was recognized ("" for a shape written by hand)
      mlp            "gated" (3 matrices: gate, up, down), "plain" (2: up, down), "none"
      norm           "rms" (C weights), "layer" (C weights and C biases), "layer_weight" (LayerNorm without
                     bias: Cohere), "none" (OLMo's LayerNorm has no parameters); norms_per_layer of them in
                     each layer, and one at the end
      qkv_bias, out_bias, mlp_bias, lm_head_bias   a bias on q, k and v; on the output projection; on the
                     MLP's matrices; on the output head (Phi-2)
      qk_norm        "head" (one norm of E on q, one on k: Qwen3, Gemma-3), "head_bias" (LayerNorm of E:
                     Phi), "per_head" ((Hq + Hkv)·E weights: OLMo-2 over the whole width, Cohere and
                     StableLM per head), "l2" (no weights: Llama 4)
      sinks          one learned logit per query head and layer (gpt-oss)
      attention_gate the query projection also yields a gate on the output: q is 2·Hq·E wide (Qwen3-Next)
      parallel_block attention and MLP read the same normed input (Falcon, Cohere, Phi-2, GPT-NeoX): the
                     count of norms in norms_per_layer says what it changes
      positions      "rope", "learned" (a P x C table: GPT-2), "alibi" (no weights, no rotation), "none"
      layer_types    one of LAYER_TYPES per layer (None: from sliding_window and window_layers, the first
                     window_layers layers sliding); attention_chunk: the chunk of chunked layers (Llama 4)
      experts, latent, linear   Experts, LatentAttention, LinearAttention: see their docstrings
      quantization   the config's quantization_config method (e.g. "fp8"); the bill's dtype is the caller's
      notes          what the reader left out, said once in the bill (a vision tower, MTP layers)
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
    qkv_bias: bool | None = None
    norms_per_layer: int = 2
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)  # a dict cannot be hashed
    architecture: str = ""
    mlp: str | None = None
    norm: str | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    lm_head_bias: bool = False
    qk_norm: str | None = None
    sinks: bool = False
    attention_gate: bool = False
    parallel_block: bool = False
    positions: str | None = None
    layer_types: tuple[str, ...] | None = None
    attention_chunk: int | None = None
    experts: Experts | None = None
    latent: LatentAttention | None = None
    linear: LinearAttention | None = None
    quantization: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_sizes(self)
        _fill_from_arch(self)
        _check_block(self)
        _fill_layer_types(self)
        _check_parts(self)
        _check_rope(self)

    # -- the layers, by kind ------------------------------------------------------------------------

    def count(self, kind: str) -> int:
        """How many layers are of this kind (one of LAYER_TYPES)."""
        assert self.layer_types is not None  # __post_init__ fills it
        return self.layer_types.count(kind)

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention (full, sliding or chunked): all but the linear ones."""
        return self.layers - self.count("linear_attention")

    @property
    def attention_kind(self) -> str:
        """ "MHA" (a K and V per query head), "GQA" (groups of query heads share one), "MQA" (one for all of
        them) or "MLA" (a latent that every head decompresses)."""
        if self.latent is not None:
            return "MLA"
        return "MHA" if self.kv_heads == self.heads else "MQA" if self.kv_heads == 1 else "GQA"

    @property
    def kv_width(self) -> int:
        """Numbers an attention layer keeps per token: 2·Hkv·E (k and v), or kv_rank + rope_dim (the latent)."""
        if self.latent is not None:
            return self.latent.kv_rank + self.latent.rope_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The width RoPE rotates: qk_rope_head_dim for latent attention, else head_dim (before any
        partial_rotary_factor, which rope_scaling carries)."""
        return self.latent.rope_dim if self.latent is not None else self.head_dim

    def _windows(self) -> dict[str, int | None]:
        """Kind -> the keys a layer of that kind keeps at most (None: all of them), for the attention kinds."""
        return {
            "full_attention": None,
            "sliding_attention": self.sliding_window,
            "chunked_attention": self.attention_chunk,
        }

    # -- parameters, piece by piece (weights are (in, out) matrices; a bias adds `out`) --------------

    @property
    def attention_parameters(self) -> int:
        """One attention layer: C·Hq·E (q; twice that with attention_gate) + 2·C·Hkv·E (k, v) + Hq·E·C (out),
        the biases, the q/k norms and the sinks; latent attention's own formula (LatentAttention)."""
        if self.latent is not None:
            return self.latent.parameters(self.hidden, self.heads)
        q = self.heads * self.head_dim * (2 if self.attention_gate else 1)  # width of q (and its gate)
        kv = self.kv_heads * self.head_dim  # width of k (= v)
        weights = self.hidden * (q + 2 * kv) + self.heads * self.head_dim * self.hidden
        biases = (q + 2 * kv if self.qkv_bias else 0) + (self.hidden if self.out_bias else 0)
        qk_norm = {
            None: 0,
            "l2": 0,
            "head": 2 * self.head_dim,
            "head_bias": 4 * self.head_dim,
            "per_head": (self.heads + self.kv_heads) * self.head_dim,
        }[self.qk_norm]
        return weights + biases + qk_norm + (self.heads if self.sinks else 0)

    @property
    def linear_attention_parameters(self) -> int:
        """One linear-attention layer's weights (0 without linear layers)."""
        return 0 if self.linear is None else self.linear.parameters(self.hidden)

    def _mlp_parameters(self, width: int) -> int:
        c = self.hidden
        if self.mlp == "gated":
            return 3 * c * width + (2 * width + c if self.mlp_bias else 0)
        if self.mlp == "plain":
            return 2 * c * width + (width + c if self.mlp_bias else 0)
        return 0

    @property
    def mlp_parameters(self) -> int:
        """One dense MLP: 3·C·F (gate, up, down) gated, 2·C·F plain, + 2F + C or F + C with mlp_bias."""
        return self._mlp_parameters(self.intermediate)

    @property
    def moe_parameters(self) -> int:
        """One MoE layer: the router, every expert and the shared experts (0 without experts)."""
        if self.experts is None:
            return 0
        moe = self.experts
        shared = self._mlp_parameters(moe.shared_intermediate) if moe.shared_intermediate else 0
        gate = self.hidden if moe.shared_gate else 0
        return moe.router_parameters(self.hidden) + moe.count * moe.expert_parameters(self.hidden) + shared + gate

    @property
    def norm_parameters(self) -> int:
        """Every norm's weights, the final one included: RMSNorm has C, LayerNorm 2·C (weight, bias)."""
        per_norm = {"rms": 1, "layer": 2, "layer_weight": 1, "none": 0}[self.norm or "none"] * self.hidden
        return (self.layers * self.norms_per_layer + 1) * per_norm

    @property
    def embedding_parameters(self) -> int:
        """Token table V·C, the output head V·C unless tied to it (and V with lm_head_bias), and the learned
        position table P·C."""
        if self.arch == "attention":
            return 0
        tables = 1 if self.tied_embeddings else 2
        positions = (self.max_positions or 0) if self.positions == "learned" else 0
        return (tables * self.vocab + positions) * self.hidden + (self.vocab if self.lm_head_bias else 0)

    @property
    def num_parameters(self) -> int:
        """All weights: embeddings + every layer's attention (or linear attention) and MLP (or MoE) + norms."""
        assert self.layer_types is not None
        moe_layers = 0 if self.experts is None else len(self.experts.layers)
        linear = self.count("linear_attention")
        mixers = (self.layers - linear) * self.attention_parameters + linear * self.linear_attention_parameters
        mlps = (self.layers - moe_layers) * self.mlp_parameters + moe_layers * self.moe_parameters
        return self.embedding_parameters + mixers + mlps + self.norm_parameters

    @property
    def active_parameters(self) -> int | None:
        """The weights one token runs: all but the routed experts it does not use, (E - k) per MoE layer.

        Equal to num_parameters without experts; None when the config does not say k. The embedding table
        counts (a token reads its row), as in DeepSeek-V3's "37 B activated" of its 671 B.
        """
        if self.experts is None:
            return self.num_parameters
        moe = self.experts
        if moe.per_token is None:
            return None
        unused = (moe.count - moe.per_token) * moe.expert_parameters(self.hidden) * len(moe.layers)
        return self.num_parameters - unused

    # -- bytes --------------------------------------------------------------------------------------

    def weights_bytes(self, dtype: Any = "bf16") -> int:
        """num_parameters · bytes_per_element: every expert is held, whichever a token runs."""
        return nbytes(self.num_parameters, dtype)

    def _kind_kv_bytes(self, kind: str, tokens: int, dtype: Any, batch: int, decompressed: bool) -> int:
        """K and V (or the latent) of the layers of one attention kind after `tokens` tokens."""
        layers, window = self.count(kind), self._windows()[kind]
        if not layers:
            return 0
        sizes = dict(layers=layers, dtype=dtype, batch=batch, window=window)
        if self.latent is None:
            return kv_cache_bytes(tokens, kv_heads=self.kv_heads, head_dim=self.head_dim, **sizes)
        if decompressed:  # every head's key (nope + rope) and value (v_dim), as a naive implementation keeps them
            return kv_cache_bytes(tokens, kv_heads=self.heads, head_dim=self.head_dim, head_dim_v=self.latent.v_dim,
                                  **sizes)  # fmt: skip
        return latent_cache_bytes(tokens, kv_rank=self.latent.kv_rank, rope_dim=self.latent.rope_dim, **sizes)

    def kv_cache_bytes(self, tokens: int, dtype: Any = "bf16", batch: int = 1, *, decompressed: bool = False) -> int:
        """K and V after `tokens` tokens, summed over the attention layers: full layers keep every token,
        sliding ones min(tokens, window), chunked ones min(tokens, chunk); linear layers keep none (their
        state is state_bytes). Latent attention keeps its latent (memory.latent_cache_bytes), or with
        decompressed=True every head's key and value, as a naive implementation does."""
        check_bool(decompressed, "decompressed")
        return sum(self._kind_kv_bytes(kind, tokens, dtype, batch, decompressed) for kind in self._windows())

    def kv_bytes_per_token(self, dtype: Any = "bf16", *, decompressed: bool = False) -> dict[str, int]:
        """What one token adds to the cache while no window is full, by attention kind (the kinds it has)."""
        check_bool(decompressed, "decompressed")
        return {
            kind: self._kind_kv_bytes(kind, 1, dtype, 1, decompressed) for kind in self._windows() if self.count(kind)
        }

    def state_bytes(self, dtype: Any = "bf16", batch: int = 1) -> int:
        """The fixed state of the linear-attention layers (LinearAttention.state_bytes), 0 without them."""
        layers = self.count("linear_attention")
        return 0 if self.linear is None or not layers else self.linear.state_bytes(layers, dtype, batch)

    def cache_bytes(self, tokens: int, dtype: Any = "bf16", batch: int = 1, *, decompressed: bool = False) -> int:
        """Everything decoding keeps per sequence: kv_cache_bytes + state_bytes."""
        return self.kv_cache_bytes(tokens, dtype, batch, decompressed=decompressed) + self.state_bytes(dtype, batch)

    # -- FLOPs and positions --------------------------------------------------------------------------

    def attention_flops(self, tokens: int, batch: int = 1) -> int:
        """QKᵀ and PV of the softmax-attention layers over a causal context of `tokens`: window layers count
        their band, chunked layers their blocks; linear layers have no score matrix and are not counted."""
        e_v = self.latent.v_dim if self.latent is not None else None  # latent attention: keys 192, values 128

        def flops(window: int | None = None, chunk: int | None = None) -> int:
            return attention_flops(tokens, heads=self.heads, head_dim=self.head_dim, head_dim_v=e_v, causal=True,
                                   batch=batch, window=window, chunk=chunk)  # fmt: skip

        per_kind = {
            "full_attention": flops,
            "sliding_attention": lambda: flops(window=self.sliding_window),
            "chunked_attention": lambda: flops(chunk=self.attention_chunk),
        }
        return sum(self.count(kind) * per_layer() for kind, per_layer in per_kind.items() if self.count(kind))

    def rope_frequencies(self, seq_len: int | None = None) -> Any:
        """θ of this model's RoPE (position.rope_frequencies with its base, scaling and max positions)."""
        if self.rope_theta is None:
            raise ValueError(f"{self.name} has no rotary positions (rope_theta is None)")
        return rope_frequencies(
            self.rotary_dim,
            self.rope_theta,
            scaling=self.rope_scaling,
            seq_len=seq_len,
            max_position_embeddings=self.max_positions,
        )

    def layer_summary(self) -> str:
        """'21 full + 21 sliding 4,096': the layers by kind, windows and chunks with their size."""
        sizes = {"sliding_attention": self.sliding_window, "chunked_attention": self.attention_chunk}
        parts = []
        for kind in LAYER_TYPES:
            if self.count(kind):
                size = f" {sizes[kind]:,}" if sizes.get(kind) else ""
                parts.append(f"{self.count(kind)} {kind.split('_')[0]}{size}")
        return " + ".join(parts)

    def describe(self) -> list[str]:
        """The architecture in a few short lines, as the bill prints them."""
        return _describe(self)


# -- ModelShape's checks, in the order __post_init__ runs them (frozen: a filled default is set with
# object.__setattr__, so that two shapes that mean the same model compare equal) --------------------


def _set(shape: ModelShape, field: str, value: Any) -> None:
    object.__setattr__(shape, field, value)


def _check_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_sizes(shape: ModelShape) -> None:
    """The sizes: positive ints, a window that means something, heads in groups."""
    if not isinstance(shape.name, str):  # it heads every table and JSON row
        raise TypeError(f"name must be a str; got {shape.name!r} ({type(shape.name).__name__})")
    for field in ("layers", "heads", "kv_heads", "head_dim", "hidden"):
        check_positive_int(getattr(shape, field), field)
    for field in ("vocab", "intermediate", "norms_per_layer"):
        check_count(getattr(shape, field), field)
    for field in ("max_positions", "sliding_window", "attention_chunk"):
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
    if shape.heads % shape.kv_heads:
        raise ValueError(
            f"heads must be a multiple of kv_heads (grouped-query attention); "
            f"got heads={shape.heads}, kv_heads={shape.kv_heads}"
        )
    _check_choice(shape.arch, "arch", ARCHS)


def _fill_from_arch(shape: ModelShape) -> None:
    """Every field left as None takes arch's default (see ModelShape's docstring)."""
    mlp, norm, positions, biases = _ARCH_DEFAULTS[shape.arch]
    for field, default in (("mlp", mlp), ("norm", norm), ("qkv_bias", biases), ("out_bias", biases),
                           ("mlp_bias", biases)):  # fmt: skip
        if getattr(shape, field) is None:
            _set(shape, field, default)
    if shape.positions is None:
        _set(shape, "positions", "rope" if shape.rope_theta is not None else positions)


def _check_block(shape: ModelShape) -> None:
    """The block's fields: known names, booleans, and positions that agree with rope_theta."""
    _check_choice(shape.mlp, "mlp", MLPS)
    _check_choice(shape.norm, "norm", NORMS)
    _check_choice(shape.positions, "positions", POSITIONS)
    if shape.qk_norm is not None:
        _check_choice(shape.qk_norm, "qk_norm", QK_NORMS)
    for field in ("tied_embeddings", "qkv_bias", "out_bias", "mlp_bias", "lm_head_bias", "sinks", "attention_gate",
                  "parallel_block"):  # fmt: skip
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


def _fill_layer_types(shape: ModelShape) -> None:
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
        _check_choice(kind, "layer_types[i]", LAYER_TYPES)
    sliding = types.count("sliding_attention")
    if shape.window_layers is not None and shape.window_layers != sliding:
        raise ValueError(f"window_layers={shape.window_layers} but layer_types has {sliding} sliding_attention layers")
    needs = {
        "sliding_attention": "sliding_window",
        "chunked_attention": "attention_chunk",
        "linear_attention": "linear",
    }
    for kind, field in needs.items():
        if kind in types and getattr(shape, field) is None:
            raise ValueError(f"layer_types has {types.count(kind)} {kind} layers, which need {field}; got None")
    if shape.linear is not None and "linear_attention" not in types:
        raise ValueError("linear describes linear_attention layers, but layer_types has none")
    _set(shape, "layer_types", types)
    _set(shape, "window_layers", None if shape.sliding_window is None or sliding == shape.layers else sliding)


def _check_parts(shape: ModelShape) -> None:
    """Experts on existing layers; latent attention without the fields it has no use for."""
    for field, kind in (("experts", Experts), ("latent", LatentAttention), ("linear", LinearAttention)):
        value = getattr(shape, field)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{field} must be a {kind.__name__} or None; got {type(value).__name__}")
    if shape.experts is not None and shape.experts.layers[-1] >= shape.layers:
        raise ValueError(
            f"experts.layers must be layer indices below layers={shape.layers}; got {shape.experts.layers}"
        )
    if shape.latent is not None:
        if shape.head_dim != shape.latent.nope_dim + shape.latent.rope_dim:
            raise ValueError(
                f"with latent attention head_dim is nope_dim + rope_dim = "
                f"{shape.latent.nope_dim + shape.latent.rope_dim}; got {shape.head_dim}"
            )
        for field in ("qk_norm", "attention_gate", "sinks", "qkv_bias", "out_bias"):
            if getattr(shape, field):
                raise ValueError(
                    f"{field}={getattr(shape, field)!r} is not part of latent attention (its bias is latent.bias)"
                )
    if shape.quantization is not None and not isinstance(shape.quantization, str):
        raise TypeError(f"quantization must be a str or None; got {shape.quantization!r}")


def _check_rope(shape: ModelShape) -> None:
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
        rope_attention_factor(shape.rope_scaling, **sizes)


def _describe(shape: ModelShape) -> list[str]:
    """ModelShape.describe: attention, the block, the layer kinds, the experts, each in a line."""
    if shape.latent is not None:
        lat = shape.latent
        q = "a full q projection" if lat.q_rank is None else f"q through a rank of {lat.q_rank:,}"
        attention = (f"MLA: {shape.heads} heads; the cache keeps a latent of {lat.kv_rank} + a rotary key of "
                     f"{lat.rope_dim} per token and layer; {q}")  # fmt: skip
    else:
        kv = f"{shape.kv_heads} kv head{'s' if shape.kv_heads > 1 else ''}"
        attention = f"{shape.attention_kind}: {shape.heads} query heads over {kv} of {shape.head_dim}"
        extras = [text for flag, text in ((shape.qk_norm, f"{shape.qk_norm} q/k norm"), (shape.sinks, "sinks"),
                                          (shape.attention_gate, "an output gate")) if flag]  # fmt: skip
        attention += f" ({', '.join(extras)})" if extras else ""
    mlp = {"gated": "gated MLP (3 matrices)", "plain": "2-matrix MLP", "none": "no MLP"}[shape.mlp or "none"]
    norm = {"rms": "RMSNorm", "layer": "LayerNorm", "layer_weight": "LayerNorm without bias", "none": "no norm weights"}
    norms = norm["none"] if shape.norm in (None, "none") else f"{norm[shape.norm]} x {shape.norms_per_layer} per layer"
    block = [mlp, norms, f"positions: {shape.positions}"]
    block += ["parallel attention and MLP"] if shape.parallel_block else []
    block += ["tied embeddings" if shape.tied_embeddings else "untied embeddings"] if shape.arch != "attention" else []
    lines = [attention, ", ".join(block), _describe_layers(shape)]
    if shape.experts is not None:
        lines.append(_describe_experts(shape))
    return lines + list(shape.notes)


def _describe_layers(shape: ModelShape) -> str:
    """'48 layers: 12 full + 36 linear (a state of fixed size)'."""
    state = " (a state of fixed size)" if shape.linear is not None else ""
    return f"{shape.layers} layer{'s' if shape.layers > 1 else ''}: {shape.layer_summary()}{state}"


def _describe_experts(shape: ModelShape) -> str:
    assert shape.experts is not None
    moe = shape.experts
    per_token = "k unknown" if moe.per_token is None else f"{moe.per_token} per token"
    shared = f", shared width {moe.shared_intermediate:,}" if moe.shared_intermediate else ""
    dense = shape.layers - len(moe.layers)
    dense_text = f"; {dense} dense layers of width {shape.intermediate:,}" if dense else ""
    experts = f"{moe.count} experts of width {moe.intermediate:,}, {per_token}{shared}"
    return f"MoE on {len(moe.layers)} layers: {experts}{dense_text}"


# ---------------------------------------------------------------------------------------------------
# one model's bill
