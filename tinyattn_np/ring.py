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

The causal mask and the balance. Number the sequence's chunks by position (shards.py, the layouts). For
a pair (query chunk a held here, key chunk b that arrived):

    b < a   full:      every query sees every key
    b == a  diagonal:  the causal triangle, flash_attention(causal=True)
    b > a   hidden:    every key lies in every query's future; skipped, nothing computed

Split plainly ("contiguous"), rank r has r full pairs and 1 diagonal: the last does about 2 - 1/P times the
mean work while the others wait (Brandon et al. 2023, "Striped Attention"). Split "zigzag", every rank has
2P-1 full and 2 diagonal pairs, the same work. Without a causal mask every pair is full.

The backward (ring_attention_backward) goes round the same ring. Each rank keeps its queries and their
gradient dq; the K/V blocks travel as in the forward, and beside each block travels its gradient
accumulator (dK, dV), one step behind it: a rank adds its share of the block's gradient and passes the
accumulator on, and after P steps it arrives home, holding every rank's share. Per pair of chunks the
work is FlashAttention-2's backward with the forward's global lse, whose P = exp(S − lse) are the
weights over the whole sequence restricted to the pair's keys, so the gradients of the pairs simply add
up. (Ring-flash-attention's scheme, github.com/zhuzilin/ring-flash-attention; here a rank keeps its share
of its own block at home instead of sending it round, one message fewer.)

Failures (_mpi.py): bad input on any rank is raised on every rank before any block moves; any exception
after that, Ctrl-C included, ends the whole job (MPI_Abort) rather than leave the other ranks waiting.
mpi4py is imported only when a ring runs: `pip install -e ".[distributed]"`, `mpiexec -n 4 python ...`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._backward_kernel import BackwardPlan, check_weights_sum_to_one, query_rows, run_key_blocks
from ._checks import QKVShape, check_bool, check_count, check_positive_int, compute_dtype, result_dtype
from ._flash_kernel import FlashPlan, TileSizes, flash_forward, flash_plan
from ._mpi import (
    Settings,
    abort_on_failure,
    agreed_inputs,
    check_backward,
    check_forward,
    check_on_every_rank,
    finish,
    pack_block,
    pass_on,
    unpack_block,
    wait_for,
)
from ._parallel import one_blas_thread
from .blockmask import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, Band, square_tiles
from .shards import chunks_of, n_chunks, shard, unshard
from .softmax import merge_states

Array = NDArray[np.floating]

__all__ = [
    "DIAGONAL",
    "FULL",
    "HIDDEN",
    "Pair",
    "RingStats",
    "StepStats",
    "pair_kind",
    "ring_attention",
    "ring_attention_backward",
    "ring_pairs",
    "shard",
    "tile_counts",
    "unshard",
]

# A pair's kind: FULL (every query sees every key), DIAGONAL (the chunk against itself, the causal diagonal
# through it) or HIDDEN (every key lies in its queries' future: nothing to compute)
FULL, DIAGONAL, HIDDEN = "full", "diagonal", "hidden"


# ---------------------------------------------------------------------------------------------------
# the forward


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
    Failures (_mpi.py): bad input on any rank is raised on every rank, before any block moves; any exception
    after that (Ctrl-C too) is printed with its rank and ends the job (MPI_Abort).
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
    check = partial(check_forward, q, k, v, settings)
    q, k, v, dims, settings = agreed_inputs(comm, check, "ring_attention's check")
    # 2) the ring; a failure on any rank from here on ends the job
    with abort_on_failure(comm, "ring_attention"):
        out, lse, stats = forward_ring(comm, q, k, v, dims, settings)
        results: list[Any] = [out.astype(result_dtype(q, k, v), copy=False)]
    if settings.return_lse:
        results.append(lse)  # in the compute dtype, as flash_attention's: float32 for float16 inputs
    if settings.return_stats:
        results.append(stats)
    return finish(results)


