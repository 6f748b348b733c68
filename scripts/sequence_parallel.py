"""The ring and Ulysses on real processes, forward and backward: per rank, the time, the waiting, the bytes
sent and the peak memory, against one process; and the bytes each scheme sends at a model's scale.

    mpiexec -n 2 python scripts/sequence_parallel.py --tokens 16384   # the benchmark: 2 ranks on 2 cores
    mpiexec -n 4 python scripts/sequence_parallel.py                  # 4 ranks (on 2 cores: right, not fast)
    python scripts/sequence_parallel.py                               # one rank, and the bytes table

Rank 0 draws q, k, v and dout (1 sequence, --heads x --head-dim, causal, float32 by default) and hands every
rank its shards. Every rank then runs three schemes, --repeats times each, the forward (return_lse=True)
then the backward, each started together on every rank: the ring with the zigzag split, the ring with the
contiguous split, and Ulysses (where the heads split over the ranks). Rank 0 prints:
  1) the bytes one process sends, forward and backward, for --model at --model-tokens tokens over 2 .. 64
     processes (tinyattn_np.peaks.sequence_parallel_bytes: a formula, no processes needed)
  2) the ring's backward per layout and rank: tiles, time, waiting, bytes sent and the formula's, peak memory
  3) ring (zigzag) against Ulysses per rank, forward + backward: time, waiting, bytes sent, peak memory
  4) each scheme's wall time (the slowest rank's forward plus the slowest rank's backward) against one
     process's flash_attention and flash_attention_backward (--reference-workers threads), and the largest
     difference of the gathered output and gradients from that process's
Each rank computes with one thread (--workers 1, BLAS held to one thread): with one rank per core, more
would oversubscribe the cores; more ranks than cores only time-share them. Ctrl-C stops every rank after
the call it is in, prints what was measured, and exits with status 130.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from tinyattn_np import flash_attention, flash_attention_backward, load_model_shape, to_unit
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q
from tinyattn_np.measure import traced_peak
from tinyattn_np.memory import attention_backward_flops, attention_flops
from tinyattn_np.mpi_job import StopTogether, idle_wait, load_mpi
from tinyattn_np.peaks import sequence_parallel_bytes
from tinyattn_np.report import (
    Checklist,
    add_seed_and_format,
    add_wide_argument,
    column_unit,
    fit_table,
    format_sig,
    max_diff,
    positive,
    table_width,
)
from tinyattn_np.ring import ring_attention, ring_attention_backward, tile_counts
from tinyattn_np.shards import unshard
from tinyattn_np.ulysses import ulysses_attention, ulysses_attention_backward

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts
import limits
import machine
import mpi_runs
import outputs

# gathered output and gradients against one process: the tests' tolerances (tests/ring_worker.py)
TOLERANCE = {"float64": (1e-10, 1e-10), "float32": (1e-4, 1e-5), "float16": (2e-3, 2e-3)}
SCHEMES = {  # name: (forward, backward, layout)
    "ring zigzag": (ring_attention, ring_attention_backward, "zigzag"),
    "ring contiguous": (ring_attention, ring_attention_backward, "contiguous"),
    "ulysses": (ulysses_attention, ulysses_attention_backward, "zigzag"),
}
PROCESSES = (2, 4, 8, 16, 32, 64)  # section 1's rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tokens, heads, workers = (positive(int, most) for most in (limits.MAX_TOKENS, limits.MAX_HEADS, limits.MAX_WORKERS))
    p.add_argument("--tokens", type=tokens, default=4096, help="T, the whole sequence (default 4096)")
    p.add_argument("--heads", type=heads, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=heads, default=None, help="key/value heads (default --heads)")
    p.add_argument("--head-dim", type=heads, default=64, help="E, channels per head (default 64)")
    p.add_argument("--dtype", choices=list(mpi_runs.DTYPES), default="float32", help="inputs' dtype (default float32)")
    p.add_argument("--block", type=tokens, default=DEFAULT_BLOCK_Q, help=f"tile side (default {DEFAULT_BLOCK_Q})")
    p.add_argument("--workers", type=workers, default=1, help="threads per rank (default 1: a rank per core)")
    p.add_argument(
        "--reference-workers",
        type=workers,
        default=os.cpu_count() or 1,
        help="threads of the one process it is timed against (default: the CPU count)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the one-process run and the comparison")
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="timed runs per figure, the median shown (default 3)",
    )
    p.add_argument(
        "--model",
        default="llama-3-8b",
        help="section 1's model: a preset or a config.json (default llama-3-8b)",
    )
    p.add_argument(
        "--model-tokens",
        type=positive(int, 2**40),
        default=2**20,
        help="section 1's tokens (default 1,048,576)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_wide_argument(p)
    add_seed_and_format(p, "the random q, k, v and dout")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    try:
        args.shape = load_model_shape(args.model)
    except (OSError, ValueError, TypeError) as err:
        p.error(f"--model {args.model}: {err}")
    outputs.check_output(p, "--json", args.json)
    return args


def check_size(args: argparse.Namespace, size: int) -> str | None:
    """What keeps the flags from running on `size` ranks (None when nothing does): tokens that the zigzag
    split cannot cut, arrays that do not fit on rank 0, or a run that cannot end within the time limit."""
    if args.tokens % (2 * size):
        return f"--tokens {args.tokens:,} cannot be cut into {2 * size} equal chunks (zigzag, {size} ranks)"
    per_token = (args.heads * 9 + args.kv_heads * 6) * args.head_dim  # q, dout, out, dq, ... and k, v, dk, dv
    # rank 0: inputs, outputs, gathered
    held = args.tokens * per_token * np.dtype(mpi_runs.DTYPES[args.dtype]).itemsize
    problem = limits.memory_problem(held, f"--tokens {args.tokens:,}", "lower --tokens or --heads", " on rank 0")
    if problem:
        return problem
    sizes = dict(heads=args.heads, head_dim=args.head_dim, causal=True)
    flops = attention_flops(args.tokens, **sizes) + attention_backward_flops(args.tokens, **sizes)
    runs = len(SCHEMES) * (args.repeats + 1) / size + (0 if args.no_reference else args.repeats)
    rate = machine.matmul_rate("float64" if args.dtype == "float64" else "float32", n=1024, repeats=3)
    return limits.time_problem(runs * flops, rate, "lower --tokens or --repeats")


# --- 1) the bytes, by formula ------------------------------------------------------------------------------


def bytes_section(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """1) what one process sends for --model at --model-tokens tokens, both schemes (bf16, all layers)."""
    model, tokens = args.shape, args.model_tokens
    sizes = dict(heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim, layers=model.layers, dtype="bf16")
    rows, body = [], []
    for processes in (p for p in PROCESSES if tokens % p == 0):
        row: dict[str, Any] = {
            "processes": processes,
            "ring": sequence_parallel_bytes(tokens, processes, scheme="ring", **sizes),
        }
        if model.heads % processes == 0 and model.kv_heads % processes == 0:
            row["ulysses"] = sequence_parallel_bytes(tokens, processes, scheme="ulysses", **sizes)
        rows.append(row)
        cells = [row[s][d] / 2**30 if s in row else None for s in ("ring", "ulysses") for d in ("forward", "backward")]
        body.append([str(processes), f"{tokens // processes:,}", *("-" if c is None else f"{c:,.1f}" for c in cells)])
    print(
        f"\n1) GiB one process sends: {model.name} ({model.layers} layers, {model.heads} query heads, "
        f"{model.kv_heads} kv heads of {model.head_dim}, bf16) at {tokens:,} tokens"
    )
    headers = ["processes", "tokens each", "ring forward", "ring backward", "Ulysses forward"]
    headers += ["Ulysses backward"]
    print(fit_table(body, headers, args.format, table_width(args)))
    print(f"   -: Ulysses splits the heads, and {model.kv_heads} kv heads do not split over that many processes")
    report["bytes"] = {"model": model.name, "tokens": tokens, "rows": rows}


# --- 2), 3) the schemes on every rank --------------------------------------------------------------------


def run_scheme(
    comm: Any, args: argparse.Namespace, name: str, full: dict[str, np.ndarray] | None, ctrl_c: StopTogether
) -> dict[str, Any]:
    """Scatter the shards from rank 0, run the scheme's forward and backward once under tracemalloc (first:
    it warms the caches too) and --repeats times timed: every rank's figures, and its output and gradients,
    gathered on rank 0."""
    forward, backward, layout = SCHEMES[name]
    MAX = load_mpi().MAX
    mine = mpi_runs.scatter_shards(comm, full, layout)  # q, k, v, dout: (1, H, T/P, E) each
    settings = dict(comm=comm, causal=True, layout=layout, block_q=args.block, block_k=args.block, workers=args.workers)

    def both() -> tuple[Any, ...]:
        """The forward and the backward, each started together on every rank (a rank's time then includes
        waiting for the slower ones, but not for their forward): the results and the two times."""
        comm.Barrier()
        started = time.perf_counter()
        out, lse, forward_stats = forward(
            mine["q"], mine["k"], mine["v"], return_lse=True, return_stats=True, **settings
        )
        forward_seconds = time.perf_counter() - started
        comm.Barrier()
        started = time.perf_counter()
        *grads, backward_stats = backward(
            mine["q"], mine["k"], mine["v"], out, mine["dout"], lse, return_stats=True, **settings
        )
        return out, grads, forward_stats, backward_stats, (forward_seconds, time.perf_counter() - started)

    _, peak = traced_peak(both)  # first: it warms the caches for the timed runs too
    seconds, walls = [], []
    for _ in range(args.repeats):
        out, grads, forward_stats, backward_stats, times = both()
        seconds.append(times)
        walls.append(tuple(comm.allreduce(t, op=MAX) for t in times))  # a pass is done when its last rank is
        if ctrl_c.stop(comm):
            raise KeyboardInterrupt
    figures = rank_figures(comm, args, name, (forward_stats, backward_stats), peak, seconds)
    return {
        "ranks": comm.gather(figures, root=0),
        "parts": [comm.gather(x, root=0) for x in (out, *grads)],
        "wall_forward_ms": 1e3 * statistics.median(w[0] for w in walls),
        "wall_ms": 1e3 * statistics.median(w[0] + w[1] for w in walls),
        "busy": machine.busy_reasons(),
    }


def rank_figures(
    comm: Any, args: argparse.Namespace, name: str, stats: tuple[Any, Any], peak: int, seconds: list[tuple[float, ...]]
) -> dict[str, Any]:
    """This rank's figures of a scheme (stats: its forward's and backward's): the tiles it computed and
    counted, its peak, its times and waits, the bytes it sent beside the formula's."""
    rank, size, layout = comm.Get_rank(), comm.Get_size(), SCHEMES[name][2]
    forward_stats, backward_stats = stats
    formula = sequence_parallel_bytes(
        args.tokens,
        size,
        scheme=name.split()[0],
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
    )
    figures = {
        "rank": rank,
        "tiles": backward_stats.tiles,
        "peak_bytes": peak,
        "forward_ms": 1e3 * statistics.median(s[0] for s in seconds),
        "backward_ms": 1e3 * statistics.median(s[1] for s in seconds),
        "forward_wait_ms": 1e3 * forward_stats.wait_seconds,
        "backward_wait_ms": 1e3 * backward_stats.wait_seconds,
        "forward_sent": forward_stats.bytes_sent,
        "backward_sent": backward_stats.bytes_sent,
        "formula_forward": formula["forward"],
        "formula_backward": formula["backward"],
        "counted_tiles": tile_counts(
            args.tokens, size, layout=layout, causal=True, block_q=args.block, block_k=args.block
        )[rank]["tiles"],
    }
    return figures


