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

Read rope() first: the rotation on one screen, its fast path for interleaved pairs beside it, then
rope_backward (its gradient) and rope_frequencies (θ). Long context stretches θ: a config.json's
rope_scaling dict, checked field by field, and each method's formulas (linear, dynamic NTK, YaRN, Llama 3,
LongRoPE) live in _rope_scaling.py; rope_frequencies and rope_attention_factor are their entries. Then
rope_table and rope_with_table: the turns of positions 0 .. T-1 made once, for a model that turns the same
positions in every layer and step. Below them: the input checks, the two pair layouts and the learned table.
"""

from __future__ import annotations

import functools
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
from ._rope_scaling import attention_factor, check_finite_number, check_rope_scaling, rotary_dim, scaled_frequencies

Array = NDArray[np.floating]

__all__ = [
    "LearnedPositions",
    "half_split_permutation",
    "permute_qk_weight",
    "rope",
    "rope_attention_factor",
    "rope_backward",
    "rope_frequencies",
    "rope_table",
    "rope_with_table",
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

    positions: (T,) finite numbers, default 0 .. T-1 (negative ones rotate back). interleaved: pairs
    (2i, 2i+1), else (i, i + d/2). Apply to q and k, never to v. Norms are kept: a rotation does not stretch.

    Long context only: scaling, a config's rope_scaling dict, stretches θ and may bring a factor a; seq_len
    (default: the largest position + 1, as transformers takes it) and max_position_embeddings (the config's)
    are what it reads, as in rope_frequencies. With partial_rotary_factor only the first rotary_dim channels
    turn; the rest pass unchanged.

        >>> rope(np.array([[1.0, 0.0]]), positions=[np.pi / 2]).round(6)   # a quarter turn
        array([[0., 1.]])
    """
    x, positions, interleaved = check_rope(x, positions, interleaved)  # x (..., T, d), positions (T,) float64
    seq_len = rope_seq_len(positions, seq_len)  # what dynamic and longrope scaling read
    theta = rope_frequencies(
        x.shape[-1], base, scaling=scaling, seq_len=seq_len, max_position_embeddings=max_position_embeddings
    )
    a = rope_attention_factor(scaling, max_position_embeddings=max_position_embeddings)  # 1.0 without scaling
    r, out_dtype = 2 * theta.shape[0], x.dtype  # r: the channels that turn (d, or fewer with partial rotary)
    x = x.astype(compute_dtype(x), copy=False)  # float16 is computed in float32 and cast back
    if interleaved and x.strides[-1] == x.itemsize:  # each pair side by side in memory: the fast path below
        turns = _turns(positions[:, None] * theta, a, x.dtype)  # (T, r/2) a·e^{imθ_i}
        return _rotate_as_complex(x, turns, r).astype(out_dtype, copy=False)

    # 1) the angle of pair i at position m, in float64: m · θ_i for m in the thousands keeps its digits
    angles = positions[:, None] * theta  # (T, r/2)
    cos, sin = (a * np.cos(angles)).astype(x.dtype), (a * np.sin(angles)).astype(x.dtype)  # (T, r/2) each

    # 2) the two channels of every pair: (0, 1), (2, 3), ... interleaved, or (i, i + r/2) half-split
    first, second = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
    x1, x2 = x[..., first], x[..., second]  # (..., T, r/2) each

    # 3) rotate each pair; channels r .. d-1 (partial rotary) pass unchanged
    out = x.copy()  # (..., T, d), C-contiguous whatever the layout of x (a view of heads)
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x1 * sin + x2 * cos
    return out.astype(out_dtype, copy=False)


def _rotate_as_complex(x: Array, turns: NDArray[np.complexfloating], r: int) -> Array:
    """rope's rotation of interleaved pairs that lie side by side in memory, in one pass: x1 + i·x2 is a
    complex number, and turning it by mθ_i times a is its product with a·e^{imθ_i} = a (cos mθ_i + i sin mθ_i).
    x (..., T, d) in its compute dtype; turns (T, r/2), those products' a·e^{imθ_i} (_turns)."""
    out = np.empty(x.shape, x.dtype)  # (..., T, d), C-contiguous whatever the layout of x (a view of heads)
    if r < x.shape[-1]:
        out[..., r:] = x[..., r:]  # channels r .. d-1 (partial rotary) pass unchanged
    pairs = turns.dtype  # the complex dtype of x's: two numbers of x in each
    np.multiply(x[..., :r].view(pairs), turns, out=out[..., :r].view(pairs))  # (..., T, r/2)
    return out


