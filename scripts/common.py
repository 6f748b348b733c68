"""What the scripts share: timing, the machine and code lines, the busy-machine check, the run estimate,
Ctrl-C, output paths, the torch and MPI imports, and the attention benchmark's flags and inputs.

A script imports it as the module `common` and calls its helpers by that name, so that a reader sees which
calls are the scripts' shared machinery and which are the library:

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py sits beside this script
    import common

    common.progress(f"T = {T}")
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from textwrap import fill
from types import SimpleNamespace
from typing import Any

import numpy as np

import tinyattn_np
from tinyattn_np import attention, best_unit, flash_attention, flash_attention_bytes, format_bytes, to_unit
from tinyattn_np.measure import memory_available, memory_total
from tinyattn_np.mpi_job import idle_wait, load_mpi  # noqa: F401  (the scripts call them as common's)
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q
from tinyattn_np.measure import machine_info, median_ms
from tinyattn_np.report import (  # noqa: F401  (table, text_table: the scripts call them as common's too)
    TABLE_WIDTH,
    add_format_argument,
    fit_table,
    format_duration,
    nonnegative_seed,
    positive,
    table,
    text_table,
)

TORCH_INSTALL_HINT = "bash torch_crosscheck/install_torch_cpu.sh"  # torch 2.13.0+cpu, never the CUDA build
MiB = 2**20
SETTLE_SECONDS = 0.3  # idle before each timed figure (settled_median_ms says why)
MAX_MINUTES = 30  # a run whose lower-bound time is longer is refused before it starts
SAY_SECONDS = 10  # a run whose lower-bound time is longer says how long before it starts
RATE_DRIFT = 0.20  # a row whose matmul rate moved more than this from the run's first is marked
INTERRUPTED = 130  # the exit code of a program stopped by Ctrl-C: 128 + SIGINT
# each size flag's largest value: past it no run of these scripts fits one machine, refused by the flag itself
MAX_TOKENS, MAX_HEADS, MAX_WORKERS, MAX_REPEATS = 2**22, 1024, 256, 1000


# ---------------------------------------------------------------------------------------------------
# printing and timing


def progress(message: str) -> None:
    """A progress line on stderr, so that stdout holds only the tables."""
    print(message, file=sys.stderr, flush=True)


def max_diff(a: Any, b: Any) -> float:
    """max |a - b| in float64, 0.0 for empty arrays."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def settled_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """median_ms after a short idle: OpenBLAS and torch's OpenMP threads busy-wait for a while after
    each call, and on a 2-core machine those spinning threads would slow the next library's first
    runs. Each figure starts once the previous library's threads have gone to sleep, and two untimed
    calls then wake its own threads (the first call after a sleep pays for waking them)."""
    time.sleep(SETTLE_SECONDS)
    return median_ms(fn, repeats, warmup=2)


def matmul_rate(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one n x n matmul on all BLAS threads: the machine's ceiling for this dtype, now (after the
    same short idle as settled_median_ms, so that no other library's threads are still spinning)."""
    a = np.random.default_rng(1).standard_normal((n, n)).astype(dtype)
    time.sleep(SETTLE_SECONDS)
    return 2 * n**3 / median_ms(lambda: a @ a, repeats) / 1e6


# ---------------------------------------------------------------------------------------------------
# which machine and which code printed a table


def code_version() -> str:
    """'tinyattn_np 0.1.0, git 1e80941' ('-dirty' added when tracked files have changes), or
    'tinyattn_np 0.1.0, not a git checkout': which code printed a table that someone quotes."""
    version = f"tinyattn_np {tinyattn_np.__version__}"
    checkout = Path(tinyattn_np.__file__).resolve().parent.parent  # the folder that holds the package

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "--short", "HEAD")
    if top is None or head is None or Path(top).resolve() != checkout:
        return f"{version}, not a git checkout"
    changes = git("status", "--porcelain", "--untracked-files=no")
    return f"{version}, git {head}{'-dirty' if changes else ''}"


def header(torch_version: str | None = None, threads: int | None = None) -> tuple[dict[str, Any], str]:
    """(machine_info(), the header lines every benchmark prints: the machine, its BLAS (and torch), the code)."""
    info = machine_info()
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} {b['architecture']} kernels ({b['num_threads']} threads)"
        for b in info["blas"]
    )
    torch = f"\ntorch: {torch_version} ({threads} threads)" if torch_version else ""
    machine = f"machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, NumPy {info['numpy']}"
    return info, f"{machine}\nBLAS: {blas}{torch}\ncode: {code_version()}"  # a line each: each fits a terminal