def rank_rows(runs: dict[str, Any], names: list[str], cells: Any) -> list[list[str]]:
    """One row per scheme and rank, its cells from cells(figures)."""
    return [[name, str(r["rank"]), *cells(r)] for name in names if name in runs for r in runs[name]["ranks"]]


def backward_section(runs: dict[str, Any], args: argparse.Namespace, check: Checklist) -> None:
    """2) the ring's backward, per layout and rank, checked: tiles as counted, bytes as the formula says."""
    names = [name for name in ("ring zigzag", "ring contiguous") if name in runs]
    every = [r for name in names for r in runs[name]["ranks"]]
    u = column_unit([r["backward_sent"] for r in every], "binary")
    u_peak = column_unit([r["peak_bytes"] for r in every], "binary")
    body = rank_rows(
        runs,
        names,
        lambda r: [
            f"{r['tiles']:,}",
            f"{r['backward_ms']:,.1f}",
            f"{r['backward_wait_ms']:,.1f}",
            format_sig(to_unit(r["backward_sent"], u)),
            format_sig(to_unit(r["formula_backward"], u)),
            format_sig(to_unit(r["peak_bytes"], u_peak)),
        ],
    )
    print("\n2) the ring's backward, per rank (the K/V blocks and their dK/dV accumulators go round; peak =")
    print("   tracemalloc's, over a forward and its backward)")
    headers = ["layout", "rank", "tiles", "backward ms", "waiting ms", f"sent ({u})", f"formula ({u})"]
    headers += [f"peak ({u_peak})"]
    print(fit_table(body, headers, args.format, table_width(args)))
    for name in names:
        tiles = [r["tiles"] for r in runs[name]["ranks"]]
        print(f"   {name}: busiest rank's tiles / mean = {max(tiles) / statistics.mean(tiles):.3f}")
        for r in runs[name]["ranks"]:
            check(r["tiles"] == r["counted_tiles"], f"{name} rank {r['rank']}: backward tiles == tile_counts'")
    if "ring zigzag" in runs:
        tiles = [r["tiles"] for r in runs["ring zigzag"]["ranks"]]
        check(
            max(tiles) <= 1.05 * statistics.mean(tiles),
            "zigzag backward: busiest rank within 1.05x of the mean",
        )