def _turns(angles: NDArray[np.float64], a: float, dtype: Any) -> NDArray[np.complexfloating]:
    """a·e^{i·angle} for the angles mθ_i (T, r/2), in the complex dtype that holds two numbers of `dtype`."""
    return (a * np.exp(1j * angles)).astype(np.result_type(dtype, np.complex64))


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
    return rope(
        grad,
        positions=-forward,
        base=base,
        interleaved=interleaved,
        scaling=scaling,
        seq_len=seq_len,
        max_position_embeddings=max_position_embeddings,
    )


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
    check_rope_scaling; _rope_scaling.py has each method's formula. seq_len: the current sequence
    length (dynamic uses it; longrope picks long_factor past L0). max_position_embeddings: the config's;
    L0 where the dict has no original_max_position_embeddings, and always for dynamic.
    d is rotary_dim(dim, scaling): dim unless partial_rotary_factor says less. Shape (d/2,), float64.
    """
    base = check_finite_number(base, "base", low=1.0, allowed="> 1")
    params = check_rope_scaling(scaling, dim, base=base, max_position_embeddings=max_position_embeddings)
    d = rotary_dim(dim, scaling)
    if seq_len is not None:
        seq_len = check_positive_int(seq_len, "seq_len")
    theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    if params is None:
        return theta
    return scaled_frequencies(theta, params, base=base, seq_len=seq_len, given=scaling)  # (d/2,)


def rope_attention_factor(scaling: dict[str, Any] | None, *, max_position_embeddings: int | None = None) -> float:
    """The number that multiplies cos and sin (so every score by its square): 1.0 unless the method has one.

    yarn      attention_factor, else (0.1 · mscale · ln f + 1) / (0.1 · mscale_all_dim · ln f + 1)
              when the dict has both, else 0.1 · ln f + 1
    longrope  attention_factor, else sqrt(1 + ln f / ln L0)   (1 where f <= 1)
    """
    return attention_factor(check_rope_scaling(scaling, max_position_embeddings=max_position_embeddings))


@functools.lru_cache(maxsize=64)
def rope_table(n: int, dim: int, dtype: Any = np.float32, *, backward: bool = False) -> NDArray[np.complexfloating]:
    """The turns e^{imθ_i} (n, dim/2) of the positions m = 0 .. n-1 (backward: of -m, rope_backward's), θ of the
    default base without scaling, in the complex dtype of x's dtype: what rope() multiplies x's pairs by.

    Made once for each (n, dim, dtype, backward) and kept, read-only: a model turns the same T positions in every
    layer and every step (llama's precompute_freqs_cis). rope_with_table applies it.
    """
    positions = rope_positions(None, n)  # (n,) 0 .. n-1 in float64, as rope() takes them
    angles = (-positions if backward else positions)[:, None] * rope_frequencies(dim)  # (n, dim/2)
    table = _turns(angles, 1.0, dtype)
    table.flags.writeable = False
    return table


def rope_with_table(x: Array, table: NDArray[np.complexfloating]) -> Array:
    """rope(x) for x (..., T, d) at positions 0 .. T-1, interleaved pairs, with the turns of rope_table(T, d,
    x.dtype) (with backward=True: rope_backward(x)): the same numbers, θ and the angles not worked out again (to
    the bit, as rope turns pairs that lie side by side in memory; pairs apart are made so first).

        >>> x = np.arange(8.0).reshape(2, 4)
        >>> bool((rope_with_table(x, rope_table(2, 4, x.dtype)) == rope(x)).all())
        True
    """
    if x.shape[-2:] != (table.shape[0], 2 * table.shape[1]) or table.dtype != np.result_type(x.dtype, np.complex64):
        raise ValueError(
            f"x (..., T, d) must match the table's (T, d/2) {table.shape} and dtype {table.dtype} (rope_table(T, "
            f"d, x.dtype)); got x of shape {x.shape}, {x.dtype}"
        )
    if x.dtype == np.float16:  # computed in float32, as rope() computes it, and cast back
        return rope_with_table(x.astype(np.float32), table).astype(np.float16)
    if x.strides[-1] != x.itemsize:  # the pairs side by side in memory, as the complex view needs them
        x = np.ascontiguousarray(x)
    return _rotate_as_complex(x, table, x.shape[-1])


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
