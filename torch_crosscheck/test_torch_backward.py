"""Every gradient case in grad_cases.GRAD_CASES, on every device, SDPA kernel and dtype it runs in: our
hand-written backward against torch autograd, within the tolerance grad_cases.py states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cases import run_case  # noqa: E402  (needs torch, so after the importorskip)
from devices import case_params  # noqa: E402
from grad_cases import GRAD_CASES  # noqa: E402


@pytest.mark.parametrize(("case", "dtype", "device", "kernel"), case_params(GRAD_CASES))
def test_gradient_case(case, dtype: str, device: str, kernel: str | None) -> None:
    result = run_case(case, device, dtype, kernel)
    if result is None:
        pytest.skip(f"not supported for this case: torch has no {kernel} kernel for it on {device}")
    assert result.passed, f"{case.name}, {device}, {kernel}, {dtype}: {result.explain()}"
