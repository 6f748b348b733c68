"""What the attention benchmarks share (scaling.py, torch_naive.py, tiles.py, scaling_backward.py): their flags
(T, the heads, the dtype, the mask, flash's tiles, the naive path's memory budget), the sizes refused up front,
the random q, k, v, the check that naive and flash agree before anything is timed, the start every benchmark
makes (the header, the matmul rate, the refusal of a run too long) and its rows, measured until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import interrupts
import limits
import machine
import numpy as np
import outputs

from tinyattn_np import attention, flash_attention, flash_attention_bytes
from tinyattn_np.blockmask import DEFAULT_BLOCK_Q
from tinyattn_np.measure import memory_total
from tinyattn_np.report import add_seed_and_format, max_diff, positive

MiB = 2**20


# ---------------------------------------------------------------------------------------------------
# the flags, and the sizes refused up front


def add_shape_arguments(p: argparse.ArgumentParser, *, tokens_range: bool = True, repeats: int = 5) -> None:
    """The flags every attention benchmark takes: T, the heads, the dtype, the mask, repeats, seed, format."""
    if tokens_range:
        tokens = positive(int, limits.MAX_TOKENS)
        p.add_argument("--max-tokens", type=tokens, default=8192, help="largest T (default 8192)")
        p.add_argument("--min-tokens", type=tokens, default=256, help="smallest T; it doubles (default 256)")
    p.add_argument("--heads", type=positive(int, limits.MAX_HEADS), default=4, help="attention heads (default 4)")
    p.add_argument(
        "--head-dim",
        type=positive(int, limits.MAX_HEADS),
        default=64,
        help="E, channels per head (default 64)",
    )
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="q, k, v dtype (default float32)")
    p.add_argument("--no-causal", action="store_true", help="no mask: every tile runs")
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=repeats,
        help=f"timed runs per figure (default {repeats})",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_seed_and_format(p, "the random q, k, v")


def add_flash_arguments(p: argparse.ArgumentParser, *, per_step: bool = True) -> None:
    """flash_attention's knobs: workers, tile sides and (forward only: per_step) kv heads per tile step."""
    p.add_argument(
        "--workers",
        type=positive(int, limits.MAX_WORKERS),
        default=None,
        help="flash worker threads (default: CPU count)",
    )
    # the backward's stays on any cores
    more_cores = f", {2 * DEFAULT_BLOCK_Q} on over 8 cores" if per_step else ""
    rule = f"{DEFAULT_BLOCK_Q}{more_cores}, less for a short causal T: tune.default_tiles"
    block = positive(int, limits.MAX_TOKENS)
    p.add_argument("--block-q", type=block, default=None, help=f"flash query block (default {rule})")
    p.add_argument("--block-k", type=block, default=None, help=f"flash key block (default {rule})")
    if per_step:
        p.add_argument(
            "--kv-heads-per-step",
            type=positive(int, limits.MAX_HEADS),
            default=None,
            help="kv heads (each with its query heads) in one batched matmul per flash tile step (default: as many "
            "as fit in 2^18 scores, 2^19 on more than 8 cores: tune.default_tiles)",
        )


def flash_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """flash_attention's knobs as the flags give them (add_flash_arguments; None: flash's own default)."""
    return {name: getattr(args, name, None) for name in ("block_q", "block_k", "workers", "kv_heads_per_step")}


def add_budget_argument(p: argparse.ArgumentParser) -> None:
    ram = memory_total() / 2**30
    p.add_argument(
        "--mem-budget",
        type=positive(float, round(ram, 1)),
        default=None,
        help=f"GiB the naive path may use, at most this machine's {ram:.1f}; rows over it are skipped (default: a "
        "quarter of it)",
    )


def naive_budget(args: argparse.Namespace) -> float:
    """Bytes the naive path may take (--mem-budget, default a quarter of the RAM):
    rows over it are skipped."""
    return args.mem_budget * 2**30 if args.mem_budget is not None else memory_total() / 4


