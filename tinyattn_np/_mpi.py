"""The MPI plumbing of the sequence-parallel schemes (ring.py, ulysses.py): internal, so that their steps
read like the papers. Loading mpi4py, passing a block to the next rank, waits that poll, the inputs checked
on every rank and agreed on, abort on failure, and stopping together.

Basics. Every rank checks its own inputs, and the ranks compare what they checked (an allgather) before any
block moves: bad input on one rank is raised on every rank alike, as a ValueError or TypeError naming the
rank (check_on_every_rank, agree). Once the blocks move, a rank that raised alone (an error inside the
compute, a MemoryError, Ctrl-C) would leave the others waiting for its next message forever, and MPI cannot
call back a half-finished exchange. So any exception from there on, on any rank, is printed with its rank
and ends the whole job with MPI_Abort (exit status 130 for Ctrl-C, else 1), as `python -m mpi4py` does for
an unhandled one (abort_on_failure). A communicator of one rank has nobody waiting: it raises as usual.

Details. The waits poll (MPI.Request.Testall), so that Ctrl-C lands in them too: MPI_Waitall would block
inside C, where Python cannot deliver it. A program that would rather finish its step on every rank and
keep what it has (a training loop) runs inside tinyattn_np.mpi_job.StopTogether, which notes Ctrl-C
instead of raising it, and asks at the end of each step. One mistake cannot be seen: a rank that passes
another communicator (MPI.COMM_SELF where the others pass MPI.COMM_WORLD) runs a scheme of its own, and the
others wait in the input check for a rank that never comes; that job ends only by Ctrl-C (which ends it
promptly) or its time limit.

mpi4py is imported only when a scheme runs (load_mpi): importing this module needs NumPy alone. A program
reaches load_mpi and abort_on_failure through tinyattn_np.mpi_job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from ._checks import (
    QKVShape,
    check_bool,
    check_layout,
    check_like,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
)
from ._tuning import TILE_SIDE

__all__ = [
    "INSTALL_HINT",
    "Failed",
    "Report",
    "Settings",
    "abort_on_failure",
    "agree",
    "agreed_inputs",
    "check_backward",
    "check_comm",
    "check_forward",
    "check_on_every_rank",
    "check_settings",
    "check_shards",
    "finish",
    "load_mpi",
    "pack_block",
    "pass_on",
    "unpack_block",
    "wait_for",
]

INSTALL_HINT = 'pip install -e ".[distributed]"  (mpi4py and the mpich wheel, which brings mpiexec)'
PRINT_SECONDS = 0.25  # how long a failing rank lets mpiexec pass on its message before MPI_Abort


# ---------------------------------------------------------------------------------------------------
# mpi4py, and the messages


def load_mpi() -> Any:
    """The mpi4py.MPI module, or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(f"needs mpi4py and an MPI library: {INSTALL_HINT}") from err
    return MPI


def check_comm(comm: Any) -> tuple[int, int]:
    """(rank, size) of an mpi4py communicator; anything else is a TypeError."""
    if not isinstance(comm, load_mpi().Comm):
        raise TypeError(f"comm must be an mpi4py communicator such as MPI.COMM_WORLD; got {type(comm).__name__}")
    return comm.Get_rank(), comm.Get_size()


def wait_for(requests: list[Any]) -> None:
    """MPI.Request.Waitall(requests), polled. Waitall blocks inside C, where Python cannot deliver Ctrl-C:
    a rank waiting for a neighbour that is gone would wait forever. Between two polls it lands."""
    MPI = load_mpi()
    while not MPI.Request.Testall(requests):
        time.sleep(0)  # give the core away for a moment: ranks may outnumber the cores


def pass_on(comm: Any, send_buf: np.ndarray, recv_buf: np.ndarray, tag: int) -> list[Any]:
    """Start sending send_buf to the right neighbour and receiving the next block from the left one into
    recv_buf, without waiting: the two requests to wait for (wait_for)."""
    MPI = load_mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    return [
        comm.Irecv([recv_buf.view(np.uint8), MPI.BYTE], source=(rank - 1) % size, tag=tag),
        comm.Isend([send_buf.view(np.uint8), MPI.BYTE], dest=(rank + 1) % size, tag=tag),
    ]


