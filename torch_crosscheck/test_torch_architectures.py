"""Every text decoder transformers ships, billed or refused by name: the reader against the models themselves.

The census (tinyattn_np/hf_config/census.py) sorts every model type of transformers' causal-LM mapping at the
pinned version into three lists: the ones the reader bills (its ARCHITECTURES), the text decoders it refuses
(with why) and the models that are not decoder-only text models (with what they are). For each one billed:

- parameters: transformers' default config (a released model: LlamaConfig is LLaMA-7B) and small variants
  (kv heads, tied or not, biases and the switches the class has), built on the meta device, which allocates
  nothing: the bill's parameters equal sum(p.numel());
- cache: a tiny variant run forward over a few tokens, below and above its window: the bill's cache bytes
  equal the bytes of every tensor transformers' cache then holds (keys, values, an indexer's keys, the
  convolution and recurrent states), layer kind by layer kind.

A refused model type is refused by name, and its reason is the census's. The counts print at the end, as
`python scripts/memory.py --architectures` prints them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from tinyattn_np.hf_config import ARCHITECTURES, shape_from_config  # noqa: E402
from tinyattn_np.hf_config.census import BILLED as BILLED_TYPES  # noqa: E402
from tinyattn_np.hf_config.census import (  # noqa: E402
    CAUSAL_LM_MODEL_TYPES,
    NOT_TEXT_DECODERS,
    REFUSED,
    TRANSFORMERS_VERSION,
    census,
)
from tinyattn_np.hf_config.defaults import DEFAULTS  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="transformers")

MAPPING = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
BILLED = [model_type for model_type in MAPPING if model_type in BILLED_TYPES]
ROWS = [model_type for model_type in BILLED if model_type in ARCHITECTURES]  # a row of their own: variants, cache

# what a default config needs before transformers builds it at all (its class's defaults do not)
FIXES: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(head_dim=128),  # 4096 // 96 = 42 channels a head, of which half rotate: 21, an odd count
    "ministral": dict(head_dim=128),
    "hunyuan_v1_dense": dict(head_dim=128),
    "hunyuan_v1_moe": dict(head_dim=128),
    "dots1": dict(n_routed_experts=128, n_shared_experts=2, num_experts_per_tok=6),
    "nemotron": dict(num_key_value_heads=8, head_dim=128),
    "dbrx": dict(attn_config={"kv_n_heads": 8, "rope_theta": 500000.0}),
    "cohere_compass_text": dict(
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("full_attention", "sliding_attention")
        }
    ),
    "lfm2_moe": dict(layer_types=["conv", "conv", "full_attention", "conv"] * 8),
}
# the sizes of a tiny model, by the names the classes use (each applied where the class has the field)
TINY = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=8,
    attention_chunk_size=8,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    shared_expert_intermediate_size=32,
    intermediate_size_mlp=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    n_layer=4,
    n_embd=64,
    n_head=4,
    n_positions=256,
    n_inner=96,
    pad_token_id=0,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
)
# RoPE per layer kind, half of each head rotated (a tiny head's 0.334 would rotate an odd count)
ROPE_BY_KIND = {
    kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    for kind in ("full_attention", "sliding_attention")
}
GEMMA4 = dict(global_head_dim=32, layer_types=["sliding_attention", "full_attention"] * 3, num_hidden_layers=6)
# a model type's own tiny sizes, where the generic ones do not fit its class
TINY_OWN: dict[str, dict[str, Any]] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=8),
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "dbrx": dict(hidden_size=None, d_model=64,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "modernbert-decoder": dict(local_attention=16),
    "minimax_m3_vl_text": dict(rotary_dim=8),
    "cohere_compass_text": dict(rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for kind in ("full_attention", "sliding_attention")}),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=16),
    "bamba": dict(mamba_n_heads=8, mamba_d_state=16, attn_layer_indices=[1, 3]),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_state=16, shared_intermediate_size=48,
                             layer_types=["mamba", "attention", "mamba", "attention"]),
    "jamba": dict(mamba_d_state=8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2),
    "falcon_h1": dict(mamba_d_ssm=96, mamba_n_heads=8, mamba_d_state=16),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=2, moe_shared_expert_intermediate_size=48,
                       n_routed_experts=4),
    "mimo_v2_flash": dict(head_dim=24, v_head_dim=16, rope_parameters=ROPE_BY_KIND),
    "recurrent_gemma": dict(lru_width=48, attention_window_size=8),
    "dots3_note_text": dict(head_dim=32, shared_experts_intermediate_size=32, swa_num_attention_heads=2,
                            swa_num_key_value_heads=2, swa_q_lora_rank=12, swa_kv_lora_rank=8, swa_head_dim=32,
                            swa_qk_nope_head_dim=24, swa_v_head_dim=8,
                            rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25}
                                             for kind in ("indexed_attention", "sliding_attention")},
                            layer_types=["indexed_attention", "sliding_attention"] * 2),
    "inkling_text": dict(swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=8, sliding_window_size=8,
                         n_shared_experts=1, d_rel=4, rel_extent=16, local_layer_ids=[0, 2],
                         mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, n_mamba_heads=2, mamba_d_state=8, num_hidden_layers=6),
    "zamba2": dict(mamba_d_state=8, n_mamba_heads=8, adapter_rank=4, head_dim=None, num_mem_blocks=2,
                   layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid"],
                   num_hidden_layers=5),
    "gemma4_text": dict(GEMMA4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),
    "gemma3n_text": dict(GEMMA4, global_head_dim=None, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=128, laurel_rank=8, altup_num_inputs=3),
    "gemma4_unified_text": dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2),
    "longcat_flash": dict(head_dim=8, zero_expert_num=3, moe_topk=2, expert_ffn_hidden_size=32),
    "xlstm": dict(hidden_size=128, num_heads=2, ffn_proj_factor=1.5, ffn_round_up_to_multiple_of=32),
    "kimi_linear": dict(linear_num_heads=2, linear_head_dim=8, num_experts=4, num_experts_per_token=2,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
}  # fmt: skip
# more variants of a model type, each a change to its tiny config
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "xlstm": [dict(use_bias=True, qk_dim_factor=1.0)],
    "dots3_note_text": [dict(attention_bias=True, n_shared_experts=2, first_k_dense_replace=2, mlp_layer_types=None),
                        dict(use_dsa=False, q_lora_rank=20, rope_parameters=ROPE_BY_KIND)],
    "inkling_text": [dict(mlp_layer_types=None, dense_mlp_idx=2, dense_intermediate_size=80, n_shared_experts=2)],
    "zamba": [dict(attention_head_dim=8, mamba_proj_bias=True, layers_block_type=["hybrid", "mamba"] * 3)],
    "zamba2": [dict(use_shared_attention_adapter=True, add_bias_linear=True, num_mem_blocks=1, use_mem_rope=True),
               dict(num_mem_blocks=4, mamba_ngroups=2)],
    "gemma4_text": [dict(attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
                         use_double_wide_mlp=True, vocab_size_per_layer_input=96),
                    dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                         hidden_size_per_layer_input=0, attention_bias=True)],
    "gemma3n_text": [dict(intermediate_size=[96, 64, 96, 128, 96, 80], num_kv_shared_layers=0, altup_num_inputs=4,
                          vocab_size_per_layer_input=96)],
    "gemma4_unified_text": [dict(attention_k_eq_v=False, num_kv_shared_layers=0),
                            dict(use_double_wide_mlp=True, use_bidirectional_attention=None)],
    "longcat_flash": [dict(router_bias=True, attention_bias=True, zero_expert_num=0)],
    "gpt_bigcode": [dict(multi_query=False)],
    "mimo_v2_flash": [dict(num_key_value_heads=1, attention_bias=True, v_head_dim=24)],
}  # fmt: skip
# model types whose kv heads cannot be as many as the heads (MiMo-V2-Flash doubles them in its sliding layers)
FEWER_KV_HEADS = {"mimo_v2_flash"}
# model types whose config class refuses tied embeddings
UNTIED = {"dbrx"}
# model types whose transformers model keeps no cache (it recomputes every token): nothing to hold the bill to
NO_CACHE = {"openai-gpt"}
# model types whose transformers cache keeps every token of a window layer, and masks the older ones
WHOLE_WINDOWS = {"gpt_neo"}


def class_fields(model_type: str) -> set[str]:
    """The fields of the model type's config class, with the names its attribute_map accepts."""
    config = AutoConfig.for_model(model_type, **FIXES.get(model_type, {}))
    return set(config.to_dict()) | set(getattr(type(config), "attribute_map", {}))


