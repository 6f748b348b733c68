"""The memory of one training step of gpt.GPT with optim.AdamW, before it runs: the bill in bytes.

With P parameters, c bytes per number (4 for float32), N = B·T tokens, L layers, width C, MLP hidden H,
vocabulary V, h heads:

    weights      P c                                   the parameters
    gradients    P c                                   one per parameter, built during the backward
    moments      2 P c                                 Adam's m and v
    activations  c N a + dropout masks                 what the forward keeps for the backward (GPT's Trace)
    working      what the backward holds beside them at its fullest (below)

a, the numbers kept per token, counts each array the forward keeps (layers.py and multihead.py):

    per block    10 C      the two norms' x̂; the attention's input, q and k (after RoPE), its
                           output y, and qkv (3 C: v is a view of it, so all of qkv stays); the MLP's input
                 2 H       GELU: the MLP's pre-activation u and the activation's output (its backward makes
                           tanh(...) again, a block of rows at a time)
                 (4 H      SwiGLU: the two halves [gate | up], σ(gate), the output)
                 2 + h     the two norms' 1/σ, and flash attention's logsumexp per head
    the head     2 C + 1   the final norm's x̂ and 1/σ, its output (the head's input)
                 V         the probabilities, which the backward turns into dlogits in place
The weights are kept as they are, not copied: nothing changes them between the step's forward and its backward
(the GPT calls multihead_forward with copies=False). Dropout adds one byte per element of its masks:
N C (2 L + 1). A learned position table (positions="learned") adds its context x C weights to P, nothing a token.

A gated delta layer (GPTConfig.layer_pattern's L; deltanet.py's gated_deltanet, of conv_channels ch = 3C and value
channels V = C in this GPT) keeps in place of the attention's 7 C + h:

    per token    C + 3 ch + 2 V + 4 h   its input; the convolution's inputs, its outputs and their SiLU (q, k,
                                        v); the gated norm's x̂ and the gate z; g, β, x W_a and the norm's 1/σ
    per sequence (K − 1) ch + h d²      the convolution's K − 1 inputs before the first token, and the state
                                        the rule started from (zeros)
and, as the attention, the parameters themselves (the optimizer changes them only after the backward). Its
backward at its fullest is the larger of two moments: inside the rule's backward (beside the layer's own five
arrays of V a token, the rule's flattened copies of q, k, v and do, its gradients, the states and writes it
keeps, and a worker's group of chunks: _linear_kernel.backward_numbers), and after it (the gradients of q, k, v
and the convolution's, 8 V + 2 h d + 5 ch a token).

With gradient accumulation (accumulate = k > 1: optim.accumulated_grads runs the batch k equal slices at a
time), the activations and the backward's working arrays are those of one slice of B/k sequences, and a
running sum of the gradients, P c more (accumulated), is held from the first slice's backward to the update.

The step's peak: the weights and moments live throughout; on top of them either the backward's start
(all activations, the head's gradients: E's V C and dx's N C; then, with the probabilities freed, the
last MLP's backward: the N x H arrays of its activation's gradient and dW_proj; then the last attention's
backward: beside E's gradient, dx and the last MLP's gradients, its own N x C arrays (dropout's mask
applied to dx, the heads merged for dW_out, dY, and the contiguous copies of v and dY that the flash
backward reads) and the flash backward's own peak, peaks.flash_attention_backward_bytes; or the last gated
delta layer's backward; the last mixer of a kind that is not the last layer finds the activations of the blocks
after it freed, less their parameters' gradients) or the optimizer's update (every gradient, and one scratch
array the size of the largest parameter):

    peak = weights + moments + accumulated + max(activations + working, gradients + largest parameter)

(with accumulation the second term is a slice's gradients being added to the sum, with the product of the
largest one's weighting; without it, accumulated is 0 and the second term is the optimizer's update).

The formulas count NumPy's arrays (what tracemalloc sees), not Python's objects or the interpreter;
tests/test_trainbill.py holds them within 10% of tracemalloc's peak for the presets and their variants.

API:
    training_memory(config, batch, tokens=None, accumulate=1) -> TrainingMemory(weights, gradients, moments,
                                                        activations, working, accumulated, peak), each in bytes
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from ._checks import check_positive_int
from ._linear_kernel import backward_numbers
from .gpt import GPTConfig, param_shapes, parameter_count
from .peaks import flash_attention_backward_bytes

__all__ = ["TrainingMemory", "training_memory"]


class TrainingMemory(NamedTuple):
    """Bytes of one training step: the parameters, their gradients, Adam's two moments, the activations kept
    for the backward, the backward's working arrays at its fullest, the running sum of gradient accumulation
    (0 without it), and the step's peak (the module docstring)."""

    weights: int
    gradients: int
    moments: int
    activations: int
    working: int
    accumulated: int
    peak: int


def activation_numbers_per_token(config: GPTConfig) -> int:
    """a: the numbers the forward keeps per token (the module docstring's tables)."""
    C, H, shape = config.width, config.hidden, config.delta_shape
    every_block = 3 * C + (2 * H if config.mlp == "gelu" else 4 * H) + 2  # the two norms' x̂ and 1/σ, the MLP's
    attention = 7 * C + config.heads
    delta = C + 3 * shape.conv_channels + 2 * shape.value_heads * shape.value_dim + 4 * shape.value_heads
    mixers = (config.layers - config.delta_layers) * attention + config.delta_layers * delta
    return config.layers * every_block + mixers + 2 * C + 1 + config.vocab


def delta_numbers_per_sequence(config: GPTConfig) -> int:
    """A gated delta layer's numbers kept per sequence: the convolution's inputs before the first token and the
    state the rule started from."""
    shape = config.delta_shape
    return (shape.conv_kernel - 1) * shape.conv_channels + shape.value_heads * shape.key_dim * shape.value_dim