def versus_section(runs: dict[str, Any], args: argparse.Namespace, check: Checklist) -> None:
    """3) ring (zigzag) against Ulysses, per rank, forward + backward; every scheme's bytes checked."""
    names = [name for name in ("ring zigzag", "ulysses") if name in runs]
    every = [r for name in names for r in runs[name]["ranks"]]
    u = column_unit([r["forward_sent"] + r["backward_sent"] for r in every], "binary")
    u_peak = column_unit([r["peak_bytes"] for r in every], "binary")
    body = rank_rows(
        runs,
        names,
        lambda r: [
            f"{r['forward_ms']:,.1f}",
            f"{r['backward_ms']:,.1f}",
            f"{r['forward_wait_ms'] + r['backward_wait_ms']:,.1f}",
            format_sig(to_unit(r["forward_sent"] + r["backward_sent"], u)),
            format_sig(to_unit(r["formula_forward"] + r["formula_backward"], u)),
            format_sig(to_unit(r["peak_bytes"], u_peak)),
        ],
    )
    print("\n3) ring (zigzag) against Ulysses, per rank, forward + backward (waiting: in the ring's waits, or in")
    print("   Ulysses' all-to-alls, packing included)")
    headers = ["scheme", "rank", "forward ms", "backward ms", "waiting ms", f"sent ({u})", f"formula ({u})"]
    headers += [f"peak ({u_peak})"]
    print(fit_table(body, headers, args.format, table_width(args)))
    for name, run in runs.items():
        for r in run["ranks"]:
            exact = (r["forward_sent"], r["backward_sent"]) == (r["formula_forward"], r["formula_backward"])
            check(exact, f"{name} rank {r['rank']}: bytes sent, forward and backward == sequence_parallel_bytes")


