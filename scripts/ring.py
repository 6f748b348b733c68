"""Ring attention on real processes: the tiles, the messages, the balance, and the check against one process.

    mpiexec -n 4 python scripts/ring.py --tokens 65536     # 4 ranks, both layouts, causal
    mpiexec -n 2 python scripts/ring.py --tokens 16384     # the benchmark: 2 ranks on 2 cores
    python scripts/ring.py                                 # a ring of one: plain flash attention

Rank 0 draws q, k, v (1 sequence, --heads x --head-dim, float32 by default), hands every rank its shard
(tinyattn_np.ring.shard), and every rank runs ring_attention on its own shard. Rank 0 then prints:
  1) the tiles per rank that the causal mask leaves, counted without running anything: zigzag against
     contiguous for 2 .. --max-ranks ranks (the busiest rank over the mean)
  2) per layout and per rank: the chunks and tokens it holds, the tiles it computed, the bytes it sent
     and received per ring step and in total next to tinyattn_np.memory's estimate (they must be equal),
     its peak memory (tracemalloc), its time and the part of it spent waiting on the ring
  3) each layout's wall time against single-process flash_attention (--reference-workers threads), and
     the largest difference between the gathered ring output and the single-process one

Each rank computes with one thread (--workers 1, BLAS held to one thread): with one rank per core, more
would oversubscribe the cores. More ranks than cores only time-share them, so there the times show that
the ring is right, not how fast it is. Needs the distributed extra: pip install -e ".[distributed]".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tinyattn_np import flash_attention
from tinyattn_np.flash import DEFAULT_BLOCK_Q
from tinyattn_np.measure import memory_available, traced_peak
from tinyattn_np.memory import ring_attention_bytes
from tinyattn_np.report import Checklist, add_format_argument, column_unit, format_sig, text_table, to_unit
from tinyattn_np.ring import INSTALL_HINT, LAYOUTS, chunks_of, n_chunks, ring_attention, shard, tile_counts, unshard

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
# Gathered output against single-process flash_attention: the tests' tolerances (tests/conftest.py).
TOLERANCE = {"float64": (1e-12, 1e-12), "float32": (2e-5, 2e-6), "float16": (2e-3, 2e-3)}
MAX_TOKENS = 1 << 22  # 4M tokens: the full q, k, v and two outputs on rank 0 are already GiBs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="T, the whole sequence (default 4096)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, GQA when fewer (default --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="E, channels per head (default 64)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="inputs' dtype (default float32)")
    p.add_argument(
        "--layout", choices=["both", *LAYOUTS], default="both", help="zigzag, contiguous, or both (default both)"
    )
    p.add_argument("--no-causal", action="store_true", help="no mask: every pair of chunks is full")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK_Q, help=f"flash tile side (default {DEFAULT_BLOCK_Q})")
    p.add_argument("--workers", type=int, default=1, help="flash threads per rank (default 1: a rank per core)")
    p.add_argument(
        "--reference-workers", type=int, default=os.cpu_count() or 1,
        help="threads of the single-process flash_attention it is timed against (default: the CPU count)",
    )  # fmt: skip
    p.add_argument("--no-reference", action="store_true", help="skip the single-process run and the comparison")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, the median is shown (default 3)")
    p.add_argument("--max-ranks", type=int, default=8, help="largest ring in the tile-count table (default 8)")
    p.add_argument("--seed", type=int, default=0, help="random seed for q, k, v (default 0)")
    add_format_argument(p)
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH (its folder must exist)")
    args = p.parse_args(argv)
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    for name in ("tokens", "heads", "kv_heads", "head_dim", "block", "workers", "reference_workers", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    for name in ("workers", "reference_workers"):
        if getattr(args, name) > 256:
            p.error(f"--{name.replace('_', '-')} must be at most 256 threads; got {getattr(args, name)}")
    if args.max_ranks < 2:
        p.error(f"--max-ranks must be at least 2; got {args.max_ranks}")
    if args.max_ranks > 1024:
        p.error(f"--max-ranks must be at most 1024; got {args.max_ranks}")
    if args.tokens < 2 * args.max_ranks:
        p.error(
            f"--tokens must be at least 2 x --max-ranks = {2 * args.max_ranks} (the tile table cuts it into "
            f"2 chunks per rank); got {args.tokens}"
        )
    if args.seed < 0:
        p.error(f"--seed must be 0 or more; got {args.seed}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.tokens > MAX_TOKENS:
        p.error(f"--tokens must be at most {MAX_TOKENS:,}; got {args.tokens:,}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    return args


def check_against_size(args: argparse.Namespace, size: int) -> str | None:
    """What is wrong with the flags for a ring of `size` ranks (None when nothing is)."""
    for layout in layouts(args):
        pieces = n_chunks(size, layout)
        if args.tokens % pieces:
            return (
                f"--tokens {args.tokens} cannot be split into {pieces} equal chunks ({layout} layout, {size} ranks): "
                f"use a multiple of {pieces}"
            )
    itemsize = np.dtype(DTYPES[args.dtype]).itemsize
    held = args.tokens * (3 * args.heads + 2 * args.kv_heads) * args.head_dim * itemsize  # q, out, ref, k, v
    if held > memory_available() // 2:
        return f"--tokens {args.tokens:,} needs about {held / 2**30:,.1f} GiB on rank 0; this machine has less free"
    return None


def layouts(args: argparse.Namespace) -> list[str]:
    return list(LAYOUTS) if args.layout == "both" else [args.layout]


def idle_wait(comm: Any) -> None:
    """Wait for the other ranks without spinning: MPI's blocking calls poll the CPU, and a polling rank
    would take a core from the single-process run that rank 0 times meanwhile."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


