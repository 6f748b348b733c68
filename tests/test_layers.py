"""layers.py: every forward against an independent formula (SciPy where it has one), every backward against
central differences in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import expit, log_softmax
from test_backward import numerical_grad  # central differences, h = 1e-6

from tinyattn_np import _parallel, _tuning
from tinyattn_np.layers import (
    cross_entropy,
    cross_entropy_backward,
    dropout,
    dropout_backward,
    gelu,
    gelu_backward,
    layer_norm,
    layer_norm_backward,
    mlp,
    mlp_backward,
    rms_norm,
    rms_norm_backward,
    swiglu,
    swiglu_backward,
)


def assert_gradient(mine: np.ndarray, loss, x: np.ndarray, what: str) -> None:
    gold = numerical_grad(loss, x)
    np.testing.assert_allclose(mine, gold, rtol=1e-6, atol=1e-8, err_msg=what)


@pytest.fixture
def x(rng) -> np.ndarray:
    return rng.normal(size=(3, 4, 6)) * 2 + 0.5  # (B, T, C): not centred, not unit


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_is_the_normalised_row(x, rng, with_bias):
    gain, bias = rng.normal(size=6), (rng.normal(size=6) if with_bias else None)
    y, _ = layer_norm(x, gain, bias)
    gold = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gain
    np.testing.assert_allclose(y, gold + (bias if with_bias else 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_backward_matches_central_differences(x, rng, with_bias):
    gain, bias = rng.normal(size=6), (rng.normal(size=6) if with_bias else None)
    r = rng.normal(size=x.shape)  # loss = Σ y ∘ r, so dy = r

    def loss() -> float:
        return float(np.sum(layer_norm(x, gain, bias)[0] * r))

    _, saved = layer_norm(x, gain, bias)
    grads = layer_norm_backward(r, saved)
    assert_gradient(grads.dx, loss, x, "dx")
    assert_gradient(grads.dgain, loss, gain, "dgain")
    if with_bias:
        assert_gradient(grads.dbias, loss, bias, "dbias")
    else:
        assert grads.dbias is None  # no bias, no gradient for one (and no pass over dy for it)


def test_rms_norm_is_the_row_over_its_root_mean_square(x, rng):
    gain = rng.normal(size=6)
    y, _ = rms_norm(x, gain)
    np.testing.assert_allclose(y, x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * gain, rtol=1e-12)


def test_rms_norm_backward_matches_central_differences(x, rng):
    gain, r = rng.normal(size=6), rng.normal(size=x.shape)

    def loss() -> float:
        return float(np.sum(rms_norm(x, gain)[0] * r))

    grads = rms_norm_backward(r, rms_norm(x, gain)[1])
    assert grads.dbias is None
    assert_gradient(grads.dx, loss, x, "dx")
    assert_gradient(grads.dgain, loss, gain, "dgain")


def test_gelu_is_u_times_a_sigmoid(rng):
    # ½ (1 + tanh z) = σ(2z): the same function written another way, through SciPy's expit
    u = rng.normal(size=(5, 7)) * 3
    inner = np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)
    np.testing.assert_allclose(gelu(u)[0], u * expit(2 * inner), rtol=1e-12, atol=1e-15)


def test_gelu_backward_matches_central_differences(rng):
    u, r = rng.normal(size=(4, 9)) * 2, rng.normal(size=(4, 9))
    du = gelu_backward(r, gelu(u)[1])
    assert_gradient(du, lambda: float(np.sum(gelu(u)[0] * r)), u, "du")


@pytest.mark.parametrize(
    ("dtype", "far"), [(np.float32, [1.4e13, 1.5e13, 1e30, 3e38]), (np.float64, [1.1e103, 1.2e103, 1e200, 1e308])]
)
def test_gelu_backward_is_finite_far_from_zero(dtype, far):
    """Where tanh is ±1 to the last bit, dy/du = ½ (1 + t)(1 + u (a + 3 b u²)(1 - t)) is 0 (u < 0) or 1 (u > 0),
    as torch's autograd gives: the cubic overflows there, and inf times 1 + t = 0 must not make a NaN."""
    u = np.array([[-x for x in far] + far], dtype)
    dy = np.full_like(u, 3.0)
    du = gelu_backward(dy, gelu(u)[1])
    assert du.dtype == dtype
    np.testing.assert_array_equal(du, [[0.0] * len(far) + [3.0] * len(far)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_backward_keeps_its_bits_where_nothing_overflows(rng, dtype):
    """The derivative's lines in their order, over the whole array at once and without any bound on u: the same
    bits for u from 10^-3 to 10^4 (beyond 10, tanh is ±1 to the last bit in every float dtype)."""
    u = (rng.normal(size=(64, 33)) * np.logspace(-3, 4, 64)[:, None]).astype(dtype)
    dy = rng.normal(size=u.shape).astype(dtype)
    a = math.sqrt(2 / math.pi)  # Python floats: they take u's dtype, as the layer's constants do
    b = 0.044715 * a
    t = np.tanh((np.square(u) * b + a) * u)  # the forward's t, in its order
    one_minus_t = 1.0 - t
    gold = ((np.square(u) * (3.0 * b) + a) * u * one_minus_t + 1.0) * (2.0 - one_minus_t) * 0.5 * dy
    assert gold.dtype == dtype
    np.testing.assert_array_equal(gelu_backward(dy, gelu(u)[1]), gold)


def test_swiglu_is_silu_of_the_gate_times_up(rng):
    a = rng.normal(size=(3, 2, 10)) * 3
    gate, up = a[..., :5], a[..., 5:]
    np.testing.assert_allclose(swiglu(a)[0], gate * expit(gate) * up, rtol=1e-12, atol=1e-15)


def test_swiglu_backward_matches_central_differences(rng):
    a, r = rng.normal(size=(4, 10)) * 2, rng.normal(size=(4, 5))
    da = swiglu_backward(r, swiglu(a)[1])
    assert da.shape == a.shape
    assert_gradient(da, lambda: float(np.sum(swiglu(a)[0] * r)), a, "da")


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_mlp_backward_matches_central_differences(rng, kind, with_bias):
    N, C, H = 5, 4, 6
    fc = 2 * H if kind == "swiglu" else H
    x, w_fc, w_proj = rng.normal(size=(N, C)), rng.normal(size=(C, fc)), rng.normal(size=(H, C))
    b_fc, b_proj = (rng.normal(size=fc), rng.normal(size=C)) if with_bias else (None, None)
    r = rng.normal(size=(N, C))

    def loss() -> float:
        return float(np.sum(mlp(x, w_fc, w_proj, b_fc, b_proj, kind=kind)[0] * r))

    grads = mlp_backward(r, mlp(x, w_fc, w_proj, b_fc, b_proj, kind=kind)[1])
    for name, value, grad in [("x", x, grads.dx), ("w_fc", w_fc, grads.dw_fc), ("w_proj", w_proj, grads.dw_proj)]:
        assert_gradient(grad, loss, value, name)
    if with_bias:
        assert_gradient(grads.db_fc, loss, b_fc, "b_fc")
        assert_gradient(grads.db_proj, loss, b_proj, "b_proj")
    else:
        assert grads.db_fc is None and grads.db_proj is None


def test_mlp_refuses_an_unknown_kind(rng):
    with pytest.raises(ValueError, match="kind must be one of"):
        mlp(np.ones((2, 3)), np.ones((3, 4)), np.ones((4, 3)), kind="relu")


def test_dropout_keeps_the_mean_and_its_backward_uses_the_same_mask(rng):
    x = rng.normal(size=(200, 300))
    y, keep = dropout(x, 0.25, np.random.default_rng(0))
    assert keep is not None and keep.dtype == np.bool_
    assert abs(keep.mean() - 0.75) < 0.01  # 60,000 draws: the standard error is 0.0018
    np.testing.assert_allclose(y, np.where(keep, x / 0.75, 0.0), rtol=1e-15)
    dy = rng.normal(size=x.shape)
    np.testing.assert_allclose(dropout_backward(dy, keep, 0.25), np.where(keep, dy / 0.75, 0.0), rtol=1e-15)


def test_dropout_of_zero_is_the_identity_and_draws_nothing():
    x = np.ones((2, 3))
    gen = np.random.default_rng(0)
    state = gen.bit_generator.state
    y, keep = dropout(x, 0.0, gen)
    assert y is x and keep is None and gen.bit_generator.state == state
    assert dropout_backward(x, None, 0.0) is x


def test_dropout_needs_a_generator():
    with pytest.raises(ValueError, match="pass rng"):
        dropout(np.ones(3), 0.1, None)


def test_cross_entropy_is_the_mean_negative_log_likelihood(rng):
    logits, targets = rng.normal(size=(7, 5)) * 3, rng.integers(0, 5, 7)
    loss, probs = cross_entropy(logits, targets)
    gold = -log_softmax(logits, axis=-1)[np.arange(7), targets].mean()
    assert loss == pytest.approx(gold, rel=1e-14)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-14)


def test_cross_entropy_backward_matches_central_differences(rng):
    logits, targets = rng.normal(size=(6, 4)), rng.integers(0, 4, 6)
    dlogits = cross_entropy_backward(cross_entropy(logits, targets)[1], targets)
    assert_gradient(dlogits, lambda: cross_entropy(logits, targets)[0], logits, "dlogits")


def test_cross_entropy_with_out_writes_where_it_is_told(rng):
    logits, targets = rng.normal(size=(4, 6)), rng.integers(0, 6, 4)
    loss, probs = cross_entropy(logits, targets)
    dlogits = cross_entropy_backward(probs, targets)
    in_place = logits.copy()
    loss_2, probs_2 = cross_entropy(in_place, targets, out=in_place)
    assert probs_2 is in_place and loss_2 == loss
    np.testing.assert_array_equal(probs_2, probs)
    assert cross_entropy_backward(probs_2, targets, out=probs_2) is probs_2
    np.testing.assert_array_equal(probs_2, dlogits)
    elsewhere = np.empty_like(probs)
    assert cross_entropy_backward(probs, targets, out=elsewhere) is elsewhere
    np.testing.assert_array_equal(elsewhere, dlogits)


def test_cross_entropy_survives_large_float32_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]], np.float32)  # exp(1000) is inf in any float
    loss, probs = cross_entropy(logits, np.array([1]))
    assert loss == pytest.approx(1000.0) and probs.dtype == np.float32
    np.testing.assert_array_equal(probs, [[1.0, 0.0, 0.0]])


