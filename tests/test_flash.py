import inspect
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, bottom_right, gold_attention
from threadpoolctl import threadpool_info

from tinyattn_np import (
    attention,
    draw_tile_plan,
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_one_head,
    flash_attention_one_head,
    flash_decode,
    merge_states,
    tile_plan,
    window_mask,
)
from tinyattn_np._checks import QKVShape
from tinyattn_np._flash_kernel import hide_past_diagonal
from tinyattn_np._tiles import PARTIAL
from tinyattn_np._tuning import SCORES_PER_WORKER, call_workers, default_tiles, diagonal_side, tile_rule, workers_for
from tinyattn_np.blockmask import Tile
from tinyattn_np.measure import traced_peak
from tinyattn_np.mods import causal_band

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
    out, lse = flash_attention(q, k, v, causal=True, scale=0.2, block_q=5, block_k=6, return_lse=True)
    assert out.shape == (33, 8) and out.dtype == np.float16
    assert lse.shape == (33,) and lse.dtype == np.float32  # computed in float32, and kept: see the next test
    gold, gold_lse = gold_attention(q[None], k[None], v[None], bottom_right(33, 33), scale=0.2)
    assert_close(out, gold[0], np.float16, "float16 2-D")
    assert_close(lse, gold_lse[0], np.float32, "float16 lse")


def test_float16_lse_past_float16_range():
    # scores of 1e5 (float16 tops out at 65504): out is v, lse is 1e5 + log(2), which float16 cannot hold
    q = np.full((1, 2, 1), 100.0, np.float16)
    k = np.full((1, 2, 1), 1000.0, np.float16)
    v = np.ones((1, 2, 3), np.float16)
    out, lse = flash_attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_array_equal(out, 1.0)
    assert lse.dtype == np.float32
    np.testing.assert_allclose(lse, 1e5 + np.log(2), rtol=1e-6)


@pytest.mark.parametrize(
    "shift,falls_back",
    [(0.0, False), (95.0, True), (-70.0, True), (30.0, False)],  # float32: exp overflows past 88.7; e^-70 · S < √tiny
)
def test_sums_against_zero_fall_back_to_the_running_max_where_exp_cannot_hold_them(rng, monkeypatch, shift, falls_back):
    """The fast path sums exp(s) against 0 (_flash_kernel.attend_block); scores too large for exp, or all far below 0,
    send a block to the running max (attend_tiles with running_max=True). Either way the result is the
    reference's."""
    import tinyattn_np._flash_kernel as flash_module

    q = rng.standard_normal((2, 40, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 50, 8)).astype(np.float32) for _ in range(2))
    q[1, :, 0], k[1, :, 0] = 0.0, shift  # key channel 0 holds the shift, which only queries 16..31 read:
    q[1, 16:32] = 0.0
    q[1, 16:32, 0] = 1.0  # their every score is `shift`
    tiles, used = flash_module.attend_tiles, []

    def counted(*args, running_max):
        used.extend([1] * running_max)
        return tiles(*args, running_max=running_max)

    monkeypatch.setattr(flash_module, "attend_tiles", counted)
    out, lse = flash_attention(q, k, v, causal=True, scale=1.0, block_q=16, block_k=16, return_lse=True)
    gold, gold_lse = gold_attention(q, k, v, bottom_right(40, 50), scale=1.0)
    assert_close(out, gold, np.float32, f"shift {shift}")
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-6, atol=1e-6)
    assert bool(used) == falls_back  # only the block with those rows, and only when exp cannot hold them
    assert len(used) <= 1


def test_same_bits_for_any_number_of_workers(rng):
    q = rng.standard_normal((1, 4, 300, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 300, 32)).astype(np.float32) for _ in range(2))
    one = flash_attention(q, k, v, causal=True, block_q=32, block_k=64, workers=1, return_lse=True)
    for workers in (2, 3, 8):
        many = flash_attention(q, k, v, causal=True, block_q=32, block_k=64, workers=workers, return_lse=True)
        np.testing.assert_array_equal(one[0], many[0])
        np.testing.assert_array_equal(one[1], many[1])


def test_same_bits_for_any_heads_per_step(rng):
    # GQA, batch 2: 4 kv heads of 3 query heads each, stepped 1, 2, 3 (a ragged last step) and 4 at a time
    q = rng.standard_normal((2, 6, 40, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 50, 8)).astype(np.float32) for _ in range(2))
    gold = attention(q, k, v, causal=True)
    for heads in (1, 2, 3, 4):
        out = flash_attention(q, k, v, causal=True, block_q=16, block_k=16, kv_heads_per_step=heads)
        assert_close(out, gold, np.float32, f"kv_heads_per_step={heads}")


