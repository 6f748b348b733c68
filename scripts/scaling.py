"""The quadratic bill, measured: the reference attention() against flash_attention() as T doubles.

    python scripts/scaling.py                      # 1 sequence, 4 heads of 64, causal, float32, T up to 8192
    python scripts/scaling.py --torch              # add torch SDPA on the CPU (same dtype, same threads)
    python scripts/scaling.py --torch-naive        # and the article's CPU table: torch naive vs torch fused
    python scripts/scaling.py --no-causal          # the same without the mask
    python scripts/scaling.py --sweep-blocks 4096  # flash block sizes and worker counts at one T
    python scripts/scaling.py --backward --torch   # flash's backward beside its forward and torch's backward

Every time is the median of --repeats runs after two warm-ups; every peak is what tracemalloc saw in a
separate run, next to tinyattn_np.memory's estimate. Figures are ratios within this one run: the
machine is shared and noisy, so compare columns, not runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from tinyattn_np import attention, flash_attention, flash_attention_backward
from tinyattn_np.flash import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, default_tiles, tile_plan
from tinyattn_np.measure import machine_info, median_ms, memory_total, traced_peak
from tinyattn_np.memory import (
    attention_backward_flops,
    attention_flops,
    flash_attention_backward_bytes,
    flash_attention_bytes,
    naive_attention_bytes,
    score_matrix_bytes,
)
from tinyattn_np.report import add_format_argument, format_bytes, nonnegative_seed, table, text_table

MiB = 2**20
SETTLE_SECONDS = 0.3
MAX_MINUTES = 30  # a run whose lower-bound time is longer is refused before it starts


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def settled_median_ms(fn: Any, repeats: int) -> float:
    """median_ms after a short idle: OpenBLAS and torch's OpenMP threads busy-wait for a while after
    each call, and on a 2-core machine those spinning threads would slow the next library's first
    runs. Each figure starts once the previous library's threads have gone to sleep, and two untimed
    calls then wake its own threads (the first call after a sleep pays for waking them)."""
    time.sleep(SETTLE_SECONDS)
    return median_ms(fn, repeats, warmup=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=8192, help="largest T; T doubles from --min-tokens (default 8192)")
    p.add_argument("--min-tokens", type=int, default=256, help="smallest T (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="E, channels per head (default 64)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="q, k, v dtype (default float32)")
    p.add_argument("--no-causal", action="store_true", help="no mask: every tile runs")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure, after two warm-ups (default 5)")
    p.add_argument("--workers", type=int, default=None, help="flash worker threads (default: CPU count)")
    rule = f"{DEFAULT_BLOCK_Q}, or {2 * DEFAULT_BLOCK_Q} on more than 8 cores: flash.default_tiles"
    p.add_argument("--block-q", type=int, default=None, help=f"flash query block (default {rule})")
    p.add_argument("--block-k", type=int, default=None, help=f"flash key block (default {rule})")
    p.add_argument(
        "--kv-heads-per-step",
        type=int,
        default=None,
        help="kv heads (each with its query heads) in one batched matmul per flash tile step (default: as many as "
        "fit in 2^18 scores, 2^19 on more than 8 cores: flash.default_tiles)",
    )
    p.add_argument(
        "--mem-budget",
        type=float,
        default=None,
        help="GiB the naive path may use; rows over it are skipped (default: a quarter of this machine's RAM)",
    )
    p.add_argument("--torch", action="store_true", help="add a torch SDPA CPU column (needs torch)")
    p.add_argument(
        "--torch-3d",
        action="store_true",
        help="with --torch, also time torch on 3-D (H, T, E) inputs, which its CPU backend sends to the slow math path",
    )
    p.add_argument(
        "--torch-naive",
        action="store_true",
        help="implies --torch; also time the article's naive torch code (causal masked_fill, softmax, @ v) and "
        "print the article's CPU table, torch naive vs torch fused, beside ours",
    )
    p.add_argument(
        "--sweep-blocks",
        type=int,
        metavar="T",
        default=None,
        help="instead of the table: time flash at T for square tiles of 128 to 1024, 1, 2 or 4 heads per tile step and "
        "1 or all workers, and measure each tile step's interpreter-held time against its work (the many-core model)",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="instead of the table: flash_attention_backward as T doubles, beside flash's forward, its GFLOP/s, "
        "its traced peak and memory.py's estimate, and with --torch torch's CPU backward (autograd through SDPA)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure and the machine to PATH")
    p.add_argument("--plot", metavar="PATH.png", help="draw time and memory vs T (needs the plot extra)")
    add_format_argument(p)
    p.add_argument(
        "--seed", type=nonnegative_seed, default=0, help="seed for the random q, k, v (an int >= 0; default 0)"
    )
    args = p.parse_args(argv)
    for name in ("max_tokens", "min_tokens", "heads", "head_dim", "repeats", "block_q", "block_k", "kv_heads_per_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be at least 1; got {args.workers}")
    if args.min_tokens > args.max_tokens:
        p.error(f"--min-tokens ({args.min_tokens}) must not exceed --max-tokens ({args.max_tokens})")
    if args.mem_budget is not None and not (math.isfinite(args.mem_budget) and args.mem_budget > 0):
        p.error(f"--mem-budget must be a finite number of GiB > 0; got {args.mem_budget}")
    if args.torch_3d and not args.torch:
        p.error("--torch-3d needs --torch")
    if args.torch_naive and (args.sweep_blocks is not None or args.backward):
        p.error(
            "--torch-naive prints the forward table as T doubles; it does not apply to --sweep-blocks or --backward"
        )
    args.torch = args.torch or args.torch_naive  # the article's table needs torch's fused time too
    if args.sweep_blocks is not None and args.sweep_blocks < 1:
        p.error(f"--sweep-blocks must be a positive T; got {args.sweep_blocks}")
    if args.backward and (args.sweep_blocks is not None or args.plot is not None or args.torch_3d):
        p.error("--backward is a table of its own: it does not combine with --sweep-blocks, --plot or --torch-3d")
    check_fits(p, args)
    check_outputs(p, args)
    return args


def check_fits(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse up front sizes whose inputs and flash working memory alone need more than half of this
    machine's memory (huge --max-tokens, --heads, --head-dim): NumPy would fail in the middle instead."""
    T = args.sweep_blocks if args.sweep_blocks is not None else args.max_tokens
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=not args.no_causal)
    inputs = 3 * args.heads * T * args.head_dim * np.dtype(args.dtype).itemsize  # q, k, v: (H, T, E) each
    blocks = dict(block_q=args.block_q, block_k=args.block_k, workers=args.workers)
    needed = inputs + flash_attention_bytes(T, **dims, **blocks, kv_heads_per_step=args.kv_heads_per_step)
    if needed > memory_total() / 2:
        p.error(
            f"T={T:,} with {args.heads} heads x {args.head_dim} ({args.dtype}) needs {format_bytes(needed)} for "
            f"q, k, v and flash alone, more than half of this machine's {format_bytes(memory_total())}: "
            "lower --max-tokens, --heads or --head-dim"
        )


