"""Extreme and empty inputs: what each function does, checked for the reference and flash alike."""

import importlib

import numpy as np
import pytest
from conftest import assert_close, gold_attention

from tinyattn_np import AttentionMemoryError, attention, flash_attention, scaled_dot_product_attention

# the package exports the function attention(), which hides the module of the same name
guard_module = importlib.import_module("tinyattn_np._guard")  # the memory guard reads the memory here


@pytest.fixture(params=["attention", "flash"])
def attend(request):
    if request.param == "attention":
        return attention
    return lambda q, k, v, **kw: flash_attention(q, k, v, block_q=3, block_k=4, **kw)


def test_no_keys_gives_zeros(attend, rng):
    # S = 0: every query sees nothing, like a fully masked row: output 0 (torch gives 0 here too)
    q, kv = rng.standard_normal((2, 5, 4)), np.zeros((2, 0, 4))
    out = attend(q, kv, kv, causal=False)
    assert out.shape == (2, 5, 4)
    np.testing.assert_array_equal(out, 0.0)


def test_no_queries_gives_empty_output(attend, rng):
    q, kv = np.zeros((2, 0, 4)), rng.standard_normal((2, 6, 4))
    assert attend(q, kv, kv, causal=True).shape == (2, 0, 4)


def test_flash_lse_for_no_keys():
    out, lse = flash_attention(np.ones((3, 4)), np.zeros((0, 4)), np.zeros((0, 2)), return_lse=True)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def test_nan_reaches_only_the_rows_that_touch_it(attend, rng):
    q, k, v = (rng.standard_normal((1, 8, 4)) for _ in range(3))
    q[0, 2, 1] = np.nan  # query 2 is broken: only output row 2
    k[0, 5, 0] = np.nan  # key 5 is broken: only the rows that may see it (causal: rows 5, 6, 7)
    with np.errstate(invalid="ignore"):
        out = attend(q, k, v, causal=True)
    bad_rows = np.isnan(out[0]).any(axis=-1)
    assert bad_rows.tolist() == [False, False, True, False, False, True, True, True]


def test_nan_in_v_spreads_through_the_matmul(rng):
    q, k, v = (rng.standard_normal((1, 4, 2)) for _ in range(3))
    v[0, 3, 0] = np.nan  # only row 3 may see key 3, but 0 · NaN = NaN in weights @ v
    out = attention(q, k, v, causal=True)
    assert np.isnan(out[0, :, 0]).all() and not np.isnan(out[0, :, 1]).any()


def test_huge_scores_do_not_overflow(attend, rng):
    # q·k around 1e4 in float32: exp(1e4) is inf, exp(score - row max) is not
    q = rng.standard_normal((1, 6, 16)).astype(np.float32) * 100
    k = q.copy()
    v = rng.standard_normal((1, 6, 3)).astype(np.float32)
    with np.errstate(over="raise", invalid="raise"):
        out = attend(q, k, v, causal=True)
    assert np.isfinite(out).all()
    scores = (q[0] @ k[0].T) / 4
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(scores)).any()  # the naive formula without the max would overflow
    assert_close(out, gold_attention(q, k, v, np.tril(np.ones((6, 6), bool)))[0], np.float32, "huge")


def test_float16_inputs_near_their_limit(attend, rng):
    # float16 holds at most 65504: these scores would overflow if they were computed in float16
    q = np.full((1, 4, 8), 100.0, np.float16)
    v = rng.standard_normal((1, 4, 2)).astype(np.float16)
    out = attend(q, q, v, causal=False)
    assert out.dtype == np.float16 and np.isfinite(out).all()
    np.testing.assert_allclose(out[0], np.broadcast_to(v[0].astype(np.float32).mean(0), (4, 2)), atol=2e-3)


def test_memory_guard_refuses_and_can_be_overridden(monkeypatch, rng):
    q = rng.standard_normal((2, 64, 8))
    blockwise = flash_attention(q, q, q, causal=True)  # before the memory shrinks: flash's guard reads it too
    monkeypatch.setattr(guard_module, "memory_available", lambda: 10_000)
    with pytest.raises(AttentionMemoryError, match=r"would allocate 76\.0 KiB.*flash_attention\(\)") as err:
        attention(q, q, q, causal=True)
    assert isinstance(err.value, MemoryError)
    with pytest.raises(AttentionMemoryError):
        scaled_dot_product_attention(q, q, q)
    out = attention(q, q, q, causal=True, check_memory=False)
    assert_close(out, blockwise, np.float64, "override")


def test_memory_guard_reads_the_machine():
    from tinyattn_np._guard import FALLBACK_MEMORY_BYTES, memory_available, memory_total

    assert 0 < memory_available() <= memory_total()
    assert FALLBACK_MEMORY_BYTES == 2 * 2**30
