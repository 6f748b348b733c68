"""Every case in cases.CASES, on every device, SDPA kernel and dtype it runs in: tinyattn_np vs torch,
within the tolerance the case states (cases.py says why each tolerance is what it is). A kernel that
torch does not have for a case (flash in float32 on CUDA, say) is a skip that names it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cases import CASES, kernels_for, run_case  # noqa: E402  (needs torch, so after the importorskip)
from devices import DEVICE_PARAMS  # noqa: E402


def params() -> list:
    """(case, dtype, device, kernel) for every device in DEVICE_PARAMS, with its marks (cuda: skipped
    without a GPU)."""
    out = []
    for device in DEVICE_PARAMS:
        name = device.values[0]
        for case in CASES:
            for kernel in kernels_for(case, name):
                for dtype in case.dtypes:
                    label = f"{case.name} | {name} | {kernel or '-'} | {dtype}"
                    out.append(pytest.param(case, dtype, name, kernel, id=label, marks=device.marks))
    return out


@pytest.mark.parametrize(("case", "dtype", "device", "kernel"), params())
def test_case(case, dtype: str, device: str, kernel: str | None) -> None:
    result = run_case(case, device, dtype, kernel)
    if result is None:
        pytest.skip(f"not supported for this case: torch has no {kernel} kernel for it on {device}")
    assert result.passed, f"{case.name}, {device}, {kernel}, {dtype}: {result.explain()}"
