"""The parts some models add to the decoder block, each with its weights and what it keeps per sequence:
a mixture of experts in place of the MLP, multi-head latent attention (a latent cached instead of the heads),
linear-attention and state-space layers with a state of fixed size, DeepSeek's sparse-attention indexer, and
the few weights that one architecture alone has (Extra). ModelShape (models.py) holds them; the formulas of
their bytes are memory.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._bytes import nbytes
from ._checks import check_bool, check_count, check_positive_int
from ._shape_checks import check_choice
from .memory import linear_attention_state_bytes

__all__ = [
    "EXTRA_PLACES",
    "Experts",
    "Extra",
    "Indexer",
    "KindAttention",
    "LatentAttention",
    "LinearAttention",
    "StateSpace",
]


# the kinds of LinearAttention
LINEAR_KINDS = ("gated_deltanet", "lightning", "short_conv", "kda", "rglru", "rwkv", "mlstm")


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
    buffer, not counted); shared_gate: Qwen2-MoE's C -> 1 gate on the shared expert; gated=False: experts
    of two matrices, up and down (Nemotron-H), whose shared expert follows the model's MLP; beside_mlp: the
    layer keeps its dense MLP beside the experts (LongCat-Flash's shortcut experts, Gemma-4's).
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
    gated: bool = True
    beside_mlp: bool = False

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
        for flag in ("shared_gate", "router_bias", "expert_bias", "score_bias", "gated", "beside_mlp"):
            check_bool(getattr(self, flag), flag)
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("shared_gate gates the shared expert, so it needs shared_intermediate > 0")

    def expert_parameters(self, hidden: int) -> int:
        """One expert: gate and up (C x F each) and down (F x C), plus 2F + C biases with expert_bias; without
        the gate (gated=False) 2·C·F and F + C."""
        matrices = 3 if self.gated else 2
        biases = (matrices - 1) * self.intermediate + hidden if self.expert_bias else 0
        return matrices * hidden * self.intermediate + biases

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
class KindAttention:
    """The attention of the layers of one kind, where its sizes are not the model's own.

    MiMo-V2-Flash's sliding layers have twice the kv heads of its full ones, and sinks; Gemma-4's full layers
    have heads of 512 (global_head_dim) where its sliding ones have 256, and keys that are the values;
    Inkling's sliding layers have heads of their own; dots.llm3's sliding layers a latent attention of their own
    and no indexer. kind: the layer kind (full, sliding or chunked attention); heads, kv_heads, head_dim and
    value_dim (None: head_dim) as ModelShape's; sinks: a learned logit a head; values=False: the keys are the
    values (no v projection; transformers' cache still keeps both); latent: the kind's LatentAttention, in a
    model of latent attention (heads its heads, head_dim its nope + rope); indexer=False: the model's indexer
    does not run on these layers. Weights and cache follow the formulas of the model's own attention.
    """

    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int | None = None
    sinks: bool = False
    values: bool = True
    latent: LatentAttention | None = None
    indexer: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise TypeError(f"kind must be a str; got {self.kind!r}")
        _check_ints(self, ("heads", "kv_heads", "head_dim"))
        if self.value_dim is not None:
            check_positive_int(self.value_dim, "value_dim")
        for flag in ("sinks", "values", "indexer"):
            check_bool(getattr(self, flag), flag)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads must be a multiple of kv_heads; got heads={self.heads}, kv_heads={self.kv_heads}")
        if self.latent is not None and not isinstance(self.latent, LatentAttention):
            raise TypeError(f"latent must be a LatentAttention or None; got {type(self.latent).__name__}")
        if self.latent is not None and self.head_dim != self.latent.nope_dim + self.latent.rope_dim:
            raise ValueError(f"with latent attention head_dim is nope_dim + rope_dim; got {self.head_dim}")

    @property
    def value_width(self) -> int:
        """The width of a value head: the latent's v_dim, else value_dim, else head_dim."""
        if self.latent is not None:
            return self.latent.v_dim
        return self.head_dim if self.value_dim is None else self.value_dim


@dataclass(frozen=True)
class LinearAttention:
    """The layers of linear attention (and other recurrences) that keep a state of fixed size, not a cache.

    kind "gated_deltanet" (Qwen3-Next): a short causal convolution of conv_kernel over q, k and v, then
    per value head a key_dim x value_dim state S updated by the gated delta rule; the q and k heads
    (key_heads) are shared by value_heads / key_heads value heads. Weights: the q, k, v and output-gate
    projections C·(2·Hk·Dk + 2·Hv·Dv), C·2Hv for the gate and step size, the convolution's
    (2·Hk·Dk + Hv·Dv)·K, 2Hv (A and its step bias), the output norm Dv and Hv·Dv·C out.

    kind "kda" (Kimi Delta Attention): the delta rule with a forget gate per channel, H heads of D (keys and
    values): q, k, v C·3HD, the convolution 3HD·K, forget and output gates of rank D (C·D + D·HD each), the
    forget gate's bias HD and A H, the step size C·H, the output norm D, out HD·C.

    kind "lightning" (MiniMax): H heads with key_dim = value_dim = E and S_t = decay · S_{t-1} + k_t v_tᵀ;
    weights C·3HE (q, k, v), HE (the norm), C·HE (the output gate) and HE·C out. No convolution.

    kind "short_conv" (LFM2): no recurrence, a gated short convolution of conv_kernel over value_dim = C
    channels (one "head"): in_proj C·3C (B, C and x), the convolution C·K, out_proj C·C; bias adds 3C + C + C.

    kind "rglru" (RecurrentGemma's RG-LRU): a recurrence of W = H·value_dim channels (key_dim 1) with
    block-diagonal input and recurrence gates of H blocks: the two branches C·W + W each, out W·C + C, the
    convolution W·K + W, the recurrence W and the gates 2·(W²/H + W); it keeps its last K - 1 inputs.

    kind "rwkv" (RWKV-4's time mixing): value_dim = A channels of a weighted sum kept as three numbers each:
    key, value, receptance C·A each, out A·C, the decays 2A and the token-shift mixes 3C; its state is 5·C a
    layer (the sums, and the last token of the time and channel mixing).

    kind "mlstm" (xLSTM): H heads, a matrix memory of Dk x Dv, a normaliser of Dk and a maximum each: q, k C·Hk·Dk
    each, v and the output gate C·Hv·Dv each, input and forget gates C·2H + 2H, the head norm Hv·Dv and out Hv·Dv·C;
    bias adds the projections' (2·Hk·Dk + 3·Hv·Dv + C).

    The state per layer and sequence: value_heads · key_dim · value_dim, and the convolution's last inputs,
    conv_channels · conv_kernel (K - 1 for rglru); rwkv and mlstm as said.
    """

    kind: str
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 0
    bias: bool = False

    def __post_init__(self) -> None:
        check_choice(self.kind, "kind", LINEAR_KINDS)
        _check_ints(self, ("key_heads", "value_heads", "key_dim", "value_dim"), ("conv_kernel",))
        check_bool(self.bias, "bias")
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"value_heads must be a multiple of key_heads; got value_heads={self.value_heads}, "
                f"key_heads={self.key_heads}"
            )
        heads, dims = (self.key_heads, self.key_dim), (self.value_heads, self.value_dim)
        shapes = {  # kind -> what its heads must be, in words and as a test
            "lightning": ("key_heads == value_heads, key_dim == value_dim", heads == dims),
            "kda": ("key_heads == value_heads, key_dim == value_dim", heads == dims),
            "short_conv": (
                "one head: key_heads == value_heads == 1, key_dim == value_dim",
                (self.key_heads, self.value_heads, self.key_dim) == (1, 1, self.value_dim),
            ),
            "rglru": (
                "key_heads == value_heads and key_dim == 1",
                self.key_heads == self.value_heads and self.key_dim == 1,
            ),
            "rwkv": ("one head: key_heads == value_heads == key_dim == 1", heads == (1, 1) and self.value_heads == 1),
            "mlstm": ("key_heads == value_heads", self.key_heads == self.value_heads),
        }
        if self.kind in shapes and not shapes[self.kind][1]:
            raise ValueError(f"{self.kind} has {shapes[self.kind][0]}; got {self}")
        convolves = self.kind in ("gated_deltanet", "kda", "short_conv", "rglru")
        if convolves != (self.conv_kernel >= 1):
            which = "has a short convolution: conv_kernel must be >= 1" if convolves else "has no convolution: 0"
            raise ValueError(f"{self.kind} {which}; got {self.conv_kernel}")

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q and k (Hk·Dk each) and v (Hv·Dv); the width for short_conv and
        rglru; 0 without a convolution."""
        if self.conv_kernel == 0:
            return 0
        if self.kind in ("short_conv", "rglru"):
            return self.value_heads * self.value_dim
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def parameters(self, hidden: int) -> int:
        """One linear-attention layer's weights (the formulas in the class docstring)."""
        c, h, k = hidden, self.value_heads, self.conv_kernel
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        if self.kind == "lightning":
            return c * 3 * values + values + c * values + values * c
        if self.kind == "short_conv":
            return c * 3 * values + values * k + values * c + (5 * values if self.bias else 0)
        if self.kind == "kda":
            low_rank = c * self.key_dim + self.key_dim * values  # a gate through a rank of D
            return c * 3 * values + 3 * values * k + 2 * low_rank + values + h + c * h + self.value_dim + values * c
        if self.kind == "rglru":
            gates = 2 * (values * self.value_dim + values)  # H blocks of (W/H)², and a bias, for each of two gates
            return 2 * (c * values + values) + values * c + c + values * k + values + values + gates
        if self.kind == "rwkv":
            return 4 * c * values + 2 * values + 3 * c
        if self.kind == "mlstm":
            bias = 2 * keys + 3 * values + c if self.bias else 0
            return c * (2 * keys + 2 * values) + c * 2 * h + 2 * h + values + values * c + bias
        projections = c * (2 * keys + 2 * values) + c * 2 * self.value_heads
        return projections + self.conv_channels * k + 2 * self.value_heads + self.value_dim + values * c

    def state_numbers(self) -> int:
        """The numbers one such layer keeps per sequence (the class docstring)."""
        recurrent = self.value_heads * self.key_dim * self.value_dim
        if self.kind == "rwkv":
            return 5 * self.value_dim
        if self.kind == "mlstm":
            return recurrent + self.value_heads * self.key_dim + self.value_heads
        if self.kind == "rglru":
            return recurrent + self.conv_channels * (self.conv_kernel - 1)
        return (0 if self.kind == "short_conv" else recurrent) + self.conv_channels * self.conv_kernel

    def state_bytes(self, layers: int, dtype: Any = "bf16", batch: int = 1) -> int:
        """memory.linear_attention_state_bytes for `layers` such layers; the kinds its formula does not fit
        (a short convolution's inputs alone, RG-LRU, RWKV, mLSTM): state_numbers of each."""
        if self.kind in ("short_conv", "rglru", "rwkv", "mlstm"):
            return nbytes(layers * batch * self.state_numbers(), dtype)
        return linear_attention_state_bytes(
            layers=layers,
            heads=self.value_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            conv_channels=self.conv_channels,
            conv_kernel=self.conv_kernel,
            dtype=dtype,
            batch=batch,
        )


