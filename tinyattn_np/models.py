"""Model shapes: the sizes a transformer's memory bill depends on.

A ModelShape holds layers, heads, kv heads, head_dim, hidden, vocab, MLP width, the kind of each layer
(full, sliding-window or chunked attention, linear attention, a state-space layer, or an MLP alone), how its
blocks are built (gated or plain MLP, which norms, which biases) and the parts some models add
(model_parts.py): a mixture of experts, multi-head latent attention, DeepSeek's indexer, linear-attention and
state-space layers with a state of fixed size, the weights one architecture alone has. Its methods count
parameters (total and active), bytes and FLOPs with the formulas of memory.py; bill.py's model_bill gathers
them at each context length.

Where shapes come from: presets.py (released models), or a Hugging Face config.json through the config
reader (tinyattn_np.hf_config: load_model_shape, shape_from_config), which refuses what it does not
understand. The rules, one line each, are on docs/memory.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ._bytes import nbytes
from ._checks import check_bool, check_positive_int
from ._shape_checks import (
    ATTENTION_TYPES,
    LAYER_TYPES,
    check_block,
    check_choice,
    check_rope,
    check_sizes,
    fill_from_arch,
    fill_layer_types,
)
from ._shape_describe import describe
from .memory import attention_flops, causal_entries, kv_cache_bytes, latent_cache_bytes
from .model_parts import (
    EXTRA_PLACES,
    Experts,
    Extra,
    Indexer,
    KindAttention,
    LatentAttention,
    LinearAttention,
    StateSpace,
)
from .position import rope_frequencies

__all__ = ["ModelShape"]


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
      positions      "rope", "learned" (a P x C table: GPT-2), "alibi" (no weights, no rotation), "sinusoidal"
                     (a fixed table, no weights: XGLM, CTRL), "none"
      layer_types    one per layer: full_attention, sliding_attention, chunked_attention, linear_attention,
                     mamba (a state-space layer), mlp (no token mixing: an MLP or experts alone); None: from
                     sliding_window and window_layers, the first window_layers layers sliding;
                     attention_chunk: the chunk of chunked layers (Llama 4)
      mlp_layers     the layers with an MLP or experts (None: all of them; Nemotron-H's mixers stand alone)
      experts, latent, linear, state_space, indexer   Experts, LatentAttention, LinearAttention,
                     StateSpace, Indexer: see their docstrings (model_parts.py)
      mamba_beside_attention   every attention layer also runs state_space on the same input (Falcon-H1, Zamba)
      shared_attention   the attention layers run blocks of weights they share, counted once among the extras
                     (Zamba's shared transformer blocks): each keeps its own cache
      kv_shared_layers   the last n layers read an earlier layer's keys and values, cache none and have no k
                     and v projections (Gemma-3n, Gemma-4)
      head_dim_v     the width of a value head where it is narrower than a key's (MiMo-V2-Flash: 128 and 192)
      kind_attention KindAttention sizes of the layers of one kind where they are not the model's (MiMo-V2's
                     sliding layers: twice the kv heads; Gemma-4's full layers: heads of 512)
      extras         Extra weights (and states) one architecture alone has, counted where they sit
      embedding_dim  the width of the token table and the head where projections join it to hidden (OPT-350m)
      final_norm     a norm after the last layer (OpenAI GPT and post-norm OPT have none)
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
    state_space: StateSpace | None = None
    indexer: Indexer | None = None
    mlp_layers: tuple[int, ...] | None = None
    mamba_beside_attention: bool = False
    kv_shared_layers: int = 0
    extras: tuple[Extra, ...] = ()
    embedding_dim: int | None = None
    final_norm: bool = True
    head_dim_v: int | None = None
    kind_attention: tuple[KindAttention, ...] = ()
    shared_attention: bool = False

    def __post_init__(self) -> None:
        check_sizes(self)
        fill_from_arch(self)
        check_block(self)
        fill_layer_types(self)
        _check_parts(self)
        check_rope(self)

    # -- the layers, by kind ------------------------------------------------------------------------

    def count(self, kind: str) -> int:
        """How many layers are of this kind (one of LAYER_TYPES)."""
        assert self.layer_types is not None  # __post_init__ fills it
        return self.layer_types.count(kind)

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention: full, sliding or chunked."""
        return sum(self.count(kind) for kind in ATTENTION_TYPES)

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

    @property
    def mlp_layer_count(self) -> int:
        """Layers with a feed-forward: a dense MLP or experts (all of them unless mlp_layers says fewer)."""
        return self.layers if self.mlp_layers is None else len(self.mlp_layers)

    def places(self, where: str) -> int:
        """How many times an Extra at `where` counts: 1 for the model, else the layers it sits on."""
        moe = 0 if self.experts is None else len(self.experts.layers)
        counts = {
            "model": 1,
            "every layer": self.layers,
            "attention": self.attention_layers,
            "moe": moe,
            "dense": self.mlp_layer_count - moe,
        }
        return counts[where] if where in counts else self.count(where)

    # -- parameters, piece by piece (weights are (in, out) matrices; a bias adds `out`) --------------

    def attention_sizes(self, kind: str | None) -> KindAttention:
        """The sizes of the attention of one layer kind: its own (kind_attention), else (and for None) the model's."""
        own = next((sizes for sizes in self.kind_attention if sizes.kind == kind), None)
        if own is not None:
            return own
        return KindAttention(
            kind or "", self.heads, self.kv_heads, self.head_dim, self.head_dim_v, self.sinks, latent=self.latent
        )

    @property
    def attention_parameters(self) -> int:
        """One attention layer: C·Hq·E (q; twice that with attention_gate) + C·Hkv·E (k) + C·Hkv·Ev (v) + Hq·Ev·C
        (out), the biases, the q/k norms, the sinks and the indexer; latent attention's own formula
        (LatentAttention). Layers of a kind with sizes of its own: attention_parameters_of."""
        return self.attention_parameters_of(None)

    def attention_parameters_of(self, kind: str | None, shared: bool = False) -> int:
        """One attention layer of this kind; shared=True: one that reads an earlier layer's keys and values
        (kv_shared_layers), without k and v projections or a k norm."""
        sizes = self.attention_sizes(kind)
        indexer = 0 if self.indexer is None or not sizes.indexer else self.indexer.parameters(self.hidden)
        if sizes.latent is not None:
            return sizes.latent.parameters(self.hidden, sizes.heads) + indexer
        e, ev = sizes.head_dim, sizes.value_width
        q = sizes.heads * e * (2 if self.attention_gate else 1)  # width of q (and its gate)
        kv = 0 if shared else sizes.kv_heads * (e + (ev if sizes.values else 0))  # widths of k and v
        weights = self.hidden * (q + kv) + sizes.heads * ev * self.hidden
        biases = (q + kv if self.qkv_bias else 0) + (self.hidden if self.out_bias else 0)
        qk_norm = {
            None: 0,
            "l2": 0,
            "head": e if shared else 2 * e,
            "head_bias": 2 * e if shared else 4 * e,
            "per_head": (sizes.heads + (0 if shared else sizes.kv_heads)) * e,
        }[self.qk_norm]
        return weights + biases + qk_norm + (sizes.heads if sizes.sinks else 0) + indexer

    @property
    def all_attention_parameters(self) -> int:
        """Every softmax-attention layer's weights, each kind with its sizes, the kv_shared_layers without k and v
        (none with shared_attention: the blocks they share are extras)."""
        assert self.layer_types is not None
        if self.shared_attention:
            return 0
        total = 0
        for i, kind in enumerate(self.layer_types):
            if kind in ATTENTION_TYPES:
                total += self.attention_parameters_of(kind, shared=i >= self.layers - self.kv_shared_layers)
        return total

    @property
    def linear_attention_parameters(self) -> int:
        """One linear-attention layer's weights (0 without linear layers)."""
        return 0 if self.linear is None else self.linear.parameters(self.hidden)

    @property
    def state_space_parameters(self) -> int:
        """One state-space layer's weights (0 without them)."""
        return 0 if self.state_space is None else self.state_space.parameters(self.hidden)

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
        return (self.layers * self.norms_per_layer + int(self.final_norm)) * per_norm

    @property
    def embedding_parameters(self) -> int:
        """Token table V·C, the output head V·C unless tied to it (and V with lm_head_bias), and the learned
        position table P·C; with an embedding_dim D of its own, tables of V·D and the projections D·C and C·D."""
        if self.arch == "attention":
            return 0
        tables = 1 if self.tied_embeddings else 2
        width = self.hidden if self.embedding_dim is None else self.embedding_dim
        projections = 0 if width == self.hidden else 2 * width * self.hidden
        positions = (self.max_positions or 0) * self.hidden if self.positions == "learned" else 0
        return tables * self.vocab * width + projections + positions + (self.vocab if self.lm_head_bias else 0)

    @property
    def extra_parameters(self) -> int:
        """The Extra weights, each times the places it sits on."""
        return sum(extra.parameters * self.places(extra.where) for extra in self.extras)

    @property
    def num_parameters(self) -> int:
        """All weights: embeddings, every layer's mixer (attention, linear attention or a state-space layer) and
        feed-forward (an MLP or experts), the norms and the extras."""
        moe_layers = 0 if self.experts is None else len(self.experts.layers)
        beside = self.attention_layers if self.mamba_beside_attention else 0
        mixers = (
            self.all_attention_parameters
            + self.count("linear_attention") * self.linear_attention_parameters
            + (self.count("mamba") + beside) * self.state_space_parameters
        )
        dense = self.mlp_layer_count - (0 if self.experts is None or self.experts.beside_mlp else moe_layers)
        mlps = dense * self.mlp_parameters + moe_layers * self.moe_parameters
        return self.embedding_parameters + mixers + mlps + self.norm_parameters + self.extra_parameters

    @property
    def active_parameters(self) -> int | None:
        """The weights one token runs: all but the routed experts it does not use, (E - k) per MoE layer.

        Equal to num_parameters without experts; None when the config does not say k. The embedding table
        counts (a token reads its row), as in DeepSeek-V3's "37 B activated" of its 671 B.
        """
        idle = sum(extra.parameters * self.places(extra.where) for extra in self.extras if not extra.active)
        if self.experts is None:
            return self.num_parameters - idle
        moe = self.experts
        if moe.per_token is None:
            return None
        unused = (moe.count - moe.per_token) * moe.expert_parameters(self.hidden) * len(moe.layers)
        return self.num_parameters - unused - idle

    # -- bytes --------------------------------------------------------------------------------------

    def weights_bytes(self, dtype: Any = "bf16") -> int:
        """num_parameters · bytes_per_element: every expert is held, whichever a token runs."""
        return nbytes(self.num_parameters, dtype)

    def cached_layers(self, kind: str) -> int:
        """Layers of this kind that keep a cache of their own: all but the last kv_shared_layers."""
        assert self.layer_types is not None
        return self.layer_types[: self.layers - self.kv_shared_layers].count(kind)

    def _kind_kv_bytes(self, kind: str, tokens: int, dtype: Any, batch: int, decompressed: bool) -> int:
        """K and V (or the latent), and the indexer's keys, of the layers of one attention kind after `tokens`."""
        layers, window = self.cached_layers(kind), self._windows()[kind]
        if not layers:
            return 0
        sizes = dict(layers=layers, dtype=dtype, batch=batch, window=window)
        own, indexer = self.attention_sizes(kind), 0
        if self.indexer is not None and own.indexer:  # one key of head_dim a token beside the latent (or the heads)
            indexer = kv_cache_bytes(tokens, kv_heads=1, head_dim=self.indexer.head_dim, **sizes) // 2
        if own.latent is None:
            return (
                kv_cache_bytes(tokens, kv_heads=own.kv_heads, head_dim=own.head_dim, head_dim_v=own.value_dim, **sizes)
                + indexer
            )
        if decompressed:  # every head's key (nope + rope) and value (v_dim), as a naive implementation keeps them
            return (
                kv_cache_bytes(tokens, kv_heads=own.heads, head_dim=own.head_dim, head_dim_v=own.latent.v_dim, **sizes)
                + indexer
            )
        return latent_cache_bytes(tokens, kv_rank=own.latent.kv_rank, rope_dim=own.latent.rope_dim, **sizes) + indexer

    def kv_cache_bytes(self, tokens: int, dtype: Any = "bf16", batch: int = 1, *, decompressed: bool = False) -> int:
        """K and V after `tokens` tokens, summed over the attention layers: full layers keep every token,
        sliding ones min(tokens, window), chunked ones min(tokens, chunk); linear and state-space layers keep
        none (their state is state_bytes), nor do layers that share another's (kv_shared_layers). Latent
        attention keeps its latent (memory.latent_cache_bytes), or with decompressed=True every head's key
        and value, as a naive implementation does; an indexer adds its key."""
        check_bool(decompressed, "decompressed")
        return sum(self._kind_kv_bytes(kind, tokens, dtype, batch, decompressed) for kind in self._windows())

    def kv_bytes_per_token(self, dtype: Any = "bf16", *, decompressed: bool = False) -> dict[str, int]:
        """What one token adds to the cache while no window is full, by attention kind (the kinds it has)."""
        check_bool(decompressed, "decompressed")
        return {
            kind: self._kind_kv_bytes(kind, 1, dtype, 1, decompressed)
            for kind in self._windows()
            if self.cached_layers(kind)
        }

    def state_bytes(self, dtype: Any = "bf16", batch: int = 1) -> int:
        """The fixed state of the linear-attention and state-space layers and of the extras that keep one."""
        linear, mamba = self.count("linear_attention"), self.count("mamba")
        mamba += self.attention_layers if self.mamba_beside_attention else 0
        total = 0 if self.linear is None or not linear else self.linear.state_bytes(linear, dtype, batch)
        total += 0 if self.state_space is None or not mamba else self.state_space.state_bytes(mamba, dtype, batch)
        numbers = sum(extra.state * self.places(extra.where) for extra in self.extras)
        return total + nbytes(numbers * batch, dtype)

    def cache_bytes(self, tokens: int, dtype: Any = "bf16", batch: int = 1, *, decompressed: bool = False) -> int:
        """Everything decoding keeps per sequence: kv_cache_bytes + state_bytes."""
        return self.kv_cache_bytes(tokens, dtype, batch, decompressed=decompressed) + self.state_bytes(dtype, batch)

    # -- FLOPs and positions --------------------------------------------------------------------------

    def attention_flops(self, tokens: int, batch: int = 1) -> int:
        """QKᵀ and PV of the softmax-attention layers over a causal context of `tokens`: window layers count
        their band, chunked layers their blocks, an indexer's layers the topk keys each query attends and
        the indexer's own scores of every key; linear and state-space layers have no score matrix."""
        indexed = [kind for kind in ATTENTION_TYPES if self.indexer is not None and self.attention_sizes(kind).indexer]

        def flops(kind: str, window: int | None = None, chunk: int | None = None) -> int:
            own = self.attention_sizes(kind)  # latent attention: keys of nope + rope, values of v_dim
            if window is None and chunk is None and kind in indexed:
                window = self.indexer.topk if self.indexer is not None else None  # the keys the indexer picks
            return attention_flops(
                tokens,
                heads=own.heads,
                head_dim=own.head_dim,
                head_dim_v=own.value_width,
                causal=True,
                batch=batch,
                window=window,
                chunk=chunk,
            )

        per_kind = {
            "full_attention": lambda: flops("full_attention"),
            "sliding_attention": lambda: flops("sliding_attention", window=self.sliding_window),
            "chunked_attention": lambda: flops("chunked_attention", chunk=self.attention_chunk),
        }
        total = sum(self.count(kind) * per_layer() for kind, per_layer in per_kind.items() if self.count(kind))
        if self.indexer is not None:  # q · k of every indexer head and every causal pair
            scores = 2 * self.indexer.heads * self.indexer.head_dim * causal_entries(tokens) * batch
            total += sum(self.count(kind) for kind in indexed) * scores
        return total

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
        return describe(self)


