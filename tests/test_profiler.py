"""tinyattn_np.profiler: the timed copies of the kernels' tile loops give the kernels' bits, and every part of a
run is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np.profiler import PARTS, PYTHON, Stopwatch, profile_backward, profile_forward


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("profile", [profile_forward, profile_backward], ids=["forward", "backward"])
def test_the_copy_gives_the_kernels_bits_and_names_every_part(profile, causal) -> None:
    rng = np.random.default_rng(0)
    qkv = tuple(rng.standard_normal((1, 2, 96, 16)).astype(np.float32) for _ in range(3))
    row = profile(qkv, causal=causal, repeats=1, matmul_rate=lambda: 100.0)
    assert row["same_bits"], "the profile's copy must give the kernel's bits"
    assert set(row["parts_ms"]) == {*PARTS, PYTHON} and all(ms >= 0 for ms in row["parts_ms"].values())
    assert row["tiles"] > 0 and row["flops"] > 0 and row["matmul_gflops"] == 100.0


def test_a_stopwatch_adds_each_block_to_its_part() -> None:
    clock = Stopwatch()
    for _ in range(3):
        with clock("matmuls"):
            pass
    with clock("masking"):
        pass
    assert clock.laps == 4 and set(clock.seconds) == {"matmuls", "masking"}
    assert Stopwatch.lap_cost(laps=10) >= 0.0
