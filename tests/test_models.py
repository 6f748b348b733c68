"""models.py: RoPE and window fields from config.json, multimodal configs, strict JSON booleans, model_bill
for one context; and the window parameter of memory.py's estimates."""

from __future__ import annotations

import dataclasses
import importlib
import json

import numpy as np
import pytest

import tinyattn_np
from tinyattn_np import memory
from tinyattn_np.bill import model_bill
from tinyattn_np.hf_config import load_model_shape
from tinyattn_np.masks import window_mask
from tinyattn_np.memory import attention_flops, causal_entries
from tinyattn_np.models import ModelShape
from tinyattn_np.position import rope_frequencies
from tinyattn_np.presets import LLAMA31_ROPE_SCALING, PRESETS

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
    homes = {
        "ModelShape": "models",
        "model_bill": "bill",
        "PRESETS": "presets",
        "Experts": "model_parts",
        "load_model_shape": "hf_config",
        "shape_from_config": "hf_config",
    }
    for name, home in homes.items():
        assert getattr(tinyattn_np, name) is getattr(importlib.import_module(f"tinyattn_np.{home}"), name)
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
        **LLAMA_31_8B,
        "model_type": "phi3",
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    }
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


@pytest.mark.parametrize(
    ("field", "model_type"),
    [("tie_word_embeddings", "llama"), ("use_sliding_window", "qwen2"), ("attention_bias", "llama")],
)
def test_json_booleans_must_be_booleans(field, model_type):
    with pytest.raises(ValueError, match=f"config field '{field}' must be true or false; got 'false' \\(str\\)"):
        load_model_shape({**LLAMA_31_8B, "model_type": model_type, field: "false"})


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
    dense = ModelShape(**{**mistral.__dict__, "sliding_window": None, "layer_types": None})
    n = 32768
    sizes = dict(heads=32, head_dim=128, causal=True)
    assert mistral.attention_flops(n) == 32 * attention_flops(n, window=4096, **sizes)
    assert dense.attention_flops(n) == 32 * attention_flops(n, **sizes)
    assert mistral.attention_flops(4096) == dense.attention_flops(4096)  # the window only bites past 4,096
    half = 21 * attention_flops(n, heads=16, head_dim=256, causal=True)
    assert gemma.attention_flops(n) == half + 21 * attention_flops(n, heads=16, head_dim=256, causal=True, window=4096)
    assert model_bill(mistral, n)["contexts"][0]["attention_flops"] == mistral.attention_flops(n)


def test_mistral_config_slides_on_every_layer_and_zero_window_layers_on_none():
    mistral = {
        **LLAMA_31_8B,
        "model_type": "mistral",
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    }
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
    config = {
        **LLAMA_31_8B,
        "max_position_embeddings": 16384,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    shape = load_model_shape(config)
    assert shape.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}
    expected = rope_frequencies(128, 500000.0, scaling=shape.rope_scaling, seq_len=32768, max_position_embeddings=16384)
    np.testing.assert_array_equal(shape.rope_frequencies(seq_len=32768), expected)
    base = 500000.0 * (2 * 32768 / 16384 - 1) ** (128 / 126)
    np.testing.assert_allclose(expected, base ** (-np.arange(0, 128, 2) / 128), rtol=1e-13)
    no_max = {**config, "max_position_embeddings": None}
    with pytest.raises(ValueError, match="'dynamic' needs the trained length L0 from max_position_embeddings="):
        load_model_shape(no_max)


PHI3_LONGROPE = {
    **LLAMA_31_8B,
    "model_type": "phi3",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 4096,
    "hidden_size": 3072,
    "num_key_value_heads": 32,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
}


@pytest.mark.parametrize(
    ("rope_scaling", "error", "message"),
    [
        ({"rope_type": "linear", "factor": "2"}, TypeError, r"scaling\['factor'\] must be a number > 0; got '2'"),
        ({"rope_type": "linear", "factor": -2}, ValueError, r"scaling\['factor'\] must be a finite number > 0; got -2"),
        (
            {**PHI3_LONGROPE["rope_scaling"], "long_factor": [2.0] * 47},
            ValueError,
            r"scaling\['long_factor'\] must be 48 positive numbers \(one per pair\); got 47",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, ValueError, r"scaling\['beta_fast'\] must be a finite"),
    ],
)
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
    monkeypatch.setattr(tinyattn_np.hf_config.files, "MAX_CONFIG_BYTES", 100)
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


# --- every architecture's rule, by hand-counted small configs -----------------------------------------------
# A tiny decoder: C = 8, 2 query heads over 1 kv head of 4, an MLP of 12, vocab 10, 2 layers. As Llama builds it:
#   embeddings 10·8 + lm_head 10·8 = 160
#   a layer: q 8·8 + k 8·4 + v 8·4 + o 8·8 = 192, gate/up/down 3·8·12 = 288, two RMSNorms 2·8 = 16: 496
#   2 layers 992 + the final norm 8: 1,160 in all
TINY = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 12,
    "vocab_size": 10,
    "num_hidden_layers": 2,
}
LAYER_ATTENTION, LAYER_MLP, LAYER_NORMS = 192, 288, 16