def forward_ring(
    comm: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, dims: QKVShape, settings: Settings
) -> tuple[np.ndarray, np.ndarray, RingStats]:
    """ring_attention's steps on checked inputs: out and lse in the compute dtype, and the record."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ct = compute_dtype(q, k, v)
    # 1) this rank's running state: no key seen yet (0, -inf)
    q_c = q.astype(ct, copy=False)  # (..., Hq, T/P, E)
    out = np.zeros((*dims.batch, dims.hq, dims.n_q, dims.ev), ct)  # (..., Hq, T/P, Ev)
    lse = np.full((*dims.batch, dims.hq, dims.n_q), -np.inf, ct)  # (..., Hq, T/P)
    held = chunks_of(rank, size, settings.layout)
    part = dims.n_q // len(held) if settings.causal else dims.n_q  # tokens per pair side: a chunk, or the shard
    sizes = TileSizes(settings.block_q, settings.block_k, workers=settings.workers)
    plan = flash_plan(dims._replace(n_q=part, n_k=part), Band(None), settings.scale, sizes)  # band: per pair
    stats = RingStats(rank, size, settings.layout, settings.causal, dims.n_q, held)
    # 2) two buffers: send_buf is the block in hand (computed on while it goes to the right neighbour),
    #    recv_buf takes the next block from the left. K/V travel in their own dtype (float16 stays 2 bytes).
    send_buf = pack_block(k, v, np.result_type(k, v))  # (B·Hkv·T/P·(E + Ev),): k_block and v_block, one message
    recv_buf = np.empty_like(send_buf)
    for step in range(size):
        source_rank = (rank - step) % size  # whose block is in send_buf now
        started = time.perf_counter()
        # 3) start passing the block on while we compute on it; the last block needs no passing
        requests = pass_on(comm, send_buf, recv_buf, step) if step < size - 1 else []
        k_block, v_block = (x.astype(ct, copy=False) for x in unpack_block(send_buf, k.shape, v.shape))
        pairs = ring_pairs(rank, source_rank, size, layout=settings.layout, causal=settings.causal)
        tiles = ring_step(q_c, k_block, v_block, out, lse, pairs, part, plan)
        computed = time.perf_counter()
        # 4) wait for the next block to arrive (and ours to leave), then swap the two buffers
        wait_for(requests)
        stats.steps.append(
            step_stats(
                step,
                source_rank,
                tiles,
                pairs,
                send_buf.nbytes if requests else 0,
                computed - started,
                time.perf_counter() - computed,
            )
        )
        send_buf, recv_buf = recv_buf, send_buf
    return out, lse, stats


def ring_step(
    q: np.ndarray,
    k_block: np.ndarray,
    v_block: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    pairs: list[Pair],
    part: int,
    plan: FlashPlan,
) -> int:
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
        pair_plan = plan._replace(tile_mask=Band(0 if pair.kind == DIAGONAL else None))  # diagonal: L == S, offset 0
        part_out, part_lse = flash_forward(q_p, k_p, v_p, dims, pair_plan)  # (..., part, Ev), (..., part)
        out[..., rows, :], lse[..., rows] = merge_states(out[..., rows, :], lse[..., rows], part_out, part_lse)
        tiles += pair_tiles(pair, part, plan.block_q, plan.block_k)
    return tiles


# ---------------------------------------------------------------------------------------------------
# the backward


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
    check = partial(check_backward, q, k, v, out, dout, lse, settings)
    q, k, v, out, dout, lse, dims, settings = agreed_inputs(comm, check, "ring_attention_backward's check")
    # 2) the ring; a failure on any rank from here on ends the job
    with abort_on_failure(comm, "ring_attention_backward"):
        query, dk, dv, stats = backward_ring(comm, q, k, v, out, dout, lse, dims, settings)
    # 3) the forward's lse, checked on every rank's rows: all ranks raise, or none
    check_on_every_rank(comm, partial(check_lse, query), "ring_attention_backward's lse check")
    dq = (query.dq * settings.scale).reshape(q.shape).astype(q.dtype, copy=False)
    results = [dq, dk.reshape(k.shape).astype(k.dtype, copy=False), dv.reshape(v.shape).astype(v.dtype, copy=False)]
    if settings.return_stats:
        results.append(stats)
    return tuple(results)


def backward_ring(
    comm: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    dims: QKVShape,
    settings: Settings,
) -> tuple[QuerySide, np.ndarray, np.ndarray, RingStats]:
    """ring_attention_backward's steps on checked inputs: the query side (dq inside), dk, dv, the record."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ct = compute_dtype(q, k, v, out, dout)
    held = chunks_of(rank, size, settings.layout)
    part = dims.n_q // len(held) if settings.causal else dims.n_q  # tokens per pair side
    plan = BackwardPlan(settings.scale, Band(None), settings.block_q, settings.block_k, settings.workers)
    stats = RingStats(rank, size, settings.layout, settings.causal, dims.n_q, held)
    n_kv = int(np.prod(dims.batch, dtype=np.int64)) * dims.hkv
    kv_shapes = (n_kv, dims.n_k, dims.e), (n_kv, dims.n_k, dims.ev)  # a block, one row block per (batch, kv head)
    # 1) the query side, once; the K/V blocks' two buffers, as in the forward
    query = query_side(q, out, dout, lse, dims, settings.scale, ct)
    send_buf = pack_block(k, v, np.result_type(k, v))  # (B·Hkv·T/P·(E + Ev),)
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
            k_block, v_block = (x.astype(ct, copy=False) for x in unpack_block(send_buf, *kv_shapes))
            pairs = ring_pairs(rank, source_rank, size, layout=settings.layout, causal=settings.causal)
            share = home if step == 0 else mine
            tiles = ring_backward_step(query, k_block, v_block, *unpack_block(share, *kv_shapes), pairs, part, plan)
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
            stats.steps.append(
                step_stats(step, source_rank, tiles, pairs, sent, computed - started, time.perf_counter() - computed)
            )
            send_buf, recv_buf = recv_buf, send_buf
        # 5) our own block's accumulator comes home with every other rank's share
        wait_for(grad_requests)
    if size > 1:
        home += arrived
    dk, dv = unpack_block(home, *kv_shapes)
    return query, dk, dv, stats


