"""RoPE for long context: a config.json's `rope_scaling` (or `rope_parameters`) dict, every field checked, and
what each method does to the frequencies θ_i. position.py's rope_frequencies and rope_attention_factor read it;
so does the config reader.

A config names a method and the fields that method needs:

    rope_type   what it needs                                    what it may have
    (any)                                                        partial_rotary_factor, rope_theta (= base)
    default     nothing
    linear      factor
    dynamic     factor, and L0 from the config
    yarn        factor, L0                                       attention_factor, beta_fast, beta_slow,
                                                                 mscale, mscale_all_dim, truncate
    llama3      factor, low_freq_factor, high_freq_factor,
                original_max_position_embeddings (L0)
    longrope    short_factor, long_factor (one per pair), L0     factor, attention_factor

L0, the trained context, is the dict's original_max_position_embeddings, else the config's
max_position_embeddings (dynamic: always the config's), as in Hugging Face transformers
(src/transformers/modeling_rope_utils.py).
check_rope_scaling reads every field once, in three steps: each field alone (its type and range), then L0
and the factor from the config where the dict leaves them out, then the fields against each other. Each
error names the field, its value and what is allowed. The result, RopeScaling, is what the formulas read:
no field there is read from the dict again.

Each method stretches the wavelengths 2π/θ_i so that positions past the trained length L0 land on angles
the model has seen (transformers' _compute_*_parameters functions):
  linear    θ_i / factor for every pair (position interpolation, Chen et al. 2023)
  dynamic   NTK-aware: base' = base · (factor · T / L0 - (factor - 1))^(d / (d - 2)) once the sequence
            length T passes L0; plain RoPE up to L0
  yarn      high frequencies kept, low ones divided by factor, a linear ramp between, and cos and sin
            multiplied by 0.1 · ln(factor) + 1 (Peng et al. 2023, "YaRN")
  llama3    wavelength < L0 / high_freq_factor kept, > L0 / low_freq_factor divided by factor, smooth
            in between (Llama 3.1)
  longrope  θ_i / ext_i with per-pair factors: short_factor up to L0, long_factor past it, and cos and
            sin times sqrt(1 + ln(factor) / ln(L0)) (Phi-3; Ding et al. 2024, "LongRoPE")
partial_rotary_factor p (where the dict has it) rotates only the first int(p · d) channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import check_bool, check_positive_int

__all__ = [
    "NO_FACTOR",
    "ROPE_TYPES",
    "RopeScaling",
    "attention_factor",
    "check_finite_number",
    "check_rope_scaling",
    "rope_type",
    "rotary_dim",
    "scaled_frequencies",
]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}
# the fields that are numbers > 0 wherever they appear (null, as in transformers, means "not given")
_POSITIVE_KEYS = (
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
)

NO_FACTOR = (
    "scaling with rope_type {kind!r} has no factor: give it in the dict, or max_position_embeddings= (the "
    "config's) so that factor = max_position_embeddings / original_max_position_embeddings"
)


@dataclass(frozen=True)
class RopeScaling:
    """A rope_scaling dict after check_rope_scaling: every field checked, the defaults filled in."""

    rope_type: str
    factor: float  # the stretch; 0.0 where there is none (default; longrope given no max_position_embeddings)
    original_length: int  # L0, the trained context; 0 for default and linear, which need none
    attention_factor: float | None  # the dict's; None: rope_attention_factor derives it from factor
    beta_fast: float  # yarn: pairs turning more often than this within L0 keep θ (default 32)
    beta_slow: float  # yarn: pairs turning less often than this get θ / factor (default 1)
    truncate: bool  # yarn: round the ramp's ends to whole pairs (default True)
    mscale: float | None  # yarn: counts only together with mscale_all_dim, as in transformers
    mscale_all_dim: float | None
    low_freq_factor: float  # llama3 (which requires both); 0.0 for the other methods
    high_freq_factor: float
    short_factor: NDArray[np.float64]  # longrope: (d/2,) each (which requires both); empty for the others
    long_factor: NDArray[np.float64]


def check_rope_scaling(
    scaling: dict[str, Any] | None,
    dim: int | None = None,
    *,
    base: float | None = None,
    max_position_embeddings: int | None = None,
) -> RopeScaling | None:
    """Every field of a rope_scaling dict checked, and what its method needs filled in (None for None).

    Each error names the field, its value and what is allowed. dim, the head size, lets the per-pair lists
    be checked against rotary_dim(dim) / 2; base (rope_theta) must match the dict's rope_theta where it
    has one (transformers 5's rope_parameters carries it); max_position_embeddings is the config's.
    Unknown keys are left alone (configs carry others, such as mrope_section).
    """
    if scaling is None:
        return None
    kind = rope_type(scaling)  # a dict that names a known method and has its keys
    given = {key: value for key, value in scaling.items() if value is not None}  # null means "not given"
    if max_position_embeddings is not None:
        max_position_embeddings = check_positive_int(max_position_embeddings, "max_position_embeddings")
    if base is not None and "rope_theta" in given and _positive_number(given, "rope_theta") != base:
        raise ValueError(
            f"scaling['rope_theta'] is {given['rope_theta']!r} but base is {base!r}: pass base=scaling['rope_theta'] "
            "(transformers 5's rope_parameters carry RoPE's base)"
        )
    pairs = None if dim is None else rotary_dim(dim, scaling) // 2  # checks partial_rotary_factor too
    # 1) each field alone
    number = {key: _positive_number(given, key) for key in _POSITIVE_KEYS if key in given}
    per_pair = {key: _per_pair(given, key, pairs) for key in ("short_factor", "long_factor") if key in given}
    key = "original_max_position_embeddings"
    in_dict = check_positive_int(given[key], f"scaling[{key!r}]") if key in given else None
    # 2) L0 and the factor, from the config where the dict leaves them out
    original, factor = _length_and_factor(kind, in_dict, number.get("factor"), max_position_embeddings)
    # 3) the fields against each other
    _check_relations(kind, number, original, factor, pairs)
    return RopeScaling(
        rope_type=kind,
        factor=factor or 0.0,
        original_length=original or 0,
        attention_factor=number.get("attention_factor"),
        beta_fast=number.get("beta_fast", 32.0),
        beta_slow=number.get("beta_slow", 1.0),
        truncate=check_bool(given.get("truncate", True), "scaling['truncate']"),
        mscale=number.get("mscale"),
        mscale_all_dim=number.get("mscale_all_dim"),
        low_freq_factor=number.get("low_freq_factor", 0.0),
        high_freq_factor=number.get("high_freq_factor", 0.0),
        short_factor=per_pair.get("short_factor", np.zeros(0)),
        long_factor=per_pair.get("long_factor", np.zeros(0)),
    )


def rope_type(scaling: Any) -> str:
    """The method a scaling dict names ("rope_type", or the older "type"), after checking that the dict has
    every key that method needs."""
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a config's rope_scaling dict or None; got {type(scaling).__name__}")
    kind = next((scaling[key] for key in ("rope_type", "type") if scaling.get(key) is not None), "default")
    if not isinstance(kind, str) or kind not in _REQUIRED_KEYS:
        raise ValueError(f"scaling has rope_type {kind!r}, which is unknown; known: {', '.join(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED_KEYS[kind] if scaling.get(key) is None]
    if missing:
        raise ValueError(
            f"scaling with rope_type {kind!r} is missing {', '.join(missing)}; "
            f"{kind} needs {', '.join(_REQUIRED_KEYS[kind])}"
        )
    return kind


def rotary_dim(dim: int, scaling: dict[str, Any] | None = None) -> int:
    """Channels RoPE turns: int(partial_rotary_factor · dim), all of them when the dict has no such key."""
    dim = check_positive_int(dim, "dim")
    share = 1.0
    if scaling is not None and rope_type(scaling) and scaling.get("partial_rotary_factor") is not None:
        share = _positive_number(scaling, "partial_rotary_factor", "in (0, 1]")
        if share > 1:
            raise ValueError(f"scaling['partial_rotary_factor'] must be a number in (0, 1]; got {share!r}")
    rotated = int(dim * share)
    if rotated % 2 or rotated == 0:
        raise ValueError(
            f"dim must be even (channels are rotated in pairs), and so must the rotated part; "
            f"got dim={dim}, partial_rotary_factor={share} -> {rotated} rotated channels"
        )
    return rotated


def _length_and_factor(
    kind: str, in_dict: int | None, factor: float | None, max_position_embeddings: int | None
) -> tuple[int | None, float | None]:
    """(L0, factor). L0: the dict's original_max_position_embeddings, else the config's max_position_embeddings;
    dynamic always takes the config's (transformers' _compute_dynamic_ntk_parameters reads only
    config.max_position_embeddings). factor: the dict's, else max_position_embeddings / L0 (yarn, longrope)."""
    original = max_position_embeddings if kind == "dynamic" or in_dict is None else in_dict
    if original is None and kind == "dynamic":
        raise ValueError(
            "scaling with rope_type 'dynamic' needs the trained length L0 from max_position_embeddings= (the "
            "config's), as transformers takes it (not from the dict's original_max_position_embeddings); got None"
        )
    if original is None and kind not in ("default", "linear"):
        raise ValueError(
            f"scaling with rope_type {kind!r} needs the trained length: original_max_position_embeddings in "
            f"the dict, or max_position_embeddings= (the config's); got neither"
        )
    if factor is None and max_position_embeddings is not None and original is not None:
        factor = max_position_embeddings / original  # transformers' fallback (huggingface/transformers#38224)
    if factor is None and kind == "yarn":
        raise ValueError(NO_FACTOR.format(kind=kind))
    return original, factor


