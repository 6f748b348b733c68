"""tinyattn_np.profiler: the timed copies of the kernels' tile loops give the kernels' bits, and every part of a
run is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np.profiler import (
    PARTS,
    PYTHON,
    Stopwatch,
    products_ratio,
    profile_backward,
    profile_decode,
    profile_forward,
    profile_mla,
)


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


@pytest.mark.parametrize("group", [1, 4], ids=["one query head a kv head", "four"])
def test_the_decode_steps_copy_gives_the_engines_bits(group) -> None:
    """A decode step (flash_decode's engine, one chunk of keys) profiled part by part: the copy's out and lse are
    the engine's, to the bit, and products_ratio is its time over its products'."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2 * group, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 700, 16)).astype(np.float32) for _ in range(2))
    row = profile_decode(q, k, v, repeats=1, matmul_rate=lambda: 100.0)
    assert row["same_bits"] and row["tiles"] >= 1 and row["flops"] == 2 * 32 * 2 * group * 700
    assert products_ratio(row) == pytest.approx(sum(row["parts_ms"].values()) / row["parts_ms"]["matmuls"])
    assert products_ratio(row) >= 1.0


def test_the_mla_steps_copy_gives_attend_latents_bits() -> None:
    """The MLA decode step (absorbed) profiled part by part: the copy gives the bits of the engines that
    attend_latent runs (one chunk of keys)."""
    rng = np.random.default_rng(2)
    q_nope, q_rope = rng.standard_normal((1, 4, 1, 8)), rng.standard_normal((1, 4, 1, 4))
    latent, w_ukv = rng.standard_normal((1, 1, 300, 16 + 4)), rng.standard_normal((16, 4 * (8 + 6))) / 4
    row = profile_mla(q_nope, q_rope, latent, w_ukv, repeats=1, matmul_rate=lambda: 100.0)
    assert row["same_bits"] and set(row["parts_ms"]) == {*PARTS, PYTHON} and products_ratio(row) >= 1.0
