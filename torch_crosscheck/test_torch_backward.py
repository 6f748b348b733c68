"""Every gradient case in grad_cases.GRAD_CASES, on every device, SDPA kernel and dtype it runs in: our
hand-written backward against torch autograd, within the tolerance grad_cases.py states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cases import kernels_for, run_case  # noqa: E402  (needs torch, so after the importorskip)
from devices import DEVICE_PARAMS  # noqa: E402
from grad_cases import GRAD_CASES  # noqa: E402


def params() -> list:
    """(case, dtype, device, kernel) for every device in DEVICE_PARAMS (cuda: skipped without a GPU)."""
    out = []
    for device in DEVICE_PARAMS:
        name = device.values[0]
        for case in GRAD_CASES:
            for kernel in kernels_for(case, name):
                for dtype in case.dtypes:
                    label = f"{case.name} | {name} | {kernel or '-'} | {dtype}"
                    out.append(pytest.param(case, dtype, name, kernel, id=label, marks=device.marks))
    return out


@pytest.mark.parametrize(("case", "dtype", "device", "kernel"), params())
def test_gradient_case(case, dtype: str, device: str, kernel: str | None) -> None:
    result = run_case(case, device, dtype, kernel)
    if result is None:
        pytest.skip(f"not supported for this case: torch has no {kernel} kernel for it on {device}")
    assert result.passed, f"{case.name}, {device}, {kernel}, {dtype}: {result.explain()}"
