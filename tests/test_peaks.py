"""What our own functions allocate, worked out from their tiles (peaks.py), held to what tracemalloc
measures: the reference, flash_attention and the backward, in every dtype; the bills' own checks."""

import numpy as np
import pytest
from test_memory import HEAD_DIM, HEADS, _check, _qkv

from tinyattn_np import flash_attention_backward_bytes, naive_attention_bytes
from tinyattn_np.attention import attention
from tinyattn_np.flash import flash_attention
from tinyattn_np.measure import traced_peak
from tinyattn_np.memory import score_matrix_bytes
from tinyattn_np.peaks import flash_attention_bytes


@pytest.mark.parametrize("n", [256, 512, 1024, 2048, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_estimate_matches_tracemalloc(warm, n, causal):
    q, k, v = _qkv(n, np.float32)
    _, measured = traced_peak(flash_attention, q, k, v, causal=causal, workers=1)
    estimate = flash_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, dtype="fp32", causal=causal, workers=1)
    _check(f"flash_attention T={n} causal={causal}", measured, estimate)


@pytest.mark.parametrize("n", [1024, 4096])
def test_flash_estimate_with_two_workers(warm, n):
    """Two threads hold their tiles at once. On a busy machine one thread may finish its rows before the other
    starts, so a run can peak lower: never above the bill, and the highest of a few runs reaches it."""
    q, k, v = _qkv(n, np.float32)
    estimate = flash_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, dtype="fp32", causal=True, workers=2)
    highest = 0
    for _ in range(5):
        _, measured = traced_peak(flash_attention, q, k, v, causal=True, workers=2)
        assert measured <= 1.15 * estimate, f"T={n}: measured {measured:,} B above the bill {estimate:,} B"
        highest = max(highest, measured)
        if highest >= estimate / 1.15:
            break
    _check(f"flash_attention T={n} workers=2, highest of the runs", highest, estimate)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_estimates_for_other_dtypes(warm, dtype):
    """float16 is computed in float32: the copies of q, k, v and the cast back are part of the bill."""
    n, name = 1024, np.dtype(dtype).name
    q, k, v = _qkv(n, dtype)
    _, measured = traced_peak(attention, q, k, v, causal=True)
    _check(
        f"attention {name}",
        measured,
        naive_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, causal=True),
    )
    _, measured = traced_peak(flash_attention, q, k, v, causal=True, workers=1)
    estimate = flash_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, causal=True, workers=1)
    _check(f"flash_attention {name}", measured, estimate)


def test_flash_memory_grows_linearly():
    """8x the tokens: flash's estimate grows less than 8x (the worker tiles stay), the scores 64x."""
    flash = [flash_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, causal=True, workers=16) for n in (4096, 32768)]
    assert flash[1] < 8 * flash[0]
    # 16 workers each hold one tile step of up to 2^18 scores (1 MiB in float32) plus its rows
    assert flash[0] < score_matrix_bytes(4096, heads=HEADS, dtype="fp32") / 5


def test_byte_estimates_refuse_heads_that_do_not_group():
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        flash_attention_backward_bytes(64, heads=6, kv_heads=4, head_dim=8)
