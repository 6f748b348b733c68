"""The runnable examples in the package's docstrings are run: an example that no longer prints what it
shows fails here."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import numpy as np
import pytest

import tinyattn_np

MODULES = sorted(
    info.name for info in pkgutil.iter_modules(tinyattn_np.__path__, "tinyattn_np.") if info.name != "tinyattn_np.ring"
) + ["tinyattn_np.ring"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"np": np}, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
