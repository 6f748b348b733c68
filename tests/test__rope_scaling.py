"""RoPE for long context: each method's documented properties, Llama-3.1-8B's real rope_scaling, and clear
errors for unknown methods and missing keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyattn_np import rope, rope_attention_factor, rope_frequencies
from tinyattn_np._rope_scaling import ROPE_TYPES, check_rope_scaling, rotary_dim

# huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json: rope_theta 500000, head_dim 128
LLAMA_31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
THETA_31 = 500000.0
RNG = np.random.default_rng(7)


def test_no_scaling_is_plain_rope():
    theta = rope_frequencies(8, 100.0)
    np.testing.assert_allclose(theta, [1.0, 100**-0.25, 100**-0.5, 100**-0.75])
    np.testing.assert_array_equal(rope_frequencies(64, scaling={"rope_type": "default"}), rope_frequencies(64))
    assert rope_attention_factor(None) == 1.0


def test_llama3_keeps_high_frequencies_and_divides_low_ones():
    plain = rope_frequencies(128, THETA_31)
    scaled = rope_frequencies(128, THETA_31, scaling=LLAMA_31)
    wavelength = 2 * np.pi / plain  # (64,) positions per turn
    high = wavelength < 8192 / 4.0  # turns more than 4 times in the trained 8,192 tokens: kept
    low = wavelength > 8192 / 1.0  # turns less than once: divided by 8
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-15)
    assert high.sum() == 29 and low.sum() == 29  # Llama-3.1-8B: 29 pairs kept, 29 divided, 6 between
    middle = ~high & ~low
    ratio = scaled[middle] / plain[middle]
    assert np.all((ratio > 1 / 8) & (ratio < 1)) and np.all(np.diff(ratio) < 0)  # a smooth, falling blend
    # one middle pair by hand: s = (8192 / wavelength - 1) / (4 - 1), θ' = (1 - s) θ / 8 + s θ
    i = np.flatnonzero(middle)[0]
    s = (8192 / wavelength[i] - 1) / 3
    assert scaled[i] == pytest.approx((1 - s) * plain[i] / 8 + s * plain[i], rel=1e-14)
    assert scaled[0] == 1.0 and scaled[-1] == pytest.approx(THETA_31 ** (-126 / 128) / 8, rel=1e-14)
    assert rope_attention_factor(LLAMA_31) == 1.0


def test_linear_divides_every_frequency():
    scaling = {"type": "linear", "factor": 4.0}  # the older key name, "type"
    np.testing.assert_allclose(rope_frequencies(64, scaling=scaling), rope_frequencies(64) / 4, rtol=1e-15)
    # so position 4p with linear scaling turns exactly as far as position p without it
    x = RNG.standard_normal((5, 64))
    np.testing.assert_allclose(
        rope(x, positions=4 * np.arange(5), scaling=scaling), rope(x, positions=np.arange(5)), atol=1e-12
    )


def test_dynamic_is_plain_up_to_the_original_length_and_stretches_past_it():
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    plain = rope_frequencies(64)
    for seq_len in (None, 1, 4096):
        scaled = rope_frequencies(64, scaling=scaling, seq_len=seq_len, max_position_embeddings=4096)
        np.testing.assert_allclose(scaled, plain, rtol=1e-15)
    longer = rope_frequencies(64, scaling=scaling, seq_len=8192, max_position_embeddings=4096)
    base = 10000 * (2 * 8192 / 4096 - 1) ** (64 / 62)  # NTK: base' = base (f T / L0 - (f - 1))^(d / (d - 2))
    np.testing.assert_allclose(longer, base ** (-np.arange(0, 64, 2) / 64), rtol=1e-13)
    assert longer[0] == 1.0 and np.all(longer[1:] < plain[1:])
    # rope() takes seq_len from the largest position: 0 .. 4095 is plain RoPE, 0 .. 8191 is not
    x = RNG.standard_normal((2, 64))
    short = rope(x, positions=[0, 4095], scaling=scaling, max_position_embeddings=4096)
    np.testing.assert_allclose(short, rope(x, positions=[0, 4095]), atol=1e-12)
    long = rope(x, positions=[0, 8191], scaling=scaling, max_position_embeddings=4096)
    assert not np.allclose(long[1], rope(x, positions=[0, 8191])[1])


def test_yarn_attention_factor_and_ramp():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert rope_attention_factor(scaling) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_attention_factor({**scaling, "attention_factor": 0.5}) == 0.5
    mscale = {**scaling, "mscale": 0.707, "mscale_all_dim": 0.707}  # DeepSeek's pair: the two cancel
    assert rope_attention_factor(mscale) == 1.0
    plain = rope_frequencies(128, 1e6)
    scaled = rope_frequencies(128, 1e6, scaling=scaling)
    ratio = plain / scaled  # (64,): 1 where kept, 4 where interpolated
    turns = 32768 * plain / (2 * np.pi)  # how often each pair turns within the trained length
    assert np.all(ratio[turns > 32] == 1)  # beta_fast = 32: fast pairs untouched
    np.testing.assert_allclose(ratio[turns < 1], 4.0, rtol=1e-14)  # beta_slow = 1: slow pairs divided
    assert np.all(np.diff(ratio) >= -1e-12)  # a ramp between
    # cos and sin carry the factor: every rotated vector is that much longer
    x = RNG.standard_normal((3, 128))
    lengths = np.linalg.norm(rope(x, scaling=scaling), axis=-1) / np.linalg.norm(x, axis=-1)
    np.testing.assert_allclose(lengths, 0.1 * math.log(4.0) + 1, rtol=1e-12)
    # a given factor wins over max_position_embeddings / L0 (Qwen3: factor 4 from 32,768, max 40,960)
    assert rope_attention_factor(scaling, max_position_embeddings=40960) == pytest.approx(0.1 * math.log(4) + 1)
    no_truncate = rope_frequencies(128, 1e6, scaling={**scaling, "truncate": False})
    assert not np.array_equal(no_truncate, scaled)
    step = rope_frequencies(128, 1e6, scaling={**scaling, "beta_fast": 8, "beta_slow": 8, "truncate": False})
    assert set(np.round(plain / step, 9)) == {1.0, 4.0}  # a zero-width ramp is a step


def test_yarn_without_original_length_takes_it_from_the_argument():
    scaling = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="original_max_position_embeddings in the dict, or max_position_embeddings="):
        rope_frequencies(64, scaling=scaling)
    np.testing.assert_array_equal(
        rope_frequencies(64, scaling=scaling, max_position_embeddings=4096),
        rope_frequencies(64, scaling={**scaling, "original_max_position_embeddings": 4096}),
    )


def test_longrope_short_and_long_factors():
    d = 8
    scaling = {"rope_type": "longrope", "short_factor": [1, 1, 2, 2], "long_factor": [1, 2, 4, 8]}
    plain = rope_frequencies(d)
    kwargs = dict(scaling=scaling, max_position_embeddings=131072)
    original = {**scaling, "original_max_position_embeddings": 4096}
    np.testing.assert_allclose(rope_frequencies(d, **{**kwargs, "scaling": original}), plain / [1, 1, 2, 2])
    long = rope_frequencies(d, seq_len=5000, **{**kwargs, "scaling": original})
    np.testing.assert_allclose(long, plain / [1, 2, 4, 8])
    # Phi-3: factor = 131072 / 4096 = 32, attention factor sqrt(1 + ln 32 / ln 4096)
    expected = math.sqrt(1 + math.log(32) / math.log(4096))
    assert rope_attention_factor(original, max_position_embeddings=131072) == pytest.approx(expected)
    assert rope_attention_factor({**scaling, "factor": 1.0}, max_position_embeddings=4096) == 1.0
    with pytest.raises(ValueError, match=r"scaling\['short_factor'\] must be 2 positive numbers"):
        rope_frequencies(4, **kwargs)
    with pytest.raises(ValueError, match="'longrope' has no factor: give it in the dict, or max_position_embeddings="):
        rope_attention_factor(original)


def test_partial_rotary_factor_turns_only_the_first_channels():
    scaling = {"rope_type": "default", "partial_rotary_factor": 0.5}
    assert rotary_dim(64, scaling) == 32
    theta = rope_frequencies(64, scaling=scaling)
    np.testing.assert_allclose(theta, 10000.0 ** (-np.arange(0, 32, 2) / 32))  # d is the rotated part
    x = RNG.standard_normal((4, 64))
    for interleaved in (True, False):
        out = rope(x, scaling=scaling, interleaved=interleaved)
        np.testing.assert_array_equal(out[:, 32:], x[:, 32:])
        np.testing.assert_allclose(out[:, :32], rope(x[:, :32], interleaved=interleaved), atol=1e-15)


@pytest.mark.parametrize(
    ("scaling", "error", "message"),
    [
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, ValueError, "unknown; known: " + ", ".join(ROPE_TYPES)),
        ({"rope_type": "llama3", "factor": 8.0}, ValueError, "missing low_freq_factor, high_freq_factor"),
        ({"type": "linear"}, ValueError, "'linear' is missing factor; linear needs factor"),
        ({"rope_type": "longrope"}, ValueError, "missing short_factor, long_factor"),
        ({"rope_type": "linear", "factor": "2"}, TypeError, r"scaling\['factor'\] must be a number"),
        ({"rope_type": "linear", "factor": -2.0}, ValueError, r"scaling\['factor'\] must be a finite number > 0"),
        ({**LLAMA_31, "high_freq_factor": 0.5}, ValueError, "high_freq_factor > low_freq_factor"),
        ({"rope_type": "default", "partial_rotary_factor": 1.5}, ValueError, "partial_rotary_factor"),
        ([("rope_type", "linear")], TypeError, "scaling must be a config's rope_scaling dict or None; got list"),
    ],
)
def test_bad_scaling_names_what_is_wrong(scaling, error, message):
    with pytest.raises(error, match=message):
        rope_frequencies(64, scaling=scaling)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="base must be a finite number > 1; got inf"):
        rope_frequencies(64, float("inf"))
    with pytest.raises(TypeError, match="base must be a number > 1"):
        rope_frequencies(64, "10000")
    with pytest.raises(ValueError, match="seq_len must be a positive int; got 0"):
        rope_frequencies(64, scaling={"rope_type": "dynamic", "factor": 2.0}, seq_len=0, max_position_embeddings=8)
    with pytest.raises(ValueError, match="dynamic scaling needs more than 2 rotated channels"):
        rope_frequencies(2, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="dim must be even"):
        rope_frequencies(7)


def test_dynamic_takes_its_trained_length_from_max_position_embeddings_as_transformers_does():
    """transformers' _compute_dynamic_ntk_parameters (modeling_rope_utils.py) reads L0 from
    config.max_position_embeddings only; taking the dict's original_max_position_embeddings instead would
    move the last θ by 80% at seq_len 32,768 for a dict with 4,096 and a config with 16,384."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    with_key = {**scaling, "original_max_position_embeddings": 4096}
    theta = rope_frequencies(64, scaling=with_key, seq_len=32768, max_position_embeddings=16384)
    base = 10000 * (2 * 32768 / 16384 - 1) ** (64 / 62)  # base' with L0 = 16,384
    np.testing.assert_allclose(theta, base ** (-np.arange(0, 64, 2) / 64), rtol=1e-13)
    plain_key = rope_frequencies(64, scaling=scaling, seq_len=32768, max_position_embeddings=16384)
    np.testing.assert_array_equal(theta, plain_key)
    x = RNG.standard_normal((2, 64))
    np.testing.assert_array_equal(
        rope(x, positions=[0, 32767], scaling=with_key, max_position_embeddings=16384),
        rope(x, positions=[0, 32767], scaling=scaling, max_position_embeddings=16384),
    )
    with pytest.raises(ValueError, match="'dynamic' needs the trained length L0 from max_position_embeddings="):
        rope_frequencies(64, scaling=with_key, seq_len=32768)  # the dict's key is not a way round it


