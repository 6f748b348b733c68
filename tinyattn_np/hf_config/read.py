"""shape_from_config: a ModelShape from a config.json's dict, by the rules of its model_type."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._shape_checks import LAYER_TYPES
from ..model_parts import Extra
from ..models import ModelShape
from .census import refuse_model_type
from .defaults import DEFAULTS, NO_MODEL_TYPE_DEFAULTS
from .experts import read_experts
from .fields import MAX_LAYERS, Fields, check_depth, shown_value, switch
from .formulas import evaluate
from .layer_kinds import read_layer_types
from .special import OWN_LAYERS, SPECIAL_READERS
from .table import ARCHITECTURES, NO_MODEL_TYPE, Arch

__all__ = ["shape_from_config"]

# the names of the full-attention layers' RoPE in a rope_parameters given per layer kind (dots.llm3: indexed)
FULL_KINDS = ("full_attention", "indexed_attention")
# rope_types transformers knows and rope_frequencies does not compute (any other unknown one is refused)
TRANSFORMERS_ONLY_ROPE = ("proportional",)


# fields that never change the weights or the cache: bookkeeping, token ids, numerics, dropout,
# activations, logit and residual scalings, routing choices (which experts, not how many)
_NEVER_BILLED = frozenset(
    """
    _name_or_path architectures auto_map transformers_version torch_dtype dtype id2label label2id problem_type
    return_dict use_return_dict output_attentions output_hidden_states chunk_size_feed_forward tokenizer_class
    prefix task_specific_params finetuning_task torchscript use_bfloat16 tf_legacy_loss use_cache
    cache_implementation _attn_implementation attn_implementation bos_token_id eos_token_id pad_token_id
    sep_token_id decoder_start_token_id max_length min_length do_sample early_stopping num_beams num_beam_groups
    diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores return_dict_in_generate
    forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty
    suppress_tokens begin_suppress_tokens is_decoder
    initializer_range rms_norm_eps layer_norm_eps layer_norm_epsilon norm_epsilon attention_dropout
    hidden_dropout resid_pdrop embd_pdrop attn_pdrop residual_dropout embedding_dropout classifier_dropout
    pretraining_tp clip_qkv router_aux_loss_coef router_jitter_noise output_router_logits aux_loss_alpha
    seq_aux moe_norm_min hidden_act hidden_activation activation activation_function swiglu_alpha swiglu_limit
    logit_scale logits_scaling embedding_multiplier residual_multiplier attention_multiplier
    attn_logit_softcapping final_logit_softcapping query_pre_attn_scalar attn_scale attn_temperature_tuning
    floor_scale scale_attn_weights scale_attn_by_inverse_layer_idx reorder_and_upcast_attn rope_interleave
    rope_local_base_freq norm_topk_prob routed_scaling_factor n_group topk_group topk_method scoring_func
    ep_size block_size full_attn_alpha_factor full_attn_beta_factor linear_attn_alpha_factor
    linear_attn_beta_factor mlp_alpha_factor mlp_beta_factor summary_type summary_use_proj summary_activation
    summary_proj_to_labels summary_first_dropout n_ctx apply_residual_connection_post_layernorm
    initial_context_length lambda_std_dev embedding_initializer_range
    dropout dropout_p activation_dropout hidden_dropout_prob attention_probs_dropout_prob mlp_dropout resid_dropout
    emb_pdrop embed_dropout layerdrop local_attention_probs_dropout_prob lsh_attention_probs_dropout_prob afn
    attention_softmax_in_fp32 scale_attention_softmax_in_fp32 autocast_kernel_dtype aux_loss_coef z_loss_coefficient
    init_std init_device initializer_cutoff_factor w_init_variance_scale ngpt_alpha_init learnable_sink_init
    eps norm_eps mixer_rms_eps rms_norm_eps_moe_gate norm_reduction_force_float32 residual_in_fp32
    rescale_prenorm_residual input_jitter_noise enable_moe_fp32_combine slow_but_exact seed
    image_token_id image_token_index boi_token_index eoi_token_index vision_start_token_id vision_end_token_id
    video_token_id audio_token_id cls_token_id eod_token_id num_logits_to_keep max_inference_chunksize
    mamba_chunk_size chunk_size_lm_head chunkwise_kernel step_kernel sequence_kernel inference_state_dtype
    use_mamba_kernels use_mambapy use_mem_eff_path use_associative_scan mamba_hidden_act mlp_hidden_act
    hidden_mamba_act time_step_floor time_step_init_scheme time_step_limit time_step_max time_step_min
    time_step_scale linear_a_log_max linear_a_log_min linear_dt_init_floor linear_dt_max linear_dt_min
    gate_soft_cap logits_soft_cap output_logit_soft_cap mlp_gate_softcap mlp_up_softcap moe_router_logit_softcapping
    moe_apply_router_weight_on_input moe_routed_scaling_factor route_scale router_scaling_factor
    mtp_loss_scaling_factor mup_enabled logits_mup_width_multiplier key_multiplier lm_head_multiplier
    ssm_in_multiplier ssm_out_multiplier ssm_multipliers mlp_multipliers attention_in_multiplier
    attention_out_multiplier dim_model_base scale_emb scale_depth embedding_scale log_scaling_alpha
    log_scaling_n_floor kda_lower_bound kda_safe_gate qk_l2_clip_threshold rel_l2_clip_threshold
    classifier_activation expert_selection_fn shared_expert_combination_strategy mamba_ssm_cache_dtype
    chunk_size mamba_norm_before_gate time_step_limit
