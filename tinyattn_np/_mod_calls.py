"""Calling a mod (mods.py teaches them): a mask_mod or a score_mod on a block of scores, with what it returns
checked, and a score_mod checked before anything runs.

The reference (attention.py), the block masks (blockmask.py) and the tile kernels (_flash_kernel.py,
_backward_kernel.py) all call the user's mods through these, so that a mod that returns the wrong thing is
refused with the same message wherever it runs: bools from a mask_mod, numbers from a score_mod and from its
derivative, each of a shape that broadcasts to the indices or the scores.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "MaskMod",
    "ScoreModFn",
    "check_score_mod",
    "derivative_of",
    "modded",
    "name_of",
    "positional_arguments",
    "score_indices",
    "visible",
]

MaskMod = Callable[..., Any]
ScoreModFn = Callable[..., Any]


def score_indices(batch: tuple[int, ...], hq: int, n_q: int, n_k: int) -> tuple[np.ndarray, ...]:
    """b, h, q_idx, kv_idx for the scores (*batch, Hq, L, S), each shaped to broadcast against them;
    b counts the batch entries in C order over the leading dims (0 when there are none)."""
    b = np.arange(math.prod(batch)).reshape(*batch, 1, 1, 1)  # (*batch, 1, 1, 1)
    return b, np.arange(hq)[:, None, None], np.arange(n_q)[:, None], np.arange(n_k)  # (Hq, 1, 1), (L, 1), (S,)


def visible(mask_mod: MaskMod, b: Any, h: Any, q_idx: np.ndarray, kv_idx: np.ndarray) -> np.ndarray:
    """mask_mod(b, h, q_idx, kv_idx) as a bool array (True = may attend) that broadcasts to the shape of the
    indices; anything but bools is a TypeError, another shape a ValueError."""
    allowed = np.asarray(mask_mod(b, h, q_idx, kv_idx))
    if allowed.dtype != np.bool_:
        name = name_of(mask_mod)
        raise TypeError(f"mask_mod must return bools (True = may attend); {name} gave {allowed.dtype}")
    indices = np.broadcast_shapes(*(np.shape(x) for x in (b, h, q_idx, kv_idx)))
    if not broadcasts_to(allowed.shape, indices):
        raise ValueError(
            "mask_mod must return one bool per (b, h, q_idx, kv_idx), an array that broadcasts to the "
            f"indices' shape {indices}; {name_of(mask_mod)} gave shape {allowed.shape}"
        )
    return allowed


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of `shape` broadcasts to `target` without growing it."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:  # shapes that do not broadcast at all
        return False


def modded(score_mod: ScoreModFn, scores: np.ndarray, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
    """score_mod(scores, b, h, q_idx, kv_idx), checked: numbers that broadcast to the scores' shape."""
    new = np.asarray(score_mod(scores, b, h, q_idx, kv_idx))
    return checked_numbers(new, scores.shape, "score_mod", score_mod)


def derivative_of(
    score_mod: Any,
    scores: np.ndarray,
    b: Any,
    h: Any,
    q_idx: Any,
    kv_idx: Any,
) -> np.ndarray | None:
    """score_mod.derivative(scores, b, h, q_idx, kv_idx) = ∂new/∂score, checked as modded checks the mod's own
    result; None stands for 1 (a bias). mod_grads.py derives what the backward does with it."""
    derivative = score_mod.derivative(scores, b, h, q_idx, kv_idx)
    if derivative is None:
        return None
    return checked_numbers(np.asarray(derivative), scores.shape, "score_mod.derivative", score_mod)


def checked_numbers(result: np.ndarray, shape: tuple[int, ...], what: str, mod: Any) -> np.ndarray:
    """result, when it holds numbers (not bools) that broadcast to the scores' shape; else a TypeError."""
    if result.dtype == np.bool_:
        raise TypeError(
            f"{what} must return numbers; {name_of(mod)} gave bools, as a mask_mod does: pass a mask_mod as "
            "block_mask=create_block_mask(mask_mod, B, H, L, S) (or mask_mod= to attention), "
            "not as the score_mod"
        )
    if result.dtype.kind not in "fiu" or not broadcasts_to(result.shape, shape):
        raise TypeError(
            f"{what} must return numbers of the scores' shape {shape}; {name_of(mod)} gave {result.dtype} "
            f"of shape {result.shape}"
        )
    return result


def name_of(mod: Any) -> str:
    """A mod's name for a message: its function name, or its repr."""
    return getattr(mod, "__name__", None) or repr(mod)


def check_score_mod(score_mod: Any, backward: bool = False) -> Any:
    """score_mod as given (None or a function); for the backward it must say its derivative."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        raise TypeError(
            f"score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) or None; got {score_mod!r}"
        )
    if positional_arguments(score_mod) == 4:
        raise TypeError(
            f"score_mod {name_of(score_mod)} takes 4 arguments, as a mask_mod(b, h, q_idx, kv_idx) does; "
            "a score_mod takes (score, b, h, q_idx, kv_idx). To hide keys, pass "
            "block_mask=create_block_mask(mask_mod, B, H, L, S)"
        )
    if backward and not callable(getattr(score_mod, "derivative", None)):
        raise TypeError(
            f"score_mod {name_of(score_mod)} does not give its derivative, which the backward needs: pass "
            "score_mod=Differentiable(score_mod, derivative), derivative(score, b, h, q_idx, kv_idx) = "
            "∂score_mod/∂score (1 for a bias), or a ready-made mod (Alibi, Softcap, RelativeBias)"
        )
    return score_mod


def positional_arguments(fn: Any) -> int | None:
    """How many positional arguments fn takes (None: any number, or its signature cannot be read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
