"""Run under mpiexec by tests/test_ring.py, tests/test_ulysses.py and tests/test_sequence_parallel.py.

    mpiexec -n P python tests/ring_worker.py                      every agreement and error case
    mpiexec -n P python tests/ring_worker.py fail FUNCTION HOW RANK   one rank fails inside one call
    mpiexec -n P python tests/ring_worker.py other-comm           the last rank passes MPI.COMM_SELF
    mpiexec -n P python tests/ring_worker.py long                 a long ring, for Ctrl-C to the whole job

Agreement: each rank passes its own shards to ring_attention, ring_attention_backward, ulysses_attention
and ulysses_attention_backward; rank 0 gathers the parts, puts them back in order (unshard) and compares
with single-process flash_attention and flash_attention_backward on the whole sequence. The bytes each
call reports (its stats) must equal what this rank handed MPI to send (CountingComm) and the formula
(peaks.sequence_parallel_bytes). Then each bad input that only some ranks pass must raise on every rank.
Rank 0 prints one line per case and the last line "ring worker: P ranks, N cases passed, M failed".

fail: rank RANK fails in FUNCTION (ring, ring-backward, ulysses, ulysses-backward) HOW: an exception in
the compute of step 0 or 1 ("error-0", "error-1"), a MemoryError ("memory"), Ctrl-C in the compute
("interrupt", a real SIGINT to itself) or in the input check ("interrupt-in-check"). The job must end
at once (MPI_Abort) with that rank's error printed; it prints "returned" on any rank whose call returns.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from tinyattn_np import _mpi, flash_attention, flash_attention_backward, ring, ulysses  # noqa: E402
from tinyattn_np.peaks import sequence_parallel_bytes  # noqa: E402
from tinyattn_np.ring import ring_attention, ring_attention_backward, tile_counts  # noqa: E402
from tinyattn_np.shards import shard, unshard  # noqa: E402
from tinyattn_np.ulysses import ulysses_attention, ulysses_attention_backward  # noqa: E402

# float64: the forward to 1e-12, the gradients to 1e-10; float32 and float16 to the tests' tolerances
TOLERANCE = {
    np.float64: dict(rtol=1e-12, atol=1e-12),
    np.float32: dict(rtol=2e-5, atol=2e-6),
    np.float16: dict(rtol=2e-3, atol=2e-3),
}
GRAD_TOLERANCE = {np.float64: dict(rtol=1e-10, atol=1e-10), np.float32: dict(rtol=1e-4, atol=1e-5)}
BLOCK = 16  # tiles of 16: the chunks below (12 or 21 tokens) are not multiples of it


class CountingComm(MPI.Intracomm):
    """COMM_WORLD, counting the bytes this rank hands MPI for the other ranks: every Isend's buffer, and of
    every Ialltoall's the rows for the other ranks. An independent count of what the processes sent."""

    sent = 0

    def Isend(self, buf: Any, *args: Any, **kwargs: Any) -> MPI.Request:
        CountingComm.sent += np.asarray(buf[0]).nbytes
        return super().Isend(buf, *args, **kwargs)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> MPI.Request:
        CountingComm.sent += np.asarray(sendbuf[0]).nbytes * (self.Get_size() - 1) // self.Get_size()
        return super().Ialltoall(sendbuf, recvbuf)


world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
counting = CountingComm(world)
failures: list[str] = []
passed = 0


def report(ok: bool, what: str) -> None:
    global passed
    ok = bool(world.allreduce(ok, op=MPI.LAND))  # a case passes when it passed on every rank
    if rank == 0:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if ok:
        passed += 1
    else:
        failures.append(what)


def sent_by(call: Callable[[], Any]) -> tuple[Any, int]:
    """call()'s result and the bytes this rank handed MPI to send meanwhile (CountingComm)."""
    before = CountingComm.sent
    result = call()
    return result, CountingComm.sent - before


def matches(mine: list[np.ndarray], gold: list[np.ndarray], layout: str, tolerance: dict[str, float]) -> bool:
    """Every rank's parts of each of `mine`, gathered on rank 0 and put back in order, equal `gold` (rank 0's
    only: the others pass gold as []). A part without a last channel axis (lse) is gathered as (..., T/P, 1)."""
    ok = True
    for n, part in enumerate(mine):
        parts = world.gather(part[..., None] if part.ndim == mine[0].ndim - 1 else part, root=0)
        if rank == 0:
            whole = unshard(parts, layout=layout)
            whole = whole[..., 0] if whole.shape != gold[n].shape else whole
            close = whole.dtype == gold[n].dtype and np.allclose(whole, gold[n], **tolerance)
            if not close:
                print(f"      part {n}: max |diff| {np.abs(whole - gold[n]).max():.3g}, {whole.dtype}", flush=True)
            ok = ok and close
    return bool(world.bcast(ok, root=0))


