"""scripts/train.py --task copy (scripts/copy_task.py): its gradients are right, its Adam is Adam, fused and
reference training give the same losses, the model learns, and bad flags are clear errors. Tiny
configurations only."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from test_scripts import interrupt, load

from tinyattn_np import MultiHeadAttention
from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.optim import AdamW, clip_grad_norm, warmup_cosine_lr

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "30", "--batch", "8", "--length", "4", "--vocab", "6", "--d-model", "8", "--eval-every", "10"]


train = load("copy_task.py")
train_script = load("train.py")


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("fused", [True, False])
def test_gradient_check_passes(layers, fused):
    assert train.gradient_check(layers, fused, seed=3) < 1e-7


def test_gradient_check_catches_a_wrong_gradient(monkeypatch):
    """The check is a real check: break the residual's gradient and it reports a large error."""
    real = MultiHeadAttention.backward

    def half(self, dout, saved):
        dx, dw_qkv, dw_out = real(self, dout, saved)
        return 0.5 * dx, dw_qkv, dw_out

    monkeypatch.setattr(MultiHeadAttention, "backward", half)
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


def test_heat_map_shows_a_row_spread_over_many_keys():
    """At the random start a row spreads its weight over all its keys: past ten keys each is under 0.1, the
    lightest tenth, and still drawn (a dot), while a weight of exactly 0 stays a space."""
    T = 24
    weights = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]  # (T, T): query i spread over keys 0 .. i
    lines = train.heat_map(weights, np.arange(T) % 8, "abcdefgh").splitlines()[1:]
    for i, line in enumerate(lines):
        cells = line.split("|    ")[1]
        assert len(cells) == i + 1 and " " not in cells, f"row {i}: {line!r}"
    zero_then_one = train.heat_map(np.array([[0.5, 0.0], [0.0, 1.0]]), np.array([0, 1]), "ab").splitlines()[2]
    assert zero_then_one.endswith("|     @"), zero_then_one


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


# --- scripts/train.py: the GPT -------------------------------------------------------------------------
# A smaller model than the presets (2 layers of width 16, context 16) keeps a step to milliseconds: the tests
# patch it in as the tiny preset, in this process (small_preset) or in a subprocess (WRAPPER).

SMALL_CONFIG = dict(vocab=65, context=16, layers=2, heads=2, width=16)
WRAPPER = f"""\
import sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
import train_flags
from tinyattn_np.gpt import GPTConfig
train_flags.PRESETS["tiny"] = train_flags.Preset(GPTConfig(**{SMALL_CONFIG!r}), batch=4, lr=1e-2, warmup=2, beta2=0.99)
import train
sys.exit(train.main(sys.argv[1:]))
"""


def small_text(n_words=600, seed=0):
    """A text with something to learn: short words from a small list, in random order."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "."]
    return " ".join(np.random.default_rng(seed).choice(words, n_words))


@pytest.fixture
def small_preset(monkeypatch):
    train_flags = sys.modules["train_flags"]
    config = GPTConfig(**SMALL_CONFIG)
    monkeypatch.setitem(train_flags.PRESETS, "tiny", train_flags.Preset(config, batch=4, lr=1e-2, warmup=2, beta2=0.99))
    return train_flags


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(small_text(), encoding="utf-8")
    return path


def gpt_flags(data, out=None, *more):
    flags = ["--data", str(data), "--steps", "8", "--eval-every", "4", "--eval-windows", "8", "--sample", "0"]
    return [*flags, *(["--out", str(out)] if out else []), *more]


class CtrlCAfter:
    """Stands in for StopTogether: 'Ctrl-C' is seen after the n-th step."""

    def __init__(self, n):
        self.n, self.asked, self.terminated = n, 0, False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def pressed(self):
        self.asked += 1
        return self.asked >= self.n


def saved_arrays(folder):
    return sys.modules["checkpoint"].load(folder)[0]


def test_resume_equals_an_uninterrupted_run_bit_for_bit(small_preset, data, tmp_path, monkeypatch, capsys):
    assert train_script.main(gpt_flags(data, tmp_path / "whole")) == 0
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(3))  # Ctrl-C after step 3
        assert train_script.main(gpt_flags(data, tmp_path / "parts")) == 130
    assert "interrupted (Ctrl-C) after 3 of 8 steps" in capsys.readouterr().out
    assert train_script.main(gpt_flags(data, tmp_path / "parts", "--resume")) == 0
    assert "resumed from" in capsys.readouterr().out
    whole, parts = saved_arrays(tmp_path / "whole"), saved_arrays(tmp_path / "parts")
    assert whole.keys() == parts.keys()
    for name in whole:  # the weights, AdamW's moments and step count, every loss: the same bits
        np.testing.assert_array_equal(whole[name], parts[name], err_msg=name)


def trained_whole_and_resumed(data, tmp_path, monkeypatch, capsys, flags, changed):
    """A run with the model flags `flags`, and the same run stopped after step 3 and resumed without them: every
    array (the weights, AdamW's moments and step count, every loss) the same bits; the whole run's arrays.
    changed: the field the flags change, which the run prints as not the preset's."""
    assert train_script.main(gpt_flags(data, tmp_path / "whole", *flags)) == 0
    assert f"not the preset's: {changed}" in capsys.readouterr().out
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(3))
        assert train_script.main(gpt_flags(data, tmp_path / "parts", *flags)) == 130
    assert train_script.main(gpt_flags(data, tmp_path / "parts", "--resume")) == 0
    whole, parts = saved_arrays(tmp_path / "whole"), saved_arrays(tmp_path / "parts")
    assert whole.keys() == parts.keys()
    for name in whole:
        np.testing.assert_array_equal(whole[name], parts[name], err_msg=name)
    return whole


