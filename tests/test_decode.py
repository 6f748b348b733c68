"""flash_decode (split-KV decoding) equals direct attention for any number of splits, and scripts/decode.py
runs, checks what it prints and refuses bad flags up front."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyattn_np import attention, flash_attention, flash_decode
from tinyattn_np.splitkv import default_kv_splits

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(5)


def _qkv(batch=(2,), hq=8, hkv=2, n_q=1, n_k=37, e=16, ev=12, dtype=np.float64):
    q = RNG.standard_normal((*batch, hq, n_q, e)).astype(dtype)
    k = RNG.standard_normal((*batch, hkv, n_k, e)).astype(dtype)
    v = RNG.standard_normal((*batch, hkv, n_k, ev)).astype(dtype)
    return q, k, v


# --- flash_decode ----------------------------------------------------------------------------------


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
    assert default_kv_splits(0, 2) == 1 and default_kv_splits(500, 8) == 1  # short: one chunk, no threads
    assert default_kv_splits(2048, 2) == 2 and default_kv_splits(2048, 16) == 2  # at least 1,024 keys each
    assert default_kv_splits(32768, 2) == 2  # one chunk per worker


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


# --- scripts/decode.py -----------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("decode_script", ROOT / "scripts" / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_generates_the_same_tokens_with_and_without_the_cache(tmp_path, capsys):
    path = tmp_path / "decode.json"
    args = ["--tokens", "24", "--prompt", "4", "--window", "5", "--d-model", "32", "--vocab", "64", "--json", str(path)]
    assert _script().main(args) == 0
    text = capsys.readouterr().out
    assert "all checks passed" in text and "window=5 ms/token" in text
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert rows[-1]["context"] == 28 and all(r["cache_bytes"] == r["kv_cache_bytes"] for r in rows)
    assert rows[-1]["window_bytes"] == 2 * 2 * 5 * 2 * 8 * 8  # layers, k and v, window, kv heads, d_head, float64
    assert rows[-1]["max_diff"] < 1e-9


def test_script_step_mode_without_torch(capsys, tmp_path, monkeypatch):
    path = tmp_path / "step.json"
    args = ["--step", "--context", "3000", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"]
    script = _script()
    monkeypatch.setattr(sys.modules["common"], "SETTLE_SECONDS", 0.0)  # no idle before each of the 12 rows' rates
    assert script.main([*args, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "flash_decode (split-KV)" in text and "S = 3,000 cached keys" in text and "torch" not in text
    rows = {r["kernel"]: r for r in json.loads(path.read_text())["rows"]}
    for name in (
        "read K and V once, 1 thread",
        "read K and V once, 2 threads",
        "16 sequences of 93..3,000 keys: read once",
    ):
        assert rows[name]["max_diff"] is None  # a read of the bytes, the floor: nothing to compare
    for name in ("paged_decode, blocks of 16", "paged_decode, blocks of 256", "paged_decode, blocks of 16, every other "
                 "block", "16 sequences: paged_decode, blocks of 16"):  # fmt: skip
        assert rows[name]["max_diff"] < 1e-5  # each equals attention() (the script checks it too)
    assert re.search(
        r"^  paged_decode, blocks of 256: [0-9.]+x the floor \(target 1.3x: (met|[0-9]+% over)\)$", text, re.M
    )
    assert "16 sequences: paged_decode, blocks of 16: " in text


def test_script_step_mode_floor_reads_the_bytes_once_on_one_and_two_threads():
    script = _script()
    reads = []
    arrays = [type("Array", (), {"sum": lambda self, i=i: reads.append(i)})() for i in range(2)]
    script.read_once(arrays, threads=1)
    script.read_once(arrays, threads=2)
    assert sorted(reads) == [0, 0, 1, 1]


def test_script_step_mode_scatters_blocks_on_request():
    k = v = np.zeros((2, 100, 4), np.float32)
    cache, (seq,) = _script().paged([100], k, v, 16, True)
    table = cache.block_table(seq)
    assert len(table) == 7 and all(b % 2 == 0 for b in table)  # every other block: no two adjacent
    cache, (seq,) = _script().paged([100], k, v, 16, False)
    assert cache.block_table(seq) == tuple(range(7))  # alone in an empty pool: one run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "must be an int >= 0"),
        (["--tokens", "0"], "must be a positive int; got 0"),
        (["--tokens", "nan"], "must be a positive int; got 'nan'"),
        (["--tokens", "5000"], "at most 4,096"),
        (["--heads", "3"], "must be a multiple of --kv-heads"),
        (["--d-model", "36", "--heads", "4"], "heads of an even size"),
        (["--d-model", "100000"], "argument --d-model: must be a positive int at most 4,096; got 100,000"),
        (["--step", "--context", "4194304"], "lower --context"),
        (["--json", "/no/such/folder/x.json"], "folder that exists"),
    ],
)
def test_script_refuses_bad_flags_up_front(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        _script().parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_flash_decode_lse_of_float16_is_float32_like_flash_attention():
    q, k, v = (x.astype(np.float16) for x in _qkv())
    out, lse = flash_decode(q, k, v, kv_splits=2, return_lse=True)
    _, lse_flash = flash_attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == lse_flash.dtype == np.float32
