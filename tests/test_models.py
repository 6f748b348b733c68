"""models.py: RoPE and window fields from config.json, multimodal configs, strict JSON booleans, model_bill
for one context; and the window parameter of memory.py's estimates."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tinyattn_np
from tinyattn_np import memory
from tinyattn_np.masks import window_mask
from tinyattn_np.memory import attention_flops, causal_entries
from tinyattn_np.models import LLAMA31_ROPE_SCALING, PRESETS, ModelShape, load_model_shape, model_bill
from tinyattn_np.position import rope_frequencies

# huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json, the fields read here
LLAMA_31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": dict(LLAMA31_ROPE_SCALING),
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_the_names_stay_importable_where_they_were():
    for name in ("ModelShape", "PRESETS", "load_model_shape", "shape_from_config", "model_bill"):
        assert getattr(tinyattn_np, name) is getattr(tinyattn_np.models, name)
    assert not hasattr(memory, "ModelShape")  # memory.py keeps the byte and FLOP formulas only


def test_llama31_rope_fields_and_frequencies():
    shape = load_model_shape(LLAMA_31_8B)
    assert shape.rope_theta == 500000.0 and shape.rope_scaling == LLAMA31_ROPE_SCALING
    assert shape.num_parameters == 8_030_261_248
    np.testing.assert_array_equal(
        shape.rope_frequencies(), rope_frequencies(128, 500000.0, scaling=LLAMA31_ROPE_SCALING)
    )
    assert PRESETS["llama-3.1-70b"].rope_scaling == LLAMA31_ROPE_SCALING
    hash(PRESETS["llama-3.1-70b"])  # still hashable: the dict is left out of the hash
    with pytest.raises(ValueError, match="has no rotary positions"):
        PRESETS["gpt2"].rope_frequencies()


def test_rope_defaults_and_the_transformers_5_rope_parameters():
    plain = {key: value for key, value in LLAMA_31_8B.items() if key not in ("rope_scaling", "rope_theta")}
    shape = load_model_shape(plain)
    assert (shape.rope_theta, shape.rope_scaling) == (10000.0, None)  # every rotary config class's default
    v5 = {**plain, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    assert (load_model_shape(v5).rope_theta, load_model_shape(v5).rope_scaling) == (1000000.0, None)
    yarn = {**plain, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    assert load_model_shape(yarn).rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    gpt2 = load_model_shape("gpt2")
    assert gpt2.rope_theta is None


def test_top_level_rope_fields_move_into_the_scaling_dict():
    # Phi-3-mini-128k: longrope, original_max_position_embeddings at the top of config.json
    phi3 = {
        **LLAMA_31_8B, "model_type": "phi3", "rope_theta": 10000.0, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "hidden_size": 3072, "num_attention_heads": 32,
        "num_key_value_heads": 32, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                                    "long_factor": [2.0] * 48},
    }  # fmt: skip
    shape = load_model_shape(phi3)
    assert shape.rope_scaling is not None and shape.rope_scaling["original_max_position_embeddings"] == 4096
    np.testing.assert_allclose(shape.rope_frequencies(seq_len=5000), rope_frequencies(96) / 2)
    partial = load_model_shape({**LLAMA_31_8B, "rope_scaling": None, "partial_rotary_factor": 0.5})
    assert partial.rope_scaling == {"partial_rotary_factor": 0.5, "rope_type": "default"}
    assert partial.rope_frequencies().shape == (32,)


def test_multimodal_configs_load_their_text_model():
    text = {key: value for key, value in LLAMA_31_8B.items() if key != "tie_word_embeddings"}
    vision = {
        "_name_or_path": "llava-like",
        "model_type": "llava",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
    }
    shape = load_model_shape(vision)
    assert shape.name == "llava-like"
    assert shape.num_parameters == 8_030_261_248 and shape.rope_scaling == LLAMA31_ROPE_SCALING
    tied = load_model_shape({**vision, "tie_word_embeddings": True})
    assert tied.tied_embeddings and tied.num_parameters == 8_030_261_248 - 128256 * 4096


@pytest.mark.parametrize("field", ["tie_word_embeddings", "use_sliding_window", "attention_bias"])
def test_json_booleans_must_be_booleans(field):
    with pytest.raises(ValueError, match=f"config field '{field}' must be true or false; got 'false' \\(str\\)"):
        load_model_shape({**LLAMA_31_8B, field: "false"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "'su', which is unknown; known: default, linear"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing low_freq_factor"),
        ({"rope_scaling": "llama3"}, "config field 'rope_scaling' must be an object or null"),
        ({"rope_theta": 0.5}, "rope_theta must be a finite number > 1 or None; got 0.5"),
    ],
)
def test_bad_rope_fields_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        load_model_shape({**LLAMA_31_8B, **change})


def test_model_bill_takes_one_context_or_a_list():
    model = PRESETS["llama-3-8b"]
    one = model_bill(model, 8192)
    assert one["contexts"] == model_bill(model, [8192])["contexts"]
    assert one["contexts"][0]["kv_cache_bytes"] == 8192 * 131_072
    assert model_bill(model, np.int64(8192))["contexts"] == one["contexts"]
    with pytest.raises(TypeError, match="tokens must be an int or a list of ints; got str"):
        model_bill(model, "8192")
    with pytest.raises(TypeError, match="tokens must be an int or a list of ints; got bool"):
        model_bill(model, True)


# --- sliding windows in the estimates --------------------------------------------------------------


@pytest.mark.parametrize(("n_q", "n_k"), [(1, 1), (4, 4), (3, 10), (10, 3), (1, 9), (0, 5), (5, 0), (17, 17)])
@pytest.mark.parametrize("window", [1, 2, 4, 100])
def test_window_entries_count_the_band_mask(n_q, n_k, window):
    assert causal_entries(n_q, n_k, window=window) == int(window_mask(n_q, n_k, window=window).sum())


def test_window_makes_flops_linear_in_the_context():
    flops = [attention_flops(n, heads=1, head_dim=1, causal=True, window=1024) for n in (8192, 16384)]
    # 2 · (E + Ev) = 4 FLOPs per kept score; past the first window every row keeps exactly W keys
    assert flops[1] - flops[0] == 4 * 8192 * 1024
    assert attention_flops(8, heads=1, head_dim=1, causal=True, window=100) == attention_flops(
        8, heads=1, head_dim=1, causal=True
    )
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        attention_flops(8, heads=1, head_dim=1, window=4)
    with pytest.raises(ValueError, match="window must be a positive int; got 0"):
        causal_entries(8, window=0)


def test_model_flops_count_window_layers_by_their_band():
    mistral, gemma = PRESETS["mistral-7b-v0.1"], PRESETS["gemma-2-9b"]
    dense = ModelShape(**{**mistral.__dict__, "sliding_window": None})
    n = 32768
    sizes = dict(heads=32, head_dim=128, causal=True)
    assert mistral.attention_flops(n) == 32 * attention_flops(n, window=4096, **sizes)
    assert dense.attention_flops(n) == 32 * attention_flops(n, **sizes)
    assert mistral.attention_flops(4096) == dense.attention_flops(4096)  # the window only bites past 4,096
    half = 21 * attention_flops(n, heads=16, head_dim=256, causal=True)
    assert gemma.attention_flops(n) == half + 21 * attention_flops(n, heads=16, head_dim=256, causal=True, window=4096)
    assert model_bill(mistral, n)["contexts"][0]["attention_flops"] == mistral.attention_flops(n)


def test_mistral_config_slides_on_every_layer_and_zero_window_layers_on_none():
    mistral = {**LLAMA_31_8B, "model_type": "mistral", "vocab_size": 32000, "max_position_embeddings": 32768,
               "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 4096}  # fmt: skip
    shape = load_model_shape(mistral)
    assert shape == ModelShape(**{**PRESETS["mistral-7b-v0.1"].__dict__, "name": "mistral"})
    assert shape.window_layers is None and shape.kv_cache_bytes(8192) == shape.kv_cache_bytes(4096)
    none_slide = load_model_shape({**mistral, "layer_types": ["full_attention"] * 32})
    assert none_slide.window_layers == 0 and none_slide.kv_cache_bytes(8192) == 2 * none_slide.kv_cache_bytes(4096)
    assert none_slide.attention_flops(8192) == 32 * attention_flops(8192, heads=32, head_dim=128, causal=True)


# --- hostile inputs: every rope field at load, the ModelShape fields, and files that are not config.json -----


def test_dynamic_config_keeps_its_trained_length_at_max_position_embeddings():
    """load_model_shape moved a top-level original_max_position_embeddings into every scaling dict, and
    dynamic then used it as L0; transformers reads L0 from max_position_embeddings for dynamic."""
    config = {**LLAMA_31_8B, "max_position_embeddings": 16384, "original_max_position_embeddings": 4096,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}  # fmt: skip
    shape = load_model_shape(config)
    assert shape.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    expected = rope_frequencies(128, 500000.0, scaling=shape.rope_scaling, seq_len=32768, max_position_embeddings=16384)
    np.testing.assert_array_equal(shape.rope_frequencies(seq_len=32768), expected)
    base = 500000.0 * (2 * 32768 / 16384 - 1) ** (128 / 126)
    np.testing.assert_allclose(expected, base ** (-np.arange(0, 128, 2) / 128), rtol=1e-13)
    no_max = {key: value for key, value in config.items() if key != "max_position_embeddings"}
    with pytest.raises(ValueError, match="'dynamic' needs the trained length L0 from max_position_embeddings="):
        load_model_shape(no_max)


PHI3_LONGROPE = {
    **LLAMA_31_8B, "model_type": "phi3", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
    "hidden_size": 3072, "num_key_value_heads": 32,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
}  # fmt: skip


@pytest.mark.parametrize(
    ("rope_scaling", "error", "message"),
    [
        ({"rope_type": "linear", "factor": "2"}, TypeError, r"scaling\['factor'\] must be a number > 0; got '2'"),
        ({"rope_type": "linear", "factor": -2}, ValueError, r"scaling\['factor'\] must be a finite number > 0; got -2"),
        ({**PHI3_LONGROPE["rope_scaling"], "long_factor": [2.0] * 47}, ValueError,
         r"scaling\['long_factor'\] must be 48 positive numbers \(one per pair\); got 47"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, ValueError, r"scaling\['beta_fast'\] must be a finite"),
    ],
)  # fmt: skip
def test_every_rope_field_is_checked_at_load(rope_scaling, error, message):
    """These used to load, and fail (or give wrong θ) only when the frequencies were asked for."""
    with pytest.raises(error, match=message):
        load_model_shape({**PHI3_LONGROPE, "rope_scaling": rope_scaling})


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(name=3), TypeError, "name must be a str; got 3 \\(int\\)"),
        (dict(window_layers=2), ValueError, "window_layers counts the layers that use sliding_window, so it needs one"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ValueError, "rope_scaling .* needs rope_theta"),
    ],
)
def test_model_shape_fields_that_mean_nothing_alone(change, error, message):
    sizes = dict(name="x", layers=4, heads=2, kv_heads=2, head_dim=8, hidden=16, vocab=10, intermediate=32)
    with pytest.raises(error, match=message):
        ModelShape(**{**sizes, **change})


def test_files_that_are_not_a_config_json_are_named_in_a_value_error(tmp_path):
    """Deep nesting ended in a RecursionError traceback, a 5,000-character path in an OSError, a Latin-1
    file in a UnicodeDecodeError that named no file, and a bad field said nothing of where it was."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"_name_or_path": "café"}'.encode("latin-1"))
    bad_field = tmp_path / "bad" / "config.json"
    bad_field.parent.mkdir()
    bad_field.write_text(json.dumps({**LLAMA_31_8B, "rope_scaling": {"rope_type": "linear", "factor": -2}}))
    with pytest.raises(ValueError, match=f"{deep} nests its JSON too deeply to read"):
        load_model_shape(deep)
    with pytest.raises(ValueError, match=f"{latin1} is not UTF-8 text, as a config.json is: byte 0xe9 at offset 22"):
        load_model_shape(latin1)
    with pytest.raises(ValueError, match=f"{bad_field}: " + r"scaling\['factor'\] must be a finite number > 0"):
        load_model_shape(bad_field.parent)  # the folder: its config.json
    with pytest.raises(ValueError, match=r"source 'aaa.*' \(5,000 characters\) cannot be opened as a config.json"):
        load_model_shape("a" * 5000)
    with pytest.raises(ValueError, match="source must be a preset .* or a path to a config.json; got 'no-such-model'"):
        load_model_shape("no-such-model")


def test_a_file_too_big_for_a_config_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    monkeypatch.setattr(tinyattn_np.models, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(ValueError, match=r"config.json has \d{3} bytes, more than a config.json \(at most 100\)"):
        load_model_shape(path)


def test_configs_without_a_name_are_named_by_their_file(tmp_path):
    # two files in one folder must not both be called after the folder (issue 21, item 20)
    config = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "intermediate_size": 256,
    }
    folder = tmp_path / "a"
    folder.mkdir()
    for stem in ("x", "y", "config"):
        (folder / f"{stem}.json").write_text(json.dumps(config))
    names = [load_model_shape(folder / f"{stem}.json").name for stem in ("x", "y", "config")]
    assert names == ["x", "y", "a"]
    named = {**config, "_name_or_path": "org/tiny"}
    (folder / "x.json").write_text(json.dumps(named))
    assert load_model_shape(folder / "x.json").name == "org/tiny"