def pack_block(k: np.ndarray, v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """k and v in one flat buffer, so that a block travels as one message."""
    return np.concatenate([k.ravel(), v.ravel()]).astype(dtype, copy=False)  # (k.size + v.size,)


def unpack_block(buf: np.ndarray, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Views of k_block and v_block inside a buffer made by pack_block."""
    n_k = int(np.prod(k_shape))
    return buf[:n_k].reshape(k_shape), buf[n_k:].reshape(v_shape)


def finish(results: list[Any]) -> Any:
    """A scheme's results: one alone, several as a tuple."""
    return results[0] if len(results) == 1 else tuple(results)


# ---------------------------------------------------------------------------------------------------
# when a rank fails


@contextmanager
def abort_on_failure(comm: Any, what: str) -> Iterator[None]:
    """Any exception inside, Ctrl-C and MemoryError included, ends the whole job: it is printed with this
    rank's number, then MPI_Abort ends every process (exit status 130 for Ctrl-C, else 1).

    Why: once ranks exchange messages, one that raises alone leaves the others waiting for it forever, and
    MPI cannot call back a half-finished exchange (mpi4py's documentation, mpi4py.run: "the interplay of
    automatic MPI finalization and unhandled exceptions may lead to deadlocks"). A communicator of one rank
    has nobody waiting on it: there the exception is raised as usual.
    """
    try:
        yield
    except BaseException as err:
        rank, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            raise
        interrupted = isinstance(err, KeyboardInterrupt)
        sys.stdout.flush()  # what the program printed before: MPI_Abort ends the process without flushing
        cause = "interrupted (Ctrl-C)" if interrupted else f"failed: {type(err).__name__}: {err}"
        sys.stderr.write(
            f"rank {rank} of {size}: {what} {cause}; MPI_Abort ends the whole job (the other ranks "
            "would wait for this one forever)\n"
        )
        if not interrupted:
            traceback.print_exception(err, file=sys.stderr)
        sys.stderr.flush()
        time.sleep(PRINT_SECONDS)  # MPI_Abort ends every process at once: what is still in mpiexec's pipes is lost
        status = 130 if interrupted else 1
        comm.Abort(status)
        os._exit(status)  # MPICH's MPI_Abort may return while its launcher ends the job: end this process now


# ---------------------------------------------------------------------------------------------------
# the inputs, checked on every rank and agreed on


class Failed(NamedTuple):
    """A rank's check that raised: the exception's type name and message, to be raised on every rank."""

    kind: str
    message: str

    def error(self, rank: int, size: int) -> Exception:
        """The same error on every rank, naming the rank whose check failed: a TypeError stays a TypeError,
        anything else (a MemoryError in the check, say) becomes a ValueError that names it."""
        detail = self.message if self.kind in ("TypeError", "ValueError") else f"{self.kind}: {self.message}"
        return (TypeError if self.kind == "TypeError" else ValueError)(f"rank {rank} of {size}: {detail}")


def check_on_every_rank(comm: Any, check: Callable[[], tuple[Any, Any]], what: str) -> tuple[Any, list[Any]]:
    """Run this rank's check, which returns (what it checked, its report), and gather every rank's report.
    A check that raised on any rank is raised on every rank alike, so no rank is left waiting for another.
    Returns this rank's checked values and every rank's report, in rank order."""
    checked = None
    with abort_on_failure(comm, what):  # a Ctrl-C in the check is no Exception: it ends the job
        try:
            checked, report = check()
        except Exception as err:
            report = Failed(type(err).__name__, str(err))
        if comm.Get_size() > 1:
            wait_for([comm.Ibarrier()])  # every rank has come: a Ctrl-C lands while this one waits for the others
        reports = comm.allgather(report)
    for rank, report in enumerate(reports):
        if isinstance(report, Failed):
            raise report.error(rank, len(reports))
    return checked, reports


def agreed_inputs(comm: Any, check: Callable[[], tuple[Any, Report]], what: str) -> Any:
    """A scheme's first step: comm checked (check_comm), this rank's inputs checked (check: check_forward or
    check_backward, bound to them) and compared with every other rank's (check_on_every_rank, agree).
    Returns this rank's checked values; any rank's bad input raises the same error on every rank.

    A comm that is no communicator (None, say) is bad input like any other: that rank cannot reach the others
    through it, so it reports its TypeError through MPI.COMM_WORLD, the communicator the others pass when
    they pass the usual one, and every rank raises it."""
    try:
        check_comm(comm)
    except TypeError as err:
        comm, check = load_mpi().COMM_WORLD, _raises(err)
    checked, reports = check_on_every_rank(comm, check, what)
    agree(reports)
    return checked


def _raises(err: Exception) -> Callable[[], tuple[Any, Report]]:
    """A check that raises err: this rank's report of an input it could not even check."""

    def check() -> tuple[Any, Report]:
        raise err

    return check


class Report(NamedTuple):
    """What one rank checked about its own inputs; every rank must report the same."""

    shapes: tuple[tuple[int, ...], ...]  # q, k, v (and out, dout, lse for a backward)
    dtypes: tuple[str, ...]
    settings: tuple[Any, ...]  # causal, layout, scale, block_q, block_k

    @staticmethod
    def of(arrays: tuple[np.ndarray, ...], settings: Settings) -> Report:
        agreed = (settings.causal, settings.layout, settings.scale, settings.block_q, settings.block_k)
        return Report(tuple(a.shape for a in arrays), tuple(str(a.dtype) for a in arrays), agreed)


def agree(reports: list[Report]) -> None:
    """Raise the same ValueError on every rank when the ranks' checked inputs disagree: every rank holds
    the same reports (comm.allgather), so every rank raises, or none does."""
    tokens = [r.shapes[0][-2] for r in reports]
    if len(set(tokens)) > 1:
        raise ValueError(
            f"the ranks hold shards of unequal length: tokens per rank {tokens}; "
            "every rank must hold T/size tokens (shard() splits a sequence so)"
        )
    for what, values in (
        ("shapes", [r.shapes for r in reports]),
        ("dtypes", [r.dtypes for r in reports]),
        ("settings (causal, layout, scale, block_q, block_k)", [r.settings for r in reports]),
    ):
        differ = [rank for rank, value in enumerate(values) if value != values[0]]
        if differ:
            raise ValueError(
                f"the ranks disagree on their {what}: rank 0 has {values[0]}, rank {differ[0]} has "
                f"{values[differ[0]]}; every rank must pass the same shapes and arguments"
            )


class Settings(NamedTuple):
    """The keyword arguments every scheme takes: as the caller gave them, then checked (check_settings: bools,
    a layout name, ints; check_shards: the scale). causal, layout, scale, block_q and block_k must agree between
    the ranks (Report); workers and the return_ flags may differ."""

    causal: Any
    layout: Any
    scale: Any
    block_q: Any
    block_k: Any
    workers: Any
    return_lse: Any = False
    return_stats: Any = False


def check_settings(settings: Settings) -> Settings:
    """settings with every field checked (the scale comes later: check_shards)."""
    return settings._replace(
        causal=check_bool(settings.causal, "causal"),
        layout=check_layout(settings.layout),
        return_lse=check_bool(settings.return_lse, "return_lse"),
        return_stats=check_bool(settings.return_stats, "return_stats"),
        block_q=check_positive_int(settings.block_q, "block_q", default=TILE_SIDE),
        block_k=check_positive_int(settings.block_k, "block_k", default=TILE_SIDE),
        workers=check_positive_int(settings.workers, "workers"),
    )


def check_shards(
    q: Any, k: Any, v: Any, settings: Settings
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape, Settings]:
    """This rank's q, k, v shards against the contract, and settings with the scale checked:
    -> (q, k, v, dims, settings). Raises ValueError or TypeError naming what is wrong."""
    if np.ndim(q) < 3 or np.ndim(k) < 3 or np.ndim(v) < 3:
        raise ValueError(
            f"q, k and v must be shards with a head axis, (..., H, T/size, E); got shapes "
            f"{np.shape(q)}, {np.shape(k)}, {np.shape(v)}"
        )
    q, k, v, dims = check_qkv(q, k, v)
    if dims.n_q != dims.n_k:
        raise ValueError(
            f"q and k must hold the same tokens (the ring is self-attention over one sequence); got "
            f"{dims.n_q} queries (q {q.shape}) and {dims.n_k} keys (k {k.shape})"
        )
    if settings.layout == "zigzag" and dims.n_q % 2:
        raise ValueError(
            f"a zigzag shard is two equal chunks, so its token count must be even; got {dims.n_q} (q {q.shape}): "
            "the whole sequence must be a multiple of 2·size (shard() checks this)"
        )
    scale = check_scale(settings.scale, dims.e, compute_dtype(q, k, v))
    return q, k, v, dims, settings._replace(scale=scale)


def check_forward(q: Any, k: Any, v: Any, settings: Settings) -> tuple[Any, Report]:
    """A forward's inputs on this rank: ((q, k, v, dims, settings), its report)."""
    q, k, v, dims, settings = check_shards(q, k, v, check_settings(settings))
    return (q, k, v, dims, settings), Report.of((q, k, v), settings)


def check_backward(q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, settings: Settings) -> tuple[Any, Report]:
    """A backward's inputs on this rank, out, dout and lse against q's shape:
    ((q, k, v, out, dout, lse, dims, settings), its report)."""
    q, k, v, dims, settings = check_shards(q, k, v, check_settings(settings))
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    out = check_like(out, "out", out_shape, "(..., Hq, T/size, Ev)")
    dout = check_like(dout, "dout", out_shape, "out's (..., Hq, T/size, Ev)")
    lse = check_like(lse, "lse", out_shape[:-1], "(..., Hq, T/size)")
    return (q, k, v, out, dout, lse, dims, settings), Report.of((q, k, v, out, dout, lse), settings)
