"""Shared test helpers. NumPy and SciPy are the oracles here; torch is never needed under tests/."""

from __future__ import annotations

import signal
import sys
from types import ModuleType

import numpy as np
import pytest
from scipy.special import softmax as scipy_softmax
from test_scripts import load

# Ctrl-C reaches the programs the tests start and then interrupt (SIGINT), also when the suite itself runs as a
# background job: a shell starts a background job with SIGINT ignored, a child inherits an ignored signal through
# exec, and a Python started with SIGINT ignored never turns it into KeyboardInterrupt. A handler of this process's
# own is reset to the default in every child it starts, so the children hear Ctrl-C as a user's program would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def tolerance(dtype: np.dtype) -> dict[str, float]:
    """Tolerances for comparing two attention results computed in different orders.

    float64: unit roundoff 1.1e-16; a sum over a few hundred keys loses a few hundred ulps at worst.
    float32: unit roundoff 6e-8, same argument. float16 outputs are rounded to 2^-11 relative.
    """
    return {
        np.dtype(np.float64): dict(rtol=1e-12, atol=1e-12),
        np.dtype(np.float32): dict(rtol=2e-5, atol=2e-6),
        np.dtype(np.float16): dict(rtol=2e-3, atol=2e-3),
    }[np.dtype(dtype)]


def assert_close(mine: np.ndarray, gold: np.ndarray, dtype: np.dtype, what: str = "") -> None:
    """np.testing.assert_allclose with the dtype's tolerance; on failure both arrays' shapes print."""
    np.testing.assert_allclose(
        mine, gold, **tolerance(dtype), err_msg=f"{what}: mine {mine.shape} vs gold {gold.shape}"
    )


def gold_attention(q, k, v, allowed=None, scale=None):
    """An independent oracle: expand the kv heads with np.repeat, use scipy's softmax, and return
    (out, lse) in float64. allowed: bool (L, S) or broadcastable, True = may attend."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("...le,...se->...ls", q, k) * scale
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = scipy_softmax(scores, axis=-1)
    weights = np.nan_to_num(weights, nan=0.0)  # scipy gives NaN for an all -inf row; we define 0
    from scipy.special import logsumexp

    return weights @ v, logsumexp(scores, axis=-1)


def bottom_right(n_q: int, n_k: int) -> np.ndarray:
    """Oracle for the bottom-right causal mask, written with a loop instead of broadcasting."""
    allowed = np.zeros((n_q, n_k), bool)
    for i in range(n_q):
        for j in range(n_k):
            allowed[i, j] = j <= i + (n_k - n_q)
    return allowed


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --- hypothesis profiles (tests/test_properties.py) ------------------------------------------
# "ci" is loaded here, so it is the default; `pytest --hypothesis-profile=thorough` overrides it,
# because hypothesis's pytest plugin loads the named profile after this file is imported.
# deadline=None: a shared CI machine is noisy, and a slow example is not a wrong one.
from hypothesis import settings  # noqa: E402  (kept beside the profiles it serves)

settings.register_profile("ci", max_examples=500, deadline=None)
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile("ci")


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/machine.py as the scripts import it, with no idle waits, a fixed 100 GFLOP/s matmul rate and no
    load: the shape of a script's output is under test, not its timings."""
    load("scaling.py")
    module = sys.modules["machine"]
    monkeypatch.setattr(module, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(module, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)
    monkeypatch.setattr(module, "load_average", lambda: 0.0)
    return module


@pytest.fixture(scope="module")
def warm() -> None:
    """One call of each first, for the tests that trace peaks: the thread-pool controller and NumPy's
    first-use buffers are one-off."""
    from tinyattn_np import attention, flash_attention

    x = np.ones((4, 64, 64), np.float32)
    attention(x, x, x, causal=True)
    flash_attention(x, x, x, causal=True, workers=2)
