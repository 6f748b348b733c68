"""The devices every crosscheck test runs on: "cpu" always, "cuda" skipped with its reason when torch
sees no GPU (shown by pytest -ra, never silently absent).

    @pytest.mark.parametrize("device", DEVICE_PARAMS)

(This is not a conftest.py on purpose: tests/ imports helpers with `from conftest import ...`, and a
second conftest module on sys.path would shadow its own.)
"""

from __future__ import annotations

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