def tiny(**change):
    return load_model_shape({**TINY, **change})


def test_the_tiny_llama_by_hand():
    shape = tiny()
    assert (shape.attention_parameters, shape.mlp_parameters) == (LAYER_ATTENTION, LAYER_MLP)
    assert shape.num_parameters == 160 + 2 * (LAYER_ATTENTION + LAYER_MLP + LAYER_NORMS) + 8 == 1_160
    assert shape.active_parameters == shape.num_parameters and shape.architecture == "llama"
    assert tiny(tie_word_embeddings=True).num_parameters == 1_160 - 80  # one table, read twice


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        # llama's attention_bias: q 8 + k 4 + v 4 + o 8 per layer; mlp_bias: gate 12 + up 12 + down 8
        ({"attention_bias": True}, 2 * 24),
        ({"mlp_bias": True}, 2 * 32),
        # Qwen2: q, k and v only (16 a layer), whatever the config says
        ({"model_type": "qwen2"}, 2 * 16),
        # GLM-4: q, k, v biases by default, and 4 norms a layer (2 more of 8)
        ({"model_type": "glm4"}, 2 * (16 + 16)),
        # Gemma-2: tied (-80), 4 norms a layer (+16 a layer)
        ({"model_type": "gemma2"}, -80 + 2 * 16),
        # Qwen3: a norm of E = 4 on q and one on k, every layer; Gemma-3 too, tied and with 4 norms
        ({"model_type": "qwen3"}, 2 * 8),
        ({"model_type": "gemma3_text"}, -80 + 2 * (8 + 16)),
        # OLMo-2: q_norm over all 2·4 and k_norm over 1·4 (12 a layer); OLMo: LayerNorm without parameters
        ({"model_type": "olmo2"}, 2 * 12),
        ({"model_type": "olmo"}, -(2 * 16 + 8)),
        # Cohere: one LayerNorm (weight only) a layer for its parallel block (-8 a layer), tied (-80); its
        # use_qk_norm: a weight per head and channel, (2 + 1)·4 = 12 a layer
        ({"model_type": "cohere"}, -80 - 2 * 8),
        ({"model_type": "cohere", "use_qk_norm": True}, -80 - 2 * 8 + 2 * 12),
        # StableLM: LayerNorm with bias (+16 a layer, +8 final); its per-head qk_layernorm (2 + 1)·4 = 12 a layer;
        # parallel: one norm (-16 a layer)
        ({"model_type": "stablelm"}, 2 * 16 + 8),
        ({"model_type": "stablelm", "qk_layernorm": True}, 2 * (16 + 12) + 8),
        ({"model_type": "stablelm", "use_parallel_residual": True}, 8),
    ],
)
def test_each_block_rule_by_hand(change, difference):
    assert tiny(**change).num_parameters == 1_160 + difference


def test_two_matrix_mlps_and_layernorms_by_hand():
    """StarCoder2 (biases on by default), GPT-NeoX (MLP biases always, attention_bias true by default), Phi-2
    (one norm, biases everywhere, a bias on the output head): up 8·12 and down 12·8 = 192, + 12 + 8 biases."""
    plain = 2 * 8 * 12
    starcoder2 = tiny(model_type="starcoder2")  # tied, LayerNorm with bias, every bias
    assert starcoder2.num_parameters == 80 + 2 * (LAYER_ATTENTION + 24 + plain + 20 + 2 * 16) + 16
    assert tiny(model_type="starcoder2", use_bias=False).num_parameters == 80 + 2 * (LAYER_ATTENTION + plain + 32) + 16
    neox = load_model_shape({**TINY, "model_type": "gpt_neox", "num_key_value_heads": None, "head_dim": None})
    mha = 4 * 8 * 8 + 8 * 3 + 8  # 2 heads of 4 over 2 kv heads: q, k, v, o of 8·8, and their biases
    assert neox.num_parameters == 160 + 2 * (mha + plain + 20 + 2 * 16) + 16
    phi = load_model_shape({**TINY, "model_type": "phi", "num_key_value_heads": 2, "head_dim": None})
    assert phi.num_parameters == 160 + 10 + 2 * (mha + plain + 20 + 16) + 16  # lm_head's bias: 10
    assert (
        load_model_shape({**TINY, "model_type": "phi", "num_key_value_heads": 2, "qk_layernorm": True}).num_parameters
        == phi.num_parameters + 2 * 4 * 4
    )  # LayerNorm(4) on q and k, with bias


