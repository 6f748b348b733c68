"""scripts/decode.py runs, checks what it prints and refuses bad flags up front (flash_decode: test_splitkv.py)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from test_scripts import interrupt, load

from tinyattn_np import flash_decode

ROOT = Path(__file__).resolve().parents[1]


# --- scripts/decode.py -----------------------------------------------------------------------------


def test_script_generates_the_same_tokens_with_and_without_the_cache(machine, tmp_path, capsys):  # no idles
    path = tmp_path / "decode.json"
    args = ["--tokens", "24", "--prompt", "4", "--window", "5", "--d-model", "32", "--vocab", "64", "--json", str(path)]
    assert load("decode.py").main(args) == 0
    text = capsys.readouterr().out
    assert "all checks passed" in text and "window=5 ms/token" in text
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert rows[-1]["context"] == 28 and all(r["cache_bytes"] == r["kv_cache_bytes"] for r in rows)
    assert rows[-1]["window_bytes"] == 2 * 2 * 5 * 2 * 8 * 8  # layers, k and v, window, kv heads, d_head, float64
    assert rows[-1]["max_diff"] < 1e-9


def test_script_step_mode_without_torch(machine, capsys, tmp_path):  # no idle, no matmul before each row
    path = tmp_path / "step.json"
    args = ["--step", "--context", "3000", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "1"]
    script = load("decode.py")
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
    for name in (
        "paged_decode, blocks of 16",
        "paged_decode, blocks of 256",
        "paged_decode, blocks of 16, every other block",
        "16 sequences: paged_decode, blocks of 16",
    ):
        assert rows[name]["max_diff"] < 1e-5  # each equals attention() (the script checks it too)
    assert re.search(
        r"^  paged_decode, blocks of 256: [0-9.]+x the floor \(target 1.3x: (met|[0-9]+% over)\)$", text, re.M
    )
    assert "16 sequences: paged_decode, blocks of 16: " in text


def test_script_step_mode_times_flash_decode_and_torchs_fastest_in_turns(machine, monkeypatch, capsys):
    """With --torch, flash_decode and torch's fastest formulation are also timed in turns (TURNS turns of two
    warm-ups and --repeats runs each, alternating), and flash_decode's aim against torch's fastest is their
    ratio there. torch is stood in for: each call of its formulations logs 't', each flash_decode call 'f'."""
    script, log = load("decode.py"), []
    step = sys.modules["decode_step"]  # decode.py --step's kernels and rows
    monkeypatch.setattr(sys.modules["torch_import"], "load_torch", lambda: None)
    torch_call = lambda gold: (time.sleep(0.002), log.append("t"), gold)[2]  # noqa: E731  2 ms, then the reference
    fake = lambda q, k, v, gold, args: [  # noqa: E731  the two torch rows
        (name, "one", lambda: torch_call(gold), gold) for name in ("torch SDPA (enable_gqa)", step.TORCH_FASTEST)
    ]
    monkeypatch.setattr(step, "torch_runs", fake)
    monkeypatch.setattr(step, "flash_decode", lambda *a, **kw: (log.append("f"), flash_decode(*a, **kw))[1])
    flags = ["--step", "--context", "3000", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "2"]
    assert script.main([*flags, "--torch"]) == 0
    # torch's fastest's row (its check, its timing), then the turns; the batch's row after them calls neither
    assert "".join(log).endswith("t" * 5 + ("ffff" + "tttt") * step.TURNS), "".join(log)
    out = capsys.readouterr().out
    line = re.search(
        r"^  flash_decode \(split-KV\) and torch's fastest in turns \(3 turns of 2 runs each\): "
        r"([0-9.]+) and ([0-9.]+) ms, ([0-9.]+)x$",
        out,
        re.M,
    )
    assert line, out
    ratio = float(line[1]) / float(line[2])
    aim = re.search(r"^  flash_decode \(split-KV\): [0-9.]+x the floor .*; ([0-9.]+)x torch's fastest", out, re.M)
    assert aim and float(aim[1]) == pytest.approx(ratio, abs=0.02), out


def test_script_step_mode_floor_reads_the_bytes_once_on_one_and_two_threads():
    load("decode.py")
    script = sys.modules["decode_step"]
    reads = []
    arrays = [type("Array", (), {"sum": lambda self, i=i: reads.append(i)})() for i in range(2)]
    script.read_once(arrays, threads=1)
    script.read_once(arrays, threads=2)
    assert sorted(reads) == [0, 0, 1, 1]


def test_script_step_mode_scatters_blocks_on_request():
    k = v = np.zeros((2, 100, 4), np.float32)
    load("decode.py")
    paged = sys.modules["decode_step"].paged
    cache, (seq,) = paged([100], k, v, 16, True)
    table = cache.block_table(seq)
    assert len(table) == 7 and all(b % 2 == 0 for b in table)  # every other block: no two adjacent
    cache, (seq,) = paged([100], k, v, 16, False)
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
        load("decode.py").parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


# --- Ctrl-C prints what was measured, says so in one line, exits 130 ------------------------------


def test_ctrl_c_in_decode_keeps_the_rows_so_far(tmp_path: Path) -> None:
    figures = tmp_path / "decode.json"
    flags = ["--tokens", "1200", "--json", str(figures)]  # the first row at 158 tokens, the next seven longer
    code, out, err = interrupt(tmp_path, ["scripts/decode.py", *flags], after=r"context \d+: row measured")
    assert code == 130 and "Traceback" not in err, err
    assert "1) 1200 tokens after a 8-token prompt" in out and "interrupted (Ctrl-C) after" in out
    assert json.loads(figures.read_text())["rows"][0]["context"] == 8 + 1200 // 8


# --- the whole run estimated up front -------------------------------------------------------------


def test_decode_refuses_a_model_larger_than_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        load("decode.py").parse_args(["--d-model", "4096", "--vocab", "1000000", "--tokens", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "this run needs about" in err and "lower --d-model, --vocab, --layers or --tokens" in err


def test_decode_refuses_a_run_longer_than_the_limit(machine: ModuleType) -> None:
    decode = load("decode.py")
    with pytest.raises(SystemExit, match=r"decode.py: error: this run needs at least [0-9,]+ minutes"):
        decode.main(["--tokens", "4000", "--d-model", "1024", "--layers", "16"])
    assert decode.run_flops(decode.parse_args([])) / 100e9 < 60  # the default: seconds at 100 GFLOP/s
