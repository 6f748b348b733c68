"""optim.py: AdamW against a loop written from the paper's Algorithm 2, a saved and restored state that
continues bit for bit, the schedule's values, clipping and accumulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.optim import AdamW, accumulate_grads, accumulated_grads, clip_grad_norm, global_norm, warmup_cosine_lr


def quadratic_grads(params: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The gradient of Σ (θ - 1)² plus a fixed wiggle per step: it depends on θ, so errors would compound."""
    wiggle = np.random.default_rng(step)
    return {name: 2 * (p - 1.0) + wiggle.normal(size=p.shape) for name, p in params.items()}


def paper_adamw(theta0, alpha, beta1, beta2, eps, lam, multipliers, decayed):
    """Loshchilov & Hutter 2019, Algorithm 2, one Python float at a time:
    m = β1 m + (1-β1) g;  v = β2 v + (1-β2) g²;  m̂ = m/(1-β1^t);  v̂ = v/(1-β2^t);
    θ = θ - η_t (α m̂ / (√v̂ + ε) + λ θ)     (λ = 0 for the parameters that are not decayed)."""
    theta = {name: [float(x) for x in p.ravel()] for name, p in theta0.items()}
    m = {name: [0.0] * len(v) for name, v in theta.items()}
    v = {name: [0.0] * len(x) for name, x in theta.items()}
    for t, eta in enumerate(multipliers, start=1):
        arrays = {name: np.array(x).reshape(theta0[name].shape) for name, x in theta.items()}
        grads = quadratic_grads(arrays, t)
        for name in theta:
            weight_decay = lam if decayed[name] else 0.0
            for i, g in enumerate(grads[name].ravel()):
                m[name][i] = beta1 * m[name][i] + (1 - beta1) * g
                v[name][i] = beta2 * v[name][i] + (1 - beta2) * g * g
                m_hat = m[name][i] / (1 - beta1**t)
                v_hat = v[name][i] / (1 - beta2**t)
                theta[name][i] -= eta * (alpha * m_hat / (math.sqrt(v_hat) + eps) + weight_decay * theta[name][i])
    return {name: np.array(x).reshape(theta0[name].shape) for name, x in theta.items()}


def test_adamw_is_the_papers_algorithm_2():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    alpha, beta1, beta2, eps, lam = 0.01, 0.9, 0.95, 1e-8, 0.5
    multipliers = [warmup_cosine_lr(s, lr=1.0, warmup=2, total=8, min_lr=0.1) for s in range(8)]
    gold = paper_adamw(params, alpha, beta1, beta2, eps, lam, multipliers, {"w": True, "b": False})
    # torch's parametrisation: lr = η_t α, weight_decay = λ / α
    opt = AdamW(params, lr=alpha, betas=(beta1, beta2), eps=eps, weight_decay=lam / alpha)
    for t, eta in enumerate(multipliers, start=1):
        opt.step(params, quadratic_grads(params, t), lr=eta * alpha)
    assert opt.t == 8 and opt.decay == {"w": True, "b": False}
    assert repr(opt) == "AdamW(lr=0.01, betas=(0.9, 0.95), eps=1e-08, weight_decay=50; 2 arrays, 8 steps taken)"
    for name in params:
        np.testing.assert_allclose(params[name], gold[name], rtol=1e-13, atol=1e-15, err_msg=name)


def test_a_restored_state_continues_bit_for_bit(tmp_path):
    rng = np.random.default_rng(1)
    start = {"w": rng.normal(size=(5, 3)).astype(np.float32), "g": rng.normal(size=3).astype(np.float32)}
    straight = {name: p.copy() for name, p in start.items()}
    opt = AdamW(straight, lr=0.01)
    for t in range(6):
        opt.step(straight, quadratic_grads(straight, t), lr=0.01 / (t + 1))

    resumed = {name: p.copy() for name, p in start.items()}
    first = AdamW(resumed, lr=0.01)
    for t in range(3):
        first.step(resumed, quadratic_grads(resumed, t), lr=0.01 / (t + 1))
    np.savez(tmp_path / "optimizer.npz", **first.state_dict())
    np.savez(tmp_path / "params.npz", **resumed)
    resumed = dict(np.load(tmp_path / "params.npz"))
    second = AdamW(resumed, lr=0.5, betas=(0.5, 0.5))  # hyperparameters come back from the state too
    second.load_state_dict(dict(np.load(tmp_path / "optimizer.npz")))
    assert second.t == 3 and (second.lr, second.beta1, second.beta2) == (0.01, 0.9, 0.95)
    for t in range(3, 6):
        second.step(resumed, quadratic_grads(resumed, t), lr=0.01 / (t + 1))
    for name in start:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
        assert resumed[name].dtype == np.float32