# --- 4) against one process ------------------------------------------------------------------------------


def reference_run(args: argparse.Namespace, full: dict[str, np.ndarray]) -> dict[str, Any]:
    """One process on rank 0:
    median ms of flash_attention and of flash_attention_backward, and the results."""
    settings = dict(causal=True, block_q=args.block, block_k=args.block, workers=args.reference_workers)
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        out, lse = flash_attention(full["q"], full["k"], full["v"], return_lse=True, **settings)
        middle = time.perf_counter()
        grads = flash_attention_backward(full["q"], full["k"], full["v"], out, full["dout"], lse, **settings)
        seconds.append((middle - started, time.perf_counter() - middle))
    forward_ms, backward_ms = (1e3 * statistics.median(s[i] for s in seconds) for i in (0, 1))
    return {"forward_ms": forward_ms, "backward_ms": backward_ms, "results": [out, *grads]}


def wall_section(
    runs: dict[str, Any],
    reference: dict[str, Any] | None,
    args: argparse.Namespace,
    check: Checklist,
    report: dict[str, Any],
) -> None:
    """4) each scheme's wall time against one process, and the largest difference from its results."""
    size = len(next(iter(runs.values()))["ranks"])
    print("\n4) wall time (the slowest rank), forward + backward, against one process")
    if reference is not None:
        print(
            f"   one process: flash_attention + flash_attention_backward with {args.reference_workers} worker(s): "
            f"{reference['forward_ms']:,.1f} + {reference['backward_ms']:,.1f} ms"
        )
    body, summary = [], []
    for name, run in runs.items():
        tiles = [r["tiles"] for r in run["ranks"]]
        row = [
            name,
            f"{run['wall_forward_ms']:,.1f}",
            f"{run['wall_ms']:,.1f}",
            f"{max(tiles) / statistics.mean(tiles):.3f}",
        ]
        entry = {
            "scheme": name,
            "wall_forward_ms": run["wall_forward_ms"],
            "wall_ms": run["wall_ms"],
            "busy": run["busy"],
        }
        if reference is not None:
            rtol, atol = TOLERANCE[args.dtype]
            layout = SCHEMES[name][2]
            mine = [unshard(parts, layout=layout) for parts in run["parts"]]
            diff = max(max_diff(a, b) for a, b in zip(mine, reference["results"], strict=True))
            close = all(
                np.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(mine, reference["results"], strict=True)
            )
            check(close, f"{name}: gathered out, dq, dk, dv == one process's")
            ratio = run["wall_ms"] / (reference["forward_ms"] + reference["backward_ms"])
            row += [f"{ratio:.2f}", f"{diff:.2e}"]
            entry.update(ratio=ratio, max_abs_diff=diff)
        body.append(row)
        summary.append(entry)
    headers = ["scheme", "forward wall ms", "forward + backward wall ms", "busiest/mean tiles"]
    if reference is not None:
        headers += ["/ one process", "max |diff|"]
    print(machine.marked_table(body, summary, headers, args.format, lambda row: row["scheme"], width=table_width(args)))
    if "ring zigzag" in runs and "ring contiguous" in runs:
        ratio = runs["ring contiguous"]["wall_ms"] / runs["ring zigzag"]["wall_ms"]
        print(f"   contiguous / zigzag wall time: {ratio:.2f}")
    mpi_runs.say_if_time_shared(size)
    report["summary"] = summary


