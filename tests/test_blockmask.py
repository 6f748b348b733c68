"""The planners against a dense oracle: for every alignment, window and tile size down to 1, Band's row and
column tiles, tile_plan, create_block_mask's table and BlockMask's tiles hold exactly the entries the mask
lets through, agree with each other, and give each tile its place in its row; flash_attention and its
backward on those plans equal the dense reference. Then what a BlockMask refuses, its read-only tables,
and indexing by batch entry and head."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import gold_attention

from tinyattn_np import (
    attention,
    attention_backward,
    create_block_mask,
    flash_attention,
    flash_attention_backward,
    tile_plan,
)
from tinyattn_np.blockmask import FULL, check_band

ALIGNMENTS = ("bottom_right", "top_left")


def loop_band(n_q, n_k, causal, window, align):
    """The dense oracle, with loops: query i sees key j when j <= i + offset, and j > i + offset - window."""
    offset = n_k - n_q if align == "bottom_right" else 0
    allowed = np.zeros((n_q, n_k), bool)
    for i in range(n_q):
        for j in range(n_k):
            seen = not causal or j <= i + offset
            allowed[i, j] = seen and (window is None or j > i + offset - window)
    return allowed


def bands(n_q, n_k):
    """(causal, window, align) for every alignment and every window from 1 to past the longest."""
    yield False, None, "bottom_right"
    for align in ALIGNMENTS:
        for window in (None, *range(1, n_q + n_k + 2)):
            yield True, window, align


def check_rows_and_columns(plan, allowed, block_q, block_k, heads=None):
    """plan's row tiles hold every allowed entry once, none empty, "full" exactly where the whole tile is
    allowed, each at its place in its row; its column tiles are the same tiles. Returns the row tiles."""
    n_q, n_k = allowed.shape
    rows = []
    for q_start in range(0, n_q, block_q):
        q_stop = min(q_start + block_q, n_q)
        row = list(plan.row_tiles(q_start, q_stop, n_k, block_k, heads))
        assert plan.row_length(q_start, q_stop, n_k, block_k, heads) == len(row)
        for place, t in enumerate(row):
            assert plan.place(t, n_k, block_k, heads) == place, t
        rows += row
    covered = np.zeros_like(allowed, int)
    for t in rows:
        assert t.q_stop > t.q_start and t.k_stop > t.k_start and t.k_start % block_k == 0, t
        seen = allowed[t.q_start : t.q_stop, t.k_start : t.k_stop]
        assert seen.any(), f"{t} holds no entry the mask lets through"
        assert (t.kind == FULL) == seen.all(), t
        covered[t.q_start : t.q_stop, t.k_start : t.k_stop] += 1
    assert covered.max(initial=0) <= 1 and (covered[allowed] == 1).all()
    columns = [t for k_start in range(0, n_k, block_k)
               for t in plan.column_tiles(k_start, min(k_start + block_k, n_k), n_q, block_q, heads)]  # fmt: skip
    assert sorted(columns) == sorted(rows)
    return rows


@pytest.mark.parametrize("n_q", range(7))
def test_every_planner_holds_exactly_the_dense_masks_entries(n_q):
    """Band (flash_attention's plan), tile_plan and create_block_mask's BlockMask, for L, S up to 6, tiles of
    1 to 7 in both directions, both alignments and every window: rows that see no key get no tile."""
    for n_k in range(7):
        for causal, window, align in bands(n_q, n_k):
            allowed = loop_band(n_q, n_k, causal, window, align)
            band = check_band(causal, window, n_q, n_k, align)
            for block_q in (1, 2, 3, 4, 7):
                for block_k in (1, 2, 3, 5, 7):
                    rows = check_rows_and_columns(band, allowed, block_q, block_k)
                    plan = tile_plan(n_q, n_k, block_q, block_k, causal=causal, window=window, align=align)
                    assert list(plan) == rows
                    if n_q and n_k:
                        mask = create_block_mask(band.mask_mod, None, None, n_q, n_k, BLOCK_SIZE=(block_q, block_k))
                        assert [t[:4] for t in check_rows_and_columns(mask, allowed, block_q, block_k)] == [
                            t[:4] for t in rows
                        ]


def test_rows_past_the_window_get_no_tile_and_give_zero():
    """L > S + w - 1, top-left, with small tiles: the last rows see no key (out 0, lse -inf)."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 80, 8)), rng.standard_normal((1, 48, 8)), rng.standard_normal((1, 48, 8))
    out, lse = flash_attention(q, k, v, causal=True, window=5, align="top_left", block_q=16, block_k=16,
                               return_lse=True)  # fmt: skip
    gold_out, gold_lse = gold_attention(q, k, v, loop_band(80, 48, True, 5, "top_left"))
    np.testing.assert_allclose(out, gold_out, atol=1e-12)
    np.testing.assert_array_equal(lse[0, 52:], -np.inf)
    np.testing.assert_allclose(lse[0, :52], gold_lse[0, :52], atol=1e-12)


def finishes_within(seconds, call, *args, **kwargs):
    """call(*args, **kwargs) on a thread that must end within `seconds` (no pytest-timeout here): its result, or its
    exception raised here; a call still running then fails the test instead of hanging it."""
    outcome = {}

    def target():
        try:
            outcome["result"] = call(*args, **kwargs)
        except BaseException as err:  # handed to the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a wait that does not end"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_flash_forward_and_backward_on_every_small_plan_equal_the_dense_reference(align):
    rng = np.random.default_rng(1)
    for n_q in (0, 1, 3, 6):
        for n_k in (0, 1, 2, 5):
            q, k, v, dout = (rng.standard_normal(shape) for shape in [(2, n_q, 3), (2, n_k, 3), (2, n_k, 2),
                                                                       (2, n_q, 2)])  # fmt: skip
            for window in (None, 1, 2, 4):
                allowed = loop_band(n_q, n_k, True, window, align)
                gold_out = attention(q, k, v, mask=allowed)
                gold_grads = attention_backward(q, k, v, dout, mask=allowed)
                for block_q, block_k in [(1, 1), (1, 3), (2, 1), (4, 4)]:
                    run = dict(causal=True, window=window, align=align, block_q=block_q, block_k=block_k, workers=3)
                    out, lse = flash_attention(q, k, v, return_lse=True, **run)
                    np.testing.assert_allclose(out, gold_out, atol=1e-12)
                    grads = finishes_within(20, flash_attention_backward, q, k, v, out, dout, lse, **run)
                    for mine, gold in zip(grads, gold_grads, strict=True):
                        np.testing.assert_allclose(mine, gold, atol=1e-12)