def check_outputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--json's folder and --plot's matplotlib are checked before the benchmark, not after it."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            p.error(f"{flag} {path} is a folder: give a file name in it")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"{flag} {path}: the folder {folder} does not exist or is not writable")
    if args.plot is not None:
        if args.sweep_blocks is not None:
            p.error("--plot draws the table as T doubles; it does not apply to --sweep-blocks")
        try:
            import matplotlib  # noqa: F401  (only to know now that the plot can be drawn)
        except ImportError:
            p.error("--plot needs matplotlib: pip install -e '.[plot]'")


def check_duration(args: argparse.Namespace, sizes: list[int], causal: bool, rate: float) -> None:
    """Refuse, before the first row, a run that cannot end within MAX_MINUTES even if flash ran at this
    machine's matmul rate (it runs slower, so this is a lower bound; --repeats 1000000000 stops here)."""
    runs = args.repeats + 3  # two warm-ups and the traced run around the timed ones
    full = [attention_flops(T, heads=args.heads, head_dim=args.head_dim) for T in sizes]
    masked = [attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal) for T in sizes]
    flops = runs * (sum(masked) + (sum(full) if causal else 0))  # with causal, the no-mask run too
    if args.sweep_blocks is not None:
        flops = runs * 2 * len(SWEEP_SIDES) * len(SWEEP_HEADS) * masked[0]  # two worker counts per tile shape
    if args.backward:  # the forward, and the backward's 2.5x the forward's FLOPs
        flops = runs * sum(masked) * 3.5
    minutes = flops / (rate * 1e9) / 60
    if minutes > MAX_MINUTES:
        sys.exit(
            f"error: this run needs at least {minutes:,.0f} minutes ({flops:.2e} FLOP at this machine's "
            f"{rate:.1f} GFLOP/s matmul rate), over the {MAX_MINUTES}-minute limit: lower --max-tokens or --repeats"
        )


def make_qkv(rng: np.random.Generator, T: int, args: argparse.Namespace) -> tuple[np.ndarray, ...]:
    shape = (1, args.heads, T, args.head_dim)  # (B, H, T, E): torch's fast CPU path needs 4-D
    return tuple(rng.standard_normal(shape, dtype=np.dtype(args.dtype)) for _ in range(3))


