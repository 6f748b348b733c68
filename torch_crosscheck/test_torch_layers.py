"""The layers' and the sampler's edges against torch: cross_entropy with ignore_index (loss and gradient
against F.cross_entropy and autograd), gelu_backward far from zero (against autograd through
F.gelu(approximate="tanh")), and the rows of logits that sample_next refuses (torch's multinomial raises on
each of them).

Far from zero torch's own GELU gradient overflows too, a little further out than ours did (float32: NaN
from about 1e30, where ours was NaN from 1.4e13): where torch's is finite the two must be equal; where it is
NaN, ours is the limit, 0 below zero and 1 above.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402

from tinyattn_np.layers import cross_entropy, cross_entropy_backward, gelu, gelu_backward  # noqa: E402
from tinyattn_np.sampling import sample_next  # noqa: E402

TOLERANCE = {"float64": 1e-12, "float32": 2e-6}


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("ignore_index", [-100, 3, 1000])
def test_cross_entropy_with_ignored_targets_matches_torch(ignore_index: int, dtype: str, device: str) -> None:
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(40, 9)) * 4).astype(dtype)
    targets = rng.integers(0, 9, 40)
    targets[rng.random(40) < 0.3] = ignore_index  # about a third ignored
    loss, probs = cross_entropy(logits, targets, ignore_index=ignore_index)
    dlogits = cross_entropy_backward(probs, targets, ignore_index=ignore_index)

    z = torch.tensor(logits, device=device, requires_grad=True)
    loss_t = F.cross_entropy(z, torch.tensor(targets, device=device), ignore_index=ignore_index)
    loss_t.backward()
    assert loss == pytest.approx(loss_t.item(), rel=TOLERANCE[dtype])
    gold = z.grad.cpu().numpy()
    np.testing.assert_allclose(dlogits, gold, rtol=0, atol=TOLERANCE[dtype] * np.abs(gold).max())
    np.testing.assert_array_equal(dlogits[targets == ignore_index], 0.0)  # torch's too: 0 on ignored rows
    np.testing.assert_array_equal(gold[targets == ignore_index], 0.0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize(
    ("dtype", "far"),
    [("float32", [1.4e13, 1e20, 1e30, 3e38]), ("float64", [1.1e103, 1.2e103, 1e200, 1e308])],
)
def test_gelu_backward_far_from_zero_matches_autograd(dtype: str, far: list[float], device: str) -> None:
    ordinary = [-20.0, -5.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 5.0, 20.0]
    u = np.array([-x for x in far] + ordinary + far, dtype)
    dy = np.full_like(u, 1.5)
    du = gelu_backward(dy[None], gelu(u[None])[1])[0]

    u_t = torch.tensor(u, device=device, requires_grad=True)
    F.gelu(u_t, approximate="tanh").backward(torch.tensor(dy, device=device))
    gold = u_t.grad.cpu().numpy()
    assert np.isfinite(du).all(), du
    defined = np.isfinite(gold)
    nearer = np.isin(u, [-far[0], *ordinary, far[0]])
    assert defined[nearer].all()  # torch is finite out to ±1.4e13 (float32) and ±1.1e103 (float64)
    np.testing.assert_allclose(du[defined], gold[defined], rtol=TOLERANCE[dtype], atol=1e-30)
    np.testing.assert_array_equal(du[~defined], np.where(u[~defined] < 0, 0.0, 1.5))  # the limits


@pytest.mark.parametrize(
    "row",
    [[-np.inf] * 4, [np.nan] * 4, [0.0, np.nan, 2.0, 1.0], [np.inf, 0.0, np.inf, 1.0]],
    ids=["all -inf", "all NaN", "one NaN", "two +inf"],
)
def test_the_rows_sample_next_refuses_are_the_rows_torch_cannot_draw_from(row: list[float]) -> None:
    """torch.multinomial(softmax(row)) raises on each: its probabilities hold NaN. One +inf is where the two
    part: softmax makes it NaN too, and torch raises, where sample_next draws the certain token."""
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        torch.multinomial(torch.softmax(torch.tensor(row, dtype=torch.float64), dim=-1), 1)
    with pytest.raises(ValueError, match="row 0 of logits"):
        sample_next(np.array([row]), rng=0)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        torch.multinomial(torch.softmax(torch.tensor([0.0, np.inf, 1.0], dtype=torch.float64), dim=-1), 1)
    assert sample_next(np.array([[0.0, np.inf, 1.0]]), rng=0)[0] == 1