def inputs(dtype: type, hq: int, hkv: int, tokens: int, seed: list[int]) -> list[np.ndarray]:
    """q, k, v and dout for the whole sequence, the same on every rank: (2, H, T, 8), v and dout with Ev = 5."""
    rng = np.random.default_rng(seed)
    shapes = [(2, hq, tokens, 8), (2, hkv, tokens, 8), (2, hkv, tokens, 5), (2, hq, tokens, 5)]
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


# --- agreement with one process ---------------------------------------------------------------------------


def forward_case(dtype: type, causal: bool, layout: str, hq: int, hkv: int, chunk: int) -> None:
    """The gathered ring output and lse against one process, T = 2·size·chunk tokens; tiles as counted."""
    tokens = 2 * size * chunk
    q, k, v, _ = inputs(dtype, hq, hkv, tokens, [int(causal), len(layout), hq, hkv, chunk])
    mine = [shard(x, rank, size, layout=layout) for x in (q, k, v)]
    out, lse, stats = ring_attention(
        *mine,
        comm=world,
        causal=causal,
        layout=layout,
        return_lse=True,
        return_stats=True,
        block_q=BLOCK,
        block_k=BLOCK,
    )
    counted = tile_counts(tokens, size, layout=layout, causal=causal, block_q=BLOCK, block_k=BLOCK)[rank]["tiles"]
    gold = list(flash_attention(q, k, v, causal=causal, return_lse=True)) if rank == 0 else []
    ok = matches([out, lse], gold, layout, TOLERANCE[dtype]) and stats.tiles == counted
    report(ok, f"forward {np.dtype(dtype).name} causal={causal} {layout} Hq={hq} Hkv={hkv} T={tokens}")


def backward_case(dtype: type, causal: bool, layout: str, hq: int, hkv: int, chunk: int, workers: int = 1) -> None:
    """The gathered ring gradients against flash_attention_backward on the whole sequence; the bytes sent
    against CountingComm's count and the formula."""
    tokens = 2 * size * chunk
    q, k, v, dout = inputs(dtype, hq, hkv, tokens, [7, int(causal), len(layout), hq, hkv, chunk])
    mine = [shard(x, rank, size, layout=layout) for x in (q, k, v, dout)]
    settings = dict(causal=causal, layout=layout, block_q=BLOCK, block_k=BLOCK)
    (out, lse), sent_forward = sent_by(lambda: ring_attention(*mine[:3], comm=counting, return_lse=True, **settings))
    (dq, dk, dv, stats), sent = sent_by(
        lambda: ring_attention_backward(
            *mine[:3], out, mine[3], lse, comm=counting, workers=workers, return_stats=True, **settings
        )
    )
    formula = sequence_parallel_bytes(
        tokens,
        size,
        scheme="ring",
        heads=hq,
        kv_heads=hkv,
        head_dim=8,
        head_dim_v=5,
        batch=2,
        dtype=np.dtype(dtype).name,
    )
    gold = []
    if rank == 0:
        whole_out, whole_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        gold = list(flash_attention_backward(q, k, v, whole_out, dout, whole_lse, causal=causal))
    bytes_ok = sent == stats.bytes_sent == formula["backward"] and sent_forward == formula["forward"]
    ok = matches([dq, dk, dv], gold, layout, GRAD_TOLERANCE[dtype]) and bytes_ok
    what = f"backward {np.dtype(dtype).name} causal={causal} {layout} Hq={hq} Hkv={hkv} T={tokens} workers={workers}"
    report(ok, what + ("" if bytes_ok else f" (bytes {sent}, stats {stats.bytes_sent}, formula {formula})"))


