"""scripts/train.py --task copy (scripts/copy_task.py): its gradients are right, its Adam is Adam, fused and
reference training give the same losses, the model learns, and bad flags are clear errors. Tiny
configurations only."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "30", "--batch", "8", "--length", "4", "--vocab", "6", "--d-model", "8", "--eval-every", "10"]


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = load_script("copy_task")
train_script = load_script("train")


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_gradient_check_passes(layers, fused):
    assert train.gradient_check(layers, fused, seed=3) < 1e-7


def test_gradient_check_catches_a_wrong_gradient(monkeypatch):
    """The check is a real check: break the residual's gradient and it reports a large error."""
    real = train.MultiHeadAttention.backward

    def half(self, dout, saved):
        dx, dw_qkv, dw_out = real(self, dout, saved)
        return 0.5 * dx, dw_qkv, dw_out

    monkeypatch.setattr(train.MultiHeadAttention, "backward", half)
    assert train.gradient_check(1, True, seed=3) > 1e-3


def test_adam_first_step_moves_each_weight_by_lr():
    """At t = 1, m̂ = g and v̂ = g², so every weight moves by lr · sign(g) (up to ε)."""
    w = {"w": np.array([1.0, -2.0, 3.0])}
    adam = train.Adam(w, lr=0.1)
    adam.step({"w": np.array([0.5, -4.0, 1e-3])})
    np.testing.assert_allclose(w["w"], [0.9, -1.9, 2.9], atol=1e-6)


def test_fused_and_reference_train_to_the_same_losses():
    args = train.parse_args(TINY)
    _, fused_rows, _ = train.train(args, progress=False)
    _, ref_rows, _ = train.train(train.parse_args([*TINY, "--no-fused"]), progress=False)
    for a, b in zip(fused_rows, ref_rows, strict=True):
        # float32 sums in another order: a few ulps per step, compounded over 30 steps of Adam
        np.testing.assert_allclose(a["held_out_loss"], b["held_out_loss"], rtol=1e-4)
        if a["train_loss"] is not None:
            np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)


def test_the_model_learns_to_copy():
    args = train.parse_args(
        ["--steps", "120", "--length", "6", "--vocab", "8", "--d-model", "16", "--eval-every", "60"]
    )
    model, rows, shown = train.train(args, progress=False)
    assert rows[0]["held_out_accuracy"] < 0.3 and rows[-1]["held_out_accuracy"] > 0.9, rows
    after = shown["after"][0]  # (H, T, T): some head looks 5 back from the second copy
    assert max(train.induction_weight(w, 6) for w in after) > 0.5


def test_main_prints_table_and_heat_maps(tmp_path, capsys):
    figures = tmp_path / "train.json"
    assert train_script.main(["--task", "copy", *TINY, "--kv-heads", "1", "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "\ncode: tinyattn_np " in out  # which machine and code printed it
    assert "gradient check (float64" in out and "ok" in out
    assert "held-out accuracy" in out and "before: mean weight" in out and "after: mean weight" in out
    assert "keys " in out
    saved = json.loads(figures.read_text())
    assert len(saved["rows"]) == 4 and saved["stopped"] is None and saved["interrupted"] is False  # 0, 10, 20, 30


def test_main_draws_the_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    plot = tmp_path / "train.png"
    assert train_script.main(["--task", "copy", *TINY, "--no-check", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000


def test_heat_map_shades():
    weights = np.array([[1.0, 0.0], [0.25, 0.75]])
    lines = train.heat_map(weights, np.array([0, 1]), "ab").splitlines()
    assert lines[0] == "       keys ab" and lines[1].index("@") == lines[0].index("a")
    assert lines[1].endswith("|    @") and lines[2].endswith("|    :#")  # 0.25 -> shade 2 of 10, 0.75 -> shade 7


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--seed", "-1"], "--seed: must be an int >= 0"),
        (["--lr", "nan"], "must be a positive float"),
        (["--steps", "0"], "must be a positive int"),
        (["--vocab", "63"], "at most 62"),
        (["--length", "1"], "at least 2"),
        (["--length", "100000"], "would not finish"),
        (["--d-model", "10", "--heads", "4"], "even size"),
        (["--heads", "4", "--kv-heads", "3"], "multiple of --kv-heads"),
        (["--plot", "/no/such/folder/x.png"], "does not exist"),
        (["--heads", "4", "--d-model", "1022"], "even size"),
        (["--json", "/no/such/folder/x.json"], "does not exist"),
        (["--json", "/"], "is a folder"),
    ],
)
def test_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        train.parse_args(["--plot", str(tmp_path / "x.png")])
    assert "--plot needs matplotlib" in capsys.readouterr().err
