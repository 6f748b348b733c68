"""Ring attention: the sequence split over processes, the keys and values passed round a ring, forward and
backward.

Rank r of P holds T/P of the tokens: its queries q_r, keys k_r and values v_r, shape (..., H, T/P, E).
Attention over the whole sequence needs every key, but never all of them at once, because a softmax
over two disjoint key blocks A and B merges exactly from the two parts (softmax.merge_states):

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) · out_A + exp(lse_B - lse) · out_B

So the K/V blocks travel. At step t = 0 .. P-1 rank r holds the block of source_rank = (r - t) mod P,
attends to it with flash_attention, merges the part into its running (out, lse), and meanwhile passes
the block on to rank r + 1 while the next one arrives from rank r - 1 (non-blocking send and receive
into a second buffer: double buffering). After P steps every query has seen every key, and a rank has
held only its own shard and two blocks: memory per rank is O(T/P). (Liu, Zaharia & Abbeel 2023,
"Ring Attention with Blockwise Transformers for Near-Infinite Context".)

The causal mask and the balance. Number the sequence's chunks by position. For a pair (query chunk a
held here, key chunk b that arrived):

    b < a   full:      every query sees every key
    b == a  diagonal:  the causal triangle, flash_attention(causal=True)
    b > a   hidden:    every key lies in every query's future; skipped, nothing computed

With the plain split ("contiguous": rank r holds chunk r of P) the last rank sees every chunk and the
first only its own triangle, so the last does about 2 - 1/P times the mean work and the others wait.
The "zigzag" split cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r, one early
and one late: every rank then has exactly 2P-1 full and 2 diagonal pairs, the same work (Brandon
et al. 2023, "Striped Attention", for the imbalance; the zigzag layout is the one Llama 3's context
parallelism uses, Dubey et al. 2024, "The Llama 3 Herd of Models").

Without a causal mask every pair is full and the layout only decides which tokens a rank holds.

The backward (ring_attention_backward) goes round the same ring. Each rank keeps its queries and their
gradient dq; the K/V blocks travel as in the forward, and beside each block travels its gradient
accumulator (dK, dV), one step behind it: a rank adds its share of the block's gradient and passes the
accumulator on, and after P steps it arrives home, holding every rank's share. Per pair of chunks the
work is FlashAttention-2's backward with the forward's global lse, whose P = exp(S − lse) are the
weights over the whole sequence restricted to the pair's keys, so the gradients of the pairs simply add
up. (Ring-flash-attention's scheme, github.com/zhuzilin/ring-flash-attention; here a rank keeps its share
of its own block at home instead of sending it round, one message fewer.)

When something fails. Inputs are checked on every rank and compared (an allgather) before any block
moves: bad input on one rank is raised on every rank alike, as a ValueError or TypeError naming the rank.
Once the blocks move, a rank that raised alone (an error inside the compute, a MemoryError, Ctrl-C)
would leave the others waiting for its next message forever, and MPI cannot call back a half-finished
exchange. So any exception inside the ring, on any rank, is printed with its rank and ends the whole job
with MPI_Abort (exit status 130 for Ctrl-C, else 1), as `python -m mpi4py` does for an unhandled one.
The waits poll (MPI.Request.Testall), so that Ctrl-C lands in them too: MPI_Waitall would block inside
C, where Python cannot deliver it. A communicator of one rank has nobody waiting: it raises as usual.
A program that would rather finish its step on every rank and keep what it has (a training loop) runs
inside StopTogether, which notes Ctrl-C instead of raising it, and asks at the end of each step.
One mistake cannot be seen: a rank that passes another communicator (MPI.COMM_SELF where the others pass
MPI.COMM_WORLD) runs a ring of its own, and the others wait in the input check for a rank that never
comes; that job ends only by Ctrl-C (which ends it promptly) or its time limit.

mpi4py is imported only when a ring runs: shard, unshard and the tile counts are plain NumPy.
Install the MPI pieces with `pip install -e ".[distributed]"` and run with `mpiexec -n 4 python ...`.
DeepSpeed-Ulysses, the other way to split a sequence over processes, lives beside this file (ulysses.py);
its functions can be imported from here too.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._checks import (
    QKVShape,
    check_bool,
    check_count,
    check_positive_int,
    check_qkv,
    check_scale,
    compute_dtype,
    result_dtype,
)
from ._parallel import one_blas_thread, run_items
from .backward import BackwardPlan, OrderedDq, check_like, check_weights_sum_to_one, key_block_grads
from .flash import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    DIAGONAL,
    FULL,
    Band,
    FlashPlan,
    TileMods,
    flash_forward,
    flash_plan,
)
from .softmax import merge_states

Array = NDArray[np.floating]

LAYOUTS = ("zigzag", "contiguous")
HIDDEN = "hidden"  # a chunk pair whose keys all lie in its queries' future; FULL and DIAGONAL as flash's tiles
INSTALL_HINT = 'pip install -e ".[distributed]"  (mpi4py and the mpich wheel, which brings mpiexec)'
PRINT_SECONDS = 0.25  # how long a failing rank lets mpiexec pass on its message before MPI_Abort


# ---------------------------------------------------------------------------------------------------
# the layouts: which chunks of the sequence each rank holds


def check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(name) for name in LAYOUTS)}; got {layout!r}")
    return str(layout)


def n_chunks(size: int, layout: str = "zigzag") -> int:
    """How many equal chunks the layout cuts the sequence into: 2·size for zigzag, size for contiguous."""
    size = check_positive_int(size, "size")
    return 2 * size if check_layout(layout) == "zigzag" else size


def chunks_of(rank: int, size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunk numbers rank holds, in the order it stores them: (r, 2·size-1-r) for zigzag, (r,) for
    contiguous. Rank 1 of 4 under zigzag holds chunks 1 and 6 of 0..7."""
    size = check_positive_int(size, "size")
    rank = check_count(rank, "rank")
    if rank >= size:
        raise ValueError(f"rank must lie in [0, size) = [0, {size}); got {rank}")
    return (rank, 2 * size - 1 - rank) if check_layout(layout) == "zigzag" else (rank,)


