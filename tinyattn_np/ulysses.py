"""DeepSpeed-Ulysses: the sequence split over processes, turned into a split of the heads by an all-to-all,
attention on whole sequences, and back. (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models".)

Rank r of P holds T/P tokens of every head, as in the ring: q (..., Hq, T/P, E), k, v (..., Hkv, T/P, E).
Attention mixes tokens but never heads, so a head can be computed whole on one rank:

    1) all-to-all: rank r sends rank j its tokens of head group j (heads j·H/P .. (j+1)·H/P - 1) and
       receives every rank's tokens of its own group: (..., H/P, T, E), the whole sequence of H/P heads
    2) flash attention on this rank alone, over the whole sequence (the causal mask as on one process)
    3) all-to-all back: out (..., H/P, T, Ev) -> (..., H, T/P, Ev), this rank's tokens of every head

The backward is the same: q, k, v, out, dout and lse go to heads, flash_attention_backward runs on whole
rows (so the forward's lse is checked as on one process), and dq, dk, dv come back to tokens.

Its limit: the heads must split evenly over the ranks, Hq % P == 0, and under GQA also Hkv % P == 0, so
that each rank's query heads find their kv heads on the same rank (query head h reads kv head h // G, and
rank j's groups are heads j·Hq/P .. and kv heads j·Hkv/P ..). Llama-3-8B's 8 kv heads allow P = 1, 2, 4
or 8; the ring takes any P that divides the tokens. What it buys: an all-to-all sends (P - 1)/P of a
rank's shard, so its bytes per rank fall like 1/P, where the ring's stay those of a whole K/V sequence
(peaks.sequence_parallel_bytes; docs/sequence_parallel.md compares the two).

Every rank is busy the same: each computes whole causal rows for H/P heads, whatever the layout; the
layout only says which tokens a rank holds (layout="zigzag", the default, takes the ring's shards as they
are). Failures as in the ring (_mpi.py, the plumbing both share): bad input on any rank, heads that do not
split included, is raised on every rank before anything moves; any exception after that ends the job
(MPI_Abort).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._backward_kernel import BackwardPlan, flex_backward
from ._checks import QKVShape
from ._flash_kernel import TileSizes, flash_forward, flash_plan
from ._mpi import (
    Report,
    Settings,
    abort_on_failure,
    agreed_inputs,
    check_backward,
    check_forward,
    check_on_every_rank,
    finish,
    load_mpi,
    wait_for,
)
from .blockmask import check_band, square_tiles
from .shards import shard, unshard

Array = NDArray[np.floating]

__all__ = ["UlyssesStats", "ulysses_attention", "ulysses_attention_backward"]


# ---------------------------------------------------------------------------------------------------
# forward and backward


def ulysses_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    comm: Any,
    causal: bool = False,
    layout: str = "zigzag",
    return_lse: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    workers: int = 1,
    return_stats: bool = False,
) -> Any:
    """Attention over a sequence sharded across the ranks of comm, by two all-to-alls: ring_attention's
    arguments and results, computed another way.

    q (..., Hq, T/P, E), k (..., Hkv, T/P, E), v (..., Hkv, T/P, Ev): this rank's shard, made by
    shard(x, rank, P, layout=layout) -> out (..., Hq, T/P, Ev), this rank's rows of
    attention(q_all, k_all, v_all, causal=causal); with return_lse=True also lse (..., Hq, T/P).
    Hq and Hkv must be multiples of P (the module doc): else every rank raises a ValueError that says so.
    workers: flash_attention's threads per rank. return_stats=True appends a UlyssesStats.
    Failures as in ring_attention: bad input raised on every rank, anything later ends the job (MPI_Abort).
    """
    settings = Settings(
        causal=causal,
        layout=layout,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        return_lse=return_lse,
        return_stats=return_stats,
        workers=workers,
    )
    # 1) every rank's inputs checked and compared
    check = partial(check_ulysses, partial(check_forward, q, k, v, settings), comm)
    q, k, v, dims, settings = agreed_inputs(comm, check, "ulysses_attention's check")
    size = comm.Get_size()
    with abort_on_failure(comm, "ulysses_attention"):
        stats = new_stats(comm, dims, settings)
        # 2) tokens to heads: the whole sequence of H/P heads, (..., H/P, T, E)
        q_h, k_h, v_h = to_heads(comm, [q, k, v], settings.layout, stats)
        # 3) flash attention over the whole sequence, here alone
        started = time.perf_counter()
        dims_h = head_dims(dims, size)
        band = check_band(settings.causal, None, dims_h.n_q, dims_h.n_k)
        sizes = TileSizes(settings.block_q, settings.block_k, workers=settings.workers)
        out_h, lse_h = flash_forward(q_h, k_h, v_h, dims_h, flash_plan(dims_h, band, settings.scale, sizes))
        stats.compute_seconds += time.perf_counter() - started
        # 4) heads back to tokens: this rank's rows of every head (lse only when asked: it is bytes to send)
        sent_back = [out_h, lse_h[..., None]] if settings.return_lse else [out_h]
        back = to_sequence(comm, sent_back, settings.layout, stats)
    results: list[Any] = [back[0]]
    if settings.return_lse:
        results.append(back[1][..., 0])  # (..., Hq, T/P), in the compute dtype
    if settings.return_stats:
        results.append(stats)
    return finish(results)


def ulysses_attention_backward(
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    dout: Array,
    lse: Array,
    *,
    comm: Any,
    causal: bool = False,
    layout: str = "zigzag",
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    workers: int = 1,
    return_stats: bool = False,
) -> Any:
    """The gradients of ulysses_attention(q, k, v, comm=comm, causal=causal, layout=layout, scale=scale),
    ring_attention_backward's arguments and results computed another way.

    q, k, v: this rank's shards, as the forward got them; out (..., Hq, T/P, Ev) and lse (..., Hq, T/P)
    this rank's rows from ulysses_attention(..., return_lse=True) (or ring_attention's: the same numbers);
    dout = ∂loss/∂out for those rows -> dq, dk, dv shaped and typed like q, k, v.
    The forward's lse is checked as flash_attention_backward checks it; where it does not match, every
    rank raises the ValueError. Heads that do not split over the ranks are refused as in the forward.
    """
    settings = Settings(
        causal=causal,
        layout=layout,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        return_stats=return_stats,
        workers=workers,
    )
    # 1) every rank's inputs checked and compared
    check = partial(check_ulysses, partial(check_backward, q, k, v, out, dout, lse, settings), comm)
    q, k, v, out, dout, lse, dims, settings = agreed_inputs(comm, check, "ulysses_attention_backward's check")
    size = comm.Get_size()
    with abort_on_failure(comm, "ulysses_attention_backward"):
        stats = new_stats(comm, dims, settings)
        # 2) tokens to heads, for everything the backward reads
        arrays = [q, k, v, out, dout, lse[..., None]]
        q_h, k_h, v_h, out_h, dout_h, lse_h = to_heads(comm, arrays, settings.layout, stats)
        # 3) flash_attention_backward over whole rows, here alone
        started = time.perf_counter()
        dims_h = head_dims(dims, size)
        band = check_band(settings.causal, None, dims_h.n_q, dims_h.n_k)
        plan = BackwardPlan(settings.scale, band, settings.block_q, settings.block_k, settings.workers)
        grads, mismatch = local_backward(q_h, k_h, v_h, out_h, dout_h, lse_h[..., 0], dims_h, plan)
        stats.compute_seconds += time.perf_counter() - started
        # 4) heads back to tokens
        dq, dk, dv = to_sequence(comm, list(grads), settings.layout, stats)
    # 5) an lse that did not match on any rank is raised on every rank
    check_on_every_rank(comm, partial(raise_mismatch, mismatch), "ulysses_attention_backward's lse check")
    return (dq, dk, dv, stats) if settings.return_stats else (dq, dk, dv)


def local_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    dims: QKVShape,
    plan: BackwardPlan,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ValueError | None]:
    """flex_backward (_backward_kernel.py) on this rank's heads, and the ValueError it raises where lse does not
    match q, k and the mask (kept, with zeros for gradients, so that the all-to-all still runs and every rank
    can raise it)."""
    try:
        dq, dk, dv, _, _ = flex_backward(q, k, v, out, dout, lse, dims, plan)
        return (dq, dk, dv), None
    except ValueError as err:  # on checked inputs only _check_weights_sum_to_one raises one
        return (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)), err


def raise_mismatch(mismatch: ValueError | None) -> tuple[None, None]:
    """A check for check_on_every_rank: raise this rank's lse mismatch, if it had one."""
    if mismatch is not None:
        raise mismatch
    return None, None