# --- 1) tiles per rank, counted --------------------------------------------------------------------


def balance_rows(args: argparse.Namespace, causal: bool) -> list[dict[str, Any]]:
    """For 2 .. --max-ranks ranks: the busiest rank's tiles over the mean, zigzag and contiguous.

    T is --tokens rounded down to a multiple of 2·ranks, so that both layouts can split it."""
    rows = []
    for size in range(2, args.max_ranks + 1):
        tokens = args.tokens - args.tokens % (2 * size)
        row: dict[str, Any] = {"ranks": size, "tokens": tokens}
        for layout in LAYOUTS:
            tiles = [r["tiles"] for r in tile_counts(tokens, size, layout=layout, causal=causal, **blocks(args))]
            row[layout] = {"tiles": tiles, "max_over_mean": max(tiles) / statistics.mean(tiles)}
        rows.append(row)
    return rows


def balance_table(rows: list[dict[str, Any]], fmt: str) -> str:
    body = [
        [
            str(row["ranks"]),
            f"{row['tokens']:,}",
            *(
                cell
                for layout in LAYOUTS
                for cell in (
                    f"{statistics.mean(row[layout]['tiles']):,.1f}",
                    f"{max(row[layout]['tiles']):,}",
                    f"{row[layout]['max_over_mean']:.3f}x",
                )
            ),
        ]
        for row in rows
    ]
    headers = ["ranks", "tokens", "zigzag mean", "max", "max/mean", "contiguous mean", "max", "max/mean"]
    return text_table(body, headers, fmt)


def blocks(args: argparse.Namespace) -> dict[str, int]:
    return {"block_q": args.block, "block_k": args.block}


# --- 2) the ring, on every rank ----------------------------------------------------------------------