def check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace, T: int, flag: str = "--max-tokens") -> None:
    """Refuse up front a T (or --min-tokens over --max-tokens) whose inputs and flash working memory alone
    need more than this machine can give (NumPy would fail in the middle instead), and a --json PATH that
    cannot be written."""
    if getattr(args, "min_tokens", T) > T:
        p.error(f"--min-tokens ({args.min_tokens}) must not exceed --max-tokens ({T})")
    dims = dict(heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=not args.no_causal)
    inputs = 3 * args.heads * T * args.head_dim * np.dtype(args.dtype).itemsize  # q, k, v: (H, T, E) each
    blocks = flash_knobs(args)
    what = f"T={T:,} with {args.heads} heads x {args.head_dim} ({args.dtype})"
    needed = inputs + flash_attention_bytes(T, **dims, **blocks)
    lower = f"lower {flag}, --heads or --head-dim"
    problem = limits.memory_problem(needed, what, lower, " for q, k, v and flash alone")
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)


# ---------------------------------------------------------------------------------------------------
# sizes, inputs, and the check before anything is timed


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


# ---------------------------------------------------------------------------------------------------
# the run: its start, its rows


def start_benchmark(
    args: argparse.Namespace,
    run_flops: Callable[..., float],
    torch_runner: Callable[[int], Any] | None = None,
) -> SimpleNamespace:
    """Everything an attention benchmark does before its first row: torch's runner if asked for, naive ==
    flash on 64 tokens, the machine and the code that print the table, the matmul rate, and the refusal of a
    run that cannot end within limits.MAX_MINUTES (run_flops(args, sizes, causal): its FLOPs).

    Returns the run: causal, threads, sizes (each T), info (machine_info()), rate (GFLOP/s), torch (what
    torch_runner(threads) returned first, or None) and torch_version."""
    run = SimpleNamespace(causal=not args.no_causal, threads=getattr(args, "workers", None) or os.cpu_count() or 1)
    run.torch, run.torch_version = torch_runner(run.threads) if torch_runner else (None, None)
    diff = check_agreement(args, run.causal, getattr(args, "workers", None))
    print(f"check: naive == flash on 64 tokens (max |diff| {diff:.2e})")
    run.rate = machine.matmul_rate(args.dtype)
    run.info, lines = machine.header(run.torch_version, run.threads)
    print(lines)
    print(f"{args.dtype} matmul, 2048 x 2048: {run.rate:.1f} GFLOP/s")
    one_size = "tokens" in vars(args)
    run.sizes = [args.tokens] if one_size else doubling(args.min_tokens, args.max_tokens)
    lower = f"lower {'--tokens' if one_size else '--max-tokens'} or --repeats"
    problem = limits.time_problem(run_flops(args, run.sizes, run.causal), run.rate, lower)
    if problem:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {problem}")
    return run


def measure_rows(
    args: argparse.Namespace,
    run: SimpleNamespace,
    items: list[Any],
    measure_row: Callable[..., Any],
    print_rows: Callable[..., None],
    title: str = "",
) -> int:
    """The title, measure_row(item, args, run) for each item, then print_rows(rows, args, run), --json, and
    the exit code: 130 after Ctrl-C, which stops the rows, not what follows (the rows measured are printed
    and kept)."""
    if title:
        print(title)
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(items, lambda item: measure_row(item, args, run), rows)
    if rows:
        print_rows(rows, args, run)
    if args.json:
        figures = {
            "machine": run.info,
            "matmul_gflops": run.rate,
            "torch": run.torch_version,
            "args": vars(args),
        }
        outputs.write_json(args.json, {**figures, **getattr(run, "extra", {}), "results": rows}, stopped)
    return interrupts.interrupted(len(rows), len(items)) if stopped else 0


# ---------------------------------------------------------------------------------------------------
# cells


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def cell(x: Any) -> str:
    """One table cell: floats to 2 decimals, None (a figure not measured) as "-", the rest as they are."""
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)