def test_falcon_multi_query_new_decoder_and_alibi():
    """Falcon: n_head / n_layer, a 2-matrix MLP of 4 x hidden (ffn_hidden_size null), tied, no bias."""
    falcon = {"model_type": "falcon", "hidden_size": 8, "n_head": 2, "n_layer": 2, "vocab_size": 10}
    mlp = 2 * 8 * 32
    mqa = load_model_shape(falcon)  # multi_query: one kv head; qkv 8·(8 + 2·4), dense 8·8; one LayerNorm (parallel)
    assert (mqa.kv_heads, mqa.norms_per_layer, mqa.positions) == (1, 1, "rope")
    assert mqa.num_parameters == 80 + 2 * (8 * 16 + 64 + mlp + 16) + 16
    new = load_model_shape({**falcon, "new_decoder_architecture": True, "num_kv_heads": 2})
    assert new.kv_heads == 2 and new.norms_per_layer == 2  # ln_attn and ln_mlp
    assert new.num_parameters == 80 + 2 * (8 * 24 + 64 + mlp + 32) + 16
    old = load_model_shape({**falcon, "multi_query": False, "parallel_attn": False, "alibi": True, "bias": True})
    assert (old.kv_heads, old.positions, old.rope_theta) == (2, "alibi", None)
    with pytest.raises(ValueError, match="has no rotary positions"):
        old.rope_frequencies()
    assert old.num_parameters == 80 + 2 * (8 * 24 + 64 + 24 + 8 + mlp + 32 + 8 + 32) + 16


def test_gpt2_names_learned_positions_and_a_head_dim_of_its_own():
    gpt2 = load_model_shape(
        {
            "model_type": "gpt2",
            "n_embd": 8,
            "n_head": 2,
            "n_layer": 2,
            "n_positions": 5,
            "vocab_size": 10,
            "n_inner": None,
        }
    )
    layer = 4 * 8 * 8 + 32 + 2 * 8 * 32 + 40 + 32  # q k v o and 4 biases of 8, MLP of 32, two LayerNorms
    assert gpt2.num_parameters == 80 + 5 * 8 + 2 * layer + 16 and gpt2.positions == "learned"
    # head_dim 6, not 8 / 2: q 8·12, k and v 8·6, o 12·8
    assert tiny(head_dim=6).attention_parameters == 8 * 12 + 2 * 8 * 6 + 12 * 8


# --- experts --------------------------------------------------------------------------------------------------


