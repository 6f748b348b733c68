"""Every case in cases.CASES, on every device and dtype it runs in: tinyattn_np vs torch, within the
tolerance the case states (cases.py says why each tolerance is what it is)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cases import CASES  # noqa: E402  (needs torch, so after the importorskip)
from devices import DEVICE_PARAMS  # noqa: E402

PARAMS = [pytest.param(case, dtype, id=f"{case.name} | {dtype}") for case in CASES for dtype in case.dtypes]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize(("case", "dtype"), PARAMS)
def test_case(case, dtype: str, device: str) -> None:
    result = case.run(device, dtype)
    assert result.passed, f"{case.name}, {device}, {dtype}: {result.explain()}"
