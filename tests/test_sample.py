"""scripts/sample.py and scripts/attention.py --checkpoint, on a checkpoint that train.py wrote: cached
generation equals recomputation token for token, the speeds are printed, the induction score is what its
definition says, and every bad input (an empty prompt, characters the vocabulary lacks, --tokens 0, a folder
that holds no checkpoint, weights of another configuration, an altered file) is a clear error."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from test_scripts import load
from test_train import gpt_flags, small_text, train_script

from tinyattn_np import gpt as gpt_module
from tinyattn_np.gpt import GPTConfig

sample = load("sample.py")
attention_script = load("attention.py")
checkpoint = sys.modules["checkpoint"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of the small model (test_train's) after 40 steps on a text of short words."""
    train_flags = sys.modules["train_flags"]
    folder = tmp_path_factory.mktemp("run")
    data = folder / "text.txt"
    data.write_text(small_text(), encoding="utf-8")
    small = train_flags.Preset(GPTConfig(vocab=65, context=16, layers=2, heads=2, width=16), 4, 1e-2, 2, 0.99)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(train_flags.PRESETS, "tiny", small)
        assert train_script.main(gpt_flags(data, folder / "out", "--steps", "40", "--eval-every", "20")) == 0
    return folder / "out"


@pytest.mark.parametrize("flags", [["--temperature", "0"], ["--temperature", "1.0", "--top-k", "5", "--top-p", "0.9"]])
def test_cached_generation_equals_recomputation(trained, flags, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.modules["machine"], "load_average", lambda: 0.0)  # a quiet machine: its conclusion
    figures = tmp_path / "sample.json"
    assert (
        sample.main(
            [str(trained), "--compare", "--tokens", "40", "--prompt", "the cat", *flags, "--json", str(figures)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "\ncode: tinyattn_np " in out  # which machine and code timed it
    assert "the two agree on all 40 tokens" in out and re.search(r"the cache is [0-9.]+x faster", out), out
    assert re.search(r"40 tokens in [0-9.]+ s with the KV cache: [0-9,.]+ tokens/s", out)
    assert re.search(r"40 tokens in [0-9.]+ s without a cache \(.*\): [0-9,.]+ tokens/s", out)
    saved = json.loads(figures.read_text())
    assert saved["text"].startswith("the cat") and set(saved["runs"]) == {"cache", "no_cache"}


def test_several_samples_are_drawn_at_once_and_both_ways_agree_on_each(trained, tmp_path, capsys):
    figures = tmp_path / "samples.json"
    flags = ["--compare", "--samples", "3", "--tokens", "30", "--prompt", "the", "--temperature", "1.5"]
    assert sample.main([str(trained), *flags, "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "the two agree on all 90 tokens" in out and "3 x 30 tokens in " in out, out
    texts = json.loads(figures.read_text())["texts"]
    assert len(texts) == 3 and all(text.startswith("the") and text in out for text in texts)
    assert len(set(texts)) == 3  # three draws, not one printed three times


def test_a_prompt_read_from_a_file_is_the_same_prompt(trained, tmp_path, capsys):
    path = tmp_path / "prompt.txt"
    path.write_text("the cat", encoding="utf-8")
    saved = tmp_path / "s.json"
    for flags in (["--prompt", "the cat"], ["--prompt-file", str(path)]):
        assert sample.main([str(trained), "--tokens", "12", "--seed", "5", *flags, "--json", str(saved)]) == 0
        assert json.loads(saved.read_text())["text"].startswith("the cat")
    outs = capsys.readouterr().out.split("checkpoint: ")[1:]
    assert outs[0].split("tokens in")[0] == outs[1].split("tokens in")[0]  # the same text, drawn the same way
    empty, latin1 = tmp_path / "empty.txt", tmp_path / "latin1.txt"
    empty.write_text("")
    latin1.write_bytes(b"caf\xe9")
    for name, message in [
        ("nothing.txt", "no such file"),
        ("empty.txt", "must hold at least one token"),
        ("latin1.txt", "is not UTF-8 text"),
    ]:
        assert sample.main([str(trained), "--prompt-file", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sample.py: error: --prompt-file {tmp_path / name}") and message in err, err


def test_past_the_context_both_ways_still_agree(trained, capsys):
    """40 tokens after a 10-token prompt run past the context of 16: the cache keeps a window of 16 keys."""
    assert sample.main([str(trained), "--compare", "--tokens", "40", "--prompt", "the cat sa", "--seed", "3"]) == 0
    assert "the two agree on all 40 tokens" in capsys.readouterr().out


def test_one_way_prints_its_speed_and_the_text(trained, capsys):
    assert sample.main([str(trained), "--no-cache", "--tokens", "5", "--prompt", "a"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: " in out and "  step 40, validation loss " in out and "; GPT (tiny), " in out
    assert "without a cache" in out and "with the KV cache" not in out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tokens", "0"], "--tokens: must be a positive int; got 0"),
        (["--tokens", "1e9"], "--tokens: must be a positive int, written in digits"),
        (["--tokens", "200000"], "--tokens must be at most 100,000"),
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["--top-p", "1.5"], "--top-p: must be a number in (0, 1]"),
        (["--compare", "--no-cache"], "--compare runs both ways already"),
        (["--samples", "0"], "--samples: must be a positive int; got 0"),
        (["--samples", "2000"], "--samples must be at most 1,000"),
        (["--prompt", "a", "--prompt-file", "p.txt"], "argument --prompt-file: not allowed with argument --prompt"),
    ],
)
def test_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sample.parse_args(["somewhere", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_default_prompt_is_a_newline_or_the_first_token_where_the_vocabulary_has_none(trained, capsys):
    """Without --prompt: a newline, as train.py's own sample starts; the trained text is one line, so its
    vocabulary has no newline, and the default is its first token (' ') rather than an error."""
    tokenizer = checkpoint.load_model(trained)[1]
    default = argparse.Namespace(prompt=None, prompt_file=None)
    assert sample.encoded_prompt(tokenizer, default).tolist() == [0] and tokenizer.decode([0]) == " "
    with_newline = sys.modules["text_data"].make_tokenizer("char", "a\nb")
    assert with_newline.decode(sample.encoded_prompt(with_newline, default)) == "\n"
    assert sample.main([str(trained), "--tokens", "5"]) == 0
    printed = capsys.readouterr().out.split("-" * 80)[1]  # the sample, between its two rules
    assert len(printed) == 1 + 6 + 1 and printed.startswith("\n ")  # a line break, the prompt and 5 tokens, one more


def test_a_prompt_the_vocabulary_cannot_spell(trained, capsys):
    assert sample.main([str(trained), "--prompt", "the Zero€"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sample.py: error: --prompt: the text has 2 character(s) that the vocabulary lacks: 'Z', '€'")
    assert sample.main([str(trained), "--prompt", ""]) == 2
    assert "--prompt must hold at least one token" in capsys.readouterr().err


def test_a_folder_without_a_checkpoint(tmp_path, capsys):
    assert sample.main([str(tmp_path / "nothing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert sample.main([str(tmp_path)]) == 2
    assert "holds no checkpoint.json: it is not a checkpoint" in capsys.readouterr().err


def test_a_checkpoint_of_another_configuration(trained, tmp_path, capsys):
    arrays, meta = checkpoint.load(trained)
    meta = {k: v for k, v in meta.items() if k not in ("arrays", "arrays_sha256")}
    meta["config"] = {**meta["config"], "width": 32}  # the weights are width 16's
    checkpoint.save(tmp_path / "other", arrays, meta)
    assert sample.main([str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "'param.wte' is float32 of shape (15, 16); the model needs float32 of shape (15, 32)" in err


def test_an_altered_checkpoint_is_found(trained, tmp_path, capsys):
    arrays, meta = checkpoint.load(trained)
    copy = tmp_path / "copy"
    checkpoint.save(copy, arrays, {k: v for k, v in meta.items() if k not in ("arrays", "arrays_sha256")})
    npz = next(copy.glob("checkpoint-*.npz"))
    npz.write_bytes(npz.read_bytes()[:-10] + b"0123456789")
    assert sample.main([str(copy)]) == 2
    assert "is not the file that checkpoint.json was written with" in capsys.readouterr().err


# --- attention.py --checkpoint ------------------------------------------------------------------------


def test_attention_script_shows_the_trained_heads(trained, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    plot = tmp_path / "heads.png"
    flags = ["--checkpoint", str(trained), "--sentence", "the cat sat", "--sequences", "4", "--plot", str(plot)]
    assert attention_script.main(flags) == 0
    out = capsys.readouterr().out
    assert "7) induction score per head: 4 random sequences of 8 tokens" in out
    assert len(re.findall(r"^ +[01] +[01] +0\.\d{3} +0\.\d{3}$", out, re.MULTILINE)) == 4  # 2 layers x 2 heads
    assert "8) layer " in out and "\ntrained:\n" in out and "\nrandom:\n" in out and "all checks passed" in out
    assert plot.stat().st_size > 1000
    assert attention_script.main(["--checkpoint", str(trained), "--sentence", "the cat", "--head", "1", "0"]) == 0
    assert "8) layer 1, head 0 on 'the cat'" in capsys.readouterr().out
    assert attention_script.main(["--checkpoint", str(trained), "--sentence", "a", "--head", "2", "0"]) == 2
    assert "--head 2 0: the model has 2 layers of 2 heads" in capsys.readouterr().err
    assert attention_script.main(["--checkpoint", str(trained), "--sentence", "Zero"]) == 2
    assert "--sentence: the text has 1 character(s) that the vocabulary lacks: 'Z'" in capsys.readouterr().err


def test_layer_inputs_are_what_each_layer_reads(trained, monkeypatch):
    """attention.py's layer_inputs against the inputs GPT.hidden hands each attention layer."""
    model = checkpoint.load_model(trained)[0]
    idx = np.random.default_rng(0).integers(0, model.config.vocab, (2, 12))
    seen = []
    forward = gpt_module.multihead_forward

    def record(x, weights, **kwargs):
        seen.append(np.array(x))
        return forward(x, weights, **kwargs)

    monkeypatch.setattr(gpt_module, "multihead_forward", record)
    model.hidden(idx)
    monkeypatch.undo()
    mine = attention_script.layer_inputs(model, idx)
    assert len(seen) == len(mine) == model.config.layers
    for got, want in zip(mine, seen, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_heads_of_a_model_with_a_learned_position_table_are_its_own(monkeypatch):
    """Without RoPE, beside a learned table: each layer's weights, applied to its values and projected, give the
    output the layer gives inside GPT.hidden."""
    from dataclasses import replace

    config = replace(GPTConfig(vocab=11, context=12, layers=2, heads=2, width=16), positions="learned")
    model = gpt_module.GPT(config, rng=3)
    idx = np.random.default_rng(1).integers(0, config.vocab, (2, 12))
    seen = []
    forward = gpt_module.multihead_forward

    def record(x, weights, **kwargs):
        out = forward(x, weights, **kwargs)
        seen.append((np.array(x), np.array(out[0]), weights))
        return out

    monkeypatch.setattr(gpt_module, "multihead_forward", record)
    model.hidden(idx)
    monkeypatch.undo()
    inputs, weights = attention_script.layer_inputs(model, idx), attention_script.head_weights(model, idx)
    for h, w, (x, y, heads) in zip(inputs, weights, seen, strict=True):
        np.testing.assert_allclose(h, x, rtol=1e-5, atol=1e-6)
        v = (x @ heads.w_qkv)[..., 2 * config.width :].reshape(2, 12, config.heads, -1).swapaxes(1, 2)
        mixed = (w @ v).swapaxes(1, 2).reshape(x.shape) @ heads.w_out  # (B, T, C)
        np.testing.assert_allclose(mixed, y, rtol=1e-4, atol=1e-5)


def test_a_hybrid_model_has_no_attention_weights_to_show(trained, tmp_path, capsys, monkeypatch):
    model, tokenizer, meta, extra = checkpoint.load_model(trained)
    hybrid = gpt_module.GPT(
        GPTConfig(vocab=model.config.vocab, context=16, layers=2, heads=2, width=16, layer_pattern="LA"), rng=0
    )
    monkeypatch.setattr(checkpoint, "load_model", lambda folder: (hybrid, tokenizer, meta, extra))
    assert attention_script.main(["--checkpoint", str(trained), "--sentence", "the cat"]) == 2
    assert "layer pattern LA has gated delta layers (L), which weigh no keys" in capsys.readouterr().err


def test_uniform_attention_scores_one_over_the_keys_it_sees(trained, capsys):
    """With every query weight 0, the scores are all equal: the query at n + i spreads its weight over its
    n + i + 1 keys, and the induction score is the mean of 1 / (n + i + 1)."""
    model = checkpoint.load_model(trained)[0]
    for layer in range(model.config.layers):
        model.params[f"h.{layer}.attn.w_qkv"][:, : model.config.width] = 0  # q = 0
    n = 6
    scores = attention_script.induction_scores(model, n, sequences=3, seed=0)
    np.testing.assert_allclose(scores, np.mean(1 / np.arange(n + 1, 2 * n + 1)), rtol=1e-5)
    args = argparse.Namespace(repeat=n, sequences=3, seed=0, format="simple", plot=None)
    attention_script.induction_demo(model, model, args)
    assert "no head has learned to copy: the highest score, layer " in capsys.readouterr().out


def test_a_prompt_too_long_is_refused_before_it_is_read(trained, tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text("the cat " * 20_000, encoding="utf-8")  # 160,000 bytes
    assert sample.main([str(trained), "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sample.py: error: --prompt-file {path} holds 160,000 bytes; a prompt may hold at most")
    assert sample.main([str(trained), "--prompt", "the cat " * 20_000]) == 2
    assert "--prompt holds 160,000 bytes" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: a file that is always full (Linux)")
def test_json_to_a_full_disk_is_one_line(trained, capsys):
    with pytest.raises(SystemExit) as stop:
        sample.main([str(trained), "--tokens", "4", "--json", "/dev/full"])
    assert str(stop.value.code).endswith(": error: --json /dev/full: cannot write it (No space left on device)")
    assert "\n" not in str(stop.value.code)


def test_sample_py_runs_under_train_pys_blas_setting(trained):
    """As a program, sample.py sets OpenBLAS's idle threads to sleep soon, as train.py does (os_tweaks.py),
    before NumPy loads, and --compare names the setting beside its timings."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "sample.py"), str(trained), "--compare", "--tokens", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "OpenBLAS: idle threads sleep after 2^18 cycles without work (OPENBLAS_THREAD_TIMEOUT=18)" in done.stdout