def _check_relations(
    kind: str, number: dict[str, float], original: int | None, factor: float | None, pairs: int | None
) -> None:
    """What a field may be given the others: the checks no single field can make."""
    beta_fast, beta_slow = number.get("beta_fast", 32.0), number.get("beta_slow", 1.0)
    if beta_fast < beta_slow:  # the ramp would run backwards, dividing fast pairs and keeping slow ones
        raise ValueError(
            f"scaling['beta_fast'] must be >= beta_slow (defaults 32 and 1); got beta_fast={beta_fast}, "
            f"beta_slow={beta_slow}"
        )
    if kind == "llama3" and number["high_freq_factor"] <= number["low_freq_factor"]:
        raise ValueError(
            f"scaling needs high_freq_factor > low_freq_factor; got {number['high_freq_factor']} and "
            f"{number['low_freq_factor']}"
        )
    if kind == "dynamic" and pairs is not None and pairs <= 1:
        raise ValueError(f"dynamic scaling needs more than 2 rotated channels (d / (d - 2)); got {2 * pairs}")
    longrope_factor = kind == "longrope" and "attention_factor" not in number and factor is not None and factor > 1
    if longrope_factor and original == 1:  # sqrt(1 + ln(factor) / ln(L0)) would divide by ln 1 = 0
        raise ValueError(
            "scaling['original_max_position_embeddings'] must be >= 2 for longrope's attention factor "
            "sqrt(1 + ln(factor) / ln(L0)); got 1 (or give attention_factor)"
        )