def test_mixtral_experts_total_and_active():
    """4 experts of 12 on every layer, 2 per token: a router 8·4, 4 experts of 3·8·12 = 288."""
    moe = tiny(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert moe.moe_parameters == 8 * 4 + 4 * 288
    assert moe.num_parameters == 1_160 + 2 * (32 + 3 * 288)
    assert moe.active_parameters == moe.num_parameters - 2 * 2 * 288  # 2 experts a layer it skips
    no_k = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": None}
    assert load_model_shape(no_k).active_parameters is None


def test_qwen_moe_layers_shared_expert_and_its_gate():
    """Qwen2-MoE: layer i routes unless in mlp_only_layers, every decoder_sparse_step-th; experts of
    moe_intermediate_size 6; a shared expert of 10 behind a gate of 8 -> 1."""
    config = {
        **TINY,
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "num_experts": 3,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 6,
        "shared_expert_intermediate_size": 10,
        "decoder_sparse_step": 2,
    }
    shape = load_model_shape(config)
    assert shape.experts.layers == (1, 3)
    assert shape.moe_parameters == 8 * 3 + 3 * (3 * 8 * 6) + 3 * 8 * 10 + 8
    assert load_model_shape({**config, "mlp_only_layers": [3]}).experts.layers == (1,)


def test_deepseek_dense_layers_first_and_shared_experts():
    """first_k_dense_replace 1: layer 0 dense (intermediate_size); then n_routed_experts 4 of 6, and 2 shared
    experts of 6 as one MLP of 12."""
    config = {
        **TINY,
        "model_type": "deepseek_v3",
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": None,
        "kv_lora_rank": 4,
        "q_lora_rank": None,
        "qk_rope_head_dim": 2,
        "qk_nope_head_dim": 2,
        "v_head_dim": 3,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
    }
    shape = load_model_shape(config)
    assert shape.experts.layers == (1, 2, 3) and shape.experts.shared_intermediate == 12
    assert shape.moe_parameters == 8 * 4 + 4 * (3 * 8 * 6) + 3 * 8 * 12
    # transformers' DeepSeek-V3 routes every layer from first_k_dense_replace on, whatever moe_layer_freq says
    assert load_model_shape({**config, "moe_layer_freq": 2}).experts.layers == (1, 2, 3)


def test_gpt_oss_router_and_expert_biases_and_sinks():
    config = {
        **TINY,
        "model_type": "gpt_oss",
        "num_local_experts": 3,
        "num_experts_per_tok": 1,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
    }
    shape = load_model_shape(config)
    expert = 3 * 8 * 12 + 2 * 12 + 8  # gate, up and down, and their biases
    assert shape.moe_parameters == (8 * 3 + 3) + 3 * expert  # router weights and bias
    assert shape.attention_parameters == LAYER_ATTENTION + 24 + 2  # biases on q, k, v, o; 2 sinks
    assert shape.active_parameters == shape.num_parameters - 2 * 2 * expert


def test_llama4_interleaved_moe_and_the_dense_width():
    """Llama 4: every interleave_moe_layer_step-th layer routes, to experts and one shared expert of
    intermediate_size; the other layers' MLP is intermediate_size_mlp wide; its L2 q/k norm has no weights."""
    config = {
        **TINY,
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 20,
        "attention_chunk_size": 4,
    }
    shape = load_model_shape(config)
    assert shape.experts.layers == (1, 3) and shape.intermediate == 20 and shape.qk_norm == "l2"
    assert shape.mlp_parameters == 3 * 8 * 20 and shape.moe_parameters == 8 * 2 + 2 * 288 + 288
    assert shape.layer_types == ("chunked_attention",) * 3 + ("full_attention",)  # every 4th layer has no RoPE


def test_ernie_moe_layer_range_and_its_score_bias():
    config = {
        **TINY,
        "model_type": "ernie4_5_moe",
        "num_hidden_layers": 4,
        "moe_num_experts": 2,
        "moe_k": 1,
        "moe_intermediate_size": 6,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 2,
    }
    shape = load_model_shape(config)
    assert shape.experts.layers == (1, 2) and shape.tied_embeddings
    assert shape.moe_parameters == 8 * 2 + 2 + 2 * (3 * 8 * 6) + 3 * 8 * 6  # router, correction bias, experts, shared


# --- latent attention -------------------------------------------------------------------------------------


def test_latent_attention_weights_and_cache_by_hand():
    """2 heads; kv_lora_rank 4, q_lora_rank 3, rope 2, nope 2, v 3; C = 8.
    q: 8·3 + 3 (norm) + 3·2·(2 + 2); kv: 8·(4 + 2) + 4 (norm); 4·2·(2 + 3); o: 2·3·8."""
    config = {
        **TINY,
        "model_type": "deepseek_v2",
        "num_key_value_heads": 2,
        "head_dim": None,
        "kv_lora_rank": 4,
        "q_lora_rank": 3,
        "qk_rope_head_dim": 2,
        "qk_nope_head_dim": 2,
        "v_head_dim": 3,
        "first_k_dense_replace": 2,
    }
    shape = load_model_shape(config)
    assert shape.attention_kind == "MLA" and shape.head_dim == 4 and shape.kv_width == 6
    assert shape.attention_parameters == (24 + 3 + 24) + (48 + 4) + 40 + 48 == 191
    assert load_model_shape({**config, "q_lora_rank": None}).attention_parameters == 8 * 2 * 4 + 52 + 40 + 48
    assert load_model_shape({**config, "attention_bias": True}).attention_parameters == 191 + 3 + 6 + 8
    # the cache: 4 + 2 numbers a token and layer; decompressed, 2 heads of keys 4 and values 3
    assert shape.kv_cache_bytes(10, "fp32") == 2 * 6 * 10 * 4
    assert shape.kv_cache_bytes(10, "fp32", decompressed=True) == 2 * 2 * (4 + 3) * 10 * 4
    assert shape.rotary_dim == 2 and shape.rope_frequencies().shape == (1,)


# --- layer kinds: windows, chunks, linear layers ------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "kinds"),
    [
        ({"model_type": "mistral", "sliding_window": 4}, "SSSS"),
        ({"model_type": "mistral", "sliding_window": None}, "FFFF"),
        ({"model_type": "mistral", "sliding_window": 0}, "FFFF"),  # 0: off
        ({"model_type": "qwen2", "sliding_window": 4}, "FFFF"),  # use_sliding_window false by default: off
        ({"model_type": "qwen2", "sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}, "FSSS"),
        ({"model_type": "qwen2_moe", "sliding_window": 4, "use_sliding_window": True, "max_window_layers": 3,
          "num_experts": 0}, "SFSF"),
        ({"model_type": "gemma2", "sliding_window": 4}, "SFSF"),
        ({"model_type": "gemma3_text", "sliding_window": 4, "sliding_window_pattern": 3}, "SSFS"),
        ({"model_type": "cohere2", "sliding_window": 4}, "SSSF"),
        ({"model_type": "exaone4", "sliding_window": 4, "sliding_window_pattern": "LG"}, "SFSF"),
        ({"model_type": "smollm3", "sliding_window": 4, "use_sliding_window": True, "no_rope_layers": [1, 0, 1, 0]},
         "FSFS"),
        ({"model_type": "llama4_text", "attention_chunk_size": 4, "num_local_experts": 1, "no_rope_layer_interval": 2},
         "CFCF"),
        ({"model_type": "llama4_text", "attention_chunk_size": None, "num_local_experts": 1}, "FFFF"),
        ({"model_type": "minimax", "num_local_experts": 1, "num_experts_per_tok": 1}, "FLFL"),
        ({"model_type": "mistral", "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"] * 2},
         "FSFS"),
    ],
)  # fmt: skip
def test_which_layers_slide_chunk_or_are_linear(change, kinds):
    letters = {"full_attention": "F", "sliding_attention": "S", "chunked_attention": "C", "linear_attention": "L"}
    shape = tiny(num_hidden_layers=4, **change)
    assert "".join(letters[kind] for kind in shape.layer_types) == kinds


def test_cache_by_layer_kind_by_hand():
    """4 layers of 1 kv head of 4, fp32: 2·4·4 = 32 B a token and layer. Full layers keep every token, sliding
    ones at most 4, chunked ones at most their chunk of 4, linear ones a fixed state."""
    mixed = tiny(model_type="gemma2", num_hidden_layers=4, sliding_window=4)  # S F S F
    assert mixed.kv_cache_bytes(10, "fp32") == 32 * (2 * 10 + 2 * 4)
    assert mixed.kv_bytes_per_token("fp32") == {"full_attention": 64, "sliding_attention": 64}
    chunked = tiny(
        model_type="llama4_text",
        num_hidden_layers=4,
        attention_chunk_size=4,
        num_local_experts=1,
        num_experts_per_tok=1,
    )
    assert chunked.kv_cache_bytes(10, "fp32", batch=2) == 2 * 32 * (10 + 3 * 4)
    # 2 heads, 2 (E + Ev) = 16 FLOPs a score: 3 chunked layers of 23 scores, a full one of 55
    assert chunked.attention_flops(10) == 2 * 16 * (3 * causal_entries(10, chunk=4) + causal_entries(10))
    heads = {
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 3,
        "linear_value_head_dim": 5,
    }
    linear = tiny(
        model_type="qwen3_next",
        num_hidden_layers=4,
        num_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=6,
        linear_conv_kernel_dim=2,
        **heads,
    )
    assert linear.kv_cache_bytes(10, "fp32") == 32 * 10  # one full layer (every 4th)
    # 3 linear layers: 2 value heads of a 3 x 5 state, and a convolution of 2 over 2·1·3 + 2·5 = 16 channels
    assert linear.state_bytes("fp32") == 3 * (2 * 3 * 5 + 16 * 2) * 4
    assert linear.cache_bytes(10, "fp32") == 32 * 10 + 3 * 62 * 4
    assert linear.linear_attention_parameters == 8 * (6 + 20) + 8 * 4 + 16 * 2 + 4 + 5 + 10 * 8
    assert linear.attention_parameters == 8 * 16 + 2 * 32 + 64 + 8  # q and its gate 8·16, q/k norms 4 + 4
    lightning = tiny(model_type="minimax", num_local_experts=1, num_experts_per_tok=1)  # 2 heads of a 4 x 4 state
    assert lightning.state_bytes("fp32") == 1 * 2 * 4 * 4 * 4
    assert lightning.linear_attention_parameters == 8 * 24 + 8 + 8 * 8 + 8 * 8


# --- what the reader refuses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "no_such_model"}, r"'model_type' = 'no_such_model' is not an architecture the reader knows"),
        (
            {"num_local_experts": 8},
            r"'num_local_experts' = 8 would change the bill and is not understood for "
            r"model_type 'llama'; a bill that guessed could be wrong",
        ),
        ({"kv_lora_rank": 512}, r"'kv_lora_rank' = 512 would change the bill"),
        ({"sliding_window": 4096}, r"'sliding_window' = 4096 would change the bill"),
        ({"is_encoder_decoder": True}, r"'is_encoder_decoder' = True describes a model that is not a plain decoder"),
        ({"model_type": "phi3", "attention_bias": True}, r"'attention_bias' = True is not built by transformers"),
        (
            {"model_type": "gemma2", "layer_types": ["mamba", "full_attention"]},
            r"'layer_types' = \['mamba'\] names layer kinds the reader does not know",
        ),
        (
            {"model_type": "gemma2", "sliding_window": 0, "layer_types": ["sliding_attention", "full_attention"]},
            r"'layer_types' has sliding_attention layers, but the sliding window is off",
        ),
        (
            {"model_type": "mistral", "layer_types": ["linear_attention"] * 2},
            r"'layer_types' = \['linear_attention'\] names layer kinds the reader does not know",
        ),
    ],
)
def test_what_the_reader_does_not_understand_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        tiny(**change)


