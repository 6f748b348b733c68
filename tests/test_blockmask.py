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
    BlockMask,
    attention,
    attention_backward,
    causal_mod,
    create_block_mask,
    flash_attention,
    flash_attention_backward,
    flex_attention,
    tile_plan,
)
from tinyattn_np._tiles import FULL
from tinyattn_np.blockmask import check_band

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
    """(causal, window, align) for every alignment and every window that draws another mask: 1 to max(L, S) (a
    wider one hides nothing the causal band shows, in either alignment: query i sees keys from i + offset back
    to 0, fewer than max(L, S) of them), and one past the longest (L + S + 1) for the planners' arithmetic."""
    yield False, None, "bottom_right"
    for align in ALIGNMENTS:
        for window in (None, *range(1, max(n_q, n_k) + 1), n_q + n_k + 1):
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
    columns = [
        t
        for k_start in range(0, n_k, block_k)
        for t in plan.column_tiles(k_start, min(k_start + block_k, n_k), n_q, block_q, heads)
    ]
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
    out, lse = flash_attention(
        q, k, v, causal=True, window=5, align="top_left", block_q=16, block_k=16, return_lse=True
    )
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
            q, k, v, dout = (
                rng.standard_normal(shape) for shape in [(2, n_q, 3), (2, n_k, 3), (2, n_k, 2), (2, n_q, 2)]
            )
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


# --- a BlockMask: what it refuses, its read-only tables, indexing -------------------------------------


def per_entry_mod(b, h, q_idx, kv_idx):
    """A mask that differs between batch entries (the diagonal moves with b) and heads (every third key)."""
    return (kv_idx <= q_idx + b) & ((kv_idx + h) % 3 != 0)


def test_a_block_mask_indexed_by_batch_entry_and_head_is_that_entrys_mask():
    """block_mask[b], [:, h], [b, h], slices and lists, as torch indexes a BlockMask (an int keeps its axis):
    the tables are those entries', and flex_attention with it gives those entries' results."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 10, 4)) for _ in range(3))
    block_mask = create_block_mask(per_entry_mod, 2, 3, 10, 10, BLOCK_SIZE=(4, 3))
    whole = flex_attention(q, k, v, block_mask=block_mask)
    for index, b, h in [
        (1, [1], [0, 1, 2]),
        ((slice(None), 2), [0, 1], [2]),
        ((1, 2), [1], [2]),
        (([1, 0], slice(0, 2)), [1, 0], [0, 1]),
        ((-1, -2), [1], [1]),
    ]:
        picked = block_mask[index]
        assert picked.shape == (len(b), len(h), 10, 10)
        np.testing.assert_array_equal(picked.kinds, block_mask.kinds[np.ix_(b, h)])
        mine = flex_attention(q[np.ix_(b, h)], k[np.ix_(b, h)], v[np.ix_(b, h)], block_mask=picked)
        np.testing.assert_allclose(mine, whole[np.ix_(b, h)], rtol=1e-13, atol=1e-15)  # other head groupings
    one = block_mask[1, 2]  # one entry, shared by every batch entry and head it meets
    shared = flex_attention(q, k, v, block_mask=one)
    np.testing.assert_allclose(shared[0, 0], flex_attention(q[0, 0], k[0, 0], v[0, 0], block_mask=one), rtol=1e-13)
    assert "per_entry_mod[b in [1], h in [2]]" in repr(one)
    for bad in [2, (0, 3), (0, 0, 0), slice(2, 2)]:
        with pytest.raises(IndexError, match="BlockMask"):
            block_mask[bad]


def test_a_hand_made_block_mask_must_match_its_lengths_and_tiles():
    made = create_block_mask(causal_mod(10), None, None, 10, 10, BLOCK_SIZE=4)  # a grid of 3 x 3 tiles
    assert BlockMask(made.kinds, (10, 10), 4, made.mask_mod).tile_plan() == made.tile_plan()
    for kinds, lengths, block_size, message in [
        (made.kinds, (10, 13), 4, r"kinds must have shape \(B, H, 3, 4\) .* got shape \(1, 1, 3, 3\)"),
        (made.kinds, (10, 10), 5, r"kinds must have shape \(B, H, 2, 2\)"),
        (made.kinds[0], (10, 10), 4, r"got shape \(1, 3, 3\)"),
        (made.kinds * 2, (10, 10), 4, "the ints 0 .empty., 1 .partial. and 2 .full. only"),
        (made.kinds.astype(float), (10, 10), 4, "got float64"),
        (made.kinds, (10,), 4, r"seq_lengths must be a pair"),
        (made.kinds, (10, 10), (4,), r"BLOCK_SIZE must be an int or a pair \(block_q, block_k\); got \(4,\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            BlockMask(kinds, lengths, block_size, made.mask_mod)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        BlockMask(made.kinds, (10, 10), 4, None)
    for block_size in [(2,), (2, 2, 2), [0, 2]]:
        with pytest.raises(ValueError, match="BLOCK_SIZE must be"):
            create_block_mask(causal_mod(10), None, None, 10, 10, BLOCK_SIZE=block_size)
    assert create_block_mask(causal_mod(10), None, None, 10, 10, BLOCK_SIZE=[4, 2]).BLOCK_SIZE == (4, 2)


def test_a_block_masks_tables_and_attributes_are_read_only():
    made = create_block_mask(per_entry_mod, 2, 3, 10, 10, BLOCK_SIZE=4)
    kinds = np.array(made.kinds)
    hand_made = BlockMask(kinds, (10, 10), 4, per_entry_mod)
    kinds[:] = 0  # the caller's array: the mask keeps its own copy
    np.testing.assert_array_equal(hand_made.kinds, made.kinds)
    for table in (made.kv_num_blocks, made.full_kv_indices, made.to_dense()):
        assert table.flags.writeable  # the answers to torch's names are new arrays: the caller's to change
    with pytest.raises(ValueError, match="read-only"):
        made.kinds[...] = 0
    for name in ("kinds", "seq_lengths", "BLOCK_SIZE", "mask_mod"):
        with pytest.raises(AttributeError):
            setattr(made, name, getattr(made, name))


def test_tile_plan_of_a_batch_entry_or_head_the_mask_does_not_have_is_refused():
    made = create_block_mask(per_entry_mod, 2, 3, 10, 10, BLOCK_SIZE=4)
    assert made.tile_plan(1, 2) != made.tile_plan(0, 0)
    with pytest.raises(ValueError, match=r"b=5 is not one of the block mask's 2 \(0 .. 1\)"):
        made.tile_plan(b=5)
    with pytest.raises(ValueError, match=r"h=3 is not one of the block mask's 3"):
        made.tile_plan(h=3)
    with pytest.raises(ValueError, match="b must be an int >= 0"):
        made.tile_plan(b=-1)