def test_a_hybrid_model_trains_resumes_bit_for_bit_and_decodes_through_both_caches(
    small_preset, data, tmp_path, monkeypatch, capsys
):
    """--layer-pattern LA: a gated delta layer, then softmax attention. The checkpoint keeps the pattern and the
    delta layer's weights; a run stopped after step 3 and resumed ends with the bits of one that never stopped; and
    sample.py --compare draws the same tokens through the KV cache and the delta state as by recomputation."""
    whole = trained_whole_and_resumed(data, tmp_path, monkeypatch, capsys, ["--layer-pattern", "LA"], "layer_pattern")
    assert "param.h.0.delta.w_qkv" in whole and "param.h.1.attn.w_qkv" in whole
    assert sys.modules["checkpoint"].load(tmp_path / "parts")[1]["config"]["layer_pattern"] == "LA"
    capsys.readouterr()
    assert load("sample.py").main([str(tmp_path / "parts"), "--prompt", "the cat", "--tokens", "40", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "layer pattern LA" in out and "with the KV caches and the gated delta states" in out
    assert "the two agree on all 40 tokens" in out


def test_a_learned_position_table_trains_resumes_bit_for_bit_and_old_checkpoints_read_as_rope(
    small_preset, data, tmp_path, monkeypatch, capsys
):
    """--positions learned: nanoGPT's table (wpe) in place of RoPE. The checkpoint keeps the field and the table;
    a run stopped after step 3 and resumed ends with the bits of one that never stopped; sample.py draws the same
    tokens through the caches as by recomputation past the context; the flag against a checkpoint of RoPE is
    refused by name; and a checkpoint written before the field (no positions key) reads as RoPE."""
    flags = ["--positions", "learned"]
    whole = trained_whole_and_resumed(data, tmp_path, monkeypatch, capsys, flags, "positions")
    assert whole["param.wpe"].shape == (SMALL_CONFIG["context"], 16)
    assert sys.modules["checkpoint"].load(tmp_path / "parts")[1]["config"]["positions"] == "learned"
    capsys.readouterr()
    assert load("sample.py").main([str(tmp_path / "parts"), "--prompt", "the cat", "--tokens", "40", "--compare"]) == 0
    assert "the two agree on all 40 tokens" in capsys.readouterr().out
    rope = tmp_path / "rope"
    assert train_script.main(gpt_flags(data, rope)) == 0
    assert train_script.main(gpt_flags(data, rope, "--resume", "--steps", "12", *flags)) == 2
    assert "has --positions rope, not --positions learned" in capsys.readouterr().err
    meta = json.loads((rope / "checkpoint.json").read_text(encoding="utf-8"))
    del meta["config"]["positions"]  # as a checkpoint written before the field
    (rope / "checkpoint.json").write_text(json.dumps(meta), encoding="utf-8")
    assert sys.modules["checkpoint"].load_model(rope)[0].config.positions == "rope"


def test_train_py_takes_the_steps_of_a_plain_loop_bit_for_bit(small_preset, data, tmp_path):
    """Every loss train.py prints and keeps, and its weights at the end, equal to the bit those of the plain loop
    below, written from the library's public calls alone: the same batches from the same seed, GPT.loss_and_grads,
    clip_grad_norm, AdamW at warmup_cosine_lr's rate. A change in the numbers train.py computes fails here; its
    validations and checkpoints between the steps change nothing."""
    steps, lr, warmup, batch = 12, 1e-2, 3, 4  # batch: the small preset's
    flags = ["--steps", str(steps), "--lr", str(lr), "--warmup", str(warmup), "--eval-every", "5"]
    assert train_script.main(gpt_flags(data, tmp_path / "run", *flags)) == 0
    kept = saved_arrays(tmp_path / "run")

    text = data.read_text(encoding="utf-8")
    chars = sorted(set(text))  # the char tokenizer: one id per distinct character, in order
    tokens = np.array([chars.index(c) for c in text], dtype=np.int32)  # (n,)
    train_tokens = tokens[: len(tokens) - int(round(len(tokens) * 0.1))]  # the last tenth is validated on
    model = GPT(GPTConfig(**{**SMALL_CONFIG, "vocab": len(chars)}), rng=0)  # --seed 0
    optimizer = AdamW(model.params, lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    rng, T = np.random.default_rng([0, 1]), SMALL_CONFIG["context"]  # the batches' generator: seed, then 1
    losses = []
    for step in range(steps):
        starts = rng.integers(0, len(train_tokens) - T, size=batch)  # (B,)
        windows = train_tokens[starts[:, None] + np.arange(T + 1)]  # (B, T + 1)
        loss, grads = model.loss_and_grads(windows[:, :-1], windows[:, 1:])  # y: x one token ahead
        clip_grad_norm(grads, 1.0)
        rate = warmup_cosine_lr(step, lr=lr, warmup=warmup, total=steps, min_lr=lr / 10)
        optimizer.step(model.params, grads, lr=rate)
        losses.append(loss)
    np.testing.assert_array_equal(kept["history"], np.array([np.arange(1, steps + 1), losses]).T)
    for name, weights in model.params.items():
        np.testing.assert_array_equal(kept[f"param.{name}"], weights, err_msg=name)


def test_accumulated_slices_train_as_the_whole_batch_and_resume_as_they_ran(
    small_preset, data, tmp_path, monkeypatch, capsys
):
    """--accumulate 2 (the small preset's batch of 4 in 2 slices of 2): every step's loss and the weights at the
    end those of the whole batch to float32 rounding; stopped and resumed without the flag, it goes on in
    slices (the checkpoint keeps the setting), to the same bits as a run that never stopped."""
    assert train_script.main(gpt_flags(data, tmp_path / "whole")) == 0
    assert train_script.main(gpt_flags(data, tmp_path / "sliced", "--accumulate", "2")) == 0
    assert "in 2 slices of 2 sequences (gradient accumulation)" in capsys.readouterr().out
    whole, sliced = saved_arrays(tmp_path / "whole"), saved_arrays(tmp_path / "sliced")
    np.testing.assert_allclose(sliced["history"], whole["history"], rtol=1e-5)  # (step, loss) of every step
    for name in (n for n in whole if n.startswith("param.")):
        np.testing.assert_allclose(sliced[name], whole[name], rtol=1e-4, atol=1e-6, err_msg=name)
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(3))
        assert train_script.main(gpt_flags(data, tmp_path / "parts", "--accumulate", "2")) == 130
    assert train_script.main(gpt_flags(data, tmp_path / "parts", "--resume")) == 0
    assert "in 2 slices of 2 sequences" in capsys.readouterr().out
    parts = saved_arrays(tmp_path / "parts")
    for name in sliced:
        np.testing.assert_array_equal(parts[name], sliced[name], err_msg=name)


def test_beta2_reaches_adamw_and_the_checkpoint_keeps_it(small_preset, data, tmp_path, capsys):
    """--beta2: the small preset's own 0.99 as a flag trains to the same bits as no flag, another value trains
    otherwise (the first step's update is the same for any β2: v̂ = g² then), and the checkpoint keeps it."""
    for name, flags in (("plain", []), ("same", ["--beta2", "0.99"]), ("other", ["--beta2", "0.5"])):
        assert train_script.main(gpt_flags(data, tmp_path / name, *flags)) == 0
    assert "β2 0.5, weight decay 0.1)" in capsys.readouterr().out
    plain, same, other = (saved_arrays(tmp_path / name)["history"] for name in ("plain", "same", "other"))
    np.testing.assert_array_equal(same, plain)
    np.testing.assert_array_equal(other[:2], plain[:2])
    assert not np.array_equal(other[2:], plain[2:])
    assert sys.modules["checkpoint"].load(tmp_path / "other")[1]["settings"]["beta2"] == 0.5


def test_a_run_prints_its_table_sample_plot_and_json(small_preset, data, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    flags = ["--sample", "30", "--plot", str(tmp_path / "loss.png"), "--json", str(tmp_path / "run.json")]
    assert train_script.main([*gpt_flags(data, tmp_path / "run"), *flags]) == 0
    assert not sys.modules["os_tweaks"].freed_memory_kept  # main() leaves the calling process's malloc as it was
    out = capsys.readouterr().out
    assert "data: " in out and "15 tokens)" not in out and "tied head: " in out
    assert "sample (30 tokens after ' ', the vocabulary's first token," in out  # a text of one line: no newline
    saved = json.loads((tmp_path / "run.json").read_text())
    rows = saved["rows"]
    assert saved["validation"] == 0.1  # the split the run used: the default, no --validation given
    assert [r["step"] for r in rows] == [0, 4, 8] and rows[0]["train_loss"] is None
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.3, rows  # it learns
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert f"python scripts/sample.py {tmp_path / 'run'}" in out


def test_a_loss_gone_nan_stops_and_keeps_the_last_good_checkpoint(small_preset, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_script.main([*gpt_flags(data, out, "--lr", "1e6", "--warmup", "0", "--steps", "50")]) == 1
    err = capsys.readouterr().err
    assert "the loss became nan at step" in err and "Lower --lr (now 1e+06" in err, err
    assert "RuntimeWarning" not in err  # NumPy's overflow warnings: the one message says it
    arrays, meta = sys.modules["checkpoint"].load(out)
    assert f"the last checkpoint, {out} at step 0, is kept" in err  # the one of the last validation
    assert meta["step"] == 0 and all(np.isfinite(a).all() for a in arrays.values())
    # with a learning rate that works, the run goes on from there
    assert train_script.main([*gpt_flags(data, out, "--lr", "1e-2", "--steps", "4", "--resume")]) == 0
    assert "AdamW (lr 0.01 -> 0.001, warm-up 0 steps, cosine to step 4," in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--steps", "1e20"], "--steps: must be a positive int; got '1e20'"),
        (["--steps", "20000000"], "--steps must be at most 10,000,000"),
        (["--batch", "5000"], "--batch must be at most 4,096"),
        (["--accumulate", "0"], "--accumulate: must be a positive int; got 0"),
        (["--accumulate", "5000"], "--accumulate must be at most 4,096"),
        (["--resume"], "--resume continues the checkpoint in --out DIR: give --out"),
        (["--validation", "1"], "--validation: must be a fraction between 0 and 1"),
        (["--dropout", "1"], "--weight-decay and --dropout must be numbers in [0, 1)"),
        (["--task", "copy", "--data", "x"], "unrecognized arguments: --data"),
        (["--layers", "0"], "--layers: must be a positive int; got 0"),
        (["--beta2", "1"], "--beta2: must be a fraction between 0 and 1; got 1.0"),
        (["--width", "100000"], "--width: must be a positive int at most 65,536; got 100,000"),
        (["--mlp", "relu"], "--mlp: invalid choice: 'relu'"),
    ],
)
def test_bad_gpt_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_script.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,flags,message",
    [
        ("", [], "is empty: give a text file with something in it"),
        ("abc " * 3, [], "is too short for the context: 12 tokens give 11 to train on and 1 to validate on"),
        (b"\xff\xfe caf\xe9", [], "is not UTF-8 text"),
        ("x" * 2000, ["--preset", "part3", "--batch", "4096"], "a training step needs about"),
        ("x" * 2000, ["--width", "65536", "--heads", "1"], "or take a smaller model (--preset tiny, --width,"),
        ("x" * 2000, ["--accumulate", "5"], "--batch 12 does not split into 1 process(es) x --accumulate 5 equal"),
        ("x" * 2000, ["--heads", "3"], "--heads 3: width (128) must split into 3 heads of an even size"),
        ("x" * 2000, ["--layer-pattern", "LAX"], "--layer-pattern LAX: layer_pattern must be None or a string of A"),
        ("x" * 2000, ["--context", "5000"], "is too short for the context"),
        ("x" * 2000, ["--tokenizer", "words"], "--tokenizer must be char, byte or the path of a tokenizer.json"),
        ("x" * 2000, ["--tokenizer", "/no/such/tokenizer.json"], "--tokenizer /no/such/tokenizer.json: no such file"),
    ],
)
def test_bad_data_is_a_clear_error(text, flags, message, tmp_path, capsys):
    path = tmp_path / "text.txt"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert train_script.main(["--data", str(path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and message in err, err


def test_a_checkpoint_is_continued_only_on_purpose_and_with_its_own_data(small_preset, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_script.main(gpt_flags(data, out, "--steps", "2")) == 0
    capsys.readouterr()
    assert train_script.main(gpt_flags(data, out, "--steps", "2")) == 2
    assert "holds a checkpoint already: add --resume" in capsys.readouterr().err
    assert train_script.main(gpt_flags(data, out, "--resume", "--preset", "part3")) == 2
    assert "is a tiny model; --preset part3 is another configuration" in capsys.readouterr().err
    assert train_script.main(gpt_flags(data, out, "--resume", "--steps", "2")) == 2
    assert "is at step 2 already: give --steps above it" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(small_text(seed=1))
    assert train_script.main(gpt_flags(other, out, "--resume")) == 2
    assert "this text is another: give the same --data to resume" in capsys.readouterr().err


def test_the_model_flags_shape_the_model_and_its_checkpoint_keeps_the_shape(small_preset, data, tmp_path, capsys):
    """--layers, --heads, --width, --context, --mlp, --norm and --bias in place of the preset's: the model trains in
    that shape, the checkpoint holds it, --resume goes on in it (the same flags may be given again), a flag that
    differs from the checkpoint is refused by name, and sample.py draws from it."""
    out = tmp_path / "run"
    shape = {"layers": 1, "heads": 4, "width": 32, "context": 8, "mlp": "swiglu", "norm": "rmsnorm", "bias": True}
    flags = [f"--{name}" if value is True else f"--{name} {value}" for name, value in shape.items()]
    assert train_script.main(gpt_flags(data, out, *" ".join(flags).split())) == 0
    printed = capsys.readouterr().out
    assert "GPT (tiny), 1 layer, 4 heads, width 32, context 8, swiglu MLP of 88, rmsnorm with biases," in printed
    assert "not the preset's: layers, heads, width, context, mlp, norm, bias" in printed
    meta = sys.modules["checkpoint"].load(out)[1]
    assert {name: meta["config"][name] for name in shape} == shape
    assert train_script.main(gpt_flags(data, out, "--resume", "--steps", "12", "--width", "32", "--bias")) == 0
    assert "resumed from" in capsys.readouterr().out
    assert sys.modules["checkpoint"].load(out)[1]["config"] == meta["config"]
    assert train_script.main(gpt_flags(data, out, "--resume", "--steps", "16", "--width", "64", "--no-bias")) == 2
    err = capsys.readouterr().err
    assert "has --width 32, not --width 64; has --bias, not --no-bias: that is another configuration" in err
    assert load("sample.py").main([str(out), "--prompt", "the cat", "--tokens", "12", "--compare"]) == 0
    assert "context 8" in capsys.readouterr().out


def test_resume_keeps_the_checkpoints_validation_split(small_preset, data, tmp_path, monkeypatch, capsys):
    """A run with --validation 0.2, stopped and resumed without the flag, goes on with its own split (the same bits
    as a run that never stopped), where the default 0.1 would train on other windows; another split is refused."""
    flags = ["--validation", "0.2"]
    assert train_script.main(gpt_flags(data, tmp_path / "whole", *flags)) == 0
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(3))
        assert train_script.main(gpt_flags(data, tmp_path / "parts", *flags)) == 130
    assert train_script.main(gpt_flags(data, tmp_path / "parts", "--resume")) == 0
    whole, parts = saved_arrays(tmp_path / "whole"), saved_arrays(tmp_path / "parts")
    for name in whole:
        np.testing.assert_array_equal(whole[name], parts[name], err_msg=name)
    capsys.readouterr()
    assert (
        train_script.main(gpt_flags(data, tmp_path / "parts", "--resume", "--steps", "9", "--validation", "0.1")) == 2
    )
    assert "validates on the last 0.2 of its text; --validation 0.1 is another split" in capsys.readouterr().err


def test_resume_keeps_the_checkpoints_validation_rows(small_preset, data, tmp_path, monkeypatch):
    """--eval-every and --eval-windows, given to the run that wrote the checkpoint, hold for --resume without
    them: the validations fall on the same steps and measure the same windows as a run that never stopped
    (the defaults, 25 and 64, would validate at other steps on other windows)."""
    flags = ["--data", str(data), "--steps", "9", "--eval-every", "3", "--eval-windows", "5", "--sample", "0"]
    assert train_script.main([*flags, "--out", str(tmp_path / "whole")]) == 0
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(4))
        assert train_script.main([*flags, "--out", str(tmp_path / "parts")]) == 130
    assert train_script.main(["--data", str(data), "--sample", "0", "--out", str(tmp_path / "parts"), "--resume"]) == 0
    whole, parts = (sys.modules["checkpoint"].load(tmp_path / name)[1]["rows"] for name in ("whole", "parts"))
    assert [row["step"] for row in parts] == [row["step"] for row in whole] == [0, 3, 6, 9]
    assert [row["val_loss"] for row in parts] == [row["val_loss"] for row in whole]


def test_init_from_fine_tunes_a_checkpoint_on_another_text(small_preset, data, tmp_path, capsys):
    """--init-from DIR: a new run (step 0, a new AdamW) from DIR's weights, model and tokenizer, on another text;
    its first validation loss is the trained model's on that text, far below a fresh model's. A text the
    tokenizer cannot spell, another shape, --resume beside it and --out DIR itself are refused by name."""
    assert train_script.main(gpt_flags(data, tmp_path / "pre", "--steps", "40", "--eval-every", "20")) == 0
    other = tmp_path / "other.txt"
    other.write_text(small_text(seed=3), encoding="utf-8")  # the same words in another order
    start_loss, printed = {}, {}
    for name, flags in (("tuned", ["--init-from", str(tmp_path / "pre")]), ("fresh", [])):
        capsys.readouterr()
        assert train_script.main(gpt_flags(other, tmp_path / name, *flags)) == 0
        printed[name] = capsys.readouterr().out
        meta = sys.modules["checkpoint"].load(tmp_path / name)[1]
        start_loss[name] = meta["rows"][0]["val_loss"]
        assert meta["step"] == 8  # --steps 8 from step 0: a new run, not the checkpoint's step 40 continued
    assert f"started from the weights of the checkpoint in {tmp_path / 'pre'} (--init-from)" in printed["tuned"]
    assert start_loss["tuned"] < start_loss["fresh"] - 0.5, start_loss
    zebra = tmp_path / "zebra.txt"
    zebra.write_text("zebra " * 200, encoding="utf-8")
    assert train_script.main(gpt_flags(zebra, tmp_path / "z", "--init-from", str(tmp_path / "pre"))) == 2
    err = capsys.readouterr().err
    assert f"--init-from {tmp_path / 'pre'}: its tokenizer cannot spell {zebra}: the text has 2 character(s)" in err
    flags = ["--init-from", str(tmp_path / "pre"), "--width", "32"]
    assert train_script.main(gpt_flags(other, tmp_path / "w", *flags)) == 2
    assert f"the checkpoint in {tmp_path / 'pre'} has --width 16, not --width 32" in capsys.readouterr().err
    for flags, message in ((["--resume"], "--init-from starts a new run and --resume continues one"),
                           ([], "is --init-from's own folder: give the new run another --out")):  # fmt: skip
        with pytest.raises(SystemExit):
            train_script.parse_args(gpt_flags(other, tmp_path / "pre", "--init-from", str(tmp_path / "pre"), *flags))
        assert message in capsys.readouterr().err


def test_without_data_it_trains_on_the_projects_own_pages(small_preset, capsys):
    assert train_script.main(["--steps", "1", "--eval-windows", "2", "--sample", "0"]) == 0
    out = capsys.readouterr().out
    pages = len(list((ROOT / "docs").glob("*.md")))
    assert f"data: this project's README.md and {pages} pages of docs/: " in out


def run_wrapper(tmp_path):
    """WRAPPER as a file, and the environment to run it in."""
    script = tmp_path / "train_small.py"
    script.write_text(WRAPPER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return script, env


def signal_a_run(data, tmp_path, signum):
    """Start a run of 100,000 steps (WRAPPER's small model, --out tmp_path/run), send it signum once it is
    stepping, and return (its exit code, its stdout, its stderr, the run's folder)."""
    script, env = run_wrapper(tmp_path)
    out = tmp_path / "run"
    flags = [*gpt_flags(data, out), "--steps", "100000", "--eval-every", "100000"]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        process = subprocess.Popen([sys.executable, str(script), *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=err, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        deadline = time.monotonic() + 60
        while not re.search(r"step \d+/100000", err_path.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        process.send_signal(signum)
        stdout, _ = process.communicate(timeout=60)
    return process.returncode, stdout, err_path.read_text(), out


def test_ctrl_c_keeps_a_checkpoint(data, tmp_path):
    code, stdout, stderr, out = signal_a_run(data, tmp_path, signal.SIGINT)
    assert code == 130 and "Traceback" not in stderr, stderr
    done = int(re.search(r"interrupted \(Ctrl-C\) after (\d+) of 100000 steps", stdout).group(1))
    assert done >= 1 and sys.modules["checkpoint"].load(out)[1]["step"] == done


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is missing: the distributed extra")
def test_the_data_parallel_step_equals_one_process(data, tmp_path):
    from test_ring import MPIEXEC, run_mpi

    if MPIEXEC is None:
        pytest.skip("mpiexec is missing: the distributed extra")
    script, _ = run_wrapper(tmp_path)
    figures = {}
    for ranks, more in ((1, ()), (2, ()), (2, ("--accumulate", "2"))):  # the last: 2 slices of 1 row a process
        path = tmp_path / f"{ranks}{''.join(more)}.json"
        result = run_mpi(ranks, str(script), *gpt_flags(data), "--data-parallel", *more, "--json", str(path),
                         timeout=120)  # fmt: skip
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
        assert "split over 2 processes" in result.stdout or ranks == 1, result.stdout
        said = ("scaling efficiency", "no conclusion drawn: measured on a busy machine")  # a quiet machine, a busy one
        assert any(text in result.stdout for text in said) or ranks == 1, result.stdout
        figures[ranks, more] = json.loads(path.read_text())["rows"]
    assert "in 2 slices of 1 sequence a process (gradient accumulation)" in result.stdout, result.stdout
    for split in ((2, ()), (2, ("--accumulate", "2"))):
        for one, two in zip(figures[1, ()], figures[split], strict=True):  # float32 sums in another order
            np.testing.assert_allclose(two["val_loss"], one["val_loss"], rtol=1e-5)
            if one["train_loss"] is not None:
                np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is missing: the distributed extra")
def test_a_failing_rank_ends_the_data_parallel_job(data, tmp_path):
    from test_ring import MPIEXEC, run_mpi

    if MPIEXEC is None:
        pytest.skip("mpiexec is missing: the distributed extra")
    script = tmp_path / "fail.py"
    failing = (
        "from tinyattn_np.mpi_job import load_mpi\nif load_mpi().COMM_WORLD.Get_rank() == 1:\n"
        "    train.train_step = None\n"
    )
    script.write_text(WRAPPER.replace("sys.exit(train.main", failing + "sys.exit(train.main"))
    started = time.monotonic()
    result = run_mpi(2, str(script), *gpt_flags(data), "--data-parallel", "--steps", "1000", timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 50, result.stderr
    assert "rank 1 of 2: train.py --data-parallel failed: TypeError" in result.stderr, result.stderr


# --- scripts/train_speed.py, at a tiny size (the timings themselves are not under test) ----------------


def test_train_speed_prints_both_tables(small_preset, machine, tmp_path, capsys):  # machine: a quiet one
    speed = load("train_speed.py")
    figures = tmp_path / "speed.json"
    flags = ["--presets", "tiny", "--batch", "2", "--tokens", "20", "--repeats", "1", "--json", str(figures)]
    assert speed.main(flags) == 0
    out = capsys.readouterr().out
    assert "1) a training step (forward, backward, clipping, AdamW)" in out and "ours / torch" not in out
    assert re.search(r"^tiny +7,264 +2 x 16 +[0-9,.]+ +[0-9,]+$", out, re.MULTILINE), out  # vocab 65
    assert "2) generation of 20 tokens" in out and re.search(r"^tiny( +[0-9,.]+){2} +[0-9.]+x$", out, re.MULTILINE)
    assert "all checks passed" in out
    saved = json.loads(figures.read_text())
    assert saved["training"][0]["ours_ms"] > 0 and saved["generation"][0]["cache_s"] > 0


def test_train_speed_trains_the_two_models_in_alternating_turns(monkeypatch):
    """--equal-time trains each model in --rounds turns of the time, the models taking turns, so that a machine
    whose speed drifts slows both alike (the step's times come in turns too: measure.alternating_medians_ms)."""
    speed = load("train_speed.py")
    monkeypatch.setattr(speed.machine, "SETTLE_SECONDS", 0.0)
    steps: list[list[int]] = [[], []]
    taken = speed.train_in_turns(0.03, [steps[0].append, lambda i: (steps[1].append(i), time.sleep(0.002))], 3)
    assert taken == [len(steps[0]), len(steps[1])] and steps == [list(range(n)) for n in taken]  # each in its order
    assert 3 <= taken[1] <= 18 and taken[0] > taken[1]  # 3 turns of 10 ms each; the slower model takes fewer
    with pytest.raises(SystemExit):
        speed.parse_args(["--presets", "tiny", "--repeats", "5000", "--rounds", "3"])


def test_train_speed_equal_time_says_it_needs_torch(monkeypatch, capsys):
    speed = load("train_speed.py")
    for name in ("torch", "torch.nn.functional"):
        monkeypatch.setitem(sys.modules, name, None)  # import torch now fails, as where it is not installed
    with pytest.raises(SystemExit) as stop:
        speed.main(["--presets", "tiny", "--equal-time", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--equal-time needs torch" in err and len(err.splitlines()) == 1, err


def test_train_speed_times_the_layers_at_every_row_block(tmp_path, capsys):
    """--row-blocks: each layer's row at every block size, the size layers.py takes marked, a step's worth summed
    from the rows (2L + 1 norms, L GELUs), and ROW_BLOCK as it was afterwards."""
    from tinyattn_np.tune import row_block

    speed, figures, before = load("train_speed.py"), tmp_path / "blocks.json", row_block()
    flags = ["--row-blocks", "--presets", "tiny", "--batch", "1", "--repeats", "1", "--rounds", "1"]
    assert speed.main([*flags, "--json", str(figures)]) == 0 and row_block() == before
    out = capsys.readouterr().out
    assert f"2^{before.bit_length() - 1}*" in out and "2^13" in out and "2^20" in out, out
    for layer in ("layer_norm (64 x 128)", "layer_norm backward (64 x 128)", "gelu (64 x 512)", "gelu backward"):
        assert re.search(rf"^tiny: {re.escape(layer)}.*?( +[0-9.]+){{8}}$", out, re.MULTILINE), out
    rows = json.loads(figures.read_text())["row_blocks"][0]["layers"]
    step = sum(r["per_step"] * r["ms"][0] for r in rows)
    assert [r["per_step"] for r in rows] == [9, 9, 4, 4] and f"{step:.2f}" in out.split("a step's norms and GELUs")[1]
    with pytest.raises(SystemExit):
        speed.parse_args(["--row-blocks", "--torch"])


def test_train_speed_refuses_what_would_not_fit(capsys):
    speed = load("train_speed.py")
    with pytest.raises(SystemExit):
        speed.parse_args(["--presets", "part3", "--batch", "4096", "--vocab", "1000000"])
    assert "a training step of part3 needs about" in capsys.readouterr().err


# --- Ctrl-C prints what was measured, says so in one line, exits 130 ------------------------------


def test_ctrl_c_in_train_keeps_the_table_so_far(tmp_path: Path) -> None:
    figures = tmp_path / "train.json"
    flags = ["--task", "copy", "--steps", "5000", "--no-check", "--json", str(figures)]
    code, out, err = interrupt(tmp_path, ["scripts/train.py", *flags], after=r"step 10/5000")
    assert code == 130 and "Traceback" not in err, err
    assert re.search(r"^0 +- +[0-9.]+ +[0-9.]+%$", out, re.MULTILINE), out  # the step-0 row
    assert "interrupted (Ctrl-C) after" in out and "of 201 table rows" in out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and saved["rows"][0]["step"] == 0 and saved["stopped"] == "Ctrl-C"


# --- the whole run estimated up front -------------------------------------------------------------


def test_train_refuses_every_size_flag_at_its_maximum(machine: ModuleType) -> None:
    train = load("train.py")
    flags = ["--task", "copy", "--length", "256", "--batch", "4096", "--d-model", "1024", "--layers", "8"]
    with pytest.raises(SystemExit, match=r"train.py: error: this run needs about [0-9,.]+ GiB \(the weights"):
        train.main(flags)
    with pytest.raises(SystemExit, match=r"needs at least [0-9,]+ minutes .* lower --batch"):
        train.main(["--task", "copy", "--steps", "1000000", "--batch", "4096", "--length", "8", "--no-check"])


# --- a loss gone NaN stops training with a cure, and the figures are written ----------------------


def test_train_stops_at_the_first_non_finite_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = tmp_path / "train.json"
    flags = ["--task", "copy", "--lr", "1e8", "--steps", "50", "--no-check", "--json", str(figures)]
    assert load("train.py").main(flags) == 1
    captured = capsys.readouterr()
    assert "Lower --lr (now 1e+08" in captured.err and "Traceback" not in captured.err
    assert "RuntimeWarning" not in captured.err  # NumPy's overflow warnings: the one message says it
    saved = json.loads(figures.read_text())
    assert saved["rows"][0]["step"] == 0 and "training cannot go on" in saved["stopped"]
    assert saved["interrupted"] is False


def test_os_tweaks_set_the_blas_timeout_only_before_numpy_and_never_over_the_users():
    """os_tweaks.shorten_spin() sets OPENBLAS_THREAD_TIMEOUT where NumPy is not loaded yet and the user set
    none; after NumPy's import it changes nothing (OpenBLAS read the variable already); a user's value stays.
    train.py and train_speed.py as programs start OpenBLAS with it, and train_speed.py names it."""
    script = (
        f"import os, sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import os_tweaks\n"
        "first = os_tweaks.shorten_spin(); value = os.environ.get(os_tweaks.VARIABLE)\n"
        "os.environ.pop(os_tweaks.VARIABLE); import numpy\n"
        "print(first, value, os_tweaks.shorten_spin(), os_tweaks.VARIABLE in os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                          env=env)  # fmt: skip
    assert done.stdout.split() == ["True", "18", "False", "False"]
    users_script = script.replace("first = ", "os.environ['OPENBLAS_THREAD_TIMEOUT'] = '22'; first = ")
    users = subprocess.run([sys.executable, "-c", users_script], capture_output=True, text=True, timeout=120,
                           check=True, env=env)  # fmt: skip
    assert users.stdout.split() == ["False", "22", "False", "False"]
    line = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_speed.py"), "--presets", "tiny", "--tokens",
                           "4", "--repeats", "1"], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert line.returncode == 0, line.stderr
    assert "OpenBLAS: idle threads sleep after 2^18 cycles without work (OPENBLAS_THREAD_TIMEOUT=18)" in line.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and getrusage's page faults")
def test_kept_memory_spares_the_page_faults_of_arrays_made_again():
    """os_tweaks.keep_freed_memory() (train.py sets it) takes on glibc, and an array of 64 MiB made and freed ten
    times then faults its pages in once, where by default every one of them does (getrusage's minor faults)."""
    script = (
        "import resource, sys, numpy as np\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import os_tweaks\n"
        "def faults():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(10):\n"
        "        np.ones(2**24, np.float32)  # 64 MiB, made and freed\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "plain = faults()\n"
        "kept = os_tweaks.keep_freed_memory()\n"
        "faults()  # the first array after the setting faults its pages in, once\n"
        "print(kept, plain, faults())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    kept, plain, again = done.stdout.split()
    if kept != "True":
        pytest.skip("the C library is not glibc: mallopt does not exist there")
    assert int(plain) >= 10 * 32  # each array faults in its pages: at least 32 of 2 MiB (huge pages) each
    assert int(again) < int(plain) / 10


def test_the_time_column_goes_on_after_resume(small_preset, data, tmp_path, monkeypatch, capsys):
    """Each step takes 1 s of a fake clock: the table's time column counts every step's, the ones before a
    --resume too (a run stopped at step 3 and resumed ends at 8 s, as the run that never stopped)."""
    clock = iter(range(10**6))
    monkeypatch.setattr(train_script, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    flags = ["--eval-every", "2"]
    assert train_script.main(gpt_flags(data, tmp_path / "whole", *flags)) == 0
    with monkeypatch.context() as patch:
        patch.setattr(train_script, "StopTogether", lambda **_: CtrlCAfter(3))
        assert train_script.main(gpt_flags(data, tmp_path / "parts", *flags)) == 130
    assert train_script.main(gpt_flags(data, tmp_path / "parts", "--resume", *flags)) == 0
    whole, parts = (sys.modules["checkpoint"].load(tmp_path / name)[1]["rows"] for name in ("whole", "parts"))
    assert [row["seconds"] for row in whole] == [0, 2, 4, 6, 8]
    assert [row["seconds"] for row in parts] == [0, 2, 4, 6, 8]
    assert re.search(r"^      8 .* 8\.0s$", capsys.readouterr().out, re.MULTILINE)


def test_the_docs_training_commands_are_taken_as_written(capsys):
    """Every `python scripts/train.py ...` command of docs/gpt.md parses as written: one that draws the page's own
    picture (git tracks it) says --overwrite, which --plot needs to replace a tracked picture; and --help says
    the presets' own --bias."""
    page = (ROOT / "docs" / "gpt.md").read_text(encoding="utf-8").replace("\n", " ")
    commands = re.findall(r"`python scripts/train\.py([^`]*)`", page)
    assert any("--plot docs/gpt_loss.png" in command for command in commands), commands
    plots = importlib.util.find_spec("matplotlib") is not None  # --plot is refused without the plot extra
    for command in commands:
        if "--plot" in command and not plots:
            assert "docs/gpt_loss.png" not in command or "--overwrite" in command, command
            continue
        args = train_script.parse_args(command.split())  # a refusal is SystemExit: the test fails
        assert args.plot is None or "docs/" not in args.plot or args.overwrite, command
    with pytest.raises(SystemExit):
        train_script.parse_args(["--help"])
    assert "(default: the preset's: none in tiny, biases in part3)" in " ".join(capsys.readouterr().out.split())


def test_the_parameter_count_says_its_vocabulary_and_the_presets(small_preset, data, capsys):
    """A preset's published count is at its own vocabulary (part3's 5,781,504 at 4,096): where the text's
    vocabulary is another, the model line says both."""
    assert train_script.main(gpt_flags(data, None, "--steps", "1")) == 0
    assert "tied head: 6,464 parameters (float32) at a vocabulary of 15 (7,264 at the preset's 65)" in (
        capsys.readouterr().out
    )


def test_train_speed_says_what_it_measures_as_it_goes_and_its_default_takes_seconds(capsys):
    """A line on stderr before each measurement, so that a run of minutes shows it is at work within seconds;
    the defaults are a run of seconds (the tiny preset, 256 tokens), part3 a flag away."""
    speed = load("train_speed.py")
    defaults = speed.parse_args([])
    assert defaults.presets == ["tiny"] and defaults.tokens <= 256
    assert speed.main(["--presets", "tiny", "--tokens", "8", "--repeats", "1", "--rounds", "1"]) == 0
    err = capsys.readouterr().err
    assert "tiny: a training step, 1 turns of 1 steps after 2 untimed" in err
    assert "tiny: generation of 8 tokens with the KV cache, then without one" in err
