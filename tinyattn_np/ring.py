"""Ring attention: the sequence split over processes, the keys and values passed round a ring.

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
and one late: every rank then has exactly 2P-1 full pairs and 2 diagonal pairs, the same work (Brandon
et al. 2023, "Striped Attention", for the imbalance; the zigzag layout is the one Llama 3's context
parallelism uses, Dubey et al. 2024, "The Llama 3 Herd of Models").

Without a causal mask every pair is full and the layout only decides which tokens a rank holds.

mpi4py is imported only when ring_attention runs: shard, unshard and the tile counts are plain NumPy.
Install the MPI pieces with `pip install -e ".[distributed]"` and run with `mpiexec -n 4 python ...`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
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
from .flash import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    DIAGONAL,
    FULL,
    Band,
    FlashPlan,
    flash_forward,
    flash_plan,
    tile_plan,
)
from .softmax import merge_states

Array = NDArray[np.floating]

LAYOUTS = ("zigzag", "contiguous")
HIDDEN = "hidden"  # a chunk pair whose keys all lie in its queries' future; FULL and DIAGONAL as flash's tiles
INSTALL_HINT = 'pip install -e ".[distributed]"  (mpi4py and the mpich wheel, which brings mpiexec)'


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
    return _planned_tiles(part_tokens, block_q, block_k, pair.kind == DIAGONAL)


@functools.lru_cache(maxsize=64)
def _planned_tiles(part_tokens: int, block_q: int, block_k: int, causal: bool) -> int:
    """len(tile_plan(...)), remembered: a ring asks for the same few sizes at every step."""
    return len(tile_plan(part_tokens, part_tokens, block_q, block_k, causal=causal))


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
# the ring


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
    """What ring_attention did on this rank (return_stats=True): a record per step, and the totals."""

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


def _mpi() -> Any:
    """The mpi4py.MPI module, or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(f"ring attention needs mpi4py and an MPI library: {INSTALL_HINT}") from err
    return MPI


class _Local(NamedTuple):
    """What one rank checked about its own inputs; every rank must report the same."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtypes: tuple[str, str, str]
    settings: tuple[Any, ...]  # causal, layout, scale, block_q, block_k


def _check_local(q: Any, k: Any, v: Any, settings: dict[str, Any]) -> _Local:
    """This rank's inputs against the contract; raises ValueError or TypeError naming what is wrong."""
    if np.ndim(q) < 3 or np.ndim(k) < 3 or np.ndim(v) < 3:
        raise ValueError(
            f"q, k and v must be shards with a head axis, (..., H, T/size, E); got shapes "
            f"{np.shape(q)}, {np.shape(k)}, {np.shape(v)}"
        )
    q, k, v, dims = check_qkv(q, k, v)
    layout = check_layout(settings["layout"])
    if dims.n_q != dims.n_k:
        raise ValueError(
            f"q and k must hold the same tokens (the ring is self-attention over one sequence); got "
            f"{dims.n_q} queries (q {q.shape}) and {dims.n_k} keys (k {k.shape})"
        )
    if layout == "zigzag" and dims.n_q % 2:
        raise ValueError(
            f"a zigzag shard is two equal chunks, so its token count must be even; got {dims.n_q} (q {q.shape}): "
            "the whole sequence must be a multiple of 2·size (shard() checks this)"
        )
    return _Local(q.shape, k.shape, v.shape, (str(q.dtype), str(k.dtype), str(v.dtype)), tuple(settings.values()))


def _agree(reports: list[Any]) -> None:
    """Raise the same error on every rank when any rank's inputs were bad or the ranks disagree.

    reports is what comm.allgather collected: per rank a _Local, or (error type name, message).
    Every rank holds the same list, so every rank raises (or not) together: no rank is left waiting.
    """
    for rank, report in enumerate(reports):
        if not isinstance(report, _Local):
            kind, message = report
            error = TypeError if kind == "TypeError" else ValueError
            detail = message if kind in ("TypeError", "ValueError") else f"{kind}: {message}"
            raise error(f"rank {rank} of {len(reports)}: {detail}")
    tokens = [r.q_shape[-2] for r in reports]
    if len(set(tokens)) > 1:
        raise ValueError(
            f"the ranks hold shards of unequal length: tokens per rank {tokens}; "
            "every rank must hold T/size tokens (shard() splits a sequence so)"
        )
    for what, values in (
        ("shapes (q, k, v)", [(r.q_shape, r.k_shape, r.v_shape) for r in reports]),
        ("dtypes (q, k, v)", [r.dtypes for r in reports]),
        ("settings (causal, layout, scale, block_q, block_k)", [r.settings for r in reports]),
    ):
        differ = [rank for rank, value in enumerate(values) if value != values[0]]
        if differ:
            raise ValueError(
                f"the ranks disagree on their {what}: rank 0 has {values[0]}, rank {differ[0]} has "
                f"{values[differ[0]]}; every rank must pass the same shapes and arguments"
            )