def test_dynamic_with_a_huge_factor_stays_finite():
    """base' = base · ratio^(d/(d-2)) overflows float64 (an OverflowError) for factor 1e300; θ'_i =
    θ_i · ratio^(-2i/(d-2)) is the same number without the overflow, and tends to 0 past pair 0."""
    scaling = {"rope_type": "dynamic", "factor": 1e300}
    theta = rope_frequencies(64, scaling=scaling, seq_len=10**6, max_position_embeddings=4096)
    assert np.all(np.isfinite(theta)) and theta[0] == 1.0 and np.all(np.diff(theta) <= 0)
    huge = rope_frequencies(64, scaling={**scaling, "factor": 1e308}, seq_len=10**9, max_position_embeddings=4096)
    assert huge[0] == 1.0 and np.all(huge[1:] == 0)  # factor · T / L0 past float64: every other pair stops turning


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}


@pytest.mark.parametrize(
    ("scaling", "error", "message"),
    [
        # yarn: each field a finite number > 0 (0 is not the default, a negative mscale no attention factor)
        (
            {**YARN, "mscale": -1.0, "mscale_all_dim": 1.0},
            ValueError,
            r"scaling\['mscale'\] must be a finite number > 0; got -1.0",
        ),
        (
            {**YARN, "mscale": 1.0, "mscale_all_dim": "1"},
            TypeError,
            r"scaling\['mscale_all_dim'\] must be a number > 0; got '1' \(str\)",
        ),
        ({**YARN, "beta_fast": 0}, ValueError, r"scaling\['beta_fast'\] must be a finite number > 0; got 0"),
        (
            {**YARN, "beta_fast": float("nan")},
            ValueError,
            r"scaling\['beta_fast'\] must be a finite number > 0; got nan",
        ),
        (
            {**YARN, "beta_slow": float("inf")},
            ValueError,
            r"scaling\['beta_slow'\] must be a finite number > 0; got inf",
        ),
        ({**YARN, "beta_slow": -1}, ValueError, r"scaling\['beta_slow'\] must be a finite number > 0; got -1"),
        ({**YARN, "beta_fast": "32"}, TypeError, r"scaling\['beta_fast'\] must be a number > 0; got '32' \(str\)"),
        (
            {**YARN, "beta_fast": 1, "beta_slow": 32},
            ValueError,
            r"scaling\['beta_fast'\] must be >= beta_slow .*got beta_fast=1.0, beta_slow=32.0",
        ),
        ({**YARN, "truncate": "false"}, TypeError, r"scaling\['truncate'\] must be True or False; got 'false' \(str\)"),
        (
            {**YARN, "attention_factor": 0},
            ValueError,
            r"scaling\['attention_factor'\] must be a finite number > 0; got 0",
        ),
        ({**YARN, "factor": True}, TypeError, r"scaling\['factor'\] must be a number > 0; got True \(bool\)"),
        (
            {**YARN, "original_max_position_embeddings": 4096.5},
            TypeError,
            r"scaling\['original_max_position_embeddings'\] must be a positive int; got 4096.5",
        ),
        (
            {**YARN, "original_max_position_embeddings": 0},
            ValueError,
            r"scaling\['original_max_position_embeddings'\] must be a positive int; got 0",
        ),
        # llama3
        (
            {**LLAMA_31, "low_freq_factor": 0},
            ValueError,
            r"scaling\['low_freq_factor'\] must be a finite number > 0; got 0",
        ),
        (
            {**LLAMA_31, "high_freq_factor": "4"},
            TypeError,
            r"scaling\['high_freq_factor'\] must be a number > 0; got '4'",
        ),
        # longrope: lists of finite numbers > 0, one per rotated pair, both of them (not only the one in use)
        (
            {**LONGROPE, "long_factor": [2.0] * 31},
            ValueError,
            r"scaling\['long_factor'\] must be 32 positive numbers \(one per pair\); got 31",
        ),
        (
            {**LONGROPE, "short_factor": ["1"] * 32},
            TypeError,
            r"scaling\['short_factor'\] must be a list of numbers, one per rotated pair",
        ),
        ({**LONGROPE, "short_factor": 2.0}, TypeError, r"scaling\['short_factor'\] must be a list of numbers"),
        (
            {**LONGROPE, "long_factor": [2.0] * 31 + [-1.0]},
            ValueError,
            r"scaling\['long_factor'\] must hold finite numbers > 0; got -1.0 at index 31",
        ),
        (
            {**LONGROPE, "original_max_position_embeddings": 1},
            ValueError,
            r"scaling\['original_max_position_embeddings'\] must be >= 2 for longrope",
        ),
        # any method
        (
            {"rope_type": ["linear"], "factor": 2.0},
            ValueError,
            r"rope_type \['linear'\], which is unknown; known: default",
        ),
        (
            {"rope_type": "default", "partial_rotary_factor": "0.5"},
            TypeError,
            r"scaling\['partial_rotary_factor'\] must be a number in \(0, 1\]; got '0.5'",
        ),
        (
            {"rope_type": "default", "partial_rotary_factor": 0.0},
            ValueError,
            r"scaling\['partial_rotary_factor'\] must be a finite number in \(0, 1\]; got 0.0",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            ValueError,
            r"scaling\['rope_theta'\] is 1000000.0 but base is 10000.0",
        ),
        (
            {"rope_type": "linear", "factor": 5e-324},
            ValueError,
            r"'linear' gives frequency θ_0 = inf: its factors are too extreme for float64",
        ),
    ],
)
def test_every_scaling_field_is_checked_and_named(scaling, error, message):
    """Unchecked, each would pass silently, or end in "math domain error", NaN-to-int, an OverflowError or a
    ZeroDivisionError; checked, each is an error naming the field, its value and what is allowed."""
    with pytest.raises(error, match=message):
        rope(np.ones((2, 64)), scaling=scaling, max_position_embeddings=131072)