def test_null_and_off_mean_off_and_notes_say_what_is_left_out():
    assert tiny(num_local_experts=None).experts is None  # null: not given
    assert tiny(model_type="qwen2_moe", sliding_window=0, num_experts=0).sliding_window is None
    text = {"model_type": "llava", "text_config": {**TINY}, "vision_config": {"hidden_size": 4}}
    assert load_model_shape(text).notes == ("the language model only (text_config): the other towers are not counted",)
    quantized = tiny(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert quantized.quantization == "fp8" and "quantized (fp8)" in quantized.notes[0]
    assert load_model_shape({key: value for key, value in TINY.items() if key != "model_type"}).notes == (
        "the config names no model_type: read as Llama",
    )


# --- the published figures, from each model's config.json ---------------------------------------------------

# huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json, the fields that make its bill
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "ep_size": 1,
    "attention_bias": False,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
# huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
QWEN25_72B = {
    "model_type": "qwen2",
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 80,
    "tie_word_embeddings": False,
}
# huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
LLAMA31_405B = {
    "model_type": "llama",
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": dict(LLAMA31_ROPE_SCALING),
    "tie_word_embeddings": False,
}


def test_the_kv_cache_per_token_of_the_deepseek_v3_report():
    """The DeepSeek-V3 report's comparison, per token in bf16: 70,272 B (the latent), 327,680 B, 516,096 B."""
    deepseek, qwen, llama = (load_model_shape(config) for config in (DEEPSEEK_V3, QWEN25_72B, LLAMA31_405B))
    assert deepseek.kv_cache_bytes(1) == 61 * (512 + 64) * 2 == 70_272
    assert qwen.kv_cache_bytes(1) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert llama.kv_cache_bytes(1) == 2 * 126 * 8 * 128 * 2 == 516_096
    assert model_bill(deepseek, 1)["kv_bytes_per_token_decompressed"] == 61 * 128 * (192 + 128) * 2


def test_deepseek_v3_is_671b_with_37b_active():
    shape = load_model_shape(DEEPSEEK_V3)
    assert shape.num_parameters == 671_026_404_352  # the "671B": no MTP layer (its note says so)
    assert 37e9 < shape.active_parameters < 38e9  # "37B activated": 8 of 256 experts a token, and the shared one
    assert shape == dataclasses.replace(PRESETS["deepseek-v3"], name="deepseek_v3")
    assert any("multi-token-prediction" in note for note in shape.notes)


def test_qwen25_72b_and_llama31_405b_parameters():
    assert load_model_shape(QWEN25_72B).num_parameters == 72_706_203_648  # "72.7B"
    assert load_model_shape(LLAMA31_405B).num_parameters == 405_853_388_800  # "405B"


# --- the kinds of layer of the newer architectures, each on a config of its own ------------------------------------

SMALL = dict(
    hidden_size=8,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=12,
    vocab_size=10,
)
MLA = dict(kv_lora_rank=4, q_lora_rank=3, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=3)
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
NEW_KINDS = {
    "kimi_linear": {
        **SMALL,
        **MLA,
        "model_type": "kimi_linear",
        "num_experts": 4,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 6,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 4,
            "short_conv_kernel_size": 3,
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
        },
    },
    "mimo_v2_flash": {
        **SMALL,
        **ROUTED,
        "model_type": "mimo_v2_flash",
        "head_dim": 6,
        "v_head_dim": 4,
        "sliding_window": 5,
    },
    "gemma4_text": {
        **SMALL,
        "model_type": "gemma4_text",
        "head_dim": 4,
        "global_head_dim": 8,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 2,
        "vocab_size_per_layer_input": 10,
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma3n_text": {
        **SMALL,
        "model_type": "gemma3n_text",
        "head_dim": 4,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 2,
        "vocab_size_per_layer_input": 10,
        "laurel_rank": 2,
        "altup_num_inputs": 2,
        "sliding_window": 5,
        "intermediate_size": [12, 8, 12, 16],
    },
    "recurrent_gemma": {
        **SMALL,
        "model_type": "recurrent_gemma",
        "lru_width": 6,
        "attention_window_size": 5,
        "block_types": ["recurrent", "attention"],
    },
    "rwkv": {"model_type": "rwkv", "hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10},
    "xlstm": {"model_type": "xlstm", "hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 10, "num_heads": 2},
    "longcat_flash": {
        **MLA,
        "model_type": "longcat_flash",
        "hidden_size": 8,
        "num_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 10,
        "head_dim": 2,
        "n_routed_experts": 4,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 6,
        "zero_expert_num": 2,
        "ffn_hidden_size": 12,
    },
    "zamba": {
        **SMALL,
        "model_type": "zamba",
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "n_mamba_heads": 2,
        "mamba_d_state": 4,
    },
    "zamba2": {
        **SMALL,
        "model_type": "zamba2",
        "n_mamba_heads": 4,
        "mamba_d_state": 4,
        "adapter_rank": 2,
        "num_mem_blocks": 2,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
    },
    "inkling_text": {
        **SMALL,
        **ROUTED,
        "model_type": "inkling_text",
        "head_dim": 4,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 2,
        "sliding_window_size": 5,
        "n_shared_experts": 1,
        "d_rel": 2,
        "rel_extent": 6,
    },
    "dots3_note_text": {
        **SMALL,
        **MLA,
        **ROUTED,
        "model_type": "dots3_note_text",
        "num_key_value_heads": 2,
        "head_dim": 8,
        "shared_experts_intermediate_size": 6,
        "index_n_heads": 2,
        "index_head_dim": 4,
        "index_topk": 3,
        "sliding_window": 5,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "swa_q_lora_rank": 3,
        "swa_kv_lora_rank": 2,
        "swa_head_dim": 4,
        "swa_qk_nope_head_dim": 2,
        "swa_v_head_dim": 2,
    },
}


def test_a_kind_of_layer_with_sizes_of_its_own_by_hand():
    """MiMo-V2-Flash: layer 0 full (1 kv head of 6, values of 4), layers 1-3 sliding (2 kv heads, and sinks)."""
    shape = load_model_shape(NEW_KINDS["mimo_v2_flash"])
    assert shape.layer_types == ("full_attention",) + ("sliding_attention",) * 3
    assert shape.kv_bytes_per_token("fp32") == {"full_attention": (6 + 4) * 4, "sliding_attention": 3 * 2 * 10 * 4}
    full, sliding = shape.attention_parameters_of("full_attention"), shape.attention_parameters_of("sliding_attention")
    assert full == 8 * (12 + 6 + 4) + 2 * 4 * 8 and sliding == 8 * (12 + 12 + 8) + 2 * 4 * 8 + 2
    assert any(
        "sliding layers: 2 query heads over 2 kv heads of 6, values of 4, sinks" in line for line in shape.describe()
    )


def test_the_fields_a_released_config_adds_must_say_what_transformers_builds():
    """MiMo's swa_ fields, Kimi's linear_attn_config: read where they agree, refused by name where not."""
    mimo = NEW_KINDS["mimo_v2_flash"]
    assert load_model_shape({**mimo, "swa_num_key_value_heads": 2, "add_swa_attention_sink_bias": True})
    with pytest.raises(ValueError, match="'swa_num_key_value_heads' = 1 is not what transformers builds"):
        load_model_shape({**mimo, "swa_num_key_value_heads": 1})
    kimi = NEW_KINDS["kimi_linear"]
    assert load_model_shape(kimi).layer_types == ("linear_attention", "full_attention") * 2
    with pytest.raises(ValueError, match="'linear_attn_config' .* must number each of the 4 layers once"):
        load_model_shape({**kimi, "linear_attn_config": {"full_attn_layers": [0, 2], "kda_layers": [1, 3]}})
    with pytest.raises(ValueError, match="holds use_full_rank_gate, which transformers does not build"):
        load_model_shape({**kimi, "linear_attn_config": {"use_full_rank_gate": True}})


def test_kv_shared_layers_cache_nothing_and_have_no_k_and_v():
    """Gemma-4: the last 2 layers read an earlier layer's keys and values; the full layers' heads of 8 have their keys
    for values (no v projection)."""
    shape = load_model_shape(NEW_KINDS["gemma4_text"])
    unshared = load_model_shape({**NEW_KINDS["gemma4_text"], "num_kv_shared_layers": 0})
    assert shape.kv_bytes_per_token("fp32") == {"full_attention": 2 * 8 * 4, "sliding_attention": 2 * 4 * 4}
    assert unshared.kv_bytes_per_token("fp32") == {"full_attention": 2 * 2 * 8 * 4, "sliding_attention": 2 * 2 * 4 * 4}
    # layer 2 (sliding) loses k and v 8·4 each and its k norm 4; layer 3 (full) k 8·8 and its norm 8 (no v: its keys
    # are its values)
    assert unshared.num_parameters - shape.num_parameters == (2 * 8 * 4 + 4) + (8 * 8 + 8)
    varying = {**NEW_KINDS["gemma4_text"], "per_layer_config": {"1": {"head_dim": 8}, "3": {"head_dim": 16}}}
    with pytest.raises(ValueError, match="varies the sizes of the full_attention layers"):
        load_model_shape(varying)


def test_shared_blocks_are_counted_once_where_transformers_ties_them():
    """Zamba2: 2 hybrid uses of 2 blocks; untied embeddings untie the blocks too, as transformers builds them."""
    tied = load_model_shape(NEW_KINDS["zamba2"])
    untied = load_model_shape({**NEW_KINDS["zamba2"], "tie_word_embeddings": False})
    assert tied.layer_types == ("mamba", "full_attention") * 2 and tied.shared_attention
    assert untied.num_parameters - tied.num_parameters == 10 * 8  # the head; each use has its own block either way
    two_uses = {**NEW_KINDS["zamba"], "layers_block_type": ["hybrid", "mamba"] * 2}
    zamba = load_model_shape(two_uses)
    one_block = [extra.parameters for extra in zamba.extras if extra.what == "the shared attention block"]
    twice = load_model_shape({**two_uses, "tie_word_embeddings": False})
    assert twice.num_parameters - zamba.num_parameters == 10 * 8 + one_block[0]  # 2 uses, each its own copy


# --- hostile configs: one clear line, never a traceback -------------------------------------------------------

HOSTILE_BASES = [
    dict(TINY),
    {
        **TINY,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 2,
        "kv_lora_rank": 4,
        "q_lora_rank": 3,
        "qk_rope_head_dim": 2,
        "qk_nope_head_dim": 2,
        "v_head_dim": 3,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
        "first_k_dense_replace": 1,
    },
    {"model_type": "mamba", "hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10},
    {**TINY, "model_type": "gemma2"},
    *NEW_KINDS.values(),
]


def nested(levels):
    """A list nested `levels` deep, built without recursion."""
    top = current = []
    for _ in range(levels):
        current.append([])
        current = current[0]
    return top


@pytest.mark.parametrize("base", HOSTILE_BASES, ids=lambda base: base["model_type"])
def test_hostile_configs_get_one_clear_line(base):
    """Every field of a config, and a few more, set to a wrong type, NaN, infinity, a negative or huge size, a
    list of the wrong length or one nested 100,000 deep: a shape, or a ValueError or TypeError of one line."""
    values = [
        None,
        float("nan"),
        float("inf"),
        -1,
        0,
        10**7,
        10**100,
        "4096",
        [1, 2],
        {"a": 1},
        True,
        3.5,
        nested(100_000),
    ]
    fields = [*base, "rope_scaling", "layer_types", "head_dim", "num_key_value_heads", "text_config", "rope_theta"]
    for field in fields:
        for value in values:
            try:
                load_model_shape({**base, field: value})
            except (TypeError, ValueError) as err:
                assert "\n" not in str(err) and len(str(err)) < 700, (field, str(err)[:200])


def test_a_huge_layer_count_is_refused_before_anything_is_built():
    """10^7 layers: refused by arithmetic, at once, not after building a table of 10^7 layer kinds."""
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"'num_hidden_layers' = 10,000,000 is larger than any model's"):
        load_model_shape({**TINY, "num_hidden_layers": 10**7})
    assert time.perf_counter() - start < 0.1
    with pytest.raises(ValueError, match=r"nests its values more than 32 levels deep"):
        load_model_shape({**TINY, "rope_scaling": nested(10_000)})


# --- the census, the defaults and the formulas ---------------------------------------------------------------


def test_the_census_sorts_every_model_type_once_and_counts_them():
    from tinyattn_np.hf_config.census import BILLED, CAUSAL_LM_MODEL_TYPES, NOT_TEXT_DECODERS, REFUSED, census

    lists = [set(CAUSAL_LM_MODEL_TYPES) & BILLED, set(REFUSED), set(NOT_TEXT_DECODERS)]
    assert set.union(*lists) == set(CAUSAL_LM_MODEL_TYPES) and sum(map(len, lists)) == len(CAUSAL_LM_MODEL_TYPES)
    counts = census()
    assert counts["billed"] + len(counts["refused"]) == counts["text_decoders"]
    assert counts["summary"].startswith("transformers 5.24.0's causal-LM mapping: 196 model types")


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("blt", r"'blt' is a text decoder the reader does not bill: bytes grouped into patches"),
        ("bart", r"'bart' is not a decoder-only text model \(an encoder-decoder"),
        ("qwen3_5", r"'qwen3_5' keeps its language model in text_config \(model_type 'qwen3_5_text'\)"),
        ("no_such_model", r"'no_such_model' is not an architecture the reader knows \(it reads \d+ model types"),
    ],
)
def test_a_model_type_the_reader_does_not_bill_is_named_with_why(model_type, message):
    with pytest.raises(ValueError, match=message):
        load_model_shape({**TINY, "model_type": model_type})


