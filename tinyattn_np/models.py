"""Model shapes: the sizes a transformer's memory bill depends on, from a preset or a Hugging Face config.json.

A ModelShape holds layers, heads, kv heads, head_dim, hidden, vocab, MLP width, the kind of each layer
(full, sliding-window, chunked or linear attention), how its blocks are built (gated or plain MLP, which
norms, which biases) and the parts some models add: a mixture of experts, multi-head latent attention,
linear-attention layers with a state of fixed size. model_bill turns one into parameters (total and active),
bytes and FLOPs at each context length with the formulas of memory.py.

load_model_shape reads a config.json of an architecture it knows (ARCHITECTURES, each as transformers'
modeling file builds it), and refuses, naming the field, its value and the architectures it knows, any
field that would change the bill and that it does not understand: a wrong bill in a clean table is worse
than none. The rules, one line each, are on docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._bytes import nbytes
from ._checks import check_bool, check_count, check_positive_int
from ._rope_scaling import check_rope_scaling
from .memory import (
    attention_flops,
    kv_cache_bytes,
    latent_cache_bytes,
    linear_attention_state_bytes,
    score_matrix_bytes,
)
from .position import rope_attention_factor, rope_frequencies

__all__ = [
    "ARCHITECTURES",
    "LAYER_TYPES",
    "PRESETS",
    "Experts",
    "LatentAttention",
    "LinearAttention",
    "ModelShape",
    "load_model_shape",
    "model_bill",
    "shape_from_config",
]

# ---------------------------------------------------------------------------------------------------
# the parts some models add: experts, latent attention, linear attention

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


def _check_ints(part: Any, positive: tuple[str, ...], counts: tuple[str, ...] = ()) -> None:
    for field in positive:
        check_positive_int(getattr(part, field), field)
    for field in counts:
        check_count(getattr(part, field), field)


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in place of the MLP on some layers (Mixtral, DeepSeek, Qwen-MoE, gpt-oss, Llama 4).

    A router (C x E weights) scores the E experts for each token, which then runs through the top per_token
    of them, each a gated MLP of width `intermediate`, and through the shared experts (one gated MLP of
    width shared_intermediate), which every token runs. Only the MoE layers (`layers`, indices) route; the
    others keep the model's dense MLP. Total parameters count every expert, active ones the experts a token
    runs: total - (E - per_token) · one expert, per MoE layer (per_token None: the config does not say).

    router_bias, expert_bias: gpt-oss's biases on the router and on every expert's projections;
    score_bias: Ernie-4.5's per-expert correction of the routing scores, a parameter (DeepSeek-V3's is a
    buffer, not counted); shared_gate: Qwen2-MoE's C -> 1 gate on the shared expert.
    """

    count: int
    per_token: int | None
    intermediate: int
    layers: tuple[int, ...]
    shared_intermediate: int = 0
    shared_gate: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    score_bias: bool = False

    def __post_init__(self) -> None:
        _check_ints(self, ("count", "intermediate"), ("shared_intermediate",))
        if self.per_token is not None and check_positive_int(self.per_token, "per_token") > self.count:
            raise ValueError(f"per_token must be at most count={self.count}; got {self.per_token}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise TypeError(f"layers must be a non-empty tuple of layer indices; got {self.layers!r}")
        for index in self.layers:
            check_count(index, "layers[i]")
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"layers must be increasing layer indices, each once; got {self.layers}")
        for flag in ("shared_gate", "router_bias", "expert_bias", "score_bias"):
            check_bool(getattr(self, flag), flag)
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("shared_gate gates the shared expert, so it needs shared_intermediate > 0")

    def expert_parameters(self, hidden: int) -> int:
        """One expert: gate and up (C x F each) and down (F x C), plus 2F + C biases with expert_bias."""
        weights = 3 * hidden * self.intermediate
        return weights + (2 * self.intermediate + hidden if self.expert_bias else 0)

    def router_parameters(self, hidden: int) -> int:
        """The router's C x E weights, and E for each of router_bias and score_bias."""
        return self.count * (hidden + int(self.router_bias) + int(self.score_bias))


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2 paper, section 2.1; DeepSeek-V3, Kimi K2).

    Keys and values of every head come out of one small latent per token, so that the cache keeps the
    latent instead of the heads:

        c_KV = RMSNorm(x W_DKV)                (kv_rank)       the compressed latent, cached
        k_R  = RoPE(x W_KR)                    (rope_dim)      one rotary key for all heads, cached
        k_h  = [c_KV W_UK_h, k_R]              (nope_dim + rope_dim)
        v_h  = c_KV W_UV_h                     (v_dim)
        q_h  = c_Q W_UQ_h, c_Q = RMSNorm(x W_DQ) (q_rank), or x W_Q_h when q_rank is None

    Weights per layer: C·q_rank + q_rank + q_rank·H·(nope + rope) (or C·H·(nope + rope)),
    C·(kv_rank + rope) + kv_rank, kv_rank·H·(nope + v) and H·v·C; `bias` (attention_bias) adds
    q_rank, kv_rank + rope and C. The cache: kv_rank + rope_dim numbers per token and layer (the latent),
    or H·(nope + rope + v) when a naive implementation decompresses every head's key and value.
    """

    kv_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    q_rank: int | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        _check_ints(self, ("kv_rank", "rope_dim", "nope_dim", "v_dim"))
        if self.q_rank is not None:
            check_positive_int(self.q_rank, "q_rank")
        check_bool(self.bias, "bias")

    def parameters(self, hidden: int, heads: int) -> int:
        """One layer's projections and its two latent norms (the formula in the class docstring)."""
        c, qk = hidden, self.nope_dim + self.rope_dim
        if self.q_rank is None:
            q = c * heads * qk
        else:
            q = c * self.q_rank + self.q_rank + self.q_rank * heads * qk + (self.q_rank if self.bias else 0)
        kv_a = (c + int(self.bias)) * (self.kv_rank + self.rope_dim) + self.kv_rank  # W_DKV and W_KR, the norm
        kv_b = self.kv_rank * heads * (self.nope_dim + self.v_dim)  # W_UK and W_UV of every head
        out = heads * self.v_dim * c + (c if self.bias else 0)
        return q + kv_a + kv_b + out