# --- the program -------------------------------------------------------------------------------------------


def run_schemes(comm: Any, args: argparse.Namespace, runs: dict[str, Any]) -> None:
    """Every scheme on every rank (Ulysses where the heads split), into runs; Ctrl-C: KeyboardInterrupt on
    every rank after the same call."""
    size, full = comm.Get_size(), None
    if comm.Get_rank() == 0:
        full = mpi_runs.draw_inputs(args, {"q": args.heads, "k": args.kv_heads, "v": args.kv_heads, "dout": args.heads})
        runs["inputs"] = full
    with StopTogether() as ctrl_c:
        for name in SCHEMES:
            if name == "ulysses" and (args.heads % size or args.kv_heads % size):
                continue  # Ulysses' limit: said under the tables
            runs[name] = run_scheme(comm, args, name, full, ctrl_c)
            outputs.progress(f"  {name}: done") if comm.Get_rank() == 0 else None


def main(argv: list[str] | None = None) -> int:
    ready = mpi_runs.setup(argv, parse_args, check_size, "sequence_parallel.py")
    if isinstance(ready, int):
        return ready
    comm, args = ready
    rank, size = comm.Get_rank(), comm.Get_size()
    threadpool_limits(limits=1, user_api="blas")  # one BLAS thread per rank, as the schemes hold it
    check, runs, report = Checklist(), {}, {"ranks": size, "args": {k: str(v) for k, v in vars(args).items()}}
    if rank == 0:
        report["machine"], lines = machine.header()
        print(lines)
        print(
            f"{size} rank(s): T = {args.tokens:,} tokens, 1 sequence, {args.heads} query heads and "
            f"{args.kv_heads} kv heads of {args.head_dim}, {args.dtype}, causal;\ntiles {args.block} x {args.block}, "
            f"{args.workers} thread(s) per rank; times are the median of {args.repeats}"
        )
        bytes_section(args, report)
    try:
        run_schemes(comm, args, runs)
    except KeyboardInterrupt:
        return stop_all(comm, args, runs, report)
    full = runs.pop("inputs", None)
    reference = reference_run(args, full) if rank == 0 and full is not None and not args.no_reference else None
    idle_wait(comm)  # the other ranks sleep meanwhile, so that the one process has every core
    if rank == 0:
        print_sections(runs, reference, args, check, report)
    return int(comm.bcast(check.finish() if rank == 0 else 0, root=0))


