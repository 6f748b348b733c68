"""Every case in cases.CASES, on every device, SDPA kernel and dtype it runs in: tinyattn_np vs torch,
within the tolerance the case states (cases.py says why each tolerance is what it is). A kernel that
torch does not have for a case (flash in float32 on CUDA, say) is a skip that names it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cases import CASES, Outcome, run_case  # noqa: E402  (needs torch, so after the importorskip)
from devices import case_params  # noqa: E402


@pytest.mark.parametrize(("case", "dtype", "device", "kernel"), case_params(CASES))
def test_case(case, dtype: str, device: str, kernel: str | None) -> None:
    result = run_case(case, device, dtype, kernel)
    if result is None:
        pytest.skip(f"not supported for this case: torch has no {kernel} kernel for it on {device}")
    assert result.passed, f"{case.name}, {device}, {kernel}, {dtype}: {result.explain()}"
    if result.torch_off:
        warnings.warn(
            f"{case.name}, {device}, {dtype}: torch's value is off the exact one, ours is not: {result.explain()}",
            stacklevel=1,
        )


@pytest.mark.parametrize("name", ["flash_attention lse L<S", "flash_attention lse L>S (rows with no key)"])
def test_lse_cases_ours_is_the_exact_value(name: str) -> None:
    """The lse cases carry their exact witness (np.longdouble), ours sits within the float64 tolerance of it, and
    the case passes: torch's value within it too, or off it while ours is on it (torch_off: it has been seen
    off by 7e-10 now and then inside a test process, never alone)."""
    case = next(c for c in CASES if c.name == name)
    result = run_case(case, "cpu", "float64", None)
    seen = result._seen()
    assert result.exact is not None
    assert np.abs(result.mine[seen] - result.exact[seen]).max() <= result.tolerance
    assert result.passed, result.explain()


def test_an_exact_witness_says_which_side_is_off() -> None:
    """Torch off the exact value while ours is on it passes (torch_off, and the explanation shows all three);
    ours off fails whatever torch says; both off fails."""
    exact = np.array([4.527751820283849, 3.0])
    off = exact + np.array([7.2e-10, 0.0])
    assert Outcome(exact, off, 2e-14, exact=exact).passed and Outcome(exact, off, 2e-14, exact=exact).torch_off
    assert "exact np.float64(4.527751820283849)" in Outcome(exact, off, 2e-14, exact=exact).explain()
    assert not Outcome(off, exact, 2e-14, exact=exact).passed
    assert not Outcome(off, off + 1e-9, 2e-14, exact=exact).passed
    assert not Outcome(exact, off, 2e-14).passed  # no witness: the difference fails as before