def check_finite_number(value: Any, name: str, low: float = 0.0, allowed: str = "> 0") -> float:
    """value as a float: a real number (not a bool or a str), finite and > low; `allowed` says so in the message."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number {allowed}; got {value!r} ({type(value).__name__})")
    if not (_as_float(value) < math.inf and value > low):
        raise ValueError(f"{name} must be a finite number {allowed}; got {value!r}")
    return float(value)


def _positive_number(scaling: dict[str, Any], key: str, allowed: str = "> 0") -> float:
    """scaling[key] as a float: a real number (not a bool or a str), finite and > 0."""
    return check_finite_number(scaling[key], f"scaling[{key!r}]", 0.0, allowed)


def _per_pair(scaling: dict[str, Any], key: str, pairs: int | None) -> NDArray[np.float64]:
    """scaling[key] as (pairs,) float64: a list of finite numbers > 0, one per rotated pair."""
    value = scaling[key]
    entries = list(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if entries is None or not all(
        isinstance(e, (int, float, np.floating, np.integer)) and not isinstance(e, (bool, np.bool_)) for e in entries
    ):
        raise TypeError(f"scaling[{key!r}] must be a list of numbers, one per rotated pair; got {value!r}")
    if pairs is not None and len(entries) != pairs:
        raise ValueError(f"scaling[{key!r}] must be {pairs} positive numbers (one per pair); got {len(entries)}")
    for index, entry in enumerate(entries):
        if not (_as_float(entry) < math.inf and entry > 0):
            raise ValueError(f"scaling[{key!r}] must hold finite numbers > 0; got {entry!r} at index {index}")
    return np.array(entries, dtype=np.float64)


def _as_float(number: Any) -> float:
    """float(number), with an int too large for a float (10**400) as inf instead of an OverflowError."""
    try:
        return float(number)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------------------------------
# what each method does: θ from plain θ (d/2,), and the factor on cos and sin


def scaled_frequencies(
    theta: NDArray[np.float64], params: RopeScaling, *, base: float, seq_len: int | None, given: Any
) -> NDArray[np.float64]:
    """θ (d/2,) of plain RoPE stretched by the method params names (checked by check_rope_scaling); seq_len
    None or > 0. given, the dict as the caller passed it, is named if the factors overflow float64."""
    with np.errstate(over="ignore"):  # an overflow is refused just below, with the fields that caused it
        theta = _SCALED_FREQUENCIES[params.rope_type](theta, params, base, seq_len)  # (d/2,)
    bad = np.flatnonzero(~np.isfinite(theta))
    if bad.size:  # a factor such as 1e-320 divides θ past float64's largest
        raise ValueError(
            f"scaling with rope_type {params.rope_type!r} gives frequency θ_{bad[0]} = {theta[bad[0]]}: "
            f"its factors are too extreme for float64; got {given!r}"
        )
    return theta


def attention_factor(params: RopeScaling | None) -> float:
    """The number that multiplies cos and sin (so every score by its square): 1.0 unless the method has one.

    yarn      attention_factor, else (0.1 · mscale · ln f + 1) / (0.1 · mscale_all_dim · ln f + 1)
              when the dict has both, else 0.1 · ln f + 1
    longrope  attention_factor, else sqrt(1 + ln f / ln L0)   (1 where f <= 1)
    """
    if params is None or params.rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.attention_factor is not None:
        return params.attention_factor
    factor = params.factor
    if factor == 0.0:  # longrope with no factor in the dict and no max_position_embeddings to derive one
        raise ValueError(NO_FACTOR.format(kind=params.rope_type))
    if params.rope_type == "yarn":
        if params.mscale is not None and params.mscale_all_dim is not None:
            return _yarn_mscale(factor, params.mscale) / _yarn_mscale(factor, params.mscale_all_dim)
        return _yarn_mscale(factor)
    if factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params.original_length))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    """Pairs whose wavelength fits more than high_freq_factor times in L0 keep θ, fewer than low_freq_factor
    times get θ / factor, and between them a mix by how many times it fits."""
    factor, low, high = params.factor, params.low_freq_factor, params.high_freq_factor
    wavelength = 2 * np.pi / theta  # (d/2,) positions per full turn
    smooth = np.clip((params.original_length / wavelength - low) / (high - low), 0.0, 1.0)  # 0: divide, 1: keep
    return (1 - smooth) * theta / factor + smooth * theta


def _longrope(theta: NDArray[np.float64], params: RopeScaling, base: float, seq_len: int | None) -> NDArray[np.float64]:
    """Each pair divided by its own factor: short_factor up to L0, long_factor past it."""
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
