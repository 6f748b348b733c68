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

Array = NDArray[np.floating]


# ---------------------------------------------------------------------------------------------------
# RoPE for long context: the `rope_scaling` (or `rope_parameters`) dict of a config.json
#
# Each method stretches the wavelengths 2π/θ_i so that positions past the trained length
# (original_max_position_embeddings, L0) land on angles the model has seen. The formulas follow Hugging
# Face transformers, src/transformers/modeling_rope_utils.py (the _compute_*_parameters functions):
#   linear    θ_i / factor for every pair (position interpolation, Chen et al. 2023)
#   dynamic   NTK-aware: base' = base · (factor · T / L0 - (factor - 1))^(d / (d - 2)) once the sequence
#             length T passes L0; plain RoPE up to L0
#   yarn      high frequencies kept, low ones divided by factor, a linear ramp between, and cos and sin
#             multiplied by 0.1 · ln(factor) + 1 (Peng et al. 2023, "YaRN")
#   llama3    wavelength < L0 / high_freq_factor kept, > L0 / low_freq_factor divided by factor, smooth
#             in between (Llama 3.1)
#   longrope  θ_i / ext_i with per-pair factors: short_factor up to L0, long_factor past it, and cos and
#             sin times sqrt(1 + ln(factor) / ln(L0)) (Phi-3; Ding et al. 2024, "LongRoPE")
# partial_rotary_factor p (where the dict has it) rotates only the first int(p · d) channels.

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}


def _check_base(base: Any) -> float:
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, (int, float, np.floating, np.integer)):
        raise TypeError(f"base must be a number > 1; got {base!r} ({type(base).__name__})")
    if not (math.isfinite(float(base)) and base > 1):
        raise ValueError(f"base must be a finite number > 1; got {base!r}")
    return float(base)


def _rope_type(scaling: Any) -> str:
    """The method a scaling dict names ("rope_type", or the older "type"), after checking its keys."""
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a config's rope_scaling dict or None; got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _REQUIRED_KEYS:
        raise ValueError(f"scaling has rope_type {kind!r}, which is unknown; known: {', '.join(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED_KEYS[kind] if scaling.get(key) is None]
    if missing:
        raise ValueError(
            f"scaling with rope_type {kind!r} is missing {', '.join(missing)}; "
            f"{kind} needs {', '.join(_REQUIRED_KEYS[kind])}"
        )
    return str(kind)


def _number(scaling: dict[str, Any], key: str) -> float:
    value = scaling.get(key)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"scaling[{key!r}] must be a number; got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scaling[{key!r}] must be a finite number > 0; got {value!r}")
    return float(value)


def _original_length(kind: str, scaling: dict[str, Any], max_position_embeddings: Any) -> int:
    """L0, the trained context: the dict's original_max_position_embeddings, else the config's
    max_position_embeddings (passed in), as transformers does."""
    value = scaling.get("original_max_position_embeddings")
    if value is None:
        value = max_position_embeddings
    if value is None:
        raise ValueError(
            f"scaling with rope_type {kind!r} needs the trained length: original_max_position_embeddings in "
            f"the dict, or max_position_embeddings= (the config's); got neither"
        )
    return check_positive_int(value, "original_max_position_embeddings")


def _factor(kind: str, scaling: dict[str, Any], max_position_embeddings: Any) -> float:
    """The stretch factor of yarn and longrope: the dict's factor; where it has none (Phi-3's longrope),
    max_position_embeddings / L0, as transformers does since it stopped letting that ratio override a
    given factor (huggingface/transformers issue 38224)."""
    if scaling.get("factor") is not None:
        return _number(scaling, "factor")
    if max_position_embeddings is None:
        raise ValueError(
            f"scaling with rope_type {kind!r} has no factor: give it in the dict, or max_position_embeddings= "
            f"(the config's) so that factor = max_position_embeddings / original_max_position_embeddings"
        )
    original = _original_length(kind, scaling, max_position_embeddings)
    return check_positive_int(max_position_embeddings, "max_position_embeddings") / original


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None, *, max_position_embeddings: int | None = None) -> float:
    """The number that multiplies cos and sin (so every score by its square): 1.0 unless the method has one.

    yarn      attention_factor, else (0.1 · mscale · ln f + 1) / (0.1 · mscale_all_dim · ln f + 1)
              when the dict has both, else 0.1 · ln f + 1
    longrope  attention_factor, else sqrt(1 + ln f / ln L0)   (1 where f <= 1)
    """
    if scaling is None:
        return 1.0
    kind = _rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return _number(scaling, "attention_factor")
    factor = _factor(kind, scaling, max_position_embeddings)
    if kind == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor)
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(_original_length(kind, scaling, max_position_embeddings)))