def ring_backward_step(
    query: QuerySide,
    k_block: np.ndarray,
    v_block: np.ndarray,
    dk_block: np.ndarray,
    dv_block: np.ndarray,
    pairs: list[Pair],
    part: int,
    plan: BackwardPlan,
) -> int:
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
        rows = slice(pair.q_part * part, (pair.q_part + 1) * part)  # this pair's queries within the shard
        keys = slice(pair.k_part * part, (pair.k_part + 1) * part)  # and its keys within the block
        # Algorithm 2 over the pair, as flash_attention_backward runs it; every head sees the same band
        run_key_blocks(
            query.q_lse[:, rows],
            k_block[:, keys],
            v_block[:, keys],
            query.do_d[:, rows],
            query.lse[:, rows],
            query.dq[:, rows],
            query.p_sums[:, rows],
            query.dk_heads[:, keys],
            query.dv_heads[:, keys],
            plan._replace(tile_mask=band),
            hq=len(query.q_lse),
        )
        tiles += pair_tiles(pair, part, plan.block_q, plan.block_k)
    # a kv head's share is the sum over the G query heads that read it, in head order
    n_kv, group = k_block.shape[0], query.q_lse.shape[0] // k_block.shape[0]
    dk_block[...] = query.dk_heads.reshape(n_kv, group, *k_block.shape[1:]).sum(axis=1)  # (B·Hkv, T/P, E)
    dv_block[...] = query.dv_heads.reshape(n_kv, group, *v_block.shape[1:]).sum(axis=1)  # (B·Hkv, T/P, Ev)
    return tiles


class QuerySide(NamedTuple):
    """What a rank keeps through the backward's ring, one row block per (batch, query head), in the compute
    dtype: its queries' inputs, their gradient, and one step's share of the travelling block's gradient."""

    q_lse: np.ndarray  # (B·Hq, T/P, E + 1)  [q times the scale, −lse]
    do_d: np.ndarray  # (B·Hq, T/P, Ev + 1)  [dout, −D], D = rowsum(dO ∘ O) with the whole sequence's out
    d: np.ndarray  # (B·Hq, T/P)        D itself
    lse: np.ndarray  # (B·Hq, T/P)      the forward's lse over the whole sequence; -inf made +inf: P = 0
    dq: np.ndarray  # (B·Hq, T/P, E)    dQ / scale, summed over the steps
    p_sums: np.ndarray  # (B·Hq, T/P)   the row sums of P over the steps: 1 where lse is the forward's
    dk_heads: np.ndarray  # (B·Hq, T/P, E)   one step's dK of the block, per query head (summed per kv head)
    dv_heads: np.ndarray  # (B·Hq, T/P, Ev)


def query_side(
    q: np.ndarray, out: np.ndarray, dout: np.ndarray, lse: np.ndarray, dims: QKVShape, scale: float, ct: np.dtype
) -> QuerySide:
    """The backward's per-rank state, made once: [q scaled, −lse], [dout, −D], D = rowsum(dO ∘ O) and lse with
    +inf for -inf, as flash_attention_backward makes them (_backward_kernel.query_rows), and zeros to add into."""
    q_lse, do_d, d, lse_c = query_rows(q, out, dout, lse, dims, scale, ct)  # (B·Hq, T/P, E + 1), (.., Ev + 1), ...
    dq, dk_heads, dv_heads = (np.zeros_like(x[..., :-1]) for x in (q_lse, q_lse, do_d))  # (B·Hq, T/P, E or Ev)
    return QuerySide(q_lse, do_d, d, lse_c, dq, np.zeros_like(lse_c), dk_heads, dv_heads)


def check_lse(query: QuerySide) -> tuple[None, None]:
    """P's rows, summed over the steps, against 1 (_backward_kernel.check_weights_sum_to_one); nothing to report."""
    check_weights_sum_to_one(query.p_sums, query.lse)
    return None, None


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
    hidden, for a sequence of `tokens` on `size` ranks (the module doc counts them). ring_attention counts
    the same as it runs."""
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
    """What ring_attention (or its backward) did on this rank (return_stats=True): each step, and the totals."""

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
