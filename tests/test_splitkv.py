"""splitkv.py: flash_decode (split-KV decoding) equals direct attention for any number of splits and under
every layout tune() can choose, the same bits for any number of workers; and it refuses, before allocating, a
step whose peak does not fit, with a peak estimate checked against what tracemalloc sees."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import assert_close, gold_attention
from hypothesis import given
from hypothesis import strategies as st
from test_kvcache import _under_address_space_limit
from test_paged_decode import _filled, _gold

from tinyattn_np import (
    AttentionMemoryError,
    attention,
    flash_attention,
    flash_decode,
    merge_chunks,
    merge_states,
    paged_decode,
)
from tinyattn_np._checks import check_qkv, compute_dtype
from tinyattn_np._decode_kernel import block_keys as _block_keys
from tinyattn_np._decode_kernel import decode_bytes, merges_without_copy
from tinyattn_np._decode_kernel import default_kv_splits as _default_kv_splits
from tinyattn_np._tuning import (
    DECODE_LAYOUTS,
    DEFAULT_LAYOUT,
    DecodeLayout,
    decode_layout,
    default_layout,
    use_decode_layout,
)
from tinyattn_np.measure import traced_peak
from tinyattn_np.splitkv import split_kv_attention

RNG = np.random.default_rng(5)
guard_module = importlib.import_module("tinyattn_np._guard")  # the memory guard reads the memory here


def _qkv(batch=(2,), hq=8, hkv=2, n_q=1, n_k=37, e=16, ev=12, dtype=np.float64):
    q = RNG.standard_normal((*batch, hq, n_q, e)).astype(dtype)
    k = RNG.standard_normal((*batch, hkv, n_k, e)).astype(dtype)
    v = RNG.standard_normal((*batch, hkv, n_k, ev)).astype(dtype)
    return q, k, v


# --- flash_decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_chunks", [1, 2, 7, 37])
def test_the_plain_split_kv_is_attention_and_flash_decode(n_chunks):
    """split_kv_attention, the chunks' own attention and lse merged by their share of the denominator: attention()
    for any number of chunks, and what flash_decode computes with its chunks on the cores."""
    q, k, v = _qkv(batch=(2,), hq=3, hkv=3, n_q=2, n_k=37)
    out, lse = split_kv_attention(q, k, v, n_chunks)
    gold, gold_lse = gold_attention(q, k, v)
    assert_close(out, gold, np.float64, f"{n_chunks} chunks")
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-13)
    fast, fast_lse = flash_decode(q, k, v, kv_splits=n_chunks, return_lse=True)
    np.testing.assert_allclose(out, fast, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, fast_lse, rtol=1e-13)


@pytest.mark.parametrize("kv_splits", [None, 1, 2, 3, 7, 36, 37, 1000])
def test_equals_attention_for_any_number_of_splits(kv_splits):
    q, k, v = _qkv()
    out, lse = flash_decode(q, k, v, kv_splits=kv_splits, return_lse=True)
    np.testing.assert_allclose(out, attention(q, k, v), atol=1e-13)
    _, lse_gold = flash_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(lse, lse_gold, atol=1e-13)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 1), (8, 2)])
@pytest.mark.parametrize("n_q", [1, 3])
def test_gqa_mqa_and_a_few_queries(hq, hkv, n_q):
    q, k, v = _qkv(batch=(2, 1), hq=hq, hkv=hkv, n_q=n_q, n_k=50)
    for kv_splits in (1, 4):
        np.testing.assert_allclose(
            flash_decode(q, k, v, kv_splits=kv_splits, scale=0.3), attention(q, k, v, scale=0.3), atol=1e-13
        )


def test_one_step_of_decoding_is_bottom_right_causal():
    """The one query is the newest token: it sees every cached key, which is causal=True bottom-right."""
    q, k, v = _qkv(n_q=1, n_k=20)
    np.testing.assert_allclose(flash_decode(q, k, v, kv_splits=3), attention(q, k, v, causal=True), atol=1e-13)


def test_same_bits_for_any_number_of_workers():
    q, k, v = _qkv(n_k=3000, dtype=np.float32)  # chunks of 600 keys: blocks of 256, 256 and 88
    one = flash_decode(q, k, v, kv_splits=5, workers=1)
    for workers in (2, 3, 8):
        np.testing.assert_array_equal(flash_decode(q, k, v, kv_splits=5, workers=workers), one)


def test_float16_two_d_and_no_keys():
    q, k, v = _qkv(dtype=np.float16)
    out = flash_decode(q, k, v, kv_splits=4)
    assert out.dtype == np.float16
    gold = attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(out.astype(np.float32), gold, atol=2e-3)
    q2, k2, v2 = q[0, 0], k[0, 0], v[0, 0]  # (L, E): one head, no head axis
    np.testing.assert_allclose(flash_decode(q2, k2, v2, kv_splits=2), attention(q2, k2, v2), atol=2e-3)
    out, lse = flash_decode(*_qkv(n_k=0), return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_default_splits():
    assert _default_kv_splits(0, 2) == 1 and _default_kv_splits(500, 8) == 1  # short: one chunk, no threads
    assert _default_kv_splits(2048, 2) == 2 and _default_kv_splits(2048, 16) == 2  # at least 1,024 keys each
    assert _default_kv_splits(32768, 2) == 2  # one chunk per worker


def test_bad_arguments_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="kv_splits must be a positive int; got 0"):
        flash_decode(q, k, v, kv_splits=0)
    with pytest.raises(TypeError, match="kv_splits must be a positive int"):
        flash_decode(q, k, v, kv_splits=2.0)
    with pytest.raises(ValueError, match="workers must be a positive int; got -1"):
        flash_decode(q, k, v, workers=-1)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        flash_decode(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="must be float16, float32 or float64"):
        flash_decode(q.astype(np.int32), k, v)


def test_flash_decode_lse_of_float16_is_float32_like_flash_attention():
    q, k, v = (x.astype(np.float16) for x in _qkv())
    out, lse = flash_decode(q, k, v, kv_splits=2, return_lse=True)
    _, lse_flash = flash_attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == lse_flash.dtype == np.float32


# --- the memory a step takes, refused before it is allocated ----------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype", "kv_dtype", "kv_splits"),
    [
        ((2, 8, 2, 1, 5000, 64), np.float32, np.float32, 1),
        ((2, 8, 2, 4, 5000, 64), np.float32, np.float16, 4),  # a float16 cache, converted block by block
        ((1, 32, 8, 16, 3000, 128), np.float64, np.float64, 3),
        ((64, 32, 8, 1, 300, 64), np.float32, np.float32, 1),  # many query rows, few keys
        ((8, 16, 16, 1, 6000, 64), np.float16, np.float16, 8),
    ],
)
def test_the_peak_estimate_bounds_what_tracemalloc_sees(shape, dtype, kv_dtype, kv_splits):
    """decode_bytes is an upper bound of the peak (the arrays; Python's own objects, threads among them, add a
    few tens of KiB), and not a loose one: within twice the peak of one worker (with two, the peak depends on
    how their work overlaps)."""
    b, hq, hkv, n_q, n_k, e = shape
    q = RNG.standard_normal((b, hq, n_q, e)).astype(dtype)
    k, v = (RNG.standard_normal((b, hkv, n_k, e)).astype(kv_dtype) for _ in range(2))
    flash_decode(q, k, v, kv_splits=kv_splits, workers=2)  # the first call's one-time allocations
    dims = check_qkv(q, k, v)[3]
    for workers in (1, 2):
        _, peak = traced_peak(flash_decode, q, k, v, kv_splits=kv_splits, workers=workers)
        estimate = decode_bytes(dims, compute_dtype(q, k, v), np.result_type(k, v), kv_splits, workers)
        assert peak - 64 * 1024 <= estimate, (workers, peak, estimate)
        assert estimate <= 2 * peak or workers > 1, (workers, peak, estimate)


def test_a_step_that_does_not_fit_is_refused_before_it_is_made(monkeypatch):
    q, k, v = _qkv(batch=(4,), n_k=3000)
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1024)
    message = r"flash_decode would allocate .* \(32 query rows against 3,000 keys in 2 chunks: .*\), but only 1\.0 KiB"
    with pytest.raises(AttentionMemoryError, match=message):
        flash_decode(q, k, v, kv_splits=2)
    with pytest.raises(MemoryError, match="pass fewer queries per call"):  # an AttentionMemoryError is one
        flash_decode(q, k, v)


def test_a_step_beyond_the_address_space_limit_is_refused_before_anything_is_allocated():
    """q of 64 MiB exists; the step's scaled copy alone would not fit in the 32 MiB left under the limit."""
    setup = "q = np.ones((64, 32, 64, 128), np.float32); k = np.ones((64, 8, 256, 128), np.float32)"
    printed = _under_address_space_limit(setup, "tinyattn_np.flash_decode(q, k, k)")
    assert printed.startswith("refused: flash_decode would allocate"), printed
    assert "pass fewer queries per call" in printed