def _split_tokens(x: Any, name: str, pieces: int, what: str) -> np.ndarray:
    """x as an array of at least 2 dims whose token axis -2 splits into `pieces` equal chunks."""
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., tokens, E); got shape {x.shape}")
    if x.shape[-2] % pieces:
        raise ValueError(
            f"{name} has {x.shape[-2]} tokens (shape {x.shape}), which {what} cannot split into {pieces} "
            f"equal chunks; use a multiple of {pieces} tokens"
        )
    return x


def shard(x: Any, rank: int, size: int, *, layout: str = "zigzag") -> np.ndarray:
    """The part of x (..., T, E) that rank holds, along the token axis -2: (..., T/size, E), a new array.

    zigzag: chunks r and 2·size-1-r of 2·size equal chunks, in that order (T must divide by 2·size);
    contiguous: chunk r of size equal chunks (T must divide by size).
    """
    held = chunks_of(rank, size, layout)
    pieces = n_chunks(size, layout)
    x = _split_tokens(x, "x", pieces, f"layout={layout!r} with size={size}")
    c = x.shape[-2] // pieces  # tokens per chunk
    return np.concatenate([x[..., i * c : (i + 1) * c, :] for i in held], axis=-2)  # (..., T/size, E)


def unshard(parts: Any, *, layout: str = "zigzag") -> np.ndarray:
    """The inverse of shard: every rank's part, in rank order, put back into (..., T, E)."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts must be a non-empty list of every rank's array, in rank order; got {parts!r:.80}")
    size = len(parts)
    per_rank = n_chunks(size, layout) // size  # chunks each rank holds: 2 (zigzag) or 1
    arrays = [_split_tokens(p, f"parts[{r}]", per_rank, f"layout={layout!r}") for r, p in enumerate(parts)]
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"parts must all have one shape (equal shards); got {[a.shape for a in arrays]}")
    c = arrays[0].shape[-2] // per_rank  # tokens per chunk
    chunks: dict[int, np.ndarray] = {}
    for rank, part in enumerate(arrays):
        for i, chunk in enumerate(chunks_of(rank, size, layout)):
            chunks[chunk] = part[..., i * c : (i + 1) * c, :]  # (..., c, E)
    return np.concatenate([chunks[i] for i in sorted(chunks)], axis=-2)  # (..., T, E)


# ---------------------------------------------------------------------------------------------------
# the schedule: which pairs of chunks meet at each step, and how many tiles they cost


class Pair(NamedTuple):
    """One (local query chunk, arriving key chunk) meeting. q_part / k_part index the chunk within its
    shard (0 or 1 under zigzag); q_chunk / k_chunk are its position in the sequence; kind is full,
    diagonal or hidden. Without a causal mask the whole shard is one part (q_part = k_part = 0)."""

    q_part: int
    k_part: int
    q_chunk: int
    k_chunk: int
    kind: str


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """full when every query of chunk q_chunk sees every key of chunk k_chunk, diagonal when they are the
    same chunk under a causal mask (the triangle), hidden when the keys all lie in the queries' future."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else HIDDEN


def ring_pairs(rank: int, source_rank: int, size: int, *, layout: str = "zigzag", causal: bool = False) -> list[Pair]:
    """The pairs that meet on `rank` while it holds the K/V block of `source_rank`, hidden ones included."""
    causal = check_bool(causal, "causal")
    q_chunks, k_chunks = chunks_of(rank, size, layout), chunks_of(source_rank, size, layout)
    if not causal:  # every key visible: one pair, the whole shard against the whole block
        return [Pair(0, 0, q_chunks[0], k_chunks[0], FULL)]
    return [
        Pair(a, b, q_chunk, k_chunk, pair_kind(q_chunk, k_chunk, causal))
        for a, q_chunk in enumerate(q_chunks)
        for b, k_chunk in enumerate(k_chunks)
    ]