@dataclass(frozen=True)
class LinearAttention:
    """The layers of linear attention that keep a state of fixed size instead of a growing cache.

    kind "gated_deltanet" (Qwen3-Next): a short causal convolution of conv_kernel over q, k and v, then
    per value head a key_dim x value_dim state S updated by the gated delta rule; the q and k heads
    (key_heads) are shared by value_heads / key_heads value heads. Weights: the q, k, v and output-gate
    projections C·(2·Hk·Dk + 2·Hv·Dv), C·2Hv for the gate and step size, the convolution's
    (2·Hk·Dk + Hv·Dv)·K, 2Hv (A and its step bias), the output norm Dv and Hv·Dv·C out.

    kind "lightning" (MiniMax): H heads with key_dim = value_dim = E and S_t = decay · S_{t-1} + k_t v_tᵀ;
    weights C·3HE (q, k, v), HE (the norm), C·HE (the output gate) and HE·C out. No convolution.

    The state per layer and sequence: value_heads · key_dim · value_dim, plus conv_channels · conv_kernel.
    """

    kind: str
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 0

    def __post_init__(self) -> None:
        kinds = ("gated_deltanet", "lightning")
        if self.kind not in kinds:
            raise ValueError(f"kind must be one of {', '.join(kinds)}; got {self.kind!r}")
        _check_ints(self, ("key_heads", "value_heads", "key_dim", "value_dim"), ("conv_kernel",))
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"value_heads must be a multiple of key_heads; got value_heads={self.value_heads}, "
                f"key_heads={self.key_heads}"
            )
        if self.kind == "lightning" and (
            (self.key_heads, self.key_dim, self.conv_kernel) != (self.value_heads, self.value_dim, 0)
        ):
            raise ValueError("lightning attention has key_heads == value_heads, key_dim == value_dim, no conv_kernel")
        if self.kind == "gated_deltanet" and self.conv_kernel < 1:
            raise ValueError(
                f"gated_deltanet has a short convolution: conv_kernel must be >= 1; got {self.conv_kernel}"
            )

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q and k (Hk·Dk each) and v (Hv·Dv); 0 for lightning."""
        if self.kind == "lightning":
            return 0
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def parameters(self, hidden: int) -> int:
        """One linear-attention layer's weights (the formulas in the class docstring)."""
        c = hidden
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        if self.kind == "lightning":
            return c * 3 * values + values + c * values + values * c
        projections = c * (2 * keys + 2 * values) + c * 2 * self.value_heads
        return projections + self.conv_channels * self.conv_kernel + 2 * self.value_heads + self.value_dim + values * c

    def state_bytes(self, layers: int, dtype: Any = "bf16", batch: int = 1) -> int:
        """memory.linear_attention_state_bytes for `layers` such layers."""
        return linear_attention_state_bytes(
            layers=layers, heads=self.value_heads, key_dim=self.key_dim, value_dim=self.value_dim,
            conv_channels=self.conv_channels, conv_kernel=self.conv_kernel, dtype=dtype, batch=batch,
        )  # fmt: skip


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


# Llama 3.1's rope_scaling, as its config.json has it (every Llama 3.1 size shares it)
LLAMA31_ROPE_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# DeepSeek-V3's rope_scaling (config.json): YaRN from 4,096 to 163,840 positions, on the 64-wide rotary key
DEEPSEEK_V3_ROPE_SCALING: dict[str, Any] = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_ALTERNATING = ("sliding_attention", "full_attention")  # Gemma-2, gpt-oss: layers 0, 2, 4, ... slide

