"""Hardening of the kernels: gradients of the forward that was run, accuracy that holds for any number of
splits, memory that stays O((L + S)·E), guards that run before anything is built, and Ctrl-C that stops a
multi-worker call promptly. Each test here failed before the fix it guards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tinyattn_np import (
    AttentionMemoryError,
    MultiHeadAttention,
    attention,
    attention_backward,
    attention_backward_bytes,
    flash_attention,
    flash_attention_backward,
    flash_attention_backward_bytes,
    flash_decode,
    one_head,
)
from tinyattn_np import _guard as guard_module
from tinyattn_np.measure import traced_peak

ROOT = Path(__file__).resolve().parents[1]


def qkv(rng, shape, dtype=np.float64, n=4):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(n))


# --- flash_decode: one merge over every chunk, float16 read block by block (issue 21, items 3 and 11) ---


def test_flash_decode_keeps_float32_accuracy_for_any_number_of_splits(rng):
    q = rng.standard_normal((6, 16, 32)).astype(np.float32)
    k, v = (rng.standard_normal((6, 20_000, 32)).astype(np.float32) for _ in range(2))
    gold = attention(*(x.astype(np.float64) for x in (q, k, v)))
    one_split = np.abs(flash_decode(q, k, v, kv_splits=1) - gold).max()
    for splits in (64, 4096, 20_000):  # a sequential fold of merge_states drifted to 2e-6 at 20,000
        error = np.abs(flash_decode(q, k, v, kv_splits=splits) - gold).max()
        assert error <= 2 * max(one_split, 3e-8), f"{splits} splits: {error:.2e} against {one_split:.2e} with one"


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


# --- the backward of the forward that ran (issue 21, items 4 and 6) ---------------------------------


@pytest.mark.parametrize("n_q,n_k,window", [(12, 12, 3), (7, 15, 4), (15, 7, 2)])
def test_a_windowed_forward_has_its_backward(rng, n_q, n_k, window):
    q, k, v, dout = qkv(rng, (2, n_q, 4))
    k, v = k[:, :1].repeat(n_k, 1), v[:, :1].repeat(n_k, 1)
    k, v = k + rng.standard_normal(k.shape), v + rng.standard_normal(v.shape)
    out, lse = flash_attention(q, k, v, causal=True, window=window, return_lse=True, block_q=4, block_k=4)
    mine = flash_attention_backward(q, k, v, out, dout, lse, causal=True, window=window, block_q=3, block_k=5)
    gold = attention_backward(q, k, v, dout, causal=True, window=window)
    for name, a, b in zip("qkv", mine, gold, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize(
    "forward,backward",
    [
        (dict(causal=True, window=3), dict(causal=True)),  # the case: wrong by 11.4 before
        (dict(causal=True), dict(causal=False)),
        (dict(causal=False), dict(causal=True)),
        (dict(causal=True, scale=0.5), dict(causal=True)),
    ],
)
def test_a_backward_handed_another_forwards_state_refuses(rng, forward, backward):
    q, k, v, dout = qkv(rng, (2, 32, 8))
    out, lse = flash_attention(q, k, v, return_lse=True, **forward)
    with pytest.raises(ValueError, match="lse does not match"):
        flash_attention_backward(q, k, v, out, dout, lse, **backward)


@pytest.mark.parametrize("fused", [True, False])
def test_multihead_forward_and_backward_take_the_window(rng, fused):
    mha = MultiHeadAttention(8, 2, rng=1, dtype=np.float64, rope=True)
    x, dout = rng.standard_normal((2, 9, 8)), rng.standard_normal((2, 9, 8))
    out, saved = mha.forward(x, window=3, fused=fused)
    dx, _, _ = mha.backward(dout, saved)
    i, step = (1, 5, 2), 1e-6
    losses = []
    for shift in (step, -step):  # central difference of sum(out · dout) in one entry of x
        x_shifted = x.copy()
        x_shifted[i] += shift
        losses.append(float(np.sum(mha.forward(x_shifted, window=3, fused=fused)[0] * dout)))
    assert abs(dx[i] - (losses[0] - losses[1]) / (2 * step)) < 1e-7
    with pytest.raises(ValueError, match="window=3 needs causal=True"):
        mha.forward(x, causal=False, window=3, fused=fused)


def test_multihead_backward_uses_the_forwards_input_and_weights(rng):
    mha = MultiHeadAttention(8, 2, rng=3, dtype=np.float64)
    x, dout = rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
    for fused in (True, False):
        _, saved = mha.forward(x, fused=fused)
        before = mha.backward(dout, saved)
        x_kept, w_qkv, w_out = x.copy(), mha.w_qkv.copy(), mha.w_out.copy()
        x += 1.0  # the caller changes its input in place ...
        mha.w_qkv -= 0.1  # ... and an optimizer steps the weights
        mha.w_out *= 2.0
        after = mha.backward(dout, saved)
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)
        x[...], mha.w_qkv[...], mha.w_out[...] = x_kept, w_qkv, w_out


# --- the reference backward's guard (issue 21, item 9) -------------------------------------------------


@pytest.mark.parametrize("n,causal,hkv", [(256, False, 4), (1024, True, 4), (512, True, 2), (768, False, 1)])
def test_attention_backward_estimate_matches_tracemalloc(rng, n, causal, hkv):
    q, dout = (rng.standard_normal((4, n, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((hkv, n, 64)).astype(np.float32) for _ in range(2))
    attention_backward(q[:, :8], k[:, :8], v[:, :8], dout[:, :8], causal=causal)  # one-off first-use buffers
    _, measured = traced_peak(attention_backward, q, k, v, dout, causal=causal)
    estimate = attention_backward_bytes(n, heads=4, kv_heads=hkv, head_dim=64, dtype="fp32", causal=causal)
    assert 1 / 1.15 <= measured / estimate <= 1.15, f"measured {measured:,} B, estimated {estimate:,} B"


def test_attention_backward_refuses_before_converting_float16(monkeypatch):
    q = np.zeros((1, 2**16, 2), np.float16)  # float32 copies alone: 1 MiB; the L x S arrays: 32 GiB
    monkeypatch.setattr(guard_module, "memory_available", lambda: 2**30)

    def refused():
        with pytest.raises(AttentionMemoryError, match=r"attention_backward\(\) would allocate .*check_memory=False"):
            attention_backward(q, q, q, q)

    _, peak = traced_peak(refused)
    assert peak < 64 * 1024, f"{peak:,} B allocated before refusing"


def test_attention_backward_check_memory_false_runs(monkeypatch, rng):
    q, k, v, dout = qkv(rng, (2, 16, 4))
    monkeypatch.setattr(guard_module, "memory_available", lambda: 1000)
    with pytest.raises(AttentionMemoryError):
        attention_backward(q, k, v, dout)
    grads = attention_backward(q, k, v, dout, check_memory=False)
    assert all(np.isfinite(g).all() for g in grads)


# --- the blockwise backward's bookkeeping (issue 21, item 10) --------------------------------------


def test_flash_backward_makes_its_tiles_lazily(rng):
    q, k, v, dout = qkv(rng, (1, 256, 4), np.float32)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    flash_attention_backward(
        q[:, :4], k[:, :4], v[:, :4], out[:, :4], dout[:, :4], lse[:, :4], causal=True, block_q=1, block_k=1
    )  # one-off first-use buffers
    _, peak = traced_peak(
        flash_attention_backward, q, k, v, out, dout, lse, causal=True, block_q=1, block_k=1, workers=1
    )  # 32,896 tiles: a list of them and a dict of the same size took 4 MiB
    estimate = flash_attention_backward_bytes(256, heads=1, head_dim=4, causal=True, block_q=1, block_k=1, workers=1)
    assert peak < 1.15 * estimate + 64 * 1024, f"{peak:,} B traced, {estimate:,} B estimated"


# --- Ctrl-C stops a multi-worker call promptly (issue 21, item 8) -----------------------------------


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
        line = proc.stdout.readline().split()
        assert proc.wait(timeout=30) == 130
    assert line and line[0] == "stopped", line
    assert float(line[1]) - sent < 1.0, f"{which}: {float(line[1]) - sent:.2f} s from Ctrl-C to the stop"


# --- what the last round did not reach (issue 21, item 15) --------------------------------------------


def test_one_head_refuses_an_empty_head():
    x = np.ones((3, 4))
    with pytest.raises(ValueError, match="d_head of at least 1"):
        one_head(x, np.ones((4, 0)), np.ones((4, 0)), np.ones((4, 2)))


@pytest.mark.parametrize("fn", [attention, flash_attention, flash_decode])
def test_a_scale_that_overflows_float32_is_refused(fn):
    q = np.ones((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="overflows float32"):
        fn(q, q, q, scale=1e40)
    assert np.isfinite(fn(q.astype(np.float64), q, q, scale=1e40)).all()  # float64 holds it


@pytest.mark.parametrize("fn", [flash_attention, flash_decode])
def test_a_ragged_list_names_q(fn):
    with pytest.raises(ValueError, match="q must be an array of numbers with one shape"):
        fn([[1.0, 2.0], [3.0]], np.ones((2, 2)), np.ones((2, 2)))


def test_split_heads_checks_its_input():
    mha = MultiHeadAttention(8, 2, rng=0)
    with pytest.raises(ValueError, match=r"x must be \(B, T, 8\)"):
        mha.split_heads(np.ones((3, 8)))
    with pytest.raises(TypeError, match="x must be float16, float32 or float64"):
        mha.split_heads(np.ones((1, 3, 8), np.int64))


def test_byte_estimates_refuse_heads_that_do_not_group():
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        flash_attention_backward_bytes(64, heads=6, kv_heads=4, head_dim=8)


def test_multihead_decoding_into_one_kv_cache_from_threads_keeps_every_token(rng):
    # the length read, the rotation at it and the append are one step under the cache's lock: no token lost,
    # no two tokens at one position (issue 21, item 2, through MultiHeadAttention)
    from concurrent.futures import ThreadPoolExecutor

    from tinyattn_np import KVCache

    mha = MultiHeadAttention(16, 4, 2, rope=True, rng=0)
    cache = KVCache(1, 2, 400, 4)
    x = rng.standard_normal((1, 1, 16)).astype(np.float32)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: mha(x, cache=cache), range(200)))
    assert len(cache) == 200
    keys = cache.keys[0, 0]  # the same token at 200 positions: RoPE turned each by its own, so all differ
    assert len({tuple(np.round(key, 5)) for key in keys}) == 200
