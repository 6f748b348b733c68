"""A tiny GPT: token embeddings, pre-norm blocks of attention (RoPE, flash) and an MLP, a tied output head.

The model in its lines, B sequences of T tokens, width C, vocabulary V, N = B·T rows:

    x = E[idx] (+ P[0 .. T-1])                   (N, C)    E (V, C): the token embeddings; P (context, C):
                                                           a learned position table, where there is one
    for each of the L blocks:
        x = x + drop(Mix(Norm_1(x)))             (N, C)    softmax attention (multihead_forward: RoPE, causal,
                                                           flash), or a gated delta layer (deltanet.py)
        x = x + drop(MLP(Norm_2(x)))             (N, C)    GELU (4C) or SwiGLU, layers.mlp
    logits = Norm_f(x) Eᵀ                        (N, V)    the head is E itself: tied
    loss = cross_entropy(logits, targets)                  the mean of -log p(target)

Mix is softmax attention in every block unless layer_pattern says otherwise: a string of A (softmax attention)
and L (Qwen3-Next's Gated DeltaNet: a state of head_dim x head_dim per head, no position table, no cache that
grows), repeated over the layers; "LLLA" is Qwen3-Next's three gated delta layers to one of attention.

The backward runs those lines last first (layers.py derives each layer's; multihead.py the attention's, deltanet.py
the gated delta layer's). A residual line x = x + f(x) passes its gradient on unchanged and adds f's. E is used
twice, once to embed and once as the head, so its gradient is the sum of the two uses' (GPT._backward says
where). The parameters are one dict of arrays; a block is one function over them, block() below, which
training and inference (with or without the caches) both call, and block_backward its backward: the attention
is multihead.py's functional layer on the block's two matrices, the gated delta layer deltanet.py's
gated_deltanet on its nine arrays.

Positions come from RoPE inside the attention (positions="rope", the default), so there is no position table;
positions="learned" adds a learned table P instead (GPT-2's wpe, nanoGPT's model) and the attention turns
nothing. A sequence longer than the context is attended with a sliding window of `context` keys (each
attention layer sees the last `context` tokens; a gated delta layer's state has seen them all): that is what a
KVCache(window=context) decodes, so cached generation equals recomputation token for token at any length, and
for T <= context it is the plain causal model. A learned table has rows for the context only: past it the rows
start again from 0 (GPTConfig.table_rows).

API (names kept once published):
    GPTConfig(vocab, context, layers, heads, width, mlp="gelu"|"swiglu", norm="layernorm"|"rmsnorm",
              dropout=0.0, bias=False, dtype="float32", mlp_hidden=None, layer_pattern=None,
              positions="rope"|"learned")
              .to_dict()  GPTConfig.from_dict(d)  .layer_kind(layer)  .delta_layers  .delta_shape
    GPT_PRESETS["tiny"]    nanoGPT's CPU Shakespeare model: 4 layers, 4 heads, width 128, context 64, no dropout
    GPT_PRESETS["part3"]   6 layers, width 256, 4 heads of 64, context 256, LayerNorm, GELU 4x, biases in the
                           MLP and the norms: 5,781,504 parameters with vocab = 4,096 (the preset's vocab)
    param_shapes(config) -> {name: shape}          init_params(config, rng) -> {name: array}
    parameter_count(config) -> int                 param_shapes' total, by arithmetic (constant time)
    GPT(config, params=None, *, rng=None)          .params (name -> array, the optimizer updates them in place);
                                                   refused, before anything is built, where the weights do not
                                                   fit the memory this process can take (_guard.py)
        .loss_and_grads(idx, targets, *, rng=None) -> (loss, grads)   idx, targets (B, T) ints; grads like params
        .loss(idx, targets) -> float               .logits(idx) -> (B, T, V)     no dropout, no gradients
        .hidden(idx, caches=None) -> (B, T, C)     .new_caches(batch, max_tokens) -> one cache per layer: a
                                                   KVCache, or a GatedDeltaCache for a gated delta layer
        .num_parameters                            .check_tokens(idx, name) -> idx as int64 (B, T) ids
    block(x, params, config, layer, shape, mask, ...)   one block in place on x (N, C); block_backward its
                                                   backward; embed(params, config, idx) the first line
Generation lives in sampling.py; the memory of a training step in trainbill.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from ._checks import check_rng
from ._gpt_checks import check_config, checked_params
from ._guard import refuse_unless_fits
from .blockmask import Band, check_band
from .deltanet import (
    GatedDeltaCache,
    GatedDeltaNetSaved,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    gated_deltanet,
    gated_deltanet_backward,
)
from .kvcache import KVCache
from .layers import (
    MLP_KINDS,
    MLPSaved,
    NormGrads,
    NormSaved,
    cross_entropy,
    cross_entropy_backward,
    dropout,
    dropout_backward,
    layer_norm,
    layer_norm_backward,
    mlp,
    mlp_backward,
    rms_norm,
    rms_norm_backward,
)
from .multihead import HeadWeights, MultiheadSaved, multihead_backward, multihead_forward, project_out

Array = NDArray[np.floating]
Params = dict[str, Array]

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "LAYER_KINDS",
    "NORM_KINDS",
    "POSITION_KINDS",
    "block",
    "block_backward",
    "embed",
    "init_params",
    "param_shapes",
    "parameter_count",
]

NORM_KINDS = ("layernorm", "rmsnorm")
LAYER_KINDS = {"A": "softmax attention", "L": "a gated delta layer (Gated DeltaNet)"}  # layer_pattern's letters
GPT_DTYPES = ("float32", "float64")
POSITION_KINDS = ("rope", "learned")  # RoPE in the attention, or a learned table added to the embeddings
INIT_STD = 0.02  # GPT-2's initialisation (Radford et al. 2019), as nanoGPT draws it


def block(
    x: Array,
    params: Params,
    config: GPTConfig,
    layer: int,
    shape: tuple[int, int],
    mask: Band,
    *,
    drop: float = 0.0,
    rng: Any = None,
    cache: KVCache | GatedDeltaCache | None = None,
) -> BlockSaved:
    """One block, in place on the residual stream x (N, C) of shape = (B, T) tokens, with layer `layer`'s
    weights in params:

        x = x + drop(Mix(Norm_1(x)))        Mix: softmax attention within mask, or a gated delta layer
        x = x + drop(MLP(Norm_2(x)))

    and what block_backward needs. Training calls it (drop: dropout's p, rng its masks), and so does inference,
    with drop 0, on the whole sequence or through the layer's cache (x's tokens continue what it holds)."""
    prefix, (B, T) = f"h.{layer}.", shape
    # 1) the mixer: attention or a gated delta layer, on this block's weights; or through the cache
    h, norm_1 = apply_norm(x, params, prefix + "ln_1", config.norm)  # (N, C)
    a, mixer = mix(h.reshape(B, T, -1), params, config, layer, mask, cache)  # (B, T, C)
    a, keep_1 = dropout(a.reshape(x.shape), drop, rng)  # (N, C)
    x += a
    # 2) the MLP
    h, norm_2 = apply_norm(x, params, prefix + "ln_2", config.norm)  # (N, C)
    biases = (params.get(prefix + "mlp.b_fc"), params.get(prefix + "mlp.b_proj"))
    m, mlp_saved = mlp(h, params[prefix + "mlp.w_fc"], params[prefix + "mlp.w_proj"], *biases, kind=config.mlp)
    m, keep_2 = dropout(m, drop, rng)  # (N, C)
    x += m
    return BlockSaved(norm_1, mixer, keep_1, norm_2, mlp_saved, keep_2)


def block_backward(
    dx: Array, saved: BlockSaved, config: GPTConfig, layer: int, shape: tuple[int, int], grads: Params
) -> Array:
    """dx (N, C) through one block, last line first; the block's parameter gradients go into grads."""
    prefix, drop = f"h.{layer}.", config.dropout
    # 2) x = x + drop(MLP(Norm_2(x))): dx flows on unchanged and gains the branch's gradient
    m = mlp_backward(dropout_backward(dx, saved.keep_2, drop), saved.mlp)
    grads[prefix + "mlp.w_fc"], grads[prefix + "mlp.w_proj"] = m.dw_fc, m.dw_proj
    if m.db_fc is not None and m.db_proj is not None:
        grads[prefix + "mlp.b_fc"], grads[prefix + "mlp.b_proj"] = m.db_fc, m.db_proj
    dx += apply_norm_backward(m.dx, saved.norm_2, prefix + "ln_2", config.norm, grads)
    # 1) x = x + drop(Mix(Norm_1(x)))
    da = dropout_backward(dx, saved.keep_1, drop).reshape(*shape, -1)  # (B, T, C)
    if isinstance(saved.mixer, GatedDeltaNetSaved):
        dh, dw = gated_deltanet_backward(da, saved.mixer)
        grads |= {f"{prefix}delta.{field}": grad for field, grad in zip(dw._fields, dw, strict=True)}
    else:
        dh, grads[prefix + "attn.w_qkv"], grads[prefix + "attn.w_out"] = multihead_backward(
            da, cast(MultiheadSaved, saved.mixer)
        )
    dx += apply_norm_backward(dh.reshape(dx.shape), saved.norm_1, prefix + "ln_1", config.norm, grads)
    return dx