def test_load_state_dict_refuses_another_models_state():
    opt = AdamW({"w": np.zeros((2, 2))})
    state = opt.state_dict()
    with pytest.raises(ValueError, match="missing \\['m.w', 'v.w'\\], unexpected \\['m.u', 'v.u'\\]"):
        opt.load_state_dict({k.replace(".w", ".u"): v for k, v in state.items()})
    with pytest.raises(ValueError, match="state\\[m.'w'\\] must have shape \\(2, 2\\)"):
        opt.load_state_dict(state | {"m.w": np.zeros(3)})


def test_step_refuses_gradients_that_do_not_fit():
    params = {"w": np.zeros((2, 2))}
    opt = AdamW(params)
    with pytest.raises(ValueError, match="grads must be a dict with the optimiser's names \\['w'\\]"):
        opt.step(params, {"u": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="grads\\['w'\\] must have shape \\(2, 2\\)"):
        opt.step(params, {"w": np.zeros(4)})
    assert opt.t == 0  # nothing was taken


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(lr=-1.0), ValueError, "lr must be a finite number >= 0"),
        (dict(lr="fast"), TypeError, "lr must be a number"),
        (dict(betas=(1.0, 0.9)), ValueError, "betas\\[0\\] must be a finite number in \\[0, 1.0\\)"),
        (dict(eps=float("nan")), ValueError, "eps must be a finite number"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kwargs, error, match):
    with pytest.raises(ValueError, match="params must be a non-empty dict"):
        AdamW({})
    with pytest.raises(error, match=match):
        AdamW({"w": np.zeros(2)}, **kwargs)


def test_the_schedule_warms_up_then_follows_a_half_cosine():
    lrs = [warmup_cosine_lr(s, lr=1.0, warmup=4, total=14, min_lr=0.1) for s in range(16)]
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.55)  # halfway down: (1 + 0.1) / 2
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert lrs[14] == lrs[15] == 0.1


def test_the_schedule_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="min_lr must be a finite number >= 0"):
        warmup_cosine_lr(0, lr=1.0, warmup=1, total=2, min_lr=-0.1)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        warmup_cosine_lr(-1, lr=1.0, warmup=1, total=2)


def test_clipping_scales_to_the_max_norm_and_leaves_small_gradients_alone():
    grads = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}
    assert global_norm(grads) == 5.0
    assert clip_grad_norm(grads, 1.0) == 5.0
    assert global_norm(grads) == pytest.approx(1.0, rel=1e-6)
    small = {"a": np.array([0.3, 0.4])}
    assert clip_grad_norm(small, 1.0) == pytest.approx(0.5)
    np.testing.assert_array_equal(small["a"], [0.3, 0.4])
    broken = {"a": np.array([np.nan, 1.0])}
    assert math.isnan(clip_grad_norm(broken, 1.0))
    assert broken["a"][1] == 1.0


def test_accumulated_micro_batches_give_the_whole_batchs_gradient():
    config = GPTConfig(vocab=9, context=5, layers=1, heads=2, width=8, dtype="float64")
    model = GPT(config, rng=0)
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, 9, (4, 5)), rng.integers(0, 9, (4, 5))
    _, whole = model.loss_and_grads(idx, targets)
    total = None
    for half in (slice(0, 2), slice(2, 4)):
        total = accumulate_grads(total, model.loss_and_grads(idx[half], targets[half])[1], 0.5)
    assert total is not None
    for name in whole:
        np.testing.assert_allclose(total[name], whole[name], rtol=1e-12, atol=1e-15, err_msg=name)
    with pytest.raises(ValueError, match="grads must have total's names"):
        accumulate_grads(total, {"wte": whole["wte"]})


@pytest.mark.parametrize("parts", [1, 2, 3, 6])
def test_accumulated_grads_equal_the_whole_batch_in_any_number_of_slices(parts):
    config = GPTConfig(vocab=9, context=5, layers=2, heads=2, width=8, dtype="float64")
    model = GPT(config, rng=0)
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, 9, (6, 5)), rng.integers(0, 9, (6, 5))
    whole_loss, whole = model.loss_and_grads(idx, targets)
    seen = []

    def loss_and_grads(x, y):
        seen.append(len(x))
        return model.loss_and_grads(x, y)

    loss, grads = accumulated_grads(loss_and_grads, idx, targets, parts)
    assert seen == [6 // parts] * parts  # equal slices, one call each
    assert loss == pytest.approx(whole_loss, rel=1e-13)
    assert grads.keys() == whole.keys()
    for name in whole:
        np.testing.assert_allclose(grads[name], whole[name], rtol=1e-12, atol=1e-15, err_msg=name)


@pytest.mark.parametrize(
    ("rows", "parts", "error", "match"),
    [(6, 4, ValueError, "a multiple of parts = 4; got 6 and 6"), (6, 0, ValueError, "parts must be a positive int"),
     (6, 1.5, TypeError, "parts must be a positive int")],
)  # fmt: skip
def test_accumulated_grads_refuse_slices_that_do_not_split_the_batch(rows, parts, error, match):
    def never(x, y):
        raise AssertionError("loss_and_grads must not run")

    x = np.zeros((rows, 5), np.int64)
    with pytest.raises(error, match=match):
        accumulated_grads(never, x, x, parts)
