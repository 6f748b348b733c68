"""Position information: rotary embeddings (RoPE) and, as the contrast, a learned position table.

Attention alone cannot tell word order: shuffle the tokens and the outputs come out shuffled the same
way. RoPE (Su et al. 2021, "RoFormer") rotates each pair of channels of q and k by the angle
position · θ_i with θ_i = base^(-2i/d). A rotation by mθ dotted with one by nθ depends only on
(m - n)θ, so the score q_m · k_n depends on the distance m - n, never on m or n alone.

Which channels make a pair is a convention:
    interleaved=True    pairs (0, 1), (2, 3), ...       Meta's Llama code (complex multiply)
    interleaved=False   pairs (i, i + d/2)              Hugging Face's rotate_half
They are the same rotation once the channels are permuted; to_half_split() and permute_qk_weight()
convert one into the other.

Read rope() first: the math on one screen, and beside it rope_backward, its gradient. Below them, their
input checks and θ; then the layouts and the learned table; last, apart, what each method of RoPE scaling
for long context does to θ (a config.json's rope_scaling dict, whose fields rope_scaling.py checks).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    ACCEPTED_DTYPES,
    as_float_array,
    check_bool,
    check_ndim,
    check_positive_int,
    check_rng,
    compute_dtype,
)
from .rope_scaling import _NO_FACTOR, RopeScaling, _check_finite_number, check_rope_scaling, rotary_dim

Array = NDArray[np.floating]

__all__ = [
    "LearnedPositions",
    "half_split_permutation",
    "permute_qk_weight",
    "rope",
    "rope_attention_factor",
    "rope_backward",
    "rope_frequencies",
    "to_half_split",
    "to_interleaved",
]


def rope(
    x: Array,
    *,
    positions: Any = None,
    base: float = 10000.0,
    interleaved: bool = True,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> Array:
    """Rotate each channel pair (x1, x2) of x (..., T, d) at position m by the angle m · θ_i:

        x1' = a · (x1 cos mθ_i - x2 sin mθ_i)        θ_i = base^(-2i/d)       (rope_frequencies)
        x2' = a · (x1 sin mθ_i + x2 cos mθ_i)        a = 1 without scaling    (rope_attention_factor)

    positions: (T,) finite numbers, default 0 .. T-1 (negative ones rotate back). Norms are kept (a
    rotation does not stretch) unless scaling has an attention factor a. scaling, seq_len and
    max_position_embeddings: as in rope_frequencies; seq_len defaults to the largest position + 1, as
    transformers computes it. With partial_rotary_factor only the first rotary_dim channels turn; the
    rest pass unchanged. Apply to q and k, never to v.

        >>> rope(np.array([[1.0, 0.0]]), positions=[np.pi / 2]).round(6)   # a quarter turn
        array([[0., 1.]])
    """
    x, positions, interleaved = check_rope(x, positions, interleaved)  # x (..., T, d), positions (T,) float64
    # the scaling machinery (see the section at the end) gives θ and a; without scaling: base^(-2i/d) and 1
    seq_len = rope_seq_len(positions, seq_len)
    theta = rope_frequencies(
        x.shape[-1], base, scaling=scaling, seq_len=seq_len, max_position_embeddings=max_position_embeddings
    )  # (r/2,): r = d, or fewer channels with partial_rotary_factor
    a = rope_attention_factor(scaling, max_position_embeddings=max_position_embeddings)
    r = 2 * theta.shape[0]  # channels that turn
    dtype, out_dtype = compute_dtype(x), x.dtype  # float16 is computed in float32 and cast back

    # 1) the angle of pair i at position m, in float64: m · θ_i for m in the thousands keeps its digits
    angles = positions[:, None] * theta  # (T, r/2)
    x = x.astype(dtype, copy=False)
    out = np.empty(x.shape, dtype)  # (..., T, d), C-contiguous whatever the layout of x (a view of heads)
    out[..., r:] = x[..., r:]  # channels r .. d-1 (partial rotary) pass unchanged

    if interleaved and x.strides[-1] == x.itemsize:
        # 2) interleaved pairs lie in memory as complex numbers x1 + i·x2, and the rotation by mθ_i times a is
        #    the product with a·e^{imθ_i} = a (cos mθ_i + i sin mθ_i): the two lines below in one pass
        complex_dtype = np.result_type(dtype, np.complex64)
        turn = (a * np.exp(1j * angles)).astype(complex_dtype)  # (T, r/2)
        np.multiply(x[..., :r].view(complex_dtype), turn, out=out[..., :r].view(complex_dtype))  # (..., T, r/2)
        return out.astype(out_dtype, copy=False)

    # 2) the two halves of every pair: (0, 1), (2, 3), ... interleaved, or (i, i + r/2) half-split
    first, second = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
    x1, x2 = x[..., first], x[..., second]  # (..., T, r/2) each
    cos = (a * np.cos(angles)).astype(dtype)  # (T, r/2)
    sin = (a * np.sin(angles)).astype(dtype)  # (T, r/2)

    # 3) rotate each pair, written straight into its two channels
    out_1, out_2 = out[..., first], out[..., second]  # (..., T, r/2) each, views
    np.multiply(x1, cos, out=out_1)
    out_1 -= x2 * sin  # x1 cos - x2 sin
    np.multiply(x1, sin, out=out_2)
    out_2 += x2 * cos  # x1 sin + x2 cos
    return out.astype(out_dtype, copy=False)


def rope_backward(
    grad: Array,
    *,
    positions: Any = None,
    base: float = 10000.0,
    interleaved: bool = True,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> Array:
    """∂loss/∂x from ∂loss/∂rope(x) = grad (..., T, d): rope with the angles negated.

    rope multiplies each channel pair at position m by a · R(mθ_i), a rotation (times scaling's attention
    factor a, 1 without scaling), so the gradient goes back through a · R(mθ_i)ᵀ = a · R(−mθ_i): the
    rotation by −θ. Pass what the forward got: positions, base, pair layout, scaling, seq_len and
    max_position_embeddings. Channels that partial rotary leaves alone pass the gradient as is.
    """
    grad = as_float_array(grad, "grad")
    if grad.ndim < 2:
        raise ValueError(f"grad must have at least 2 dims (..., T, d); got shape {grad.shape}")
    # the forward's positions (T,), checked as rope checks them, as float64: negating an unsigned int would wrap
    forward = rope_positions(positions, grad.shape[-2])
    if seq_len is None and scaling is not None and forward.size:
        # the forward's θ came from its largest position (dynamic scaling): take it from there, not from -θ's
        seq_len = max(int(forward.max()) + 1, 1)
    return rope(grad, positions=-forward, base=base, interleaved=interleaved, scaling=scaling, seq_len=seq_len,
                max_position_embeddings=max_position_embeddings)  # fmt: skip


def check_rope(x: Any, positions: Any, interleaved: Any, name: str = "x") -> tuple[Array, NDArray[np.float64], bool]:
    """rope's inputs, checked before any math: x a float array (..., T, d), positions (T,) finite numbers as
    float64 (rope_positions), interleaved a real bool. Each failure names the argument."""
    x = as_float_array(x, name)
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., T, d); got shape {x.shape}")
    return x, rope_positions(positions, x.shape[-2]), check_bool(interleaved, "interleaved")


def rope_positions(positions: Any, n: int) -> NDArray[np.float64]:
    """positions as (n,) float64: 0 .. n-1 for None, else n finite ints or floats, one per row of x.

    NaN or inf would turn every channel of its row into NaN: refused. Float64 keeps an integer position
    exact up to 2^53 and lets the backward negate an unsigned one without wrapping.
    """
    if positions is None:
        return np.arange(n, dtype=np.float64)
    try:
        positions = np.asarray(positions)
    except ValueError as err:  # a ragged nested list
        raise ValueError(f"positions must be a 1-D array of numbers; could not make one: {err}") from None
    if positions.ndim != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must be 1-D with one entry per row of x ({n}); got shape {positions.shape}")
    if not (np.issubdtype(positions.dtype, np.integer) or np.issubdtype(positions.dtype, np.floating)):
        raise TypeError(f"positions must be ints or floats; got dtype {positions.dtype}")
    positions = positions.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(positions))
    if bad.size:
        raise ValueError(f"positions must be finite numbers; got {positions[bad[0]]} at index {bad[0]}")
    return positions


def rope_seq_len(positions: NDArray[np.float64], seq_len: int | None = None) -> int | None:
    """The sequence length that dynamic and longrope scaling see: seq_len when given, else the largest
    position + 1 (at least 1), as transformers takes it from position_ids; None with no positions."""
    if seq_len is not None or positions.size == 0:
        return seq_len
    return max(int(positions.max()) + 1, 1)


def rope_frequencies(
    dim: int,
    base: float = 10000.0,
    *,
    scaling: dict[str, Any] | None = None,
    seq_len: int | None = None,
    max_position_embeddings: int | None = None,
) -> NDArray[np.float64]:
    """θ_i = base^(-2i / d) for i = 0 .. d/2 - 1, stretched for long context by `scaling`.

    Without scaling, pair 0 turns one radian a position and the last pair barely turns over thousands
    of positions. scaling: a config.json's rope_scaling (or rope_parameters) dict, every field checked by
    check_rope_scaling; see the last section of this file for each method. seq_len: the current sequence
    length (dynamic uses it; longrope picks long_factor past L0). max_position_embeddings: the config's;
    L0 where the dict has no original_max_position_embeddings, and always for dynamic.
    d is rotary_dim(dim, scaling): dim unless partial_rotary_factor says less. Shape (d/2,), float64.
    """
    base = _check_base(base)
    params = check_rope_scaling(scaling, dim, base=base, max_position_embeddings=max_position_embeddings)
    d = rotary_dim(dim, scaling)
    if seq_len is not None:
        seq_len = check_positive_int(seq_len, "seq_len")
    theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    if params is None:
        return theta
    with np.errstate(over="ignore"):  # an overflow is refused just below, with the fields that caused it
        theta = _SCALED_FREQUENCIES[params.rope_type](theta, params, base, seq_len)  # (d/2,)
    bad = np.flatnonzero(~np.isfinite(theta))
    if bad.size:  # a factor such as 1e-320 divides θ past float64's largest
        raise ValueError(
            f"scaling with rope_type {params.rope_type!r} gives frequency θ_{bad[0]} = {theta[bad[0]]}: "
            f"its factors are too extreme for float64; got {scaling!r}"
        )
    return theta


def _check_base(base: Any) -> float:
    return _check_finite_number(base, "base", low=1.0, allowed="> 1")


# ---------------------------------------------------------------------------------------------------
# the two pair layouts


def half_split_permutation(dim: int) -> NDArray[np.intp]:
    """perm with x[..., perm] taking the interleaved layout to the half-split one:
    [0, 2, 4, ..., 1, 3, 5, ...], so that interleaved pair (2i, 2i+1) lands on (i, i + d/2)."""
    dim = check_positive_int(dim, "dim")
    if dim % 2:
        raise ValueError(f"dim must be even; got {dim}")
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def to_half_split(x: Array) -> Array:
    """Permute the last axis from the interleaved pair layout to the half-split one."""
    x = as_float_array(x, "x")
    check_ndim(x, "x", 1, "(..., d), d even")
    return x[..., half_split_permutation(x.shape[-1])]


def to_interleaved(x: Array) -> Array:
    """Permute the last axis from the half-split pair layout to the interleaved one."""
    x = as_float_array(x, "x")
    check_ndim(x, "x", 1, "(..., d), d even")
    return x[..., np.argsort(half_split_permutation(x.shape[-1]))]


def permute_qk_weight(w: Array, n_heads: int, *, to: str = "half_split") -> Array:
    """Permute the columns of a q or k projection w (d_model, n_heads · d_head), head by head, so that
    a model written for one RoPE layout gives the same scores with the other. (This is what the Llama
    to Hugging Face weight conversion does.)  x @ permute_qk_weight(w, H) == to_half_split(x @ w) per head.
    """
    w = as_float_array(w, "w")
    n_heads = check_positive_int(n_heads, "n_heads")
    if w.ndim != 2 or w.shape[1] % n_heads:
        raise ValueError(f"w must be 2-D with columns divisible by n_heads={n_heads}; got shape {w.shape}")
    if to not in ("half_split", "interleaved"):
        raise ValueError(f"to must be 'half_split' or 'interleaved'; got {to!r}")
    d_head = w.shape[1] // n_heads
    perm = half_split_permutation(d_head)
    if to == "interleaved":
        perm = np.argsort(perm)
    cols = (np.arange(n_heads)[:, None] * d_head + perm[None, :]).ravel()  # (n_heads · d_head,)
    return w[:, cols]


# ---------------------------------------------------------------------------------------------------
# the contrast: a learned table


class LearnedPositions:
    """A learned absolute position table (GPT-2's wpe): row p is added to the token at position p.

    It has a fixed number of rows, so a position past the end has no vector: asking for one is a
    ValueError, where RoPE would just compute another angle.
    rng: a np.random.Generator, an int seed, or None (a fresh table each time); dtype: float16, 32 or 64.
    """

    def __init__(
        self, max_positions: int, dim: int, *, rng: np.random.Generator | int | None = None, dtype: Any = np.float32
    ):
        self.max_positions = check_positive_int(max_positions, "max_positions")
        self.dim = check_positive_int(dim, "dim")
        if np.dtype(dtype) not in ACCEPTED_DTYPES:  # an int table would round every 0.01-sized entry to 0
            raise TypeError(f"dtype must be float16, float32 or float64; got {np.dtype(dtype)}")
        rng = check_rng(rng)  # None: a fresh table; an int: that seed
        # GPT-2 initialises wpe with N(0, 0.01²) (Radford et al. 2019, the released code)
        self.table = (0.01 * rng.standard_normal((self.max_positions, self.dim))).astype(dtype)

    def __call__(self, positions: Any) -> Array:
        """positions (T,) of ints in [0, max_positions) -> (T, dim) rows of the table."""
        positions = np.asarray(positions)
        if not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"positions must be ints; got dtype {positions.dtype}")
        outside = positions[(positions < 0) | (positions >= self.max_positions)]
        if outside.size:
            raise ValueError(
                f"positions must lie in [0, {self.max_positions}): this table has {self.max_positions} "
                f"rows and no vector for position {int(outside[0])}"
            )
        return self.table[positions]


# ---------------------------------------------------------------------------------------------------
# RoPE for long context: the `rope_scaling` (or `rope_parameters`) dict of a config.json
#
# Each method stretches the wavelengths 2π/θ_i so that positions past the trained length L0 land on
# angles the model has seen. The formulas follow Hugging Face transformers,
# src/transformers/modeling_rope_utils.py (the _compute_*_parameters functions):
#   linear    θ_i / factor for every pair (position interpolation, Chen et al. 2023)
#   dynamic   NTK-aware: base' = base · (factor · T / L0 - (factor - 1))^(d / (d - 2)) once the sequence
#             length T passes L0; plain RoPE up to L0
#   yarn      high frequencies kept, low ones divided by factor, a linear ramp between, and cos and sin
#             multiplied by 0.1 · ln(factor) + 1 (Peng et al. 2023, "YaRN")
#   llama3    wavelength < L0 / high_freq_factor kept, > L0 / low_freq_factor divided by factor, smooth
#             in between (Llama 3.1)
#   longrope  θ_i / ext_i with per-pair factors: short_factor up to L0, long_factor past it, and cos and
#             sin times sqrt(1 + ln(factor) / ln(L0)) (Phi-3; Ding et al. 2024, "LongRoPE")
# L0 is the dict's original_max_position_embeddings, else the config's max_position_embeddings; dynamic
# always takes max_position_embeddings, as transformers' _compute_dynamic_ntk_parameters does.
# partial_rotary_factor p (where the dict has it) rotates only the first int(p · d) channels.
# rope_scaling.py checks every field of the dict first; the formulas below read its RopeScaling.


def rope_attention_factor(scaling: dict[str, Any] | None, *, max_position_embeddings: int | None = None) -> float:
    """The number that multiplies cos and sin (so every score by its square): 1.0 unless the method has one.

    yarn      attention_factor, else (0.1 · mscale · ln f + 1) / (0.1 · mscale_all_dim · ln f + 1)
              when the dict has both, else 0.1 · ln f + 1
    longrope  attention_factor, else sqrt(1 + ln f / ln L0)   (1 where f <= 1)
    """
    params = check_rope_scaling(scaling, max_position_embeddings=max_position_embeddings)
    if params is None or params.rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.attention_factor is not None:
        return params.attention_factor
    factor = params.factor
    if factor == 0.0:  # longrope with no factor in the dict and no max_position_embeddings to derive one
        raise ValueError(_NO_FACTOR.format(kind=params.rope_type))
    if params.rope_type == "yarn":
        if params.mscale is not None and params.mscale_all_dim is not None:
            return _yarn_mscale(factor, params.mscale) / _yarn_mscale(factor, params.mscale_all_dim)
        return _yarn_mscale(factor)
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params.original_length))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# θ of each method from plain θ (d/2,); params checked by check_rope_scaling, seq_len None or > 0


def _linear(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    return theta / params.factor


def _dynamic(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    """base' = base · ratio^(d/(d-2)) with ratio = factor · (T / L0 - 1) + 1 for T past L0, so that
    θ'_i = base'^(-2i/d) = θ_i · ratio^(-2i/(d-2)): no power of base' to overflow float64."""
    d, original, factor = 2 * theta.shape[0], params.original_length, params.factor
    length = original if seq_len is None else max(seq_len, original)  # plain RoPE up to L0
    ratio = factor * (length / original - 1) + 1  # factor · T / L0 - (factor - 1), with no cancellation
    return theta * ratio ** (-np.arange(0, d, 2, dtype=np.float64) / (d - 2))  # (d/2,)


def _yarn(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    """YaRN: pairs that turn more than beta_fast times over L0 keep θ, pairs that turn fewer than
    beta_slow times get θ / factor, and a linear ramp over the pair index joins the two."""
    d, original, factor = 2 * theta.shape[0], params.original_length, params.factor

    def pair_turning(turns: float) -> float:  # the pair index i whose wavelength fits `turns` times in L0
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(params.beta_fast), pair_turning(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0.0, 1.0)  # (d/2,): 0 keep θ, 1 use θ / factor
    return theta * (1 - ramp) + theta / factor * ramp


def _llama3(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    factor, low, high = params.factor, params.low_freq_factor, params.high_freq_factor
    wavelength = 2 * np.pi / theta  # (d/2,) positions per full turn
    smooth = np.clip((params.original_length / wavelength - low) / (high - low), 0.0, 1.0)  # 0: divide, 1: keep
    return (1 - smooth) * theta / factor + smooth * theta


def _longrope(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    long = seq_len is not None and seq_len > params.original_length
    ext = params.long_factor if long else params.short_factor  # (d/2,) checked against d by check_rope_scaling
    return theta / ext


_SCALED_FREQUENCIES = {
    "default": lambda theta, params, base, seq_len: theta,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}
