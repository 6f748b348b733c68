"""Ring attention on real processes: the tiles, the messages, the balance, and the check against one process.

    mpiexec -n 4 python scripts/ring.py --tokens 65536     # 4 ranks, both layouts, causal
    mpiexec -n 2 python scripts/ring.py --tokens 16384     # the benchmark: 2 ranks on 2 cores
    python scripts/ring.py                                 # a ring of one: plain flash attention

Rank 0 draws q, k, v (1 sequence, --heads x --head-dim, float32 by default), hands every rank its shard
(tinyattn_np.shards.shard), and every rank runs ring_attention on its own shard. Rank 0 then prints:
  1) the tiles per rank that the causal mask leaves, counted without running anything: zigzag against
     contiguous for 2 .. 8 ranks, then powers of two up to --max-ranks (the busiest rank over the mean)
  2) per layout and per rank: the chunks and tokens it holds, the tiles it computed, the bytes it sent
     and received per ring step and in total next to tinyattn_np.memory's estimate (they must be equal),
     its peak memory (tracemalloc), its time and the part of it spent waiting on the ring
  3) each layout's wall time against single-process flash_attention (--reference-workers threads), and
     the largest difference between the gathered ring output and the single-process one

Each rank computes with one thread (--workers 1, BLAS held to one thread): with one rank per core, more
would oversubscribe the cores. More ranks than cores only time-share them, so there the times show that
the ring is right, not how fast it is. Needs the distributed extra: pip install -e ".[distributed]".
Ctrl-C stops every ring after the run it is in (a ring cut halfway would have to end the job at once), and
then ends every rank (MPI_Abort, exit code 130) once rank 0 has printed what it measured (and --json kept it).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from tinyattn_np import flash_attention, tile_plan, to_unit
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q
from tinyattn_np.measure import median_ms, traced_peak
from tinyattn_np.memory import attention_flops
from tinyattn_np.mpi_job import StopTogether, idle_wait, load_mpi
from tinyattn_np.peaks import ring_attention_bytes
from tinyattn_np.report import (
    Checklist,
    add_format_argument,
    add_wide_argument,
    column_unit,
    fit_table,
    format_sig,
    max_diff,
    table_width,
    text_table,
)
from tinyattn_np.ring import ring_attention, tile_counts
from tinyattn_np.shards import LAYOUTS, chunks_of, n_chunks, unshard

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts
import limits
import machine
import mpi_runs
import outputs
import ring_balance

# Gathered output against single-process flash_attention: the tests' tolerances (tests/conftest.py).
TOLERANCE = {"float64": (1e-12, 1e-12), "float32": (2e-5, 2e-6), "float16": (2e-3, 2e-3)}
# each size flag's smallest and largest value (4M tokens: q, k, v and two outputs on rank 0 are GiBs)
BOUNDS = {
    "tokens": (1, limits.MAX_TOKENS),
    "heads": (1, limits.MAX_HEADS),
    "kv_heads": (1, limits.MAX_HEADS),
    "head_dim": (1, limits.MAX_HEADS),
    "block": (1, limits.MAX_TOKENS),
    "workers": (1, limits.MAX_WORKERS),
    "reference_workers": (1, limits.MAX_WORKERS),
    "repeats": (1, limits.MAX_REPEATS),
    "max_ranks": (2, 1024),
}
ONE_RANK = (
    "ran 1 rank: a ring of one is plain flash attention, and its checks say nothing about the messages between "
    "ranks;\nfor a ring of 4 ranks: mpiexec -n 4 python scripts/ring.py"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="T, the whole sequence (default 4096)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, GQA when fewer (default --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="E, channels per head (default 64)")
    p.add_argument("--dtype", choices=list(mpi_runs.DTYPES), default="float32", help="inputs' dtype (default float32)")
    p.add_argument(
        "--layout",
        choices=["both", *LAYOUTS],
        default="both",
        help="zigzag, contiguous, or both (default both)",
    )
    p.add_argument("--no-causal", action="store_true", help="no mask: every pair of chunks is full")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK_Q, help=f"flash tile side (default {DEFAULT_BLOCK_Q})")
    p.add_argument("--workers", type=int, default=1, help="flash threads per rank (default 1: a rank per core)")
    p.add_argument(
        "--reference-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="threads of the single-process flash_attention it is timed against (default: the CPU count)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the single-process run and the comparison")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure, the median is shown (default 3)")
    p.add_argument(
        "--max-ranks",
        type=int,
        default=8,
        help="largest ring in the tile-count table: 2 .. 8 ranks, then powers of two up to this (default 8)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for q, k, v (default 0)")
    add_format_argument(p)
    add_wide_argument(p)
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH (its folder must exist)")
    args = p.parse_args(argv)
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    for name, (low, high) in BOUNDS.items():
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if value < low or value > high:
            p.error(
                f"{flag} must be {'at least' if value < low else 'at most'} {low if value < low else high:,}; "
                f"got {value:,}"
            )
    if args.tokens < 2 * args.max_ranks:
        p.error(
            f"--tokens must be at least 2 x --max-ranks = {2 * args.max_ranks} (the tile table cuts it into "
            f"2 chunks per rank); got {args.tokens}"
        )
    if args.seed < 0:
        p.error(f"--seed must be 0 or more; got {args.seed}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    outputs.check_output(p, "--json", args.json)
    return args


def check_against_size(args: argparse.Namespace, size: int) -> str | None:
    """What is wrong with the flags for a ring of `size` ranks (None when nothing is): tokens that do not
    split, arrays that do not fit on rank 0, or a run that cannot end within the time limit."""
    for layout in layouts(args):
        pieces = n_chunks(size, layout)
        if args.tokens % pieces:
            return (
                f"--tokens {args.tokens} cannot be split into {pieces} equal chunks ({layout} layout, {size} ranks): "
                f"use a multiple of {pieces}"
            )
    itemsize = np.dtype(mpi_runs.DTYPES[args.dtype]).itemsize
    held = args.tokens * (3 * args.heads + 2 * args.kv_heads) * args.head_dim * itemsize  # q, out, ref, k, v
    problem = limits.memory_problem(
        held,
        f"--tokens {args.tokens:,}",
        "lower --tokens, --heads or --head-dim",
        " on rank 0 (q, k, v, two outputs)",
    )
    if problem:
        return problem
    flops, rate, seconds = run_cost(args, size)
    return limits.time_problem(flops, rate, "lower --max-ranks, --tokens or --repeats, or raise --block", seconds)


def run_cost(args: argparse.Namespace, size: int) -> tuple[float, float, float]:
    """(FLOPs, the matmul rate in GFLOP/s, seconds of bookkeeping) of the whole run, for time_problem: the
    rings' and the reference's FLOPs, and the tile-count table of section 1, priced by timing a small one
    here (its pairs of chunks, and the tiles tile_plan lists)."""
    rate = machine.matmul_rate("float64" if args.dtype == "float64" else "float32", n=1024, repeats=3)
    flops = attention_flops(args.tokens, heads=args.heads, head_dim=args.head_dim, causal=not args.no_causal)
    rings = len(layouts(args)) * (args.repeats + 1) * flops / size  # every rank computes its share at once
    reference = 0 if args.no_reference else args.repeats * flops
    probe = argparse.Namespace(**{**vars(args), "tokens": 1024, "max_ranks": 32, "block": 1024})  # 1 tile a pair
    pair_s = (
        median_ms(lambda: ring_balance.balance_rows(probe, True), 3)
        / 1e3
        / sum(5 * n * n for n in ring_balance.table_sizes(32))
    )
    tile_s = median_ms(lambda: tile_plan(512, 512, 8, 8), 3) / 1e3 / 64**2
    seconds = 0.0
    for ranks in ring_balance.table_sizes(args.max_ranks):  # zigzag: 4 pairs per rank and step, contiguous: 1
        parts = (args.tokens / (2 * ranks), args.tokens / ranks)  # a zigzag chunk, a contiguous one
        seconds += 5 * ranks**2 * pair_s + sum(2 * math.ceil(part / args.block) ** 2 for part in parts) * tile_s
    return rings + reference, rate, seconds


def layouts(args: argparse.Namespace) -> list[str]:
    return list(LAYOUTS) if args.layout == "both" else [args.layout]


def blocks(args: argparse.Namespace) -> dict[str, int]:
    return {"block_q": args.block, "block_k": args.block}


# --- 2) the ring, on every rank ----------------------------------------------------------------------


def run_ring(
    comm: Any, args: argparse.Namespace, layout: str, full: dict[str, np.ndarray] | None, ctrl_c: StopTogether
) -> dict[str, Any]:
    """Scatter the shards from rank 0, run the ring --repeats times and once under tracemalloc; return
    this rank's figures (and, on rank 0, the gathered output). Ctrl-C: KeyboardInterrupt on every rank
    after the same run."""
    causal = not args.no_causal
    mine = mpi_runs.scatter_shards(comm, full, layout)  # {"q": (1, Hq, T/P, E), "k": ..., "v": ...}

    settings = dict(comm=comm, causal=causal, layout=layout, return_stats=True, workers=args.workers)

    def ring() -> Any:
        return ring_attention(mine["q"], mine["k"], mine["v"], **settings, **blocks(args))

    walls, seconds = [], []
    for _ in range(args.repeats):
        comm.Barrier()  # start together: a rank's time then includes waiting for slower neighbours
        started = time.perf_counter()
        out, stats = ring()
        seconds.append(time.perf_counter() - started)
        walls.append(comm.allreduce(seconds[-1], op=load_mpi().MAX))  # the ring is done when its last rank is
        if ctrl_c.stop(comm):
            raise KeyboardInterrupt
    comm.Barrier()
    (_, _), peak = traced_peak(ring)
    gathered = comm.gather(out, root=0)
    figures = rank_figures(comm, args, layout, stats, peak, seconds)
    every = comm.gather(figures, root=0)
    return {"ranks": every, "wall_ms": 1e3 * statistics.median(walls), "out": gathered}


def rank_figures(
    comm: Any, args: argparse.Namespace, layout: str, stats: Any, peak: int, seconds: list[float]
) -> dict[str, Any]:
    """This rank's figures of its ring (stats: ring_attention's RingStats): what it held, computed, sent and
    received beside memory.py's estimate and the tiles counted, its peak, its time and its waits, step by step."""
    rank, size, causal = comm.Get_rank(), comm.Get_size(), not args.no_causal
    estimate = ring_attention_bytes(
        args.tokens,
        size,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        workers=args.workers,
        **blocks(args),
    )
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
            {
                "step": s.step,
                "source_rank": s.source_rank,
                "tiles": s.tiles,
                "bytes_sent": s.bytes_sent,
                "compute_ms": 1e3 * s.compute_seconds,
                "wait_ms": 1e3 * s.wait_seconds,
            }
            for s in stats.steps
        ],
    }
    return figures


