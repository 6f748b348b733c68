"""The mods' derivatives: the backward through a score_mod, and the gradients of what it learns.

The forward (attention.py, flex.py) rewrites every scaled score S into S' = score_mod(S; θ) before the
softmax. The backward's five lines (backward.py) then give dS' = ∂loss/∂S' where they gave dS, and the
chain rule carries it through the mod: one line for the scores, one for the mod's learned parameters θ.

    dS = dS' ∘ ∂S'/∂S                 score_mod.derivative(S, b, h, q_idx, kv_idx); None means 1 (a bias)
    dθ_h = Σ_ij dS'_ij ∂S'_ij/∂θ_h    score_mod.param_grad(dS', b, h, q_idx, kv_idx), head by head

The ready-made mods (mods.py) carry both:

    Alibi          S' = S − slope_h·|i + S − L − j|: a bias, ∂S'/∂S = 1; learned slopes:
                   ∂S'/∂slope_h = −|i + S − L − j|, so dslope_h = −Σ_ij dS'_ij |i + S − L − j|
    RelativeBias   S' = S + table[h, bucket(j − i')]: a bias; dtable[h, r] = Σ of dS' over head h's bucket r
    Softcap        S' = cap·tanh(S / cap): ∂S'/∂S = 1 − tanh²(S / cap); nothing learned

A mod of your own tells the backward its derivative through Differentiable(score_mod, derivative). A sink (a
logit per head that joins every row's softmax and holds no value) takes the weight P_sink,i = exp(sink_h −
lse_i) of row i, so O_i loses that share: ∂O_i/∂sink_h = −P_sink,i O_i, and dsink_h = −Σ_i P_sink,i D_i.

Read it in this order: score_mod_grads (the two lines on one block of one head's scores, plain), then
Differentiable. attention_backward runs the same two lines on whole matrices (backward.score_mod_backward),
flex_attention_backward on every tile it runs (the engine's _backward_kernel.through_score_mod); the tests
(tests/test_mod_grads.py) hold them to finite differences and to each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._mod_calls import ScoreModFn, derivative_of, name_of

__all__ = ["Differentiable", "score_mod_grads"]


def score_mod_grads(
    dnew: np.ndarray, score: np.ndarray, score_mod: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any
) -> tuple[np.ndarray, np.ndarray | None]:
    """The chain rule through new = score_mod(score) for one block of scores of head h in batch entry b:
    dnew = ∂loss/∂new and the raw scores, shaped alike, -> (dscore = ∂loss/∂score, dparams = ∂loss/∂θ_h, the
    gradient of head h's row of score_mod.params, or None when nothing is learned).

    >>> from tinyattn_np import Softcap
    >>> score, dnew = np.array([[0.0, 2.0]]), np.ones((1, 2))
    >>> q_idx, kv_idx = np.arange(1)[:, None], np.arange(2)  # (1, 1), (2,): one query, two keys
    >>> dscore, dparams = score_mod_grads(dnew, score, Softcap(2.0), 0, 0, q_idx, kv_idx)
    >>> dscore.round(3)  # 1 - tanh²(score / cap): 1 at 0, 1 - tanh²(1) at the cap
    array([[1.  , 0.42]])
    """
    learned = getattr(score_mod, "params", None) is not None
    dparams = score_mod.param_grad(dnew, b, h, q_idx, kv_idx) if learned else None  # dθ_h = Σ dnew ∂new/∂θ_h
    derivative = derivative_of(score_mod, score, b, h, q_idx, kv_idx)  # ∂new/∂score; None: 1 (a bias)
    dscore = dnew if derivative is None else dnew * derivative  # dS = dS' ∘ ∂S'/∂S
    return dscore, dparams


class Differentiable:
    """Your score_mod with its derivative, so that the backward can go through it:

        Differentiable(score_mod, derivative), derivative(score, b, h, q_idx, kv_idx) = ∂score_mod/∂score

    called on the raw scores of a tile (a number or an array that broadcasts to them; 1 for a bias). Nothing
    in it is learned: for learned parameters, write a class like mods.Alibi with params and param_grad.
    """

    params = None

    def __init__(self, score_mod: ScoreModFn, derivative: ScoreModFn):
        if not callable(score_mod) or not callable(derivative):
            got = f"{score_mod!r} and {derivative!r}"
            raise TypeError(f"score_mod and derivative must be functions; got {got}")
        self.score_mod, self.derivative_fn = score_mod, derivative
        self.__name__ = name_of(score_mod)

    def __repr__(self) -> str:
        return f"Differentiable({self.__name__})"

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.score_mod(score, b, h, q_idx, kv_idx)

    def derivative(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.derivative_fn(score, b, h, q_idx, kv_idx)