def _pack(k: np.ndarray, v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """k and v in one flat buffer, so that a block travels as one message."""
    return np.concatenate([k.ravel(), v.ravel()]).astype(dtype, copy=False)  # (k.size + v.size,)


def _unpack(buf: np.ndarray, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Views of k_block and v_block inside a buffer made by _pack."""
    n_k = int(np.prod(k_shape))
    return buf[:n_k].reshape(k_shape), buf[n_k:].reshape(v_shape)


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


def check_ring(q: Any, k: Any, v: Any, comm: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Check this rank's inputs, then compare every rank's (comm.allgather): one bad rank makes every rank
    raise the same error, so no rank is left waiting for another. Returns the checked settings."""
    workers = 1
    try:
        settings["causal"] = check_bool(settings["causal"], "causal")
        for flag in ("return_lse", "return_stats"):
            check_bool(settings.pop(flag), flag)
        settings["block_q"] = check_positive_int(settings["block_q"], "block_q", default=DEFAULT_BLOCK_Q)
        settings["block_k"] = check_positive_int(settings["block_k"], "block_k", default=DEFAULT_BLOCK_K)
        workers = check_positive_int(settings.pop("workers"), "workers")
        local: Any = _check_local(q, k, v, settings)
        compute = np.float64 if "float64" in local.dtypes else np.float32  # float16 computes in float32
        settings["scale"] = check_scale(settings["scale"], local.q_shape[-1], compute)
        local = local._replace(settings=tuple(settings.values()))
    except Exception as err:  # any error: the other ranks must hear of it, or they would wait in allgather forever
        local = (type(err).__name__, str(err))
    _agree(comm.allgather(local))
    return {**settings, "workers": workers}


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
    Bad input on any rank is raised on every rank (the inputs are compared first), never a hang.
    float16 is computed in float32 and out cast back (lse stays float32, as flash_attention's); the K/V
    blocks travel in their own dtype.
    """
    MPI = _mpi()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator such as MPI.COMM_WORLD; got {type(comm).__name__}")
    rank, size = comm.Get_rank(), comm.Get_size()
    # 1) every rank's inputs checked and compared; then this rank's running state: no key seen yet (0, -inf)
    settings = check_ring(q, k, v, comm, {"causal": causal, "layout": layout, "scale": scale, "block_q": block_q,
                                          "block_k": block_k, "return_lse": return_lse, "return_stats": return_stats,
                                          "workers": workers})  # fmt: skip
    q, k, v, dims = check_qkv(q, k, v)
    ct = compute_dtype(q, k, v)
    q_c = q.astype(ct, copy=False)  # (..., Hq, T/P, E)
    out = np.zeros((*dims.batch, dims.hq, dims.n_q, dims.ev), ct)  # (..., Hq, T/P, Ev)
    lse = np.full((*dims.batch, dims.hq, dims.n_q), -np.inf, ct)  # (..., Hq, T/P)
    held = chunks_of(rank, size, layout)
    part = dims.n_q // len(held) if settings["causal"] else dims.n_q  # tokens per pair side: a chunk, or the shard
    plan = flash_plan(
        dims._replace(n_q=part, n_k=part),
        Band(None),
        settings["scale"],
        block_q=settings["block_q"],
        block_k=settings["block_k"],
        workers=settings["workers"],
    )  # the band is set per pair
    stats = RingStats(rank, size, layout, settings["causal"], dims.n_q, held)
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
        pairs = ring_pairs(rank, source_rank, size, layout=layout, causal=settings["causal"])
        tiles = ring_step(q_c, k_block, v_block, out, lse, pairs, part, plan)
        computed = time.perf_counter()
        # 4) wait for the next block to arrive (and ours to leave), then swap the two buffers
        MPI.Request.Waitall(requests)
        stats.steps.append(step_stats(step, source_rank, tiles, pairs, send_buf.nbytes if requests else 0,
                                      computed - started, time.perf_counter() - computed))  # fmt: skip
        send_buf, recv_buf = recv_buf, send_buf
    results: list[Any] = [out.astype(result_dtype(q, k, v), copy=False)]
    if return_lse:
        results.append(lse)  # in the compute dtype, as flash_attention's: float32 for float16 inputs
    if return_stats:
        results.append(stats)
    return results[0] if len(results) == 1 else tuple(results)


def pass_on(comm: Any, send_buf: np.ndarray, recv_buf: np.ndarray, step: int) -> list[Any]:
    """Start sending send_buf to the right neighbour and receiving the next block from the left one into
    recv_buf, without waiting: the two requests to wait for (MPI.Request.Waitall)."""
    MPI = _mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    return [
        comm.Irecv([recv_buf.view(np.uint8), MPI.BYTE], source=(rank - 1) % size, tag=step),
        comm.Isend([send_buf.view(np.uint8), MPI.BYTE], dest=(rank + 1) % size, tag=step),
    ]


def step_stats(
    step: int, source_rank: int, tiles: int, pairs: list[Pair], passed: int, compute: float, wait: float
) -> StepStats:
    """The record of one ring step: whose block, the work done, the bytes passed (sent and received)."""
    kinds = {kind: sum(p.kind == kind for p in pairs) for kind in (FULL, DIAGONAL, HIDDEN)}
    return StepStats(step, source_rank, tiles, kinds, passed, passed, compute, wait)