def rank_table(ranks: list[dict[str, Any]], units: str, fmt: str, width: int | None) -> str:
    """One row per rank: what it held, computed, sent and waited (split into parts of `width` columns)."""
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
                *(format_sig(to_unit(r[key], u)) for key in ("sent", "received", "estimate_total")),
                format_sig(to_unit(r["peak_bytes"], u_peak)),
                f"{r['ms']:,.1f}",
                f"{r['wait_ms']:,.1f}",
            ]
        )
    headers = ["rank", "chunks", "tokens", "tiles", "pairs full/diag/hidden", f"sent per step ({u}) x steps"]
    headers += [f"sent ({u})", f"received ({u})", f"memory.py ({u})", f"peak ({u_peak})", "ms", "waiting ms"]
    return fit_table(body, headers, fmt, width)


def step_table(ranks: list[dict[str, Any]], fmt: str) -> str:
    """Rank 0's ring, step by step: whose block it held, the tiles, the bytes, computing and waiting."""
    body = [
        [
            str(s["step"]),
            str(s["source_rank"]),
            f"{s['tiles']:,}",
            f"{s['bytes_sent']:,}",
            f"{s['compute_ms']:,.1f}",
            f"{s['wait_ms']:,.1f}",
        ]
        for s in ranks[0]["steps"]
    ]
    headers = ["step", "block of rank", "tiles", "bytes sent = received", "compute ms", "waiting ms"]
    return text_table(body, headers, fmt)