# Each preset is the model's Hugging Face config.json, read the way load_model_shape reads it.
# tests/test_memory.py checks num_parameters against the size in each comment, and
# torch_crosscheck/test_torch_models.py against transformers' own model.
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
        intermediate=3072, max_positions=1024, tied_embeddings=True, arch="gpt2", architecture="gpt2",
    ),
    # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json: 32 layers, 32 heads and 32 kv heads
    # (multi-head attention), hidden 4096, intermediate 11008, vocab 32000, max_position_embeddings 4096.
    # 6,738,415,616.
    "llama-2-7b": ModelShape(
        "Llama-2-7B", layers=32, heads=32, kv_heads=32, head_dim=128, hidden=4096, vocab=32000,
        intermediate=11008, max_positions=4096, rope_theta=10000.0, architecture="llama",
    ),
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 128256, max_position_embeddings 8192. 8,030,261,248.
    "llama-3-8b": ModelShape(
        "Llama-3-8B", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=128256,
        intermediate=14336, max_positions=8192, rope_theta=500000.0, architecture="llama",
    ),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 80 layers, 64 heads, 8 kv heads,
    # hidden 8192, intermediate 28672, vocab 128256, max_position_embeddings 131072, rope_theta 500000,
    # rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, from 8,192). 70,553,706,496.
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B", layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192, vocab=128256,
        intermediate=28672, max_positions=131072, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
        architecture="llama",
    ),
    # huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: 32 layers, 32 heads, 8 kv heads,
    # hidden 4096, intermediate 14336, vocab 32000, max_position_embeddings 32768, sliding_window 4096
    # on every layer. 7,241,732,096.
    "mistral-7b-v0.1": ModelShape(
        "Mistral-7B-v0.1", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=32000,
        intermediate=14336, max_positions=32768, sliding_window=4096, rope_theta=10000.0, architecture="mistral",
    ),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json: 28 layers, 28 heads, 4 kv heads, hidden 3584,
    # intermediate 18944, vocab 152064, max_position_embeddings 131072, use_sliding_window false, untied;
    # Qwen2 puts a bias on q, k and v. 7,615,616,512.
    "qwen2.5-7b": ModelShape(
        "Qwen2.5-7B", layers=28, heads=28, kv_heads=4, head_dim=128, hidden=3584, vocab=152064,
        intermediate=18944, max_positions=131072, qkv_bias=True, rope_theta=1000000.0, architecture="qwen2",
    ),
    # huggingface.co/google/gemma-2-9b/blob/main/config.json: 42 layers, 16 heads, 8 kv heads,
    # head_dim 256 (not 3584 / 16 = 224), hidden 3584, intermediate 14336, vocab 256000,
    # max_position_embeddings 8192, sliding_window 4096 on every other layer, tied, 4 norms per layer.
    # 9,241,705,984.
    "gemma-2-9b": ModelShape(
        "Gemma-2-9B", layers=42, heads=16, kv_heads=8, head_dim=256, hidden=3584, vocab=256000,
        intermediate=14336, max_positions=8192, sliding_window=4096, layer_types=_ALTERNATING * 21,
        tied_embeddings=True, norms_per_layer=4, rope_theta=10000.0, architecture="gemma2",
    ),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json: 32 layers, 32 heads and
    # 32 kv heads of 96, hidden 3072, intermediate 8192, vocab 32064, max_position_embeddings 4096,
    # sliding_window 2047, untied. 3,821,079,552.
    "phi-3-mini": ModelShape(
        "Phi-3-mini", layers=32, heads=32, kv_heads=32, head_dim=96, hidden=3072, vocab=32064,
        intermediate=8192, max_positions=4096, sliding_window=2047, rope_theta=10000.0, architecture="phi3",
    ),
    # huggingface.co/tiiuae/falcon-7b/blob/main/config.json: 32 layers, 71 heads of 64 over one kv head
    # (multi_query), hidden 4544, a 2-matrix MLP of 4 · 4544, attention and MLP in parallel from one
    # LayerNorm, no biases, tied, vocab 65024; 2,048 positions (FalconConfig's default). 6,921,720,704.
    "falcon-7b": ModelShape(
        "Falcon-7B", layers=32, heads=71, kv_heads=1, head_dim=64, hidden=4544, vocab=65024, intermediate=18176,
        max_positions=2048, tied_embeddings=True, mlp="plain", norm="layer", norms_per_layer=1,
        parallel_block=True, rope_theta=10000.0, architecture="falcon",
    ),
    # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: Mistral-7B's attention, 8 experts
    # of 14336 on every layer, 2 per token, max_position_embeddings 32768, rope_theta 1e6, no window.
    # 46,702,792,704 in all, 12,879,925,248 active.
    "mixtral-8x7b": ModelShape(
        "Mixtral-8x7B", layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=32000,
        intermediate=14336, max_positions=32768, rope_theta=1000000.0, architecture="mixtral",
        layer_types=("full_attention",) * 32, experts=Experts(8, 2, 14336, tuple(range(32))),
    ),
    # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers, 128 heads of latent
    # attention (kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, qk_nope_head_dim 128,
    # v_head_dim 128), hidden 7168, vocab 129280; the first 3 layers dense (intermediate 18432), then
    # 256 routed experts of 2048, 8 per token, and 1 shared; max_position_embeddings 163840 (YaRN);
    # fp8 weights; one MTP layer. 671,026,404,352 in all (the "671B"), 37,552,282,624 active ("37B").
    "deepseek-v3": ModelShape(
        "DeepSeek-V3", layers=61, heads=128, kv_heads=128, head_dim=192, hidden=7168, vocab=129280,
        intermediate=18432, max_positions=163840, rope_theta=10000.0, rope_scaling=DEEPSEEK_V3_ROPE_SCALING,
        architecture="deepseek_v3", latent=LatentAttention(512, 64, 128, 128, q_rank=1536),
        experts=Experts(256, 8, 2048, tuple(range(3, 61)), shared_intermediate=2048), quantization="fp8",
        notes=("1 multi-token-prediction layer(s) (num_nextn_predict_layers) not counted: transformers does not "
               "build them", "the checkpoint stores its weights quantized (fp8): the bill's bytes are for the "
               "dtype asked"),
    ),
    # transformers' GptOssConfig defaults, which are gpt-oss-120b: 36 layers, 64 heads of 64 over 8 kv
    # heads with sinks and biases, windows of 128 on every other layer, 128 experts of 2880 with biases,
    # 4 per token; YaRN to 131072 positions. 116,829,156,672 in all, 5,711,982,912 active.
    "gpt-oss-120b": ModelShape(
        "gpt-oss-120b", layers=36, heads=64, kv_heads=8, head_dim=64, hidden=2880, vocab=201088,
        intermediate=2880, max_positions=131072, sliding_window=128, layer_types=_ALTERNATING * 18,
        qkv_bias=True, out_bias=True, sinks=True, rope_theta=150000.0, architecture="gpt_oss",
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        experts=Experts(128, 4, 2880, tuple(range(36)), router_bias=True, expert_bias=True),
    ),
    # transformers' Llama4TextConfig defaults, which are Llama-4-Scout-17B-16E's text model: 48 layers,
    # 40 heads over 8 kv heads of 128, 3 of every 4 layers chunked attention of 8192, 16 experts of 8192
    # and one shared, 1 per token, on every layer. 107,769,861,120 in all, 17,172,894,720 active.
    "llama-4-scout": ModelShape(
        "Llama-4-Scout", layers=48, heads=40, kv_heads=8, head_dim=128, hidden=5120, vocab=202048,
        intermediate=16384, max_positions=131072, rope_theta=500000.0, architecture="llama4_text",
        qk_norm="l2", attention_chunk=8192, layer_types=(("chunked_attention",) * 3 + ("full_attention",)) * 12,
        experts=Experts(16, 1, 8192, tuple(range(48)), shared_intermediate=8192),
        notes=("the language model only (text_config): the other towers are not counted",),
    ),
    # transformers' Qwen3NextConfig defaults, which are Qwen3-Next-80B-A3B: 48 layers, 3 of every 4 gated
    # DeltaNet (16 key heads, 32 value heads of 128, convolution of 4), every 4th full attention (16
    # heads over 2 kv heads of 256, with an output gate), 512 experts of 512, 10 per token, one shared.
    # 79,674,391,296 in all.
    "qwen3-next-80b-a3b": ModelShape(
        "Qwen3-Next-80B-A3B", layers=48, heads=16, kv_heads=2, head_dim=256, hidden=2048, vocab=151936,
        intermediate=5632, max_positions=32768, rope_theta=10000.0, rope_scaling={"partial_rotary_factor": 0.25,
        "rope_type": "default"}, architecture="qwen3_next", qk_norm="head", attention_gate=True,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 12,
        linear=LinearAttention("gated_deltanet", 16, 32, 128, 128, conv_kernel=4),
        experts=Experts(512, 10, 512, tuple(range(48)), shared_intermediate=512, shared_gate=True),
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# config.json: every architecture the reader knows, as transformers' modeling files build them


class _Fields:
    """A config dict that remembers which fields were read, so that the ones left over can be judged."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.read: set[str] = set()

    def get(self, *names: str, default: Any = None) -> Any:
        """The first of names present and not null (null means "not given"), else default."""
        self.read.update(names)
        for name in names:
            if self.config.get(name) is not None:
                return self.config[name]
        return default

    def integer(self, *names: str, required: bool = True, default: Any = None, zero: bool = False) -> Any:
        """A positive int (>= 0 with zero=True); a missing required field names every spelling."""
        value = self.get(*names)
        if value is None:
            if required:
                wanted = " or ".join(repr(name) for name in names)
                raise ValueError(f"config is missing {wanted}; got keys {sorted(self.config)}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
            kind = "an integer >= 0" if zero else "a positive integer"
            raise ValueError(f"config field {names[0]!r} must be {kind}; got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        """A true/false field; JSON's true and false only (the string "false" is truthy in Python)."""
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"config field {name!r} must be true or false; got {value!r} ({type(value).__name__})")
        return value

    def integers(self, name: str) -> list[int] | None:
        """A list of integers >= 0 (layer indices, 0/1 flags), or None."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
            raise ValueError(f"config field {name!r} must be a list of integers >= 0; got {_shown_value(value)}")
        return value


# a rule that switches a part on: a constant, a true/false field (absent: false), or (field, the config
# class's default when config.json leaves the field out)
_Rule = bool | str | tuple[str, bool]


@dataclass(frozen=True)
class _Arch:
    """How one model_type builds its layers, each switch a _Rule."""

    mlp: str = "gated"
    norm: str = "rms"
    norms_per_layer: int = 2
    tied: bool = False  # the config class's tie_word_embeddings when config.json leaves it out
    qkv_bias: _Rule = False
    out_bias: _Rule = False
    mlp_bias: _Rule = False
    lm_head_bias: _Rule = False
    qk_norm: tuple[_Rule, str] | None = None  # (the rule that switches it, its kind)
    parallel: _Rule = False
    windows: str = "none"  # which layers slide when the config has no layer_types (_default_layer_types)
    moe: str | None = None  # how the config names its experts (_MOE_READERS)
    special: str | None = None  # a reader of its own for what no other architecture has (_SPECIAL_READERS)
    sinks: bool = False
    attention_gate: bool = False
    names: tuple[tuple[str, ...], ...] = ()  # (field, its spellings ...): GPT-2's and Falcon's names
    kv_heads: bool = True  # reads num_key_value_heads (GPT-2 and GPT-NeoX have none; Falcon has its own)
    off: tuple[str, ...] = ()  # fields the class has but ignores: read only when false, 0 or null


_QKVO: dict[str, Any] = dict(qkv_bias="attention_bias", out_bias="attention_bias")
_USE_BIAS = ("use_bias", True)  # StarCoder2
# (field, how this architecture spells it ...): GPT-2's own names, Falcon's old ones and its ffn_hidden_size
_GPT2_NAMES = (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"), ("hidden_size", "n_embd"),
               ("max_position_embeddings", "n_positions"), ("intermediate_size", "n_inner"))  # fmt: skip
_FALCON_NAMES = (("num_hidden_layers", "num_hidden_layers", "n_layer"),
                 ("num_attention_heads", "num_attention_heads", "n_head"), ("hidden_size", "hidden_size", "n_embed"),
                 ("intermediate_size", "ffn_hidden_size"))  # fmt: skip

# model_type -> its rules; each line checked to the parameter against transformers' model in
# torch_crosscheck/test_torch_models.py (the class defaults, which are released models, and variants)
ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch(**_QKVO, mlp_bias="mlp_bias"),
    "granite": _Arch(**_QKVO, mlp_bias="mlp_bias"),
    "smollm3": _Arch(**_QKVO, mlp_bias="mlp_bias", tied=True, windows="nope"),
    "mistral": _Arch(windows="every"),
    "mixtral": _Arch(windows="every", moe="mixtral"),
    "minimax": _Arch(windows="minimax", moe="mixtral", special="lightning"),
    "granitemoe": _Arch(**_QKVO, moe="mixtral"),
    "olmoe": _Arch(**_QKVO, qk_norm=(True, "per_head"), moe="mixtral"),
    "gpt_oss": _Arch(qkv_bias=("attention_bias", True), out_bias=("attention_bias", True), sinks=True,
                     windows="alternate", moe="gpt_oss"),
    "qwen2": _Arch(qkv_bias=True, windows="qwen2"),
    "qwen2_moe": _Arch(qkv_bias=("qkv_bias", True), windows="qwen2_moe", moe="qwen"),
    "qwen3": _Arch(**_QKVO, qk_norm=(True, "head"), windows="qwen2"),
    "qwen3_moe": _Arch(**_QKVO, qk_norm=(True, "head"), windows="switched", moe="qwen"),
    "qwen3_next": _Arch(**_QKVO, qk_norm=(True, "head"), attention_gate=True, windows="qwen3_next", moe="qwen",
                        special="gated_deltanet"),
    "gemma": _Arch(**_QKVO, tied=True),
    "gemma2": _Arch(**_QKVO, tied=True, norms_per_layer=4, windows="alternate"),
    "gemma3_text": _Arch(**_QKVO, tied=True, norms_per_layer=4, qk_norm=(True, "head"), windows="pattern6"),
    "cohere": _Arch(**_QKVO, norm="layer_weight", norms_per_layer=1, tied=True, parallel=True,
                    qk_norm=("use_qk_norm", "per_head")),
    "cohere2": _Arch(**_QKVO, norm="layer_weight", norms_per_layer=1, tied=True, parallel=True, windows="pattern4"),
    "phi": _Arch(mlp="plain", norm="layer", norms_per_layer=1, qkv_bias=True, out_bias=True, mlp_bias=True,
                 lm_head_bias=True, parallel=True, qk_norm=("qk_layernorm", "head_bias")),
    "phi3": _Arch(windows="every", off=("attention_bias",)),
    "gpt2": _Arch(mlp="plain", norm="layer", qkv_bias=True, out_bias=True, mlp_bias=True, tied=True, names=_GPT2_NAMES,
                  kv_heads=False),
    "olmo": _Arch(**_QKVO, norm="none"),
    "olmo2": _Arch(**_QKVO, qk_norm=(True, "per_head")),
    "stablelm": _Arch(norm="layer", qkv_bias="use_qkv_bias", qk_norm=("qk_layernorm", "per_head"),
                      parallel="use_parallel_residual", special="stablelm"),
    "glm4": _Arch(qkv_bias=("attention_bias", True), norms_per_layer=4),
    "exaone4": _Arch(qk_norm=(True, "head"), windows="exaone4"),
    "starcoder2": _Arch(mlp="plain", norm="layer", qkv_bias=_USE_BIAS, out_bias=_USE_BIAS, mlp_bias=_USE_BIAS,
                        tied=True, windows="every"),
    "gpt_neox": _Arch(mlp="plain", norm="layer", qkv_bias=("attention_bias", True), out_bias=("attention_bias", True),
                      mlp_bias=True, parallel=("use_parallel_residual", True), kv_heads=False),
    "falcon": _Arch(mlp="plain", norm="layer", qkv_bias="bias", out_bias="bias", mlp_bias="bias", tied=True,
                    names=_FALCON_NAMES, special="falcon", kv_heads=False),
    "deepseek_v2": _Arch(mlp_bias="mlp_bias", moe="deepseek", special="latent"),
    "deepseek_v3": _Arch(moe="deepseek", special="latent"),
    "kimi_k2": _Arch(moe="deepseek", special="latent"),  # Kimi K2: DeepSeek-V3's layers (DeepseekV3ForCausalLM)
    "llama4_text": _Arch(**_QKVO, qk_norm=(("use_qk_norm", True), "l2"), windows="llama4", moe="llama4"),
    "ernie4_5": _Arch(qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias", tied=True),
    "ernie4_5_moe": _Arch(qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias", lm_head_bias="use_bias",
                          tied=True, moe="ernie"),
}  # fmt: skip
# a config without model_type: read as Llama, sliding windows and layer_types as written
_NO_MODEL_TYPE = _Arch(**_QKVO, mlp_bias="mlp_bias", windows="every")

# fields that never change the weights or the cache: bookkeeping, token ids, numerics, dropout,
# activations, logit and residual scalings, routing choices (which experts, not how many)
_NEVER_BILLED = frozenset(
    """
    _name_or_path architectures auto_map transformers_version torch_dtype dtype id2label label2id problem_type
    return_dict use_return_dict output_attentions output_hidden_states chunk_size_feed_forward tokenizer_class
    prefix task_specific_params finetuning_task torchscript use_bfloat16 tf_legacy_loss use_cache
    cache_implementation _attn_implementation attn_implementation bos_token_id eos_token_id pad_token_id
    sep_token_id decoder_start_token_id max_length min_length do_sample early_stopping num_beams num_beam_groups
    diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores return_dict_in_generate
    forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty
    suppress_tokens begin_suppress_tokens is_decoder
    initializer_range rms_norm_eps layer_norm_eps layer_norm_epsilon norm_epsilon attention_dropout
    hidden_dropout resid_pdrop embd_pdrop attn_pdrop residual_dropout embedding_dropout classifier_dropout
    pretraining_tp clip_qkv router_aux_loss_coef router_jitter_noise output_router_logits aux_loss_alpha
    seq_aux moe_norm_min hidden_act hidden_activation activation activation_function swiglu_alpha swiglu_limit
    logit_scale logits_scaling embedding_multiplier residual_multiplier attention_multiplier
    attn_logit_softcapping final_logit_softcapping query_pre_attn_scalar attn_scale attn_temperature_tuning
    floor_scale scale_attn_weights scale_attn_by_inverse_layer_idx reorder_and_upcast_attn rope_interleave
    rope_local_base_freq norm_topk_prob routed_scaling_factor n_group topk_group topk_method scoring_func
    ep_size block_size full_attn_alpha_factor full_attn_beta_factor linear_attn_alpha_factor
    linear_attn_beta_factor mlp_alpha_factor mlp_beta_factor summary_type summary_use_proj summary_activation
    summary_proj_to_labels summary_first_dropout n_ctx apply_residual_connection_post_layernorm
    initial_context_length