# ---------------------------------------------------------------------------------------------------
# the all-to-all


def all_to_all(comm: Any, outgoing: list[list[np.ndarray]], stats: UlyssesStats) -> list[list[np.ndarray]]:
    """Send outgoing[j], a list of arrays, to rank j, and receive from every rank i the arrays it sends
    here, in rank order: one MPI all-to-all of bytes, each array in its own dtype. Every rank sends the same
    shapes and dtypes (the inputs were compared first), so what arrives is shaped like outgoing[0]."""
    size = comm.Get_size()
    parts = [(a.shape, a.dtype, a.nbytes) for a in outgoing[0]]
    row = sum(nbytes for _, _, nbytes in parts)  # bytes for each rank
    send_buf, recv_buf = np.empty((size, row), np.uint8), np.empty((size, row), np.uint8)  # (P, row)
    started = time.perf_counter()
    for j, arrays in enumerate(outgoing):
        offset = 0
        for a in arrays:
            send_buf[j, offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
            offset += a.nbytes
    MPI = load_mpi()
    wait_for([comm.Ialltoall([send_buf, MPI.BYTE], [recv_buf, MPI.BYTE])])  # polled: Ctrl-C lands meanwhile
    starts = np.cumsum([0] + [nbytes for _, _, nbytes in parts])  # where each array begins in a row
    incoming = [
        [
            recv_buf[i, start : start + nbytes].view(dtype).reshape(shape)
            for (shape, dtype, nbytes), start in zip(parts, starts, strict=False)
        ]
        for i in range(size)
    ]
    stats.bytes_sent += (size - 1) * row  # the row for this rank stays here
    stats.bytes_received += (size - 1) * row
    stats.wait_seconds += time.perf_counter() - started
    return incoming


def to_heads(comm: Any, arrays: list[np.ndarray], layout: str, stats: UlyssesStats) -> list[np.ndarray]:
    """Sequence shards (..., H, T/P, E) -> this rank's head group over the whole sequence (..., H/P, T, E)."""
    size = comm.Get_size()
    groups = [np.split(x, size, axis=-3) for x in arrays]  # the head groups of each array, (..., H/P, T/P, E)
    outgoing = [[heads[j] for heads in groups] for j in range(size)]  # head group j to rank j
    incoming = all_to_all(comm, outgoing, stats)  # incoming[i]: rank i's tokens of our heads, (..., H/P, T/P, E)
    return [unshard([parts[n] for parts in incoming], layout=layout) for n in range(len(arrays))]  # (.., H/P, T, E)


def to_sequence(comm: Any, arrays: list[np.ndarray], layout: str, stats: UlyssesStats) -> list[np.ndarray]:
    """This rank's head group over the whole sequence (..., H/P, T, E) -> its sequence shard (..., H, T/P, E)."""
    size = comm.Get_size()
    outgoing = [[shard(x, j, size, layout=layout) for x in arrays] for j in range(size)]  # rank j's tokens
    incoming = all_to_all(comm, outgoing, stats)  # incoming[i]: head group i at our tokens, (..., H/P, T/P, E)
    return [np.concatenate([parts[n] for parts in incoming], axis=-3) for n in range(len(arrays))]  # (.., H, T/P, E)


def head_dims(dims: QKVShape, size: int) -> QKVShape:
    """The sizes one rank computes: H/P heads of the whole sequence of T = P·T/P tokens."""
    tokens = dims.n_q * size
    return dims._replace(hq=dims.hq // size, hkv=dims.hkv // size, n_q=tokens, n_k=tokens)


# ---------------------------------------------------------------------------------------------------
# the checks, and what a rank did


def check_heads(dims: QKVShape, size: int) -> None:
    """Ulysses' limit: the query heads and the kv heads must both split evenly over the ranks."""
    if dims.hq % size or dims.hkv % size:
        raise ValueError(
            f"Ulysses gives each of the {size} ranks Hq/{size} query heads and Hkv/{size} kv heads, so both must "
            f"be multiples of {size}; got Hq={dims.hq} and Hkv={dims.hkv}. Use ring_attention, which takes any "
            "number of heads, or a number of ranks that divides both"
        )


def check_ulysses(check: Any, comm: Any) -> tuple[Any, Report]:
    """A scheme's check (_mpi.check_forward or check_backward) and Ulysses' own: the heads split over the
    ranks of comm."""
    checked, report = check()
    check_heads(checked[-2], comm.Get_size())  # checked ends with (dims, settings)
    return checked, report


@dataclass
class UlyssesStats:
    """What ulysses_attention (or its backward) did on this rank (return_stats=True)."""

    rank: int
    size: int
    layout: str
    causal: bool
    tokens: int  # this rank's tokens of the sequence, T/P
    heads: int  # the query heads it computed, Hq/P (of every batch entry)
    tiles: int  # flash tiles of the whole T x T score matrix (tile_plan's count), for every head
    bytes_sent: int  # to the other ranks, over every all-to-all (as many were received)
    bytes_received: int
    compute_seconds: float  # flash attention (or its backward) on this rank's heads
    wait_seconds: float  # in the all-to-alls: packing, moving, and waiting for the slowest rank


def new_stats(comm: Any, dims: QKVShape, settings: Settings) -> UlyssesStats:
    """A record with nothing counted yet; the tiles are those of flash over the whole T x T matrix."""
    size, tokens = comm.Get_size(), dims.n_q * comm.Get_size()
    tiles = square_tiles(tokens, settings.block_q, settings.block_k, settings.causal)
    return UlyssesStats(
        comm.Get_rank(), size, settings.layout, settings.causal, dims.n_q, dims.hq // size, tiles, 0, 0, 0.0, 0.0
    )