def ulysses_case(dtype: type, causal: bool, layout: str, hq: int, hkv: int, chunk: int) -> None:
    """Ulysses' out, lse and gradients against one process; its bytes against the count and the formula."""
    tokens = 2 * size * chunk
    q, k, v, dout = inputs(dtype, hq, hkv, tokens, [11, int(causal), len(layout), hq, hkv, chunk])
    mine = [shard(x, rank, size, layout=layout) for x in (q, k, v, dout)]
    settings = dict(causal=causal, layout=layout, block_q=BLOCK, block_k=BLOCK, return_stats=True)
    (out, lse, forward_stats), sent_forward = sent_by(
        lambda: ulysses_attention(*mine[:3], comm=counting, return_lse=True, **settings)
    )
    (dq, dk, dv, stats), sent = sent_by(
        lambda: ulysses_attention_backward(*mine[:3], out, mine[3], lse, comm=counting, **settings)
    )
    formula = sequence_parallel_bytes(
        tokens,
        size,
        scheme="ulysses",
        heads=hq,
        kv_heads=hkv,
        head_dim=8,
        head_dim_v=5,
        batch=2,
        dtype=np.dtype(dtype).name,
    )
    gold: list[np.ndarray] = []
    if rank == 0:
        gold = list(flash_attention(q, k, v, causal=causal, return_lse=True))
        gold += list(flash_attention_backward(q, k, v, gold[0], dout, gold[1], causal=causal))
    tolerance = TOLERANCE[dtype] if dtype != np.float64 else GRAD_TOLERANCE[dtype]
    bytes_ok = (sent_forward, sent) == (forward_stats.bytes_sent, stats.bytes_sent) == tuple(formula.values())[1:]
    ok = matches([out, lse, dq, dk, dv], gold, layout, tolerance) and bytes_ok
    what = f"ulysses {np.dtype(dtype).name} causal={causal} {layout} Hq={hq} Hkv={hkv} T={tokens}"
    report(ok, what + ("" if bytes_ok else f" (bytes {sent_forward}, {sent}, formula {formula})"))


# --- bad input on some ranks: an error on every rank ---------------------------------------------------------


def error_case(what: str, expected: str, call: Callable[[], Any], error: type = ValueError) -> None:
    """call() gets input that is wrong on some ranks: every rank must raise `error` saying `expected`."""
    try:
        call()
        mine = "no error"
    except error as err:
        mine = str(err)
    every = world.gather(mine, root=0)
    ok = rank != 0 or all(expected in message for message in every)
    if not ok:
        print(f"      messages: {every}", flush=True)
    report(ok, f"error on every rank: {what}")


def error_cases() -> None:
    x = np.zeros((1, 2, 8, 4))
    if size > 1:
        wide = np.zeros((1, 2, 10, 4)) if rank == size - 1 else x  # the last rank holds more tokens
        error_case("unequal shards", "shards of unequal length", lambda: ring_attention(wide, wide, wide, comm=world))
        more_heads = np.zeros((1, 4, 8, 4)) if rank == size - 1 else x
        error_case(
            "mismatched shapes", "disagree on their shapes", lambda: ring_attention(more_heads, x, x, comm=world)
        )
        error_case(
            "mismatched arguments",
            "disagree on their settings",
            lambda: ring_attention(x, x, x, comm=world, causal=rank == 0),
        )
        odd_heads = np.zeros((1, size + 1, 8, 4))
        error_case(
            "Ulysses' heads that do not split",
            f"both must be multiples of {size}",
            lambda: ulysses_attention(odd_heads, odd_heads, odd_heads, comm=world),
        )
        error_case(
            "Ulysses' backward, heads that do not split",
            f"Hq={size + 1} and Hkv={size + 1}",
            lambda: ulysses_attention_backward(*[odd_heads] * 5, odd_heads[..., 0], comm=world),
        )
    odd = np.zeros((1, 2, 7, 4)) if rank == size - 1 else x
    error_case(
        "an odd zigzag shard on one rank",
        f"rank {size - 1} of {size}: a zigzag shard",
        lambda: ring_attention(odd, odd, odd, comm=world),
    )
    short_lse = x[..., :3, 0] if rank == size - 1 else x[..., 0]
    error_case(
        "a backward's lse of the wrong shape on one rank",
        f"rank {size - 1} of {size}: lse must have shape",
        lambda: ring_attention_backward(x, x, x, x, x, short_lse, comm=world),
    )
    q, k, v, dout = (shard(a, rank, size) for a in inputs(np.float64, size, size, 4 * size, [3]))
    out, lse = ring_attention(q, k, v, comm=world, return_lse=True)  # no mask: the backward below has one
    for name, backward in (("ring", ring_attention_backward), ("ulysses", ulysses_attention_backward)):
        error_case(
            f"{name}: an lse from another mask",
            "lse does not match q, k and the mask",
            lambda backward=backward: backward(q, k, v, out, dout, lse, comm=world, causal=True),
        )