def test_overlapping_calls_keep_the_blas_limit_and_the_bits(rng):
    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    q, k, v = (rng.standard_normal((4, 500, 32)).astype(np.float32) for _ in range(3))
    serial = flash_attention(q, k, v, causal=True, block_q=64, block_k=64)
    results: list[np.ndarray] = [None] * 6  # type: ignore[list-item]
    started = threading.Barrier(6)

    def call(i: int) -> None:
        started.wait()  # all six at once: each enters while the others run
        results[i] = flash_attention(q, k, v, causal=True, block_q=64, block_k=64, workers=1 + i % 3)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        np.testing.assert_array_equal(result, serial)
    assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == before


def test_nested_calls_restore_the_limit(rng):
    from tinyattn_np._parallel import one_blas_thread

    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    with one_blas_thread():
        with one_blas_thread():
            pass
        assert all(p["num_threads"] == 1 for p in threadpool_info() if p["user_api"] == "blas")
    assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == before


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
        assert t.kind == ("full" if inside.all() else "partial"), t
    assert (covered[visible] == 1).all()
    assert (covered <= 1).all()


@pytest.mark.parametrize("keys_down", [True, False])
def test_causal_tiles_hidden_by_slices_are_the_mask_mods_entries(keys_down):
    """hide_past_diagonal writes -inf exactly where causal_band(offset) hides a key, and leaves every other
    entry's bits, NaN and inf included, for tiles on and off the diagonal, taller and wider than a strip,
    and (keys down) with one or three query heads of a kv head side by side."""
    rng = np.random.default_rng(0)
    for n_q, n_k, q_start, k_start, offset, group in itertools.product(
        (1, 31, 64, 70), (1, 33, 64), (0, 5, 64), (0, 7), (-40, 0, 3, 90), (1, 3)
    ):
        tile = Tile(q_start, q_start + n_q, k_start, k_start + n_k, PARTIAL)
        s = rng.standard_normal((2, n_k, group, n_q) if keys_down else (2 * group, n_q, n_k)).astype(np.float32)
        s.flat[::7], s.flat[3::11] = np.nan, np.inf  # inputs a mask must not let through, nor leave out
        hidden = tile_hidden(causal_band(offset), q_start, n_q, k_start, n_k)  # (n_q, n_k)
        want = np.where(hidden.T[None, :, None, :] if keys_down else hidden[None], -np.inf, s)
        hide_past_diagonal(s, tile, offset, keys_down=keys_down)
        np.testing.assert_array_equal(s, want)


def tile_hidden(mask_mod, q_start, n_q, k_start, n_k):
    """(n_q, n_k) True where mask_mod hides key k_start + j from query q_start + i."""
    q_idx, kv_idx = np.arange(q_start, q_start + n_q)[:, None], np.arange(k_start, k_start + n_k)[None, :]
    return ~mask_mod(0, 0, q_idx, kv_idx)


def test_causal_plan_skips_about_half():
    # 8 x 8 blocks: 28 below the diagonal run full, 8 on it need a mask, 28 above are skipped
    tiles = tile_plan(1024, 1024, 128, 128, causal=True)
    kinds = [t.kind for t in tiles]
    assert kinds.count("full") == 28 and kinds.count("partial") == 8
    assert len(tile_plan(1024, 1024, 128, 128)) == 64


def test_draw_tile_plan():
    tiles = tile_plan(4, 4, 2, 2, causal=True)
    assert draw_tile_plan(tiles, 4, 4, 2, 2) == "\\ .\n# \\"
    assert draw_tile_plan(tiles) == "\\ .\n# \\"  # the plan carries its sizes


def test_draw_tile_plan_refuses_sizes_that_are_not_the_plans():
    tiles = tile_plan(4, 4, 2, 2, causal=True)
    with pytest.raises(ValueError, match="block_q=1 does not match the plan, which has block_q=2"):
        draw_tile_plan(tiles, 4, 4, 1, 2)
    with pytest.raises(ValueError, match="n_k=8"):
        draw_tile_plan(tiles, 4, 8, 2, 2)
    with pytest.raises(TypeError, match="tile_plan"):
        draw_tile_plan(list(tiles), 4, 4, 2, 2)


