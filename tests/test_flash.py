import itertools

import numpy as np
import pytest
from conftest import assert_close, bottom_right, gold_attention

from tinyattn_np import attention, draw_tile_plan, flash_attention, merge_states, tile_plan
from tinyattn_np.measure import traced_peak

SHAPES = [  # (n_q, n_k, block_q, block_k): dividing blocks, ragged blocks, L != S both ways, L = 1
    (64, 64, 16, 16),
    (64, 64, 128, 256),
    (37, 53, 8, 16),
    (53, 37, 16, 8),
    (100, 30, 7, 9),
    (1, 50, 1, 7),
    (1, 1, 4, 4),
    (129, 257, 64, 64),
]


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_flash_equals_reference_and_gold(rng, n_q, n_k, block_q, block_k, causal, dtype):
    q = rng.standard_normal((2, 4, n_q, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, n_k, 16)).astype(dtype)  # GQA: 2 query heads per kv head
    v = rng.standard_normal((2, 2, n_k, 12)).astype(dtype)
    out, lse = flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k, return_lse=True)
    assert out.shape == (2, 4, n_q, 12) and out.dtype == dtype
    assert lse.shape == (2, 4, n_q) and lse.dtype == dtype
    assert_close(out, attention(q, k, v, causal=causal), dtype, "flash vs attention")
    gold_out, gold_lse = gold_attention(q, k, v, bottom_right(n_q, n_k) if causal else None)
    assert_close(out, gold_out, dtype, "flash vs gold")
    # lse against scipy.special.logsumexp of the scaled, masked scores (-inf where a row sees nothing)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(gold_lse))
    finite = np.isfinite(gold_lse)
    assert_close(lse[finite], gold_lse[finite], dtype, "lse")


def test_rows_that_see_no_key(rng):
    q = rng.standard_normal((1, 9, 4))
    k, v = rng.standard_normal((1, 4, 4)), rng.standard_normal((1, 4, 2))
    with np.errstate(all="raise"):
        out, lse = flash_attention(q, k, v, causal=True, block_q=2, block_k=3, return_lse=True)
    np.testing.assert_array_equal(out[0, :5], 0.0)  # queries 0..4 of 9 over 4 keys: nothing visible
    np.testing.assert_array_equal(lse[0, :5], -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[0, 5:]).all()


def test_scale_float16_and_two_d(rng):
    q, k, v = (rng.standard_normal((33, 8)).astype(np.float16) for _ in range(3))
    out = flash_attention(q, k, v, causal=True, scale=0.2, block_q=5, block_k=6)
    assert out.shape == (33, 8) and out.dtype == np.float16
    gold, _ = gold_attention(q[None], k[None], v[None], bottom_right(33, 33), scale=0.2)
    assert_close(out, gold[0], np.float16, "float16 2-D")


def test_same_bits_for_any_number_of_workers(rng):
    q = rng.standard_normal((1, 4, 300, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 300, 32)).astype(np.float32) for _ in range(2))
    one = flash_attention(q, k, v, causal=True, block_q=32, block_k=64, workers=1, return_lse=True)
    for workers in (2, 3, 8):
        many = flash_attention(q, k, v, causal=True, block_q=32, block_k=64, workers=workers, return_lse=True)
        np.testing.assert_array_equal(one[0], many[0])
        np.testing.assert_array_equal(one[1], many[1])


def test_merge_of_two_key_halves_is_the_whole(rng):
    q, k, v = (rng.standard_normal((2, 20, 8)) for _ in range(3))
    half_a = flash_attention(q, k[:, :9], v[:, :9], return_lse=True)
    half_b = flash_attention(q, k[:, 9:], v[:, 9:], return_lse=True)
    out, lse = merge_states(*half_a, *half_b)
    whole = flash_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, whole[0], atol=1e-14)
    np.testing.assert_allclose(lse, whole[1], atol=1e-14)