def test_keys_that_reshape_only_by_a_copy_are_counted():
    k = np.zeros((3, 4, 10, 8))
    assert merges_without_copy(k) and merges_without_copy(k[:, :, :5])  # a slice of the keys: still a view
    assert not merges_without_copy(k.transpose(1, 0, 2, 3)) and merges_without_copy(k[:1].transpose(1, 0, 2, 3))
    assert not np.shares_memory(k.transpose(1, 0, 2, 3).reshape(12, 10, 8), k)  # NumPy does copy that one


@given(
    n_chunks=st.integers(1, 6),
    rows=st.integers(1, 4),
    seen=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_chunks_is_merge_states_folded(n_chunks, rows, seen, seed):
    rng = np.random.default_rng(seed)
    outs = [rng.standard_normal((rows, 3)) for _ in range(n_chunks)]
    lses = [rng.standard_normal(rows) * 5 if seen[n] else np.full(rows, -np.inf) for n in range(n_chunks)]
    out, lse = merge_chunks(outs, lses)
    fold_out, fold_lse = outs[0] * np.isfinite(lses[0])[:, None], lses[0]
    for out_n, lse_n in zip(outs[1:], lses[1:], strict=True):
        fold_out, fold_lse = merge_states(fold_out, fold_lse, out_n, lse_n)
    np.testing.assert_allclose(out, fold_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(fold_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], fold_lse[np.isfinite(fold_lse)], rtol=1e-12)


# --- flash_decode: one merge over every chunk, float16 read block by block ------------------------


def test_flash_decode_keeps_float32_accuracy_for_any_number_of_splits(rng):
    q = rng.standard_normal((6, 16, 32)).astype(np.float32)
    k, v = (rng.standard_normal((6, 20_000, 32)).astype(np.float32) for _ in range(2))
    gold = attention(*(x.astype(np.float64) for x in (q, k, v)))
    one_split = np.abs(flash_decode(q, k, v, kv_splits=1) - gold).max()
    for splits in (64, 4096, 20_000):  # a sequential fold of merge_states drifts to 2e-6 at 20,000
        error = np.abs(flash_decode(q, k, v, kv_splits=splits) - gold).max()
        assert error <= 2 * max(one_split, 3e-8), f"{splits} splits: {error:.2e} against {one_split:.2e} with one"


@pytest.mark.parametrize(
    "shift,falls_back",
    [(0.0, False), (95.0, True), (-70.0, True), (30.0, False)],  # float32: exp overflows past 88.7; e^-70 · S < √tiny
)
def test_decode_sums_against_zero_fall_back_to_the_running_max_where_exp_cannot_hold_them(
    rng, monkeypatch, shift, falls_back
):
    """flash_decode sums exp(s) against 0, as flash_attention does; scores too large for exp, or all far below
    0, send the chunk to the running max (_sum_blocks with running_max=True). Either way: the reference."""
    import tinyattn_np._decode_kernel as splitkv_module

    q = rng.standard_normal((4, 1, 8)).astype(np.float32)  # 4 query heads over 2 kv heads, one decode step
    k, v = (rng.standard_normal((2, 700, 8)).astype(np.float32) for _ in range(2))
    k[1, :, 0], q[2:] = shift, 0.0  # kv head 1's channel 0 holds the shift, which only query heads 2 and 3 read:
    q[2:, :, 0] = 1.0  # their every score is `shift`
    blocks, used = splitkv_module._sum_blocks, []

    def counted(*args, running_max):
        used.extend([1] * running_max)
        return blocks(*args, running_max=running_max)

    monkeypatch.setattr(splitkv_module, "_sum_blocks", counted)
    out, lse = flash_decode(q, k, v, scale=1.0, kv_splits=1, return_lse=True)
    gold, gold_lse = gold_attention(q, k, v, scale=1.0)
    assert_close(out, gold, np.float32, f"shift {shift}")
    np.testing.assert_allclose(lse, gold_lse, rtol=1e-6, atol=1e-6)
    assert len(used) == falls_back  # one chunk, read again only when exp cannot hold its sums


def test_flash_decode_checks_return_lse():
    x = np.ones((1, 2, 4))
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        flash_decode(x, x, x, return_lse="False")


def test_flash_decode_reads_a_float16_cache_block_by_block(rng):
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, 16_384, 64)).astype(np.float16) for _ in range(2))  # 4 MiB each
    out, peak = traced_peak(flash_decode, q, k, v, workers=2)
    assert peak < k.nbytes / 4, f"{peak:,} B traced for a cache of {k.nbytes + v.nbytes:,} B"
    gold = attention(*(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_allclose(out, gold, atol=2e-3)


# --- the layouts tune() chooses among ---------------------------------------------------------------


@pytest.fixture
def layout_in_force():
    """Each test sets layouts with use_decode_layout; the default is back in force after it."""
    yield use_decode_layout
    use_decode_layout(None)


@pytest.mark.parametrize("layout", DECODE_LAYOUTS)
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"), [(np.float64, np.float64), (np.float32, np.float32), (np.float32, np.float16)]
)
def test_every_decode_layout_gives_the_reference(layout_in_force, layout, dtype, kv_dtype):
    # 3,000 keys in 3 chunks: blocks of 256 keys and more, and a ragged last block, under every layout
    q, _, _ = _qkv(batch=(2,), hq=8, hkv=2, n_q=2, n_k=3000, dtype=dtype)
    _, k, v = _qkv(batch=(2,), hq=8, hkv=2, n_q=2, n_k=3000, dtype=kv_dtype)
    gold, gold_lse = gold_attention(q, k, v)
    layout_in_force(layout)
    out, lse = flash_decode(q, k, v, kv_splits=3, return_lse=True)
    assert_close(out, gold, dtype, f"out under {layout}")
    assert_close(lse, gold_lse, dtype, f"lse under {layout}")


@pytest.mark.parametrize("layout", DECODE_LAYOUTS)
def test_one_layout_gives_the_same_bits_on_every_run(layout_in_force, layout):
    q, k, v = _qkv(n_k=5000, dtype=np.float32)
    layout_in_force(layout)
    first = flash_decode(q, k, v, kv_splits=4, workers=1, return_lse=True)
    for workers in (1, 2, 3):
        again = flash_decode(q, k, v, kv_splits=4, workers=workers, return_lse=True)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_layout_in_force_sets_the_block_and_the_bill(layout_in_force):
    assert decode_layout() == default_layout()
    dims = check_qkv(*_qkv(batch=(1,), hq=32, hkv=8, n_k=32768, e=128, ev=128, dtype=np.float32))[3]
    layout_in_force(DecodeLayout(2**17, keys_first=False))
    large_bill = decode_bytes(dims, np.dtype(np.float32), np.dtype(np.float32), 2, 2)
    assert _block_keys(32) == 4096  # 2^17 scores over 8 kv heads x 4 query rows
    layout_in_force(DecodeLayout(2**13, keys_first=True))
    assert _block_keys(32) == 256 and decode_layout().keys_first
    assert decode_bytes(dims, np.dtype(np.float32), np.dtype(np.float32), 2, 2) < large_bill  # smaller blocks
    layout_in_force(None)
    assert decode_layout() == default_layout()


MEASURED_FASTEST = {  # the layouts docs/results/decoding.md and docs/results/xeon.md measured fastest
    ("AuthenticAMD", "SkylakeX"): DecodeLayout(2**15, True),
    ("AuthenticAMD", "Haswell"): DecodeLayout(2**15, True),
    ("GenuineIntel", "SkylakeX"): DecodeLayout(2**13, False),
    ("GenuineIntel", "Haswell"): DecodeLayout(2**17, False),
}


@pytest.mark.parametrize("maker", ["AuthenticAMD", "GenuineIntel", ""])
@pytest.mark.parametrize("kernels", ["SkylakeX", "Haswell", "Zen", ""])
def test_the_untuned_layout_is_the_one_measured_fastest_under_the_blas_kernels(monkeypatch, maker, kernels):
    """On an AMD EPYC, AVX-512 and AVX2 kernels: keys first, blocks of 2^15 scores; on an Intel Xeon, queries
    first in blocks of 2^13 (AVX-512) and 2^17 (AVX2); a maker or kernels nobody measured, or a BLAS that does
    not name them: DEFAULT_LAYOUT."""
    import tinyattn_np._tuning as tuning

    monkeypatch.setattr(tuning, "blas_kernel_set", lambda: kernels)
    monkeypatch.setattr(tuning, "cpu_maker", lambda: maker)
    want = MEASURED_FASTEST.get((maker, kernels), DEFAULT_LAYOUT)
    assert default_layout() == decode_layout() == want


def test_keys_first_takes_one_row_at_a_time_only_for_a_few_rows(layout_in_force):
    """Up to VECTOR_ROWS query rows a kv head (1, 2 and 8 here), keys first makes each row's scores by a
    matrix-vector product; past it, one matrix product: the bits of queries first. Either way, the reference."""
    import tinyattn_np._tuning as splitkv

    for rows in (1, 2, splitkv.VECTOR_ROWS, 2 * splitkv.VECTOR_ROWS):
        q, k, v = _qkv(batch=(1,), hq=2 * rows, hkv=2, n_q=1, n_k=2000, e=64, ev=64, dtype=np.float32)
        runs = []
        for keys_first in (True, False):
            layout_in_force(DecodeLayout(2**15, keys_first=keys_first))
            runs.append(flash_decode(q, k, v, kv_splits=1))
        assert_close(runs[0], gold_attention(q, k, v)[0], np.float32, f"{rows} rows, keys first")
        if rows > splitkv.VECTOR_ROWS:
            np.testing.assert_array_equal(runs[0], runs[1])


def test_the_blas_kernel_set_is_numpys():
    from threadpoolctl import threadpool_info

    from tinyattn_np._parallel import blas_kernel_set

    named = [pool.get("architecture") for pool in threadpool_info() if pool.get("user_api") == "blas"]
    assert blas_kernel_set() == (named[0] or "" if named else "")


def test_a_layout_of_the_wrong_types_is_refused(layout_in_force):
    with pytest.raises(ValueError, match="scores_per_block"):
        layout_in_force(DecodeLayout(0, keys_first=False))
    with pytest.raises(TypeError, match="keys_first"):
        layout_in_force(DecodeLayout(2**13, keys_first=1))  # type: ignore[arg-type]
    assert decode_layout() == default_layout()


@pytest.mark.parametrize("layout", DECODE_LAYOUTS)
def test_every_decode_layout_reads_a_paged_cache_piece_by_piece(layout_in_force, layout):
    """paged_decode shares the blocks: pages of 3 tokens interleaved in the pool make blocks of many pieces."""
    cache, seqs = _filled([700, 41, 300], 3)
    q = RNG.standard_normal((3, 6, 1, 8))
    layout_in_force(layout)
    assert_close(paged_decode(q, cache, seqs, kv_splits=2), _gold(q, cache, seqs), np.float64, f"under {layout}")


def test_one_chunk_is_its_own_merge_bit_for_bit(rng):
    """flash_decode with one chunk returns the chunk's out and lse as they are: merge_chunks of one part gives
    them back to the bit (its weight is exp(0) = 1, its sum 1), rows that see no key and NaN rows included."""
    q = rng.standard_normal((2, 6, 3, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, 900, 16)).astype(np.float32) for _ in range(2))
    k[1, 2, 5, 0] = np.nan  # one kv head's scores are NaN
    out, lse = flash_decode(q, k, v, kv_splits=1, return_lse=True)
    merged = merge_chunks([out], [lse])
    np.testing.assert_array_equal(merged[0], out)
    np.testing.assert_array_equal(merged[1], lse)
    assert np.isnan(out[1, 4:]).all() and np.isfinite(out[0]).all()
    empty = flash_decode(q, k[..., :0, :], v[..., :0, :], kv_splits=1, return_lse=True)
    for got, want in zip(merge_chunks([empty[0]], [empty[1]]), empty, strict=True):
        np.testing.assert_array_equal(got, want)
