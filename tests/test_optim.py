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


def stepped_optimiser() -> tuple[AdamW, dict[str, np.ndarray]]:
    """An AdamW two steps in, over a matrix (decayed) and a vector (not): its moments are not zero."""
    rng = np.random.default_rng(5)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    opt = AdamW(params, lr=0.1)
    for t in range(2):
        opt.step(params, quadratic_grads(params, t))
    return opt, params


def snapshot(opt: AdamW, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return opt.state_dict() | {f"param.{name}": p.copy() for name, p in params.items()}


def assert_unchanged(before: dict[str, np.ndarray], opt: AdamW, params: dict[str, np.ndarray]) -> None:
    after = snapshot(opt, params)
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        assert after[name].dtype == before[name].dtype, name


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (np.ones(4, np.int64), TypeError, "grads\\['b'\\] must hold real floats; got dtype int64"),
        (np.ones(4, np.complex128), TypeError, "grads\\['b'\\] must hold real floats; got dtype complex128"),
        (np.array([1.0, np.nan, 0.0, 0.0]), ValueError, "grads\\['b'\\] holds NaN or inf"),
        (np.array([1.0, 0.0, -np.inf, 0.0], np.float32), ValueError, "grads\\['b'\\] holds NaN or inf"),
    ],
    ids=["int", "complex", "nan", "-inf"],
)
def test_a_step_that_is_refused_changes_nothing(bad, error, match):
    """Every check comes before the first change: the step count, every weight and both moments stay as they
    were, though the first array ("w") was fine and its update would have come first."""
    opt, params = stepped_optimiser()
    before = snapshot(opt, params)
    grads = quadratic_grads(params, 2) | {"b": bad}
    with pytest.raises(error, match=match):
        opt.step(params, grads)
    assert_unchanged(before, opt, params)


def test_a_step_refuses_weights_it_cannot_update_in_place():
    opt, params = stepped_optimiser()
    before = snapshot(opt, params)
    frozen = params | {"b": params["b"].copy()}
    frozen["b"].flags.writeable = False
    with pytest.raises(ValueError, match="params\\['b'\\] must be a writable ndarray"):
        opt.step(frozen, quadratic_grads(params, 2))
    with pytest.raises(TypeError, match="params\\['b'\\] must be a writable ndarray"):
        opt.step(params | {"b": [0.0] * 4}, quadratic_grads(params, 2))
    assert_unchanged(before, opt, params)
    with pytest.raises(TypeError, match="params\\['w'\\] must hold real floats; got dtype int64"):
        AdamW({"w": np.zeros((2, 2), np.int64)})


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(lr=np.array(np.nan)), ValueError, "state\\['lr'\\] must be a finite number >= 0; got nan"),
        (dict(beta2=np.array(1.0)), ValueError, "state\\['beta2'\\] must be a finite number in \\[0, 1.0\\)"),
        (dict(beta1=np.array(-0.1)), ValueError, "state\\['beta1'\\] must be a finite number in \\[0, 1.0\\)"),
        (dict(eps=np.array([1e-8, 1e-8])), ValueError, "state\\['eps'\\] must be one number; got shape \\(2,\\)"),
        (dict(t=np.array(-1)), ValueError, "state\\['t'\\] must be an int >= 0; got -1"),
        (dict(t=np.array(2.5)), TypeError, "state\\['t'\\] must be an int >= 0"),
        ({"v.b": np.array([0.1, -1e-3, 0.0, 0.0], np.float32)}, ValueError, "state\\[v.'b'\\] .* must be >= 0"),
        ({"v.w": np.full((3, 4), np.nan)}, ValueError, "state\\[v.'w'\\] .* must be >= 0"),
        ({"m.w": np.full((3, 4), np.inf)}, ValueError, "state\\[m.'w'\\] holds NaN or inf"),
        ({"m.b": np.ones(4, np.complex64)}, TypeError, "state\\[m.'b'\\] must hold real floats; got dtype complex64"),
        ({"m.b": np.ones(3)}, ValueError, "state\\[m.'b'\\] must have shape \\(4,\\)"),
    ],
    ids=[
        "lr nan",
        "beta2 1",
        "beta1 < 0",
        "eps 2 numbers",
        "t < 0",
        "t 2.5",
        "v < 0",
        "v nan",
        "m inf",
        "complex",
        "shape",
    ],
)
def test_load_state_dict_refuses_a_state_no_step_could_make_and_changes_nothing(change, error, match):
    opt, params = stepped_optimiser()
    before = snapshot(opt, params)
    state = opt.state_dict()
    state["m.w"] += 1.0  # a state other than the optimiser's own, so that a partial load would show
    with pytest.raises(error, match=match):
        opt.load_state_dict(state | change)
    assert_unchanged(before, opt, params)


def test_a_second_moment_that_overflowed_loads_back():
    """v = β2 v + (1 - β2) g² is inf in float32 for |g| past 1.8e19, a finite gradient: such a state is the
    optimiser's own, and is restored as it was."""
    opt, params = stepped_optimiser()
    opt.step(params, {"w": np.full((3, 4), 1e20, np.float32), "b": np.zeros(4, np.float32)})
    state = opt.state_dict()
    assert np.isinf(state["v.w"]).all() and np.isfinite(params["w"]).all()
    restored = AdamW(params)
    restored.load_state_dict(state)
    np.testing.assert_array_equal(restored.v["w"], state["v.w"])


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
    [
        (6, 4, ValueError, "a multiple of parts = 4; got 6 and 6"),
        (6, 0, ValueError, "parts must be a positive int"),
        (6, 1.5, TypeError, "parts must be a positive int"),
    ],
)
def test_accumulated_grads_refuse_slices_that_do_not_split_the_batch(rows, parts, error, match):
    def never(x, y):
        raise AssertionError("loss_and_grads must not run")

    x = np.zeros((rows, 5), np.int64)
    with pytest.raises(error, match=match):
        accumulated_grads(never, x, x, parts)


@pytest.mark.parametrize(
    ("grads", "norm"),
    [
        ({"a": np.full(4, 3e38, np.float32), "b": np.full((2, 3), -1e38, np.float32)}, math.sqrt(4 * 9 + 6) * 1e38),
        ({"a": np.array([3e200, 0.0]), "b": np.array([[4e200]])}, 5e200),
        ({"a": np.array([1e20], np.float32), "b": np.array([1.0], np.float32)}, 1e20),
    ],
    ids=["float32 near its largest", "float64 past 1e154", "float32 past 1.8e19"],
)
def test_the_norm_of_finite_gradients_is_finite_however_large(grads, norm):
    """Σ g² overflows (float32 past 1.8e19, float64 past 1.3e154) while ‖g‖ itself is a float: it is taken again
    of g / max|g|, times max|g|. Clipping then scales the gradients to max_norm as it should."""
    assert global_norm(grads) == pytest.approx(norm, rel=1e-6)
    assert clip_grad_norm(grads, 1.0) == pytest.approx(norm, rel=1e-6)
    assert global_norm(grads) == pytest.approx(1.0, rel=1e-5)
    assert global_norm({"a": np.array([np.inf, 1.0]), "b": np.array([1e200])}) == math.inf
    assert math.isnan(global_norm({"a": np.array([np.nan, 1e200, 1e200])}))