""".split()
)


# fields that describe another kind of model unless they say "off"
_MUST_BE_OFF = (
    "is_encoder_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "pruned_heads",
    "use_bidirectional_attention",
)


def _check_all_read(fields: Fields, arch: Arch) -> None:
    """Every field the architecture did not read must be one that never changes the bill, or say "off"."""
    for name, value in fields.config.items():
        if name in _MUST_BE_OFF and name not in fields.read and value not in (None, False, 0, {}, []):
            raise fields.refuse(name, "describes a model that is not a plain decoder")
        if name in fields.read or name in _NEVER_BILLED or name in arch.unbilled or name in _MUST_BE_OFF:
            continue
        if value is not None:
            raise fields.refuse(name, "would change the bill and is not understood")


def _spellings(arch: Arch, field: str) -> tuple[str, ...]:
    """The spellings of a field in this architecture's config.json (GPT-2's n_layer for num_hidden_layers)."""
    return next((names[1:] for names in arch.names if names[0] == field), (field,))


def _read_sizes(fields: Fields, arch: Arch) -> dict[str, Any]:
    """layers, heads, kv heads, head_dim, hidden, vocab, the MLP's width and max positions; the layers first, in
    constant time, so that a config of 10^7 layers is refused before anything is built for each."""
    listed = fields.get(arch.layers_from) if arch.layers_from else None
    if isinstance(listed, list) and 0 < len(listed) <= MAX_LAYERS:  # the list wins over num_hidden_layers
        layers = len(listed)
        fields.value("num_hidden_layers")
    else:  # LongCat-Flash: two attentions and two MLPs in each layer of its config
        layers = arch.sublayers * fields.integer(
            *_spellings(arch, "num_hidden_layers"), most=MAX_LAYERS // arch.sublayers
        )
    hidden = fields.integer(*_spellings(arch, "hidden_size"))
    heads = fields.integer(*_spellings(arch, "num_attention_heads")) if arch.attention else 1  # Mamba has none
    if arch.intermediate is None:
        intermediate = fields.integer(*_spellings(arch, "intermediate_size"), none=True)  # GPT-2's n_inner null: 4·C
    else:  # BLOOM's 4·C, MPT's expansion_ratio · C
        intermediate = evaluate(arch.intermediate, dict(hidden=hidden, heads=heads, layers=layers), fields)
    head_dim = fields.integer(*_spellings(arch, "head_dim"), none=True) if arch.attention else 1
    if head_dim is None:  # transformers' classes take hidden_size // num_attention_heads, rounded down (Zamba: 2·C)
        head_dim = evaluate(arch.head_dim, dict(hidden=hidden, heads=heads, layers=layers), fields)
        if head_dim == 0:
            raise ValueError(f"config: hidden_size {hidden} is smaller than num_attention_heads {heads}")
    kv_heads = fields.integer("num_key_value_heads", none=True) if arch.kv_heads and arch.attention else None
    kv_heads = 1 if switch(fields, arch.multi_query) else kv_heads
    return dict(
        layers=layers,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=fields.integer("vocab_size"),
        intermediate=4 * hidden if intermediate is None else intermediate,
        max_positions=fields.integer(*_spellings(arch, "max_position_embeddings"), none=True),
    )


def _read_block(fields: Fields, arch: Arch) -> dict[str, Any]:
    """The block: MLP, norms, biases, q/k norm, parallel attention and MLP, tied embeddings, positions."""
    for name in arch.off:  # the class carries the field and builds nothing with it
        if fields.get(name) not in (None, False, 0):
            raise fields.refuse(name, "is not built by transformers")
    qk_norm = None
    if arch.qk_norm is not None and switch(fields, arch.qk_norm[0]):
        qk_norm = arch.qk_norm[1]
    return dict(
        mlp=arch.mlp,
        norm=arch.norm,
        norms_per_layer=arch.norms,
        tied_embeddings=switch(fields, arch.tied),
        qkv_bias=switch(fields, arch.qkv_bias),
        out_bias=switch(fields, arch.out_bias),
        mlp_bias=switch(fields, arch.mlp_bias),
        lm_head_bias=switch(fields, arch.lm_head_bias),
        qk_norm=qk_norm,
        parallel_block=switch(fields, arch.parallel),
        sinks=switch(fields, arch.sinks),
        attention_gate=switch(fields, arch.attention_gate),
        positions=arch.positions,
    )


def _rope_fields(fields: Fields, rotary: bool) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config: rope_theta at the top (default 10,000, every rotary
    config class's default; GPT-NeoX's rotary_emb_base) or inside rope_parameters (transformers 5);
    rope_scaling or rope_parameters as the scaling dict, with a top-level partial_rotary_factor (GPT-NeoX's
    rotary_pct) and (Phi-3's) original_max_position_embeddings moved into it, so that it is all
    rope_frequencies needs. Not for dynamic: its L0 is max_position_embeddings whatever else the config
    says, as in transformers. Gemma-3's rope_parameters per layer kind: the full-attention layers' own."""
    parameters = fields.get("rope_scaling", "rope_parameters", default={})
    theta_top = fields.get("rope_theta", "rotary_emb_base")
    partial, original = (
        fields.get("partial_rotary_factor", "rotary_pct"),
        fields.get("original_max_position_embeddings"),
    )
    if not rotary:
        return None, None
    if not isinstance(parameters, dict):
        raise ValueError(f"config field 'rope_scaling' must be an object or null; got {shown_value(parameters)}")
    full = next((kind for kind in FULL_KINDS if isinstance(parameters.get(kind), dict)), None)
    if parameters and set(parameters) <= set(LAYER_TYPES) | set(FULL_KINDS) and full is not None:
        parameters = parameters[full]  # Gemma-3: {"sliding_attention": {...}, "full_attention": {...}}
    theta = theta_top if theta_top is not None else parameters.get("rope_theta", 10000.0)
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    if partial is not None and "partial_rotary_factor" not in scaling:
        scaling["partial_rotary_factor"] = partial
    if parameters.get("rope_type", parameters.get("type")) != "dynamic":  # dynamic's L0: max_position_embeddings
        if original is not None and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = original
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        scaling["rope_type"] = "default"
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in TRANSFORMERS_ONLY_ROPE:  # frequencies the reader does not work out: no bill needs them
        return theta, {"rope_type": kind, "unread": True}
    if scaling.get("rope_type", scaling.get("type")) == "default" and set(scaling) <= {"rope_type", "type"}:
        scaling = {}  # plain RoPE: nothing to carry
    return theta, scaling or None