def tiny(model_type: str) -> dict[str, Any]:
    """The overrides that make the model type tiny: TINY where its class has the field, then its own."""
    fields = class_fields(model_type)
    sizes = {key: value for key, value in TINY.items() if key in fields}
    if "kv_lora_rank" in fields:  # latent attention: head_dim is the rotary width, every head decompresses its k, v
        sizes.pop("head_dim", None)
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sizes = {**FIXES.get(model_type, {}), **sizes, **TINY_OWN.get(model_type, {})}
    return {key: value for key, value in sizes.items() if value is not None}  # None: the generic size does not fit


def variants_of(model_type: str) -> list[dict[str, Any]]:
    """The tiny config, then the same with the kv heads as many as the heads, the embeddings tied the other way,
    and the model type's own variants."""
    small = tiny(model_type)
    found = [small]
    if "num_key_value_heads" in small and model_type not in FEWER_KV_HEADS:
        found.append({**small, "num_key_value_heads": small.get("num_attention_heads", 4)})
    tied = AutoConfig.for_model(model_type, **small).to_dict().get("tie_word_embeddings")
    if isinstance(tied, bool) and model_type not in UNTIED:
        found.append({**small, "tie_word_embeddings": not tied})
    return found + [{**small, **change} for change in VARIANTS.get(model_type, [])]