def rotary_dim(dim: int, scaling: dict[str, Any] | None = None) -> int:
    """Channels RoPE turns: int(partial_rotary_factor · dim), all of them when the dict has no such key."""
    dim = check_positive_int(dim, "dim")
    share = 1.0 if scaling is None or scaling.get("partial_rotary_factor") is None else scaling["partial_rotary_factor"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"scaling['partial_rotary_factor'] must be a number in (0, 1]; got {share!r}")
    rotated = int(dim * share)
    if rotated % 2 or rotated == 0:
        raise ValueError(
            f"dim must be even (channels are rotated in pairs), and so must the rotated part; "
            f"got dim={dim}, partial_rotary_factor={share} -> {rotated} rotated channels"
        )
    return rotated


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
    of positions. scaling: a config.json's rope_scaling (or rope_parameters) dict; see the section above
    for each method. seq_len: the current sequence length (dynamic uses it; longrope picks long_factor
    past L0). max_position_embeddings: the config's, where the dict has no original_max_position_embeddings.
    d is rotary_dim(dim, scaling): dim unless partial_rotary_factor says less. Shape (d/2,), float64.
    """
    kind = "default" if scaling is None else _rope_type(scaling)  # checks the dict's keys first
    d = rotary_dim(dim, scaling)
    base = _check_base(base)
    if seq_len is not None:
        seq_len = check_positive_int(seq_len, "seq_len")
    i2 = np.arange(0, d, 2, dtype=np.float64)  # (d/2,): 2i
    theta = base ** (-i2 / d)  # (d/2,)
    if scaling is None:
        return theta
    if kind == "linear":
        return theta / _number(scaling, "factor")
    if kind == "dynamic":
        if d <= 2:
            raise ValueError(f"dynamic scaling needs more than 2 rotated channels (d / (d - 2)); got {d}")
        factor, original = _number(scaling, "factor"), _original_length(kind, scaling, max_position_embeddings)
        length = original if seq_len is None else max(seq_len, original)  # plain RoPE up to L0
        stretched = base * (factor * length / original - (factor - 1)) ** (d / (d - 2))
        return stretched ** (-i2 / d)
    if kind == "yarn":
        return _yarn_frequencies(theta, d, base, scaling, max_position_embeddings)
    if kind == "llama3":
        factor = _number(scaling, "factor")
        low, high = _number(scaling, "low_freq_factor"), _number(scaling, "high_freq_factor")
        if high <= low:
            raise ValueError(f"scaling needs high_freq_factor > low_freq_factor; got {high} and {low}")
        original = _original_length(kind, scaling, max_position_embeddings)
        wavelength = 2 * np.pi / theta  # (d/2,) positions per full turn
        smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: divide, 1: keep
        return (1 - smooth) * theta / factor + smooth * theta
    if kind == "longrope":
        original = _original_length(kind, scaling, max_position_embeddings)
        key = "long_factor" if seq_len is not None and seq_len > original else "short_factor"
        ext = np.asarray(scaling[key], dtype=np.float64)
        if ext.shape != theta.shape or not np.all(np.isfinite(ext) & (ext > 0)):
            raise ValueError(f"scaling[{key!r}] must be {d // 2} positive numbers (one per pair); got {scaling[key]!r}")
        return theta / ext
    return theta  # "default"


def _yarn_frequencies(
    theta: NDArray[np.float64], d: int, base: float, scaling: dict[str, Any], max_position_embeddings: Any
) -> NDArray[np.float64]:
    """YaRN: pairs that turn more than beta_fast times over L0 keep θ, pairs that turn fewer than
    beta_slow times get θ / factor, and a linear ramp over the pair index joins the two."""
    factor = _factor("yarn", scaling, max_position_embeddings)
    original = _original_length("yarn", scaling, max_position_embeddings)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def pair_turning(turns: float) -> float:  # the pair index i whose wavelength fits `turns` times in L0
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0.0, 1.0)  # (d/2,): 0 keep θ, 1 use θ / factor
    return theta * (1 - ramp) + theta / factor * ramp


def _positions(positions: Any, n: int) -> NDArray[np.float64]:
    if positions is None:
        return np.arange(n, dtype=np.float64)
    positions = np.asarray(positions)
    if positions.ndim != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must be 1-D with one entry per row of x ({n}); got shape {positions.shape}")
    if not (np.issubdtype(positions.dtype, np.integer) or np.issubdtype(positions.dtype, np.floating)):
        raise TypeError(f"positions must be ints or floats; got dtype {positions.dtype}")
    return positions.astype(np.float64)


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
    """Rotate channel pairs of x (..., T, d) by position · θ_i. positions: (T,), default 0 .. T-1.

    Norms are preserved (a rotation does not stretch) unless scaling has an attention factor, which
    multiplies cos and sin (rope_attention_factor). scaling, seq_len, max_position_embeddings: as in
    rope_frequencies; seq_len defaults to the largest position + 1, as transformers computes it.
    With partial_rotary_factor only the first rotary_dim channels turn; the rest pass unchanged.
    Apply to q and k, never to v.
    """
    x = as_float_array(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., T, d); got shape {x.shape}")
    interleaved = check_bool(interleaved, "interleaved")
    T, d = x.shape[-2], x.shape[-1]
    pos = _positions(positions, T)  # (T,)
    if seq_len is None and scaling is not None and T:
        seq_len = max(int(pos.max()) + 1, 1)
    theta = rope_frequencies(d, base, scaling=scaling, seq_len=seq_len, max_position_embeddings=max_position_embeddings)
    r = 2 * theta.shape[0]  # channels that turn
    factor = rope_attention_factor(scaling, max_position_embeddings=max_position_embeddings)
    angles = pos[:, None] * theta  # (T, r/2), in float64: large m·θ keeps its digits
    dtype = compute_dtype(x)
    cos, sin = (factor * np.cos(angles)).astype(dtype), (factor * np.sin(angles)).astype(dtype)  # (T, r/2)
    x_c = x.astype(dtype, copy=False)
    out = x_c.copy()  # channels r .. d-1 (partial rotary) pass unchanged
    if interleaved:
        x1, x2 = x_c[..., 0:r:2], x_c[..., 1:r:2]  # (..., T, r/2): pairs (0,1), (2,3), ...
    else:
        x1, x2 = x_c[..., : r // 2], x_c[..., r // 2 : r]  # (..., T, r/2): pairs (i, i + r/2)
    r1 = x1 * cos - x2 * sin  # the 2-D rotation of each pair
    r2 = x1 * sin + x2 * cos
    if interleaved:
        out[..., 0:r:2], out[..., 1:r:2] = r1, r2
    else:
        out[..., : r // 2], out[..., r // 2 : r] = r1, r2
    return out.astype(x.dtype, copy=False)


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