def _architecture(config: dict[str, Any]) -> tuple[str, Arch, dict[str, Any], tuple[str, ...]]:
    """(model_type, its row, its class's defaults, notes); a model_type the reader does not bill is refused."""
    model_type = config.get("model_type")
    if model_type is None:
        return "llama", NO_MODEL_TYPE, NO_MODEL_TYPE_DEFAULTS, ("the config names no model_type: read as Llama",)
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise refuse_model_type(model_type)
    return model_type, ARCHITECTURES[model_type], DEFAULTS.get(model_type, {}), ()


def _read_quantization(fields: Fields) -> tuple[str | None, tuple[str, ...]]:
    """The quantization_config's method, and the note that says the bill's dtype is the caller's."""
    quantization = fields.get("quantization_config")
    if quantization is None:
        return None, ()
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not isinstance(method, str):
        raise ValueError(
            f"config field 'quantization_config' must be an object with a quant_method; got {shown_value(quantization)}"
        )
    return method, (
        f"the checkpoint stores its weights quantized ({method}): the bill's bytes are for the dtype asked",
    )


def _extras(fields: Fields, arch: Arch, found: dict[str, Any]) -> tuple[Extra, ...]:
    """The row's Parts, their formulas worked out with the sizes found and the config's fields."""
    return tuple(
        Extra(
            part.what,
            part.where,
            evaluate(part.parameters, found, fields),
            evaluate(part.state, found, fields),
            active=part.active,
        )
        for part in arch.extras
        if switch(fields, part.when)
    )


