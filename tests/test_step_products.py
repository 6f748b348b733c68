"""scripts/step_products.py (train_speed.py --torch): the dense products of a training step, at the shapes and
layouts the step runs them, and their timing in turns (torch stood in for by NumPy itself here)."""

from __future__ import annotations

import types

import numpy as np
from test_scripts import load

from tinyattn_np.gpt import GPT, GPTConfig


def test_every_weight_matrix_gives_its_three_products_and_the_tied_head_its_own() -> None:
    products = load("step_products.py").product_shapes
    config = GPTConfig(vocab=11, context=8, layers=2, heads=2, width=8)
    model, N = GPT(config, rng=0), 3 * 8
    shapes = products(model, batch=3)
    matrices = [w for name, w in model.params.items() if w.ndim == 2 and name != "wte"]
    assert len(shapes) == 3 * len(matrices) + 3
    assert shapes[:3] == [((N, 8), (11, 8), "abt"), ((N, 11), (11, 8), "ab"), ((N, 11), (N, 8), "atb")]  # the head
    assert model.params["h.0.mlp.w_fc"].shape == (8, 32)  # x W, dy Wᵀ and xᵀ dy of the MLP's first matrix
    assert {((N, 8), (8, 32), "ab"), ((N, 32), (8, 32), "abt"), ((N, 8), (N, 32), "atb")} <= set(shapes)
    for a, b, layout in shapes:  # every product is defined: its inner sizes agree
        inner = {"ab": (a[1], b[0]), "abt": (a[1], b[1]), "atb": (a[0], b[0])}[layout]
        assert inner[0] == inner[1], (a, b, layout)


def test_a_learned_position_table_is_no_product() -> None:
    products = load("step_products.py").product_shapes
    rope = GPT(GPTConfig(vocab=11, context=8, layers=1, heads=2, width=8), rng=0)
    learned = GPT(GPTConfig(vocab=11, context=8, layers=1, heads=2, width=8, positions="learned"), rng=0)
    assert "wpe" in learned.params and products(learned, 2) == products(rope, 2)


def test_both_sides_are_timed_in_turns() -> None:
    class Tensor(np.ndarray):
        def t(self) -> np.ndarray:
            return self.T

    torch = types.SimpleNamespace(from_numpy=lambda a: a.view(Tensor))
    model = GPT(GPTConfig(vocab=11, context=8, layers=1, heads=2, width=8), rng=0)
    ours, theirs = load("step_products.py").time_products(torch, model, 2, repeats=2, rounds=2, idle=0.0)
    assert ours > 0 and theirs > 0