def build(model_type: str, sizes: dict[str, Any], device: str = "meta") -> tuple[Any, Any]:
    """(config, model) of transformers for these sizes, on the device."""
    config = AutoConfig.for_model(model_type, **sizes)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def read(config: Any) -> Any:
    """The bill's shape of a transformers config, through JSON as a config.json would come."""
    return shape_from_config(json.loads(json.dumps(config.to_dict(), default=str)))


def parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# --- the census ---------------------------------------------------------------------------------------


def test_the_census_is_of_this_transformers() -> None:
    assert transformers.__version__ == TRANSFORMERS_VERSION
    assert list(CAUSAL_LM_MODEL_TYPES) == MAPPING


def test_the_census_sorts_every_model_type_of_the_mapping_once() -> None:
    sorted_into = [set(BILLED), set(REFUSED), set(NOT_TEXT_DECODERS)]
    assert set(MAPPING) == set.union(*sorted_into), sorted(set(MAPPING) - set.union(*sorted_into))
    assert sum(map(len, sorted_into)) == len(MAPPING), "a model type is in two lists"
    assert set(REFUSED) | set(NOT_TEXT_DECODERS) <= set(MAPPING), "the census names a type the mapping lacks"


def test_the_census_prints_its_counts(capsys: Any) -> None:
    """The counts, as scripts/memory.py --architectures prints them; the billed ones never fewer than now."""
    counts = census()
    with capsys.disabled():
        print("\n" + counts["summary"])
        print("refused: " + ", ".join(counts["refused"]))
    assert counts["billed"] >= 137 and counts["billed"] + len(counts["refused"]) == counts["text_decoders"]
    assert counts["billed"] >= 0.9 * counts["text_decoders"]


# --- parameters -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", BILLED)
def test_parameters_of_the_default_config_equal_transformers(model_type: str) -> None:
    config, model = build(model_type, FIXES.get(model_type, {}))
    shape = read(config)
    assert shape.num_parameters == parameters(model), shape.describe()


@pytest.mark.parametrize("model_type", ROWS)
def test_parameters_of_small_variants_equal_transformers(model_type: str) -> None:
    for sizes in variants_of(model_type):
        config, model = build(model_type, sizes)
        shape = read(config)
        assert shape.num_parameters == parameters(model), (sizes, shape.describe())


# --- the cache ----------------------------------------------------------------------------------------------

WINDOW = 8


def held_bytes(cache: Any) -> dict[str, int]:
    """Bytes of every tensor a transformers cache holds, by layer kind (keys and values, an indexer's keys, the
    convolution and recurrent states of linear and state-space layers)."""
    held: dict[str, int] = {}
    for layer in getattr(cache, "layers", []):
        tensors = [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
        for name in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, name, None) or {}).values())
        kind = type(layer).__name__
        held[kind] = held.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    states = [t for t in getattr(cache, "linear_cache", []) if torch.is_tensor(t)]  # MiniMax's lightning layers
    if states:
        held["linear_cache"] = sum(t.numel() * t.element_size() for t in states)
    return held