def matmul_rate(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one large n x n matmul on all BLAS threads: the machine's ceiling for this dtype."""
    a = np.random.default_rng(1).standard_normal((n, n)).astype(dtype)
    return 2 * n**3 / median_ms(lambda: a @ a, repeats) / 1e6


def check_agreement(args: argparse.Namespace, causal: bool) -> float:
    """Naive vs flash on a 64-token slice; stop with an error if they disagree."""
    q, k, v = make_qkv(np.random.default_rng(args.seed), 64, args)
    naive = attention(q, k, v, causal=causal)
    flash = flash_attention(q, k, v, causal=causal, block_q=16, block_k=16, workers=args.workers)
    diff = float(np.max(np.abs(naive - flash)))
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    if not diff <= tol:
        sys.exit(f"error: naive and flash disagree on 64 tokens: max |diff| = {diff:.3g} > {tol:g}")
    return diff


def torch_runner(args: argparse.Namespace, threads: int) -> Any:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit(
            "error: --torch needs torch; install the pinned CPU wheel (see torch_crosscheck/README.md):\n"
            "  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
        )
    torch.set_num_threads(threads)

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> Any:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))  # shares the memory, no copy
        return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return run, torch.__version__


# ---------------------------------------------------------------------------------------------------
# --torch-naive: the CPU table of "Train a Tiny GPT at Home, Part 2: Attention", torch naive vs torch fused