""".split()
)
# fields that describe another kind of model unless they say "off"
_MUST_BE_OFF = ("is_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
                "pruned_heads", "use_bidirectional_attention")  # fmt: skip


def _shown_value(value: Any) -> str:
    """A config value for a message: whole when short, else its start and its length."""
    text = repr(value)
    return (
        text if len(text) <= 80 else f"{text[:60]} ... ({len(value) if hasattr(value, '__len__') else len(text)} items)"
    )


def _known() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def _refuse(field: str, value: Any, model_type: str, why: str) -> ValueError:
    return ValueError(
        f"config field {field!r} = {_shown_value(value)} {why} for model_type {model_type!r}; the reader knows "
        f"{_known()} (and a config without model_type, read as Llama). A bill that guessed could be wrong."
    )


def _check_all_read(fields: _Fields, model_type: str) -> None:
    """Every field the architecture did not read must be one that never changes the bill, or say "off"."""
    for name, value in fields.config.items():
        if name in _MUST_BE_OFF and value not in (None, False, 0, {}, []):
            raise _refuse(name, value, model_type, "describes a model that is not a plain decoder")
        if name in fields.read or name in _NEVER_BILLED or name in _MUST_BE_OFF or value is None:
            continue
        raise _refuse(name, value, model_type, "would change the bill and is not understood")


def _switch(fields: _Fields, rule: _Rule) -> bool:
    """A _Rule read from the config: a constant, a field (absent: false), or (field, the class's default)."""
    if isinstance(rule, bool):
        return rule
    name, default = rule if isinstance(rule, tuple) else (rule, False)
    return fields.boolean(name, default)


def _names(arch: _Arch, field: str) -> tuple[str, ...]:
    """The spellings of a field in this architecture's config.json (GPT-2's n_layer for num_hidden_layers)."""
    for field_and_spellings in arch.names:
        if field_and_spellings[0] == field:
            return field_and_spellings[1:]
    return (field,)


def _read_sizes(fields: _Fields, arch: _Arch, model_type: str) -> dict[str, Any]:
    """layers, heads, kv heads, head_dim, hidden, vocab, the MLP's width and max positions."""
    layers = fields.integer(*_names(arch, "num_hidden_layers"))
    heads = fields.integer(*_names(arch, "num_attention_heads"))
    hidden = fields.integer(*_names(arch, "hidden_size"))
    four_c = model_type in ("gpt2", "falcon")  # n_inner / ffn_hidden_size null: 4 x hidden
    intermediate = fields.integer(*_names(arch, "intermediate_size"), required=not four_c, default=4 * hidden)
    head_dim = fields.integer("head_dim", required=False)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"config: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return dict(
        layers=layers,
        heads=heads,
        kv_heads=fields.integer("num_key_value_heads", required=False, default=heads) if arch.kv_heads else heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=fields.integer("vocab_size"),
        intermediate=intermediate,
        max_positions=fields.integer(*_names(arch, "max_position_embeddings"), required=False),
    )