def own_states(model: Any, out: Any) -> list[Any]:
    """The states a model keeps outside transformers' cache classes: RecurrentGemma's recurrent blocks hold theirs,
    RWKV returns a list of them, xLSTM a cache of its own."""
    tensors = []
    for layer in getattr(getattr(model, "model", None), "layers", []):
        block = getattr(layer, "temporal_block", None)
        tensors += [
            getattr(block, "conv1d_state", None),
            getattr(getattr(block, "rg_lru", None), "recurrent_states", None),
        ]
    tensors += list(getattr(out, "state", None) or [])
    for states in getattr(getattr(out, "cache_params", None), "rnn_state", {}).values():
        tensors += list(states)
    return [t for t in tensors if torch.is_tensor(t)]


# model types whose forward builds a cache it does not return: the test hands it one
GIVEN_CACHE = {"recurrent_gemma"}


def forward(model_type: str, sizes: dict[str, Any], tokens: int, batch: int = 2) -> tuple[Any, Any, list[Any]]:
    """(config, the cache after a forward of `tokens` random tokens through a random tiny model, the states the model
    keeps outside it), float32."""
    torch.manual_seed(0)
    config, model = build(model_type, sizes, device="cpu")
    ids = torch.randint(3, config.get_text_config().vocab_size, (batch, tokens))
    given = {"cache": DynamicCache(config=config)} if model_type in GIVEN_CACHE else {}
    with torch.no_grad():
        out = model.eval()(ids, use_cache=True, **given)
    return config, given.get("cache", getattr(out, "past_key_values", None)), own_states(model, out)


@pytest.mark.parametrize("tokens", [WINDOW - 3, 2 * WINDOW + 3])
@pytest.mark.parametrize("model_type", [model_type for model_type in ROWS if model_type not in NO_CACHE])
def test_cache_bytes_equal_what_transformers_holds(model_type: str, tokens: int) -> None:
    config, cache, outside = forward(model_type, tiny(model_type), tokens)
    shape = read(config)
    if model_type in WHOLE_WINDOWS:  # the bill's window layers keep W tokens; this cache keeps them all
        full = tuple("full_attention" if kind == "sliding_attention" else kind for kind in shape.layer_types)
        shape = dataclasses.replace(shape, layer_types=full, sliding_window=None, window_layers=None)
    # transformers keeps W - 1 tokens of a full window (the next step's own token makes W): one token less
    per_token = shape.kv_bytes_per_token("fp32")
    windows = {"sliding_attention": shape.sliding_window, "chunked_attention": shape.attention_chunk}
    fewer = sum(2 * per_token.get(kind, 0) for kind, window in windows.items() if window and tokens >= window)
    held = held_bytes(cache)
    held["outside the cache"] = sum(t.numel() * t.element_size() for t in outside)
    assert sum(held.values()) == shape.cache_bytes(tokens, "fp32", batch=2) - fewer, (held, shape.describe())


# --- what the reader refuses ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_refused_text_decoder_is_refused_by_name(model_type: str) -> None:
    with pytest.raises(ValueError, match=f"'model_type' = '{model_type}' is a text decoder the reader does not bill"):
        shape_from_config({"model_type": model_type})


# --- a field left out, or null, means what transformers means ------------------------------------------


def built(model_type: str, config: dict[str, Any]) -> Any:
    """transformers' model of a config.json's dict on the meta device, or None where transformers refuses it."""
    try:
        instance = type(AutoConfig.for_model(model_type)).from_dict(config)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(instance)
    except Exception:  # noqa: BLE001 - transformers refusing the config is what this test skips
        return None


@pytest.mark.parametrize("model_type", ROWS)
def test_a_field_left_out_or_null_means_what_transformers_means(model_type: str) -> None:
    """Each field of the model type's defaults (every one that changes the bill), left out of its tiny config and
    then set to null: where transformers builds the model, the bill equals its parameters, or refuses by name."""
    base = json.loads(json.dumps(AutoConfig.for_model(model_type, **tiny(model_type)).to_dict(), default=str))
    wrong = []
    for field in sorted(set(DEFAULTS.get(model_type, {})) & set(base)):
        for what, config in (
            ("left out", {k: v for k, v in base.items() if k != field}),
            ("null", {**base, field: None}),
        ):
            model = built(model_type, config)
            if model is None:
                continue
            try:
                ours = shape_from_config(config).num_parameters
            except (TypeError, ValueError):  # refused, with what is wrong: allowed, never a wrong number
                continue
            if ours != parameters(model):
                wrong.append(f"{field} {what}: the bill {ours:,}, transformers {parameters(model):,}")
    assert not wrong, "\n".join(wrong)