def pair_tiles(pair: Pair, part_tokens: int, block_q: int, block_k: int) -> int:
    """flash_attention's tiles for one pair of part_tokens x part_tokens: tile_plan counts them exactly."""
    if pair.kind == HIDDEN:
        return 0
    return square_tiles(part_tokens, block_q, block_k, pair.kind == DIAGONAL)


@functools.lru_cache(maxsize=64)
def square_tiles(tokens: int, block_q: int, block_k: int, causal: bool) -> int:
    """len(tile_plan(tokens, tokens, block_q, block_k, causal=causal)), counted row block by row block
    without making the tiles, and remembered: a ring asks for the same few sizes at every step."""
    band = Band(0 if causal else None)
    return sum(band.row_length(q, min(q + block_q, tokens), tokens, block_k) for q in range(0, tokens, block_q))


def tile_counts(
    tokens: int,
    size: int,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
) -> list[dict[str, int]]:
    """Per rank, without running anything: tiles computed, and the chunk pairs that are full, diagonal and
    hidden, for a sequence of `tokens` on `size` ranks. ring_attention counts the same as it runs.

    Under causal, zigzag gives every rank 2·size-1 full and 2 diagonal pairs; contiguous gives rank r
    r full pairs and 1 diagonal, so the busiest rank does about 2 - 1/size times the mean.
    """
    tokens = check_count(tokens, "tokens")
    size = check_positive_int(size, "size")
    block_q = check_positive_int(block_q, "block_q", default=DEFAULT_BLOCK_Q)
    block_k = check_positive_int(block_k, "block_k", default=DEFAULT_BLOCK_K)
    causal = check_bool(causal, "causal")
    pieces = n_chunks(size, layout)
    if tokens % pieces:
        raise ValueError(f"tokens={tokens} cannot be split into {pieces} equal chunks ({layout}, size={size})")
    part_tokens = tokens // pieces if causal else tokens // size  # a pair is chunk x chunk, or shard x shard
    counts = []
    for rank in range(size):
        row = {"rank": rank, "tiles": 0, FULL: 0, DIAGONAL: 0, HIDDEN: 0}
        for source_rank in range(size):
            for pair in ring_pairs(rank, source_rank, size, layout=layout, causal=causal):
                row[pair.kind] += 1
                row["tiles"] += pair_tiles(pair, part_tokens, block_q, block_k)
        counts.append(row)
    return counts


# ---------------------------------------------------------------------------------------------------
# what a ring did


@dataclass
class StepStats:
    """What one ring step did on one rank: whose block it held, the work and the messages."""

    step: int
    source_rank: int
    tiles: int
    pairs: dict[str, int]
    bytes_sent: int
    bytes_received: int
    compute_seconds: float
    wait_seconds: float


@dataclass
class RingStats:
    """What ring_attention (or its backward) did on this rank (return_stats=True): a record per step, and the
    totals."""

    rank: int
    size: int
    layout: str
    causal: bool
    tokens: int
    chunks: tuple[int, ...]
    steps: list[StepStats] = field(default_factory=list)

    @property
    def tiles(self) -> int:
        return sum(s.tiles for s in self.steps)

    @property
    def pairs(self) -> dict[str, int]:
        return {kind: sum(s.pairs[kind] for s in self.steps) for kind in (FULL, DIAGONAL, HIDDEN)}

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.steps)

    @property
    def bytes_received(self) -> int:
        return sum(s.bytes_received for s in self.steps)

    @property
    def wait_seconds(self) -> float:
        return sum(s.wait_seconds for s in self.steps)

    @property
    def compute_seconds(self) -> float:
        return sum(s.compute_seconds for s in self.steps)


def step_stats(
    step: int, source_rank: int, tiles: int, pairs: list[Pair], passed: int, compute: float, wait: float
) -> StepStats:
    """The record of one ring step: whose block, the work done, the bytes passed (sent and received)."""
    kinds = {kind: sum(p.kind == kind for p in pairs) for kind in (FULL, DIAGONAL, HIDDEN)}
    return StepStats(step, source_rank, tiles, kinds, passed, passed, compute, wait)


# ---------------------------------------------------------------------------------------------------
# the processes: MPI, and what happens when one of them fails


