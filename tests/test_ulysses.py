"""Ulysses in this process, on MPI.COMM_SELF (a one-rank stand-in where mpi4py is missing): forward and
backward equal one process's flash attention, the heads' limit is refused with a message that says what to
do, the all-to-all keeps every array's dtype, and neither scheme imports the other. The runs on real
processes are in tests/test_sequence_parallel.py (tests/ring_worker.py under mpiexec -n 1..4)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close
from test_ring import modules_after, one_rank_comm

from tinyattn_np import flash_attention, flash_attention_backward
from tinyattn_np._checks import QKVShape
from tinyattn_np.ulysses import (
    UlyssesStats,
    check_heads,
    ulysses_attention,
    ulysses_attention_backward,
)


@pytest.fixture
def comm_self(monkeypatch: pytest.MonkeyPatch) -> object:
    return one_rank_comm(monkeypatch)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_of_one_is_flash_attention(layout: str, causal: bool, rng: np.random.Generator, comm_self: object):
    q = rng.standard_normal((2, 4, 42, 8))  # (B, Hq, T, E), GQA: 2 query heads per kv head
    k, v = rng.standard_normal((2, 2, 42, 8)), rng.standard_normal((2, 2, 42, 5))
    dout = rng.standard_normal((2, 4, 42, 5))
    settings = dict(causal=causal, layout=layout, block_q=16, block_k=16, return_stats=True)
    out, lse, stats = ulysses_attention(q, k, v, comm=comm_self, return_lse=True, **settings)
    gold, gold_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    assert_close(out, gold, np.float64, "out")
    assert_close(lse, gold_lse, np.float64, "lse")
    dq, dk, dv, backward_stats = ulysses_attention_backward(q, k, v, out, dout, lse, comm=comm_self, **settings)
    for name, mine, want in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), flash_attention_backward(q, k, v, out, dout, lse, causal=causal), strict=True
    ):
        np.testing.assert_allclose(mine, want, rtol=1e-10, atol=1e-10, err_msg=name)
    for record in (stats, backward_stats):
        assert isinstance(record, UlyssesStats)
        assert (record.bytes_sent, record.bytes_received, record.heads, record.tokens) == (0, 0, 4, 42)
        assert record.tiles == (6 if causal else 9)  # a 42 x 42 matrix in tiles of 16: 3 x 3, or its triangle


def test_ulysses_keeps_float16_and_returns_out_alone(rng: np.random.Generator, comm_self: object) -> None:
    q, k, v, dout = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(4))
    out = ulysses_attention(q, k, v, comm=comm_self, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    assert_close(out, flash_attention(q, k, v, causal=True), np.float16, "float16")
    _, lse = ulysses_attention(q, k, v, comm=comm_self, causal=True, return_lse=True)
    assert lse.dtype == np.float32  # the all-to-all carries each array in its own dtype
    grads = ulysses_attention_backward(q, k, v, out, dout, lse, comm=comm_self, causal=True)
    assert [g.dtype for g in grads] == [np.float16] * 3


@pytest.mark.parametrize(("module", "other"), [("ulysses", "ring"), ("ring", "ulysses")])
def test_neither_scheme_imports_the_other(module: str, other: str) -> None:
    loaded = modules_after(f"tinyattn_np.{module}", "tinyattn_np.")
    assert {"tinyattn_np._mpi", "tinyattn_np.shards"} <= set(loaded), loaded  # what both build on
    assert f"tinyattn_np.{other}" not in loaded, loaded


def test_heads_that_do_not_split_are_refused_saying_what_to_do() -> None:
    dims = QKVShape((1,), 32, 8, 128, 128, 64, 64)  # Llama-3-8B's heads
    check_heads(dims, 8)  # 4 query heads and 1 kv head per rank: fine
    with pytest.raises(ValueError, match=r"both must be multiples of 16; got Hq=32 and Hkv=8\. Use ring_attention"):
        check_heads(dims, 16)
    with pytest.raises(ValueError, match="got Hq=6 and Hkv=3"):
        check_heads(dims._replace(hq=6, hkv=3), 2)


def test_ulysses_errors_name_what_is_wrong(rng: np.random.Generator, comm_self: object) -> None:
    q, k, v, dout = (rng.standard_normal((1, 2, 16, 8)) for _ in range(4))
    with pytest.raises(ValueError, match="rank 0 of 1: a zigzag shard is two equal chunks"):
        ulysses_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :], comm=comm_self)
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        ulysses_attention(q, k, v, comm="world")
    out, lse = ulysses_attention(q, k, v, comm=comm_self, return_lse=True)  # no mask
    with pytest.raises(ValueError, match="rank 0 of 1: lse does not match q, k and the mask"):
        ulysses_attention_backward(q, k, v, out, dout, lse, comm=comm_self, causal=True)
    with pytest.raises(ValueError, match="rank 0 of 1: dout must have shape"):
        ulysses_attention_backward(q, k, v, out, dout[..., :3], lse, comm=comm_self)