@pytest.mark.parametrize("bad", [-1, 5, 10**9, -101])
def test_cross_entropy_refuses_targets_outside_the_classes(rng, bad):
    """-1 would score class V - 1 and -100 class V - 100 (NumPy's negative indices); torch refuses both."""
    logits, targets = rng.normal(size=(4, 5)), np.array([0, 4, bad, 1])
    match = f"targets hold {bad} at row 2, outside the classes \\[0, 5\\) and not ignore_index \\(-100\\)"
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, targets)
    with pytest.raises(ValueError, match=match):
        cross_entropy_backward(softmax_rows(logits), targets)


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits, axis=-1))


@pytest.mark.parametrize("ignore_index", [-100, 2, 7])
def test_ignored_targets_leave_the_mean_and_get_no_gradient(rng, ignore_index):
    """torch's ignore_index: the rows whose target is ignore_index are out of the mean (which divides by the rows
    that count) and their gradient is 0; the others' loss and gradient are those of the kept rows alone, bit for bit."""
    logits = rng.normal(size=(6, 5)) * 3
    targets = np.array([1, ignore_index, 4, ignore_index, 0, 3])
    kept = targets != ignore_index
    loss, probs = cross_entropy(logits, targets, ignore_index=ignore_index)
    dlogits = cross_entropy_backward(probs, targets, ignore_index=ignore_index)
    loss_kept, probs_kept = cross_entropy(logits[kept], targets[kept])
    assert loss == loss_kept
    np.testing.assert_array_equal(dlogits[kept], cross_entropy_backward(probs_kept, targets[kept]))
    np.testing.assert_array_equal(dlogits[~kept], 0.0)
    assert_gradient(dlogits, lambda: cross_entropy(logits, targets, ignore_index=ignore_index)[0], logits, "dz")