def load_mpi() -> Any:
    """The mpi4py.MPI module, or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(f"ring attention needs mpi4py and an MPI library: {INSTALL_HINT}") from err
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
        sys.stderr.write(f"rank {rank} of {size}: {what} {cause}; MPI_Abort ends the whole job (the other ranks "
                         "would wait for this one forever)\n")  # fmt: skip
        if not interrupted:
            traceback.print_exception(err, file=sys.stderr)
        sys.stderr.flush()
        time.sleep(PRINT_SECONDS)  # MPI_Abort ends every process at once: what is still in mpiexec's pipes is lost
        status = 130 if interrupted else 1
        comm.Abort(status)
        os._exit(status)  # MPICH's MPI_Abort may return while its launcher ends the job: end this process now


class StopTogether:
    """Ctrl-C in a program that loops over ring calls (a training loop), without ending the job: inside
    `with StopTogether() as ctrl_c:`, Ctrl-C is noted instead of raised, so that no rank stops in the middle
    of a ring (which ends the job, abort_on_failure) or of a collective call. ctrl_c.stop(comm), called by
    every rank at the same point (between two steps), tells every rank whether any rank has seen one, so
    that all of them stop after the same step and the program can keep what it has. It must be entered from
    the main thread (Python runs signal handlers there); a second Ctrl-C still reaches mpiexec, which then
    ends the job itself."""

    def __enter__(self) -> StopTogether:
        self.pressed = False
        self.previous = signal.signal(signal.SIGINT, self.press)
        return self

    def press(self, signum: int, frame: Any) -> None:
        self.pressed = True

    def stop(self, comm: Any) -> bool:
        """Whether any rank of comm saw Ctrl-C (a collective call: every rank must make it)."""
        return bool(comm.allreduce(self.pressed, op=load_mpi().LOR))

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


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


def pass_on(comm: Any, send_buf: np.ndarray, recv_buf: np.ndarray, tag: int) -> list[Any]:
    """Start sending send_buf to the right neighbour and receiving the next block from the left one into
    recv_buf, without waiting: the two requests to wait for (wait_for)."""
    MPI = load_mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    return [
        comm.Irecv([recv_buf.view(np.uint8), MPI.BYTE], source=(rank - 1) % size, tag=tag),
        comm.Isend([send_buf.view(np.uint8), MPI.BYTE], dest=(rank + 1) % size, tag=tag),
    ]


# ---------------------------------------------------------------------------------------------------
# the inputs, checked on every rank


class Report(NamedTuple):
    """What one rank checked about its own inputs; every rank must report the same."""

    shapes: tuple[tuple[int, ...], ...]  # q, k, v (and out, dout, lse for a backward)
    dtypes: tuple[str, ...]
    settings: tuple[Any, ...]  # causal, layout, scale, block_q, block_k

    @staticmethod
    def of(arrays: tuple[np.ndarray, ...], settings: dict[str, Any]) -> Report:
        agreed = tuple(settings[name] for name in ("causal", "layout", "scale", "block_q", "block_k"))
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


def check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments every scheme takes, checked (the scale comes later: it needs E and the dtype).
    workers and the return_ flags may differ between ranks; the rest must agree (Report)."""
    checked = dict(settings)
    checked["causal"] = check_bool(settings["causal"], "causal")
    checked["layout"] = check_layout(settings["layout"])
    for flag in ("return_lse", "return_stats"):
        if flag in settings:
            checked[flag] = check_bool(settings[flag], flag)
    checked["block_q"] = check_positive_int(settings["block_q"], "block_q", default=DEFAULT_BLOCK_Q)
    checked["block_k"] = check_positive_int(settings["block_k"], "block_k", default=DEFAULT_BLOCK_K)
    checked["workers"] = check_positive_int(settings["workers"], "workers")
    return checked


def check_shards(
    q: Any, k: Any, v: Any, settings: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, QKVShape]:
    """This rank's q, k, v shards against the contract, with the scale checked into settings:
    -> (q, k, v, dims). Raises ValueError or TypeError naming what is wrong."""
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
    if settings["layout"] == "zigzag" and dims.n_q % 2:
        raise ValueError(
            f"a zigzag shard is two equal chunks, so its token count must be even; got {dims.n_q} (q {q.shape}): "
            "the whole sequence must be a multiple of 2·size (shard() checks this)"
        )
    settings["scale"] = check_scale(settings["scale"], dims.e, compute_dtype(q, k, v))
    return q, k, v, dims


def check_forward(q: Any, k: Any, v: Any, settings: dict[str, Any]) -> tuple[Any, Report]:
    """A forward's inputs on this rank: ((q, k, v, dims, settings), its report)."""
    settings = check_settings(settings)
    q, k, v, dims = check_shards(q, k, v, settings)
    return (q, k, v, dims, settings), Report.of((q, k, v), settings)


def check_backward(
    q: Any, k: Any, v: Any, out: Any, dout: Any, lse: Any, settings: dict[str, Any]
) -> tuple[Any, Report]:
    """A backward's inputs on this rank, out, dout and lse against q's shape:
    ((q, k, v, out, dout, lse, dims, settings), its report)."""
    settings = check_settings(settings)
    q, k, v, dims = check_shards(q, k, v, settings)
    out_shape = (*dims.batch, dims.hq, dims.n_q, dims.ev)
    out = check_like(out, "out", out_shape, "(..., Hq, T/size, Ev)")
    dout = check_like(dout, "dout", out_shape, "out's (..., Hq, T/size, Ev)")
    lse = check_like(lse, "lse", out_shape[:-1], "(..., Hq, T/size)")
    return (q, k, v, out, dout, lse, dims, settings), Report.of((q, k, v, out, dout, lse), settings)


