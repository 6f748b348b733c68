import numpy as np
import pytest

from tinyattn_np import (
    LearnedPositions,
    half_split_permutation,
    permute_qk_weight,
    rope,
    rope_backward,
    rope_frequencies,
    to_half_split,
    to_interleaved,
)
from tinyattn_np.position import rope_table, rope_with_table


def rope_by_complex(x, positions, base=10000.0):
    """Oracle for the interleaved layout: pairs (2i, 2i+1) as complex numbers times e^{i m θ}."""
    d = x.shape[-1]
    theta = base ** (-np.arange(0, d, 2) / d)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * np.outer(positions, theta))
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def rotate_half_rope(x, positions, base=10000.0):
    """Oracle for the half-split layout, written the way Hugging Face writes it (rotate_half)."""
    d = x.shape[-1]
    theta = base ** (-np.arange(0, d, 2) / d)
    angles = np.outer(positions, theta)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def test_frequencies():
    theta = rope_frequencies(8)
    np.testing.assert_allclose(theta, [1.0, 10000**-0.25, 10000**-0.5, 10000**-0.75])
    with pytest.raises(ValueError, match="even"):
        rope_frequencies(7)
    with pytest.raises(ValueError, match="base"):
        rope_frequencies(8, base=1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_layouts_match_their_oracles(rng, dtype):
    x = rng.standard_normal((2, 3, 10, 16)).astype(dtype)
    pos = np.arange(10)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(rope(x), rope_by_complex(x.astype(np.float64), pos), atol=tol)
    np.testing.assert_allclose(rope(x, interleaved=False), rotate_half_rope(x.astype(np.float64), pos), atol=tol)
    assert rope(x).dtype == dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pairs_turn_alike_in_any_memory_layout(rng, dtype):
    """Interleaved pairs side by side in memory turn as complex numbers, one product; pairs with channels
    apart in memory turn by the two lines. Both match the oracle, and a view of heads (tokens strided, as
    MultiHeadAttention makes them) gives the bits of its contiguous copy."""
    heads = rng.standard_normal((2, 10, 3, 16)).astype(dtype).swapaxes(1, 2)  # (2, 3, 10, 16)
    strided = np.repeat(heads, 2, axis=-1)[..., ::2]  # the same numbers, each channel 2 apart in memory
    assert strided.strides[-1] == 2 * strided.itemsize and np.array_equal(strided, heads)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    for x in (heads, strided):
        np.testing.assert_allclose(rope(x), rope_by_complex(x.astype(np.float64), np.arange(10)), atol=tol)
    np.testing.assert_array_equal(rope(heads), rope(np.ascontiguousarray(heads)))


def test_positions_keyword(rng):
    x = rng.standard_normal((4, 8))
    pos = np.array([5, 100, 7, 3000])
    np.testing.assert_allclose(rope(x, positions=pos), rope_by_complex(x, pos), atol=1e-12)
    with pytest.raises(ValueError, match="positions must be 1-D with one entry per row"):
        rope(x, positions=np.arange(3))
    with pytest.raises(TypeError, match="positions"):
        rope(x, positions=np.array(["a", "b", "c", "d"]))


def test_norms_are_preserved(rng):
    x = rng.standard_normal((50, 64))
    for interleaved in (True, False):
        np.testing.assert_allclose(
            np.linalg.norm(rope(x, interleaved=interleaved), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13
        )


def test_score_depends_only_on_distance(rng):
    q, k = rng.standard_normal(64), rng.standard_normal(64)

    def score(m, n):
        return float((rope(q[None], positions=[m]) @ rope(k[None], positions=[n]).T)[0, 0])

    seven = [score(10, 3), score(110, 103), score(507, 500)]
    np.testing.assert_allclose(seven, seven[0], rtol=1e-10)
    assert not np.isclose(score(10, 9), seven[0])


def test_layout_conversion(rng):
    x = rng.standard_normal((3, 7, 16))
    perm = half_split_permutation(16)
    assert perm.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    np.testing.assert_array_equal(to_interleaved(to_half_split(x)), x)
    # the same rotation: rotate interleaved then permute == permute then rotate half-split
    np.testing.assert_allclose(to_half_split(rope(x)), rope(to_half_split(x), interleaved=False), atol=1e-14)


def test_permuted_weights_give_the_same_scores(rng):
    d_model, n_heads, d_head, T = 32, 4, 8, 6
    x = rng.standard_normal((T, d_model))
    wq, wk = rng.standard_normal((d_model, n_heads * d_head)), rng.standard_normal((d_model, n_heads * d_head))

    def scores(wq, wk, interleaved):
        q = (x @ wq).reshape(T, n_heads, d_head).swapaxes(0, 1)  # (H, T, d_head)
        k = (x @ wk).reshape(T, n_heads, d_head).swapaxes(0, 1)
        return rope(q, interleaved=interleaved) @ rope(k, interleaved=interleaved).swapaxes(-1, -2)

    meta = scores(wq, wk, True)
    hf = scores(permute_qk_weight(wq, n_heads), permute_qk_weight(wk, n_heads), False)
    np.testing.assert_allclose(hf, meta, atol=1e-12)
    back = permute_qk_weight(permute_qk_weight(wq, n_heads), n_heads, to="interleaved")
    np.testing.assert_array_equal(back, wq)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        permute_qk_weight(wq[:, :30], n_heads)
    with pytest.raises(ValueError, match="to must be"):
        permute_qk_weight(wq, n_heads, to="sideways")


def test_rope_bad_input(rng):
    with pytest.raises(ValueError, match="even"):
        rope(rng.standard_normal((4, 7)))
    with pytest.raises(ValueError, match="at least 2 dims"):
        rope(rng.standard_normal(8))
    with pytest.raises(TypeError, match="int64"):
        rope(np.ones((4, 8), np.int64))


def test_learned_positions_refuse_past_the_table(rng):
    table = LearnedPositions(16, 8, rng=rng)
    assert table(np.arange(16)).shape == (16, 8)
    np.testing.assert_array_equal(table([3]), table.table[[3]])
    with pytest.raises(ValueError, match=r"\[0, 16\).*position 16"):
        table(np.arange(17))
    with pytest.raises(ValueError, match="position -1"):
        table([-1])
    with pytest.raises(TypeError, match="ints"):
        table([1.5])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_positions_must_be_finite(rng, bad):
    """A NaN position turned its whole row into NaN without a word (and with scaling ended in "cannot
    convert float NaN to integer"); an infinite one gave NaN with a RuntimeWarning."""
    x = rng.standard_normal((3, 8))
    for scaling in (None, {"rope_type": "dynamic", "factor": 2.0}):
        with pytest.raises(ValueError, match=f"positions must be finite numbers; got {bad} at index 2"):
            rope(x, positions=[0.0, 1.0, bad], scaling=scaling, max_position_embeddings=8)
    with pytest.raises(ValueError, match="positions must be a 1-D array of numbers; could not make one"):
        rope(x, positions=[[0], [1, 2], 3])
    np.testing.assert_allclose(rope(x, positions=[-2, 0, 2.5]), rope_by_complex(x, [-2, 0, 2.5]), atol=1e-12)


# --- arguments checked at the door ----------------------------------------------------------------


def test_rope_refuses_bad_base_and_flags():
    x = np.ones((3, 4))
    for base in (float("inf"), float("nan"), 0.0, -2.0, 1.0):
        with pytest.raises(ValueError, match="base must be a finite number > 1"):
            rope(x, base=base)
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        rope(x, interleaved="False")


def test_layout_helpers_need_an_axis():
    for convert in (to_half_split, to_interleaved):
        with pytest.raises(ValueError, match=r"x must have at least 1 dim \(\.\.\., d\), d even; got shape \(\)"):
            convert(1.0)


def test_learned_positions_refuse_int_tables():
    with pytest.raises(TypeError, match="dtype must be float16, float32 or float64; got int32"):
        LearnedPositions(8, 4, dtype=np.int32)
    assert LearnedPositions(8, 4, dtype=np.float16).table.dtype == np.float16


def test_learned_positions_take_a_seed_or_draw_fresh():
    np.testing.assert_array_equal(LearnedPositions(8, 4, rng=3).table, LearnedPositions(8, 4, rng=3).table)
    assert not np.array_equal(LearnedPositions(8, 4).table, LearnedPositions(8, 4).table)
    with pytest.raises(ValueError, match="rng as a seed must be an int >= 0; got -1"):
        LearnedPositions(8, 4, rng=-1)
    with pytest.raises(TypeError, match="rng must be a np.random.Generator, an int seed or None"):
        LearnedPositions(8, 4, rng="3")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_table_made_once_turns_as_rope_does_to_the_bit(rng, dtype):
    """rope_with_table with rope_table(T, d, dtype) is rope(x), and with backward=True rope_backward(x), bit for
    bit, in x's own dtype, on heads that are views of a wider array; pairs apart in memory are turned as rope
    turns them side by side (its other path rounds otherwise, within a few ulps)."""
    x = rng.standard_normal((2, 7, 3, 8)).astype(dtype).swapaxes(1, 2)  # (2, 3, 7, 8): a view of heads
    table, back = rope_table(7, 8, dtype), rope_table(7, 8, dtype, backward=True)  # (7, 4) each
    for mine, gold in ((rope_with_table(x, table), rope(x)), (rope_with_table(x, back), rope_backward(x))):
        assert mine.dtype == dtype
        np.testing.assert_array_equal(mine, gold)
    apart = np.asfortranarray(x)  # each pair's two numbers apart in memory
    np.testing.assert_array_equal(rope_with_table(apart, table), rope(np.ascontiguousarray(apart)))
    tolerance = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype]
    np.testing.assert_allclose(rope_with_table(apart, table), rope(apart), rtol=tolerance, atol=tolerance)


def test_the_table_is_kept_read_only_and_must_fit():
    table = rope_table(5, 8, np.float32)
    assert rope_table(5, 8, np.float32) is table and not table.flags.writeable  # made once, shared
    assert table.shape == (5, 4) and table.dtype == np.complex64
    assert rope_table(5, 8, np.float64).dtype == np.complex128
    with pytest.raises(ValueError, match="must match the table's"):
        rope_with_table(np.zeros((6, 8), np.float32), table)  # another T
    with pytest.raises(ValueError, match="must match the table's"):
        rope_with_table(np.zeros((5, 8)), table)  # float64 turned by a float32 table