# --- the program ---------------------------------------------------------------------------------------


def layout_section(section: int, layout: str, run: dict[str, Any], args: argparse.Namespace, check: Checklist) -> None:
    """2) and 3) on rank 0: one layout's ring, rank by rank and (rank 0's) step by step, checked."""
    ranks, size = run["ranks"], len(run["ranks"])
    print(f"\n{section}) {layout}: per rank (pairs of chunks: full / diagonal / hidden; memory.py = its estimate of")
    print("   the bytes sent, exact; peak = tracemalloc's, in the ring call)")
    print(rank_table(ranks, "binary", args.format, table_width(args)))
    if size > 1:
        print(f"   rank 0 step by step (it sends each block on to rank 1 and receives from rank {size - 1}):")
        print(step_table(ranks, args.format))
    for r in ranks:
        check(r["tiles"] == r["tiles_counted"], f"{layout} rank {r['rank']}: tiles computed == tiles counted")
        check(r["sent"] == r["estimate_total"], f"{layout} rank {r['rank']}: bytes sent == memory.py's estimate")
        check(r["received"] == r["estimate_total"], f"{layout} rank {r['rank']}: bytes received == estimate")
        steps = r["sent_per_step"]
        check(
            all(b == r["estimate_per_step"] for b in steps[:-1]) and steps[-1] == 0,
            f"{layout} rank {r['rank']}: every step but the last sends memory.py's block",
        )