# defaults a config class takes from **kwargs in its __post_init__ (not a dataclass field of its own)
KWARG_DEFAULTS = {
    ("qwen3_next", "full_attention_interval"): 4,
    ("axk1", "first_k_dense_replace"): 1,
    **{
        ("dots3_note_text", name): value
        for name, value in dict(
            first_k_dense_replace=1,
            moe_layer_freq=1,
            sliding_window_size=512,
            use_sliding_window=True,
            swa_num_attention_heads=64,
            swa_num_key_value_heads=64,
            swa_q_lora_rank=1024,
            swa_kv_lora_rank=1024,
            swa_head_dim=256,
            swa_qk_nope_head_dim=192,
            swa_v_head_dim=128,
        ).items()
    },
    ("inkling_text", "dense_mlp_idx"): 0,
    ("gemma4_text", "global_head_dim"): 512,
    ("gemma4_unified_text", "global_head_dim"): 512,
    ("recurrent_gemma", "partial_rotary_factor"): 0.5,
    ("kimi_linear", "first_k_dense_replace"): 1,
    ("axk1", "moe_layer_freq"): 1,
    ("modernbert-decoder", "global_attn_every_n_layers"): 3,
}


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_the_defaults_are_the_config_classes(model_type: str) -> None:
    """Each default of defaults.py is its config class's (None where the class has no such field: the modeling
    code's getattr finds nothing)."""
    cls = type(
        AutoConfig.for_model({"kimi_k2": "deepseek_v3"}.get(model_type, model_type), **FIXES.get(model_type, {}))
    )
    declared = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            declared[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            declared[field.name] = field.default_factory()
    for alias, name in getattr(cls, "attribute_map", {}).items():  # a field declared by the name config.json stores
        if alias in declared and alias not in DEFAULTS[model_type]:
            declared.setdefault(name, declared[alias])
    wrong = {
        name: (value, declared.get(name, KWARG_DEFAULTS.get((model_type, name))))
        for name, value in DEFAULTS[model_type].items()
        if value != declared.get(name, KWARG_DEFAULTS.get((model_type, name)))
    }
    assert not wrong, wrong


# --- the script prints the same bill ----------------------------------------------------------------------

NEW_KINDS = [
    "mamba2",
    "jamba",
    "falcon_h1",
    "nemotron_h",
    "deepseek_v32",
    "lfm2",
    "qwen3_5_text",
    "bloom",
    "opt",
    "jetmoe",
    "dbrx",
    "kimi_linear",
    "mimo_v2_flash",
    "gemma4_text",
    "gemma4_unified_text",
    "gemma3n_text",
    "recurrent_gemma",
    "rwkv",
    "xlstm",
    "longcat_flash",
    "zamba",
    "zamba2",
    "inkling_text",
    "dots3_note_text",
]


@pytest.mark.parametrize("model_type", NEW_KINDS)
def test_memory_py_on_a_config_of_each_new_kind_prints_the_tests_bill(model_type: str, tmp_path: Any, capsys: Any):
    """scripts/memory.py --config on the tiny config.json of each new kind of layer: parameters, weights and the
    cache at each context as this test's shape and transformers' model have them."""
    import importlib.util
    from pathlib import Path

    config, model = build(model_type, tiny(model_type))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict(), default=str))
    script = Path(__file__).resolve().parents[1] / "scripts" / "memory.py"
    spec = importlib.util.spec_from_file_location("memory_script", script)
    memory = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(memory)
    assert memory.main(["--config", str(path), "--tokens", "5,19", "--kv-dtype", "fp32", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["models"]["rows"][0]
    shape = read(config)
    assert row["parameters"] == shape.num_parameters == parameters(model)
    assert [c["cache_bytes"] for c in row["contexts"]] == [shape.cache_bytes(n, "fp32") for n in (5, 19)]