def test_a_batch_with_every_target_ignored_is_refused(rng):
    """The mean over no rows is 0/0: torch returns nan; a loss of nan would stop training a step later with less to
    say, so it is refused here."""
    with pytest.raises(ValueError, match="every target is ignore_index \\(-100\\): the mean over no rows"):
        cross_entropy(rng.normal(size=(3, 4)), np.full(3, -100))
    with pytest.raises(ValueError, match="every target is ignore_index \\(-100\\): the mean over no rows"):
        cross_entropy_backward(softmax_rows(rng.normal(size=(3, 4))), np.full(3, -100))


@pytest.mark.parametrize(
    ("targets", "kwargs", "error", "match"),
    [
        (np.array([0.0, 1.0, 2.0]), {}, TypeError, "targets must be integer class ids; got dtype float64"),
        (
            np.array([0, 1]),
            {},
            ValueError,
            "targets must be \\(N,\\) = \\(3,\\) class ids, one per row; got shape \\(2,\\)",
        ),
        (
            np.array([[0, 1, 2]]),
            {},
            ValueError,
            "targets must be \\(N,\\) = \\(3,\\) class ids, one per row; got shape \\(1, 3\\)",
        ),
        (np.array([0, 1, 2]), dict(ignore_index=True), TypeError, "ignore_index must be an int"),
        (np.array([0, 1, 2]), dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
    ],
)
def test_cross_entropy_refuses_targets_that_are_not_class_ids(rng, targets, kwargs, error, match):
    with pytest.raises(error, match=match):
        cross_entropy(rng.normal(size=(3, 4)), targets, **kwargs)


@pytest.mark.parametrize("block", [_tuning.ROW_BLOCK, 64])  # the default, and blocks of a few rows
@pytest.mark.parametrize("workers", [1, 2])
def test_the_row_blocks_give_the_bits_of_one_pass(rng, monkeypatch, block, workers):
    """layer_norm, gelu, their backwards and cross_entropy run their lines block by block on the cores: the same bits as
    the same lines over the whole array at once, for any block size and number of workers."""
    n = 2 * _tuning.ROW_BLOCK // 257 + 3  # rows: several blocks at either size
    u, dy = (rng.normal(size=(n, 257)).astype(np.float32) for _ in range(2))
    gain, bias = (rng.normal(size=257).astype(np.float32) for _ in range(2))
    logits, targets = u * 4, rng.integers(0, 257, n)

    def every_layer():
        y_gelu, gelu_saved = gelu(u)
        y_norm, norm_saved = layer_norm(u, gain, bias)
        loss, probs = cross_entropy(logits, targets)
        return y_gelu, gelu_backward(dy, gelu_saved), y_norm, layer_norm_backward(dy, norm_saved).dx, loss, probs

    monkeypatch.setattr(_tuning, "ROW_BLOCK", 1 << 40)  # the whole array, one block, on one core
    monkeypatch.setattr(_parallel, "cpu_cores", lambda: 1)
    y_whole, du_whole, y_norm_whole, dx_whole, loss_whole, probs_whole = every_layer()
    monkeypatch.setattr(_tuning, "ROW_BLOCK", block)
    monkeypatch.setattr(_parallel, "cpu_cores", lambda: workers)
    monkeypatch.setattr(_parallel, "_ELEMENTS_PER_WORKER", 1)  # as many workers as cores, however small the array
    y, du, y_norm, dx, loss, probs = every_layer()
    np.testing.assert_array_equal(y, y_whole)
    np.testing.assert_array_equal(du, du_whole)
    np.testing.assert_array_equal(y_norm, y_norm_whole)
    np.testing.assert_array_equal(dx, dx_whole)
    assert loss == loss_whole
    np.testing.assert_array_equal(probs, probs_whole)


@pytest.mark.parametrize(
    "forward",
    [
        lambda x: layer_norm(x, np.ones(8, np.float32), np.zeros(8, np.float32))[0],
        lambda x: rms_norm(x, np.ones(8, np.float32))[0],
        lambda x: gelu(x)[0],
        lambda x: swiglu(x)[0],
    ],
    ids=["layer_norm", "rms_norm", "gelu", "swiglu"],
)
def test_float32_stays_float32(forward):
    assert forward(np.ones((2, 8), np.float32)).dtype == np.float32


def test_float32_rows_stay_float32_under_float64_weights(rng):
    """The module's rule: a layer returns its input's dtype whatever its weights' (a float64 product rounded
    where it is stored), as layer_norm always did; so do the input's gradients."""
    x, dy = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=(5, 8)).astype(np.float32)
    gain, bias = rng.normal(size=8), rng.normal(size=8)
    for forward, backward in (
        (lambda: layer_norm(x, gain, bias), layer_norm_backward),
        (lambda: rms_norm(x, gain), rms_norm_backward),
    ):
        y, saved = forward()
        assert y.dtype == np.float32 and backward(dy, saved).dx.dtype == np.float32
    for kind, fc in (("gelu", 12), ("swiglu", 24)):
        w_fc, w_proj, b_fc, b_proj = (
            rng.normal(size=(8, fc)),
            rng.normal(size=(12, 8)),
            rng.normal(size=fc),
            rng.normal(size=8),
        )
        y, saved = mlp(x, w_fc, w_proj, b_fc, b_proj, kind=kind)
        assert y.dtype == np.float32
        gold = mlp(x.astype(np.float64), w_fc, w_proj, b_fc, b_proj, kind=kind)[0]
        np.testing.assert_allclose(y, gold, rtol=1e-5, atol=1e-5 * np.abs(gold).max())
        assert mlp_backward(dy, saved).dx.dtype == np.float32