def mix(
    h: Array, params: Params, config: GPTConfig, layer: int, mask: Band, cache: KVCache | GatedDeltaCache | None
) -> tuple[Array, MultiheadSaved | GatedDeltaNetSaved | None]:
    """Layer `layer`'s mixing of the tokens h (B, T, C) -> (B, T, C), and what its backward needs (None through
    a cache): softmax attention, heads, RoPE (or none beside a learned table) and flash (multihead.py), within
    mask; or a gated delta layer (deltanet.py's gated_deltanet: chunks of 64 tokens, a token at a time through its
    cache)."""
    if config.layer_kind(layer) == "L":
        weights = GatedDeltaNetWeights(*(params[f"h.{layer}.delta.{field}"] for field in GatedDeltaNetWeights._fields))
        y, saved = gated_deltanet(h, weights, config.delta_shape, cache=cast(GatedDeltaCache, cache))
        return y, saved if cache is None else None
    rope = config.positions == "rope"
    heads = HeadWeights(
        params[f"h.{layer}.attn.w_qkv"], params[f"h.{layer}.attn.w_out"], config.heads, config.heads, rope
    )
    if cache is None:  # the weights stay as they are until the step's backward: nothing to copy
        return multihead_forward(h, heads, mask=mask, copies=False)
    return project_out(cast(KVCache, cache).attend(heads, h), heads.w_out), None