def _pack(k: np.ndarray, v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """k and v in one flat buffer, so that a block travels as one message."""
    return np.concatenate([k.ravel(), v.ravel()]).astype(dtype, copy=False)  # (k.size + v.size,)


def _unpack(buf: np.ndarray, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Views of k_block and v_block inside a buffer made by _pack."""
    n_k = int(np.prod(k_shape))
    return buf[:n_k].reshape(k_shape), buf[n_k:].reshape(v_shape)


def finish(results: list[Any]) -> Any:
    """One result alone, several as a tuple."""
    return results[0] if len(results) == 1 else tuple(results)


# ---------------------------------------------------------------------------------------------------
# the forward


def ring_step(
    q: np.ndarray, k_block: np.ndarray, v_block: np.ndarray, out: np.ndarray, lse: np.ndarray, pairs: list[Pair],
    part: int, plan: FlashPlan,
) -> int:  # fmt: skip
    """One step of the ring: this rank's queries q (..., Hq, T/P, E) attend to the block that has arrived,
    k_block (..., Hkv, T/P, E), v_block (..., Hkv, T/P, Ev), and fold the result into the running out
    (..., Hq, T/P, Ev) and lse (..., Hq, T/P). Returns the tiles computed.

    For each pair of chunks (pairs: ring_pairs, `part` tokens a side), the three cases of the module doc:
        hidden      skip: every key lies in every query's future
        full        out_p, lse_p = flash attention of the pair, no mask
        diagonal    out_p, lse_p = flash attention of the pair, causal (the chunk against itself)
        then        out, lse = merge_states(out, lse, out_p, lse_p) over the pair's rows
    """
    tiles = 0
    for pair in pairs:
        if pair.kind == HIDDEN:
            continue
        rows = slice(pair.q_part * part, (pair.q_part + 1) * part)  # this pair's queries within the shard
        keys = slice(pair.k_part * part, (pair.k_part + 1) * part)  # and its keys within the block
        q_p, k_p, v_p = q[..., rows, :], k_block[..., keys, :], v_block[..., keys, :]
        dims = QKVShape(q.shape[:-3], q.shape[-3], k_p.shape[-3], part, part, q.shape[-1], v_p.shape[-1])  # a pair
        band = Band(0 if pair.kind == DIAGONAL else None)  # the chunk against itself: L == S, offset 0
        part_out, part_lse = flash_forward(
            q_p, k_p, v_p, dims, plan._replace(band=band)
        )  # (..., part, Ev), (..., part)
        out[..., rows, :], lse[..., rows] = merge_states(out[..., rows, :], lse[..., rows], part_out, part_lse)
        tiles += pair_tiles(pair, part, plan.block_q, plan.block_k)
    return tiles


def ring_attention(
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
    """Attention over a sequence sharded across the ranks of comm, each rank passing its own shard.

    q (..., Hq, T/P, E), k (..., Hkv, T/P, E), v (..., Hkv, T/P, Ev): this rank's shard, made by
    shard(x, rank, P, layout=layout) -> out (..., Hq, T/P, Ev), this rank's rows of
    attention(q_all, k_all, v_all, causal=causal); with return_lse=True also lse (..., Hq, T/P).
    causal=True is the usual decoder mask over the whole sequence (L == S, so both alignments agree).
    GQA as in flash_attention: query head h reads kv head h // (Hq // Hkv); only the Hkv heads travel.
    comm: an mpi4py communicator (MPI.COMM_WORLD; MPI.COMM_SELF is plain flash attention).
    workers: flash_attention's threads per rank; keep 1 when there is one rank per core.
    return_stats=True appends a RingStats: tiles, messages, bytes and waiting time of every step.
    float16 is computed in float32 and out cast back (lse stays float32, as flash_attention's); the K/V
    blocks travel in their own dtype.
    Failures (the module doc): bad input on any rank is raised on every rank, before any block moves; any
    exception after that (Ctrl-C too) is printed with its rank and ends the job (MPI_Abort). A rank that
    passes another communicator than the others cannot be told from a slow one: the others wait for it.
    """
    check_comm(comm)
    settings = {"causal": causal, "layout": layout, "scale": scale, "block_q": block_q, "block_k": block_k,
                "return_lse": return_lse, "return_stats": return_stats, "workers": workers}  # fmt: skip
    # 1) every rank's inputs checked and compared
    checked, reports = check_on_every_rank(comm, partial(check_forward, q, k, v, settings), "ring_attention's check")
    agree(reports)
    q, k, v, dims, settings = checked
    # 2) the ring; a failure on any rank from here on ends the job
    with abort_on_failure(comm, "ring_attention"):
        out, lse, stats = forward_ring(comm, q, k, v, dims, settings)
        results: list[Any] = [out.astype(result_dtype(q, k, v), copy=False)]
    if settings["return_lse"]:
        results.append(lse)  # in the compute dtype, as flash_attention's: float32 for float16 inputs
    if settings["return_stats"]:
        results.append(stats)
    return finish(results)


def forward_ring(
    comm: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, settings: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, RingStats]:
    """ring_attention's steps on checked inputs: out and lse in the compute dtype, and the record."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ct = compute_dtype(q, k, v)
    # 1) this rank's running state: no key seen yet (0, -inf)
    q_c = q.astype(ct, copy=False)  # (..., Hq, T/P, E)
    out = np.zeros((*dims.batch, dims.hq, dims.n_q, dims.ev), ct)  # (..., Hq, T/P, Ev)
    lse = np.full((*dims.batch, dims.hq, dims.n_q), -np.inf, ct)  # (..., Hq, T/P)
    held = chunks_of(rank, size, settings["layout"])
    part = dims.n_q // len(held) if settings["causal"] else dims.n_q  # tokens per pair side: a chunk, or the shard
    sizes = {name: settings[name] for name in ("block_q", "block_k", "workers")}
    plan = flash_plan(dims._replace(n_q=part, n_k=part), Band(None), settings["scale"], **sizes)  # band: per pair
    stats = RingStats(rank, size, settings["layout"], settings["causal"], dims.n_q, held)
    # 2) two buffers: send_buf is the block in hand (computed on while it goes to the right neighbour),
    #    recv_buf takes the next block from the left. K/V travel in their own dtype (float16 stays 2 bytes).
    send_buf = _pack(k, v, np.result_type(k, v))  # (B·Hkv·T/P·(E + Ev),): k_block and v_block, one message
    recv_buf = np.empty_like(send_buf)
    for step in range(size):
        source_rank = (rank - step) % size  # whose block is in send_buf now
        started = time.perf_counter()
        # 3) start passing the block on while we compute on it; the last block needs no passing
        requests = pass_on(comm, send_buf, recv_buf, step) if step < size - 1 else []
        k_block, v_block = (x.astype(ct, copy=False) for x in _unpack(send_buf, k.shape, v.shape))
        pairs = ring_pairs(rank, source_rank, size, layout=settings["layout"], causal=settings["causal"])
        tiles = ring_step(q_c, k_block, v_block, out, lse, pairs, part, plan)
        computed = time.perf_counter()
        # 4) wait for the next block to arrive (and ours to leave), then swap the two buffers
        wait_for(requests)
        stats.steps.append(step_stats(step, source_rank, tiles, pairs, send_buf.nbytes if requests else 0,
                                      computed - started, time.perf_counter() - computed))  # fmt: skip
        send_buf, recv_buf = recv_buf, send_buf
    return out, lse, stats


# ---------------------------------------------------------------------------------------------------
# the backward


class QuerySide(NamedTuple):
    """What a rank keeps through the backward's ring, one row block per (batch, query head), in the compute
    dtype: its queries' inputs, their gradient, and one step's share of the travelling block's gradient."""

    q_s: np.ndarray  # (B·Hq, T/P, E)   q times the scale
    d_o: np.ndarray  # (B·Hq, T/P, Ev)  dout
    d: np.ndarray  # (B·Hq, T/P)        D = rowsum(dO ∘ O), with the forward's out over the whole sequence
    lse: np.ndarray  # (B·Hq, T/P)      the forward's lse over the whole sequence; -inf made +inf: P = 0
    dq: np.ndarray  # (B·Hq, T/P, E)    dQ / scale, summed over the steps
    p_sums: np.ndarray  # (B·Hq, T/P)   the row sums of P over the steps: 1 where lse is the forward's
    dk_heads: np.ndarray  # (B·Hq, T/P, E)   one step's dK of the block, per query head (summed per kv head)
    dv_heads: np.ndarray  # (B·Hq, T/P, Ev)


def query_side(q: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray, dims: QKVShape, scale: float,
               ct: np.dtype) -> QuerySide:  # fmt: skip
    """The backward's per-rank state, made once: q scaled, D = rowsum(dO ∘ O), lse with +inf for -inf, and
    zeros to add into."""
    n_heads = int(np.prod(dims.batch, dtype=np.int64)) * dims.hq
    q_s = np.multiply(q.reshape(n_heads, dims.n_q, dims.e), scale, dtype=ct)  # (B·Hq, T/P, E)
    d_o = np.ascontiguousarray(dout.reshape(n_heads, dims.n_q, dims.ev), dtype=ct)  # (B·Hq, T/P, Ev)
    d = np.einsum("hle,hle->hl", d_o, out.reshape(n_heads, dims.n_q, dims.ev).astype(ct, copy=False))
    lse_c = lse.reshape(n_heads, dims.n_q).astype(ct)  # (B·Hq, T/P), a copy we may change
    lse_c[np.isneginf(lse_c)] = np.inf  # a row that saw no key: P = exp(S − inf) = 0, not NaN
    return QuerySide(q_s, d_o, d, lse_c, np.zeros_like(q_s), np.zeros((n_heads, dims.n_q), ct), np.zeros_like(q_s),
                     np.zeros_like(d_o))  # fmt: skip


def ring_backward_step(
    query: QuerySide, k_block: np.ndarray, v_block: np.ndarray, dk_block: np.ndarray, dv_block: np.ndarray,
    pairs: list[Pair], part: int, plan: BackwardPlan,
) -> int:  # fmt: skip
    """One step of the ring's backward: this rank's queries against the block that has arrived, k_block
    (B·Hkv, T/P, E), v_block (B·Hkv, T/P, Ev). Adds into query.dq and writes this rank's share of the
    block's gradient into dk_block, dv_block (same shapes), which travel on with the block. Returns the tiles.

    For each pair of chunks, the cases of ring_step, with the forward's lse over the whole sequence:
        hidden      skip: the forward gave these keys no weight
        full        FlashAttention-2's backward of the pair (Algorithm 2), no mask:
                    P = exp(S − lse);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − D_i);
                    dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
        diagonal    the same, causal (the chunk against itself)
    P are the forward's weights restricted to the pair's keys, so each gradient is a sum over the pairs.
    """
    query.dk_heads[...] = 0.0
    query.dv_heads[...] = 0.0
    tiles = 0
    for pair in pairs:
        if pair.kind == HIDDEN:
            continue
        band = Band(0 if pair.kind == DIAGONAL else None)  # the chunk against itself: L == S, offset 0
        pair_backward(query, k_block, v_block, pair, part, plan._replace(band=band))
        tiles += pair_tiles(pair, part, plan.block_q, plan.block_k)
    # a kv head's share is the sum over the G query heads that read it, in head order
    n_kv, group = k_block.shape[0], query.q_s.shape[0] // k_block.shape[0]
    dk_block[...] = query.dk_heads.reshape(n_kv, group, *k_block.shape[1:]).sum(axis=1)  # (B·Hkv, T/P, E)
    dv_block[...] = query.dv_heads.reshape(n_kv, group, *v_block.shape[1:]).sum(axis=1)  # (B·Hkv, T/P, Ev)
    return tiles


def pair_backward(
    query: QuerySide, k_block: np.ndarray, v_block: np.ndarray, pair: Pair, part: int, plan: BackwardPlan
) -> None:
    """Algorithm 2 over one pair of chunks, as flash_attention_backward runs it: every key block of every
    query head is a work item (backward.key_block_grads), the dq shares added in key-block order."""
    rows = slice(pair.q_part * part, (pair.q_part + 1) * part)  # this pair's queries within the shard
    keys = slice(pair.k_part * part, (pair.k_part + 1) * part)  # and its keys within the block
    n_heads, group = query.q_s.shape[0], query.q_s.shape[0] // k_block.shape[0]
    ordered_dq = OrderedDq(query.dq[:, rows], query.p_sums[:, rows], plan.band, part, plan.block_q, plan.block_k)

    def run(item: tuple[int, int]) -> None:
        k_start, h = item  # query head h reads kv head h // G
        cols = slice(k_start, min(k_start + plan.block_k, part))  # within the pair
        tiles = plan.band.column_tiles(cols.start, cols.stop, part, plan.block_q)
        mods = TileMods(plan.band.mask_mod, None, 0, 0)  # the causal band: the same for every batch entry and head
        key_block_grads(query.q_s[h, rows], k_block[h // group, keys], v_block[h // group, keys], query.d_o[h, rows],
                        query.lse[h, rows], query.d[h, rows], mods, tiles, partial(ordered_dq.add, h),
                        query.dk_heads[h, keys][cols], query.dv_heads[h, keys][cols])  # fmt: skip

    items = ((k_start, h) for k_start in range(0, part, plan.block_k) for h in range(n_heads))
    run_items(run, items, plan.workers, on_failure=ordered_dq.fail)


def ring_attention_backward(
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
    """The gradients of ring_attention(q, k, v, comm=comm, causal=causal, layout=layout, scale=scale), each
    rank passing its own shards.

    q (..., Hq, T/P, E), k (..., Hkv, T/P, E), v (..., Hkv, T/P, Ev): this rank's shards, as the forward got
    them; out (..., Hq, T/P, Ev) and lse (..., Hq, T/P) this rank's rows from ring_attention(...,
    return_lse=True); dout (..., Hq, T/P, Ev) = ∂loss/∂out for those rows -> dq, dk, dv shaped and typed
    like q, k, v: this rank's rows of flash_attention_backward over the whole sequence.
    Only the Hkv kv heads travel, with their gradients (GQA). The K/V blocks travel in their own dtype,
    the dK/dV accumulators in the compute dtype (float32 for float16: they are sums over every rank).
    The lse is checked as flash_attention_backward checks it: P's rows, summed over every rank's keys, must
    sum to 1, else every rank raises a ValueError (another mask, scale or input than the forward's).
    return_stats=True appends a RingStats; bytes per step count both the K/V block and the accumulator.
    Failures as in ring_attention: bad input raised on every rank, anything later ends the job (MPI_Abort).
    """
    check_comm(comm)
    settings = {"causal": causal, "layout": layout, "scale": scale, "block_q": block_q, "block_k": block_k,
                "return_stats": return_stats, "workers": workers}  # fmt: skip
    # 1) every rank's inputs checked and compared
    check = partial(check_backward, q, k, v, out, dout, lse, settings)
    checked, reports = check_on_every_rank(comm, check, "ring_attention_backward's check")
    agree(reports)
    q, k, v, out, dout, lse, dims, settings = checked
    # 2) the ring; a failure on any rank from here on ends the job
    with abort_on_failure(comm, "ring_attention_backward"):
        query, dk, dv, stats = backward_ring(comm, q, k, v, out, dout, lse, dims, settings)
    # 3) the forward's lse, checked on every rank's rows: all ranks raise, or none
    check_on_every_rank(comm, partial(check_lse, query), "ring_attention_backward's lse check")
    dq = (query.dq * settings["scale"]).reshape(q.shape).astype(q.dtype, copy=False)
    results = [dq, dk.reshape(k.shape).astype(k.dtype, copy=False), dv.reshape(v.shape).astype(v.dtype, copy=False)]
    if settings["return_stats"]:
        results.append(stats)
    return tuple(results)


def check_lse(query: QuerySide) -> tuple[None, None]:
    """P's rows, summed over the steps, against 1 (backward.check_weights_sum_to_one); nothing to report."""
    check_weights_sum_to_one(query.p_sums, query.lse)
    return None, None


def backward_ring(
    comm: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray,
    dims: QKVShape, settings: dict[str, Any],
) -> tuple[QuerySide, np.ndarray, np.ndarray, RingStats]:  # fmt: skip
    """ring_attention_backward's steps on checked inputs: the query side (dq inside), dk, dv, the record."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ct = compute_dtype(q, k, v, out, dout)
    held = chunks_of(rank, size, settings["layout"])
    part = dims.n_q // len(held) if settings["causal"] else dims.n_q  # tokens per pair side
    plan = BackwardPlan(settings["scale"], Band(None), settings["block_q"], settings["block_k"], settings["workers"])
    stats = RingStats(rank, size, settings["layout"], settings["causal"], dims.n_q, held)
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv
    kv_shapes = (n_kv, dims.n_k, dims.e), (n_kv, dims.n_k, dims.ev)  # a block, one row block per (batch, kv head)
    # 1) the query side, once; the K/V blocks' two buffers, as in the forward
    query = query_side(q, out, dout, lse, dims, settings["scale"], ct)
    send_buf = _pack(k, v, np.result_type(k, v))  # (B·Hkv·T/P·(E + Ev),)
    recv_buf = np.empty_like(send_buf)
    # 2) the gradient accumulators: this rank's share of its own block stays home; the accumulator of the
    #    block in hand is computed in `mine`, goes right from `in_flight`, and the next arrives in `arrived`
    home = np.empty(send_buf.size, ct)
    mine, in_flight, arrived = np.empty_like(home), np.empty_like(home), np.empty_like(home)
    grad_requests: list[Any] = []
    with one_blas_thread():
        for step in range(size):
            source_rank = (rank - step) % size
            started = time.perf_counter()
            # 3) pass the K/V block on while computing on it, as in the forward
            kv_requests = pass_on(comm, send_buf, recv_buf, 2 * step) if step < size - 1 else []
            k_block, v_block = (x.astype(ct, copy=False) for x in _unpack(send_buf, *kv_shapes))
            pairs = ring_pairs(rank, source_rank, size, layout=settings["layout"], causal=settings["causal"])
            share = home if step == 0 else mine
            tiles = ring_backward_step(query, k_block, v_block, *_unpack(share, *kv_shapes), pairs, part, plan)
            computed = time.perf_counter()
            # 4) the block's accumulator came from the left meanwhile (from step 2 on): add our share to it and
            #    pass it right, one rank nearer the block's home; then the K/V block, as in the forward
            wait_for(grad_requests)
            if step >= 2:
                mine += arrived
            grad_requests = pass_on(comm, mine, arrived, 2 * step + 1) if step >= 1 else []
            mine, in_flight = in_flight, mine
            wait_for(kv_requests)
            sent = (send_buf.nbytes if kv_requests else 0) + (home.nbytes if grad_requests else 0)
            stats.steps.append(step_stats(step, source_rank, tiles, pairs, sent, computed - started,
                                          time.perf_counter() - computed))  # fmt: skip
            send_buf, recv_buf = recv_buf, send_buf
        # 5) our own block's accumulator comes home with every other rank's share
        wait_for(grad_requests)
    if size > 1:
        home += arrived
    dk, dv = _unpack(home, *kv_shapes)
    return query, dk, dv, stats


def __getattr__(name: str) -> Any:
    """ulysses_attention and ulysses_attention_backward live in ulysses.py, beside the ring, which imports this
    module: they are found from here too (tinyattn_np.ring.ulysses_attention), imported when first asked for."""
    if name in ("ulysses_attention", "ulysses_attention_backward", "UlyssesStats"):
        from . import ulysses

        return getattr(ulysses, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