def run_ring(comm: Any, args: argparse.Namespace, layout: str, full: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """Scatter the shards from rank 0, run the ring --repeats times and once under tracemalloc; return
    this rank's figures (and, on rank 0, the gathered output)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    causal = not args.no_causal
    parts = None
    if rank == 0 and full is not None:
        parts = [{name: shard(x, r, size, layout=layout) for name, x in full.items()} for r in range(size)]
    mine = comm.scatter(parts, root=0)  # {"q": (1, Hq, T/P, E), "k": ..., "v": ...}
    del parts

    def ring() -> Any:
        return ring_attention(
            mine["q"], mine["k"], mine["v"], comm=comm, causal=causal, layout=layout,
            return_stats=True, workers=args.workers, **blocks(args),
        )  # fmt: skip

    walls, seconds = [], []
    for _ in range(args.repeats):
        comm.Barrier()  # start together: a rank's time then includes waiting for slower neighbours
        started = time.perf_counter()
        out, stats = ring()
        seconds.append(time.perf_counter() - started)
        walls.append(comm.allreduce(seconds[-1], op=_mpi().MAX))  # the ring is done when its last rank is
    comm.Barrier()
    (_, _), peak = traced_peak(ring)
    gathered = comm.gather(out, root=0)
    estimate = ring_attention_bytes(
        args.tokens, size, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, workers=args.workers,
        **blocks(args),
    )  # fmt: skip
    counted = tile_counts(args.tokens, size, layout=layout, causal=causal, **blocks(args))[rank]
    figures = {
        "rank": rank,
        "chunks": list(chunks_of(rank, size, layout)),
        "tokens": stats.tokens,
        "tiles": stats.tiles,
        "tiles_counted": counted["tiles"],
        "pairs": stats.pairs,
        "sent_per_step": [s.bytes_sent for s in stats.steps],
        "received_per_step": [s.bytes_received for s in stats.steps],
        "sent": stats.bytes_sent,
        "received": stats.bytes_received,
        "estimate_per_step": estimate["sent_per_step"],
        "estimate_total": estimate["sent_total"],
        "peak_bytes": peak,
        "ms": 1e3 * statistics.median(seconds),
        "wait_ms": 1e3 * stats.wait_seconds,
        "steps": [
            {"step": s.step, "source_rank": s.source_rank, "tiles": s.tiles, "bytes_sent": s.bytes_sent,
             "compute_ms": 1e3 * s.compute_seconds, "wait_ms": 1e3 * s.wait_seconds}
            for s in stats.steps
        ],
    }  # fmt: skip
    every = comm.gather(figures, root=0)
    return {"ranks": every, "wall_ms": 1e3 * statistics.median(walls), "out": gathered}


def rank_table(ranks: list[dict[str, Any]], units: str, fmt: str) -> str:
    """One row per rank: what it held, computed, sent and waited."""
    u = column_unit([r["sent"] for r in ranks] + [r["estimate_per_step"] for r in ranks], units)
    u_peak = column_unit([r["peak_bytes"] for r in ranks], units)
    body = []
    for r in ranks:
        per_step = r["sent_per_step"][0] if len(r["sent_per_step"]) > 1 else 0
        body.append(
            [
                str(r["rank"]),
                " ".join(map(str, r["chunks"])),
                f"{r['tokens']:,}",
                f"{r['tiles']:,}",
                f"{r['pairs']['full']}/{r['pairs']['diagonal']}/{r['pairs']['hidden']}",
                f"{format_sig(to_unit(per_step, u))} x {len(r['sent_per_step']) - 1}",
                format_sig(to_unit(r["sent"], u)),
                format_sig(to_unit(r["received"], u)),
                format_sig(to_unit(r["estimate_total"], u)),
                format_sig(to_unit(r["peak_bytes"], u_peak)),
                f"{r['ms']:,.1f}",
                f"{r['wait_ms']:,.1f}",
            ]
        )
    headers = [
        "rank", "chunks", "tokens", "tiles", "pairs full/diag/hidden", f"sent per step ({u}) x steps",
        f"sent ({u})", f"received ({u})", f"memory.py ({u})", f"peak ({u_peak})", "ms", "waiting ms",
    ]  # fmt: skip
    return text_table(body, headers, fmt)


def step_table(ranks: list[dict[str, Any]], fmt: str) -> str:
    """Rank 0's ring, step by step: whose block it held, the tiles, the bytes, computing and waiting."""
    body = [
        [str(s["step"]), str(s["source_rank"]), f"{s['tiles']:,}", f"{s['bytes_sent']:,}",
         f"{s['compute_ms']:,.1f}", f"{s['wait_ms']:,.1f}"]
        for s in ranks[0]["steps"]
    ]  # fmt: skip
    headers = ["step", "block of rank", "tiles", "bytes sent = received", "compute ms", "waiting ms"]
    return text_table(body, headers, fmt)


# --- the program ---------------------------------------------------------------------------------------


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def main(argv: list[str] | None = None) -> int:
    try:
        MPI = _mpi()
    except ImportError:
        parse_args(argv)  # --help and bad flags answer even without MPI
        print(f"ring.py needs mpi4py and an MPI library: {INSTALL_HINT}", file=sys.stderr)
        return 2
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # only rank 0 speaks: the other ranks parse the same flags quietly (and fail the same way)
    quiet = io.StringIO()
    with (
        contextlib.redirect_stdout(quiet if rank else sys.stdout),
        contextlib.redirect_stderr(quiet if rank else sys.stderr),
    ):
        args = parse_args(argv)
        problem = check_against_size(args, size) if rank == 0 else None
        problem = comm.bcast(problem, root=0)
        if problem:
            print(f"ring.py: error: {problem}", file=sys.stderr)
            return 2

    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # one BLAS thread per rank (flash holds it there too)
    causal = not args.no_causal
    dtype = DTYPES[args.dtype]
    say = print if rank == 0 else (lambda *a, **k: None)
    check = Checklist()
    report: dict[str, Any] = {"ranks": size, "args": dict(vars(args))}

    mask = "causal" if causal else "no mask"
    say(f"ring of {size} rank(s): T = {args.tokens:,} tokens, 1 sequence, {args.heads} query heads and")
    say(f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype}, {mask}; flash tiles {args.block} x {args.block},")
    say(f"{args.workers} thread(s) per rank; times are the median of {args.repeats}")

    # 1) balance, counted (plain arithmetic: rank 0 alone)
    if rank == 0:
        balance = balance_rows(args, causal)
        report["balance"] = balance
        say(f"\n1) tiles per rank ({mask}), counted: the busiest rank against the mean")
        say(balance_table(balance, args.format))
        say("   a tile is block x block, smaller where a chunk ends mid-block: compare ranks within one layout")
    if causal and rank == 0:
        worst = max(row["zigzag"]["max_over_mean"] for row in balance)
        check(worst <= 1.05, f"zigzag's busiest rank within 1.05x of the mean (worst {worst:.3f}x)")

    # 2) the ring itself, layout by layout
    full = None
    if rank == 0:
        rng = np.random.default_rng(args.seed)
        full = {
            "q": rng.standard_normal((1, args.heads, args.tokens, args.head_dim)).astype(dtype),
            "k": rng.standard_normal((1, args.kv_heads, args.tokens, args.head_dim)).astype(dtype),
            "v": rng.standard_normal((1, args.kv_heads, args.tokens, args.head_dim)).astype(dtype),
        }
    runs = {}
    for section, layout in enumerate(layouts(args), start=2):
        run = run_ring(comm, args, layout, full)
        runs[layout] = run
        if rank:
            continue
        ranks = run["ranks"]
        say(f"\n{section}) {layout}: per rank (pairs of chunks: full / diagonal / hidden; memory.py = its estimate of")
        say("   the bytes sent, exact; peak = tracemalloc's, in the ring call)")
        say(rank_table(ranks, "binary", args.format))
        if size > 1:
            say(f"   rank 0 step by step (it sends each block on to rank 1 and receives from rank {size - 1}):")
            say(step_table(ranks, args.format))
        for r in ranks:
            check(r["tiles"] == r["tiles_counted"], f"{layout} rank {r['rank']}: tiles computed == tiles counted")
            check(r["sent"] == r["estimate_total"], f"{layout} rank {r['rank']}: bytes sent == memory.py's estimate")
            check(r["received"] == r["estimate_total"], f"{layout} rank {r['rank']}: bytes received == estimate")
            steps = r["sent_per_step"]
            check(
                all(b == r["estimate_per_step"] for b in steps[:-1]) and steps[-1] == 0,
                f"{layout} rank {r['rank']}: every step but the last sends memory.py's block",
            )
        report[layout] = {"wall_ms": run["wall_ms"], "ranks": ranks}

    # 3) against one process
    reference_ms, reference = None, None
    if not args.no_reference:
        if rank == 0 and full is not None:

            def single() -> Any:
                return flash_attention(
                    full["q"], full["k"], full["v"], causal=causal, workers=args.reference_workers, **blocks(args)
                )

            seconds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                reference = single()
                seconds.append(time.perf_counter() - started)
            reference_ms = 1e3 * statistics.median(seconds)
        idle_wait(comm)  # the other ranks sleep meanwhile, so that the reference has every core
    if rank == 0:
        say(f"\n{len(layouts(args)) + 2}) wall time (the slowest rank) against one process")
        body, summary = [], {}
        for layout, run in runs.items():
            tiles = [r["tiles"] for r in run["ranks"]]
            row = [layout, f"{run['wall_ms']:,.1f}", f"{max(tiles):,}", f"{max(tiles) / statistics.mean(tiles):.3f}x"]
            diff = None
            if reference is not None:
                mine = unshard(run["out"], layout=layout)
                diff = float(np.max(np.abs(mine.astype(np.float64) - reference.astype(np.float64)), initial=0.0))
                rtol, atol = TOLERANCE[args.dtype]
                close = np.allclose(mine, reference, rtol=rtol, atol=atol)
                check(bool(close), f"{layout}: gathered ring output == single-process flash_attention")
                row += [f"{run['wall_ms'] / reference_ms:.2f}", f"{diff:.2e}"]
            body.append(row)
            summary[layout] = {"wall_ms": run["wall_ms"], "max_abs_diff": diff}
        headers = ["layout", "wall ms", "busiest rank's tiles", "max/mean"]
        if reference is not None:
            headers += ["/ one process", "max |ring - one process|"]
            say(f"   one process: flash_attention with {args.reference_workers} worker(s): {reference_ms:,.1f} ms")
        say(text_table(body, headers, args.format))
        if len(runs) == 2:
            ratio = runs["contiguous"]["wall_ms"] / runs["zigzag"]["wall_ms"]
            say(f"   contiguous / zigzag wall time: {ratio:.2f}")
        if size > (os.cpu_count() or 1):
            say(f"   {size} ranks on {os.cpu_count()} cores time-share them: these times show correctness, not speed")
        report["reference_ms"] = reference_ms
        report["summary"] = summary
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
            say(f"   figures written to {args.json}")
    code = check.finish() if rank == 0 else 0
    return int(comm.bcast(code, root=0))


if __name__ == "__main__":
    sys.exit(main())