def delta_backward_numbers(config: GPTConfig, batch: int, tokens: int, itemsize: int) -> int:
    """A gated delta layer's backward at its fullest, in numbers (the module docstring): inside the rule's
    backward, or after it."""
    shape, N = config.delta_shape, batch * tokens
    V, qk, h = shape.value_heads * shape.value_dim, shape.value_heads * shape.key_dim, shape.value_heads
    rule = backward_numbers(batch * h, tokens, 64, shape.key_dim, shape.value_dim, itemsize)  # gpt's chunks of 64
    return max(N * (5 * V + 2 * qk + 2 * V + 2 * h) + rule, N * (8 * V + 2 * qk + 5 * shape.conv_channels))


def backward_working(config: GPTConfig, batch: int, tokens: int, one_layer: dict[str, tuple[int, ...]],
                     delta_layer: dict[str, tuple[int, ...]]) -> int:  # fmt: skip
    """The backward's working bytes at its fullest (the module docstring): the head's gradients, the last MLP's
    backward, or the last mixer of each kind's, less what the blocks after it freed (their activations, beside
    the gradients they left)."""
    c, N, C, H, V = np.dtype(config.dtype).itemsize, batch * tokens, config.width, config.hidden, config.vocab
    # the head's gradients (E's from the head, dx), then, with the probabilities freed, the last MLP's backward:
    # GELU's dh and du (SwiGLU: dh, [dgate | dup] and a temporary)
    head = V * C + N * C
    last_mlp = head - N * V + (2 if config.mlp == "gelu" else 3) * N * H + H * C
    mlp_grads = sum(math.prod(shape) for name, shape in one_layer.items() if name.startswith("h.0.mlp."))
    attention_arrays = (5 if config.dropout else 4) * N * C + C * C  # [dropout's dx], y merged, dY, copies; dW_out
    flash = flash_attention_backward_bytes(tokens, heads=config.heads, head_dim=config.head_dim, batch=batch,
                                           dtype=config.dtype, causal=True)  # fmt: skip
    working = c * max(head, last_mlp)
    freed = {  # what a block's backward leaves freed: its activations, less its parameters' gradients
        kind: N * (activation_numbers_per_token(dataclasses.replace(config, layers=1, layer_pattern=kind)) - 2 * C - 1
                   - V) - sum(math.prod(shape) for name, shape in layer.items() if name.startswith("h.0."))
        for kind, layer in (("A", one_layer), ("L", delta_layer))
    }  # fmt: skip
    freed["L"] += batch * delta_numbers_per_sequence(config)
    mixers = {"A": attention_arrays, "L": delta_backward_numbers(config, batch, tokens, c)}
    for kind, other in (("A", "L"), ("L", "A")):
        after = layers_after_the_last(config, kind)  # the other kind's blocks, their backward done
        if after is not None:
            arrays = head - N * V + mlp_grads + mixers[kind] - after * freed[other]
            working = max(working, c * arrays + (flash if kind == "A" else 0))
    return working


def layers_after_the_last(config: GPTConfig, kind: str) -> int | None:
    """How many layers come after the last of this kind ("A" or "L"); None where there is none: at most one
    repeat of layer_pattern is searched."""
    pattern = config.layer_pattern or "A"
    for after in range(min(len(pattern), config.layers)):
        if config.layer_kind(config.layers - 1 - after) == kind:
            return after
    return None


def training_memory(config: GPTConfig, batch: int, tokens: int | None = None, accumulate: int = 1) -> TrainingMemory:
    """The bill of one step (loss_and_grads, clip_grad_norm, AdamW.step) for `batch` sequences of `tokens`
    tokens each (default: the context), in bytes; accumulate > 1: the batch in that many equal slices
    (optim.accumulated_grads), which must divide it. Arithmetic on the sizes: constant time, whatever the batch
    or the depth.

        >>> bill = training_memory(GPTConfig(), batch=12)   # the tiny preset: 795,904 parameters
        >>> bill.weights, bill.moments
        (3183616, 6367232)
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig; got {type(config).__name__}")
    batch = check_positive_int(batch, "batch")
    tokens = check_positive_int(tokens, "tokens", default=config.context)
    if tokens > config.context:
        raise ValueError(
            f"tokens ({tokens}) must be at most the context ({config.context}): the model trains on no more"
        )
    accumulate = check_positive_int(accumulate, "accumulate")
    if batch % accumulate:
        raise ValueError(f"accumulate ({accumulate}) must divide the batch ({batch}) into equal slices")
    batch //= accumulate  # the sequences whose activations are held at once
    c = np.dtype(config.dtype).itemsize
    one_layer = param_shapes(dataclasses.replace(config, layers=1, layer_pattern=None))  # every attention layer's
    delta_layer = param_shapes(dataclasses.replace(config, layers=1, layer_pattern="L"))  # and delta layer's
    P = parameter_count(config)
    N, L, C = batch * tokens, config.layers, config.width
    delta_layers = config.delta_layers

    masks = N * C * (2 * L + 1) if config.dropout else 0  # one byte per element
    kept = N * activation_numbers_per_token(config) + batch * delta_layers * delta_numbers_per_sequence(config)
    activations = c * kept + masks
    working = backward_working(config, batch, tokens, one_layer, delta_layer)
    largest = c * max(math.prod(shape) for shape in (*one_layer.values(), *delta_layer.values()))
    weights, gradients, moments = c * P, c * P, 2 * c * P
    accumulated = c * P if accumulate > 1 else 0  # the running sum, beside a slice's own gradients
    peak = weights + moments + accumulated + max(activations + working, gradients + largest)
    return TrainingMemory(weights, gradients, moments, activations, working, accumulated, peak)