def _check_parts(shape: ModelShape) -> None:
    """Each part of its class; experts on layers that have a feed-forward; latent attention without the fields
    it has no use for."""
    parts = (
        ("experts", Experts),
        ("latent", LatentAttention),
        ("linear", LinearAttention),
        ("state_space", StateSpace),
        ("indexer", Indexer),
    )
    _check_kinds(shape)
    for field, kind in parts:
        value = getattr(shape, field)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{field} must be a {kind.__name__} or None; got {type(value).__name__}")
    if shape.mlp_layers is not None:
        _check_layer_indices(shape.mlp_layers, "mlp_layers", shape.layers)
    if shape.experts is not None:
        _check_layer_indices(shape.experts.layers, "experts.layers", shape.layers)
        outside = set(shape.experts.layers) - set(range(shape.layers) if shape.mlp_layers is None else shape.mlp_layers)
        if outside:
            raise ValueError(f"experts.layers must be layers with a feed-forward (mlp_layers); got {sorted(outside)}")
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
    if shape.mamba_beside_attention and shape.state_space is None:
        raise ValueError("mamba_beside_attention runs a state-space layer beside attention, so it needs state_space")
    _check_extras(shape.extras)
    if shape.quantization is not None and not isinstance(shape.quantization, str):
        raise TypeError(f"quantization must be a str or None; got {shape.quantization!r}")