# --- tile_plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", SHAPES + [(0, 5, 2, 2), (5, 0, 2, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_plan_covers_every_visible_entry_once(n_q, n_k, block_q, block_k, causal):
    visible = bottom_right(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
    covered = np.zeros((n_q, n_k), int)
    for t in tile_plan(n_q, n_k, block_q, block_k, causal=causal):
        covered[t.q_start : t.q_stop, t.k_start : t.k_stop] += 1
        inside = visible[t.q_start : t.q_stop, t.k_start : t.k_stop]
        assert inside.any(), f"{t} lies wholly in the masked region"
        assert t.kind == ("full" if inside.all() else "diagonal"), t
    assert (covered[visible] == 1).all()
    assert (covered <= 1).all()


def test_causal_plan_skips_about_half():
    # 8 x 8 blocks: 28 below the diagonal run full, 8 on it need a mask, 28 above are skipped
    tiles = tile_plan(1024, 1024, 128, 128, causal=True)
    kinds = [t.kind for t in tiles]
    assert kinds.count("full") == 28 and kinds.count("diagonal") == 8
    assert len(tile_plan(1024, 1024, 128, 128)) == 64


def test_draw_tile_plan():
    tiles = tile_plan(4, 4, 2, 2, causal=True)
    assert draw_tile_plan(tiles, 4, 4, 2, 2) == "\\ .\n# \\"


# --- memory ----------------------------------------------------------------------------------


def test_flash_never_holds_the_score_matrix(rng):
    n, e = 16384, 64
    q, k, v = (rng.standard_normal((1, n, e), dtype=np.float32) for _ in range(3))
    score_matrix = n * n * 4  # 1 GiB in float32
    out, peak = traced_peak(flash_attention, q, k, v)
    assert out.shape == (1, n, e)
    assert peak < 64 * 2**20, f"traced peak {peak / 2**20:.1f} MiB, score matrix {score_matrix / 2**30:.0f} GiB"


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["block_q", "block_k", "workers"])
@pytest.mark.parametrize("value,error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_block_sizes_and_workers(rng, name, value, error):
    q = rng.standard_normal((1, 4, 4))
    with pytest.raises(error, match=name):
        flash_attention(q, q, q, **{name: value})


def test_tile_plan_bad_input():
    with pytest.raises(ValueError, match="block_k"):
        tile_plan(4, 4, 2, 0)
    with pytest.raises(ValueError, match="n_q"):
        tile_plan(-1, 4, 2, 2)


@pytest.mark.parametrize("fn", [attention, flash_attention])
def test_shape_errors_name_the_argument(rng, fn):
    q = rng.standard_normal((2, 4, 5, 8))
    k = rng.standard_normal((2, 2, 7, 8))
    v = rng.standard_normal((2, 2, 7, 3))
    cases = [
        ((q[0, 0, 0], k, v), ValueError, "q must have at least 2 dims"),
        ((q, k[0], v), ValueError, "same number of dims"),
        ((q[:1], k, v), ValueError, "same batch dims"),
        ((q, k[..., :4], v), ValueError, "same last dim E"),
        ((q, k, v[..., :6, :]), ValueError, "same heads and keys"),
        ((q[:, :3], k, v), ValueError, "multiple of the kv heads"),
        ((q.astype(np.int64), k, v), TypeError, "q must be float16, float32 or float64; got dtype int64"),
        ((q, k.astype(np.complex128), v), TypeError, "k must be"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            fn(*args)
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v, scale="big")


def test_mask_errors(rng):
    q = rng.standard_normal((2, 5, 8))
    with pytest.raises(ValueError, match=r"mask must broadcast.*\(2, 5, 5\).*\(5, 4\)"):
        attention(q, q, q, mask=np.ones((5, 4), bool))
    with pytest.raises(ValueError, match="mask must broadcast"):
        attention(q, q, q, mask=np.ones((3, 2, 5, 5), bool))  # would enlarge the output: refused
    with pytest.raises(TypeError, match="mask must be bool"):
        attention(q, q, q, mask=np.ones((5, 5), np.int32))


def test_all_combinations_of_small_sizes(rng):
    # every L, S in 1..6 with every block size in 1..4: the edges of the tile arithmetic
    for n_q, n_k, bq, bk in itertools.product(range(1, 7), range(1, 7), range(1, 5), range(1, 5)):
        q, k, v = (rng.standard_normal((1, n, 3)) for n in (n_q, n_k, n_k))
        got = flash_attention(q, k, v, causal=True, block_q=bq, block_k=bk, workers=1)
        assert_close(got, attention(q, k, v, causal=True), np.float64, f"L={n_q} S={n_k} bq={bq} bk={bk}")
