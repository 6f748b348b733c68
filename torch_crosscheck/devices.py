"""The devices every crosscheck test runs on: "cpu" always, "cuda" skipped with its reason when torch
sees no GPU (shown by pytest -ra, never silently absent).

    @pytest.mark.parametrize("device", DEVICE_PARAMS)

(This is not a conftest.py on purpose: tests/ imports helpers with `from conftest import ...`, and a
second conftest module on sys.path would shadow its own.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

DEVICE_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: torch.cuda.is_available() is False"),
    ),
]


def case_params(cases: Sequence[Any]) -> list[Any]:
    """(case, dtype, device, kernel) for every case on every device of DEVICE_PARAMS, in every SDPA kernel
    (cases.kernels_for) and dtype it runs in, with the device's marks (cuda: skipped without a GPU)."""
    from cases import kernels_for  # cases imports torch too; here only when a test module asks

    out = []
    for device in DEVICE_PARAMS:
        name = device.values[0]
        for case in cases:
            for kernel in kernels_for(case, name):
                for dtype in case.dtypes:
                    label = f"{case.name} | {name} | {kernel or '-'} | {dtype}"
                    out.append(pytest.param(case, dtype, name, kernel, id=label, marks=device.marks))
    return out
