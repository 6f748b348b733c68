"""gpt.py: the configuration and its presets, the whole model's gradient against central differences in
float64, the cached forward against the whole one, determinism, and the errors that name their argument."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tinyattn_np import GatedDeltaCache, GatedDeltaNetShape, GatedDeltaNetWeights, KVCache, _guard
from tinyattn_np._guard import AttentionMemoryError
from tinyattn_np.gpt import GPT, GPT_PRESETS, GPTConfig, embed, init_params, param_shapes, parameter_count

STEP = 1e-6
SMALL = dict(vocab=11, context=6, layers=2, heads=2, width=8, dtype="float64")


def small(**changes) -> GPTConfig:
    return GPTConfig(**(SMALL | changes))


def tokens(config: GPTConfig, batch: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab, (batch, length)), rng.integers(0, config.vocab, (batch, length))


def test_part3_has_the_articles_parameter_count():
    # the article's model: 6 layers, width 256, 4 heads, GELU 4x, LayerNorm, tied, RoPE, vocab 4,096
    config = GPT_PRESETS["part3"]
    assert (config.layers, config.width, config.heads, config.head_dim, config.context) == (6, 256, 4, 64, 256)
    per_layer = 256 * 768 + 256 * 256 + (256 * 1024 + 1024) + (1024 * 256 + 256) + 2 * (256 + 256)
    assert per_layer * 6 + 512 + 4096 * 256 == 5_781_504
    assert sum(int(np.prod(shape)) for shape in param_shapes(config).values()) == 5_781_504


def test_tiny_is_nanogpts_cpu_shakespeare_model():
    config = GPT_PRESETS["tiny"]
    assert (config.layers, config.heads, config.width, config.context, config.dropout) == (4, 4, 128, 64, 0.0)
    # no biases: 12 C² per layer, a gain per norm, the embedding
    assert GPT(config, rng=0).num_parameters == 4 * (12 * 128 * 128 + 2 * 128) + 128 + 65 * 128


def test_swiglu_hidden_keeps_about_the_gelu_mlps_weights():
    config = GPTConfig(width=256, heads=4, mlp="swiglu")
    assert config.hidden == 688  # 8 · 256 / 3 = 682.7, up to a multiple of 8
    assert param_shapes(config)["h.0.mlp.w_fc"] == (256, 2 * 688)


def test_mlp_hidden_overrides_the_default():
    config = GPTConfig(mlp_hidden=100)
    assert config.hidden == 100 and param_shapes(config)["h.1.mlp.w_proj"] == (100, 128)
    with pytest.raises(ValueError, match="mlp_hidden must be a positive int"):
        GPTConfig(mlp_hidden=0)


def test_config_round_trips_through_a_dict():
    config = GPT_PRESETS["part3"]
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown GPTConfig fields \\['n_embd'\\]"):
        GPTConfig.from_dict(config.to_dict() | {"n_embd": 3})


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(width=10, heads=4), ValueError, "width \\(10\\) must split into 4 heads"),
        (dict(width=12, heads=4), ValueError, "heads of an even size"),
        (dict(mlp="relu"), ValueError, "mlp must be one of"),
        (dict(norm="batchnorm"), ValueError, "norm must be one of"),
        (dict(dtype="float16"), ValueError, "dtype must be one of"),
        (dict(dropout=1.0), ValueError, "dropout must be a number in \\[0, 1\\)"),
        (dict(layers=0), ValueError, "layers must be a positive int"),
        (dict(vocab=2.0), TypeError, "vocab must be a positive int"),
        (dict(bias="yes"), TypeError, "bias must be True or False"),
        (dict(positions="alibi"), ValueError, "positions must be one of \\('rope', 'learned'\\)"),
    ],
)
def test_config_refuses_what_cannot_be_built(changes, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**changes)


CONFIGS = {
    "layernorm gelu": small(),
    "layernorm gelu bias": small(bias=True),
    "rmsnorm swiglu": small(norm="rmsnorm", mlp="swiglu"),
    "rmsnorm gelu bias": small(norm="rmsnorm", bias=True),
    "hybrid LLA rmsnorm swiglu": small(layers=3, norm="rmsnorm", mlp="swiglu", layer_pattern="LLA"),
    "hybrid LA layernorm bias": small(layers=3, bias=True, layer_pattern="LA"),
    "learned positions layernorm bias": small(bias=True, positions="learned"),
    "hybrid LA learned positions": small(layers=3, layer_pattern="LA", positions="learned"),
}


def model_of(config: GPTConfig, seed: int) -> GPT:
    """GPT(config, rng=seed), its gated delta layers' matrices ten times their initial size and their decays
    slower (A in (0.1, 1): a token's trace lasts a few tokens), so that every part of them moves the loss."""
    model, rng = GPT(config, rng=seed), np.random.default_rng(seed + 100)
    for name, param in model.params.items():
        if ".delta." in name and param.ndim == 2:
            param *= 10.0
        elif name.endswith("delta.a_log"):
            param[...] = np.log(rng.uniform(0.1, 1.0, param.shape))
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_whole_models_gradient_matches_central_differences(name):
    """Every parameter array, a few entries each (the tied embedding's too), in float64."""
    config = CONFIGS[name]
    model = model_of(config, 1)
    idx, targets = tokens(config, 2, config.context, seed=2)
    loss, grads = model.loss_and_grads(idx, targets)
    assert list(grads) == list(model.params)
    rng = np.random.default_rng(3)
    for param_name, param in model.params.items():
        assert grads[param_name].shape == param.shape and grads[param_name].dtype == param.dtype
        for flat in rng.choice(param.size, min(param.size, 6), replace=False):
            i = np.unravel_index(flat, param.shape)
            old = param[i]
            param[i] = old + STEP
            up = model.loss(idx, targets)
            param[i] = old - STEP
            down = model.loss(idx, targets)
            param[i] = old
            numeric = (up - down) / (2 * STEP)
            assert grads[param_name][i] == pytest.approx(numeric, rel=1e-5, abs=1e-9), f"{param_name}{i}"


def test_the_gradient_with_dropout_is_that_of_the_masks_drawn():
    """With the same seed the perturbed losses draw the same masks, so central differences see one function."""
    config = small(dropout=0.2)
    model = GPT(config, rng=1)
    idx, targets = tokens(config, 2, config.context, seed=4)
    loss, grads = model.loss_and_grads(idx, targets, rng=7)
    assert loss != pytest.approx(model.loss(idx, targets))  # the masks changed something
    for name in ("wte", "h.1.mlp.w_fc", "h.0.attn.w_qkv"):
        param = model.params[name]
        i = np.unravel_index(5, param.shape)
        old = param[i]
        param[i] = old + STEP
        up = model.loss_and_grads(idx, targets, rng=7)[0]
        param[i] = old - STEP
        down = model.loss_and_grads(idx, targets, rng=7)[0]
        param[i] = old
        assert grads[name][i] == pytest.approx((up - down) / (2 * STEP), rel=1e-5, abs=1e-9), name


def test_loss_and_grads_loss_is_the_evaluation_loss_and_the_logits():
    config = small()
    model = GPT(config, rng=0)
    idx, targets = tokens(config, 3, 5, seed=0)
    logits = model.logits(idx)
    assert logits.shape == (3, 5, config.vocab)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    gold = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    assert model.loss_and_grads(idx, targets)[0] == pytest.approx(gold, rel=1e-13)
    assert model.loss(idx, targets) == pytest.approx(gold, rel=1e-13)


def test_the_same_seed_gives_the_same_model_and_the_same_gradients_bit_for_bit():
    config = small(dtype="float32", dropout=0.1)
    first, second = GPT(config, rng=5), GPT(config, rng=5)
    idx, targets = tokens(config, 2, 6, seed=1)
    loss_1, grads_1 = first.loss_and_grads(idx, targets, rng=9)
    loss_2, grads_2 = second.loss_and_grads(idx, targets, rng=9)
    assert loss_1 == loss_2
    for name in grads_1:
        np.testing.assert_array_equal(grads_1[name], grads_2[name], err_msg=name)
    assert not np.array_equal(GPT(config, rng=6).params["wte"], first.params["wte"])


def test_gradients_are_the_same_bit_for_bit_when_flash_runs_many_tiles_on_many_workers():
    """256 tokens: many query and key tiles, shared among the worker threads, whose order may vary."""
    config = GPTConfig(vocab=50, context=256, layers=1, heads=4, width=32)
    model = GPT(config, rng=0)
    idx, targets = tokens(config, 2, 256, seed=3)
    loss, grads = model.loss_and_grads(idx, targets)
    for _ in range(3):
        again_loss, again = model.loss_and_grads(idx, targets)
        assert again_loss == loss
        for name in grads:
            np.testing.assert_array_equal(again[name], grads[name], err_msg=name)


def test_init_follows_gpt2():
    config = GPTConfig(layers=8, width=64, heads=2, bias=True)
    params = init_params(config, 0)
    assert all(params[name].dtype == np.float32 for name in params)
    assert abs(params["wte"].std() - 0.02) < 0.001
    assert abs(params["h.0.mlp.w_proj"].std() - 0.02 / 4) < 0.0003  # 0.02 / √(2 · 8)
    assert np.all(params["h.3.ln_1.gain"] == 1) and np.all(params["h.3.mlp.b_fc"] == 0)


@pytest.mark.parametrize(
    "name", ["rmsnorm swiglu", "layernorm gelu bias", "hybrid LLA rmsnorm swiglu", "hybrid LA learned positions"]
)
def test_the_cached_forward_equals_the_whole_one_past_the_context(name):
    """A prompt, then one token at a time through the caches, gives hidden states equal to the whole sequence
    at once, also past the context (6), where both attend to the last `context` tokens (and a gated delta
    layer's state, in chunks or a token at a time, holds them all)."""
    config = CONFIGS[name]
    model = model_of(config, 2)
    idx, _ = tokens(config, 2, 15, seed=5)
    whole = model.hidden(idx)  # (2, 15, C)
    caches = model.new_caches(2, 15)
    parts = [model.hidden(idx[:, :4], caches)] + [model.hidden(idx[:, t : t + 1], caches) for t in range(4, 15)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=1e-12, atol=1e-12)


def test_past_the_context_each_position_sees_only_the_last_context_tokens():
    """Context 6: position 8 attends to positions 3 .. 8. With one layer, token 0 cannot reach it; with two,
    it does, through positions 3 .. 5 of the first layer (which saw it)."""
    idx, _ = tokens(small(), 1, 9, seed=6)
    changed = idx.copy()
    changed[0, 0] = (idx[0, 0] + 1) % 11
    one_layer = GPT(small(layers=1), rng=2)
    whole, other = one_layer.hidden(idx), one_layer.hidden(changed)
    assert not np.allclose(whole[0, 5], other[0, 5])  # position 5 sees token 0
    np.testing.assert_array_equal(whole[0, 8], other[0, 8])  # position 8 does not
    two_layers = GPT(small(), rng=2)
    assert not np.allclose(two_layers.hidden(idx)[0, 8], two_layers.hidden(changed)[0, 8])
    # within the context it is the plain causal model: the first 6 positions as if the rest were not there
    np.testing.assert_allclose(two_layers.hidden(idx)[0, :6], two_layers.hidden(idx[:, :6])[0], rtol=1e-12)


def test_params_are_checked_and_copied():
    config = small()
    params = init_params(config, 0)
    model = GPT(config, params)
    assert model.params["wte"] is not params["wte"]
    np.testing.assert_array_equal(model.params["wte"], params["wte"])
    with pytest.raises(ValueError, match="missing \\['ln_f.gain'\\], unexpected \\['ln_f.weight'\\]"):
        GPT(config, {k.replace("ln_f.gain", "ln_f.weight"): v for k, v in params.items()})
    with pytest.raises(ValueError, match="params\\['wte'\\] must have shape \\(11, 8\\)"):
        GPT(config, params | {"wte": np.zeros((12, 8))})
    with pytest.raises(TypeError, match="params\\['wte'\\] must be a float array; got dtype int64"):
        GPT(config, params | {"wte": np.zeros((11, 8), np.int64)})
    with pytest.raises(TypeError, match="params must be a dict name -> array; got list"):
        GPT(config, list(params.values()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT(SMALL)  # type: ignore[arg-type]
    # 11·8 + 2·(2·8 + 8·24 + 8·8 + 8·32 + 32·8) + 8 = 1,664
    assert repr(model) == (
        "GPT(layers=2, heads=2, width=8, context=6, vocab=11, mlp=gelu, norm=layernorm, parameters=1,664)"
    )


@pytest.mark.parametrize(
    ("idx", "targets", "error", "match"),
    [
        (np.zeros((2, 7), int), np.zeros((2, 7), int), ValueError, "at most 6"),
        (np.zeros((2, 3), int), np.zeros((2, 4), int), ValueError, "targets must have idx's shape"),
        (np.full((1, 3), 11), np.zeros((1, 3), int), ValueError, "idx holds token 11, outside the vocabulary"),
        (np.zeros((1, 3)), np.zeros((1, 3), int), TypeError, "idx must hold integer token ids"),
        (np.zeros(3, int), np.zeros(3, int), ValueError, "idx must be \\(B, T\\)"),
    ],
)
def test_bad_batches_are_refused_by_name(idx, targets, error, match):
    with pytest.raises(error, match=match):
        GPT(small(), rng=0).loss_and_grads(idx, targets)


def test_loss_refuses_targets_of_another_shape():
    with pytest.raises(ValueError, match="targets must have idx's shape \\(1, 3\\)"):
        GPT(small(), rng=0).loss(np.zeros((1, 3), int), np.zeros((1, 2), int))


def test_dropout_needs_a_generator():
    with pytest.raises(ValueError, match="pass rng"):
        GPT(small(dropout=0.1), rng=0).loss_and_grads(np.zeros((1, 2), int), np.zeros((1, 2), int))


def test_caches_must_be_one_per_layer():
    model = GPT(small(), rng=0)
    with pytest.raises(ValueError, match="caches must be a list of 2 KVCache or GatedDeltaCache"):
        model.hidden(np.zeros((1, 2), int), model.new_caches(1, 4)[:1])
    hybrid = GPT(small(layer_pattern="LA"), rng=0)
    caches = hybrid.new_caches(1, 4)
    assert [type(cache) for cache in caches] == [GatedDeltaCache, KVCache]
    with pytest.raises(ValueError, match="cache must be a GatedDeltaCache"):
        hybrid.hidden(np.zeros((1, 2), int), caches[::-1])


# --- the layer pattern: gated delta layers beside softmax attention ---------------------------------------


def test_the_layer_pattern_repeats_over_the_layers():
    config = small(layers=8, layer_pattern="LLLA")  # Qwen3-Next's three to one
    assert "".join(config.layer_kind(layer) for layer in range(8)) == "LLLALLLA" and config.delta_layers == 6
    assert small(layers=5, layer_pattern="LLA").delta_layers == 4  # LLALL
    assert GPTConfig(layers=10**12, layer_pattern="LA").delta_layers == 5 * 10**11  # by arithmetic
    assert small().delta_layers == 0 and small().layer_kind(1) == "A"
    shapes = param_shapes(small(layer_pattern="LA"))
    assert "h.0.delta.w_qkv" in shapes and "h.0.attn.w_qkv" not in shapes and "h.1.attn.w_qkv" in shapes
    delta = [name.split(".")[-1] for name in shapes if name.startswith("h.0.delta.")]
    assert delta == list(GatedDeltaNetWeights._fields)
    assert config.delta_shape == GatedDeltaNetShape(d_model=8, key_heads=2, value_heads=2, key_dim=4, value_dim=4)


@pytest.mark.parametrize(
    "pattern", ["", "AX", "LLA", 3, ["L", "A"]], ids=["empty", "another letter", "longer", "an int", "a list"]
)
def test_a_pattern_that_is_not_one_is_refused_by_name(pattern):
    with pytest.raises(ValueError, match="layer_pattern must be None or a string of A .* at most 2 long"):
        small(layer_pattern=pattern)


def test_the_default_pattern_is_the_gpt_as_it_was_to_the_bit():
    """layer_pattern=None, "A" or "AA": the same parameters, the same loss and gradients, bit for bit; a config
    written before the field existed (no layer_pattern key) reads back as None."""
    idx, targets = tokens(small(), 2, 6, seed=1)
    runs = [GPT(small(dtype="float32", layer_pattern=p), rng=3).loss_and_grads(idx, targets) for p in (None, "A", "AA")]
    for loss, grads in runs[1:]:
        assert loss == runs[0][0]
        for name in grads:
            np.testing.assert_array_equal(grads[name], runs[0][1][name], err_msg=name)
    old = {key: value for key, value in small().to_dict().items() if key != "layer_pattern"}
    assert GPTConfig.from_dict(old) == small()
    hybrid = small(layer_pattern="LA")
    assert GPTConfig.from_dict(hybrid.to_dict()) == hybrid


def test_a_gated_delta_layer_is_initialised_as_transformers_draws_qwen3_next():
    config = GPTConfig(layers=8, width=64, heads=2, layer_pattern="L")
    params = init_params(config, 0)
    assert abs(params["h.0.delta.w_out"].std() - 0.02 / 4) < 0.0003  # into the residual stream: 0.02 / √(2 · 8)
    assert abs(params["h.0.delta.w_qkv"].std() - 0.02) < 0.001
    assert np.all(params["h.1.delta.dt_bias"] == 1) and np.all(params["h.1.delta.norm"] == 1)
    assert np.all(np.abs(params["h.2.delta.conv"]) <= 0.5)  # U(±1/√4)
    a = np.exp(np.concatenate([params[f"h.{layer}.delta.a_log"] for layer in range(8)]))
    assert np.all((a >= 0.01) & (a <= 16))


@pytest.mark.parametrize(
    "config",
    [GPT_PRESETS["tiny"], GPT_PRESETS["part3"], small(mlp="swiglu", norm="rmsnorm", bias=True), small(bias=True),
     small(mlp="swiglu", mlp_hidden=12), small(norm="rmsnorm", layers=5),
     small(layers=7, layer_pattern="LLLA", bias=True), GPTConfig(layers=6, layer_pattern="L")],
    ids=["tiny", "part3", "swiglu rmsnorm bias", "layernorm bias", "swiglu hidden 12", "rmsnorm 5 layers",
         "hybrid LLLA bias", "all gated delta"],
)  # fmt: skip
def test_the_parameter_count_is_param_shapes_by_arithmetic(config):
    assert parameter_count(config) == sum(int(np.prod(shape)) for shape in param_shapes(config).values())


def test_a_model_larger_than_the_memory_is_refused_before_anything_is_built(monkeypatch):
    """By arithmetic, in constant time: GPT(layers=10⁶) asks for 786 GB, and spent 10 s and 1.3 GB on it before
    a raw MemoryError. The memory is the guard's (what this process can still take)."""
    monkeypatch.setattr(_guard, "memory_usable", lambda: 3 << 20)  # 3 MiB: the tiny model's 3.04 MiB do not fit
    match = "GPT\\(4 layers, width 128, vocab 65\\) would allocate 3.0 MiB .*795,904 parameters of float32.*3.0 MiB"
    with pytest.raises(AttentionMemoryError, match=match):
        GPT(GPT_PRESETS["tiny"], rng=0)
    with pytest.raises(AttentionMemoryError, match=match):
        GPT(GPT_PRESETS["tiny"], init_params(small(), 0))  # given weights are copied: the same bytes
    monkeypatch.undo()
    for config in (GPTConfig(layers=10**6), GPTConfig(layers=10**15, width=2**20, heads=2**10, vocab=10**9)):
        start = time.perf_counter()
        with pytest.raises(AttentionMemoryError, match=f"GPT\\({config.layers} layers"):
            GPT(config, rng=0)
        assert time.perf_counter() - start < 0.5


# --- a learned position table in place of RoPE -----------------------------------------------------------


def test_a_learned_table_is_a_parameter_added_to_the_embeddings():
    """positions="learned": wpe (context, C) after wte, drawn as GPT-2 draws it, counted; x = E[idx] + P[0 .. T-1]
    before the first block; heads of an odd size are allowed (nothing turns pairs)."""
    config = small(positions="learned")
    shapes = param_shapes(config)
    assert list(shapes)[:2] == ["wte", "wpe"] and shapes["wpe"] == (6, 8)
    assert parameter_count(config) == parameter_count(small()) + 6 * 8 == GPT(config, rng=0).num_parameters
    assert abs(init_params(GPTConfig(positions="learned"), 0)["wpe"].std() - 0.02) < 0.001
    assert GPTConfig(width=12, heads=4, positions="learned").head_dim == 3
    params = GPT(config, rng=1).params
    idx, _ = tokens(config, 2, 4, seed=0)
    np.testing.assert_array_equal(embed(params, config, idx), (params["wte"][idx] + params["wpe"][:4]).reshape(8, 8))


def test_the_attention_beside_a_learned_table_turns_nothing():
    """With the table's rows all 0, one layer cannot tell the order of the tokens before the last (its keys and
    values are each a token's own, and attention sums over them): RoPE does not turn q and k. With RoPE it can."""
    idx = np.array([[1, 2, 3, 4]])
    swapped = np.array([[2, 1, 3, 4]])
    learned = GPT(small(layers=1, positions="learned"), rng=1)
    learned.params["wpe"][...] = 0
    np.testing.assert_allclose(learned.hidden(idx)[0, -1], learned.hidden(swapped)[0, -1], rtol=1e-12)
    rope = GPT(small(layers=1), rng=1)
    assert not np.allclose(rope.hidden(idx)[0, -1], rope.hidden(swapped)[0, -1])


def test_past_the_context_the_tables_rows_start_again():
    """Position t takes row t mod context: a window of the last `context` tokens holds every row once."""
    config = small(positions="learned")  # context 6
    np.testing.assert_array_equal(config.table_rows(0, 4), [0, 1, 2, 3])
    np.testing.assert_array_equal(config.table_rows(4, 5), [4, 5, 0, 1, 2])


def test_the_rope_default_is_the_gpt_as_it_was_and_old_configs_read_as_rope():
    """positions="rope" is the default; a config written before the field (no positions key) reads as it; the
    learned table round-trips through a dict and shows in the repr."""
    old = {key: value for key, value in small().to_dict().items() if key != "positions"}
    assert GPTConfig.from_dict(old) == small() and small().positions == "rope"
    learned = small(positions="learned")
    assert GPTConfig.from_dict(learned.to_dict()) == learned
    assert "norm=layernorm, positions=learned, parameters=1,712)" in repr(GPT(learned, rng=0))