@dataclass(frozen=True)
class StateSpace:
    """Selective state-space layers in place of attention: Mamba (Gu & Dao 2023) and Mamba-2 (Dao & Gu 2024).

    Each layer widens x to `inner` channels (in_proj, with a gate z beside them), runs a short causal
    convolution of conv_kernel over them, then a recurrence whose state h_t = Ā_t h_{t-1} + B̄_t x_t keeps
    `state` numbers (N) per channel, read out as y_t = C_t h_t, and projects back (out_proj).

    kind "mamba": Δ, B and C come from x through x_proj (inner -> dt_rank + 2N) and dt_proj (dt_rank ->
    inner); A is inner x N. Weights: C·2I, the convolution I·K (+ I bias), I·(R + 2N), R·I + I, I·N + I (A, D)
    and I·C, with dt_norms (Jamba) R + 2N more.
    kind "mamba2": heads of inner / heads channels share one scalar A; B and C (groups · N each) come out of
    in_proj with z, x and Δ: C·(2I + 2GN + H), the convolution over I + 2GN channels, 3H (Δ's bias, A, D),
    the gated norm I (norm) and I·C.
    proj_bias adds the in and out projections' biases, conv_bias the convolution's.

    The state per layer and sequence: inner · N numbers, and the convolution's last conv_kernel inputs of
    conv_channels: both fixed, whatever the context.
    """

    kind: str
    inner: int
    state: int
    conv_kernel: int
    heads: int = 0
    groups: int = 1
    dt_rank: int = 0
    proj_bias: bool = False
    conv_bias: bool = True
    norm: bool = True
    dt_norms: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("mamba", "mamba2"):
            raise ValueError(f"kind must be one of mamba, mamba2; got {self.kind!r}")
        _check_ints(self, ("inner", "state", "conv_kernel", "groups"), ("heads", "dt_rank"))
        for flag in ("proj_bias", "conv_bias", "norm", "dt_norms"):
            check_bool(getattr(self, flag), flag)
        if self.kind == "mamba" and self.dt_rank < 1:
            raise ValueError(f"mamba's Δ goes through a projection of dt_rank >= 1; got {self.dt_rank}")
        if self.kind == "mamba2" and (self.heads < 1 or self.inner % self.heads):
            raise ValueError(f"mamba2's inner={self.inner} must split into heads >= 1; got heads={self.heads}")

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: inner (Mamba), inner + 2 · groups · N (Mamba-2: x, B and C)."""
        return self.inner + (2 * self.groups * self.state if self.kind == "mamba2" else 0)

    def parameters(self, hidden: int) -> int:
        """One state-space layer's weights (the formulas in the class docstring)."""
        c, i, n = hidden, self.inner, self.state
        conv = self.conv_channels * self.conv_kernel + (self.conv_channels if self.conv_bias else 0)
        if self.kind == "mamba":
            into, r = 2 * i, self.dt_rank
            inner = i * (r + 2 * n) + r * i + i + i * n + i + (r + 2 * n if self.dt_norms else 0)
        else:
            into = 2 * i + 2 * self.groups * n + self.heads
            inner = 3 * self.heads + (i if self.norm else 0)
        biases = into + c if self.proj_bias else 0
        return c * into + conv + inner + i * c + biases

    def state_bytes(self, layers: int, dtype: Any = "bf16", batch: int = 1) -> int:
        """memory.linear_attention_state_bytes for `layers` such layers: inner x N, and the convolution's inputs."""
        return linear_attention_state_bytes(
            layers=layers,
            heads=1,
            key_dim=self.inner,
            value_dim=self.state,
            conv_channels=self.conv_channels,
            conv_kernel=self.conv_kernel,
            dtype=dtype,
            batch=batch,
        )