def test_draw_window_band():
    # 8 x 8 tokens in 2 x 2 tiles, a window of 3: the band is two tiles wide, the rest skipped
    drawing = draw_tile_plan(tile_plan(8, 8, 2, 2, causal=True, window=3))
    assert drawing == "\\ . . .\n\\ \\ . .\n. \\ \\ .\n. . \\ \\"


# --- sliding windows -------------------------------------------------------------------------

WINDOW_SHAPES = [  # (n_q, n_k, block_q, block_k, window)
    (64, 64, 16, 16, 1),
    (64, 64, 16, 16, 17),
    (37, 53, 8, 16, 5),
    (53, 37, 16, 8, 9),
    (1, 50, 1, 7, 10),
    (129, 257, 64, 32, 100),
    (20, 20, 4, 4, 10**6),
]


@pytest.mark.parametrize("n_q,n_k,block_q,block_k,window", WINDOW_SHAPES)
def test_window_equals_reference_with_a_band_mask(rng, n_q, n_k, block_q, block_k, window):
    q = rng.standard_normal((2, 4, n_q, 8))
    k, v = (rng.standard_normal((2, 2, n_k, 8)) for _ in range(2))
    band = window_mask(n_q, n_k, window=window)
    out, lse = flash_attention(q, k, v, causal=True, window=window, block_q=block_q, block_k=block_k, return_lse=True)
    gold_out, gold_lse = gold_attention(q, k, v, band)
    assert_close(out, gold_out, np.float64, "flash window vs gold")
    assert_close(out, attention(q, k, v, mask=band), np.float64, "flash window vs attention(mask=band)")
    assert_close(attention(q, k, v, causal=True, window=window), gold_out, np.float64, "attention(window=)")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(gold_lse))
    assert_close(lse[np.isfinite(gold_lse)], gold_lse[np.isfinite(gold_lse)], np.float64, "lse")


def test_window_is_mistral_and_flash_attn_window_size():
    # with L = S, query i sees keys i - window < j <= i; flash-attn's window_size=(w, 0) is window = w + 1
    band = window_mask(6, window=3)
    for i in range(6):
        assert band[i].nonzero()[0].tolist() == [j for j in range(6) if i - 3 < j <= i]
    left = 2  # flash-attn: keys i - left ... i
    assert (band == window_mask(6, window=left + 1)).all()


@pytest.mark.parametrize("n_q,n_k,block_q,block_k,window", WINDOW_SHAPES + [(5, 0, 2, 2, 3), (0, 5, 2, 2, 3)])
def test_window_plan_covers_the_band_once(n_q, n_k, block_q, block_k, window):
    band = window_mask(n_q, n_k, window=window)
    covered = np.zeros((n_q, n_k), int)
    for t in tile_plan(n_q, n_k, block_q, block_k, causal=True, window=window):
        covered[t.q_start : t.q_stop, t.k_start : t.k_stop] += 1
        inside = band[t.q_start : t.q_stop, t.k_start : t.k_stop]
        assert inside.any(), f"{t} lies wholly outside the band"
        assert t.kind == ("full" if inside.all() else "partial"), t
    assert (covered[band] == 1).all() and (covered <= 1).all()


def test_window_tiles_grow_as_t_times_window():
    # doubling T with a fixed window doubles the tiles (T·window), where plain causal quadruples them
    windowed = [len(tile_plan(n, n, 64, 64, causal=True, window=256)) for n in (4096, 8192)]
    causal = [len(tile_plan(n, n, 64, 64, causal=True)) for n in (4096, 8192)]
    assert windowed[1] < 2.1 * windowed[0] and causal[1] > 3.9 * causal[0]


def test_window_needs_causal_and_a_positive_int(rng):
    q = rng.standard_normal((1, 4, 4))
    with pytest.raises(ValueError, match="window=3 needs causal=True"):
        flash_attention(q, q, q, window=3)
    with pytest.raises(ValueError, match="needs causal=True"):
        tile_plan(4, 4, 2, 2, window=3)
    with pytest.raises(ValueError, match="window=2 needs causal=True"):
        attention(q, q, q, window=2)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, causal=True, window=-1)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, q, q, causal=True, window=0)
    with pytest.raises(TypeError, match="window"):
        flash_attention(q, q, q, causal=True, window=2.0)
    huge = flash_attention(q, q, q, causal=True, window=2**63)  # a window past every key is plain causal
    np.testing.assert_array_equal(huge, flash_attention(q, q, q, causal=True))


