"""scripts/train_speed.py --torch at a tiny size: the torch twin of the GPT, built from our weights, gives
the same losses for two training steps (clipping and AdamW included), and the table has torch's column."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tinyattn_np.gpt import GPTConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bias", [False, True])
def test_the_torch_twin_takes_the_same_two_steps(bias, monkeypatch, capsys):
    speed = load("train_speed")
    train_flags = sys.modules["train_flags"]
    config = GPTConfig(vocab=23, context=16, layers=2, heads=2, width=16, bias=bias)
    monkeypatch.setitem(train_flags.PRESETS, "tiny", train_flags.Preset(config, batch=3, lr=1e-2, warmup=2, beta2=0.99))
    assert speed.main(["--presets", "tiny", "--tokens", "8", "--repeats", "1", "--torch"]) == 0
    out = capsys.readouterr().out
    assert "ours / torch" in out and re.search(r"^tiny .* [0-9.]+$", out, re.MULTILINE)
    # the step split in two: its dense products alone, ours and torch's, and the rest of each step
    split = re.search(r"^tiny( \*)?(\s+[\d.,]+){6}$", out.split("the step's dense products alone", 1)[1], re.MULTILINE)
    assert split, out
    assert "all checks passed" in out


def test_a_wrong_twin_is_caught(monkeypatch, capsys):
    """The loss check is a real check: a torch twin whose head is not our tied embedding gives other losses."""
    speed = load("train_speed")
    train_flags = sys.modules["train_flags"]
    config = GPTConfig(vocab=23, context=16, layers=2, heads=2, width=16)
    monkeypatch.setitem(train_flags.PRESETS, "tiny", train_flags.Preset(config, batch=3, lr=1e-2, warmup=2, beta2=0.99))
    copy_weights = speed.copy_weights

    def scaled_embedding(torch, module, model):
        copy_weights(torch, module, model)
        with torch.no_grad():
            module.wte.weight *= 10

    monkeypatch.setattr(speed, "copy_weights", scaled_embedding)
    assert speed.main(["--presets", "tiny", "--tokens", "8", "--repeats", "1", "--torch"]) == 1
    assert "tiny: step 1's loss equals torch's" in capsys.readouterr().err


def test_the_twins_rope_is_ours():
    """At initialisation attention is nearly uniform, so the losses alone would not see RoPE: compare it."""
    import numpy as np
    import torch

    from tinyattn_np import rope

    load("train_speed")
    config = GPTConfig(vocab=23, context=16, layers=1, heads=2, width=16)
    x = np.random.default_rng(0).standard_normal((1, 2, 16, 8)).astype(np.float32)  # (B, H, T, d)
    twin = sys.modules["torch_gpt"]  # train_speed.py's torch twin of the GPT
    cos, sin = twin.rope_tables(torch, config)
    theirs = twin.rotate(torch, torch.from_numpy(x), cos, sin).numpy()
    np.testing.assert_allclose(theirs, rope(x), rtol=1e-5, atol=1e-6)


def small_tiny(monkeypatch):
    """train_speed.py with a small model as the tiny preset (the text's characters set the vocabulary)."""
    speed = load("train_speed")
    train_flags = sys.modules["train_flags"]
    config = GPTConfig(vocab=23, context=16, layers=2, heads=2, width=16)
    monkeypatch.setitem(train_flags.PRESETS, "tiny", train_flags.Preset(config, batch=4, lr=1e-2, warmup=2, beta2=0.99))
    return speed


def test_equal_time_trains_both_and_compares_their_validation_losses(monkeypatch, capsys, tmp_path):
    speed = small_tiny(monkeypatch)
    figures = tmp_path / "equal.json"
    assert speed.main(["--presets", "tiny", "--equal-time", "0.5", "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "3) validation loss after 0.5 s of training each" in out
    row = r"^tiny( \*)? +[0-9.]+ +[0-9,]+ +[0-9,]+ +[0-9.]+ +[0-9.]+ +[+-][0-9.]+%$"  # '*': timed on a busy machine
    assert re.search(row, out, re.MULTILINE), out
    row = json.loads(figures.read_text())["equal_time"][0]
    assert row["ours_steps"] >= 1 and row["torch_steps"] >= 1
    assert row["ours_loss"] < row["start_loss"] and row["torch_loss"] < row["start_loss"], row


def test_equal_steps_give_equal_validation_losses(monkeypatch, capsys):
    """With the clock taken out (each trains 4 steps), the two runs are the same run: the same weights,
    batches and AdamW give the same validation loss, to float32 rounding."""
    speed = small_tiny(monkeypatch)
    monkeypatch.setattr(
        speed, "train_in_turns", lambda seconds, steps, rounds: [[step(i) for i in range(4)] and 4 for step in steps]
    )
    rows = []
    monkeypatch.setattr(speed, "print_equal_time", lambda found, args: rows.extend(found))
    assert speed.main(["--presets", "tiny", "--equal-time", "1"]) == 0
    assert rows[0]["ours_steps"] == rows[0]["torch_steps"] == 4
    assert rows[0]["ours_loss"] == pytest.approx(rows[0]["torch_loss"], rel=1e-5)
    assert rows[0]["ours_loss"] < rows[0]["start_loss"] - 0.05, rows