def torch_naive(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """The article's naive path, in torch: softmax(q kᵀ / √E with the future keys at -inf) v, written as
    the article writes it, so that scores, masked scores and weights are alive at once."""
    import torch

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if not causal:
        return scores.softmax(-1) @ v  # (B, H, T, E)
    T = q.shape[-2]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # (T, T): keys after each query
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v  # (B, H, T, E)


def torch_naive_bytes(T: int, heads: int, dtype: str, causal: bool) -> int:
    """The article's naive torch code at its peak: scores, masked scores and weights, (H, T, T) each,
    and the (T, T) bool mask, about 3.1x the score matrix (without the mask: scores and weights, 2x).
    Our attention() turns the scores into the weights in place: about 1.07x."""
    scores = score_matrix_bytes(T, heads=heads, dtype=dtype)
    return 3 * scores + T * T if causal else 2 * scores


def check_torch_naive(args: argparse.Namespace, causal: bool) -> float:
    """torch naive == torch fused (SDPA) on 64 tokens before anything is timed; stop if they disagree."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(x) for x in make_qkv(np.random.default_rng(args.seed), 64, args))
    diff = (torch_naive(q, k, v, causal) - F.scaled_dot_product_attention(q, k, v, is_causal=causal)).abs().max()
    tol = 1e-5 if args.dtype == "float32" else 1e-12
    if not float(diff) <= tol:
        sys.exit(f"error: torch naive and torch fused disagree on 64 tokens: max |diff| = {float(diff):.3g} > {tol:g}")
    return float(diff)


def measure_torch_naive(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, budget: float, repeats: int
) -> dict[str, Any]:
    """{"torch_naive_ms": median ms of torch_naive on these inputs}, None if it would exceed the budget."""
    import torch

    heads, T = q.shape[-3], q.shape[-2]
    if torch_naive_bytes(T, heads, str(q.dtype), causal) > budget:
        return {"torch_naive_ms": None}
    progress(f"  T={T}: torch naive")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))  # shares the memory, no copy
    return {"torch_naive_ms": settled_median_ms(lambda: torch_naive(tq, tk, tv, causal), repeats)}


def print_torch_naive_table(rows: list[dict[str, Any]], args: argparse.Namespace, causal: bool, threads: int) -> None:
    """The article's CPU table (tokens, score matrix, naive ms, fused ms, speed-up), with torch on both
    sides as in the article, and our two paths beside it from the same rows."""
    print(
        f"\nThe article's CPU table: torch naive (q kᵀ, {'causal masked_fill, ' if causal else ''}softmax, @ v) vs "
        f"torch fused (SDPA{', is_causal=True' if causal else ''}), {args.dtype}, {args.heads} heads x "
        f"{args.head_dim}, {threads} threads; ours beside it (same inputs, same run)"
    )
    headers = ["tokens", "scores MiB", "torch naive ms", "torch fused ms", "speed-up", "our naive ms", "our flash ms",
               "speed-up", "torch naive / our naive"]  # fmt: skip
    body = []
    for r in rows:
        line = [r["tokens"], r["score_matrix_bytes"] / MiB, r["torch_naive_ms"], r["torch_ms"],
                ratio(r["torch_naive_ms"], r["torch_ms"]), r["naive_ms"], r["flash_ms"],
                ratio(r["naive_ms"], r["flash_ms"]), ratio(r["torch_naive_ms"], r["naive_ms"])]  # fmt: skip
        body.append([cell(x) for x in line])
    print(text_table(body, headers, fmt=args.format))
    speedups = [x for r in rows if (x := ratio(r["torch_naive_ms"], r["torch_ms"])) is not None]
    if speedups:
        print(f"torch fused is {min(speedups):.1f}x to {max(speedups):.1f}x faster than torch naive here")


def measure_row(T: int, args: argparse.Namespace, causal: bool, budget: float, torch_run: Any) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + T)
    q, k, v = make_qkv(rng, T, args)
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=causal)
    blocks = dict(
        block_q=args.block_q, block_k=args.block_k, workers=args.workers, kv_heads_per_step=args.kv_heads_per_step
    )
    row: dict[str, Any] = {
        "tokens": T,
        "score_matrix_bytes": score_matrix_bytes(T, heads=args.heads, dtype=args.dtype),
        "naive_estimate_bytes": naive_attention_bytes(T, **dims),
        "flash_estimate_bytes": flash_attention_bytes(T, **dims, **blocks),
        "flops": attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal),
    }
    if row["naive_estimate_bytes"] > budget:
        row["naive_ms"] = row["naive_peak_bytes"] = None
    else:
        progress(f"  T={T}: naive")
        row["naive_ms"] = settled_median_ms(lambda: attention(q, k, v, causal=causal), args.repeats)
        row["naive_peak_bytes"] = traced_peak(attention, q, k, v, causal=causal)[1]
    progress(f"  T={T}: flash")
    time.sleep(SETTLE_SECONDS)
    row["matmul_gflops"] = matmul_rate(args.dtype)  # beside the row: "of matmul" compares like with like
    row["flash_ms"] = settled_median_ms(lambda: flash_attention(q, k, v, causal=causal, **blocks), args.repeats)
    row["flash_peak_bytes"] = traced_peak(flash_attention, q, k, v, causal=causal, **blocks)[1]
    if causal:  # the same flash run without the mask: how much the skipped tiles save
        row["flash_no_mask_ms"] = settled_median_ms(lambda: flash_attention(q, k, v, **blocks), args.repeats)
    if torch_run is not None:
        progress(f"  T={T}: torch")
        row["torch_ms"] = settled_median_ms(torch_run(q, k, v, causal), args.repeats)
        if args.torch_3d:  # the same numbers without the batch axis: (H, T, E)
            row["torch_3d_ms"] = settled_median_ms(torch_run(q[0], k[0], v[0], causal), args.repeats)
    if args.torch_naive:
        row.update(measure_torch_naive(q, k, v, causal, budget, args.repeats))
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, causal: bool) -> None:
    headers = [
        "tokens",
        "scores MiB",
        "naive ms",
        "flash ms",
        "speedup",
        "naive peak MiB",
        "(est.)",
        "flash peak MiB",
        "(est.)",
        "flash GFLOP/s",
        "of matmul",
    ]
    if causal:
        headers += ["no-mask ms", "causal/no-mask"]
    if args.torch:
        headers += ["torch ms", "flash/torch"]
    if args.torch_3d:
        headers += ["torch 3-D ms"]
    body = []
    for r in rows:
        naive_bytes = r["naive_peak_bytes"]
        gflops = r["flops"] / r["flash_ms"] / 1e6
        line: list[Any] = [
            r["tokens"],
            r["score_matrix_bytes"] / MiB,
            r["naive_ms"]
            if r["naive_ms"] is not None
            else f"skipped (needs {format_bytes(r['naive_estimate_bytes'])})",
            r["flash_ms"],
            ratio(r["naive_ms"], r["flash_ms"]),
            None if naive_bytes is None else naive_bytes / MiB,
            r["naive_estimate_bytes"] / MiB,
            r["flash_peak_bytes"] / MiB,
            r["flash_estimate_bytes"] / MiB,
            gflops,
            f"{gflops / r['matmul_gflops']:.0%}",
        ]
        if causal:
            line += [r["flash_no_mask_ms"], r["flash_ms"] / r["flash_no_mask_ms"]]
        if args.torch:
            line += [r["torch_ms"], r["flash_ms"] / r["torch_ms"]]
        if args.torch_3d:
            line += [r["torch_3d_ms"]]
        body.append([cell(x) for x in line])
    # formatted here, not by tabulate: a "skipped" string in a column stops tabulate rounding that column
    print(text_table(body, headers, fmt=args.format))


def cell(x: Any) -> str:
    """One table cell: floats to 2 decimals, None (a skipped figure) as "-", the rest as they are."""
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def doubling(min_tokens: int, max_tokens: int) -> list[int]:
    """min_tokens, 2·min_tokens, ... up to max_tokens."""
    sizes = []
    T = min_tokens
    while T <= max_tokens:
        sizes.append(T)
        T *= 2
    return sizes


def growth_line(rows: list[dict[str, Any]], key: str) -> str:
    times = [r[key] for r in rows if r.get(key) is not None]
    steps = [f"{b / a:.2f}x" for a, b in zip(times, times[1:], strict=False)]
    return ", ".join(steps) if steps else "-"


# The 16-core measurements quoted in README ("Block sizes and workers": Intel Xeon, 16 cores, the flash of
# one head per tile step, T = 8192, 4 heads x 64, causal) that calibrate the many-core model below.
XEON_CORES = 16
XEON_HELD_S_PER_STEP = 457.4e-3 / 2112  # 16 threads on 256 x 256 tiles: 457.4 ms for 2,112 tile steps
XEON_PROCESSES_MS, XEON_PROCESSES_SIDE = 64.4, 512  # 16 processes on (head, 512-query block) items, no lock


SWEEP_SIDES = (128, 256, 512, 1024)  # --sweep-blocks: square tiles
SWEEP_HEADS = (1, 2, 4)  # --sweep-blocks: kv heads per tile step


def sweep_items(T: int, side: int, heads: int, per_step: int, causal: bool) -> list[int]:
    """The tile steps of each work item (kv heads of one step x one query block), as flash_attention makes them."""
    plan = tile_plan(T, T, side, side, causal=causal)
    per_block = [sum(1 for t in plan if t.q_start == q_start) for q_start in range(0, T, side)]
    return [n for n in per_block for _ in range(-(-heads // per_step))]


def makespan(items: list[int], workers: int) -> int:
    """Steps of the busiest worker when each free worker takes the next item, longest first (as flash does)."""
    loads = [0] * workers
    for n in sorted(items, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads)


def held_us_per_step(T: int, side: int, causal: bool, repeats: int) -> float:
    """Microseconds per tile step spent in Python and NumPy's per-call overhead, with the interpreter lock held:
    the same grid of tiles and the same calls per step, on 2 x 2 tiles of E = 1, where the arithmetic is nil
    (and NumPy keeps the lock: its loops let go of it only for larger arrays). The cost of the call itself
    (checks, set-up) is measured on one tile and taken off."""

    def ms_for(n_blocks: int) -> float:
        x = np.random.default_rng(0).standard_normal((1, 2 * n_blocks, 1))
        call = lambda: flash_attention(x, x, x, causal=causal, block_q=2, block_k=2, workers=1)  # noqa: E731
        return settled_median_ms(call, max(repeats, 5))

    n_blocks = -(-T // side)
    steps = len(tile_plan(2 * n_blocks, 2 * n_blocks, 2, 2, causal=causal))
    return max(ms_for(n_blocks) - ms_for(1), 0.0) * 1e3 / max(steps - 1, 1)


def sweep_blocks(args: argparse.Namespace, causal: bool, rate: float) -> list[dict[str, Any]]:
    """Time flash at one T for tile sizes, heads per step and worker counts, and model many cores from it.

    Per tile step: w, the time of one step on one thread, and held, the part of it with the interpreter lock
    held (held_us_per_step). Amdahl: with f = held / w, N threads run at most 1 / (f + (1 - f) / N) times
    faster. The 16-core measurements add what Amdahl leaves out: 16 threads handing the lock around take
    XEON_HELD_S_PER_STEP per step (wake-ups, not the calls themselves), and cores that all compute at once
    run slower than one alone (kappa, from the 16-process run). Predicted time on 16 cores:
        max(steps · held_16, kappa · w · makespan of the items on 16 workers)
    """
    T = args.sweep_blocks
    q, k, v = make_qkv(np.random.default_rng(args.seed), T, args)
    flops = attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=causal)
    cores = os.cpu_count() or 1
    # the defaults at this shape, here and on 16 cores, with no more heads per step than there are heads
    default, xeon = (
        (side, side, min(per_step, args.heads))
        for side, _, per_step in (default_tiles(T, T, 1, cores=n) for n in (cores, XEON_CORES))
    )
    results = []
    for side in SWEEP_SIDES:
        held = held_us_per_step(T, side, causal, args.repeats)
        for per_step in [h for h in SWEEP_HEADS if h <= args.heads]:
            items = sweep_items(T, side, args.heads, per_step, causal)
            row: dict[str, Any] = dict(side=side, per_step=per_step, steps=sum(items), items=len(items), held_us=held)
            for workers in sorted({1, cores}):
                progress(f"  side={side} kv_heads_per_step={per_step} workers={workers}")

                def run(side: int = side, per_step: int = per_step, workers: int = workers) -> None:
                    flash_attention(
                        q, k, v, causal=causal, block_q=side, block_k=side, kv_heads_per_step=per_step, workers=workers
                    )

                row[f"ms_{workers}"] = settled_median_ms(run, args.repeats)
            row["w_us"] = row["ms_1"] * 1e3 / row["steps"]
            row["span_16"] = makespan(items, XEON_CORES)
            results.append(row)
    # kappa: the 16-process run (T = 8192, 4 heads) against this machine's one-thread time per step for the same
    # tiles, one head a step (a step's time depends on its tile, not on T)
    base = next((r for r in results if r["side"] == XEON_PROCESSES_SIDE and r["per_step"] == 1), None)
    xeon_span = makespan(sweep_items(8192, XEON_PROCESSES_SIDE, 4, 1, True), XEON_CORES)
    kappa = XEON_PROCESSES_MS / (base["w_us"] * xeon_span / 1e3) if base and args.head_dim == 64 else None
    body = []
    for r in results:
        f = r["held_us"] / r["w_us"]
        r["amdahl_16"] = 1 / (f + (1 - f) / XEON_CORES)
        r["predicted_16_ms"] = (
            max(r["steps"] * XEON_HELD_S_PER_STEP * 1e3, kappa * r["w_us"] * r["span_16"] / 1e3) if kappa else None
        )
        mark = " <- default" if (r["side"], r["side"], r["per_step"]) == default else ""
        body.append(
            [
                f"{r['side']} x {r['side']}",
                r["per_step"],
                r["steps"],
                r["items"],
                r["ms_1"],
                r.get(f"ms_{cores}"),
                flops / r[f"ms_{cores}"] / 1e6,
                f"{flops / r[f'ms_{cores}'] / 1e6 / rate:.0%}",
                r["w_us"],
                r["held_us"],
                r["amdahl_16"],
                r["predicted_16_ms"],
                mark,
            ]
        )
    print(
        f"\nflash_attention at T={T}, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"{'causal' if causal else 'no mask'}; median of {args.repeats}; 'ms, {cores} w' = {cores} workers"
    )
    headers = ["tiles", "heads/step", "steps", "items", "ms, 1 w", f"ms, {cores} w", "GFLOP/s", "of matmul",
               "w µs/step", "held µs/step", "Amdahl x16", "16-core ms (model)", ""]  # fmt: skip
    print(table(body, headers, fmt=args.format, floatfmt=".1f"))
    best = min(results, key=lambda r: r[f"ms_{cores}"])
    print(
        f"fastest here: {best['side']} x {best['side']}, {best['per_step']} heads per step "
        f"({best[f'ms_{cores}']:.1f} ms on {cores} workers); the default at this shape on this machine: "
        f"{default[0]} x {default[1]}, {default[2]} heads per step; on 16 cores: {xeon[0]} x {xeon[1]}, "
        f"{xeon[2]} heads per step (flash.default_tiles)"
    )
    if kappa:
        print(
            f"model: held_16 = {XEON_HELD_S_PER_STEP * 1e6:.0f} µs per step (16 threads, 256 x 256, one head a step: "
            f"457.4 ms / 2,112 steps); kappa = {kappa:.2f} ({XEON_PROCESSES_MS} ms for 16 processes on "
            f"{XEON_PROCESSES_SIDE} x {XEON_PROCESSES_SIDE} tiles against this machine's w); Amdahl x16 leaves the "
            "lock hand-offs out and is a ceiling only"
        )
    return results


def tiles_text(args: argparse.Namespace, T: int) -> str:
    """The flash tile settings of a run, as the header of its table says them."""
    block_q, block_k, per_step = default_tiles(T, T, 1, block_q=args.block_q, block_k=args.block_k)
    per_step = args.kv_heads_per_step or per_step
    chosen = "given" if args.block_q or args.block_k or args.kv_heads_per_step else "default"
    return f"tiles {block_q} x {block_k} with {min(per_step, args.heads)} heads per step ({chosen} at T={T:,})"


def torch_backward_runner(threads: int) -> Any:
    """A function (q, k, v, dout, causal) -> a call that runs torch's backward alone: the forward runs once,
    with autograd recording, and each call back-propagates dout through it again (retain_graph)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, causal: bool) -> Any:
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))  # 4-D: torch's fast CPU path
        tdout = torch.from_numpy(dout)
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        def backward() -> None:
            tq.grad = tk.grad = tv.grad = None  # fresh gradients each time, not accumulated ones
            out.backward(tdout, retain_graph=True)

        return backward

    return run