def print_sections(
    runs: dict[str, Any],
    reference: dict[str, Any] | None,
    args: argparse.Namespace,
    check: Checklist,
    report: dict[str, Any],
    stopped: bool = False,
) -> None:
    """Sections 2 to 4 on rank 0, the JSON (stopped: Ctrl-C cut the run short),
    and a word on what did not run."""
    size = len(next(iter(runs.values()))["ranks"])
    backward_section(runs, args, check)
    versus_section(runs, args, check)
    if "ulysses" not in runs and (args.heads % size or args.kv_heads % size):
        print(
            f"   Ulysses did not run: {args.heads} query heads and {args.kv_heads} kv heads do not both split over "
            f"{size} ranks (its limit; the ring has none)"
        )
    wall_section(runs, reference, args, check, report)
    report["ranks_figures"] = {name: run["ranks"] for name, run in runs.items()}
    if args.json:
        outputs.write_json(args.json, report, stopped=stopped)
    if size == 1:
        print(
            "\nran 1 rank: one rank sends nothing and waits for nobody; for 2: mpiexec -n 2 python "
            "scripts/sequence_parallel.py"
        )


def stop_all(comm: Any, args: argparse.Namespace, runs: dict[str, Any], report: dict[str, Any]) -> int:
    """Ctrl-C, seen by every rank after the same call: rank 0 says what was measured; every rank exits 130."""
    if comm.Get_rank() != 0:
        return interrupts.INTERRUPTED
    runs.pop("inputs", None)
    report["done"] = list(runs)
    if runs:  # the schemes that ran to the end, without the one-process run
        print_sections(runs, None, args, Checklist(), report, stopped=True)
    elif args.json:
        outputs.write_json(args.json, report, stopped=True)
    return interrupts.interrupted(len(runs), len(SCHEMES), "schemes")


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