def _check_kinds(shape: ModelShape) -> None:
    """kind_attention: a tuple of KindAttention, one at most a kind of softmax attention, each with its latent where
    (and only where) the model has latent attention; head_dim_v a width."""
    sizes = shape.kind_attention
    if not isinstance(sizes, tuple) or not all(isinstance(own, KindAttention) for own in sizes):
        raise TypeError(f"kind_attention must be a tuple of KindAttention; got {sizes!r}")
    kinds = [own.kind for own in sizes]
    for kind in kinds:
        check_choice(kind, "kind_attention[i].kind", ATTENTION_TYPES)
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kind_attention must give each kind of layer once; got {kinds}")
    if any((own.latent is None) != (shape.latent is None) for own in sizes):
        raise ValueError("kind_attention of a model of latent attention gives each kind's latent, and only then")
    if shape.head_dim_v is not None:
        check_positive_int(shape.head_dim_v, "head_dim_v")


def _check_layer_indices(layers: Any, name: str, count: int) -> None:
    """An increasing tuple of layer indices below count, each once."""
    if not isinstance(layers, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise TypeError(f"{name} must be a tuple of layer indices; got {layers!r}")
    if list(layers) != sorted(set(layers)) or (layers and (layers[0] < 0 or layers[-1] >= count)):
        raise ValueError(f"{name} must be increasing layer indices below layers={count}, each once; got {layers}")


def _check_extras(extras: Any) -> None:
    """A tuple of Extra, each where a place or a kind of layer says."""
    if not isinstance(extras, tuple) or not all(isinstance(extra, Extra) for extra in extras):
        raise TypeError(f"extras must be a tuple of Extra; got {extras!r}")
    for extra in extras:
        check_choice(extra.where, f"the place of extra {extra.what!r}", EXTRA_PLACES + LAYER_TYPES)