def measure_backward_row(
    T: int, args: argparse.Namespace, causal: bool, threads: int, torch_backward: Any
) -> dict[str, Any]:
    """Flash's forward and backward at T (time, GFLOP/s, traced peak beside the estimate), and torch's backward."""
    rng = np.random.default_rng(args.seed + T)
    q, k, v = make_qkv(rng, T, args)
    dout = rng.standard_normal(q.shape, dtype=np.dtype(args.dtype))
    block_q, block_k = args.block_q or DEFAULT_BLOCK_Q, args.block_k or DEFAULT_BLOCK_K  # the backward's defaults
    blocks = dict(block_q=block_q, block_k=block_k, workers=args.workers)
    sizes = dict(heads=args.heads, head_dim=args.head_dim, causal=causal)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, **blocks)
    row: dict[str, Any] = {
        "tokens": T,
        "forward_flops": attention_flops(T, **sizes),
        "backward_flops": attention_backward_flops(T, **sizes),
        "backward_estimate_bytes": flash_attention_backward_bytes(T, **sizes, dtype=args.dtype, **blocks),
    }
    progress(f"  T={T}: flash forward")
    row["forward_ms"] = settled_median_ms(
        lambda: flash_attention(q, k, v, causal=causal, return_lse=True, **blocks), args.repeats
    )
    progress(f"  T={T}: flash backward")
    row["backward_ms"] = settled_median_ms(
        lambda: flash_attention_backward(q, k, v, out, dout, lse, causal=causal, **blocks), args.repeats
    )
    row["backward_peak_bytes"] = traced_peak(flash_attention_backward, q, k, v, out, dout, lse, causal=causal,
                                             **blocks)[1]  # fmt: skip
    if torch_backward is not None:
        progress(f"  T={T}: torch backward")
        row["torch_backward_ms"] = settled_median_ms(torch_backward(q, k, v, dout, causal), args.repeats)
    return row