def _read(config: dict[str, Any], default_name: str | None) -> ModelShape:
    """shape_from_config for a config of one model (no text_config to unwrap)."""
    model_type, arch, defaults, notes = _architecture(config)
    fields = Fields(config, None if arch is NO_MODEL_TYPE else model_type, defaults)
    fields.read.add("model_type")
    found = _read_sizes(fields, arch)
    found.update(_read_block(fields, arch))
    rope_theta, rope_scaling = _rope_fields(fields, rotary=arch.positions == "rope")
    if rope_scaling is not None and rope_scaling.get("unread"):
        notes += (
            f"RoPE of rope_type {rope_scaling['rope_type']!r}, which the reader does not compute: the shape has "
            "no rope_frequencies",
        )
        rope_scaling = None
    rotary = fields.integer("rotary_dim", none=True) if arch.rotary_dim else None  # GPT-J: partial rotary
    if rotary is not None and rotary != found["head_dim"] and rope_theta is not None:
        share = rotary / found["head_dim"]
        rope_scaling = {"rope_type": "default", **(rope_scaling or {}), "partial_rotary_factor": share}
    found.update(rope_theta=rope_theta, rope_scaling=rope_scaling, notes=notes)
    mixers = tuple(kind for special in arch.special for kind in SPECIAL_READERS[special][1])
    if OWN_LAYERS == mixers:  # a reader of its own says which kind each layer is
        found.update(layer_types=None, sliding_window=None, attention_chunk=None)
    else:
        found.update(read_layer_types(fields, arch, found["layers"], mixers))
    found["experts"] = None if arch.moe is None else read_experts(fields, arch.moe, found)
    found["intermediate"] = found.pop("dense_intermediate", found["intermediate"])
    found["extras"] = _extras(fields, arch, found)
    for special in arch.special:
        SPECIAL_READERS[special][0](fields, found)
    quantization, quantized = _read_quantization(fields)
    _check_all_read(fields, arch)
    return ModelShape(
        name=config.get("_name_or_path") or default_name or config.get("model_type") or "config",
        arch="gpt2" if arch.positions == "learned" else "llama",
        architecture=model_type,
        quantization=quantization,
        **{**found, "notes": found["notes"] + quantized},
    )


def shape_from_config(config: dict[str, Any], default_name: str | None = None) -> ModelShape:
    """A ModelShape from the dict of a Hugging Face config.json, by the rules of its model_type (ARCHITECTURES).

    A field the config leaves out takes its config class's default (defaults.py), as transformers would;
    head_dim, when the config gives one, wins over hidden_size / num_attention_heads: Gemma-2-9B has
    hidden 3584 and 16 heads, but heads of 256, not 224. A field that would change the bill and that the
    architecture does not read is refused, naming the field and its value; a field whose value means "off"
    (sliding_window 0 or null, use_sliding_window false) is read as off. A multimodal config (LLaVA,
    Gemma-3, Llama 4) keeps its language model in text_config: that is the one read, under the outer
    config's name (the vision tower is not counted, and the bill says so).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict; got {type(config).__name__}")
    check_depth(config)
    text = config.get("text_config")
    if isinstance(text, dict) and config.get("num_hidden_layers", config.get("n_layer")) is None:
        name = config.get("_name_or_path") or default_name or config.get("model_type")
        outer = {key: config[key] for key in ("tie_word_embeddings",) if key in config}  # set outside, at times
        shape = _read({**outer, **text, "_name_or_path": name}, default_name=name)
        note = "the language model only (text_config): the other towers are not counted"
        return dataclasses.replace(shape, notes=(*shape.notes, note))
    return _read(config, default_name)