def test_a_bad_max_position_embeddings_is_refused_even_where_unused():
    with pytest.raises(ValueError, match="max_position_embeddings must be a positive int; got 0"):
        rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=0)
    with pytest.raises(TypeError, match="max_position_embeddings must be a positive int; got 4096.0"):
        rope_attention_factor(YARN, max_position_embeddings=4096.0)


def test_the_checked_dict_has_every_field_its_method_reads():
    """check_rope_scaling fills in what the dict leaves out: yarn's defaults and L0 from the config, longrope's
    factor as max_position_embeddings / L0, as transformers does."""
    assert check_rope_scaling(None) is None
    yarn = check_rope_scaling({"rope_type": "yarn", "factor": 4.0}, 64, max_position_embeddings=4096)
    assert (yarn.rope_type, yarn.factor, yarn.original_length) == ("yarn", 4.0, 4096)
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate, yarn.attention_factor) == (32.0, 1.0, True, None)
    longrope = check_rope_scaling(
        {**LONGROPE, "original_max_position_embeddings": 4096}, 64, max_position_embeddings=131072
    )
    assert longrope.factor == 32.0 and longrope.original_length == 4096
    np.testing.assert_array_equal(longrope.long_factor, np.full(32, 2.0))
    linear = check_rope_scaling({"type": "linear", "factor": 2.0, "mrope_section": [1, 2]})  # unknown keys: left alone
    assert (linear.rope_type, linear.factor, linear.original_length, linear.short_factor.size) == ("linear", 2.0, 0, 0)
