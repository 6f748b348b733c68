"""The memory bill: the articles' numbers to the byte, published parameter counts, config.json loading
and clear errors."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import bottom_right
from test_scripts import load  # a script as a module

from tinyattn_np import bytes_per_element, naive_attention_bytes
from tinyattn_np.attention import attention
from tinyattn_np.bill import model_bill
from tinyattn_np.hf_config import load_model_shape
from tinyattn_np.measure import traced_peak
from tinyattn_np.memory import (
    attention_flops,
    causal_entries,
    kv_cache_bytes,
    latent_cache_bytes,
    linear_attention_state_bytes,
    score_matrix_bytes,
)
from tinyattn_np.models import ModelShape
from tinyattn_np.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent


# --- the articles' numbers -------------------------------------------------------------------------


def test_worked_example_at_8192_tokens():
    """'Attention From Scratch': 67,108,864 entries; 134.2 MB = 128 MiB; x 32 heads x 32 layers."""
    one = score_matrix_bytes(8192, dtype="fp16")
    assert one == 8192 * 8192 * 2 == 134_217_728 == 128 * 2**20
    every = score_matrix_bytes(8192, heads=32, layers=32, dtype="fp16")
    assert every == 137_438_953_472 == 128 * 2**30
    assert round(every / 1e9, 1) == 137.4
    assert PRESETS["llama-3-8b"].weights_bytes("bf16") == 16_060_522_496  # "~16 GB"


def test_tiny_model_score_column():
    """'Train a Tiny GPT at Home, Part 2': 4 heads, 1.0 MiB at T=256 in fp32 ... 8192 MiB at 32k in fp16."""
    assert score_matrix_bytes(256, heads=4, dtype="fp32") == 2**20
    assert score_matrix_bytes(8192, heads=4, dtype="fp32") == 1024 * 2**20
    assert score_matrix_bytes(256, heads=4, dtype="fp16") == 2**19
    assert score_matrix_bytes(32768, heads=4, dtype="fp16") == 8192 * 2**20
    assert PRESETS["tiny"].num_parameters == 262_144  # qkv 196,608 + out 65,536


def test_kv_cache_per_token_bf16():
    assert PRESETS["llama-3-8b"].kv_cache_bytes(1, "bf16") == 131_072
    assert PRESETS["llama-3.1-70b"].kv_cache_bytes(1, "bf16") == 327_680
    assert PRESETS["gpt2"].kv_cache_bytes(1, "bf16") == 36_864
    assert kv_cache_bytes(8192, layers=32, kv_heads=8, head_dim=128) == 8192 * 131_072


def test_long_context_ratio():
    """1M tokens vs 8k: 125x the linear work, 125² = 15,625x the attention work."""
    short, long = (attention_flops(n, heads=1, head_dim=64) for n in (8_000, 1_000_000))
    assert long == 15_625 * short


# --- the estimates themselves ----------------------------------------------------------------------


def test_bytes_per_element():
    expected = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": Fraction(1, 2)}
    for name, size in expected.items():
        assert bytes_per_element(name) == size
    assert bytes_per_element("int4") == 0.5
    assert bytes_per_element(np.float16) == 2 and bytes_per_element(np.dtype("float64")) == 8
    assert bytes_per_element("BFloat16") == 2
    # int4 stays exact: 3 values take 2 bytes (the last half byte is padding), never a float
    assert kv_cache_bytes(3, layers=1, kv_heads=1, head_dim=1, dtype="int4") == 3
    assert score_matrix_bytes(3, 1, dtype="int4") == 2
    assert isinstance(score_matrix_bytes(8192, heads=32, layers=32, dtype="int4"), int)


def test_causal_entries_count_the_unmasked_scores():
    for n_q, n_k in [(1, 1), (5, 5), (2, 5), (7, 3), (64, 200), (200, 64)]:
        assert causal_entries(n_q, n_k) == bottom_right(n_q, n_k).sum(), (n_q, n_k)
    assert causal_entries(8192) == 8192 * 8193 // 2


def test_attention_flops():
    # QKᵀ and PV: 2 FLOPs per multiply-add, E of them per score in each
    assert attention_flops(1024, heads=4, head_dim=64) == 4 * 1024 * 1024 * 4 * 64
    assert attention_flops(4, heads=1, head_dim=8, causal=True) == 10 * 2 * 16
    assert attention_flops(2, 6, heads=1, head_dim=1, head_dim_v=3, batch=2) == 2 * 12 * 2 * 4


def test_sliding_window_caps_the_cache():
    assert kv_cache_bytes(10_000, layers=1, kv_heads=1, head_dim=1, dtype="fp32", window=4096) == 2 * 4096 * 4
    mistral, gemma = PRESETS["mistral-7b-v0.1"], PRESETS["gemma-2-9b"]
    assert mistral.kv_cache_bytes(32768) == mistral.kv_cache_bytes(4096)
    # Gemma-2: 21 layers keep 4,096 tokens, 21 keep all of them
    per_layer_token = 2 * 8 * 256 * 2
    assert gemma.kv_cache_bytes(8192) == 21 * per_layer_token * (4096 + 8192)


# --- config.json -----------------------------------------------------------------------------------

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_config_json_from_a_file(tmp_path):
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_3_8B_CONFIG))
    for source in (path, str(path), path.parent):
        shape = load_model_shape(source)
        assert shape.name == "Meta-Llama-3-8B"
        assert shape.num_parameters == 8_030_261_248
        assert (shape.head_dim, shape.kv_heads, shape.max_positions) == (128, 8, 8192)


def test_gemma2_head_dim_wins_over_hidden_over_heads():
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 3584,
        "head_dim": 256,
        "intermediate_size": 14336,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
    }
    shape = load_model_shape(config)
    assert shape.head_dim == 256  # not 3584 / 16 = 224
    assert shape == ModelShape(**{**PRESETS["gemma-2-9b"].__dict__, "name": "gemma2"})
    assert load_model_shape({**config, "head_dim": None}).head_dim == 224  # null: fall back


def test_gpt2_config_names_and_defaults():
    config = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "n_positions": 1024,
        "n_inner": None,
        "vocab_size": 50257,
    }
    shape = load_model_shape(config)
    assert (shape.intermediate, shape.kv_heads, shape.tied_embeddings) == (3072, 12, True)
    assert shape.num_parameters == 124_439_808


def test_qwen2_sliding_window_switched_off_and_qkv_bias():
    config = {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    shape = load_model_shape(config)
    assert shape.sliding_window is None and shape.qkv_bias
    assert shape.num_parameters == 7_615_616_512


def test_presets_by_name_any_case():
    assert load_model_shape("Llama-3-8B") is PRESETS["llama-3-8b"]


# --- bad input -------------------------------------------------------------------------------------


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="tokens must be an int >= 0; got -1"):
        kv_cache_bytes(-1, layers=1, kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="n_q must be an int >= 0; got -5"):
        score_matrix_bytes(-5)
    with pytest.raises(ValueError, match=r"dtype must be one of fp64, fp32, .*int4.*; got 'fp12'"):
        bytes_per_element("fp12")
    with pytest.raises(TypeError, match="dtype"):
        bytes_per_element(None)
    with pytest.raises(TypeError, match="heads must be a positive int; got 2.0"):
        score_matrix_bytes(8, heads=2.0)
    with pytest.raises(ValueError, match="layers must be a positive int; got 0"):
        score_matrix_bytes(8, layers=0)
    no_layers = {k: v for k, v in LLAMA_3_8B_CONFIG.items() if k not in ("num_hidden_layers", "model_type")}
    with pytest.raises(ValueError, match="config is missing 'num_hidden_layers'"):
        load_model_shape(no_layers)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(no_layers))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model_shape(path)
    with pytest.raises(ValueError, match="positive integer; got -8"):
        load_model_shape({**LLAMA_3_8B_CONFIG, "num_key_value_heads": -8})
    with pytest.raises(ValueError, match="preset .* or a path to a config.json; got 'llama-9'"):
        load_model_shape("llama-9")
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        load_model_shape({**LLAMA_3_8B_CONFIG, "num_key_value_heads": 5})
    with pytest.raises(ValueError, match="fp16, fp32 or fp64"):
        naive_attention_bytes(8, heads=1, head_dim=8, dtype="bf16")


# --- estimate vs tracemalloc -----------------------------------------------------------------------

HEADS, HEAD_DIM = 4, 64


def _qkv(n: int, dtype) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(n)
    return tuple(rng.standard_normal((HEADS, n, HEAD_DIM)).astype(dtype) for _ in range(3))


def _check(name: str, measured: int, estimate: int) -> None:
    ratio = measured / estimate
    assert 1 / 1.15 <= ratio <= 1.15, f"{name}: measured {measured:,} B, estimated {estimate:,} B ({ratio:.3f})"


@pytest.mark.parametrize("n", [256, 512, 1024, 2048, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_estimate_matches_tracemalloc(warm, n, causal):
    q, k, v = _qkv(n, np.float32)
    _, measured = traced_peak(attention, q, k, v, causal=causal)
    estimate = naive_attention_bytes(n, heads=HEADS, head_dim=HEAD_DIM, dtype="fp32", causal=causal)
    _check(f"attention T={n} causal={causal}", measured, estimate)


# --- the script ------------------------------------------------------------------------------------


def test_script_defaults_print_the_four_sections(capsys):
    assert load("memory.py").main([]) == 0
    text = capsys.readouterr().out
    for needle in ("134.2 MB", "128.0 MiB", "137.4 GB", "128.0 GiB", "15,625x", "125x", "Gemma-2-9B"):
        assert needle in text, needle
    assert " MB" not in text.split("2) ")[1]  # binary units after the worked example


def test_script_json_and_config_path(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B_CONFIG))
    args = ["--json", "--model", str(path), "--model", "gpt2", "--tokens", "8192,131072", "--kv-dtype", "fp8"]
    assert load("memory.py").main(args) == 0
    report = json.loads(capsys.readouterr().out)
    llama, gpt2 = report["models"]["rows"]
    assert llama["parameters"] == 8_030_261_248 and llama["kv_bytes_per_token"] == 65_536
    assert [c["beyond_max_positions"] for c in gpt2["contexts"]] == [True, True]


def test_script_architectures_prints_the_census(capsys):
    from tinyattn_np.hf_config import census

    assert load("memory.py").main(["--architectures"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(census()["summary"]) and "refused, each with why:\n  axk2: " in out
    assert "billed: afmoe, apertus," in out and "gpt-sw3" in out


def test_script_rejects_an_unknown_model(capsys):
    assert load("memory.py").main(["--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_report_helpers_for_byte_columns():
    from tinyattn_np.report import column_unit, format_sig, text_table

    assert column_unit([2**20, 2**30, 2**31]) == "GiB" and column_unit([10**6, 10**9], "decimal") == "GB"
    numbers = (0.000488, 0.5, 9.996, 15.0, 131.4, 8192)
    assert [format_sig(x) for x in numbers] == ["0.000488", "0.500", "10.0", "15.0", "131", "8,192"]
    assert "15.0" in text_table([["a", "15.0"]], ["x", "y (MiB)"])  # not reparsed into 15


def test_more_bad_inputs_name_what_is_wrong(tmp_path):
    with pytest.raises(TypeError, match="n_k must be an int >= 0; got 2.5"):
        score_matrix_bytes(4, 2.5)
    with pytest.raises(TypeError, match="causal must be True or False; got 1"):
        attention_flops(4, heads=1, head_dim=8, causal=1)
    with pytest.raises(TypeError, match="dtype must be a name such as 'bf16' or a NumPy dtype; got 3.5"):
        bytes_per_element(3.5)
    with pytest.raises(TypeError, match="numeric dtype; got <U3"):
        bytes_per_element(np.dtype("U3"))
    assert bytes_per_element(np.int8) == 1 and bytes_per_element(np.float16) == 2
    base = dict(name="m", layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=10, intermediate=64)
    with pytest.raises(ValueError, match="window_layers must be between 0 and layers=2; got 3"):
        ModelShape(**base, sliding_window=4, window_layers=3)
    with pytest.raises(ValueError, match="arch must be one of llama, gpt2, attention; got 'rnn'"):
        ModelShape(**base, arch="rnn")
    with pytest.raises(ValueError, match="gpt2-style model needs max_positions"):
        ModelShape(**base, arch="gpt2")
    with pytest.raises(TypeError, match="config must be a dict; got list"):
        from tinyattn_np.hf_config import shape_from_config

        shape_from_config([1, 2])
    # head_dim left out is hidden_size // num_attention_heads, rounded down, as transformers' LlamaConfig takes it
    assert load_model_shape({**LLAMA_3_8B_CONFIG, "hidden_size": 4097}).head_dim == 128
    with pytest.raises(ValueError, match="hidden_size 16 is smaller than num_attention_heads 32"):
        load_model_shape({**LLAMA_3_8B_CONFIG, "hidden_size": 16})
    with pytest.raises(TypeError, match="source must be a preset name, a path to a config.json or a dict; got int"):
        load_model_shape(7)
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_shape(broken)
    with pytest.raises(TypeError, match="model must be a ModelShape"):
        model_bill("llama-3-8b", [8192])


def test_a_model_shape_passes_through_and_layer_types_count_windows():
    shape = load_model_shape("llama-3-8b")
    assert load_model_shape(shape) is shape
    # a config without model_type is read as Llama, with the sliding window and layer_types it writes
    config = {**LLAMA_3_8B_CONFIG, "sliding_window": 1024, "num_hidden_layers": 4}
    del config["model_type"]
    config["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    mixed = load_model_shape(config)
    assert mixed.window_layers == 2
    per_layer = mixed.kv_cache_bytes(1) // 4
    # two layers keep every token, two keep at most 1,024
    assert mixed.kv_cache_bytes(4096) == per_layer * (2 * 4096 + 2 * 1024)
    every_layer = load_model_shape({**config, "layer_types": ["sliding_attention"] * 4})
    assert every_layer.kv_cache_bytes(4096) == per_layer * 4 * 1024


def test_naive_estimate_counts_the_window_edge(warm):
    # one narrow head: the bool masks weigh as much as the scores here, so the window's temporary shows
    n, window = 1024, 64
    q, k, v = (np.random.default_rng(1).standard_normal((1, n, 8)).astype(np.float32) for _ in range(3))
    _, measured = traced_peak(attention, q, k, v, causal=True, window=window)
    estimate = naive_attention_bytes(n, heads=1, head_dim=8, dtype="fp32", causal=True, window=window)
    _check(f"attention T={n} window={window}", measured, estimate)
    plain = naive_attention_bytes(n, heads=1, head_dim=8, dtype="fp32", causal=True)
    assert plain < estimate <= plain + n * n  # at most one more L x S bool
    with pytest.raises(ValueError, match="needs causal=True"):
        naive_attention_bytes(n, heads=1, head_dim=8, window=window)


# --- the formulas of latent attention, linear attention and chunked attention -------------------------------


def test_latent_cache_keeps_the_latent_and_the_rotary_key():
    """DeepSeek-V3: 61 layers of 512 + 64 numbers per token in bf16: 70,272 B, whatever its 128 heads."""
    assert latent_cache_bytes(1, layers=61, kv_rank=512, rope_dim=64) == 61 * 576 * 2 == 70_272
    assert latent_cache_bytes(10, layers=2, kv_rank=4, rope_dim=2, dtype="fp32", batch=3, window=4) == 2 * 6 * 4 * 3 * 4
    # decompressed, every head keeps a key of 128 + 64 and a value of 128: 4,997,120 B, 71.1 times the latent
    naive = kv_cache_bytes(1, layers=61, kv_heads=128, head_dim=192, head_dim_v=128)
    assert naive == 61 * 128 * (192 + 128) * 2 == 4_997_120
    with pytest.raises(ValueError, match="kv_rank must be a positive int; got 0"):
        latent_cache_bytes(1, layers=1, kv_rank=0, rope_dim=64)


def test_linear_attention_state_does_not_grow():
    """Qwen3-Next's 36 gated DeltaNet layers: 32 value heads of a 128 x 128 state, and a convolution of 4 over
    2·16·128 + 32·128 = 8,192 channels: (524,288 + 32,768) numbers a layer, 40,108,032 B in bf16."""
    sizes = dict(layers=36, heads=32, key_dim=128, value_dim=128, conv_channels=8192, conv_kernel=4)
    assert linear_attention_state_bytes(**sizes) == 36 * (32 * 128 * 128 + 8192 * 4) * 2 == 40_108_032
    assert linear_attention_state_bytes(**sizes, batch=3, dtype="fp32") == 3 * 2 * 40_108_032
    assert linear_attention_state_bytes(layers=1, heads=2, key_dim=3, value_dim=5) == 2 * 3 * 5 * 2  # no convolution


@pytest.mark.parametrize(("n_q", "n_k"), [(1, 1), (8, 8), (5, 13), (13, 5), (1, 17), (0, 4), (20, 20)])
@pytest.mark.parametrize("chunk", [1, 3, 4, 100])
def test_chunk_entries_count_the_chunked_mask(n_q, n_k, chunk):
    """Query i (at position p = i + S - L) sees key j when floor(j / C) = floor(p / C) and j <= p."""
    p = np.arange(n_q)[:, None] + n_k - n_q
    j = np.arange(n_k)[None, :]
    mask = (j <= p) & (j // chunk == p // chunk)
    assert causal_entries(n_q, n_k, chunk=chunk) == int(mask.sum())


def test_chunked_flops_and_their_errors():
    # 10 tokens in chunks of 4: rows keep 1, 2, 3, 4, 1, 2, 3, 4, 1, 2 keys = 23; 2 (E + Ev) = 4 FLOPs each
    assert attention_flops(10, heads=1, head_dim=1, causal=True, chunk=4) == 23 * 4
    with pytest.raises(ValueError, match="chunk=4 needs causal=True"):
        attention_flops(10, heads=1, head_dim=1, chunk=4)
    with pytest.raises(ValueError, match="a layer slides or is chunked, not both"):
        causal_entries(10, window=2, chunk=4)
