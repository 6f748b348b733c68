"""presets.py: each preset's parameters are the published size of the released model."""

from __future__ import annotations

import pytest

from tinyattn_np.presets import PRESETS


@pytest.mark.parametrize(
    "name, published",
    [
        ("gpt2", 124_439_808),  # tied embeddings
        ("llama-3-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("mistral-7b-v0.1", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
        ("gemma-2-9b", 9_241_705_984),
        ("phi-3-mini", 3_821_079_552),
    ],
)
def test_parameter_counts_are_the_published_sizes(name, published):
    assert PRESETS[name].num_parameters == published