def apply_norm(x: Array, params: Params, name: str, kind: str) -> tuple[Array, NormSaved]:
    """The norm called `name` (its gain, and bias if it has one) on x (..., C): kind "layernorm" or "rmsnorm"."""
    if kind == "rmsnorm":
        return rms_norm(x, params[name + ".gain"])
    return layer_norm(x, params[name + ".gain"], params.get(name + ".bias"))


def apply_norm_backward(dy: Array, saved: NormSaved, name: str, kind: str, grads: Params) -> Array:
    """dx of the norm called `name`; its gain's (and bias's) gradient into grads."""
    g: NormGrads = rms_norm_backward(dy, saved) if kind == "rmsnorm" else layer_norm_backward(dy, saved)
    grads[name + ".gain"] = g.dgain
    if g.dbias is not None:
        grads[name + ".bias"] = g.dbias
    return g.dx


def embed(params: Params, config: GPTConfig, idx: NDArray[np.int64], start: int = 0) -> Array:
    """x = E[idx] (N, C) for the tokens idx (B, T), our own copy; with a learned position table (positions
    "learned"), plus its rows of the positions start .. start + T - 1 (GPTConfig.table_rows)."""
    x = params["wte"][idx.reshape(-1)]  # (N, C): indexing copies
    if config.positions == "learned":
        rows = params["wpe"][config.table_rows(start, idx.shape[1])]  # (T, C)
        x_b = x.reshape(*idx.shape, config.width)  # (B, T, C): a view of x
        x_b += rows  # every sequence's token t gains row t
    return x


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT. vocab: tokens; context: the longest sequence trained on; layers, heads, width (C);
    mlp: "gelu" (hidden 4C) or "swiglu" (hidden 8C/3 rounded up to a multiple of 8, about the same weights);
    mlp_hidden: another hidden size; norm: "layernorm" or "rmsnorm"; dropout: on the embeddings and on
    each residual branch; bias: biases in the MLP and the LayerNorms (attention's projections have none);
    dtype: "float32" or "float64" (the weights' and the computation's); layer_pattern: None (softmax attention
    in every block) or a string of A (softmax attention) and L (a gated delta layer), repeated over the layers
    and at most as long as them: "LLLA" is Qwen3-Next's three gated delta layers to one of attention;
    positions: "rope" (q and k turned in the attention) or "learned" (a table wpe (context, C) added to the
    embeddings, GPT-2's and nanoGPT's)."""

    vocab: int = 65
    context: int = 64
    layers: int = 4
    heads: int = 4
    width: int = 128
    mlp: str = "gelu"
    norm: str = "layernorm"
    dropout: float = 0.0
    bias: bool = False
    dtype: str = "float32"
    mlp_hidden: int | None = None
    layer_pattern: str | None = None
    positions: str = "rope"

    def __post_init__(self) -> None:
        kinds = {"positions": POSITION_KINDS, "mlp": MLP_KINDS, "norm": NORM_KINDS, "dtype": GPT_DTYPES}
        check_config(self, kinds, LAYER_KINDS)

    @property
    def hidden(self) -> int:
        """The MLP's hidden size H: mlp_hidden, else 4C (GELU) or 8C/3 up to a multiple of 8 (SwiGLU)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 4 * self.width if self.mlp == "gelu" else 8 * math.ceil(self.width / 3)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def layer_kind(self, layer: int) -> str:
        """This layer's letter of layer_pattern: A (softmax attention) or L (a gated delta layer)."""
        pattern = self.layer_pattern or "A"
        return pattern[layer % len(pattern)]

    @property
    def delta_layers(self) -> int:
        """How many of the layers are gated delta layers, by arithmetic (constant time, whatever the depth)."""
        pattern = self.layer_pattern or "A"
        repeats, rest = divmod(self.layers, len(pattern))
        return repeats * pattern.count("L") + pattern[:rest].count("L")

    @property
    def delta_shape(self) -> GatedDeltaNetShape:
        """A gated delta layer's sizes: as many key and value heads as the attention has, of head_dim each, and
        Qwen3-Next's convolution over 4 tokens."""
        return GatedDeltaNetShape(self.width, self.heads, self.heads, self.head_dim, self.head_dim)

    def table_rows(self, start: int, tokens: int) -> NDArray[np.intp]:
        """The learned table's rows (tokens,) for the positions start .. start + tokens - 1: position t's row t,
        and past the context, which has no rows of its own, t mod context: the rows start again from 0, so the
        last `context` tokens, all that the window of a position past the context sees, each keep a row apart."""
        return np.arange(start, start + tokens) % self.context

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a JSON file."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """The config a to_dict() wrote; an unknown key is a ValueError that names it."""
        unknown = sorted(set(values) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; known: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**values)


GPT_PRESETS = {
    # nanoGPT's config/train_shakespeare_char.py with its CPU settings; vocab 65 is Tiny Shakespeare's characters
    "tiny": GPTConfig(vocab=65, context=64, layers=4, heads=4, width=128),
    # 6·(256·768 + 256·256 + 2·256·1024 + 1024 + 256 + 2·512) + 512 + 4096·256 = 5,781,504
    "part3": GPTConfig(vocab=4096, context=256, layers=6, heads=4, width=256, bias=True),
}


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (the optimizer's, the checkpoint's).

    Matrices multiply from the right (x @ W, W of shape (in, out)); norms have a gain (C,) and, for a
    LayerNorm with bias=True, a bias (C,). The MLP's w_fc is (C, H), or (C, 2H) = [W_gate | W_up] for SwiGLU.
    """
    C, H = config.width, config.hidden
    fc = 2 * H if config.mlp == "swiglu" else H

    def norm(name: str) -> dict[str, tuple[int, ...]]:
        with_bias = config.bias and config.norm == "layernorm"
        return {f"{name}.gain": (C,), **({f"{name}.bias": (C,)} if with_bias else {})}

    shapes: dict[str, tuple[int, ...]] = {"wte": (config.vocab, C)}
    if config.positions == "learned":
        shapes["wpe"] = (config.context, C)
    for layer in range(config.layers):
        p = f"h.{layer}."
        shapes |= norm(p + "ln_1") | mixer_shapes(config, layer) | norm(p + "ln_2")
        shapes[p + "mlp.w_fc"] = (C, fc)
        if config.bias:
            shapes[p + "mlp.b_fc"] = (fc,)
        shapes[p + "mlp.w_proj"] = (H, C)
        if config.bias:
            shapes[p + "mlp.b_proj"] = (C,)
    return shapes | norm("ln_f")


def mixer_shapes(config: GPTConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s attention (attn.w_qkv (C, 3C), attn.w_out (C, C)) or gated delta layer (delta. and the
    nine fields of GatedDeltaNetWeights, of GatedDeltaNetShape.weight_shapes)."""
    C, p = config.width, f"h.{layer}."
    if config.layer_kind(layer) == "A":
        return {p + "attn.w_qkv": (C, 3 * C), p + "attn.w_out": (C, C)}
    shapes = config.delta_shape.weight_shapes()
    return {f"{p}delta.{field}": shape for field, shape in zip(GatedDeltaNetWeights._fields, shapes, strict=True)}


def parameter_count(config: GPTConfig) -> int:
    """The number of weights param_shapes(config) lists, by arithmetic: constant time, whatever the depth.

    E (V C) and a learned table (context C); per layer the two norms, the mixer (attention: w_qkv (C x 3C) and
    w_out (C x C); a gated delta layer: its shape's weights), the MLP's w_fc (C x H, or C x 2H for SwiGLU) and
    w_proj (H x C) with their biases; the final norm. A norm is its gain (C), and its bias (C) in a LayerNorm
    with bias=True.
    """
    C, H = config.width, config.hidden
    fc = 2 * H if config.mlp == "swiglu" else H
    norm = 2 * C if config.bias and config.norm == "layernorm" else C
    mlp = C * fc + H * C + (fc + C if config.bias else 0)
    delta = sum(math.prod(shape) for shape in config.delta_shape.weight_shapes())
    mixers = (config.layers - config.delta_layers) * 4 * C * C + config.delta_layers * delta
    table = config.context * C if config.positions == "learned" else 0
    return config.vocab * C + table + config.layers * (2 * norm + mlp) + mixers + norm


def refuse_unless_weights_fit(config: GPTConfig) -> None:
    """Refuse, by arithmetic and before anything is allocated, a model whose weights alone do not fit the memory
    this process can take (_guard.refuse_unless_fits: an AttentionMemoryError that says so)."""
    count = parameter_count(config)
    refuse_unless_fits(
        count * np.dtype(config.dtype).itemsize,
        f"GPT({config.layers} layers, width {config.width}, vocab {config.vocab})",
        f"{count:,} parameters of {config.dtype}",
        "take fewer layers, a smaller width or a smaller vocabulary",
    )


def init_params(config: GPTConfig, rng: np.random.Generator | int | None = None) -> Params:
    """GPT-2's initialisation: matrices and embeddings normal(0, 0.02), the projections into the residual stream
    (attn.w_out, delta.w_out, mlp.w_proj) normal(0, 0.02 / √(2L)) so that the stream's variance does not grow
    with depth, biases 0, gains 1; a gated delta layer's own as transformers draws Qwen3-Next's: the convolution
    U(±1/√K) (torch's Conv1d), dt_bias 1, A = e^A_log ~ U(0.01, 16). rng: a Generator, an int seed, or None for
    fresh weights."""
    rng = check_rng(rng)
    residual_std = INIT_STD / math.sqrt(2 * config.layers)
    bound = config.delta_shape.conv_kernel**-0.5
    params: Params = {}
    for name, shape in param_shapes(config).items():
        if name.endswith((".gain", "delta.norm", "delta.dt_bias")):
            params[name] = np.ones(shape, config.dtype)
        elif name.endswith("delta.a_log"):
            params[name] = np.log(rng.uniform(0.01, 16, shape)).astype(config.dtype)
        elif name.endswith("delta.conv"):
            params[name] = rng.uniform(-bound, bound, shape).astype(config.dtype)
        elif len(shape) == 1:
            params[name] = np.zeros(shape, config.dtype)
        else:
            std = residual_std if name.endswith(("attn.w_out", "delta.w_out", "mlp.w_proj")) else INIT_STD
            params[name] = rng.normal(0.0, std, shape).astype(config.dtype)
    return params


class BlockSaved(NamedTuple):
    """One block's forward, kept for its backward: each norm's, the mixer's (the attention's or the gated delta
    layer's; None through a cache) and the MLP's saved values, and the dropout masks of the two residual branches
    (None without dropout)."""

    norm_1: NormSaved
    mixer: MultiheadSaved | GatedDeltaNetSaved | None
    keep_1: NDArray[np.bool_] | None
    norm_2: NormSaved
    mlp: MLPSaved
    keep_2: NDArray[np.bool_] | None


@dataclass
class Trace:
    """The whole forward's saved values: the tokens and targets (N,), the embeddings' dropout mask, the
    blocks', the final norm's and its output x_f (N, C) (the head's input), and the probabilities (N, V).
    The backward empties it as it goes (blocks become None, probs turns into dlogits), freeing each part
    once its gradient is taken."""

    idx: NDArray[np.int64]
    targets: NDArray[np.int64]
    keep_embed: NDArray[np.bool_] | None
    blocks: list[BlockSaved | None]
    norm_f: NormSaved
    x_f: Array
    probs: Array | None


class GPT:
    """The model: a GPTConfig and its parameters, a dict name -> array (param_shapes' names and order).

    params: None draws them (init_params with rng); a dict (from a checkpoint's .npz, say) is checked
    against the config (param_shapes' names and shapes) and copied into arrays of the config's dtype. Either
    way, a model whose weights do not fit the memory available is refused first (refuse_unless_weights_fit).
    """

    def __init__(self, config: GPTConfig, params: dict[str, Any] | None = None, *, rng: Any = None):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig; got {type(config).__name__}")
        refuse_unless_weights_fit(config)
        self.config = config
        self.params = (
            init_params(config, rng) if params is None else checked_params(param_shapes(config), params, config.dtype)
        )

    def __repr__(self) -> str:
        c = self.config
        pattern = "" if c.layer_pattern is None else f", layer_pattern={c.layer_pattern}"
        positions = "" if c.positions == "rope" else f", positions={c.positions}"
        return (
            f"GPT(layers={c.layers}, heads={c.heads}, width={c.width}, context={c.context}, vocab={c.vocab}, "
            f"mlp={c.mlp}, norm={c.norm}{pattern}{positions}, parameters={self.num_parameters:,})"
        )

    @property
    def num_parameters(self) -> int:
        """Every weight, the tied embedding counted once."""
        return sum(int(p.size) for p in self.params.values())

    # --- the training forward and backward ----------------------------------------------------------------

    def loss_and_grads(self, idx: Any, targets: Any, *, rng: Any = None) -> tuple[float, Params]:
        """The mean cross-entropy of targets given idx, and its gradient for every parameter.

        idx, targets: (B, T) ints in [0, vocab), T <= context (targets[b, t] is the token after idx[b, t]).
        rng: the Generator (or int seed) that draws the dropout masks; needed only when dropout > 0.
        Returns (loss, grads), grads a dict with params' names, shapes and dtype.
        """
        idx, targets = self.check_tokens(idx, "idx"), self.check_tokens(targets, "targets")
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {idx.shape}; got {targets.shape}")
        if idx.shape[1] > self.config.context:
            raise ValueError(f"idx has {idx.shape[1]} tokens a row; the model trains on at most {self.config.context}")
        if self.config.dropout and rng is None:
            raise ValueError(f"dropout={self.config.dropout} draws masks: pass rng (a np.random.Generator or a seed)")
        loss, trace = self._forward(idx, targets, None if rng is None else check_rng(rng))
        return loss, self._backward(trace, idx.shape)

    def _forward(self, idx: NDArray[np.int64], targets: NDArray[np.int64], rng: Any) -> tuple[float, Trace]:
        """The model's lines, keeping what the backward needs (Trace)."""
        p, c, (B, T) = self.params, self.config, idx.shape
        x, keep_embed = dropout(embed(p, c, idx), c.dropout, rng)  # (N, C): our own copy
        mask = check_band(True, None, T, T)  # causal
        blocks: list[BlockSaved | None] = []
        for layer in range(c.layers):  # each adds both residual branches to x in place
            blocks.append(block(x, p, c, layer, (B, T), mask, drop=c.dropout, rng=rng))
        x_f, norm_f = apply_norm(x, p, "ln_f", c.norm)  # (N, C)
        logits = x_f @ p["wte"].T  # (N, V): the tied head
        targets_flat = targets.reshape(-1)  # (N,)
        loss, probs = cross_entropy(logits, targets_flat, out=logits)  # probs (N, V), in the logits' memory
        return loss, Trace(idx.reshape(-1), targets_flat, keep_embed, blocks, norm_f, x_f, probs)

    def _backward(self, trace: Trace, shape: tuple[int, int]) -> Params:
        """Every parameter's gradient from the trace, the forward's lines last first."""
        E, grads = self.params["wte"], Params()
        probs, trace.probs = cast(Array, trace.probs), None
        dlogits = cross_entropy_backward(probs, trace.targets, out=probs)  # (N, V), in probs' memory
        del probs
        # E's gradient is the sum of its two uses' gradients: the head's here (logits = x_f Eᵀ) ...
        d_embedding = dlogits.T @ trace.x_f  # (V, C)
        dx: Array = dlogits @ E  # (N, C)
        del dlogits
        dx = apply_norm_backward(dx, trace.norm_f, "ln_f", self.config.norm, grads)  # (N, C)
        for layer in reversed(range(self.config.layers)):
            saved, trace.blocks[layer] = cast(BlockSaved, trace.blocks[layer]), None  # freed after its backward
            dx = block_backward(dx, saved, self.config, layer, shape, grads)
            del saved
        dx = dropout_backward(dx, trace.keep_embed, self.config.dropout)  # (N, C)
        # ... plus the embedding's (x = E[idx]): each row of dx goes back to the row of E it was read from
        np.add.at(d_embedding, trace.idx, dx)
        grads["wte"] = d_embedding
        if "wpe" in self.params:  # a learned table's row t: the sum of dx over every sequence's token t
            grads["wpe"] = np.zeros_like(self.params["wpe"])
            grads["wpe"][: shape[1]] = dx.reshape(*shape, -1).sum(axis=0)  # (T, C)
        return {name: grads[name] for name in self.params}  # params' order

    # --- inference: no dropout, nothing kept for a backward -----------------------------------------------

    def hidden(self, idx: Any, caches: list[KVCache | GatedDeltaCache] | None = None) -> Array:
        """The final norm's output (B, T, C) for tokens idx (B, T): the training forward's blocks, without dropout.

        caches: None runs the whole sequence (a sliding window of `context` keys past the context); a list of
        one cache per layer (new_caches) continues what they hold: idx's tokens come after it.
        """
        idx = self.check_tokens(idx, "idx")
        if caches is not None and (not isinstance(caches, list) or len(caches) != self.config.layers):
            raise ValueError(
                f"caches must be a list of {self.config.layers} KVCache or GatedDeltaCache, one per layer (new_caches)"
            )
        p, c, (B, T) = self.params, self.config, idx.shape
        start = 0 if caches is None else len(caches[0])  # the position of idx's first token
        x = embed(p, c, idx, start)  # (N, C)
        mask = check_band(True, None if T <= c.context else c.context, T, T)  # causal, past the context a window
        for layer in range(c.layers):
            cache = None if caches is None else caches[layer]
            block(x, p, c, layer, (B, T), mask, cache=cache)  # adds to x in place
        return apply_norm(x, p, "ln_f", c.norm)[0].reshape(B, T, c.width)

    def logits(self, idx: Any, caches: list[KVCache | GatedDeltaCache] | None = None) -> Array:
        """logits (B, T, V) = hidden(idx, caches) Eᵀ."""
        return self.hidden(idx, caches) @ self.params["wte"].T

    def loss(self, idx: Any, targets: Any) -> float:
        """The mean cross-entropy of targets (B, T) given idx (B, T), without dropout or gradients."""
        targets = self.check_tokens(targets, "targets")
        logits = self.logits(idx)  # (B, T, V)
        if targets.shape != logits.shape[:2]:
            raise ValueError(f"targets must have idx's shape {logits.shape[:2]}; got {targets.shape}")
        return cross_entropy(logits.reshape(-1, self.config.vocab), targets.reshape(-1))[0]

    def check_tokens(self, idx: Any, name: str = "idx") -> NDArray[np.int64]:
        """idx as an int64 array (B, T) of token ids in [0, vocab), T >= 1; anything else names the argument."""
        idx = np.asarray(idx)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids; got dtype {idx.dtype}")
        if idx.ndim != 2 or idx.shape[1] == 0:
            raise ValueError(f"{name} must be (B, T) token ids with T >= 1; got shape {idx.shape}")
        vocab = self.config.vocab
        outside = (idx < 0) | (idx >= vocab)
        if outside.any():
            raise ValueError(f"{name} holds token {idx[outside].flat[0]}, outside the vocabulary [0, {vocab})")
        return idx.astype(np.int64, copy=False)

    def new_caches(self, batch: int, max_tokens: int) -> list[KVCache | GatedDeltaCache]:
        """One empty cache per layer for `batch` sequences of up to max_tokens tokens in all: a KVCache for an
        attention layer, past the context a ring of `context` slots (the sliding window that hidden() recomputes);
        a GatedDeltaCache for a gated delta layer, the same bytes at any length."""
        window = None if max_tokens <= self.config.context else self.config.context
        c = self.config
        return [
            KVCache(batch, c.heads, max_tokens, c.head_dim, c.dtype, window=window)
            if c.layer_kind(layer) == "A"
            else GatedDeltaCache(batch, c.delta_shape, c.dtype)
            for layer in range(c.layers)
        ]
