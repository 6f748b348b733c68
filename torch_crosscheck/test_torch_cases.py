"""Every case in cases.CASES, on every device, SDPA kernel and dtype it runs in: tinyattn_np vs torch,
within the tolerance the case states (cases.py says why each tolerance is what it is). A kernel that
torch does not have for a case (flash in float32 on CUDA, say) is a skip that names it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cases import CASES, run_case  # noqa: E402  (needs torch, so after the importorskip)
from devices import case_params  # noqa: E402


@pytest.mark.parametrize(("case", "dtype", "device", "kernel"), case_params(CASES))
def test_case(case, dtype: str, device: str, kernel: str | None) -> None:
    result = run_case(case, device, dtype, kernel)
    if result is None:
        pytest.skip(f"not supported for this case: torch has no {kernel} kernel for it on {device}")
    assert result.passed, f"{case.name}, {device}, {kernel}, {dtype}: {result.explain()}"
