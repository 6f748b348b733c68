"""Run by tests/test_ring.py as `mpiexec -n P python tests/ring_worker.py`: every case on every rank.

Each rank passes its own shard to ring_attention; rank 0 gathers the parts, puts them back in order
(unshard) and compares with single-process flash_attention on the whole sequence. Then each bad input
that only some ranks pass must raise on every rank, never hang. Rank 0 prints one line per case and
the last line "ring worker: P ranks, N cases passed"; any failure exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from tinyattn_np import flash_attention  # noqa: E402
from tinyattn_np.ring import ring_attention, shard, tile_counts, unshard  # noqa: E402

# float64 to 1e-12; float32 to the forward's tolerance (tests/conftest.py)
TOLERANCE = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=2e-5, atol=2e-6)}
BLOCK = 16  # tiles of 16: the chunks below (12 or 21 tokens) are not multiples of it

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
passed = 0


def report(ok: bool, what: str) -> None:
    global passed
    if rank == 0:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if ok:
        passed += 1
    else:
        failures.append(what)


def agreement_case(dtype: type, causal: bool, layout: str, hq: int, hkv: int, chunk: int) -> None:
    """The gathered ring output (and lse) against one process, T = 2·size·chunk tokens."""
    tokens = 2 * size * chunk
    rng = np.random.default_rng([int(causal), len(layout), hq, hkv, chunk])  # the same on every rank
    q = rng.standard_normal((2, hq, tokens, 8)).astype(dtype)  # (B, Hq, T, E)
    k = rng.standard_normal((2, hkv, tokens, 8)).astype(dtype)  # (B, Hkv, T, E)
    v = rng.standard_normal((2, hkv, tokens, 5)).astype(dtype)  # (B, Hkv, T, Ev): Ev != E on purpose
    parts = [shard(x, rank, size, layout=layout) for x in (q, k, v)]
    out, lse, stats = ring_attention(
        *parts, comm=comm, causal=causal, layout=layout, return_lse=True, return_stats=True,
        block_q=BLOCK, block_k=BLOCK,
    )  # fmt: skip
    counted = tile_counts(tokens, size, layout=layout, causal=causal, block_q=BLOCK, block_k=BLOCK)[rank]["tiles"]
    tiles_ok = comm.allreduce(stats.tiles == counted, op=MPI.LAND)
    outs, lses = comm.gather(out, root=0), comm.gather(lse[..., None], root=0)
    what = f"{np.dtype(dtype).name} causal={causal} {layout} Hq={hq} Hkv={hkv} T={tokens} (chunks of {chunk})"
    ok = False
    if rank == 0:
        gold, gold_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        mine, mine_lse = unshard(outs, layout=layout), unshard(lses, layout=layout)[..., 0]
        ok = (
            mine.dtype == np.dtype(dtype)
            and np.allclose(mine, gold, **TOLERANCE[dtype])
            and np.allclose(mine_lse, gold_lse, **TOLERANCE[dtype])
        )
        if not ok:
            print(f"      max |out diff| {np.abs(mine - gold).max():.3g}, dtype {mine.dtype}", flush=True)
    report(bool(comm.bcast(ok, root=0)) and tiles_ok, what)


def error_case(what: str, expected: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: object) -> None:
    """Inputs that are wrong on some ranks: every rank must raise a ValueError that says `expected`."""
    try:
        ring_attention(q, k, v, comm=comm, **kwargs)
        mine = "no error"
    except ValueError as err:
        mine = str(err)
    every = comm.gather(mine, root=0)
    ok = False
    if rank == 0:
        ok = all(expected in message for message in every)
        if not ok:
            print(f"      messages: {every}", flush=True)
    report(bool(comm.bcast(ok, root=0)), f"error on every rank: {what}")


for dtype in (np.float64, np.float32):
    for causal in (True, False):
        for layout in ("zigzag", "contiguous"):
            agreement_case(dtype, causal, layout, hq=4, hkv=2, chunk=21)  # GQA, chunk not a multiple of 16
agreement_case(np.float64, True, "zigzag", hq=3, hkv=3, chunk=12)

x = np.zeros((1, 2, 8, 4))
wide = np.zeros((1, 2, 10, 4)) if rank == size - 1 else x  # the last rank holds more tokens
if size > 1:
    error_case("unequal shards", "shards of unequal length", wide, wide, wide)
    more_heads = np.zeros((1, 4, 8, 4)) if rank == size - 1 else x
    error_case("mismatched shapes", "disagree on their shapes", more_heads, x, x)
    error_case("mismatched arguments", "disagree on their settings", x, x, x, causal=rank == 0)
odd = np.zeros((1, 2, 7, 4)) if rank == size - 1 else x
error_case("an odd zigzag shard on one rank", f"rank {size - 1} of {size}: a zigzag shard", odd, odd, odd)

comm.Barrier()
if rank == 0:
    print(f"ring worker: {size} ranks, {passed} cases passed, {len(failures)} failed", flush=True)
sys.exit(1 if comm.allreduce(len(failures)) else 0)