def reference_run(args: argparse.Namespace, full: dict[str, np.ndarray]) -> tuple[float, np.ndarray]:
    """(median ms, output) of single-process flash_attention on the whole sequence, on rank 0."""
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        reference = flash_attention(
            full["q"],
            full["k"],
            full["v"],
            causal=not args.no_causal,
            workers=args.reference_workers,
            **blocks(args),
        )
        seconds.append(time.perf_counter() - started)
    return 1e3 * statistics.median(seconds), np.asarray(reference)  # --repeats is at least 1


def wall_section(
    runs: dict[str, Any],
    reference: tuple[float, np.ndarray] | None,
    args: argparse.Namespace,
    check: Checklist,
    report: dict[str, Any],
) -> None:
    """The last section on rank 0: each layout's wall time against one process, and the largest difference."""
    size = len(next(iter(runs.values()))["ranks"])
    print(f"\n{len(runs) + 2}) wall time (the slowest rank) against one process")
    body, summary = [], {}
    for layout, run in runs.items():
        tiles = [r["tiles"] for r in run["ranks"]]
        row = [
            layout,
            f"{run['wall_ms']:,.1f}",
            f"{max(tiles):,}",
            f"{max(tiles) / statistics.mean(tiles):.3f}x",
        ]
        diff = None
        if reference is not None:
            mine = unshard(run["out"], layout=layout)
            diff = max_diff(mine, reference[1])
            rtol, atol = TOLERANCE[args.dtype]
            check(
                bool(np.allclose(mine, reference[1], rtol=rtol, atol=atol)),
                f"{layout}: gathered ring output == single-process flash_attention",
            )
            row += [f"{run['wall_ms'] / reference[0]:.2f}", f"{diff:.2e}"]
        body.append(row)
        summary[layout] = {
            "layout": layout,
            "wall_ms": run["wall_ms"],
            "max_abs_diff": diff,
            "busy": run["busy"],
        }
    headers = ["layout", "wall ms", "busiest rank's tiles", "max/mean"]
    if reference is not None:
        headers += ["/ one process", "max |ring - one process|"]
        print(f"   one process: flash_attention with {args.reference_workers} worker(s): {reference[0]:,.1f} ms")
    label = lambda row: row["layout"]  # noqa: E731
    print(machine.marked_table(body, list(summary.values()), headers, args.format, label, width=table_width(args)))
    if len(runs) == 2:
        print(f"   contiguous / zigzag wall time: {runs['contiguous']['wall_ms'] / runs['zigzag']['wall_ms']:.2f}")
    mpi_runs.say_if_time_shared(size)
    report["reference_ms"] = None if reference is None else reference[0]
    report["summary"] = summary