def backward_section(
    args: argparse.Namespace, causal: bool, sizes: list[int], threads: int, with_torch: bool
) -> list[dict[str, Any]]:
    """--backward: the table of flash_attention_backward as T doubles."""
    torch_backward = torch_backward_runner(threads) if with_torch else None
    print(
        f"\nflash_attention_backward: 1 sequence, {args.heads} heads x {args.head_dim}, {args.dtype}, "
        f"{'causal' if causal else 'no mask'}; blocks {args.block_q or DEFAULT_BLOCK_Q} x "
        f"{args.block_k or DEFAULT_BLOCK_K}, {threads} workers; median of {args.repeats} runs; "
        "peak from tracemalloc, (est.) = memory.flash_attention_backward_bytes"
    )
    rows = []
    for T in sizes:
        progress(f"T = {T}")
        rows.append(measure_backward_row(T, args, causal, threads, torch_backward))
    headers = ["tokens", "forward ms", "backward ms", "bwd/fwd", "bwd GFLOP/s", "bwd peak MiB", "(est.)", "peak/est."]
    if with_torch:
        headers += ["torch bwd ms", "flash/torch bwd"]
    body = []
    for r in rows:
        line = [
            r["tokens"],
            f"{r['forward_ms']:.1f}",
            f"{r['backward_ms']:.1f}",
            f"{r['backward_ms'] / r['forward_ms']:.2f}",
            f"{r['backward_flops'] / r['backward_ms'] / 1e6:.1f}",
            f"{r['backward_peak_bytes'] / MiB:.1f}",
            f"{r['backward_estimate_bytes'] / MiB:.1f}",
            f"{r['backward_peak_bytes'] / r['backward_estimate_bytes']:.2f}",
        ]
        if with_torch:
            line += [f"{r['torch_backward_ms']:.1f}", f"{r['backward_ms'] / r['torch_backward_ms']:.2f}"]
        body.append(line)
    print(text_table(body, headers, fmt=args.format))
    print(
        "backward FLOPs = 2·(3E + 2Ev) per unmasked score (S again, dV, dP, dQ, dK: 2.5x the forward's 2·(E + Ev)); "
        "torch bwd = autograd's backward through F.scaled_dot_product_attention on 4-D tensors, forward excluded"
    )
    return rows