# --- defaults ----------------------------------------------------------------------------------


def test_default_tiles_rule():
    assert default_tiles(8192, 8192, 1, cores=2) == (256, 256, 4)  # 2^18 scores: 4 heads of 256 x 256
    assert default_tiles(8192, 8192, 4, cores=2) == (256, 256, 1)  # one kv head brings 4 query heads
    assert default_tiles(8192, 8192, 1, cores=16) == (512, 512, 2)  # 2^19 scores: 2 heads of 512 x 512
    assert default_tiles(1, 1, 1, cores=2) == (256, 256, 2**18)  # tiny problems: many heads per step
    assert default_tiles(1, 4096, 8, cores=2) == (256, 256, 128)  # decoding: 8 query heads x 256 keys each
    assert default_tiles(100, 100, 1, block_q=10, block_k=10, cores=2) == (10, 10, 2**18 // 100)
    # the call's kv heads: one query block of 48 heads (2^17.6 scores, one worker: workers_for) in one step;
    # at T = 128 (2^19.6 scores) steps of 16, for two workers (three on 16 cores); many query blocks, as before
    assert default_tiles(64, 64, 1, kv_heads=48, cores=2) == (256, 256, 48)
    assert default_tiles(64, 64, 1, kv_heads=48, cores=16) == (512, 512, 48)
    assert default_tiles(128, 128, 1, kv_heads=48, cores=2) == (256, 256, 16)
    assert default_tiles(128, 128, 1, kv_heads=48, cores=16) == (512, 512, 16)
    assert default_tiles(8192, 8192, 1, kv_heads=4, cores=2) == (256, 256, 4)
    assert default_tiles(300, 300, 1, kv_heads=1, cores=2) == (256, 256, 1)


def test_a_short_causal_context_gets_tiles_whose_diagonal_wastes_at_most_a_quarter():
    # halving b down to 64 while 4·min(b, L) > 2·diagonal + L: the diagonal's tiles waste min(b, L) / (2·diagonal + L)
    assert default_tiles(256, 256, 1, cores=2, diagonal=0)[:2] == (64, 64)
    assert default_tiles(512, 512, 1, cores=2, diagonal=0)[:2] == (128, 128)
    assert default_tiles(1024, 1024, 1, cores=2, diagonal=0)[:2] == (256, 256)
    assert default_tiles(1024, 1024, 1, cores=16, diagonal=0)[:2] == (256, 256)  # 512 on 16 cores, halved once
    assert default_tiles(64, 64, 1, cores=2, diagonal=0)[:2] == (64, 64)  # never below 64
    assert default_tiles(256, 256, 1, cores=2)[:2] == (256, 256)  # no diagonal: no waste to cut
    assert default_tiles(1, 32768, 8, cores=2, diagonal=32767)[:2] == (256, 256)  # a decode step sees every key
    assert default_tiles(1, 300, 8, cores=2, diagonal=299)[:2] == (256, 256)  # however short its context
    assert default_tiles(16, 1000, 1, cores=2, diagonal=984)[:2] == (256, 256)  # a triangle of 16²/2 wasted
    assert default_tiles(128, 128, 1, cores=2, diagonal=0)[:2] == (64, 64)  # one tile of 128 wastes half
    assert default_tiles(256, 256, 1, cores=2, diagonal=0, block_q=32, block_k=32)[:2] == (32, 32)  # given: kept
    assert diagonal_side(32, 256, 0) == 32 and diagonal_side(256, 256, None) == 256
    for T, tiles in [(300, 64), (700, 128), (1200, 256)]:
        share = tiles / T  # the diagonal's waste
        assert diagonal_side(256, T, 0) == tiles and share <= 0.25 and (tiles == 256 or 2 * share > 0.25)


def test_the_short_causal_tiles_are_what_the_calls_run():
    q, k, v, dout = (np.random.default_rng(seed).standard_normal((2, 3, 256, 16)) for seed in range(4))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    out_64, lse_64 = flash_attention(q, k, v, causal=True, return_lse=True, block_q=64, block_k=64)
    np.testing.assert_array_equal(out, out_64)
    np.testing.assert_array_equal(lse, lse_64)
    grads = flash_attention_backward(q, k, v, out, dout, lse, causal=True)
    grads_64 = flash_attention_backward(q, k, v, out, dout, lse, causal=True, block_q=64, block_k=64)
    for grad, grad_64 in zip(grads, grads_64, strict=True):
        np.testing.assert_array_equal(grad, grad_64)
    assert not np.array_equal(out, flash_attention(q, k, v, causal=True, block_q=256, block_k=256))  # they differ


def test_many_tiny_heads_are_batched(rng):
    # 20,000 heads of one query and one key: a handful of tile steps, not 20,000 of them
    q, k, v = (rng.standard_normal((20000, 1, 1, 4)) for _ in range(3))
    calls = []
    import tinyattn_np._flash_kernel as flash_module

    real = flash_module.attend_block
    flash_module.attend_block = lambda *a: calls.append(1) or real(*a)
    try:
        out = flash_attention(q, k, v, causal=True)
    finally:
        flash_module.attend_block = real
    assert len(calls) == 1  # one step: 20,000 scores get one worker (workers_for)
    np.testing.assert_allclose(out, v)  # one key: the weight is 1


def test_a_call_gets_a_worker_for_each_2_18_scores_at_most():
    """call_workers: the workers asked for, else the rule's, at most one per SCORES_PER_WORKER scores."""
    rule = tile_rule().workers
    dims = lambda batch, heads, t: QKVShape((batch,), heads, heads, t, t, 64, 64)  # noqa: E731
    assert call_workers(dims(12, 4, 64), 7) == 7  # given: kept
    assert call_workers(dims(12, 4, 64)) == 1  # 2^17.6 scores
    assert call_workers(dims(12, 4, 128)) == min(rule, 3)  # 2^19.6
    assert call_workers(dims(1, 4, 8192)) == rule  # 2^28
    assert workers_for(SCORES_PER_WORKER - 1) == 1 and workers_for(0) == 1
    assert workers_for(2 * SCORES_PER_WORKER, cores=16) == 2 and workers_for(2**30, cores=16) == 16


# --- flags and empty shapes ----------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("value", ["False", 0, 1, None])
def test_flags_must_be_bools(rng, flag, value):
    q = rng.standard_normal((1, 4, 4))
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        flash_attention(q, q, q, **{flag: value})
    with pytest.raises(TypeError, match="causal must be True or False"):
        tile_plan(4, 4, 2, 2, causal="False")
    flash_attention(q, q, q, causal=np.bool_(True), return_lse=np.bool_(False))  # NumPy bools are bools


@pytest.mark.parametrize(
    "q_shape,kv_shape,ev",
    [
        ((0, 4, 5, 8), (0, 2, 6, 8), 3),  # empty batch
        ((2, 0, 5, 8), (2, 1, 6, 8), 3),  # zero query heads
        ((2, 4, 5, 8), (2, 2, 6, 8), 0),  # Ev = 0
        ((1, 2, 0, 8), (1, 2, 6, 8), 3),  # no queries
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_but_valid_shapes(rng, q_shape, kv_shape, ev, causal):
    q, k = rng.standard_normal(q_shape), rng.standard_normal(kv_shape)
    v = rng.standard_normal((*kv_shape[:-1], ev))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (*q_shape[:-1], ev) and lse.shape == q_shape[:-1]
    np.testing.assert_array_equal(out, attention(q, k, v, causal=causal))
    _, gold_lse = gold_attention(q, k, v, bottom_right(q_shape[-2], kv_shape[-2]) if causal else None)
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-12)


# --- memory ----------------------------------------------------------------------------------


def test_flash_never_holds_the_score_matrix(rng):
    n, e = 16384, 64
    q, k, v = (rng.standard_normal((1, n, e), dtype=np.float32) for _ in range(3))
    score_matrix = n * n * 4  # 1 GiB in float32
    out, peak = traced_peak(flash_attention, q, k, v)
    assert out.shape == (1, n, e)
    assert peak < 64 * 2**20, f"traced peak {peak / 2**20:.1f} MiB, score matrix {score_matrix / 2**30:.0f} GiB"


def test_one_by_one_tiles_stay_linear_in_memory(rng):
    # the tiles are made per query block as it runs: 1 x 1 tiles hold no list of T² tiles
    peaks = []
    for n in (128, 256):
        x = rng.standard_normal((1, n, 4))
        out, peak = traced_peak(flash_attention, x, x, x, causal=True, block_q=1, block_k=1)
        np.testing.assert_allclose(out, attention(x, x, x, causal=True), atol=1e-12)
        peaks.append(peak)
    score_matrix = 256 * 256 * 8
    assert peaks[1] < score_matrix / 2, f"{peaks[1]} B traced, the score matrix is {score_matrix} B"
    assert peaks[1] < 3 * peaks[0], f"peaks {peaks}: more than linear in T"


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["block_q", "block_k", "workers", "kv_heads_per_step"])
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


def test_an_interrupt_at_any_bytecode_of_the_blas_limit_leaves_no_lock_held_and_the_limit_restored():
    """one_blas_thread's enter and exit under a KeyboardInterrupt at each of their bytecodes in turn: the
    lock is never left held (the next flash_attention never waits), and the state is one of the two whole
    ones: no calls inside and no limit, or calls inside and the limit that the last one out restores. (An
    interrupt between the enter and the body, or in the exit's first bytecodes, can leave one call counted
    or the limit unrestored: BLAS then stays on one thread for this process, a slower run, never a hang.)"""
    from pathlib import Path

    from test_kvcache import _interrupted_at

    from tinyattn_np import _parallel

    code = (str(Path(_parallel.__file__)), str(Path(_parallel.__file__).with_name("_atomic.py")))

    def call() -> None:
        with _parallel.one_blas_thread():
            pass

    for n in itertools.count(1):
        came = _interrupted_at(n, call, code)
        assert _parallel._blas_lock.acquire(timeout=5), f"the lock was left held at bytecode {n}"
        _parallel._blas_lock.release()
        users, limiter = _parallel._blas_state
        assert (users == 0) == (limiter is None), f"bytecode {n}: {_parallel._blas_state}"
        if users:  # one call left counted: let it out, as the sweep's next call must start from none
            _parallel._leave_blas()
        if not came:
            break
    assert n > 10  # the sweep reached the whole of both


@pytest.mark.parametrize("fn", [flash_attention, flash_decode])
def test_a_ragged_list_names_q(fn):
    with pytest.raises(ValueError, match="q must be an array of numbers with one shape"):
        fn([[1.0, 2.0], [3.0]], np.ones((2, 2)), np.ones((2, 2)))


# --- Ctrl-C stops a multi-worker call promptly ----------------------------------------------------


ROOT = Path(__file__).resolve().parents[1]


INTERRUPTED = """
import sys, time
import numpy as np
from tinyattn_np import flash_attention, flash_attention_backward, flash_decode
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((8, 8192, 64)).astype(np.float32) for _ in range(3))
which = sys.argv[1]
if which == "backward":
    out, lse = flash_attention(q[:, :2048], k[:, :2048], v[:, :2048], causal=True, return_lse=True, workers=2)
print("started", flush=True)
try:
    while True:  # until Ctrl-C
        if which == "forward":
            flash_attention(q, k, v, workers=2)
        elif which == "backward":
            flash_attention_backward(q[:, :2048], k[:, :2048], v[:, :2048], out, q[:, :2048], lse, causal=True,
                                     workers=2)
        else:
            flash_decode(q[:, :4], k, v, workers=2, kv_splits=8)
except KeyboardInterrupt:
    print("stopped", time.perf_counter(), flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("which", ["forward", "backward", "decode"])
def test_ctrl_c_stops_a_multi_worker_call_promptly(which):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-c", textwrap.dedent(INTERRUPTED), which]
    with subprocess.Popen(run, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(1.0)  # well inside a call
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        try:  # a deadline: a call that does not stop fails the test instead of waiting forever
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{which}: still running 30 s after Ctrl-C") from None
        assert proc.returncode == 130
    line = out.split()
    assert line and line[0] == "stopped", line
    assert float(line[1]) - sent < 1.0, f"{which}: {float(line[1]) - sent:.2f} s from Ctrl-C to the stop"


# --- the plain path beside the fast one -----------------------------------------------------------


def heads(rng, hq, hkv, n_q, n_k, dtype, e=8, ev=5):
    q = rng.standard_normal((hq, n_q, e)).astype(dtype)
    k = rng.standard_normal((hkv, n_k, e)).astype(dtype)
    v = rng.standard_normal((hkv, n_k, ev)).astype(dtype)
    dout = rng.standard_normal((hq, n_q, ev)).astype(dtype)
    return q, k, v, dout


ONE_HEAD_SHAPES = [(17, 17), (9, 23), (23, 9), (1, 6), (6, 1)]  # L > S: under causal the first L - S rows see no key


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("n_q,n_k", ONE_HEAD_SHAPES)
def test_algorithm_1_for_one_head_is_the_fast_path_and_the_reference(rng, dtype, causal, n_q, n_k):
    q, k, v, _ = heads(rng, 4, 2, n_q, n_k, dtype)
    out, lse = flash_attention(q, k, v, causal=causal, block_q=4, block_k=3, return_lse=True, workers=2)
    for h in range(4):  # query head h reads kv head h // 2
        one_out, one_lse = flash_attention_one_head(q[h], k[h // 2], v[h // 2], causal=causal, block_q=4, block_k=3)
        assert one_out.dtype == one_lse.dtype == dtype
        assert_close(one_out, out[h], dtype, f"out of head {h}")
        np.testing.assert_array_equal(np.isneginf(one_lse), np.isneginf(lse[h]))
        np.testing.assert_allclose(one_lse, lse[h], **dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else {})
        assert_close(one_out, attention(q[h], k[h // 2], v[h // 2], causal=causal), dtype, f"head {h} vs reference")


def test_the_plain_paths_take_the_papers_parameters_only():
    """Nothing FlexAttention adds (mods, block masks, sinks, heads, windows): those are the fast paths'."""
    forward = list(inspect.signature(flash_attention_one_head).parameters)
    backward = list(inspect.signature(flash_attention_backward_one_head).parameters)
    assert forward == ["q", "k", "v", "causal", "scale", "block_q", "block_k"]
    assert backward == ["q", "k", "v", "out", "dout", "lse", "causal", "scale", "block_q", "block_k"]
    assert "running_start" not in inspect.getsource(flash_attention_one_head)


@pytest.mark.parametrize(("q_batch", "kv_batch"), [((3,), (1,)), ((2, 3), (1, 1))])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 1), (2, 2)])
def test_kv_of_batch_one_is_broadcast_over_the_query_batch(rng, q_batch, kv_batch, hq, hkv):
    """As torch's SDPA: k and v of batch 1 serve every query batch entry, the same bits as the broadcast spelled
    out, with any heads per step (a step never spans two batch entries of k and v held once)."""
    q = rng.standard_normal((*q_batch, hq, 70, 16)).astype(np.float32)
    k, v = (rng.standard_normal((*kv_batch, hkv, 90, 16)).astype(np.float32) for _ in range(2))
    k_all, v_all = (np.broadcast_to(x, (*q_batch, *x.shape[-3:])).copy() for x in (k, v))  # spelled out
    gold, gold_lse = gold_attention(q, k_all, v_all, bottom_right(70, 90))
    for per_step in (1, 2, 3):
        out, lse = flash_attention(
            q, k, v, causal=True, block_q=32, block_k=32, kv_heads_per_step=per_step, return_lse=True
        )
        assert_close(out, gold, np.float32, f"{per_step} kv heads per step")
        assert_close(lse, gold_lse, np.float32)
        again = flash_attention(q, k_all, v_all, causal=True, block_q=32, block_k=32, kv_heads_per_step=per_step)
        np.testing.assert_array_equal(out, again)


def test_kv_of_batch_one_is_held_once_not_per_batch_entry(rng):
    q = rng.standard_normal((16, 2, 8, 32)).astype(np.float32)  # 16 batch entries of 8 queries
    k, v = (rng.standard_normal((1, 2, 4096, 32)).astype(np.float32) for _ in range(2))  # 1 MiB each
    out, peak = traced_peak(flash_attention, q, k, v)
    assert peak < 4 * k.nbytes, f"{peak:,} B traced: k and v ({k.nbytes:,} B each) copied per batch entry?"
    np.testing.assert_array_equal(out, flash_attention(q, *(np.repeat(x, 16, axis=0) for x in (k, v))))


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [((3, 2, 5, 8), (2, 2, 9, 8)), ((3, 2, 5, 8), (2, 9, 8)), ((2, 3, 2, 5, 8), (1, 3, 2, 9, 8))],
)
def test_other_batch_mismatches_are_still_refused(rng, q_shape, kv_shape):
    q, kv = rng.standard_normal(q_shape), rng.standard_normal(kv_shape)
    with pytest.raises(ValueError, match="batch dims|dims"):
        flash_attention(q, kv, kv)