def test_a_field_left_out_takes_its_config_class_default():
    """Qwen3's head_dim 128 and Mistral's 8 kv heads, where the config leaves them out; Falcon's multi_query null
    is off; Gemma-3's vocabulary, which its config.json omits, is the class's 262,208."""
    no_head_dim = {key: value for key, value in TINY.items() if key != "head_dim"}
    assert load_model_shape({**no_head_dim, "model_type": "qwen3"}).head_dim == 128
    no_kv = {key: value for key, value in TINY.items() if key != "num_key_value_heads"}
    assert load_model_shape({**no_kv, "model_type": "mistral", "num_attention_heads": 8}).kv_heads == 8
    falcon = {
        "model_type": "falcon",
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 10,
        "multi_query": None,
    }
    assert load_model_shape(falcon).kv_heads == 2
    no_vocab = {key: value for key, value in TINY.items() if key != "vocab_size"}
    assert load_model_shape({**no_vocab, "model_type": "gemma3_text"}).vocab == 262_208
    qwen3_moe = {
        **TINY,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
        "shared_expert_intermediate_size": 99,
    }
    assert load_model_shape(qwen3_moe).experts.shared_intermediate == 0  # transformers builds no shared expert


def test_the_table_formulas():
    from tinyattn_np.hf_config.fields import Fields
    from tinyattn_np.hf_config.formulas import evaluate

    fields = Fields({"num_local_experts": 8}, "jetmoe", {})
    sizes = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=3)
    assert evaluate("2·(num_local_experts - 2)·C·Hkv·E + C", sizes, fields) == 2 * 6 * 64 * 2 * 16 + 64
    assert "num_local_experts" in fields.read
    with pytest.raises(SyntaxError, match="a table formula is"):
        evaluate("C ** 2", sizes, fields)


def test_docs_memory_names_every_model_type_the_reader_knows():
    """docs/memory.md's layer kinds list every architecture of the table, each in `backticks`."""
    from pathlib import Path

    from tinyattn_np.hf_config.census import BILLED

    page = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text(encoding="utf-8")
    missing = sorted(model_type for model_type in BILLED if f"`{model_type}`" not in page)
    assert not missing, f"docs/memory.md names none of {missing}"
