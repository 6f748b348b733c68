"""AdamW, its learning-rate schedule, gradient clipping and accumulation, for parameters in a dict name -> array.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2), step t = 1, 2, ...
for a parameter θ with gradient g:

    m = β1 m + (1 - β1) g                  the running mean of the gradient
    v = β2 v + (1 - β2) g²                 ... and of its square
    m̂ = m / (1 - β1^t),  v̂ = v / (1 - β2^t)     bias correction: m and v start at 0
    θ = θ - lr λ θ - lr m̂ / (√v̂ + ε)       the decay is decoupled: it never enters m or v

The paper writes the step as η_t (α m̂ / (√v̂ + ε) + λ' θ) with a schedule multiplier η_t; here lr = η_t α and
λ = λ' / α, torch.optim.AdamW's parametrisation. Weight decay applies to matrices (2-D and more: the embeddings
and the weights of every matmul) only, never to biases or norm gains (nanoGPT's rule).

The schedule (warmup_cosine_lr): linear warm-up to lr over `warmup` steps, then a half cosine down to min_lr
at step `total`, then min_lr. Clipping (clip_grad_norm): if the global norm ‖g‖ = √(Σ over every array of
Σ g²) exceeds max_norm, every gradient is scaled by max_norm / ‖g‖. Accumulation (accumulate_grads): the sum
of k micro-batches' gradients, each weighted 1/k, is the gradient of the mean loss over the k micro-batches;
accumulated_grads runs a batch through a loss_and_grads that way, k equal slices of its rows at a time, so that
only one slice's activations are held at once (and one more set of gradients, the running sum).

API:
    AdamW(params, *, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        .step(params, grads, *, lr=None)     updates params in place; lr overrides the constructor's (a schedule)
        .t  .m  .v  .decay                   step count, the two moments (dicts like params), who is decayed
        .state_dict() -> {str: array}        for np.savez; .load_state_dict(state) restores it bit for bit
    A step, and a load, is all or nothing: every check (names, shapes, real floats, finite gradients, weights
    that can be written in place; a state's numbers in their ranges) comes before the first change.
    warmup_cosine_lr(step, *, lr, warmup, total, min_lr=0.0) -> float      step counts from 0
    global_norm(grads) -> float          clip_grad_norm(grads, max_norm) -> the norm before clipping
                                         (finite for finite gradients, however large: scaled_norm)
    accumulate_grads(total, grads, weight=1.0) -> total (None: a new dict)
    accumulated_grads(loss_and_grads, x, y, parts) -> (loss, grads)    the mean over `parts` slices of rows
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import check_count, check_positive_int
from ._parallel import cpu_cores, run_items

Array = NDArray[np.floating]
Params = dict[str, Array]

__all__ = ["AdamW", "accumulate_grads", "accumulated_grads", "clip_grad_norm", "global_norm", "warmup_cosine_lr"]

HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")


class AdamW:
    """AdamW over the arrays of a dict name -> array; its moments m and v are dicts of the same shapes and dtypes.

    params: the dict to optimise (its names, shapes and dtypes are fixed here; step() takes the same dict).
    lr: the learning rate when step() is given none; betas (β1, β2); eps (ε); weight_decay (λ, matrices only).
    """

    def __init__(
        self,
        params: Params,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
    ):
        if not isinstance(params, dict) or not params:
            raise ValueError("params must be a non-empty dict name -> array")
        for name, p in params.items():
            check_floats(p, f"params[{name!r}]")
        self.lr = check_number(lr, "lr")
        beta1, beta2 = betas
        self.beta1, self.beta2 = check_number(beta1, "betas[0]", below=1.0), check_number(beta2, "betas[1]", below=1.0)
        self.eps = check_number(eps, "eps")
        self.weight_decay = check_number(weight_decay, "weight_decay")
        self.t = 0  # steps taken
        self.decay = {name: p.ndim >= 2 for name, p in params.items()}  # matrices only
        self.m = {name: np.zeros_like(p) for name, p in params.items()}
        self.v = {name: np.zeros_like(p) for name, p in params.items()}

    def __repr__(self) -> str:
        return (
            f"AdamW(lr={self.lr:g}, betas=({self.beta1:g}, {self.beta2:g}), eps={self.eps:g}, "
            f"weight_decay={self.weight_decay:g}; {len(self.m)} arrays, {self.t} steps taken)"
        )

    def step(self, params: Params, grads: Params, *, lr: float | None = None) -> None:
        """One AdamW step (the module docstring's lines) on every array of params, in place.

        grads: a dict with params' names and shapes, finite. lr: this step's learning rate (default: the
        constructor's). Nothing changes, the step count included, when any check fails.
        """
        self._check(params, "params", writable=True)
        self._check(grads, "grads", finite=True)
        lr = self.lr if lr is None else check_number(lr, "lr")
        self.t += 1
        bias_correction1 = 1.0 - self.beta1**self.t
        sqrt_bias_correction2 = math.sqrt(1.0 - self.beta2**self.t)
        step_size = lr / bias_correction1  # lr m̂ = (lr / (1 - β1^t)) m

        def update_one(name: str) -> None:  # one parameter's lines; each writes only its own θ, m and v
            theta, g, m, v = params[name], grads[name], self.m[name], self.v[name]
            if self.decay[name]:
                theta *= 1.0 - lr * self.weight_decay  # θ - lr λ θ, before the Adam step, as torch orders it
            m *= self.beta1  # m = β1 m + (1 - β1) g
            m += (1.0 - self.beta1) * g
            v *= self.beta2  # v = β2 v + (1 - β2) g²
            update = np.square(g)  # one scratch array per parameter: g², then √v̂ + ε, then the update
            update *= 1.0 - self.beta2
            v += update
            np.sqrt(v, out=update)  # √v̂ + ε = √v / √(1 - β2^t) + ε
            update /= sqrt_bias_correction2
            update += self.eps
            np.divide(m, update, out=update)
            update *= step_size
            theta -= update

        # the parameters are independent: the cores take them in turn (NumPy lets go of the interpreter lock)
        run_items(update_one, list(params), min(len(params), cpu_cores()))

    def _check(self, arrays: Any, name: str, *, writable: bool = False, finite: bool = False) -> None:
        """arrays: a dict with exactly the optimiser's names, each a real float array of its shape; writable:
        each an ndarray the step can change in place (the weights); finite: no NaN or inf (the gradients)."""
        if not isinstance(arrays, dict) or arrays.keys() != self.m.keys():
            got = sorted(arrays) if isinstance(arrays, dict) else type(arrays).__name__
            raise ValueError(f"{name} must be a dict with the optimiser's names {sorted(self.m)}; got {got}")
        for key, value in arrays.items():
            if np.shape(value) != self.m[key].shape:
                raise ValueError(f"{name}[{key!r}] must have shape {self.m[key].shape}; got {np.shape(value)}")
            if writable and not isinstance(value, np.ndarray):
                raise TypeError(f"{name}[{key!r}] must be a writable ndarray (the step changes it in place)")
            if writable and not value.flags.writeable:
                raise ValueError(f"{name}[{key!r}] must be a writable ndarray (the step changes it in place)")
            check_floats(value, f"{name}[{key!r}]", finite=finite)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything step() reads, as arrays (np.savez(path, **opt.state_dict())): the hyperparameters, the
        step count t, and the moments under "m." and "v." + the parameter's name."""
        state: dict[str, np.ndarray] = {name: np.array(getattr(self, name)) for name in HYPERPARAMETERS}
        state["t"] = np.array(self.t)
        state |= {f"m.{name}": m.copy() for name, m in self.m.items()}
        state |= {f"v.{name}": v.copy() for name, v in self.v.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict() (from np.load, say) into this optimiser, built for the same params: the
        moments must have the same names and shapes. Nothing changes if any check fails: the hyperparameters
        as the constructor checks them, t an int >= 0, m finite and v >= 0 (+inf included: (1 - β2) g² of a
        finite float32 g past 1.8e19 overflows)."""
        want = {*HYPERPARAMETERS, "t", *(f"m.{n}" for n in self.m), *(f"v.{n}" for n in self.v)}
        if set(state) != want:
            missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
            raise ValueError(f"state does not fit this optimiser: missing {missing}, unexpected {unexpected}")
        hyperparameters = {name: check_hyperparameter(one_number(state, name), name) for name in HYPERPARAMETERS}
        t = check_count(one_number(state, "t"), "state['t']")
        moments = {(kind, name): self._checked_moment(state, kind, name) for name in self.m for kind in ("m", "v")}
        for name, value in hyperparameters.items():
            setattr(self, name, value)
        self.t = t
        for (kind, name), moment in moments.items():
            getattr(self, kind)[name] = np.array(moment, dtype=self.m[name].dtype)

    def _checked_moment(self, state: dict[str, Any], kind: str, name: str) -> np.ndarray:
        """state's moment m or v of the parameter `name`: of its shape, real floats, m finite, v >= 0."""
        value, label = np.asarray(state[f"{kind}.{name}"]), f"state[{kind}.{name!r}]"
        if value.shape != self.m[name].shape:
            raise ValueError(f"{label} must have shape {self.m[name].shape}; got {value.shape}")
        check_floats(value, label, finite=kind == "m")
        if kind == "v" and not (value >= 0).all():  # false for NaN too
            raise ValueError(f"{label} holds {value.min()}: a second moment, a mean of g², must be >= 0")
        return value


def check_floats(value: Any, name: str, *, finite: bool = False) -> None:
    """value an array of real floats (float16, 32 or 64), and finite where asked; else an error naming it."""
    dtype = np.asarray(value).dtype
    if dtype.kind != "f":
        raise TypeError(f"{name} must hold real floats; got dtype {dtype}")
    if finite and not np.isfinite(value).all():
        raise ValueError(f"{name} holds NaN or inf; nothing was changed")


def check_hyperparameter(value: Any, name: str) -> float:
    """A state's hyperparameter as the constructor checks it: β1 and β2 in [0, 1), the others finite and >= 0."""
    return check_number(value, f"state[{name!r}]", below=1.0 if name in ("beta1", "beta2") else None)


def one_number(state: dict[str, Any], name: str) -> Any:
    """state[name] as one number (a 0-d array, as np.savez writes a float, becomes its scalar)."""
    value = state[name]
    if np.ndim(value) != 0:
        raise ValueError(f"state[{name!r}] must be one number; got shape {np.shape(value)}")
    return np.asarray(value)[()]


def check_number(value: Any, name: str, *, below: float | None = None) -> float:
    """A finite number >= 0 (and < below, where given) as a float; anything else names the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number; got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (below is not None and value >= below):
        limit = f"in [0, {below})" if below is not None else ">= 0"
        raise ValueError(f"{name} must be a finite number {limit}; got {value}")
    return float(value)


def warmup_cosine_lr(step: int, *, lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """The learning rate of step `step` (from 0): lr (step + 1) / warmup while step < warmup, then
    min_lr + ½ (lr - min_lr)(1 + cos(π s)) with s = (step - warmup) / (total - warmup) going 0 -> 1, then min_lr."""
    step, warmup, total = check_count(step, "step"), check_count(warmup, "warmup"), check_count(total, "total")
    lr, min_lr = check_number(lr, "lr"), check_number(min_lr, "min_lr")
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)  # 0 .. 1
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def global_norm(grads: Params) -> float:
    """‖g‖ = √(Σ over every array of Σ g²): each array's Σ g² in its dtype (BLAS's dot), the arrays' sums added
    in float64. Where that overflows (float32 gradients past 1.8e19, float64 past 1.3e154), scaled_norm."""
    total = sum(float(np.vdot(g, g)) for g in grads.values())
    return scaled_norm(grads) if math.isinf(total) else math.sqrt(total)


def scaled_norm(grads: Params) -> float:
    """‖g‖ = s √(Σ (g / s)²) with s = max |g| over every array, in float64: no square is above 1, so only a
    gradient that holds inf (or NaN) gives inf (or NaN)."""
    largest = max((float(np.max(np.abs(g))) for g in grads.values() if np.size(g)), default=0.0)
    if not math.isfinite(largest):
        return largest
    scaled = (np.asarray(g, dtype=np.float64) / largest for g in grads.values())  # each |g / s| <= 1
    return largest * math.sqrt(sum(float(np.vdot(g, g)) for g in scaled))


def clip_grad_norm(grads: Params, max_norm: float) -> float:
    """Scale every gradient by max_norm / ‖g‖ when ‖g‖ > max_norm, in place; return ‖g‖ before clipping.

    As torch.nn.utils.clip_grad_norm_: the factor is max_norm / (‖g‖ + 1e-6), at most 1. A NaN or inf norm
    is returned as it is and changes nothing: the caller decides (stop, skip the step).
    """
    max_norm = check_number(max_norm, "max_norm")
    norm = global_norm(grads)
    factor = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and factor < 1.0:
        for g in grads.values():
            g *= factor
    return norm


def accumulate_grads(total: Params | None, grads: Params, weight: float = 1.0) -> Params:
    """total + weight · grads, in place on total's arrays (total None: a new dict weight · grads).

    Gradient accumulation: with k micro-batches of equal size, weight 1/k gives the gradient of the mean loss.
    """
    if total is None:
        return {name: g * weight for name, g in grads.items()}
    if total.keys() != grads.keys():
        raise ValueError(f"grads must have total's names {sorted(total)}; got {sorted(grads)}")
    for name, g in grads.items():
        total[name] += weight * g
    return total


def accumulated_grads(
    loss_and_grads: Callable[[Any, Any], tuple[float, Params]], x: Any, y: Any, parts: int
) -> tuple[float, Params]:
    """The mean loss over the rows of x and y (a batch, one sequence a row) and its gradients, run through
    loss_and_grads(x, y) -> (mean loss, grads) `parts` equal slices of rows at a time: gradient accumulation.
    Each slice's loss and gradients weigh 1/parts, so the result is the whole batch's to rounding, while the
    activations held at once are one slice's; the running sum is one more set of gradients beside them.

        loss, grads = accumulated_grads(model.loss_and_grads, x, y, parts=4)   # 4 slices of len(x) / 4 rows

    parts = 1 is loss_and_grads(x, y) itself. A batch whose rows do not split into equal slices is refused.
    """
    parts = check_positive_int(parts, "parts")
    if len(x) != len(y) or len(x) % parts:
        raise ValueError(f"x and y must have the same rows, a multiple of parts = {parts}; got {len(x)} and {len(y)}")
    if parts == 1:
        return loss_and_grads(x, y)
    rows = len(x) // parts
    loss, total = loss_and_grads(x[:rows], y[:rows])
    loss /= parts
    for g in total.values():  # the first slice's gradients become the running sum: scaled in place, not copied
        g *= 1 / parts
    for start in range(rows, len(x), rows):
        part_loss, grads = loss_and_grads(x[start : start + rows], y[start : start + rows])
        loss += part_loss / parts
        accumulate_grads(total, grads, 1 / parts)
        del grads  # this slice's gradients go now, not when the next slice's backward has made its own
    return loss, total