# ---------------------------------------------------------------------------------------------------
# a busy machine: the figures of a row measured beside other work are marked, and the table says why


def load_average() -> float | None:
    """The 1-minute load average (processes running or waiting for a core), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_reasons(rate: float | None = None, first_rate: float | None = None) -> list[str]:
    """Why a row's figures may not compare with the others: its matmul rate moved more than RATE_DRIFT
    from the run's first, or more processes want a core than there are cores."""
    reasons = []
    if rate is not None and first_rate and abs(rate / first_rate - 1) > RATE_DRIFT:
        reasons.append(f"matmul rate {rate:.1f} GFLOP/s, {rate / first_rate - 1:+.0%} from the run's first")
    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and round(load, 1) > cores:  # as printed: "2.0 on 2 cores" is not over
        reasons.append(f"load average {load:.1f} on {cores} cores")
    return reasons


def mark_busy(body: list[list[str]], rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table's rows with ' *' after the first cell of each row measured on a busy machine."""
    return [[f"{line[0]} *", *line[1:]] if row.get("busy") else line for line, row in zip(body, rows, strict=True)]


def busy_note(rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> str | None:
    """The lines under a table that say why its marked rows are marked (None when none is), each within TABLE_WIDTH."""
    marked = [fill(f"{label(row)}: {'; '.join(row['busy'])}", TABLE_WIDTH, initial_indent="  ",
                   subsequent_indent="    ") for row in rows if row.get("busy")]  # fmt: skip
    if not marked:
        return None
    return "\n".join(["* measured on a busy machine: compare these rows with care", *marked])


def beside_the_row(dtype: str, first_rate: float, n: int = 2048) -> dict[str, Any]:
    """What a row records of the machine: the matmul rate measured now, and busy_reasons against the first."""
    rate = matmul_rate(dtype, n=n, repeats=5 if n >= 2048 else 3)
    return {"matmul_gflops": rate, "busy": busy_reasons(rate, first_rate)}


def marked_table(body: list[list[Any]], rows: list[dict[str, Any]], headers: list[str], fmt: str,
                 label: Callable[[dict[str, Any]], str] | None = None, *, floatfmt: str | None = None,
                 width: int | None = None) -> str:  # fmt: skip
    """A table of formatted cells (or, with floatfmt, of numbers) with its busy rows marked '*', split into
    parts of at most `width` columns of text (report.fit_table; None: whole), and under it the lines that say
    why rows are marked (label(row) names a row; default: its T)."""
    text = fit_table(mark_busy(body, rows), headers, fmt, width, floatfmt)
    note = busy_note(rows, label or (lambda row: f"T={row['tokens']:,}"))
    return text if note is None else f"{text}\n{note}"


# ---------------------------------------------------------------------------------------------------
# Ctrl-C: what was measured is printed and kept, one line says so, the exit code is 130


def measure_each(items: Iterable[Any], measure: Callable[[Any], Any], rows: list[Any]) -> bool:
    """rows.append(measure(item)) for each item; True when Ctrl-C stopped it (the rows so far stay)."""
    try:
        for item in items:
            rows.append(measure(item))
    except KeyboardInterrupt:
        return True
    return False


def interrupted(done: int, total: int, what: str = "rows") -> int:
    """Say that Ctrl-C stopped the run after `done` of `total`; the exit code to return."""
    print(f"interrupted (Ctrl-C) after {done} of {total} {what}: the figures above are all that was measured")
    return INTERRUPTED


def run_main(main: Callable[[], int]) -> int:
    """A script's entry point: main()'s exit code, or 130 and one line, no traceback, on a Ctrl-C that
    main did not catch itself (before its first row)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) before anything was measured", file=sys.stderr)
        return INTERRUPTED


# ---------------------------------------------------------------------------------------------------
# the whole run, estimated up front: refused before it starts, not killed in the middle


def memory_problem(needed: float, what: str, lower: str, detail: str = "") -> str | None:
    """Why `needed` bytes are too many for this machine (None when they fit): more than half of its memory,
    or more than is free now. The message: "{what} needs about {needed}{detail}, more than ...: {lower}"."""
    total, free = memory_total(), memory_available()
    if needed <= min(total / 2, free):
        return None
    unit = best_unit(total)  # the machine's unit, so that the two figures compare at a glance
    return (
        f"{what} needs about {to_unit(needed, unit):,.1f} {unit}{detail}, more than half of this machine's "
        f"{format_bytes(total)} or the {format_bytes(free)} free now: {lower}"
    )


def time_problem(flops: float, rate: float, lower: str, overhead_seconds: float = 0.0, how: str = "") -> str | None:
    """Why a run of `flops` (and `overhead_seconds` of Python bookkeeping, timed on a small case) cannot end
    within MAX_MINUTES even at the matmul rate; None when it can, and then, for a run of SAY_SECONDS or more,
    lines on stderr that say how long it takes at least. Nothing here runs at the matmul rate, so the time is
    a lower bound: a run refused is surely too long. how: what the time counts, where not FLOPs."""
    seconds = flops / (rate * 1e9) + overhead_seconds
    if not how:
        how = f"{flops:.2e} FLOP at this machine's {rate:.1f} GFLOP/s matmul rate"
        if overhead_seconds >= 1:
            how += f", and {format_duration(overhead_seconds)} of bookkeeping, timed on a small case here"
    if seconds > 60 * MAX_MINUTES:
        minutes = f"{seconds / 60:,.0f} minutes"
        return f"this run needs at least {minutes} ({how}), over the {MAX_MINUTES}-minute limit: {lower}"
    if seconds >= SAY_SECONDS:
        progress(f"this run takes at least {format_duration(seconds)}; Ctrl-C stops it and keeps what was measured\n"
                 f"  ({how})")  # fmt: skip
    return None


# ---------------------------------------------------------------------------------------------------
# output files


def check_output(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse now, not after the run, a --json or --plot PATH that cannot be written."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        p.error(f"{flag} {path} is a folder: give a file name in it")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        p.error(f"{flag} {path}: the folder {folder} does not exist or is not writable (give a file name in a "
                "folder that exists)")  # fmt: skip


def git_tracks(path: str) -> bool:
    """Whether git tracks the file at path (False outside a checkout or without git)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        command = ["git", "-C", folder, "ls-files", "--error-unmatch", os.path.basename(path)]
        done = subprocess.run(command, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def add_plot_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", metavar="PATH.png", help=f"draw {what} (needs the plot extra)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --plot replace a picture that git tracks (such as docs/*.png); without it --plot refuses, so "
        "that a committed picture is only regenerated on purpose",
    )


def check_plot(p: argparse.ArgumentParser, path: str | None, overwrite: bool) -> None:
    """--plot: a writable path, matplotlib importable, and no tracked picture replaced by accident."""
    if path is None:
        return
    check_output(p, "--plot", path)
    if os.path.exists(path) and not overwrite and git_tracks(path):
        p.error(f"--plot {path}: git tracks this picture; add --overwrite to replace it")
    try:
        import matplotlib  # noqa: F401  (only to know now that the plot can be drawn)
    except ImportError:
        p.error("--plot needs matplotlib: pip install -e '.[plot]'")


def write_json(path: str, figures: dict[str, Any], stopped: bool = False) -> None:
    """Every figure, the code version and whether Ctrl-C cut the run short, as JSON at path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**figures, "code": code_version(), "interrupted": stopped}, f, indent=2, default=str)
    print(f"figures written to {path}")


# ---------------------------------------------------------------------------------------------------
# optional libraries


def load_torch(threads: int | None = None, flag: str = "--torch") -> tuple[Any, Any]:
    """(torch, torch.nn.functional) on `threads` threads (default: every core); exit with the install
    line where torch is missing."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit(f"error: {flag} needs torch; install its CPU build with: {TORCH_INSTALL_HINT}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return torch, F


def optional_torch() -> Any:
    """torch where it is installed, else None (tinyattn_np never needs it; a demo uses it as a witness)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


# ---------------------------------------------------------------------------------------------------
# the attention benchmarks (scaling.py, torch_naive.py, tiles.py, scaling_backward.py)


def add_seed_and_format(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The two flags every script takes: --seed (an int >= 0) and --format (any of tabulate's)."""
    p.add_argument("--seed", type=nonnegative_seed, default=0, help=f"seed for {seed_help} (an int >= 0; default 0)")
    add_format_argument(p)


def add_shape_arguments(p: argparse.ArgumentParser, *, tokens_range: bool = True, repeats: int = 5) -> None:
    """The flags every attention benchmark takes: T, the heads, the dtype, the mask, repeats, seed, format."""
    if tokens_range:
        p.add_argument("--max-tokens", type=positive(int, MAX_TOKENS), default=8192, help="largest T (default 8192)")
        p.add_argument("--min-tokens", type=positive(int, MAX_TOKENS), default=256,
                       help="smallest T; it doubles (default 256)")  # fmt: skip
    p.add_argument("--heads", type=positive(int, MAX_HEADS), default=4, help="attention heads (default 4)")
    p.add_argument("--head-dim", type=positive(int, MAX_HEADS), default=64, help="E, channels per head (default 64)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="q, k, v dtype (default float32)")
    p.add_argument("--no-causal", action="store_true", help="no mask: every tile runs")
    p.add_argument("--repeats", type=positive(int, MAX_REPEATS), default=repeats,
                   help=f"timed runs per figure (default {repeats})")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_seed_and_format(p, "the random q, k, v")


def add_flash_arguments(p: argparse.ArgumentParser, *, per_step: bool = True) -> None:
    """flash_attention's knobs: workers, tile sides and (forward only: per_step) kv heads per tile step."""
    p.add_argument("--workers", type=positive(int, MAX_WORKERS), default=None,
                   help="flash worker threads (default: CPU count)")  # fmt: skip
    more_cores = f", {2 * DEFAULT_BLOCK_Q} on over 8 cores" if per_step else ""  # the backward's stays on any cores
    rule = f"{DEFAULT_BLOCK_Q}{more_cores}, less for a short causal T: flash.default_tiles, flash.diagonal_side"
    block = positive(int, MAX_TOKENS)
    p.add_argument("--block-q", type=block, default=None, help=f"flash query block (default {rule})")
    p.add_argument("--block-k", type=block, default=None, help=f"flash key block (default {rule})")
    if per_step:
        p.add_argument(
            "--kv-heads-per-step", type=positive(int, MAX_HEADS), default=None,
            help="kv heads (each with its query heads) in one batched matmul per flash tile step (default: as many "
            "as fit in 2^18 scores, 2^19 on more than 8 cores: flash.default_tiles)",
        )  # fmt: skip


def add_budget_argument(p: argparse.ArgumentParser) -> None:
    ram = memory_total() / 2**30
    p.add_argument(
        "--mem-budget", type=positive(float, round(ram, 1)), default=None,
        help=f"GiB the naive path may use, at most this machine's {ram:.1f}; rows over it are skipped (default: a "
        "quarter of it)",
    )  # fmt: skip


def naive_budget(args: argparse.Namespace) -> float:
    """Bytes the naive path may take (--mem-budget, default a quarter of the RAM): rows over it are skipped."""
    return args.mem_budget * 2**30 if args.mem_budget is not None else memory_total() / 4


def check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace, T: int, flag: str = "--max-tokens") -> None:
    """Refuse up front a T (or --min-tokens over --max-tokens) whose inputs and flash working memory alone
    need more than this machine can give (NumPy would fail in the middle instead), and a --json PATH that
    cannot be written."""
    if getattr(args, "min_tokens", T) > T:
        p.error(f"--min-tokens ({args.min_tokens}) must not exceed --max-tokens ({T})")
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=not args.no_causal)
    inputs = 3 * args.heads * T * args.head_dim * np.dtype(args.dtype).itemsize  # q, k, v: (H, T, E) each
    blocks = {name: getattr(args, name, None) for name in ("block_q", "block_k", "workers", "kv_heads_per_step")}
    what = f"T={T:,} with {args.heads} heads x {args.head_dim} ({args.dtype})"
    needed = inputs + flash_attention_bytes(T, **dims, **blocks)
    problem = memory_problem(needed, what, f"lower {flag}, --heads or --head-dim", " for q, k, v and flash alone")
    if problem:
        p.error(problem)
    check_output(p, "--json", args.json)


def doubling(min_tokens: int, max_tokens: int) -> list[int]:
    """min_tokens, 2·min_tokens, ... up to max_tokens."""
    return [min_tokens << i for i in range((max_tokens // min_tokens).bit_length())]


def growth(times: list[float]) -> str:
    """Time ratio per doubling of T, e.g. '3.24x, 3.95x' ('-' with fewer than two figures)."""
    return ", ".join(f"{b / a:.2f}x" for a, b in zip(times, times[1:], strict=False)) or "-"


def growth_line(rows: list[dict[str, Any]], key: str) -> str:
    """growth() of the rows' figures under key, skipping rows where it was not measured."""
    return growth([r[key] for r in rows if r.get(key) is not None])


def make_qkv(rng: np.random.Generator, T: int, args: argparse.Namespace) -> tuple[np.ndarray, ...]:
    shape = (1, args.heads, T, args.head_dim)  # (B, H, T, E): torch's fast CPU path needs 4-D
    return tuple(rng.standard_normal(shape, dtype=np.dtype(args.dtype)) for _ in range(3))


def check_agreement(args: argparse.Namespace, causal: bool, workers: int | None = None) -> float:
    """Naive vs flash on a 64-token slice; stop with an error if they disagree."""
    q, k, v = make_qkv(np.random.default_rng(args.seed), 64, args)
    naive = attention(q, k, v, causal=causal)
    flash = flash_attention(q, k, v, causal=causal, block_q=16, block_k=16, workers=workers)
    diff = max_diff(naive, flash)
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    if not diff <= tol:
        sys.exit(f"error: naive and flash disagree on 64 tokens: max |diff| = {diff:.3g} > {tol:g}")
    return diff


def start_benchmark(
    args: argparse.Namespace, run_flops: Callable[..., float], torch_runner: Callable[[int], Any] | None = None
) -> SimpleNamespace:
    """Everything an attention benchmark does before its first row: torch's runner if asked for, naive ==
    flash on 64 tokens, the machine and the code that print the table, the matmul rate, and the refusal of a
    run that cannot end within MAX_MINUTES (run_flops(args, sizes, causal): its FLOPs).

    Returns the run: causal, threads, sizes (each T), info (machine_info()), rate (GFLOP/s), torch (what
    torch_runner(threads) returned first, or None) and torch_version."""
    run = SimpleNamespace(causal=not args.no_causal, threads=getattr(args, "workers", None) or os.cpu_count() or 1)
    run.torch, run.torch_version = torch_runner(run.threads) if torch_runner else (None, None)
    diff = check_agreement(args, run.causal, getattr(args, "workers", None))
    print(f"check: naive == flash on 64 tokens (max |diff| {diff:.2e})")
    run.rate = matmul_rate(args.dtype)
    run.info, lines = header(run.torch_version, run.threads)
    print(lines)
    print(f"{args.dtype} matmul, 2048 x 2048: {run.rate:.1f} GFLOP/s")
    one_size = "tokens" in vars(args)
    run.sizes = [args.tokens] if one_size else doubling(args.min_tokens, args.max_tokens)
    lower = f"lower {'--tokens' if one_size else '--max-tokens'} or --repeats"
    problem = time_problem(run_flops(args, run.sizes, run.causal), run.rate, lower)
    if problem:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {problem}")
    return run


def measure_rows(args: argparse.Namespace, run: SimpleNamespace, items: list[Any], measure_row: Callable[..., Any],
                 print_rows: Callable[..., None], title: str = "") -> int:  # fmt: skip
    """The title, measure_row(item, args, run) for each item, then print_rows(rows, args, run), --json, and
    the exit code: 130 after Ctrl-C, which stops the rows, not what follows (the rows measured are printed
    and kept)."""
    if title:
        print(title)
    rows: list[dict[str, Any]] = []
    stopped = measure_each(items, lambda item: measure_row(item, args, run), rows)
    if rows:
        print_rows(rows, args, run)
    if args.json:
        figures = {"machine": run.info, "matmul_gflops": run.rate, "torch": run.torch_version, "args": vars(args)}
        write_json(args.json, {**figures, **getattr(run, "extra", {}), "results": rows}, stopped)
    return interrupted(len(rows), len(items)) if stopped else 0


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def cell(x: Any) -> str:
    """One table cell: floats to 2 decimals, None (a figure not measured) as "-", the rest as they are."""
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    """python scripts/common.py [--help]: what this module is; it is no program and runs nothing."""
    p = argparse.ArgumentParser(prog="common.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.parse_args(argv)
    progress("common.py is not a program: the scripts beside it import it (python scripts/scaling.py --help)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
