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

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import as_float_array, check_positive_int, compute_dtype

Array = NDArray[np.floating]


def rope_frequencies(dim: int, base: float = 10000.0) -> NDArray[np.float64]:
    """θ_i = base^(-2i / dim) for i = 0 .. dim/2 - 1: pair 0 turns one radian a position, the last
    pair barely turns over thousands of positions. Shape (dim/2,), float64."""
    dim = check_positive_int(dim, "dim")
    if dim % 2:
        raise ValueError(f"dim must be even (channels are rotated in pairs); got {dim}")
    if not (isinstance(base, (int, float, np.floating, np.integer)) and base > 1):
        raise ValueError(f"base must be a number > 1; got {base!r}")
    return float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def _positions(positions: Any, n: int) -> NDArray[np.float64]:
    if positions is None:
        return np.arange(n, dtype=np.float64)
    positions = np.asarray(positions)
    if positions.ndim != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must be 1-D with one entry per row of x ({n}); got shape {positions.shape}")
    if not (np.issubdtype(positions.dtype, np.integer) or np.issubdtype(positions.dtype, np.floating)):
        raise TypeError(f"positions must be ints or floats; got dtype {positions.dtype}")
    return positions.astype(np.float64)


def rope(x: Array, *, positions: Any = None, base: float = 10000.0, interleaved: bool = True) -> Array:
    """Rotate channel pairs of x (..., T, d) by position · θ_i. positions: (T,), default 0 .. T-1.

    Norms are preserved (a rotation does not stretch). Apply to q and k, never to v.
    """
    x = as_float_array(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims (..., T, d); got shape {x.shape}")
    T, d = x.shape[-2], x.shape[-1]
    theta = rope_frequencies(d, base)  # (d/2,)
    angles = _positions(positions, T)[:, None] * theta  # (T, d/2), in float64: large m·θ keeps its digits
    dtype = compute_dtype(x)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)  # (T, d/2)
    x_c = x.astype(dtype, copy=False)
    if interleaved:
        x1, x2 = x_c[..., 0::2], x_c[..., 1::2]  # (..., T, d/2): pairs (0,1), (2,3), ...
    else:
        x1, x2 = x_c[..., : d // 2], x_c[..., d // 2 :]  # (..., T, d/2): pairs (i, i + d/2)
    out = np.empty_like(x_c)
    r1 = x1 * cos - x2 * sin  # the 2-D rotation of each pair
    r2 = x1 * sin + x2 * cos
    if interleaved:
        out[..., 0::2], out[..., 1::2] = r1, r2
    else:
        out[..., : d // 2], out[..., d // 2 :] = r1, r2
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
    return x[..., half_split_permutation(x.shape[-1])]


def to_interleaved(x: Array) -> Array:
    """Permute the last axis from the half-split pair layout to the interleaved one."""
    x = as_float_array(x, "x")
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
    """

    def __init__(
        self, max_positions: int, dim: int, *, rng: np.random.Generator | None = None, dtype: Any = np.float32
    ):
        self.max_positions = check_positive_int(max_positions, "max_positions")
        self.dim = check_positive_int(dim, "dim")
        rng = np.random.default_rng(0) if rng is None else rng
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
