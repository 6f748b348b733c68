"""trainbill.py: the bill of a training step against tracemalloc's peak of the step itself, within 10%."""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from tinyattn_np.gpt import GPT, GPT_PRESETS, GPTConfig, parameter_count
from tinyattn_np.optim import AdamW, accumulated_grads, clip_grad_norm
from tinyattn_np.trainbill import training_memory


def traced_step_peak(config: GPTConfig, batch: int, tokens: int, accumulate: int = 1) -> int:
    """tracemalloc's peak from building the model and the optimiser to the end of one step, after one untraced
    step: the first in a process also makes one-time allocations (about a tenth more here), and which test of
    a process runs first depends on the order the tests run in."""
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, config.vocab, (2, batch, tokens))

    def step() -> None:
        model = GPT(config, rng=0)
        opt = AdamW(model.params)
        loss, grads = accumulated_grads(lambda x, y: model.loss_and_grads(x, y, rng=1), idx, targets, accumulate)
        clip_grad_norm(grads, 1.0)
        opt.step(model.params, grads)

    step()
    tracemalloc.start()
    try:
        step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


CASES = {
    "tiny, batch 12": (GPT_PRESETS["tiny"], 12, 64),
    "part3, batch 2": (GPT_PRESETS["part3"], 2, 256),
    "swiglu rmsnorm dropout float64": (
        GPTConfig(vocab=300, context=32, layers=3, heads=4, width=64, mlp="swiglu", norm="rmsnorm", dropout=0.1,
                  dtype="float64"),
        6, 32,
    ),
    "tiny, 4 tokens: the optimizer's update is the peak": (GPT_PRESETS["tiny"], 1, 4),
    "tiny, batch 12 in 3 slices (gradient accumulation)": (GPT_PRESETS["tiny"], 12, 64, 3),
    "part3, batch 4 in 2 slices": (GPT_PRESETS["part3"], 4, 256, 2),
    "tiny, 4 tokens, batch 2 in 2 slices: adding a slice's gradients is the peak": (GPT_PRESETS["tiny"], 2, 4, 2),
    "tiny, every layer a gated delta layer": (replace(GPT_PRESETS["tiny"], layer_pattern="L"), 12, 64),
    "tiny LLLA: Qwen3-Next's three to one": (replace(GPT_PRESETS["tiny"], layer_pattern="LLLA"), 12, 64),
    "part3 LLLA, batch 2": (replace(GPT_PRESETS["part3"], layer_pattern="LLLA"), 2, 256),
    "part3 LA, batch 4 in 2 slices": (replace(GPT_PRESETS["part3"], layer_pattern="LA"), 4, 256, 2),
    "tiny LA, 4 tokens": (replace(GPT_PRESETS["tiny"], layer_pattern="LA"), 1, 4),
    "tiny with a learned position table": (replace(GPT_PRESETS["tiny"], positions="learned"), 12, 64),
    "swiglu rmsnorm dropout float64, LAL": (
        GPTConfig(vocab=300, context=32, layers=3, heads=4, width=64, mlp="swiglu", norm="rmsnorm", dropout=0.1,
                  dtype="float64", layer_pattern="LAL"),
        6, 32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_the_bill_is_within_ten_percent_of_tracemalloc(name):
    config, batch, tokens, *accumulate = CASES[name]
    bill = training_memory(config, batch, tokens, *accumulate)
    measured = traced_step_peak(config, batch, tokens, *accumulate)
    assert abs(bill.peak - measured) <= 0.1 * measured, f"{name}: bill {bill} against {measured:,} bytes measured"


def test_the_parts_add_up():
    bill = training_memory(GPT_PRESETS["part3"], 12)
    assert bill.weights == bill.gradients == 4 * 5_781_504 and bill.moments == 2 * bill.weights
    assert bill.peak == bill.weights + bill.moments + bill.activations + bill.working
    short = training_memory(GPT_PRESETS["part3"], 12, tokens=128)
    assert short.activations < bill.activations and short.weights == bill.weights
    assert bill.accumulated == 0
    sliced = training_memory(GPT_PRESETS["part3"], 12, accumulate=4)  # 4 slices of 3 sequences
    assert sliced.activations == training_memory(GPT_PRESETS["part3"], 3).activations
    assert sliced.accumulated == bill.gradients and sliced.peak < bill.peak
    assert sliced.peak == sliced.weights + sliced.moments + sliced.accumulated + sliced.activations + sliced.working


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((GPT_PRESETS["tiny"], 0), ValueError, "batch must be a positive int"),
        ((GPT_PRESETS["tiny"], 2, 65), ValueError, "tokens \\(65\\) must be at most the context \\(64\\)"),
        (("tiny", 2), TypeError, "config must be a GPTConfig"),
        ((GPT_PRESETS["tiny"], 12, None, 5), ValueError, "accumulate \\(5\\) must divide the batch \\(12\\)"),
        ((GPT_PRESETS["tiny"], 12, None, 0), ValueError, "accumulate must be a positive int"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, error, match):
    with pytest.raises(error, match=match):
        training_memory(*args)


def test_the_bill_takes_constant_time_whatever_the_batch_or_the_depth():
    """Arithmetic on the sizes: a batch of 10⁷ sequences took 2.5 s (a loop over every head of every sequence),
    10⁹ minutes; a million layers built a million layers' names."""
    tiny = GPT_PRESETS["tiny"]
    for config, batch in (
        (tiny, 10**7),
        (tiny, 10**12),
        (GPTConfig(layers=10**6), 4),
        (GPTConfig(layers=10**12), 10**9),
    ):
        start = time.perf_counter()
        bill = training_memory(config, batch)
        assert time.perf_counter() - start < 0.2, (config, batch)
        assert bill.weights == 4 * parameter_count(config)
    twelve, more = training_memory(tiny, 12).activations, training_memory(tiny, 24).activations
    assert training_memory(tiny, 10**7).activations == twelve + (10**7 - 12) * (more - twelve) // 12
    hybrid = GPTConfig(layers=10**12, layer_pattern="LLLA")
    start = time.perf_counter()
    bill = training_memory(hybrid, 10**9)
    assert time.perf_counter() - start < 0.2 and bill.weights == 4 * parameter_count(hybrid)
    assert hybrid.delta_layers == 3 * 10**12 // 4


def test_a_gated_delta_layer_is_billed_as_what_its_forward_keeps():
    """Its activations: per token C + 3 ch + 2 V + 4 h numbers in place of the attention's 7 C + h, and per
    sequence (K − 1) ch + h d² (neither keeps copies of its weights); its parameters, its own: 5 C² + 2 C h +
    3 C K + 2 h + d in place of 4 C² (ch = 3 C and V = C in this GPT, K = 4)."""
    tiny = GPT_PRESETS["tiny"]
    C, h, d, c, N = tiny.width, tiny.heads, tiny.head_dim, 4, 12 * 64
    softmax, delta = training_memory(tiny, 12), training_memory(replace(tiny, layer_pattern="LA"), 12)
    per_token = (C + 3 * 3 * C + 2 * C + 4 * h) - (7 * C + h)
    per_sequence = 3 * 3 * C + h * d * d
    assert delta.activations - softmax.activations == 2 * c * (N * per_token + 12 * per_sequence)
    assert delta.weights - softmax.weights == 2 * c * (5 * C * C + 2 * C * h + 3 * C * 4 + 2 * h + d - 4 * C * C)


def test_a_learned_position_table_is_billed_as_its_weights():
    """positions="learned": the table's context x C weights, with their gradients and moments, and nothing a token."""
    tiny = GPT_PRESETS["tiny"]
    rope, learned = training_memory(tiny, 12), training_memory(replace(tiny, positions="learned"), 12)
    table = 4 * tiny.context * tiny.width
    assert learned.weights - rope.weights == learned.gradients - rope.gradients == table
    assert learned.moments - rope.moments == 2 * table and learned.activations == rope.activations