def _read_block(fields: _Fields, arch: _Arch) -> dict[str, Any]:
    """The block: MLP, norms, biases, q/k norm, parallel attention and MLP, tied embeddings."""
    for name in arch.off:  # the class carries the field and builds nothing with it
        if fields.get(name) not in (None, False, 0):
            raise _refuse(
                name, fields.config[name], fields.config.get("model_type", ""), "is not built by transformers"
            )
    qk_norm = None
    if arch.qk_norm is not None and _switch(fields, arch.qk_norm[0]):
        qk_norm = arch.qk_norm[1]
    return dict(
        mlp=arch.mlp,
        norm=arch.norm,
        norms_per_layer=arch.norms_per_layer,
        tied_embeddings=fields.boolean("tie_word_embeddings", arch.tied),
        qkv_bias=_switch(fields, arch.qkv_bias),
        out_bias=_switch(fields, arch.out_bias),
        mlp_bias=_switch(fields, arch.mlp_bias),
        lm_head_bias=_switch(fields, arch.lm_head_bias),
        qk_norm=qk_norm,
        parallel_block=_switch(fields, arch.parallel),
        sinks=arch.sinks,
        attention_gate=arch.attention_gate,
    )


def _rope_fields(fields: _Fields, rotary: bool) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config: rope_theta at the top (default 10,000, every rotary
    config class's default; GPT-NeoX's rotary_emb_base) or inside rope_parameters (transformers 5);
    rope_scaling or rope_parameters as the scaling dict, with a top-level partial_rotary_factor (GPT-NeoX's
    rotary_pct) and (Phi-3's) original_max_position_embeddings moved into it, so that it is all
    rope_frequencies needs. Not for dynamic: its L0 is max_position_embeddings whatever else the config
    says, as in transformers. Gemma-3's rope_parameters per layer kind: the full-attention layers' own."""
    parameters = fields.get("rope_scaling", "rope_parameters", default={})
    theta_top = fields.get("rope_theta", "rotary_emb_base")
    partial, original = (
        fields.get("partial_rotary_factor", "rotary_pct"),
        fields.get("original_max_position_embeddings"),
    )
    if not rotary:
        return None, None
    if not isinstance(parameters, dict):
        raise ValueError(f"config field 'rope_scaling' must be an object or null; got {parameters!r}")
    if parameters and set(parameters) <= set(LAYER_TYPES) and isinstance(parameters.get("full_attention"), dict):
        parameters = parameters["full_attention"]  # Gemma-3: {"sliding_attention": {...}, "full_attention": {...}}
    theta = theta_top if theta_top is not None else parameters.get("rope_theta", 10000.0)
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    if partial is not None and "partial_rotary_factor" not in scaling:
        scaling["partial_rotary_factor"] = partial
    if parameters.get("rope_type", parameters.get("type")) != "dynamic":  # dynamic's L0: max_position_embeddings
        if original is not None and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = original
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        scaling["rope_type"] = "default"
    if scaling.get("rope_type", scaling.get("type")) == "default" and set(scaling) <= {"rope_type", "type"}:
        scaling = {}  # plain RoPE: nothing to carry
    return theta, scaling or None


def _sliding_window(fields: _Fields, arch: _Arch) -> int | None:
    """The window, or None when off: sliding_window null or 0, or use_sliding_window false (Qwen, SmolLM3)."""
    window = fields.integer("sliding_window", "sliding_window_size", required=False, zero=True) or None
    switched = arch.windows in ("qwen2", "qwen2_moe", "switched", "nope") or arch is _NO_MODEL_TYPE
    if switched and not fields.boolean("use_sliding_window", arch is _NO_MODEL_TYPE):
        return None  # Qwen2 ships sliding_window 131072 (or 0) with use_sliding_window false
    return window


def _default_layer_types(fields: _Fields, arch: _Arch, layers: int, window: bool, chunk: bool) -> list[str]:
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


def _read_layer_types(fields: _Fields, arch: _Arch, layers: int) -> dict[str, Any]:
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
                f"config field 'layer_types' must be a list of {layers} layer kinds; got {_shown_value(given)}"
            )
        unknown = sorted({kind for kind in given if kind not in LAYER_TYPES}, key=str)
        if unknown:
            why = f"names layer kinds the reader does not know (it knows {', '.join(LAYER_TYPES)})"
            raise _refuse("layer_types", unknown, fields.config.get("model_type", ""), why)
    types = tuple(given if given is not None else derived)
    if "sliding_attention" in types and window is None:
        raise ValueError(
            "config field 'layer_types' has sliding_attention layers, but the sliding window is off "
            f"(sliding_window {fields.config.get('sliding_window')!r}, use_sliding_window "
            f"{fields.config.get('use_sliding_window')!r})"
        )
    if "linear_attention" in types and arch.special not in ("gated_deltanet", "lightning"):
        raise _refuse("layer_types", "linear_attention", fields.config.get("model_type", ""), "has no linear layers")
    return dict(layer_types=types, sliding_window=window, attention_chunk=chunk)


# -- experts: how each family names them ---------------------------------------------------------------


def _moe_every_layer(fields: _Fields, sizes: dict[str, Any], **flags: bool) -> Experts:
    """Mixtral's names (MiniMax, Granite-MoE, OLMoE, gpt-oss): every layer routes, experts of intermediate_size."""
    count = fields.integer("num_local_experts", "num_experts")
    per_token = fields.integer("num_experts_per_tok", "experts_per_token", required=False)
    return Experts(count, per_token, sizes["intermediate"], tuple(range(sizes["layers"])), **flags)


def _moe_qwen(fields: _Fields, sizes: dict[str, Any]) -> Experts | None:
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


def _moe_deepseek(fields: _Fields, sizes: dict[str, Any]) -> Experts | None:
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


def _moe_llama4(fields: _Fields, sizes: dict[str, Any]) -> Experts:
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


def _moe_ernie(fields: _Fields, sizes: dict[str, Any]) -> Experts | None:
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


_MOE_READERS: dict[str, Callable[[_Fields, dict[str, Any]], Experts | None]] = {
    "mixtral": _moe_every_layer,
    "gpt_oss": lambda fields, sizes: _moe_every_layer(fields, sizes, router_bias=True, expert_bias=True),
    "qwen": _moe_qwen,
    "deepseek": _moe_deepseek,
    "llama4": _moe_llama4,
    "ernie": _moe_ernie,
}


# -- what one architecture alone has ---------------------------------------------------------------------


def _special_latent(fields: _Fields, found: dict[str, Any]) -> None:
    """DeepSeek-V2/V3, Kimi K2: multi-head latent attention; head_dim becomes nope + rope (transformers 5
    stores the rotary width in head_dim, and nope + rope in qk_head_dim: both checked)."""
    rope, nope = fields.integer("qk_rope_head_dim"), fields.integer("qk_nope_head_dim")
    latent = LatentAttention(
        kv_rank=fields.integer("kv_lora_rank"), rope_dim=rope, nope_dim=nope, v_dim=fields.integer("v_head_dim"),
        q_rank=fields.integer("q_lora_rank", required=False), bias=fields.boolean("attention_bias", False),
    )  # fmt: skip
    for field, allowed in (("head_dim", (rope, nope + rope)), ("qk_head_dim", (nope + rope,))):
        value = fields.get(field)
        if value is not None and value not in allowed:
            raise ValueError(
                f"config field {field!r} is {value!r}, but qk_nope_head_dim + qk_rope_head_dim = {nope + rope}"
            )
    found.update(latent=latent, head_dim=nope + rope, kv_heads=found["heads"])  # every head decompresses its own k, v
    mtp = fields.integer("num_nextn_predict_layers", required=False, zero=True, default=0)
    if mtp:
        found["notes"] += (f"{mtp} multi-token-prediction layer(s) (num_nextn_predict_layers) not counted: "
                           "transformers does not build them",)  # fmt: skip


def _special_gated_deltanet(fields: _Fields, found: dict[str, Any]) -> None:
    """Qwen3-Next: its linear layers' heads, widths and convolution."""
    found["linear"] = LinearAttention(
        "gated_deltanet",
        key_heads=fields.integer("linear_num_key_heads"), value_heads=fields.integer("linear_num_value_heads"),
        key_dim=fields.integer("linear_key_head_dim"), value_dim=fields.integer("linear_value_head_dim"),
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )  # fmt: skip


def _special_lightning(fields: _Fields, found: dict[str, Any]) -> None:
    """MiniMax: its linear layers have the attention's heads and head_dim."""
    heads, head_dim = found["heads"], found["head_dim"]
    found["linear"] = LinearAttention("lightning", heads, heads, head_dim, head_dim)


def _special_stablelm(fields: _Fields, found: dict[str, Any]) -> None:
    """StableLM: a parallel block has one norm per layer."""
    found["norms_per_layer"] = 1 if found["parallel_block"] else 2


def _special_falcon(fields: _Fields, found: dict[str, Any]) -> None:
    """Falcon: kv heads from new_decoder_architecture (num_kv_heads) or multi_query (1); one or two norms
    per parallel block (num_ln_in_parallel_attn); ALiBi instead of RoPE (alibi)."""
    new = fields.boolean("new_decoder_architecture", False)
    multi_query, parallel = fields.boolean("multi_query", True), fields.boolean("parallel_attn", True)
    kv_heads = fields.integer("num_kv_heads", required=False, default=found["heads"])
    found["kv_heads"] = kv_heads if new else 1 if multi_query else found["heads"]
    norms_in_parallel = fields.integer("num_ln_in_parallel_attn", required=False, default=2 if new else 1)
    found["parallel_block"] = parallel
    found["norms_per_layer"] = 2 if not parallel or norms_in_parallel == 2 else 1
    if fields.boolean("alibi", False):
        found.update(positions="alibi", rope_theta=None, rope_scaling=None)


# each reader fills in the ModelShape fields found so far
_SPECIAL_READERS: dict[str, Callable[[_Fields, dict[str, Any]], None]] = {
    "latent": _special_latent,
    "gated_deltanet": _special_gated_deltanet,
    "lightning": _special_lightning,
    "stablelm": _special_stablelm,
    "falcon": _special_falcon,
}


def _architecture(config: dict[str, Any]) -> tuple[str, _Arch, tuple[str, ...]]:
    """(model_type, its rules, notes); an unknown model_type is refused with the ones the reader knows."""
    model_type = config.get("model_type")
    if model_type is None:
        return "llama", _NO_MODEL_TYPE, ("the config names no model_type: read as Llama",)
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(
            f"config field 'model_type' = {_shown_value(model_type)} is not an architecture the reader knows; it "
            f"knows {_known()} (and a config without model_type, read as Llama). A bill that guessed could be wrong."
        )
    return model_type, ARCHITECTURES[model_type], ()


def _read_quantization(fields: _Fields) -> tuple[str | None, tuple[str, ...]]:
    """The quantization_config's method, and the note that says the bill's dtype is the caller's."""
    quantization = fields.get("quantization_config")
    if quantization is None:
        return None, ()
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not isinstance(method, str):
        raise ValueError(
            "config field 'quantization_config' must be an object with a quant_method; got "
            f"{_shown_value(quantization)}"
        )
    return method, (
        f"the checkpoint stores its weights quantized ({method}): the bill's bytes are for the dtype asked",
    )


def shape_from_config(config: dict[str, Any], default_name: str | None = None) -> ModelShape:
    """A ModelShape from the dict of a Hugging Face config.json, by the rules of its model_type (ARCHITECTURES).

    head_dim, when the config gives one, wins over hidden_size / num_attention_heads: Gemma-2-9B has
    hidden 3584 and 16 heads, but heads of 256, not 224. A field that would change the bill and that the
    architecture does not read is refused, naming the field, its value and the architectures the reader
    knows; a field whose value means "off" (sliding_window 0 or null, use_sliding_window false) is read as
    off. A multimodal config (LLaVA, Gemma-3, Llama 4) keeps its language model in text_config: that is
    the one read, under the outer config's name (the vision tower is not counted, and the bill says so).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict; got {type(config).__name__}")
    text = config.get("text_config")
    if isinstance(text, dict) and config.get("num_hidden_layers", config.get("n_layer")) is None:
        name = config.get("_name_or_path") or default_name or config.get("model_type")
        outer = {key: config[key] for key in ("tie_word_embeddings",) if key in config}  # set outside, at times
        shape = shape_from_config({**outer, **text, "_name_or_path": name}, default_name=name)
        note = "the language model only (text_config): the other towers are not counted"
        return dataclasses.replace(shape, notes=(*shape.notes, note))
    model_type, arch, notes = _architecture(config)
    fields = _Fields(config)
    fields.read.add("model_type")
    found = _read_sizes(fields, arch, model_type)
    found.update(_read_block(fields, arch))
    rope_theta, rope_scaling = _rope_fields(fields, rotary=model_type != "gpt2")
    found.update(rope_theta=rope_theta, rope_scaling=rope_scaling, notes=notes)
    found.update(_read_layer_types(fields, arch, found["layers"]))
    found["experts"] = _MOE_READERS[arch.moe](fields, found) if arch.moe else None
    if arch.special:
        _SPECIAL_READERS[arch.special](fields, found)
    quantization, quantized = _read_quantization(fields)
    _check_all_read(fields, model_type)
    return ModelShape(
        name=config.get("_name_or_path") or default_name or config.get("model_type") or "config",
        arch="gpt2" if model_type == "gpt2" else "llama",
        architecture=model_type,
        quantization=quantization,
        **{**found, "notes": found["notes"] + quantized},
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


def _contexts(model: ModelShape, tokens: list[int], dtype: Any, kv_dtype: Any, batch: int) -> list[dict[str, Any]]:
    """model_bill's figures at each context length."""
    contexts = []
    state = model.state_bytes(kv_dtype, batch)
    for n in tokens:
        n = check_count(n, "tokens")
        kv = model.kv_cache_bytes(n, kv_dtype, batch)
        decompressed = None if model.latent is None else model.kv_cache_bytes(n, kv_dtype, batch, decompressed=True)
        layers = model.attention_layers  # the softmax layers: linear ones have no score matrix
        scores = score_matrix_bytes(n, heads=model.heads, layers=layers, batch=batch, dtype=dtype) if layers else 0
        contexts.append(
            {
                "tokens": n,
                "kv_cache_bytes": kv,
                "kv_cache_bytes_decompressed": decompressed,
                "cache_bytes": kv + state,
                "score_matrix_bytes": scores,
                "attention_flops": model.attention_flops(n, batch),
                "beyond_max_positions": model.max_positions is not None and n > model.max_positions,
            }
        )
    return contexts


def model_bill(
    model: ModelShape, tokens: int | list[int], *, dtype: Any = "bf16", kv_dtype: Any = None, batch: int = 1
) -> dict[str, Any]:
    """Parameters, weights, cache, naive score matrices and attention FLOPs of a model at each context length.

    dtype is for the weights and the scores, kv_dtype for the cache and the linear layers' state (default:
    dtype). The model: architecture (the model_type recognized), description (its lines), parameters and
    active_parameters (all the weights, and those one token runs: they differ with experts; None where the
    config does not say how many experts a token runs), weights_bytes (every parameter), kv_bytes_per_token
    (all attention layers; by_kind splits it; the latent cache for latent attention, and
    kv_bytes_per_token_decompressed the per-head keys and values a naive implementation keeps), state_bytes
    (the fixed state of linear layers). Per context T:
        kv_cache_bytes        sliding layers keep at most W tokens, chunked layers at most their chunk
        cache_bytes           kv_cache_bytes + state_bytes: everything decoding keeps per sequence
        score_matrix_bytes    every softmax layer's and head's T x T scores at once (the article's worst case)
        attention_flops       QKᵀ and PV over the softmax layers, causal (decoder): windows count their band,
                              chunked layers their blocks; linear layers have no scores and are not counted
        beyond_max_positions  T > max_position_embeddings: the model was not trained that long
    Plain ints, strs and bools only, so the result is also JSON.
    """
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape (see load_model_shape); got {type(model).__name__}")
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        tokens = [int(tokens)]  # one context length
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be an int or a list of ints; got {type(tokens).__name__}")
    by_kind = model.kv_bytes_per_token(kv_dtype)
    return {
        "model": model.name,
        "architecture": model.architecture or model.arch,
        "description": model.describe(),
        "parameters": model.num_parameters,
        "active_parameters": model.active_parameters,
        "weights_bytes": model.weights_bytes(dtype),
        "kv_bytes_per_token": model.kv_cache_bytes(1, kv_dtype, batch),
        "kv_bytes_per_token_by_kind": {kind: batch * per_token for kind, per_token in by_kind.items()},
        "kv_bytes_per_token_decompressed": (
            None if model.latent is None else model.kv_cache_bytes(1, kv_dtype, batch, decompressed=True)
        ),
        "state_bytes": model.state_bytes(kv_dtype, batch),
        "max_positions": model.max_positions,
        "sliding_window": model.sliding_window,
        "attention_chunk": model.attention_chunk,
        "contexts": _contexts(model, list(tokens), dtype, kv_dtype, batch),
    }