def agreement() -> None:
    for dtype in (np.float64, np.float32):
        for causal in (True, False):
            for layout in ("zigzag", "contiguous"):
                forward_case(dtype, causal, layout, hq=4, hkv=2, chunk=21)  # GQA, chunk not a multiple of 16
    forward_case(np.float64, True, "zigzag", hq=3, hkv=3, chunk=12)
    for causal in (True, False):
        for layout in ("zigzag", "contiguous"):
            backward_case(np.float64, causal, layout, hq=4, hkv=2, chunk=21)
            ulysses_case(np.float64, causal, layout, hq=2 * size, hkv=size, chunk=21)  # GQA: 2 query heads per kv
    backward_case(np.float64, True, "zigzag", hq=3, hkv=3, chunk=12, workers=2)
    backward_case(np.float32, True, "zigzag", hq=4, hkv=2, chunk=21)
    ulysses_case(np.float16, True, "zigzag", hq=size, hkv=size, chunk=12)
    error_cases()
    world.Barrier()
    if rank == 0:
        print(f"ring worker: {size} ranks, {passed} cases passed, {len(failures)} failed", flush=True)
    sys.exit(1 if world.allreduce(len(failures)) else 0)


# --- one rank fails inside a call: the job must end ------------------------------------------------------------


def failing(original: Callable[..., Any], how: str, at_call: int, name: str) -> Callable[..., Any]:
    """original, made to fail on this rank the way `how` says at its call number at_call."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call, calls[0] = calls[0], calls[0] + 1
        if call == at_call:
            if how.startswith("error"):
                raise RuntimeError(f"injected failure in call {call} of {name} on rank {rank}")
            if how == "memory":
                raise MemoryError(f"injected: no memory for {name} on rank {rank}")
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, to this rank alone; it lands in what follows
        return original(*args, **kwargs)

    return wrapper


def fail(function: str, how: str, failing_rank: int) -> None:
    """Rank failing_rank fails inside `function` as `how` says; the others run it as usual. The compute is
    a ring step (error-1: the second) or Ulysses' one local flash call; a backward's check is the second
    check (the forward's comes first)."""
    computes = {
        "ring": (ring, "ring_step"),
        "ring-backward": (ring, "ring_backward_step"),
        "ulysses": (ulysses, "flash_forward"),
        "ulysses-backward": (ulysses, "flex_backward"),
    }
    module, name = (_mpi, "check_shards") if how == "interrupt-in-check" else computes[function]
    at_call = int(how == "error-1" or (how == "interrupt-in-check" and function.endswith("backward")))
    if rank == failing_rank:
        setattr(module, name, failing(getattr(module, name), how, at_call, name))
    q, k, v, dout = (shard(a, rank, size) for a in inputs(np.float64, 2 * size, size, 8 * size, [5]))
    if function.startswith("ring"):
        out, lse = ring_attention(q, k, v, comm=world, causal=True, return_lse=True)
        if function == "ring-backward":
            ring_attention_backward(q, k, v, out, dout, lse, comm=world, causal=True)
    else:
        out, lse = ulysses_attention(q, k, v, comm=world, causal=True, return_lse=True)
        if function == "ulysses-backward":
            ulysses_attention_backward(q, k, v, out, dout, lse, comm=world, causal=True)
    print(f"rank {rank}: returned", flush=True)
    world.Barrier()  # the ranks whose call returned wait here until the abort ends them


def long_ring() -> None:
    """A ring whose steps each take 0.2 s (a stand-in for a long compute), on every rank, for Ctrl-C."""
    original = ring.ring_step

    def slow_step(*args: Any) -> int:
        time.sleep(0.2)
        return original(*args)

    ring.ring_step = slow_step
    x = np.zeros((1, 2, 8, 4))
    if rank == 0:
        print("rank 0: calling ring_attention", flush=True)
    for _ in range(1000):
        ring_attention(x, x, x, comm=world)


def other_comm() -> None:
    """The last rank passes MPI.COMM_SELF, the others COMM_WORLD: the others wait for it in the check."""
    x = np.zeros((1, 2, 8, 4))
    if rank == 0:
        print("rank 0: calling ring_attention", flush=True)
    ring_attention(x, x, x, comm=MPI.COMM_SELF if rank == size - 1 else world)
    print(f"rank {rank}: returned", flush=True)
    time.sleep(600)  # as a program would go on; the test ends the job with Ctrl-C


if __name__ == "__main__":
    if sys.argv[1:2] == ["fail"]:
        fail(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1:2] == ["other-comm"]:
        other_comm()
    elif sys.argv[1:2] == ["long"]:
        long_ring()
    else:
        agreement()