def run_sections(comm: Any, args: argparse.Namespace, check: Checklist, report: dict[str, Any]) -> None:
    """Every section in order; rank 0 prints, every rank runs the rings."""
    rank, full = comm.Get_rank(), None
    if rank == 0:
        ring_balance.balance_section(args, check, report)
        full = mpi_runs.draw_inputs(args, {"q": args.heads, "k": args.kv_heads, "v": args.kv_heads})
    runs = {}
    with StopTogether() as ctrl_c:  # Ctrl-C is noted, not raised, inside a ring
        for section, layout in enumerate(layouts(args), start=2):
            runs[layout] = run_ring(comm, args, layout, full, ctrl_c)
            # the machine's load: every rank computes on one core
            runs[layout]["busy"] = machine.busy_reasons()
            if rank == 0:
                layout_section(section, layout, runs[layout], args, check)
                report[layout] = {"wall_ms": runs[layout]["wall_ms"], "ranks": runs[layout]["ranks"]}
    reference = None
    if not args.no_reference:
        if rank == 0 and full is not None:
            reference = reference_run(args, full)
        idle_wait(comm)  # the other ranks sleep meanwhile, so that the reference has every core
    if rank == 0:
        wall_section(runs, reference, args, check, report)


def main(argv: list[str] | None = None) -> int:
    ready = mpi_runs.setup(argv, parse_args, check_against_size, "ring.py")
    if isinstance(ready, int):
        return ready
    comm, args = ready
    rank, size = comm.Get_rank(), comm.Get_size()
    threadpool_limits(limits=1, user_api="blas")  # one BLAS thread per rank (flash holds it there too)
    check = Checklist()
    report: dict[str, Any] = {"ranks": size, "args": dict(vars(args))}
    if rank == 0:
        info, lines = machine.header()
        report["machine"] = info
        mask = "no mask" if args.no_causal else "causal"
        print(lines)
        print(f"ring of {size} rank(s): T = {args.tokens:,} tokens, 1 sequence, {args.heads} query heads and")
        print(
            f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype}, {mask}; flash tiles {args.block} x "
            f"{args.block},\n{args.workers} thread(s) per rank; times are the median of {args.repeats}"
        )
        if size == 1:
            print(ONE_RANK)
    try:
        run_sections(comm, args, check, report)
    except KeyboardInterrupt:
        return stop_all(comm, args, report)
    if rank == 0 and args.json:
        outputs.write_json(args.json, report)
    if rank == 0 and size == 1:
        print(f"\n{ONE_RANK}")
    code = check.finish() if rank == 0 else 0
    return int(comm.bcast(code, root=0))


def stop_all(comm: Any, args: argparse.Namespace, report: dict[str, Any]) -> int:
    """Ctrl-C: rank 0 keeps what was measured (printed, and in --json) and says so; then the whole job ends:
    a rank left waiting for a message from a stopped one would wait forever."""
    if comm.Get_rank() == 0:
        if args.json:
            outputs.write_json(args.json, report, stopped=True)
        interrupts.interrupted(sum(layout in report for layout in layouts(args)), len(layouts(args)), "layouts")
        sys.stdout.flush()
    else:
        time.sleep(1.0)  # let rank 0, interrupted too, print first
    if comm.Get_size() > 1:
        comm.Abort(interrupts.INTERRUPTED)
    return interrupts.INTERRUPTED


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