def test_a_backward_refuses_what_another_forward_saved(rng):
    x, dy = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    layer_saved, rms_saved = layer_norm(x, np.ones(4))[1], rms_norm(x, np.ones(4))[1]
    with pytest.raises(TypeError, match="saved must be the NormSaved that layer_norm returned; got NoneType"):
        layer_norm_backward(dy, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="saved must be the NormSaved that layer_norm returned; got rms_norm's"):
        layer_norm_backward(dy, rms_saved)
    with pytest.raises(TypeError, match="saved must be the NormSaved that rms_norm returned; got layer_norm's"):
        rms_norm_backward(dy, layer_saved)
    with pytest.raises(TypeError, match="saved must be the GeluSaved that gelu returned; got NormSaved"):
        gelu_backward(dy, layer_saved)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="saved must be the SwigluSaved that swiglu returned; got tuple"):
        swiglu_backward(dy, (x, x, x))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="saved must be the MLPSaved that mlp returned; got NoneType"):
        mlp_backward(dy, None)  # type: ignore[arg-type]


def test_a_row_block_is_the_l2_cache_in_float32(tmp_path) -> None:
    """The row block follows the core's L2 cache as sysfs gives it: 512 KiB -> 2^17 float32 elements, 1 MiB ->
    2^18, clamped to 2^13 .. 2^18, and 2^17 where the size is unknown (no such folder, or a size unread)."""
    from tinyattn_np._parallel import l2_cache_bytes

    for name, level, size in (("index0", "1", "48K"), ("index2", "2", "2048K"), ("index3", "3", "105M")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert l2_cache_bytes(str(tmp_path)) == 2 << 20
    assert l2_cache_bytes(str(tmp_path / "absent")) is None
    l2_sizes = (512 << 10, 1 << 20, 2 << 20, 1 << 10, 1 << 30, None)
    assert [_tuning.default_row_block(b) for b in l2_sizes] == [1 << 17, 1 << 18, 1 << 18, 1 << 13, 1 << 18, 1 << 17]