@dataclass(frozen=True)
class Indexer:
    """DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5): which `topk` keys each query attends.

    Per layer, heads small query heads of head_dim read the query latent (q_rank wide, from latent attention)
    and one shared key of head_dim per token, scored as Σ_h w_h · ReLU(q_h · k): wq_b q_rank·H_I·d_I, wk C·d_I,
    its LayerNorm 2·d_I, the head weights C·H_I. The cache keeps the key: head_dim numbers per token and
    layer beside the latent. The attention then reads min(T, topk) keys per query, the indexer every key.
    """

    heads: int
    head_dim: int
    topk: int
    q_rank: int

    def __post_init__(self) -> None:
        _check_ints(self, ("heads", "head_dim", "topk", "q_rank"))

    def parameters(self, hidden: int) -> int:
        """One layer's indexer (the formula in the class docstring)."""
        return (
            self.q_rank * self.heads * self.head_dim + hidden * self.head_dim + 2 * self.head_dim + hidden * self.heads
        )


# where an Extra sits: once in the model, on every layer, on the layers of one kind (models.LAYER_TYPES),
# on the softmax-attention layers, or on the layers with experts, or with a dense MLP
EXTRA_PLACES = ("model", "every layer", "attention", "moe", "dense")


@dataclass(frozen=True)
class Extra:
    """Weights (and a fixed state) that one architecture alone has, counted where they sit.

    what: a name for the bill's description; where: one of EXTRA_PLACES or a layer kind; parameters: how
    many per such layer (once for "model"); state: numbers a sequence keeps per such layer, whatever the
    context (a short convolution's last inputs). DiffLlama's λ vectors, Gemma-3n's per-layer embeddings,
    BLOOM's LayerNorm on the embeddings: each a line of the config reader's table.
    """

    what: str
    where: str
    parameters: int = 0
    state: int = 0
    active: bool = True  # False: weights a token does not run (JetMoE's attention experts beyond the top k)

    def __post_init__(self) -> None:
        check_bool(self.active, "active")
        if not isinstance(self.what, str) or not isinstance(self.where, str):
            raise TypeError(f"what and where must be str; got {self.what!r}, {self.where!r}")
        _check_ints(self, (), ("parameters", "state"))
