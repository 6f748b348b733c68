"""tinyattn_np.linear_profile: the timed copy of the gated delta rule's chunked forward gives the engine's output and
final state, and every part of a run is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np import gated_delta_rule
from tinyattn_np.linear_profile import LINEAR_PARTS, profile_chunked
from tinyattn_np.profiler import PYTHON, products_ratio


def inputs(T: int, heads: int = 2, d: int = 8, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, heads, T, d)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.5, (1, heads, T)).astype(np.float32)
    return q, k, v, g, rng.uniform(0.0, 1.0, (1, heads, T)).astype(np.float32)


@pytest.mark.parametrize(("T", "C"), [(100, 16), (64, 64), (5, 16)], ids=["chunks and a part", "one", "T < C"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_the_chunked_forwards_copy_gives_the_engines_bits(T, C, l2norm) -> None:
    """The chunked forward profiled part by part: the copy's o and final state are the engine's to the bit (and
    gated_delta_rule's o), every part is named, and the FLOPs are 2 (5 C² d + 3 C d²) a chunk of a head."""
    q, k, v, g, beta = inputs(T)
    row = profile_chunked(q, k, v, g, beta, chunk_size=C, l2norm_qk=l2norm, repeats=1, matmul_rate=lambda: 100.0)
    assert row["same_bits"] and row["matmul_gflops"] == 100.0
    assert tuple(row["parts_ms"]) == (*LINEAR_PARTS, PYTHON) and all(ms >= 0 for ms in row["parts_ms"].values())
    n, d = -(-T // C), 8
    assert row["chunks"] == n and row["flops"] == 2 * 2 * n * (5 * C * C * d + 3 * C * d * d)
    assert products_ratio(row) >= 1.0


def test_the_copy_is_the_rule() -> None:
    """What the profile times is gated_delta_rule's chunked form: the copy, run on its own, gives its output."""
    from tinyattn_np import linear_profile
    from tinyattn_np._linear_kernel import Prep, _flat_heads
    from tinyattn_np.profiler import Stopwatch

    q, k, v, g, beta = inputs(70, seed=1)
    tokens = _flat_heads(q, k, v, g[..., None], beta)
    out, _ = linear_profile.forward_copy(tokens, np.zeros((2, 8, 8), np.float32), 16, Prep(8**-0.5, True), Stopwatch())
    np.testing.assert_array_equal(
        out.reshape(v.shape), gated_delta_rule(q, k, v, g, beta, chunk_size=16, l2norm_qk=True)
    )


def test_the_profile_refuses_per_channel_decays_and_mixed_widths() -> None:
    q, k, v, g, beta = inputs(16)
    with pytest.raises(ValueError, match="one decay a head"):
        profile_chunked(q, k, v, np.repeat(g[..., None], 8, -1), beta, repeats=1, matmul_rate=lambda: 100.0)
    with pytest.raises(ValueError, match="one width"):
        profile_chunked(q, k, v[..., :4], g, beta, repeats=1, matmul_rate=lambda: 100.0)


def test_the_profile_checks_its_flags_before_it_runs() -> None:
    q, k, v, g, beta = inputs(16)
    with pytest.raises(ValueError, match="chunk_size"):
        profile_chunked(q, k, v, g, beta, chunk_size=0, repeats=1, matmul_rate=lambda: 100.0)
    with pytest.raises(TypeError, match="l2norm_qk must be True or False"):
        profile_chunked(q, k, v, g, beta, l2norm_qk="False", repeats=1, matmul_rate=lambda: 100.0)
    with pytest.raises(ValueError, match="repeats"):
        profile_chunked(q, k, v, g, beta, repeats=0, matmul_rate=lambda: 100.0)
