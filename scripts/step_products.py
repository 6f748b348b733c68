"""train_speed.py --torch: a training step's dense products alone, ours (NumPy's matmul, OpenBLAS) and torch's, at
the shapes and layouts the step runs them, timed in turns. For every weight matrix W (in, out) of the model, with
N = batch x context rows:

    x W        (N, in) @ (in, out)        the forward
    dy Wᵀ      (N, out) @ (in, out)ᵀ      dx
    xᵀ dy      (N, in)ᵀ @ (N, out)        dW

and for the head tied to the embedding E (V, C): x Eᵀ, dlogits E and dlogitsᵀ x. The attention's own products
(inside its kernels) are left out. What the two steps take beyond these is everything else: the attention, the
element-wise layers, the loss, the optimizer and the Python around them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinyattn_np.gpt import GPT
from tinyattn_np.measure import alternating_medians_ms

Shape = tuple[int, int]


def product_shapes(model: GPT, batch: int) -> list[tuple[Shape, Shape, str]]:
    """(left, right, layout) of each dense product of a step: layout "ab" (a @ b), "abt" (a @ bᵀ, b stored as
    given) or "atb" (aᵀ @ b, a stored as given), as the step's lines take their operands."""
    N, products = batch * model.config.context, []
    for name, w in model.params.items():
        if w.ndim != 2 or name == "wpe":  # a vector, or the learned position table (added, not multiplied)
            continue
        if name == "wte":  # the tied head: logits = x Eᵀ, dx = dlogits E, dE = dlogitsᵀ x
            V, C = w.shape
            products += [((N, C), (V, C), "abt"), ((N, V), (V, C), "ab"), ((N, V), (N, C), "atb")]
        else:
            fan_in, fan_out = w.shape
            products += [
                ((N, fan_in), w.shape, "ab"),
                ((N, fan_out), w.shape, "abt"),
                ((N, fan_in), (N, fan_out), "atb"),
            ]
    return products


def time_products(torch: Any, model: GPT, batch: int, repeats: int, rounds: int, idle: float) -> tuple[float, float]:
    """The step's dense products (product_shapes) in NumPy and in torch, float32, the same numbers, the two
    taking turns: (ours ms, torch's ms), each the median of `rounds` turns of `repeats` passes over them all."""
    rng = np.random.default_rng(0)
    operands = [
        (rng.standard_normal(a, dtype=np.float32), rng.standard_normal(b, dtype=np.float32), layout)
        for a, b, layout in product_shapes(model, batch)
    ]
    tensors = [(torch.from_numpy(a), torch.from_numpy(b), layout) for a, b, layout in operands]

    def ours() -> None:
        for a, b, layout in operands:
            _ = a @ b.T if layout == "abt" else a.T @ b if layout == "atb" else a @ b

    def theirs() -> None:
        for a, b, layout in tensors:
            _ = a @ b.t() if layout == "abt" else a.t() @ b if layout == "atb" else a @ b

    ms = alternating_medians_ms([ours, theirs], repeats, rounds, idle=idle)
    return ms[0], ms[1]