def plot(rows: list[dict[str, Any]], path: str, args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: --plot needs matplotlib: pip install -e '.[plot]'")
    tokens = np.array([r["tokens"] for r in rows], float)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, label in (("naive_ms", "naive (reference)"), ("flash_ms", "flash"), ("torch_ms", "torch SDPA")):
        pts = [(r["tokens"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax_t.plot(*zip(*pts, strict=True), "o-", label=label)
    for key, label in (("naive_peak_bytes", "naive peak"), ("flash_peak_bytes", "flash peak")):
        pts = [(r["tokens"], r[key] / MiB) for r in rows if r.get(key) is not None]
        if pts:
            ax_m.plot(*zip(*pts, strict=True), "o-", label=label)
    # reference slopes: T² through the last naive point (or flash's), T through the last flash point
    naive_last = [r for r in rows if r.get("naive_ms") is not None]
    anchors = (
        (ax_t, (naive_last or rows)[-1], "naive_ms" if naive_last else "flash_ms", rows[-1]["flash_ms"], "ms"),
        (
            ax_m,
            (naive_last or rows)[-1],
            "naive_peak_bytes" if naive_last else "flash_peak_bytes",
            rows[-1]["flash_peak_bytes"] / MiB,
            "MiB",
        ),
    )
    for ax, quad_row, quad_key, linear_y, unit in anchors:
        quad_y = quad_row[quad_key] / (MiB if unit == "MiB" else 1)
        ax.plot(tokens, quad_y * (tokens / quad_row["tokens"]) ** 2, "k--", lw=0.8, label="∝ T²")
        ax.plot(tokens, linear_y * (tokens / tokens[-1]), "k:", lw=0.8, label="∝ T")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel(unit)
        ax.legend()
    ax_t.set_title(f"time, {args.heads} heads x {args.head_dim}, {args.dtype}")
    ax_m.set_title("traced peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    causal = not args.no_causal
    cores = os.cpu_count() or 1
    threads = args.workers or cores
    budget = (args.mem_budget * 2**30) if args.mem_budget is not None else memory_total() / 4
    info = machine_info()
    torch_run, torch_version = torch_runner(args, threads) if args.torch else (None, None)

    diff = check_agreement(args, causal)
    print(f"check: naive == flash on 64 tokens (max |diff| {diff:.2e})")
    if args.torch_naive:
        print(f"check: torch naive == torch fused on 64 tokens (max |diff| {check_torch_naive(args, causal):.2e})")
    rate = matmul_rate(args.dtype)
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} {b['architecture']} kernels ({b['num_threads']} threads)"
        for b in info["blas"]
    )
    print(
        f"machine: {info['cpu']}, {cores} cores; NumPy {info['numpy']}, BLAS {blas}"
        + (f"; torch {torch_version} ({threads} threads)" if torch_version else "")
    )
    print(f"{args.dtype} matmul, 2048 x 2048: {rate:.1f} GFLOP/s")
    sizes = [args.sweep_blocks] if args.sweep_blocks is not None else doubling(args.min_tokens, args.max_tokens)
    check_duration(args, sizes, causal, rate)

    if args.sweep_blocks is not None:
        results: Any = sweep_blocks(args, causal, rate)
    elif args.backward:
        results = backward_section(args, causal, sizes, threads, torch_run is not None)
    else:
        print(
            f"\n1 sequence, {args.heads} heads x {args.head_dim}, {args.dtype}, "
            f"{'causal' if causal else 'no mask'}; flash {tiles_text(args, sizes[-1])}, "
            f"{threads} workers; median of {args.repeats} runs; peaks from tracemalloc, "
            f"(est.) = tinyattn_np.memory; naive budget {format_bytes(budget)}"
        )
        results = []
        for T in sizes:
            progress(f"T = {T}")
            results.append(measure_row(T, args, causal, budget, torch_run))
        print_table(results, args, causal)
        print(
            f"time growth per doubling: naive {growth_line(results, 'naive_ms')}; "
            f"flash {growth_line(results, 'flash_ms')}"
        )
        print(
            "useful FLOPs = 2·(E + Ev) per unmasked score (QKᵀ and PV); 'of matmul' = flash GFLOP/s / the GFLOP/s of "
            f"one 2048 x 2048 {args.dtype} matmul measured just before that row (same BLAS threads): the share of this "
            "machine's matmul rate that flash reaches (over 100%: the load changed between the two)."
        )
        if args.torch_naive:
            print_torch_naive_table(results, args, causal, threads)
        if args.plot:
            plot(results, args.plot, args)

    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": info,
                    "matmul_gflops": rate,
                    "args": vars(args),
                    "torch": torch_version,
                    "results": results,
                },
                f,
                indent=2,
            )
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
